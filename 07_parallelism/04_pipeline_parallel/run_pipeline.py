"""Stage 07, lesson 4, runnable: every pipeline schedule checked against one process.

Splits a stack of residual MLP blocks over the ranks and runs one forward and backward of the
batch under every schedule (``pipeline_schedules.py``, run by ``pipeline_parallel.py``) and
the plain 1F1B loops (``one_f_one_b.py``, Gloo only), for each micro-batch count m. Every
layer's gradient and the loss must equal what one process computes on the whole batch. Prints
what matched and the micro-batches each rank held at once; exits 1 on any difference (every
rank reaches the same verdict).

Run:  python 07_parallelism/04_pipeline_parallel/run_pipeline.py               # 4 stages, m = 8
      python 07_parallelism/04_pipeline_parallel/run_pipeline.py --device cuda # on the GPU
      torchrun --nproc-per-node=4 07_parallelism/04_pipeline_parallel/run_pipeline.py
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

# float32: m micro-batch gradients summed round differently from one matrix product over the
# batch; a real bug (a missing / m) is off by a factor m.
GRAD_RTOL = 1e-4
GRAD_ATOL = 1e-6


def run_one(model, ctx, args, name: str, m: int, inputs, targets) -> tuple[dict, list[range]]:
    """One forward and backward of the batch under schedule ``name`` ("plain 1F1B": the three
    loops) on this rank's layers: (the result, the layers it ran)."""
    v = schedules.chunks_per_rank(name, args.chunks)
    micro_inputs = list(inputs.chunk(m)) if ctx.rank == 0 else None   # m x [batch / m, d_model]
    micro_targets = None
    if ctx.rank == schedules.loss_rank(name, ctx.world_size, v):
        micro_targets = list(targets.chunk(m))
    shape = (args.batch // m, args.d_model)
    model.zero_grad(set_to_none=True)
    layers = pipeline_parallel.chunk_layers(args.layers, ctx.world_size, ctx.rank, v,
                                            schedules.layout_of(name))
    chunks = [model[piece.start:piece.stop] for piece in layers]
    if name == "plain 1F1B":
        stage = one_f_one_b.Stage(chunks[0], shape, ctx.device, F.mse_loss, m)
        return one_f_one_b.one_f_one_b(stage, micro_inputs, micro_targets), layers
    schedule = schedules.all_ranks(name, ctx.world_size, m, v)
    return pipeline_parallel.run_schedule(chunks, schedule, micro_inputs, micro_targets, shape,
                                          ctx.device), layers


def worker(ctx, args) -> None:
    # Every rank builds the whole stack from one seed (the same weights, nothing sent) and
    # runs its own layers of it; the reference is the same stack in one process.
    model = pipeline_parallel.build_model(args.layers, args.d_model, args.hidden).to(ctx.device)
    reference = pipeline_parallel.build_model(args.layers, args.d_model, args.hidden,
                                              linear=nn.Linear).to(ctx.device)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(args.batch, args.d_model, generator=generator).to(ctx.device)
    targets = torch.randn(args.batch, args.d_model, generator=generator).to(ctx.device)
    want_loss = F.mse_loss(reference(inputs), targets)
    want_loss.backward()
    cases = [(name, m) for name in args.schedules for m in args.micro_batches]
    if ctx.backend == "gloo":             # the plain loops' sends can wait on each other on NCCL
        cases += [("plain 1F1B", m) for m in args.micro_batches]
    problems = []
    seen = []                             # per case: (largest relative difference, held)
    for name, m in cases:
        result, layers = run_one(model, ctx, args, name, m, inputs, targets)
        largest = 0.0
        for layer in [layer for piece in layers for layer in piece]:
            for got, want in zip(model[layer].parameters(), reference[layer].parameters()):
                if got.grad is None or not torch.allclose(got.grad, want.grad, GRAD_RTOL,
                                                          GRAD_ATOL):
                    problems.append(f"rank {ctx.rank}: {name} m={m}: layer {layer} differs")
                    continue
                difference = (got.grad - want.grad).abs().max() / want.grad.abs().max()
                largest = max(largest, difference.item())
        off = abs(result["loss"] - want_loss.item())
        if ctx.rank == schedules.loss_rank(name, ctx.world_size, args.chunks) and \
                off > GRAD_RTOL * want_loss.item():
            problems.append(f"rank {ctx.rank}: {name} m={m}: loss {result['loss']:.6g}, one "
                            f"process {want_loss.item():.6g}")
        seen.append((largest, result["peak_held"]))
    everyone = [None] * ctx.world_size    # one verdict on every rank: (problems, seen) each
    dist.all_gather_object(everyone, (problems, seen))
    problems = [problem for rank_problems, _ in everyone for problem in rank_problems]
    if ctx.is_main:
        print(f"{ctx.world_size} stages, {args.layers} blocks of width {args.d_model} (hidden "
              f"{args.hidden}), batch {args.batch}, {ctx.backend}/{ctx.device.type}; every "
              "layer's gradient and the loss against one process on the whole batch:")
        for index, (name, m) in enumerate(cases):
            largest = max(rank_seen[index][0] for _, rank_seen in everyone)
            held = " ".join(str(rank_seen[index][1]) for _, rank_seen in everyone)
            print(f"  {name + f' m={m}':18} largest relative difference {largest:.1e} (allowed "
                  f"{GRAD_RTOL:g}); micro-batches held at once per rank: {held}")
    if problems:
        ctx.print("pipeline check FAILED:\n  " + "\n  ".join(problems), all_ranks=False)
        raise SystemExit(1)
    ctx.print("all checks passed: every schedule's gradients and loss equal one process's",
              all_ranks=False)


def main(argv=None) -> None:
    root = Path(__file__).resolve().parents[2]            # the demo needs common/ (the lesson not)
    if not (root / "common").is_dir():
        raise SystemExit(f"{Path(__file__).name}: the algorithm works on its own; this script "
                         "needs the repository around it (common/)")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from common import launch
    names = list(schedules.SCHEDULES)
    parser = launch.make_parser(__doc__, world_size=4)
    parser.add_argument("--layers", type=launch.positive_int, default=8, help="MLP blocks")
    parser.add_argument("--d-model", type=launch.positive_int, default=256, help="their width")
    parser.add_argument("--hidden", type=launch.positive_int, default=1024, help="inside one")
    parser.add_argument("--batch", type=launch.positive_int, default=64, help="rows per batch")
    parser.add_argument("--micro-batches", type=launch.int_list, help="m values; default 2p")
    parser.add_argument("--schedules", type=launch.choice_list(names), default=names)
    parser.add_argument("--chunks", type=launch.positive_int, default=2, help="interleaved's v")
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    p = config.world_size
    args.micro_batches = args.micro_batches or [2 * p]
    for name in args.schedules:
        v = schedules.chunks_per_rank(name, args.chunks)
        if args.layers % (p * v):
            parser.error(f"--layers {args.layers} do not split into {p} stages x {v} chunks "
                         f"({name})")
        for m in args.micro_batches:
            if args.batch % m:      # unequal micro-batches: the m losses / m are not the mean
                parser.error(f"--batch {args.batch} does not split into {m} equal micro-batches")
            try:
                schedules.all_ranks(name, p, m, v)
            except ValueError as error:           # the schedule's own rule on m
                parser.error(f"--schedules {name} --micro-batches {m}: {error}")
    launch.launch(worker, config, args)


if __name__ == "__main__":
    main()
