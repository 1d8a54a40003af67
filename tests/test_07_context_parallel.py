"""Stage 07, context parallelism: ring attention against scaled_dot_product_attention on the
whole sequence (outputs, dq, dk, dv; float64 and float32; causal and not; both layouts; W = 4
and W = 2; head_dim 5), the bytes and work per rank against their formulas, Ulysses the same
way (its all-to-all bytes beside their formula), the course LM on CP = 2 and CP = 2 x DP = 2
against one process with either, the TP + SP block with ring attention (tp = 2 x
cp = 2), all in one launch of 4 ranks (tests/checks_context_parallel.py); each check beside a
planted bug it must catch; in the same launch the benchmark's sweep on a ring of 2 and 4
(measure/bench_context_parallel.py: rows as they land). Then the layouts by hand, bad input
in-process on the benchmark's and the demo's flags, and the demo run as a learner runs it (a
subprocess)."""

import argparse
import csv
import os
import time
import math

import pytest
import torch
import torch.distributed as dist

import bench_context_parallel as bench
import checks_context_parallel as run_cp
import context_parallel as cp
import tensor_parallel as tp
from common import models
from bench import supervisor as launch
from helpers import REPO, assert_main_usage_error, run_script

CFG = {"batch": 2, "heads": 2, "seq": 16, "head_dim": 5, "layouts": ["contiguous", "zigzag"]}
ULYSSES_CFG = {**CFG, "heads": 4}    # Ulysses splits the heads: they divide by W = 2 and 4


def expect_pass(failures, what):
    assert not failures, f"{what}:\n  " + "\n  ".join(failures)


def expect_caught(failures, what, needle, absent=None):
    """A planted bug: the check must fail, on every rank alike (``agree`` merged the verdicts),
    naming ``needle``, and not ``absent`` (what the bug leaves right)."""
    assert any(needle in failure for failure in failures), f"{what} not caught: {failures}"
    if absent is not None:
        assert not any(absent in failure for failure in failures), (what, failures)


def ring_once(ctx, group, cfg):
    """float64 zig-zag causal: the case the planted bugs are tried on."""
    row, failures = run_cp.ring_case(ctx, group, cfg, torch.float64, "zigzag", True)
    return run_cp.agree(failures)


def forgets_to_rescale(out, lse, chunk_out, chunk_lse):
    new_lse = torch.logaddexp(lse, chunk_lse)
    chunk_weight = torch.exp(chunk_lse - new_lse).unsqueeze(-1)
    return out + chunk_out * chunk_weight, new_lse  # the running output keeps its old weight


def local_positions(local_len, rank, world_size, layout, device=None):
    return torch.arange(local_len, device=device)  # the shard's own 0 .. L-1, not global


def never_sent_home(grad_k, grad_v, group):
    return grad_k, grad_v  # keeps the dK/dV of the block it held last: someone else's


def reduce_over_data_only(model, loss, groups):
    """The torchtitan #3280 trap: the context ranks are never combined."""
    cp.average_gradients(model, groups["data"])
    total = loss.clone()
    dist.all_reduce(total, group=groups["data"])
    return total / groups["dp"]


def summed_over_context(model, loss, groups):
    """All ranks summed, but divided by the data ranks only: cp times too large."""
    group = groups["data_and_context"]
    for param in model.parameters():
        dist.all_reduce(param.grad, group=group)
        param.grad /= groups["dp"]
    total = loss.clone()
    dist.all_reduce(total, group=group)
    return total / groups["dp"]


def forgets_to_regroup(x, group, to_heads):
    """An all-to-all that sends the tensor as it lies, [b, H, S/W, d] cut along its first
    dimension, instead of regrouping it by heads first: block j is not head group j."""
    world_size = dist.get_world_size(group)
    if not to_heads:
        return ORIGINAL_SWAP(x, group, to_heads)
    batch, heads, local_seq, head_dim = x.shape
    send = x.reshape(world_size, batch, heads // world_size, local_seq, head_dim).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    received = received.permute(1, 2, 0, 3, 4)
    return received.reshape(batch, heads // world_size, world_size * local_seq, head_dim)


ORIGINAL_SWAP = cp.swap_split


def ulysses_once(ctx, group, cfg):
    """float64 causal: the case the planted all-to-all is tried on."""
    row, failures = run_cp.ulysses_case(ctx, group, cfg, torch.float64, True)
    return run_cp.agree(failures)


def patched(name, replacement, run):
    original = getattr(cp, name)
    setattr(cp, name, replacement)
    try:
        return run()
    finally:
        setattr(cp, name, original)


def tensor_and_context_parallel_block(ctx, tp_group, context_group):
    """The composition the grid lesson builds on: the TP + SP block (tp = 2, neighbouring
    ranks: ``tp_group`` holds ranks 0, 1 or 2, 3) whose attention is ring attention over the
    context ranks (cp = 2: ``context_group`` holds 0, 2 or 1, 3): each rank holds its tp-th part
    of its context shard. Output, input gradient and gradients (summed over the context ranks)
    equal the block on one process. Failures of this rank."""
    tp_rank = ctx.rank % 2
    context_rank = ctx.rank // 2
    torch.manual_seed(0)
    full = models.Block(16, 32, 4)
    x = torch.randn(2, 16, 16)
    probe = torch.randn_like(x)
    x_ref = x.clone().requires_grad_(True)
    out_ref = full(x_ref)
    out_ref.backward(probe)

    def ring(q, k, v):
        return cp.ring_attention(q, k, v, group=context_group, layout="zigzag")

    def mine(t):
        context_shard = cp.shard_sequence(t.detach(), 1, context_rank, 2, "zigzag")
        return context_shard.chunk(2, dim=1)[tp_rank]

    attention = full.attn.attend
    full.attn.attend = ring
    block = tp.TensorParallelBlock(full, tp_group, sequence_parallel=True)
    full.attn.attend = attention
    x_mine = mine(x).requires_grad_(True)
    out = block(x_mine)
    out.backward(mine(probe))
    block.all_reduce_replicated_grads()
    failures = []
    for name, param in block.named_parameters():
        dist.all_reduce(param.grad, group=context_group)  # each held part of the sequence
        owner = block.get_submodule(name.rsplit(".", 1)[0])
        want = full.get_parameter(name).grad
        if hasattr(owner, "local_part"):
            want = owner.local_part(want)
        if not torch.allclose(param.grad, want, rtol=1e-4, atol=1e-5):
            failures.append(f"tp x cp block {name}.grad off by {(param.grad - want).abs().max()}")
    for what, got, want in (("output", out, mine(out_ref)), ("input.grad", x_mine.grad,
                                                              mine(x_ref.grad))):
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            failures.append(f"tp x cp block {what} off by {(got - want).abs().max()}")
    return failures


def cp_worker(ctx):
    rings = {4: run_cp.make_groups(ctx, 1, 4), 2: run_cp.make_groups(ctx, 1, 2)}
    for world_size, groups in rings.items():
        rows, balance, failures = run_cp.check_ring_attention(ctx, groups["context"], CFG)
        expect_pass(run_cp.agree(failures), f"ring attention at W={world_size}")
        assert len(rows) == 8 and all(row["W"] == world_size for row in rows)
        local_len = CFG["seq"] // world_size
        for row in balance:
            if row["causal"] and row["layout"] == "contiguous":  # exactly (2LW - L + 1)/(WL + 1)
                want = (2 * local_len * world_size - local_len + 1) / (world_size * local_len + 1)
                assert math.isclose(row["max/mean"], want, rel_tol=1e-12), row
                assert abs(row["max/mean"] / (2 - 1 / world_size) - 1) < 0.04, row
            else:
                assert row["max/mean"] == 1.0, row

    for world_size, groups in rings.items():
        rows, failures = run_cp.check_ulysses(ctx, groups["context"], ULYSSES_CFG)
        expect_pass(run_cp.agree(failures), f"Ulysses at W={world_size}")
        assert len(rows) == 4 and all(row["W"] == world_size for row in rows)
    with pytest.raises(ValueError, match="3 heads do not divide by 4 ranks"):
        cp.ulysses_attention(*[torch.zeros(1, 3, 4, 2)] * 3)
    # more heads than ranks, yet not a multiple: refused in one line, not a reshape error
    # (issue 44: a check written `heads < world_size` let 6 heads on 4 ranks through)
    with pytest.raises(ValueError, match="6 heads do not divide by 4 ranks"):
        cp.ulysses_attention(*[torch.zeros(1, 6, 4, 2)] * 3)
    expect_caught(patched("swap_split", forgets_to_regroup,
                          lambda: ulysses_once(ctx, rings[4]["context"], ULYSSES_CFG)),
                  "an all-to-all that forgets to regroup the heads", "output differs")

    group = rings[4]["context"]
    expect_pass(ring_once(ctx, group, CFG), "the unpatched control case")
    expect_caught(patched("merge", forgets_to_rescale, lambda: ring_once(ctx, group, CFG)),
                  "a merge that forgets to rescale", "output differs")
    expect_caught(patched("shard_positions", local_positions, lambda: ring_once(ctx, group, CFG)),
                  "a mask by local positions", "output differs")
    expect_caught(patched("send_home", never_sent_home, lambda: ring_once(ctx, group, CFG)),
                  "dK/dV never sent home", "dk differs", absent="output differs")
    original_exchange = cp.post_exchange
    extras = []

    def sends_k_twice(send, receive, group):
        extras.append(torch.empty_like(send[0]))
        return original_exchange(send + [send[0]], receive + [extras[-1]], group)
    expect_caught(patched("post_exchange", sends_k_twice, lambda: ring_once(ctx, group, CFG)),
                  "a ring that sends a K block twice (right answer, wrong traffic)", "the formula "
                  "says", absent="differs")

    lm_cfg = {"batch": 4, "seq": 16}
    grids = [(run_cp.make_groups(ctx, 2, 2), "zigzag"), (rings[2], "contiguous")]
    for groups, layout in grids:
        rows, failures = run_cp.check_lm(ctx, groups, lm_cfg, layout)
        expect_pass(run_cp.agree(failures), f"LM dp={groups['dp']} cp={groups['cp']} {layout}")
        assert len(rows) == run_cp.LM_STEPS and all(row["ok"] for row in rows), rows
    for groups in (rings[2], grids[0][0]):       # Ulysses: cp 2, and dp 2 x cp 2
        rows, failures = run_cp.check_lm(ctx, groups, lm_cfg, "contiguous", kind="ulysses")
        expect_pass(run_cp.agree(failures), f"LM dp={groups['dp']} cp={groups['cp']} Ulysses")
        assert len(rows) == run_cp.LM_STEPS and all(row["ok"] for row in rows), rows
    dp2_cp2 = grids[0][0]
    # tp = neighbours (the context rings of two above), cp = every other rank (dp2_cp2's data)
    failures = tensor_and_context_parallel_block(ctx, rings[2]["context"], dp2_cp2["data"])
    expect_pass(run_cp.agree(failures), "TP + SP x CP block")
    for reduce, what in ((reduce_over_data_only, "loss averaged over dp only"),
                         (summed_over_context, "loss not averaged over cp")):
        rows, failures = run_cp.check_lm(ctx, dp2_cp2, lm_cfg, "zigzag", reduce=reduce)
        failures = run_cp.agree(failures)
        expect_caught(failures, what, "weights differ")
        expect_caught(failures, what, "reported loss")


    # The benchmark's sweep, in the same launch: one rank, rings of 2 and 4, both layouts, real
    # and emulated compute; it checks its own byte counts against the formula.
    bench_cfg = {"batch": 1, "heads": 4, "head_dim": 4, "layouts": ["contiguous", "zigzag"],
                 "seqs": [16], "ring_sizes": [2, 4], "warmup": 0, "iters": 1, "emulate_ms": 2.0}
    bench.bench_main(ctx, bench_cfg)
    # make bench's deadline: the first length runs, the next (4x the work) cannot end in time
    os.environ["BENCH_STEP_DEADLINE"] = f"{time.time() + 1e-3:.6f}"
    bench.bench_main(ctx, {**bench_cfg, "seqs": [8, 16], "ring_sizes": [2], "layouts": ["zigzag"]})
    del os.environ["BENCH_STEP_DEADLINE"]


def test_ring_attention_and_the_lm_on_4_ranks_with_planted_bugs(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("RESULTS_DIR", str(tmp_path))
    launch.launch(cp_worker, launch.LaunchConfig(4, "gloo", "cpu"), timeout_s=240)
    out = capfd.readouterr().out
    assert "ring bytes sent per rank equal the formula in every row: True" in out, out[-3000:]
    assert "Ulysses bytes sent per rank equal the formula in every row: True" in out, out[-3000:]
    assert "seq 16 and longer: skipped" in out, out[-3000:]
    assert "at seq 8: longer lengths were skipped at make bench's deadline" in out, out[-3000:]
    rows = [row for row in csv.DictReader((tmp_path / "context_parallel.csv").open())
            if row["seq"] == "16"]  # (seq 8: the deadline's run)
    assert sorted((r["impl"], r["W"], r["layout"], r["compute"]) for r in rows) == sorted(
        [("full, sdpa", "1", "-", "real"), ("full, our kernel", "1", "-", "real")]
        + [("ring", w, layout, compute) for w in ("2", "4") for layout in ("contiguous", "zigzag")
           for compute in ("real", "emulated 2 ms")]
        + [("ulysses", w, "contiguous", compute) for w in ("2", "4")
           for compute in ("real", "emulated 2 ms")])
    for row in rows:
        assert row["sent_bytes"] == row["bytes_formula"] and float(row["step_ms"]) > 0, row


def test_layouts_by_hand():
    x = torch.arange(8)
    assert cp.shard_sequence(x, 0, 0, 2, "contiguous").tolist() == [0, 1, 2, 3]
    assert cp.shard_sequence(x, 0, 1, 2, "contiguous").tolist() == [4, 5, 6, 7]
    assert cp.shard_sequence(x, 0, 0, 2, "zigzag").tolist() == [0, 1, 6, 7]
    assert cp.shard_sequence(x, 0, 1, 2, "zigzag").tolist() == [2, 3, 4, 5]
    assert cp.shard_positions(2, 1, 4, "zigzag").tolist() == [1, 6]
    # work per rank, causal, W = 4, seq 8: contiguous 1+2 | 3+4 | 5+6 | 7+8, zig-zag all 9
    assert [bench.visible_scores(r, 4, 8, "contiguous", True, 1) for r in range(4)] == \
        [3, 7, 11, 15]
    assert [bench.visible_scores(r, 4, 8, "zigzag", True, 1) for r in range(4)] == [9, 9, 9, 9]
    assert bench.ring_bytes(4, 100) == (600, 600 + 800)


@pytest.mark.parametrize("call, needle", [
    (lambda: cp.shard_sequence(torch.zeros(2, 12), 1, 0, 4, "zigzag"), "does not divide into 8"),
    (lambda: cp.shard_sequence(torch.zeros(2, 12), 1, 0, 4, "spiral"), "unknown layout 'spiral'"),
    (lambda: cp.ring_attention(*[torch.zeros(1, 1, 3, 2)] * 3), "does not divide by 2"),
    (lambda: cp.ring_attention(*[torch.zeros(1, 1, 4, 2)] * 3, layout="x"), "unknown layout"),
])
def test_bad_arguments_raise_before_any_communication(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


WHERE = ["--world-size", "4", "--backend", "gloo", "--device", "cpu"]


@pytest.mark.parametrize("argv, needle", [
    (["--layouts", "spiral"], "'spiral' is not allowed"),
    (["--bench", "--seqs", "100"], "--seqs 100 does not divide into"),
    (["--bench", "--ring-sizes", "8"], "--ring-sizes [8]"),
    (["--bench", "--seqs", "8000000", "--layouts", "contiguous"], "host memory"),
    (["--bench", "--emulate-ms", "1e30"], "--emulate-ms 1e+30: at most 60000"),
])
def test_bad_input_one_line_exit_2(argv, needle, capsys):
    assert_main_usage_error(bench.main, [*WHERE, *argv], capsys, needle)


def test_the_box_sets_the_bench_defaults():
    """Issue 45: the host runs 1 warm-up + 3 timed steps (not a GPU's 2 + 5), whatever GPUs the
    box has; flags given are kept."""
    for device, want in (("cpu", (1, 3, [256, 512, 1024])), ("cuda", (2, 5, [1024, 2048, 4096]))):
        args = argparse.Namespace(seqs=None, warmup=None, iters=None, ring_sizes=None)
        bench.box_defaults(args, launch.LaunchConfig(4, "gloo" if device == "cpu" else "nccl", device))
        assert (args.warmup, args.iters, args.seqs, args.ring_sizes) == (*want, [2, 4])
    args = argparse.Namespace(seqs=[64], warmup=0, iters=7, ring_sizes=[2])
    bench.box_defaults(args, launch.LaunchConfig(2, "gloo", "cpu"))
    assert (args.warmup, args.iters, args.seqs, args.ring_sizes) == (0, 7, [64], [2])


def test_gloo_on_cuda_is_refused_in_one_line(capsys, monkeypatch):
    """Ring attention's only message is batch_isend_irecv, which Gloo runs on CPU tensors:
    refused before any worker starts (a GPU faked: none is needed to refuse)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    line = assert_main_usage_error(bench.main, ["--world-size", "2", "--backend", "gloo",
                                                "--device", "cuda", "--bench"], capsys,
                                   "batch_isend_irecv", "gloo cannot carry for cuda tensors")
    assert "--device cpu" in line and "NCCL" in line


DEMO = REPO / "07_parallelism/05_context_parallel/run_context_parallel.py"


@pytest.mark.parametrize("argv, needle", [
    (["--dp", "3"], "--dp 3 must divide the world size 4 and --batch"),   # ranks left out
    (["--dp", "2", "--batch", "3"], "--dp 2 must divide the world size 4 and --batch"),
    (["--layouts", "spiral"], "'spiral' is not allowed"),
])
def test_the_demo_refuses_in_one_line(argv, needle, capsys):
    import run_context_parallel as demo
    assert_main_usage_error(demo.main, [*WHERE, *argv], capsys, needle)


def test_the_demo_passes_with_data_and_context_ranks():
    result = run_script(DEMO, *WHERE, "--dp", "2", "--batch", "2", "--heads", "2", "--head-dim",
                        "4", "--seq", "16", "--layouts", "zigzag")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for text in ("ring    float64 zigzag     causal=True", "ring    float32 zigzag     causal=False",
                 "ulysses float64 contiguous causal=True", "LM dp=2 cp=2 ring zigzag step 2",
                 "LM dp=2 cp=2 ulysses contiguous step 2", "all checks passed on every rank"):
        assert text in result.stdout, text


def test_the_zigzag_ratio_reads_the_rings_rows_only():
    """Ulysses' rows are contiguous shards too: the bench's zig-zag / contiguous ratio must not
    take Ulysses' time for the contiguous ring's (it did, once: 1.01 printed for 0.60)."""
    rows = []
    for impl, layout, step_ms in (("ring", "contiguous", 100.0), ("ring", "zigzag", 60.0),
                                  ("ulysses", "contiguous", 59.0)):
        rows.append({"impl": impl, "layout": layout, "seq": 64, "W": 4,
                     "compute": "emulated 400 ms", "step_ms": step_ms})
    assert bench.ratio(rows, 4, "emulated") == pytest.approx(0.6)
