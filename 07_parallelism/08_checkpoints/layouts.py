"""Stage 07, lesson 8: layouts, what each rank holds, for ``checkpoint.py``.

Every way of training in this course is, for a checkpoint, the same kind of thing: each rank
holds some boxes of some full tensors, and one rank per box is the one that writes it. A layout
is that list, one entry per local tensor:

    {"name": "model.blocks.0.attn.qkv.weight",     # model.<parameter>, optimizer.<parameter>.<key>
     "tensor": the local tensor (saved from, loaded into),
     "full_shape": [192, 64],
     "boxes": [(local_box, full_box), ...],         # this part of the local tensor is that
                                                    # part of the full one; a box: [start, stop)
                                                    # per dimension
     "write": True}                                 # a replica: True on one rank only

The layouts of the course, each a few lines:

* DDP (stages 03-06) and one process: every rank holds everything; rank 0 writes it.
* ZeRO-1 (lesson 1): every rank holds the weights, the owner of a parameter holds its AdamW
  state; the owner writes both (its copy of the weights is the one it updated). ZeRO-2 holds
  the same between steps (its gradients are not saved): the same layout.
* FSDP (lesson 2), at any world size N: a weight of 2+ dimensions is held in padded row blocks,
  rank r rows [r k, (r+1) k) with k = ceil(rows / N), the padding (rows past the end) not in any
  box; 1-D parameters whole on every rank, written by rank 0.
* Tensor, pipeline, context and data parallel on lesson 7's grid: ``parallel_lm.placements``
  says where each local parameter sits in the full model (tensor parallel: a block of rows,
  three for the stacked q, k, v, or of columns; pipeline: whole layers of one stage); its
  ``replica`` flag picks the writer.

AdamW's state follows its parameter: ``exp_avg`` and ``exp_avg_sq`` have the parameter's boxes
(AdamW works element by element, so AdamW on slices is AdamW on the whole), and ``step``, a
scalar, is held wherever the parameter's state is and written by the rank that writes the
parameter's first element.

Torch alone: copy this file (with ``checkpoint.py``) anywhere.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

ADAMW_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")   # the last one with amsgrad only


def whole(shape) -> list[list[int]]:
    """The box of a whole tensor of ``shape``."""
    return [[0, size] for size in shape]


def entry(name: str, tensor: torch.Tensor, full_shape, boxes, write: bool) -> dict:
    return {"name": name, "tensor": tensor, "full_shape": list(full_shape), "boxes": boxes,
            "write": write}


def init_adamw_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW makes its state at its first step; a layout to load into needs it now. Zeros and
    step 0, as AdamW's first step would make them (which then finds them and uses them)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if len(state) > 0:
                continue
            if group.get("capturable") or group.get("fused"):
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            else:
                state["step"] = torch.tensor(0.0)          # AdamW keeps it on the CPU
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def adamw_entries(parameter: str, boxes, full_shape, state: dict, write: bool) -> list[dict]:
    """The AdamW state of one parameter: the moments in the parameter's boxes, the step count
    (a scalar) written by the rank that writes the parameter's first element."""
    entries = []
    for key in ADAMW_MOMENTS:
        if key in state:
            entries.append(entry(f"optimizer.{parameter}.{key}", state[key], full_shape, boxes,
                                 write))
    holds_first_element = False
    for _, full_box in boxes:
        if all(start == 0 for start, _ in full_box):
            holds_first_element = True
    entries.append(entry(f"optimizer.{parameter}.step", state["step"], [], [([], [])],
                         write and holds_first_element))
    return entries


def optimizer_options(optimizer: torch.optim.Optimizer) -> dict:
    """The settings of the optimizer's (one) parameter group, for the manifest: a plain AdamW
    state_dict can be rebuilt from them (``checkpoint.consolidate``)."""
    if len(optimizer.param_groups) != 1:
        raise ValueError("optimizer_options: one parameter group only (consolidate rebuilds one)")
    options = {}
    for key, value in optimizer.param_groups[0].items():
        if key in ("params", "param_names"):
            continue
        if torch.is_tensor(value):
            value = value.item()
        options[key] = value
    return options


# --------------------------------------------------------------------------- the layouts


def replicated_layout(model: torch.nn.Module, optimizer=None, rank: int = 0) -> list[dict]:
    """DDP (03-06), and one process (rank 0 of 1): every rank holds everything, rank 0 writes."""
    if optimizer is not None:
        init_adamw_state(optimizer)
    layout = []
    for name, p in model.named_parameters():
        boxes = [(whole(p.shape), whole(p.shape))]
        layout.append(entry(f"model.{name}", p, p.shape, boxes, rank == 0))
        if optimizer is not None:
            layout.extend(adamw_entries(name, boxes, p.shape, optimizer.state[p], rank == 0))
    return layout


def zero1_layout(model: torch.nn.Module, optimizer, group=None) -> list[dict]:
    """ZeRO-1 (lesson 1's ``ShardedOptimizer`` over ``group``): the weights on every rank, the
    AdamW state of a parameter on its owner (``optimizer.owner[p]``, a rank of ``group``, whose
    ``optimizer.optim`` holds it). The owner writes the parameter and its state."""
    rank = dist.get_rank(group)
    init_adamw_state(optimizer.optim)
    layout = []
    for name, p in model.named_parameters():
        boxes = [(whole(p.shape), whole(p.shape))]
        owns = optimizer.owner[p] == rank
        layout.append(entry(f"model.{name}", p, p.shape, boxes, owns))
        if owns:
            layout.extend(adamw_entries(name, boxes, p.shape, optimizer.optim.state[p], True))
    return layout


def padded_row_block(full_shape, rank: int, world_size: int) -> list:
    """FSDP's boxes of a weight at ``world_size`` ranks: rank r holds rows [r k, (r+1) k) of the
    full tensor padded with zero rows, k = ceil(rows / world_size). The padding is in no box:
    a rank whose rows all lie past the end holds no box at all."""
    rows = full_shape[0]
    rows_per_rank = math.ceil(rows / world_size)                      # k
    first = min(rank * rows_per_rank, rows)
    last = min(first + rows_per_rank, rows)
    if first == last:
        return []
    local_box = [[0, last - first]] + whole(full_shape[1:])
    full_box = [[first, last]] + whole(full_shape[1:])
    return [(local_box, full_box)]


def fsdp_layout(fsdp: torch.nn.Module, optimizer, full_shapes: dict, group=None) -> list[dict]:
    """FSDP (lesson 2) over ``group``: ``fsdp.module``'s parameters are this rank's shards;
    ``full_shapes`` {name: shape} are the model's before it was wrapped; ``optimizer`` an AdamW
    over the shards. Every rank writes its own rows; rank 0 the 1-D parameters."""
    rank = dist.get_rank(group)
    world_size = dist.get_world_size(group)
    init_adamw_state(optimizer)
    layout = []
    for name, p in fsdp.module.named_parameters():
        full_shape = list(full_shapes[name])
        if len(full_shape) >= 2:
            expected_rows = math.ceil(full_shape[0] / world_size)
            if p.shape[0] != expected_rows:
                raise ValueError(f"fsdp_layout: {name} holds {p.shape[0]} rows; FSDP at "
                                 f"{world_size} ranks holds ceil({full_shape[0]} / "
                                 f"{world_size}) = {expected_rows}")
            boxes = padded_row_block(full_shape, rank, world_size)
            write = True
        else:
            boxes = [(whole(full_shape), whole(full_shape))]
            write = rank == 0
        layout.append(entry(f"model.{name}", p, full_shape, boxes, write))
        layout.extend(adamw_entries(name, boxes, full_shape, optimizer.state[p], write))
    return layout


def grid_layout(placements: list[dict], grid, optimizer) -> list[dict]:
    """Lesson 7's grid (tensor, pipeline, context, data parallel): ``placements`` from
    ``parallel_lm.placements(chunks, grid)``; ``optimizer`` an AdamW over this rank's pieces,
    or lesson 1's ShardedOptimizer over the grid's "dp_cp" group (train.py --fsdp), which
    keeps a piece's state on its owner only. A piece's state is written where the piece is
    (its ``replica``) or, sharded, by its owner among the copies of tp rank 0's piece."""
    sharded = hasattr(optimizer, "owner")       # ShardedOptimizer: .owner[p], .optim
    inner = optimizer
    if sharded:
        inner = optimizer.optim
    init_adamw_state(inner)
    layout = []
    for placement in placements:
        p = placement["tensor"]
        name = placement["name"]
        full_shape = list(placement["full_shape"])
        boxes = []
        for local_box, full_box in placement["boxes"]:
            boxes.append(([list(pair) for pair in local_box], [list(pair) for pair in full_box]))
        layout.append(entry(f"model.{name}", p, full_shape, boxes, placement["replica"]))
        if sharded:
            if optimizer.owner[p] != grid.rank("dp_cp"):
                continue                        # another rank of dp_cp keeps this state
            split_over_tp = list(p.shape) != full_shape
            write_state = split_over_tp or grid.rank("tp") == 0
        else:
            write_state = placement["replica"]
        layout.extend(adamw_entries(name, boxes, full_shape, inner.state[p], write_state))
    return layout


def lm_block_columns(parameter_names, num_heads: int, d_model: int, d_ff: int) -> dict:
    """The course LM's tensors that tensor parallelism cuts along their LAST dimension, with
    the narrowest cut (``checkpoint.save``'s ``block_columns``): the row-parallel weights
    (attn.out [d_model, d_model], mlp.2 [d_model, d_ff]) by columns, the column-parallel bias
    mlp.0 [d_ff], at multiples of in / tp, tp dividing the heads and d_ff (lesson 3). Saved in
    units that narrow, any tp reads whole units."""
    finest = math.gcd(num_heads, d_ff)          # the largest tp the model allows
    widths = {}
    for name in parameter_names:
        if name.endswith("attn.out.weight"):
            width = d_model // finest
        elif name.endswith(("mlp.2.weight", "mlp.0.bias")):
            width = d_ff // finest
        else:
            continue
        widths[f"model.{name}"] = width
        for key in ADAMW_MOMENTS:
            widths[f"optimizer.{name}.{key}"] = width
    return widths


def layout_bytes(layout: list[dict], written_only: bool = False) -> int:
    """Bytes of the boxes of a layout (what it holds, padding excluded), or of those it writes."""
    total = 0
    for item in layout:
        if written_only and not item["write"]:
            continue
        for _, full_box in item["boxes"]:
            count = 1
            for start, stop in full_box:
                count *= stop - start
            total += count * item["tensor"].element_size()
    return total
