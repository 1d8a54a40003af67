"""Starting workers: what stage 01 writes out by hand, made safe for every later stage.

Two ways in, one code path for the stage:

* ``python NN_stage/script.py --world-size N`` spawns N workers on this machine (start method
  "spawn"), rendezvousing on loopback at a free port (or ``MASTER_ADDR``/``MASTER_PORT``);
* ``torchrun ... NN_stage/script.py`` has already started us: ``RANK``, ``WORLD_SIZE`` and
  ``LOCAL_RANK`` are in the environment, so the worker runs in this very process.

Either way the stage's worker is called as ``worker(ctx, *args)`` with a :class:`Dist` that
says who we are, inside an initialised process group that is torn down afterwards.

What this adds to stage 01's ten lines, so that nothing hangs and nothing is silent:
* a rank that raises or dies stops the run: the others are killed and the parent prints the
  traceback of the rank that failed first (or the signal that killed it, or that it stalled);
* Ctrl-C or SIGTERM to the parent stops every worker at once, with one line, no tracebacks;
* a worker whose parent died (SIGKILL) notices within a second and exits;
* collectives and rendezvous time out (``DIST_TIMEOUT_S``, default 300 s);
* flags are checked before any worker starts: one line on stderr, exit status 2, including
  world sizes whose ranks would not fit in this machine's memory.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = float(os.environ.get("DIST_TIMEOUT_S", "300"))


@dataclass(frozen=True)
class Dist:
    """Who this worker is. ``device`` is where its tensors live (cuda:LOCAL_RANK or cpu)."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def print(self, *parts, all_ranks: bool = True) -> None:
        """print() prefixed with the rank, one write per line so ranks never interleave."""
        if all_ranks or self.is_main:
            sys.stdout.write(" ".join([f"[rank {self.rank}]", *map(str, parts)]) + "\n")
            sys.stdout.flush()


@dataclass(frozen=True)
class LaunchConfig:
    world_size: int
    backend: str
    device: str  # "cpu" or "cuda"


class Stopped(SystemExit):
    """Raised in the parent after Ctrl-C / SIGTERM stopped the workers (exit 128 + signal).
    A benchmark catches it to report the rows finished so far, then re-raises."""


# --------------------------------------------------------------------------- flags


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit status 2."""

    def error(self, message: str):  # noqa: D401 - argparse's API
        usage_error(message, prog=self.prog)


def usage_error(message: str, prog: str | None = None) -> None:
    prog = prog or os.path.basename(sys.argv[0])
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


# Flag types. argparse calls them on the text and turns their ArgumentTypeError into the
# one-line usage error above. Each rejects what makes no sense (NaN, infinities, empty lists),
# so no flag can switch a check off by accident.


def _number(text: str, kind, lowest, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if value != value or value in (float("inf"), float("-inf")) or value < lowest:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, 1, "a whole number >= 1")


def non_negative_int(text: str) -> int:
    return _number(text, int, 0, "a whole number >= 0")


def positive_float(text: str) -> float:
    value = _number(text, float, 0.0, "a finite number > 0")
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number > 0")
    return value


def list_of(item):
    """A flag type: a non-empty comma-separated list of ``item`` values, duplicates dropped."""
    def parse(text: str) -> list:
        items = [s.strip() for s in text.split(",") if s.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"empty list: give comma-separated values, e.g. 1,2,4")
        return list(dict.fromkeys(item(s) for s in items))
    parse.__name__ = "list"
    return parse


int_list = list_of(positive_int)  # '1,2,4' -> [1, 2, 4]


def choice_list(allowed):
    """A flag type: a non-empty comma-separated subset of ``allowed``, in the order given."""
    def parse(text: str) -> list[str]:
        items = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
        bad = [s for s in items if s not in allowed]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"{(bad or [text])[0]!r} is not allowed: give a "
                                             f"comma-separated subset of {', '.join(allowed)}")
        return items
    parse.__name__ = "list"
    return parse


def make_parser(doc: str | None, world_size: int = 2) -> Parser:
    """A parser with the flags every stage shares: --world-size, --backend, --device."""
    first_line = (doc or "").strip().splitlines()[0] if doc else None
    parser = Parser(description=first_line, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument(
        "--world-size", type=positive_int, default=world_size,
        help="number of worker processes to spawn on this machine (ignored under torchrun, "
             "which sets WORLD_SIZE)")
    parser.add_argument(
        "--backend", choices=["gloo", "nccl"], default=None,
        help="process-group backend; default: nccl when there is one GPU per rank, else gloo")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default=None,
        help="where tensors live; default: cuda when a GPU is present, else cpu")
    return parser


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def ranks_on_this_node(world_size: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if under_torchrun() else world_size


def resolve(args: argparse.Namespace, min_world_size: int = 1) -> LaunchConfig:
    """Check the common flags and fill in machine-dependent defaults.

    CPU only: gloo/cpu. Fewer GPUs than ranks on this node (e.g. one GPU): the ranks share
    the GPU(s) over Gloo, because NCCL refuses two ranks on one GPU ("Duplicate GPU
    detected"). At least one GPU per rank: nccl/cuda.
    """
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.world_size
    ranks_here = ranks_on_this_node(world_size)
    if world_size < min_world_size:
        usage_error(f"--world-size must be >= {min_world_size}, got {world_size}")
    if not under_torchrun():
        from common import limits  # noqa: PLC0415 (limits imports this module)
        limits.check_ranks_fit(ranks_here)
    n_gpus = torch.cuda.device_count()
    if args.backend == "nccl" and (n_gpus == 0 or not dist.is_nccl_available()):
        usage_error("--backend nccl needs CUDA GPUs and none is visible; use --backend gloo")
    device = args.device or ("cuda" if n_gpus > 0 else "cpu")
    if device == "cuda" and n_gpus == 0:
        usage_error("--device cuda needs a GPU and none is visible; use --device cpu")
    backend = args.backend or ("nccl" if device == "cuda" and n_gpus >= ranks_here else "gloo")
    if backend == "nccl":
        if device != "cuda":
            usage_error("--backend nccl needs --device cuda (NCCL moves GPU memory only); "
                        "use --backend gloo for cpu")
        if n_gpus < ranks_here:
            usage_error(f"--backend nccl needs one GPU per rank: {ranks_here} ranks on this "
                        f"node but {n_gpus} GPU(s); use --backend gloo to share them")
    return LaunchConfig(world_size=world_size, backend=backend, device=device)


# --------------------------------------------------------------------------- workers


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it), so parallel runs never collide."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_worker(worker, rank: int, world_size: int, local_rank: int,
                backend: str, device: str, args: tuple, on_error=None):
    dev = torch.device("cuda", local_rank % torch.cuda.device_count()) \
        if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    init = dict(backend=backend, rank=rank, world_size=world_size,
                timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
    if backend == "nccl":
        init["device_id"] = dev  # bind the communicator to our GPU up front
    dist.init_process_group(**init)  # env:// rendezvous: MASTER_ADDR / MASTER_PORT
    try:
        return worker(Dist(rank, world_size, local_rank, backend, dev), *args)
    except BaseException:
        if on_error is not None:
            on_error()
        raise
    finally:
        dist.destroy_process_group()


def _exit_when_orphaned(parent_pid: int, error_dir: str) -> None:
    """A daemon thread in each worker: when the launcher dies (even by SIGKILL, which no
    handler sees), the worker is re-parented; it then cleans up and exits."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        shutil.rmtree(error_dir, ignore_errors=True)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def _spawned_entry(rank: int, worker, world_size: int, backend: str, device: str,
                   addr: str, port: int, args: tuple, error_dir: str, parent_pid: int):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _exit_when_orphaned(parent_pid, error_dir)
    # The same variables torchrun sets, so code below cannot tell the two apart.
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    # Share the cores instead of every rank starting one thread per core (torchrun does the
    # same with OMP_NUM_THREADS=1): oversubscribed ranks would time each other's contention.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))

    def record_failure():
        # A rank's failure makes its peers fail moments later ("connection closed by peer"):
        # record when each failed, so the parent can name the first. Renamed into place.
        error = sys.exc_info()[1]
        text = (f"exited with status {error.code} (its own checks failed: see its output)\n"
                if isinstance(error, SystemExit) else traceback.format_exc())
        path = os.path.join(error_dir, f"rank{rank}.err")
        with open(path + ".tmp", "w") as f:
            f.write(f"{time.time()!r}\n{text}")
        os.replace(path + ".tmp", path)

    try:
        _run_worker(worker, rank, world_size, rank, backend, device, args, record_failure)
    except BaseException:
        sys.exit(1)  # quietly: the parent prints the first failure, once


def launch(worker, config: LaunchConfig, *args, timeout_s: float | None = None) -> None:
    """Run ``worker(ctx, *args)`` on every rank.

    Under torchrun this process is one rank and runs it in-process. Otherwise spawn
    ``config.world_size`` processes and supervise them (``_supervise``); ``timeout_s``
    bounds the whole run.
    """
    if under_torchrun():
        _run_worker(worker, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                    int(os.environ["LOCAL_RANK"]), config.backend, config.device, args)
        return
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT") or free_port())
    error_dir = tempfile.mkdtemp(prefix="launch-errors-")
    spawn = multiprocessing.get_context("spawn")
    processes = [spawn.Process(target=_spawned_entry, daemon=True, args=(
        rank, worker, config.world_size, config.backend, config.device, addr, port, args,
        error_dir, os.getpid())) for rank in range(config.world_size)]
    stop = _StopOnSignals(threading.current_thread() is threading.main_thread())
    try:
        with stop:
            for p in processes:
                p.start()
            _supervise(processes, timeout_s, error_dir, stop)
    finally:
        _kill(processes)
        shutil.rmtree(error_dir, ignore_errors=True)


class _StopOnSignals:
    """While supervising: SIGINT / SIGTERM set a flag the supervisor acts on (no traceback)."""

    def __init__(self, install: bool = True):
        self.signum, self.install, self._old = None, install, {}

    def __enter__(self):
        if self.install:  # only the main thread may set signal handlers
            self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame):
        self.signum = signum

    def __exit__(self, *exc):
        for s, handler in self._old.items():
            signal.signal(s, handler)
        return False


def _kill(processes) -> None:
    for p in processes:
        if p.is_alive():
            p.kill()  # SIGKILL: also ends a rank that is stopped (SIGSTOP) or stuck in C++
    for p in processes:
        p.join(timeout=5)


def _state(pid: int) -> str:
    """Linux's one-letter process state (R running, S sleeping, T stopped), '?' if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def _supervise(processes, timeout_s, error_dir: str, stop: _StopOnSignals) -> None:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        codes = [p.exitcode for p in processes]
        if all(c == 0 for c in codes):
            return
        stalled = [r for r, p in enumerate(processes) if p.exitcode is None
                   and _state(p.pid) == "T"]
        if stop.signum is not None:
            _kill(processes)
            name = signal.Signals(stop.signum).name
            print(f"stopped by {name}: all {len(processes)} ranks ended; results written "
                  "before this point are kept", file=sys.stderr, flush=True)
            raise Stopped(128 + stop.signum)
        if any(c not in (None, 0) for c in codes):
            _kill(processes)
            _report_failure(codes, error_dir, stalled)
            raise SystemExit(1)
        if deadline is not None and time.monotonic() > deadline:
            _kill(processes)
            print(f"error: run exceeded its {timeout_s:.0f}s limit; all ranks killed"
                  + _stalled_note(stalled), file=sys.stderr, flush=True)
            raise SystemExit(1)
        multiprocessing.connection.wait([p.sentinel for p in processes if p.exitcode is None],
                                        timeout=0.5)


def _stalled_note(stalled: list[int]) -> str:
    return (f" (rank(s) {stalled} had been stopped by a signal (SIGSTOP?) and stalled the "
            "others)") if stalled else ""


def _report_failure(codes: list, error_dir: str, stalled: list[int]) -> None:
    """Print the root cause: the earliest Python traceback, a rank killed by a signal, or a
    stalled rank the others gave up waiting for."""
    failures = []
    for name in os.listdir(error_dir):
        if name.endswith(".err"):
            with open(os.path.join(error_dir, name)) as f:
                stamp, _, tb = f.read().partition("\n")
            failures.append((float(stamp), int(name[4:-4]), tb))
    failures.sort()
    for rank, code in enumerate(codes):
        if code is not None and code < 0 and rank not in {r for _, r, _ in failures}:
            print(f"error: rank {rank} was killed by {signal.Signals(-code).name}",
                  file=sys.stderr)
    if stalled:
        print(f"error: rank(s) {stalled} stalled (stopped by a signal, SIGSTOP?); the others "
              "gave up waiting for them", file=sys.stderr)
    if failures:
        _, rank, tb = failures[0]
        waited = " while waiting for a stalled rank" if stalled else ""
        print(f"error: rank {rank} failed first{waited}:\n{tb}", file=sys.stderr, end="")
        later = sorted(r for _, r, _ in failures[1:])
        if later:
            print(f"(then rank(s) {later} failed too, usually because a peer went away)",
                  file=sys.stderr)
    sys.stderr.flush()
