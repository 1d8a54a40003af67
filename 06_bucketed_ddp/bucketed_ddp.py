"""Stage 06: bucketed DDP, overlap (stage 05) plus fewer, larger all-reduces (stage 04).

Stage 05 overlaps communication with backward but pays the per-call overhead of one
all-reduce per parameter; stage 04 pays it once but cannot start before backward ends.
``BucketedDDP`` takes the middle road torch's own DistributedDataParallel takes: parameters
are grouped, in reverse registration order (roughly the order backward produces their
gradients), into buckets of at most ``bucket_size_mb`` MiB; each bucket is one flat buffer;
the moment the last gradient of a bucket arrives, the whole bucket is all-reduced
asynchronously. Small buckets overlap well but pay the overhead often; big buckets pay it
rarely but leave a big last bucket to communicate after backward. The README derives the
bucket size that balances the two (``best_bucket_size_bytes`` below) and checks it against a
measured sweep.

Run it:

    python 06_bucketed_ddp/bucketed_ddp.py --world-size 2     # verify + model + small sweep
    python 06_bucketed_ddp/bucketed_ddp.py --bench --model small --bucket-sizes 1,10,100,1000
    python 06_bucketed_ddp/bucketed_ddp.py --profile          # torch.profiler traces + timeline
    torchrun --nproc-per-node=2 06_bucketed_ddp/bucketed_ddp.py

The class below needs only torch: copy this file into another project and
``from bucketed_ddp import BucketedDDP``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import os
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

MIB = 2 ** 20  # bucket sizes count MiB, as torch DDP's bucket_cap_mb does

# --------------------------------------------------------------------------- the algorithm


def broadcast_module_state(module: nn.Module, group=None) -> None:
    """Make every rank start from rank 0's parameters and buffers (same code in 03-06 on purpose,
    so each file stays copyable on its own)."""
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.detach(), src=src, group=group)

def weak_hook(ddp: nn.Module, *args):
    """A post-accumulate-grad hook calling ``ddp._on_grad_ready(*args, param)`` that does not
    keep ``ddp`` alive. Hooks live in autograd's C++ state, which Python's garbage collector
    cannot see into: a hook holding the wrapper (which holds the model, whose parameters hold
    the hook) is a cycle the collector never frees, so every wrapper built and dropped, with
    its model and buffers, would leak. A weak reference breaks the cycle. (Same code in 05
    and 06 on purpose, so each file stays copyable on its own.)"""
    ddp_ref = weakref.ref(ddp)

    def hook(param: torch.Tensor) -> None:
        live = ddp_ref()
        if live is not None:  # the wrapper is gone: leave the gradient alone
            live._on_grad_ready(*args, param)

    return hook


def check_bucket_size_mb(bucket_size_mb) -> float | None:
    """``None`` (one bucket) or a positive number of MiB; anything else is a clear error."""
    if bucket_size_mb is None:
        return None
    if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, numbers.Real):
        raise TypeError(f"bucket_size_mb must be a positive number of MiB or None (one bucket), "
                        f"got {bucket_size_mb!r} of type {type(bucket_size_mb).__name__}")
    if math.isnan(bucket_size_mb) or bucket_size_mb <= 0:
        raise ValueError(f"bucket_size_mb must be > 0 MiB (or None for one bucket), "
                         f"got {bucket_size_mb!r}")
    return float(bucket_size_mb)


def assign_buckets(params: list[torch.Tensor], bucket_size_mb: float | None) -> list[list[int]]:
    """Group parameters into buckets; returns lists of indices into ``params``, in launch order.

    Parameters are taken in reverse order (pass them in registration order). Each (dtype,
    device) has its own open bucket, since one flat buffer holds one dtype on one device.
    A bucket closes when the next parameter would take it past the cap, so a bucket is at most
    ``bucket_size_mb`` MiB, except that a parameter larger than the cap gets a bucket of its
    own. (torch DDP closes a bucket once it *reaches* the cap, so its buckets are at least
    the cap; and it makes its first bucket 1 MiB. Compare bucket counts, not only sizes.)
    Buckets are launched in the order in which they are expected to complete: by the
    position of their last parameter.
    """
    cap = math.inf if bucket_size_mb is None else bucket_size_mb * MIB
    open_buckets: dict[tuple, dict] = {}
    closed: list[dict] = []
    for position, index in enumerate(reversed(range(len(params)))):
        p = params[index]
        key, nbytes = (p.dtype, p.device), p.numel() * p.element_size()
        bucket = open_buckets.get(key)
        if bucket is not None and bucket["bytes"] + nbytes > cap:
            closed.append(open_buckets.pop(key))
            bucket = None
        if bucket is None:
            bucket = open_buckets[key] = {"indices": [], "bytes": 0, "last": position}
        bucket["indices"].append(index)
        bucket["bytes"] += nbytes
        bucket["last"] = position
    closed.extend(open_buckets.values())
    closed.sort(key=lambda b: b["last"])
    return [b["indices"] for b in closed]


class _Bucket:
    """One flat buffer and the parameters whose gradients live in it during communication."""

    def __init__(self, index: int, params: list[torch.Tensor]):
        self.index = index
        self.params = params
        numel = sum(p.numel() for p in params)
        self.buffer = torch.empty(numel, dtype=params[0].dtype, device=params[0].device)
        self.views, offset = [], 0  # views[i] is params[i]'s slice, shaped like the parameter
        for p in params:
            self.views.append(self.buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.nbytes = numel * self.buffer.element_size()
        self.reset()

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)  # gradients still to arrive this step
        self.work: dist.Work | None = None


class BucketedDDP(nn.Module):
    """Data parallelism with gradient buckets all-reduced asynchronously during backward.

    ``bucket_size_mb``: the cap per bucket in MiB (2**20 bytes), like torch DDP's
    ``bucket_cap_mb``; ``None`` puts everything (per dtype and device) into one bucket.
    Usage is that of stage 05: ``loss.backward()``, then ``finish_gradient_synchronization()``,
    then ``optimizer.step()``; ``no_sync()`` for gradient accumulation.

    Invariants that keep every rank in step (collectives are matched by the ORDER in which each
    rank issues them; Gloo even runs two of them at once on its two worker threads):

    1. Every rank builds the same buckets (same model, same rule) and launches each bucket
       exactly once per synchronised step, in bucket-index order. A bucket that completes
       before an earlier one waits until all earlier buckets have been launched.
    2. A bucket whose gradients did not all arrive in this backward on this rank (an unused
       branch) is launched by ``finish_gradient_synchronization()``, still in index order,
       with zeros standing in for the missing gradients, so every rank issues the same calls.
    3. ``finish_gradient_synchronization()`` always ends with one small all-reduce of "had a
       gradient" flags (one int per parameter): a gradient missing on some ranks becomes the
       mean with zeros for them; missing on every rank, ``.grad`` stays ``None``. That is the
       rule of stages 03 and 04 and of single-process training.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float | None = 25.0,
                 process_group=None):
        super().__init__()
        self.bucket_size_mb = check_bucket_size_mb(bucket_size_mb)  # before any collective
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("BucketedDDP needs an initialised process group: call "
                               "torch.distributed.init_process_group(...) first")
        if not any(p.requires_grad for p in module.parameters()):
            raise ValueError("BucketedDDP: the module has no parameters that require grad, so "
                             "there is nothing to synchronise; wrap a trainable model")
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        broadcast_module_state(module, process_group)

        # module.parameters() yields a tied (shared) parameter once, so it is reduced once.
        self._params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = [_Bucket(b, [self._params[i] for i in indices])
                        for b, indices in enumerate(assign_buckets(self._params, self.bucket_size_mb))]
        self._hooks = []
        for bucket in self.buckets:
            for slot, p in enumerate(bucket.params):
                hook = weak_hook(self, bucket.index, slot)  # indices, not objects: see weak_hook
                self._hooks.append(p.register_post_accumulate_grad_hook(hook))
        backend = dist.get_backend(process_group)
        self._flag_device = (self._params[0].device if backend == "nccl" and self._params
                             else torch.device("cpu"))
        self._require_sync = True
        self._next = 0  # index of the next bucket to launch

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) for the backwards run inside."""
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    # -- inside backward ---------------------------------------------------------------

    def _on_grad_ready(self, bucket_index: int, slot: int, param: torch.Tensor) -> None:
        bucket = self.buckets[bucket_index]
        # The hook gets the parameter, not the gradient, and fires on every backward.
        if not self._require_sync:
            return
        if bucket.ready[slot]:
            raise RuntimeError(
                "BucketedDDP: a gradient became ready twice before finish_gradient_synchronization(); "
                "call it after every synchronised backward (or run extra backwards inside no_sync())")
        bucket.ready[slot] = True
        bucket.pending -= 1
        # Copy into the bucket now, while the gradient is fresh in cache, and divide by the
        # world size on the way (one pass instead of two): the SUM all-reduce then gives the mean.
        torch.div(param.grad, self.world_size, out=bucket.views[slot])
        if bucket.pending == 0:
            self._launch_ready_in_order()

    def _launch_ready_in_order(self) -> None:
        # Invariant 1: strictly in index order, whatever order this rank's gradients came in.
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            bucket = self.buckets[self._next]
            bucket.work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
            self._next += 1

    # -- after backward ----------------------------------------------------------------

    def finish_gradient_synchronization(self) -> None:
        """Launch the buckets backward did not, wait for all, and copy the means out."""
        if not self._require_sync or not self.buckets:  # inside no_sync(): nothing to do
            return
        # Invariant 2: the rest, in index order on every rank. A parameter without a fresh
        # gradient contributes what its .grad holds (gradients accumulated under no_sync(),
        # zeros left by zero_grad(set_to_none=False)) or zeros when it has none.
        for bucket in self.buckets[self._next:]:
            for slot, p in enumerate(bucket.params):
                if not bucket.ready[slot]:
                    if p.grad is None:
                        bucket.views[slot].zero_()
                    else:
                        torch.div(p.grad, self.world_size, out=bucket.views[slot])
            bucket.work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
        self._next = len(self.buckets)

        # Invariant 3: one int per parameter, "I had a gradient", summed over ranks.
        flags = torch.tensor([p.grad is not None for p in self._params], dtype=torch.int32,
                             device=self._flag_device)
        flag_work = dist.all_reduce(flags, group=self.process_group, async_op=True)

        missing_here = []
        for bucket in self.buckets:  # launch order: the first bucket finishes first
            bucket.work.wait()
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is None:
                    missing_here.append((p, view))
                else:
                    p.grad.copy_(view)
            bucket.reset()
        flag_work.wait()
        if missing_here:  # only ranks that lacked a gradient need to read the flags
            had_grad = dict(zip(map(id, self._params), flags.tolist()))
            for p, view in missing_here:
                if had_grad[id(p)] > 0:  # someone had one: the mean, zeros for us
                    p.grad = view.clone()
                # else: missing on every rank, .grad stays None (single-process behaviour)
        self._next = 0


# --------------------------------------------------------------------------- the overhead model


def comm_after_backward_model(n_buckets: float, total_bytes: float, o_s: float,
                              w_bytes_per_s: float) -> float:
    """Seconds of communication left after backward with ``n_buckets`` equal buckets.

    Each bucket pays the per-call overhead ``o``; all of them but the last overlap with
    backward, so what is left is ``n_b * o + s / (n_b * w)`` (see the README's derivation).
    """
    return n_buckets * o_s + total_bytes / (n_buckets * w_bytes_per_s)


def best_bucket_size_bytes(total_bytes: float, o_s: float, w_bytes_per_s: float) -> tuple[float, float]:
    """(best bucket size in bytes, best number of buckets): ``sqrt(s*w*o)`` and ``sqrt(s/(w*o))``."""
    n_best = math.sqrt(total_bytes / (w_bytes_per_s * o_s))
    return math.sqrt(total_bytes * w_bytes_per_s * o_s), n_best


# --------------------------------------------------------------------------- harness


def _common():
    """The repo's shared helpers and the stages this one is compared with (harness only)."""
    root = Path(__file__).resolve().parents[1]
    for name in ("", "02_allreduce_bench", "03_naive_ddp", "04_flat_ddp", "05_overlap_ddp"):
        path = str(root / name) if name else str(root)
        if path not in sys.path:
            sys.path.insert(0, path)
    from common import launch, profiling, results, step_bench
    return launch, profiling, results, step_bench


def make_bucketed_ddp(module: nn.Module, bucket_size_mb: float | None = 25.0) -> BucketedDDP:
    """Module-level factory (use functools.partial to pick the bucket size)."""
    return BucketedDDP(module, bucket_size_mb=bucket_size_mb)


def parse_bucket_sizes(text: str) -> list[float]:
    """'1,10,100,1000' -> [1.0, 10.0, 100.0, 1000.0] (MiB); ValueError naming a bad entry."""
    sizes = []
    for part in text.split(","):
        try:
            size = float(part)
        except ValueError:
            raise ValueError(f"--bucket-sizes entry {part!r} is not a number of MB") from None
        if not size > 0 or math.isinf(size):
            raise ValueError(f"--bucket-sizes entry {part!r} must be a positive, finite number of MB")
        sizes.append(size)
    return sizes


# -- the overhead model against the measured sweep -----------------------------------------


def measure_latency_bandwidth(ctx, sizes_bytes=(2**12, 2**16, 2**20, 2**22, 2**24)) -> dict:
    """Fit t = a + N / w from a quick all-reduce sweep, when stage 02 left no fit behind."""
    # Stage 02's least-squares fit (pure arithmetic, not its harness): the same t = a + N / w
    # whether stage 02 or this fallback measured the points.
    from allreduce_bench import fit_latency_bandwidth
    from common import timing
    times = []
    for nbytes in sizes_bytes:
        x = torch.zeros(nbytes // 4, dtype=torch.float32, device=ctx.device)
        stats = timing.gather_times(timing.measure(lambda: dist.all_reduce(x), ctx.device,
                                                   warmup=3, iters=10, barrier=True))
        times.append(stats.median)
    a, w = fit_latency_bandwidth(list(sizes_bytes), times)
    return {"a_s": a, "w_bytes_per_s": w, "source": "measured in this run",
            "sizes_bytes": list(sizes_bytes), "times_s": times}


def latency_bandwidth(ctx, results) -> dict:
    """Stage 02's fitted (a, w) for this backend/device/world size, else measure them now.

    Call on every rank. Rank 0 alone reads results/allreduce_fit.json and broadcasts what it
    found: under multi-node torchrun each node has its own results/, and if one node measured
    (collectives) while another read a file (none), the run would hang.
    """
    key = f"{ctx.backend}/{ctx.device.type}/{ctx.world_size}"
    decision = [None]  # rank 0's answer: the fit to use, or the reason to measure
    if ctx.is_main:
        fit = (results.read_json("allreduce_fit.json") or {}).get(key)
        run = os.environ.get("RESULTS_RUN_ID")  # set by make bench: only this run's fit counts
        if fit and run and fit.get("run_id") != run:
            decision[0] = f"the fit for {key} is from another run"
        elif fit and fit.get("a_s", 0) > 0 and 0 < fit.get("w_bytes_per_s", 0) < math.inf:
            decision[0] = {"a_s": fit["a_s"], "w_bytes_per_s": fit["w_bytes_per_s"],
                           "source": f"results/allreduce_fit.json [{key}] (stage 02)"}
        else:
            decision[0] = "no fit for " + key if not fit else \
                f"unusable fit for {key} (a <= 0 or w infinite)"
    dist.broadcast_object_list(decision, src=0)  # every rank now takes the same branch
    if isinstance(decision[0], dict):
        return decision[0]
    ctx.print(f"({decision[0]} in results/allreduce_fit.json: measuring all-reduce latency and "
              f"bandwidth here; run stage 02 for a better fit)", all_ranks=False)
    return measure_latency_bandwidth(ctx)


def gradient_bytes_and_buckets(model_name: str, context_length: int, sizes: list[float]):
    """Total trainable gradient bytes of the LM and the bucket count at each cap (meta device:
    nothing allocated)."""
    from common import models
    with torch.device("meta"):
        lm = models.TransformerLM(model_name, context_length=context_length)
    params = [p for p in lm.parameters() if p.requires_grad]
    total = sum(p.numel() * p.element_size() for p in params)
    return total, {size: len(assign_buckets(params, size)) for size in sizes}


def model_vs_sweep(ctx, args, sweep_rows: list[dict], fit: dict,
                   json_name: str = "bucket_model.json") -> dict:
    """Print the model's prediction beside the measured sweep (rank 0); save the summary under
    ``results/<json_name>`` keyed by backend/device/world size/model; return it."""
    _, _, results, _ = _common()
    sizes = [float(r["bucket_mb"]) for r in sweep_rows]
    s, n_buckets = gradient_bytes_and_buckets(args.model, args.context_length, sizes)
    o, w = fit["a_s"], fit["w_bytes_per_s"]
    best_bytes, n_best = best_bucket_size_bytes(s, o, w)
    best_mb = best_bytes / MIB
    predicted_best_ms = comm_after_backward_model(max(1.0, n_best), s, o, w) * 1e3
    rows = []
    for r in sweep_rows:
        nb = n_buckets[float(r["bucket_mb"])]
        rows.append({"bucket_mb": r["bucket_mb"], "buckets": nb,
                     "model_comm_after_bwd_ms": comm_after_backward_model(nb, s, o, w) * 1e3,
                     "measured_comm_after_bwd_ms": r["comm_after_backward_ms"],
                     "measured_step_ms": r["step_ms"]})
    by_step = min(rows, key=lambda r: r["measured_step_ms"])
    order = sorted(sizes)
    i = order.index(float(by_step["bucket_mb"]))
    lo, hi = order[max(0, i - 1)], order[min(len(order) - 1, i + 1)]
    within = lo <= best_mb <= hi
    summary = {
        "model": args.model, "gradient_bytes": s, "o_s": o, "w_bytes_per_s": w,
        "fit_source": fit["source"], "predicted_best_bucket_mb": best_mb,
        "predicted_best_n_buckets": n_best, "predicted_comm_after_backward_ms": predicted_best_ms,
        "measured_best_bucket_mb": float(by_step["bucket_mb"]),
        "measured_best_step_ms": by_step["measured_step_ms"],
        "neighbour_range_mb": [lo, hi], "prediction_within_neighbours": within,
        "sweep": rows, "machine": results.machine_name(), "run_id": results.run_id(),
        "backend": ctx.backend, "device": ctx.device.type, "world_size": ctx.world_size,
    }
    if ctx.is_main:
        print(f"\nOverhead model (README): s = {s / MIB:.1f} MiB of gradients, o = {o * 1e6:.0f} us "
              f"per all-reduce, w = {w / 1e9:.2f} GB/s ({fit['source']})\n"
              f"  comm left after backward ~ n_b * o + s / (n_b * w), smallest at "
              f"n_b = sqrt(s / (w o)) = {n_best:.1f} buckets,\n"
              f"  i.e. a bucket size of sqrt(s w o) = {best_mb:.1f} MiB, leaving about "
              f"{predicted_best_ms:.1f} ms after backward", flush=True)
        results.print_table(rows, title="model vs measured, BucketedDDP sweep:")
        print(f"measured best bucket size (by step time): {by_step['bucket_mb']} MB; predicted "
              f"{best_mb:.1f} MiB is {'within' if within else 'OUTSIDE'} the best and its "
              f"neighbours [{lo:g}, {hi:g}] MB", flush=True)
        key = f"{ctx.backend}/{ctx.device.type}/{ctx.world_size}/{args.model}"
        saved = results.read_json(json_name) or {}
        saved[key] = summary
        results.write_json(json_name, saved)
    return summary


# -- workers --------------------------------------------------------------------------


def sweep_cases(sizes: list[float], with_earlier_stages: bool):
    """BucketedDDP and torch DDP at every size (torch DDP at its default 25 MB is added by
    the harness), and stages 03-05 for comparison."""
    _, _, _, step_bench = _common()
    cases = []
    if with_earlier_stages:
        from flat_ddp import FlatDDP
        from naive_ddp import NaiveDDP
        from overlap_ddp import OverlapDDP
        cases += [("naive", None, NaiveDDP), ("flat", None, FlatDDP), ("overlap", None, OverlapDDP)]
    for size in sizes:
        cases.append(("bucketed", size, functools.partial(make_bucketed_ddp, bucket_size_mb=size)))
    for size in sizes:
        if size != step_bench.TORCH_DDP_DEFAULT_BUCKET_MB:
            cases.append(("torch_ddp", size, step_bench.torch_ddp_factory(size)))
    return cases


def sweep_and_model(ctx, args, with_earlier_stages: bool, demo: bool = False) -> None:
    """The sweep and the model beside it. ``demo`` (the plain run's quick sweep): write to
    results/ddp_step_demo.csv and bucket_model_demo.json instead, so that a `make run` never
    replaces the rows and model entry of a real --bench of the same model."""
    _, _, results, step_bench = _common()
    fit = latency_bandwidth(ctx, results)
    rows = step_bench.run_step_bench(
        ctx, sweep_cases(args.bucket_sizes, with_earlier_stages), args,
        csv_name=step_bench.DEMO_CSV_NAME if demo else step_bench.CSV_NAME)
    model_vs_sweep(ctx, args, [r for r in rows if r["impl"] == "bucketed"], fit,
                   json_name="bucket_model_demo.json" if demo else "bucket_model.json")
    if ctx.is_main:
        best = min((r for r in rows if r["impl"] == "bucketed"), key=lambda r: r["step_ms"])
        ref = [r for r in rows if r["impl"] == "torch_ddp"]
        print(f"BucketedDDP at its best size ({best['bucket_mb']} MB): {best['step_ms']:.1f} ms/step "
              f"= {best['ratio_vs_torch_ddp']:.2f}x torch DDP at its default 25 MB; torch DDP's best "
              f"over the same sizes: {min(r['step_ms'] for r in ref):.1f} ms", flush=True)


def data_parallel_main(ctx, args) -> None:
    """Plain run: verify against one process, then the model and a quick sweep (tiny LM)."""
    _, _, _, step_bench = _common()
    # 1 KiB buckets: the toy models get several buckets, the tiny LM about one per tensor.
    factory = functools.partial(make_bucketed_ddp, bucket_size_mb=1 / 1024)
    if not step_bench.verify_ddp(ctx, factory, "BucketedDDP (1 KiB buckets)"):
        raise SystemExit(1)
    ctx.print(f"\nquick sweep on the {args.model} LM (--bench --model small for the real one):",
              all_ranks=False)
    sweep_and_model(ctx, args, with_earlier_stages=False, demo=True)


def step_bench_main(ctx, args) -> None:
    """--bench: the sweep, with stages 03-05 and torch DDP in the same run, and the model."""
    sweep_and_model(ctx, args, with_earlier_stages=True)


def profile_main(ctx, args) -> None:
    """--profile: traces per rank and a timeline, NaiveDDP (03) above BucketedDDP (06)."""
    _, profiling, _, _ = _common()
    from naive_ddp import NaiveDDP
    bucketed = functools.partial(make_bucketed_ddp, bucket_size_mb=args.bucket_size_mb)
    summaries = profiling.profile_ddp(
        ctx, [("naive (03)", NaiveDDP), (f"bucketed (06, {args.bucket_size_mb:g} MB)", bucketed)],
        args, name="06_bucketed_ddp")
    if ctx.is_main:
        profiling.print_summary(summaries)


def main(argv=None) -> None:
    launch, profiling, _, step_bench = _common()
    parser = launch.make_parser(__doc__)
    parser.add_argument("--bench", action="store_true",
                        help="benchmark: BucketedDDP swept over --bucket-sizes, torch DDP at the "
                             "same sizes and at its default, stages 03-05, all in one run")
    parser.add_argument("--bucket-sizes", default=None,
                        help="comma-separated bucket caps in MB (MiB, as torch's bucket_cap_mb); "
                             "default 1,10,100,1000 with --bench, 0.25,1,4 for the plain run's "
                             "quick sweep on the tiny LM")
    parser.add_argument("--bucket-size-mb", type=float, default=25.0,
                        help="bucket cap for --profile")
    step_bench.add_step_bench_args(parser)
    profiling.add_profile_args(parser)
    args = parser.parse_args(argv)
    try:
        args.bucket_sizes = parse_bucket_sizes(
            args.bucket_sizes or ("1,10,100,1000" if args.bench else "0.25,1,4"))
        check_bucket_size_mb(args.bucket_size_mb)
    except (TypeError, ValueError) as e:
        launch.usage_error(str(e).replace("bucket_size_mb", "--bucket-size-mb"))
    config = launch.resolve(args)
    step_bench.check_step_bench_args(args, config)
    if args.bench:
        launch.launch(step_bench_main, config, args)
    elif args.profile:
        launch.launch(profile_main, config, args)
    else:  # the plain run's sweep is a short one
        args.steps, args.warmup = min(args.steps, 5), min(args.warmup, 2)
        launch.launch(data_parallel_main, config, args)


if __name__ == "__main__":
    main()
