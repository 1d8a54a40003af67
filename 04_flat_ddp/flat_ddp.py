"""Stage 04: flat data-parallel training, all gradients in one all-reduce.

What it teaches. Stage 03 called ``all_reduce`` once per parameter tensor. Every call pays a
fixed cost (launching the collective, a handshake between ranks, for Gloo a round of
messages per step of its algorithm) on top of the time that is proportional to the bytes.
In the latency-bandwidth model of stage 02, reducing P tensors of total size s costs

    naive:  P * a + s / w          flat:  1 * a + s / w   (+ two memory copies of s bytes)

so flattening wins whenever P * a is large next to the cost of copying s bytes twice, i.e.
for models with many small tensors (a Transformer has biases and LayerNorm weights of a few
KB each). The change from stage 03 is in ``finish_gradient_synchronization``: concatenate
the gradients into one buffer (what ``torch._utils._flatten_dense_tensors`` does; here into a
buffer reused across steps), all-reduce it once,
divide by ``world_size``, and copy the slices back (``_unflatten_dense_tensors``).

Still after backward: the network idles while backward runs (stages 05 and 06 fix that).

Run it (trains two toy models under FlatDDP beside one process; exit 1 on a difference):
    python 04_flat_ddp/flat_ddp.py --world-size 3
    torchrun --nproc-per-node=2 04_flat_ddp/flat_ddp.py

Use it in your own loop (this file needs only torch; copy it anywhere):
    model = FlatDDP(model)                   # after dist.init_process_group(...)
    loss_fn(model(x_local), y_local).backward()
    model.finish_gradient_synchronization()  # after backward, before optimizer.step()
    optimizer.step()
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _unflatten_dense_tensors

# --------------------------------------------------------------------------- the algorithm


def broadcast_module_state(module: nn.Module, group=None) -> None:
    """Make every rank start from rank 0's parameters and buffers: buffers too (BatchNorm's
    running statistics) and frozen parameters, since they are state as much as the weights.
    (The same code in stages 03-06, on purpose: each file stays copyable on its own.)"""
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.detach(), src=src, group=group)


class FlatDDP(nn.Module):
    """Wrap ``module`` for data-parallel training: one ``all_reduce`` of all gradients.

    The wrapped model stays reachable as ``.module``; ``forward`` calls it unchanged. Call
    :meth:`finish_gradient_synchronization` after ``backward()`` and before
    ``optimizer.step()``; afterwards every rank holds the gradient averaged over ranks.

    Parameters with ``requires_grad=False`` are never synchronised (they have no gradient).
    A parameter whose gradient is ``None`` on some ranks this step (a branch of the model
    that those ranks skipped) counts as a zero gradient there, like torch DDP with
    ``find_unused_parameters=True``; one that is ``None`` on every rank stays ``None``, so
    the optimizer skips it as it would in single-process training.

    A flat buffer holds one dtype on one device, so parameters are grouped by (device,
    dtype): one all-reduce per group, which is exactly one for an ordinary model.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        # parameters() yields a tied (shared) weight once, so it is reduced once, not twice.
        groups: dict[tuple, list[nn.Parameter]] = defaultdict(list)
        for p in module.parameters():
            if p.requires_grad:
                groups[(p.device, p.dtype)].append(p)
        if not groups:
            raise ValueError("FlatDDP: no parameters require grad: nothing to synchronise")
        self._groups = list(groups.values())
        # One flat buffer per group, allocated at the first step and reused: a fresh buffer
        # of every gradient's bytes each step costs page faults and zeroing (see the README).
        self._flat_buffers: list[torch.Tensor | None] = [None] * len(self._groups)
        broadcast_module_state(module)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        world_size = dist.get_world_size()
        for i, params in enumerate(self._groups):
            # A gradient missing here (a skipped branch) goes in as zeros, so every rank
            # sends a buffer of the same layout. The ranks must also learn whether anyone
            # had that gradient: one 0/1 flag per parameter rides at the end of the same
            # buffer, so agreeing on it costs no extra call.
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            has_grad = torch.tensor([p.grad is not None for p in params],
                                    dtype=grads[0].dtype, device=grads[0].device)
            # One copy in (s bytes). This is _flatten_dense_tensors(grads + [has_grad]),
            # a torch.cat of the flattened tensors, written into the buffer kept from the
            # last step instead of a new one.
            flat = torch.cat([t.reshape(-1) for t in grads + [has_grad]],
                             out=self._flat_buffers[i])
            self._flat_buffers[i] = flat
            dist.all_reduce(flat)                              # the one call
            flat.div_(world_size)                              # sum -> average
            *averaged, used_somewhere = _unflatten_dense_tensors(flat, grads + [has_grad])
            for p, g, avg, used in zip(params, grads, averaged, used_somewhere.tolist()):
                if used == 0:
                    continue  # no rank had it: stays None, as in single-process training
                g.copy_(avg)  # one copy out: s bytes (into the existing .grad, or the zeros)
                if p.grad is None:
                    p.grad = g


# --------------------------------------------------------------------------- harness


def verify_main(ctx) -> None:
    """Train beside one process (common/verify.py); exit 1 on a difference."""
    from common import verify
    if not verify.verify_ddp(ctx, FlatDDP, "FlatDDP"):
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
