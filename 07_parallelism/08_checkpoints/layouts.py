"""Stage 07, lesson 8: layouts, what each rank holds, for ``checkpoint.py``.

Every way of training in this course is, for a checkpoint, the same thing: each rank holds
boxes of full tensors, and one rank per box writes it. A layout is that list, one entry per
local tensor: ``{"name", "tensor", "full_shape", "boxes": [(local_box, full_box)], "write"}``.
DDP, ZeRO-1, FSDP and lesson 7's grid are a few lines each. AdamW's moments have their
parameter's boxes (AdamW is elementwise: on a slice it is AdamW on the whole); its ``step``, a
scalar, is written by the rank writing the parameter's first element. Torch alone.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

ADAMW_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")   # the last one with amsgrad only


def whole(shape) -> list[list[int]]:
    return [[0, size] for size in shape]


def entry(name: str, tensor: torch.Tensor, full_shape, boxes, write: bool) -> dict:
    return dict(name=name, tensor=tensor, full_shape=list(full_shape), boxes=boxes, write=write)


def init_adamw_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW makes its state at its first step; a layout to load into needs it now (zeros and
    step 0: what that step would make)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if len(state) > 0:
                continue
            state["step"] = torch.tensor(0.0)                   # AdamW keeps it on the CPU
            if group.get("capturable") or group.get("fused"):
                state["step"] = torch.zeros((), device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def adamw_entries(parameter: str, boxes, full_shape, state: dict, write: bool) -> list[dict]:
    """One parameter's AdamW state: the moments in its boxes, and its step."""
    entries = [entry(f"optimizer.{parameter}.{key}", state[key], full_shape, boxes, write)
               for key in ADAMW_MOMENTS if key in state]
    first = any(all(start == 0 for start, _ in full_box) for _, full_box in boxes)
    entries.append(entry(f"optimizer.{parameter}.step", state["step"], [], [([], [])],
                         write and first))
    return entries


def optimizer_options(optimizer: torch.optim.Optimizer) -> dict:
    """The parameter group's settings: ``consolidate`` rebuilds an AdamW state_dict from them."""
    if len(optimizer.param_groups) != 1:        # consolidate would rebuild the others wrong
        raise ValueError("optimizer_options: one parameter group only")
    group = optimizer.param_groups[0]
    return {key: value.item() if torch.is_tensor(value) else value
            for key, value in group.items() if key not in ("params", "param_names")}


def replicated_layout(model: torch.nn.Module, optimizer=None, rank: int = 0) -> list[dict]:
    """DDP, and one process: every rank holds everything, rank 0 writes."""
    if optimizer is not None:
        init_adamw_state(optimizer)
    layout = []
    for name, p in model.named_parameters():
        boxes = [(whole(p.shape), whole(p.shape))]
        layout.append(entry(f"model.{name}", p, p.shape, boxes, rank == 0))
        if optimizer is not None:
            layout += adamw_entries(name, boxes, p.shape, optimizer.state[p], rank == 0)
    return layout


def zero1_layout(model: torch.nn.Module, optimizer, group=None) -> list[dict]:
    """ZeRO-1 (lesson 1's ShardedOptimizer): a parameter's owner writes it and its state."""
    init_adamw_state(optimizer.optim)
    layout = []
    for name, p in model.named_parameters():
        boxes = [(whole(p.shape), whole(p.shape))]
        owns = optimizer.owner[p] == dist.get_rank(group)
        layout.append(entry(f"model.{name}", p, p.shape, boxes, owns))
        if owns:
            layout += adamw_entries(name, boxes, p.shape, optimizer.optim.state[p], True)
    return layout


def padded_row_block(full_shape, rank: int, world_size: int) -> list:
    """FSDP's box of a weight on ``rank``: rows [r k, (r+1) k), k = ceil(rows / world_size),
    cut at the last real row (the padding is in no box)."""
    rows_per_rank = math.ceil(full_shape[0] / world_size)               # k
    first = min(rank * rows_per_rank, full_shape[0])
    last = min(first + rows_per_rank, full_shape[0])
    if first == last:
        return []
    return [([[0, last - first]] + whole(full_shape[1:]), [[first, last]] + whole(full_shape[1:]))]


def fsdp_layout(fsdp: torch.nn.Module, optimizer, full_shapes: dict, group=None) -> list[dict]:
    """FSDP (lesson 2): ``fsdp.module``'s parameters are this rank's row blocks of the 2+-D
    weights (1-D ones whole, written by rank 0); ``full_shapes``: {name: shape} unwrapped."""
    rank = dist.get_rank(group)
    world_size = dist.get_world_size(group)
    init_adamw_state(optimizer)
    layout = []
    for name, p in fsdp.module.named_parameters():
        full_shape = list(full_shapes[name])
        boxes = [(whole(full_shape), whole(full_shape))]
        write = rank == 0
        if len(full_shape) >= 2:
            rows = math.ceil(full_shape[0] / world_size)
            if p.shape[0] != rows:       # another sharding: its boxes would be wrong, silently
                raise ValueError(f"fsdp_layout: {name} holds {p.shape[0]} rows; FSDP at "
                                 f"{world_size} ranks holds ceil({full_shape[0]} / "
                                 f"{world_size}) = {rows}")
            boxes = padded_row_block(full_shape, rank, world_size)
            write = True
        layout.append(entry(f"model.{name}", p, full_shape, boxes, write))
        layout += adamw_entries(name, boxes, full_shape, optimizer.state[p], write)
    return layout


def grid_layout(placements: list[dict], grid, optimizer) -> list[dict]:
    """Lesson 7's grid: ``placements`` from ``parallel_lm.placements(chunks, grid)``;
    ``optimizer`` an AdamW over this rank's pieces, or lesson 1's ShardedOptimizer over the
    "dp_cp" group, which keeps a piece's state on its owner: there the owner among the
    copies of a piece writes its state (of a tp-replicated piece, tp rank 0's owner)."""
    sharded = hasattr(optimizer, "owner")
    inner = optimizer.optim if sharded else optimizer
    init_adamw_state(inner)
    layout = []
    for placement in placements:
        p = placement["tensor"]
        full_shape = list(placement["full_shape"])
        boxes = [([list(pair) for pair in local], [list(pair) for pair in full])
                 for local, full in placement["boxes"]]
        layout.append(entry(f"model.{placement['name']}", p, full_shape, boxes,
                            placement["replica"]))
        write_state = placement["replica"]
        if sharded:
            if optimizer.owner[p] != grid.rank("dp_cp"):
                continue                        # another rank of dp_cp keeps this state
            write_state = list(p.shape) != full_shape or grid.rank("tp") == 0
        layout += adamw_entries(placement["name"], boxes, full_shape, inner.state[p],
                                write_state)
    return layout


def lm_block_columns(parameter_names, preset: dict) -> dict:
    """``checkpoint.save``'s ``block_columns`` for the course LM (a ``models.PRESETS`` entry):
    tensor parallelism cuts attn.out and mlp.2 weights and the mlp.0 bias along their last
    dimension at multiples of in / tp; units that narrow suit the largest tp the model allows."""
    finest = math.gcd(preset["num_heads"], preset["d_ff"])
    widths = {}
    for name in parameter_names:
        width = None
        if name.endswith("attn.out.weight"):
            width = preset["d_model"] // finest
        if name.endswith(("mlp.2.weight", "mlp.0.bias")):
            width = preset["d_ff"] // finest
        if width is not None:
            widths[f"model.{name}"] = width
            widths.update({f"optimizer.{name}.{key}": width for key in ADAMW_MOMENTS})
    return widths
