"""Stage 07b: pipeline parallelism (GPipe, 1F1B, interleaved 1F1B, ZB-H1 as data, one executor).

The schedules are tested as pure data, without processes: order of events, matched sends,
deadlocks (with Gloo's and with NCCL's send semantics), the unit-time simulator against each
formula, the activations held. The executor runs once per stage count, every schedule and m
inside that one launch; the 4-stage launch also runs the script's own worker (table, CSV).
Bad input is checked in-process; the copy test imports both files from an empty folder.
"""

import csv
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import pipeline_parallel as pp
import pipeline_schedules as ps
from common import launch
from helpers import REPO

CFG = dict(layers=8, d_model=16, hidden=32, batch=16, chunks=2)  # batch divides by 1, 2, 4, 8


def chunks_for(name: str) -> int:
    return CFG["chunks"] if name == "interleaved" else 1


def settings(max_p: int = 6, max_m: int = 12):
    """Every (schedule, p, m, v) a schedule allows, p <= max_p, m <= max_m, v <= 3."""
    for name in ps.SCHEDULES:
        for p in range(1, max_p + 1):
            for v in (1, 2, 3) if name == "interleaved" else (1,):
                for m in range(1, max_m + 1):
                    if name != "interleaved" or m % p == 0:
                        yield name, p, m, v


def expected_peak(name: str, rank: int, p: int, m: int, v: int) -> int:
    """Activations held at once, from each schedule's own argument (see the docstrings)."""
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(p - rank, m)
    if name == "interleaved":   # warm-up forwards, plus the first steady-state one
        return min(2 * (p - 1 - rank) + (v - 1) * p + 1, v * m)
    return min(p, m)            # zbh1: W trails B by r on rank r, after p - r warm-up forwards


# --------------------------------------------------------------------------- pure schedules


def test_every_schedule_is_ordered_matched_deadlock_free_and_meets_its_formula():
    for name, p, m, v in settings():
        lists = ps.all_ranks(name, p, m, v)
        ps.check_order(lists)            # raises on a wrong order, peer or unmatched message
        timed = ps.simulate(lists)       # raises on a deadlock
        for share in ps.idle_shares(timed):
            assert share == pytest.approx(ps.bubble_formula(name, p, m, v)), (name, p, m, v)
        for rank, steps in enumerate(lists):
            assert ps.peak_held(steps) == expected_peak(name, rank, p, m, v), (name, p, m, v)
        ps.check_grouped_p2p(lists)     # p2p_plan: receives in time, no deadlock on NCCL


def test_idle_at_p4_m8_shrinks_gpipe_to_zbh1_and_zbh1_formula_derivation():
    idle = {name: ps.simulated_idle(name, 4, 8, 2) for name in ps.SCHEDULES}
    assert idle["gpipe"] == idle["1f1b"] == pytest.approx([3 / 11] * 4)
    assert idle["interleaved"] == pytest.approx([3 / 19] * 4)     # (p-1)/(vm+p-1)
    assert idle["zbh1"] == pytest.approx([3 / 27] * 4)            # (p-1)/(3m+p-1)
    assert idle["zbh1"][0] < idle["interleaved"][0] < idle["1f1b"][0]
    # pipeline_parallel.md's derivation: rank 0 can start B0 only after p forwards and p-1 input-
    # gradient steps (2p-1 units), having done at most p forwards, so it idles p-1 units
    # there; after that ZB-H1 keeps every rank busy: the pass lasts 3m + p - 1 units.
    timed = ps.simulate(ps.all_ranks("zbh1", 4, 8))
    b0 = next(start for start, _, s in timed[0] if s.op == ps.BACKWARD)
    assert b0 == 2 * 4 - 1 and max(end for _, end, _ in timed[0]) == 3 * 8 + 4 - 1
    # 1F1B's share does not depend on T_B / T_F: a backward twice as long, same share.
    slow_b = ps.simulate(ps.all_ranks("1f1b", 4, 8), cost={"F": 1, "B": 2, "W": 1})
    assert ps.idle_shares(slow_b) == pytest.approx([3 / 11] * 4)


def test_timelines_small_cases():
    def lines(name, p, m, v=1):
        return ps.format_timeline(ps.simulate(ps.all_ranks(name, p, m, v))).splitlines()
    assert lines("gpipe", 2, 3) == ["rank 0 | F0 F1 F2 .  .  B0 B1 B2",
                                    "rank 1 | .  F0 F1 F2 B0 B1 B2 ."]
    assert lines("1f1b", 2, 3) == ["rank 0 | F0 F1 .  B0 F2 B1 .  B2",
                                   "rank 1 | .  F0 B0 F1 B1 F2 B2 ."]
    assert lines("zbh1", 2, 2) == ["rank 0 | F0 F1 .  B0 W0 B1 W1",
                                   "rank 1 | .  F0 B0 F1 B1 W0 W1"]
    assert lines("interleaved", 2, 2, 2) == ["rank 0 | F0a F1a F0b F1b .   B0b .   B1b B0a B1a",
                                             "rank 1 | .   F0a F1a F0b B0b F1b B1b B0a B1a ."]
    assert ps.describe("zbh1", 2, 2).splitlines()[0] == \
        "zbh1, p=2, m=2: idle 0.143 of the pass (formula 0.143):"


def _replace(steps, k, step):
    return steps[:k] + [step] + steps[k + 1:]


def test_order_checks_catch_each_kind_of_broken_schedule():
    good = ps.all_ranks("1f1b", 2, 2)
    f0, b0 = good[1][0], good[1][1]                    # rank 1: F0 B0 F1 B1
    cases = {
        "before": [good[0], [b0, f0, *good[1][2:]]],                       # B0 before F0
        "once": [good[0], good[1][:-1]],                                   # B1 missing
        "peers": [good[0], _replace(good[1], 0, ps.Step("F", 0, 0, None, None))],
        "channel": [good[0], [good[1][2], good[1][3], f0, b0]],          # F1 received first
    }
    for says, lists in cases.items():
        with pytest.raises(ValueError, match=says):
            ps.check_order(lists)
    zb = ps.all_ranks("zbh1", 2, 2)
    w_first = [s for s in zb[0] if s.op == "W"] + [s for s in zb[0] if s.op != "W"]
    with pytest.raises(ValueError, match="before"):
        ps.check_order([w_first, zb[1]])
    # In order on each rank and every message matched, yet a cycle: rank 0 wants B0 before
    # it sends F1, rank 1 wants F1 before it sends B0.
    cyclic = [[ps.make_step(op, 0, 2, i) for op, i in (("F", 0), ("B", 0), ("F", 1), ("B", 1))],
              [ps.make_step(op, 1, 2, i) for op, i in (("F", 0), ("F", 1), ("B", 0), ("B", 1))]]
    ps.check_order(cyclic)
    with pytest.raises(RuntimeError, match="deadlock"):
        ps.simulate(cyclic)


def naive_plan(lists):
    """Each step's send grouped with the next step's receive (Megatron's
    send_forward_recv_backward pairing): the plan stage 07 used before p2p_plan."""
    plan = []
    for r, steps in enumerate(lists):
        before = [[] for _ in range(len(steps) + 1)]
        for k, s in enumerate(steps):
            if s.send_to is not None:
                before[k + 1].append(("send", s.send_to, ps.message(s, r, len(lists), True)))
            if s.recv_from is not None:
                before[k].append(("recv", s.recv_from, ps.message(s, r, len(lists))))
        plan.append([[group] if group else [] for group in before])
    return plan


def test_grouped_p2p_check_catches_a_deadlocking_plan_and_late_receives():
    # Fine for 1F1B; for interleaved the pairs cross: rank r's send to r+1 waits in a group
    # that rank r+1 only posts after its own send to r completes, which waits on rank r.
    ps.check_grouped_p2p(ps.all_ranks("1f1b", 4, 8), naive_plan(ps.all_ranks("1f1b", 4, 8)))
    lists = ps.all_ranks("interleaved", 4, 8, 2)
    ps.simulate(lists)                                 # fine with Gloo's buffered sends
    with pytest.raises(RuntimeError, match="deadlock"):
        ps.check_grouped_p2p(lists, naive_plan(lists))
    ps.check_grouped_p2p(lists)                        # p2p_plan: the rounds cannot cycle
    late = ps.p2p_plan(lists)
    late[1][-1] += [group for groups in late[1][:-1] for group in groups]   # all at the end
    for groups in late[1][:-1]:
        groups.clear()
    with pytest.raises(RuntimeError, match="not planned before"):
        ps.check_grouped_p2p(lists, late)


def test_setting_errors():
    ps.check_setting("interleaved", 4, 8, 2, layers=8, batch=64)
    for args, says in [(("interleaved", 4, 6, 2), "multiple"),
                       (("interleaved", 4, 8, 2, 12), "--layers 12"),
                       (("zbh1", 4, 8, 1, 8, 12), "--batch 12")]:
        with pytest.raises(ValueError, match=says):
            ps.check_setting(*args)


def test_chunk_layers_and_deferred_linear_without_processes():
    assert pp.chunk_layers(8, 4, 1) == [range(2, 4)]
    assert pp.chunk_layers(8, 4, 1, chunks=2) == [range(1, 2), range(5, 6)]
    with pytest.raises(ValueError):
        pp.chunk_layers(6, 4, 0)
    # B leaves W's work in the store; W adds exactly the weight gradients autograd would.
    torch.manual_seed(0)
    plain, deferred = nn.Linear(5, 3), pp.DeferredLinear(5, 3)
    deferred.load_state_dict(plain.state_dict())
    x = torch.randn(4, 2, 5)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    plain(xa).square().sum().backward()
    store = []
    pp.set_weight_grad_store(deferred, store)
    deferred(xb).square().sum().backward()
    assert torch.allclose(xa.grad, xb.grad) and deferred.weight.grad is None and len(store) == 1
    for layer, inp, dy in store:
        layer.weight_grad(inp, dy)
    assert torch.allclose(deferred.weight.grad, plain.weight.grad, atol=1e-6)
    assert torch.allclose(deferred.bias.grad, plain.bias.grad, atol=1e-6)


# --------------------------------------------------------------------------- the executor


def pipeline_worker(ctx, harness_cfg):
    """Every schedule at m = 1, p, 2p where it allows m: gradients equal one process's,
    activations held as the schedule says; one emulated pass; then the script's own worker
    (checks, measurement, table, CSV) on a small setting, if asked."""
    p, rank = ctx.world_size, ctx.rank
    cfg = dict(CFG, v={name: chunks_for(name) for name in ps.SCHEDULES})
    model = pp.build_model(CFG["layers"], CFG["d_model"], CFG["hidden"])
    want = pp.reference_grads(cfg, ctx.device)
    ran = []
    for name in ps.SCHEDULES:
        v = chunks_for(name)
        for m in (1, p, 2 * p):
            if name == "interleaved" and m % p:
                continue
            result = pp.pipeline_pass(model, name, ctx, m, cfg)
            for r in pp.chunk_layers(CFG["layers"], p, rank, v):
                for i in r:
                    for q, w in zip(model[i].parameters(), want[i]):
                        assert torch.allclose(q.grad, w, rtol=1e-4, atol=1e-6), (name, m, i)
            steps = ps.schedule_steps(name, rank, p, m, v)
            assert result["peak_held"] == ps.peak_held(steps), (name, m, result)
            assert 0 < result["busy_s"] <= result["total_s"]
            ran.append((name, m))
    assert len(ran) == 11
    steps = ps.schedule_steps("zbh1", rank, p, p, 1)
    result = pp.pipeline_pass(model, "zbh1", ctx, p, cfg, emulate_ms=2.0)
    assert result["busy_s"] >= len(steps) * 2e-3 and result["peak_held"] == ps.peak_held(steps)
    assert all(q.grad is None for q in model.parameters())   # emulated: no compute at all
    if harness_cfg:
        pp.pipeline_parallel_main(ctx, harness_cfg)


@pytest.mark.parametrize("stages", [2, 4])
def test_gradients_match_single_process(stages, tmp_path, capfd, monkeypatch):
    harness = None
    if stages == 4:   # the script's worker too, in the same launch: one start-up fewer
        monkeypatch.setenv("RESULTS_DIR", str(tmp_path))
        harness = dict(CFG, batch=16, schedules=list(ps.SCHEDULES), micro_batches=[8],
                       v={name: chunks_for(name) for name in ps.SCHEDULES}, emulate_ms=1.0,
                       warmup=0, iters=1)
    launch.launch(pipeline_worker, launch.LaunchConfig(stages, "gloo", "cpu"), harness,
                  timeout_s=120)
    if harness is None:
        return
    out = capfd.readouterr().out
    for text in ("emulated 1 ms", "zbh1, p=4, m=8", "interleaved, p=4, m=8, v=2", "W7",
                 "gradients match one process"):
        assert text in out, text
    rows = list(csv.DictReader((tmp_path / "pipeline_bubble.csv").open()))
    assert len(rows) == 4 * 2 * 4                      # schedules x (real, emulated) x ranks
    assert {(r["schedule"], r["chunks"], r["emulated_ms"]) for r in rows} == {
        (name, str(chunks_for(name)), ms) for name in ps.SCHEDULES for ms in ("0.0", "1.0")}
    for row in rows:
        assert float(row["idle_share_simulated"]) == pytest.approx(ps.simulated_idle(
            row["schedule"], 4, int(row["micro_batches"]), int(row["chunks"]))[int(row["rank"])])
    for column in ("backend", "device", "world_size", "layers", "d_model", "hidden", "batch",
                   "idle_share", "idle_share_formula", "peak_held", "step_ms", "run_id",
                   "machine"):
        assert rows[0][column] != "", column


def test_main_defaults_reach_the_launch(monkeypatch):
    launched = []
    monkeypatch.setattr(launch, "launch", lambda worker, config, cfg: launched.append(cfg))
    pp.main(["--world-size", "4", "--backend", "gloo", "--device", "cpu"])
    cfg, = launched
    assert cfg["micro_batches"] == [8] and cfg["schedules"] == list(ps.SCHEDULES)
    assert cfg["v"] == {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zbh1": 1}
    assert cfg["emulate_ms"] > 0 and cfg["iters"] >= 3


@pytest.mark.parametrize("argv, needle", [
    (["--schedules", "interleaved", "--micro-batches", "2"], "multiple"),
    (["--layers", "6"], "--layers 6"),
    (["--layers", "4", "--schedules", "1f1b,interleaved"], "--layers 4"),
    (["--batch", "10", "--micro-batches", "4"], "--batch 10"),
    (["--schedules", "gpipe,zb"], "'zb'"),
    (["--schedules", ","], "','"),
    (["--micro-batches", ""], "empty"),
    (["--emulate-ms", "nan"], "'nan'"),
    (["--emulate-ms", "0"], "'0'"),
    (["--chunks", "0"], "'0'"),
])
def test_bad_input_one_line_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        pp.main(["--world-size", "4", "--backend", "gloo", "--device", "cpu", *argv])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert exc.value.code == 2 and len(lines) == 1 and needle in lines[0], captured.err
    assert "[rank" not in captured.out                 # rejected before any worker started


def test_copy_both_files(tmp_path):
    for name in ("pipeline_parallel.py", "pipeline_schedules.py"):
        shutil.copy(REPO / "07_parallelism" / "04_pipeline_parallel" / name, tmp_path / name)
    code = textwrap.dedent(f"""
        import sys, torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
        import pipeline_parallel as pp, pipeline_schedules as ps
        assert "common" not in sys.modules
        dist.init_process_group("gloo", init_method="file://{tmp_path}/rdzv", rank=0,
                                world_size=1)
        ref = pp.build_model(4, 8, 16, linear=nn.Linear)
        x, y = torch.randn(6, 8), torch.randn(6, 8)
        loss = F.mse_loss(ref(x), y)
        loss.backward()
        for name, v in (("1f1b", 1), ("zbh1", 1), ("interleaved", 2)):
            model = pp.build_model(4, 8, 16)
            chunks = [model[r.start:r.stop] for r in pp.chunk_layers(4, 1, 0, v)]
            out = pp.run_schedule(chunks, ps.all_ranks(name, 1, 3, v), list(x.chunk(3)),
                                  list(y.chunk(3)), (2, 8), torch.device("cpu"))
            assert abs(out["loss"] - loss.item()) < 1e-5, (name, out)
            assert all(torch.allclose(q.grad, w.grad, atol=1e-6)
                       for q, w in zip(model.parameters(), ref.parameters())), name
        print(ps.describe("zbh1", 4, 8))
        dist.destroy_process_group()
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.endswith("ok\n"), r.stderr
    assert "rank 3 | .  .  .  F0 B0" in r.stdout
