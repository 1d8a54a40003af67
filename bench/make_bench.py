"""``make bench``: every measurement the course makes, on this box, in one command, and a report.

    make bench                       # = python bench/make_bench.py
    BENCH_QUICK=1 make bench         # smaller sizes; BENCH_BUDGET_S, BENCH_MODEL: bench/README.md

What runs on which box (``pick_setup``, ``plan``), how the budget is shared out (``SHARES``,
``plan_budget``, ``run_all``), how a step is stopped and the report kept whole: bench/README.md.
No stage is imported: each script runs with ``RESULTS_RUN_ID`` set, so ``bench/report.py``
reports this run's rows only. To add a step: a row in ``SHARES`` and a ``step(...)`` in ``plan``.
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.report import STAGE_PICTURES, write_report  # noqa: E402
from common import models  # noqa: E402
from bench import results
from bench.check import kill_group  # noqa: E402
from common import usage_error  # noqa: E402

# The whole run, every stop included (a GPU box's quick run pays a CUDA start-up a step).
DEFAULT_BUDGET_S = {True: 150, False: 510}      # a CPU box (and full on any box)
GPU_QUICK_BUDGET_S = 180                         # quick on a GPU box
MAX_BUDGET_S = 24 * 3600
GRACE_S = 8        # after a step's Ctrl-C, the time it has to write what it finished
KILL_WAIT_S = 2    # after SIGKILL to its process group, the time to reap it
STOP_S = GRACE_S + KILL_WAIT_S  # the most a step can run past its deadline
# Kept out of a full run's plan for overruns and slower boxes (quick runs' minimums fill 180 s).
UNPLANNED_FULL = 0.15
SIGNAL_GRACE_S = 3  # when make bench itself is stopped (SIGINT, SIGTERM): a shorter grace
# A step's start-up before its first measurement (CUDA: 8-12 s in the one-GPU H200 logs).
CUDA_STARTUP_S = 12
CPU_STARTUP_S = 3

# Each step's share of the default budget in seconds to its Ctrl-C, per kind of box, quick and
# full, and the least it needs (start-up and one configuration); 0: not in that mode. A step over
# Gloo takes the one_gpu column on any GPU box. A plan's shares add up to at most the default
# budget less STOP_S (a test checks). CPU: this 2-core VM's runs; one GPU: the H200 logs; NCCL:
# estimates (bench/README.md).
SHARES = {  # key: {box: (quick, full, minimum)}, in the order the steps run
    "compute": dict(cpu=(7, 6, 5), one_gpu=(16, 22, 15), nccl=(16, 20, 15)),
    "allreduce": dict(cpu=(10, 21, 8), one_gpu=(18, 27, 15), nccl=(18, 39, 15)),
    "ddp": dict(cpu=(21, 37, 15), one_gpu=(21, 46, 20), nccl=(21, 46, 20)),
    "profile": dict(cpu=(12, 11, 10), one_gpu=(16, 21, 15), nccl=(16, 20, 15)),
    "tp": dict(cpu=(10, 7, 6), one_gpu=(16, 17, 15), nccl=(16, 17, 15)),
    "pp": dict(cpu=(16, 74, 12), one_gpu=(17, 33, 15), nccl=(17, 27, 15)),
    "ledger": dict(cpu=(17, 43, 15), one_gpu=(17, 29, 15), nccl=(17, 33, 15)),
    "cp": dict(cpu=(14, 31, 8), one_gpu=(16, 27, 15), nccl=(16, 30, 15)),
    "ep2": dict(cpu=(0, 8, 6), one_gpu=(0, 20, 15), nccl=(0, 20, 15)),  # quick: 4 ranks only
    "ep4": dict(cpu=(13, 11, 8), one_gpu=(17, 22, 15), nccl=(17, 22, 15)),
    "grid": dict(cpu=(0, 108, 45), one_gpu=(0, 57, 45), nccl=(0, 52, 45)),  # no smaller size
    "checkpoint": dict(cpu=(14, 15, 6), one_gpu=(16, 25, 15), nccl=(16, 22, 15)),
    "backends": dict(cpu=(0, 11, 8), one_gpu=(0, 26, 15), nccl=(0, 26, 15)),
    "muon": dict(cpu=(0, 19, 12), one_gpu=(0, 26, 15), nccl=(0, 26, 15)),
    "prediction": dict(cpu=(6, 14, 5), one_gpu=(0, 17, 15), nccl=(0, 17, 15)),  # quick: CPU
    "crossover": dict(cpu=(0, 7, 5), one_gpu=(0, 0, 15), nccl=(0, 0, 15)),  # its prediction: Gloo/CPU
}


# Freed blocks kept by glibc (as CUDA's allocator keeps them), so a CPU step time measures the
# algorithm, not the kernel zeroing fresh pages (AdamW 85-89 ms -> 51-54 ms on the course LM
# on the 2-core VM). The report says so; a setting of the user's own wins.
KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),
                     "MALLOC_TRIM_THRESHOLD_": str(2**40)}


def box_kind(gpus: int) -> str:
    """The column of ``SHARES`` for a box with ``gpus`` GPUs."""
    return {0: "cpu", 1: "one_gpu"}.get(gpus, "nccl")


@dataclass
class Step:
    key: str            # names the step in the report ("allreduce", "ddp", ...)
    title: str
    argv: list[str]     # script and its flags, run with this Python from the repo root
    share_s: float      # its share of the default budget (SHARES)
    min_s: float        # with less time than this it is skipped, not started
    cap_s: float = 0.0  # its share of this run's budget (plan_budget); 0: skipped
    budget_flag: str = ""  # a flag of its script set from the cap it gets (sized to its deadline)
    cases: int = 1      # ... divided among this many configurations
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
    return Setup(gpus, gpu_name, "nccl", "cuda", f"{gpus} GPUs ({gpu_name}): NCCL, one GPU per rank.")


def bench_model(setup: Setup, quick: bool) -> str:
    """``BENCH_MODEL`` if set, else tiny on a CPU, course on one GPU (its ranks' gradients cross
    host memory), small with a GPU per rank (course when quick)."""
    name = os.environ.get("BENCH_MODEL", "").strip()
    if name and name not in models.PRESETS:
        usage_error(f"BENCH_MODEL={name!r} is not a preset; choose from "
                    f"{', '.join(models.PRESETS)}", prog="make bench")
    return name or ("tiny" if setup.gpus == 0 else "course" if quick or setup.gpus == 1 else "small")


def default_budget_s(quick: bool, gpus: int = 0) -> float:
    """510 s full; quick 150 s on a CPU box, 180 s on a GPU box."""
    return GPU_QUICK_BUDGET_S if quick and gpus > 0 else DEFAULT_BUDGET_S[quick]


def budget_s(quick: bool, gpus: int = 0) -> float:
    """``BENCH_BUDGET_S``, else ``default_budget_s``: the whole run's limit, at most a day."""
    text = os.environ.get("BENCH_BUDGET_S", "").strip()
    try:
        value = float(text) if text else float(default_budget_s(quick, gpus))
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_BUDGET_S:  # NaN fails this too
        usage_error(f"BENCH_BUDGET_S={text!r}: give the whole run's limit in seconds, from "
                    f"{smallest_budget_s():.0f} (one step) to {MAX_BUDGET_S} (a day)",
                    prog="make bench")
    return value


def smallest_budget_s() -> float:
    """The least budget that runs one step on a CPU box: the smallest minimum, and one stop."""
    return min(row["cpu"][2] for row in SHARES.values()) + STOP_S


def plan(setup: Setup, quick: bool, model: str, trace_dir: str = "results/traces") -> list[Step]:
    """The steps for this box, in order (a step whose share is 0 in this mode is left out)."""
    gpus = setup.gpus

    def step(key: str, title: str, argv: list[str], budget_flag: str = "", cases: int = 1) -> Step:
        # sized by what it runs: a step over Gloo takes one GPU's share (the host's on a CPU box)
        kind = box_kind(min(gpus, 1) if "gloo" in argv else gpus)
        quick_share, full_share, minimum = SHARES[key][kind]
        share = quick_share if quick else full_share
        return Step(key, title, argv, share, minimum, budget_flag=budget_flag, cases=cases)
    where = ["--backend", setup.backend, "--device", setup.device]
    ws = 2 if gpus < 2 else min(gpus, 8)  # stages 03-06 and the ledger
    pp_ws = 4 if gpus in (0, 1) or gpus >= 4 else 2
    steps = ["--steps", "5", "--warmup", "2"]
    if gpus == 0:
        ar = ["--backend", "gloo", "--device", "cpu", "--sizes",
              "64KB,1MB,10MB" if quick else "64KB,1MB,10MB,100MB", "--world-sizes",
              "2" if quick else "2,4"]
        lm = ["--batch-size", "8", "--context-length", "64"]
        steps = steps if quick else ["--steps", "10", "--warmup", "3", "--rounds", "3"]
        buckets = "0.25,1,4"
        tp = ["--d-model", "512", "--d-ff", "2048", "--batch", "4", "--seq", "128", "--heads", "8"]
        pp = ["--d-model", "256", "--hidden", "1024", "--batch", "64", "--emulate-ms", "30"]
        micro_batches = "8" if quick else "4,8"
    else:
        lm = ["--batch-size", "8", "--context-length", "256"]
        steps = steps if quick else ["--steps", "6", "--warmup", "2", "--rounds", "2"]
        buckets = "1,25,100" if quick else "1,5,25,100"
        tp = ["--d-model", "1024", "--d-ff", "4096", "--batch", "8", "--seq", "256", "--heads", "16"]
        # One GPU: collectives cross host memory (about 1.7 GB/s), so sizes are cut to fit.
        ar = ["--device", "cuda", "--sizes", "1MB,10MB,100MB", "--world-sizes",
              "2" if quick else "2,4"]
        pp = ["--d-model", "512", "--hidden", "2048", "--batch", "64", "--emulate-ms", "10"]
        micro_batches = "8" if quick else "4,8"
    if gpus > 1:  # a GPU per rank, NCCL: the sizes an interconnect is measured at
        ar = ["--backend", "nccl", "--device", "cuda",
              "--sizes", "1MB,10MB,100MB" if quick else "1MB,10MB,100MB,1GB",
              "--world-sizes", "2" if quick else ",".join(str(n) for n in (2, 4, 8) if n <= gpus)]
        pp = ["--d-model", "1024", "--hidden", "4096", "--batch", "128", "--emulate-ms", "20"]
        micro_batches = "8" if quick else "4,8,16"
    lm[1] = str(ws * max(1, int(lm[1]) // ws))  # the global batch splits evenly over the ranks
    lm = ["--model", model, *lm]
    # none, torch DDP, 03-05, 06 at each size, torch DDP at the other sizes
    ddp_cases = 2 + 3 + 2 * len(buckets.split(",")) - 1
    # The ledger's LM: course on a CPU (checkpointing does little for tiny's logits; quick: tiny,
    # no checkpointing) and on one GPU (small missed its cap over the host path).
    ledger_model = model if gpus >= 2 and not quick else "course"
    ledger_lm = ["--model", "tiny" if quick else "course"] if gpus == 0 else \
        ["--model", ledger_model, "--batch-size", str(2 * ws), "--context-length", "256",
         "--steps", "5", "--warmup", "2"]
    cp = context_parallel_argv(setup, quick)
    grid = together_argv(setup)
    checkpoint = checkpoint_argv(setup, quick)
    models_list = f"{model},small" if gpus > 0 and not quick and model != "small" else model
    planned = [  # first the device alone, before any step can run over and leave it no time
        step("compute", "compute on one device at world size 1: the matmul peak, lesson 9's kernel "
                        "table, the LM's forward, backward, optimizer, memory, MFU",
             ["bench/compute.py", "--device", setup.device, "--models", models_list,
              "--batch-size", str(int(_flag(lm, "--batch-size")) // ws),
              "--context-length", _flag(lm, "--context-length"),
              "--steps", "3" if quick else "5", "--warmup", "2"]),
        step("allreduce", "02 all-reduce sweep",
             ["bench/allreduce_sweep.py", *ar, "--budget-s", "120"],
             budget_flag="--budget-s", cases=len(_flag(ar, "--world-sizes").split(","))),
        step("ddp", f"03-06 DDP step times, bucket sweep and model (LM {model})",
             ["bench/ddp_step.py", "--world-size", str(ws), *where, *lm,
              *steps, "--bucket-sizes", buckets, "--case-budget-s", "120"],
             budget_flag="--case-budget-s", cases=ddp_cases),
        step("profile", f"05 profile: naive vs overlapped DDP (LM {model})",
             ["bench/profile_ddp.py", "--world-size", str(ws), *where,
              *lm, "--trace-dir", trace_dir]),
        step("tp", "07 tensor and sequence parallel, 2 ranks",
             ["07_parallelism/measure/bench_tensor_parallel.py", "--bench", "--world-size", "2",
              *where, *tp]),
        step("pp", f"07 pipeline schedules, {pp_ws} stages, real and emulated compute",
             ["07_parallelism/measure/bench_pipeline.py", "--world-size",
              str(pp_ws), *where, *pp, "--micro-batches", micro_batches, "--chunks", "2",
              "--warmup", "1", "--iters", "2" if quick or gpus == 1 else "3"]),
        step("ledger", f"07 sharding ledger: DDP, ZeRO-1/2, FSDP, torch's, a compute-only control "
                       f"(LM {ledger_lm[1]})",
             ["07_parallelism/measure/bench_fsdp.py", "--bench", "--world-size", str(ws), *where,
              *ledger_lm, "--checkpointing", "off" if quick else "off,on"]),
        step("cp", f"07 context parallel: ring attention on {'4' if quick else '2 and 4'} ranks "
                   f"({_flag(cp, '--backend')}/{_flag(cp, '--device')})", cp),
        *(step(f"ep{n}", f"07 expert parallel, {n} ranks", expert_parallel_argv(setup, quick, n))
          for n in (2, 4)),
        step("grid", f"07 everything together: grids on {_flag(grid, '--world-size')} ranks, "
                     "torch's composition and pipelining beside ours", grid),
        step("checkpoint", f"07 checkpoints: saved at 2 ranks, loaded at "
                           f"{_flag(checkpoint, '--world-size')}, and back, beside "
                           f"torch.distributed.checkpoint (LM {_flag(checkpoint, '--model')})",
             checkpoint),
        step("backends", "which collective each backend/device pair of this box carries, each op "
                         "in a process of its own", ["bench/backends.py"]),
        step("muon", f"11 Muon: four designs beside AdamW + ZeRO-1, 2 and 4 ranks ({setup.backend}/"
                     f"{setup.device})", ["07_parallelism/measure/bench_muon.py", *where,
                                          "--world-sizes", "2,4" if gpus == 0 or gpus >= 4 else "2"]),
        step("crossover", "09 planning: the tokens per rank where DDP stops being "
                          "communication-bound, predicted, then swept",
             ["07_parallelism/measure/crossover.py", *where, "--model", model,
              "--seq", _flag(lm, "--context-length")]),
        step("prediction", "07 planning: the planner's step times beside the ones measured above",
             ["07_parallelism/measure/check_prediction.py", *where]),  # last: it reads their rows
    ]
    return [planned_step for planned_step in planned if planned_step.share_s > 0]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def over(setup: Setup, ranks: int, gloo_device: str = "cuda") -> list[str]:
    """NCCL with a GPU per rank, else Gloo: with ``gloo_device`` tensors on a GPU box."""
    if setup.gpus >= ranks:
        return ["--backend", "nccl", "--device", "cuda"]
    return ["--backend", "gloo", "--device", gloo_device if setup.gpus else "cpu"]


def context_parallel_argv(setup: Setup, quick: bool) -> list[str]:
    """Ring attention on 4 ranks (rings of 2 and 4; quick: 4); Gloo sends CPU tensors only."""
    where = over(setup, 4, "cpu")
    seqs = "256,512" if quick else "256,512,1024"  # the host's, whatever the box
    shape = []
    if "nccl" in where:
        seqs = "1024,2048" if quick else "1024,2048,4096"
        shape = ["--batch", "1", "--heads", "8", "--head-dim", "64"]
    repeats = []
    if quick:
        repeats = ["--ring-sizes", "4", "--warmup", "1", "--iters", "2"]
    elif setup.gpus == 0:
        repeats = ["--warmup", "1", "--iters", "3"]
    return ["07_parallelism/measure/bench_context_parallel.py", "--bench",
            "--world-size", "4", *where, *shape, "--seqs", seqs, *repeats]


def expert_parallel_argv(setup: Setup, quick: bool, world_size: int) -> list[str]:
    """Expert parallel on ``world_size`` ranks; on a CPU the script's --bench sizes (d_model
    128), on a GPU d_model 1024 and, over Gloo, fewer tokens (its all-to-alls cross host memory:
    8 MB at 1024 x 1024 x 2 floats)."""
    where = over(setup, world_size)
    sizes = ["--tokens", "256,2048", "--warmup", "1", "--iters", "3"] if quick else []
    if setup.gpus:
        nccl = "nccl" in where
        tokens = "4096,16384,32768" if nccl else "1024,4096"
        warmup, iters = {(True, True): ("2", "5"), (True, False): ("1", "3"),   # (quick, nccl)
                         (False, True): ("3", "10"), (False, False): ("2", "5")}[quick, nccl]
        sizes = ["--d-model", "1024", "--d-ff", "4096", "--tokens",
                 tokens.rsplit(",", 1)[0] if quick else tokens, "--warmup", warmup, "--iters", iters]
    return ["07_parallelism/measure/bench_expert_parallel.py", "--bench",
            "--world-size", str(world_size), *where, "--num-experts", "8", *sizes]


def together_argv(setup: Setup) -> list[str]:
    """Lesson 7's grids: NCCL on 8 or 4 ranks with 4+ GPUs, else the host's cores on 4."""
    ranks = 8 if setup.gpus >= 8 else 4
    where = over(setup, ranks, "cpu")
    return ["07_parallelism/measure/grid_bench.py", "--bench", "--world-size", str(ranks), *where,
            "--bench-sizes", "gpu" if "nccl" in where else "cpu"]


def checkpoint_argv(setup: Setup, quick: bool) -> list[str]:
    """Checkpoints saved at 2 ranks, loaded at the world size (3 or more), and back; over Gloo
    the course LM (small's 400 MB of state through host memory missed its cap)."""
    world_size = min(setup.gpus, 4) if setup.gpus >= 3 else 4
    where = over(setup, world_size)
    sizes = ["--model", "small" if "nccl" in where else "course"]
    if quick:
        sizes = ["--model", "course" if setup.gpus else "tiny", "--iters", "2"]
    return ["07_parallelism/measure/bench_checkpoint.py", "--bench", "--world-size",
            str(world_size), *where, *sizes]


def plan_budget(steps: list[Step], budget: float, unplanned: float = 0.0) -> None:
    """Give each step its cap, up front: its minimum and a part of the rest in proportion to
    its share above it; the neediest steps are skipped while the minimums do not fit."""
    usable = budget * (1 - unplanned) - STOP_S
    running = list(steps)
    while running and sum(s.min_s for s in running) > usable:
        neediest = max(reversed(running), key=lambda s: s.min_s)  # of equals, the later one
        neediest.status = (f"skipped: a {budget:.0f} s budget cannot give every step its "
                           "minimum, and of those left this one needs the most "
                           f"({neediest.min_s:.0f} s)")
        running.remove(neediest)
    if not running:
        usage_error(f"BENCH_BUDGET_S={budget:g} is too small for any step: the smallest needs "
                    f"{smallest_budget_s():.0f} s with its stop; give at least that",
                    prog="make bench")
    spare = usable - sum(s.min_s for s in running)
    above_minimums = sum(s.share_s - s.min_s for s in running)  # > 0: every share > its minimum
    for s in running:
        s.cap_s = s.min_s + spare * (s.share_s - s.min_s) / above_minimums


PREDICTION_READS = ("ddp", "ledger", "grid")  # the steps whose rows the prediction checks
NOTHING_TO_CHECK = ("skipped with a note: none of the steps it checks ran (DDP, the ledger, "
                    "the grids), so it has nothing to compare")


def run_all(steps: list[Step], run, clock=time.monotonic) -> None:
    """Run the planned steps in order; ``run(step, cap)`` runs one. A step's deadline is the start
    plus the caps so far (time left passes on); one left less than its minimum is skipped."""
    deadline = clock()
    planned = [s for s in steps if s.cap_s > 0]
    for i, step in enumerate(planned, 1):
        deadline += step.cap_s
        cap = deadline - clock()
        if step.key == "prediction" and not any(s.status == "ok" for s in steps
                                                if s.key in PREDICTION_READS):
            step.status = NOTHING_TO_CHECK
            print(f"\n[bench {i}/{len(planned)}] {step.title}: {step.status}", flush=True)
            continue
        if cap < step.min_s:
            step.status = (f"skipped: the steps before it ran over, {max(0.0, cap):.0f} s was "
                           f"left of the {step.min_s:.0f} s it needs")
            print(f"\n[bench {i}/{len(planned)}] {step.title}: {step.status}", flush=True)
            continue
        size_to_deadline(step, cap)
        print(f"\n[bench {i}/{len(planned)}] {step.title} (Ctrl-C at {cap:.0f} s)\n"
              f"  $ python {' '.join(step.argv)}", flush=True)
        try:
            run(step, cap)
        finally:  # stopped by a signal too
            print(f"[bench {i}/{len(planned)}] {step.title}: {step.status} in "
                  f"{step.seconds:.0f} s", flush=True)


def size_to_deadline(step: Step, cap: float) -> None:
    """Set the step's budget flag from its cap less its start-up, shared by its configurations."""
    if not step.budget_flag:
        return
    startup = CUDA_STARTUP_S if "cuda" in step.argv else CPU_STARTUP_S
    seconds = max(0.1, (cap - startup) / max(1, step.cases))
    step.argv[step.argv.index(step.budget_flag) + 1] = f"{math.floor(seconds * 10) / 10:g}"


# --------------------------------------------------------------------------- one step
class Interrupted(Exception):
    """SIGINT or SIGTERM to make bench: the running step is stopped, the report written."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def on_stop_signal(signum, frame) -> None:
    for s in STOP_SIGNALS:  # one is enough: a second must not cut the stop and report short
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signum)


def die_with_this_process():
    """A ``preexec_fn``: on Linux the step gets SIGKILL when make bench dies (PR_SET_PDEATHSIG)."""
    parent = os.getpid()
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
    pr_set_pdeathsig = 1  # from <linux/prctl.h>

    def arm() -> None:  # runs in the child, between fork and exec
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # `make bench &` ignores Ctrl-C: not its steps
        if prctl is not None:
            prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() != parent:  # make bench died before prctl: too late for the signal
            os._exit(1)
    return arm


def run_step(step: Step, env: dict, cap_s: float) -> None:
    """Run one stage script; at ``cap_s`` Ctrl-C, then SIGKILL; a signal to make bench is passed
    on. Nothing of the step outlives it."""
    start = time.monotonic()
    # A session of its own: a terminal's Ctrl-C reaches make bench alone; the group is the step.
    env = {**(os.environ if env is None else env),  # for the scripts that size themselves
           "BENCH_STEP_DEADLINE": f"{time.time() + cap_s:.3f}"}
    proc = subprocess.Popen([sys.executable, *step.argv], cwd=REPO_ROOT, env=env,
                            start_new_session=True, preexec_fn=die_with_this_process())
    try:
        rc = proc.wait(timeout=cap_s)
        step.status = "ok" if rc == 0 else f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        step.status = f"stopped at its {cap_s:.0f} s cap (exit {stop(proc, signal.SIGINT, GRACE_S)})"
    except Interrupted as e:
        step.status = f"stopped by {e} (exit {stop(proc, e.signum, SIGNAL_GRACE_S)})"
        raise
    finally:
        kill_group(proc.pid)  # a rank the script left behind, however it ended
        step.seconds = time.monotonic() - start


def stop(proc: subprocess.Popen, signum: int, grace_s: float) -> int:
    """``signum`` to the script; SIGKILL to its group after ``grace_s``. Returns its exit status."""
    proc.send_signal(signum)
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        return proc.wait(timeout=KILL_WAIT_S)


def take_the_lock(out: Path):
    """One make bench at a time on a results folder (flock on the folder); the second is refused."""
    import fcntl
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        usage_error(f"another make bench is writing {out} now; wait for it to finish, or give "
                    "this one another folder (RESULTS_DIR=...)", prog="make bench")
    return fd


def main() -> None:
    import torch

    quick = os.environ.get("BENCH_QUICK", "") not in ("", "0")
    gpus = torch.cuda.device_count()
    setup = pick_setup(gpus, torch.cuda.get_device_name(0) if gpus else "")
    model, budget = bench_model(setup, quick), budget_s(quick, gpus)
    out = results.check_writable()
    trace_dir = out / "traces"  # raw traces: not part of the committed report
    shown = os.path.relpath(trace_dir, REPO_ROOT) if trace_dir.is_relative_to(REPO_ROOT) \
        else str(trace_dir)
    steps = plan(setup, quick, model, shown)
    # before anything runs: a budget too small is refused here
    plan_budget(steps, budget, 0.0 if quick else UNPLANNED_FULL)
    lock = take_the_lock(out)  # held until this process ends
    run_id = "bench-" + time.strftime("%Y%m%d-%H%M%S")
    env = {**KEEP_FREED_MEMORY, **os.environ, "RESULTS_RUN_ID": run_id, "PYTHONUNBUFFERED": "1"}
    allocator = {name: env[name] for name in KEEP_FREED_MEMORY}
    print(f"make bench ({'quick' if quick else 'full'}) on {results.machine_name()}\n"
          f"{setup.picked}\nLM: {model}. Run id {run_id}; results in {out}; time budget "
          f"{budget:.0f} s (BENCH_BUDGET_S).\nPlan (seconds to each step's Ctrl-C; time a step "
          "leaves passes on):\n" + "\n".join(
              f"  {i}. {s.title}: " + (f"{s.cap_s:.0f} s" if s.cap_s else s.status)
              for i, s in enumerate(steps, 1)), flush=True)
    start, started_at, stopped_by = time.monotonic(), time.time(), None
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s, handler in previous.items():  # (ignored, as in `make bench &` from a script: stays so)
        if handler is not signal.SIG_IGN:
            signal.signal(s, on_stop_signal)
    try:
        try:
            run_all(steps, lambda step, cap: run_step(step, env, cap))
        except Interrupted as e:
            stopped_by = e.signum
            print(f"\n{e}: the running step was stopped; writing the report of what finished",
                  flush=True)
        for s in STOP_SIGNALS:  # the report is seconds away: a signal now must not cut it short
            signal.signal(s, signal.SIG_IGN)
        total = time.monotonic() - start
        info = {"run_id": run_id, "quick": quick, "model": model, "setup": asdict(setup),
                "machine": results.machine_name(), "cpu_cores": os.cpu_count(),
                "torch": torch.__version__, "total_s": total,
                "started_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started_at)),
                "budget_s": budget, "allocator": allocator,
                "keeps_freed_memory": allocator == KEEP_FREED_MEMORY,
                "steps": [asdict(s) for s in steps]}
        # a stage's picture is this run's if drawn since it started (else it is an older one)
        drawn = [out / "allreduce_busbw.png", trace_dir / "05_overlap_ddp" / "timeline.png",
                 out / "expert_parallel_load.png"]
        pictures = [(src, name) for src, name in zip(drawn, STAGE_PICTURES)
                    if src.exists() and src.stat().st_mtime >= started_at - 1]
        try:
            path, empty = write_report(out, info, pictures)
        except OSError as e:
            print(f"make bench: error: the report could not be written ({e.strerror}: "
                  f"{e.filename or out}); the previous report is kept", file=sys.stderr,
                  flush=True)
            raise SystemExit(1) from None
    finally:
        for s, handler in previous.items():  # as they were (tests run main() in their process)
            signal.signal(s, handler)
    print(f"\nmake bench finished in {total:.0f} s ({total / 60:.1f} min)", flush=True)
    if path is None:
        print(f"nothing was measured: the previous report, {out / 'README.md'}, is left as it "
              "was", file=sys.stderr, flush=True)
    else:
        print(f"report: {path}" + (f" (no data for: {'; '.join(empty)})" if empty else ""),
              flush=True)
    if stopped_by is not None:
        raise SystemExit(128 + stopped_by)
    ran = [s for s in steps if s.cap_s > 0 and s.status != NOTHING_TO_CHECK]
    if path is None or any(s.status != "ok" for s in ran):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
