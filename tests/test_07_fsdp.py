"""Stage 07, lesson 2: FSDP (07_parallelism/02_fsdp/fsdp.py) against single-process training,
what it sends and when, and the ledger.

The checks live in tests/checks_fsdp.py and run in one launch per world size (``launch_07``,
shared with tests/test_07_zero.py, whose ZeRO cases run in it too); one test per (case, world
size) reads their verdicts, reached on every rank. Negative controls in the same launch: an
FSDP that reduce-scatters in the compute dtype, one whose backward prefetches two units ahead,
and one that forgets to average the reduced gradients; each must make its check fail. The
measurement's flags are tested in-process; the demo, ``run_fsdp.py``, runs as a learner runs it (a subprocess).
"""

from __future__ import annotations

import pytest
import torch

import bench_fsdp
import fsdp as fsdp_mod
from checks_fsdp import IMPLS, launch_07, run_demo, tiny_lm
from helpers import REPO, assert_main_usage_error

DEMO = REPO / "07_parallelism" / "02_fsdp" / "run_fsdp.py"

@pytest.fixture
def findings(tmp_path):
    def at(world_size):
        return launch_07(world_size, tmp_path)
    return at


CASES_ALL = ["counter_calls", "norm_toy_sgd", "norm_toy_memory_after_step", "norm_toy_adamw", "toy_sgd",
             "toy_memory_after_step", "toy_adamw", "tied_layer_sgd", "tied_layer_memory_after_step",
             "tied_layer_adamw", "sum_not_mean_is_caught", "lm_per_block_adamw", "lm_memory_after_step",
             "lm_peak_gathered_is_the_largest_unit", "norm_toy_bfloat16", "norm_toy_float16",
             "mixed_precision_reduces_in_float32", "reduce_in_bfloat16_is_caught", "prefetch_order",
             "prefetch_two_ahead_is_caught"]
CASES_TWO = ["tied_lm_sgd", "tied_lm_memory_after_step", "lm_bfloat16", "lm_float16",
             "gradient_accumulation", "checkpointing_equals_plain",
             "checkpointing_gathers_once", "gathered_weights_told_apart", "ddp_classes_with_checkpointing",
             "profile_shows_collectives_during_backward", "ledger_rows",
             "ledger_fsdp_peak", "ledger_checkpointing_saves_activations", "ledger_csv",
             "ledger_targets_printed", "ledger_targets_one_rank", "ledger_control_optimizer_timed"]
for impl in IMPLS:
    CASES_TWO += [f"ledger_{impl}_off_bytes_held", f"ledger_{impl}_off_bytes_sent", f"ledger_{impl}_off_activations"]
CASES_TWO += ["ledger_fsdp_on_bytes_held", "ledger_fsdp_on_bytes_sent"]


@pytest.mark.parametrize("world_size, case", [(2, c) for c in CASES_ALL + CASES_TWO]
                         + [(3, c) for c in CASES_ALL])
def test_fsdp(findings, world_size, case):
    found = findings(world_size)
    assert case in found, f"{case} was not checked at world size {world_size}"
    ok, detail = found[case]
    assert ok, f"{case} at world size {world_size}: {detail}"


def test_bench_flags_one_line(capsys, tmp_path, monkeypatch):
    # the measurement's flags (bench_fsdp.py) and its up-front checks: one line, exit 2, no
    # worker started
    for argv, needle in ((["--world-size", "0"], "--world-size"), (["--steps", "0"], "'0' is not a whole number"),
                         (["--backend", "nccl", "--device", "cpu"], "--backend nccl needs"),  # no pair carries
                         (["--rounds", "nan"], "'nan' is not a whole number"), (["--model", "huge"], "'huge'"),
                         (["--checkpointing", "maybe"], "'maybe' is not allowed"),
                         (["--checkpointing", ","], "subset of off, on"),
                         (["--bench", "--batch-size", "3"], "--batch-size 3 is not divisible"),
                         (["--profile", "--batch-size", "3"], "--batch-size 3 is not divisible"),
                         (["--bench", "--model", "2.7B", "--batch-size", "2", "--context-length", "100000"],
                          "GiB")):
        ranks = [] if argv[0] == "--world-size" else ["--world-size", "2"]
        where = [] if "--backend" in argv else ["--backend", "gloo", "--device", "cpu"]
        assert_main_usage_error(bench_fsdp.main, [*argv, *ranks, *where], capsys, needle)
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("RESULTS_DIR", str(tmp_path / "a_file"))
    assert_main_usage_error(bench_fsdp.main, ["--bench", "--world-size", "2", "--backend", "gloo", "--device",
                                              "cpu"], capsys, "cannot write results")


def test_units_plan():
    """Named units take the weights below them; the rest get a unit per owner; a weight shared
    by two units merges them (the tied embedding and output layer)."""
    lm = tiny_lm(tied=True)
    plan = fsdp_mod.plan_units(lm, list(lm.blocks))
    roots = [[type(r).__name__ for r in roots] for roots, _ in plan]
    assert roots == [["Embedding", "Linear"], ["Embedding"], ["Block"], ["Block"]], roots
    assert [len(slots) for _, slots in plan] == [2, 1, 4, 4]
    flat = torch.arange(10.0)  # copy_rows: a 5 x 2 tensor over 3 ranks, k = 2 rows each
    shards = torch.zeros(3, 4)
    fsdp_mod.copy_rows(flat, shards, into_blocks=True)
    assert shards.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 0]]
    back = torch.zeros(10)
    fsdp_mod.copy_rows(back, shards, into_blocks=False)
    assert torch.equal(back, flat)
    flat = torch.arange(12.0)  # a 6 x 2 tensor over 3 ranks: no padding, no partial block
    shards = torch.zeros(3, 4)
    fsdp_mod.copy_rows(flat, shards, into_blocks=True)
    assert torch.equal(shards.flatten(), flat)


def test_run_fsdp_demo():
    """The demo as a learner runs it: the tied tiny LM against one process, on the device it
    names (here the CPU), every check passed; a flag it does not take refused in one line."""
    where = ["--backend", "gloo", "--device", "cpu"]
    done, unknown = run_demo(DEMO, ["--world-size", "2", *where], ["--profile", *where])
    assert done.returncode == 0, done.stdout + done.stderr
    for line in ("FSDP vs one process, tiny LM in 4 units, 2 ranks (gloo, tensors on cpu)",
                 "allclose, and bitwise equal across ranks", "[rank 0] all checks passed"):
        assert line in done.stdout, done.stdout
    says = "run_fsdp.py: error: unrecognized arguments: --profile"
    assert unknown.returncode == 2 and says in unknown.stderr, unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1, unknown.stderr
