"""Stage 05: overlap gradient communication with the backward pass.

Stages 03 and 04 wait until ``loss.backward()`` has finished and only then start talking to
the other ranks, so every millisecond of communication is added to the step. But backward
produces gradients one layer at a time, last layer first: the last layer's gradient is final
long before the first layer's has even been computed. ``OverlapDDP`` starts an asynchronous
all-reduce (``async_op=True``) for each gradient the moment autograd has finished writing it
(``register_post_accumulate_grad_hook``), so communication runs *while* backward computes the
rest; ``finish_gradient_synchronization()`` only waits for what is still in flight.

The class is a drop-in for ``NaiveDDP`` (stage 03): ``.module``, forward delegation, rank 0's
parameters and buffers broadcast at construction, ``finish_gradient_synchronization()``
between ``backward()`` and ``optimizer.step()``, and ``no_sync()`` for gradient accumulation.

Run it (trains two toy models under OverlapDDP beside one process; exit 1 on a difference):
    python 05_overlap_ddp/overlap_ddp.py --world-size 3
    torchrun --nproc-per-node=2 05_overlap_ddp/overlap_ddp.py

The class below needs only torch: copy this file into another project and
``from overlap_ddp import OverlapDDP``.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

# --------------------------------------------------------------------------- the algorithm


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


class OverlapDDP(nn.Module):
    """Data parallelism that all-reduces each gradient as soon as backward has produced it.

    Usage, per step::

        loss = loss_fn(ddp(x), y)
        loss.backward()                         # all-reduces start inside backward
        ddp.finish_gradient_synchronization()   # wait for them; grads now hold the mean
        optimizer.step()

    Invariants that keep every rank in step (collectives are matched by the ORDER in which each
    rank issues them, not by name or by tensor):

    1. Every rank launches exactly one all-reduce per trainable parameter per synchronised
       step, in the same fixed order: reverse registration order, roughly the order in which
       backward produces the gradients. A gradient that arrives "early" (before one that comes
       earlier in that order) waits until all earlier ones have been launched.
    2. A parameter that gets no gradient in this backward on this rank (an unused branch) never
       fires its hook, so it and everything after it is launched by
       ``finish_gradient_synchronization()``, still in the fixed order, with zeros standing in
       for the missing gradient. Every rank therefore issues the same sequence of calls.
    3. ``finish_gradient_synchronization()`` always ends with one small all-reduce of "had a
       gradient" flags (one int per parameter), so a rank can tell "missing here only" (the
       gradient is the mean with zeros for the ranks that lacked it) from "missing on every
       rank" (``.grad`` stays ``None``, as in single-process training). That is the same rule
       as stages 03 and 04.
    """

    def __init__(self, module: nn.Module, process_group=None):
        super().__init__()
        if not any(p.requires_grad for p in module.parameters()):
            raise ValueError("OverlapDDP: no parameters require grad: nothing to synchronise")
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        broadcast_module_state(module, process_group)

        # module.parameters() yields a tied (shared) parameter once, so it is reduced once.
        # Reversed: backward runs from the output back to the input, so the last registered
        # parameters usually get their gradients first.
        self._params = [p for p in reversed(list(module.parameters())) if p.requires_grad]
        self._hooks = [
            p.register_post_accumulate_grad_hook(weak_hook(self, i))
            for i, p in enumerate(self._params)]
        # Flags travel on the GPU only where the backend demands it (NCCL); on Gloo a CPU
        # tensor avoids a device round trip.
        backend = dist.get_backend(process_group)
        self._flag_device = self._params[0].device if backend == "nccl" else torch.device("cpu")
        self._require_sync = True
        self._reset_step_state()

    def _reset_step_state(self) -> None:
        self._ready = [False] * len(self._params)  # hook fired in this synchronised backward
        self._next = 0                             # index of the next parameter to launch
        self._works: list[tuple[int, torch.Tensor, dist.Work]] = []

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) for the backwards run inside.

        For gradient accumulation: k micro-batches inside ``no_sync()``, then one more backward
        outside it and ``finish_gradient_synchronization()``; that last backward all-reduces the
        accumulated sum, once.
        """
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    # -- inside backward ---------------------------------------------------------------

    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        # The post-accumulate hook gets the parameter (its .grad is final for this backward)
        # and fires on EVERY backward, also inside no_sync(): hence the gate.
        if not self._require_sync:
            return
        if self._ready[index]:
            raise RuntimeError(
                "OverlapDDP: a gradient became ready twice before finish_gradient_synchronization(); "
                "call it after every synchronised backward (or run extra backwards inside no_sync())")
        self._ready[index] = True
        self._launch_ready_in_order()

    def _launch_ready_in_order(self) -> None:
        # Invariant 1: launch strictly in index order, so that every rank issues the same
        # sequence however its own gradients happen to arrive.
        while self._next < len(self._params) and self._ready[self._next]:
            grad = self._params[self._next].grad
            work = dist.all_reduce(grad, group=self.process_group, async_op=True)
            self._works.append((self._next, grad, work))
            self._next += 1

    # -- after backward ----------------------------------------------------------------

    def finish_gradient_synchronization(self) -> None:
        """Launch what backward did not, wait for every all-reduce, and average."""
        if not self._require_sync:  # inside no_sync(): nothing to do
            return
        # Invariant 2: what is left is launched in the same order on every rank. A parameter
        # without a gradient here contributes zeros (or whatever .grad already holds, e.g.
        # gradients accumulated under no_sync() or zeros left by zero_grad(set_to_none=False)).
        for index in range(self._next, len(self._params)):
            param = self._params[index]
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            work = dist.all_reduce(grad, group=self.process_group, async_op=True)
            self._works.append((index, grad, work))
        self._next = len(self._params)

        # Invariant 3: one int per parameter, "I had a gradient", summed over ranks.
        flags = torch.tensor([p.grad is not None for p in self._params], dtype=torch.int32,
                             device=self._flag_device)
        flag_work = dist.all_reduce(flags, group=self.process_group, async_op=True)

        missing_here = []
        for index, grad, work in self._works:  # in launch order: the first finishes first
            work.wait()
            param = self._params[index]
            if param.grad is None:
                missing_here.append((param, grad))
            else:
                param.grad.div_(self.world_size)  # SUM -> mean; .grad was reduced in place
        flag_work.wait()
        if missing_here:  # only ranks that lacked a gradient need to read the flags
            had_grad = dict(zip(map(id, self._params), flags.tolist()))
            for param, grad in missing_here:
                if had_grad[id(param)] > 0:  # someone had one: the mean, zeros for us
                    param.grad = grad.div_(self.world_size)
                # else: missing on every rank, .grad stays None (single-process behaviour)
        self._reset_step_state()


# --------------------------------------------------------------------------- harness


def verify_main(ctx) -> None:
    """Train beside one process (common/verify.py); exit 1 on a difference."""
    from common import verify
    if not verify.verify_ddp(ctx, OverlapDDP, "OverlapDDP"):
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
