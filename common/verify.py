"""The claim of stages 03-06, checked: data-parallel training equals one process trained on
the whole batch, up to float32 rounding (the sums run in another order: 1.2e-7 relative an
addition, so rtol 1e-5 leaves 10-100x room), and stays bitwise equal across ranks."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import models

TOLERANCE = (1e-5, 1e-6)  # (rtol, atol): a gradient 0.1% off fails


def agree_on_problems(problems: list[str], group=None) -> list[str]:
    """Every rank's problems on every rank: one verdict, so all raise or none waits forever."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, problems, group=group)
    return [f"rank {rank}: {p}" for rank, theirs in enumerate(everyone) for p in theirs]


def verify_ddp(ctx, wrap, name: str, steps: int = 5) -> bool:
    """``wrap(model)`` beside one process on ToyModel + SGD and TiedModel + AdamW: a line each;
    True when every check passed on every rank."""
    cases = [("ToyModel + SGD", models.ToyModel, lambda m: torch.optim.SGD(
                 [p for p in m.parameters() if p.requires_grad], lr=0.1, momentum=0.9)),
             ("TiedModel + AdamW", models.TiedModel, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))]
    ctx.print(f"{name} on {ctx.world_size} ranks ({ctx.backend}/{ctx.device.type}) against one "
              "process on the whole batch:", all_ranks=False)
    all_ok = True
    for label, build, make_optimizer in cases:
        torch.manual_seed(1000 + ctx.rank)   # every rank starts somewhere else ...
        model = build().to(ctx.device)
        ddp = wrap(model)                     # ... until the wrapper broadcasts rank 0's weights
        torch.manual_seed(1000)               # the reference starts where rank 0 started
        reference = build().to(ctx.device)
        optimizer, ref_optimizer = make_optimizer(model), make_optimizer(reference)
        close, same, grad_diff, weight_diff, rank_diff = True, True, 0.0, 0.0, 0.0
        for step in range(steps):
            x, y = (t.to(ctx.device) for t in models.random_regression_data(4 * ctx.world_size, seed=step))
            mine = slice(ctx.rank * 4, ctx.rank * 4 + 4)
            optimizer.zero_grad(set_to_none=True)      # data parallel: my slice,
            F.mse_loss(ddp(x[mine]), y[mine]).backward()
            ddp.finish_gradient_synchronization()      # the averaged gradient
            ref_optimizer.zero_grad(set_to_none=True)  # one process: the whole batch
            F.mse_loss(reference(x), y).backward()
            for p, q in zip(model.parameters(), reference.parameters()):
                close &= (p.grad is None) == (q.grad is None)
                if p.grad is not None and q.grad is not None:
                    grad_diff = max(grad_diff, (p.grad - q.grad).abs().max().item())
                    close &= torch.allclose(p.grad, q.grad, *TOLERANCE)
            optimizer.step()
            ref_optimizer.step()
            for p, q in zip(model.parameters(), reference.parameters()):
                weight_diff = max(weight_diff, (p - q).abs().max().item())
                close &= torch.allclose(p, q, *TOLERANCE)
            flat = torch.cat([p.detach().flatten() for p in model.parameters()])
            everyone = [torch.empty_like(flat) for _ in range(ctx.world_size)]
            dist.all_gather(everyone, flat)
            for e in everyone:
                same &= torch.equal(e, everyone[0])
                rank_diff = max(rank_diff, (e - everyone[0]).abs().max().item())
        ok = not agree_on_problems([] if close and same else [label])
        all_ok &= ok
        across = f"bitwise equal across ranks: {same}"
        if not same:
            across += f" (max |weight - rank 0's| {rank_diff:.1e})"
        ctx.print(f"  [{'ok' if ok else 'FAIL'}] {label:<18} {steps} steps: max |grad - one process| "
                  f"{grad_diff:.1e}, |weight - one process| {weight_diff:.1e} (allclose "
                  f"rtol={TOLERANCE[0]:g} atol={TOLERANCE[1]:g}: {close}); {across}",
                  all_ranks=not ok)
    return all_ok
