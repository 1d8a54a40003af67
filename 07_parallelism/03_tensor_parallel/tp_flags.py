"""Stage 07, lesson 3, harness: the flags of the tensor-parallel demo and of its measurement
(``07_parallelism/measure/bench_tensor_parallel.py`` takes the same ones), and the sizes they
refuse in one line (exit 2) before any worker starts. One file for both: the demo never
imports its measurement, and the measurement never imports a run script."""

from __future__ import annotations

import tensor_parallel as tp
from bench import supervisor as launch  # TODO(lab): memory checks move to the lab


def add_flags(parser) -> None:
    for flag, default, what in (("--d-model", 64, "MLP and block input/output width"),
                                ("--d-ff", 256, "MLP hidden width"),
                                ("--batch", 8, "sequences per batch"),
                                ("--seq", 16, "tokens per sequence"),
                                ("--heads", 4, "attention heads of the block")):
        parser.add_argument(flag, type=launch.positive_int, default=default, help=what)
    parser.add_argument("--variants", type=launch.choice_list(list(tp.VARIANTS)),
                        default=list(tp.VARIANTS), help="comma-separated subset of: "
                        + ", ".join(tp.VARIANTS))


def refuse_bad_sizes(parser, args, world_size: int) -> None:
    """One line and exit 2 for sizes the split cannot take, before any worker starts."""
    if args.d_ff % world_size:
        parser.error(f"--d-ff {args.d_ff} is not divisible by the tensor-parallel size "
                     f"(world size) {world_size}")
    if "allgather" in args.variants and args.d_model % world_size:
        parser.error(f"--d-model {args.d_model} is not divisible by the world size {world_size} "
                     "(the all-gather variant splits fc2's outputs)")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    if args.heads % world_size:
        parser.error(f"--heads {args.heads} is not divisible by the world size {world_size} "
                     "(each rank holds whole heads)")
    if args.seq % world_size:
        parser.error(f"--seq {args.seq} is not divisible by the world size {world_size} "
                     "(sequence parallelism gives each rank seq / t tokens)")


def refuse_too_large(config, args) -> None:
    """One line and exit 2 when a rank's rough peak (float32: the full MLP and block, their
    gradients, its slices and torch's copy, the activations of three blocks) cannot fit: in
    a GPU's memory (ranks sharing it add up), else the host's."""
    weights = 2 * args.d_model * args.d_ff + 4 * args.d_model * args.d_model
    tokens = args.batch * args.seq
    activations = tokens * (12 * args.d_model + 3 * args.d_ff) + args.batch * args.heads * args.seq
    need = 4 * (6 * weights + 4 * activations)
    what = (f"{need / 2**30:.1f} GiB each for --d-model {args.d_model} --d-ff {args.d_ff} "
            f"--batch {args.batch} --seq {args.seq}")
    launch.check_fits(config, need, what)
