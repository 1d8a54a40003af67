"""Stage 07, lesson 4, runnable: every pipeline schedule checked against one process.

The lesson's files, in reading order: ``one_f_one_b.py`` (1F1B as three plain loops),
``pipeline_schedules.py`` (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V and DualPipeV as
data), and ``pipeline_parallel.py`` (the executor that runs any of them). This script splits
a stack of residual MLP blocks over the ranks and, for every schedule and micro-batch count m
(and the plain 1F1B loops), checks that every layer's gradient and the loss equal what one
process computes on the whole batch, and that every rank holds as many micro-batches at once
as the schedule promises. It prints what matched, each schedule's timeline in unit time, and exits 1
on any difference (every rank reaches the same verdict).

Run:  python 07_parallelism/04_pipeline_parallel/run_pipeline.py               # 4 stages, m = 8 (make 07)
      python 07_parallelism/04_pipeline_parallel/run_pipeline.py --device cuda # the same on the GPU
      torchrun --nproc-per-node=4 07_parallelism/04_pipeline_parallel/run_pipeline.py

The bubble (each rank's idle share, with real and with emulated compute) is measured by
``07_parallelism/measure/bench_pipeline.py``; ``--bench``, ``--emulate-ms``, ``--warmup`` and
``--iters`` hand this command over to it, e.g. ``run_pipeline.py --micro-batches 4,8,16
--emulate-ms 50``.
"""

from __future__ import annotations

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

# float32: the pipeline sums m micro-batch gradients (each of a loss / m) where one process
# sums the whole batch in one matrix product; they round differently by a few units in the
# last place, times the depth. A real bug (a missing / m) is off by a factor m.
GRAD_RTOL = 1e-4
GRAD_ATOL = 1e-6


def _repo() -> None:
    """The harness needs common/, the algorithm does not (the same in every runnable script,
    on purpose: each lesson's folder runs from where it lies)."""
    root = Path(__file__).resolve().parent
    while not (root / "common" / "launch.py").exists():
        if root == root.parent:
            raise SystemExit(f"{Path(__file__).name}: the algorithm works on its own; this "
                             "script needs the repository around it (common/)")
        root = root.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


def make_data(args, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), [batch, d_model] each, the same on every rank."""
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(args.batch, args.d_model, generator=generator).to(device)
    targets = torch.randn(args.batch, args.d_model, generator=generator).to(device)
    return inputs, targets


def one_process(args, device: torch.device) -> tuple[list, float]:
    """The reference: the same stack (plain nn.Linear, the same weights) on the whole batch.
    Returns each layer's parameter gradients and the loss."""
    model = pipeline_parallel.build_model(args.layers, args.d_model, args.hidden, linear=nn.Linear)
    model = model.to(device)
    inputs, targets = make_data(args, device)
    loss = F.mse_loss(model(inputs), targets)
    loss.backward()
    grads = []
    for block in model:
        grads.append([parameter.grad for parameter in block.parameters()])
    return grads, loss.item()


def pipeline_step(model, ctx, args, name: str, m: int) -> tuple[dict, list[range]]:
    """One forward and backward of the whole batch under schedule ``name`` (the plain 1F1B
    loops for "plain 1F1B"), on this rank's layers: (the result, the layers it ran)."""
    stages = ctx.world_size
    inputs, targets = make_data(args, ctx.device)
    micro_inputs = None
    if ctx.rank == 0:
        micro_inputs = list(inputs.chunk(m))           # m x [batch / m, d_model]
    micro_targets = None
    if ctx.rank == schedules.loss_rank(name, stages, args.chunks):
        micro_targets = list(targets.chunk(m))
    activation_shape = (args.batch // m, args.d_model)
    model.zero_grad(set_to_none=True)
    if name == "plain 1F1B":
        layers = pipeline_parallel.chunk_layers(args.layers, stages, ctx.rank)
        stage = one_f_one_b.Stage(model[layers[0].start:layers[0].stop], activation_shape,
                                  ctx.device, F.mse_loss, m)
        return one_f_one_b.one_f_one_b(stage, micro_inputs, micro_targets), layers
    v = chunks_for(args, name)
    layers = pipeline_parallel.chunk_layers(args.layers, stages, ctx.rank, v,
                                            schedules.layout_of(name))
    chunks = []
    for piece in layers:
        chunks.append(model[piece.start:piece.stop])
    schedule = schedules.all_ranks(name, stages, m, v)
    result = pipeline_parallel.run_schedule(chunks, schedule, micro_inputs, micro_targets,
                                            activation_shape, ctx.device)
    return result, layers


def chunks_for(args, name: str) -> int:
    """v: --chunks for interleaved, 2 for the V schedules (ZB-V, DualPipeV), else 1."""
    return schedules.chunks_per_rank(name, args.chunks)


def promised_peak(ctx, args, name: str, m: int) -> int:
    """The most micro-batches the schedule says this rank holds at once."""
    if name == "plain 1F1B":
        return min(ctx.world_size - ctx.rank, m)
    steps = schedules.schedule_steps(name, ctx.rank, ctx.world_size, m, chunks_for(args, name))
    return schedules.peak_held(steps)


def pipeline_main(ctx, args) -> None:
    from common import verify
    # Every rank builds the whole stack from one seed (the same weights, nothing sent), and
    # runs its own layers of it.
    model = pipeline_parallel.build_model(args.layers, args.d_model, args.hidden).to(ctx.device)
    want_grads, want_loss = one_process(args, ctx.device)
    cases = []
    for name in args.schedules:
        for m in args.micro_batches:
            cases.append((name, m))
    if ctx.backend == "gloo":             # the plain loops' sends can wait on each other on NCCL
        for m in args.micro_batches:
            cases.append(("plain 1F1B", m))
    problems = []
    seen = []                             # (case, largest relative gradient difference, held)
    for name, m in cases:
        label = f"{name} m={m}"
        result, layers = pipeline_step(model, ctx, args, name, m)
        largest = 0.0
        for piece in layers:
            for layer in piece:
                for index, parameter in enumerate(model[layer].parameters()):
                    want = want_grads[layer][index]
                    if parameter.grad is None:
                        problems.append(f"{label}: layer {layer} parameter {index} got no gradient")
                        continue
                    difference = (parameter.grad - want).abs().max().item()
                    largest = max(largest, difference / want.abs().max().item())
                    if not torch.allclose(parameter.grad, want, rtol=GRAD_RTOL, atol=GRAD_ATOL):
                        problems.append(f"{label}: layer {layer} parameter {index} differs from "
                                        f"one process by {difference:.3g}")
        off = abs(result["loss"] - want_loss)
        last = schedules.loss_rank(name, ctx.world_size, args.chunks)
        if ctx.rank == last and off > GRAD_RTOL * want_loss:
            problems.append(f"{label}: loss {result['loss']:.6g}, one process {want_loss:.6g}")
        promised = promised_peak(ctx, args, name, m)
        if result["peak_held"] != promised:
            problems.append(f"{label}: held {result['peak_held']} micro-batches at once, the "
                            f"schedule says {promised}")
        seen.append((label, largest, result["peak_held"]))
    problems = verify.agree_on_problems(problems)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, seen)
    if ctx.is_main:
        print(f"{ctx.world_size} stages, {args.layers} blocks of width {args.d_model} (hidden "
              f"{args.hidden}), batch {args.batch}, {ctx.backend}/{ctx.device.type}; every "
              "layer's gradient and the loss against one process on the whole batch:")
        for index, (label, _, _) in enumerate(seen):
            largest = max(rank_seen[index][1] for rank_seen in everyone)
            held = " ".join(str(rank_seen[index][2]) for rank_seen in everyone)
            print(f"  {label:20} largest relative difference {largest:.1e} (allowed "
                  f"{GRAD_RTOL:g}); micro-batches held at once per rank: {held}")
        for name in args.schedules:
            m = max(args.micro_batches)
            print("\n" + schedules.describe(name, ctx.world_size, m, chunks_for(args, name)))
    if problems:
        ctx.print("pipeline check FAILED:\n  " + "\n  ".join(problems), all_ranks=False)
        raise SystemExit(1)
    ctx.print("all checks passed: every schedule's gradients and loss equal one process's, "
              "activations held as each schedule says", all_ranks=False)


def main(argv=None) -> None:
    _repo()
    from bench import launch  # TODO(lab)
    from common import hand_over
    parser = launch.make_parser(__doc__, world_size=4)
    add_flags(parser)
    args = parser.parse_args(argv)
    measuring = [args.emulate_ms, args.warmup, args.iters]
    if args.bench or measuring != [None, None, None]:
        hand_over("07_parallelism/measure/bench_pipeline.py")
    config = launch.resolve(args)
    check_flags(args, config)
    launch.launch(pipeline_main, config, args)


# --------------------------------------------------------------------------- flags
# The same flags and checks as measure/bench_pipeline.py (repeated on purpose: the lesson
# never imports its measurement).


def add_flags(parser) -> None:
    from bench import launch  # TODO(lab): memory checks move to the lab
    names = list(schedules.SCHEDULES)
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
    measure = "measure the bubble instead: hands over to 07_parallelism/measure/bench_pipeline.py"
    parser.add_argument("--bench", action="store_true", help=measure)
    parser.add_argument("--emulate-ms", help=measure + " (every F, B, W a wait of this many ms)")
    parser.add_argument("--warmup", help=measure + " (untimed passes)")
    parser.add_argument("--iters", help=measure + " (timed passes per setting)")


def check_flags(args, config) -> None:
    """Every setting refused in one line (exit 2) before any worker starts."""
    from bench import launch  # TODO(lab): memory checks move to the lab
    stages = config.world_size
    if args.micro_batches is None:
        args.micro_batches = [2 * stages]
    for name in args.schedules:
        for m in args.micro_batches:
            try:
                schedules.check_setting(name, stages, m, chunks_for(args, name), args.layers,
                                        args.batch)
            except ValueError as error:       # layers, batch, the schedule's own rules
                launch.usage_error(f"--schedules {name} --micro-batches {m} --chunks "
                                   f"{chunks_for(args, name)} --layers {args.layers} --batch "
                                   f"{args.batch}: {error}")
    # A rank's rough peak, float32: the stack and the reference with their gradients and
    # copies (5 x the parameters) and the activations of the micro-batches held.
    parameters = args.layers * (2 * args.d_model * args.hidden + args.d_model + args.hidden)
    activations = 2 * args.layers * args.batch * (args.d_model + 2 * args.hidden)
    need = 4 * (5 * parameters + activations)
    what = (f"--layers {args.layers} --d-model {args.d_model} --hidden {args.hidden} "
            f"--batch {args.batch}")
    launch.check_fits(config, need, f"{need / 2**30:.2f} GiB each for {what}")


if __name__ == "__main__":
    main()
