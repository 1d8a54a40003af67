"""Proof of overlap (make bench's "profile" step): torch.profiler traces of a few LM training
steps per rank, NaiveDDP (03) above OverlapDDP (05) by default, with a timeline of compute and
communication (bench/profiling.py), rows in results/ddp_profile.csv.

    python bench/profile_ddp.py --world-size 2 --stage 05 --trace-dir traces
    python bench/profile_ddp.py --stage 06 --bucket-size-mb 25   # NaiveDDP above BucketedDDP
"""

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import profiling, step_bench  # noqa: E402

from bench import supervisor as launch
from common import import_stage  # noqa: E402

STAGES = {"03": "03_naive_ddp", "05": "05_overlap_ddp", "06": "06_bucketed_ddp"}


def profile_main(ctx, args) -> list[dict]:
    cases = [("naive (03)", import_stage("03_naive_ddp/naive_ddp").NaiveDDP)]
    if args.stage == "05":
        cases.append(("overlap (05)", import_stage("05_overlap_ddp/overlap_ddp").OverlapDDP))
    if args.stage == "06":
        bucketed = import_stage("06_bucketed_ddp/bucketed_ddp").BucketedDDP
        cases.append((f"bucketed (06, {args.bucket_size_mb:g} MB)",
                      functools.partial(bucketed, bucket_size_mb=args.bucket_size_mb)))
    return profiling.profile_ddp(ctx, cases, args, name=STAGES[args.stage])


def main(argv=None) -> None:
    parser = launch.make_parser(__doc__)
    parser.add_argument("--stage", choices=list(STAGES), default="05",
                        help="03: NaiveDDP alone; 05: above OverlapDDP; 06: above BucketedDDP")
    parser.add_argument("--bucket-size-mb", type=launch.positive_float, default=25.0,
                        help="BucketedDDP's cap with --stage 06")
    step_bench.add_step_bench_args(parser)
    profiling.add_profile_args(parser)
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    step_bench.check_step_bench_args(args, config)
    launch.launch(profile_main, config, args)


if __name__ == "__main__":
    main()
