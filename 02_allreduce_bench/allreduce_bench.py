"""Stage 02: measure all-reduce, the one collective data-parallel training lives on.

What it teaches
  How long ``dist.all_reduce`` takes as the tensor grows and as ranks are added, on each
  backend and device here, beside stage 01's two rings. Each configuration is filled,
  checked, timed and written as a row: time (slowest rank's median, min, max), algorithm
  and bus bandwidth (nccl-tests' conventions). Then ``t = a + N / w`` is fitted per backend,
  device and world size: stage 06 sizes its buckets with this machine's ``a`` and ``w``.

Sizes are binary (1 MB = 2^20 bytes of float32); bandwidths decimal (1 GB/s = 10^9 B/s).
Writes results/allreduce.csv, allreduce_fit.json and allreduce_busbw.png (with matplotlib).

How to run
  python 02_allreduce_bench/allreduce_bench.py                   # every backend/device here
  python 02_allreduce_bench/allreduce_bench.py --backend gloo --device cpu --sizes 1MB,10MB
  torchrun --nproc-per-node=4 02_allreduce_bench/allreduce_bench.py --backend gloo --device cpu
"""

from __future__ import annotations

import argparse
import math
import os
import re
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


def measure(ctx, impl: str, all_reduce, nbytes: int, cfg: dict) -> dict | str:
    """Fill -> check -> time one all-reduce of ``nbytes``: the CSV row, or why it was skipped.
    The check is exact: every impl must produce the exact sums, so all agree bit for bit.
    Every rank checks its own buffer; all raise if any buffer is wrong (a rank that raised
    alone would leave the others waiting in the timed calls)."""
    from common import verify
    from bench import timing
    buf = torch.empty(nbytes // 4, dtype=torch.float32, device=ctx.device)
    fill(buf, ctx.rank)
    first_call = timing.gather_times(timing.measure(lambda: all_reduce(buf), ctx.device,
                                                    warmup=0, iters=1)).max  # every rank's
    error = check(buf, ctx.world_size)
    problem = None
    if error > 0:
        problem = (f"{impl} all-reduce of {format_size(nbytes)} gave a wrong sum: "
                   f"max |sum - expected| = {error:g}")
    verify.agree(problem)
    if first_call * (cfg["warmup"] + 3) > cfg["budget_s"]:
        return f"one call took {first_call:.1f} s: over the {cfg['budget_s']:g} s budget"
    # Zeros from here on: sums of real values would grow n-fold per call and overflow;
    # adding zeros costs what adding anything else costs.
    buf.zero_()
    iters = max(3, min(cfg["iters"], int(1.0 / max(first_call, 1e-6))))  # ~1 s of timing
    stats = timing.gather_times(timing.measure(lambda: all_reduce(buf), ctx.device,
                                               warmup=cfg["warmup"], iters=iters, barrier=True))
    alg = algbw(nbytes, stats.median)
    return {"backend": ctx.backend, "device": ctx.device.type, "world_size": ctx.world_size,
            "bytes": nbytes, "impl": impl, "time_ms_median": stats.median * 1e3,
            "time_ms_min": stats.min * 1e3, "time_ms_max": stats.max * 1e3, "algbw_gbps": alg,
            "busbw_gbps": busbw(alg, ctx.world_size), "iters": iters, "run_id": cfg["run_id"],
            "machine": cfg["machine"]}


def check_sums(ctx, cfg: dict) -> None:
    """--check: each impl's all-reduce gives the exact sums at every size, on every rank;
    nothing is timed or written. What `make check` runs."""
    from common import import_stage, verify
    stage01 = import_stage("01_collectives/collectives")
    impls = {"backend": dist.all_reduce, "ring": stage01.ring_all_reduce,
             "ring_pipelined": stage01.pipelined_ring_all_reduce}
    checked = []
    for nbytes in cfg["sizes"]:
        for impl in cfg["impls"]:
            if impl == "ring" and ctx.device.type == "cuda" and ctx.backend == "gloo":
                continue  # the textbook ring sends GPU tensors, which Gloo cannot
            buf = torch.empty(nbytes // 4, dtype=torch.float32, device=ctx.device)
            fill(buf, ctx.rank)
            impls[impl](buf)
            error = check(buf, ctx.world_size)
            problem = None
            if error > 0:
                problem = (f"{impl} all-reduce of {format_size(nbytes)} gave a wrong sum: "
                           f"max |sum - expected| = {error:g}")
            verify.agree(problem)
            checked.append(f"{impl} {format_size(nbytes)}")
    ctx.print(f"exact sums on every rank ({ctx.backend}/{buf.device}, {ctx.world_size} ranks): "
              + ", ".join(checked), all_ranks=False)


def allreduce_sweep(ctx, cfg: dict) -> None:
    """On every rank: each size, each impl: skip (with the reason), or measure and write."""
    from common import import_stage
    from bench import results
    stage01 = import_stage("01_collectives/collectives")
    impls = {"backend": dist.all_reduce, "ring": stage01.ring_all_reduce,
             "ring_pipelined": stage01.pipelined_ring_all_reduce}
    last: dict[str, tuple[int, float]] = {}  # impl -> (bytes, seconds) at the previous size
    for nbytes in cfg["sizes"]:
        for impl in cfg["impls"]:
            decision = [skip_reason(ctx, impl, nbytes, last.get(impl), cfg)]
            dist.broadcast_object_list(decision, src=0)  # rank 0's: clocks and memory differ
            why = decision[0]
            row = why or measure(ctx, impl, impls[impl], nbytes, cfg)
            label = f"{ctx.backend}/{ctx.device.type} ws={ctx.world_size} {format_size(nbytes)} {impl}"
            if isinstance(row, str):
                ctx.print(f"{label}: skipped: {row}", all_ranks=False)
                continue
            last[impl] = (nbytes, row["time_ms_median"] / 1e3)
            if ctx.is_main:  # written at once: a run stopped later keeps it
                results.upsert_csv("allreduce.csv", [row],
                                   key=["backend", "device", "world_size", "bytes", "impl"])
                print(f"{label}: {row['time_ms_median']:.3f} ms, busbw "
                      f"{row['busbw_gbps']:.3f} GB/s ({row['iters']} iters)", flush=True)


# --------------------------------------------------------------------------- harness


def _repo() -> None:
    """The harness needs common/, the algorithm does not (the same in every runnable script,
    on purpose: each lesson's folder runs from where it lies)."""
    root = Path(__file__).resolve().parent
    while not (root / "common" / "launch.py").exists():
        if root == root.parent:
            raise SystemExit(f"{Path(__file__).name}: the algorithm works on its own; this "
                             "script needs the repository around it (common/)")
        root = root.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


def skip_reason(ctx, impl: str, nbytes: int, previous, cfg: dict) -> str | None:
    """Why not to run this configuration, the same on every rank: the textbook ring cannot take
    GPU tensors over Gloo; the previous size's time, scaled, is over budget; memory is short."""
    from common import import_stage
    if impl == "ring" and ctx.device.type == "cuda" and ctx.backend == "gloo":
        return "the textbook ring sends GPU tensors, which Gloo cannot (ring_pipelined can)"
    if previous is not None:
        estimate = previous[1] * nbytes / previous[0] * (1 + cfg["warmup"] + 3)
        if estimate > cfg["budget_s"]:
            return (f"estimated {estimate:.0f} s from {format_size(previous[0])}: over the "
                    f"{cfg['budget_s']:g} s budget")
        # make bench's deadline for this step (the caller takes rank 0's verdict)
        left = cfg["deadline"] - time.time() if cfg.get("deadline") else math.inf
        if estimate > left:
            return (f"estimated {estimate:.0f} s from {format_size(previous[0])}: {left:.0f} s "
                    "is left before make bench stops this step")
    cuda = ctx.device.type == "cuda"  # the buffer, the backend's and a ring's scratch per rank
    return import_stage("02_allreduce_bench/sweep_extras").memory_shortfall(
        ctx, (2 if cuda else 4) * nbytes, 3 * nbytes)


def fits_of(rows: list[dict]) -> dict:
    """The backend's ``t = a + N / w`` per group of two sizes or more, keyed "gloo/cpu/2"."""
    groups: dict[tuple, list] = {}
    for r in (r for r in rows if r["impl"] == "backend"):
        groups.setdefault((r["backend"], r["device"], int(r["world_size"])), []).append(
            (int(r["bytes"]), float(r["time_ms_median"]) / 1e3))
    fits = {}
    for (backend, device, ws), points in groups.items():
        if len(points) >= 2:
            a, w = fit_latency_bandwidth(*zip(*points))
            fits[f"{backend}/{device}/{ws}"] = dict(
                backend=backend, device=device, world_size=ws, a_s=a, w_bytes_per_s=w,
                run_id=rows[0]["run_id"], points=[{"bytes": n, "time_s": t, "rel_error":
                                                   (a + n / w) / t - 1} for n, t in points])
    return fits


def report(rows: list[dict], machine: str) -> None:
    """Print the table and the fits; write the fit JSON and the plot (parent / rank 0)."""
    from common import import_stage
    from bench import results
    fits = fits_of(rows)
    error = {(key, p["bytes"]): f"{p['rel_error']:+.0%}" for key, f in fits.items()
             for p in f["points"]}  # each backend point against its group's fit
    rows = sorted(rows, key=lambda r: (r["backend"], r["device"], int(r["world_size"]),
                                       int(r["bytes"]), r["impl"]))
    results.print_table([{
        "backend/device": f"{r['backend']}/{r['device']}", "ws": r["world_size"],
        "size": format_size(int(r["bytes"])), "impl": r["impl"],
        "ms (median)": float(r["time_ms_median"]), "min": float(r["time_ms_min"]),
        "max": float(r["time_ms_max"]), "algbw GB/s": float(r["algbw_gbps"]),
        "busbw GB/s": float(r["busbw_gbps"]), "fit error": "" if r["impl"] != "backend" else
        error.get((f"{r['backend']}/{r['device']}/{r['world_size']}", int(r["bytes"])), "")}
        for r in rows], title=f"\nall_reduce, float32, slowest rank's median ({machine})")
    if not fits:
        return print("fit: needs two sizes or more of one backend/device/world size")
    results.print_table([{"backend/device/ws": key, "a (latency) us": f["a_s"] * 1e6,
                          "w (bandwidth) GB/s": f["w_bytes_per_s"] / 1e9}
                         for key, f in fits.items()],
                        title="\nfit of the backend's times: t = a + N / w (least squares on "
                              "relative error; a < 0: add smaller sizes)")
    print(f"fit written to {results.update_json('allreduce_fit.json', fits)}")
    lines = {}  # busbw against size, a line style per impl
    for r in rows:
        xs, ys, _ = lines.setdefault(
            f"{r['backend']}/{r['device']} ws={r['world_size']} {r['impl']}",
            ([], [], {"backend": "-", "ring": ":", "ring_pipelined": "--"}[r["impl"]]))
        xs.append(int(r["bytes"]))
        ys.append(float(r["busbw_gbps"]))
    sizes = {n: format_size(n) for n in sorted({int(r["bytes"]) for r in rows})}
    import_stage("02_allreduce_bench/sweep_extras").plot_lines(
        results.results_dir() / "allreduce_busbw.png", lines, "buffer size (float32)",
        "bus bandwidth (GB/s = 10^9 B/s)", f"all_reduce busbw\n{machine}", sizes)


def plan_configurations(args) -> list[tuple[str, str, int]]:
    """(backend, device, world_size) asked for and possible here: NCCL moves GPU memory only,
    one GPU per rank; by default GPU tensors go over Gloo only where ranks share GPUs."""
    from bench import supervisor as launch  # TODO(lab): memory checks move to the lab
    gpus = torch.cuda.device_count()
    nccl_gpus = gpus if dist.is_nccl_available() else 0
    plan = []
    for backend in args.backend or (["nccl", "gloo"] if nccl_gpus else ["gloo"]):
        for device in args.device or (["cuda", "cpu"] if gpus else ["cpu"]):
            for ws in args.world_sizes:
                runs = device == "cpu" or gpus > 0
                if backend == "nccl":
                    runs = device == "cuda" and ws <= nccl_gpus
                elif device == "cuda" and not args.backend:
                    runs = runs and ws > nccl_gpus  # default: over Gloo only where shared
                if runs:
                    plan.append((backend, device, ws))
    if not plan or (args.backend and {b for b, _, _ in plan} != set(args.backend)):
        launch.usage_error(f"cannot run --backend {','.join(args.backend or ['(default)'])} at "
                           f"world sizes {args.world_sizes} here ({gpus} GPU(s)): nccl needs "
                           "--device cuda and one GPU per rank; cuda needs a GPU")
    if not launch.under_torchrun():
        launch.check_ranks_fit(max(ws for _, _, ws in plan))
    return plan


def size_list(text: str) -> list[int]:
    """--sizes: '1MB,10MB' -> sorted byte counts, at least one."""
    if not text.strip(" ,"):
        raise argparse.ArgumentTypeError("empty list: give sizes like 1MB,10MB")
    try:
        return sorted({parse_size(s) for s in text.split(",") if s.strip()})
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv=None) -> None:
    _repo()
    from bench import supervisor as launch  # TODO(lab): memory checks move to the lab
    from bench import results

    p = launch.Parser(description=__doc__.splitlines()[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", type=size_list, default="1MB,10MB,100MB,1GB",
                   help="float32 buffer sizes, binary units (B, KB, MB, GB)")
    p.add_argument("--world-sizes", type=launch.int_list, default=[2, 4, 6],
                   help="rank counts to sweep, each >= 2 (under torchrun: WORLD_SIZE)")
    p.add_argument("--world-size", type=launch.positive_int, help="same as --world-sizes N")
    for flag, allowed in (("--backend", ["gloo", "nccl"]), ("--device", ["cpu", "cuda"])):
        p.add_argument(flag, type=launch.choice_list(allowed), default=None,
                       help=f"comma-separated subset of {', '.join(allowed)}; default: every "
                            "one this box supports")
    p.add_argument("--warmup", type=launch.non_negative_int, default=5, help="untimed calls")
    p.add_argument("--iters", type=launch.positive_int, default=20,
                   help="at most this many timed calls (about 1 s of timing, at least 3)")
    p.add_argument("--budget-s", type=launch.positive_float, default=300.0,
                   help="skip a configuration whose estimated time is over this many seconds")
    p.add_argument("--no-ring", action="store_true", help="time only the backend's all_reduce")
    p.add_argument("--check", action="store_true",
                   help="only check each impl's exact sums at --sizes; time and write nothing")
    args = p.parse_args(argv)
    torchrun = launch.under_torchrun()
    args.world_sizes = [int(os.environ["WORLD_SIZE"])] if torchrun else \
        [args.world_size] if args.world_size else args.world_sizes
    if min(args.world_sizes) < 2:
        launch.usage_error(f"world size {min(args.world_sizes)}: an all-reduce needs 2 ranks or more")
    configs = plan_configurations(args)
    if torchrun and len(configs) != 1:
        launch.usage_error("under torchrun give one --backend and one --device")
    if not args.check:
        results.check_writable()
    is_main = not torchrun or os.environ["RANK"] == "0"
    cfg = dict(sizes=args.sizes, warmup=args.warmup, iters=args.iters, budget_s=args.budget_s,
               impls=["backend"] + ([] if args.no_ring else ["ring", "ring_pipelined"]),
               run_id=results.run_id(), machine=results.machine_name(),
               deadline=float(os.environ.get("BENCH_STEP_DEADLINE", "0") or 0))
    if is_main:
        what = "exact-sum check" if args.check else "sweep"
        print(f"all_reduce {what} on {cfg['machine']}: {len(configs)} backend/device/world "
              f"size group(s) x {len(args.sizes)} size(s) x {len(cfg['impls'])} impl(s)")
    if args.check:
        for backend, device, ws in configs:
            launch.launch(check_sums, launch.LaunchConfig(ws, backend, device), cfg,
                          timeout_s=120 + 30 * len(args.sizes))
        return
    stopped = None
    try:
        for backend, device, ws in configs:
            launch.launch(allreduce_sweep, launch.LaunchConfig(ws, backend, device), cfg,
                          timeout_s=args.budget_s * len(args.sizes) * len(cfg["impls"]) + 120)
    except launch.Stopped as e:  # Ctrl-C or SIGTERM: report what finished, then stop
        stopped = e
    if is_main:
        rows = [r for r in results.read_csv("allreduce.csv") if r.get("run_id") == cfg["run_id"]]
        if not rows:
            print("nothing was measured: every configuration was skipped (reasons above)",
                  file=sys.stderr)
            raise SystemExit(stopped.code if stopped else 1)
        report(rows, cfg["machine"])
    if stopped:
        raise stopped


if __name__ == "__main__":
    main()
