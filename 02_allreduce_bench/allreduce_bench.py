"""Stage 02: measure all-reduce, the one collective data-parallel training lives on.

What it teaches
  How long ``dist.all_reduce`` takes as the tensor grows and as ranks are added, beside stage
  01's two rings, and how to time a collective: each configuration is filled, checked for
  exact sums, then timed (the slowest rank's median), with algorithm and bus bandwidth
  (nccl-tests' conventions). Then ``t = a + N / w`` is fitted per world size: stage 06 sizes
  its buckets with a machine's ``a`` and ``w``. Sizes are binary (1 MB = 2^20 bytes of
  float32); bandwidths decimal (1 GB/s = 10^9 B/s).

How to run
  python 02_allreduce_bench/allreduce_bench.py --sizes 64KB,1MB,10MB --world-sizes 2,4
  python 02_allreduce_bench/allreduce_bench.py --check --sizes 12348B,1MB   # exact sums only
  torchrun --nproc-per-node=4 02_allreduce_bench/allreduce_bench.py
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# --------------------------------------------------------------------------- units and bandwidth

KB, MB, GB = 2**10, 2**20, 2**30
_UNITS = {"": 1, "b": 1, "kb": KB, "kib": KB, "mb": MB, "mib": MB, "gb": GB, "gib": GB}


def parse_size(text: str) -> int:
    """'64KB' -> 65536, '1.5GB', '4096' (bytes): a positive whole number of float32s."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse size {text!r}: use a number and B, KB, MB or GB "
                         "(binary units), e.g. 64KB,1MB,1GB")
    nbytes = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if nbytes <= 0 or nbytes != int(nbytes) or int(nbytes) % 4:
        raise ValueError(f"size {text!r} = {nbytes:g} bytes is not a positive multiple of "
                         "4 bytes (one float32)")
    return int(nbytes)


def format_size(nbytes: int) -> str:
    """65536 -> '64KB', 3 * 2**29 -> '1.5GB' (binary units)."""
    for unit, scale in (("GB", GB), ("MB", MB), ("KB", KB)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g}{unit}"
    return f"{nbytes}B"


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s: the buffer size over the time the call took."""
    return nbytes / seconds / 1e9


def busbw(algbw_gbps: float, world_size: int) -> float:
    """Bus bandwidth (nccl-tests): algbw x 2(n-1)/n for all-reduce.

    A ring all-reduce makes every rank send 2(n-1)/n x N bytes (stage 01), so this is the
    rate each rank's link actually carried: comparable across world sizes and with the
    hardware's link speed. With n = 2 the factor is 1.
    """
    return algbw_gbps * 2 * (world_size - 1) / world_size


# --------------------------------------------------------------------------- the alpha-beta model


def fit_latency_bandwidth(nbytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Fit ``t = a + N / w`` by least squares on relative error; return ``(a, w)``.

    With ``b = 1 / w`` the model is linear, ``t = a + b N``. The sizes span decades, so plain
    least squares would let the largest size decide everything; dividing each residual by the
    measured time gives every point the same say: minimise sum(((a + b N_i) - t_i) / t_i)^2,
    weights 1 / t_i^2, a 2 x 2 system solved in closed form. A negative ``a`` can come out of
    noisy points and is returned as is (the caller says so).
    """
    if len(nbytes) != len(seconds) or len(set(nbytes)) < 2:
        raise ValueError("the fit needs at least two different sizes")
    sw = swn = swnn = swt = swnt = 0.0
    for n, t in zip(nbytes, seconds):
        w = 1.0 / (t * t)
        sw, swn, swnn = sw + w, swn + w * n, swnn + w * n * n
        swt, swnt = swt + w * t, swnt + w * n * t
    det = sw * swnn - swn * swn
    b = (sw * swnt - swn * swt) / det
    a = (swt - b * swn) / sw
    return a, (1.0 / b if b > 0 else math.inf)


# --------------------------------------------------------------------------- the measurement

def _tile(buf: torch.Tensor) -> torch.Tensor:
    """0, 1, ..., 6 repeated: small integers, whose sums float32 keeps exact in any order.
    Buffers are filled and checked tile by tile: a 1 GB buffer needs no 1 GB index."""
    return (torch.arange(7 << 17, device=buf.device) % 7).to(buf.dtype)


def fill(buf: torch.Tensor, rank: int) -> None:
    """buf[i] = i % 7 + rank."""
    tile = _tile(buf)
    for seg in buf.split(tile.numel()):
        seg.copy_(tile[: seg.numel()]).add_(rank)


def check(buf: torch.Tensor, world_size: int) -> float:
    """Max |buf - expected| after the all-reduce: sum over ranks of (i % 7 + r)."""
    tile = _tile(buf)
    expected = tile * world_size + world_size * (world_size - 1) / 2
    return max((seg - expected[: seg.numel()]).abs().max().item()
               for seg in buf.split(tile.numel()))


def check_everywhere(ctx, impl: str, buf: torch.Tensor) -> None:
    """Raise on every rank if any rank's sums are wrong (a rank raising alone would leave the
    others waiting in the next collective): the largest error, all-reduced with MAX."""
    error = torch.tensor([check(buf, ctx.world_size)], device=buf.device)
    dist.all_reduce(error, op=dist.ReduceOp.MAX)
    if error.item() > 0:
        raise AssertionError(f"{impl} all-reduce of {format_size(buf.numel() * 4)} gave a wrong "
                             f"sum: max |sum - expected| = {error.item():g} (worst rank)")


def time_calls(fn, device: torch.device, warmup: int, iters: int) -> list[list[float]]:
    """Seconds per call of ``fn``, every rank's list, on every rank. The rules: warm-up calls
    first (they pay for lazy set-up: connections, buffers); a barrier before each timed call,
    so no clock runs while its rank waits for a slower one; ``cuda.synchronize`` before each
    clock read (a CUDA call returns before the GPU is done). Report the median (robust to the
    odd slow call) of the slowest rank (a collective is done when its last rank is)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    mine = torch.tensor(times, dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [t.tolist() for t in everyone]


def measure(ctx, impl: str, all_reduce, nbytes: int, warmup: int, iters: int) -> dict:
    """Fill -> check -> time one all-reduce of ``nbytes``: a row."""
    buf = torch.empty(nbytes // 4, dtype=torch.float32, device=ctx.device)
    fill(buf, ctx.rank)
    all_reduce(buf)
    check_everywhere(ctx, impl, buf)
    buf.zero_()  # from here on: real values would grow n-fold per call and overflow
    everyone = time_calls(lambda: all_reduce(buf), ctx.device, warmup, iters)
    median = max(statistics.median(t) for t in everyone)
    alg = algbw(nbytes, median)
    return {"backend": ctx.backend, "device": ctx.device.type, "world_size": ctx.world_size,
            "bytes": nbytes, "impl": impl, "time_ms_median": median * 1e3,
            "time_ms_min": min(map(min, everyone)) * 1e3,
            "time_ms_max": max(map(max, everyone)) * 1e3, "algbw_gbps": alg,
            "busbw_gbps": busbw(alg, ctx.world_size), "iters": iters}


# --------------------------------------------------------------------------- harness


def all_reduces(ctx, no_ring: bool = False) -> dict:
    """The backend's all-reduce and stage 01's rings (the textbook one sends with
    batch_isend_irecv, which Gloo cannot carry for GPU tensors)."""
    from common import import_stage, launch
    stage01 = import_stage("01_collectives/collectives")
    impls = {"backend": dist.all_reduce}
    if not no_ring and launch.carries_point_to_point(ctx.backend, ctx.device.type):
        impls["ring"] = stage01.ring_all_reduce
    if not no_ring:
        impls["ring_pipelined"] = stage01.pipelined_ring_all_reduce
    return impls


def check_worker(ctx, args) -> None:
    """--check: each all-reduce gives the exact sums at every size, on every rank."""
    checked = []
    for nbytes in args.sizes:
        for impl, all_reduce in all_reduces(ctx, args.no_ring).items():
            buf = torch.empty(nbytes // 4, dtype=torch.float32, device=ctx.device)
            fill(buf, ctx.rank)
            all_reduce(buf)
            check_everywhere(ctx, impl, buf)
            checked.append(f"{impl} {format_size(nbytes)}")
    ctx.print(f"exact sums on every rank ({ctx.backend}/{ctx.device.type}, {ctx.world_size} "
              f"ranks): {', '.join(checked)}", all_ranks=False)


def sweep(ctx, args, skip=None, on_row=None) -> list[dict]:
    """Every size and impl, measured; rank 0 prints a line each. ``skip(impl, nbytes,
    previous)`` may return why not to run one (the same on every rank); ``on_row(row)``."""
    rows = []
    last = {}  # impl -> the row at the previous size
    for nbytes in args.sizes:
        for impl, all_reduce in all_reduces(ctx, args.no_ring).items():
            label = f"{ctx.backend}/{ctx.device.type} ws={ctx.world_size} {format_size(nbytes)} {impl}"
            why = skip(impl, nbytes, last.get(impl)) if skip else None
            if why:
                ctx.print(f"{label}: skipped: {why}", all_ranks=False)
                continue
            row = measure(ctx, impl, all_reduce, nbytes, args.warmup, args.iters)
            rows.append(row)
            last[impl] = row
            ctx.print(f"{label}: {row['time_ms_median']:.3f} ms, busbw {row['busbw_gbps']:.3f} GB/s",
                      all_ranks=False)
            if on_row:
                on_row(row)
    return rows


def sweep_worker(ctx, args) -> None:
    """The sweep, then rank 0's table and the backend's fit."""
    rows = sweep(ctx, args)
    if not ctx.is_main:
        return
    print(f"\nall_reduce, float32, {ctx.world_size} ranks, {ctx.backend}/{ctx.device.type}: "
          f"the slowest rank's median of {args.iters} calls\n"
          f"{'size':>8} {'impl':<15} {'ms':>9} {'min':>9} {'max':>9} {'busbw GB/s':>11}")
    for r in rows:
        print(f"{format_size(r['bytes']):>8} {r['impl']:<15} {r['time_ms_median']:9.3f} "
              f"{r['time_ms_min']:9.3f} {r['time_ms_max']:9.3f} {r['busbw_gbps']:11.3f}")
    points = [(r["bytes"], r["time_ms_median"] / 1e3) for r in rows if r["impl"] == "backend"]
    if len(points) >= 2:
        a, w = fit_latency_bandwidth(*zip(*points))
        print(f"fit of the backend's times, t = a + N / w: a = {a * 1e6:.0f} us, "
              f"w = {w / 1e9:.3g} GB/s" + (" (a < 0: add smaller sizes)" if a < 0 else ""))
    print(flush=True)


def size_list(text: str) -> list[int]:
    """--sizes: '1MB,10MB' -> sorted byte counts, at least one."""
    if not text.strip(" ,"):
        raise argparse.ArgumentTypeError("empty list: give sizes like 1MB,10MB")
    try:
        return sorted({parse_size(s) for s in text.split(",") if s.strip()})
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def make_parser():
    from common import launch
    p = launch.make_parser(__doc__)
    p.set_defaults(world_size=None)
    p.add_argument("--world-sizes", type=launch.int_list, default=[2, 4],
                   help="rank counts to sweep, one launch each (--world-size N: just N)")
    p.add_argument("--sizes", type=size_list, default=size_list("64KB,1MB,10MB,100MB"),
                   help="float32 buffer sizes, binary units (B, KB, MB, GB)")
    p.add_argument("--warmup", type=launch.non_negative_int, default=5, help="untimed calls")
    p.add_argument("--iters", type=launch.positive_int, default=10, help="timed calls")
    p.add_argument("--no-ring", action="store_true", help="time only the backend's all_reduce")
    p.add_argument("--check", action="store_true", help="exact sums only, nothing timed")
    return p


def configurations(args) -> list:
    """A launch per world size (under torchrun: torchrun's). Backend and device: the flags, or
    common/launch.py's defaults (NCCL where this node has a GPU for each of its ranks)."""
    from common import launch
    configs = []
    for ws in [args.world_size] if args.world_size or launch.under_torchrun() else args.world_sizes:
        args.world_size = ws
        configs.append(launch.resolve(args))
    return configs


def main(argv=None) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
    try:
        from common import launch
    except ImportError:  # copied alone: the algorithm above needs torch only
        raise SystemExit(f"{__file__}: this demo needs the repository (common/)")
    args = make_parser().parse_args(argv)
    for config in configurations(args):
        launch.launch(check_worker if args.check else sweep_worker, config, args)


if __name__ == "__main__":
    main()
