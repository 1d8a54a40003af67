"""Stage 06, second idea: how big should a bucket be? A model, set beside a measured sweep.

With total gradient bytes ``s``, all-reduce bandwidth ``w``, per-call overhead ``o`` and
``n_b`` equal buckets, and a bucket taking about as long to compute as to communicate, every
bucket but the last overlaps backward, and every call pays ``o``. What is left after
backward is about

    t(n_b) = n_b * o + s / (n_b * w),

smallest where its derivative o - s / (n_b^2 w) is zero: n_b = sqrt(s / (w o)) buckets, a
bucket size of s / n_b = sqrt(s w o). Stage 02 measured ``o`` (its fitted latency ``a``) and
``w`` on this machine; ``bucketed_ddp.py --bench`` sweeps the bucket size and calls
``model_vs_sweep`` to print the prediction beside the measurements (the README says where
and why they part). Run through ``bucketed_ddp.py``; the formulas need only the standard
library.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

MIB = 2 ** 20
# all-reduce sizes (bytes) timed for (a, w) when stage 02's fit is missing
FIT_SIZES = [2**12, 2**16, 2**20, 2**22, 2**24]


def comm_after_backward_model(n_buckets: float, total_bytes: float, o_s: float,
                              w_bytes_per_s: float) -> float:
    """Seconds of communication left after backward with ``n_buckets`` equal buckets."""
    return n_buckets * o_s + total_bytes / (n_buckets * w_bytes_per_s)


def best_bucket_size_bytes(total_bytes: float, o_s: float,
                           w_bytes_per_s: float) -> tuple[float, float]:
    """(best bucket size in bytes, best number of buckets): sqrt(s w o) and sqrt(s / (w o))."""
    return (math.sqrt(total_bytes * w_bytes_per_s * o_s),
            math.sqrt(total_bytes / (w_bytes_per_s * o_s)))


# --------------------------------------------------------------------------- harness


def latency_bandwidth(ctx) -> dict:
    """Stage 02's fitted (a, w) for this backend/device/world size, else measured here.

    Rank 0 alone reads results/allreduce_fit.json and broadcasts what it found: under
    multi-node torchrun each node has its own results/, and if one node measured (with
    collectives) while another read a file, the run would hang. A missing, corrupt or
    malformed fit, or one from another make-bench run, is measured here instead.
    """
    import os

    from common import import_stage

    from bench import results, timing
    key = f"{ctx.backend}/{ctx.device.type}/{ctx.world_size}"
    decision = [None]
    if ctx.is_main:
        fit = results.read_json("allreduce_fit.json").get(key)
        run = os.environ.get("RESULTS_RUN_ID")  # set by make bench: only this run's fit counts
        decision[0] = ("no fit for " + key if not fit else
                       f"the fit for {key} is from another run" if run and fit.get("run_id") != run
                       else f"the fit for {key} is not two positive numbers"
                       if not (isinstance(fit, dict) and usable(fit)) else
                       {"a_s": fit["a_s"], "w_bytes_per_s": fit["w_bytes_per_s"],
                        "source": f"results/allreduce_fit.json [{key}] (stage 02)"})
    dist.broadcast_object_list(decision, src=0)  # every rank now takes the same branch
    if isinstance(decision[0], dict):
        return decision[0]
    ctx.print(f"({decision[0]} in results/allreduce_fit.json: measuring latency and bandwidth "
              "here; run stage 02 for a better fit)", all_ranks=False)
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


def model_vs_sweep(ctx, args, sweep_rows: list[dict], fit: dict, json_name: str,
                   assign_buckets, show: bool = True) -> dict:
    """Print the prediction beside the measured sweep (rank 0; ``show=False``: only write) and
    save the summary in ``results/<json_name>`` keyed by backend/device/world size/model. The
    sweep may be partial (a step stopped part-way): the summary names the sizes it has.
    ``assign_buckets``: stage 06's, passed in (this module is imported by stage 06)."""
    from common import models
    from bench import results
    if not usable(fit):  # a fit measured on a noisy machine can come out with a <= 0
        if show:
            ctx.print(f"bucket model: no prediction: the latency-bandwidth fit ({fit['source']}) "
                      f"gave a = {fit['a_s']:.3g} s, w = {fit['w_bytes_per_s']:.3g} B/s",
                      all_ranks=False)
        return {}
    with torch.device("meta"):  # sizes only: nothing allocated
        lm = models.TransformerLM(args.model, context_length=args.context_length)
    params = [p for p in lm.parameters() if p.requires_grad]
    s = sum(p.numel() * p.element_size() for p in params)
    o, w = fit["a_s"], fit["w_bytes_per_s"]
    best_bytes, n_best = best_bucket_size_bytes(s, o, w)
    rows = []
    for r in sweep_rows:
        buckets = len(assign_buckets(params, float(r["bucket_mb"])))
        rows.append({"bucket_mb": r["bucket_mb"], "buckets": buckets,
                     "model_comm_after_bwd_ms": comm_after_backward_model(buckets, s, o, w) * 1e3,
                     "measured_comm_after_bwd_ms": r["comm_after_backward_ms"],
                     "measured_step_ms": r["step_ms"]})
    best = min(rows, key=lambda r: r["measured_step_ms"])
    order = sorted(float(r["bucket_mb"]) for r in rows)
    i = order.index(float(best["bucket_mb"]))
    lo, hi = order[max(0, i - 1)], order[min(len(order) - 1, i + 1)]
    within = lo <= best_bytes / MIB <= hi
    summary = {
        "model": args.model, "gradient_bytes": s, "o_s": o, "w_bytes_per_s": w,
        "fit_source": fit["source"], "predicted_best_bucket_mb": best_bytes / MIB,
        "predicted_best_n_buckets": n_best,
        "predicted_comm_after_backward_ms": comm_after_backward_model(max(1.0, n_best), s, o, w) * 1e3,
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
        results.update_json(json_name, {key: summary})
    return summary
