"""Not a lesson: lesson 1's (ZeRO) measurement, the sharding ledger's ZeRO rows.

The sharding ledger's rows without FSDP (ledger.py): DDP (stage 06), ZeRO-1 (06 +
ShardedOptimizer), ZeRO-2 (Zero2DDP) and torch's ZeroRedundancyOptimizer, and the compute-only
control (``none``), bytes counted beside the formulas and the step time, to
results/sharding.csv. ``bench_fsdp.py`` runs all six and the control.

    python 07_parallelism/measure/bench_zero.py --bench
"""

import bench_fsdp  # this folder is on the path: Python puts a script's folder there
import ledger


def bench_main(ctx, args) -> None:
    ledger.run_ledger(ctx, [row for row in ledger.strategies() if "fsdp" not in row[0]], args)


def main(argv=None) -> None:
    bench_fsdp.main(argv, __doc__, bench_main, profile=False)


if __name__ == "__main__":
    main()
