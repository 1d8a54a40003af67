"""The checks of lesson 4 (pipeline parallelism) that the tests run: one pass of the executor
or of the plain 1F1B loops on this rank's layers, compared with one process (every layer's
gradient, the loss, the micro-batches held at once), and one verdict on every rank.

Each check returns the problems it found (an empty list: it passed), so a test can run it on
the real code and beside a planted bug (``tests/test_07_pipeline_parallel.py``), which must
make the same check fail. run_pipeline.py has its own loop for the learner; this is the
version the tests bend, with the micro-batches held checked against the schedule's count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import one_f_one_b
import pipeline_parallel
import pipeline_schedules as schedules
import schedule_check

GRAD_RTOL = 1e-4                        # float32: see compare_gradients
GRAD_ATOL = 1e-6
PROBLEMS_SHOWN_PER_RANK = 6            # a failed check names these, then counts the rest


def make_data(batch: int, d_model: int, device: torch.device, seed: int = 1) -> list:
    """[inputs, targets], each [batch, d_model]: the same on every rank for a given seed."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch, d_model, generator=generator).to(device)
    targets = torch.randn(batch, d_model, generator=generator).to(device)
    return [inputs, targets]


def one_process(cfg: dict, device: torch.device) -> dict:
    """The reference: one process, plain nn.Linear, the whole batch at once. Per layer its
    parameters' gradients ("grads"), and the batch's loss ("loss")."""
    model = pipeline_parallel.build_model(cfg["layers"], cfg["d_model"], cfg["hidden"],
                                          linear=nn.Linear).to(device)
    inputs, targets = make_data(cfg["batch"], cfg["d_model"], device)
    loss = F.mse_loss(model(inputs), targets)
    loss.backward()
    grads = []
    for block in model:
        grads.append([parameter.grad.clone() for parameter in block.parameters()])
    return {"grads": grads, "loss": loss.item()}


def micro_batches_of(tensor: torch.Tensor, m: int) -> list[torch.Tensor]:
    """m equal micro-batches: [batch, d_model] -> m x [batch / m, d_model]."""
    return list(tensor.chunk(m))


def layers_of(cfg: dict, name: str, ctx) -> list[range]:
    """This rank's layers, one range per chunk, as schedule ``name`` lays them out."""
    return pipeline_parallel.chunk_layers(cfg["layers"], ctx.world_size, ctx.rank, cfg["v"][name],
                                          schedules.layout_of(name))


def pipeline_pass(model: nn.Sequential, name: str, ctx, m: int, cfg: dict,
                  loss_fn=F.mse_loss, schedule=None) -> dict:
    """Zero the gradients, run one pass of schedule ``name`` on this rank's chunks of the
    model (``schedule``: every rank's steps, by default the named schedule's)."""
    stages = ctx.world_size
    chunks_per_rank = cfg["v"][name]
    inputs, targets = make_data(cfg["batch"], cfg["d_model"], ctx.device)
    model.zero_grad(set_to_none=True)
    chunks = []
    for layers in layers_of(cfg, name, ctx):
        chunks.append(model[layers.start:layers.stop])
    if schedule is None:
        schedule = schedules.all_ranks(name, stages, m, chunks_per_rank)
    micro_inputs = None
    if ctx.rank == 0:
        micro_inputs = micro_batches_of(inputs, m)
    micro_targets = None
    if ctx.rank == schedules.loss_rank(name, stages, chunks_per_rank):
        micro_targets = micro_batches_of(targets, m)
    activation_shape = (cfg["batch"] // m, cfg["d_model"])      # [rows per micro-batch, d_model]
    return pipeline_parallel.run_schedule(chunks, schedule, micro_inputs, micro_targets,
                                          activation_shape, ctx.device, loss_fn=loss_fn)


def plain_1f1b_pass(model: nn.Sequential, ctx, m: int, cfg: dict, loss_fn=F.mse_loss) -> dict:
    """Zero the gradients, run one_f_one_b.py's three loops on this rank's layers."""
    stages = ctx.world_size
    inputs, targets = make_data(cfg["batch"], cfg["d_model"], ctx.device)
    model.zero_grad(set_to_none=True)
    layers = pipeline_parallel.chunk_layers(cfg["layers"], stages, ctx.rank)[0]
    activation_shape = (cfg["batch"] // m, cfg["d_model"])      # [rows per micro-batch, d_model]
    stage = one_f_one_b.Stage(model[layers.start:layers.stop], activation_shape, ctx.device,
                              loss_fn, m)
    micro_inputs = None
    if ctx.rank == 0:
        micro_inputs = micro_batches_of(inputs, m)
    micro_targets = None
    if ctx.rank == stages - 1:
        micro_targets = micro_batches_of(targets, m)
    return one_f_one_b.one_f_one_b(stage, micro_inputs, micro_targets)


def compare_gradients(model: nn.Sequential, want: list, layer_ranges: list[range],
                      label: str) -> tuple[list[str], float]:
    """This rank's layers against one process: the problems found, and the largest relative
    difference. Tolerance: float32, the pipeline sums m micro-batch gradients (each of a
    loss / m) where one process sums the whole batch in one matrix product, so the two
    round differently by a few units in the last place, times the depth; rtol 1e-4 leaves
    room for that and catches any real bug (a missing / m is off by a factor m)."""
    problems = []
    largest = 0.0
    for layers in layer_ranges:
        for layer in layers:
            parameters = list(model[layer].parameters())
            for index, parameter in enumerate(parameters):
                expected = want[layer][index]
                if parameter.grad is None:
                    problems.append(f"{label}: layer {layer} parameter {index} got no gradient")
                    continue
                difference = (parameter.grad - expected).abs().max().item()
                relative = difference / max(expected.abs().max().item(), 1e-30)
                largest = max(largest, relative)
                close = torch.allclose(parameter.grad, expected, rtol=GRAD_RTOL, atol=GRAD_ATOL)
                if not close:
                    problems.append(f"{label}: layer {layer} parameter {index} differs from one "
                                    f"process by {difference:.3g} (relative {relative:.3g})")
    return problems, largest


def compare_loss(ctx, result: dict, reference: dict, label: str, last_rank: int) -> list[str]:
    """The loss the last stage's rank reports against one process's (the others report 0.0)."""
    if ctx.rank != last_rank:
        return []
    difference = abs(result["loss"] - reference["loss"])
    if difference > GRAD_RTOL * abs(reference["loss"]):
        return [f"{label}: loss {result['loss']:.6g}, one process {reference['loss']:.6g}"]
    return []


def check_schedule_pass(model, reference: dict, ctx, cfg: dict, name: str, m: int,
                        loss_fn=F.mse_loss, schedule=None) -> tuple[list[str], float]:
    """One pass of the executor: this rank's gradients, the loss, the micro-batches held."""
    chunks_per_rank = cfg["v"][name]
    result = pipeline_pass(model, name, ctx, m, cfg, loss_fn=loss_fn, schedule=schedule)
    layer_ranges = layers_of(cfg, name, ctx)
    label = f"{name} m={m}"
    last_rank = schedules.loss_rank(name, ctx.world_size, chunks_per_rank)
    problems = compare_loss(ctx, result, reference, label, last_rank)
    gradient_problems, largest = compare_gradients(model, reference["grads"], layer_ranges, label)
    problems += gradient_problems
    steps = schedules.all_ranks(name, ctx.world_size, m, chunks_per_rank)[ctx.rank]
    promised = schedule_check.peak_held(steps)
    if result["peak_held"] != promised:
        problems.append(f"{label}: held {result['peak_held']} micro-batches at once, the "
                        f"schedule says {promised}")
    return problems, largest


def check_plain_pass(model, reference: dict, ctx, cfg: dict, m: int,
                     loss_fn=F.mse_loss) -> tuple[list[str], float]:
    """One pass of the plain 1F1B loops: gradients, loss, at most p - r micro-batches held."""
    result = plain_1f1b_pass(model, ctx, m, cfg, loss_fn=loss_fn)
    layer_ranges = pipeline_parallel.chunk_layers(cfg["layers"], ctx.world_size, ctx.rank)
    label = f"plain 1F1B m={m}"
    problems = compare_loss(ctx, result, reference, label, ctx.world_size - 1)
    gradient_problems, largest = compare_gradients(model, reference["grads"], layer_ranges, label)
    problems += gradient_problems
    promised = min(ctx.world_size - ctx.rank, m)
    if result["peak_held"] != promised:
        problems.append(f"{label}: held {result['peak_held']} micro-batches at once, 1F1B "
                        f"holds min(p - r, m) = {promised}")
    return problems, largest


class NcclBranchOnGloo(pipeline_parallel.ScheduleRunner):
    """The executor's NCCL branch run over Gloo: every group waited for as soon as it is
    posted (where NCCL makes only the GPU stream wait, this blocks the host: stricter)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.nccl = True


def with_nccl_branch(check, *args, **kwargs):
    """Run ``check`` with the executor's NCCL branch (``NcclBranchOnGloo``) in place."""
    original = pipeline_parallel.ScheduleRunner
    pipeline_parallel.ScheduleRunner = NcclBranchOnGloo
    try:
        return check(*args, **kwargs)
    finally:
        pipeline_parallel.ScheduleRunner = original


def gather_from_every_rank(ctx, value) -> list:
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, value)
    return everyone


def one_verdict(ctx, problems: list[str], what: str) -> None:
    """Every rank's problems gathered, then every rank raises the same error, or none does."""
    everyone = gather_from_every_rank(ctx, problems)
    total = 0
    lines = []
    for rank, rank_problems in enumerate(everyone):
        total += len(rank_problems)
        for problem in rank_problems[:PROBLEMS_SHOWN_PER_RANK]:
            lines.append(f"rank {rank}: {problem}")
        hidden = len(rank_problems) - PROBLEMS_SHOWN_PER_RANK
        if hidden > 0:
            lines.append(f"rank {rank}: ... and {hidden} more")
    if total > 0:
        raise AssertionError(f"{what} failed, {total} problem(s):\n  " + "\n  ".join(lines))


def check_against_one_process(ctx, cfg: dict, model: nn.Sequential) -> float:
    """Every schedule and m of ``cfg``, then the plain 1F1B loops: one verdict. Returns the
    largest relative gradient difference from one process, over every rank."""
    reference = one_process(cfg, ctx.device)
    problems = []
    largest = 0.0
    for name in cfg["schedules"]:
        for m in cfg["micro_batches"]:
            found, difference = check_schedule_pass(model, reference, ctx, cfg, name, m)
            problems += found
            largest = max(largest, difference)
    if ctx.backend == "gloo":   # the plain loops' sends can wait on each other on NCCL
        for m in cfg["micro_batches"]:
            found, difference = check_plain_pass(model, reference, ctx, cfg, m)
            problems += found
            largest = max(largest, difference)
    one_verdict(ctx, problems, "pipeline check against one process")
    return max(gather_from_every_rank(ctx, largest))
