"""``make check``: every stage's and lesson's own check, on this box's device, in one command.

    make check                  # = python bench/check.py --device cpu
    make check DEVICE=cuda      # on a GPU box: the first command to run there

Each script below checks itself against one process and exits 0 only when everything matched.
They run one after another on ``--device`` (with the box's default backend), their output shown
as it comes, then a table: stage, device, outcome, seconds. Exit 2 with one last line
``prog: error: ...`` is "refused" (the script cannot carry this backend/device pair), not a
failure; anything else non-zero (a traceback, a failed check, a timeout) is FAILED: exit 1.
Result files go to a temporary ``RESULTS_DIR``, removed at the end. Ctrl-C or SIGTERM ends the
running script and its ranks, in one line; SIGKILL: its script follows (Linux's parent-death
signal) and the next run removes the folder left behind.
"""

import argparse
import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
from common import usage_error  # noqa: E402  (stdlib only: make check starts at once)


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit status 2, as every script here
        usage_error(message, prog="make check")

# (stage, script and its flags; --device is added). Quick sizes: the whole list takes about
# three minutes on a one-GPU box, most of it each script's start-up.
CHECKS = [
    ("01 collectives", ["01_collectives/collectives.py", "--world-size", "4"]),
    ("02 all-reduce: exact sums", ["02_allreduce_bench/allreduce_bench.py", "--check",
                                   "--world-sizes", "2", "--sizes", "12348B,1MB"]),
    ("03 naive DDP", ["03_naive_ddp/naive_ddp.py"]),
    ("04 flat DDP", ["04_flat_ddp/flat_ddp.py"]),
    ("05 overlap DDP", ["05_overlap_ddp/overlap_ddp.py"]),
    ("06 bucketed DDP", ["06_bucketed_ddp/bucketed_ddp.py"]),
    ("07.1 ZeRO", ["07_parallelism/01_zero/run_zero.py"]),
    ("07.2 FSDP", ["07_parallelism/02_fsdp/run_fsdp.py"]),
    ("07.3 tensor parallel", ["07_parallelism/03_tensor_parallel/run_tensor_parallel.py"]),
    ("07.4 pipeline parallel", ["07_parallelism/04_pipeline_parallel/run_pipeline.py"]),
    ("07.5 context parallel", ["07_parallelism/05_context_parallel/run_context_parallel.py"]),
    ("07.6 expert parallel", ["07_parallelism/06_expert_parallel/run_expert_parallel.py",
                              "--world-size", "4"]),
    ("07.7 everything together", ["07_parallelism/07_together/train.py", "--world-size", "4",
                                  "--dp", "2", "--tp", "2", "--steps", "6", "--log-every", "3",
                                  "--check"]),
    ("07.8 checkpoints", ["07_parallelism/08_checkpoints/run_checkpoint.py", "--world-size",
                          "4"]),
    ("07.10 hangs", ["07_parallelism/10_hangs/run_hangs.py"]),
    ("07.11 Muon", ["07_parallelism/11_muon/run_muon.py", "--world-size", "4"]),
]
TIMEOUT_S = 240  # one script's limit: a hang ends as FAILED, never as a stuck make check
REFUSAL = re.compile(r"^\S+: error: .+")  # launch.usage_error's one line (and argparse's)


def outcome(returncode: int, output: str) -> tuple[str, str]:
    """("ok" | "refused" | "FAILED", the line to show) from a script's exit status and output.
    Refused: exit 2, no traceback, no usage text (argparse's: a flag this list gets wrong is
    our bug, not a refusal), and a last line ``prog: error: why``."""
    lines = [line for line in output.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if returncode == 0:
        return "ok", ""
    usage = any(line.startswith("usage:") for line in lines)
    if returncode == 2 and REFUSAL.match(last) and "Traceback" not in output and not usage:
        return "refused", last
    if returncode < 0:
        return "FAILED", f"killed by {signal.Signals(-returncode).name}: {last}"
    return "FAILED", f"exit {returncode}: {last}"


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # nothing left in it
        os.killpg(pgid, signal.SIGKILL)


def die_with_parent() -> None:
    """In the child, before exec: Linux sends it SIGKILL when check.py dies, however it dies."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


RUNNING = {"pgid": None}  # the running script's process group, for the signal handler


def run_one(argv: list[str], timeout_s: float, results_dir: str) -> tuple[int, str]:
    """Run one script from the repository root, echoing its output as it comes; its exit
    status and output. Past ``timeout_s`` its process group is killed (exit 124)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RESULTS_DIR": results_dir}
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env, preexec_fn=die_with_parent)
    RUNNING["pgid"] = proc.pid
    timer = threading.Timer(timeout_s, kill_group, args=(proc.pid,))
    timer.start()
    kept = []
    try:
        for line in proc.stdout:
            print("  " + line, end="", flush=True)
            kept.append(line)
        returncode = proc.wait()
    finally:
        timed_out = not timer.is_alive() and timer.finished.is_set()
        timer.cancel()
        kill_group(proc.pid)  # a rank the script left behind
        RUNNING["pgid"] = None
    if timed_out and returncode < 0:
        kept.append(f"check.py: stopped after its {timeout_s:.0f} s limit\n")
        returncode = 124
    return returncode, "".join(kept)


def summary(rows: list[tuple[str, str, str, float, str]]) -> str:
    """The closing table: stage, device, outcome, seconds (and the line behind each outcome)."""
    width = max(len(stage) for stage, *_ in rows)
    return "\n".join([f"{'stage':<{width}}  device  outcome   seconds  note"] +
                     [f"{stage:<{width}}  {device:<6}  {status:<8}  {seconds:7.1f}  {note}"
                      for stage, device, status, seconds, note in rows])


SCRATCH_PREFIX = "make-check-"


def sweep_stale_scratch() -> None:
    """Remove the scratch folders of earlier runs that were killed (their pid is gone)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*"):
        pid = folder.name[len(SCRATCH_PREFIX):].split("-")[0]
        if pid.isdecimal() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)


class Stop(Exception):
    """Ctrl-C or SIGTERM: end the running script, keep the table so far, exit 128 + signal."""


def on_signal(signum, _frame):
    if RUNNING["pgid"] is not None:
        kill_group(RUNNING["pgid"])
    raise Stop(signum)


def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where every check runs (make check DEVICE=cuda)")
    parser.add_argument("--only", default="",
                        help="comma-separated stage prefixes to run (e.g. 01,07.3); default all")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("make check: error: DEVICE=cuda needs a GPU and none is visible; use "
                  "DEVICE=cpu", file=sys.stderr)
            return 2
    wanted = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = [p for p in wanted if not any(stage.startswith(p) for stage, _ in CHECKS)]
    if unknown:
        print(f"make check: error: --only {unknown[0]!r} names no stage; stages: "
              f"{', '.join(stage.split()[0] for stage, _ in CHECKS)}", file=sys.stderr)
        return 2
    rows = []
    start = time.monotonic()
    sweep_stale_scratch()
    scratch = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")  # results, thrown away
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for stage, script in [(stage, script) for stage, script in CHECKS
                              if not wanted or any(stage.startswith(p) for p in wanted)]:
            command = [*script, "--device", args.device]
            print(f"\n[check] {stage} on {args.device}\n  $ python {' '.join(command)}",
                  flush=True)
            began = time.monotonic()
            returncode, output = run_one(command, TIMEOUT_S, scratch)
            status, note = outcome(returncode, output)
            rows.append((stage, args.device, status, time.monotonic() - began, note))
            print(f"[check] {stage}: {status} in {rows[-1][3]:.0f} s", flush=True)
    except Stop as stop:
        signum = stop.args[0]
        print(f"make check: stopped by {signal.Signals(signum).name}; the running script and "
              f"its ranks ended", file=sys.stderr, flush=True)
        return 128 + signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\nmake check on {args.device}: {len(rows)} scripts in "
          f"{time.monotonic() - start:.0f} s\n{summary(rows)}", flush=True)
    failed = [stage for stage, _, status, *_ in rows if status == "FAILED"]
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
