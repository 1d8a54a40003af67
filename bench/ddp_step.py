"""Stages 03-06's step benchmark (make bench's "ddp" step) and stage 06's bucket model beside it.

The LM's training step under NaiveDDP (03), FlatDDP (04), OverlapDDP (05), BucketedDDP (06) and
torch DDP at each of ``--bucket-sizes``, beside no communication and torch DDP at 25 MB
(bench/step_bench.py): results/ddp_step.csv. Then bucket_model.py's overhead model with stage
02's fitted latency and bandwidth (else measured here) beside the sweep: results/bucket_model.json.

    python bench/ddp_step.py --world-size 2 --model small --bucket-sizes 1,10,100,1000
"""

import functools
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench import results, step_bench, timing  # noqa: E402

from bench import supervisor as launch
from common import import_stage, models  # noqa: E402

MIB = 2 ** 20
FIT_SIZES = [2**12, 2**16, 2**20, 2**22, 2**24]  # all-reduces timed when stage 02's fit is missing


def latency_bandwidth(ctx) -> dict:
    """Stage 02's fitted (a, w) for this backend/device/world size, as rank 0 reads it (each node
    has its own results/) and broadcasts; missing, malformed or another run's: measured here."""
    key = f"{ctx.backend}/{ctx.device.type}/{ctx.world_size}"
    decision = [None]
    if ctx.is_main:
        fit = results.read_json("allreduce_fit.json").get(key)
        run = os.environ.get("RESULTS_RUN_ID")
        if not fit:
            decision[0] = "no fit for " + key
        elif run and fit.get("run_id") != run:
            decision[0] = f"the fit for {key} is from another run"
        elif not (isinstance(fit, dict) and usable(fit)):
            decision[0] = f"the fit for {key} is not two positive numbers"
        else:
            decision[0] = {"a_s": fit["a_s"], "w_bytes_per_s": fit["w_bytes_per_s"],
                           "source": f"results/allreduce_fit.json [{key}] (stage 02)"}
    dist.broadcast_object_list(decision, src=0)
    if isinstance(decision[0], dict):
        return decision[0]
    ctx.print(f"({decision[0]} in results/allreduce_fit.json: measuring latency and bandwidth "
              "here)", all_ranks=False)
    times = []
    for nbytes in FIT_SIZES:
        x = torch.zeros(nbytes // 4, device=ctx.device)
        times.append(timing.gather_times(timing.measure(
            lambda: dist.all_reduce(x), ctx.device, warmup=3, iters=10, barrier=True)).median)
    stage02 = import_stage("02_allreduce_bench/allreduce_bench")
    a, w = stage02.fit_latency_bandwidth(FIT_SIZES, times)
    return {"a_s": a, "w_bytes_per_s": w, "source": "measured in this run"}


def usable(fit: dict) -> bool:
    """Two positive, finite numbers: what the model's square roots need."""
    return all(isinstance(fit.get(k), (int, float)) and 0 < fit[k] < math.inf
               for k in ("a_s", "w_bytes_per_s"))


def model_vs_sweep(ctx, args, sweep_rows: list[dict], fit: dict, show: bool = True) -> dict:
    """The prediction beside the sweep so far (printed by rank 0 if ``show``), saved in
    results/bucket_model.json under backend/device/world size/model."""
    bucket_model = import_stage("06_bucketed_ddp/bucket_model")
    assign_buckets = import_stage("06_bucketed_ddp/bucketed_ddp").assign_buckets
    if not usable(fit):  # a fit on a noisy machine can come out with a <= 0
        if show:
            ctx.print(f"bucket model: no prediction: the fit ({fit['source']}) gave a = "
                      f"{fit['a_s']:.3g} s, w = {fit['w_bytes_per_s']:.3g} B/s", all_ranks=False)
        return {}
    with torch.device("meta"):  # sizes only: nothing allocated
        lm = models.TransformerLM(args.model, context_length=args.context_length)
    params = [p for p in lm.parameters() if p.requires_grad]
    s = sum(p.numel() * p.element_size() for p in params)
    o, w = fit["a_s"], fit["w_bytes_per_s"]
    best_bytes, n_best = bucket_model.best_bucket_size_bytes(s, o, w)
    rows = [{"bucket_mb": r["bucket_mb"], "buckets": n,
             "model_comm_after_bwd_ms": bucket_model.comm_after_backward_model(n, s, o, w) * 1e3,
             "measured_comm_after_bwd_ms": r["comm_after_backward_ms"], "measured_step_ms": r["step_ms"]}
            for r in sweep_rows for n in [len(assign_buckets(params, float(r["bucket_mb"])))]]
    best = min(rows, key=lambda r: r["measured_step_ms"])
    order = sorted(float(r["bucket_mb"]) for r in rows)
    i = order.index(float(best["bucket_mb"]))
    lo, hi = order[max(0, i - 1)], order[min(len(order) - 1, i + 1)]
    within = lo <= best_bytes / MIB <= hi
    summary = {
        "model": args.model, "gradient_bytes": s, "o_s": o, "w_bytes_per_s": w,
        "fit_source": fit["source"], "predicted_best_bucket_mb": best_bytes / MIB,
        "predicted_best_n_buckets": n_best, "predicted_comm_after_backward_ms":
            bucket_model.comm_after_backward_model(max(1.0, n_best), s, o, w) * 1e3,
        "measured_best_bucket_mb": float(best["bucket_mb"]),
        "measured_best_step_ms": best["measured_step_ms"], "neighbour_range_mb": [lo, hi],
        "prediction_within_neighbours": within, "sweep": rows, "backend": ctx.backend,
        "device": ctx.device.type, "world_size": ctx.world_size,
        "machine": results.machine_name(), "run_id": results.run_id()}
    if ctx.is_main and show:
        print(f"\nbucket model: s = {s / MIB:.1f} MiB of gradients, o = {o * 1e6:.0f} us per "
              f"all-reduce, w = {w / 1e9:.2f} GB/s ({fit['source']}): best n_b = sqrt(s / (w o)) "
              f"= {n_best:.1f} buckets of sqrt(s w o) = {best_bytes / MIB:.2f} MiB")
        results.print_table(rows, title="model vs measured, BucketedDDP sweep:")
        print(f"measured best bucket size (by step time): {best['bucket_mb']} MB; the predicted "
              f"{best_bytes / MIB:.2f} MiB is {'within' if within else 'OUTSIDE'} the best and "
              f"its neighbours [{lo:g}, {hi:g}] MB", flush=True)
    if ctx.is_main:
        key = f"{ctx.backend}/{ctx.device.type}/{ctx.world_size}/{args.model}"
        results.update_json("bucket_model.json", {key: summary})
    return summary


def sweep_and_model(ctx, args, with_earlier_stages: bool = True) -> list[dict]:
    """Stages 03-05 (``with_earlier_stages``), BucketedDDP and torch DDP at every size, and the
    model beside the sweep, rewritten as each size lands."""
    bucketed = import_stage("06_bucketed_ddp/bucketed_ddp").BucketedDDP
    fit = latency_bandwidth(ctx)
    cases = []
    if with_earlier_stages:
        cases = [("naive", None, import_stage("03_naive_ddp/naive_ddp").NaiveDDP),
                 ("flat", None, import_stage("04_flat_ddp/flat_ddp").FlatDDP),
                 ("overlap", None, import_stage("05_overlap_ddp/overlap_ddp").OverlapDDP)]
    cases += [("bucketed", size, functools.partial(bucketed, bucket_size_mb=size))
              for size in args.bucket_sizes]
    cases += [("torch_ddp", size, step_bench.torch_ddp_factory(size)) for size in args.bucket_sizes
              if size != step_bench.TORCH_DDP_DEFAULT_BUCKET_MB]

    def model_so_far(rows, show=False):  # none before a bucketed case has run
        swept = [r for r in rows if r["impl"] == "bucketed"]
        if swept:
            model_vs_sweep(ctx, args, swept, fit, show=show)
    rows = step_bench.run_step_bench(ctx, cases, args, after_case=model_so_far)
    model_so_far(rows, show=True)
    return rows


def main(argv=None) -> None:
    parser = launch.make_parser(__doc__)
    parser.add_argument("--bucket-sizes", type=launch.list_of(launch.positive_float),
                        default=[1.0, 10.0, 100.0, 1000.0],
                        help="comma-separated bucket caps in MiB for BucketedDDP and torch DDP")
    step_bench.add_step_bench_args(parser)
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    step_bench.check_step_bench_args(args, config)
    launch.launch(sweep_and_model, config, args)


if __name__ == "__main__":
    main()
