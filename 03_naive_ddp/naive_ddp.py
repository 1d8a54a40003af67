"""Stage 03: naive data-parallel training (DDP), one all-reduce per gradient.

What it teaches. Data parallelism in its plainest form: every rank holds a full copy of the
model, trains on its own slice of the global batch, and after ``backward()`` the ranks
average their gradients so that every copy takes the same optimizer step. Three rules make
the copies stay identical:

1. start equal: broadcast rank 0's parameters *and buffers* when wrapping the model;
2. see different data: rank r gets the r-th slice of each global batch;
3. step equal: all-reduce (sum) every gradient, divide by ``world_size``, then step.

Why averaging gives single-process training: with the loss a mean over the batch and equal
slices of size b = B / world_size,

    grad L(B) = (1/B) sum_i grad l_i = (1/world_size) sum_r [ (1/b) sum_{i in slice r} grad l_i ]
              = mean over ranks of each rank's local gradient.

"Naive" because it calls ``all_reduce`` once per parameter, after the whole backward pass:
a model with P parameter tensors pays P call latencies, and the network idles while
backward runs. Stage 04 makes one call; stages 05 and 06 overlap it with backward.

Run it (trains two toy models under NaiveDDP beside one process; exit 1 on a difference):
    python 03_naive_ddp/naive_ddp.py --world-size 3
    torchrun --nproc-per-node=2 03_naive_ddp/naive_ddp.py

Use it in your own loop (this file needs only torch; copy it anywhere):
    model = NaiveDDP(model)                  # after dist.init_process_group(...)
    loss_fn(model(x_local), y_local).backward()
    model.finish_gradient_synchronization()  # after backward, before optimizer.step()
    optimizer.step()
"""

from __future__ import annotations

import sys
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


class NaiveDDP(nn.Module):
    """Wrap ``module`` for data-parallel training: one ``all_reduce`` per gradient.

    The wrapped model stays reachable as ``.module``; ``forward`` calls it unchanged. Call
    :meth:`finish_gradient_synchronization` after ``backward()`` and before
    ``optimizer.step()``; afterwards every rank holds the gradient averaged over ranks.

    Parameters with ``requires_grad=False`` are never synchronised (they have no gradient).
    A parameter whose gradient is ``None`` on some ranks this step (a branch of the model
    that those ranks skipped) counts as a zero gradient there, like torch DDP with
    ``find_unused_parameters=True``; one that is ``None`` on every rank stays ``None``, so
    the optimizer skips it as it would in single-process training.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        # parameters() yields a tied (shared) weight once, so it is reduced once, not twice.
        self._trainable = [p for p in module.parameters() if p.requires_grad]
        if not self._trainable:
            raise ValueError("NaiveDDP: no parameters require grad: nothing to synchronise")
        broadcast_module_state(module)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        world_size = dist.get_world_size()
        params = self._trainable
        # Which parameters got a gradient this step, on any rank? Every rank must make the
        # same sequence of all_reduce calls or the collectives pair up wrongly and hang, so
        # the ranks first agree on it with one small all-reduce of 0/1 flags.
        has_grad = torch.tensor([p.grad is not None for p in params],
                                dtype=torch.float32, device=params[0].device)
        dist.all_reduce(has_grad)
        for p, used_somewhere in zip(params, has_grad.tolist()):
            if used_somewhere == 0:
                continue  # no rank used it: leave it None, as single-process training would
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # skipped here, used elsewhere: contributes 0
            dist.all_reduce(p.grad)  # sum over ranks, one call per parameter (the "naive")
            p.grad.div_(world_size)  # ... / world_size = the average


# --------------------------------------------------------------------------- harness


def verify_main(ctx) -> None:
    """Train beside one process (common/verify.py); exit 1 on a difference."""
    from common import verify
    if not verify.verify_ddp(ctx, NaiveDDP, "NaiveDDP"):
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
