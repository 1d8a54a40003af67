"""Stage 07: tensor parallelism. Split every weight matrix of an MLP across ranks.

Data parallelism copies the whole model onto every rank and splits the batch; tensor
parallelism splits the *layers*: each rank holds a slice of every weight matrix and computes
a slice of every layer's output. The price is communication inside every forward and backward.
Two ways to split ``y = fc2(gelu(fc1(x)))`` over n ranks:

* **Megatron-LM** (Shoeybi et al., 2019, section 3): fc1 *column-parallel* (rank r holds d_ff/n
  of its outputs), GELU on the local slice, fc2 *row-parallel* (the matching d_ff/n of its
  inputs), whose partial sums one all-reduce completes. Two conjugate autograd operators
  carry it all: ``f`` = identity forward / all-reduce backward (before fc1), ``g`` = all-reduce
  forward / identity backward (after fc2): one all-reduce of tokens x d_model each way.
* **All-gather after every layer** (the simplest thing that works): every layer
  column-parallel, its output gathered whole; it also moves the d_ff-wide activation.

The script checks the output, the input's gradient and every parameter's gradient against the
same MLP on one process (the shards are sliced from the same full matrices), counts the bytes
each layer communicates forward and backward (by watching the collectives) beside what the
algorithm predicts; the script fails if any of them differs.

Run:
    python 07_parallelism/03_tensor_parallel/tensor_parallel.py                      # 2 ranks, gloo/cpu
    python 07_parallelism/03_tensor_parallel/tensor_parallel.py --world-size 4
    torchrun --nproc-per-node=4 07_parallelism/03_tensor_parallel/tensor_parallel.py

The algorithm part (everything above the harness) needs torch only: copy this file into
another project and ``from tensor_parallel import ColumnParallelLinear, RowParallelLinear``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# --------------------------------------------------------------------------- the operators
#
# Notation (Megatron's): Y = X A, with A of shape (in, out). nn.Linear stores A transposed,
# weight of shape (out, in), so "A's columns" are nn.Linear's weight *rows*.


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce backward.

    Forward: every rank already has the full input x. Backward: rank r's column slice A_r
    contributes only dY_r A_r^T to dX; the true dX = sum_r dY_r A_r^T, so sum over ranks.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # Clone: autograd may hand the same gradient tensor to other consumers, and
        # all_reduce works in place.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward, identity backward.

    Forward: a row-parallel layer leaves a partial sum X_r B_r on each rank; Y = sum_r X_r B_r.
    Backward: dY/d(X_r B_r) is the identity, and dY is already the same on every rank.
    """

    @staticmethod
    def forward(ctx, partial, group):
        out = partial.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromTensorParallel(torch.autograd.Function):
    """All-gather the last dimension forward; take this rank's slice of the gradient backward.

    Slicing, not summing: every rank runs the *same* downstream computation on the *same*
    gathered tensor (the next layer has an ``f`` in front, the loss is replicated), so the
    gradient arriving here is already the full dL/dY on every rank. Had the downstream left
    per-rank partial gradients, backward would need a reduce-scatter instead (what torch's
    ``torch.distributed.nn.functional.all_gather`` does); summing a complete one multiplies it by n.
    """

    @staticmethod
    def forward(ctx, local, group):
        ctx.rank, ctx.world_size = dist.get_rank(group), dist.get_world_size(group)
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(ctx.world_size)]
        dist.all_gather(parts, local, group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.world_size, dim=-1)[ctx.rank].contiguous(), None


# --------------------------------------------------------------------------- the layers


def _shard(t: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank's contiguous 1/world_size of ``t`` along ``dim`` (size must divide evenly)."""
    if t.shape[dim] % world_size:
        raise ValueError(f"size {t.shape[dim]} is not divisible by world size {world_size}")
    return t.detach().chunk(world_size, dim=dim)[rank].clone()


class ColumnParallelLinear(nn.Module):
    """Y_r = X A_r + b_r: rank r computes out_features / n of the outputs.

    Holds rows [r*k, (r+1)*k) of nn.Linear's (out, in) weight, k = out/n, and the same slice
    of the bias. The input goes through ``f`` (full X on every rank forward, all-reduced dX
    backward). With ``gather_output`` the slices are all-gathered into the full Y.
    """

    SHARD_DIM = {"weight": 0, "bias": 0}  # where each parameter is cut (None: whole)

    def __init__(self, full: nn.Linear, group=None, gather_output: bool = False):
        super().__init__()
        self.group, self.gather_output = group, gather_output
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        self.weight = nn.Parameter(_shard(full.weight, 0, rank, world_size))
        self.bias = nn.Parameter(_shard(full.bias, 0, rank, world_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = CopyToTensorParallel.apply(x, self.group)  # f
        y = F.linear(x, self.weight, self.bias)        # X A_r + b_r
        if self.gather_output:
            y = GatherFromTensorParallel.apply(y, self.group)
        return y


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r B_r + b: rank r holds in_features / n of the inputs.

    Holds columns [r*k, (r+1)*k) of nn.Linear's (out, in) weight. Its input X_r is the output
    slice of a column-parallel layer, so no communication is needed before it; the partial
    products are summed by ``g``. The bias is whole on every rank and added once, *after* the
    all-reduce (added before it, it would be counted n times).
    """

    SHARD_DIM = {"weight": 1, "bias": None}

    def __init__(self, full: nn.Linear, group=None):
        super().__init__()
        self.group = group
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        self.weight = nn.Parameter(_shard(full.weight, 1, rank, world_size))
        # Replicated: its gradient sum_tokens dY is the same on every rank, because dY is.
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x_local, self.weight)                   # X_r B_r
        return ReduceFromTensorParallel.apply(partial, self.group) + self.bias  # g, then b


# --------------------------------------------------------------------------- the MLPs


class MLP(nn.Module):
    """The single-process reference: fc1 (d_model -> d_ff), GELU, fc2 (d_ff -> d_model)."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TensorParallelMLP(nn.Module):
    """Megatron's MLP: f -> column-parallel fc1 -> local GELU -> row-parallel fc2 -> g.

    GELU is elementwise, so applying it to the local slice of fc1's output is exact: no
    communication between the two layers. That is the whole trick of the column-then-row pair.
    """

    def __init__(self, full: MLP, group=None):
        super().__init__()
        self.fc1 = ColumnParallelLinear(full.fc1, group, gather_output=False)
        self.fc2 = RowParallelLinear(full.fc2, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class AllGatherMLP(nn.Module):
    """The simplest split: every layer column-parallel, its output all-gathered at once."""

    def __init__(self, full: MLP, group=None):
        super().__init__()
        self.fc1 = ColumnParallelLinear(full.fc1, group, gather_output=True)
        self.fc2 = ColumnParallelLinear(full.fc2, group, gather_output=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


VARIANTS = {"megatron": TensorParallelMLP, "allgather": AllGatherMLP}


def predicted_comm(variant: str, tokens: int, d_model: int, d_ff: int,
                   element_size: int = 4) -> dict[tuple[str, str], tuple[str, int]]:
    """What each layer must communicate: {(layer, phase): (op, bytes)}, tokens = batch x seq.

    Megatron: fc1's forward nothing (f is the identity), its backward all-reduces dX (tokens x
    d_model); fc2's forward all-reduces Y (tokens x d_model), its backward nothing (g's is the
    identity). All-gather: each layer gathers its output forward and all-reduces dX backward.
    """
    e = element_size
    if variant == "megatron":
        return {("fc1", "forward"): ("-", 0),
                ("fc1", "backward"): ("all_reduce", tokens * d_model * e),
                ("fc2", "forward"): ("all_reduce", tokens * d_model * e),
                ("fc2", "backward"): ("-", 0)}
    if variant == "allgather":
        return {("fc1", "forward"): ("all_gather", tokens * d_ff * e),
                ("fc1", "backward"): ("all_reduce", tokens * d_model * e),
                ("fc2", "forward"): ("all_gather", tokens * d_model * e),
                ("fc2", "backward"): ("all_reduce", tokens * d_ff * e)}
    raise ValueError(f"unknown variant {variant!r}; allowed: {', '.join(VARIANTS)}")


# --------------------------------------------------------------------------- harness


def _repo() -> None:
    """The harness needs common/, the algorithm above does not (same in every stage, on purpose)."""
    root = Path(__file__).resolve().parent
    while not (root / "common" / "launch.py").exists():
        if root == root.parent:
            raise SystemExit(f"{Path(__file__).name}: the algorithm above works on its own; the "
                             "demo and benchmark need the repository around this file (common/)")
        root = root.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


def check_variant(ctx, variant: str, cfg: dict) -> tuple[list[dict], dict]:
    """One forward + backward of the TP MLP and of the one-process MLP on the same data:
    a row per output and gradient compared, and the collectives counted per layer and phase
    (hooks label the counter as fc1/fc2 start their forward and as backward reaches them)."""
    from common import import_stage
    ledger = import_stage("07_parallelism/measure/counters")
    torch.manual_seed(0)  # every rank builds the same full MLP and data, then keeps its shards
    ref = MLP(cfg["d_model"], cfg["d_ff"]).to(ctx.device)
    x = torch.randn(cfg["batch"], cfg["seq"], cfg["d_model"], device=ctx.device)
    target = torch.randn_like(x)
    tp = VARIANTS[variant](ref)
    x_ref, x_tp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)  # dX matters:
    F.mse_loss(ref(x_ref), target).backward()                           # it feeds the layer below
    with ledger.CommCounter() as comm:
        for name in ("fc1", "fc2"):
            getattr(tp, name).register_forward_pre_hook(
                lambda *_, n=name: setattr(comm, "current", f"{n} forward"))
            getattr(tp, name).register_full_backward_pre_hook(
                lambda *_, n=name: setattr(comm, "current", f"{n} backward"))
        out = tp(x_tp)
        F.mse_loss(out, target).backward()
    compared = [("output", out, ref(x_ref)), ("input.grad", x_tp.grad, x_ref.grad)]
    for name in ("fc1", "fc2"):  # each gradient against the matching slice of the full one
        for pname, dim in getattr(tp, name).SHARD_DIM.items():
            full = getattr(getattr(ref, name), pname).grad
            want = full if dim is None else full.chunk(ctx.world_size, dim)[ctx.rank]
            compared.append((f"{name}.{pname}.grad", getattr(getattr(tp, name), pname).grad, want))
    return [{"variant": variant, "checked": what, "max_abs_diff": (got - want).abs().max().item(),
             "ok": torch.allclose(got, want, rtol=1e-4, atol=1e-5)}
            for what, got, want in compared], comm.by_label


def tensor_parallel_main(ctx, cfg: dict) -> None:
    """Check both variants against one process and count their bytes; raise on a mismatch."""
    from common import import_stage, results
    ledger = import_stage("07_parallelism/measure/counters")
    n, tokens, failures, checks, byte_rows = ctx.world_size, cfg["batch"] * cfg["seq"], [], [], []
    for variant in cfg["variants"]:
        rows, counted = check_variant(ctx, variant, cfg)
        checks += rows
        failures += [f"{r['variant']} {r['checked']}: max abs diff {r['max_abs_diff']:.3g}"
                     for r in rows if not r["ok"]]
        for (layer, phase), (op, want) in predicted_comm(variant, tokens, cfg["d_model"],
                                                         cfg["d_ff"]).items():
            got = counted.get(f"{layer} {phase}", {"ops": [], "payload_bytes": 0})
            if got["payload_bytes"] != want or got["ops"] != ([op] if want else []):
                failures.append(f"{variant} {layer} {phase}: counted {got['ops']} "
                                f"{got['payload_bytes']} B, predicted {op} {want} B")
            byte_rows.append({"variant": variant, "layer": layer, "phase": phase, "collective": op,
                              "bytes_counted": got["payload_bytes"], "bytes_predicted": want,
                              "ring_bytes_sent_per_rank": ledger.ring_send_bytes(op, want, n)
                              if want else 0})
    if ctx.is_main:
        where = f"{ctx.backend}/{ctx.device.type} ({results.machine_name()})"
        print(f"Tensor-parallel MLP on {n} ranks: d_model {cfg['d_model']}, d_ff {cfg['d_ff']}, "
              f"{tokens} tokens, {where}")
        results.print_table(checks, "\nAgainst the one-process MLP (rank 0's shards; every rank "
                                    "checks its own):", floatfmt=".3g")
        results.print_table(byte_rows, "\nBytes per layer, one forward + backward (float32):",
                            floatfmt=".0f")
        same = {"backend": ctx.backend, "device": ctx.device.type, "world_size": n,
                "tokens": tokens, "d_model": cfg["d_model"], "d_ff": cfg["d_ff"]}
        results.upsert_csv("tensor_parallel.csv", [{**same, **r, "run_id": results.run_id()}
                                                   for r in byte_rows],
                           key=[*same, "variant", "layer", "phase"])
    if failures:
        raise AssertionError(f"tensor-parallel check failed on rank {ctx.rank}:\n  "
                             + "\n  ".join(failures))
    ctx.print("all checks passed: outputs, every gradient, bytes as predicted", all_ranks=False)


def main(argv=None) -> None:
    _repo()
    from common import launch
    parser = launch.make_parser(__doc__, world_size=2)
    for flag, default, what in (("--d-model", 64, "MLP input/output width"),
                                ("--d-ff", 256, "MLP hidden width"),
                                ("--batch", 8, "sequences per batch"),
                                ("--seq", 16, "tokens per sequence")):
        parser.add_argument(flag, type=launch.positive_int, default=default, help=what)
    parser.add_argument("--variants", type=launch.choice_list(list(VARIANTS)),
                        default=list(VARIANTS), help="comma-separated subset of: "
                        + ", ".join(VARIANTS))
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    n = config.world_size
    if args.d_ff % n:
        parser.error(f"--d-ff {args.d_ff} is not divisible by the tensor-parallel size "
                     f"(world size) {n}")
    if "allgather" in args.variants and args.d_model % n:
        parser.error(f"--d-model {args.d_model} is not divisible by the world size {n} (the "
                     "all-gather variant splits fc2's outputs)")
    from common import results
    results.check_writable()
    launch.launch(tensor_parallel_main, config, vars(args))


if __name__ == "__main__":
    main()
