"""``make bench``: what it picks on each kind of box, the cap on a script, the report written
from known numbers (and only this run's), and one real quick run end to end on CPU."""

from __future__ import annotations

import csv
import json
import re
import textwrap
import time

import pytest

from bench import make_bench, report
from common import results
from helpers import REPO, assert_usage_error, run_script

DRIVER = REPO / "bench" / "make_bench.py"


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _step(steps, key):
    return next(s for s in steps if s.key == key)


# --------------------------------------------------------------------------- the plan per box


def test_cpu_only_box_runs_gloo_cpu_small(monkeypatch):
    monkeypatch.delenv("BENCH_MODEL", raising=False)
    setup = make_bench.pick_setup(0)
    assert (setup.backend, setup.device) == ("gloo", "cpu") and "No GPU" in setup.picked
    model = make_bench.bench_model(setup, quick=False)
    assert model == "tiny"
    steps = make_bench.plan(setup, quick=False, model=model)
    assert [s.key for s in steps] == ["allreduce", "ddp", "profile", "tp2", "tp4", "pp"]
    for s in steps:  # every script on gloo/cpu, every one capped
        assert (_flag(s.argv, "--backend"), _flag(s.argv, "--device")) == ("gloo", "cpu"), s
        assert 0 < s.cap_s <= 300
    assert "GB" not in _flag(steps[0].argv, "--sizes")  # small sizes on CPU
    assert _flag(steps[0].argv, "--budget-s") == "120"  # no configuration over 2 minutes
    assert _flag(_step(steps, "ddp").argv, "--case-budget-s") == "120"
    quick = make_bench.plan(setup, quick=True, model=model)
    assert _flag(quick[0].argv, "--world-sizes") == "2" and len(quick) == 5


def test_one_gpu_box_shares_it_over_gloo(monkeypatch):
    monkeypatch.delenv("BENCH_MODEL", raising=False)
    setup = make_bench.pick_setup(1, "NVIDIA H100 80GB HBM3")
    assert (setup.backend, setup.device) == ("gloo", "cuda")
    assert "NCCL refuses two ranks on one GPU" in setup.picked
    assert make_bench.bench_model(setup, quick=False) == "small"
    assert make_bench.bench_model(setup, quick=True) == "course"
    steps = make_bench.plan(setup, quick=False, model="small")
    ar = steps[0].argv
    assert _flag(ar, "--backend") == "all" and _flag(ar, "--device") == "all"  # 02: cpu + cuda
    assert _flag(ar, "--sizes").endswith("1GB") and _flag(ar, "--world-sizes") == "2,4"
    ddp = _step(steps, "ddp").argv
    assert (_flag(ddp, "--backend"), _flag(ddp, "--device"), _flag(ddp, "--world-size")) == \
        ("gloo", "cuda", "2")
    assert _flag(_step(steps, "pp").argv, "--world-size") == "4"  # 4 stages share the GPU
    # the course LM in the reference shape: batch 4, context 256
    course = _step(make_bench.plan(setup, quick=True, model="course"), "ddp").argv
    assert (_flag(course, "--batch-size"), _flag(course, "--context-length")) == ("4", "256")


@pytest.mark.parametrize("gpus, ddp_ws, batch, ar_world, pp_ws, tp_keys", [
    (2, "2", "8", "2", "2", ["tp2"]),
    (3, "3", "6", "2", "2", ["tp2"]),           # batch 8 rounded to split over 3 ranks
    (8, "8", "8", "2,4,8", "4", ["tp2", "tp4"]),
])
def test_multi_gpu_box_uses_nccl_one_gpu_per_rank(gpus, ddp_ws, batch, ar_world, pp_ws, tp_keys):
    setup = make_bench.pick_setup(gpus, "NVIDIA H100")
    assert (setup.backend, setup.device) == ("nccl", "cuda")
    steps = make_bench.plan(setup, quick=False, model="small")
    ddp = _step(steps, "ddp").argv
    assert (_flag(ddp, "--world-size"), _flag(ddp, "--batch-size")) == (ddp_ws, batch)
    assert _flag(ddp, "--backend") == "nccl"
    assert _flag(steps[0].argv, "--world-sizes") == ar_world
    assert _flag(_step(steps, "pp").argv, "--world-size") == pp_ws
    assert [s.key for s in steps if s.key.startswith("tp")] == tp_keys


@pytest.mark.parametrize("gpus", [0, 1, 3, 8])
def test_every_plan_passes_each_scripts_own_checks(gpus, monkeypatch):
    """Each planned command through its script's main() on this box or a faked GPU box (the
    GPU plans cannot run here), up to the point where it would start its ranks: flags, world
    sizes, divisibility, NCCL's one GPU per rank and the memory estimates must all be
    accepted (a usage error would exit 2 here)."""
    import importlib

    import torch
    import torch.distributed as dist

    from common import launch

    class Props:
        total_memory = 80 * 2**30
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: Props())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    launched = []
    monkeypatch.setattr(launch, "launch", lambda worker, config, *a, **k: launched.append(config))
    allreduce_bench = importlib.import_module("allreduce_bench")
    monkeypatch.setattr(allreduce_bench, "_gpu_free_bytes", lambda: [80 * 2**30] * gpus)
    for quick in (False, True):
        setup = make_bench.pick_setup(gpus, "Fake GPU")
        for step in make_bench.plan(setup, quick, "small" if gpus else "tiny"):
            module = importlib.import_module(step.argv[0].split("/")[-1][:-3])
            launched.clear()
            module.main(step.argv[1:])
            assert launched, step.argv
            for config in launched:
                if step.key != "allreduce":  # 02 sweeps several; the rest run as planned
                    assert (config.backend, config.device) == (
                        _flag(step.argv, "--backend"), _flag(step.argv, "--device")), step.argv
                if config.backend == "nccl":
                    assert config.world_size <= gpus, (step.argv, config)


def test_bench_model_and_budget_env(monkeypatch):
    setup = make_bench.pick_setup(0)
    monkeypatch.setenv("BENCH_MODEL", "course")
    assert make_bench.bench_model(setup, quick=True) == "course"
    monkeypatch.setenv("BENCH_BUDGET_S", "300")
    assert make_bench.budget_s(quick=False) == 300.0
    r = run_script(DRIVER, env={"BENCH_MODEL": "huge"}, timeout=60)
    assert_usage_error(r, "BENCH_MODEL='huge'", "tiny, course, small")
    r = run_script(DRIVER, env={"BENCH_BUDGET_S": "soon"}, timeout=60)
    assert_usage_error(r, "BENCH_BUDGET_S='soon'", ">= 60")


def test_a_script_past_its_cap_gets_ctrl_c_then_the_bench_goes_on(tmp_path):
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
    step = make_bench.Step("slow", "a slow script", [str(script)], cap_s=60)
    start = time.monotonic()
    make_bench.run_step(step, env=None, cap_s=2)
    assert step.status == "stopped at its 2 s cap"
    assert flag.read_text() == "rows"  # it had the chance to write its rows
    assert time.monotonic() - start < 20


def test_the_budget_holds_even_when_every_script_overruns_its_cap():
    """Worst case: every script ignores Ctrl-C and is killed after the grace and kill wait."""
    now = [0.0]
    steps = make_bench.plan(make_bench.pick_setup(1, "GPU"), quick=False, model="small")

    def run(step, cap):  # takes all it may, and then some
        assert cap >= make_bench.MIN_STEP_S and cap <= step.cap_s
        step.seconds = cap + make_bench.GRACE_S + make_bench.KILL_WAIT_S
        step.status = "stopped"
        now[0] += step.seconds

    make_bench.run_all(steps, budget=510, run=run, clock=lambda: now[0])
    assert now[0] <= 510, now[0]
    ran = [s for s in steps if s.status == "stopped"]
    assert ran and all(s.status.startswith(("stopped", "skipped")) for s in steps)
    # and when every script is quick, every step runs
    now[0] = 0.0
    for s in steps:
        s.status = "not run"

    def quick_run(step, cap):
        step.status, step.seconds = "ok", 5.0
        now[0] += 5.0

    make_bench.run_all(steps, budget=510, run=quick_run, clock=lambda: now[0])
    assert all(s.status == "ok" for s in steps)


# --------------------------------------------------------------------------- the report


def _write_csv(path, rows):
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _fixture(out, gpus=0, run_id="r1", backend="gloo", device="cpu"):
    """Result files as the stages write them, with known numbers for run r1 and a stale
    row of an older run r0 in every file, which the report must leave out."""
    out.mkdir(parents=True, exist_ok=True)
    steps = [{"key": "allreduce", "title": "02 all-reduce sweep", "argv": ["x.py"],
              "cap_s": 100, "status": "ok", "seconds": 12.0}]
    setup = make_bench.pick_setup(gpus, "NVIDIA H100 80GB HBM3")
    json.dump({"run_id": run_id, "quick": False, "model": "tiny",
               "setup": {k: getattr(setup, k) for k in ("gpus", "gpu_name", "backend", "device",
                                                        "picked")},
               "machine": "test box", "cpu_cores": 2, "torch": "2.x", "started_utc": "now",
               "total_s": 100.0, "budget_s": 540, "steps": steps},
              (out / "bench_run.json").open("w"))
    ar = []
    for rid, busbw in (("r1", 1.0), ("r0", 777.0)):
        for nbytes, t_ms in ((2**20, 2.0), (10 * 2**20, 11.0)):
            for impl, factor in (("backend", 1.0), ("ring", 0.9)):
                ar.append({"backend": "gloo", "device": "cpu", "world_size": 2, "bytes": nbytes,
                           "impl": impl, "time_ms_median": t_ms / factor,
                           "busbw_gbps": busbw * factor * nbytes / 2**24, "run_id": rid})
    _write_csv(out / "allreduce.csv", ar)
    fit = {"backend": "gloo", "device": "cpu", "world_size": 2, "a_s": 0.001,
           "w_bytes_per_s": 1e9, "points": [{"rel_error": 0.02}, {"rel_error": -0.05}]}
    json.dump({"gloo/cpu/2": {**fit, "run_id": "r1"}, "gloo/cpu/4": {**fit, "run_id": "r0"}},
              (out / "allreduce_fit.json").open("w"))
    common = {"backend": backend, "device": device, "world_size": 2, "model": "tiny",
              "params": 1400000, "batch_size": 8, "context_length": 64, "steps": 10,
              "warmup": 3, "optimizer_ms": 10.0}
    ddp = []
    for impl, bucket, step, comm in (("none", "", 50.0, 0.0), ("torch_ddp", 25, 100.0, 1.0),
                                     ("naive", "", 180.0, 70.0), ("flat", "", 130.0, 20.0),
                                     ("overlap", "", 120.0, 8.0), ("bucketed", 1.0, 94.0, 3.0),
                                     ("bucketed", 4.0, 99.0, 5.0), ("torch_ddp", 1.0, 98.0, 1.0),
                                     ("naive", "", 99999.0, 0.0)):
        rid = "r0" if step == 99999.0 else "r1"
        ddp.append({**common, "impl": impl, "bucket_mb": bucket, "step_ms": step,
                    "fwd_bwd_ms": step - comm - 10, "comm_after_backward_ms": comm,
                    "comm_share": comm / step, "ratio_vs_torch_ddp": step / 100.0, "run_id": rid})
    _write_csv(out / "ddp_step.csv", ddp)
    sweep = [{"bucket_mb": 1.0, "buckets": 6, "measured_step_ms": 94.0,
              "measured_comm_after_bwd_ms": 3.0, "model_comm_after_bwd_ms": 2.5},
             {"bucket_mb": 4.0, "buckets": 2, "measured_step_ms": 99.0,
              "measured_comm_after_bwd_ms": 5.0, "model_comm_after_bwd_ms": 4.0}]
    json.dump({"gloo/cpu/2/tiny": {
        "run_id": "r1", "model": "tiny", "gradient_bytes": 5 * 2**20, "o_s": 0.001,
        "w_bytes_per_s": 1e9, "fit_source": "stage 02", "predicted_best_n_buckets": 2.3,
        "predicted_best_bucket_mb": 2.2, "measured_best_bucket_mb": 1.0,
        "neighbour_range_mb": [1.0, 4.0], "prediction_within_neighbours": True,
        "sweep": sweep, "machine": "test box", "backend": backend, "device": device,
        "world_size": 2}}, (out / "bucket_model.json").open("w"))
    _write_csv(out / "ddp_profile.csv", [
        {"backend": "gloo", "device": "cpu", "world_size": 2, "model": "tiny",
         "stage": "05_overlap_ddp", "case": case, "step_ms": 100.0, "backward_ms": 40.0,
         "all_reduces": 26, "comm_during_backward_ms": during,
         "comm_after_backward_ms": after, "run_id": "r1"}
        for case, during, after in (("naive (03)", 0.0, 40.0), ("overlap (05)", 30.0, 10.0))])
    tp = []
    for variant, fwd, bwd in (("megatron", 1000, 1000), ("allgather", 5000, 5000)):
        for phase, nbytes in (("forward", fwd), ("backward", bwd)):
            tp.append({"backend": backend, "device": device, "world_size": 2, "tokens": 128,
                       "d_model": 64, "d_ff": 256, "variant": variant, "layer": "fc1",
                       "phase": phase, "bytes_counted": nbytes, "run_id": "r1"})
    _write_csv(out / "tensor_parallel.csv", tp)
    _write_csv(out / "tensor_parallel_time.csv", [
        {"world_size": 2, "variant": v, "fwd_bwd_ms": ms, "speedup_vs_single": 10.0 / ms,
         "run_id": "r1"} for v, ms in (("single", 10.0), ("megatron", 8.0), ("allgather", 12.5))])
    pp = []
    for schedule in ("gpipe", "1f1b"):
        for m in (1, 8):
            for rank in range(4):
                pp.append({"backend": backend, "device": device, "world_size": 4, "layers": 8,
                           "d_model": 64, "hidden": 256, "batch": 64, "schedule": schedule,
                           "micro_batches": m, "rank": rank,
                           "idle_share": 0.8 if m == 1 else (0.40 if schedule == "gpipe" else 0.36),
                           "idle_share_simulated": 0.75 if m == 1 else 3 / 11,
                           "idle_share_formula": 0.75 if m == 1 else 3 / 11,
                           "peak_held": m if schedule == "gpipe" else min(m, 4 - rank),
                           "step_ms": 50.0, "run_id": "r1"})
    _write_csv(out / "pipeline_bubble.csv", pp)


def test_report_from_known_numbers(tmp_path):
    out = tmp_path / "results"
    _fixture(out)
    text = report.write_report(out).read_text()
    # the machine, the CPU-only note, every section
    assert "Machine: **test box**" in text and "This is a CPU-only run" in text
    for heading in ["## Headline", "## Runs", "## All-reduce", "### Latency-bandwidth fit",
                    "## Data-parallel training step", "## Bucket size", "## Overlap",
                    "## Tensor parallelism", "## Pipeline parallelism"]:
        assert heading in text, heading
    assert "No rows from this run" not in text
    # readings computed from the numbers: bucketed 94 ms vs torch DDP 100 ms -> 0.94x, met
    assert "BucketedDDP at its best bucket size (1.0 MB) is 0.94x torch DDP's step time " \
           "(target: within 1.05x, met); overlap and bucketed are both faster" in text
    assert "| BucketedDDP (best bucket) vs torch DDP, step time | 0.94x (94.0 vs 100.0 ms" in text
    assert "naive DDP still waits 70.0 ms" in text
    assert "prediction lies within that size and its neighbours [1, 4] MB" in text
    assert "moves 9.77KB, 5.0x as much" in text  # 10000 B all-gather vs 2000 B Megatron
    assert "Measured at m = 8: GPipe 0.40, 1F1B 0.36" in text
    assert "GPipe holds all 8 micro-batches' activations at its peak and 1F1B at most 4" in text
    assert "overlap (05): 75% of its 40.0 ms of communication ran while backward" in text
    assert "about 1000 us before any byte moves and then 1.00 GB/s" in text
    # the stale run's rows are left out
    assert "99999" not in text and "777" not in text and "| gloo/cpu | 4 |" not in text
    pictures = ["bench_ddp_step.png", "bench_bucket_sweep.png", "bench_pipeline_bubble.png"]
    if results.pyplot() is not None:
        for name in pictures:
            assert (out / name).stat().st_size > 1000 and f"]({name})" in text
    else:
        assert "no picture" in text


def test_report_says_what_is_missing_and_names_one_gpu_setup(tmp_path):
    out = tmp_path / "results"
    _fixture(out, gpus=1)
    for name in ("ddp_step.csv", "bucket_model.json", "pipeline_bubble.csv"):
        (out / name).unlink()
    text = report.write_report(out).read_text()
    assert "1 x NVIDIA H100 80GB HBM3" in text and "NCCL refuses two ranks" in text
    assert "CPU-only" not in text
    assert text.count("No rows from this run") == 3
    assert "## All-reduce" in text and "| gloo/cpu | 2 | 10MB |" in text


def test_report_wording_follows_the_setup_and_the_numbers(tmp_path):
    """NCCL box: no 'shared cores' excuses; a fit with a <= 0 is called what it is; a
    pipeline that meets the formula is not said to sit above it; a broken file costs one
    section, not the report."""
    out = tmp_path / "results"
    _fixture(out, gpus=8, backend="nccl", device="cuda")
    fits = json.loads((out / "allreduce_fit.json").read_text())
    fits["gloo/cpu/2"]["a_s"] = -4e-5
    (out / "allreduce_fit.json").write_text(json.dumps(fits))
    rows = list(csv.DictReader((out / "pipeline_bubble.csv").open()))
    for r in rows:
        r["idle_share"] = r["idle_share_formula"]
    _write_csv(out / "pipeline_bubble.csv", rows)
    (out / "ddp_profile.csv").write_text("run_id,stage\nr1,05_overlap_ddp\n")  # truncated
    text = report.write_report(out).read_text()
    assert "8 x NVIDIA H100 80GB HBM3" in text and "NCCL, one GPU per rank" in text
    assert "Each rank has its own GPU and the collectives run over NCCL." in text
    assert "same cores" not in text and "share one GPU" not in text
    assert "latency could not be pinned down" in text and "-40 us" not in text
    assert "close to the formula" in text and "above the formula" not in text
    assert "This section failed: KeyError" in text and "## Pipeline parallelism" in text


def test_tables_without_tabulate(monkeypatch, capsys):
    monkeypatch.setattr(results, "tabulate", None)  # a GPU box's Python may lack it
    text = results.print_table([{"impl": "naive", "step_ms": 12.3456}])
    assert text.splitlines() == ["| impl | step_ms |", "|---|---|", "| naive | 12.35 |"]


# --------------------------------------------------------------------------- end to end


def test_make_bench_quick_end_to_end_on_cpu(tmp_path):
    """The real thing, quick mode: every step ok, a report with every section filled in."""
    out = tmp_path / "results"
    r = run_script(DRIVER, env={"RESULTS_DIR": str(out), "BENCH_QUICK": "1"}, timeout=420)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    progress = re.findall(r"\[bench (\d)/5\] .*: ok in \d+ s", r.stdout)
    assert progress == ["1", "2", "3", "4", "5"], r.stdout[-3000:]
    text = (out / "README.md").read_text()
    assert "No rows from this run" not in text and text.count("| ok |") == 5
    info = json.loads((out / "bench_run.json").read_text())
    assert info["setup"]["device"] == "cpu" and info["model"] == "tiny" and info["quick"]
    # every row the report read is this run's
    with (out / "ddp_step.csv").open(newline="") as f:
        assert {row["run_id"] for row in csv.DictReader(f)} == {info["run_id"]}
    if results.pyplot() is not None:
        for name in ("bench_allreduce_busbw.png", "bench_ddp_step.png", "bench_bucket_sweep.png",
                     "bench_overlap_timeline.png", "bench_pipeline_bubble.png"):
            assert (out / name).exists(), name
    assert list((out / "traces").rglob("*_rank0.json"))  # raw traces beside the report
