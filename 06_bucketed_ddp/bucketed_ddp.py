"""Stage 06: bucketed DDP, overlap (stage 05) plus fewer, larger all-reduces (stage 04).

Stage 05 overlaps communication with backward but pays the per-call overhead of one
all-reduce per parameter; stage 04 pays it once but cannot start before backward ends.
``BucketedDDP`` takes the middle road torch's own DistributedDataParallel takes: parameters
are grouped, in reverse registration order (roughly the order backward produces their
gradients), into buckets of at most ``bucket_size_mb`` MiB, each one flat buffer all-reduced
asynchronously the moment its last gradient arrives. Small buckets overlap well but pay the
overhead often; big ones leave a big last bucket after backward. ``bucket_model.py`` predicts
the best size from stage 02's latency and bandwidth.

Run it (trains two toy models under BucketedDDP, 1 KiB buckets, beside one process; exit 1 on
a difference):
    python 06_bucketed_ddp/bucketed_ddp.py --world-size 3
    torchrun --nproc-per-node=2 06_bucketed_ddp/bucketed_ddp.py

The class needs only torch: copy this file anywhere and ``from bucketed_ddp import BucketedDDP``.
"""

from __future__ import annotations

import contextlib
import functools
import math
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
        self.bucket_size_mb = bucket_size_mb
        if not any(p.requires_grad for p in module.parameters()):
            raise ValueError("BucketedDDP: no parameters require grad: nothing to synchronise")
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


def verify_main(ctx) -> None:
    """Train beside one process (common/verify.py) with 1 KiB buckets, several per toy model;
    exit 1 on a difference."""
    from common import verify
    if not verify.verify_ddp(ctx, functools.partial(BucketedDDP, bucket_size_mb=1 / 1024),
                             "BucketedDDP (1 KiB buckets)"):
        raise SystemExit(1)


def main(argv=None) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
    try:
        from common import launch
    except ImportError:  # copied alone: the algorithm above needs torch only
        raise SystemExit(f"{__file__}: this demo needs the repository (common/)")
    config = launch.resolve(launch.make_parser(__doc__).parse_args(argv))
    launch.launch(verify_main, config)


if __name__ == "__main__":
    main()
