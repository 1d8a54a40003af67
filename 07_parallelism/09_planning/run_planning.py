"""Stage 07, lesson 9: which grid for this model on this cluster? Every grid ranked, before any
GPU is rented.

For a model (a course preset, or Llama 3.1 8B) and a cluster preset, this tries every way to
split the ranks into (pp, dp, cp, tp) with each data-parallel kind (DDP, ZeRO-1, ZeRO-2, FSDP),
micro-batch counts and activation checkpointing, keeps those that fit in memory, and prints them
fastest first, with the best one's step time taken apart term by term (planner.py, beside this
file, says where each term comes from). Everything printed is a prediction: arithmetic on the
lessons' formulas and a spec sheet, nothing run.

Run:  make plan                                           # the course's small LM, 8 x H100
      make plan MODEL=llama3-8b CLUSTER=8xH100-nvlink
      python 07_parallelism/09_planning/run_planning.py --model medium --cluster 16xH100-ib --top 5
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import planner  # noqa: E402  (the lesson, beside this file)

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


def course_lm(preset: str, batch: int, seq: int) -> planner.LM:
    from common import models
    shape = models.PRESETS[preset]
    return planner.LM(layers=shape["num_layers"], d_model=shape["d_model"], d_ff=shape["d_ff"],
                      heads=shape["num_heads"], vocab=models.VOCAB_SIZE, seq=seq, batch=batch,
                      compute_bytes=2)


def parse_args(argv=None) -> argparse.Namespace:
    _repo()
    from common import models
    from common.launch import Parser     # argparse, a usage error in one line, exit 2
    parser = Parser(description=__doc__.split("\n\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small",
                        help=f"a course preset ({', '.join(models.PRESETS)}) or llama3-8b "
                             "(default: small)")
    parser.add_argument("--cluster", default="8xH100-nvlink",
                        help=f"one of {', '.join(planner.CLUSTERS)} (default: 8xH100-nvlink)")
    parser.add_argument("--ranks", type=int, default=0,
                        help="GPUs to use (default: every GPU of the cluster preset)")
    parser.add_argument("--batch", type=int, default=0,
                        help="sequences per optimizer step (default: 2 per GPU)")
    parser.add_argument("--seq", type=int, default=0,
                        help="tokens per sequence (default: 256 for course presets, 8192 for llama3-8b)")
    parser.add_argument("--top", type=int, default=10, help="grids to print (default: 10)")
    parser.add_argument("--grid", default="",
                        help="only grids whose label starts with this, e.g. 'dp8 fsdp' (default: all)")
    args = parser.parse_args(argv)
    if args.model != "llama3-8b" and args.model not in models.PRESETS:
        parser.error(f"--model {args.model!r}: choose one of {', '.join(models.PRESETS)}, llama3-8b")
    if args.cluster not in planner.CLUSTERS:
        parser.error(f"--cluster {args.cluster!r}: choose one of {', '.join(planner.CLUSTERS)}")
    for flag in ("ranks", "batch", "seq", "top"):
        if getattr(args, flag) < 0 or (flag == "top" and args.top == 0):
            parser.error(f"--{flag} {getattr(args, flag)}: must be a positive whole number")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    machine = planner.CLUSTERS[args.cluster]
    ranks = args.ranks or machine.ranks
    batch = args.batch or 2 * ranks
    if args.model == "llama3-8b":
        lm = dataclasses.replace(planner.LLAMA3_8B, batch=batch, seq=args.seq or planner.LLAMA3_8B.seq)
    else:
        lm = course_lm(args.model, batch, args.seq or 256)
    print(f"model {args.model}: {planner.parameter_count(lm) / 1e9:.3g}B parameters, "
          f"{lm.batch} sequences of {lm.seq} tokens a step, {lm.compute_bytes * 8}-bit compute")
    print(f"cluster {args.cluster}: {machine.name} ({machine.source}), {ranks} GPUs")
    print("every figure below is PREDICTED from the formulas and the spec sheet, not measured\n")

    fitting = []
    too_big = []
    for grid in planner.candidate_grids(lm, ranks, machine.ranks_per_node):
        if not planner.label(grid).startswith(args.grid):
            continue
        prediction = planner.predict(lm, grid, machine)
        if prediction["fits"]:
            fitting.append(prediction)
        else:
            too_big.append(prediction)
    if args.grid:                    # the grids asked for by name: say which do not fit, and why
        for prediction in too_big:
            print(f"{planner.label(prediction['grid'])}: does not fit, "
                  f"{prediction['memory']['total'] / 2**30:.1f} GiB a GPU predicted "
                  f"(of {machine.memory / 2**30:.1f} GiB)")
    if not fitting:
        like = ""
        if args.grid:
            like = f" like {args.grid!r}"
        print(f"no grid of {ranks} GPUs{like} fits this model in {machine.memory / 1e9:.0f} GB "
              f"a GPU ({len(too_big)} tried): more GPUs, a smaller batch, or a shorter sequence")
        return 1
    fitting.sort(key=lambda prediction: prediction["step_s"])
    print(f"{len(fitting)} grids fit ({len(too_big)} do not); the "
          f"{min(args.top, len(fitting))} fastest:")
    print(f"{'grid':32} {'GiB/GPU':>8} {'step ms':>9} {'tokens/s/GPU':>13} {'MFU':>6}")
    for prediction in fitting[:args.top]:
        print(f"{planner.label(prediction['grid']):32} {prediction['memory']['total'] / 2**30:8.1f} "
              f"{prediction['step_s'] * 1e3:9.1f} {prediction['tokens_per_s_per_rank']:13,.0f} "
              f"{prediction['mfu']:6.1%}")
    best = fitting[0]
    print(f"\nthe fastest, {planner.label(best['grid'])}, term by term:")
    for name, seconds, source in best["terms"]:
        print(f"  {name:46} {seconds * 1e3:9.2f} ms   {source}")
    memory = best["memory"]
    print("  memory per GPU: " + ", ".join(f"{kind} {memory[kind] / 2**30:.2f} GiB"
                                           for kind in ("param", "grad", "optim", "activation")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
