"""Stage 07, lesson 4: pipeline parallelism, run, checked against one process, and measured.

The lesson's files, in reading order: ``one_f_one_b.py`` (1F1B as three plain loops),
``pipeline_schedules.py`` (GPipe, 1F1B, interleaved 1F1B and ZB-H1 as data, with a unit-time
simulator), ``pipeline_parallel.py`` (the executor that runs any of them). This script:

1. checks them against one process: a stack of residual MLP blocks split over the ranks, and
   for every schedule and micro-batch count m (and the plain 1F1B loops) every layer's
   gradient equals the one one process computes on the whole batch, and every rank holds as
   many micro-batches at once as the schedule promises; one verdict on every rank;
2. measures the bubble: each rank's idle share, with real compute and with emulated compute
   (``--emulate-ms``: every F, B, W a fixed wait, the messages real), beside the unit-time
   simulation and the formula; four ranks on two shared cores cannot show a bubble with
   real compute, emulated compute can;
3. prints each schedule's timeline and writes ``results/pipeline_bubble.csv``.

Run:  python 07_parallelism/04_pipeline_parallel/run_pipeline.py               # 4 stages, m = 8, gloo/cpu
      python 07_parallelism/04_pipeline_parallel/run_pipeline.py --micro-batches 4,8,16 --emulate-ms 50
      torchrun --nproc-per-node=4 07_parallelism/04_pipeline_parallel/run_pipeline.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

try:                                    # the lesson, beside this file
    import one_f_one_b
    import pipeline_parallel
    import pipeline_schedules as schedules
except ModuleNotFoundError as missing:
    if missing.name not in ("one_f_one_b", "pipeline_parallel", "pipeline_schedules"):
        raise
    raise SystemExit(f"{Path(__file__).name}: {missing.name}.py is missing beside it: copy the "
                     f"folder {Path(__file__).resolve().parent.name}/ whole") from None

MAX_EMULATE_MS = 60_000.0               # a minute per step: more is a typo, not a measurement
GRAD_RTOL = 1e-4                        # float32: see compare_gradients
GRAD_ATOL = 1e-6
PROBLEMS_SHOWN_PER_RANK = 6            # a failed check names these, then counts the rest


def _repo() -> None:
    """The harness needs common/, the algorithm above does not (same in every stage, on purpose)."""
    root = Path(__file__).resolve().parent
    while not (root / "common" / "launch.py").exists():
        if root == root.parent:
            raise SystemExit(f"{Path(__file__).name}: the algorithm above works on its own; the "
                             "demo and benchmark need the repository around this file (common/)")
        root = root.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


# --------------------------------------------------------------------------- one pass


def make_data(batch: int, d_model: int, device: torch.device, seed: int = 1) -> list:
    """[inputs, targets], each [batch, d_model]: the same on every rank for a given seed."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch, d_model, generator=generator).to(device)
    targets = torch.randn(batch, d_model, generator=generator).to(device)
    return [inputs, targets]


def one_process(cfg: dict, device: torch.device) -> dict:
    """The reference: one process, plain nn.Linear, the whole batch at once. Per layer its
    parameters' gradients ("grads"), and the batch's loss ("loss")."""
    model = build_reference(cfg).to(device)
    inputs, targets = make_data(cfg["batch"], cfg["d_model"], device)
    loss = F.mse_loss(model(inputs), targets)
    loss.backward()
    grads = []
    for block in model:
        grads.append([parameter.grad.clone() for parameter in block.parameters()])
    return {"grads": grads, "loss": loss.item()}


def build_reference(cfg: dict) -> nn.Sequential:
    return pipeline_parallel.build_model(cfg["layers"], cfg["d_model"], cfg["hidden"],
                                         linear=nn.Linear)


def micro_batches_of(tensor: torch.Tensor, m: int) -> list[torch.Tensor]:
    """m equal micro-batches: [batch, d_model] -> m x [batch / m, d_model]."""
    return list(tensor.chunk(m))


def pipeline_pass(model: nn.Sequential, name: str, ctx, m: int, cfg: dict, emulate_ms=0.0,
                  loss_fn=F.mse_loss, schedule=None) -> dict:
    """Zero the gradients, run one pass of schedule ``name`` on this rank's chunks of the
    model (``schedule``: every rank's steps, by default the named schedule's)."""
    stages = ctx.world_size
    chunks_per_rank = cfg["v"][name]
    inputs, targets = make_data(cfg["batch"], cfg["d_model"], ctx.device)
    model.zero_grad(set_to_none=True)
    chunks = []
    for layers in pipeline_parallel.chunk_layers(cfg["layers"], stages, ctx.rank, chunks_per_rank):
        chunks.append(model[layers.start:layers.stop])
    if schedule is None:
        schedule = schedules.all_ranks(name, stages, m, chunks_per_rank)
    micro_inputs = None
    if ctx.rank == 0:
        micro_inputs = micro_batches_of(inputs, m)
    micro_targets = None
    if ctx.rank == stages - 1:
        micro_targets = micro_batches_of(targets, m)
    activation_shape = (cfg["batch"] // m, cfg["d_model"])      # [rows per micro-batch, d_model]
    return pipeline_parallel.run_schedule(chunks, schedule, micro_inputs, micro_targets,
                                          activation_shape, ctx.device, loss_fn=loss_fn,
                                          emulate_s=emulate_ms / 1e3)


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


# --------------------------------------------------------------------------- the checks


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


def compare_loss(ctx, result: dict, reference: dict, label: str) -> list[str]:
    """The loss the last stage reports against one process's (the others report 0.0)."""
    if ctx.rank != ctx.world_size - 1:
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
    layer_ranges = pipeline_parallel.chunk_layers(cfg["layers"], ctx.world_size, ctx.rank,
                                                  chunks_per_rank)
    label = f"{name} m={m}"
    problems = compare_loss(ctx, result, reference, label)
    gradient_problems, largest = compare_gradients(model, reference["grads"], layer_ranges, label)
    problems += gradient_problems
    steps = schedules.schedule_steps(name, ctx.rank, ctx.world_size, m, chunks_per_rank)
    promised = schedules.peak_held(steps)
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
    problems = compare_loss(ctx, result, reference, label)
    gradient_problems, largest = compare_gradients(model, reference["grads"], layer_ranges, label)
    problems += gradient_problems
    promised = min(ctx.world_size - ctx.rank, m)
    if result["peak_held"] != promised:
        problems.append(f"{label}: held {result['peak_held']} micro-batches at once, 1F1B "
                        f"holds min(p - r, m) = {promised}")
    return problems, largest


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
    """Every schedule and m, then the plain 1F1B loops: one verdict. Returns the largest
    relative gradient difference from one process, over every rank."""
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


# --------------------------------------------------------------------------- the bubble


def measure_bubble(ctx, cfg: dict, model: nn.Sequential) -> list[dict]:
    """Every schedule and m: each rank's idle share (median over the timed passes), with
    real compute, then emulated; the step time; the most micro-batches held."""
    from common.timing import gather_times
    stages = ctx.world_size
    rows = []
    for name in cfg["schedules"]:
        chunks_per_rank = cfg["v"][name]
        for m in cfg["micro_batches"]:
            simulated = schedules.simulated_idle(name, stages, m, chunks_per_rank)
            peak = None
            # Real compute, then emulated (warm by then).
            for emulated_ms in (0.0, cfg["emulate_ms"]):
                passes = cfg["iters"]
                if emulated_ms == 0.0:
                    passes += cfg["warmup"]
                results = []
                for _ in range(passes):
                    results.append(pipeline_pass(model, name, ctx, m, cfg, emulated_ms))
                timed = results[-cfg["iters"]:]            # the warm-up passes are not timed
                if peak is None:
                    held = gather_times([timed[0]["peak_held"]]).rank_medians
                    peak = [int(count) for count in held]
                idle_shares = []
                for result in timed:
                    idle_shares.append(1 - result["busy_s"] / result["total_s"])
                idle = gather_times(idle_shares).rank_medians
                gap = 0.0
                for measured, unit_time in zip(idle, simulated):
                    gap = max(gap, abs(measured - unit_time))
                pass_seconds = [result["total_s"] for result in timed]
                rows.append({"schedule": name, "m": m, "v": chunks_per_rank,
                             "emulated_ms": emulated_ms, "peak": peak, "idle": idle,
                             "sim": simulated, "gap": gap,
                             "formula": schedules.bubble_formula(name, stages, m, chunks_per_rank),
                             "step_ms": gather_times(pass_seconds).median * 1e3})
                if ctx.is_main:
                    write_rows(ctx, cfg, rows)
    return rows


def pipeline_parallel_main(ctx, cfg: dict) -> None:
    """The worker: every schedule and m checked against one process, then the bubble measured
    (real and emulated compute); rank 0 prints and writes the results."""
    _repo()
    # Each rank builds all layers from one seed (same weights, nothing sent), runs its own.
    model = pipeline_parallel.build_model(cfg["layers"], cfg["d_model"], cfg["hidden"])
    model = model.to(ctx.device)
    largest = check_against_one_process(ctx, cfg, model)
    plain = " and the plain 1F1B loops"
    if ctx.backend != "gloo":
        plain = " (the plain 1F1B loops are checked on Gloo only)"
    ctx.print(f"gradients match one process for every schedule and m{plain} (largest relative "
              f"difference {largest:.1e}, allowed {GRAD_RTOL:g}); activations held as each "
              "schedule says", all_ranks=False)
    rows = measure_bubble(ctx, cfg, model)
    if ctx.is_main:
        report(ctx, cfg, rows)


def write_rows(ctx, cfg: dict, rows: list[dict]):
    """Rank 0: upsert the settings measured so far into results/pipeline_bubble.csv (called as
    each setting finishes, so a run stopped at make bench's cap keeps them)."""
    from common.results import machine_name, run_id, upsert_csv
    stages = ctx.world_size
    size = {}
    for key in ("layers", "d_model", "hidden", "batch"):
        size[key] = cfg[key]
    csv_rows = []
    for row in rows:
        for rank in range(stages):
            csv_rows.append(dict(
                backend=ctx.backend, device=ctx.device.type, world_size=stages, **size,
                schedule=row["schedule"], micro_batches=row["m"], rank=rank,
                idle_share=row["idle"][rank], idle_share_simulated=row["sim"][rank],
                idle_share_formula=row["formula"], peak_held=row["peak"][rank],
                step_ms=row["step_ms"], run_id=run_id(), emulated_ms=row["emulated_ms"],
                chunks=row["v"], machine=machine_name()))
    key = ["backend", "device", "world_size", *size, "schedule", "micro_batches", "chunks",
           "emulated_ms", "rank"]
    return upsert_csv("pipeline_bubble.csv", csv_rows, key=key)


def report(ctx, cfg: dict, rows: list[dict]) -> None:
    """Rank 0: the table, the emulated-compute verdict, the timelines, the CSV."""
    from common.results import machine_name, print_table
    stages = ctx.world_size
    size = {}
    for key in ("layers", "d_model", "hidden", "batch"):
        size[key] = cfg[key]
    size_text = ", ".join(f"{key} {value}" for key, value in size.items())
    print(f"\nPipeline parallel, {stages} stages, {size_text}; {ctx.backend}/{ctx.device.type}, "
          f"{machine_name()}\n")
    table = []
    for row in rows:
        compute = "real"
        if row["emulated_ms"]:
            compute = f"emulated {row['emulated_ms']:g} ms"
        table.append({"schedule": row["schedule"], "m": row["m"], "v": row["v"],
                      "compute": compute,
                      "idle per rank": " ".join(f"{share:.3f}" for share in row["idle"]),
                      "simulated": statistics.fmean(row["sim"]), "formula": row["formula"],
                      "max gap": row["gap"], "step_ms": row["step_ms"],
                      "peak held per rank": " ".join(str(count) for count in row["peak"])})
    print_table(table, f"Idle share per rank (median of {cfg['iters']} passes) beside the "
                "unit-time simulation and the formula; activations held at once:",
                floatfmt=".3f")
    emulated_gaps = [row["gap"] for row in rows if row["emulated_ms"]]
    gap = max(emulated_gaps)
    if gap <= 0.05:
        verdict = f"yes (largest gap {gap:.3f})"
    else:
        verdict = (f"no, {gap:.3f} (each message's delay on a busy box adds to it; a larger "
                   "--emulate-ms shrinks its share)")
    print("\nemulated compute: measured idle within 0.05 of the simulation on every rank: "
          + verdict)
    for name in cfg["schedules"]:
        print("\n" + schedules.describe(name, stages, max(cfg["micro_batches"]), cfg["v"][name]))
    path = write_rows(ctx, cfg, rows)
    print(f"\nwrote {path}")


# --------------------------------------------------------------------------- flags


def emulate_ms_flag(text: str) -> float:
    """--emulate-ms: a finite number of milliseconds in (0, MAX_EMULATE_MS]."""
    from common import launch
    allowed = f"a number of milliseconds > 0 and <= {MAX_EMULATE_MS:g}"
    try:
        value = launch.positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {allowed}") from None
    if value > MAX_EMULATE_MS:
        raise argparse.ArgumentTypeError(f"{text!r} is not {allowed}")
    return value


def bytes_per_rank(args) -> int:
    """A rank's rough peak, float32: the whole stack built on every rank, the one-process
    reference with its gradients and their copies, this rank's gradients (5 x the
    parameters), and the activations of the reference and of the micro-batches held."""
    parameters = args.layers * (2 * args.d_model * args.hidden + args.d_model + args.hidden)
    activations = 2 * args.layers * args.batch * (args.d_model + 2 * args.hidden)
    return 4 * (5 * parameters + activations)


def check_memory(args, config) -> None:
    from common import launch
    need = bytes_per_rank(args)
    what = (f"--layers {args.layers} --d-model {args.d_model} --hidden {args.hidden} "
            f"--batch {args.batch}")
    ranks_here = launch.ranks_on_this_node(config.world_size)
    if config.device == "cuda":
        per_gpu = -(-ranks_here // torch.cuda.device_count()) * need     # ceil
        total = torch.cuda.get_device_properties(0).total_memory
        if per_gpu > 0.9 * total:
            launch.usage_error(f"{what} needs about {per_gpu / 2**30:.1f} GiB per GPU but a GPU "
                               f"has {total / 2**30:.1f} GiB; use smaller sizes")
    else:
        launch.check_ranks_fit(ranks_here, need, f"{need / 2**30:.2f} GiB each for {what}")


def main(argv=None) -> None:
    _repo()
    from common import launch, results
    names = list(schedules.SCHEDULES)
    parser = launch.make_parser(__doc__, world_size=4)
    parser.add_argument("--layers", type=launch.positive_int, default=8,
                        help="residual MLP blocks; must divide by p (x v)")
    parser.add_argument("--d-model", type=launch.positive_int, default=256,
                        help="activation width")
    parser.add_argument("--hidden", type=launch.positive_int, default=1024,
                        help="hidden width inside a block")
    parser.add_argument("--batch", type=launch.positive_int, default=64,
                        help="rows per batch; must divide by every m")
    parser.add_argument("--micro-batches", type=launch.int_list, default=None,
                        help="micro-batch counts m; default: 2p")
    parser.add_argument("--schedules", type=launch.choice_list(names), default=names,
                        help="subset of " + ",".join(names))
    parser.add_argument("--chunks", type=launch.positive_int, default=2,
                        help="v, model chunks per rank (interleaved only); at most layers / p")
    parser.add_argument("--emulate-ms", type=emulate_ms_flag, default=20.0,
                        help="measure also with every F, B, W replaced by a wait of this many ms "
                        f"(emulated compute; the messages stay real); at most {MAX_EMULATE_MS:g}")
    parser.add_argument("--warmup", type=launch.non_negative_int, default=0,
                        help="untimed passes besides the checked one")
    parser.add_argument("--iters", type=launch.positive_int, default=3,
                        help="timed passes per setting")
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    stages = config.world_size
    if args.micro_batches is None:
        args.micro_batches = [2 * stages]
    args.v = {}
    for name in args.schedules:
        args.v[name] = 1
    if "interleaved" in args.schedules:
        args.v["interleaved"] = args.chunks
        layers_per_stage = args.layers // stages           # a chunk holds one layer at least
        if args.layers % stages == 0 and args.chunks > layers_per_stage:
            launch.usage_error(f"--chunks {args.chunks} with --layers {args.layers} on {stages} "
                               f"stages: a stage holds {layers_per_stage} layer(s), so at most "
                               f"{layers_per_stage} chunk(s) (allowed: 1 to {layers_per_stage})")
    for name in args.schedules:
        for m in args.micro_batches:
            try:
                schedules.check_setting(name, stages, m, args.v[name], args.layers, args.batch)
            except ValueError as error:
                launch.usage_error(f"--schedules {name} --micro-batches {m}: {error}")
    check_memory(args, config)
    results.check_writable()
    launch.launch(pipeline_parallel_main, config, vars(args))


if __name__ == "__main__":
    main()
