"""Lesson 7's checks that need ranks: grids of four ranks trained beside one process, with
planted bugs that each must be caught, run inside one launch (``grid_worker``). Besides
train.py's check (the loss, every gradient, every weight), after each step: every replica of a
piece bitwise equal to its copies, and the pieces marked to be saved cover the full model
exactly once (``placement_problems``).

A planted bug replaces one function of ``parallel_lm`` inside the worker (a forked rank does
not see the test's monkeypatch), for one case, and puts the original back after it.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from common import import_stage, verify

train = import_stage("07_parallelism/07_together/train")


def small_args(data: str, **grid) -> argparse.Namespace:
    """train.py's flags for a fast check: the tiny LM, 8 sequences of 32 bytes."""
    args = dict(dp=1, pp=1, cp=1, tp=1, dp_shard=1, fsdp=False, schedule="1f1b", chunks=1, micro_batches=1,
                model="tiny", batch_size=8, seq_len=32, lr=3e-3, seed=0, data=data,
                max_bytes=None)
    args.update(grid)
    return argparse.Namespace(**args)


def parallel_lm():
    return train.lessons()[1]


def replicated_parameters(chunks) -> list:
    params = []
    for chunk in chunks:
        for block in chunk.blocks:
            params.extend(block.replicated_parameters())
        for module in (chunk.embedding, chunk.head):
            if module is not None:
                params.extend(module.parameters())
    return [p for p in params if p.grad is not None]


def sum_over_dp_only(original):
    """Planted bug (torchtitan #3280's kind): gradients summed over the data ranks, not over
    data and context: each context rank steps with its part of the sequence alone."""
    def sum_gradients(chunks, grid):
        lm = parallel_lm()
        everything = [p for chunk in chunks for p in chunk.parameters() if p.grad is not None]
        lm.all_reduce_sum(replicated_parameters(chunks), grid.group("tp"))
        lm.all_reduce_sum(everything, grid.group("dp"))
    return sum_gradients


def no_sum_over_tp(original):
    """Planted bug: the tp-replicated parameters (LayerNorms, biases, embeddings, head) keep
    the gradient of this rank's tokens only (sequence parallelism split them)."""
    def sum_gradients(chunks, grid):
        everything = [p for chunk in chunks for p in chunk.parameters() if p.grad is not None]
        parallel_lm().all_reduce_sum(everything, grid.group("dp_cp"))
    return sum_gradients


def twice_over_tp(original):
    """Planted bug: the tp-replicated gradients summed over tp twice (2x too big: AdamW would
    hide it in the weights, the gradient check must not)."""
    def sum_gradients(chunks, grid):
        parallel_lm().all_reduce_sum(replicated_parameters(chunks), grid.group("tp"))
        original(chunks, grid)
    return sum_gradients


def unscaled_loss(original):
    """Planted bug: each rank's mean loss not divided by R, the ranks holding different tokens."""
    def scaled_loss_fn(grid):
        def loss_fn(logits, targets):
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return loss_fn
    return scaled_loss_fn


def hsdp_sums_over_all_data_ranks(original):
    """Planted bug: HSDP's last sum over the whole data axis (dp_replicate and dp_shard), not
    over dp_replicate alone: each rank's row block gets the other shards' blocks added in."""
    def sum_over_replicas(params, grid):
        parallel_lm().all_reduce_sum(params, grid.group("dp"))
    return sum_over_replicas


def replica_on_every_tp_rank(original):
    """Planted bug: a tp-replicated parameter (a LayerNorm, a bias, the embeddings, the head)
    marked as the copy to save on every tp rank, not on tp rank 0 alone: written twice."""
    def placement_of(full_name, p, module, grid, fsdp_rows=None):
        entry = original(full_name, p, module, grid, fsdp_rows)
        entry["replica"] = grid.rank("dp_cp") == 0
        return entry
    return placement_of


# (label, grid, planted bug or None): four ranks; every correct grid must equal one process,
# every planted bug must be caught
FOUR_RANK_CASES = [
    ("dp2 tp2", dict(dp=2, tp=2), None),
    ("pp2 tp2, 1f1b, 2 micro-batches", dict(pp=2, tp=2, micro_batches=2), None),
    ("dp2 pp2, gpipe, 4 micro-batches", dict(dp=2, pp=2, schedule="gpipe", micro_batches=4), None),
    ("cp2 tp2", dict(cp=2, tp=2), None),
    ("dp2 cp2, ZeRO-1 (--fsdp)", dict(dp=2, cp=2, fsdp=True), None),
    ("pp2 tp2, zbh1, 4 micro-batches", dict(pp=2, tp=2, schedule="zbh1", micro_batches=4), None),
    ("dp2 cp2, summed over dp only", dict(dp=2, cp=2), "dp only"),
    ("dp2 tp2, no sum over tp", dict(dp=2, tp=2), "no tp sum"),
    ("dp2 tp2, summed over tp twice", dict(dp=2, tp=2), "twice over tp"),
    ("dp2 cp2, loss not divided by R", dict(dp=2, cp=2), "unscaled"),
    ("dp2 tp2, replicas saved on every tp rank", dict(dp=2, tp=2), "replica every tp"),
    # HSDP: 2 copies of 2 shards, and 2 shards of tensor-parallel halves (8 ranks for both at
    # once would be a launch of its own: the pieces meet in these two)
    ("HSDP replicate 2 x shard 2", dict(dp=4, dp_shard=2), None),
    ("HSDP shard 2 x tp 2, 2 micro-batches", dict(dp=2, dp_shard=2, tp=2, micro_batches=2), None),
    ("HSDP 2 x 2, summed over the whole data axis", dict(dp=4, dp_shard=2), "hsdp over dp"),
]
PLANTED = {"dp only": ("sum_gradients", sum_over_dp_only),
           "no tp sum": ("sum_gradients", no_sum_over_tp),
           "twice over tp": ("sum_gradients", twice_over_tp),
           "unscaled": ("scaled_loss_fn", unscaled_loss),
           "replica every tp": ("placement_of", replica_on_every_tp_rank),
           "hsdp over dp": ("sum_over_replicas", hsdp_sums_over_all_data_ranks)}


@contextmanager
def planted(name: str | None):
    """Replace one function of parallel_lm (in this process) for the duration."""
    if name is None:
        yield
        return
    attribute, make = PLANTED[name]
    module = parallel_lm()
    original = getattr(module, attribute)
    setattr(module, attribute, make(original))
    try:
        yield
    finally:
        setattr(module, attribute, original)


def nan_stop(ctx) -> dict:
    """``stop_unless_finite`` on every rank with a NaN loss: every rank exits 2, rank 0 says
    one line naming the step."""
    captured = io.StringIO()
    real_stderr = sys.stderr
    sys.stderr = captured
    code = None
    try:
        train.stop_unless_finite(float("nan"), 7)
    except SystemExit as stop:
        code = stop.code
    finally:
        sys.stderr = real_stderr
    return {"code": code, "stderr": captured.getvalue()}


def grid_worker(ctx, data: str, out: str) -> None:
    findings = {}
    for label, grid, bug in FOUR_RANK_CASES:
        with planted(bug):
            problems, worst = train.check_against_one_process(ctx, small_args(data, **grid), 2,
                                                              placement_problems)
        findings[label] = {"problems": problems, "worst": worst}
    stops = verify.agree_on_problems([json.dumps(nan_stop(ctx))])  # every rank's, everywhere
    if ctx.is_main:
        findings["nan stop"] = [json.loads(line.split(": ", 1)[1]) for line in stops]
        Path(out).write_text(json.dumps(findings))


def placement_problems(chunks, grid) -> list[str]:
    """The tests' checks beside train.py's, after each step: replicas and saved pieces."""
    return replica_differences(chunks, grid) + saved_once_problems(chunks, grid)


def replica_differences(chunks, grid) -> list[str]:
    """Copies of one piece held by several ranks must be bitwise equal: over dp and cp for
    every piece (under HSDP a weight's row block over dp_replicate: the dp_shard ranks hold
    different blocks), and over tp too for the pieces tensor parallelism does not split."""
    problems = []
    for entry in parallel_lm().placements(chunks, grid):
        groups = ["dp_cp"]
        if entry["dp_sharded"]:
            groups = ["dp_replicate"]
        if entry["tp_whole"]:
            groups.append("tp")
        for axis in groups:
            if grid.size(axis) == 1:
                continue
            mine = entry["tensor"].detach().contiguous()
            copies = [torch.empty_like(mine) for _ in range(grid.size(axis))]
            dist.all_gather(copies, mine, group=grid.group(axis))
            for index, copy in enumerate(copies):
                if not torch.equal(copy, mine):
                    problems.append(f"{entry['name']}: the copy on {axis} rank {index} differs "
                                    f"from rank {grid.rank(axis)}'s")
    return problems


def saved_once_problems(chunks, grid) -> list[str]:
    """The pieces marked ``replica`` (the copy to save, to gather, to checkpoint) must cover
    every element of the full model exactly once: a piece marked on two ranks is written twice,
    a piece marked on none is lost. Rank 0 counts, per element, how many ranks mark it (the
    boxes travel as objects: bookkeeping, not tensors); the others return no problem."""
    mine = []
    for entry in parallel_lm().placements(chunks, grid):
        if entry["replica"]:
            full_boxes = [full_box for _, full_box in entry["boxes"]]
            mine.append((entry["name"], entry["full_shape"], full_boxes))
    gathered = None
    if dist.get_rank() == 0:
        gathered = [None] * dist.get_world_size()
    dist.gather_object(mine, gathered, dst=0)
    if gathered is None:
        return []
    counts = {}
    for name, p in train.build_full_lm(SHAPE_ONLY).named_parameters():
        counts[name] = torch.zeros(p.shape, dtype=torch.int32)
    holders = {}
    for rank, entries in enumerate(gathered):
        for name, _, full_boxes in entries:
            holders.setdefault(name, []).append(rank)
            for full_box in full_boxes:
                index = tuple(slice(start, stop) for start, stop in full_box)
                counts[name][index] += 1
    problems = []
    for name, count in counts.items():
        if not bool((count == 1).all()):
            problems.append(f"{name}: marked to be saved by ranks {holders.get(name, [])}, "
                            f"covering its elements {int(count.min())} to {int(count.max())} "
                            "times; each must be saved exactly once")
    return problems


# the full model's names and shapes, as small_args builds it
SHAPE_ONLY = argparse.Namespace(model="tiny", seq_len=32, seed=0)
