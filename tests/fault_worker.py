"""A tiny launcher client for the fault tests: one rank misbehaves while the others wait.

    python tests/fault_worker.py --world-size 3 --fault raise|kill|segv|stop|none|busy --bad-rank 1

raise: the bad rank raises; kill: it SIGKILLs itself; segv: it reads address 0 (a segfault, as
a crash in native code); stop: it SIGSTOPs itself (stalls); busy: every rank keeps meeting at
barriers for a minute (something to stop from outside).
"""

import ctypes
import os
import resource
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import supervisor as launch  # noqa: E402


def faulty_main(ctx, fault: str, bad_rank: int) -> None:
    dist.barrier()
    if fault == "busy":
        ctx.print(f"pid {os.getpid()} busy")  # one write per line: ranks never interleave
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
    dist.barrier()  # the healthy ranks wait here for the bad one, forever if nobody acts
    ctx.print("passed the second barrier")


def main(argv=None) -> None:
    parser = launch.make_parser(__doc__)
    parser.add_argument("--fault", choices=["raise", "kill", "segv", "stop", "none", "busy"],
                        default="raise")
    parser.add_argument("--bad-rank", type=int, default=1)
    args = parser.parse_args(argv)
    launch.launch(faulty_main, launch.resolve(args), args.fault, args.bad_rank)


if __name__ == "__main__":
    main()
