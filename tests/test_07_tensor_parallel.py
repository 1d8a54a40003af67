"""Stage 07, tensor and sequence parallelism. One launch of 4 ranks runs every check of
tests/checks_tensor_parallel.py beside the planted bugs it must catch (both MLP variants and
the block at t = 4 and t = 2 against one process, bytes and saved activations beside their
formulas, torch's parallelize_module, the rows written as each configuration lands). Then the
formulas on their own, the demo as a learner runs it (a subprocess), torch's control left out
on Gloo with CUDA tensors, and the measurement's bad input."""

import pytest

import bench_tensor_parallel as bench
import checks_tensor_parallel as checks
from bench import supervisor as launch
from common.launch import carries_point_to_point
from helpers import REPO, assert_main_usage_error, run_script

DEMO = REPO / "07_parallelism/03_tensor_parallel/run_tensor_parallel.py"


def test_mlp_and_block_at_world_size_4_with_planted_bugs():
    launch.launch(checks.check_everything, launch.LaunchConfig(4, "gloo", "cpu"), timeout_s=240)


def test_predicted_bytes():
    tokens, d, ff = 10, 8, 32
    megatron = bench.predicted_comm("megatron", tokens, d, ff)
    allgather = bench.predicted_comm("allgather", tokens, d, ff)
    # Megatron: one all-reduce of tokens x d_model forward (g) and one backward (f).
    assert sum(b for _, b in megatron.values()) == 2 * tokens * d * 4
    assert megatron[("fc2", "forward")] == ("all_reduce", tokens * d * 4)
    # The all-gather variant also moves the d_ff-wide activation, forward and backward.
    assert sum(b for _, b in allgather.values()) == 2 * tokens * (d + ff) * 4
    # A block: 4 all-reduces (TP) or 4 all-gathers + 4 reduce-scatters (SP) of tokens x d_model.
    plain = bench.predicted_block_comm(tokens, d, sequence_parallel=False)
    sequence = bench.predicted_block_comm(tokens, d, sequence_parallel=True)
    assert sorted(op for op, b in plain.values() if b) == ["all_reduce"] * 4
    assert sorted(op for op, _ in sequence.values()) == ["all_gather"] * 4 + ["reduce_scatter"] * 4
    assert sum(b for _, b in sequence.values()) == 2 * sum(b for _, b in plain.values())
    # The replicated gradients: two LayerNorms' weight and bias and fc2's bias, with SP only.
    assert bench.predicted_replicated_grads(d, sequence_parallel=True) == 5 * d * 4
    assert bench.predicted_replicated_grads(d, sequence_parallel=False) == 0


def test_formula_of_saved_activations():
    cfg = {"batch": 2, "seq": 8, "d_model": 16, "d_ff": 64, "heads": 4}
    one = sum(bench.saved_formula(cfg, 1, False))
    b, s, h, f, a = 2, 8, 16, 64, 4  # one process: 8 bsh + 2 bsf + 4 bs + abs floats
    assert one == 4 * (8 * b * s * h + 2 * b * s * f + 4 * b * s + a * b * s)
    plain = bench.saved_formula(cfg, 4, False)
    sequence = bench.saved_formula(cfg, 4, True)
    assert sequence[0] * 4 == plain[0] and sequence[1] == plain[1]


def test_torch_control_left_out_where_the_pair_cannot_carry_it():
    """DTensor's coalesced collectives: never on Gloo with CUDA tensors (the one shared rule)."""
    assert not carries_point_to_point("gloo", "cuda")
    assert carries_point_to_point("gloo", "cpu") and carries_point_to_point("nccl", "cuda")


def test_demo_passes_as_make_07_runs_it():
    result = run_script(DEMO, "--backend", "gloo", "--device", "cpu", "--d-model", "32",
                        "--d-ff", "64", "--batch", "2", "--seq", "8")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all 38 checks passed on every rank" in result.stdout, result.stdout
    assert "block, torch TP + SP: 2/2 allclose" in result.stdout


@pytest.mark.parametrize("argv, needle", [
    (["--world-size", "4", "--d-ff", "250"], "--d-ff 250 is not divisible"),
    (["--world-size", "4", "--d-model", "30"], "--d-model 30 is not divisible"),
    (["--variants", ""], "is not allowed"),      # would check nothing and "pass"
    (["--variants", "megatron,ring"], "'ring' is not allowed"),
    (["--batch", "0"], "'0' is not a whole number >= 1"),
    (["--heads", "3"], "--d-model 64 is not divisible by --heads 3"),
    (["--world-size", "4", "--heads", "2", "--d-model", "64"], "--heads 2 is not divisible"),
    (["--world-size", "4", "--seq", "10"], "--seq 10 is not divisible by the world size 4"),
    (["--d-model", "1000000", "--d-ff", "1000000"], "host memory"),
])
def test_bad_input_one_line_exit_2(argv, needle, capsys):
    assert_main_usage_error(bench.main, [*argv, "--backend", "gloo", "--device", "cpu"], capsys, needle)
