"""Not a lesson: what torch's Flight Recorder costs on a lesson-7 step, and that lesson 10's
diagnose raises no false alarm on a correct grid.

    python 07_parallelism/measure/bench_hangs.py                    # 4 ranks, dp2 tp2, CPU sizes
    python 07_parallelism/measure/bench_hangs.py --dp 4 --tp 1 --iters 20

Two launches of the same step (grid_bench.build_grid: lesson 7's LM on the grid,
``parallel_lm.train_step``, AdamW), timed as grid_bench times it (the slowest rank's median):
``TORCH_FR_BUFFER_SIZE=0`` (the recorder off) and ``=2000`` (on: torch 2.13's default),
alternated ``--rounds`` times. The variable is read once, when a process's first group
starts, hence a launch each. Every launch writes each rank's record and runs lesson 10's
``diagnose`` on it: the ranks of a correct grid must agree (exit 1 if not). One line per
launch, then the ratio of each setting's fastest launch.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: common/

import grid_bench  # noqa: E402 (this folder is on the path: Python puts a script's folder there)
from common import import_stage  # noqa: E402
from bench import timing
from bench import supervisor as launch


def bench_step(ctx, spec: dict, sizes: dict, folder: str) -> None:
    built = grid_bench.build_grid(ctx, spec, sizes, grid_bench.load_lessons())
    seconds = timing.measure(built["step"], ctx.device, warmup=sizes["warmup"],
                             iters=sizes["iters"], barrier=True)
    stats = timing.gather_times(seconds)
    Path(folder, f"rank_{ctx.rank}").write_bytes(torch._C._distributed_c10d._dump_fr_trace())
    if ctx.is_main:
        Path(folder, "step.json").write_text(json.dumps({"median_s": stats.median}))


def main(argv=None) -> None:
    parser = launch.make_parser(__doc__, world_size=4)
    parser.add_argument("--dp", type=launch.positive_int, default=2)
    parser.add_argument("--tp", type=launch.positive_int, default=2)
    parser.add_argument("--iters", type=launch.positive_int, default=10)
    parser.add_argument("--rounds", type=launch.positive_int, default=2)
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    if args.dp * args.tp != config.world_size:
        parser.error(f"--dp {args.dp} x --tp {args.tp} must be --world-size {config.world_size}")
    spec = grid_bench.grid_spec(dp=args.dp, tp=args.tp)
    sizes = {**grid_bench.SIZES["cpu" if config.device == "cpu" else "gpu"], "iters": args.iters}
    diagnose = import_stage("07_parallelism/10_hangs/diagnose")
    medians = {"0": [], "2000": []}
    for _ in range(args.rounds):  # alternated: a busy box's slow spells hit both settings
        for buffer in medians:
            os.environ["TORCH_FR_BUFFER_SIZE"] = buffer
            with tempfile.TemporaryDirectory() as folder:
                launch.launch(bench_step, config, spec, sizes, folder)
                median = json.loads(Path(folder, "step.json").read_text())["median_s"]
                agree, line = diagnose.diagnose(diagnose.load(folder))
            medians[buffer].append(median)
            print(f"TORCH_FR_BUFFER_SIZE={buffer:<5} {grid_bench.grid_label(spec)}, "
                  f"{sizes['model']} LM, batch {sizes['batch_size']} x {sizes['seq_len']}: step "
                  f"{median * 1e3:.1f} ms (slowest rank's median of {args.iters}); diagnose: "
                  f"{line}", flush=True)
            if not agree:
                raise SystemExit(1)
    on = min(medians["2000"])
    off = min(medians["0"])
    print(f"recorder on / off: {on / off:.3f}x (each setting's fastest launch of "
          f"{args.rounds})")

if __name__ == "__main__":
    main()
