"""Stage 07, lesson 1: ZeRO-1 (ShardedOptimizer) and ZeRO-2 (Zero2DDP) against one process.

Every training case (tests/checks_zero.py: ``train_and_compare``, 10 AdamW steps, the LM 3, two
param groups with their own options, beside plain AdamW on one process, bitwise equal across
ranks) runs in stage 07's one launch per world size (``checks_fsdp.launch_07``, which also runs
FSDP's cases and the ledger that sets these beside DDP and FSDP); each case's verdict is
reached on every rank and read by one test here. The checkpoint cases also resume: the
consolidated state dict goes on in plain AdamW, and (``ShardedOptimizer.load_state_dict``) in a
ShardedOptimizer at another world size; a plain AdamW's state dict goes on in a
ShardedOptimizer. Bad input is tested in-process; the demo, ``run_zero.py``, runs as a learner
runs it (a subprocess); tests/test_copy_one_file.py trains from the lone file.
"""

from __future__ import annotations

import pytest
import torch

import bench_zero
import zero
from checks_fsdp import launch_07, run_demo
from checks_zero import all_case_names
from helpers import REPO, assert_main_usage_error

DEMO = REPO / "07_parallelism" / "01_zero" / "run_zero.py"

@pytest.fixture
def findings(tmp_path):
    def at(world_size):
        return launch_07(world_size, tmp_path)
    return at


@pytest.mark.parametrize("world_size, case", [(2, name) for name in all_case_names(2)]
                         + [(3, name) for name in all_case_names(3)])
def test_zero_against_one_process(findings, world_size, case):
    found = findings(world_size)
    assert case in found, f"{case} was not checked at world size {world_size}"
    ok, detail = found[case]
    assert ok, f"{case} at world size {world_size}: {detail}"

# --------------------------------------------------------------------------- no process group


def test_owners_balanced_and_buckets_ordered():
    sizes = [7, 300, 5, 64, 64, 1, 128, 90, 33, 2]
    params = [torch.zeros(size, requires_grad=True) for size in sizes]
    params.append(torch.zeros(1000))  # frozen: weighs nothing
    for world_size in (2, 3, 4):
        loads = [0] * world_size
        owner = zero.assign_owners(params, loads)
        assert sum(loads) == 4 * sum(sizes) and len(owner) == len(params)
        assert max(loads) - sum(loads) / world_size <= 4 * max(sizes)
        for rank in range(world_size):
            owned = [param for param in params if owner[param] == rank and param.requires_grad]
            assert loads[rank] == sum(4 * param.numel() for param in owned)
        buckets = zero.owner_buckets(params[:-1], owner, bucket_size_mb=400 / 2**20)
        assert sorted(id(p) for bucket in buckets for p in bucket.params) == sorted(map(id, params[:-1]))
        for bucket in buckets:
            assert {owner[param] for param in bucket.params} == {bucket.owner}
            assert len(bucket.params) == 1 or sum(4 * param.numel() for param in bucket.params) <= 400
        # launch order = completion order: by the position (in reverse) of the last parameter
        position = {id(param): len(params) - 2 - i for i, param in enumerate(params[:-1])}
        last = [max(position[id(param)] for param in bucket.params) for bucket in buckets]
        assert last == sorted(last)
    # the deal itself, at 3 ranks, largest first to the lightest rank: 300 -> 0, 128 -> 1,
    # 90 -> 2, 64 -> 2, 64 -> 1, 33 -> 2, 7 -> 2, 5 -> 1, 2 -> 2, 1 -> 2, the frozen one -> 1
    loads = [0, 0, 0]
    owner = zero.assign_owners(params, loads)
    assert [owner[param] for param in params] == [2, 0, 1, 2, 1, 2, 1, 2, 2, 2, 1]
    assert loads == [4 * 300, 4 * (128 + 64 + 5), 4 * (90 + 64 + 33 + 7 + 2 + 1)]


def test_bench_flags_one_line(capsys):
    """The ledger's flags (measure/bench_zero.py): one line, exit 2, no worker started."""
    for argv, says in ((["--world-size", "0"], "'0' is not a whole number >= 1"),
                       (["--world-size", "nan"], "'nan' is not a whole number >= 1"),
                       (["--bench", "--batch-size", "3"], "not divisible by world size 2")):
        assert_main_usage_error(bench_zero.main, [*argv, "--backend", "gloo", "--device", "cpu"],
                                capsys, says)


# --------------------------------------------------------------------------- the demo


def test_run_zero_demo():
    """The demo as a learner runs it: both ways against one process, on the device it names
    (here the CPU), every check passed; a flag it does not take refused in one line (exit 2)."""
    where = ["--backend", "gloo", "--device", "cpu"]
    done, unknown = run_demo(DEMO, ["--world-size", "2", *where], ["--bench", *where])
    assert done.returncode == 0, done.stdout + done.stderr
    for line in ("2 ranks (gloo, tensors on cpu) vs AdamW on one process",
                 "ZeRO-1, BucketedDDP (06) + ShardedOptimizer: max |diff|",
                 "[rank 0] all checks passed"):
        assert line in done.stdout, done.stdout
    assert done.stdout.count("resumed bitwise: True") == 2, done.stdout
    says = "run_zero.py: error: unrecognized arguments: --bench"
    assert unknown.returncode == 2 and says in unknown.stderr, unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1, unknown.stderr
