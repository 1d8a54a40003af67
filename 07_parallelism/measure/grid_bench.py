"""Not a lesson: the measurements of lesson 7 (everything together), for make bench.

    python 07_parallelism/measure/grid_bench.py --bench                   # 4 ranks, CPU sizes
    python 07_parallelism/measure/grid_bench.py --bench --bench-sizes gpu --world-size 8

Into results/grid.csv, in one launch: (1) our grids (``GRIDS``): train.py's step, timed in rounds (the
slowest rank's median), and per rank the bytes held and sent per axis, counted (``counters.py``) beside
``combined_formula``; (2) torch's composition (``parallelize_module`` then ``fully_shard``) as the control,
in pairs (the ``pair`` column): ``replicated_tp``, ``fsdp_tp`` (ours ZeRO-1) and ``hsdp``; (3) the pipeline
axis against ``torch.distributed.pipelining`` on pp = 2 and 4, real compute (gradients compared) and
emulated (a fixed wait per F, B and W), beside the simulation. A row holds the largest rank's count and
formula, and the worst relative difference of any rank in any column. What cannot end before make bench's
deadline (``BENCH_STEP_DEADLINE``) is skipped with a line. torch's context parallelism has no CPU path in
torch 2.13: no row.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import types
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import bench_pipeline  # first: it puts the repository on the path
from bench_pipeline import gradient_difference
from bench import results, step_bench, timing
from bench import supervisor as launch
from common import import_stage, models
from common.launch import carries_point_to_point
from counters import (CommCounter, FunctionalCommCounter, SavedActivations,
                      gathered_storage_keys, optimizer_state_bytes, state_bytes, storage_key)

CSV_NAME = "grid.csv"
CSV_KEY = ["impl", "grid", "setting", "model", "batch_size", "seq_len", "micro_batches",
           "world_size", "backend", "device"]
FLOAT = 4           # float32
INT64 = 8           # token ids and positions
STEP_COUNT = 4      # AdamW's step: one float32 scalar tensor per parameter tensor
VOCAB = 256         # bytes as tokens, as train.py trains
AXES = ("tp", "cp", "pp", "dp_cp", "dp_shard", "dp_replicate", "world", "other")  # other: no axis
KINDS = ("param", "grad", "optim", "activation")
ALL_KINDS = [*KINDS, *(f"sent_{axis}" for axis in AXES)]
TARGET_BYTES = 0.05          # counted within 5% of the formula
TARGET_TORCH_TP = 1.25       # ours at most 1.25x torch's composition, in each pair
TARGET_PIPELINE = 1.10       # our executor at most 1.10x torch.distributed.pipelining


def grid_spec(dp=1, pp=1, cp=1, tp=1, fsdp=False, schedule="1f1b", chunks=1,
              micro_batches=1, dp_shard=1) -> dict:
    """One grid: its degrees, ZeRO-1 or not, the schedule; dp_shard > 1: HSDP."""
    return {"dp": dp, "pp": pp, "cp": cp, "tp": tp, "fsdp": fsdp, "schedule": schedule,
            "chunks": chunks, "micro_batches": micro_batches, "dp_shard": dp_shard}


# The grids by world size (the tiny LM has 2 blocks: pp <= 2).
GRIDS = {
    4: [grid_spec(dp=4), grid_spec(dp=2, tp=2), grid_spec(dp=2, tp=2, fsdp=True), grid_spec(tp=4),
        grid_spec(pp=2, tp=2, micro_batches=4), grid_spec(dp=2, pp=2, micro_batches=4),
        grid_spec(cp=2, tp=2), grid_spec(dp=2, cp=2, fsdp=True),
        grid_spec(dp=4, dp_shard=2), grid_spec(dp=4, dp_shard=4)],
    8: [grid_spec(dp=8), grid_spec(dp=4, tp=2), grid_spec(dp=2, tp=4),
        grid_spec(dp=2, pp=2, tp=2, micro_batches=4), grid_spec(dp=2, cp=2, tp=2),
        grid_spec(pp=2, cp=2, tp=2, micro_batches=4),
        grid_spec(dp=2, pp=2, cp=2, fsdp=True, micro_batches=4),
        grid_spec(dp=8, dp_shard=4), grid_spec(dp=4, tp=2, dp_shard=2)],
}

# "cpu": about 2 minutes on 2 cores; "pipeline": part 3 (DualPipeV needs m >= 2p).
PIPELINE = {"stages": [2, 4], "schedules": ["gpipe", "1f1b", "interleaved", "zbv", "dualpipev"],
            "compute": ["real", "emulated"], "layers": 8, "micro_batches": 8}
SIZES = {
    "cpu": {"model": "tiny", "batch_size": 16, "seq_len": 64, "warmup": 1, "iters": 4,
            "rounds": 2, "lr": 3e-3, "pipeline": {**PIPELINE, "rows": 2, "seq_len": 64, "emulate_ms": 10.0}},
    "gpu": {"model": "small", "batch_size": 32, "seq_len": 1024, "warmup": 2, "iters": 5,
            "rounds": 2, "lr": 3e-3, "pipeline": {**PIPELINE, "rows": 4, "seq_len": 1024, "emulate_ms": 5.0}},
}


def grid_label(spec: dict) -> str:
    """'dp2 tp2', 'pp2 tp2': the axes of degree > 1."""
    parts = [f"{axis}{spec[axis]}" for axis in ("dp", "pp", "cp", "tp") if spec[axis] > 1]
    dp_shard = spec.get("dp_shard", 1)
    if dp_shard > 1:        # HSDP: the data axis by its two parts
        parts[0] = f"dp_replicate{spec['dp'] // dp_shard} dp_shard{dp_shard}"
    return " ".join(parts) or "one rank"


def setting_label(spec: dict) -> str:
    """The optimizer, and the schedule when there is a pipeline."""
    words = ["HSDP AdamW"] if spec.get("dp_shard", 1) > 1 else ["ZeRO-1 AdamW" if spec["fsdp"] else "AdamW"]
    if spec["pp"] > 1:
        words.append(f"{spec['schedule']} m{spec['micro_batches']}")
    return ", ".join(words)


def load_lessons() -> types.SimpleNamespace:
    """Lesson 7's train, grid and parallel_lm, lesson 3's torch plan, lesson 4's executor."""
    train = import_stage("07_parallelism/07_together/train")
    grid_module, parallel_lm, _ = train.lessons()
    return types.SimpleNamespace(
        train=train, grid=grid_module, parallel_lm=parallel_lm,
        torch_tp=import_stage("07_parallelism/03_tensor_parallel/torch_tensor_parallel"),
        pipeline=import_stage("07_parallelism/04_pipeline_parallel/pipeline_parallel"),
        schedules=import_stage("07_parallelism/04_pipeline_parallel/pipeline_schedules"))


def lm_shape(sizes: dict) -> dict:
    """The letters of the formula for the LM of ``sizes``."""
    preset = models.PRESETS[sizes["model"]]
    return {"h": preset["d_model"], "f": preset["d_ff"], "heads": preset["num_heads"],
            "layers": preset["num_layers"], "vocab": VOCAB, "seq": sizes["seq_len"],
            "batch": sizes["batch_size"]}


def ring_share(ranks: int) -> float:
    """(n-1)/n: the share of a payload one rank sends in a ring all-gather or reduce-scatter."""
    return (ranks - 1) / ranks


def combined_formula(shape: dict, spec: dict, pp_rank: int, world_size: int, dp_cp_rank: int = 0) -> dict:
    """The bytes per rank at pp_rank (ZeRO-1: dp_cp_rank in its group), by ALL_KINDS."""
    h, f, vocab, seq = shape["h"], shape["f"], shape["vocab"], shape["seq"]
    d, p, c, t = spec["dp"], spec["pp"], spec["cp"], spec["tp"]
    m, v = spec["micro_batches"], spec["chunks"]
    rows = shape["batch"] // (d * m)          # b: one micro-batch's rows on this rank
    context = seq // c                        # S: the tokens of this rank's context shard
    between = context // t                    # S / t: between the tensor-parallel regions
    blocks = shape["layers"] // p             # n: this rank's blocks, all its chunks
    virtual_stages = [chunk * p + pp_rank for chunk in range(v)]
    last_stage = p * v - 1
    first = 0 in virtual_stages
    last = last_stage in virtual_stages

    # Parameters, in values: whole on every tp rank (replicated) or split over tp.
    replicated = blocks * 5 * h                            # norm1, norm2 (2h each), fc2's bias
    split = blocks * (4 * h * h + 2 * h * f + f) // t      # qkv 3h^2, out h^2, fc1 hf + f, fc2 fh
    tensors = blocks * 10
    if first:
        replicated += (vocab + seq) * h                    # token and position embeddings
        tensors += 2
    if last:
        replicated += 2 * h + vocab * h                    # final LayerNorm, vocabulary head
        tensors += 3
    params = replicated + split
    summed_over_tp = replicated
    shard = spec.get("dp_shard", 1)
    if shard > 1:       # HSDP (pp = 1): FSDP's units padded over s; the 1-D parameters whole
        sharded = blocks * (fsdp_block(3 * h // t, h, shard) + fsdp_block(h, h // t, shard)
                            + fsdp_block(f // t, h, shard) + fsdp_block(h, f // t, shard))
        whole = blocks * (5 * h + f // t)
        summed_over_tp = blocks * 5 * h                    # LayerNorms, fc2's bias
        head_unit = 0
        if first:
            embedding_unit = fsdp_block(vocab, h, shard) + fsdp_block(seq, h, shard)
            sharded += embedding_unit
            summed_over_tp += embedding_unit
        if last:
            head_unit = fsdp_block(vocab, h, shard)
            sharded += head_unit
            whole += 2 * h
            summed_over_tp += 2 * h + head_unit
        params = sharded + whole
    optimizer_state = 2 * FLOAT * params + STEP_COUNT * tensors
    if spec["fsdp"] and shard == 1:                        # ZeRO-1 over the dp x cp ranks
        optimizer_state = zero1_dealt_state(shape, spec, pp_rank, dp_cp_rank)

    # What one micro-batch saves for backward on this rank.
    per_block = (2 * rows * context * h + 4 * rows * context) // t   # the two LayerNorms
    per_block += 2 * rows * context * h                    # the gathered inputs of qkv and fc1
    per_block += 4 * rows * context * h // t               # q, k, v, attention's output
    per_block += rows * (shape["heads"] // t) * context    # log-sum-exp
    per_block += 2 * rows * context * f // t               # fc1's output, GELU's
    if c > 1:
        per_block += rows * context * h // t               # the out projection's copy
    activation = FLOAT * blocks * per_block
    if first:
        activation += INT64 * (rows * between + between)   # token ids, positions
    if last:
        head_values = rows * between * (h + 2)             # final LayerNorm: input, mean, 1/std
        head_values += rows * between * h                  # its output, the head's input
        head_values += rows * between * vocab              # log-softmax
        activation += FLOAT * head_values + INT64 * rows * between + FLOAT

    # Bytes sent per step, by axis.
    sent = {axis: 0.0 for axis in AXES}
    gathered = FLOAT * rows * context * h                  # one [b, S, h] tensor
    sent["tp"] = m * blocks * 8 * ring_share(t) * gathered
    sent["tp"] += 2 * ring_share(t) * FLOAT * summed_over_tp
    if c > 1:
        kv_block = FLOAT * rows * context * h / t          # this rank's heads of K (or V)
        sent["cp"] = m * blocks * (4 * (c - 1) + 2 * c) * kv_block
    messages = 0
    for stage in virtual_stages:
        if stage < last_stage and (stage + 1) % p != pp_rank:
            messages += m                                  # activations forward
        if stage > 0 and (stage - 1) % p != pp_rank:
            messages += m                                  # gradients backward
    sent["pp"] = messages * FLOAT * rows * between * h
    data_and_context = d * c
    sent["dp_cp"] = 2 * ring_share(data_and_context) * FLOAT * params
    if spec["fsdp"]:
        sent["dp_cp"] += ring_share(data_and_context) * FLOAT * params
    sent["world"] = 2 * ring_share(world_size) * 8
    if shard > 1:
        # each unit gathered for forward and backward (the head once), each gradient scattered
        gathers = 2 * sharded - head_unit
        sent["dp_cp"] = 0.0
        sent["dp_shard"] = m * (gathers + sharded) * ring_share(shard) * FLOAT * shard
        sent["dp_shard"] += 2 * ring_share(shard) * FLOAT * whole   # 1-D gradients, over s
        sent["dp_replicate"] = 2 * ring_share(d // shard) * FLOAT * (sharded + whole)

    return {"param": FLOAT * params, "grad": FLOAT * params, "optim": optimizer_state,
            "activation": activation, **{f"sent_{axis}": sent[axis] for axis in AXES}}


def fsdp_block(rows: int, columns: int, ranks: int) -> int:
    """Values of one rank's FSDP block of a [rows, columns] weight (ceil(rows / ranks) rows)."""
    return -(-rows // ranks) * columns


def zero1_dealt_state(shape: dict, spec: dict, pp_rank: int, dp_cp_rank: int) -> int:
    """ZeRO-1's AdamW state on one rank: whole tensors, largest first, to the least-held rank."""
    h, f, t, p, chunks = shape["h"], shape["f"], spec["tp"], spec["pp"], spec["chunks"]
    sizes = []             # each tensor's values, in the optimizer's order (parallel_lm's chunks)
    for chunk in range(chunks):
        virtual_stage = chunk * p + pp_rank
        if virtual_stage == 0:
            sizes += [shape["vocab"] * h, shape["seq"] * h]
        for _ in range(shape["layers"] // (p * chunks)):
            sizes += [h, h, 3 * h * h // t, h * h // t, h, h, f * h // t, f // t, h * f // t, h]
        if virtual_stage == p * chunks - 1:
            sizes += [h, h, shape["vocab"] * h]
    loads = [0] * (spec["dp"] * spec["cp"])
    owned = [0] * (spec["dp"] * spec["cp"])       # the AdamW state bytes each rank ends with
    for index in sorted(range(len(sizes)), key=lambda index: -sizes[index]):   # ties: in order
        owner = loads.index(min(loads))
        loads[owner] += FLOAT * sizes[index]
        owned[owner] += 2 * FLOAT * sizes[index] + STEP_COUNT
    return owned[dp_cp_rank]


def zero1_deal_bound(shape: dict, spec: dict, pp_rank: int) -> float:
    """The largest tensor's AdamW state over the mean: how far ZeRO-1's deal may be off."""
    h, p = shape["h"], spec["pp"]
    virtual_stages = [chunk * p + pp_rank for chunk in range(spec["chunks"])]
    largest = max(3 * h * h, shape["f"] * h) // spec["tp"]        # qkv, fc1 or fc2
    if 0 in virtual_stages or p * spec["chunks"] - 1 in virtual_stages:
        largest = max(largest, shape["vocab"] * h, shape["seq"] * h)   # embeddings, head
    whole = combined_formula(shape, {**spec, "fsdp": False}, pp_rank, 1)["optim"]
    mean = whole / (spec["dp"] * spec["cp"])
    return (2 * FLOAT * largest + STEP_COUNT) / mean


def torch_formula(shape: dict, dp: int, tp: int, sharded: bool = True) -> dict:
    """torch's composition per rank (embeddings, head split over tp; ``sharded``: over dp)."""
    h, f, layers = shape["h"], shape["f"], shape["layers"]
    params = (shape["vocab"] + shape["seq"]) * h // tp + layers * (4 * h * h + 2 * h * f + f) // tp
    params += shape["vocab"] * h // tp
    params += layers * 5 * h + 2 * h                      # whole on every tp rank
    if sharded:
        params = params // dp
    tensors = 2 + layers * 12 + 3
    return {"param": FLOAT * params, "grad": FLOAT * params,
            "optim": 2 * FLOAT * params + STEP_COUNT * tensors}


def relative_difference(counted: float, formula: float) -> float:
    """|counted - formula| / formula; anything counted where the formula says 0: inf."""
    if formula == 0:
        return 0.0 if counted == 0 else math.inf
    return abs(counted - formula) / formula


def worst_difference(counted: dict, formula: dict) -> tuple[float, str]:
    """The largest relative difference over the formula's columns, and that column."""
    worst = (0.0, "")
    for kind, want in formula.items():
        difference = relative_difference(counted[kind], want)
        if difference > worst[0]:
            worst = (difference, kind)
    return worst


def random_batch(sizes: dict, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch, the same on every rank: byte tokens [batch, seq] and their targets."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(VOCAB, (sizes["batch_size"], sizes["seq_len"] + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def train_args(sizes: dict, spec: dict) -> argparse.Namespace:
    """What train.py's build reads."""
    degrees = {key: spec.get(key, 1) for key in ("dp", "pp", "cp", "tp", "dp_shard", "chunks")}
    return argparse.Namespace(model=sizes["model"], seq_len=sizes["seq_len"], seed=0, lr=sizes["lr"],
                              fsdp=spec["fsdp"], **degrees)


def saved_one_micro_batch(chunks, grid, parallel_lm, spec, sizes, inputs, targets, device) -> int:
    """Bytes autograd saves for one micro-batch through this rank's chunks and the loss."""
    rows = sizes["batch_size"] // (spec["dp"] * spec["micro_batches"])
    # copies with storage of their own: a saved slice of a bigger tensor keeps all of it
    my_inputs = parallel_lm.local_tokens(inputs, grid)[:rows].to(device).clone()   # [b, S/t]
    my_targets = parallel_lm.local_tokens(targets, grid)[:rows].to(device).clone()
    d_model = chunks[0].blocks[0].norm1.normalized_shape[0]
    loss_fn = parallel_lm.scaled_loss_fn(grid)
    total = 0
    for chunk in chunks:
        x = torch.randn(rows, my_inputs.shape[1], d_model, device=device) if chunk.embedding is None else my_inputs
        gathered = set
        if chunk.sharded_by:             # HSDP: FSDP's gathered weights are weights, not saved
            gathered = functools.partial(gathered_storage_keys, chunk.sharded_by[0])
        with SavedActivations(chunk, exclude_now=gathered) as saved:
            y = parallel_lm.runner(chunk)(x)
            if chunk.head is not None:
                loss_fn(y, my_targets)
        total += saved.bytes
    return total


def build_grid(ctx, spec: dict, sizes: dict, lessons) -> dict:
    """This rank's part of the LM on grid ``spec``, its optimizer, and a training step."""
    parallel_lm = lessons.parallel_lm
    grid, chunks, optimizer, _ = lessons.train.build(ctx, train_args(sizes, spec))
    params = [p for chunk in chunks for p in chunk.parameters()]
    inputs, targets = random_batch(sizes)

    def step():
        result = parallel_lm.train_step(chunks, grid, spec["schedule"], spec["micro_batches"],
                                        inputs, targets, ctx.device)
        optimizer.step()
        return result

    return {"grid": grid, "chunks": chunks, "params": params, "optimizer": optimizer,
            "inputs": inputs, "targets": targets, "step": step}


def count_grid(ctx, spec: dict, sizes: dict, built: dict, lessons) -> dict:
    """This rank's bytes in one step (HSDP: the second), beside its formula; the first loss."""
    grid = built["grid"]
    losses = []
    if spec.get("dp_shard", 1) > 1:
        losses.append(built["step"]()["loss"])
    # the group of a collective names its axis
    axes = {axis: grid.group(axis) for axis in ("tp", "cp", "pp", "dp_cp", "dp", "dp_shard", "dp_replicate")}
    with CommCounter(axes=axes) as comm:
        result = built["step"]()
    losses.append(result["loss"])
    counted = {"param": state_bytes(built["params"]),
               "grad": state_bytes(p.grad for p in built["params"]),
               "optim": optimizer_state_bytes(built["optimizer"]),
               "activation": saved_one_micro_batch(built["chunks"], grid, lessons.parallel_lm, spec, sizes,
                                                   built["inputs"], built["targets"], ctx.device)}
    sent = {axis: entry["sent_bytes"] for axis, entry in comm.by_axis.items()}
    counted.update({f"sent_{axis}": sent.get(axis, 0.0) for axis in AXES})
    if "dp" in sent:             # the formula sends nothing on dp alone: it goes under "other"
        counted["sent_other"] += sent["dp"]
    formula = combined_formula(lm_shape(sizes), spec, grid.rank("pp"), ctx.world_size, grid.rank("dp_cp"))
    worst, worst_kind = worst_difference(counted, formula)
    return {"rank": ctx.rank, "coordinate": dict(grid.coordinate), "counted": counted, "formula": formula,
            "worst": worst, "worst_kind": worst_kind, "loss": losses[0], "peak_held": result["peak_held"]}


def everyone(mine):
    """Every rank's ``mine``, in rank order, on every rank."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def byte_columns(per_rank: list[dict], kinds) -> dict:
    """The largest rank's count and formula of each kind, and the worst rank's difference."""
    columns = {}
    for kind in kinds:
        columns[f"{kind}_bytes"] = max(rank["counted"][kind] for rank in per_rank)
        if kind in per_rank[0]["formula"]:
            columns[f"{kind}_bytes_formula"] = max(rank["formula"][kind] for rank in per_rank)
    worst_rank = max(per_rank, key=lambda rank: rank["worst"])
    columns["worst_difference"] = worst_rank["worst"]
    columns["worst_where"] = f"rank {worst_rank['rank']} {worst_rank['worst_kind']}".strip()
    return columns


def timed_row(ctx, sizes: dict, impl: str, grid: str, setting: str, seconds: list[float],
              micro_batches: int) -> dict:
    """A CSV row's first columns: what ran, where, and the slowest rank's median step."""
    stats = timing.gather_times(seconds)
    tokens = sizes["batch_size"] * sizes["seq_len"]
    return {"impl": impl, "pair": "", "grid": grid, "setting": setting, "model": sizes["model"],
            "batch_size": sizes["batch_size"], "seq_len": sizes["seq_len"], "micro_batches": micro_batches,
            "world_size": ctx.world_size, "backend": ctx.backend, "device": ctx.device.type,
            "step_ms": stats.median * 1e3, "step_ms_min": stats.min * 1e3, "step_ms_max": stats.max * 1e3,
            "tokens_per_s": tokens / stats.median, "steps_timed": len(seconds),
            "machine": results.machine_name(), "run_id": results.run_id()}


def our_row(ctx, sizes: dict, spec: dict, setting: str, seconds: list[float], per_rank: list[dict],
            pair: str = "") -> dict:
    """Our grid's CSV row; ZeRO-1: the bound of the rank whose optimizer state is most off."""
    row = timed_row(ctx, sizes, "ours", grid_label(spec), setting, seconds, spec["micro_batches"])
    row.update(pair=pair, first_loss=per_rank[ctx.rank]["loss"])
    if not pair:
        row["peak_held"] = max(rank["peak_held"] for rank in per_rank)
    row.update(byte_columns(per_rank, ALL_KINDS))
    row["zero1_deal_bound"] = ""
    if spec["fsdp"]:
        most_off = max(per_rank, key=lambda rank: relative_difference(rank["counted"]["optim"],
                                                                      rank["formula"]["optim"]))
        row["zero1_deal_bound"] = zero1_deal_bound(lm_shape(sizes), spec, most_off["coordinate"]["pp"])
    return row


def reference_loss(sizes: dict, lessons) -> float:
    """The first step's loss on one process: every implementation must report it."""
    inputs, targets = random_batch(sizes)
    full_lm = lessons.train.build_full_lm(train_args(sizes, grid_spec()))
    with torch.no_grad():
        return models.lm_loss(full_lm(inputs), targets).item()


def build_torch(ctx, sizes: dict, lessons, data_mesh, tp_mesh=None) -> dict:
    """The LM with parallelize_module over ``tp_mesh``, then fully_shard over ``data_mesh``
    ((dp, 1): replicated; ``replicate`` after parallelize_module trains nothing)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    args = train_args(sizes, grid_spec())
    lm = lessons.train.build_full_lm(args)      # q, k and v as three Linears, as torch's plans expect
    lm.blocks = nn.ModuleList([lessons.torch_tp.SplitQKVBlock(block) for block in lm.blocks])
    lm = lm.to(ctx.device)
    if tp_mesh is not None:     # torch's tutorial's plan around the blocks, for our names
        sequence_out = {"input_layouts": Replicate(), "output_layouts": Shard(1)}
        plan = {"token_embedding": RowwiseParallel(**sequence_out),
                "position_embedding": RowwiseParallel(**sequence_out), "norm": SequenceParallel(),
                "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
        parallelize_module(lm, tp_mesh, plan)
    for block in lm.blocks:
        if tp_mesh is not None:                  # a plan's objects serve one module
            parallelize_module(block, tp_mesh, lessons.torch_tp.block_plan())
        fully_shard(block, mesh=data_mesh)
    fully_shard(lm, mesh=data_mesh)
    optimizer = torch.optim.AdamW(lm.parameters(), lr=args.lr, weight_decay=0.0, eps=lessons.train.ADAM_EPS)
    inputs, targets = random_batch(sizes)
    data_rank = 0
    for dim in range(data_mesh.ndim):            # row-major over the data mesh's dims
        data_rank = data_rank * data_mesh.size(dim) + data_mesh.get_local_rank(dim)
    rows = sizes["batch_size"] // data_mesh.size()
    my_inputs = inputs[data_rank * rows:(data_rank + 1) * rows].to(ctx.device)
    my_targets = targets[data_rank * rows:(data_rank + 1) * rows].to(ctx.device)
    # [1, seq]: each embedding [batch, seq/t, h] on each tp rank (their plans' Shard(1) outputs)
    positions = torch.arange(sizes["seq_len"], device=ctx.device).unsqueeze(0)

    def forward_loss():
        logits = lm(my_inputs, positions)        # every tp rank: all the tokens, all logits
        return F.cross_entropy(logits.flatten(0, 1), my_targets.flatten())

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = forward_loss()
        loss.backward()
        optimizer.step()
        return loss

    return {"lm": lm, "optimizer": optimizer, "step": step, "forward_loss": forward_loss}


def count_torch(ctx, built: dict, axes: dict, second: bool, formula: dict) -> dict:
    """torch's composition counted as ours (``second``: the second step), its first loss."""
    lm = built["lm"]
    first = built["step"]() if second else None
    with CommCounter(axes=axes) as comm:
        with FunctionalCommCounter(axes=axes) as functional:
            loss = built["step"]()
    first = (loss if first is None else first).detach().reshape(1) / ctx.world_size
    dist.all_reduce(first)
    counted = {"param": state_bytes(lm.parameters()), "grad": state_bytes(p.grad for p in lm.parameters()),
               "optim": optimizer_state_bytes(built["optimizer"])}
    counted.update({f"sent_{axis}": 0.0 for axis in [*AXES, "dp"]})
    for counter in (comm, functional):
        for axis, entry in counter.by_axis.items():
            counted[f"sent_{axis}"] += entry["sent_bytes"]
    def weights_now():          # fully_shard gathers the weights into new storage
        return {storage_key(p) for p in lm.parameters()}
    with SavedActivations(lm, exclude_now=weights_now) as saved:
        built["forward_loss"]()
    counted["activation"] = saved.bytes
    worst, worst_kind = worst_difference(counted, formula)
    return {"rank": ctx.rank, "counted": counted, "formula": formula, "worst": worst,
            "worst_kind": worst_kind, "loss": first.item()}


def compare_with_torch(ctx, sizes: dict, lessons, deadline) -> list[dict]:
    """Ours and torch's in three pairs, timed in alternating rounds: two rows a pair."""
    from torch.distributed.device_mesh import init_device_mesh
    tp = 2
    dp = shard = ctx.world_size // 2
    shape = lm_shape(sizes)
    rows = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        # one mesh for both tp pairs: the counter matches groups by name
        mesh = init_device_mesh(ctx.device.type, (dp, 1, tp), mesh_dim_names=("dp", "dp_shard", "tp"))
        hsdp_mesh = init_device_mesh(ctx.device.type, (2, shard), mesh_dim_names=("replicate", "shard"))
        tp_axes = {"dp": mesh["dp"].get_group(), "tp": mesh["tp"].get_group()}
        hsdp_axes = {"dp_replicate": hsdp_mesh["replicate"].get_group(),
                     "dp_shard": hsdp_mesh["shard"].get_group()}
        pairs = [("replicated_tp", grid_spec(dp=dp, tp=tp), mesh["dp", "dp_shard"], mesh["tp"],
                  tp_axes, "parallelize_module + fully_shard on (dp, 1): replicated",
                  torch_formula(shape, dp, tp, sharded=False)),
                 ("fsdp_tp", grid_spec(dp=dp, tp=tp, fsdp=True), mesh["dp"], mesh["tp"],
                  tp_axes, "parallelize_module + fully_shard", torch_formula(shape, dp, tp)),
                 ("hsdp", grid_spec(dp=ctx.world_size, dp_shard=shard), hsdp_mesh, None,
                  hsdp_axes, "fully_shard on a (replicate, shard) mesh: HSDP",
                  torch_formula(shape, shard, 1))]
        for pair, spec, data_mesh, tp_mesh, axes, torch_setting, formula in pairs:
            if not deadline.allows(f"torch's composition beside ours, {pair} and what follows"):
                break
            ours = build_grid(ctx, spec, sizes, lessons)
            ours_mine = count_grid(ctx, spec, sizes, ours, lessons)
            theirs = build_torch(ctx, sizes, lessons, data_mesh, tp_mesh)
            theirs_mine = count_torch(ctx, theirs, axes, pair == "hsdp", formula)
            seconds = measure_alternating(ctx, {"ours": ours["step"], "torch": theirs["step"]}, sizes)
            ours["grid"].destroy()
            setting = f"{setting_label(spec)}, timed beside torch's"
            rows.append(our_row(ctx, sizes, spec, setting, seconds["ours"], everyone(ours_mine), pair))
            row = timed_row(ctx, sizes, "torch", grid_label(spec), f"{torch_setting}, AdamW",
                            seconds["torch"], 1)
            row.update(byte_columns(everyone(theirs_mine), [*ALL_KINDS, "sent_dp"]), pair=pair,
                       first_loss=theirs_mine["loss"])
            rows.append(row)
    for group in {*tp_axes.values(), *hsdp_axes.values()}:
        dist.destroy_process_group(group)
    return rows


def measure_alternating(ctx, steps: dict, sizes: dict) -> dict[str, list[float]]:
    """Each step warmed up, then ``rounds`` rounds of ``iters`` calls of each in turn, pooled."""
    seconds = {}
    for name, step in steps.items():
        timing.measure(step, ctx.device, warmup=sizes["warmup"], iters=0)
        seconds[name] = []
    for _ in range(sizes["rounds"]):
        for name, step in steps.items():
            seconds[name] += timing.measure(step, ctx.device, warmup=0, iters=sizes["iters"], barrier=True)
    return seconds


def with_deferred_weight_grads(module: nn.Module, pipeline_parallel) -> nn.Module:
    """``module`` with each nn.Linear now lesson 4's DeferredLinear (same weights): W steps."""
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            deferred = pipeline_parallel.DeferredLinear(
                child.in_features, child.out_features, bias=child.bias is not None,
                device=child.weight.device)
            deferred.load_state_dict(child.state_dict())
            setattr(module, name, deferred)
        else:
            with_deferred_weight_grads(child, pipeline_parallel)
    return module


def build_pipelines(ctx, grid, sizes: dict, schedule_name: str, compute: str, lessons) -> dict:
    """Our executor and torch's on the same blocks and micro-batches: a step of each."""
    setting = sizes["pipeline"]
    shape = lm_shape(sizes)
    stages = grid.size("pp")
    pp_rank = grid.rank("pp")
    chunks_per_rank = lessons.schedules.chunks_per_rank(schedule_name, 2)   # 2: interleaved, V
    micro_batches = setting["micro_batches"]
    schedule = lessons.schedules.all_ranks(schedule_name, stages, micro_batches, chunks_per_rank)
    # W steps (ZB-V, DualPipeV): weight gradients after B
    splits_backward = any(step.op == lessons.schedules.WEIGHT for step in schedule[pp_rank])
    torch.manual_seed(0)
    blocks = [models.Block(shape["h"], shape["f"], shape["heads"]).to(ctx.device)
              for _ in range(setting["layers"])]
    generator = torch.Generator().manual_seed(1)
    shape_all = (micro_batches * setting["rows"], setting["seq_len"], shape["h"])  # [m b, seq, h]
    inputs = torch.randn(shape_all, generator=generator).to(ctx.device)
    targets = torch.randn(shape_all, generator=generator).to(ctx.device)
    emulate_s = setting["emulate_ms"] / 1e3 if compute == "emulated" else 0.0
    ours, modules = [], []
    layout = lessons.schedules.layout_of(schedule_name)       # V: pieces r and 2p-1-r
    for layer_numbers in lessons.pipeline.chunk_layers(setting["layers"], stages, pp_rank,
                                                       chunks_per_rank, layout):
        if compute == "emulated":   # F, B (and W where the schedule splits it) wait, in both
            mine = bench_pipeline.TorchEmulatedChunk(emulate_s, False)
            if splits_backward:
                mine = bench_pipeline.EmulatedChunk(emulate_s, True)
            ours.append(mine.to(ctx.device))
            modules.append(bench_pipeline.TorchEmulatedChunk(emulate_s, splits_backward))
            modules[-1].to(ctx.device)
            continue
        pieces = [copy.deepcopy(blocks[layer]) for layer in layer_numbers]
        ours.append(nn.Sequential(*pieces))
        modules.append(nn.Sequential(*[copy.deepcopy(piece) for piece in pieces]))
        if splits_backward:         # ours: the weight gradients in W, the same weights
            with_deferred_weight_grads(ours[-1], lessons.pipeline)
    built = bench_pipeline.beside_torch(ctx, schedule_name, micro_batches, ours, modules, inputs,
                                        targets, stages, pp_rank, grid.group("pp"))
    built["ideal_s"] = built["makespan"] * emulate_s       # the simulation x the emulated wait
    return built


def compare_pipelines(ctx, sizes: dict, lessons, deadline) -> list[dict]:
    """Every (stages, schedule, compute) of ``sizes["pipeline"]``: ours and torch's rows."""
    setting = sizes["pipeline"]
    rows = []
    for stages in setting["stages"]:
        if ctx.world_size % stages != 0:
            continue
        grid = lessons.grid.ProcessGrid(dp=ctx.world_size // stages, pp=stages)
        side_by_side = ctx.world_size // stages
        label = f"pp{stages}" + (f" (x{side_by_side} side by side)" if side_by_side > 1 else "")
        for schedule_name in setting["schedules"]:
            if (schedule_name in bench_pipeline.TORCH_SCHEDULES
                    and bench_pipeline.torch_schedule_class(schedule_name) is None):
                ctx.print(f"  torch {torch.__version__} has no class for {schedule_name}: no "
                          "pipeline row for it", all_ranks=False)
                continue
            for compute in setting["compute"]:
                if not deadline.allows(f"{label} {schedule_name}, {compute} and what follows"):
                    break
                built = build_pipelines(ctx, grid, sizes, schedule_name, compute, lessons)
                seconds = measure_alternating(ctx, {"ours": built["ours"], "torch": built["torch"]}, sizes)
                difference = float("nan")
                if compute == "real":        # the largest on any rank
                    difference = max(timing.gather_times([gradient_difference(built)]).rank_medians)
                emulated_ms = setting["emulate_ms"] if compute == "emulated" else 0.0
                words = f"{schedule_name}, {bench_pipeline.compute_of(emulated_ms)}"
                for impl, name in (("ours", "our executor"), ("torch", "torch.distributed.pipelining")):
                    row = timed_row(ctx, sizes, impl, label, words, seconds[impl], setting["micro_batches"])
                    batch = setting["rows"] * setting["micro_batches"]
                    row.update(batch_size=batch, seq_len=setting["seq_len"],
                               model=f"{setting['layers']} {sizes['model']} blocks",
                               tokens_per_s=batch * setting["seq_len"] / (row["step_ms"] / 1e3),
                               schedule=schedule_name, compute=compute, stages=stages, implementation=name,
                               ideal_ms=built["ideal_s"] * 1e3, gradient_max_difference=difference)
                    rows.append(row)
        grid.destroy()
    return rows


def bench_worker(ctx, sizes: dict, grids: list[dict], out_path: str | None = None) -> None:
    """Every rank: the three parts; rank 0 writes the CSV, the report, JSON to ``out_path``."""
    lessons = load_lessons()
    deadline = step_bench.Deadline(ctx)
    timed_grids = []
    for spec in grids:
        if not deadline.allows(f"grid {grid_label(spec)}, {setting_label(spec)} and what follows"):
            break
        built = build_grid(ctx, spec, sizes, lessons)
        mine = count_grid(ctx, spec, sizes, built, lessons)
        seconds = timing.measure(built["step"], ctx.device, warmup=sizes["warmup"],
                                 iters=sizes["iters"], barrier=True)
        per_rank = everyone(mine)
        row = our_row(ctx, sizes, spec, setting_label(spec), seconds, per_rank)
        timed_grids.append({"spec": spec, "step": built["step"], "seconds": seconds, "row": row,
                            "grid": built["grid"], "per_rank": per_rank})
        ctx.print(f"  {row['grid']}, {row['setting']}: {row['step_ms']:.1f} ms/step (round 1)",
                  all_ranks=False)
        if ctx.is_main:  # as each grid finishes: a run stopped at make bench's cap keeps them
            results.upsert_csv(CSV_NAME, [timed["row"] for timed in timed_grids], key=CSV_KEY)
    # more rounds, every grid in turn, pooled: every grid through the same noisy spells
    for done in range(1, sizes["rounds"]):
        estimate = sum(sum(timed["seconds"]) for timed in timed_grids) / done
        if not deadline.allows(f"round {done + 1} of {sizes['rounds']} and what follows", estimate):
            break
        for timed in timed_grids:
            timed["seconds"] += timing.measure(timed["step"], ctx.device, warmup=0,
                                               iters=sizes["iters"], barrier=True)
            timed["row"].update(our_row(ctx, sizes, timed["spec"], timed["row"]["setting"],
                                        timed["seconds"], timed["per_rank"]))
    for timed in timed_grids:             # each grid's groups (communicators) freed
        timed["grid"].destroy()
    grid_rows = [timed["row"] for timed in timed_grids]
    torch_rows = compare_with_torch(ctx, sizes, lessons, deadline)   # main: a backend that sends
    if ctx.is_main:
        results.upsert_csv(CSV_NAME, grid_rows + torch_rows, key=CSV_KEY)
    pipeline_rows = compare_pipelines(ctx, sizes, lessons, deadline)
    reference = reference_loss(sizes, lessons)
    if not ctx.is_main:
        return
    path = results.upsert_csv(CSV_NAME, grid_rows + torch_rows + pipeline_rows, key=CSV_KEY)
    report(ctx, sizes, grid_rows + torch_rows[0::2], torch_rows, pipeline_rows, reference)
    print(f"wrote {path}", flush=True)
    if out_path is not None:
        with open(out_path, "w") as f:
            details = [{"grid": timed["row"]["grid"], "setting": timed["row"]["setting"],
                        "spec": timed["spec"], "per_rank": timed["per_rank"]} for timed in timed_grids]
            json.dump({"grid_rows": grid_rows, "torch_rows": torch_rows, "pipeline_rows": pipeline_rows,
                       "details": details, "reference_loss": reference, "csv": str(path)}, f)


def percent(share: float) -> str:
    """0.0806 -> '8.06%'; 0.000211 -> '0.0211%'; 0 -> '0'."""
    return f"{100 * share:.3g}%" if share else "0"


def counted_and_formula(row: dict, kind: str, unit: int) -> str:
    """'counted (formula)' in ``unit``s; just the count where there is no formula."""
    text = f"{row[f'{kind}_bytes'] / unit:.1f}"
    if f"{kind}_bytes_formula" in row:
        text += f" ({row[f'{kind}_bytes_formula'] / unit:.1f})"
    return text


def report(ctx, sizes: dict, our_rows: list[dict], torch_rows: list[dict],
           pipeline_rows: list[dict], reference: float) -> None:
    """Rank 0: the tables, then the targets beside what this run measured."""
    machine = results.machine_name()
    large = max(row["param_bytes"] for row in our_rows) > 64 * 2**20
    unit, unit_name = (2**20, "MiB") if large else (1024, "KiB")
    shape = lm_shape(sizes)
    print(f"\nThe {sizes['model']} LM (h {shape['h']}, f {shape['f']}, {shape['heads']} heads, "
          f"{shape['layers']} blocks, vocabulary {VOCAB}), batch {sizes['batch_size']} x "
          f"{sizes['seq_len']}, {ctx.world_size} ranks ({ctx.backend}/{ctx.device.type}; "
          f"{machine}). Step: the slowest rank's median of {sizes['iters']} a round.", flush=True)

    def bytes_of(row: dict, kinds: tuple) -> dict:
        return {f"{kind} {unit_name}": counted_and_formula(row, kind, unit) for kind in kinds}

    ours = [{"grid": row["grid"], "setting": row["setting"], "step ms": row["step_ms"],
             **bytes_of(row, ("param", "optim", "activation", "sent_tp", "sent_cp", "sent_pp", "sent_dp_cp")),
             "worst difference": percent(row["worst_difference"])} for row in our_rows]
    results.print_table(ours, floatfmt=".0f", title="\nOur grids, the largest rank, counted "
                        "(formula); activation: one micro-batch; sent: per step:")
    beside = [{"pair": row["pair"], "impl": row["impl"], "setting": row["setting"],
               "step ms": row["step_ms"], **bytes_of(row, ("param", "optim", "activation", "sent_tp"))}
              for row in torch_rows]
    results.print_table(beside, floatfmt=".1f", title="\ntorch's composition beside ours, "
                        f"{sizes['rounds']} alternating rounds, torch's bytes (its formula):")
    pairs = list(zip(pipeline_rows[0::2], pipeline_rows[1::2]))     # (ours, torch's)
    table = [{"stages": ours["grid"], "schedule": ours["schedule"],
              "compute": ours["setting"].split(", ", 1)[1], "ours ms": ours["step_ms"],
              "torch ms": theirs["step_ms"], "ours / torch": ours["step_ms"] / theirs["step_ms"],
              "ideal ms": ours["ideal_ms"] or "-",
              "max |grad diff|": ours["gradient_max_difference"]} for ours, theirs in pairs]
    pipeline = sizes["pipeline"]
    results.print_table(table, floatfmt=".3g", title="\nThe pipeline axis, ours beside "
                        f"torch.distributed.pipelining: {pipeline['layers']} blocks, "
                        f"{pipeline['micro_batches']} micro-batches of {pipeline['rows']} x "
                        f"{pipeline['seq_len']}; ideal: the simulation x the emulated wait:")
    print(f"\nTargets, measured in this run ({machine}):")
    worst = max(our_rows, key=lambda row: row["worst_difference"])
    verdict = "met" if worst["worst_difference"] <= TARGET_BYTES else "NOT met"
    print(f"  counted bytes / the combined formula, every grid, rank and column: worst "
          f"{100 * worst['worst_difference']:.2f}% ({worst['grid']}, {worst['setting']}, "
          f"{worst['worst_where']}) (target within {100 * TARGET_BYTES:.0f}%: {verdict})")
    for row in our_rows:
        if row["worst_difference"] != 0:
            text = (f"    not exact: {row['grid']} {row['setting']}: {row['worst_where']} "
                    f"{percent(row['worst_difference'])}")
            if row["zero1_deal_bound"] != "" and row["worst_where"].endswith("optim"):
                text += f" (ZeRO-1's whole-tensor deal: within {100 * row['zero1_deal_bound']:.1f}%)"
            print(text)
    for ours, theirs in zip(torch_rows[0::2], torch_rows[1::2]):
        ratio = ours["step_ms"] / theirs["step_ms"]
        verdict = "met" if ratio <= TARGET_TORCH_TP else "NOT met"
        print(f"  {ours['pair']}: our {ours['grid']} step / torch's: {ours['step_ms']:.1f} / "
              f"{theirs['step_ms']:.1f} ms = {ratio:.2f}x (target <= {TARGET_TORCH_TP}x: {verdict})")
    for ours, theirs in pairs:
        if ours["compute"] == "emulated" and ours["stages"] == 4:
            print(f"  our pipeline / torch's, {ours['schedule']}, pp 4, emulated: "
                  f"{ours['step_ms'] / theirs['step_ms']:.2f}x (target <= {TARGET_PIPELINE}x)")
    difference = max(abs(row["first_loss"] - reference) for row in our_rows + torch_rows)
    print(f"  first-step loss of every grid and torch's against one process ({reference:.6f}): "
          f"largest difference {difference:.1e}", flush=True)


def size_problems(sizes: dict, grids: list[dict], world_size: int) -> list[str]:
    """What ``sizes`` cannot run: one line each."""
    shape = lm_shape(sizes)
    problems = []
    for spec in grids:
        rows = sizes["batch_size"] // spec["dp"]
        if (shape["heads"] % spec["tp"] or shape["f"] % spec["tp"]
                or shape["seq"] % (2 * spec["cp"] * spec["tp"])
                or shape["layers"] % (spec["pp"] * spec["chunks"])
                or sizes["batch_size"] % spec["dp"] or rows % spec["micro_batches"]):
            problems.append(f"grid {grid_label(spec)}: the LM or the batch does not split over it")
    pipeline = sizes["pipeline"]
    for stages in pipeline["stages"]:
        if world_size % stages == 0:
            problems += pipeline_schedule_problems(pipeline, stages)
    return problems


def pipeline_schedule_problems(pipeline: dict, stages: int) -> list[str]:
    """Each schedule that refuses its micro-batches and blocks on ``stages`` stages, a line each."""
    problems = []
    for name in pipeline["schedules"]:
        chunks = bench_pipeline.schedules.chunks_per_rank(name, 2)
        try:
            bench_pipeline.schedule_check.check_setting(name, stages, pipeline["micro_batches"],
                                                        chunks, pipeline["layers"])
        except ValueError as error:
            problems.append(f"pipeline: {name} on {stages} stages, {pipeline['micro_batches']} "
                            f"micro-batches, {pipeline['layers']} blocks: {error}")
    return problems


def main(argv=None) -> None:
    """The measurements on the grids of ``GRIDS`` for the world size."""
    parser = launch.make_parser(__doc__, world_size=4)
    parser.add_argument("--bench", action="store_true", help="(what this script does)")
    parser.add_argument("--bench-sizes", choices=tuple(SIZES), default=None,
                        help="default: gpu with a GPU per rank, else cpu")
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    if config.world_size not in GRIDS:
        parser.error(f"--bench runs its grids on {' or '.join(map(str, GRIDS))} ranks, not "
                     f"{config.world_size}")
    if not carries_point_to_point(config.backend, config.device):
        parser.error("--bench with --device cuda needs NCCL, a GPU per rank; use --device cpu")
    name = args.bench_sizes or ("gpu" if config.device == "cuda" else "cpu")
    problems = size_problems(SIZES[name], GRIDS[config.world_size], config.world_size)
    if problems:
        parser.error(f"--bench-sizes {name}: " + problems[0])
    results.check_writable()
    load_lessons()                  # the lessons' folders on the path, for every worker
    launch.launch(bench_worker, config, SIZES[name], GRIDS[config.world_size])


if __name__ == "__main__":
    main()
