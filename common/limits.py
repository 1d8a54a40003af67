"""What fits: memory checks before workers start (a run that cannot fit is refused with one
line, exit 2, instead of an out-of-memory kill half way) and between configurations."""

import math
import os

import torch
import torch.distributed as dist

from common.launch import usage_error

GIB = 2 ** 30


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


def rank_baseline_bytes() -> int:
    """What one rank costs before any model: this process's resident memory (a worker imports
    the same torch), plus 64 MiB for its process group and buffers."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") + (64 << 20)
    except (OSError, ValueError, IndexError):
        return 512 << 20


def check_ranks_fit(ranks_here: int, per_rank_bytes: int = 0, what: str = "") -> None:
    """One-line usage error when ``ranks_here`` workers (each its baseline plus
    ``per_rank_bytes``, described by ``what``) would not fit in host memory."""
    baseline = rank_baseline_bytes()
    need, have = ranks_here * (baseline + per_rank_bytes), int(0.9 * host_available_bytes())
    if need > have:
        usage_error(f"{ranks_here} ranks need about {need / GIB:.1f} GiB of host memory "
                    f"({baseline / 2**20:.0f} MiB each to start{', plus ' + what if what else ''})"
                    f" but {have / GIB:.1f} GiB is available; use a smaller --world-size"
                    + (" or size" if what else ""))


def agreed_shortfall(ctx, host_per_rank: int, gpu_per_rank: int = 0) -> str | None:
    """Why ``host_per_rank`` bytes on the host (and ``gpu_per_rank`` on each rank's GPU) would
    not fit for the ranks on this node, or None. Checked inside a run, every rank for its own
    GPU, all getting the same answer: one rank short means all skip, or their collectives
    would not match."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
    host, have = ranks_here * (rank_baseline_bytes() + host_per_rank), host_available_bytes()
    why = None
    if host > 0.9 * have:
        why = f"needs about {host / GIB:.1f} GiB of host memory, {have / GIB:.1f} GiB available"
    elif ctx.device.type == "cuda" and gpu_per_rank:
        torch.cuda.empty_cache()  # else the last configuration's cached blocks count as used
        free = torch.cuda.mem_get_info(ctx.device)[0]  # + 1 GiB for context and buffers:
        per_gpu = math.ceil(ranks_here / torch.cuda.device_count()) * (gpu_per_rank + GIB)
        if per_gpu > 0.9 * free:
            why = f"needs about {per_gpu / GIB:.1f} GiB per GPU, {free / GIB:.1f} GiB free"
    flag = torch.tensor([float(why is not None)],
                        device=ctx.device if ctx.backend == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return (why or "memory is short on another rank") if flag.item() else None
