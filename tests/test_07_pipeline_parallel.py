"""Stage 07b: pipeline parallelism (GPipe and 1F1B schedules as data, one executor).

The schedules are tested as pure functions, without any process group; the executor is run
once per stage count, looping over both schedules and every micro-batch count inside.
"""

import shutil
import subprocess
import sys
import textwrap

import pytest
import torch.nn as nn

import pipeline_parallel as pp
from common import launch
from helpers import REPO, assert_usage_error, run_script

SCRIPT = REPO / "07_parallelism" / "pipeline_parallel.py"
CFG = dict(layers=8, d_model=16, hidden=32, batch=16)  # batch divides by 1, 2, 4, 8


# --------------------------------------------------------------------------- pure schedules


@pytest.mark.parametrize("name", list(pp.SCHEDULES))
def test_schedules_are_complete_and_deadlock_free(name):
    schedule = pp.SCHEDULES[name]
    for p in range(1, 6):
        for m in range(1, 10):
            for rank in range(p):
                steps = schedule(rank, p, m)
                fwd = [s.micro_batch for s in steps if s.op == pp.FORWARD]
                bwd = [s.micro_batch for s in steps if s.op == pp.BACKWARD]
                assert sorted(fwd) == sorted(bwd) == list(range(m))
                for i in range(m):  # a micro-batch's backward comes after its forward
                    assert steps.index(pp._forward(rank, p, i)) < \
                        steps.index(pp._backward(rank, p, i))
                peak = pp.peak_in_flight(steps)
                if name == "gpipe":
                    assert peak == m
                else:
                    assert peak == min(p - rank, m) <= p
            grid = pp.simulate(schedule, p, m)  # raises on a deadlock or an unmatched receive
            # In unit time both schedules idle exactly (p-1)/(m+p-1) on every rank.
            for share in pp.ideal_bubble(grid):
                assert share == pytest.approx(pp.bubble_formula(p, m))
            assert all(len(row) == 2 * (m + p - 1) for row in grid)


def test_timeline_shape_small_case():
    gpipe = pp.format_timeline(pp.simulate(pp.gpipe_schedule, 2, 3)).splitlines()
    assert gpipe == ["rank 0 | F0 F1 F2 .  .  B0 B1 B2",
                     "rank 1 | .  F0 F1 F2 B0 B1 B2 ."]
    ofob = pp.format_timeline(pp.simulate(pp.one_f_one_b_schedule, 2, 3)).splitlines()
    assert ofob == ["rank 0 | F0 F1 .  B0 F2 B1 .  B2",
                    "rank 1 | .  F0 B0 F1 B1 F2 B2 ."]


def test_simulate_detects_deadlock():
    def bad(rank, stages, m):  # the last stage wants B0 before it has run F0's forward chain
        steps = pp.gpipe_schedule(rank, stages, m)
        return steps[::-1] if rank == 0 else steps
    with pytest.raises((RuntimeError, ValueError)):
        pp.simulate(bad, 2, 2)


def test_stage_layers_split_evenly():
    assert [list(pp.stage_layers(8, 4, r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError):
        pp.stage_layers(6, 4, 0)


# --------------------------------------------------------------------------- the executor


def pipeline_worker(ctx):
    p, rank = ctx.world_size, ctx.rank
    model = pp.build_model(CFG["layers"], CFG["d_model"], CFG["hidden"])
    mine = pp.stage_layers(CFG["layers"], p, rank)
    stage = nn.Sequential(*[model[i] for i in mine])
    want = pp.reference_grads(CFG, ctx.device, mine)
    for schedule in pp.SCHEDULES:
        for m in (1, p, 2 * p):
            result = pp.pipeline_pass(stage, schedule, rank, p, m, CFG, ctx.device)
            problems = pp.check_pass(stage, want, result, schedule, rank, p, m)
            assert not problems, problems
            expected_peak = m if schedule == "gpipe" else min(p - rank, m)
            assert result["peak_held"] == expected_peak
            assert 0 < result["busy_s"] <= result["total_s"]


@pytest.mark.parametrize("stages", [2, 4])
def test_gradients_match_single_process(stages):
    launch.launch(pipeline_worker, launch.LaunchConfig(stages, "gloo", "cpu"), timeout_s=120)


# --------------------------------------------------------------------------- the script


@pytest.mark.parametrize("argv, needle", [
    (["--world-size", "4", "--layers", "6"], "--layers 6"),
    (["--world-size", "2", "--batch", "10", "--micro-batches", "4"], "--batch 10"),
])
def test_bad_input_one_line_exit_2(argv, needle):
    r = run_script(SCRIPT, *argv, "--backend", "gloo", "--device", "cpu", timeout=60)
    assert_usage_error(r, needle, "divisible")


def test_copy_one_file(tmp_path):
    shutil.copy(SCRIPT, tmp_path / "pipeline_parallel.py")
    code = textwrap.dedent(f"""
        import torch, torch.distributed as dist, torch.nn.functional as F
        import pipeline_parallel as pp
        dist.init_process_group("gloo", init_method="file://{tmp_path}/rdzv", rank=0,
                                world_size=1)
        model = pp.build_model(2, 8, 16)
        x, y = torch.randn(6, 8), torch.randn(6, 8)
        F.mse_loss(model(x), y).backward()
        want = [q.grad.clone() for q in model.parameters()]
        model.zero_grad()
        steps = pp.one_f_one_b_schedule(0, 1, 3)
        out = pp.run_schedule(model, steps, list(x.chunk(3)), list(y.chunk(3)), (2, 8),
                              torch.device("cpu"))
        assert out["peak_held"] == 1
        assert all(torch.allclose(q.grad, w, atol=1e-6) for q, w in zip(model.parameters(), want))
        print(pp.format_timeline(pp.simulate(pp.gpipe_schedule, 2, 2)))
        dist.destroy_process_group()
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
