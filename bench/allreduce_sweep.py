"""Stage 02's sweep as make bench runs it (its "allreduce" step): the lesson's measurement
(02_allreduce_bench/allreduce_bench.py) with what a run nobody watches needs. Every row goes to
results/allreduce.csv as it lands; the backend's ``t = a + N / w`` per backend/device/world
size to results/allreduce_fit.json (stage 06's bucket model reads it), the bus bandwidths to
results/allreduce_busbw.png. A size is skipped, with its reason, when its estimate (the size
before, scaled) passes ``--budget-s`` or make bench's deadline, or its memory would not fit.

    python bench/allreduce_sweep.py --backend gloo --device cpu --sizes 1MB,10MB --world-sizes 2,4
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench import results, step_bench  # noqa: E402

from bench import supervisor as launch
from common import import_stage  # noqa: E402

stage02 = import_stage("02_allreduce_bench/allreduce_bench")
CSV_KEY = ["backend", "device", "world_size", "bytes", "impl"]


def memory_shortfall(ctx, host_per_rank: int, gpu_per_rank: int) -> str | None:
    """Why these bytes per rank would not fit on this node, or None: the same on every rank."""
    gib = launch.GIB
    ranks_here = launch.ranks_on_this_node(ctx.world_size)
    have = launch.host_available_bytes()
    host = ranks_here * (launch.rank_baseline_bytes() + host_per_rank)
    why = None
    if host > 0.9 * have:
        why = f"needs about {host / gib:.1f} GiB of host memory, {have / gib:.1f} GiB available"
    elif ctx.device.type == "cuda":
        torch.cuda.empty_cache()  # else the last configuration's cached blocks count as used
        free = torch.cuda.mem_get_info(ctx.device)[0]  # + 1 GiB for context and buffers
        per_gpu = launch.ranks_per_gpu(ctx.world_size) * (gpu_per_rank + gib)
        if per_gpu > 0.9 * free:
            why = f"needs about {per_gpu / gib:.1f} GiB per GPU, {free / gib:.1f} GiB free"
    flag = torch.tensor([float(why is not None)], device=ctx.device if ctx.backend == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return (why or "memory is short on another rank") if flag.item() else None


def over_budget(ctx, nbytes: int, previous: dict, args) -> str | None:
    """Rank 0's verdict, broadcast: this size's estimate (``previous`` scaled, every call of
    the measurement) against ``--budget-s`` and make bench's deadline for the step."""
    decision = [None]
    if ctx.is_main:
        per_call = previous["time_ms_median"] / 1e3 * nbytes / previous["bytes"]
        estimate = per_call * (1 + args.warmup + args.iters)
        left = step_bench.seconds_left()
        start = f"estimated {estimate:.0f} s from {stage02.format_size(previous['bytes'])}: "
        if estimate > args.budget_s:
            decision[0] = start + f"over the {args.budget_s:g} s budget"
        elif estimate > left:
            decision[0] = start + f"{left:.0f} s is left before make bench stops this step"
    dist.broadcast_object_list(decision, src=0)
    return decision[0]


def skip_reason(ctx, impl: str, nbytes: int, previous: dict | None, args) -> str | None:
    """Why not to run this configuration, the same on every rank: over the budget or the deadline
    (scaled from the size before, or from one call timed here), or memory short."""
    if previous is not None and (why := over_budget(ctx, nbytes, previous, args)):
        return why
    cuda = ctx.device.type == "cuda"  # the buffer, the backend's and a ring's scratch per rank
    why = memory_shortfall(ctx, (2 if cuda else 4) * nbytes, 3 * nbytes)
    if why or previous is not None:
        return why
    buf = torch.zeros(nbytes // 4, device=ctx.device)
    start = time.perf_counter()
    stage02.all_reduces(ctx, args.no_ring)[impl](buf)
    if cuda:
        torch.cuda.synchronize(ctx.device)
    took = torch.tensor([time.perf_counter() - start], device=buf.device if ctx.backend == "nccl" else "cpu")
    dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's
    return over_budget(ctx, nbytes, {"bytes": nbytes, "time_ms_median": took.item() * 1e3}, args)


def sweep_worker(ctx, args) -> None:
    def write(row):
        if ctx.is_main:  # at once: a run stopped later keeps it
            row = {**row, "run_id": results.run_id(), "machine": results.machine_name()}
            results.upsert_csv("allreduce.csv", [row], key=CSV_KEY)
    stage02.sweep(ctx, args, skip=lambda *a: skip_reason(ctx, *a, args), on_row=write)


def fits_of(rows: list[dict]) -> dict:
    """The backend's ``t = a + N / w`` per group of two sizes or more, keyed "gloo/cpu/2"."""
    groups = {}
    for r in (r for r in rows if r["impl"] == "backend"):
        groups.setdefault((r["backend"], r["device"], int(r["world_size"])), []).append(
            (int(r["bytes"]), float(r["time_ms_median"]) / 1e3))
    fits = {}
    for (backend, device, ws), points in groups.items():
        if len(points) >= 2:
            a, w = stage02.fit_latency_bandwidth(*zip(*points))
            errors = [{"bytes": n, "time_s": t, "rel_error": (a + n / w) / t - 1} for n, t in points]
            fits[f"{backend}/{device}/{ws}"] = dict(backend=backend, device=device, world_size=ws, a_s=a,
                                                    w_bytes_per_s=w, run_id=rows[0]["run_id"], points=errors)
    return fits


def report(rows: list[dict], machine: str) -> None:
    """The table, the fits (to allreduce_fit.json) and the plot."""
    fits = fits_of(rows)
    error = {(key, p["bytes"]): f"{p['rel_error']:+.0%}" for key, f in fits.items() for p in f["points"]}
    rows = sorted(rows, key=lambda r: (r["backend"], r["device"], int(r["world_size"]),
                                       int(r["bytes"]), r["impl"]))
    results.print_table([{
        "backend/device": f"{r['backend']}/{r['device']}", "ws": r["world_size"],
        "size": stage02.format_size(int(r["bytes"])), "impl": r["impl"],
        "ms (median)": float(r["time_ms_median"]), "min": float(r["time_ms_min"]),
        "max": float(r["time_ms_max"]), "algbw GB/s": float(r["algbw_gbps"]),
        "busbw GB/s": float(r["busbw_gbps"]),
        "fit error": error.get((f"{r['backend']}/{r['device']}/{r['world_size']}", int(r["bytes"])), "")
        if r["impl"] == "backend" else ""}
        for r in rows], title=f"\nall_reduce, float32, slowest rank's median ({machine})")
    if not fits:
        return print("fit: needs two sizes or more of one backend/device/world size")
    results.print_table([{"backend/device/ws": key, "a (latency) us": f["a_s"] * 1e6,
                          "w (bandwidth) GB/s": f["w_bytes_per_s"] / 1e9} for key, f in fits.items()],
                        title="\nfit of the backend's times: t = a + N / w (least squares on relative error; "
                              "a < 0: add smaller sizes)")
    print(f"fit written to {results.update_json('allreduce_fit.json', fits)}")
    plt = results.pyplot()
    if plt is None:
        return print("plot: matplotlib is not installed, so no allreduce_busbw.png")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"backend": "-", "ring": ":", "ring_pipelined": "--"}
    for key in dict.fromkeys((r["backend"], r["device"], r["world_size"], r["impl"]) for r in rows):
        mine = [r for r in rows if (r["backend"], r["device"], r["world_size"], r["impl"]) == key]
        ax.plot([int(r["bytes"]) for r in mine], [float(r["busbw_gbps"]) for r in mine],
                styles[key[3]], marker="o", label=f"{key[0]}/{key[1]} ws={key[2]} {key[3]}")
    sizes = sorted({int(r["bytes"]) for r in rows})
    ax.set(xscale="log", xlabel="buffer size (float32)", ylabel="bus bandwidth (GB/s = 10^9 B/s)")
    ax.set_xticks(sizes, [stage02.format_size(n) for n in sizes], minor=False)
    ax.set_title(f"all_reduce busbw\n{machine}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = results.results_dir() / "allreduce_busbw.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}", flush=True)


def main(argv=None) -> None:
    parser = stage02.make_parser()
    parser.add_argument("--budget-s", type=launch.positive_float, default=300.0,
                        help="skip a size whose estimated time is over this many seconds")
    args = parser.parse_args(argv)
    configs = stage02.configurations(args)
    if not launch.under_torchrun():
        launch.check_ranks_fit(max(c.world_size for c in configs))
    if args.check:
        for config in configs:
            launch.launch(stage02.check_worker, config, args, timeout_s=120 + 30 * len(args.sizes))
        return
    results.check_writable()
    given = os.environ.get("RESULTS_RUN_ID")
    os.environ["RESULTS_RUN_ID"] = given or results.run_id()  # the ranks' rows name this run
    stopped = None
    try:
        for config in configs:
            launch.launch(sweep_worker, config, args, timeout_s=args.budget_s * len(args.sizes) * 3 + 120)
    except launch.Stopped as e:  # Ctrl-C or SIGTERM: report what finished, then stop
        stopped = e
    finally:
        if given is None:  # as it was: a caller in this process (a test) sees no run id
            del os.environ["RESULTS_RUN_ID"]
    if not launch.under_torchrun() or os.environ["RANK"] == "0":
        rows = [r for r in results.read_csv("allreduce.csv") if r.get("run_id") == results.run_id()]
        if not rows:
            print("nothing was measured: every configuration was skipped (reasons above)", file=sys.stderr)
            raise SystemExit(stopped.code if stopped else 1)
        report(rows, results.machine_name())
    if stopped:
        raise stopped


if __name__ == "__main__":
    main()
