"""The claim of stages 03-06, checked: data-parallel training equals training on one process.

The gradient of a mean loss over the whole batch is the mean over ranks of each rank's
gradient on its equal slice. So ranks that start from the same weights (the broadcast),
average their gradients (the all-reduce) and take the same optimizer step stay equal to one
process trained on the whole batch: up to float32 rounding against it (the sums run in
another order), and bitwise across ranks. ``check_ddp`` runs that experiment; ``verify_ddp``
runs it on three models and prints a line each. The tests add the edge cases.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import models


def check_ddp(ctx, wrap, build, make_optimizer, make_batch, steps: int,
              rtol: float, atol: float) -> tuple[bool, bool, float]:
    """Train ``wrap(build())`` and a one-process copy side by side for ``steps`` steps on
    ``make_batch(step) -> (x, y, loss_fn)``, the global batch (the same on every rank, in equal
    slices). Returns (allclose to one process after every step, bitwise equal across ranks,
    the largest difference seen)."""
    torch.manual_seed(1000 + ctx.rank)  # every rank starts somewhere else ...
    model = build().to(ctx.device)
    ddp = wrap(model)                    # ... until the wrapper broadcasts rank 0's weights
    torch.manual_seed(1000)              # the reference starts where rank 0 started
    reference = build().to(ctx.device)
    optimizer, ref_optimizer = make_optimizer(model), make_optimizer(reference)
    close, same, worst = True, True, 0.0
    for step in range(steps):
        x, y, loss_fn = make_batch(step)
        b = len(x) // ctx.world_size
        mine = slice(ctx.rank * b, (ctx.rank + 1) * b)

        optimizer.zero_grad(set_to_none=True)             # data parallel: my slice,
        loss_fn(ddp(x[mine]), y[mine]).backward()
        ddp.finish_gradient_synchronization()             # the averaged gradient,
        optimizer.step()                                  # the same step everywhere

        ref_optimizer.zero_grad(set_to_none=True)         # one process: the whole batch
        loss_fn(reference(x), y).backward()
        ref_optimizer.step()

        for p, q in zip(model.parameters(), reference.parameters()):
            worst = max(worst, (p - q).abs().max().item())
            close &= torch.allclose(p, q, rtol=rtol, atol=atol)
        mine_flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        everyone = [torch.empty_like(mine_flat) for _ in range(ctx.world_size)]
        dist.all_gather(everyone, mine_flat)
        same &= all(torch.equal(e, everyone[0]) for e in everyone)
    return close, same, worst


def verify_ddp(ctx, wrap, name: str, steps: int = 5) -> bool:
    """``check_ddp`` on the toy model (a frozen parameter and a bias that does not train),
    the tied model (one weight used twice) and the tiny Transformer LM. Prints one line per
    model on rank 0 (every rank prints a failure); True when every check passed everywhere."""
    def toy_batch(step):  # global batches of 4 (toy) and 2 (LM) rows per rank: equal slices
        x, y = models.random_regression_data(4 * ctx.world_size, seed=100 + step)
        return x.to(ctx.device), y.to(ctx.device), F.mse_loss

    def lm_batch(step):
        return (*models.random_tokens(2 * ctx.world_size, 32, seed=step, device=ctx.device),
                models.lm_loss)
    # (label, model, optimizer, batches, steps, tolerance). The LM's longer sums round more,
    # and AdamW turns any gradient, however small, into a step of about lr: 3 steps there.
    cases = [
        ("ToyModel + SGD", models.ToyModel,
         lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1,
                                   momentum=0.9), toy_batch, steps, (1e-5, 1e-6)),
        ("TiedModel + AdamW", models.TiedModel,
         lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), toy_batch, steps, (1e-5, 1e-6)),
        ("TransformerLM tiny + AdamW", lambda: models.TransformerLM("tiny", context_length=32),
         lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), lm_batch, 3, (1e-4, 1e-5)),
    ]
    ctx.print(f"{name} on {ctx.world_size} ranks ({ctx.backend}/{ctx.device.type}) against one "
              f"process on the whole batch:", all_ranks=False)
    all_ok = True
    for label, build, make_optimizer, make_batch, n, (rtol, atol) in cases:
        close, same, worst = check_ddp(ctx, wrap, build, make_optimizer, make_batch, n, rtol, atol)
        flag = torch.tensor([float(close and same)],
                            device=ctx.device if ctx.backend == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # ok only if ok on every rank
        ok = bool(flag.item())
        all_ok &= ok
        ctx.print(f"  [{'ok' if ok else 'FAIL'}] {label:<27} {n} steps: max |weight - one "
                  f"process| {worst:.1e} (allclose rtol={rtol:g} atol={atol:g}: {close}); "
                  f"bitwise equal across ranks: {same}", all_ranks=not (close and same))
    return all_ok
