"""Lesson 8's checks, for tests/test_07_checkpoints.py: each case saved after two training
steps and loaded into another layout:
* FSDP at W ranks -> FSDP at W - 1 ranks, and -> one process (``consolidate``);
* the grid (dp, tp) = (2, W/2) -> (pp, dp) = (2, W/2), and -> one process;
* ZeRO-1 at W - 1 ranks -> one process with a plain AdamW (``load_state_dict``);
* HSDP (lesson 7's grid, 2 copies of 2 shards) -> FSDP at 4 ranks -> HSDP again (W = 4);
and for each: the full tensors (weights and AdamW's moments and steps) after the load bitwise
equal to what was saved; two more steps from the loaded state equal to two more steps of the
run that never stopped (loss and weights, float32 tolerance: the layouts sum the gradients in
a different order); the bytes each rank wrote equal to its own boxes (replicas once; together
exactly the full state) and the bytes each rank read equal to what it holds (the overlap);
then damaged checkpoints (truncated, corrupted, a file missing, no manifest, another model's,
one the layout cannot hold): each refused on every rank with one line naming the file, and
nothing loaded. Every verdict is gathered: all ranks fail together, naming what differed.
The demo a learner runs is 07_parallelism/08_checkpoints/run_checkpoint.py; this module is
the same kind of check, wider, with the hooks its tests plant bugs through.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from common import import_stage

checkpoint = import_stage("07_parallelism/08_checkpoints/checkpoint")
layouts = import_stage("07_parallelism/08_checkpoints/layouts")

LR = 1e-3
# AdamW's eps, as in lesson 7's train.py: with torch's 1e-8, rounding noise in a near-zero
# gradient becomes a step of about the learning rate; 1e-6 keeps it below float32 tolerance.
ADAM_EPS = 1e-6
VOCAB = 256
SEQ = 16
# Training continued in another layout sums the gradients in another order: the weights agree
# to float32 rounding carried through two AdamW steps of LR (measured: below 1e-6), the loss
# to float32's relative precision. A bug (a moment lost, a step counter reset, a box moved)
# moves weights by about LR = 1e-3.
WEIGHT_ATOL = 1e-5
WEIGHT_RTOL = 1e-4
LOSS_RTOL = 1e-5


def zero1_layout(model: torch.nn.Module, optimizer, group=None) -> list[dict]:
    """ZeRO-1 (lesson 1's ShardedOptimizer): a parameter's owner writes it and its state."""
    layouts.init_adamw_state(optimizer.optim)
    layout = []
    for name, p in model.named_parameters():
        boxes = [(layouts.whole(p.shape), layouts.whole(p.shape))]
        owns = optimizer.owner[p] == dist.get_rank(group)
        layout.append(layouts.entry(f"model.{name}", p, p.shape, boxes, owns))
        if owns:
            layout += layouts.adamw_entries(name, boxes, p.shape, optimizer.optim.state[p], True)
    return layout


def fsdp_layout(fsdp: torch.nn.Module, optimizer, full_shapes: dict, group=None) -> list[dict]:
    """FSDP (lesson 2): row blocks of the 2+-D weights, 1-D ones whole (rank 0 writes them);
    ``full_shapes``: {name: shape} unwrapped."""
    rank = dist.get_rank(group)
    world_size = dist.get_world_size(group)
    layouts.init_adamw_state(optimizer)
    layout = []
    for name, p in fsdp.module.named_parameters():
        full_shape = list(full_shapes[name])
        boxes = [(layouts.whole(full_shape), layouts.whole(full_shape))]
        write = rank == 0
        if len(full_shape) >= 2:
            rows = math.ceil(full_shape[0] / world_size)
            if p.shape[0] != rows:       # another sharding: its boxes would be wrong, silently
                raise ValueError(f"fsdp_layout: {name} holds {p.shape[0]} rows; FSDP at "
                                 f"{world_size} ranks holds ceil({full_shape[0]} / "
                                 f"{world_size}) = {rows}")
            boxes = layouts.padded_row_block(full_shape, rank, world_size)
            write = True
        layout.append(layouts.entry(f"model.{name}", p, full_shape, boxes, write))
        layout += layouts.adamw_entries(name, boxes, full_shape, optimizer.state[p], write)
    return layout


def lessons():
    """The lessons whose layouts are checkpointed: ZeRO, FSDP, and lesson 7's grid."""
    zero = import_stage("07_parallelism/01_zero/zero")
    fsdp = import_stage("07_parallelism/02_fsdp/fsdp")
    import_stage("07_parallelism/03_tensor_parallel/tensor_parallel")
    import_stage("07_parallelism/04_pipeline_parallel/pipeline_parallel")
    import_stage("07_parallelism/05_context_parallel/context_parallel")
    grid = import_stage("07_parallelism/07_together/grid")
    parallel_lm = import_stage("07_parallelism/07_together/parallel_lm")
    return zero, fsdp, grid, parallel_lm


# --------------------------------------------------------------------------- verdicts


def agree(problems: list[str], group=None) -> list[str]:
    """Every rank's problems on every rank, named by rank: one verdict (common/verify.py)."""
    from common import verify
    return verify.agree_on_problems(problems, group)


def bitwise_problems(label: str, got: dict, want: dict) -> list[str]:
    """Every tensor of ``want`` in ``got``, bitwise equal."""
    problems = []
    for name, expected in want.items():
        if name not in got:
            problems.append(f"{label}: {name} is missing")
            continue
        if not torch.equal(got[name], expected):
            difference = (got[name].double() - expected.double()).abs().max().item()
            problems.append(f"{label}: {name} is not bitwise equal to what was saved (max "
                            f"difference {difference:.3g})")
    return problems


def close_problems(label: str, got: dict, want: dict, got_losses, want_losses) -> tuple:
    """Weights allclose (WEIGHT_ATOL, WEIGHT_RTOL) and losses within LOSS_RTOL; returns the
    problems and the largest weight difference."""
    problems = []
    worst = 0.0
    for name, expected in want.items():
        difference = (got[name] - expected).abs().max().item()
        worst = max(worst, difference)
        if not torch.allclose(got[name], expected, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL):
            problems.append(f"{label}: {name} differs from the run that never stopped by "
                            f"{difference:.3g}")
    for step, (loss, expected) in enumerate(zip(got_losses, want_losses)):
        if not math.isclose(loss, expected, rel_tol=LOSS_RTOL):
            problems.append(f"{label}: loss {loss:.7f} after the load, {expected:.7f} in the run "
                            f"that never stopped (step {step + 3})")
    return problems, worst


def count_problem(label: str, what: str, got: int, want: int) -> list[str]:
    if got != want:
        return [f"{label}: {what} {got} bytes, expected {want}"]
    return []


def staging_counts(layout: list[dict]) -> dict:
    """What a save of ``layout`` copies to the host (checkpoint.staging_plan's choice):
    {"bytes_staged", "copies"}."""
    copied = [view for _, _, view, copy in checkpoint.staging_plan(layout) if copy]
    return {"bytes_staged": sum(v.numel() * v.element_size() for v in copied),
            "copies": len(copied)}


def layout_bytes(layout: list[dict], written_only: bool = False) -> int:
    """Bytes of the boxes of a layout (what it holds, padding excluded), or of those it writes."""
    total = 0
    for item in layout:
        if written_only and not item["write"]:
            continue
        for _, full_box in item["boxes"]:
            total += math.prod(checkpoint.box_shape(full_box)) * item["tensor"].element_size()
    return total


# --------------------------------------------------------------------------- the model, the data


def tiny_lm(seed: int, context_length: int = SEQ):
    from common import models
    torch.manual_seed(seed)
    return models.TransformerLM("tiny", vocab_size=VOCAB, context_length=context_length)


def global_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``, the same on every rank: [batch_size, SEQ] inputs and targets."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(VOCAB, (batch_size, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def my_rows(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    rows = tensor.shape[0] // world_size
    return tensor[rank * rows:(rank + 1) * rows]


def meta_for(parameter_names: list[str], optimizer) -> dict:
    """What the manifest carries for consolidate: the plain model's parameter order and the
    optimizer's settings."""
    return {"parameter_order": parameter_names, "optimizer": layouts.optimizer_options(optimizer)}


def parameter_names() -> list[str]:
    return [name for name, _ in tiny_lm(0).named_parameters()]


def full_state_bytes() -> int:
    """The tiny LM's state, each element once: weights, and AdamW's two moments and a step
    (4 bytes) per parameter."""
    total = 0
    for p in tiny_lm(0).parameters():
        total += 3 * p.numel() * 4 + 4
    return total


def plain_state(model, optimizer) -> dict:
    """One process's model and AdamW state under the checkpoint's names."""
    state = {}
    for name, p in model.named_parameters():
        state[f"model.{name}"] = p.detach().clone()
        if optimizer is not None:
            for key, value in optimizer.state[p].items():
                state[f"optimizer.{name}.{key}"] = value.detach().clone()
    return state


def weights_of(state: dict) -> dict:
    weights = {}
    for name, value in state.items():
        if name.startswith("model."):
            weights[name] = value
    return weights


def one_process_steps(model, optimizer, steps, batch_size) -> list[float]:
    """Train one process on the whole batches of ``steps``."""
    from common import models
    losses = []
    for step in steps:
        inputs, targets = global_batch(step, batch_size)
        optimizer.zero_grad(set_to_none=True)
        loss = models.lm_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def one_process_problems(label: str, folder, saved: dict, never_stopped: dict, losses,
                         batch_size: int) -> tuple[list[str], float]:
    """Load ``folder`` into one process (``consolidate``, then a plain LM and a plain AdamW's
    load_state_dict), compare it with ``saved`` bitwise, train steps 3 and 4, compare with the
    run that never stopped."""
    state = checkpoint.consolidate(folder)
    model = tiny_lm(seed=3)
    model.load_state_dict(state["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    optimizer.load_state_dict(state["optimizer"])
    problems = bitwise_problems(f"{label} -> one process", plain_state(model, optimizer), saved)
    got_losses = one_process_steps(model, optimizer, (2, 3), batch_size)
    found, worst = close_problems(f"{label} -> one process", plain_state(model, None),
                                  never_stopped, got_losses, losses)
    return problems + found, worst


# --------------------------------------------------------------------------- FSDP


def fsdp_step(fsdp, optimizer, step: int, batch_size: int, group) -> float:
    """One step of FSDP over ``group``: this rank's rows of the batch; returns the batch loss."""
    from common import models
    rank = dist.get_rank(group)
    world_size = dist.get_world_size(group)
    inputs, targets = global_batch(step, batch_size)
    optimizer.zero_grad(set_to_none=True)
    loss = models.lm_loss(fsdp(my_rows(inputs, rank, world_size)),
                          my_rows(targets, rank, world_size))
    loss.backward()
    fsdp.finish_gradient_synchronization()
    optimizer.step()
    mean = loss.detach().reshape(1) / world_size
    dist.all_reduce(mean, group=group)
    return mean.item()


def fsdp_full_state(fsdp, optimizer, full_shapes: dict, group) -> dict:
    """What FSDP holds, made whole again without the checkpoint: every rank's padded blocks
    gathered (one all_gather of them all, flattened), the padding cut off; 1-D tensors are
    whole everywhere."""
    world_size = dist.get_world_size(group)
    state = {}
    blocks = []                                 # (full name, rows of the full tensor, block)
    for name, p in fsdp.module.named_parameters():
        tensors = {f"model.{name}": p.detach()}
        for key, value in optimizer.state[p].items():
            tensors[f"optimizer.{name}.{key}"] = value
        for full_name, local in tensors.items():
            if local.dim() >= 2:
                blocks.append((full_name, full_shapes[name][0], local))
            else:
                state[full_name] = local.detach().clone()
    flat = torch.cat([local.reshape(-1) for _, _, local in blocks])
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat, group=group)
    offset = 0
    for full_name, rows, local in blocks:
        pieces = []
        for theirs in everyone:                 # rank r's block of this tensor, rank by rank
            pieces.append(theirs[offset:offset + local.numel()].view_as(local))
        state[full_name] = torch.cat(pieces)[:rows]
        offset += local.numel()
    return state


def fsdp_bytes(full_shapes: dict, rank: int, world_size: int, written: bool) -> int:
    """Bytes of FSDP's state on ``rank`` at ``world_size`` (padding excluded), counted from the
    shapes alone: the rank's rows of each weight, three times (the weight and two moments);
    the 1-D parameters whole, three times too; a step counter (4 bytes) per parameter.
    ``written``: what the rank writes: the 1-D parameters and the steps on rank 0 only (rank 0
    holds every weight's first row); else what it holds: the steps everywhere."""
    total = 0
    for shape in full_shapes.values():
        numel = 1
        for size in shape:
            numel *= size
        if len(shape) >= 2:
            rows_per_rank = math.ceil(shape[0] / world_size)
            rows_here = max(0, min(rows_per_rank, shape[0] - rank * rows_per_rank))
            total += 3 * rows_here * (numel // shape[0]) * 4
        elif rank == 0 or not written:
            total += 3 * numel * 4
        if rank == 0 or not written:
            total += 4
    return total


def fsdp_case(ctx, root: Path) -> tuple[list[str], list[dict], float]:
    """FSDP at W ranks, saved after 2 steps; loaded at W - 1 ranks and in one process."""
    _, fsdp_mod, _, _ = lessons()
    world_size = ctx.world_size
    smaller = world_size - 1
    batch_size = world_size * smaller
    problems = []
    rows = []
    label = f"FSDP {world_size} -> FSDP {smaller}"
    model = tiny_lm(seed=1)
    full_shapes = {}
    for name, p in model.named_parameters():
        full_shapes[name] = list(p.shape)
    fsdp = fsdp_mod.FSDP(model)
    optimizer = torch.optim.AdamW(fsdp.parameters(), lr=LR, eps=ADAM_EPS)
    for step in (0, 1):
        fsdp_step(fsdp, optimizer, step, batch_size, None)
    saved = fsdp_full_state(fsdp, optimizer, full_shapes, None)
    layout = fsdp_layout(fsdp, optimizer, full_shapes)
    stats = checkpoint.save(root / "fsdp", layout, 2, f"fsdp at {world_size} ranks",
                            meta_for(list(full_shapes), optimizer))
    want = fsdp_bytes(full_shapes, ctx.rank, world_size, written=True)
    problems += count_problem(label, "written", stats["bytes_written"], want)
    rows.append({"case": f"save FSDP {world_size}", "rank": ctx.rank,
                 "bytes": stats["bytes_written"], "expected": want})
    losses = []
    for step in (2, 3):
        losses.append(fsdp_step(fsdp, optimizer, step, batch_size, None))
    never_stopped = weights_of(fsdp_full_state(fsdp, optimizer, full_shapes, None))
    folder = checkpoint.latest_checkpoint(root / "fsdp")
    found, target_rows, worst = fsdp_smaller_problems(ctx, folder, saved, full_shapes,
                                                      never_stopped, losses)
    problems += found
    rows += target_rows
    if ctx.rank == 0:
        found, difference = one_process_problems(f"FSDP {world_size}", folder, saved,
                                                 never_stopped, losses, batch_size)
        problems += found
        worst = max(worst, difference)
    return problems, rows, worst


def fsdp_smaller_problems(ctx, folder, saved: dict, full_shapes: dict, never_stopped=None,
                          losses=None) -> tuple[list[str], list[dict], float]:
    """The FSDP checkpoint of W ranks ``folder`` loaded by FSDP at W - 1 ranks: the bytes read
    by each (the formula), the state made whole bitwise equal to ``saved``; with
    ``never_stopped``: steps 3 and 4 from it equal to the run that never stopped."""
    _, fsdp_mod, _, _ = lessons()
    smaller = ctx.world_size - 1
    batch_size = ctx.world_size * smaller
    label = f"FSDP {ctx.world_size} -> FSDP {smaller}"
    problems = []
    rows = []
    worst = 0.0
    group = dist.new_group(list(range(smaller)))          # every rank makes every group
    if ctx.rank >= smaller:
        return problems, rows, worst
    target = fsdp_mod.FSDP(tiny_lm(seed=2), process_group=group)
    target_optimizer = torch.optim.AdamW(target.parameters(), lr=LR, eps=ADAM_EPS)
    target_layout = fsdp_layout(target, target_optimizer, full_shapes, group)
    stats = checkpoint.load(folder, target_layout, group=group)
    want = fsdp_bytes(full_shapes, ctx.rank, smaller, written=False)
    problems += count_problem(label, "read", stats["bytes_read"], want)
    problems += count_problem(label, "needed", stats["bytes_needed"], want)
    rows.append({"case": f"load FSDP {smaller}", "rank": ctx.rank,
                 "bytes": stats["bytes_read"], "expected": want})
    loaded = fsdp_full_state(target, target_optimizer, full_shapes, group)
    problems += bitwise_problems(label, loaded, saved)
    if never_stopped is not None:
        target_losses = []
        for step in (2, 3):
            target_losses.append(fsdp_step(target, target_optimizer, step, batch_size, group))
        continued = weights_of(fsdp_full_state(target, target_optimizer, full_shapes, group))
        found, worst = close_problems(label, continued, never_stopped, target_losses, losses)
        problems += found
    return problems, rows, worst


# --------------------------------------------------------------------------- ZeRO-1


def zero_full_state(model, optimizer, group) -> dict:
    """ZeRO-1's state made whole without the checkpoint: the weights (every rank's are the
    same) and each parameter's AdamW state from its owner (all_gather_object)."""
    names = {}
    for name, p in model.named_parameters():
        names[p] = name
    mine = {}
    for p, state in optimizer.optim.state.items():
        for key, value in state.items():
            mine[f"optimizer.{names[p]}.{key}"] = value.detach().clone()
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    state = plain_state(model, None)
    for theirs in everyone:
        state.update(theirs)
    return state


def zero_step(model, optimizer, step: int, batch_size: int, group) -> float:
    """One data-parallel step: this rank's rows, gradients averaged over ``group``, then the
    ShardedOptimizer's step (each owner updates, then broadcasts)."""
    from common import models
    rank = dist.get_rank(group)
    world_size = dist.get_world_size(group)
    inputs, targets = global_batch(step, batch_size)
    optimizer.zero_grad(set_to_none=True)
    loss = models.lm_loss(model(my_rows(inputs, rank, world_size)),
                          my_rows(targets, rank, world_size))
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, group=group)
        p.grad.div_(world_size)
    optimizer.step()
    mean = loss.detach().reshape(1) / world_size
    dist.all_reduce(mean, group=group)
    return mean.item()


def zero_case(ctx, root: Path) -> tuple[list[str], list[dict], float]:
    """ZeRO-1 at W - 1 ranks, saved after 2 steps; loaded in one process with a plain AdamW."""
    zero, _, _, _ = lessons()
    ranks = max(1, ctx.world_size - 1)
    batch_size = 2 * ranks
    label = f"ZeRO-1 {ranks} -> plain AdamW"
    problems = []
    rows = []
    group = dist.new_group(list(range(ranks)))
    worst = 0.0
    saved = None
    never_stopped = None
    losses = []
    if ctx.rank < ranks:
        model = tiny_lm(seed=1)
        optimizer = zero.ShardedOptimizer(model.parameters(), torch.optim.AdamW,
                                          process_group=group, lr=LR, eps=ADAM_EPS)
        for step in (0, 1):
            zero_step(model, optimizer, step, batch_size, group)
        saved = zero_full_state(model, optimizer, group)
        layout = zero1_layout(model, optimizer, group)
        stats = checkpoint.save(root / "zero", layout, 2, f"zero-1 at {ranks} ranks",
                                meta_for(parameter_names(), optimizer), group=group)
        want = 0            # the owner's parameters, each with two moments and a step
        for p in model.parameters():
            if optimizer.owner[p] == dist.get_rank(group):
                want += 3 * p.numel() * 4 + 4
        problems += count_problem(label, "written", stats["bytes_written"], want)
        rows.append({"case": f"save ZeRO-1 {ranks}", "rank": ctx.rank,
                     "bytes": stats["bytes_written"], "expected": want})
        for step in (2, 3):
            losses.append(zero_step(model, optimizer, step, batch_size, group))
        never_stopped = plain_state(model, None)
    if ctx.rank == 0:
        folder = checkpoint.latest_checkpoint(root / "zero")
        found, worst = one_process_problems(f"ZeRO-1 {ranks}", folder, saved, never_stopped,
                                            losses, batch_size)
        problems += found
    return problems, rows, worst


# --------------------------------------------------------------------------- the grid


def grid_full_state(chunks, grid, optimizer, parallel_lm) -> dict | None:
    """The grid's weights and AdamW state made whole on rank 0 without the checkpoint: each
    rank sends the boxes it is the saving replica of (``placements``), for the weight and its
    moments alike, and its step counter with the first element."""
    mine = []
    for placement in parallel_lm.placements(chunks, grid):
        if not placement["replica"]:
            continue
        p = placement["tensor"]
        tensors = {f"model.{placement['name']}": p.detach()}
        for key, value in optimizer.state[p].items():
            tensors[f"optimizer.{placement['name']}.{key}"] = value
        for name, local in tensors.items():
            if local.dim() == 0:
                has_origin = False
                for _, full_box in placement["boxes"]:
                    if all(start == 0 for start, _ in full_box):
                        has_origin = True
                if has_origin:
                    mine.append((name, [], [([], local.clone())]))
                continue
            pieces = []
            for local_box, full_box in placement["boxes"]:
                index = tuple(slice(start, stop) for start, stop in local_box)
                pieces.append((full_box, local[index].clone()))
            mine.append((name, list(placement["full_shape"]), pieces))
    return parallel_lm.assemble_boxes(mine, 0)


def grid_steps(chunks, grid, optimizer, parallel_lm, steps, batch_size, device) -> list[float]:
    losses = []
    for step in steps:
        inputs, targets = global_batch(step, batch_size)
        result = parallel_lm.train_step(chunks, grid, "1f1b", 1, inputs, targets, device)
        optimizer.step()
        losses.append(result["loss"])
    return losses


def grid_fits(world_size: int) -> bool:
    """(dp, tp) = (2, W/2) needs W even and W/2 dividing the tiny LM's 4 heads."""
    return world_size % 2 == 0 and 4 % (world_size // 2) == 0


def grid_case(ctx, root: Path) -> tuple[list[str], list[dict], float]:
    """(dp, tp) = (2, W/2), saved after 2 steps; loaded into (pp, dp) = (2, W/2) and into one
    process."""
    from common import models
    _, _, grid_mod, parallel_lm = lessons()
    world_size = ctx.world_size
    tp = world_size // 2
    batch_size = 2 * tp
    label = f"(dp, tp) = (2, {tp}) -> (pp, dp) = (2, {tp})"
    problems = []
    rows = []
    preset = models.PRESETS["tiny"]
    names = parameter_names()
    block_columns = layouts.lm_block_columns(names, preset)
    grid = grid_mod.ProcessGrid(dp=2, tp=tp)
    chunks = [chunk.to(ctx.device) for chunk in parallel_lm.build_chunks(tiny_lm(seed=1), grid,
                                                                         SEQ)]
    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = torch.optim.AdamW(params, lr=LR, eps=ADAM_EPS)
    grid_steps(chunks, grid, optimizer, parallel_lm, (0, 1), batch_size, ctx.device)
    saved = grid_full_state(chunks, grid, optimizer, parallel_lm)
    layout = layouts.grid_layout(parallel_lm.placements(chunks, grid), grid, optimizer)
    stats = checkpoint.save(root / "grid", layout, 2, f"grid dp 2 x tp {tp}",
                            meta_for(names, optimizer), block_columns)
    want = layout_bytes(layout, written_only=True)
    problems += count_problem(label, "written", stats["bytes_written"], want)
    total = torch.tensor([stats["bytes_written"]], dtype=torch.int64)
    dist.all_reduce(total)
    problems += count_problem(label, "written by all ranks", int(total.item()),
                              full_state_bytes())
    rows.append({"case": f"save dp 2 x tp {tp}", "rank": ctx.rank,
                 "bytes": stats["bytes_written"], "expected": want})
    losses = grid_steps(chunks, grid, optimizer, parallel_lm, (2, 3), batch_size, ctx.device)
    never_stopped = parallel_lm.full_state_dict(chunks, grid)
    folder = checkpoint.latest_checkpoint(root / "grid")
    target_grid = grid_mod.ProcessGrid(dp=tp, pp=2)
    target_chunks = [chunk.to(ctx.device) for chunk in
                     parallel_lm.build_chunks(tiny_lm(seed=2), target_grid, SEQ)]
    target_params = [p for chunk in target_chunks for p in chunk.parameters()]
    target_optimizer = torch.optim.AdamW(target_params, lr=LR, eps=ADAM_EPS)
    target_layout = layouts.grid_layout(parallel_lm.placements(target_chunks, target_grid),
                                        target_grid, target_optimizer)
    stats = checkpoint.load(folder, target_layout)
    want = layout_bytes(target_layout)
    problems += count_problem(label, "read", stats["bytes_read"], want)
    problems += count_problem(label, "needed", stats["bytes_needed"], want)
    rows.append({"case": f"load pp 2 x dp {tp}", "rank": ctx.rank,
                 "bytes": stats["bytes_read"], "expected": want})
    loaded = grid_full_state(target_chunks, target_grid, target_optimizer, parallel_lm)
    if ctx.rank == 0:
        problems += bitwise_problems(label, loaded, saved)
    target_losses = grid_steps(target_chunks, target_grid, target_optimizer, parallel_lm,
                               (2, 3), batch_size, ctx.device)
    continued = parallel_lm.full_state_dict(target_chunks, target_grid)
    worst = 0.0
    if ctx.rank == 0:
        prefixed = {}
        want_weights = {}
        for name, value in continued.items():
            prefixed[f"model.{name}"] = value
            want_weights[f"model.{name}"] = never_stopped[name]
        found, worst = close_problems(label, prefixed, want_weights, target_losses, losses)
        problems += found
        found, difference = one_process_problems(f"dp 2 x tp {tp}", folder, saved,
                                                 want_weights, losses, batch_size)
        problems += found
        worst = max(worst, difference)
    return problems, rows, worst


# --------------------------------------------------------------------------- HSDP <-> FSDP


def hsdp_fits(world_size: int) -> bool:
    """HSDP as (dp_replicate, dp_shard) = (2, 2) needs four ranks."""
    return world_size == 4


def hsdp_grid(seed: int, device):
    """Lesson 7's grid as HSDP, 2 copies of 2 shards (lesson 2's FSDP over each dp_shard
    pair), the tiny LM of ``seed`` on it, and AdamW over its blocks."""
    _, _, grid_mod, parallel_lm = lessons()
    grid = grid_mod.ProcessGrid(dp=4, dp_shard=2)
    chunks = [chunk.to(device) for chunk in parallel_lm.build_chunks(tiny_lm(seed), grid, SEQ)]
    parallel_lm.shard_chunks(chunks, grid)
    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = torch.optim.AdamW(params, lr=LR, eps=ADAM_EPS)
    return grid, chunks, optimizer


def hsdp_case(ctx, root: Path) -> tuple[list[str], list[dict], float]:
    """HSDP (2, 2) saved after 2 steps; loaded into plain FSDP at 4 ranks, which saves it
    again; that loaded into a fresh HSDP (2, 2): the state made whole after each load bitwise
    equal to what HSDP saved (every rank of a dp_shard pair writes its row blocks, one copy
    of the pair writes; the 1-D parameters once)."""
    _, fsdp_mod, _, parallel_lm = lessons()
    label = "HSDP 2 x 2 -> FSDP 4 -> HSDP 2 x 2"
    problems = []
    rows = []
    names = parameter_names()
    grid, chunks, optimizer = hsdp_grid(1, ctx.device)
    grid_steps(chunks, grid, optimizer, parallel_lm, (0, 1), 4, ctx.device)
    saved = grid_full_state(chunks, grid, optimizer, parallel_lm)     # rank 0; None elsewhere
    layout = layouts.grid_layout(parallel_lm.placements(chunks, grid), grid, optimizer)
    stats = checkpoint.save(root / "hsdp", layout, 2, "hsdp replicate 2 x shard 2",
                            meta_for(names, optimizer))
    want = layout_bytes(layout, written_only=True)
    problems += count_problem(label, "written", stats["bytes_written"], want)
    rows.append({"case": "save HSDP 2 x 2", "rank": ctx.rank, "bytes": stats["bytes_written"],
                 "expected": want})
    model = tiny_lm(seed=2)
    full_shapes = {}
    for name, p in model.named_parameters():
        full_shapes[name] = list(p.shape)
    fsdp = fsdp_mod.FSDP(model)
    fsdp_optimizer = torch.optim.AdamW(fsdp.parameters(), lr=LR, eps=ADAM_EPS)
    fsdp_4_layout = fsdp_layout(fsdp, fsdp_optimizer, full_shapes)
    checkpoint.load(checkpoint.latest_checkpoint(root / "hsdp"), fsdp_4_layout)
    loaded = fsdp_full_state(fsdp, fsdp_optimizer, full_shapes, None)
    if ctx.rank == 0:
        problems += bitwise_problems("HSDP 2 x 2 -> FSDP 4", loaded, saved)
    checkpoint.save(root / "hsdp_fsdp", fsdp_4_layout, 2, "fsdp at 4 ranks",
                    meta_for(names, fsdp_optimizer))
    grid, chunks, optimizer = hsdp_grid(3, ctx.device)
    back_layout = layouts.grid_layout(parallel_lm.placements(chunks, grid), grid, optimizer)
    checkpoint.load(checkpoint.latest_checkpoint(root / "hsdp_fsdp"), back_layout)
    back = grid_full_state(chunks, grid, optimizer, parallel_lm)
    if ctx.rank == 0:
        problems += bitwise_problems(label, back, saved)
    return problems, rows, 0.0


# --------------------------------------------------------------------------- damaged checkpoints


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(data)


def slice_offset(folder: Path, name: str, file_name: str) -> int:
    """Where ``name``'s first saved box in ``file_name`` starts (read from the manifest)."""
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
    for saved in manifest["tensors"][name]["slices"]:
        if saved["file"] == file_name:
            return saved["offset"]
    raise ValueError(f"{name} has no box in {file_name}")


def damage(folder: Path, root: Path, world_size: int) -> dict:
    """Rank 0: damaged copies of the FSDP checkpoint ``folder``: {case: (folder, expected
    words in the message, the file it must name, the ranks that must find it)}. The
    checkpoint saved by W ranks is loaded back at W ranks: rank r reads rank r's file (its
    rows) and rank 0's (the 1-D parameters, the steps)."""
    cases = {}
    everyone = list(range(world_size))
    last_file = f"rank_{world_size - 1:05d}.bin"
    copy = root / "truncated" / folder.name
    shutil.copytree(folder, copy)
    size = (copy / last_file).stat().st_size
    os.truncate(copy / last_file, size - 100)
    cases["truncated"] = (copy, "truncated", copy / last_file, [world_size - 1])
    copy = root / "corrupted_rows" / folder.name
    shutil.copytree(folder, copy)
    # row 5 of the token embedding's block on rank 1 (rows k .. 2k - 1): rank 1 reads it
    row_bytes = tiny_lm(0).token_embedding.weight.shape[1] * 4
    offset = slice_offset(copy, "model.token_embedding.weight", "rank_00001.bin")
    flip_byte(copy / "rank_00001.bin", offset + 5 * row_bytes + 2)
    cases["corrupted rows"] = (copy, "corrupted", copy / "rank_00001.bin", [1])
    copy = root / "corrupted_replica" / folder.name
    shutil.copytree(folder, copy)
    offset = slice_offset(copy, "model.norm.weight", "rank_00000.bin")    # every rank reads it
    flip_byte(copy / "rank_00000.bin", offset + 7)
    cases["corrupted replica"] = (copy, "corrupted", copy / "rank_00000.bin", everyone)
    copy = root / "missing_file" / folder.name
    shutil.copytree(folder, copy)
    (copy / last_file).unlink()
    cases["missing file"] = (copy, "missing", copy / last_file, [world_size - 1])
    copy = root / "no_manifest" / folder.name
    shutil.copytree(folder, copy)
    (copy / checkpoint.MANIFEST).unlink()
    cases["no manifest"] = (copy, "missing", copy / checkpoint.MANIFEST, everyone)
    return cases


def refusal(folder, layout, group=None) -> dict:
    """Load a damaged checkpoint: the message, who found it, and whether the layout's
    tensors are untouched."""
    before = []
    for item in layout:
        before.append(item["tensor"].detach().clone())
    result = {"message": None, "found_by": None}
    try:
        checkpoint.load(folder, layout, group=group)
    except checkpoint.CheckpointError as error:
        result["message"] = str(error)
        result["found_by"] = error.found_by
    unchanged = True
    for item, value in zip(layout, before):
        if not torch.equal(item["tensor"], value):
            unchanged = False
    result["unchanged"] = unchanged
    return result


def damaged_case(ctx, folder: Path, root: Path) -> tuple[list[str], dict]:
    """Damaged copies of the FSDP checkpoint of W ranks ``folder`` (made under ``root``), each
    loaded back at W ranks: refused on every rank, one line naming the file, nothing loaded;
    each found by exactly the ranks that read what is damaged."""
    _, fsdp_mod, _, _ = lessons()
    cases = None
    if ctx.rank == 0:
        cases = damage(folder, root / "damaged", ctx.world_size)
    shared = [cases]
    dist.broadcast_object_list(shared, src=0)
    cases = shared[0]
    # another model's checkpoint: the LM with twice the context (a longer position table);
    # one without optimizer state, which a layout holding AdamW's cannot be filled from
    other = tiny_lm(seed=4, context_length=2 * SEQ)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=LR)
    checkpoint.save(root / "damaged" / "other_model",
                    layouts.replicated_layout(other, other_optimizer, ctx.rank), 2, "ddp")
    folder_other = checkpoint.latest_checkpoint(root / "damaged" / "other_model")
    cases["another model"] = (folder_other, "another model", folder_other / "manifest.json",
                              list(range(ctx.world_size)))
    checkpoint.save(root / "damaged" / "weights_only",
                    layouts.replicated_layout(tiny_lm(seed=4), None, ctx.rank), 2, "ddp")
    folder_weights = checkpoint.latest_checkpoint(root / "damaged" / "weights_only")
    cases["cannot hold"] = (folder_weights, "cannot fill", folder_weights / "manifest.json",
                            list(range(ctx.world_size)))
    model = tiny_lm(seed=5)
    full_shapes = {}
    for name, p in model.named_parameters():
        full_shapes[name] = list(p.shape)
    target = fsdp_mod.FSDP(model)
    optimizer = torch.optim.AdamW(target.parameters(), lr=LR, eps=ADAM_EPS)
    layout = fsdp_layout(target, optimizer, full_shapes)
    findings = {}
    problems = []
    for label, (damaged, words, path, finders) in cases.items():
        result = refusal(damaged, layout)
        findings[label] = result
        message = result["message"]
        if message is None:
            problems.append(f"damaged ({label}): loaded without an error")
            continue
        if "\n" in message or str(path) not in message or words not in message:
            problems.append(f"damaged ({label}): the message {message!r} is not one line "
                            f"naming {path} and saying {words!r}")
        if result["found_by"] != finders:
            problems.append(f"damaged ({label}): found by ranks {result['found_by']}, "
                            f"expected {finders}")
        if not result["unchanged"]:
            problems.append(f"damaged ({label}): the layout's tensors changed")
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, findings)
    for label in findings:
        messages = set(theirs[label]["message"] for theirs in everyone)
        if len(messages) != 1:
            problems.append(f"damaged ({label}): the ranks raised different messages")
    return problems, findings


# --------------------------------------------------------------------------- the checks


CASES = ("fsdp", "zero", "grid", "hsdp", "damaged")


def run_checks(ctx, root: Path, cases=CASES) -> dict:
    """The lesson's checks (each a function above), on every rank; returns, the same on every
    rank: {"problems": [...], "rows": bytes per rank and case, "worst": the largest weight
    difference of continued training, "damaged": what each damaged checkpoint raised,
    "skipped": the cases this world size cannot run}."""
    problems = []
    rows = []
    worst = 0.0
    damaged = {}
    if "fsdp" in cases:
        found, case_rows, difference = fsdp_case(ctx, root)
        problems += found
        rows += case_rows
        worst = max(worst, difference)
    if "zero" in cases:
        found, case_rows, difference = zero_case(ctx, root)
        problems += found
        rows += case_rows
        worst = max(worst, difference)
    skipped = []
    if "grid" in cases and grid_fits(ctx.world_size):
        found, case_rows, difference = grid_case(ctx, root)
        problems += found
        rows += case_rows
        worst = max(worst, difference)
    elif "grid" in cases:
        skipped.append(f"the grid case: (dp, tp) = (2, W/2) needs W even and W/2 dividing "
                       f"the tiny LM's 4 heads, and W = {ctx.world_size}")
    if "hsdp" in cases and hsdp_fits(ctx.world_size):
        found, case_rows, _ = hsdp_case(ctx, root)
        problems += found
        rows += case_rows
    elif "hsdp" in cases:
        skipped.append(f"the HSDP case: (dp_replicate, dp_shard) = (2, 2) needs W = 4, and W = "
                       f"{ctx.world_size}")
    if "damaged" in cases:
        found, damaged = damaged_case(ctx, checkpoint.latest_checkpoint(root / "fsdp"), root)
        problems += found
    all_rows = [None] * ctx.world_size
    dist.all_gather_object(all_rows, rows)
    merged_rows = []
    for theirs in all_rows:
        merged_rows += theirs
    case_order = []                     # the cases in the order they ran
    for row in merged_rows:
        if row["case"] not in case_order:
            case_order.append(row["case"])
    merged_rows.sort(key=lambda row: (case_order.index(row["case"]), row["rank"]))
    worst_everywhere = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(worst_everywhere, op=dist.ReduceOp.MAX)
    return {"problems": agree(problems), "rows": merged_rows,
            "worst": worst_everywhere.item(), "damaged": damaged, "skipped": skipped}


def one_folder(ctx, given: str | None, prefix: str) -> Path:
    """The folder every rank works in: ``given``, or one rank 0 makes in the temp folder."""
    name = None
    if ctx.is_main:
        name = given or tempfile.mkdtemp(prefix=prefix)
    shared = [name]
    dist.broadcast_object_list(shared, src=0)
    return Path(shared[0])
