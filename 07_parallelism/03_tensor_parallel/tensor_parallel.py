"""Stage 07, lesson 3: tensor parallelism, and sequence parallelism on top of it.

Data parallelism copies the whole model onto every rank and splits the batch; tensor
parallelism splits the *layers*: each of t ranks holds a slice of every weight matrix and
computes a slice of every layer's output, paying with communication inside every forward and
backward. Two ways to split ``y = fc2(gelu(fc1(x)))`` over t ranks:

* **Megatron-LM** (Shoeybi et al., 2019, section 3): fc1 *column-parallel* (rank r holds d_ff/t
  of its outputs), GELU on the local slice, fc2 *row-parallel* (the matching d_ff/t of its
  inputs), whose partial sums one all-reduce completes. Two conjugate autograd operators
  carry it all: ``f`` = identity forward / all-reduce backward (before fc1), ``g`` = all-reduce
  forward / identity backward (after fc2): one all-reduce of tokens x d_model each way.
* **All-gather after every layer** (the simplest thing that works): every layer
  column-parallel, its output gathered whole; it also moves the d_ff-wide activation.

A Transformer block splits the same way: attention's heads are independent, so the fused
q/k/v projection is column-parallel by heads, attention runs on the local heads, and the
output projection is row-parallel; then the MLP as above. The LayerNorms and residual adds
between the two parallel regions are *replicated*: every rank runs them on every token.

**Sequence parallelism** (Korthikanti et al., 2022, section 4.2.2) splits those replicated
parts along the sequence: between the regions each rank holds [batch, seq/t, hidden], so the
LayerNorms run on 1/t of the tokens and keep 1/t of the activations. Entering a column-parallel
layer, an all-gather along the sequence replaces ``f`` (its backward a reduce-scatter); leaving
a row-parallel layer, a reduce-scatter replaces ``g`` (its backward an all-gather). A ring
all-reduce is a reduce-scatter then an all-gather: the same bytes as plain tensor parallelism.
New: a replicated parameter (a LayerNorm's weight and bias, fc2's bias) sees only this rank's
tokens, so its gradient is a partial sum to all-reduce over the group
(``TensorParallelBlock.all_reduce_replicated_grads``).

Use it: every rank builds the same full layer (same seed), then keeps its slices:

    mlp = TensorParallelMLP(MLP(d_model, d_ff), group=None)
    block = TensorParallelBlock(full_block, group=None, sequence_parallel=True)
    y_local = block(x_local)          # x_local: this rank's [batch, seq/t, d_model]
    loss.backward()
    block.all_reduce_replicated_grads()

``full_block`` is shaped like the course LM's block (common/models.py ``Block``): ``norm1``,
``attn`` (``qkv``, ``out``, ``num_heads``, ``attend``), ``norm2``, and ``mlp`` a Sequential of
Linear, activation, Linear. The demo beside this file runs it against one process. This file
needs torch alone: copy it anywhere.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

SEQUENCE_DIM = 1  # activations are [batch, seq, hidden]

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
        grad = grad.contiguous().clone()  # all_reduce works in place; autograd may share grad
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

    Slicing, not summing: every rank runs the *same* computation downstream on the *same*
    gathered tensor, so the gradient arriving here is already the full dL/dY on every rank
    (summing it over ranks would multiply it by t)."""

    @staticmethod
    def forward(ctx, local, group):
        ctx.rank = dist.get_rank(group)
        ctx.world_size = dist.get_world_size(group)
        return all_gather_along(local, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.world_size, dim=-1)[ctx.rank].contiguous(), None


def all_gather_along(local: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Every rank's ``local``, concatenated along ``dim`` in rank order (e.g. the sequence:
    [batch, seq/t, hidden] on each rank -> [batch, seq, hidden], rank 0's tokens first)."""
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter_sequence(full: torch.Tensor, group=None) -> torch.Tensor:
    """[batch, seq, hidden] partial sums on each rank -> this rank's [batch, seq/t, hidden] of
    their sum over ranks."""
    parts = [part.contiguous() for part in full.chunk(dist.get_world_size(group), dim=SEQUENCE_DIM)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


class GatherFromSequenceParallel(torch.autograd.Function):
    """Sequence parallelism's replacement for ``f``, entering a column-parallel layer:
    all-gather along the sequence forward, reduce-scatter backward.

    Forward: the layer needs every token, each rank has seq/t of them. Backward: each rank's
    column slice gives a partial dX for *every* token (as with ``f``); the true dX is their sum,
    and this rank keeps only its own tokens' part: a reduce-scatter.
    """

    @staticmethod
    def forward(ctx, local, group):
        ctx.group = group
        return all_gather_along(local, SEQUENCE_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad, ctx.group), None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Sequence parallelism's replacement for ``g``, leaving a row-parallel layer:
    reduce-scatter along the sequence forward, all-gather backward.

    Forward: each rank holds a partial sum X_r B_r for every token; the sum, cut along the
    sequence, is what the next (sequence-parallel) part needs. Backward: each partial sum
    needs the gradient of every token, and each rank has its own tokens': an all-gather.
    """

    @staticmethod
    def forward(ctx, partial, group):
        ctx.group = group
        return reduce_scatter_sequence(partial, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, SEQUENCE_DIM, ctx.group), None


# --------------------------------------------------------------------------- the layers


def shard(tensor: torch.Tensor, dim: int, rank: int, world_size: int,
          stacked: int = 1) -> torch.Tensor:
    """Rank's contiguous 1/world_size of ``tensor`` along ``dim`` (a copy). ``stacked``: the
    tensor is that many equal blocks one after the other along ``dim`` (a fused q, k, v: 3),
    each cut on its own, and rank's slices of them stacked again."""
    if tensor.shape[dim] % (stacked * world_size) != 0:
        raise ValueError(f"size {tensor.shape[dim]} is not divisible into {stacked} x world size "
                         f"{world_size} equal parts")
    slices = [block.chunk(world_size, dim=dim)[rank] for block in tensor.detach().chunk(stacked, dim=dim)]
    return torch.cat(slices, dim=dim).clone()


class ColumnParallelLinear(nn.Module):
    """Y_r = X A_r + b_r: rank r computes out_features / t of the outputs.

    Holds rows [r*k, (r+1)*k) of nn.Linear's (out, in) weight, k = out/t, and the same slice
    of the bias (``stacked`` > 1: that slice of each of the stacked blocks, see ``shard``). The
    input goes through ``f`` (full X on every rank forward, all-reduced dX backward), or, with
    ``sequence_parallel``, through the all-gather along the sequence. With ``gather_output``
    the slices are all-gathered into the full Y.
    """

    def __init__(self, full: nn.Linear, group=None, gather_output: bool = False,
                 sequence_parallel: bool = False, stacked: int = 1):
        super().__init__()
        self.group = group
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.stacked = stacked
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.weight = nn.Parameter(self.local_part(full.weight))
        self.bias = None if full.bias is None else nn.Parameter(self.local_part(full.bias))

    def local_part(self, full_tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full layer's weight or bias (or of its gradient)."""
        return shard(full_tensor, 0, self.rank, self.world_size, self.stacked)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = GatherFromSequenceParallel.apply(x, self.group)  # [b, s/t, in] -> [b, s, in]
        else:
            x = CopyToTensorParallel.apply(x, self.group)        # f
        y = F.linear(x, self.weight, self.bias)                  # X A_r + b_r
        if self.gather_output:
            y = GatherFromTensorParallel.apply(y, self.group)
        return y


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r B_r + b: rank r holds in_features / t of the inputs.

    Holds columns [r*k, (r+1)*k) of nn.Linear's (out, in) weight. Its input X_r is the output
    slice of a column-parallel layer, so no communication is needed before it; the partial
    products are summed by ``g`` (or, with ``sequence_parallel``, summed and cut along the
    sequence by a reduce-scatter). The bias is whole on every rank and added once, *after* the
    sum (added before it, it would be counted t times).
    """

    def __init__(self, full: nn.Linear, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.weight = nn.Parameter(self.local_part(full.weight))
        # The bias is replicated. Its gradient sum_tokens dY is the same on every rank when
        # every rank sees every token (plain tensor parallel); with sequence parallelism not.
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())

    def local_part(self, full_tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full layer's weight (columns) or bias (all of it)."""
        if full_tensor.dim() == 1:
            return full_tensor.detach().clone()
        return shard(full_tensor, 1, self.rank, self.world_size)

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x_local, self.weight)                            # X_r B_r
        if self.sequence_parallel:
            out = ReduceScatterToSequenceParallel.apply(partial, self.group)  # [b, s/t, out]
        else:
            out = ReduceFromTensorParallel.apply(partial, self.group)         # g
        if self.bias is not None:
            out = out + self.bias
        return out


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


# --------------------------------------------------------------------------- a Transformer block


class TensorParallelAttention(nn.Module):
    """Multi-head attention with this rank's heads: q/k/v column-parallel (``stacked=3``: the
    fused projection holds q, k and v one after the other, and each is cut by heads), the
    attention itself (``full.attend``, e.g. causal softmax attention) on the local heads, and
    the output projection row-parallel over the same heads."""

    def __init__(self, full: nn.Module, group=None, sequence_parallel: bool = False):
        super().__init__()
        world_size = dist.get_world_size(group)
        if full.num_heads % world_size != 0:  # (the slices would cut heads in two, silently)
            raise ValueError(f"{full.num_heads} heads do not divide over {world_size} ranks")
        self.num_heads = full.num_heads // world_size  # heads on this rank
        self.qkv = ColumnParallelLinear(full.qkv, group, sequence_parallel=sequence_parallel,
                                        stacked=3)
        self.out = RowParallelLinear(full.out, group, sequence_parallel=sequence_parallel)
        self.attend = full.attend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)                    # [batch, seq, 3 * local_width], every token
        batch, seq, width = qkv.shape
        local_width = width // 3             # this rank's heads x head_dim
        head_dim = local_width // self.num_heads
        # each of q, k, v: [batch, seq, local_width] -> [batch, local heads, seq, head_dim]
        q, k, v = [part.view(batch, seq, self.num_heads, head_dim).transpose(1, 2)
                   for part in qkv.split(local_width, dim=-1)]
        y = self.attend(q, k, v)             # [batch, local heads, seq, head_dim]
        y = y.transpose(1, 2).reshape(batch, seq, local_width)
        return self.out(y)                   # summed over ranks (g, or the reduce-scatter)


class TensorParallelBlock(nn.Module):
    """A pre-norm Transformer block, x + attn(norm1(x)), then + mlp(norm2(x)), heads and MLP
    columns split over the group. With ``sequence_parallel`` its input and output are this
    rank's [batch, seq/t, d_model] (rank r: tokens r*seq/t .. (r+1)*seq/t - 1), else the full
    [batch, seq, d_model]. Its parameters are the full block's slices, under the same names."""

    def __init__(self, full: nn.Module, group=None, sequence_parallel: bool = True):
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.norm1 = copy.deepcopy(full.norm1)  # replicated
        self.attn = TensorParallelAttention(full.attn, group, sequence_parallel)
        self.norm2 = copy.deepcopy(full.norm2)  # replicated
        self.mlp = nn.Sequential(
            ColumnParallelLinear(full.mlp[0], group, sequence_parallel=sequence_parallel),
            copy.deepcopy(full.mlp[1]),         # elementwise: exact on the local columns
            RowParallelLinear(full.mlp[2], group, sequence_parallel=sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))   # norm1 on this rank's tokens (all of them without SP)
        return x + self.mlp(self.norm2(x))

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The parameters every rank holds whole: the LayerNorms' and the row-parallel biases."""
        biases = [layer.bias for layer in (self.attn.out, self.mlp[2]) if layer.bias is not None]
        return [*self.norm1.parameters(), *self.norm2.parameters(), *biases]

    def all_reduce_replicated_grads(self) -> None:
        """Call after backward. With sequence parallelism each rank ran the LayerNorms and
        added the biases on its own tokens only: the gradients of those replicated parameters
        are partial sums over tokens, and the whole gradient is their sum over the group.
        Without it every rank saw every token and they are whole already: nothing to do."""
        if not self.sequence_parallel:
            return
        for param in self.replicated_parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, group=self.group)

