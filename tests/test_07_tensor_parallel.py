"""Stage 07, tensor parallelism: both variants against the single-process MLP at world size 4
on awkward shapes, bytes counted beside predicted (one launch, everything asserted inside),
the check that cannot pass empty, and bad input. The script itself runs in
tests/test_bench.py's end-to-end run."""

import pytest

import tensor_parallel as tp
from common import launch
from helpers import assert_main_usage_error



def tp_worker(ctx):
    # (d_model, d_ff, batch, seq): awkward batch/seq sizes on purpose; widths divide by 4
    for d_model, d_ff, batch, seq in [(16, 64, 3, 5), (32, 48, 2, 7)]:
        cfg = {"d_model": d_model, "d_ff": d_ff, "batch": batch, "seq": seq}
        for variant in tp.VARIANTS:
            rows, counted = tp.check_variant(ctx, variant, cfg)
            bad = [(r["checked"], r["max_abs_diff"]) for r in rows if not r["ok"]]
            assert not bad, f"rank {ctx.rank} {variant} {cfg}: {bad}"
            assert [r["checked"] for r in rows] == ["output", "input.grad", "fc1.weight.grad",
                                                   "fc1.bias.grad", "fc2.weight.grad",
                                                   "fc2.bias.grad"]
            for (layer, phase), (op, nbytes) in tp.predicted_comm(variant, batch * seq,
                                                                  d_model, d_ff).items():
                got = counted.get(f"{layer} {phase}", {"ops": [], "payload_bytes": 0})
                assert got["payload_bytes"] == nbytes and got["ops"] == ([op] if nbytes else []), \
                    (variant, layer, phase, counted)
        model = tp.TensorParallelMLP(tp.MLP(d_model, d_ff))
        assert model.fc1.weight.shape == (d_ff // ctx.world_size, d_model)  # 1/n each
        assert model.fc2.weight.shape == (d_model, d_ff // ctx.world_size)


def test_outputs_gradients_and_bytes_at_world_size_4():
    launch.launch(tp_worker, launch.LaunchConfig(4, "gloo", "cpu"), timeout_s=120)


def test_predicted_bytes():
    tokens, d, ff = 10, 8, 32
    megatron = tp.predicted_comm("megatron", tokens, d, ff)
    allgather = tp.predicted_comm("allgather", tokens, d, ff)
    # Megatron: one all-reduce of tokens x d_model forward (g) and one backward (f).
    assert sum(b for _, b in megatron.values()) == 2 * tokens * d * 4
    assert megatron[("fc2", "forward")] == ("all_reduce", tokens * d * 4)
    # The all-gather variant also moves the d_ff-wide activation, forward and backward.
    assert sum(b for _, b in allgather.values()) == 2 * tokens * (d + ff) * 4


@pytest.mark.parametrize("argv, needle", [
    (["--world-size", "4", "--d-ff", "250"], "--d-ff 250 is not divisible"),
    (["--world-size", "4", "--d-model", "30"], "--d-model 30 is not divisible"),
    (["--variants", ""], "is not allowed"),      # would check nothing and "pass"
    (["--variants", "megatron,ring"], "'ring' is not allowed"),
    (["--batch", "0"], "'0' is not a whole number >= 1"),
])
def test_bad_input_one_line_exit_2(argv, needle, capsys):
    assert_main_usage_error(tp.main, [*argv, "--backend", "gloo", "--device", "cpu"], capsys,
                            needle)
