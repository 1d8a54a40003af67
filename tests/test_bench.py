"""``make bench``: what it plans on each kind of box (and that every planned command passes its
script's own checks there), the budget planned up front (shares, minimums, skips, refusals),
the cap on a script, signals (SIGINT and SIGTERM passed on to the running step; SIGTERM and
SIGKILL to a real run leave nothing of its step alive), the report from known numbers (and only
this run's), rebuilt on a fresh clone and never replaced by a worse one, and one real
end-to-end run of the driver on tiny sizes, which is also where stages 02, 06 (with 03-05),
05's profile, 07's tensor-parallel, pipeline, sharding and context-parallel scripts are run
the way ``make bench`` runs them. It runs in the background from this file's first test to its
last. Expert parallel, everything together and checkpoints are left out of it (several seconds
each, a minute for the grids): their planned commands pass their scripts' checks here and
their report sections are read from known numbers.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from bench import make_bench, report
from bench import results
from helpers import REPO, alive, session, start_script, wait_for_line


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def _step(steps, key):
    return next(s for s in steps if s.key == key)


KEYS = ["compute", "allreduce", "ddp", "profile", "tp", "pp", "ledger", "cp", "ep2", "ep4", "grid",
        "checkpoint", "backends", "muon", "crossover", "prediction"]   # a CPU box's full run
QUICK_KEYS = ["compute", "allreduce", "ddp", "profile", "tp", "pp", "ledger", "cp", "ep4",
              "checkpoint", "prediction"]


def test_plans_per_box(monkeypatch):
    """What each kind of box runs. A CPU box: Gloo/CPU at small sizes. One GPU (resized from
    the H200 box's logs, where 10 of 11 steps missed their caps): the course LM for 03-06, the
    ledger and checkpoints; the all-reduce sweep on the GPU only (--device cuda), up to 100 MB;
    fewer expert-parallel tokens; the budget flags set from each step's cap. A GPU per rank:
    NCCL, the small LM, the sweep up to 1 GB."""
    monkeypatch.delenv("BENCH_MODEL", raising=False)
    cpu = make_bench.pick_setup(0)
    assert (cpu.backend, cpu.device, make_bench.bench_model(cpu, quick=False)) == ("gloo", "cpu", "tiny")
    steps = make_bench.plan(cpu, quick=False, model="tiny")
    assert [s.key for s in steps] == KEYS
    sweep = _step(steps, "allreduce").argv
    assert "GB" not in _flag(sweep, "--sizes") and _flag(sweep, "--device") == "cpu"
    assert _step(steps, "ddp").budget_flag == "--case-budget-s"
    assert _flag(_step(steps, "compute").argv, "--device") == "cpu"
    one = make_bench.pick_setup(1, "NVIDIA H200")
    assert (one.backend, one.device) == ("gloo", "cuda") and "NCCL refuses two ranks" in one.picked
    assert (make_bench.bench_model(one, False), make_bench.bench_model(one, True)) == ("course", "course")
    steps = make_bench.plan(one, quick=False, model="course")
    sweep = _step(steps, "allreduce").argv
    assert _flag(sweep, "--device") == "cuda" and "--backend" not in sweep  # no gloo/cpu sweep
    assert _flag(sweep, "--sizes") == "1MB,10MB,100MB" and _flag(sweep, "--world-sizes") == "2,4"
    assert _flag(_step(steps, "pp").argv, "--world-size") == "4"  # 4 stages share the GPU
    for key in ("ddp", "profile", "ledger", "checkpoint"):
        assert _flag(_step(steps, key).argv, "--model") == "course", key
    assert _flag(_step(steps, "ep4").argv, "--tokens") == "1024,4096"
    ddp = _step(steps, "ddp").argv
    assert (_flag(ddp, "--batch-size"), _flag(ddp, "--context-length")) == ("8", "256")
    compute = _step(steps, "compute").argv
    assert (_flag(compute, "--device"), _flag(compute, "--batch-size")) == ("cuda", "4")  # a rank's
    for gpus, ws, batch, pp_ws in ((2, "2", "8", "2"), (3, "3", "6", "2"), (8, "8", "8", "4")):
        setup = make_bench.pick_setup(gpus, "NVIDIA H100")
        assert make_bench.bench_model(setup, False) == "small"
        steps = make_bench.plan(setup, quick=False, model="small")
        ddp = _step(steps, "ddp").argv
        assert (setup.backend, _flag(ddp, "--world-size"), _flag(ddp, "--batch-size")) == ("nccl", ws, batch)
        assert _flag(_step(steps, "pp").argv, "--world-size") == pp_ws
        sweep = _step(steps, "allreduce").argv
        assert (_flag(sweep, "--backend"), _flag(sweep, "--device")) == ("nccl", "cuda")
        assert _flag(sweep, "--sizes").endswith("1GB")


@pytest.mark.parametrize("gpus", [0, 1, 8])
def test_plan_sizes_and_shares_per_box(gpus):
    """A CPU box, a one-GPU box and an 8-GPU box, quick and full: the shares come from their
    own column of SHARES and add up to the default budget less one stop at most; every minimum
    on a GPU box is above a CUDA step's start-up (8-12 s in the logs); every command names its
    device (the box's, or the host's where a lesson cannot send CUDA tensors over Gloo); and a
    step's budget flag is set from the cap it gets, less its start-up, per configuration."""
    kind = make_bench.box_kind(gpus)
    assert kind == {0: "cpu", 1: "one_gpu", 8: "nccl"}[gpus]
    setup = make_bench.pick_setup(gpus, "GPU")
    for quick in (True, False):
        steps = make_bench.plan(setup, quick, make_bench.bench_model(setup, quick))
        budget = make_bench.default_budget_s(quick, gpus)
        assert sum(s.share_s for s in steps) <= budget - make_bench.STOP_S, (gpus, quick)
        for s in steps:
            column = make_bench.SHARES[s.key][kind]
            assert (s.share_s, s.min_s) == (column[0 if quick else 1], column[2])
            assert s.share_s > s.min_s > 0
            if gpus:
                assert s.min_s > make_bench.CUDA_STARTUP_S, s
            assert s.key == "backends" or _flag(s.argv, "--device") in (("cpu",) if not gpus else ("cuda", "cpu")), s.argv
        on_gpu = [s.key for s in steps if gpus and _flag(s.argv, "--device") == "cuda"]
        if gpus:
            assert {"allreduce", "ddp", "profile", "ledger", "compute"} <= set(on_gpu)
        make_bench.plan_budget(steps, budget)
        assert all(s.cap_s >= s.share_s for s in steps), steps
        sweep = _step(steps, "allreduce")
        make_bench.size_to_deadline(sweep, sweep.cap_s)
        startup = make_bench.CUDA_STARTUP_S if gpus else make_bench.CPU_STARTUP_S
        assert float(_flag(sweep.argv, "--budget-s")) == pytest.approx(
            (sweep.cap_s - startup) / sweep.cases, abs=0.5)
        ddp = _step(steps, "ddp")
        make_bench.size_to_deadline(ddp, ddp.cap_s)
        assert float(_flag(ddp.argv, "--case-budget-s")) * ddp.cases <= ddp.cap_s


@pytest.mark.parametrize("gpus", [2, 3])
def test_a_step_over_gloo_on_an_nccl_box_is_sized_as_on_one_gpu(gpus):
    """On 2-3 GPUs context parallel, the grids, expert parallel on 4 ranks (and checkpoints on
    2 GPUs) run over Gloo, on the host or sharing GPUs: they take one GPU's share and sizes
    (larger ones overran on the H200); the steps over NCCL take the NCCL column."""
    one = {s.key: s for s in make_bench.plan(make_bench.pick_setup(1, "GPU"), False, "small")}
    over_gloo = set()
    for s in make_bench.plan(make_bench.pick_setup(gpus, "GPU"), quick=False, model="small"):
        kind = "nccl"
        if _flag(s.argv, "--backend") == "gloo":
            over_gloo.add(s.key)
            kind = "one_gpu"
            assert s.argv == one[s.key].argv, s.argv
        assert (s.share_s, s.min_s) == make_bench.SHARES[s.key][kind][1:], (s.key, kind)
    assert over_gloo == {"cp", "ep4", "grid"} | ({"checkpoint"} if gpus == 2 else set())


def _where(argv) -> tuple:
    """(world size, backend, device) of a planned command."""
    return _flag(argv, "--world-size"), _flag(argv, "--backend"), _flag(argv, "--device")


def test_the_07_lessons_are_planned_for_what_each_box_can_run():
    """Context and expert parallel, everything together and checkpoints on each kind of box:
    NCCL where there is a GPU per rank; ring attention, which Gloo can send CPU tensors only
    for, and measure/grid_bench.py --bench, which refuses CUDA over Gloo, on the host's cores otherwise;
    expert parallel and checkpoints share the GPUs over Gloo. Quick leaves out the two steps
    with no quicker size (expert parallel on 2 ranks, everything together)."""
    cases = {  # gpus: (cp, ep2, ep4, grid, checkpoint)
        0: (("4", "gloo", "cpu"), ("2", "gloo", "cpu"), ("4", "gloo", "cpu"),
            ("4", "gloo", "cpu"), ("4", "gloo", "cpu")),
        1: (("4", "gloo", "cpu"), ("2", "gloo", "cuda"), ("4", "gloo", "cuda"),
            ("4", "gloo", "cpu"), ("4", "gloo", "cuda")),
        2: (("4", "gloo", "cpu"), ("2", "nccl", "cuda"), ("4", "gloo", "cuda"),
            ("4", "gloo", "cpu"), ("4", "gloo", "cuda")),
        3: (("4", "gloo", "cpu"), ("2", "nccl", "cuda"), ("4", "gloo", "cuda"),
            ("4", "gloo", "cpu"), ("3", "nccl", "cuda")),
        4: (("4", "nccl", "cuda"), ("2", "nccl", "cuda"), ("4", "nccl", "cuda"),
            ("4", "nccl", "cuda"), ("4", "nccl", "cuda")),
        8: (("4", "nccl", "cuda"), ("2", "nccl", "cuda"), ("4", "nccl", "cuda"),
            ("8", "nccl", "cuda"), ("4", "nccl", "cuda")),
    }
    for gpus, want in cases.items():
        steps = make_bench.plan(make_bench.pick_setup(gpus, "GPU"), quick=False,
                                model="small" if gpus else "tiny")
        assert [s.key for s in steps] == [key for key in KEYS if not gpus or key != "crossover"]
        got = tuple(_where(_step(steps, key).argv) for key in ("cp", "ep2", "ep4", "grid", "checkpoint"))
        assert got == want, (gpus, got)
        grid = _step(steps, "grid").argv
        assert _flag(grid, "--bench-sizes") == ("gpu" if gpus >= 4 else "cpu"), gpus
        checkpoint = _step(steps, "checkpoint").argv
        assert _flag(checkpoint, "--model") == ("small" if gpus > 2 else "course")
        cp = _step(steps, "cp").argv
        assert _flag(cp, "--seqs") == ("1024,2048,4096" if gpus >= 4 else "256,512,1024")
        assert "--ring-sizes" not in cp  # rings of 2 and 4
        quick = make_bench.plan(make_bench.pick_setup(gpus, "GPU"), quick=True, model="course")
        want = QUICK_KEYS
        if gpus:        # a GPU box's quick run leaves the planning check out (its start-ups)
            want = [key for key in QUICK_KEYS if key != "prediction"]
        assert [s.key for s in quick] == want
        assert _flag(_step(quick, "cp").argv, "--ring-sizes") == "4"
        assert _flag(_step(quick, "checkpoint").argv, "--iters") == "2"
    tp = _step(make_bench.plan(make_bench.pick_setup(0), False, "tiny"), "tp").argv
    assert _flag(tp, "--heads") == "8"  # sequence parallelism splits whole heads


@pytest.mark.parametrize("gpus", [0, 1, 3, 4, 8])
def test_every_planned_command_passes_its_scripts_own_checks(gpus, monkeypatch):
    """Each planned command through its script's main() on this box or a faked GPU box, up
    to the point where it would start its ranks: flags, world sizes, divisibility, NCCL's one
    GPU per rank and the memory estimates must all be accepted (a usage error exits 2)."""
    import torch
    import torch.distributed as dist

    from bench import supervisor as launch
    from common import launch as course_launch

    class Props:
        total_memory = 80 * 2**30
    for name, value in (("device_count", lambda: gpus), ("is_available", lambda: gpus > 0),
                        ("get_device_properties", lambda i=0: Props()),
                        ("get_device_name", lambda i=0: "Fake GPU")):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    launched = []
    monkeypatch.setattr(launch, "launch", lambda worker, config, *a, **k: launched.append(config))
    monkeypatch.setattr(course_launch, "launch",
                        lambda worker, config, *a, **k: launched.append(config))
    for quick in (False, True):
        setup = make_bench.pick_setup(gpus, "Fake GPU")
        for step in make_bench.plan(setup, quick, "small" if gpus else "tiny"):
            if step.key == "backends":  # its own processes, one per op: no flags
                continue
            if step.key == "compute":  # one process, no launch: its flags checked alone
                args = importlib.import_module("bench.compute").parse_args(step.argv[1:])
                assert args.device == ("cuda" if gpus else "cpu")
                continue
            if step.key == "prediction":  # one process reading the rows above: its flags alone
                args = importlib.import_module("check_prediction").parse_args(step.argv[1:])
                assert args.device == ("cuda" if gpus else "cpu")
                continue
            name = step.argv[0].split("/")[-1][:-3]
            lab = step.argv[0].startswith("bench/")
            module = importlib.import_module(f"bench.{name}" if lab else name)
            launched.clear()
            try:
                module.main(step.argv[1:])
            except SystemExit as e:  # 02 finds no rows after the faked launch: not a usage error
                assert step.key == "allreduce" and e.code == 1, (step.argv, e.code)
            assert launched, step.argv
            for config in launched:
                if step.key != "allreduce":  # 02 sweeps several; the rest run as planned
                    assert (config.backend, config.device) == (
                        _flag(step.argv, "--backend"), _flag(step.argv, "--device")), step.argv
                assert config.backend != "nccl" or config.world_size <= gpus, (step.argv, config)


@pytest.mark.parametrize("gpus", [2])
def test_the_default_plans_fit_their_budgets(gpus):
    """(0, 1 and 8 GPUs: test_plan_sizes_and_shares_per_box.) Full fits 9 minutes, quick about
    2 on a CPU box and 3 on a GPU box (each GPU step pays a CUDA start-up)."""
    assert make_bench.DEFAULT_BUDGET_S[False] <= 9 * 60 and make_bench.DEFAULT_BUDGET_S[True] <= 150
    assert make_bench.GPU_QUICK_BUDGET_S <= 180
    for quick in (True, False):
        steps = make_bench.plan(make_bench.pick_setup(gpus, "GPU"), quick, "small")
        budget = make_bench.default_budget_s(quick, gpus)
        assert sum(s.share_s for s in steps) <= budget - make_bench.STOP_S, (gpus, quick)
        assert all(s.share_s > s.min_s > make_bench.CUDA_STARTUP_S for s in steps), steps
        make_bench.plan_budget(steps, budget)
        assert all(s.cap_s >= s.share_s for s in steps), steps


def test_the_budget_is_planned_before_anything_runs(capsys):
    """BENCH_BUDGET_S=60 with quick sizes used to skip steps 1-4 at 0 s elapsed ("the budget
    was spent") and run the pipeline alone. Now: every step gets its minimum and a scaled part
    of the rest, the steps that need the most are skipped first, with the reason, up front."""
    steps = make_bench.plan(make_bench.pick_setup(0), quick=True, model="tiny")
    make_bench.plan_budget(steps, 65)
    running = [s for s in steps if s.cap_s > 0]
    assert [s.key for s in running] == ["compute", "allreduce", "tp", "cp", "ep4",
                                        "checkpoint", "prediction"]
    assert sum(s.cap_s for s in running) == pytest.approx(65 - make_bench.STOP_S)
    assert all(s.cap_s >= s.min_s for s in running)
    for key, minimum in (("ddp", 15), ("ledger", 15), ("pp", 12), ("profile", 10)):  # the largest
        assert _step(steps, key).status == ("skipped: a 65 s budget cannot give every step its "
                                            "minimum, and of those left this one needs the most "
                                            f"({minimum} s)")
    smallest = min(s.min_s for s in steps) + make_bench.STOP_S
    assert make_bench.smallest_budget_s() == smallest == 15
    steps = make_bench.plan(make_bench.pick_setup(0), quick=True, model="tiny")
    make_bench.plan_budget(steps, smallest)  # exactly enough for the cheapest step alone
    assert [(s.key, s.cap_s) for s in steps if s.cap_s > 0] == [("compute", 5)]
    with pytest.raises(SystemExit) as e:
        make_bench.plan_budget(steps, smallest - 0.5)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == ("make bench: error: BENCH_BUDGET_S=14.5 is too small "
                                         "for any step: the smallest needs 15 s with its stop; "
                                         "give at least that\n")


def test_environment_variables_and_a_tiny_budget_are_refused_before_anything_runs(
        monkeypatch, capfd):
    setup = make_bench.pick_setup(0)
    monkeypatch.setenv("BENCH_MODEL", "course")
    assert make_bench.bench_model(setup, quick=True) == "course"
    monkeypatch.setenv("BENCH_BUDGET_S", "300")
    assert make_bench.budget_s(quick=False) == 300.0
    monkeypatch.setenv("BENCH_MODEL", "huge")
    with pytest.raises(SystemExit) as e:
        make_bench.bench_model(setup, True)
    err = capfd.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "tiny, course, small" in err, err
    for value in ("soon", "nan", "0", "-5", "1e30", "inf"):
        monkeypatch.setenv("BENCH_BUDGET_S", value)
        with pytest.raises(SystemExit) as e:
            make_bench.budget_s(True)
        err = capfd.readouterr().err
        assert e.value.code == 2 and err == (f"make bench: error: BENCH_BUDGET_S={value!r}: give "
                                             "the whole run's limit in seconds, from 15 (one step) "
                                             "to 86400 (a day)\n"), err
    monkeypatch.delenv("BENCH_MODEL")
    monkeypatch.setenv("BENCH_BUDGET_S", "10")  # the whole driver: refused before any step
    monkeypatch.setenv("BENCH_QUICK", "1")
    with pytest.raises(SystemExit) as e:
        make_bench.main()
    out, err = capfd.readouterr()
    assert e.value.code == 2 and err.splitlines() == [
        "make bench: error: BENCH_BUDGET_S=10 is too small for any step: the smallest needs 15 s "
        "with its stop; give at least that"] and out == "", (out, err)


def test_a_script_past_its_cap_gets_ctrl_c_then_the_bench_goes_on(tmp_path):
    """Even where make bench was started with Ctrl-C ignored (`make bench &` in a script)."""
    flag = tmp_path / "wrote_rows"
    script = tmp_path / "slow.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        try:
            time.sleep(60)
        except KeyboardInterrupt:  # what a stage does: write what finished, then exit
            open({str(flag)!r}, "w").write("rows")
            sys.exit(130)
    """))
    step = make_bench.Step("slow", "a slow script", [str(script)], share_s=60, min_s=1)
    start = time.monotonic()
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as `make bench &` starts: its
    try:                                                    # steps must still take the Ctrl-C
        make_bench.run_step(step, env=None, cap_s=1)
    finally:
        signal.signal(signal.SIGINT, ignored)
    assert step.status == "stopped at its 1 s cap (exit 130)" and flag.read_text() == "rows"
    assert time.monotonic() - start < 20


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_to_make_bench_is_passed_on_to_its_step(sig, tmp_path):
    """make bench stopped by SIGINT or SIGTERM passes the signal on to the running step's
    script (a stage's launcher then ends its ranks: tests/test_faults.py), which writes what it
    finished; make bench then stops (``Interrupted``) and a second signal is ignored."""
    ready = tmp_path / "ready"
    script = tmp_path / "step.py"
    script.write_text(textwrap.dedent(f"""
        import pathlib, signal, sys, time
        def finish(signum, frame):
            pathlib.Path({str(tmp_path / 'got')!r}).write_text(signal.Signals(signum).name)
            sys.exit(128 + signum)
        signal.signal(signal.SIGINT, finish)
        signal.signal(signal.SIGTERM, finish)
        pathlib.Path({str(ready)!r}).write_text("")
        time.sleep(60)
    """))

    def signal_make_bench_when_the_step_is_ready():
        while not ready.exists():
            time.sleep(0.05)
        os.kill(os.getpid(), sig)  # this process plays make bench
    step = make_bench.Step("step", "a step", [str(script)], share_s=60, min_s=1)
    previous = {s: signal.getsignal(s) for s in make_bench.STOP_SIGNALS}
    signal.signal(sig, make_bench.on_stop_signal)
    threading.Thread(target=signal_make_bench_when_the_step_is_ready, daemon=True).start()
    try:
        with pytest.raises(make_bench.Interrupted):
            make_bench.run_step(step, env=None, cap_s=60)
        assert all(signal.getsignal(s) is signal.SIG_IGN for s in make_bench.STOP_SIGNALS)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert step.status == f"stopped by {sig.name} (exit {128 + sig})" and step.seconds < 30
    assert (tmp_path / "got").read_text() == sig.name


def test_a_capped_ddp_step_keeps_the_rows_it_measured_and_rounds_pool(monkeypatch, tmp_path,
                                                                      capsys):
    """Stage 06's --bench writes its rows after every case, not every round: stopped after
    its first case (as make bench's cap stops it), that case's row is in ddp_step.csv; past its
    deadline (``BENCH_STEP_DEADLINE``) after the first case, it skips the rest and says so. Rounds
    pool their steps (2 per round here, 2 rounds: 4). The control's row carries the burst timed
    beside it. One rank, in this process."""
    import torch.distributed as dist

    from bench import step_bench

    from bench import supervisor as launch
    args = argparse.Namespace(model="tiny", batch_size=2, context_length=8, steps=2, warmup=0,
                              rounds=2, case_budget_s=120.0)
    ctx = launch.Dist(0, 1, 0, "gloo", torch.device("cpu"))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{launch.free_port()}",
                            rank=0, world_size=1)
    try:
        timed = step_bench.time_steps
        calls = []

        def stopped_at_the_second_case(*a):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt  # Ctrl-C during the second case (torch DDP's)
            return timed(*a)
        monkeypatch.setattr(step_bench, "time_steps", stopped_at_the_second_case)
        with pytest.raises(KeyboardInterrupt):
            step_bench.run_step_bench(ctx, [], args)
        rows = results.read_csv(step_bench.CSV_NAME)
        assert [(r["impl"], r["steps"], r["ratio_vs_torch_ddp"]) for r in rows] == [("none", "2", "")]
        monkeypatch.setattr(step_bench, "time_steps", timed)
        # make bench's deadline just after the first case: the rest are skipped, said in a line
        monkeypatch.setenv("BENCH_STEP_DEADLINE", f"{time.time() + 1e-3:.6f}")
        assert [r["impl"] for r in step_bench.run_step_bench(ctx, [], args)] == ["none"]
        assert "the cases and rounds left: skipped: past make bench's deadline for this step; " \
               "the rows above are written" in capsys.readouterr().out
        assert [r["impl"] for r in results.read_csv(step_bench.CSV_NAME)] == ["none"]
        monkeypatch.delenv("BENCH_STEP_DEADLINE")
        step_bench.run_step_bench(ctx, [], args)
    finally:
        dist.destroy_process_group()
    rows = results.read_csv(step_bench.CSV_NAME)
    assert [(r["impl"], r["bucket_mb"], r["steps"]) for r in rows] == [("none", "", "4"),
                                                                      ("torch_ddp", "25", "4")]
    assert float(rows[1]["ratio_vs_torch_ddp"]) == 1.0
    # beside the control, every round: a small call's cost in a burst; on its row only
    assert float(rows[0]["call_ms"]) > 0 and rows[1]["call_ms"] == ""
    assert float(rows[0]["async_call_ms"]) > 0 and rows[1]["async_call_ms"] == ""   # stage 05's way
    # and lesson 9's crossover inputs: backward at one row and at two rows, an all-reduce after it
    assert all(float(rows[0][k]) > 0 for k in ("bwd_one_row_ms", "bwd_two_rows_ms", "all_reduce_after_backward_ms"))


def test_a_step_stopped_at_its_cap_still_writes_its_derived_files(monkeypatch, tmp_path, capsys):
    """The bucket model is written as each swept size lands, not after the whole sweep: stage
    06 stopped (Ctrl-C) during its second bucket size has results/bucket_model.json with the
    first size in it. The profile's summary likewise: stage 05's --profile stopped during its
    second case has the first case's row in ddp_profile.csv and its picture. Past make bench's
    deadline after the first case, both skip the rest, say so and end well. One rank, here."""
    import torch.distributed as dist

    from common import import_stage

    from bench import profiling, step_bench

    from bench import supervisor as launch
    from bench import ddp_step as bucketed
    monkeypatch.setattr(bucketed, "latency_bandwidth",
                        lambda ctx: {"a_s": 1e-4, "w_bytes_per_s": 1e9, "source": "test"})
    args = argparse.Namespace(model="tiny", batch_size=2, context_length=8, steps=2, warmup=1,
                              rounds=1, case_budget_s=120.0, bucket_sizes=[0.25, 1.0, 4.0],
                              trace_dir=tmp_path / "traces")
    ctx = launch.Dist(0, 1, 0, "gloo", torch.device("cpu"))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{launch.free_port()}",
                            rank=0, world_size=1)
    try:
        timed = step_bench.time_steps
        calls = []

        def stopped_at_the_second_bucket_size(ctx_, factory, args_):
            calls.append(getattr(factory, "keywords", {}).get("bucket_size_mb"))
            if calls.count(1.0) == 1:  # none, torch DDP and 0.25 MB have run
                raise KeyboardInterrupt
            return timed(ctx_, factory, args_)
        monkeypatch.setattr(step_bench, "time_steps", stopped_at_the_second_bucket_size)
        with pytest.raises(KeyboardInterrupt):
            bucketed.sweep_and_model(ctx, args, with_earlier_stages=False)
        models = results.read_json("bucket_model.json")
        assert len(models) == 1, models
        (model,) = models.values()
        assert [float(s["bucket_mb"]) for s in model["sweep"]] == [0.25]
        assert model["measured_best_bucket_mb"] == 0.25 and model["predicted_best_bucket_mb"] > 0
        monkeypatch.setattr(step_bench, "time_steps", timed)
        monkeypatch.setenv("BENCH_STEP_DEADLINE", f"{time.time() + 1e-3:.6f}")  # after one case
        assert [r["impl"] for r in bucketed.sweep_and_model(ctx, args, False)] == ["none"]
        assert results.read_json("bucket_model.json") == models  # no bucketed row: no new model
        monkeypatch.delenv("BENCH_STEP_DEADLINE")

        profiled = profiling.profile_case
        cases = []

        def stopped_at_the_second_case(ctx_, factory, args_, path):
            cases.append(path)
            if len(cases) == 2:
                raise KeyboardInterrupt
            return profiled(ctx_, factory, args_, path)
        monkeypatch.setattr(profiling, "profile_case", stopped_at_the_second_case)
        with pytest.raises(KeyboardInterrupt):
            profiling.profile_ddp(ctx, [("naive (03)", None), ("overlap (05)", None)], args,
                                  name="05_overlap_ddp")
        monkeypatch.setattr(profiling, "profile_case", profiled)
        monkeypatch.setenv("BENCH_STEP_DEADLINE", f"{time.time() + 1e-3:.6f}")  # after one case
        capsys.readouterr()
        assert [s["case"] for s in profiling.profile_ddp(
            ctx, [("naive (03)", None), ("overlap (05)", None)], args, name="05_overlap_ddp")] \
            == ["naive (03)"]
        assert "the cases left: skipped: past make bench's deadline" in capsys.readouterr().out
    finally:
        dist.destroy_process_group()
    rows = results.read_csv(profiling.PROFILE_CSV)
    assert [(r["stage"], r["case"]) for r in rows] == [("05_overlap_ddp", "naive (03)")]
    assert float(rows[0]["step_ms"]) > 0
    if results.pyplot() is not None:
        assert (tmp_path / "traces" / "05_overlap_ddp" / "timeline.png").exists()


def test_each_step_runs_to_its_deadline_and_the_budget_holds():
    """A step's deadline is the start plus the caps so far: time a quick step leaves passes on,
    an overrun comes out of the next step, one left under its minimum is skipped; the last
    ends by the budget even when every script ignores its Ctrl-C and is killed late."""
    now = [0.0]
    steps = make_bench.plan(make_bench.pick_setup(1, "GPU"), quick=False, model="small")
    make_bench.plan_budget(steps, 510)
    given = []

    def overrun(step, cap):  # takes all it may, ignores Ctrl-C, and is killed late
        given.append((step.key, cap))
        step.seconds = cap + make_bench.STOP_S
        step.status = "stopped"
        now[0] += step.seconds
    make_bench.run_all(steps, run=overrun, clock=lambda: now[0])
    assert now[0] <= 510 + 1e-9 and given[0] == (steps[0].key, pytest.approx(steps[0].cap_s))
    assert given[1] == (steps[1].key, pytest.approx(steps[1].cap_s - make_bench.STOP_S))
    ran = dict(given)
    for s in steps:  # each runs with at least its minimum, or is skipped with less left (time a
        if s.key in ran:  # skipped step leaves passes on)
            assert ran[s.key] >= s.min_s, s
        elif s.key != "prediction":  # (with nothing it checks run: skipped with a note)
            assert s.status.startswith("skipped: the steps before it ran over"), s
    assert len(ran) >= len(steps) - 3
    now[0] = 0.0
    given.clear()

    def quick(step, cap):  # the first step needs 1 s: its time passes on to the second
        given.append(cap)
        step.status = "ok"
        step.seconds = 1.0
        now[0] += 1.0
    make_bench.run_all(steps, run=quick, clock=lambda: now[0])
    assert given[:2] == pytest.approx([steps[0].cap_s, steps[1].cap_s + steps[0].cap_s - 1])
    now[0] = 0.0
    steps = make_bench.plan(make_bench.pick_setup(0), quick=True, model="tiny")
    make_bench.plan_budget(steps, make_bench.DEFAULT_BUDGET_S[True])

    def hang(step, cap):  # the first overruns by a minute: the next is left under its minimum
        step.status = "stopped"
        now[0] += cap + 60
    make_bench.run_all(steps[:3], run=hang, clock=lambda: now[0])
    assert steps[1].status.startswith("skipped: the steps before it ran over, 0 s was left")


def test_a_full_run_leaves_15_percent_of_its_budget_unplanned():
    """Caps that added up to 500 of 510 s left a plan living on earlier steps finishing early."""
    for gpus in (0, 1, 8):
        setup = make_bench.pick_setup(gpus, "GPU")
        steps = make_bench.plan(setup, False, make_bench.bench_model(setup, False))
        budget = make_bench.default_budget_s(False, gpus)
        make_bench.plan_budget(steps, budget, make_bench.UNPLANNED_FULL)
        assert sum(s.cap_s for s in steps) <= 0.85 * budget - make_bench.STOP_S + 1e-6, gpus
        assert all(s.cap_s >= s.share_s for s in steps), (gpus, steps)


def test_the_prediction_is_skipped_with_a_note_when_nothing_it_checks_ran():
    """BENCH_QUICK=1 BENCH_BUDGET_S=60 skipped the DDP, ledger and grid steps, and the
    prediction then failed the whole run (exit 1): it has nothing to compare, so it is skipped
    with a note and does not count as a failure. With one of them run, it runs."""
    steps = make_bench.plan(make_bench.pick_setup(0), quick=True, model="tiny")
    make_bench.plan_budget(steps, make_bench.DEFAULT_BUDGET_S[True])
    ran = []

    def skip_what_it_reads(step, cap):
        ran.append(step.key)
        step.status = "stopped" if step.key in make_bench.PREDICTION_READS else "ok"
    make_bench.run_all(steps, run=skip_what_it_reads, clock=lambda: 0.0)
    prediction = next(s for s in steps if s.key == "prediction")
    assert "prediction" not in ran and prediction.status == make_bench.NOTHING_TO_CHECK
    ran.clear()
    make_bench.run_all(steps, run=lambda step, cap: (ran.append(step.key),
                                                     setattr(step, "status", "ok")),
                       clock=lambda: 0.0)
    assert "prediction" in ran  # the negative control


def test_a_second_make_bench_on_one_folder_is_refused_in_one_line(tmp_path, capsys):
    """Two make bench at once on one results folder shared a run id and mixed their rows."""
    held = make_bench.take_the_lock(tmp_path)
    try:
        with pytest.raises(SystemExit) as e:
            make_bench.take_the_lock(tmp_path)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "another make bench is writing" in err[0]
    finally:
        os.close(held)
    os.close(make_bench.take_the_lock(tmp_path))  # free again once the first has ended


# --------------------------------------------------------------------------- signals
# make bench with a plan of two tiny steps: one writes rows the report shows, the other is a
# real launcher with two busy ranks, to be stopped from outside.
BENCH_DRIVER = """
import sys
from bench import make_bench

def tiny_plan(setup, quick, model, trace_dir):
    return [make_bench.Step("tp", "rows", [sys.argv[1]], share_s=20, min_s=2),
            make_bench.Step("busy", "busy ranks", ["tests/fault_worker.py", "--fault", "busy",
                            "--backend", "gloo", "--device", "cpu"], share_s=60, min_s=2)]

make_bench.plan = tiny_plan
make_bench.main()
"""
ROWS_STEP = """
import csv, os
with open(os.path.join(os.environ["RESULTS_DIR"], "tensor_parallel.csv"), "w") as f:
    writer = csv.writer(f)
    writer.writerow(["world_size", "tokens", "d_model", "d_ff", "variant", "phase",
                     "bytes_counted", "run_id"])
    for variant, n in (("megatron", 1000), ("allgather", 5000)):
        for phase in ("forward", "backward"):
            writer.writerow([2, 8, 4, 8, variant, phase, n, os.environ["RESULTS_RUN_ID"]])
"""
PREVIOUS_REPORT = {"README.md": "the previous report", "bench_old.png": "its picture",
                   "bench_run.json": '{"run_id": "previous"}'}


def test_sigterm_or_sigkill_to_make_bench_stop_its_step_and_every_rank(tmp_path):
    """SIGTERM or SIGKILL to ``make bench`` used to leave the running step and its ranks alive
    (in their own session) and the report's pictures deleted, and a ``launch-errors-*`` folder.
    Now, 6 s after the signal, nothing of the step is alive and no temporary file is left.
    (SIGINT takes SIGTERM's path in make bench: the test above; the launcher's answer to SIGINT
    alone: tests/test_faults.py's Ctrl-C test.)"""
    (tmp_path / "rows.py").write_text(ROWS_STEP)
    runs = {}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        out = tmp_path / sig.name / "results"
        out.mkdir(parents=True)
        for name, text in PREVIOUS_REPORT.items():
            (out / name).write_text(text)
        runs[sig] = start_script(["-c", BENCH_DRIVER, tmp_path / "rows.py"],
                                 tmp_path / sig.name / "tmp",
                                 env={"RESULTS_DIR": str(out), "BENCH_BUDGET_S": "100"})
    stages = {}  # signal: the step's pid, which is also its session's id
    ranks = {}
    signalled = {}
    for sig, proc in runs.items():
        lines = []
        wait_for_line(proc, r"\[rank 1\] pid \d+ busy", lines)
        if "[rank 0]" not in "".join(lines):
            wait_for_line(proc, r"\[rank 0\] pid \d+ busy", lines)
        ranks[sig] = [int(p) for p in re.findall(r"pid (\d+) busy", "".join(lines))]
        rank_stat = Path(f"/proc/{ranks[sig][0]}/stat").read_text()
        stages[sig] = int(rank_stat.rsplit(")", 1)[1].split()[3])  # the rank's session
        in_session = session(stages[sig])
        assert stages[sig] in in_session and set(ranks[sig]) <= set(in_session), in_session
        proc.send_signal(sig)  # to make bench alone: the step is in a session of its own
        signalled[sig] = time.monotonic()
    for sig, proc in runs.items():
        code = proc.wait(timeout=30)
        if code != (-9 if sig == signal.SIGKILL else 128 + sig):   # say why: its stderr
            _, err = proc.communicate(timeout=30)
            raise AssertionError(f"{sig.name}: exit {code}\n{err[-3000:]}")
    for sig in runs:  # before reading the outputs to their end: a live step would hold them open
        time.sleep(max(0.0, signalled[sig] + 6 - time.monotonic()))
        assert session(stages[sig]) == [] and not any(alive(p) for p in ranks[sig]), sig
        assert not list((tmp_path / sig.name / "tmp").iterdir()), f"{sig.name}: temporary files"
        assert [p.name for p in (tmp_path / sig.name / "results").iterdir()
                if p.name.startswith(".")] == [], f"{sig.name}: the report's temporary folder"
    for sig, proc in runs.items():
        out, err = proc.communicate(timeout=30)
        report = tmp_path / sig.name / "results"
        if sig == signal.SIGKILL:  # nothing written: the previous report is whole
            assert {p.name: p.read_text() for p in report.iterdir()
                    if p.name != "tensor_parallel.csv"} == PREVIOUS_REPORT
            continue
        assert "Traceback" not in err and f"stopped by {sig.name}: all 2 ranks ended; results " \
            "written before this point are kept" in err.splitlines(), err[-3000:]
        assert f"[bench 2/2] busy ranks: stopped by {sig.name} (exit {128 + sig}) in " in out, out
        text = (report / "README.md").read_text()  # the report of the steps that finished
        assert f"| busy ranks | stopped by {sig.name} (exit {128 + sig}) |" in text
        assert "moves 5.0x Megatron's bytes" in text and not (report / "bench_old.png").exists()


# --------------------------------------------------------------------------- the report


def _write_csv(path, rows):
    columns = list(rows[0])
    for row in rows:  # a union, in order: grid.csv's rows differ by kind, as the lesson's do
        columns += [key for key in row if key not in columns]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def _fixture(out, gpus=0):
    """Result files as the stages write them: known numbers for run r1, and a stale row of an
    older run r0 in every file, which the report must leave out."""
    out.mkdir(parents=True, exist_ok=True)
    setup = make_bench.pick_setup(gpus, "NVIDIA H100 80GB HBM3")
    (out / "bench_run.json").write_text(json.dumps({
        "run_id": "r1", "quick": False, "model": "tiny", "setup": setup.__dict__,
        "machine": "test box", "cpu_cores": 2, "torch": "2.x", "started_utc": "now",
        "total_s": 100.0, "budget_s": 510, "steps": [
            {"key": key, "title": f"step {key}", "argv": ["x.py"], "cap_s": 1, "status": "ok",
             "seconds": 12.0} for key in KEYS]}))
    _write_csv(out / "allreduce.csv", [
        {"backend": "gloo", "device": "cpu", "world_size": 2, "bytes": n, "impl": impl,
         "time_ms_median": t * f, "busbw_gbps": (777.0 if rid == "r0" else 1.0) / f * n / 2**24,
         "run_id": rid}
        for rid in ("r1", "r0") for n, t in ((2**20, 2.0), (16 * 2**20, 11.0))
        for impl, f in (("backend", 1.0), ("ring", 2.0), ("ring_pipelined", 1.25))])
    fit = {"backend": "gloo", "device": "cpu", "world_size": 2, "a_s": 0.001,
           "w_bytes_per_s": 1e9, "points": [{"rel_error": 0.02}, {"rel_error": -0.05}]}
    (out / "allreduce_fit.json").write_text(json.dumps(
        {"gloo/cpu/2": {**fit, "run_id": "r1"}, "gloo/cpu/4": {**fit, "run_id": "r0"}}))
    base = {"backend": "gloo", "device": "cpu", "world_size": 2, "model": "tiny",
            "params": 1400000, "batch_size": 8, "context_length": 64, "optimizer_ms": 10.0}
    _write_csv(out / "ddp_step.csv", [
        {**base, "impl": impl, "bucket_mb": b, "step_ms": step, "fwd_bwd_ms": step - comm - 10,
         "comm_after_backward_ms": comm, "ratio_vs_torch_ddp": step / 100.0,
         "run_id": "r0" if step == 99999.0 else "r1"}
        for impl, b, step, comm in (("none", "", 50.0, 0.0), ("torch_ddp", 25, 100.0, 1.0),
                                    ("naive", "", 180.0, 70.0), ("flat", "", 130.0, 20.0),
                                    ("overlap", "", 120.0, 8.0), ("bucketed", 1.0, 94.0, 3.0),
                                    ("bucketed", 4.0, 99.0, 5.0), ("naive", "", 99999.0, 0.0))])
    (out / "bucket_model.json").write_text(json.dumps({"gloo/cpu/2/tiny": {
        "run_id": "r1", "model": "tiny", "gradient_bytes": 5 * 2**20, "o_s": 0.001,
        "w_bytes_per_s": 1e9, "fit_source": "stage 02", "predicted_best_bucket_mb": 2.2,
        "measured_best_bucket_mb": 1.0, "neighbour_range_mb": [1.0, 4.0],
        "prediction_within_neighbours": True, "sweep": [
            {"bucket_mb": 1.0, "buckets": 6, "measured_step_ms": 94.0,
             "measured_comm_after_bwd_ms": 3.0, "model_comm_after_bwd_ms": 2.5}]}}))
    _write_csv(out / "ddp_profile.csv", [
        {"stage": "05_overlap_ddp", "case": case, "step_ms": 100.0, "backward_ms": 40.0,
         "collectives": 26, "comm_during_backward_ms": d, "comm_after_backward_ms": a,
         "run_id": "r1"} for case, d, a in (("naive (03)", 0.0, 40.0), ("overlap (05)", 30.0, 10.0))])
    _write_csv(out / "tensor_parallel.csv", [
        {"world_size": 2, "tokens": 128, "d_model": 64, "d_ff": 256, "variant": v,
         "phase": phase, "bytes_counted": n, "run_id": "r1"}
        for v, n in (("megatron", 1000), ("allgather", 5000)) for phase in ("forward", "backward")])
    _write_csv(out / "pipeline_bubble.csv", [
        {"backend": "gloo", "device": "cpu", "world_size": 4, "batch": 64, "schedule": s,
         "micro_batches": 8, "chunks": 2 if s == "interleaved" else 1, "emulated_ms": emu,
         "rank": rank, "idle_share": sim + (0.3 if emu == 0 else 0.01 * (rank + 1)),
         "idle_share_simulated": sim, "idle_share_formula": sim, "peak_held": 4, "step_ms": 50.0,
         "run_id": "r1"}
        for s, sim in (("gpipe", 3 / 11), ("1f1b", 3 / 11), ("interleaved", 3 / 19), ("zbh1", 3 / 27))
        for emu in (0, 20) for rank in range(4)])
    _write_csv(out / "sharding.csv", [
        {"backend": "gloo", "device": "cpu", "world_size": 2, "model": "tiny", "impl": impl,
         "checkpointing": "off", "step_ms": 100.0, "param_bytes": p, "param_bytes_predicted": p,
         "grad_bytes": g, "grad_bytes_predicted": g, "optim_bytes": 2 * p, "optim_bytes_predicted": 2 * p,
         "peak_bytes": "", "activation_bytes": 2**20, "sent_bytes": 3 * 2**20,
         "sent_bytes_predicted": 3 * 2**20, "run_id": "r1"}
        for impl, p, g in (("ddp", 4 * 2**20, 4 * 2**20), ("fsdp", 2 * 2**20, 2**20))])
    _write_csv(out / "compute.csv", [
        {"device": "cpu", "dtype": "float32", "model": "tiny", "params": 1383680,
         "nonembedding_params": 739584, "batch_size": 4, "context_length": 64, "fwd_ms": 10.0,
         "bwd_ms": 20.0, "optimizer_ms": 5.0, "step_ms": 35.0, "tokens_per_s": 7314.0,
         "flops_per_token": 4535808, "achieved_tflops": 0.0332, "peak_tflops": 0.5, "mfu": 0.0664,
         "optimizer_gbps": 1.1, "copy_gbps": 10.0, "max_memory_allocated_bytes": "",
         "memory_total_bytes": "", "run_id": rid} for rid in ("r0", "r1")])
    (out / "matmul_peak.json").write_text(json.dumps({"cpu": {
        "device": "cpu", "matmul_n": 1024, "matmul_flops_per_s": 0.5e12,
        "copy_bytes_per_s": 1e10, "run_id": "r1"}}))
    _fixture_07(out)


def _fixture_07(out):
    """Lessons 3 (sequence parallel), 5-8's result files, known numbers for run r1 and a stale
    row of r0 in each."""
    same = {"backend": "gloo", "device": "cpu", "world_size": 2, "tokens": 32, "d_model": 8,
            "d_ff": 16, "heads": 2}
    rows = [{**same, "what": "bytes", "block": "TP", "phase": "forward", "bytes": 99999,
             "formula": "", "ring_bytes_sent_per_rank": 99999, "run_id": "r0"}]
    for block, payload in (("TP", 2048), ("TP + SP", 4096), ("torch TP + SP", 4096)):
        for phase in ("forward", "backward"):
            rows.append({**same, "what": "bytes", "block": block, "phase": phase,
                         "bytes": payload, "formula": "", "ring_bytes_sent_per_rank": 2048,
                         "run_id": "r1"})
    for block, layernorms, rest in (("one process", 1000, 4000), ("TP", 1000, 3000),
                                    ("TP + SP", 500, 3000), ("torch TP + SP", 500, 3000)):
        for what, saved in (("saved layernorms", layernorms), ("saved rest", rest)):
            rows.append({**same, "what": what, "block": block, "phase": "forward",
                         "bytes": saved, "formula": saved, "ring_bytes_sent_per_rank": "",
                         "run_id": "r1"})
    _write_csv(out / "sequence_parallel.csv", rows)
    same = {"backend": "gloo", "device": "cpu", "batch": 1, "heads": 2, "head_dim": 4}
    rows = [{**same, "seq": 777, "impl": "full, sdpa", "W": 1, "layout": "-", "compute": "real",
             "step_ms": 1.0, "sent_bytes": 0, "bytes_formula": 0, "imbalance": 1.0,
             "imbalance_formula": 1.0, "saved_bytes": 1, "saved_formula": 1, "peak_bytes": 0,
             "run_id": "r0"}]
    for seq in (64, 128):
        for impl, step in (("full, sdpa", 1.0), ("full, our kernel", 2.0)):
            rows.append({**same, "seq": seq, "impl": impl, "W": 1, "layout": "-",
                         "compute": "real", "step_ms": step, "sent_bytes": 0, "bytes_formula": 0,
                         "imbalance": 1.0, "imbalance_formula": 1.0, "saved_bytes": 4096,
                         "saved_formula": 4096, "peak_bytes": 0, "run_id": "r1"})
        for world_size, layout, imbalance, real, emulated in (
                (2, "contiguous", 1.49, 8.0, 80.0), (2, "zigzag", 1.0, 7.0, 56.0),
                (4, "contiguous", 1.74, 10.0, 100.0), (4, "zigzag", 1.0, 12.0, 60.0)):
            row = {**same, "seq": seq, "impl": "ring", "W": world_size, "layout": layout,
                   "compute": "real", "step_ms": real, "sent_bytes": 1024 * world_size,
                   "bytes_formula": 1024 * world_size, "imbalance": imbalance,
                   "imbalance_formula": 2 - 1 / world_size if layout == "contiguous" else 1.0,
                   "saved_bytes": 2048, "saved_formula": 2048, "peak_bytes": 0, "run_id": "r1"}
            rows.append(row)
            if seq == 128:  # emulated compute at the longest sequence only
                rows.append({**row, "compute": "emulated 400 ms", "step_ms": emulated})
        for world_size, real, emulated in ((2, 5.0, 28.0), (4, 6.0, 30.0)):  # Ulysses, contiguous
            row = {**same, "seq": seq, "impl": "ulysses", "W": world_size, "layout": "contiguous",
                   "compute": "real", "step_ms": real, "sent_bytes": 512, "bytes_formula": 512,
                   "imbalance": 1.0, "imbalance_formula": 1.0, "saved_bytes": 2048,
                   "saved_formula": 2048, "peak_bytes": 0, "run_id": "r1"}
            rows.append(row)
            if seq == 128:
                rows.append({**row, "compute": "emulated 400 ms", "step_ms": emulated})
    _write_csv(out / "context_parallel.csv", rows)
    same = {"backend": "gloo", "device": "cpu", "d_model": 16, "d_ff": 32, "num_experts": 8,
            "top_k": 2}
    rows = [{**same, "world_size": 8, "measure": "step", "routing": "random",
             "capacity_factor": "dropless", "tokens_per_rank": 64, "replicated_ms": 777.0,
             "expert_parallel_ms": 777.0, "ep_over_replicated": 1.0, "bytes_sent_counted": 1,
             "bytes_sent_formula": 1, "dispatch_bytes": 1, "uniform_bytes_per_exchange": 1,
             "expert_bytes_replicated": 8192, "expert_bytes_per_rank": 1024, "share": 0.125,
             "router_bytes": 64, "run_id": "r0"}]
    for world_size in (2, 4):
        for tokens in (64, 128):
            rows.append({**same, "world_size": world_size, "measure": "step", "routing": "random",
                         "capacity_factor": "dropless", "tokens_per_rank": tokens,
                         "replicated_ms": 10.0, "expert_parallel_ms": 15.0,
                         "ep_over_replicated": 1.5, "bytes_sent_counted": 40 * tokens,
                         "bytes_sent_formula": 40 * tokens, "dispatch_bytes": 1000,
                         "uniform_bytes_per_exchange": 1024.0, "expert_bytes_replicated": 8192,
                         "expert_bytes_per_rank": 8192 // world_size, "share": 1 / world_size,
                         "router_bytes": 64, "run_id": "r1"})
    for routing, factor, most, dropped in (("random", "1.0", 1.02, 0.02),
                                           ("random", "dropless", 1.05, 0.0),
                                           ("skewed", "1.0", 1.6, 0.365),
                                           ("skewed", "dropless", 3.6, 0.0)):
        rows.append({**same, "world_size": 4, "measure": "load", "routing": routing,
                     "capacity_factor": factor, "tokens_per_rank": 128, "capacity_per_rank": 40,
                     "tokens_per_expert": "10 20 30 40 50 60 70 80", "rows_per_rank": "1 2 3 4",
                     "max_over_mean": most, "dropped_share": dropped, "run_id": "r1"})
    for routing, factor, most, dropped in (("random", "1.0", 7.77, 0.777),  # the smaller world
                                           ("skewed", "1.0", 6.66, 0.666)):  # size: not shown
        rows.append({**same, "world_size": 2, "measure": "load", "routing": routing,
                     "capacity_factor": factor, "tokens_per_rank": 64, "capacity_per_rank": 20,
                     "tokens_per_expert": "1 1 1 1 1 1 1 99", "rows_per_rank": "5 6",
                     "max_over_mean": most, "dropped_share": dropped, "run_id": "r1"})
    _write_csv(out / "expert_parallel.csv", rows)
    same = {"model": "tiny", "batch_size": 16, "seq_len": 64, "world_size": 4, "backend": "gloo",
            "device": "cpu", "tokens_per_s": 1000.0, "micro_batches": 1, "schedule": ""}
    kinds = ("param", "grad", "optim", "activation", "sent_tp", "sent_cp", "sent_pp",
             "sent_dp_cp", "sent_world")
    rows = [{**same, "impl": "ours", "grid": "dp4", "setting": "AdamW", "step_ms": 99999.0,
             "worst_difference": 0.0, "worst_where": "rank 0", "first_loss": 9.0, "run_id": "r0",
             **{f"{kind}_bytes": 1024 for kind in kinds},
             **{f"{kind}_bytes_formula": 1024 for kind in kinds}}]
    for grid, setting, worst, where, loss in (
            ("dp4", "AdamW", 0.0, "rank 0", 5.5), ("dp2 tp2", "ZeRO-1 AdamW", 0.012,
                                                   "rank 1 optim", 5.5000002),
            ("dp2 tp2", "AdamW, timed beside torch's", 0.0, "rank 0", 5.5)):
        row = {**same, "impl": "ours", "grid": grid, "setting": setting,
               "step_ms": 100.0 if "torch" in setting else 50.0, "worst_difference": worst,
               "worst_where": where, "first_loss": loss, "run_id": "r1",
               "pair": "fsdp_tp" if "torch" in setting else ""}
        for kind in kinds:
            row[f"{kind}_bytes"] = 2048
            row[f"{kind}_bytes_formula"] = 2048
        rows.append(row)
    for pair, impl, step_ms in (("fsdp_tp", "torch", 80.0), ("replicated_tp", "ours", 40.0),
                                ("replicated_tp", "torch", 50.0)):
        rows.append({**same, "impl": impl, "grid": "dp2 tp2", "pair": pair,
                     "setting": "parallelize_module + fully_shard, AdamW", "step_ms": step_ms,
                     "worst_difference": 0.0, "worst_where": "rank 0", "first_loss": 5.5000001,
                     "param_bytes": 1024, "param_bytes_formula": 1024, "grad_bytes": 1024,
                     "grad_bytes_formula": 1024, "optim_bytes": 2048, "optim_bytes_formula": 2048,
                     "activation_bytes": 4096, "sent_tp_bytes": 1024, "sent_dp_bytes": 512,
                     "run_id": "r1"})
    for stages, schedule, compute, ours, theirs, ideal in (
            (2, "gpipe", "emulated 10 ms", 300.0, 150.0, 140.0),  # pp 2: not a target
            (4, "gpipe", "real", 60.0, 50.0, 0.0), (4, "gpipe", "emulated 10 ms", 105.0, 100.0, 90.0),
            (4, "1f1b", "real", 55.0, 50.0, 0.0), (4, "1f1b", "emulated 10 ms", 99.0, 100.0, 90.0),
            (4, "dualpipev", "emulated 10 ms", 102.0, 100.0, 95.0)):   # the V: 2 chunks a rank
        for impl, step in (("ours", ours), ("torch", theirs)):
            rows.append({**same, "impl": impl, "grid": f"pp{stages}", "model": "8 tiny blocks",
                         "setting": f"{schedule}, {compute}", "micro_batches": 8,
                         "step_ms": step, "schedule": schedule,
                         "compute": compute.split()[0], "stages": stages, "ideal_ms": ideal,
                         "run_id": "r1"})
    _write_csv(out / "grid.csv", rows)
    same = {"model": "course", "backend": "gloo", "device": "cpu", "manifest_bytes": 2048}
    rows = [{**same, "impl": "ours", "op": "save", "saved_at": 2, "loaded_at": 8, "ranks": 2,
             "time_ms_median": 99999.0, "data_bytes_max": 1, "data_bytes_total": 1,
             "kernel_bytes_max": 1, "run_id": "r0"}]
    for saved_at, loaded_at, op, ours, theirs, ranks in ((2, 4, "save", 150.0, 100.0, 2),
                                                         (2, 4, "load", 50.0, 100.0, 4),
                                                         (4, 2, "save", 120.0, 100.0, 4),
                                                         (4, 2, "load", 80.0, 100.0, 2)):
        for impl, ms in (("ours", ours), ("torch_dcp", theirs)):
            data = {"data_bytes_max": 1000000 // ranks, "data_bytes_total": 1000000}
            if impl == "torch_dcp":
                data = {"data_bytes_max": "", "data_bytes_total": ""}
            rows.append({**same, "impl": impl, "op": op, "saved_at": saved_at,
                         "loaded_at": loaded_at, "ranks": ranks, "time_ms_median": ms, **data,
                         "kernel_bytes_max": 1100000 // ranks, "run_id": "r1"})
    _write_csv(out / "checkpoint.csv", rows)
    _write_csv(out / "prediction.csv", [
        {"config": "ddp_step flat, tiny, 2 ranks", "source": "ddp_step.csv", "world_size": 2,
         "predicted_ms": 1.0, "measured_ms": 9.0, "ratio": 0.11, "run_id": "r0"},
        {"config": "ddp_step flat, tiny, 2 ranks", "source": "ddp_step.csv", "world_size": 2,
         "predicted_ms": 55.0, "measured_ms": 50.0, "ratio": 1.1, "run_id": "r1"},
        {"config": "ledger fsdp, tiny, 2 ranks", "source": "sharding.csv", "world_size": 2,
         "predicted_ms": 90.0, "measured_ms": 60.0, "ratio": 1.5, "run_id": "r1"}])


def test_report_from_known_numbers(tmp_path):
    out = tmp_path / "results"
    _fixture(out)
    path, empty = report.write_report(out)
    text = path.read_text()
    assert empty == [] and "Machine: **test box**" in text and "A CPU-only run" in text
    for title, _ in report.SECTIONS:
        assert f"## {title}" in text
    assert "No rows from this run" not in text and "This section failed" not in text
    assert "BucketedDDP at its best bucket size (1.0 MB) takes 0.94x torch DDP's step time" in text
    assert "| BucketedDDP (best bucket) vs torch DDP, step time | 0.94x (94.0 vs 100.0 ms" in text
    assert "textbook 0.50-0.50x the backend's busbw, pipelined 0.80-0.80x" in text
    assert "the prediction lies within the best and its neighbours [1, 4] MB" in text
    assert "moves 5.0x Megatron's bytes" in text
    assert "within 0.040 of its simulation" in text  # the emulated rows' largest gap
    assert "naive (03) 0%, overlap (05) 75%" in text
    assert "| fsdp | off | 100 | 2MB (2MB) | 1MB (1MB) |" in text
    # lessons 3 (sequence parallel) and 5-8
    assert "| 2 | TP + SP | 4KB | 4KB | 4KB | 500B (500B) | 2.93KB (2.93KB) | 3.42KB |" in text
    assert ("carry 2.0x the payload of plain TP's all-reduces, and a ring sends the same bytes per "
            "rank for them (4KB vs 4KB)") in text
    assert "keep 0.50x plain TP's activations per rank (target 1/t = 0.50: met)" in text
    assert ("| sequence parallel, 2 ranks: LayerNorm activations saved per rank, TP + SP vs TP | "
            "0.50x (1/t = 0.50); ring bytes per rank equal |") in text
    assert "| seq | full, sdpa | full, our kernel | W=2 contiguous | W=2 zigzag | W=4 contiguous |" in text
    assert "| 128 | 1 | 2 | 8 | 7 | 10 | 12 |" in text
    assert "| 4 | contiguous | 4KB (4KB) | 1.740 (1.750) | 2KB (2KB) |" in text
    assert "| 4 | 1.2 | 0.6 | 0.571 |" in text  # real, emulated, ideal 4/7 (Ulysses' rows apart)
    assert "| 128 | 4 | emulated 400 ms | 4KB (4KB) | 512B (512B) | 60 | 30 | 0.50x |" in text
    assert ("contiguous is 1.740, 0.6% from 2 - 1/W = 1.750 (target within 2%: met). With "
            "emulated 400 ms compute, zig-zag's step takes 0.60x contiguous's at W=4 (target <= "
            "0.75 at W=4: met; ideal 0.57); with real compute 1.20x, which on a CPU box") in text
    assert "| 4 | 128 | 10 | 15 | 1.50x | 5KB (5KB) | 1000B (1KB) |" in text
    assert "equal the formula in 4 of 4 rows" in text
    assert "0.5 at W=2 (exactly 1/W), 0.25 at W=4 (exactly 1/W)" in text
    assert "| skewed | 1.0 | 1.6 | 36.5% | 10 20 30 40 50 60 70 80 |" in text
    assert "drops 36.5% of the assignments; dropless keeps them all, at 3.60x" in text
    assert "| dp2 tp2 | ZeRO-1 AdamW | 50 | 1000 | 2.0 (2.0) | 2.0 (2.0) | 2.0 (2.0) |" in text
    assert "worst 1.20% (dp2 tp2, ZeRO-1 AdamW, rank 1 optim; target within 5%: met)" in text
    assert "fsdp_tp: our dp2 tp2 step takes 1.25x torch's (100.0 vs 80.0 ms; target <= 1.25x: met)" in text
    assert "replicated_tp: our dp2 tp2 step takes 0.80x torch's (40.0 vs 50.0 ms; target <= 1.25x: met)" in text
    assert "parallelize_module + fully_shard:" not in text      # no ratio across the pairs
    assert "differ by at most 2.0e-07" in text
    assert "| pp4 | gpipe | emulated 10 ms | 105 | 100 | 1.05x | 90 |" in text
    assert "gpipe 1.05x, 1f1b 0.99x, dualpipev 1.02x (target <= 1.10x: met)" in text
    assert "| pp4 | dualpipev | emulated 10 ms | 102 | 100 | 1.02x | 95 |" in text
    assert ("| our pipeline executor vs torch.distributed.pipelining, pp 4, emulated | 1.05x at "
            "worst (gpipe; target <= 1.10x) |") in text
    assert "| 2 -> 4 | save | 2 | 150 | 100 | 1.50x | 488KB | 977KB | 2KB | 537KB | 537KB |" in text
    assert "Ours takes 0.50x to 1.50x torch's time (target <= 1.5x: met in 4 of 4)" in text
    assert "| ledger fsdp, tiny, 2 ranks | 90 | 60 | 1.50x |" in text
    assert ("Within 25%: 1 of 2. The worst: ledger fsdp, tiny, 2 ranks, predicted 1.50x the "
            "measured") in text
    assert "all ranks together wrote the same 977KB of data" in text
    assert ("| checkpoints: save and load time vs torch.distributed.checkpoint | 1.50x at worst "
            "(save 2 -> 4 ranks; target <= 1.5x; LM course) |") in text
    # compute on one device, and tokens/s and MFU beside the DDP step times (tiny LM, batch 8 x
    # 64 = 512 tokens in 100 ms: 5120 tokens/s; 4535808 FLOPs per token; peak 0.5 TFLOP/s)
    assert ("| tiny | 1.4M | 4 x 64 | 10 | 20 | 5 | 7314 | 0.0332 of 0.5 | 6.6% | 1.1 of 10 | - |"
            in text)
    assert "a 1024^3 float32 matmul at 0.50 TFLOP/s" in text
    assert "| torch DDP (25 MB buckets) | 100 | 89 | 1 | 10 | 1.00x | 5120 | 4.6% |" in text
    assert "99999" not in text and "777" not in text and "| gloo/cpu | 4 |" not in text
    if results.pyplot() is not None:
        for name in ("bench_ddp_step.png", "bench_sharding_bytes.png"):
            assert (out / name).stat().st_size > 1000 and f"]({name})" in text
    assert [p.name for p in out.iterdir() if p.name.startswith(".report-")] == []


def test_mfu_arithmetic_against_a_hand_computation():
    """The course LM (d_model 512, d_ff 1344, 4 layers, 16 heads of 32, vocabulary 10000) at
    context 256, computed by hand:
      per block: qkv 512 x 1536 = 786432, out 512 x 512 = 262144, MLP 512 x 1344 + 1344 =
      689472 and 1344 x 512 + 512 = 688640, two LayerNorms 2 x 1024 = 2048: 2428736;
      N = 4 x 2428736 + final LayerNorm 1024 + LM head 512 x 10000 = 14835968 (the token and
      position tables left out);
      FLOPs per token = 6 N + 12 L H Q T = 89015808 + 12 x 4 x 16 x 32 x 256 (6291456)
      = 95307264;
      4 sequences x 256 tokens in 20 ms (forward 5, backward 10, AdamW 5) = 51200 tokens/s;
      achieved 95307264 x 51200 = 4.8797319168e12 FLOP/s; against a measured 50 TFLOP/s peak,
      MFU = 0.097594638336."""
    from bench import compute
    assert compute.nonembedding_parameters("course", 256) == 14835968
    assert compute.flops_per_token("course", 256) == 95307264
    assert compute.mfu(95307264, 51200, 50e12) == pytest.approx(0.097594638336, rel=1e-12)
    measured = {"forward": 0.005, "backward": 0.010, "optimizer": 0.005, "params": 20087040,
                "max_memory_allocated": None}
    peak = {"matmul_flops_per_s": 50e12, "copy_bytes_per_s": 1e12}
    row = compute.make_row("course", 4, 256, torch.device("cpu"), measured, peak)
    assert row["tokens_per_s"] == pytest.approx(51200)
    assert row["achieved_tflops"] == pytest.approx(4.8797319168)
    assert row["mfu"] == pytest.approx(0.097594638336, rel=1e-12) and row["peak_tflops"] == 50
    assert row["optimizer_gbps"] == pytest.approx(28 * 20087040 / 0.005 / 1e9)
    # the report's MFU of a DDP row: all ranks' tokens over the devices doing the work (one GPU
    # shared over Gloo; a GPU per rank over NCCL)
    ddp = {"model": "course", "batch_size": 8, "context_length": 256, "step_ms": 40.0,
           "world_size": 2, "backend": "gloo", "device": "cuda"}
    tokens_per_s, mfu = report.model_flops_utilisation(ddp, peak)
    assert tokens_per_s == pytest.approx(51200) and mfu == pytest.approx(0.097594638336)
    tokens_per_s, mfu = report.model_flops_utilisation({**ddp, "backend": "nccl"}, peak)
    assert mfu == pytest.approx(0.097594638336 / 2)


def test_a_one_gpu_report_labels_gloos_host_path_and_reads_as_a_gpu_report(tmp_path):
    """On one GPU the ranks' collectives cross host memory: every section whose rows ran CUDA
    tensors over Gloo says so beside its timings (the sharding section: not a comparison of
    strategies), the header says what each kind of figure describes; NCCL rows carry no such
    label."""
    out = tmp_path / "results"
    _fixture(out, gpus=1)
    for name in ("allreduce.csv", "ddp_step.csv", "sharding.csv"):
        rows = results.read_csv(name, out)
        _write_csv(out / name, [{**r, "device": "cuda"} for r in rows])
    text = report.write_report(out)[0].read_text()
    assert "A one-GPU run, read as such" in text and "A CPU-only run" not in text
    assert "(gloo/cuda, 2 ranks; Gloo's host path, not an interconnect) |" in text  # headline
    sections = {title: text.split(f"## {title}\n\n")[1].split("\n## ")[0]
                for title, _ in report.SECTIONS}
    for title, claim in ((report.SECTIONS[1][0], "the bus bandwidth below is that path's"),
                         (report.SECTIONS[2][0], "not what each costs on NCCL"),
                         (report.SECTIONS[8][0], "not a comparison of strategies")):
        assert sections[title].startswith("> **Gloo's host path, not an interconnect.**"), title
        assert claim in sections[title] and "GPU -> pinned host memory -> loopback TCP" in text
    assert "host path" not in sections[report.SECTIONS[7][0]]  # pipeline rows: gloo/cpu here
    assert report.host_path_note([{"backend": "nccl", "device": "cuda"}], "x") == ""


def test_report_shows_the_expert_load_of_the_largest_world_size(tmp_path):
    """The expert-parallel load table comes from the largest world size measured: the fixture
    has load rows at 2 and 4 ranks with different numbers, and only 4's are shown."""
    out = tmp_path / "results"
    _fixture(out)
    text = report.write_report(out)[0].read_text()
    section = text.split("## Expert parallelism")[1].split("\n## ")[0]
    assert "Load on 4 ranks, 128 tokens per rank" in section
    assert "| skewed | 1.0 | 1.6 | 36.5% | 10 20 30 40 50 60 70 80 |" in section
    assert "Load on 2 ranks" not in section
    for smaller in ("7.77", "6.66", "77.7%", "66.6%", "1 1 1 1 1 1 1 99"):
        assert smaller not in section, smaller


def test_report_says_what_is_missing_and_one_bad_file_costs_one_section(tmp_path, monkeypatch,
                                                                        capsys):
    out = tmp_path / "results"
    _fixture(out, gpus=1)
    for name in ("ddp_step.csv", "bucket_model.json", "sharding.csv"):
        (out / name).unlink()
    (out / "ddp_profile.csv").write_text("run_id,stage\nr1,05_overlap_ddp\n")  # columns lost
    info = json.loads((out / "bench_run.json").read_text())  # a quick run: no grids planned
    info["steps"] = [step for step in info["steps"] if step["key"] != "grid"]
    (out / "bench_run.json").write_text(json.dumps(info))
    (out / "grid.csv").unlink()
    path, empty = report.write_report(out)
    text = path.read_text()
    assert "1 x NVIDIA H100 80GB HBM3" in text and "NCCL refuses two ranks" in text
    assert "CPU-only" not in text and text.count("No rows from this run") == 3
    assert empty == [report.SECTIONS[i][0] for i in (2, 3, 8, 11)]
    assert f"## {report.SECTIONS[11][0]}\n\n{report.NOT_PLANNED}" in text
    assert "This section failed: KeyError" in text and "## Pipeline schedules" in text
    monkeypatch.setattr(results, "tabulate", None)  # a GPU box's Python may lack tabulate
    assert results.print_table([{"impl": "naive", "step_ms": 12.3456}]).splitlines() == [
        "| impl | step_ms |", "|---|---|", "| naive | 12.35 |"]


@pytest.mark.parametrize("run_file", [None, "{", "[]", '{"run_id": "r1"}'])
def test_report_py_on_a_fresh_clone(run_file, tmp_path, monkeypatch, capsys):
    """No run record (a fresh clone, stages run by hand), or a torn or wrong one: a traceback
    (KeyError: 'run_id') before. Now every section shows the last run that wrote its file and
    names it, and the command line says which sections have no data."""
    out = tmp_path / "results"
    _fixture(out)
    (out / "bench_run.json").unlink()
    if run_file is not None:
        (out / "bench_run.json").write_text(run_file)
    (out / "sharding.csv").unlink()
    monkeypatch.setenv("RESULTS_DIR", str(out))
    monkeypatch.setattr(results, "pyplot", lambda: None)  # no plots: not what this tests
    report.main()
    printed, err = capsys.readouterr()
    assert printed == (f"report: {out / 'README.md'} (no data for: {report.SECTIONS[3][0]}; "
                       f"{report.SECTIONS[8][0]})\n")  # 06's model: written by run r1, not r0
    assert run_file is None or "warning: ignoring" in err, err
    text = (out / "README.md").read_text()
    assert "No run record (`results/bench_run.json` is missing or unreadable" in text
    assert "## Runs" not in text and "No rows in the results files for this section" in text
    sections = dict(part.split("\n", 1) for part in text.split("\n## ")[1:])
    # each file's last run: the stale r0 rows come last in allreduce.csv and ddp_step.csv
    assert sections[report.SECTIONS[1][0]].startswith("\n_Run `r0`, machine not recorded._")
    assert "| gloo/cpu | 2 | 16MB | 777 |" in sections[report.SECTIONS[1][0]]
    assert sections[report.SECTIONS[2][0]].startswith("\n_Run `r0`")
    assert "| naive (03) | 99999 |" in sections[report.SECTIONS[2][0]]
    assert sections[report.SECTIONS[7][0]].startswith("\n_Run `r1`")


def test_the_report_is_replaced_only_by_a_whole_better_one(tmp_path, monkeypatch, capsys):
    """The old report and its pictures stay until the new ones exist: a build cut short (here a
    section interrupted, as by a signal) leaves them as they were, with no temporary folder; a
    run that measured nothing leaves them too, and says so; a new report then replaces the
    README, its run record and pictures, and removes the pictures it no longer shows."""
    out = tmp_path / "results"
    out.mkdir()
    old = {"README.md": "old report", "bench_ddp_step.png": "old ddp", "bench_gone.png": "old",
           "bench_run.json": '{"run_id": "r0"}'}
    for name, text in old.items():
        (out / name).write_text(text)

    def as_they_were():
        assert {p.name: p.read_text() for p in out.iterdir()} == old
    monkeypatch.setenv("RESULTS_DIR", str(out))
    with pytest.raises(SystemExit) as e:  # a fresh clone: no rows at all
        report.main()
    assert e.value.code == 1 and "nothing to report" in capsys.readouterr().err
    as_they_were()
    info = {"run_id": "r1", "quick": True, "model": "tiny", "machine": "box",
            "setup": make_bench.pick_setup(0).__dict__, "started_utc": "now", "total_s": 1.0,
            "steps": []}
    assert report.write_report(out, info) == (None, [t for t, _ in report.SECTIONS])
    as_they_were()  # make bench's run that measured nothing: the old report and record kept
    _fixture(out)
    (out / "bench_run.json").write_text(old["bench_run.json"])

    def interrupted(where):
        raise KeyboardInterrupt
    sections = report.SECTIONS
    monkeypatch.setattr(report, "SECTIONS", [*sections[:3], (sections[3][0], interrupted),
                                             *sections[4:]])
    with pytest.raises(KeyboardInterrupt):
        report.write_report(out, info)
    assert {n: (out / n).read_text() for n in old} == old
    assert [p.name for p in out.iterdir() if p.name.startswith(".report-")] == []
    monkeypatch.setattr(report, "SECTIONS", sections)
    source = tmp_path / "drawn_by_stage_02.png"
    source.write_text("new busbw")
    path, _ = report.write_report(out, info, [(source, "bench_allreduce_busbw.png")])
    assert json.loads((out / "bench_run.json").read_text())["run_id"] == "r1"
    assert "](bench_allreduce_busbw.png)" in path.read_text()
    assert (out / "bench_allreduce_busbw.png").read_text() == "new busbw"
    assert not (out / "bench_gone.png").exists()  # shown by the old report only
    if results.pyplot() is not None:
        assert (out / "bench_ddp_step.png").read_bytes()[:4] == b"\x89PNG"  # redrawn


def test_a_run_that_filled_fewer_sections_keeps_the_better_reports_sections(tmp_path):
    """An interrupted or partial make bench (here run r2, whose only rows are the all-reduce
    sweep's) never replaces a better report: each section it did not fill keeps the previous
    report's, marked with that run and machine, and the pictures those sections show stay; a
    third partial run keeps the mark of the run that measured them (r1), not r2's."""
    out = tmp_path / "results"
    _fixture(out)
    info = json.loads((out / "bench_run.json").read_text())
    first, empty = report.write_report(out, info)
    assert empty == []
    before = first.read_text()
    pictures = sorted(p.name for p in out.glob("bench_*.png"))
    ddp_table = before.split("## Data-parallel training step")[1].split("\n## ")[0]
    ddp_table = ddp_table.split("\n\n", 1)[1].split("\n\n")[0]  # its first paragraph
    for run in ("r2", "r3"):
        rows = results.read_csv("allreduce.csv", out)
        rows += [{**r, "run_id": run, "time_ms_median": 3.0} for r in rows if r["run_id"] == "r1"]
        _write_csv(out / "allreduce.csv", rows)
        partial = {**info, "run_id": run, "machine": f"box {run}", "steps": [
            {**step, "status": "ok" if step["key"] == "allreduce" else "stopped by SIGTERM (exit 143)"}
            for step in info["steps"]]}
        path, empty = report.write_report(out, partial)
        text = path.read_text()
        assert f"Run `{run}`" in text and "Machine: **box " + run in text
        assert len(empty) == len(report.SECTIONS) - 1  # all but the all-reduce sweep
        for title, _ in report.SECTIONS:
            if title.startswith("All-reduce"):
                continue  # this run's
            section = text.split(f"## {title}\n\n")[1]
            assert section.startswith("_Carried over from run `r1` on test box: this run did not "
                                      "fill this section._"), (run, title)
        assert ddp_table in text
        assert "Sections this run did not fill, kept from the report before it" in text
        assert "No rows from this run" not in text
        assert sorted(p.name for p in out.glob("bench_*.png")) == pictures
        assert "](bench_ddp_step.png)" in text or not pictures


# --------------------------------------------------------------------------- end to end
# The real driver and the real scripts (tests/end_to_end_bench.py), in a subprocess that
# conftest.py starts with the session's first test and this test awaits: while the suite's
# scripts and ranks import torch a core is idle, and the end-to-end run uses it.

def test_make_bench_end_to_end_on_tiny_sizes(end_to_end):
    """The real driver, the real scripts, tiny sizes: every step ok, exit 0, no launcher's or
    report's temporary folder left (torch may leave its compile cache), and a report with every
    section filled in from this run's rows, which are checked here as the stages' contract."""
    proc, root = end_to_end
    out = root / "results"
    code = proc.wait(timeout=1800)
    stdout = (root / "stdout").read_text()
    stderr = (root / "stderr").read_text()
    assert code == 0 and stdout.count(": ok in ") == 9, stdout[-4000:] + stderr[-4000:]
    assert "warning: ignoring" in stderr and "allreduce_fit.json" in stderr  # replaced, said so
    assert not list((root / "tmp").glob("launch-errors-*")) and not list(out.glob(".report-*"))
    info = json.loads((out / "bench_run.json").read_text())
    text = (out / "README.md").read_text()
    assert "section failed" not in text, text
    # the steps kept the host memory they freed, and the report says so
    expected = {name: os.environ.get(name, value)             # a setting of the user's wins
                for name, value in make_bench.KEEP_FREED_MEMORY.items()}
    assert info["allocator"] == expected
    assert info["keeps_freed_memory"] == (expected == make_bench.KEEP_FREED_MEMORY)
    if info["keeps_freed_memory"]:
        assert "Host memory: every step's processes kept the blocks they freed" in text
    # every section this plan's steps feed has rows; expert parallel, everything together and
    # checkpoints are not in it: their sections are read from known numbers above
    sections = dict(part.split("\n", 1) for part in text.split("\n## ")[1:])
    not_planned = [title for title, _ in report.SECTIONS[10:13]]
    assert len(not_planned) == 3 and not_planned[0].startswith("Expert parallelism")
    assert "No rows from this run" not in text
    for title, _ in report.SECTIONS:
        assert (report.NOT_PLANNED in sections[title]) == (title in not_planned), title
    for name in ("allreduce.csv", "ddp_step.csv", "ddp_profile.csv", "tensor_parallel.csv",
                 "sequence_parallel.csv", "pipeline_bubble.csv", "sharding.csv",
                 "context_parallel.csv", "compute.csv"):
        assert {r["run_id"] for r in results.read_csv(name, out)} == {info["run_id"]}, name
    assert results.read_json("matmul_peak.json", out)["cpu"]["run_id"] == info["run_id"]
    # stage 02: every impl at both sizes (4100 B does not split evenly), a fit over the corrupt one
    rows = results.read_csv("allreduce.csv", out)
    assert {(r["bytes"], r["impl"]) for r in rows} == {
        (n, i) for n in ("4100", "262144") for i in ("backend", "ring", "ring_pipelined")}
    assert "gloo/cpu/2" in results.read_json("allreduce_fit.json", out)
    # stage 06: 03-05, bucketed and torch DDP at every size, the model
    rows = results.read_csv("ddp_step.csv", out)
    assert sorted((r["impl"], r["bucket_mb"]) for r in rows) == sorted([
        ("none", ""), ("naive", ""), ("flat", ""), ("overlap", ""), ("bucketed", "0.01"),
        ("bucketed", "1.0"), ("torch_ddp", "25"), ("torch_ddp", "0.01"), ("torch_ddp", "1.0")])
    assert {r["steps"] for r in rows} == {"2"}  # capped at 2 (said so); rounds: tested above
    model = results.read_json("bucket_model.json", out)["gloo/cpu/2/tiny"]  # from this run's
    assert model["predicted_best_bucket_mb"] > 0 and model["fit_source"] in (  # stage 02 fit, or
        "results/allreduce_fit.json [gloo/cpu/2] (stage 02)", "measured in this run")  # remeasured
    # stage 07: bytes as predicted; every schedule, real and emulated; the sharding strategies
    assert all(r["bytes_counted"] == r["bytes_predicted"]
               for r in results.read_csv("tensor_parallel.csv", out))
    assert {(r["schedule"], float(r["emulated_ms"])) for r in results.read_csv(
        "pipeline_bubble.csv", out)} == {(s, e) for s in ("gpipe", "1f1b", "interleaved", "zbh1",
                                                          "zbv")  # dualpipev needs m >= 2p
                                         for e in (0.0, 5.0)}
    assert {r["impl"] for r in results.read_csv("sharding.csv", out)} >= {"ddp", "zero1", "zero2",
                                                                        "fsdp"}
    # lesson 5: the one-rank kernels and both layouts on a ring of 2, real and emulated compute
    assert sorted((r["impl"], r["layout"], r["compute"]) for r in results.read_csv(
        "context_parallel.csv", out)) == sorted([
            ("full, sdpa", "-", "real"), ("full, our kernel", "-", "real"),
            ("ring", "contiguous", "real"), ("ring", "zigzag", "real"),
            ("ring", "contiguous", "emulated 20 ms"), ("ring", "zigzag", "emulated 20 ms")])
    assert "Ring bytes sent per rank equal the formula in every row" in text
    # lesson 9: the planner beside this run's DDP and ledger steps
    configs = [r["config"] for r in results.read_csv("prediction.csv", out)]
    assert any(c.startswith("ddp_step flat") for c in configs) and any(
        c.startswith("ledger fsdp") for c in configs), configs
    assert "Within 25%:" in text
    if results.pyplot() is not None:
        for name in ("bench_allreduce_busbw.png", "bench_overlap_timeline.png",
                     "bench_ddp_step.png"):
            assert (out / name).exists(), name


# --------------------------------------------------------------------------- make check
def test_make_check_covers_every_stage_and_lesson_and_reads_a_refusal():
    """``make check`` runs bench/check.py on $(DEVICE); its list names every stage script and
    every 07 lesson's demo, each with --device added; a refusal (exit 2, one ``prog: error``
    line) is "refused", while a traceback, a wrong flag (argparse's usage text) or any other
    exit status is FAILED. Nothing is run here but ``make -n``."""
    from bench import check
    scripts = [argv[0] for _, argv in check.CHECKS]
    stages = sorted(str(p.relative_to(REPO)) for p in REPO.glob("0[1-6]_*/*.py")
                    if p.name not in ("bucket_model.py",))
    for stage_script in stages:
        assert stage_script in scripts, f"make check does not run {stage_script}"
    lessons = sorted(p for p in (REPO / "07_parallelism").glob("[0-9][0-9]_*") if p.is_dir())
    assert len(lessons) >= 8
    for lesson in lessons:
        if lesson.name == "09_planning":
            continue            # arithmetic on the lessons' formulas: it runs nothing on a device
        demos = sorted(lesson.glob("run_*.py")) + sorted(lesson.glob("train.py"))
        assert demos, f"{lesson.name} has no demo script"
        for demo in demos:
            assert str(demo.relative_to(REPO)) in scripts, f"make check does not run {demo}"
    for _, argv in check.CHECKS:
        assert (REPO / argv[0]).exists() and "--device" not in argv and "--backend" not in argv
    assert "--check" in dict(check.CHECKS)["07.7 everything together"]
    dry = subprocess.run(["make", "-n", "check", "DEVICE=cuda"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert "bench/check.py --device cuda" in dry

    refusal = ("[rank 0] starting\nrun_context_parallel.py: error: --device cuda over gloo: "
               "batch_isend_irecv sends CPU tensors only on Gloo; use --backend nccl\n")
    assert check.outcome(2, refusal) == ("refused", refusal.splitlines()[-1])
    assert check.outcome(0, "all checks passed\n") == ("ok", "")
    traceback = "Traceback (most recent call last):\n  ...\nx.py: error: boom\n"
    assert check.outcome(2, traceback)[0] == "FAILED"
    wrong_flag = "usage: x.py [-h]\nx.py: error: unrecognized arguments: --chek\n"
    assert check.outcome(2, wrong_flag)[0] == "FAILED"
    assert check.outcome(1, "[rank 0] [FAILED] weights differ\n")[0] == "FAILED"
    assert check.outcome(-11, "error: rank 1 was killed by SIGSEGV\n")[0] == "FAILED"
    table = check.summary([("01 collectives", "cuda", "ok", 9.0, ""),
                           ("07.5 context parallel", "cuda", "refused", 3.0, refusal.splitlines()[-1])])
    assert "refused" in table and "07.5 context parallel" in table and "cuda" in table


def test_until_deadline_outside_a_launch_yields_while_the_one_before_fits(monkeypatch, capsys):
    """The launcher's own verdict (``ctx`` None): no deadline, every configuration; a deadline
    that the first one's time would pass, the first only and one line."""
    from bench import step_bench

    def run(deadline):
        monkeypatch.setenv("BENCH_STEP_DEADLINE", deadline)
        done = []
        for n in step_bench.until_deadline(None, [1, 2, 3], "the launches left"):
            time.sleep(0.05)
            done.append(n)
        return done
    assert run("") == [1, 2, 3] and capsys.readouterr().out == ""
    assert run(f"{time.time() + 0.07:.3f}") == [1]
    assert "the launches left: skipped: past make bench's deadline" in capsys.readouterr().out
