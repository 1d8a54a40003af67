"""A tiny launcher client for the fault tests: one rank misbehaves while the others wait.

    python tests/fault_worker.py --world-size 3 --fault raise|kill --bad-rank 1
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import launch  # noqa: E402


def faulty_main(ctx, fault: str, bad_rank: int) -> None:
    dist.barrier()
    if ctx.rank == bad_rank:
        print(f"planting {fault} at {time.time()!r}", flush=True)
        if fault == "raise":
            raise ValueError(f"planted failure on rank {ctx.rank}")
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # the healthy ranks wait here for the bad one, forever if nobody acts
    ctx.print("passed the second barrier")


if __name__ == "__main__":
    parser = launch.make_parser(__doc__)
    parser.add_argument("--fault", choices=["raise", "kill", "none"], default="raise")
    parser.add_argument("--bad-rank", type=int, default=1)
    args = parser.parse_args()
    launch.launch(faulty_main, launch.resolve(args), args.fault, args.bad_rank)
