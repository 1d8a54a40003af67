"""Stage 02: measure all-reduce, the one collective data-parallel training lives on.

What it teaches
  How long ``dist.all_reduce`` takes as the tensor grows and as ranks are added, on each
  backend and device this machine has, beside the ring all-reduce of stage 01 on the same
  buffers. Each configuration is reported as time (the slowest rank's median, with min and
  max), algorithm bandwidth and bus bandwidth (the conventions of NVIDIA's nccl-tests), and
  the latency-bandwidth model ``t = a + N / w`` is fitted per backend, device and world size,
  so later stages (06) can reason about bucket sizes with this machine's own ``a`` and ``w``.

Units
  Sizes are binary: 1 KB = 2^10, 1 MB = 2^20, 1 GB = 2^30 bytes (buffers are float32).
  Bandwidths are decimal, as in nccl-tests: 1 GB/s = 10^9 bytes per second.

How to run
  python 02_allreduce_bench/allreduce_bench.py                   # every backend/device here
  python 02_allreduce_bench/allreduce_bench.py --backend gloo --device cpu \\
      --sizes 64KB,1MB,10MB --world-sizes 2,4                    # what `make 02` runs
  torchrun --standalone --nproc-per-node=4 02_allreduce_bench/allreduce_bench.py --backend gloo --device cpu
  (under torchrun the one world size torchrun gives and one backend/device are measured)

Writes results/allreduce.csv (one row per backend, device, world size, size, impl),
results/allreduce_fit.json (the fitted model) and results/allreduce_busbw.png (matplotlib).

The arithmetic (sizes, bandwidths, the fit) comes first and needs only the standard library;
the benchmark harness below it uses torch and the repo's ``common`` package.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# --------------------------------------------------------------------------- sizes and units

KB, MB, GB = 2**10, 2**20, 2**30  # binary: a "1 MB" buffer is 2^20 bytes
_UNITS = {"": 1, "b": 1, "k": KB, "kb": KB, "kib": KB, "m": MB, "mb": MB, "mib": MB,
          "g": GB, "gb": GB, "gib": GB}
FLOAT32_BYTES = 4


def parse_size(text: str) -> int:
    """'64KB' -> 65536, '1MB' -> 1048576, '1.5GB', '4096' (bytes). ValueError if unparsable.

    The result must be a positive whole number of float32 elements (a multiple of 4 bytes).
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse size {text!r}: use a number and B, KB, MB or GB "
                         "(binary units), e.g. 64KB,1MB,1GB")
    nbytes = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if nbytes <= 0 or nbytes != int(nbytes) or int(nbytes) % FLOAT32_BYTES:
        raise ValueError(f"size {text!r} = {nbytes:g} bytes is not a positive multiple of "
                         f"{FLOAT32_BYTES} bytes (one float32)")
    return int(nbytes)


def format_size(nbytes: int) -> str:
    """65536 -> '64KB', 1048576 -> '1MB', 3 * 2**29 -> '1.5GB' (binary units)."""
    for unit, scale in (("TB", 1024 * GB), ("GB", GB), ("MB", MB), ("KB", KB)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g}{unit}"
    return f"{nbytes}B"


# --------------------------------------------------------------------------- bandwidths


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (10^9 B/s): the buffer size over the time the call took."""
    return nbytes / seconds / 1e9


def busbw(algbw_gbps: float, world_size: int) -> float:
    """Bus bandwidth (nccl-tests): algbw x 2(n-1)/n for all-reduce.

    A ring all-reduce makes every rank send (and receive) 2(n-1)/n x N bytes: N/n per step,
    n-1 steps of reduce-scatter and n-1 of all-gather. Scaling algbw by that factor gives the
    rate each rank's link actually carried, a number comparable across world sizes and with
    the hardware's link bandwidth. With n = 2 the factor is 1: busbw = algbw.
    """
    return algbw_gbps * 2 * (world_size - 1) / world_size


# --------------------------------------------------------------------------- the alpha-beta model


def fit_latency_bandwidth(nbytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Fit ``t = a + N / w`` by least squares on relative error; return ``(a, w)``.

    Writing ``b = 1 / w`` makes the model linear, ``t = a + b N``. The sizes span decades
    (1 MB to 1 GB), so plain least squares would let the largest size decide everything and
    leave ``a`` as noise; dividing each residual by the measured time gives every point the
    same say: minimise sum(((a + b N_i) - t_i) / t_i)^2, a weighted linear least squares with
    weights 1 / t_i^2. The 2 x 2 normal equations are solved in closed form.
    A negative ``a`` can come out of noisy points; it is returned as is (the caller says so).
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


def predict_seconds(a: float, w: float, nbytes: float) -> float:
    return a + nbytes / w


# --------------------------------------------------------------------------- the harness

# Everything below is the benchmark: it imports torch.distributed work and the repo's
# `common` package (inside the functions, so the arithmetic above stays importable alone).

CSV_NAME, FIT_NAME, PLOT_NAME = "allreduce.csv", "allreduce_fit.json", "allreduce_busbw.png"
CSV_KEY = ["backend", "device", "world_size", "bytes", "impl"]
TARGET_TIMED_S = 1.0  # aim for about this much timed work per configuration
PATTERN_PERIOD = 7    # check values are (index % 7) + rank: small integers, sums exact in fp32
STAGE01 = Path(__file__).resolve().parents[1] / "01_collectives" / "collectives.py"


def _common():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from common import launch, results, timing
    return launch, results, timing


def load_ring_all_reduce(path: Path | str = STAGE01):
    """``ring_all_reduce`` from stage 01's file (by path: stage folders are not packages)."""
    if not Path(path).exists():
        return None
    spec = importlib.util.spec_from_file_location("stage01_collectives", path)
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as a normal import would be: code that looks its own module
    # up by name while being defined (dataclasses, typing, pickle) finds it.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return getattr(module, "ring_all_reduce", None)


def memory_shortfall(nbytes: int, ranks_here: int, device: str, ring: bool,
                     backend: str = "gloo", gpu_free: list[int] | None = None) -> str | None:
    """Why buffers of ``nbytes`` on ``ranks_here`` ranks would not fit in free memory, or None.

    Per rank: the benchmark buffer and its check copy (2 N), the ring's receive chunk
    (N / ranks), and about one more N for the backend's own scratch (Gloo reduces through
    temporary buffers; Gloo on CUDA tensors stages them in host memory), plus a fixed
    allowance for each process (the torch runtime, CUDA/NCCL context). On gloo/cuda the ring
    also stages through the host (stage 01): a host copy of N and its N / ranks chunk there.
    ``gpu_free``: free bytes of the GPUs to check (a rank passes its own GPU's); by default
    every GPU's, asked in a separate process (see ``_gpu_free_bytes``).
    """
    ring_chunk = nbytes // ranks_here if ring else 0
    per_rank = 3 * nbytes + ring_chunk
    if device == "cpu":
        host_need = ranks_here * (per_rank + 512 * MB)
    else:  # CUDA tensors: Gloo stages through (pinned) host memory, and so does the ring
        host_ring = nbytes + ring_chunk if ring and backend == "gloo" else 0
        host_need = ranks_here * (2 * nbytes + host_ring + 512 * MB)
    launch, _, _ = _common()
    host_free = launch.host_available_bytes()
    if host_need > 0.9 * host_free:
        return (f"needs about {format_size(host_need)} of host memory, "
                f"{format_size(host_free)} available")
    if device == "cuda":
        n_gpus = torch.cuda.device_count()  # counts GPUs without a CUDA context on any
        per_gpu = math.ceil(ranks_here / n_gpus) * (per_rank + GB)  # + context, NCCL buffers
        free_list = gpu_free if gpu_free is not None else _gpu_free_bytes()
        if free_list:  # None: could not ask; each rank checks its own GPU again
            free = min(free_list)
            if per_gpu > 0.9 * free:
                return f"needs about {format_size(per_gpu)} per GPU, {format_size(free)} free"
    return None


_GPU_FREE: list[int] | None = None


def _gpu_free_bytes() -> list[int] | None:
    """Free bytes on every GPU, asked once, in a short-lived child process.

    ``torch.cuda.mem_get_info(i)`` creates a CUDA context on GPU i (a few hundred MB of its
    memory) that lives as long as the process. Asked here, the parent would hold a context on
    every GPU for the whole sweep, taking memory from the ranks it measures; the child's
    contexts go away when it exits. None if the child fails (the ranks still check their own).
    """
    global _GPU_FREE
    if _GPU_FREE is None:
        import subprocess
        code = ("import torch; print(','.join(str(torch.cuda.mem_get_info(i)[0]) "
                "for i in range(torch.cuda.device_count())))")
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 timeout=120, check=True).stdout.strip()
            _GPU_FREE = [int(x) for x in out.split(",") if x]
        except (subprocess.SubprocessError, OSError, ValueError):
            return None
    return _GPU_FREE


def _pattern_tile(buf: torch.Tensor) -> torch.Tensor:
    # The buffer is filled and checked chunk by chunk from this small tile (0..6 repeated),
    # so a 1 GB buffer needs no 1 GB index tensor.
    return (torch.arange(PATTERN_PERIOD * 2**17, device=buf.device) % PATTERN_PERIOD).to(buf.dtype)


def _fill_check_pattern(buf: torch.Tensor, rank: int) -> None:
    tile = _pattern_tile(buf)
    for start in range(0, buf.numel(), tile.numel()):
        seg = buf[start:start + tile.numel()]
        seg.copy_(tile[:seg.numel()]).add_(rank)


def _check_sum(buf: torch.Tensor, world_size: int) -> float:
    """Max |buf - expected| for the all-reduced check pattern: n (i % 7) + n(n-1)/2."""
    expected = _pattern_tile(buf) * world_size + world_size * (world_size - 1) / 2
    worst = 0.0
    for start in range(0, buf.numel(), expected.numel()):
        seg = buf[start:start + expected.numel()]
        worst = max(worst, (seg - expected[:seg.numel()]).abs().max().item())
    return worst


def _sig(x: float) -> float:
    return float(f"{x:.7g}")  # 7 significant digits in the CSV, whatever the magnitude


def _agree_max(value: float, device: torch.device) -> float:
    """The largest ``value`` over all ranks, so every rank takes the same decision."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def allreduce_sweep(ctx, plan: dict) -> None:
    """On every rank: for each size, check the sums, then time each impl; rank 0 writes rows."""
    _, results, timing = _common()
    dev, ws, say = ctx.device, ctx.world_size, ctx.is_main
    tag = f"{ctx.backend}/{dev.type} ws={ws}"
    impls = list(plan["impls"])
    ring = load_ring_all_reduce(plan.get("ring_file", STAGE01)) if "ring" in impls else None
    last: dict[str, tuple[int, float]] = {}  # impl -> (bytes, median seconds) of the last size
    checks, checks_failed = 0, []

    def progress(k, impl, nbytes, text, end="\n"):
        if say:
            print(f"[{k}/{plan['total']}] {tag} {format_size(nbytes)} {impl}{text}",
                  end=end, flush=True)

    for nbytes, k0, skip_reason in plan["sizes"]:
        ks = {impl: k0 + i for i, impl in enumerate(impls)}
        todo = []
        for impl in impls:
            if skip_reason:  # the parent's memory guard
                progress(ks[impl], impl, nbytes, f" skipped: {skip_reason}")
            elif impl == "ring" and ring is None:
                progress(ks[impl], impl, nbytes, " skipped: no ring_all_reduce in "
                         "01_collectives/collectives.py")
            elif impl in last:
                # Time budget: the last size's median, scaled linearly with the size, times
                # the calls this configuration needs at least (check, warm-up, 3 timed).
                prev_bytes, prev_s = last[impl]
                estimate = prev_s * nbytes / prev_bytes * (1 + plan["warmup"] + 3)
                if estimate > plan["budget_s"]:
                    progress(ks[impl], impl, nbytes, f" skipped: estimated {estimate:.0f} s "
                             f"(from {format_size(prev_bytes)}) is over the "
                             f"{plan['budget_s']:g} s budget")
                else:
                    todo.append(impl)
            else:
                todo.append(impl)
        if todo:
            # Memory again, here where the ranks are (under torchrun the parent is not ours,
            # and another node may be shorter): all ranks must agree, or their collectives
            # would not match.
            ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", ws))
            # Only this rank's own GPU is asked: asking every GPU would start a CUDA context
            # on each of them from every rank.
            gpu_free = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()  # else the last size's cached blocks count as used
                gpu_free = [torch.cuda.mem_get_info(dev)[0]]
            short = memory_shortfall(nbytes, ranks_here, dev.type, "ring" in todo,
                                     ctx.backend, gpu_free)
            if _agree_max(1.0 if short else 0.0, dev) > 0:
                for impl in todo:
                    progress(ks[impl], impl, nbytes,
                             f" skipped: {short or 'memory is short on another node'}")
                todo = []
        if not todo:
            continue

        # Check first: every impl must give the exact sum (small integers add exactly in
        # float32, in any order), so the ring and the backend agree bit for bit.
        numel = nbytes // FLOAT32_BYTES
        buf = torch.empty(numel, dtype=torch.float32, device=dev)
        probe, reference = {}, None
        for impl in todo:
            fn = (lambda: dist.all_reduce(buf)) if impl == "backend" else (lambda: ring(buf))
            _fill_check_pattern(buf, ctx.rank)
            one_call = timing.measure(fn, dev, warmup=0, iters=1)[0]
            probe[impl] = _agree_max(one_call, dev)  # also a first time estimate
            err = _check_sum(buf, ws)
            if impl == "ring" and "backend" in todo:
                err = max(err, 0.0 if torch.equal(buf, reference) else math.inf)
            checks += 1
            if err > 0:
                checks_failed.append(f"{tag} {format_size(nbytes)} {impl}: max |sum - "
                                     f"expected| = {err:g}")
            if impl == "backend" and "ring" in todo:
                reference = buf.clone()
        reference = None  # free the copy before timing

        # The timed buffer holds zeros: in-place sums of real values would grow by a factor
        # n per call and overflow; adding zeros costs the same as adding anything else.
        buf.zero_()
        for impl in todo:
            fn = (lambda: dist.all_reduce(buf)) if impl == "backend" else (lambda: ring(buf))
            if probe[impl] * (plan["warmup"] + 3) > plan["budget_s"]:
                progress(ks[impl], impl, nbytes, f" skipped: one call took {probe[impl]:.1f} s,"
                         f" over the {plan['budget_s']:g} s budget with warm-up")
                continue
            iters = max(3, min(plan["max_iters"], int(TARGET_TIMED_S / max(probe[impl], 1e-6))))
            progress(ks[impl], impl, nbytes, f" ({iters} iters) ...", end="")
            times = timing.measure(fn, dev, warmup=plan["warmup"], iters=iters, barrier=True)
            stats = timing.gather_times(times)
            last[impl] = (nbytes, stats.median)
            alg = algbw(nbytes, stats.median)
            row = {"backend": ctx.backend, "device": dev.type, "world_size": ws,
                   "bytes": nbytes, "impl": impl,
                   "time_ms_median": _sig(stats.median * 1e3),
                   "time_ms_min": _sig(stats.min * 1e3), "time_ms_max": _sig(stats.max * 1e3),
                   "algbw_gbps": _sig(alg), "busbw_gbps": _sig(busbw(alg, ws)),
                   "iters": iters, "run_id": plan["run_id"], "machine": plan["machine"]}
            if say:
                print(f" {stats.median * 1e3:.3f} ms, busbw {row['busbw_gbps']:.3f} GB/s",
                      flush=True)
                results.upsert_csv(CSV_NAME, [row], key=CSV_KEY)  # at once: Ctrl-C keeps it
        del buf

    if checks_failed:
        raise AssertionError("all-reduce gave a wrong sum: " + "; ".join(checks_failed))
    if say:
        print(f"{tag}: all {checks} sum checks passed (exact sums; ring and backend bitwise "
              "equal)", flush=True)


# --------------------------------------------------------------------------- after the sweep


def fit_rows(rows: list[dict]) -> dict:
    """Fit ``t = a + N / w`` per backend/device/world size on the backend's own all-reduce
    (the ring's fit rides along under "ring"). Keys like "gloo/cpu/2"; see the README."""
    groups: dict[tuple, dict[str, list]] = {}
    for r in rows:
        key = (r["backend"], r["device"], int(r["world_size"]))
        groups.setdefault(key, {}).setdefault(r["impl"], []).append(
            (int(r["bytes"]), float(r["time_ms_median"]) / 1e3))
    fits = {}
    for (backend, device, ws), by_impl in sorted(groups.items()):
        entry = {"backend": backend, "device": device, "world_size": ws, "impl": "backend"}
        for impl in ("backend", "ring"):
            points = sorted(by_impl.get(impl, []))
            if len({n for n, _ in points}) < 2:
                continue
            a, w = fit_latency_bandwidth([n for n, _ in points], [t for _, t in points])
            fit = {"a_s": a, "w_bytes_per_s": w, "sizes_bytes": [n for n, _ in points],
                   "points": [{"bytes": n, "time_s": t, "predicted_s": predict_seconds(a, w, n),
                               "rel_error": predict_seconds(a, w, n) / t - 1}
                              for n, t in points]}
            if impl == "backend":
                entry.update(fit)
            else:
                entry["ring"] = fit
        if "a_s" in entry:
            fits[f"{backend}/{device}/{ws}"] = entry
    return fits


def report(rows: list[dict], machine: str, plot: bool = True) -> None:
    """Print the table and the fit; write the fit JSON and the plot (rank 0 / parent only)."""
    _, results, _ = _common()
    if not rows:
        print("no configuration finished: nothing to report", flush=True)
        return
    rows = sorted(rows, key=lambda r: (r["backend"], r["device"], int(r["world_size"]),
                                       int(r["bytes"]), r["impl"]))
    backend_busbw = {(r["backend"], r["device"], r["world_size"], r["bytes"]): float(r["busbw_gbps"])
                     for r in rows if r["impl"] == "backend"}
    table = []
    for r in rows:
        ref = backend_busbw.get((r["backend"], r["device"], r["world_size"], r["bytes"]))
        table.append({
            "backend/device": f"{r['backend']}/{r['device']}", "ws": int(r["world_size"]),
            "size": format_size(int(r["bytes"])), "impl": r["impl"],
            "time ms (median)": float(r["time_ms_median"]),
            "min": float(r["time_ms_min"]), "max": float(r["time_ms_max"]),
            "algbw GB/s": float(r["algbw_gbps"]), "busbw GB/s": float(r["busbw_gbps"]),
            "vs backend": f"{float(r['busbw_gbps']) / ref:.2f}x" if r["impl"] == "ring" and ref
            else ""})
    print()
    results.print_table(table, title=f"all_reduce, float32, slowest rank's median ({machine})\n"
                        "sizes in binary units (1 MB = 2^20 bytes); bandwidth in GB/s = 10^9 "
                        "bytes/s; busbw = algbw x 2(n-1)/n")
    print(f"rows in {results.results_dir() / CSV_NAME}")

    fits = fit_rows(rows)
    if fits:
        fit_table, point_table = [], []
        for key, f in fits.items():
            for impl, fit in (("backend", f), ("ring", f.get("ring"))):
                if not fit:
                    continue
                fit_table.append({"backend/device/ws": key, "impl": impl,
                                  "a (latency) us": fit["a_s"] * 1e6,
                                  "w (bandwidth) GB/s": fit["w_bytes_per_s"] / 1e9,
                                  "worst |error| %": round(max(abs(p["rel_error"]) for p in fit["points"]) * 100, 2)})
                for p in fit["points"]:
                    point_table.append({"backend/device/ws": key, "impl": impl,
                                        "size": format_size(p["bytes"]),
                                        "measured ms": p["time_s"] * 1e3,
                                        "predicted ms": p["predicted_s"] * 1e3,
                                        "error %": round(p["rel_error"] * 100, 2)})
        print()
        results.print_table(fit_table, title="fit t = a + N / w (least squares on relative error)")
        print()
        results.print_table(point_table, title="each point against the fit")
        if any(f["a_s"] < 0 for f in fits.values()):
            print("note: a negative latency a means the small sizes were too noisy or too few "
                  "to pin it down; add smaller sizes")
        for f in fits.values():
            f["run_id"] = rows[0]["run_id"]
        merged = {**(results.read_json(FIT_NAME) or {}), **fits}  # keep other runs' keys
        print(f"fit written to {results.write_json(FIT_NAME, merged)}")
    else:
        print("fit: needs at least two sizes of one backend/device/world size; none written")
    if plot:
        plot_busbw(rows, results.results_dir() / PLOT_NAME, machine)


def plot_busbw(rows: list[dict], path: Path, machine: str) -> Path | None:
    """busbw against size, one line per backend/device and world size (ring dashed)."""
    _, results, _ = _common()
    plt = results.pyplot()
    if plt is None:
        print(f"plot: matplotlib is not installed, so no {path.name} "
              "(pip install matplotlib to get it)", flush=True)
        return None
    lines: dict[tuple, list] = {}
    for r in rows:
        lines.setdefault((r["backend"], r["device"], int(r["world_size"]), r["impl"]), []).append(
            (int(r["bytes"]), float(r["busbw_gbps"])))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {}
    for (backend, device, ws, impl), pts in sorted(lines.items()):
        pts.sort()
        color = colors.setdefault((backend, device, ws), f"C{len(colors) % 10}")
        ax.plot([n for n, _ in pts], [b for _, b in pts], marker="o", color=color,
                linestyle="-" if impl == "backend" else "--",
                label=f"{backend}/{device} ws={ws}" + (" ring" if impl == "ring" else ""))
    ax.set_xscale("log")
    sizes = sorted({int(r["bytes"]) for r in rows})
    ax.set_xticks(sizes, [format_size(n) for n in sizes])
    ax.minorticks_off()
    ax.set_xlabel("buffer size (float32; 1 MB = 2^20 bytes)")
    ax.set_ylabel("bus bandwidth (GB/s = 10^9 B/s)")
    ax.set_title(f"all_reduce busbw\n{machine}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}", flush=True)
    return path


# --------------------------------------------------------------------------- command line


def _parse_list(text: str, flag: str, allowed: list[str]) -> list[str] | None:
    """'gloo,nccl' -> ['gloo', 'nccl']; 'all' -> None (every one the box supports)."""
    from common.launch import usage_error
    if text == "all":
        return None
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if not items or bad:
        usage_error(f"{flag}: {','.join(bad) or repr(text)} is not one of {', '.join(allowed)} "
                    "(a comma-separated list, or all)")
    return list(dict.fromkeys(items))


def plan_configurations(args) -> list[tuple[str, str, int]]:
    """(backend, device, world_size) to run, in order; a usage error (exit 2) for what this
    box cannot run when it was asked for by name. Prints why a default combination is left out."""
    from common.launch import usage_error
    n_gpus = torch.cuda.device_count()
    nccl_ok = n_gpus > 0 and dist.is_nccl_available()
    backends = _parse_list(args.backend, "--backend", ["gloo", "nccl"])
    devices = _parse_list(args.device, "--device", ["cpu", "cuda"])
    named = backends is not None and devices is not None
    if backends and "nccl" in backends and not nccl_ok:
        usage_error("--backend nccl needs CUDA GPUs (and a torch built with NCCL); none here: "
                    "use --backend gloo")
    if devices and "cuda" in devices and n_gpus == 0:
        usage_error("--device cuda needs a GPU and none is visible: use --device cpu")
    # GPU first: if the sweep is cut short, the figures that matter on a GPU box exist
    backends = backends or (["nccl", "gloo"] if nccl_ok else ["gloo"])
    devices = devices or (["cuda", "cpu"] if n_gpus else ["cpu"])
    if backends == ["nccl"] and devices == ["cpu"]:
        usage_error("--backend nccl needs --device cuda (NCCL moves GPU memory only)")
    plan = []
    for backend in backends:
        for device in devices:
            if backend == "nccl" and device == "cpu":
                continue  # NCCL moves GPU memory only
            for ws in args.world_sizes:
                if backend == "nccl" and n_gpus < ws:
                    if args.backend == "nccl":
                        usage_error(f"--world-sizes: {ws} ranks need {ws} GPUs for nccl, this "
                                    f"box has {n_gpus}; use --backend gloo to share them")
                    print(f"not run: nccl/cuda ws={ws} (needs one GPU per rank, {n_gpus} here)")
                    continue
                if backend == "gloo" and device == "cuda" and not named and nccl_ok \
                        and n_gpus >= ws:
                    continue  # enough GPUs: NCCL is the backend for CUDA tensors here
                plan.append((backend, device, ws))
    if not plan:
        usage_error("nothing to run on this box for the backends, devices and world sizes given")
    return plan


def build_parser():
    from common.launch import Parser
    import argparse
    p = Parser(description=__doc__.strip().splitlines()[0],
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", default="all",
                   help="gloo, nccl, a comma-separated list, or all (every backend this box runs)")
    p.add_argument("--device", default="all",
                   help="cpu, cuda, a comma-separated list, or all (every device this box has)")
    p.add_argument("--sizes", default="1MB,10MB,100MB,1GB",
                   help="float32 buffer sizes, comma-separated, binary units (B, KB, MB, GB: "
                        "1 MB = 2^20 bytes)")
    p.add_argument("--world-sizes", default="2,4,6",
                   help="numbers of ranks to sweep, comma-separated, each >= 2")
    p.add_argument("--world-size", type=int, default=None,
                   help="one world size (same as --world-sizes N; under torchrun WORLD_SIZE wins)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before timing")
    p.add_argument("--iters", type=int, default=20,
                   help="at most this many timed calls per configuration (fewer for large sizes,"
                        f" about {TARGET_TIMED_S:g} s of timed work, but at least 3)")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="skip a configuration whose estimated time is over this many seconds")
    p.add_argument("--no-ring", action="store_true",
                   help="time only the backend's all_reduce, not stage 01's ring")
    p.add_argument("--no-plot", action="store_true", help="do not draw the PNG plot")
    return p


def parse_args(argv=None):
    from common.launch import under_torchrun, usage_error
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.sizes = sorted(set(parse_size(s) for s in args.sizes.split(",") if s.strip()))
    except ValueError as e:
        usage_error(f"--sizes: {e}")
    if not args.sizes:
        usage_error("--sizes: give at least one size, e.g. 1MB")
    ws_text = str(args.world_size) if args.world_size is not None else args.world_sizes
    if under_torchrun():
        ws_text = os.environ["WORLD_SIZE"]
    try:
        args.world_sizes = list(dict.fromkeys(int(s) for s in ws_text.split(",") if s.strip()))
    except ValueError:
        usage_error(f"--world-sizes: cannot parse {ws_text!r}: use whole numbers like 2,4,6")
    bad = [w for w in args.world_sizes if w < 2]
    if bad or not args.world_sizes:
        usage_error(f"world size {bad[0] if bad else ws_text!r} is not allowed: an all-reduce "
                    "needs at least 2 ranks")
    if args.warmup < 0 or args.iters < 3:
        usage_error(f"--warmup must be >= 0 and --iters >= 3, got {args.warmup} and {args.iters}")
    if args.budget_s <= 0:
        usage_error(f"--budget-s must be > 0, got {args.budget_s:g}")
    return args


def main(argv=None) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from common import launch, results

    args = parse_args(argv)
    configs = plan_configurations(args)
    torchrun = launch.under_torchrun()
    if torchrun:
        if len(configs) != 1:
            launch.usage_error("under torchrun give one --backend and one --device "
                               f"(got {', '.join(f'{b}/{d}' for b, d, _ in configs)})")
        b, d, ws = configs[0]
        launch.resolve(argparse_namespace(ws, b, d), min_world_size=2)  # checks GPUs per node
    is_main = not torchrun or int(os.environ["RANK"]) == 0
    impls = ["backend"]
    if not args.no_ring:
        if load_ring_all_reduce() is not None:
            impls.append("ring")
        elif is_main:
            print(f"note: no ring_all_reduce in {STAGE01}; timing the backend only")
    machine = results.machine_name()
    run_id = results.run_id()  # marks this run's rows in the shared CSV
    total = len(configs) * len(args.sizes) * len(impls)
    if is_main:
        print(f"all_reduce sweep on {machine}: {len(configs)} backend/device/world-size "
              f"group(s) x {len(args.sizes)} size(s) x {len(impls)} impl(s) = {total} "
              "configurations; sizes in binary units (1 MB = 2^20 bytes), bandwidth in "
              "GB/s = 10^9 bytes/s", flush=True)

    interrupted = False
    try:
        k = 1
        for backend, device, ws in configs:
            sizes = []
            for nbytes in args.sizes:
                # The memory guard runs here, before launching; under torchrun each node
                # checks inside the worker instead (it knows its own ranks).
                short = None if torchrun else memory_shortfall(nbytes, ws, device,
                                                               "ring" in impls, backend)
                sizes.append((nbytes, k, short))
                k += len(impls)
            plan = {"sizes": sizes, "impls": impls, "total": total, "warmup": args.warmup,
                    "max_iters": args.iters, "budget_s": args.budget_s, "run_id": run_id,
                    "machine": machine}
            if all(s[2] for s in sizes):  # nothing fits: do not even start the ranks
                for nbytes, k0, short in sizes:
                    for i, impl in enumerate(impls):
                        print(f"[{k0 + i}/{total}] {backend}/{device} ws={ws} "
                              f"{format_size(nbytes)} {impl} skipped: {short}", flush=True)
                continue
            # Bound the whole group: every configuration within budget, plus start-up.
            timeout = args.budget_s * len(sizes) * len(impls) + 120
            launch.launch(allreduce_sweep, launch.LaunchConfig(ws, backend, device), plan,
                          timeout_s=None if torchrun else timeout)
    except KeyboardInterrupt:
        interrupted = True
        import multiprocessing
        for child in multiprocessing.active_children():  # our own spawned ranks only
            child.terminate()
            child.join(timeout=5)
        if is_main:
            print("\ninterrupted: the configurations finished so far are written; "
                  "reporting those", flush=True)
    if is_main:
        rows = [r for r in results.read_csv(CSV_NAME) if r.get("run_id") == run_id]
        report(rows, machine, plot=not args.no_plot)
    if interrupted:
        raise SystemExit(130)


def argparse_namespace(world_size: int, backend: str, device: str):
    import argparse
    return argparse.Namespace(world_size=world_size, backend=backend, device=device)


if __name__ == "__main__":
    main()
