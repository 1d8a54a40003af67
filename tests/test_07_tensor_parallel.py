"""Stage 07a: tensor-parallel MLP (Megatron column/row split and the all-gather variant).

One process launch per world size; the worker loops over every case and asserts inside.
"""

import csv
import shutil
import subprocess
import sys
import textwrap

import pytest

import tensor_parallel as tp
from common import launch
from helpers import REPO, assert_usage_error, run_script

SCRIPT = REPO / "07_parallelism" / "tensor_parallel.py"

# (d_model, d_ff, batch, seq): awkward batch/seq sizes on purpose; widths divide by 2 and 4.
SHAPES = [(16, 64, 3, 5), (32, 48, 2, 7)]


def tp_worker(ctx):
    import copy

    import torch

    for d_model, d_ff, batch, seq in SHAPES:
        for variant in tp.VARIANTS:
            log = tp.CommLog()
            rows, _, model = tp.check_variant(variant, d_model, d_ff, batch, seq, ctx.device, log)
            bad = [(what, diff) for what, diff, ok in rows if not ok]
            assert not bad, f"rank {ctx.rank} {variant} {(d_model, d_ff)}: {bad}"
            assert {what for what, _, _ in rows} >= {"output", "input.grad", "fc1.weight.grad",
                                                      "fc1.bias.grad", "fc2.weight.grad",
                                                      "fc2.bias.grad"}
            # Each rank holds 1/n of every split matrix.
            assert model.fc1.weight.shape == (d_ff // ctx.world_size, d_model)
            # Counted bytes equal the algorithm's prediction, layer by layer.
            predicted = tp.predicted_comm(variant, batch * seq, d_model, d_ff)
            for key, (op, nbytes) in predicted.items():
                assert log.bytes.get(key, 0) == nbytes, (variant, key, dict(log.bytes))
                assert log.ops.get(key, "-") == op, (variant, key, dict(log.ops))

    # Training: the loss sequence equals single-process, and it falls.
    d_model, d_ff, batch, seq = SHAPES[0]
    torch.manual_seed(0)
    start = tp.MLP(d_model, d_ff)
    want = tp.train_losses(copy.deepcopy(start), 4, d_model, batch, seq, ctx.device, lr=0.5)
    assert want[-1] < want[0]
    for variant, cls in tp.VARIANTS.items():
        got = tp.train_losses(cls(start), 4, d_model, batch, seq, ctx.device, lr=0.5)
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (variant, got, want)


@pytest.mark.parametrize("world_size", [2, 4])
def test_outputs_and_gradients_match_single_process(world_size):
    launch.launch(tp_worker, launch.LaunchConfig(world_size, "gloo", "cpu"), timeout_s=120)


def test_predicted_bytes():
    tokens, d, ff = 10, 8, 32
    megatron = tp.predicted_comm("megatron", tokens, d, ff)
    allgather = tp.predicted_comm("allgather", tokens, d, ff)
    # Megatron: one all-reduce of tokens x d_model forward (g) and one backward (f).
    assert sum(b for _, b in megatron.values()) == 2 * tokens * d * 4
    assert megatron[("fc2", "forward")] == ("all_reduce", tokens * d * 4)
    # The all-gather variant also moves the d_ff-wide activation, forward and backward.
    assert sum(b for _, b in allgather.values()) == 2 * tokens * (d + ff) * 4
    assert tp.ring_bytes_per_rank("all_reduce", 1000, 4) == 1500
    assert tp.ring_bytes_per_rank("all_gather", 1000, 4) == 750


@pytest.mark.parametrize("argv, needles", [
    (["--world-size", "4", "--d-ff", "250"], ["250", "divisible"]),
    (["--world-size", "4", "--d-model", "30"], ["30", "divisible"]),
    (["--time-iters", "-1"], ["--time-iters", ">= 0"]),
])
def test_bad_input_one_line_exit_2(argv, needles):
    r = run_script(SCRIPT, *argv, "--backend", "gloo", "--device", "cpu", timeout=60)
    assert_usage_error(r, *needles)


def test_script_writes_bytes_and_times(tmp_path):
    """The plain run as make bench runs it: both CSVs, this run's id on every row."""
    env = {"RESULTS_DIR": str(tmp_path), "RESULTS_RUN_ID": "tp-test"}
    r = run_script(SCRIPT, "--world-size", "2", "--backend", "gloo", "--device", "cpu",
                   "--d-model", "32", "--d-ff", "64", "--time-iters", "3", env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    with (tmp_path / "tensor_parallel.csv").open(newline="") as f:
        byte_rows = list(csv.DictReader(f))
    with (tmp_path / "tensor_parallel_time.csv").open(newline="") as f:
        time_rows = {row["variant"]: row for row in csv.DictReader(f)}
    assert {row["run_id"] for row in byte_rows} == {"tp-test"} and len(byte_rows) == 8
    assert all(row["bytes_counted"] == row["bytes_predicted"] for row in byte_rows)
    assert set(time_rows) == {"single", "megatron", "allgather"}
    assert float(time_rows["single"]["speedup_vs_single"]) == 1.0
    for row in time_rows.values():
        assert float(row["fwd_bwd_ms"]) > 0 and row["run_id"] == "tp-test", row
    assert time_rows["megatron"]["ranks_working"] == "2"


def test_copy_one_file(tmp_path):
    """The file alone, on a 1-rank group: outputs, input gradient and every parameter's
    gradient equal the single-process MLP's, for both variants."""
    shutil.copy(SCRIPT, tmp_path / "tensor_parallel.py")
    code = textwrap.dedent(f"""
        import torch, torch.distributed as dist
        import tensor_parallel as tp
        dist.init_process_group("gloo", init_method="file://{tmp_path}/rdzv", rank=0,
                                world_size=1)
        torch.manual_seed(0)
        ref = tp.MLP(8, 16)
        x = torch.randn(2, 3, 8)
        target = torch.randn(2, 3, 8)
        # single-process reference: forward and backward on the full MLP
        x_ref = x.clone().requires_grad_(True)
        want = ref(x_ref)
        (want - target).square().mean().backward()
        for cls in (tp.TensorParallelMLP, tp.AllGatherMLP):
            model = cls(ref, log=tp.CommLog())
            x_tp = x.clone().requires_grad_(True)
            got = model(x_tp)
            assert torch.allclose(got, want, atol=1e-6), (cls.__name__, "output")
            (got - target).square().mean().backward()
            assert torch.allclose(x_tp.grad, x_ref.grad, atol=1e-6), (cls.__name__, "input grad")
            for layer in ("fc1", "fc2"):
                for name in ("weight", "bias"):
                    g = getattr(getattr(model, layer), name).grad
                    r = getattr(getattr(ref, layer), name).grad
                    assert g is not None and g.shape == r.shape, (cls.__name__, layer, name)
                    assert torch.allclose(g, r, rtol=1e-5, atol=1e-6), \
                        (cls.__name__, layer, name, (g - r).abs().max().item())
        dist.destroy_process_group()
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
