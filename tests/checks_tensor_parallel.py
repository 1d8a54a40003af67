"""Lesson 3's checks beside the bugs they must catch, run on every rank of one launch.

``check_everything(ctx)`` (4 ranks) runs the checks of ``07_parallelism/measure/
bench_tensor_parallel.py``: both MLP variants against the single-process MLP on awkward shapes,
bytes counted beside predicted; the Transformer block in TP and TP + SP at t = 4 (the world)
and t = 2 (two groups of 2 side by side) against the block on one process (output, input
gradient, every parameter gradient), bytes per layer and saved activations beside their
formulas, torch's parallelize_module on the same block; the rows written as each
configuration lands; and each check beside a planted bug it must catch. A planted bug replaces
an attribute of the ``tensor_parallel`` module (a subclass with the bug) inside the worker, for
the length of one check, and puts it back.
"""

import torch.distributed as dist

import bench_tensor_parallel as bench
import tensor_parallel as tp
from bench import results

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


def planted(name, buggy, run):
    """``run()`` with ``tensor_parallel.<name>`` replaced by ``buggy``; put back after."""
    original = getattr(tp, name)
    setattr(tp, name, buggy)
    try:
        return run()
    finally:
        setattr(tp, name, original)


# --------------------------------------------------------------------------- the planted bugs


class CopyWithoutAllReduce(tp.CopyToTensorParallel):
    """``f`` without its all-reduce: each rank keeps its partial dX."""

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherSlicingBackward(tp.GatherFromSequenceParallel):
    """The all-gather's backward slicing this rank's tokens instead of reduce-scattering:
    a partial dX, not summed."""

    @staticmethod
    def backward(ctx, grad):
        rank = dist.get_rank(ctx.group)
        world_size = dist.get_world_size(ctx.group)
        return bench.my_tokens(grad, rank, world_size).contiguous(), None


class AllReduceThenSlice(tp.ReduceScatterToSequenceParallel):
    """Right values, twice the bytes a reduce-scatter needs: all-reduce, then keep a slice."""

    @staticmethod
    def forward(ctx, partial, group):
        ctx.group = group
        full = partial.contiguous().clone()
        dist.all_reduce(full, group=group)
        rank = dist.get_rank(group)
        world_size = dist.get_world_size(group)
        return bench.my_tokens(full, rank, world_size).contiguous()


class BlockWithoutReplicatedGrads(tp.TensorParallelBlock):
    """The LayerNorms' (and fc2's bias) gradients left as this rank's partial sums."""

    def all_reduce_replicated_grads(self) -> None:
        return


# --------------------------------------------------------------------------- the launch


def block_failures(ctx, group):
    return bench.agree(bench.check_block(ctx, BLOCK, group, with_torch=False)["failures"])


def check_rows_land(ctx):
    """Rows are written as each configuration lands: after the first MLP variant its rows are
    in results/tensor_parallel.csv before the second runs; after TP, the one-process and TP
    rows of the block are in results/sequence_parallel.csv before TP + SP runs."""
    cfg = {**BLOCK, "variants": list(tp.VARIANTS)}
    landed = []

    def land_variant(ctx, cfg, result):
        bench.land_variant(ctx, cfg, result)
        landed.append(result["bytes"][0]["variant"])
        if ctx.is_main:
            rows = results.read_csv("tensor_parallel.csv")
            assert {row["variant"] for row in rows} == set(landed), (landed, rows)
            for row in rows:
                assert row["bytes_counted"] == row["bytes_predicted"], row

    def land_block(ctx, cfg, part):
        bench.land_block(ctx, cfg, part)
        landed.append(part["label"])
        if ctx.is_main:
            rows = results.read_csv("sequence_parallel.csv")
            assert {row["block"] for row in rows} == set(landed[2:]), (landed, rows)

    bench.check_mlp(ctx, cfg, land=land_variant)
    result = bench.check_block(ctx, cfg, land=land_block)
    assert landed == ["megatron", "allgather", "one process", "TP", "TP + SP", "torch TP + SP"]
    if ctx.is_main:
        rows = results.read_csv("sequence_parallel.csv")
        assert len(rows) == 2 + 3 * 4, rows  # one process: saved x 2; the rest: bytes x 2, saved x 2
        assert {row["world_size"] for row in rows} == {str(ctx.world_size)}
    return result


def expect_block(result, t):
    """The block at tensor-parallel size t, torch's control included: every check passed on
    every rank, every parameter checked, sequence parallelism keeping 1/t of the LayerNorms'
    activations and the rest as plain TP, torch saving what ours saves, and a ring sending the
    same bytes for TP, TP + SP and torch's."""
    expect_pass(bench.agree(result["failures"]), f"block at t={t}")
    checked = [(r["block"], r["checked"]) for r in result["checks"]]
    assert ("TP + SP", "norm2.weight.grad") in checked
    assert ("torch TP + SP", "output") in checked
    assert len(checked) == 2 * 12 + 2, checked  # 10 parameters + output + input, twice
    saved = {r["block"]: r for r in result["saved"]}
    assert saved["TP + SP"]["layernorms"] * t == saved["TP"]["layernorms"]  # 1/t with SP
    assert saved["TP + SP"]["rest"] == saved["TP"]["rest"]
    assert saved["torch TP + SP"]["total"] == saved["TP + SP"]["total"]
    totals = {(r["block"], r["phase"]): r for r in result["totals"]}
    for phase in ("forward", "backward"):
        sent = [totals[(block, phase)]["ring bytes sent per rank"]
                for block in ("TP", "TP + SP", "torch TP + SP")]
        assert sent[0] == sent[1] == sent[2] > 0, (phase, sent)


def check_everything(ctx):
    # (d_model, d_ff, batch, seq): awkward batch/seq sizes on purpose; widths divide by 4
    for d_model, d_ff, batch, seq in [(16, 64, 3, 5), (32, 48, 2, 7)]:
        cfg = {"d_model": d_model, "d_ff": d_ff, "batch": batch, "seq": seq,
               "variants": list(tp.VARIANTS)}
        checks, byte_rows, failures = bench.check_mlp(ctx, cfg)
        expect_pass(bench.agree(failures), f"MLP {cfg}")
        for variant in tp.VARIANTS:
            assert [r["checked"] for r in checks if r["variant"] == variant] == MLP_PARAMS
        assert len(byte_rows) == 8 and all(r["bytes_counted"] == r["bytes_predicted"]
                                           for r in byte_rows)
        model = tp.TensorParallelMLP(tp.MLP(d_model, d_ff))
        assert model.fc1.weight.shape == (d_ff // ctx.world_size, d_model)  # 1/t each
        assert model.fc2.weight.shape == (d_model, d_ff // ctx.world_size)
    cfg["variants"] = ["megatron"]
    failures = planted("CopyToTensorParallel", CopyWithoutAllReduce,
                       lambda: bench.agree(bench.check_mlp(ctx, cfg)[2]))
    expect_caught(failures, "f without its all-reduce", "input.grad", absent="output")

    expect_block(check_rows_land(ctx), 4)  # the world: t = 4

    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = halves[ctx.rank // 2]
    expect_block(bench.check_block(ctx, BLOCK, group), 2)  # two groups of 2 side by side

    expect_caught(planted("TensorParallelBlock", BlockWithoutReplicatedGrads,
                          lambda: block_failures(ctx, group)),
                  "LayerNorm gradients not all-reduced over the TP group",
                  "TP + SP norm1.weight.grad", absent="TP norm1.weight.grad")
    expect_caught(planted("GatherFromSequenceParallel", GatherSlicingBackward,
                          lambda: block_failures(ctx, group)),
                  "the all-gather's backward slicing instead of reduce-scattering",
                  "TP + SP input.grad", absent="TP + SP output")
    expect_caught(planted("ReduceScatterToSequenceParallel", AllReduceThenSlice,
                          lambda: block_failures(ctx, group)),
                  "an all-reduce where a reduce-scatter will do (right values)",
                  "predicted reduce_scatter", absent="max abs diff")
