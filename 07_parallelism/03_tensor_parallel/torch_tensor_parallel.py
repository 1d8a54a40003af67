"""Stage 07, lesson 3, the control: torch's own tensor and sequence parallelism on the same block.

``tensor_parallel.py`` writes the split by hand; torch spells it as a *plan*, a parallel style
per submodule (``block_plan``, each line beside the piece of ours it stands for), that
``parallelize_module`` applies to a plain module, turning its weights into DTensors and
inserting the collectives itself (DTensor's functional collectives).

One difference in shape: ``ColwiseParallel`` cuts one Linear's outputs into t contiguous
slices, so on the fused q/k/v projection rank 0 would get all of q and rank 1 all of v. Ours
cuts each of q, k and v by heads (``stacked=3``); torch's plan needs q, k and v as three
Linears: ``SplitQKVBlock`` is the course block so rebuilt, with the same weights.

    block = parallelize_block(full_block, group, "cpu")   # then block(x_local), as ours

torch alone; the demo (``run_tensor_parallel.py``) sets it beside ours. DTensor runs torch's
coalesced collectives, which Gloo cannot carry for CUDA tensors: guard a call with
``common.launch.carries_point_to_point(backend, device)``.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn


class SplitQKVAttention(nn.Module):
    """The block's attention with q, k, v as three Linears (the fused projection's three
    parts, the same weights). ``-1`` heads in the reshapes, so it runs on however many heads
    a rank holds."""

    def __init__(self, full_attn: nn.Module):
        super().__init__()
        width = full_attn.out.in_features
        self.head_dim = width // full_attn.num_heads
        self.attend = full_attn.attend
        self.q, self.k, self.v = [nn.Linear(width, width, bias=False) for _ in range(3)]
        for linear, weight in zip((self.q, self.k, self.v), full_attn.qkv.weight.detach().chunk(3)):
            linear.weight = nn.Parameter(weight.clone())
        self.out = copy.deepcopy(full_attn.out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # [batch, seq, heads * head_dim] -> [batch, heads, seq, head_dim]
        q = self.q(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        y = self.attend(q, k, v)
        return self.out(y.transpose(1, 2).reshape(batch, seq, -1))


class SplitQKVBlock(nn.Module):
    """The course block (common/models.py ``Block``) with SplitQKVAttention: what torch's
    tensor-parallel plan is applied to."""

    def __init__(self, full: nn.Module):
        super().__init__()
        self.norm1 = copy.deepcopy(full.norm1)
        self.attn = SplitQKVAttention(full.attn)
        self.norm2 = copy.deepcopy(full.norm2)
        self.mlp = copy.deepcopy(full.mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def block_plan() -> dict:
    """torch's plan for a SplitQKVBlock, sequence parallel (a plan's objects serve one module:
    make a new plan for each block)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)
    def gather_sequence():  # GatherFromSequenceParallel
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))

    return {
        "norm1": SequenceParallel(),                             # a LayerNorm on [b, s/t, h]
        "attn": gather_sequence(),
        "attn.q": ColwiseParallel(),                             # ColumnParallelLinear
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.out": RowwiseParallel(output_layouts=Shard(1)),    # RowParallelLinear + its
        "norm2": SequenceParallel(),                             # reduce-scatter (SP's g)
        "mlp": gather_sequence(),
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(output_layouts=Shard(1)),
    }


def parallelize_block(full: nn.Module, group=None, device_type: str = "cpu") -> nn.Module:
    """torch's TP + SP version of ``full`` over ``group`` (None: every rank). Its input and
    output are this rank's [batch, seq/t, d_model], as ``TensorParallelBlock``'s."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module
    if group is None:
        group = dist.group.WORLD
    mesh = DeviceMesh.from_group(group, device_type)
    return parallelize_module(SplitQKVBlock(full), mesh, block_plan())
