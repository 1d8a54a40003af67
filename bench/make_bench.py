"""``make bench``: every measurement the course makes, on this box, in one command, and a report.

    make bench                       # = python bench/make_bench.py
    BENCH_QUICK=1 make bench         # the two-minute version
    BENCH_MODEL=course make bench    # the Transformer LM preset for stages 03-07
    make bench PYTHON=python3        # a box whose Python already has torch (offline is fine)

What runs depends on the box (``pick_setup``): no GPU, Gloo with CPU tensors at small sizes;
one GPU, the ranks share it over Gloo (NCCL refuses two ranks on one GPU); two or more, NCCL
with one GPU per rank. In order: stage 02's sweep; stages 03-06 and torch DDP on the LM with
06's bucket sweep and model (one run of ``06 --bench``: ratios are fair only within a run);
05's profile; 07's tensor-parallel bytes, pipeline schedules (real and emulated compute), and
the sharding ledger (DDP, ZeRO-1/2, FSDP, torch's). Each script runs as its own process with
a wall-clock cap inside one budget (``BENCH_BUDGET_S``), and with ``RESULTS_RUN_ID`` set, so
``bench/report.py`` reports this run's rows and nothing older. No stage is imported: the
driver runs their scripts.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.report import RUN_FILE, write_report  # noqa: E402
from common import models, results  # noqa: E402
from common.launch import usage_error  # noqa: E402

GRACE_S, KILL_WAIT_S = 15, 5    # after a cap's Ctrl-C, time to write rows; after the kill
MIN_STEP_S = 15                 # a step with less time than this left is skipped, not started


@dataclass
class Step:
    key: str            # names the step in the report ("allreduce", "ddp", ...)
    title: str
    argv: list[str]     # script and its flags, run with this Python from the repo root
    cap_s: int          # wall-clock cap: at the cap the script gets Ctrl-C, then is killed
    status: str = "not run"
    seconds: float = 0.0


@dataclass
class Setup:
    """What this box runs: one backend/device for the stage scripts, and why."""
    gpus: int
    gpu_name: str
    backend: str
    device: str
    picked: str         # one or two sentences for the report and the console


def pick_setup(gpus: int, gpu_name: str = "") -> Setup:
    if gpus == 0:
        return Setup(0, "", "gloo", "cpu", "No GPU here: every stage runs on Gloo with CPU "
                     "tensors at small sizes (the numbers measure this machine's cores and "
                     "loopback, not an interconnect).")
    if gpus == 1:
        return Setup(1, gpu_name, "gloo", "cuda", f"One GPU ({gpu_name}): the ranks share it and "
                     "communicate over Gloo with CUDA tensors, because NCCL refuses two ranks on "
                     "one GPU (\"Duplicate GPU detected\"). Gloo stages GPU memory through the "
                     "host, so communication is far slower than NCCL between GPUs would be.")
    return Setup(gpus, gpu_name, "nccl", "cuda",
                 f"{gpus} GPUs ({gpu_name}): NCCL, one GPU per rank.")


def bench_model(setup: Setup, quick: bool) -> str:
    """``BENCH_MODEL`` if set, else small on a GPU box (course when quick), tiny on a CPU."""
    name = os.environ.get("BENCH_MODEL", "").strip()
    if name and name not in models.PRESETS:
        usage_error(f"BENCH_MODEL={name!r} is not a preset; choose from "
                    f"{', '.join(models.PRESETS)}", prog="make bench")
    return name or ("tiny" if setup.gpus == 0 else "course" if quick else "small")


def budget_s(quick: bool) -> float:
    """``BENCH_BUDGET_S``, else 130 s quick / 510 s full: the whole run's limit."""
    text = os.environ.get("BENCH_BUDGET_S", "").strip()
    try:
        value = float(text) if text else (130.0 if quick else 510.0)
    except ValueError:
        value = float("nan")
    if not value >= 60 or value == float("inf"):
        usage_error(f"BENCH_BUDGET_S={text!r}: give the whole run's limit in seconds, >= 60",
                    prog="make bench")
    return value


def plan(setup: Setup, quick: bool, model: str, trace_dir: str = "results/traces") -> list[Step]:
    """The steps for this box, sized so the whole run fits its budget. Caps are seconds."""
    gpus, cpu = setup.gpus, setup.gpus == 0
    where = ["--backend", setup.backend, "--device", setup.device]
    ws = 2 if gpus < 2 else min(gpus, 8)  # stages 03-06 and the ledger
    pp_ws = 4 if gpus in (0, 1) or gpus >= 4 else 2
    if cpu:
        caps = dict(allreduce=60, ddp=60, profile=45, tp=30, pp=60, ledger=60) if quick else \
            dict(allreduce=120, ddp=150, profile=60, tp=45, pp=90, ledger=120)
        ar = ["--backend", "gloo", "--device", "cpu", "--sizes",
              "64KB,1MB,10MB" if quick else "64KB,1MB,10MB,100MB", "--world-sizes",
              "2" if quick else "2,4"]
        lm = ["--batch-size", "8", "--context-length", "64"]
        steps = ["--steps", "5", "--warmup", "2"] if quick else \
            ["--steps", "10", "--warmup", "3", "--rounds", "3"]
        buckets, tp = "0.25,1,4", ["--d-model", "512", "--d-ff", "2048", "--batch", "4", "--seq", "128"]
        pp = ["--d-model", "256", "--hidden", "1024", "--batch", "64", "--emulate-ms", "50"]
    else:
        caps = dict(allreduce=45, ddp=45, profile=30, tp=25, pp=40, ledger=45) if quick else \
            dict(allreduce=150, ddp=150, profile=45, tp=30, pp=60, ledger=90)
        ar = ["--sizes", "1MB,10MB,100MB" if quick else "1MB,10MB,100MB,1GB",  # 02 picks the
              "--world-sizes", "2" if quick else ("2,4" if gpus == 1 else ",".join(  # backends
                  str(n) for n in (2, 4, 8) if n <= gpus))]
        lm = ["--batch-size", str(4 if model == "course" else 8), "--context-length", "256"]
        steps = ["--steps", "5", "--warmup", "2"] if quick else \
            ["--steps", "6", "--warmup", "2", "--rounds", "2"]
        buckets = "1,25,100" if quick else "1,5,25,100"
        tp = ["--d-model", "1024", "--d-ff", "4096", "--batch", "8", "--seq", "256"]
        pp = ["--d-model", "1024", "--hidden", "4096", "--batch", "128", "--emulate-ms", "20"]
    lm[1] = str(ws * max(1, int(lm[1]) // ws))  # the global batch splits evenly over the ranks
    lm = ["--model", model, *lm]
    # The ledger's default LM is `course` on a CPU too: per-block checkpointing cannot touch the
    # tiny LM's activations, which are mostly its vocabulary logits.
    ledger_lm = ["--model", "course"] if cpu else ["--model", "course" if quick else model,
                                                   "--batch-size", str(2 * ws), "--context-length",
                                                   "256", "--steps", "5", "--warmup", "2"]
    return [
        Step("allreduce", "02 all-reduce sweep",
             ["02_allreduce_bench/allreduce_bench.py", *ar, "--budget-s", "120"], caps["allreduce"]),
        Step("ddp", f"03-06 DDP step times, bucket sweep and model (LM {model})",
             ["06_bucketed_ddp/bucketed_ddp.py", "--bench", "--world-size", str(ws), *where, *lm,
              *steps, "--bucket-sizes", buckets, "--case-budget-s", "120"], caps["ddp"]),
        Step("profile", f"05 profile: naive vs overlapped DDP (LM {model})",
             ["05_overlap_ddp/overlap_ddp.py", "--profile", "--world-size", str(ws), *where,
              *lm, "--trace-dir", trace_dir], caps["profile"]),
        Step("tp", "07 tensor parallel, 2 ranks",
             ["07_parallelism/03_tensor_parallel/run_tensor_parallel.py", "--world-size", "2", *where, *tp], caps["tp"]),
        Step("pp", f"07 pipeline schedules, {pp_ws} stages, real and emulated compute",
             ["07_parallelism/04_pipeline_parallel/run_pipeline.py", "--world-size", str(pp_ws), *where, *pp,
              "--micro-batches", "8" if quick else ("4,8" if cpu else "4,8,16"), "--chunks", "2",
              "--warmup", "1", "--iters", "3"], caps["pp"]),
        Step("ledger", f"07 sharding ledger: DDP, ZeRO-1/2, FSDP, torch's (LM {ledger_lm[1]})",
             ["07_parallelism/02_fsdp/run_fsdp.py", "--bench", "--world-size", str(ws), *where, *ledger_lm,
              "--checkpointing", "off" if quick else "off,on"], caps["ledger"]),
    ]


def run_step(step: Step, env: dict, cap_s: float) -> None:
    """Run one stage script; at ``cap_s`` send it Ctrl-C (finished rows get written), then kill."""
    start = time.monotonic()
    # A session of its own, so the cap's Ctrl-C reaches the script and its spawned ranks.
    proc = subprocess.Popen([sys.executable, *step.argv], cwd=REPO_ROOT, env=env,
                            start_new_session=True)
    try:
        rc = proc.wait(timeout=cap_s)
        step.status = "ok" if rc == 0 else f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        for sig, wait in ((signal.SIGINT, GRACE_S), (signal.SIGKILL, KILL_WAIT_S)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        step.status = f"stopped at its {cap_s:.0f} s cap"
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGKILL)
        step.status = "interrupted"
        raise
    finally:
        step.seconds = time.monotonic() - start


def run_all(steps: list[Step], budget: float, run, clock=time.monotonic) -> None:
    """Run the steps in order within ``budget`` seconds; ``run(step, cap)`` runs one. A step
    may overrun its cap by the grace and the kill wait, so its cap is what is left minus
    that, minus ``MIN_STEP_S`` for each step still to come; a step with less than
    ``MIN_STEP_S`` left is skipped. So every step ends by ``start + budget``."""
    start = clock()
    for i, step in enumerate(steps, 1):
        left = budget - (clock() - start)
        cap = min(step.cap_s, left - GRACE_S - KILL_WAIT_S - MIN_STEP_S * (len(steps) - i))
        if cap < MIN_STEP_S:
            step.status = "skipped: the time budget was spent"
            print(f"\n[bench {i}/{len(steps)}] {step.title}: {step.status}", flush=True)
            continue
        print(f"\n[bench {i}/{len(steps)}] {step.title} (cap {cap:.0f} s, "
              f"{clock() - start:.0f} s elapsed)\n  $ python {' '.join(step.argv)}", flush=True)
        run(step, cap)
        print(f"[bench {i}/{len(steps)}] {step.title}: {step.status} in {step.seconds:.0f} s",
              flush=True)


def stage_pictures(out: Path, trace_dir: Path) -> list[tuple[Path, Path]]:
    """(drawn by a stage script, its copy in the report: ``make run`` redraws the former)."""
    return [(out / "allreduce_busbw.png", out / "bench_allreduce_busbw.png"),
            (trace_dir / "05_overlap_ddp" / "timeline.png", out / "bench_overlap_timeline.png")]


def main() -> None:
    import torch

    quick = os.environ.get("BENCH_QUICK", "") not in ("", "0")
    gpus = torch.cuda.device_count()
    setup = pick_setup(gpus, torch.cuda.get_device_name(0) if gpus else "")
    model, budget = bench_model(setup, quick), budget_s(quick)
    out = results.check_writable()
    trace_dir = out / "traces"  # raw traces: not part of the committed report
    shown = os.path.relpath(trace_dir, REPO_ROOT) if trace_dir.is_relative_to(REPO_ROOT) \
        else str(trace_dir)
    steps = plan(setup, quick, model, shown)
    run_id = "bench-" + time.strftime("%Y%m%d-%H%M%S")
    env = {**os.environ, "RESULTS_RUN_ID": run_id, "PYTHONUNBUFFERED": "1"}
    for stale in [*out.glob("bench_*.png"), *(src for src, _ in stage_pictures(out, trace_dir))]:
        stale.unlink(missing_ok=True)  # a report shows this run's pictures or none
    print(f"make bench ({'quick' if quick else 'full'}) on {results.machine_name()}\n"
          f"{setup.picked}\nLM: {model}. Run id {run_id}; results in {out}; time budget "
          f"{budget:.0f} s (BENCH_BUDGET_S).\nPlan:\n" + "\n".join(
              f"  {i}. {s.title} (cap {s.cap_s} s)" for i, s in enumerate(steps, 1)), flush=True)
    start, started = time.monotonic(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    interrupted = False
    try:
        run_all(steps, budget, lambda step, cap: run_step(step, env, cap))
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: writing the report from what finished", flush=True)
    total = time.monotonic() - start
    for src, dst in stage_pictures(out, trace_dir):
        if src.exists():
            shutil.copyfile(src, dst)
    results.write_json(RUN_FILE, {
        "run_id": run_id, "quick": quick, "model": model, "setup": asdict(setup),
        "machine": results.machine_name(), "cpu_cores": os.cpu_count(),
        "torch": torch.__version__, "started_utc": started, "total_s": total,
        "budget_s": budget, "steps": [asdict(s) for s in steps]})
    print(f"\nmake bench finished in {total:.0f} s ({total / 60:.1f} min); report: "
          f"{write_report(out)}", flush=True)
    if interrupted:
        raise SystemExit(130)
    if any(s.status != "ok" for s in steps):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
