"""The claim of stages 03-06, checked: data-parallel training equals training on one process.

The gradient of a mean loss over the whole batch is the mean over ranks of each rank's
gradient on its equal slice. So ranks that start from the same weights (the broadcast),
average their gradients (the all-reduce) and take the same optimizer step stay equal to one
process trained on the whole batch: up to float32 rounding against it (the sums run in
another order), and bitwise across ranks. ``check_ddp`` runs that experiment, comparing the
averaged gradient and the weights after every step; ``verify_ddp`` runs it on three models and
prints a line each. The tests add the edge cases, and wrappers off by a little (a gradient
0.1% too large, one parameter's update skipped) that the proof must catch.

A check that every rank makes on its own reaches one verdict before anyone acts on it:
``agree`` makes every rank raise, or none. A rank that raised alone would leave the others
waiting in their next collective for a peer that is gone.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import models

# float32 tolerance, (rtol, atol). A data-parallel gradient is the one-process gradient summed
# in another order (each slice, then across ranks), and each reordered addition rounds by up
# to float32's epsilon, 1.2e-7, relative: the gradients, and the toy models' weights, land
# within about 1e-7 of one process, so rtol = 1e-5 (and atol = 1e-6 for entries near zero)
# leaves 10-100x room. The LM's weights need ten times both: AdamW divides each step by the
# gradient's running size, so where a gradient is near zero its rounding can move the weight
# by up to about lr. A wrapper whose gradient is 0.1% off fails every case.
TOY_TOLERANCE = (1e-5, 1e-6)
LM_TOLERANCE = (1e-4, 1e-5)


class CheckFailed(AssertionError):
    """A check failed somewhere: raised by ``agree`` on every rank at once."""


def agree_on_problems(problems: list[str], group=None) -> list[str]:
    """Every rank's list of problems, on every rank of ``group``, each named by its rank: one
    verdict everywhere, so that every rank raises or none does (a rank raising alone would
    leave the others waiting in their next collective). 07's run scripts use it."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, problems, group=group)
    merged = []
    for rank, rank_problems in enumerate(everyone):
        for problem in rank_problems:
            merged.append(f"rank {rank}: {problem}")
    return merged


def agree(problem: str | None, group=None) -> None:
    """One verdict for a check each rank made on its own. ``problem`` is None where it passed,
    else what differed and by how much. Every rank raises ``CheckFailed`` naming each rank
    where it failed (group ranks), or none raises."""
    on_gpu = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    failed = torch.tensor([0.0 if problem is None else 1.0], device=device)
    dist.all_reduce(failed, group=group)  # how many ranks failed: one small call when none did
    if failed.item() == 0:
        return
    problems = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    named = [f"rank {rank}: {text}" for rank, text in enumerate(problems) if text is not None]
    raise CheckFailed("; ".join(named))


def check_ddp(ctx, wrap, build, make_optimizer, make_batch, steps: int,
              rtol: float, atol: float) -> dict:
    """Train ``wrap(build())`` and a one-process copy side by side for ``steps`` steps on
    ``make_batch(step) -> (x, y, loss_fn)``, the global batch (the same on every rank, in equal
    slices). Returns what this rank saw (``verify_ddp`` makes it one verdict): ``close``
    (gradients and weights allclose to one process after every step), ``same`` (weights
    bitwise equal across ranks), and the largest differences seen: ``grad_diff`` and
    ``weight_diff`` against one process, ``rank_diff`` between any rank's weights and
    rank 0's."""
    torch.manual_seed(1000 + ctx.rank)  # every rank starts somewhere else ...
    model = build().to(ctx.device)
    ddp = wrap(model)                    # ... until the wrapper broadcasts rank 0's weights
    torch.manual_seed(1000)              # the reference starts where rank 0 started
    reference = build().to(ctx.device)
    optimizer = make_optimizer(model)
    ref_optimizer = make_optimizer(reference)
    close = True
    same = True
    worst_grad = 0.0
    worst_weight = 0.0
    worst_rank = 0.0
    for step in range(steps):
        x, y, loss_fn = make_batch(step)
        b = len(x) // ctx.world_size
        mine = slice(ctx.rank * b, (ctx.rank + 1) * b)

        optimizer.zero_grad(set_to_none=True)             # data parallel: my slice,
        loss_fn(ddp(x[mine]), y[mine]).backward()
        ddp.finish_gradient_synchronization()             # the averaged gradient,

        ref_optimizer.zero_grad(set_to_none=True)         # one process: the whole batch
        loss_fn(reference(x), y).backward()

        for p, q in zip(model.parameters(), reference.parameters()):
            # the averaged gradient is the whole batch's (None where one process has none)
            close &= (p.grad is None) == (q.grad is None)
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            ref_grad = q.grad if q.grad is not None else torch.zeros_like(q)
            worst_grad = max(worst_grad, (grad - ref_grad).abs().max().item())
            close &= torch.allclose(grad, ref_grad, rtol=rtol, atol=atol)

        optimizer.step()                                  # the same step everywhere
        ref_optimizer.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            worst_weight = max(worst_weight, (p - q).abs().max().item())
            close &= torch.allclose(p, q, rtol=rtol, atol=atol)
        mine_flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        everyone = [torch.empty_like(mine_flat) for _ in range(ctx.world_size)]
        dist.all_gather(everyone, mine_flat)
        same &= all(torch.equal(e, everyone[0]) for e in everyone)
        for e in everyone:  # how far any rank's weights are from rank 0's
            worst_rank = max(worst_rank, (e - everyone[0]).abs().max().item())
    return {"close": close, "same": same, "grad_diff": worst_grad, "weight_diff": worst_weight,
            "rank_diff": worst_rank}


def verify_ddp(ctx, wrap, name: str, steps: int = 5) -> bool:
    """``check_ddp`` on the toy model (a frozen parameter and a bias that does not train),
    the tied model (one weight used twice) and the tiny Transformer LM. Prints one line per
    model on rank 0 (every rank prints its own where the check failed anywhere); True when
    every check passed everywhere, the same answer on every rank."""
    def toy_batch(step):  # global batches of 4 (toy) and 2 (LM) rows per rank: equal slices
        x, y = models.random_regression_data(4 * ctx.world_size, seed=100 + step)
        return x.to(ctx.device), y.to(ctx.device), F.mse_loss

    def lm_batch(step):
        return (*models.random_tokens(2 * ctx.world_size, 32, seed=step, device=ctx.device),
                models.lm_loss)
    # (label, model, optimizer, batches, steps, tolerance). AdamW turns any gradient, however
    # small its rounding, into a step of about lr: 3 steps for the LM.
    cases = [
        ("ToyModel + SGD", models.ToyModel,
         lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1,
                                   momentum=0.9), toy_batch, steps, TOY_TOLERANCE),
        ("TiedModel + AdamW", models.TiedModel,
         lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), toy_batch, steps, TOY_TOLERANCE),
        ("TransformerLM tiny + AdamW", lambda: models.TransformerLM("tiny", context_length=32),
         lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), lm_batch, 3, LM_TOLERANCE),
    ]
    ctx.print(f"{name} on {ctx.world_size} ranks ({ctx.backend}/{ctx.device.type}) against one "
              f"process on the whole batch:", all_ranks=False)
    all_ok = True
    for label, build, make_optimizer, make_batch, n, (rtol, atol) in cases:
        found = check_ddp(ctx, wrap, build, make_optimizer, make_batch, n, rtol, atol)
        flag = torch.tensor([float(found["close"] and found["same"])],
                            device=ctx.device if ctx.backend == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # ok only if ok on every rank
        ok = bool(flag.item())
        all_ok &= ok
        across = f"bitwise equal across ranks: {found['same']}"
        if not found["same"]:
            across += f" (max |weight - rank 0's| {found['rank_diff']:.1e})"
        ctx.print(f"  [{'ok' if ok else 'FAIL'}] {label:<27} {n} steps: max |grad - one process| "
                  f"{found['grad_diff']:.1e}, |weight - one process| {found['weight_diff']:.1e} "
                  f"(allclose rtol={rtol:g} atol={atol:g}: {found['close']}); {across}",
                  all_ranks=not ok)
    return all_ok
