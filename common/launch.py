"""Starting the ranks: stage 01's ten lines, once, for every later lesson.

    config = launch.resolve(parser.parse_args())   # --world-size, --backend, --device
    launch.launch(worker, config, *args)            # worker(ctx, *args) on every rank

Under torchrun this process is one rank; otherwise it forks --world-size ranks from Python's
fork server (no thread of ours holds a lock there). Defaults: no GPU, Gloo on the CPU; ranks
sharing a GPU, Gloo (NCCL refuses); a GPU per rank, NCCL. Collectives wait DIST_TIMEOUT_S (300).
"""

import argparse
import datetime
import functools
import math
import multiprocessing.forkserver
import os
import signal
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist  # torch imports torch.multiprocessing too

from common import usage_error


@dataclass(frozen=True)
class Dist:  # who this worker is; device: where its tensors live
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def print(self, *parts, all_ranks: bool = True) -> None:  # one write: lines never interleave
        if all_ranks or self.is_main:
            sys.stdout.write(" ".join([f"[rank {self.rank}]", *map(str, parts)]) + "\n")
            sys.stdout.flush()


@dataclass(frozen=True)
class LaunchConfig:
    world_size: int
    backend: str
    device: str  # "cpu" or "cuda"


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # a usage error is one line and exit status 2
        usage_error(message, prog=self.prog)


def number(kind, lowest, what: str, highest=math.inf):  # a flag type: a kind in [lowest, highest], finite
    def parse(text: str):
        try:
            value = kind(text)
            wrong = not math.isfinite(value) or not lowest <= value <= highest
        except (ValueError, OverflowError):    # not a number, or an int too large for a float
            wrong = True
        if wrong:
            raise argparse.ArgumentTypeError(f"{text[:20]!r} is not {what}")
        return value
    return parse


def list_of(item, allowed=None):  # a flag type: a comma-separated list of item (or allowed)
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


positive_int = number(int, 1, "a whole number >= 1")
non_negative_int = number(int, 0, "a whole number >= 0")
positive_float = number(float, math.nextafter(0.0, 1.0), "a finite number > 0")
int_list = list_of(positive_int)  # '1,2,4' -> [1, 2, 4]
choice_list = functools.partial(list_of, str)  # choice_list(allowed): a subset of allowed


def make_parser(doc: str | None, world_size: int = 2) -> Parser:  # the flags every lesson shares
    parser = Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=positive_int, default=world_size,
                        help=f"ranks to start here (under torchrun: WORLD_SIZE); default {world_size}")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                        help="process-group backend; default: nccl with a GPU per rank, else gloo")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="where tensors live; default: cuda when there is a GPU, else cpu")
    return parser


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def ranks_on_this_node(world_size: int) -> int:  # torchrun says it: LOCAL_WORLD_SIZE
    if under_torchrun() and os.environ.get("LOCAL_WORLD_SIZE", "").isdecimal():
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return world_size


def ranks_per_gpu(world_size: int) -> int:  # ranks on this node sharing a GPU, rounded up
    n_gpus = torch.cuda.device_count()
    if under_torchrun() and n_gpus == 1 and os.environ.get("SLURM_GPUS_PER_TASK") == "1":
        return 1  # Slurm's --gpus-per-task=1: each process sees its own GPU, alone
    return -(-ranks_on_this_node(world_size) // max(1, n_gpus))


def rank_threads(world_size: int) -> int:  # the cores shared out, as torchrun does
    return max(1, (os.cpu_count() or 1) // world_size)


def check_ranks_fit(ranks: int) -> None:  # more ranks than memory holds: one line (Linux)
    need = ranks * 400 * 2**20  # a rank with torch imported, before any model: 300-400 MiB
    try:
        with open("/proc/meminfo") as f:
            have = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return
    if need > have:
        usage_error(f"{ranks} ranks need about {need / 2**30:.1f} GiB of host memory "
                    f"but {have / 2**30:.1f} GiB is available; use a smaller --world-size")


def resolve(args: argparse.Namespace) -> LaunchConfig:  # the machine's defaults filled in
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.world_size
    if not under_torchrun():
        check_ranks_fit(world_size)
    n_gpus = torch.cuda.device_count()
    device = args.device or ("cuda" if n_gpus > 0 else "cpu")
    gpu_each = ranks_per_gpu(world_size) == 1
    backend = args.backend or ("nccl" if device == "cuda" and gpu_each else "gloo")
    if device == "cuda" and n_gpus == 0:
        usage_error("--device cuda needs a GPU and none is visible; use --device cpu")
    if backend == "nccl" and (device != "cuda" or not gpu_each):
        usage_error(f"--backend nccl needs --device cuda and one GPU per rank: "
                    f"{ranks_on_this_node(world_size)} ranks on this node, {n_gpus} GPU(s); "
                    "use --backend gloo")
    return LaunchConfig(world_size=world_size, backend=backend, device=device)


def carries_point_to_point(backend: str, device: str) -> bool:
    """Whether sends and torch's coalesced ops (pipelining, DTensor) work: Gloo's take CUDA
    tensors without a device check ("writev: Bad address", or a segfault; torch 2.13)."""
    return not (backend == "gloo" and device == "cuda")


def run_rank(worker, config: LaunchConfig, args):  # one rank: which, from torchrun's variables
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    dev = torch.device("cpu")
    if config.device == "cuda":
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=float(os.environ.get("DIST_TIMEOUT_S", "300")))
    dist.init_process_group(config.backend, rank=rank, world_size=config.world_size,
                            timeout=timeout,
                            **({"device_id": dev} if config.backend == "nccl" else {}))
    try:
        return worker(Dist(rank, config.world_size, local_rank, config.backend, dev), *args)
    finally:
        dist.destroy_process_group()


def _rank(rank, worker, config, args, environ):  # environ: the fork server's is older
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # the parent's death (torch asks Linux) ends it
    server = multiprocessing.forkserver._forkserver  # our parent: it ends when the launcher does,
    os.close(server._forkserver_alive_fd)  # once every copy of this pipe is closed, ours too
    os.environ.clear()
    os.environ.update(environ, RANK=str(rank), LOCAL_RANK=str(rank))
    torch.seed()  # ranks forked from one server would share its generator's state
    torch.set_num_threads(rank_threads(config.world_size))
    run_rank(worker, config, args)


def free_port() -> int:  # a port the OS just found free: runs side by side never meet
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker, config: LaunchConfig, *args) -> None:  # worker(ctx, *args) on every rank
    if under_torchrun():
        return run_rank(worker, config, args)
    environ = {**os.environ, "MASTER_ADDR": os.environ.get("MASTER_ADDR") or "127.0.0.1",
               "MASTER_PORT": os.environ.get("MASTER_PORT") or str(free_port()),
               "WORLD_SIZE": str(config.world_size), "LOCAL_WORLD_SIZE": str(config.world_size)}
    try:
        torch.multiprocessing.start_processes(_rank, (worker, config, args, environ),
                                              nprocs=config.world_size, start_method="forkserver")
    except (torch.multiprocessing.ProcessRaisedException,
            torch.multiprocessing.ProcessExitedException) as e:  # the first failed rank torch saw
        if getattr(e, "exit_code", None) == 2:  # bad input, said by the rank in one line
            raise SystemExit(2) from None
        raise SystemExit(f"error: rank {e.error_index} failed: {e}") from None  # exit status 1
