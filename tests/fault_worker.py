"""A tiny launcher client for the fault tests: one rank misbehaves while the others wait.

    python tests/fault_worker.py --world-size 3 --fault raise|kill|segv|stop|hang|none|busy --bad-rank 1

Every rank prints its pid. raise: the bad rank raises; kill: it SIGKILLs itself; segv: it reads
address 0 (a segfault, as a crash in native code); stop: it SIGSTOPs itself (stalls); hang: it
waits for a message nobody sends while the others wait in a barrier (each inside C++, where no
Python signal handler runs, till DIST_TIMEOUT_S); busy: every rank keeps meeting at barriers
for a minute (something to stop from outside). --ignore-sigint: every rank ignores SIGINT;
--launcher course: common/launch.py starts the ranks, not bench/supervisor.py.
"""

import ctypes
import os
import resource
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import supervisor as launch  # noqa: E402
from common import launch as course  # noqa: E402


def faulty_main(ctx, fault: str, bad_rank: int, ignore_sigint: bool) -> None:
    if ignore_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    dist.barrier()
    ctx.print(f"pid {os.getpid()} {fault}")  # one write per line: ranks never interleave
    if fault == "busy":
        for _ in range(600):
            dist.barrier()
            time.sleep(0.1)
    if ctx.rank == bad_rank:
        print(f"planting {fault} at {time.time()!r}", flush=True)
        if fault == "raise":
            raise ValueError(f"planted failure on rank {ctx.rank}")
        if fault == "segv":
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file left in the repo
            ctypes.string_at(0)
        if fault in ("kill", "stop"):
            os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        if fault == "hang":
            dist.recv(torch.zeros(1), src=(ctx.rank + 1) % ctx.world_size)
    dist.barrier()  # the healthy ranks wait here for the bad one, forever if nobody acts
    ctx.print("passed the second barrier")


def main(argv=None) -> None:
    parser = launch.make_parser(__doc__)
    parser.add_argument("--fault", choices=["raise", "kill", "segv", "stop", "hang", "none",
                                            "busy"], default="raise")
    parser.add_argument("--bad-rank", type=int, default=1)
    parser.add_argument("--ignore-sigint", action="store_true")
    parser.add_argument("--launcher", choices=["lab", "course"], default="lab")
    args = parser.parse_args(argv)
    which = launch if args.launcher == "lab" else course
    which.launch(faulty_main, which.resolve(args), args.fault, args.bad_rank, args.ignore_sigint)


if __name__ == "__main__":
    main()
