"""Stage 07, lesson 9: which grid for this model on this cluster? Every grid ranked, before any
GPU is rented: each split of the GPUs into (pp, dp, cp, tp), data-parallel kind, micro-batch
count and recomputation that fits, fastest first, the fastest term by term (planner.py); or
the one grid ``--grid`` names. Every figure is a prediction from the presets, nothing run.

Run:  make plan                                           # the course's small LM, 8 x H100
      make plan MODEL=llama3-8b CLUSTER=8xH100-nvlink
      python 07_parallelism/09_planning/run_planning.py --model llama3-8b --gpu A100 --gpus 64 \\
          --batch 64 --grid "dp64 fsdp op" --json
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import planner  # noqa: E402  (the lesson, beside this file)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: common/
from common import models  # noqa: E402
from common.launch import Parser, number  # noqa: E402  (argparse, a usage error in one line, exit 2)

SHAPE = {"layers": 10**3, "d_model": 10**6, "heads": 10**5, "d_ff": 10**7, "vocab": 10**8,
         "seq": 10**8, "batch": 10**9, "kv_heads": 10**5}   # each flag's largest value
GPUS = 10**6
MAX_GRIDS = 12_000         # ranked in a minute at the most layers (each grid walks every layer)


def up_to(largest: int):          # a flag type (common/launch.py's): a whole number, 1 to largest
    return number(int, 1, f"a whole number from 1 to {largest:,}", largest)


def parse_args(argv=None) -> argparse.Namespace:
    parser = Parser(description=__doc__.split("\n\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", choices=[*models.PRESETS, "llama3-8b"],
                        help="a preset the shape flags start from (default: small)")
    for flag, largest in SHAPE.items():
        parser.add_argument("--" + flag.replace("_", "-"), type=up_to(largest),
                            help="overrides the preset's (--batch: sequences a step, all GPUs)")
    parser.add_argument("--gated-mlp", action="store_true", help="SwiGLU MLP (Llama)")
    parser.add_argument("--no-position-embedding", action="store_true", help="rotary (Llama)")
    parser.add_argument("--compiled", action="store_true", help="Llama's element-wise ops fused")
    parser.add_argument("--cluster", default="8xH100-nvlink", choices=list(planner.CLUSTERS))
    parser.add_argument("--gpu", choices=list(planner.GPUS), help="overrides the cluster's GPU")
    parser.add_argument("--gpus", "--ranks", type=up_to(GPUS), help="GPUs in all")
    parser.add_argument("--gpus-per-node", type=up_to(1024), help="GPUs a node (default: 8)")
    parser.add_argument("--top", type=up_to(10**6), default=10, help="grids to print (default: 10)")
    parser.add_argument("--grid", help="predict this grid only, a label as printed, e.g. "
                                       "'dp1 ddp tp8 sp pp8 v3 m64 sel'")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object a grid")
    args = parser.parse_args(argv)
    preset = planner.CLUSTERS[args.cluster]
    args.machine = planner.cluster(args.gpu or "H100", args.gpus or preset.ranks,
                                   args.gpus_per_node or preset.ranks_per_node)
    args.lm = model_of(args, default_batch=2 * args.machine.ranks)
    if args.lm.d_model % args.lm.heads or args.lm.heads % (args.lm.kv_heads or args.lm.heads):
        parser.error(f"--heads {args.lm.heads}: must divide --d-model {args.lm.d_model}"
                     + f" and be a multiple of --kv-heads {args.lm.kv_heads}" * bool(args.lm.kv_heads))
    if args.machine.ranks % min(args.machine.ranks, args.machine.ranks_per_node):
        parser.error(f"--gpus {args.machine.ranks}: not whole nodes of {args.machine.ranks_per_node}")
    if args.grid is not None:
        try:
            grid = planner.parse_label(args.grid)
        except ValueError as error:
            parser.error(f"--grid {args.grid!r}: {error}")
        problem = grid_problem(args.lm, grid, args.machine.ranks, args.machine.ranks_per_node)
        if problem:
            parser.error(f"--grid {args.grid!r}: {problem}")
        args.grid = grid
    elif sum(1 for _ in planner.candidate_grids(args.lm, args.machine.ranks, args.machine.ranks_per_node)) > MAX_GRIDS:
        parser.error(f"more than {MAX_GRIDS:,} grids of {args.machine.ranks} GPUs to rank: name one with --grid")
    return args


def course_lm(preset: str, seq: int, compute_bytes: int = 2) -> planner.LM:
    shape = models.PRESETS[preset]
    return planner.LM(layers=shape["num_layers"], d_model=shape["d_model"], d_ff=shape["d_ff"], heads=shape["num_heads"],
                      vocab=models.VOCAB_SIZE, seq=seq, batch=0, compute_bytes=compute_bytes)


def model_of(args, default_batch: int) -> planner.LM:
    """The preset (2 sequences a GPU), then every shape flag given over it."""
    lm = planner.LLAMA3_8B if args.model == "llama3-8b" else course_lm(args.model, 256)
    given = {flag: getattr(args, flag) for flag in SHAPE if getattr(args, flag) is not None}
    return dataclasses.replace(lm, **{"batch": default_batch, **given},
                               gated_mlp=lm.gated_mlp or args.gated_mlp,
                               position_embedding=lm.position_embedding and not args.no_position_embedding,
                               eager=lm.eager and not args.compiled)


def box_crossover(ranks: int = 2) -> dict | None:
    """This box's DDP crossover on Gloo/CPU from make bench's results/ (None before it ran): from the
    DDP bench's control (ddp_step.csv), a rank's backward at one row and at two (a line: a floor and
    a rate) and the all-reduce of its gradients right after a backward, as a step makes it."""
    folder = Path(os.environ.get("RESULTS_DIR") or Path(__file__).resolve().parents[2] / "results")
    try:
        row = [r for r in csv.DictReader((folder / "ddp_step.csv").read_text().splitlines()) if r["impl"] == "none"
               and (r["backend"], r["device"], r["world_size"]) == ("gloo", "cpu", str(ranks))][-1]
        lm = course_lm(row["model"], int(row["context_length"]), compute_bytes=4)
        one_row, two_rows, all_reduce = (float(row[k]) / 1e3 for k in (
            "bwd_one_row_ms", "bwd_two_rows_ms", "all_reduce_after_backward_ms"))
        slope = (two_rows - one_row) / lm.seq               # backward: floor + tokens x slope
        link = planner.Link(latency=all_reduce, busbw=float("inf"))   # the step's all-reduce, whole
        rate = planner.training_flops_per_token(lm) * 2 / 3 / slope
        floor = 2 * one_row - two_rows                       # the line at no tokens
        return {"tokens": planner.dp_crossover_tokens(lm, rate, link, ranks, floor), "rate": rate,
                "floor_s": floor, "model": row["model"], "ranks": ranks, "all_reduce_s": all_reduce}
    except (OSError, LookupError, ValueError, TypeError):
        return None


def grid_problem(lm: planner.LM, grid: planner.Grid, gpus: int, gpus_per_node: int = 8) -> str:
    """Why ``grid`` cannot run ``lm`` on ``gpus`` GPUs, in one line ('' if it can)."""
    rows = lm.batch // grid.dp
    checks = [
        (grid.world_size == gpus, f"dp x tp x pp x cp = {grid.world_size}, not the {gpus} GPUs"),
        (lm.heads % grid.tp == 0 and (lm.kv_heads or lm.heads) % grid.tp == 0,
         f"tp{grid.tp} does not divide the {lm.heads} heads ({lm.kv_heads or lm.heads} kv heads)"),
        (lm.layers % (grid.pp * grid.chunks) == 0,
         f"pp{grid.pp} x v{grid.chunks} does not divide the {lm.layers} layers"),
        (grid.pp == 1 or grid.micro_batches >= grid.pp,
         f"m{grid.micro_batches}: fewer micro-batches than the {grid.pp} stages"),
        (grid.chunks == 1 or (grid.pp > 1 and grid.micro_batches % grid.pp == 0),
         f"v{grid.chunks}: interleaved 1F1B needs pp and micro-batches a multiple of the stages"),
        (grid.tp <= gpus_per_node, f"tp{grid.tp} crosses nodes of {gpus_per_node} GPUs"),
        (lm.batch % grid.dp == 0 and rows % grid.micro_batches == 0 and rows >= grid.micro_batches,
         f"the batch of {lm.batch} does not split into dp{grid.dp} x m{grid.micro_batches}"),
        (grid.cp == 1 or lm.seq % (2 * grid.cp) == 0,
         f"cp{grid.cp} does not split the sequence of {lm.seq} into {2 * grid.cp} halves"),
        (grid.tp > 1 or not grid.sp, "sp without tp"),
        (grid.recompute != "op" or (grid.tp == 1 and lm.gated_mlp), "op: torchtitan's policy, counted for its "
         f"Llama (--gated-mlp) at tp 1, not {f'tp{grid.tp}' if lm.gated_mlp else 'a GPT-style block'}"),
    ]
    return next((why for ok, why in checks if not ok), "")


def as_json(prediction: dict) -> dict:
    return {"grid": planner.label(prediction["grid"]), "step_ms": prediction["step_s"] * 1e3,
            "tokens_per_s_per_gpu": prediction["tokens_per_s_per_rank"], "mfu": prediction["mfu"],
            "memory_gib": prediction["memory"]["total"] / 2**30, "fits": prediction["fits"],
            "terms_ms": {name: seconds * 1e3 for name, seconds, _ in prediction["terms"]}}


def main(argv=None) -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)    # `make plan | head`: ends quietly, as Unix tools do
    args = parse_args(argv)
    lm = args.lm
    machine = args.machine
    grids = [args.grid] if args.grid else list(
        planner.candidate_grids(lm, machine.ranks, machine.ranks_per_node))
    predictions = [planner.predict(lm, grid, machine) for grid in grids]
    fitting = sorted((p for p in predictions if p["fits"] or args.grid), key=lambda p: p["step_s"])
    if args.json:
        print(json.dumps([as_json(p) for p in fitting[:args.top]], indent=1))
        return 0 if fitting else 1
    print(f"model: {planner.parameter_count(lm) / 1e9:.3g}B parameters, {lm.layers} layers, "
          f"d_model {lm.d_model}, {lm.heads} heads, {lm.batch} sequences of {lm.seq} tokens a step")
    print(f"cluster: {machine.name} ({machine.source})")
    print("every figure below is PREDICTED from the formulas and the presets, not measured\n")
    if not fitting:
        print(f"no grid of {machine.ranks} GPUs " + (
            f"fits this model in {machine.memory / 1e9:.0f} GB a GPU ({len(predictions)} tried): more "
            "GPUs, a smaller batch, or a shorter sequence" if predictions else f"splits this model: the "
            f"batch of {lm.batch} must split over the data ranks, the {lm.heads} heads over tp (at most "
            f"a node), the {lm.layers} layers over pp"))
        return 1
    fit = sum(p["fits"] for p in predictions)
    print(f"{fit} grids fit ({len(predictions) - fit} do not); the {min(args.top, len(fitting))} fastest:")
    print(f"{'grid':34} {'GiB/GPU':>8} {'step ms':>9} {'tokens/s/GPU':>13} {'MFU':>6}")
    for prediction in fitting[:args.top]:
        print(f"{planner.label(prediction['grid']):34} {prediction['memory']['total'] / 2**30:8.1f} "
              f"{prediction['step_s'] * 1e3:9.1f} {prediction['tokens_per_s_per_rank']:13,.0f} "
              f"{prediction['mfu']:6.1%}" + "  does not fit" * (not prediction["fits"]))
    best = fitting[0]
    print(f"\n{planner.label(best['grid'])}, term by term:")
    for name, seconds, source in best["terms"]:
        print(f"  {name:44} {seconds * 1e3:9.2f} ms   {source}")
    memory = best["memory"]
    print("  memory per GPU: " + ", ".join(f"{kind} {memory[kind] / 2**30:.2f} GiB"
                                           for kind in memory if kind != "total"))
    box = box_crossover()
    if box:
        print(f"\nthis box: DDP over {box['ranks']} ranks stops being communication-bound at {box['tokens']:.0f}"
              f" tokens a rank (LM {box['model']}: backward {box['floor_s'] * 1e3:.2g} ms + {box['rate'] / 1e9:.3g}"
              f" GFLOP/s a rank, a {box['all_reduce_s'] * 1e3:.3g} ms all-reduce), predicted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
