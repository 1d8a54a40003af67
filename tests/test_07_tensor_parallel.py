"""Stage 07, tensor and sequence parallelism, in one launch of 4 ranks: both MLP variants
against the single-process MLP on awkward shapes, bytes counted beside predicted; the
Transformer block in TP and TP + SP at t = 4 (the world) and t = 2 (two groups of 2 side by
side) against the block on one process (output, input gradient, every parameter gradient),
bytes per layer and saved activations beside their formulas, torch's parallelize_module on the
same block; and each check beside a planted bug it must catch. Then bad input. The script
itself runs in tests/test_bench.py's end-to-end run."""

import pytest
import torch
import torch.distributed as dist

import run_tensor_parallel as run_tp
import tensor_parallel as tp
from common import launch
from helpers import assert_main_usage_error

BLOCK = {"d_model": 16, "d_ff": 32, "heads": 4, "batch": 2, "seq": 8}
MLP_PARAMS = ["output", "input.grad", "fc1.weight.grad", "fc1.bias.grad", "fc2.weight.grad",
              "fc2.bias.grad"]


def expect_pass(failures, what):
    assert not failures, f"{what}:\n  " + "\n  ".join(failures)


def expect_caught(failures, what, needle, absent=None):
    """A planted bug: the check must fail on every rank alike (``agree`` merged the verdicts),
    naming ``needle``, and not ``absent`` (what the bug leaves right)."""
    assert any(needle in failure for failure in failures), f"{what} not caught: {failures}"
    if absent is not None:
        assert not any(absent in failure for failure in failures), (what, failures)


def patched(owner, name, replacement, run):
    original = owner.__dict__[name]
    setattr(owner, name, replacement)
    try:
        return run()
    finally:
        setattr(owner, name, original)


def no_all_reduce_backward(ctx, grad):
    return grad, None  # f without its all-reduce: each rank keeps its partial dX


def slices_instead_of_reduce_scatter(ctx, grad):
    rank = dist.get_rank(ctx.group)
    world_size = dist.get_world_size(ctx.group)
    return run_tp.my_tokens(grad, rank, world_size).contiguous(), None  # partial dX, not summed


def all_reduce_then_slice(ctx, partial, group):
    ctx.group = group
    full = partial.contiguous().clone()
    dist.all_reduce(full, group=group)  # right values, twice the bytes a reduce-scatter needs
    return run_tp.my_tokens(full, dist.get_rank(group), dist.get_world_size(group)).contiguous()


def block_failures(ctx, group, **options):
    return run_tp.agree(run_tp.check_block(ctx, BLOCK, group, with_torch=False,
                                           **options)["failures"])


def tp_worker(ctx):
    # (d_model, d_ff, batch, seq): awkward batch/seq sizes on purpose; widths divide by 4
    for d_model, d_ff, batch, seq in [(16, 64, 3, 5), (32, 48, 2, 7)]:
        cfg = {"d_model": d_model, "d_ff": d_ff, "batch": batch, "seq": seq,
               "variants": list(tp.VARIANTS)}
        checks, byte_rows, failures = run_tp.check_mlp(ctx, cfg)
        expect_pass(run_tp.agree(failures), f"MLP {cfg}")
        for variant in tp.VARIANTS:
            assert [r["checked"] for r in checks if r["variant"] == variant] == MLP_PARAMS
        assert len(byte_rows) == 8 and all(r["bytes_counted"] == r["bytes_predicted"]
                                           for r in byte_rows)
        model = tp.TensorParallelMLP(tp.MLP(d_model, d_ff))
        assert model.fc1.weight.shape == (d_ff // ctx.world_size, d_model)  # 1/t each
        assert model.fc2.weight.shape == (d_model, d_ff // ctx.world_size)
    cfg["variants"] = ["megatron"]
    failures = patched(tp.CopyToTensorParallel, "backward", staticmethod(no_all_reduce_backward),
                       lambda: run_tp.agree(run_tp.check_mlp(ctx, cfg)[2]))
    expect_caught(failures, "f without its all-reduce", "input.grad", absent="output")

    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for group, t in ((None, 4), (halves[ctx.rank // 2], 2)):
        result = run_tp.check_block(ctx, BLOCK, group)
        expect_pass(run_tp.agree(result["failures"]), f"block at t={t}")
        checked = [(r["block"], r["checked"]) for r in result["checks"]]
        assert ("TP + SP", "norm2.weight.grad") in checked
        assert ("torch TP + SP", "output") in checked
        assert len(checked) == 2 * 12 + 2, checked  # 10 parameters + output + input, twice
        saved = {r["block"]: r for r in result["saved"]}
        assert saved["TP + SP"]["layernorms"] * t == saved["TP"]["layernorms"]  # 1/t with SP
        assert saved["TP + SP"]["rest"] == saved["TP"]["rest"]
        assert saved["torch TP + SP"]["total"] == saved["TP + SP"]["total"]
        totals = {(r["block"], r["phase"]): r for r in run_tp.block_totals_table(result, t)}
        for phase in ("forward", "backward"):
            sent = [totals[(block, phase)]["ring bytes sent per rank"]
                    for block in ("TP", "TP + SP", "torch TP + SP")]
            assert sent[0] == sent[1] == sent[2] > 0, (phase, sent)

    group = halves[ctx.rank // 2]
    expect_caught(block_failures(ctx, group, reduce_replicated=False),
                  "LayerNorm gradients not all-reduced over the TP group",
                  "TP + SP norm1.weight.grad", absent="TP norm1.weight.grad")
    failures = patched(tp.GatherFromSequenceParallel, "backward",
                       staticmethod(slices_instead_of_reduce_scatter),
                       lambda: block_failures(ctx, group))
    expect_caught(failures, "the all-gather's backward slicing instead of reduce-scattering",
                  "TP + SP input.grad", absent="TP + SP output")
    failures = patched(tp.ReduceScatterToSequenceParallel, "forward",
                       staticmethod(all_reduce_then_slice), lambda: block_failures(ctx, group))
    expect_caught(failures, "an all-reduce where a reduce-scatter will do (right values)",
                  "predicted reduce_scatter", absent="max abs diff")


def test_mlp_and_block_at_world_size_4_with_planted_bugs():
    launch.launch(tp_worker, launch.LaunchConfig(4, "gloo", "cpu"), timeout_s=240)


def test_predicted_bytes():
    tokens, d, ff = 10, 8, 32
    megatron = tp.predicted_comm("megatron", tokens, d, ff)
    allgather = tp.predicted_comm("allgather", tokens, d, ff)
    # Megatron: one all-reduce of tokens x d_model forward (g) and one backward (f).
    assert sum(b for _, b in megatron.values()) == 2 * tokens * d * 4
    assert megatron[("fc2", "forward")] == ("all_reduce", tokens * d * 4)
    # The all-gather variant also moves the d_ff-wide activation, forward and backward.
    assert sum(b for _, b in allgather.values()) == 2 * tokens * (d + ff) * 4
    # A block: 4 all-reduces (TP) or 4 all-gathers + 4 reduce-scatters (SP) of tokens x d_model.
    plain = tp.predicted_block_comm(tokens, d, sequence_parallel=False)
    sequence = tp.predicted_block_comm(tokens, d, sequence_parallel=True)
    assert sorted(op for op, b in plain.values() if b) == ["all_reduce"] * 4
    assert sorted(op for op, _ in sequence.values()) == ["all_gather"] * 4 + ["reduce_scatter"] * 4
    assert sum(b for _, b in sequence.values()) == 2 * sum(b for _, b in plain.values())


def test_formula_of_saved_activations():
    cfg = {"batch": 2, "seq": 8, "d_model": 16, "d_ff": 64, "heads": 4}
    one = sum(run_tp.saved_formula(cfg, 1, False))
    b, s, h, f, a = 2, 8, 16, 64, 4  # one process: 8 bsh + 2 bsf + 4 bs + abs floats
    assert one == 4 * (8 * b * s * h + 2 * b * s * f + 4 * b * s + a * b * s)
    plain = run_tp.saved_formula(cfg, 4, False)
    sequence = run_tp.saved_formula(cfg, 4, True)
    assert sequence[0] * 4 == plain[0] and sequence[1] == plain[1]


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
    assert_main_usage_error(run_tp.main, [*argv, "--backend", "gloo", "--device", "cpu"], capsys,
                            needle)
