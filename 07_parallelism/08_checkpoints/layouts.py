"""Stage 07, lesson 8: layouts, what each rank holds, for ``checkpoint.py``. Torch alone.

For a checkpoint every way of training is the same: each rank holds boxes of full tensors, one
rank per box writes it. A layout: ``[{"name", "tensor", "full_shape", "boxes": [(local_box,
full_box)], "write"}]``. AdamW's moments have their parameter's boxes (AdamW is elementwise);
its ``step``, a scalar, is written by the rank writing the parameter's first element.
"""

from __future__ import annotations

import math

import torch

ADAMW_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")   # the last one with amsgrad only


def whole(shape) -> list[list[int]]:
    return [[0, size] for size in shape]


def entry(name: str, tensor: torch.Tensor, full_shape, boxes, write: bool) -> dict:
    return dict(name=name, tensor=tensor, full_shape=list(full_shape), boxes=boxes, write=write)


def init_adamw_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW makes its state at its first step; a layout to load into needs it now."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if len(state) > 0:
                continue
            on_device = group.get("capturable") or group.get("fused")   # else on the CPU
            state["step"] = torch.zeros((), device=p.device if on_device else "cpu")
            for key in ADAMW_MOMENTS if group.get("amsgrad") else ADAMW_MOMENTS[:2]:
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)


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


def padded_row_block(full_shape, rank: int, world_size: int) -> list:
    """FSDP's box on ``rank``: rows [r k, (r+1) k), k = ceil(rows / world_size), no padding."""
    rows_per_rank = math.ceil(full_shape[0] / world_size)               # k
    first = min(rank * rows_per_rank, full_shape[0])
    last = min(first + rows_per_rank, full_shape[0])
    if first == last:
        return []
    return [([[0, last - first]] + whole(full_shape[1:]), [[first, last]] + whole(full_shape[1:]))]


def grid_layout(placements: list[dict], grid, optimizer) -> list[dict]:
    """Lesson 7's grid; with lesson 1's ShardedOptimizer a piece's owner writes its state."""
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
    """``save``'s ``block_columns`` for the course LM: the narrowest column cut any tp makes."""
    finest = math.gcd(preset["num_heads"], preset["d_ff"])
    cut = {"attn.out.weight": preset["d_model"] // finest, "mlp.2.weight": preset["d_ff"] // finest,
           "mlp.0.bias": preset["d_ff"] // finest}
    widths = {}
    for name in parameter_names:
        for suffix, width in cut.items():
            if name.endswith(suffix):
                widths[f"model.{name}"] = width
                widths.update({f"optimizer.{name}.{key}": width for key in ADAMW_MOMENTS})
    return widths
