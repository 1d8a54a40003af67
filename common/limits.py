"""What fits: memory checks before workers start (a run that cannot fit is refused with one
line, exit 2, instead of an out-of-memory kill half way)."""

import os

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
