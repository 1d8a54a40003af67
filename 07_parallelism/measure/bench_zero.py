"""Not a lesson: lesson 1's (ZeRO) measurement, the sharding ledger's ZeRO rows.

The sharding ledger's rows without FSDP (ledger.py): DDP (stage 06), ZeRO-1 (06 +
ShardedOptimizer), ZeRO-2 (Zero2DDP) and torch's ZeroRedundancyOptimizer, and the compute-only
control (``none``), bytes counted beside the formulas and the step time, to
results/sharding.csv. ``bench_fsdp.py`` runs all six and the control.

    python 07_parallelism/measure/bench_zero.py --bench
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: common/

import ledger  # noqa: E402 (this folder is on the path: Python puts a script's folder there)
from bench import step_bench  # noqa: E402
from bench import supervisor as launch


def bench_main(ctx, args) -> None:
    zero_rows = []
    for impl, build in ledger.strategies():
        if "fsdp" not in impl:
            zero_rows.append((impl, build))
    ledger.run_ledger(ctx, zero_rows, args)


def main(argv=None) -> None:
    parser = launch.make_parser(__doc__)
    ledger.add_ledger_args(parser)
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    step_bench.check_step_bench_args(args, config)  # batch, memory, results/: one line, exit 2
    launch.launch(bench_main, config, args)


if __name__ == "__main__":
    main()
