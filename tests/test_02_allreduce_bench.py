"""Stage 02: the arithmetic and the fit (no process), the check that can fail, the course's
sweep and the lab's skips with their reasons (one launch), the backend picked under a faked
two-node torchrun, and bad input. make bench's sweep from the command line (bench/
allreduce_sweep.py: rows, fit, plot) runs in tests/test_bench.py's end-to-end run."""

import argparse
import json
import os
import time

import pytest
import torch

import allreduce_bench as bench
from bench import allreduce_sweep
from bench import supervisor as launch
from common import import_stage
from helpers import assert_main_usage_error

KB, MB, GB = 2**10, 2**20, 2**30


def test_sizes_are_binary_and_must_be_whole_floats():
    assert bench.parse_size("1MB") == MB and bench.parse_size("64KB") == 64 * KB
    assert bench.parse_size("1GB") == GB and bench.parse_size("1.5mb") == 3 * MB // 2
    assert bench.parse_size("4100") == bench.parse_size("4100B") == 4100
    assert [bench.format_size(n) for n in (64 * KB, MB, 10 * MB, 3 * GB // 2, 12)] == \
        ["64KB", "1MB", "10MB", "1.5GB", "12B"]
    for bad in ["12XB", "MB", "", "-1MB", "0KB", "6B", "1.0000001KB"]:
        with pytest.raises(ValueError):
            bench.parse_size(bad)


def test_algbw_and_busbw_on_known_numbers():
    assert bench.algbw(10**9, 1.0) == pytest.approx(1.0)          # GB/s are 10^9 B/s
    assert bench.algbw(MB, 1e-3) == pytest.approx(1.048576)       # 1 MB (2^20 B) in 1 ms
    assert bench.busbw(1.0, 2) == pytest.approx(1.0)              # 2(n-1)/n = 1 for n = 2
    assert bench.busbw(1.0, 4) == pytest.approx(1.5)
    assert bench.busbw(2.0, 6) == pytest.approx(2.0 * 10 / 6)


def test_fit_recovers_latency_and_bandwidth_per_group():
    a, w = 250e-6, 1.7e9
    sizes = [MB, 10 * MB, 100 * MB, GB]
    fa, fw = bench.fit_latency_bandwidth(sizes, [a + n / w for n in sizes])
    assert fa == pytest.approx(a, rel=0.01) and fw == pytest.approx(w, rel=0.01)
    noisy = [(a + n / w) * (1 + 0.003 * (-1) ** i) for i, n in enumerate(sizes)]
    assert bench.fit_latency_bandwidth(sizes, noisy)[1] == pytest.approx(w, rel=0.01)
    with pytest.raises(ValueError):
        bench.fit_latency_bandwidth([MB, MB], [1e-3, 1e-3])
    rows = [{"backend": "gloo", "device": "cpu", "world_size": str(ws), "bytes": str(n),
             "impl": impl, "run_id": "r", "time_ms_median": str(slow * (a_ + n / w_) * 1e3)}
            for ws, (a_, w_) in {2: (1e-4, 1e9), 4: (3e-4, 5e8)}.items()
            for n in (KB, MB, 8 * MB) for impl, slow in (("backend", 1.0), ("ring", 1.5))]
    fits = allreduce_sweep.fits_of(rows)  # the backend's rows only, one fit per backend/device/ws
    assert set(fits) == {"gloo/cpu/2", "gloo/cpu/4"}
    f = fits["gloo/cpu/4"]
    assert (f["a_s"], f["w_bytes_per_s"]) == (pytest.approx(3e-4, rel=1e-3), pytest.approx(5e8, rel=1e-3))
    assert [p["bytes"] for p in f["points"]] == [KB, MB, 8 * MB]
    assert all(abs(p["rel_error"]) < 1e-6 for p in f["points"])
    json.dumps(fits)


def checks_and_skips_worker(ctx):
    """The check can fail; the skips say why; an impl that does not sum fails the run, on
    every rank at once."""
    n, rank = ctx.world_size, ctx.rank
    buf = torch.empty(4100 // 4)
    bench.fill(buf, rank)  # buf[i] = i % 7 + rank, against the sum (i % 7) n + n (n - 1) / 2:
    error = bench.check(buf, n)  # before the all-reduce: off by 6 (n - 1) + n (n - 1) / 2 - rank
    want = 6 * (n - 1) + n * (n - 1) / 2 - rank
    assert error == want, f"rank {rank}: check() before the all-reduce: {error}, want {want}"
    args = argparse.Namespace(warmup=1, iters=3, budget_s=30.0, sizes=[4100, 12348], no_ring=False)
    # the budget, scaled from the last size: 1 ms at 4 KB is 2^28 ms (3 days) a call at 1 TB,
    # x 5 calls (the checked one, a warm-up, 3 timed): skipped, and no terabyte is allocated
    previous = {"bytes": 4 * KB, "time_ms_median": 1.0}
    why = allreduce_sweep.skip_reason(ctx, "backend", 2**40, previous, args)
    assert why == "estimated 1342177 s from 4KB: over the 30 s budget", why
    why = allreduce_sweep.skip_reason(ctx, "backend", 2**50, None, args)  # memory, agreed
    assert why and "host memory" in why
    row = bench.measure(ctx, "backend", torch.distributed.all_reduce, 4100, 1, 3)
    seconds = row["time_ms_median"] / 1e3  # the slowest rank's median: the same everywhere
    assert (row["bytes"], row["impl"], row["world_size"]) == (4100, "backend", n), row
    assert row["busbw_gbps"] == pytest.approx(bench.busbw(bench.algbw(4100, seconds), n)), row
    assert row["time_ms_min"] <= row["time_ms_median"] <= row["time_ms_max"], row
    with pytest.raises(AssertionError, match=r"doubler all-reduce of 4KB gave a wrong sum: "
                                             r"max \|sum - expected\| = "):
        bench.measure(ctx, "doubler", lambda t: t.mul_(2), 4 * KB, 1, 3)
    # make bench's deadline for the step: a size whose estimate passes it is skipped, said why
    os.environ["BENCH_STEP_DEADLINE"] = str(time.time() - 1)
    try:
        why = allreduce_sweep.skip_reason(ctx, "backend", 8 * KB, previous, args)
    finally:
        del os.environ["BENCH_STEP_DEADLINE"]
    assert why and why.endswith("is left before make bench stops this step"), why
    # the course's sweep, its table and fit (rank 0), then --check (make check): exact sums
    # of every impl, and a broken ring caught
    bench.sweep_worker(ctx, argparse.Namespace(**{**vars(args), "iters": 2, "sizes": [4100, 8192]}))
    bench.check_worker(ctx, args)
    stage01 = import_stage("01_collectives/collectives")
    ring = stage01.ring_all_reduce
    stage01.ring_all_reduce = lambda t, group=None: t.mul_(2)  # planted: no sum at all
    try:
        with pytest.raises(AssertionError, match=r"ring all-reduce of 4KB gave a wrong sum"):
            bench.check_worker(ctx, args)
    finally:
        stage01.ring_all_reduce = ring


def test_checks_and_skips():
    launch.launch(checks_and_skips_worker, launch.LaunchConfig(3, "gloo", "cpu"), timeout_s=120)


def test_two_nodes_of_8_gpus_default_to_nccl(monkeypatch):
    """Issue 45 item 9: under torchrun on 2 nodes x 8 GPUs, WORLD_SIZE is 16 but each node
    runs 8 ranks on its 8 GPUs: NCCL is the default and --backend nccl is accepted (stage 02
    used to set the 16 against the node's 8 GPUs, picking Gloo and refusing NCCL)."""
    monkeypatch.setenv("RANK", "9")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    for argv in ([], ["--backend", "nccl"], ["--backend", "nccl", "--device", "cuda"]):
        configs = bench.configurations(bench.make_parser().parse_args(argv))
        assert configs == [launch.LaunchConfig(16, "nccl", "cuda")], (argv, configs)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # control: 16 ranks on a node of 8 GPUs
    configs = bench.configurations(bench.make_parser().parse_args([]))
    assert configs == [launch.LaunchConfig(16, "gloo", "cuda")], configs


@pytest.mark.parametrize("main, argv, needle", [
    (bench.main, ["--sizes", "1MB,12XB"], "12XB"),
    (bench.main, ["--sizes", "6B"], "6B"),
    (bench.main, ["--sizes", ","], "empty list"),
    (bench.main, ["--world-sizes", "two"], "'two'"),
    (bench.main, ["--iters", "0"], "'0' is not a whole number >= 1"),
    (bench.main, ["--backend", "mpi"], "invalid choice: 'mpi'"),
    (bench.main, ["--backend", "nccl", "--device", "cuda"], "cuda"),
    (bench.main, ["--device", "cuda"], "cuda"),
    (allreduce_sweep.main, ["--world-sizes", "1000"], "1000 ranks need about"),
    (allreduce_sweep.main, ["--budget-s", "nan"], "'nan' is not a finite number > 0"),
    (allreduce_sweep.main, ["--budget-s", "inf"], "'inf' is not a finite number > 0"),
])
def test_bad_input_exits_2_with_one_line(main, argv, needle, capsys):
    if torch.cuda.is_available() and "cuda" in argv:
        pytest.skip("this box can run CUDA")
    assert_main_usage_error(main, argv, capsys, needle)
