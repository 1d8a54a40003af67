"""What fits: memory checks before workers start (a run that cannot fit is refused with one
line, exit 2, instead of an out-of-memory kill half way) and between configurations."""

from __future__ import annotations

import math
import os
import subprocess
import sys

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
    """What one rank costs before any model: measured as this process's resident memory
    (a worker imports the same torch), plus 64 MiB for its process group and buffers."""
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE") + (64 << 20)
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


_GPU_FREE: list[int] | None = None


def gpu_free_bytes() -> list[int] | None:
    """Free bytes on every GPU, asked once in a short-lived child process: asking here would
    leave a CUDA context (hundreds of MB) on every GPU for as long as this parent lives,
    taking memory from the ranks it starts. None if the child fails."""
    global _GPU_FREE
    if _GPU_FREE is None and torch.cuda.device_count():
        code = ("import torch; print(','.join(str(torch.cuda.mem_get_info(i)[0]) "
                "for i in range(torch.cuda.device_count())))")
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 timeout=120, check=True).stdout.strip()
            _GPU_FREE = [int(x) for x in out.split(",") if x]
        except (subprocess.SubprocessError, OSError, ValueError):
            return None
    return _GPU_FREE


def shortfall(ranks_here: int, host_per_rank: int, gpu_per_rank: int = 0,
              gpu_free: list[int] | None = None) -> str | None:
    """Why ``ranks_here`` ranks needing these bytes each would not fit, or None. Ranks share
    the GPUs evenly; ``gpu_free`` is the free bytes of the GPUs to check (default: all)."""
    host = ranks_here * (rank_baseline_bytes() + host_per_rank)
    if host > 0.9 * host_available_bytes():
        return (f"needs about {host / GIB:.1f} GiB of host memory, "
                f"{host_available_bytes() / GIB:.1f} GiB available")
    if gpu_per_rank:
        free = gpu_free if gpu_free is not None else gpu_free_bytes()
        if free:  # + about 1 GiB per rank for the CUDA context and communication buffers
            per_gpu = math.ceil(ranks_here / torch.cuda.device_count()) * (gpu_per_rank + GIB)
            if per_gpu > 0.9 * min(free):
                return (f"needs about {per_gpu / GIB:.1f} GiB per GPU, "
                        f"{min(free) / GIB:.1f} GiB free")
    return None


def agreed_shortfall(ctx, host_per_rank: int, gpu_per_rank: int = 0) -> str | None:
    """``shortfall`` checked inside a run, on every rank, each for its own GPU; all ranks get
    the same answer (one rank short means all skip, or their collectives would not match)."""
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()  # else the last configuration's cached blocks count as used
    why = shortfall(int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size)), host_per_rank,
                    gpu_per_rank if cuda else 0,
                    [torch.cuda.mem_get_info(ctx.device)[0]] if cuda else None)
    flag = torch.tensor([1.0 if why else 0.0], device=ctx.device if ctx.backend == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return (why or "memory is short on another rank") if flag.item() else None
