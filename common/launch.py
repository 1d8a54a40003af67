"""Process set-up shared by every stage: parse the common flags, start workers, join a group.

Two ways in, one code path for the stage:

* ``python NN_stage/script.py --world-size N`` spawns N workers on this machine with
  ``torch.multiprocessing`` (start method "spawn"), rendezvousing on loopback at a free port
  (or at ``MASTER_ADDR``/``MASTER_PORT`` when those are set);
* ``torchrun ... NN_stage/script.py`` has already started us: ``RANK``, ``WORLD_SIZE`` and
  ``LOCAL_RANK`` are in the environment, so the worker runs in this very process.

Either way the stage's worker is called as ``worker(ctx, *args)`` with a :class:`Dist` that
says who we are, inside an initialised process group that is torn down afterwards.

Nothing hangs and nothing is silent: the process group has a timeout, a rank that raises or
dies takes the others down with it (torch's process context terminates the survivors), and
the parent prints the failing rank's traceback and exits 1. Bad flags exit 2 with one line.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

# Collectives and rendezvous give up after this long instead of waiting forever on a dead
# peer. Generous, because a 1 GB all-reduce on Gloo/CPU takes seconds. Override with
# DIST_TIMEOUT_S.
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
        """print() prefixed with the rank, flushed so that ranks interleave line by line."""
        if all_ranks or self.is_main:  # one write per line, so ranks do not interleave mid-line
            sys.stdout.write(" ".join([f"[rank {self.rank}]", *map(str, parts)]) + "\n")
            sys.stdout.flush()


@dataclass(frozen=True)
class LaunchConfig:
    world_size: int
    backend: str
    device: str  # "cpu" or "cuda"


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
# one-line usage error above. Each rejects what makes no sense (NaN, infinities, empty lists), so no flag
# can switch a check off by accident.


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


def int_list(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]: whole numbers >= 1, at least one, duplicates dropped."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise argparse.ArgumentTypeError("empty list: give comma-separated whole numbers >= 1, "
                                         "e.g. 1,2,4")
    return list(dict.fromkeys(positive_int(s) for s in items))


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
        "--world-size", type=int, default=world_size,
        help="number of worker processes to spawn on this machine (ignored under torchrun, "
             "which sets WORLD_SIZE)")
    parser.add_argument(
        "--backend", choices=["gloo", "nccl"], default=None,
        help="process-group backend; default: nccl when there is one GPU per rank, else gloo")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default=None,
        help="where tensors live; default: cuda when a GPU is present, else cpu")
    return parser


def host_available_bytes() -> int:
    """Host memory a new allocation can still get: Linux's MemAvailable, else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def resolve(args: argparse.Namespace, min_world_size: int = 1) -> LaunchConfig:
    """Check the common flags and fill in machine-dependent defaults (SPEC section 3).

    CPU only: gloo/cpu. Fewer GPUs than ranks on this node (e.g. one GPU): the ranks share
    the GPU(s) over Gloo, because NCCL refuses two ranks on one GPU ("Duplicate GPU
    detected"). At least one GPU per rank: nccl/cuda.
    """
    if under_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    else:
        world_size = args.world_size
        ranks_here = world_size
    if world_size < min_world_size:
        usage_error(f"--world-size must be >= {min_world_size}, got {world_size}")

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


def _device_for(local_rank: int, device: str) -> torch.device:
    if device == "cuda":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _run_worker(worker, rank: int, world_size: int, local_rank: int,
                backend: str, device: str, args: tuple, on_error=None):
    dev = _device_for(local_rank, device)
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


def _spawned_entry(local_rank: int, worker, world_size: int, backend: str, device: str,
                   addr: str, port: int, args: tuple, error_dir: str):
    # Set the same variables torchrun would, so code below cannot tell the two apart.
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    # Share the cores instead of every rank starting one thread per core (torchrun does the
    # same with OMP_NUM_THREADS=1): oversubscribed ranks would time each other's contention.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))

    def record_failure():
        # When one rank fails, its peers fail moments later ("connection closed by peer").
        # Record when and how each failed, so the parent can name the rank that failed first.
        # Written before the process group is torn down, and renamed into place atomically.
        path = os.path.join(error_dir, f"rank{local_rank}.err")
        with open(path + ".tmp", "w") as f:
            f.write(f"{time.time()!r}\n{traceback.format_exc()}")
        os.replace(path + ".tmp", path)

    _run_worker(worker, local_rank, world_size, local_rank, backend, device, args, record_failure)


def _report_failure(error: ProcessException, error_dir: str) -> None:
    """Print the root cause: a rank killed by a signal, else the earliest Python traceback."""
    failures = []
    for name in os.listdir(error_dir):
        if not name.endswith(".err"):
            continue
        with open(os.path.join(error_dir, name)) as f:
            stamp, _, tb = f.read().partition("\n")
        failures.append((float(stamp), int(name[4:-4]), tb))
    failures.sort()
    if isinstance(error, ProcessExitedException) and error.error_index not in {r for _, r, _ in failures}:
        print(f"error: {error}", file=sys.stderr)  # died without a traceback (signal, os._exit)
    if failures:
        _, rank, tb = failures[0]
        print(f"error: rank {rank} failed first:\n{tb}", file=sys.stderr, end="")
        later = sorted(r for _, r, _ in failures[1:])
        if later:
            print(f"(then rank(s) {later} failed too, usually because a peer went away)",
                  file=sys.stderr)
    elif not isinstance(error, ProcessExitedException):
        print(f"error: {error}", file=sys.stderr)
    sys.stderr.flush()


def launch(worker, config: LaunchConfig, *args, timeout_s: float | None = None) -> None:
    """Run ``worker(ctx, *args)`` on every rank.

    Under torchrun this process is one rank and runs it in-process. Otherwise spawn
    ``config.world_size`` processes; if any of them raises or dies, terminate the rest,
    print its traceback and exit 1. ``timeout_s`` bounds the whole run (tests use it).
    """
    if under_torchrun():
        _run_worker(worker, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                    int(os.environ["LOCAL_RANK"]), config.backend, config.device, args)
        return

    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT") or free_port())
    with tempfile.TemporaryDirectory(prefix="launch-errors-") as error_dir:
        context = mp.start_processes(
            _spawned_entry,
            args=(worker, config.world_size, config.backend, config.device, addr, port, args,
                  error_dir),
            nprocs=config.world_size, join=False, start_method="spawn")
        _join(context, timeout_s, error_dir)


def _join(context, timeout_s: float | None, error_dir: str) -> None:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        # join() returns True when all exited cleanly; it raises as soon as one fails,
        # after terminating the others.
        while not context.join(timeout=0.5):
            if deadline is not None and time.monotonic() > deadline:
                for p in context.processes:
                    if p.is_alive():
                        p.kill()
                print(f"error: run exceeded its {timeout_s:.0f}s limit; all ranks killed",
                      file=sys.stderr, flush=True)
                raise SystemExit(1)
    except ProcessException as e:  # raised (with traceback) or exited/killed by a signal
        _report_failure(e, error_dir)
        raise SystemExit(1) from None
