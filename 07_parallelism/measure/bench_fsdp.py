"""Not a lesson: lesson 2's (FSDP) measurements, the sharding ledger and a profile.

``--bench``: the sharding ledger (ledger.py), all six ways to train the LM (DDP, ZeRO-1/2, our
FSDP, torch's ZeroRedundancyOptimizer and fully_shard) and the compute-only control, bytes
counted beside the formulas and the step time, to results/sharding.csv. ``--profile``: one
step of FSDP (a unit per block) in stage 05's timeline: the all-gathers run while blocks compute.

    python 07_parallelism/measure/bench_fsdp.py --bench
    python 07_parallelism/measure/bench_fsdp.py --profile
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: common/

import ledger  # noqa: E402 (this folder is on the path: Python puts a script's folder there)
from common import import_stage  # noqa: E402
from bench import profiling, step_bench
from bench import supervisor as launch


def fsdp_per_block(model):
    """Our FSDP with a unit per Transformer block, as the demo wraps it."""
    fsdp = import_stage("07_parallelism/02_fsdp/fsdp")
    return fsdp.FSDP(model, units=list(model.blocks))


def bench_main(ctx, args) -> None:
    if args.profile:
        profiling.profile_ddp(ctx, [("fsdp (07)", fsdp_per_block)], args, name="07_fsdp")
    else:
        ledger.run_ledger(ctx, ledger.strategies(), args)  # the control and all six, in one run


def main(argv=None, doc=__doc__, worker=bench_main, profile=True) -> None:  # bench_zero's too
    parser = launch.make_parser(doc)
    ledger.add_ledger_args(parser)
    if profile:
        profiling.add_profile_args(parser)
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    step_bench.check_step_bench_args(args, config)  # batch, memory, results/: one line, exit 2
    launch.launch(worker, config, args)


if __name__ == "__main__":
    main()
