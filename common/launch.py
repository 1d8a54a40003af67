"""Starting the ranks: stage 01's ten lines, once, for every later lesson.

    config = launch.resolve(parser.parse_args())   # --world-size, --backend, --device
    launch.launch(worker, config, *args)            # worker(ctx, *args) on every rank

Under torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` set)
this process is one rank and runs ``worker`` itself. Otherwise it starts ``--world-size``
processes on this machine with torch's ``start_processes`` and waits for them: the first rank
that raises ends the run with its traceback, and a rank whose parent dies is ended by Linux
(torch asks it to). The ranks are forked from Python's fork server, a fresh process that
imported this script (and torch) once, so no rank pays ``import torch`` again and none
inherits a lock held by another thread of this process.

Defaults follow the machine: no GPU, Gloo with CPU tensors; fewer GPUs than ranks on this node,
Gloo with the ranks sharing them (NCCL refuses two ranks on one GPU, "Duplicate GPU
detected"); a GPU per rank, NCCL. Collectives time out after ``DIST_TIMEOUT_S`` (300 s).
The lab (bench/launch.py) adds what a run that nobody watches needs: stalled ranks named,
memory checked up front, Ctrl-C handled, every environment variable checked.
"""

import argparse
import datetime
import math
import os
import signal
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing

from common import usage_error


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


# --------------------------------------------------------------------------- flags
class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit status 2."""

    def error(self, message: str):  # noqa: D401 - argparse's API
        usage_error(message, prog=self.prog)


def _number(kind, lowest, what: str):
    """A flag type for a ``kind`` >= ``lowest`` that refuses NaN and infinities too."""
    def parse(text: str):
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            value = float("nan")
        if not math.isfinite(value) or value < lowest:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


def list_of(item, allowed=None):
    """A flag type: a non-empty comma-separated list of ``item`` values (names in ``allowed``
    when given), duplicates dropped."""
    def parse(text: str) -> list:
        values = [s.strip() for s in text.split(",") if s.strip()]
        wrong = [v for v in values if v not in allowed] if allowed else []
        if allowed and (wrong or not values):
            raise argparse.ArgumentTypeError(f"{(wrong or [text])[0]!r} is not allowed: give a "
                                             f"comma-separated subset of {', '.join(allowed)}")
        if not values:
            raise argparse.ArgumentTypeError("empty list: give comma-separated values, e.g. 1,2,4")
        return list(dict.fromkeys(map(item, values)))
    parse.__name__ = "list"  # argparse names the type in its own messages
    return parse


def choice_list(allowed):
    return list_of(str, allowed)


positive_int = _number(int, 1, "a whole number >= 1")
non_negative_int = _number(int, 0, "a whole number >= 0")
positive_float = _number(float, math.nextafter(0.0, 1.0), "a finite number > 0")
int_list = list_of(positive_int)  # '1,2,4' -> [1, 2, 4]


def make_parser(doc: str | None, world_size: int = 2) -> Parser:
    """A parser with the flags every lesson shares; ``--help`` shows the whole docstring."""
    parser = Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=positive_int, default=world_size,
                        help=f"worker processes to start here (under torchrun: WORLD_SIZE); "
                             f"default {world_size}")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                        help="process-group backend; default: nccl with a GPU per rank, else gloo")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="where tensors live; default: cuda when there is a GPU, else cpu")
    return parser


# --------------------------------------------------------------------------- the machine
def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def ranks_on_this_node(world_size: int) -> int:
    """torchrun says how many ranks share this node (LOCAL_WORLD_SIZE); on its own, all of them."""
    if under_torchrun() and os.environ.get("LOCAL_WORLD_SIZE", "").isdecimal():
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return world_size


def rank_threads(world_size: int) -> int:
    """Threads per rank: the cores shared out, as torchrun does."""
    return max(1, (os.cpu_count() or 1) // world_size)


RANK_BYTES = 400 * 2**20  # a rank with torch imported, before any model: about 300-400 MiB


def check_ranks_fit(ranks: int) -> None:
    """Refuse, in one line, more ranks than this machine's memory can start (Linux only)."""
    try:
        with open("/proc/meminfo") as f:
            have = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return
    if ranks * RANK_BYTES > have:
        usage_error(f"{ranks} ranks need about {ranks * RANK_BYTES / 2**30:.1f} GiB of host memory "
                    f"but {have / 2**30:.1f} GiB is available; use a smaller --world-size")


def resolve(args: argparse.Namespace) -> LaunchConfig:
    """The common flags with the machine's defaults filled in (see the module's docstring)."""
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.world_size
    ranks_here = ranks_on_this_node(world_size)
    if not under_torchrun():
        check_ranks_fit(world_size)
    n_gpus = torch.cuda.device_count()
    device = args.device or ("cuda" if n_gpus > 0 else "cpu")
    backend = args.backend or ("nccl" if device == "cuda" and n_gpus >= ranks_here else "gloo")
    if device == "cuda" and n_gpus == 0:
        usage_error("--device cuda needs a GPU and none is visible; use --device cpu")
    if backend == "nccl" and (device != "cuda" or n_gpus < ranks_here):
        usage_error(f"--backend nccl needs --device cuda and one GPU per rank: {ranks_here} "
                    f"ranks on this node, {n_gpus} GPU(s); use --backend gloo")
    return LaunchConfig(world_size=world_size, backend=backend, device=device)


def carries_point_to_point(backend: str, device: str) -> bool:
    """Whether this backend/device pair can carry point-to-point sends and torch's coalesced
    collectives (``torch.distributed.pipelining``, DTensor and ``parallelize_module``,
    functional collectives). Gloo with CUDA tensors carries broadcast, all_reduce, reduce,
    all_gather, gather, scatter, all_gather_into_tensor, reduce_scatter_tensor and
    all_to_all_single, but its send/recv and coalesced ops have no device check: "writev: Bad
    address" or a segfault (torch 2.13, ProcessGroupGloo.cpp). Every use of those is guarded."""
    return not (backend == "gloo" and device == "cuda")


# --------------------------------------------------------------------------- one rank
def run_rank(worker, rank, world_size, local_rank, backend, device, args):
    """One rank, the same under torchrun and here: pick the device, join the process group
    (env://: MASTER_ADDR, MASTER_PORT), run ``worker``, leave the group."""
    dev = torch.device("cpu")
    if device == "cuda":
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=float(os.environ.get("DIST_TIMEOUT_S", "300")))
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout,
                            **({"device_id": dev} if backend == "nccl" else {}))
    try:
        return worker(Dist(rank, world_size, local_rank, backend, dev), *args)
    finally:
        dist.destroy_process_group()


def _rank(rank, worker, config, args):
    """A rank started here: torchrun's variables, its share of the cores, then ``run_rank``."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # the parent's death (torch asks Linux) ends it
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    torch.seed()  # ranks forked from one server would share its generator's state
    torch.set_num_threads(rank_threads(config.world_size))
    run_rank(worker, rank, config.world_size, rank, config.backend, config.device, args)


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it), so runs side by side never meet."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker, config: LaunchConfig, *args) -> None:
    """Run ``worker(ctx, *args)`` on every rank (see the module's docstring)."""
    if under_torchrun():
        run_rank(worker, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                 int(os.environ["LOCAL_RANK"]), config.backend, config.device, args)
        return
    saved = dict(os.environ)
    os.environ["MASTER_ADDR"] = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    os.environ["MASTER_PORT"] = os.environ.get("MASTER_PORT") or str(free_port())
    os.environ["WORLD_SIZE"] = os.environ["LOCAL_WORLD_SIZE"] = str(config.world_size)
    try:
        torch.multiprocessing.start_processes(_rank, (worker, config, args),
                                              nprocs=config.world_size, start_method="forkserver")
    except torch.multiprocessing.ProcessRaisedException as e:
        print(f"error: rank {e.error_index} failed:{e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except torch.multiprocessing.ProcessExitedException as e:
        if e.exit_code != 2:  # 2: bad input a rank saw, said by it in one line
            print(f"error: rank {e.error_index} {e}", file=sys.stderr, flush=True)
        raise SystemExit(2 if e.exit_code == 2 else 1) from None
    finally:
        os.environ.clear()
        os.environ.update(saved)
