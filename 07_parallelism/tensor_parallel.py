"""Stage 07a: tensor parallelism. Split every weight matrix of an MLP across ranks.

Data parallelism (stages 03-06) copies the whole model onto every rank and splits the batch.
Tensor parallelism splits the *layers*: each rank holds a slice of every weight matrix and
computes a slice of every layer's output, so a model too big for one device fits on n of them.
The price is communication inside every forward and every backward pass, on activations.

Two ways to split an MLP ``y = fc2(gelu(fc1(x)))`` across n ranks, both built here:

* **Megatron-LM style** (Shoeybi et al., 2019, "Megatron-LM: Training Multi-Billion Parameter
  Language Models Using Model Parallelism", section 3): fc1 is *column-parallel* (rank r holds
  d_ff/n of its output features), GELU runs on the local slice, fc2 is *row-parallel* (rank r
  holds the matching d_ff/n of its input features) and produces a partial sum that one
  all-reduce completes. Two conjugate autograd operators carry the communication:
  ``f`` = identity forward / all-reduce backward (before fc1) and
  ``g`` = all-reduce forward / identity backward (after fc2). One all-reduce forward, one
  backward, each of batch x seq x d_model floats, per MLP.
* **All-gather after every layer** (the simplest thing that works): every layer is
  column-parallel and its output slices are all-gathered into the full activation, so the
  next layer sees what it would see on one process. It moves the d_ff-wide activation too.

The script checks the output, the input's gradient and every parameter's gradient against the
same MLP on one process (the shards are sliced from the same full matrices), prints the bytes
each layer communicates forward and backward (counted by the autograd functions and predicted
from the algorithm; they must agree), and trains a few SGD steps whose losses match the
single-process ones.

Run:
    python 07_parallelism/tensor_parallel.py                      # 2 ranks, gloo/cpu
    python 07_parallelism/tensor_parallel.py --world-size 4
    torchrun --nproc-per-node=4 07_parallelism/tensor_parallel.py

The algorithm part (everything above the harness) needs torch only: copy this file into
another project and ``from tensor_parallel import ColumnParallelLinear, RowParallelLinear``.
"""

from __future__ import annotations

import copy
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# --------------------------------------------------------------------------- bookkeeping


class CommLog:
    """Bytes handed to collectives, per (layer, phase): the instrumented side of the byte table.

    ``phase`` is "forward" or "backward"; ``op`` the collective. The payload counted is the
    size of the full tensor the collective produces (what all_reduce reduces, what all_gather
    assembles), the usual way to state a collective's size (nccl-tests does the same).
    """

    def __init__(self):
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.ops: dict[tuple[str, str], str] = {}

    def add(self, layer: str, phase: str, op: str, nbytes: int) -> None:
        self.bytes[(layer, phase)] += nbytes
        self.ops[(layer, phase)] = op

    def clear(self) -> None:
        self.bytes.clear()
        self.ops.clear()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _log(log: CommLog | None, layer: str, phase: str, op: str, t: torch.Tensor) -> None:
    if log is not None:
        log.add(layer, phase, op, _nbytes(t))


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
    def forward(ctx, x, group, log, layer):
        ctx.group, ctx.log, ctx.layer = group, log, layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # Clone: autograd may hand the same gradient tensor to other consumers, and
        # all_reduce works in place.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        _log(ctx.log, ctx.layer, "backward", "all_reduce", grad)
        return grad, None, None, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward, identity backward.

    Forward: a row-parallel layer leaves a partial sum X_r B_r on each rank; Y = sum_r X_r B_r.
    Backward: dY/d(X_r B_r) is the identity, and dY is already the same on every rank.
    """

    @staticmethod
    def forward(ctx, partial, group, log, layer):
        out = partial.contiguous().clone()
        dist.all_reduce(out, group=group)
        _log(log, layer, "forward", "all_reduce", out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class GatherFromTensorParallel(torch.autograd.Function):
    """All-gather the last dimension forward; take this rank's slice of the gradient backward.

    Why slicing, not summing, is right here: every rank computes the *same* downstream
    function on the *same* gathered tensor (the next layer's input goes through ``f``, whose
    backward all-reduces, and the loss is replicated), so the gradient arriving here is the
    full, true dL/dY, identical on every rank; this rank's part of it is just its slice.
    If instead each rank's downstream produced only a *partial* gradient (e.g. the next layer
    used its own weight shard without an ``f`` in front), the backward would have to sum
    across ranks first: a reduce-scatter, which is what torch's autograd-aware all_gather
    (torch.distributed.nn.functional.all_gather) does. Summing an already-complete gradient
    would instead multiply it by n. Which one is right depends on what the downstream
    computation does with the gathered tensor, not on the all-gather itself.
    """

    @staticmethod
    def forward(ctx, local, group, log, layer):
        ctx.rank, ctx.world_size = dist.get_rank(group), dist.get_world_size(group)
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(ctx.world_size)]
        dist.all_gather(parts, local, group=group)
        out = torch.cat(parts, dim=-1)
        _log(log, layer, "forward", "all_gather", out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.world_size, dim=-1)[ctx.rank].contiguous(), None, None, None


def copy_to_tensor_parallel(x, group=None, log=None, layer=""):
    return CopyToTensorParallel.apply(x, group, log, layer)


def reduce_from_tensor_parallel(x, group=None, log=None, layer=""):
    return ReduceFromTensorParallel.apply(x, group, log, layer)


def gather_from_tensor_parallel(x, group=None, log=None, layer=""):
    return GatherFromTensorParallel.apply(x, group, log, layer)


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

    def __init__(self, full: nn.Linear, group=None, gather_output: bool = False,
                 log: CommLog | None = None, name: str = "column"):
        super().__init__()
        self.group, self.gather_output, self.log, self.name = group, gather_output, log, name
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        self.weight = nn.Parameter(_shard(full.weight, 0, rank, world_size))
        self.bias = nn.Parameter(_shard(full.bias, 0, rank, world_size))
        # Where each parameter sits in the full layer: (dim, rank, world_size) or None if whole.
        self.shards = {"weight": (0, rank, world_size), "bias": (0, rank, world_size)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tensor_parallel(x, self.group, self.log, self.name)  # f
        y = F.linear(x, self.weight, self.bias)                          # X A_r + b_r
        if self.gather_output:
            y = gather_from_tensor_parallel(y, self.group, self.log, self.name)
        return y


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r B_r + b: rank r holds in_features / n of the inputs.

    Holds columns [r*k, (r+1)*k) of nn.Linear's (out, in) weight. Its input X_r is the output
    slice of a column-parallel layer, so no communication is needed before it; the partial
    products are summed by ``g``. The bias is whole on every rank and added once, *after* the
    all-reduce (added before it, it would be counted n times).
    """

    def __init__(self, full: nn.Linear, group=None, log: CommLog | None = None,
                 name: str = "row"):
        super().__init__()
        self.group, self.log, self.name = group, log, name
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        self.weight = nn.Parameter(_shard(full.weight, 1, rank, world_size))
        # Replicated: its gradient sum_tokens dY is the same on every rank, because dY is.
        self.bias = nn.Parameter(full.bias.detach().clone())
        self.shards = {"weight": (1, rank, world_size), "bias": None}

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x_local, self.weight)                                   # X_r B_r
        y = reduce_from_tensor_parallel(partial, self.group, self.log, self.name)  # g
        return y + self.bias


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

    def __init__(self, full: MLP, group=None, log: CommLog | None = None):
        super().__init__()
        self.fc1 = ColumnParallelLinear(full.fc1, group, gather_output=False, log=log, name="fc1")
        self.fc2 = RowParallelLinear(full.fc2, group, log=log, name="fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class AllGatherMLP(nn.Module):
    """The simplest split: every layer column-parallel, its output all-gathered at once."""

    def __init__(self, full: MLP, group=None, log: CommLog | None = None):
        super().__init__()
        self.fc1 = ColumnParallelLinear(full.fc1, group, gather_output=True, log=log, name="fc1")
        self.fc2 = ColumnParallelLinear(full.fc2, group, gather_output=True, log=log, name="fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


VARIANTS = {"megatron": TensorParallelMLP, "allgather": AllGatherMLP}


def predicted_comm(variant: str, tokens: int, d_model: int, d_ff: int,
                   element_size: int = 4) -> dict[tuple[str, str], tuple[str, int]]:
    """What each layer must communicate, from the algorithm: {(layer, phase): (op, bytes)}.

    ``tokens`` = batch x sequence. Megatron: fc1 forward nothing (f is the identity), fc1
    backward all-reduce dX (tokens x d_model); fc2 forward all-reduce Y (tokens x d_model),
    fc2 backward nothing (g's backward is the identity). All-gather: each layer gathers its
    output forward (tokens x d_out) and all-reduces dX backward (tokens x d_in).
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


def ring_bytes_per_rank(op: str, nbytes: int, world_size: int) -> float:
    """Bytes each rank sends for a collective of ``nbytes`` done as a ring (stage 01/02).

    all_reduce = reduce-scatter + all-gather: 2 (n-1)/n N. all_gather: (n-1)/n N.
    """
    n = world_size
    return {"all_reduce": 2 * (n - 1) / n * nbytes,
            "all_gather": (n - 1) / n * nbytes}.get(op, 0.0)


def full_slice(full_param: torch.Tensor, shard) -> torch.Tensor:
    """The part of a full-layer tensor that a sharded parameter corresponds to."""
    if shard is None:
        return full_param
    dim, rank, world_size = shard
    return full_param.chunk(world_size, dim=dim)[rank]


def compare_with_reference(tp_model: nn.Module, ref_model: MLP) -> list[tuple[str, float, bool]]:
    """(name, max abs difference, ok) for every parameter's gradient against the reference."""
    rows = []
    for layer_name in ("fc1", "fc2"):
        tp_layer, ref_layer = getattr(tp_model, layer_name), getattr(ref_model, layer_name)
        for pname in ("weight", "bias"):
            got = getattr(tp_layer, pname).grad
            want = full_slice(getattr(ref_layer, pname).grad, tp_layer.shards[pname])
            rows.append((f"{layer_name}.{pname}.grad", *_diff(got, want)))
    return rows


def _diff(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-4, atol: float = 1e-5):
    """Max abs difference and whether it is within float32 tolerance (sums run in another order)."""
    diff = (got - want).abs().max().item()
    return diff, bool(torch.allclose(got, want, rtol=rtol, atol=atol))


# --------------------------------------------------------------------------- harness


def _setup_common():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def check_variant(variant: str, d_model: int, d_ff: int, batch: int, seq: int,
                  device: torch.device, log: CommLog, seed: int = 0):
    """One forward+backward of the TP MLP and of the single-process MLP on the same data.

    Returns (rows of (what, max abs diff, ok), the reference model, the TP model). Every rank
    builds the same full MLP and data from the same seed, then keeps its shards.
    """
    torch.manual_seed(seed)
    ref = MLP(d_model, d_ff).to(device)
    x = torch.randn(batch, seq, d_model, device=device)
    target = torch.randn(batch, seq, d_model, device=device)
    tp = VARIANTS[variant](ref, log=log)

    x_ref = x.clone().requires_grad_(True)    # the input needs a gradient too: inside a
    x_tp = x.clone().requires_grad_(True)     # network, dX feeds the layer below
    out_ref = ref(x_ref)
    F.mse_loss(out_ref, target).backward()
    log.clear()  # count exactly one forward + backward of the TP model
    out_tp = tp(x_tp)
    F.mse_loss(out_tp, target).backward()
    rows = [("output", *_diff(out_tp.detach(), out_ref.detach())),
            ("input.grad", *_diff(x_tp.grad, x_ref.grad)),
            *compare_with_reference(tp, ref)]
    return rows, ref, tp


def train_losses(model: nn.Module, steps: int, d_model: int, batch: int, seq: int,
                 device: torch.device, lr: float = 0.5, seed: int = 1) -> list[float]:
    """A few SGD steps on fixed random data; every rank sees the same batch (TP splits weights)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, d_model, generator=g).to(device)
    target = torch.randn(batch, seq, d_model, generator=g).mul(0.5).to(device)
    losses = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), target)
        loss.backward()
        # Plain SGD by hand: each rank updates its own shards (and its copy of the replicated
        # bias, whose gradient is the same everywhere). torch.optim would do the same, but its
        # first step imports torch._dynamo, seconds of start-up on a small machine.
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
        losses.append(loss.item())
    return losses


def time_forward_backward(ctx, cfg: dict) -> list[dict]:
    """Median forward+backward time of the single-process MLP (rank 0 alone, the others
    wait) and of each tensor-parallel variant (all ranks), slowest rank's figure, ms."""
    from common import timing

    device = ctx.device
    torch.manual_seed(0)
    full = MLP(cfg["d_model"], cfg["d_ff"]).to(device)
    x = torch.randn(cfg["batch"], cfg["seq"], cfg["d_model"], device=device)
    mlps = {"single": full, **{v: VARIANTS[v](full) for v in cfg["variants"]}}
    rows = []
    for name, model in mlps.items():
        def fwd_bwd():
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
        if name == "single":  # one device doing the whole layer, the yardstick: rank 0
            # alone (the rows are rank 0's to print), the others wait so they take no share
            # of a CPU or GPU they would share with it
            times = timing.measure(fwd_bwd, device, warmup=3, iters=cfg["time_iters"]) \
                if ctx.rank == 0 else [0.0]
            dist.barrier()
            stats = timing.summarize([times])
        else:
            stats = timing.gather_times(timing.measure(fwd_bwd, device, warmup=3,
                                                       iters=cfg["time_iters"], barrier=True))
        rows.append({"variant": name, "ranks_working": 1 if name == "single" else ctx.world_size,
                     "fwd_bwd_ms": stats.median * 1e3, "fwd_bwd_ms_min": stats.min * 1e3})
    for r in rows:  # (only rank 0 timed "single")
        r["speedup_vs_single"] = rows[0]["fwd_bwd_ms"] / r["fwd_bwd_ms"] if ctx.is_main else None
    return rows


def tensor_parallel_main(ctx, cfg: dict) -> None:
    """Verify both variants, print the byte table, train a few steps. Raises on any mismatch."""
    _setup_common()
    from common.results import machine_name, print_table, run_id, upsert_csv

    n, device = ctx.world_size, ctx.device
    tokens = cfg["batch"] * cfg["seq"]
    failures, check_rows, byte_rows, csv_rows = [], [], [], []
    for variant in cfg["variants"]:
        log = CommLog()
        rows, _, _ = check_variant(variant, cfg["d_model"], cfg["d_ff"], cfg["batch"],
                                   cfg["seq"], device, log)
        for what, diff, ok in rows:
            check_rows.append({"variant": variant, "checked": what, "max_abs_diff": diff,
                               "ok": ok})
            if not ok:
                failures.append(f"rank {ctx.rank} {variant} {what}: max abs diff {diff:.3g}")
        predicted = predicted_comm(variant, tokens, cfg["d_model"], cfg["d_ff"])
        for (layer, phase), (op, want) in predicted.items():
            counted = log.bytes.get((layer, phase), 0)
            if counted != want or log.ops.get((layer, phase), "-") != op:
                failures.append(f"rank {ctx.rank} {variant} {layer} {phase}: counted "
                                f"{log.ops.get((layer, phase), '-')} {counted} B, predicted "
                                f"{op} {want} B")
            row = {"variant": variant, "layer": layer, "phase": phase, "collective": op,
                   "bytes_counted": counted, "bytes_predicted": want,
                   "ring_bytes_sent_per_rank": ring_bytes_per_rank(op, want, n)}
            byte_rows.append(row)
            csv_rows.append({"backend": ctx.backend, "device": device.type, "world_size": n,
                             "tokens": tokens, "d_model": cfg["d_model"], "d_ff": cfg["d_ff"],
                             **row, "run_id": run_id()})

    # Training: the same few SGD steps single-process and tensor-parallel, same start.
    losses = {}
    torch.manual_seed(0)
    start = MLP(cfg["d_model"], cfg["d_ff"]).to(device)
    losses["single"] = train_losses(copy.deepcopy(start), cfg["steps"], cfg["d_model"],
                                    cfg["batch"], cfg["seq"], device)
    for variant in cfg["variants"]:
        tp = VARIANTS[variant](start)
        losses[variant] = train_losses(tp, cfg["steps"], cfg["d_model"], cfg["batch"],
                                       cfg["seq"], device)
        worst = max(abs(a - b) for a, b in zip(losses[variant], losses["single"]))
        if worst > 1e-5 * max(1.0, max(losses["single"])):
            failures.append(f"rank {ctx.rank} {variant} training loss differs from single-"
                            f"process by up to {worst:.3g}")
    loss_rows = [{"step": i, **{k: v[i] for k, v in losses.items()}}
                 for i in range(cfg["steps"])]
    falls = losses["single"][-1] < losses["single"][0]
    time_rows = time_forward_backward(ctx, cfg) if cfg["time_iters"] else []

    if ctx.is_main:
        print(f"Tensor parallel MLP: world_size={n}, d_model={cfg['d_model']}, "
              f"d_ff={cfg['d_ff']}, batch x seq = {cfg['batch']} x {cfg['seq']} tokens, "
              f"{ctx.backend}/{device.type} ({machine_name()})\n")
        print_table(check_rows, "Against the single-process MLP (rank 0's shards; every rank "
                                "checks its own):", floatfmt=".3g")
        print()
        print_table(byte_rows, f"Bytes communicated per layer, one forward + backward "
                               f"(float32, {tokens} tokens):", floatfmt=".0f")
        print()
        print_table(loss_rows, f"Training {cfg['steps']} SGD steps: loss per step",
                    floatfmt=".6f")
        path = upsert_csv("tensor_parallel.csv", csv_rows,
                          key=["backend", "device", "world_size", "tokens", "d_model", "d_ff",
                               "variant", "layer", "phase"])
        print(f"\nwrote {path}")
        if time_rows:
            print()
            print_table(time_rows, f"Forward + backward of the MLP, slowest rank's median of "
                                   f"{cfg['time_iters']} after 3 warm-up ({machine_name()}):",
                        floatfmt=".3f")
            path = upsert_csv("tensor_parallel_time.csv", [
                {"backend": ctx.backend, "device": device.type, "world_size": n,
                 "tokens": tokens, "d_model": cfg["d_model"], "d_ff": cfg["d_ff"], **r,
                 "machine": machine_name(), "run_id": run_id()} for r in time_rows],
                key=["backend", "device", "world_size", "tokens", "d_model", "d_ff", "variant"])
            print(f"wrote {path}")
    if not falls:
        failures.append(f"rank {ctx.rank}: the training loss did not fall")
    if failures:
        raise AssertionError("tensor-parallel check failed:\n  " + "\n  ".join(failures))
    ctx.print("all checks passed", all_ranks=False)


def main(argv=None) -> None:
    _setup_common()
    from common import launch

    parser = launch.make_parser(__doc__, world_size=2)
    parser.add_argument("--d-model", type=int, default=64, help="MLP input/output width")
    parser.add_argument("--d-ff", type=int, default=256, help="MLP hidden width")
    parser.add_argument("--batch", type=int, default=8, help="sequences per batch")
    parser.add_argument("--seq", type=int, default=16, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=5, help="SGD steps in the training demo")
    parser.add_argument("--variants", default="megatron,allgather",
                        help="comma-separated subset of: " + ", ".join(VARIANTS))
    parser.add_argument("--time-iters", type=int, default=10,
                        help="timed forward+backward passes per variant and for one process "
                             "alone (0: no timing)")
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    n = config.world_size
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            parser.error(f"--variants: unknown variant {v!r}; allowed: {', '.join(VARIANTS)}")
    for flag, value in (("--d-model", args.d_model), ("--d-ff", args.d_ff),
                        ("--batch", args.batch), ("--seq", args.seq), ("--steps", args.steps)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.time_iters < 0:
        parser.error(f"--time-iters must be >= 0, got {args.time_iters}")
    if args.d_ff % n:
        parser.error(f"--d-ff {args.d_ff} is not divisible by the tensor-parallel size "
                     f"(world size) {n}")
    if "allgather" in variants and args.d_model % n:
        parser.error(f"--d-model {args.d_model} is not divisible by the tensor-parallel size "
                     f"(world size) {n} (the all-gather variant splits fc2's outputs)")
    cfg = dict(d_model=args.d_model, d_ff=args.d_ff, batch=args.batch, seq=args.seq,
               steps=args.steps, variants=variants, time_iters=args.time_iters)
    launch.launch(tensor_parallel_main, config, cfg)


if __name__ == "__main__":
    main()
