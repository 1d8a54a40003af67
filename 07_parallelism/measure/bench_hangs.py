"""Not a lesson: what torch's Flight Recorder costs on a lesson-7 step, and that lesson 10's
diagnose raises no false alarm on a correct grid.

    python 07_parallelism/measure/bench_hangs.py                    # 4 ranks, dp2 tp2, CPU sizes
    python 07_parallelism/measure/bench_hangs.py --dp 4 --tp 1 --iters 20

Launches of grid_bench's step (lesson 7's LM on the grid, AdamW; the slowest rank's median),
``TORCH_FR_BUFFER_SIZE=2000`` (the recorder on: torch 2.13's default) and ``=0`` (off), read
when a process's first group starts, alternated ``--rounds`` times; each runs ``diagnose`` on
every rank's record (a disagreement exits 1). Then each setting's median and spread (min..max
of its launches), each round's on / off, and whether on / off lies outside the spreads. A
launch that no longer fits before make bench's ``BENCH_STEP_DEADLINE`` is skipped, said so.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: common/

import grid_bench  # noqa: E402 (this folder is on the path: Python puts a script's folder there)
from common import import_stage  # noqa: E402
from bench import step_bench, timing
from bench import supervisor as launch


def bench_step(ctx, spec: dict, sizes: dict, folder: str) -> None:
    built = grid_bench.build_grid(ctx, spec, sizes, grid_bench.load_lessons())
    seconds = timing.measure(built["step"], ctx.device, warmup=sizes["warmup"],
                             iters=sizes["iters"], barrier=True)
    median = timing.gather_times(seconds).median
    Path(folder, f"rank_{ctx.rank}").write_bytes(torch._C._distributed_c10d._dump_fr_trace())
    if ctx.is_main:
        Path(folder, "step_s").write_text(repr(median))


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
    print(f"{grid_bench.grid_label(spec)}, {sizes['model']} LM, batch {sizes['batch_size']} x "
          f"{sizes['seq_len']}, {config.backend}/{config.device}: each launch's step is the "
          f"slowest rank's median of {args.iters}")
    medians = {"2000": [], "0": []}  # the first launch checks diagnose on a real record
    launches = list(medians) * args.rounds  # alternated: a busy box's slow spells hit both
    for buffer in step_bench.until_deadline(None, launches, "the recorder's launches"):
        os.environ["TORCH_FR_BUFFER_SIZE"] = buffer
        with tempfile.TemporaryDirectory() as folder:
            launch.launch(bench_step, config, spec, sizes, folder)
            median = float(Path(folder, "step_s").read_text()) * 1e3
            agree, line = diagnose.diagnose(diagnose.load(folder))
        medians[buffer].append(median)
        print(f"TORCH_FR_BUFFER_SIZE={buffer:<5} step {median:.1f} ms; diagnose: {line}", flush=True)
        if not agree:
            raise SystemExit(1)
    if all(medians.values()):
        for buffer, ms in medians.items():
            print(f"TORCH_FR_BUFFER_SIZE={buffer:<5} step {statistics.median(ms):.1f} ms, the "
                  f"median of {len(ms)} launches; spread {min(ms):.1f}..{max(ms):.1f} ms")
        on, off = medians["2000"], medians["0"]
        ratio = statistics.median(on) / statistics.median(off)
        apart = min(on) > max(off) or max(on) < min(off)
        paired = [a / b for a, b in zip(on, off)]  # a round's two launches, side by side
        print(f"recorder on / off: {ratio:.3f}x (each round's {min(paired):.3f}..{max(paired):.3f}"
              "x): " + ("one launch a setting, too few to tell" if len(on) < 2 or len(off) < 2
                        else f"the recorder costs {ratio - 1:+.1%}" if apart
                        else "the spreads overlap, within the noise of this box"))


if __name__ == "__main__":
    main()
