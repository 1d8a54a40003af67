"""Stage 06: bucketed DDP, overlap (stage 05) plus fewer, larger all-reduces (stage 04).

Stage 05 overlaps communication with backward but pays the per-call overhead of one
all-reduce per parameter; stage 04 pays it once but cannot start before backward ends.
``BucketedDDP`` takes the middle road torch's own DistributedDataParallel takes: parameters
are grouped, in reverse registration order (roughly the order backward produces their
gradients), into buckets of at most ``bucket_size_mb`` MiB, each one flat buffer all-reduced
asynchronously the moment its last gradient arrives. Small buckets overlap well but pay the
overhead often; big ones leave a big last bucket after backward. ``bucket_model.py`` predicts
the best size from stage 02's latency and bandwidth; ``--bench`` sets it beside a sweep.

Run it:
    python 06_bucketed_ddp/bucketed_ddp.py --world-size 2     # verify + model + small sweep
    python 06_bucketed_ddp/bucketed_ddp.py --bench --model small --bucket-sizes 1,10,100,1000
    python 06_bucketed_ddp/bucketed_ddp.py --profile          # torch.profiler traces + timeline
    torchrun --nproc-per-node=2 06_bucketed_ddp/bucketed_ddp.py

The class needs only torch: copy this file anywhere and ``from bucketed_ddp import BucketedDDP``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

# --------------------------------------------------------------------------- the algorithm

MIB = 2 ** 20  # bucket sizes count MiB, as torch DDP's bucket_cap_mb does


def broadcast_module_state(module: nn.Module, group=None) -> None:
    """Make every rank start from rank 0's parameters and buffers: buffers too (BatchNorm's
    running statistics) and frozen parameters, since they are state as much as the weights.
    (The same code in stages 03-06, on purpose: each file stays copyable on its own.)"""
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.detach(), src=src, group=group)


def weak_hook(ddp: nn.Module, *args):
    """A post-accumulate-grad hook calling ``ddp._on_grad_ready(*args, param)`` that does not
    keep ``ddp`` alive. Hooks live in autograd's C++ state, where Python's garbage collector
    cannot see: a hook holding the wrapper (which holds the model, which holds the hook) is a
    cycle never freed, and every wrapper dropped would leak its model. A weak reference breaks
    it. (The same code in 05 and 06, on purpose: each file stays copyable on its own.)"""
    ddp_ref = weakref.ref(ddp)

    def hook(param: torch.Tensor) -> None:
        live = ddp_ref()
        if live is not None:  # the wrapper is gone: leave the gradient alone
            live._on_grad_ready(*args, param)

    return hook


def check_bucket_size_mb(bucket_size_mb) -> float | None:
    """``None`` (one bucket) or a finite number of MiB > 0; anything else is a clear error."""
    if bucket_size_mb is not None and (
            isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, numbers.Real)
            or not 0 < bucket_size_mb < math.inf):
        raise ValueError(f"bucket_size_mb must be a finite number of MiB > 0, or None for one "
                         f"bucket; got {bucket_size_mb!r}")
    return None if bucket_size_mb is None else float(bucket_size_mb)


def assign_buckets(params: list[torch.Tensor], bucket_size_mb: float | None) -> list[list[int]]:
    """Group parameters into buckets: lists of indices into ``params``, in launch order.

    Parameters are taken in reverse registration order. Each (dtype, device) has its own open
    bucket (one flat buffer holds one dtype on one device), closed when the next parameter
    would take it past the cap: at most ``bucket_size_mb`` MiB, unless one parameter alone is
    larger. (torch DDP closes a bucket once it *reaches* the cap, and makes its first 1 MiB:
    compare bucket counts, not only caps.) Buckets launch in the order they should complete.
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

    Stage 05's three invariants keep every rank in step, per bucket instead of per parameter:
    1. every rank builds the same buckets and launches each once per synchronised step, in
       bucket-index order, whatever order its own gradients arrive in;
    2. a bucket not complete after backward (an unused branch) is launched by
       ``finish_gradient_synchronization()``, in the same order, zeros for missing gradients;
    3. one small all-reduce of "had a gradient" flags: missing on some ranks means the mean
       with zeros for them; missing on every rank, ``.grad`` stays ``None``.
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
        self._flag_device = self._params[0].device if backend == "nccl" else torch.device("cpu")
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
        if not self._require_sync:  # the hook fires on every backward, inside no_sync() too
            return
        bucket = self.buckets[bucket_index]
        if bucket.ready[slot]:
            raise RuntimeError(
                "BucketedDDP: a gradient became ready twice before finish_gradient_synchronization(); "
                "call it after every synchronised backward (or run extra backwards inside no_sync())")
        bucket.ready[slot] = True
        bucket.pending -= 1
        # Into the bucket now, while the gradient is fresh in cache, divided by the world size
        # on the way (one pass, not two): the SUM all-reduce then gives the mean.
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
        if not self._require_sync:  # inside no_sync(): nothing to do
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


def sweep_and_model(ctx, args, with_earlier_stages: bool, demo: bool = False) -> None:
    """BucketedDDP and torch DDP at every size (stages 03-05 beside them for --bench), and the
    model's prediction beside the sweep. The plain run's quick sweep (``demo``) writes its own
    files, so a ``make run`` never replaces the rows of a real --bench."""
    from common import import_stage
    from bench import step_bench
    model = import_stage("06_bucketed_ddp/bucket_model")
    fit = model.latency_bandwidth(ctx)
    cases = [("naive", None, import_stage("03_naive_ddp/naive_ddp").NaiveDDP),
             ("flat", None, import_stage("04_flat_ddp/flat_ddp").FlatDDP),
             ("overlap", None, import_stage("05_overlap_ddp/overlap_ddp").OverlapDDP)
             ] if with_earlier_stages else []
    cases += [("bucketed", size, functools.partial(BucketedDDP, bucket_size_mb=size))
              for size in args.bucket_sizes]
    cases += [("torch_ddp", size, step_bench.torch_ddp_factory(size)) for size in args.bucket_sizes
              if size != step_bench.TORCH_DDP_DEFAULT_BUCKET_MB]
    json_name = "bucket_model_demo.json" if demo else "bucket_model.json"

    def model_so_far(rows):  # the model beside the sizes swept so far, written as each lands
        bucketed = [r for r in rows if r["impl"] == "bucketed"]
        if bucketed:
            model.model_vs_sweep(ctx, args, bucketed, fit, json_name, assign_buckets, show=False)
    rows = step_bench.run_step_bench(ctx, cases, args, csv_name=step_bench.DEMO_CSV_NAME
                                     if demo else step_bench.CSV_NAME, after_case=model_so_far)
    model.model_vs_sweep(ctx, args, [r for r in rows if r["impl"] == "bucketed"], fit,
                         json_name, assign_buckets)
    if ctx.is_main:
        best = min((r for r in rows if r["impl"] == "bucketed"), key=lambda r: r["step_ms"])
        print(f"BucketedDDP at its best size ({best['bucket_mb']} MB): {best['step_ms']:.1f} ms/"
              f"step = {best['ratio_vs_torch_ddp']:.2f}x torch DDP at its default 25 MB; torch "
              f"DDP's best: {min(r['step_ms'] for r in rows if r['impl'] == 'torch_ddp'):.1f} ms")


def verify_main(ctx, args) -> None:
    """Plain run: verify against one process (1 KiB buckets: several per toy model), then
    the model and a quick sweep on the tiny LM."""
    from common import verify
    if not verify.verify_ddp(ctx, functools.partial(BucketedDDP, bucket_size_mb=1 / 1024),
                             "BucketedDDP (1 KiB buckets)"):
        raise SystemExit(1)
    if args.check:
        return
    ctx.print(f"quick sweep on the {args.model} LM (--bench for the real one):", all_ranks=False)
    sweep_and_model(ctx, args, with_earlier_stages=False, demo=True)


def bench_main(ctx, args) -> None:
    sweep_and_model(ctx, args, with_earlier_stages=True)


def profile_main(ctx, args) -> None:
    """--profile: traces per rank and a timeline, NaiveDDP (03) above BucketedDDP (06)."""
    from common import import_stage
    from bench import profiling
    profiling.profile_ddp(ctx, [
        ("naive (03)", import_stage("03_naive_ddp/naive_ddp").NaiveDDP),
        (f"bucketed (06, {args.bucket_size_mb:g} MB)",
         functools.partial(BucketedDDP, bucket_size_mb=args.bucket_size_mb))], args,
        name="06_bucketed_ddp")


def main(argv=None) -> None:
    _repo()
    from common import launch
    from bench import profiling, step_bench
    parser = launch.make_parser(__doc__)
    parser.add_argument("--bench", action="store_true",
                        help="BucketedDDP swept over --bucket-sizes, torch DDP at the same sizes "
                             "and at its default, stages 03-05, all in one run")
    parser.add_argument("--bucket-sizes", type=launch.list_of(launch.positive_float), default=None,
                        help="comma-separated bucket caps in MiB; default 1,10,100,1000 with "
                             "--bench, 0.25,1,4 for the plain run's quick sweep")
    parser.add_argument("--bucket-size-mb", type=launch.positive_float, default=25.0,
                        help="bucket cap for --profile")
    step_bench.add_step_bench_args(parser)
    profiling.add_profile_args(parser)
    args = parser.parse_args(argv)
    args.bucket_sizes = args.bucket_sizes or ([1.0, 10.0, 100.0, 1000.0] if args.bench
                                               else [0.25, 1.0, 4.0])
    config = launch.resolve(args)
    if not (args.bench or args.profile):  # the plain run's demo: a batch every world size splits
        args.batch_size = config.world_size * max(1, args.batch_size // config.world_size)
    step_bench.check_step_bench_args(args, config)
    if args.bench:
        launch.launch(bench_main, config, args)
    elif args.profile:
        launch.launch(profile_main, config, args)
    else:  # the plain run's sweep is a short one
        args.steps, args.warmup = min(args.steps, 5), min(args.warmup, 2)
        launch.launch(verify_main, config, args)


if __name__ == "__main__":
    main()
