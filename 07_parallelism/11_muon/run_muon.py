"""Stage 07, lesson 11, runnable: Muon (muon.py) beside torch.optim.Muon, and its four
distributed designs, each beside Muon on one process.

1. The control, one process, 3 steps on the tiny LM's first block's matrices, the same
   gradients. bfloat16 weights: both iterate in bfloat16, bitwise equal. float32 weights: torch
   still iterates in bfloat16 (8 significant bits): an entry of its orthogonal matrix lands up
   to about 2^-7 from ours; allowed 2^-5, so a weight 2^-5 lr sqrt(max(1, rows/cols)) per step.
2. Each design on N ranks, and FSDPMuon on lesson 2's FSDP: four matrices (wide, tall, square,
   wide; rows not a multiple of N), float64, 5 steps, each rank on its slice of the batch,
   beside Muon on one process over the whole batch: within 1e-10.
3. The same for the tiny LM, float64, 3 steps, Muon on the blocks' matrices and AdamW on the
   embeddings, the head and the 1-D weights: the loss and the weights within 1e-10.

Every rank reaches the same verdict; a difference is named and exits 1.

    python 07_parallelism/11_muon/run_muon.py --world-size 4
    torchrun --nproc-per-node=2 07_parallelism/11_muon/run_muon.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from muon import DESIGNS, FSDPMuon, Muon, Sharded, copy_flat, deal, ns_flops
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: common/

TOLERANCE = 1e-10  # float64: the sums run in another order, each rounding by 1e-16 relative
LR = 0.02


def fsdp_class():
    from common import import_stage
    return import_stage("07_parallelism/02_fsdp/fsdp").FSDP


# --------------------------------------------------------------------------- 1. the control


def control(device) -> tuple[list[str], list[str]]:
    """Muon beside torch.optim.Muon, 3 steps on the tiny LM's first block's matrices, the
    same gradients. Returns the lines to print and the problems."""
    from common import models
    torch.manual_seed(0)
    matrices = block_matrices(models.TransformerLM("tiny", context_length=16))[:4]  # block 0
    lines = []
    problems = []
    steps = 3
    for dtype in (torch.bfloat16, torch.float32):
        ours = [param.detach().to(device, dtype, copy=True).requires_grad_() for param in matrices]
        theirs = [param.detach().to(device, dtype, copy=True).requires_grad_() for param in matrices]
        optimizers = (Muon(ours, lr=LR, weight_decay=0.1), torch.optim.Muon(theirs, lr=LR, weight_decay=0.1))
        for step in range(steps):
            generator = torch.Generator().manual_seed(step)
            for a, b in zip(ours, theirs):
                a.grad = torch.randn(a.shape, generator=generator).to(device, dtype)
                b.grad = a.grad.clone()
            for optimizer in optimizers:
                optimizer.step()
        diffs = [(a - b).abs().max().item() for a, b in zip(ours, theirs)]
        for a, diff in zip(ours, diffs):
            allowed = 0.0  # bfloat16: the same operations on the same numbers
            if dtype == torch.float32:
                allowed = steps * 2 ** -5 * LR * max(1, a.shape[0] / a.shape[1]) ** 0.5
            if diff > allowed:
                problems.append(f"control, {dtype}: a {tuple(a.shape)} matrix is off by {diff:.2e} > {allowed:.2e}")
        lines.append(f"  {str(dtype):15} max |Muon - torch.optim.Muon| {max(diffs):.2e}")
    return lines, problems


# --------------------------------------------------------------------------- 2. the designs


def matrices_model(device) -> nn.Module:
    """Four matrices, x [B, 12] -> [B, 7] -> [B, 16] -> [B, 16] -> [B, 3]: weights 7 x 12
    (wide), 16 x 7 (tall), 16 x 16 (square), 3 x 16 (wide; rows not a multiple of 2 or 4)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 7, bias=False), nn.Tanh(), nn.Linear(7, 16, bias=False),
                          nn.Tanh(), nn.Linear(16, 16, bias=False), nn.Tanh(), nn.Linear(16, 3, bias=False))
    return model.to(device, torch.float64)


def batch(step: int, world_size: int, device):
    """The global batch: 4 rows per rank."""
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(4 * world_size, 12, generator=generator, dtype=torch.float64)
    y = torch.randn(4 * world_size, 3, generator=generator, dtype=torch.float64)
    return x.to(device), y.to(device)


def train_matrices(ctx, make_optimizer, steps: int = 5, fsdp: bool = False) -> dict:
    """``make_optimizer(params)`` (or ``make_optimizer(params, fsdp)``) on this rank's slice,
    beside Muon on one process: the largest difference in the weights and in this rank's momentum
    (its rows where sharded; the weights alone miss gradients summed), its momentum bytes, its weights flat."""
    reference = matrices_model(ctx.device)
    model = matrices_model(ctx.device)
    one_process = Muon(reference.parameters(), lr=LR, weight_decay=0.1)
    if fsdp:
        wrapped = fsdp_class()(model, reduce_dtype=torch.float64)
        optimizer = make_optimizer(list(wrapped.parameters()), wrapped)
    else:
        wrapped = model
        optimizer = make_optimizer(list(model.parameters()))
    mine = slice(4 * ctx.rank, 4 * ctx.rank + 4)
    for step in range(steps):
        x, y = batch(step, ctx.world_size, ctx.device)
        nn.functional.mse_loss(reference(x), y).backward()
        one_process.step()
        one_process.zero_grad()
        nn.functional.mse_loss(wrapped(x[mine]), y[mine]).backward()
        if fsdp:
            wrapped.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad()
    weights = list(wrapped.gather_full_params().values()) if fsdp else list(model.parameters())
    diff = max((a - b).abs().max().item() for a, b in zip(weights, reference.parameters()))
    momentum_diff = 0.0
    for param, ref in zip(wrapped.parameters(), reference.parameters()):
        if param in optimizer.state:                 # an owner's matrices, or every rank's rows
            buf = optimizer.state[param]["momentum_buffer"]
            want = one_process.state[ref]["momentum_buffer"]
            if isinstance(optimizer, Sharded):       # k rows of the zero-padded [N k, cols]
                want = optimizer.padded(param, want)[ctx.rank * len(buf):(ctx.rank + 1) * len(buf)]
            momentum_diff = max(momentum_diff, (buf - want).abs().max().item())
    held = sum(state["momentum_buffer"].nbytes for state in optimizer.state.values())
    return {"diff": diff, "momentum_diff": momentum_diff, "momentum_bytes": held,
            "weights": torch.cat([weight.detach().flatten() for weight in weights])}


def design_makers() -> dict:
    """Name -> make_optimizer, for train_matrices."""
    makers = {}
    for name, design in DESIGNS.items():
        makers[name] = lambda params, design=design: design(params, lr=LR, weight_decay=0.1)
    makers["fsdp"] = lambda params, fsdp: FSDPMuon(params, fsdp, lr=LR, weight_decay=0.1)
    return makers


def flops_per_rank(shapes, world_size: int) -> dict:
    """Newton-Schulz FLOPs each rank runs per step, per design (the owners' dealing)."""
    costs = [ns_flops(shape) for shape in shapes]
    owner = deal(list(range(len(shapes))), costs, world_size)
    owned = [sum(cost for i, cost in enumerate(costs) if owner[i] == rank) for rank in range(world_size)]
    return {"replicated": [sum(costs)] * world_size, "owner": owned, "sharded": owned, "fsdp": owned}


def step_bytes(name: str, shapes, world_size: int, element_size: int = 8) -> float:
    """Bytes one step of design ``name`` sends, summed over the ranks (muon.py's docstring):
    M the matrices' bytes, M' with their rows padded to N ceil(rows / N)."""
    n = world_size
    whole = sum(rows * cols for rows, cols in shapes) * element_size                    # M
    padded = sum(n * -(-rows // n) * cols for rows, cols in shapes) * element_size    # M'
    return {"replicated": 2 * (n - 1) * whole, "owner": 2 * (n - 1) * whole,
            "sharded": 2 * (n - 1) * (n + 1) / n * padded, "fsdp": 2 * (n - 1) / n * padded}[name]


# --------------------------------------------------------------------------- 3. the LM


def lm_optimizers(lm, muon_params, make_muon):
    """Muon on the blocks' matrices, AdamW on everything else."""
    others = [param for param in lm.parameters() if not any(param is m for m in muon_params)]
    return make_muon(muon_params), torch.optim.AdamW(others, lr=1e-3)


def block_matrices(module) -> list:
    return [param for name, param in module.named_parameters() if param.ndim == 2 and "blocks." in name]


def train_lm(ctx, name: str, steps: int = 3) -> dict:
    """The tiny LM, float64: ``name``'s design (or FSDPMuon) beside one process. Returns the
    largest differences in the loss and the weights."""
    from common import models
    torch.manual_seed(0)
    reference = models.TransformerLM("tiny", context_length=16).to(ctx.device, torch.float64)
    lm = models.TransformerLM("tiny", context_length=16).to(ctx.device, torch.float64)
    lm.load_state_dict(reference.state_dict())
    one_process = lm_optimizers(reference, block_matrices(reference), lambda ps: Muon(ps, lr=LR))
    if name == "fsdp":
        model = fsdp_class()(lm, reduce_dtype=torch.float64, units=list(lm.blocks))
        shards = block_matrices(model)
        optimizers = lm_optimizers(model, shards, lambda ps: FSDPMuon(ps, model, lr=LR))
    else:
        model = lm
        optimizers = lm_optimizers(lm, block_matrices(lm), lambda ps: DESIGNS[name](ps, lr=LR))
    loss_diff = 0.0
    mine = slice(2 * ctx.rank, 2 * ctx.rank + 2)
    for step in range(steps):
        x, y = models.random_tokens(2 * ctx.world_size, 16, seed=step, device=ctx.device)
        want = models.lm_loss(reference(x), y)
        want.backward()
        loss = models.lm_loss(model(x[mine]), y[mine])
        loss.backward()
        if name == "fsdp":
            model.finish_gradient_synchronization()
        else:  # AdamW's gradients: averaged here (the Muon designs average their own)
            grads = [param.grad for param in optimizers[1].param_groups[0]["params"]]
            flat = torch.cat([grad.flatten() for grad in grads])
            dist.all_reduce(flat)
            copy_flat(flat / ctx.world_size, grads)
        for optimizer in (*one_process, *optimizers):
            optimizer.step()
            optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        loss_diff = max(loss_diff, abs(total.item() / ctx.world_size - want.item()))
    weights = model.gather_full_params() if name == "fsdp" else dict(lm.named_parameters())
    reference_weights = dict(reference.named_parameters())
    weight_diff = max((weights[key] - reference_weights[key]).abs().max().item() for key in reference_weights)
    return {"loss_diff": loss_diff, "weight_diff": weight_diff}


# --------------------------------------------------------------------------- the run


def check_main(ctx) -> None:
    from common import verify
    n = ctx.world_size
    lines, problems = control(ctx.device)
    ctx.print("1. Muon beside torch.optim.Muon, one process, the tiny LM's block 0, 3 steps:", all_ranks=False)
    for line in lines:
        ctx.print(line, all_ranks=False)

    shapes = [module.weight.shape for module in matrices_model("cpu") if isinstance(module, nn.Linear)]
    flops = flops_per_rank(shapes, n)
    ctx.print(f"2. four matrices {', '.join('x'.join(map(str, s)) for s in shapes)}, float64, 5 steps, "
              f"{n} ranks vs Muon on one process:", all_ranks=False)
    ctx.print(f"  {'design':11} {'weights':>8} {'momentum':>8}  {'bytes/step':>10}  {'momentum B, rank 0':>18}  "
              f"Newton-Schulz kFLOP per rank (dealt)", all_ranks=False)
    for name, make in design_makers().items():
        found = train_matrices(ctx, make, fsdp=name == "fsdp")
        if max(found["diff"], found["momentum_diff"]) > TOLERANCE:
            problems.append(f"{name}: off one process by {found['diff']:.2e} (weights), "
                            f"{found['momentum_diff']:.2e} (momentum)")
        per_rank = "/".join(f"{f / 1e3:.0f}" for f in flops[name])
        sent = step_bytes(name, shapes, n)
        ctx.print(f"  {name:11} {found['diff']:8.1e} {found['momentum_diff']:8.1e}  {sent:10.0f}  "
                  f"{found['momentum_bytes']:18}  {per_rank}",
                  all_ranks=False)

    ctx.print(f"3. tiny LM, float64, 3 steps, Muon + AdamW, {n} ranks vs one process:", all_ranks=False)
    for name in [*DESIGNS, "fsdp"]:
        found = train_lm(ctx, name)
        if max(found.values()) > TOLERANCE:
            problems.append(f"{name}: the LM differs from one process: loss by "
                            f"{found['loss_diff']:.2e}, weights by {found['weight_diff']:.2e}")
        ctx.print(f"  {name:11} loss {found['loss_diff']:.1e}  weights {found['weight_diff']:.1e}", all_ranks=False)

    problems = verify.agree_on_problems(problems)
    for problem in problems:
        ctx.print(problem, all_ranks=False)
    ctx.print("all checks passed" if not problems else "SOME CHECKS FAILED", all_ranks=bool(problems))
    if problems:
        raise SystemExit(1)


def main(argv=None) -> None:
    from common import launch
    parser = launch.make_parser(__doc__)
    args = parser.parse_args(argv)
    launch.launch(check_main, launch.resolve(args))


if __name__ == "__main__":
    main()
