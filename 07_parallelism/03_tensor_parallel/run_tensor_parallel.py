"""Stage 07, lesson 3, runnable: tensor and sequence parallelism (tensor_parallel.py) beside one
process.

Every rank builds the same full layers (same seed), keeps its slices, and runs one forward and
backward on the same data as one process: the MLP split both ways (Megatron's ``f`` and ``g``;
an all-gather after every layer), then a block of the course LM in plain tensor parallel (TP),
with sequence parallelism (TP + SP), and torch's ``parallelize_module`` as the control
(torch_tensor_parallel.py; left out, in one line, where the pair cannot carry torch's
coalesced collectives: Gloo with CUDA tensors). Each rank compares its part of the output and
of every gradient with one process's; one verdict on every rank, exit 1 on a difference.
--d-ff, --heads and --seq divide by the world size, --d-model by --heads.

    python 07_parallelism/03_tensor_parallel/run_tensor_parallel.py           # 2 ranks
    python 07_parallelism/03_tensor_parallel/run_tensor_parallel.py --world-size 4 --d-model 128 --heads 8
    torchrun --nproc-per-node=4 07_parallelism/03_tensor_parallel/run_tensor_parallel.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import tensor_parallel as tp
import torch_tensor_parallel as torch_tp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: common/
from common import launch, models, verify  # noqa: E402

# float32 sums in another order (t partial sums instead of one): differences of a few 1e-7
# relative; a missing collective or a wrong slice is off by the size of the values.
RTOL = 1e-4
ATOL = 1e-5


def compare(checks: dict, model: str, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    checks.setdefault(model, []).append(
        (what, (got - want).abs().max().item(), torch.allclose(got, want, rtol=RTOL, atol=ATOL)))


def my_tokens(x: torch.Tensor, ctx) -> torch.Tensor:
    return x.chunk(ctx.world_size, dim=1)[ctx.rank]  # [b, s, h] -> this rank's [b, s/t, h]


def check_mlp(ctx, args, variant: str, checks: dict) -> None:
    torch.manual_seed(0)  # every rank: the same full MLP and data
    full = tp.MLP(args.d_model, args.d_ff).to(ctx.device)
    x = torch.randn(args.batch, args.seq, args.d_model, device=ctx.device)
    target = torch.randn_like(x)
    mlp = tp.VARIANTS[variant](full)  # this rank's slices of the same weights
    x_full = x.clone().requires_grad_(True)  # dX matters: it feeds the layer below
    x_mine = x.clone().requires_grad_(True)
    F.mse_loss(full(x_full), target).backward()  # one process
    out = mlp(x_mine)
    F.mse_loss(out, target).backward()           # t ranks
    name = f"MLP, {variant}"
    compare(checks, name, "output", out, full(x_full))
    compare(checks, name, "input.grad", x_mine.grad, x_full.grad)
    for param_name, param in mlp.named_parameters():  # against its part of the full gradient
        layer = getattr(mlp, param_name.split(".")[0])
        want = layer.local_part(full.get_parameter(param_name).grad)
        compare(checks, name, f"{param_name}.grad", param.grad, want)


def check_block(ctx, args, with_torch: bool, checks: dict) -> None:
    torch.manual_seed(0)  # every rank: the same full block and data
    full = models.Block(args.d_model, args.d_ff, args.heads).to(ctx.device)
    x = torch.randn(args.batch, args.seq, args.d_model, device=ctx.device)
    probe = torch.randn_like(x)  # dL/d(output): a random direction, so every gradient is used
    x_full = x.clone().requires_grad_(True)
    want_out = full(x_full)
    want_out.backward(probe)     # one process
    for name, sequence_parallel in (("block, TP", False), ("block, TP + SP", True)):
        block = tp.TensorParallelBlock(full, sequence_parallel=sequence_parallel)
        mine = (lambda t: my_tokens(t, ctx)) if sequence_parallel else (lambda t: t)
        x_mine = mine(x).clone().requires_grad_(True)  # SP: this rank's tokens in, its tokens out
        out = block(x_mine)
        out.backward(mine(probe))
        block.all_reduce_replicated_grads()  # the LayerNorms' partial sums (SP only)
        compare(checks, name, "output", out, mine(want_out))
        compare(checks, name, "input.grad", x_mine.grad, mine(x_full.grad))
        for param_name, param in block.named_parameters():  # the full block's names
            want = full.get_parameter(param_name).grad
            owner = block.get_submodule(param_name.rsplit(".", 1)[0])
            if isinstance(owner, (tp.ColumnParallelLinear, tp.RowParallelLinear)):
                want = owner.local_part(want)  # a parallel layer: its slice
            compare(checks, name, f"{param_name}.grad", param.grad, want)
    if with_torch:  # the control: torch's plan on the same weights, sequence parallel
        block = torch_tp.parallelize_block(full, None, ctx.device.type)
        x_mine = my_tokens(x, ctx).clone().requires_grad_(True)
        out = block(x_mine)
        out.backward(my_tokens(probe, ctx))
        compare(checks, "block, torch TP + SP", "output", out, my_tokens(want_out, ctx))
        compare(checks, "block, torch TP + SP", "input.grad", x_mine.grad,
                my_tokens(x_full.grad, ctx))


def demo(ctx, args) -> None:
    with_torch = launch.carries_point_to_point(ctx.backend, ctx.device.type)
    if not with_torch:
        ctx.print(f"torch's parallelize_module control: left out on {ctx.backend}/"
                  f"{ctx.device.type}, which cannot carry DTensor's coalesced collectives",
                  all_ranks=False)
    checks = {}
    for variant in args.variants:
        check_mlp(ctx, args, variant, checks)
    check_block(ctx, args, with_torch, checks)
    problems = []
    for model, rows in checks.items():
        for what, diff, ok in rows:
            if not ok:
                problems.append(f"{model} {what}: differs from one process by {diff:.3g}")
    problems = verify.agree_on_problems(problems)  # every rank's, on every rank
    ctx.print(f"Tensor parallel on {ctx.world_size} ranks ({ctx.backend}/{ctx.device.type}): MLP "
              f"{args.d_model} -> {args.d_ff} -> {args.d_model}, block with {args.heads} heads, "
              f"batch {args.batch} x seq {args.seq}; against one process (rank 0's part):",
              all_ranks=False)
    for model, rows in checks.items():
        worst = max(diff for _, diff, _ in rows)
        matched = sum(ok for _, _, ok in rows)
        ctx.print(f"  {model:20}: {matched}/{len(rows)} allclose (output, input.grad, parameter "
                  f"gradients), max |diff| {worst:.1e}", all_ranks=False)
    for problem in problems:
        ctx.print(problem, all_ranks=False)
    if problems:
        raise SystemExit(1)
    total = sum(len(rows) for rows in checks.values())
    ctx.print(f"all {total} checks passed on every rank", all_ranks=False)


def build_parser(doc: str | None = __doc__):
    """The demo's flags (the lab's measurement takes the same ones)."""
    parser = launch.make_parser(doc, world_size=2)
    for flag, default, what in (("--d-model", 64, "MLP and block input/output width"),
                                ("--d-ff", 256, "MLP hidden width"),
                                ("--batch", 8, "sequences per batch"),
                                ("--seq", 16, "tokens per sequence"),
                                ("--heads", 4, "attention heads of the block")):
        parser.add_argument(flag, type=launch.positive_int, default=default, help=what)
    parser.add_argument("--variants", type=launch.choice_list(list(tp.VARIANTS)),
                        default=list(tp.VARIANTS), help="subset of " + ",".join(tp.VARIANTS))
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    launch.launch(demo, launch.resolve(args), args)


if __name__ == "__main__":
    main()
