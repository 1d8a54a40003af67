"""Stage 07, lesson 3, runnable: tensor and sequence parallelism (tensor_parallel.py) beside one
process.

Every rank builds the same full layers (same seed), keeps its slices of them, and runs one
forward and backward on the same data as the full layer does on one process:

1. the MLP, split both ways: Megatron's column-then-row pair (``f`` and ``g``) and the
   all-gather after every layer;
2. a Transformer block of the course LM, in plain tensor parallel (TP) and with sequence
   parallelism (TP + SP), and torch's own ``parallelize_module`` on the same block as the
   control (torch_tensor_parallel.py).

Each rank compares its part of the output, of the input's gradient and of every parameter's
gradient with the one-process ones (allclose at float32 tolerance). Every rank reaches the same
verdict; what differed is printed, and the run exits 1.

    python 07_parallelism/03_tensor_parallel/run_tensor_parallel.py           # 2 ranks, gloo/cpu
    python 07_parallelism/03_tensor_parallel/run_tensor_parallel.py --world-size 4 --d-model 128 --heads 8
    torchrun --nproc-per-node=4 07_parallelism/03_tensor_parallel/run_tensor_parallel.py
    python 07_parallelism/03_tensor_parallel/run_tensor_parallel.py --bench   # bytes and saved activations

``--bench`` hands the same flags to 07_parallelism/measure/bench_tensor_parallel.py: the bytes
each layer sends and the activations each rank keeps, counted beside their formulas, into
results/tensor_parallel.csv and results/sequence_parallel.csv. On Gloo with CUDA tensors
torch's control is left out, said in one line before the ranks start (torch's DTensor
all-gathers in a way Gloo cannot carry for CUDA tensors); the lesson's own layers run there.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import tensor_parallel as tp
import torch_tensor_parallel as torch_tp

# float32 sums in another order (t partial sums instead of one): differences of a few 1e-7
# relative; a missing collective or a wrong slice is off by the size of the values.
RTOL = 1e-4
ATOL = 1e-5


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


def compare(checks: list, model: str, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    checks.append({"model": model, "checked": what, "max |diff|": (got - want).abs().max().item(),
                   "ok": torch.allclose(got, want, rtol=RTOL, atol=ATOL)})


def my_tokens(x: torch.Tensor, ctx) -> torch.Tensor:
    """This rank's seq/t tokens of [batch, seq, hidden]: the sequence-parallel layout."""
    return x.chunk(ctx.world_size, dim=1)[ctx.rank]


def check_mlp(ctx, cfg: dict, variant: str, checks: list) -> None:
    torch.manual_seed(0)  # every rank: the same full MLP and data
    full = tp.MLP(cfg["d_model"], cfg["d_ff"]).to(ctx.device)
    x = torch.randn(cfg["batch"], cfg["seq"], cfg["d_model"], device=ctx.device)
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
        layer_name, kind = param_name.split(".")
        full_grad = getattr(getattr(full, layer_name), kind).grad
        want = getattr(mlp, layer_name).local_part(full_grad)
        compare(checks, name, f"{param_name}.grad", param.grad, want)


def check_block(ctx, cfg: dict, with_torch: bool, checks: list) -> None:
    from common import models
    torch.manual_seed(0)  # every rank: the same full block and data
    full = models.Block(cfg["d_model"], cfg["d_ff"], cfg["heads"]).to(ctx.device)
    x = torch.randn(cfg["batch"], cfg["seq"], cfg["d_model"], device=ctx.device)
    probe = torch.randn_like(x)  # dL/d(output): a random direction, so every gradient is used
    x_full = x.clone().requires_grad_(True)
    want_out = full(x_full)
    want_out.backward(probe)     # one process
    for sequence_parallel in (False, True):
        block = tp.TensorParallelBlock(full, sequence_parallel=sequence_parallel)
        name = "block, TP"
        x_in = x
        probe_in = probe
        out_want = want_out
        x_grad_want = x_full.grad
        if sequence_parallel:  # this rank's tokens in, its tokens out
            name = "block, TP + SP"
            x_in = my_tokens(x, ctx)
            probe_in = my_tokens(probe, ctx)
            out_want = my_tokens(want_out, ctx)
            x_grad_want = my_tokens(x_full.grad, ctx)
        x_mine = x_in.clone().requires_grad_(True)
        out = block(x_mine)
        out.backward(probe_in)
        block.all_reduce_replicated_grads()  # the LayerNorms' partial sums (SP only)
        compare(checks, name, "output", out, out_want)
        compare(checks, name, "input.grad", x_mine.grad, x_grad_want)
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


def demo(ctx, cfg: dict) -> None:
    from common import verify
    from bench import results
    checks = []
    for variant in cfg["variants"]:
        check_mlp(ctx, cfg, variant, checks)
    check_block(ctx, cfg, cfg["with_torch"], checks)
    problems = []
    for row in checks:
        if not row["ok"]:
            problems.append(f"{row['model']} {row['checked']}: differs from one process by "
                            f"{row['max |diff|']:.3g}")
    problems = verify.agree_on_problems(problems)  # every rank's, on every rank
    if ctx.is_main:
        print(f"Tensor parallel on {ctx.world_size} ranks ({ctx.backend}/{ctx.device.type}, "
              f"{results.machine_name()}): MLP {cfg['d_model']} -> {cfg['d_ff']} -> "
              f"{cfg['d_model']}, block with {cfg['heads']} heads, batch {cfg['batch']} x seq "
              f"{cfg['seq']}")
        results.print_table(checks, "\nAgainst one process (rank 0's part; every rank checks "
                                    "its own):", floatfmt=".3g")
    for problem in problems:
        ctx.print(problem, all_ranks=False)
    if problems:
        raise SystemExit(1)
    ctx.print(f"all {len(checks)} checks passed on every rank", all_ranks=False)


def main() -> None:
    _repo()
    from common import hand_over, launch
    import tp_flags                      # the flags, beside this file (the measurement's too)
    parser = launch.make_parser(__doc__, world_size=2)
    tp_flags.add_flags(parser)
    parser.add_argument("--bench", action="store_true", help="count the bytes sent and the "
                        "activations kept, beside their formulas (07_parallelism/measure/"
                        "bench_tensor_parallel.py, the same flags); rows in results/")
    args = parser.parse_args()
    if args.bench:
        hand_over("07_parallelism/measure/bench_tensor_parallel.py")
    config = launch.resolve(args)
    tp_flags.refuse_bad_sizes(parser, args, config.world_size)
    tp_flags.refuse_too_large(config, args)
    cfg = vars(args)
    why_not = torch_tp.unsupported(config.backend, config.device)
    cfg["with_torch"] = why_not is None
    if why_not is not None:
        print(f"torch's parallelize_module control: left out on {config.backend}/"
              f"{config.device}: {why_not}", flush=True)
    launch.launch(demo, config, cfg)


if __name__ == "__main__":
    main()
