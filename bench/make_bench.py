"""``make bench``: every measurement this course makes, on this box, in one command, and a report.

    make bench                       # = python bench/make_bench.py
    BENCH_QUICK=1 make bench         # the two-minute version, for trying things
    BENCH_MODEL=course make bench    # the Transformer LM preset for stages 03-06
    make bench PYTHON=python3        # a box whose Python already has torch (offline is fine)

What it runs depends on what the box has (``pick_setup``), and it says what it picked:

* no GPU: gloo with CPU tensors and small sizes, so anyone can try it;
* one GPU: the ranks share it and talk over Gloo with CUDA tensors, because NCCL refuses two
  ranks on one GPU ("Duplicate GPU detected");
* two or more GPUs: NCCL, one GPU per rank (and Gloo/CPU beside it in stage 02).

In order: stage 02's all-reduce sweep; stages 03-06 on the LM with torch DDP beside them
and 06's bucket sweep with the bucket-size model (all one run of ``06 --bench``: step-time
ratios are fair only within one run); stage 05's profile of naive against overlapped DDP (the
overlap timeline); stage 07's tensor- and pipeline-parallel measurements. Each stage script
runs as its own process with a wall-clock cap inside one budget for the whole run
(``BENCH_BUDGET_S``, ``run_all``), and no single configuration runs past two minutes (stage
02's ``--budget-s``, the step harness's ``--case-budget-s``). Every script
runs with ``RESULTS_RUN_ID`` set, so the report (``bench/report.py``) takes this run's rows
from the shared CSVs and nothing older. This driver imports no stage: it runs their scripts.
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

GRACE_S = 15                    # after a cap's Ctrl-C, how long a script gets to write rows
KILL_WAIT_S = 5                 # ... and after the kill that follows
MIN_STEP_S = 15                 # a step with less time than this left is skipped, not started


@dataclass
class Step:
    key: str            # names the step in the report ("allreduce", "ddp", ...)
    title: str
    argv: list[str]     # script and its flags, run with this Python from the repo root
    cap_s: int          # wall-clock cap; at the cap the script gets Ctrl-C, then is killed
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
        return Setup(0, "", "gloo", "cpu",
                     "No GPU here: every stage runs on Gloo with CPU tensors at small sizes "
                     "(anyone can try it; the numbers measure this machine's cores and "
                     "loopback, not an interconnect).")
    if gpus == 1:
        return Setup(1, gpu_name, "gloo", "cuda",
                     f"One GPU ({gpu_name}): the ranks share it and communicate over Gloo with "
                     "CUDA tensors, because NCCL refuses two ranks on one GPU (\"Duplicate GPU "
                     "detected\"). Gloo stages GPU memory through the host, so communication "
                     "here is far slower than NCCL between GPUs would be. Stage 02 also "
                     "measures Gloo with CPU tensors.")
    return Setup(gpus, gpu_name, "nccl", "cuda",
                 f"{gpus} GPUs ({gpu_name}): NCCL, one GPU per rank. Stage 02 also measures "
                 "Gloo with CPU tensors beside it.")


def bench_model(setup: Setup, quick: bool) -> str:
    """``BENCH_MODEL`` if set, else small on a GPU box (course in quick mode), tiny on CPU."""
    name = os.environ.get("BENCH_MODEL", "").strip()
    if name:
        if name not in models.PRESETS:
            usage_error(f"BENCH_MODEL={name!r} is not a preset; choose from "
                        f"{', '.join(models.PRESETS)}", prog="make bench")
        return name
    if setup.gpus == 0:
        return "tiny"
    return "course" if quick else "small"


def budget_s(quick: bool) -> float:
    """``BENCH_BUDGET_S``, else 130 s quick / 510 s full: the whole run's wall-clock limit
    (the issue: about two minutes, and under nine; the report and start-up fit in the rest)."""
    text = os.environ.get("BENCH_BUDGET_S", "").strip()
    if not text:
        return 130.0 if quick else 510.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 60:
        usage_error(f"BENCH_BUDGET_S={text!r}: give the whole run's limit in seconds, >= 60",
                    prog="make bench")
    return value


def plan(setup: Setup, quick: bool, model: str, trace_dir: str = "results/traces") -> list[Step]:
    """The steps for this box; sizes chosen so the whole run fits a few minutes (README).
    ``trace_dir``: where stage 05 writes its raw profiler traces (not part of the report)."""
    gpus = setup.gpus
    where = ["--backend", setup.backend, "--device", setup.device]
    # Caps, seconds: (02, 03-06, profile, each TP run, PP). On a 2-core CPU VM the full plan's
    # steps took 38, 63, 21, 16 + 25, 35 s. On one H100 (16 cores) nothing is measured yet; the
    # estimate is 02 about 150 s (Gloo through host memory at 1 GB dominates), 03-06 about
    # 150 s (12 cases x 2 rounds x 8 steps of a 100M-parameter LM, ~0.3 s a step over Gloo),
    # 15-30 s for each later script, most of it starting CUDA in each rank.
    if gpus == 0:
        caps = (60, 60, 45, 30, 45) if quick else (120, 180, 60, 60, 90)
        ar_where = ["--backend", "gloo", "--device", "cpu"]
        ar_sizes = "64KB,1MB,10MB" if quick else "64KB,1MB,10MB,100MB"
        ar_world = "2" if quick else "2,4"
        ddp_ws, ddp = 2, ["--batch-size", "8", "--context-length", "64"]
        ddp_steps = ["--steps", "5", "--warmup", "2"] if quick else \
            ["--steps", "10", "--warmup", "3", "--rounds", "3"]
        buckets = "0.25,1,4"
        tp = ["--d-model", "512", "--d-ff", "2048", "--batch", "4", "--seq", "128"]
        pp_ws, pp = 4, ["--d-model", "256", "--hidden", "1024", "--batch", "64"]
    else:
        caps = (45, 45, 30, 25, 30) if quick else (200, 200, 60, 45, 60)
        ar_where = ["--backend", "all", "--device", "all"]  # 02 picks what the box runs
        ar_sizes = "1MB,10MB,100MB" if quick else "1MB,10MB,100MB,1GB"
        if gpus == 1:  # ranks share the GPU: 2 and 4 of them
            ar_world = "2" if quick else "2,4"
        else:
            ar_world = ",".join(str(n) for n in (2, 4, 8) if n <= gpus) or "2"
            if quick:
                ar_world = "2"
        ddp_ws = 2 if gpus == 1 else min(gpus, 8)
        # the reference shape (d_model 512, 4 layers, context 256, batch 4) for course
        ddp = ["--batch-size", str(4 if model == "course" else 8), "--context-length", "256"]
        ddp_steps = ["--steps", "5", "--warmup", "2"] if quick else \
            ["--steps", "6", "--warmup", "2", "--rounds", "2"]
        buckets = "1,25,100" if quick else "1,5,25,100"
        tp = ["--d-model", "1024", "--d-ff", "4096", "--batch", "8", "--seq", "256"]
        pp_ws = 4 if gpus == 1 or gpus >= 4 else 2
        pp = ["--d-model", "1024", "--hidden", "4096", "--batch", "128"]
    if int(ddp[1]) % ddp_ws:  # the global batch must split evenly over the ranks
        ddp[1] = str(ddp_ws * max(1, int(ddp[1]) // ddp_ws))
    lm = ["--model", model, *ddp]
    micro = "1,2,4,8" if quick else "1,2,4,8,16"
    tp_world = [2] if quick or (gpus >= 2 and gpus < 4) else [2, 4]
    steps = [
        Step("allreduce", "02 all-reduce sweep",
             ["02_allreduce_bench/allreduce_bench.py", *ar_where, "--sizes", ar_sizes,
              "--world-sizes", ar_world, "--budget-s", "120"], caps[0]),
        Step("ddp", f"03-06 DDP step times, bucket sweep and model (LM {model})",
             ["06_bucketed_ddp/bucketed_ddp.py", "--bench", "--world-size", str(ddp_ws),
              *where, *lm, *ddp_steps, "--bucket-sizes", buckets, "--case-budget-s", "120"],
             caps[1]),
        Step("profile", f"05 profile: naive vs overlapped DDP (LM {model})",
             ["05_overlap_ddp/overlap_ddp.py", "--profile", "--world-size", str(ddp_ws), *where,
              *lm, "--trace-dir", trace_dir], caps[2]),
        *[Step(f"tp{n}", f"07 tensor parallel, {n} ranks",
               ["07_parallelism/tensor_parallel.py", "--world-size", str(n), *where, *tp],
               caps[3])
          for n in tp_world],
        Step("pp", f"07 pipeline parallel, {pp_ws} stages",
             ["07_parallelism/pipeline_parallel.py", "--world-size", str(pp_ws), *where,
              *pp, "--micro-batches", micro, "--warmup", "1", "--iters", "3"], caps[4]),
    ]
    return steps


# --------------------------------------------------------------------------- running


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
        _stop(proc)
        step.status = f"stopped at its {cap_s:.0f} s cap"
    except KeyboardInterrupt:
        _stop(proc)
        step.seconds = time.monotonic() - start
        step.status = "interrupted"
        raise
    step.seconds = time.monotonic() - start


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGINT, GRACE_S), (signal.SIGKILL, KILL_WAIT_S)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def run_all(steps: list[Step], budget: float, run, clock=time.monotonic) -> None:
    """Run the steps in order within ``budget`` seconds; ``run(step, cap)`` runs one.

    A step may overrun its cap by the Ctrl-C grace and the kill wait, so its cap is what is
    left minus that overrun, minus ``MIN_STEP_S`` for each step still to come (a chance for
    every one of them); a step with less than ``MIN_STEP_S`` left is skipped. So every step
    ends by ``start + budget``, whatever the scripts do."""
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
    """(drawn by a stage script, its copy in the report). The report's own names
    (``bench_*.png``) keep ``make run``, which redraws ``allreduce_busbw.png``, off them."""
    return [(out / "allreduce_busbw.png", out / "bench_allreduce_busbw.png"),
            (trace_dir / "05_overlap_ddp" / "timeline.png", out / "bench_overlap_timeline.png")]


def main() -> None:
    import torch

    quick = os.environ.get("BENCH_QUICK", "") not in ("", "0")
    gpus = torch.cuda.device_count()
    setup = pick_setup(gpus, torch.cuda.get_device_name(0) if gpus else "")
    model = bench_model(setup, quick)
    out = results.results_dir()
    trace_dir = out / "traces"  # raw traces: ignored by git, unlike the report and its pictures
    shown = os.path.relpath(trace_dir, REPO_ROOT) if trace_dir.is_relative_to(REPO_ROOT) \
        else str(trace_dir)  # scripts run from the repo root
    steps = plan(setup, quick, model, shown)
    budget = budget_s(quick)
    run_id = "bench-" + time.strftime("%Y%m%d-%H%M%S")
    env = {**os.environ, "RESULTS_RUN_ID": run_id, "PYTHONUNBUFFERED": "1"}
    # a report shows this run's pictures or none: clear the ones copied into it too
    for stale in [*out.glob("bench_*.png"), *(src for src, _ in stage_pictures(out, trace_dir))]:
        stale.unlink(missing_ok=True)
    print(f"make bench ({'quick' if quick else 'full'}) on {results.machine_name()}\n"
          f"{setup.picked}\nLM for stages 03-06: {model}. Run id {run_id}; results in {out}; "
          f"time budget {budget:.0f} s (BENCH_BUDGET_S).\nPlan:", flush=True)
    for i, s in enumerate(steps, 1):
        print(f"  {i}. {s.title} (cap {s.cap_s} s)", flush=True)

    start, started_utc = time.monotonic(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
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
    info = {"run_id": run_id, "quick": quick, "model": model, "setup": asdict(setup),
            "machine": results.machine_name(), "cpu_cores": os.cpu_count(),
            "torch": torch.__version__, "started_utc": started_utc,
            "total_s": total, "budget_s": budget, "steps": [asdict(s) for s in steps]}
    results.write_json(RUN_FILE, info)
    report = write_report(out)
    print(f"\nmake bench finished in {total:.0f} s ({total / 60:.1f} min); report: {report}",
          flush=True)
    if interrupted:
        raise SystemExit(130)
    if any(s.status != "ok" for s in steps):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
