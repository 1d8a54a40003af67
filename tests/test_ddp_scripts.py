"""Stages 03-06 as a user meets them: a plain run, the lab's profile (bench/profile_ddp.py) as
the proof of overlap, the check that can fail, ``make diff``, the lab's step benchmark
(bench/ddp_step.py) given every stage, where the step timings wait for the GPU, and bad input.
(The classes' equivalence with single-process training is tests/test_ddp.py; the step
benchmark for real, with the bucket model, runs in tests/test_bench.py's end-to-end run.)

The profile assertions are the ones that cannot flake on a loaded machine: WHERE each
all-reduce is launched (the ``c10d::allreduce_`` op on the main thread, inside the
``ddp:backward`` range or not) is decided by the code, not by timing. Whether the Gloo thread
actually ran during backward is timing, so it is asserted over both ranks and both profiled
steps together; the exact-zero case (NaiveDDP launches after backward) everywhere.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import naive_ddp
from bench import ddp_step, profile_ddp, profiling, results, step_bench
from bench import supervisor as launch
from common import models, verify
from helpers import REPO, assert_main_usage_error, run_script

TINY = ["--backend", "gloo", "--device", "cpu", "--world-size", "2", "--model", "tiny",
        "--batch-size", "4", "--context-length", "16"]


def test_plain_run_of_03_prints_the_proof():
    r = run_script(REPO / "03_naive_ddp" / "naive_ddp.py", "--world-size", "2", "--backend",
                   "gloo", "--device", "cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("[ok]") == 2 and "FAIL" not in r.stdout, r.stdout
    for what in ("ToyModel + SGD", "TiedModel + AdamW", "bitwise equal across ranks: True"):
        assert what in r.stdout, what


def _steps(trace: Path) -> list[dict]:
    """Per profiled step of one rank's trace: all-reduce launches (main thread), how many
    inside ddp:backward, and how long Gloo's all-reduces ran during it (us)."""
    data = json.loads(trace.read_text())
    xs = [e for e in (data["traceEvents"] if isinstance(data, dict) else data)
          if e.get("ph") == "X" and "dur" in e]
    forwards = sorted(e["ts"] for e in xs if e["name"] == "ddp:forward")
    backwards = sorted((e for e in xs if e["name"] == "ddp:backward"), key=lambda e: e["ts"])
    launches = [e for e in xs if e["name"] == "c10d::allreduce_"]
    gloo = [e for e in xs if e["name"] == "gloo:all_reduce"]
    assert forwards and len(forwards) == len(backwards) and launches and gloo, trace.name
    steps = []
    for i, bwd in enumerate(backwards):
        lo, hi = forwards[i], (forwards[i + 1] if i + 1 < len(forwards) else float("inf"))
        b0, b1 = bwd["ts"], bwd["ts"] + bwd["dur"]
        mine = [e for e in launches if lo <= e["ts"] < hi]
        steps.append({"launches": len(mine),
                      "in_backward": sum(b0 <= e["ts"] and e["ts"] + e["dur"] <= b1 for e in mine),
                      "gloo_in_backward_us": sum(max(0.0, min(e["ts"] + e["dur"], b1) - max(e["ts"], b0))
                                                 for e in gloo if lo <= e["ts"] < hi)})
    return steps


# Broken DDPs, each a plausible bug, that the proof (common/verify.py) must catch on every
# model at the tolerance it uses: off by a lot, and off by a little.


class SumNotMeanDDP(naive_ddp.NaiveDDP):
    """Sums gradients instead of averaging them: every gradient world_size times too large."""

    def finish_gradient_synchronization(self):
        for p in self._trainable:
            if p.grad is not None:
                dist.all_reduce(p.grad)


class ScaledGradientDDP(naive_ddp.NaiveDDP):
    """Every averaged gradient 0.1% too large (a wrong scale factor somewhere). Under AdamW
    the weights hardly move from the right ones: only the gradient comparison sees it."""

    def finish_gradient_synchronization(self):
        super().finish_gradient_synchronization()
        for p in self._trainable:
            if p.grad is not None:
                p.grad.mul_(1.001)


class ForgetsOneParameterDDP(naive_ddp.NaiveDDP):
    """Leaves the last parameter out of the all-reduce: its gradient stays this rank's own."""

    def __init__(self, module):
        super().__init__(module)
        self._trainable.pop()


class SkipsOneUpdateDDP(naive_ddp.NaiveDDP):
    """Drops the last parameter's averaged gradient on the second step, on every rank: one
    update of one parameter skipped, and the ranks stay bitwise equal."""

    def __init__(self, module):
        super().__init__(module)
        self.steps = 0

    def finish_gradient_synchronization(self):
        super().finish_gradient_synchronization()
        self.steps += 1
        if self.steps == 2:
            self._trainable[-1].grad = None


# (wrapper, what its proof lines must say): the bug is seen by the comparison with one
# process, and only ForgetsOneParameterDDP makes the ranks differ.
RANKS_EQUAL = "(allclose rtol={}: False); bitwise equal across ranks: True"
RANKS_DIFFER = ("(allclose rtol={}: False); bitwise equal across ranks: False "
                "(max |weight - rank 0's| ")
BROKEN_DDPS = [(SumNotMeanDDP, RANKS_EQUAL), (ScaledGradientDDP, RANKS_EQUAL),
               (ForgetsOneParameterDDP, RANKS_DIFFER), (SkipsOneUpdateDDP, RANKS_EQUAL)]
PROOF_MODELS = [("ToyModel + SGD", verify.TOLERANCE), ("TiedModel + AdamW", verify.TOLERANCE)]


def profiles_and_proof_worker(ctx, runs):
    for worker, args in runs:  # the profiles of 03 and 05, as profile_ddp.main parsed them
        worker(ctx, *args)
    for wrap, _ in BROKEN_DDPS:  # the proof's verdict is the same on every rank
        bug = wrap.__doc__.splitlines()[0]
        assert verify.verify_ddp(ctx, wrap, wrap.__name__) is False, \
            f"the proof passed {wrap.__name__}, a broken DDP: {bug}"


def assert_every_broken_ddp_failed_everywhere(out: str, world_size: int) -> None:
    """Every rank printed, for every broken DDP in order, a [FAIL] line per model saying what
    differed; no [ok] line. (Each rank's own lines keep their order in the output.)"""
    for rank in range(world_size):
        lines = [line for line in out.splitlines() if line.startswith(f"[rank {rank}]   [")]
        want = []
        for wrap, verdict in BROKEN_DDPS:
            for label, (rtol, atol) in PROOF_MODELS:
                want.append((wrap.__name__, label, verdict.format(f"{rtol:g} atol={atol:g}")))
        assert len(lines) == len(want), "\n".join(lines)
        for line, (name, label, verdict) in zip(lines, want):
            assert line.startswith(f"[rank {rank}]   [FAIL] {label} "), (name, line)
            assert verdict in line, (name, line)


def _parsed_run(monkeypatch, main, argv):
    """What ``main(argv)`` would launch, parsed and checked by the script but not started."""
    calls = []
    with monkeypatch.context() as m:
        m.setattr(launch, "launch", lambda worker, config, *args, **kw:
                  calls.append((worker, config, args)))
        main(argv)
    assert len(calls) == 1, calls
    return calls[0]


def test_profile_03_and_05_and_broken_ddps_fail_the_proof(tmp_path, monkeypatch, capfd):
    w3, config, a3 = _parsed_run(monkeypatch, profile_ddp.main,
                                 ["--stage", "03", *TINY, "--trace-dir", str(tmp_path)])
    w5, _, a5 = _parsed_run(monkeypatch, profile_ddp.main,
                            ["--stage", "05", *TINY, "--trace-dir", str(tmp_path)])
    launch.launch(profiles_and_proof_worker, config, [(w3, a3), (w5, a5)], timeout_s=180)
    out = capfd.readouterr().out
    assert_every_broken_ddp_failed_everywhere(out, config.world_size)
    assert "compute |" in out and "comm    |" in out  # the text timeline, always
    out3, out5 = tmp_path / "03_naive_ddp", tmp_path / "05_overlap_ddp"
    # the tiny LM has 25 parameter tensors: NaiveDDP launches one all-reduce of "had a
    # gradient" flags, then one per parameter, all after backward; OverlapDDP launches the 25
    # from hooks inside backward and the flags in finish_gradient_synchronization()
    for trace in [out3 / f"naive_03_rank{r}.json" for r in (0, 1)] + \
                 [out5 / f"naive_03_rank{r}.json" for r in (0, 1)]:
        steps = _steps(trace)
        assert len(steps) == 2, (trace, steps)  # two profiled steps
        for step in steps:  # naive: every all-reduce after backward, none ran in it
            assert step["launches"] == 26 and step["in_backward"] == 0, (trace, step)
            assert step["gloo_in_backward_us"] == 0, (trace, step)
    overlap_us = 0.0
    for rank in (0, 1):
        steps = _steps(out5 / f"overlap_05_rank{rank}.json")
        assert len(steps) == 2, steps
        for step in steps:
            assert step["launches"] == 26 and step["in_backward"] == 25, step
            overlap_us += step["gloo_in_backward_us"]
    assert overlap_us > 0, "Gloo never ran an all-reduce during backward (any rank, step)"
    if results.pyplot() is None:  # matplotlib is optional: without it, the text timeline
        assert "(matplotlib not installed: text timeline only)" in out
    else:
        assert (out5 / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    rows = {(r["stage"], r["case"]): r for r in results.read_csv(profiling.PROFILE_CSV)}
    assert set(rows) == {("03_naive_ddp", "naive (03)"), ("05_overlap_ddp", "naive (03)"),
                         ("05_overlap_ddp", "overlap (05)")}
    assert all(float(r["comm_during_backward_ms"]) == 0 for (_, c), r in rows.items()
               if c == "naive (03)")


def test_the_step_bench_times_every_stage_and_writes_the_bucket_model(monkeypatch):
    """bench/ddp_step.py: stages 03-05, BucketedDDP at every size and torch DDP at the sizes
    other than its default, then the bucket model beside the sweep in bucket_model.json. No
    process group: the benchmark is replaced by a recorder."""
    calls = []

    def fake_run_step_bench(ctx, cases, args, after_case=None):
        calls.append([(impl, size) for impl, size, _ in cases])
        return [{"impl": "bucketed", "bucket_mb": size, "step_ms": 10.0 + size,
                 "comm_after_backward_ms": 1.0} for size in args.bucket_sizes]
    monkeypatch.setattr(step_bench, "run_step_bench", fake_run_step_bench)
    monkeypatch.setattr(ddp_step, "latency_bandwidth",
                        lambda ctx: {"a_s": 1e-4, "w_bytes_per_s": 1e9, "source": "test"})
    ctx = types.SimpleNamespace(is_main=True, rank=0, world_size=2, backend="gloo",
                                device=torch.device("cpu"), print=lambda *a, **k: None)
    args = types.SimpleNamespace(model="tiny", context_length=16, bucket_sizes=[0.25, 25, 4.0])
    ddp_step.sweep_and_model(ctx, args)
    assert calls == [[("naive", None), ("flat", None), ("overlap", None), ("bucketed", 0.25),
                      ("bucketed", 25), ("bucketed", 4.0), ("torch_ddp", 0.25), ("torch_ddp", 4.0)]]
    (summary,) = results.read_json("bucket_model.json").values()
    assert [r["bucket_mb"] for r in summary["sweep"]] == [0.25, 25, 4.0]
    assert summary["measured_best_bucket_mb"] == 0.25 and summary["predicted_best_bucket_mb"] > 0


def test_step_timings_wait_for_the_compute_stream_inside_a_step(monkeypatch, tmp_path):
    """Issue 45 item 6: the clock after backward waits for the compute stream only
    (torch.cuda.synchronize would wait for NCCL's streams too, counting the communication that
    overlapped backward as backward); the device is synchronized at the end of the step. On
    the CPU, with CUDA's calls recorded: the step bench's and the profiler's steps."""
    log = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("device"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(
        synchronize=lambda: log.append("compute stream")))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    weight = torch.ones(1, requires_grad=True)
    weight.register_hook(lambda grad: log.append("backward"))
    optimizer = types.SimpleNamespace(zero_grad=lambda set_to_none: log.append("zero_grad"),
                                      step=lambda: log.append("optimizer"))
    monkeypatch.setattr(step_bench, "setup_case", lambda ctx, factory, args: (
        None, lambda x: (weight * x).sum(), lambda: log.append("finish"), optimizer, 1.0, None))
    monkeypatch.setattr(models, "lm_loss", lambda out, y: out)
    monkeypatch.setattr(step_bench.timing, "gather_times", lambda t: types.SimpleNamespace(max=max(t)))
    ctx = types.SimpleNamespace(device=torch.device("cuda", 0), rank=0, world_size=1,
                                print=lambda *a, **k: None)
    args = types.SimpleNamespace(warmup=0, steps=1, rounds=1, case_budget_s=100.0)
    step_bench.time_steps(ctx, None, args)
    assert log == ["device", "zero_grad", "backward", "compute stream", "finish",
                   "compute stream", "optimizer", "device"], log
    log.clear()

    class FakeProfile:
        def __init__(self, activities):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def export_chrome_trace(self, path):
            pass
    monkeypatch.setattr(profiling, "profile", FakeProfile)
    monkeypatch.setattr(profiling.dist, "barrier", lambda: None)
    profiling.profile_case(ctx, None, args, tmp_path / "trace.json")
    one_step = ["zero_grad", "compute stream", "backward", "compute stream", "finish",
                "compute stream", "optimizer", "device"]
    assert log == one_step * 5, log  # 3 warm-up steps, 2 profiled


@pytest.mark.parametrize("main, argv, needle", [
    (naive_ddp.main, ["--world-size", "0"], "'0' is not a whole number >= 1"),
    (naive_ddp.main, ["--backend", "mpi"], "invalid choice: 'mpi'"),
    (ddp_step.main, ["--batch-size", "3"], "not divisible by world size 2"),
    (ddp_step.main, ["--model", "huge"], "invalid choice: 'huge'"),
    (ddp_step.main, ["--steps", "0"], "'0' is not a whole number >= 1"),
    (ddp_step.main, ["--model", "2.7B", "--world-size", "64", "--batch-size", "64"], "GiB"),
    (ddp_step.main, ["--world-size", "1000", "--batch-size", "1000"], "1000 ranks need about"),
    (ddp_step.main, ["--case-budget-s", "nan"], "'nan' is not a finite number > 0"),
    (ddp_step.main, ["--bucket-sizes", "0"], "'0' is not a finite number > 0"),
    (ddp_step.main, ["--bucket-sizes", "abc"], "'abc'"),
    (ddp_step.main, ["--bucket-sizes", ""], "empty list"),
    (ddp_step.main, ["--bucket-sizes", "1,-5"], "'-5'"),
    (profile_ddp.main, ["--batch-size", "3"], "3"),
    (profile_ddp.main, ["--stage", "06", "--bucket-size-mb", "inf"], "'inf'"),
    (profile_ddp.main, ["--stage", "04"], "invalid choice: '04'"),
])
def test_bad_input_one_line_exit_2(capsys, main, argv, needle):
    assert_main_usage_error(main, ["--backend", "gloo", "--device", "cpu", "--world-size", "2",
                                   *argv], capsys, needle)


def test_code_repeated_on_purpose_is_identical_and_make_diff_shows_the_lesson():
    """broadcast_module_state (03-06) and weak_hook (05-06) are repeated so each file stays
    copyable alone; they must be the same code, so that `make diff` shows only the lesson."""
    import ast
    import subprocess

    def source(path, name):
        text = (REPO / path).read_text()
        node = next(n for n in ast.parse(text).body if getattr(n, "name", "") == name)
        return ast.get_source_segment(text, node)
    ddp_files = ["03_naive_ddp/naive_ddp.py", "04_flat_ddp/flat_ddp.py",
                 "05_overlap_ddp/overlap_ddp.py", "06_bucketed_ddp/bucketed_ddp.py"]
    assert len({source(f, "broadcast_module_state") for f in ddp_files}) == 1
    assert len({source(f, "weak_hook") for f in ddp_files[2:]}) == 1
    scripts = ["01_collectives/collectives.py", "02_allreduce_bench/allreduce_bench.py", *ddp_files]
    finding = ('    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository\n'
               '    try:\n')
    refusal = ('    except ImportError:  # copied alone: the algorithm above needs torch only\n'
               '        raise SystemExit(f"{__file__}: this demo needs the repository (common/)")\n')
    assert all(finding in source(f, "main") + "\n" and refusal in source(f, "main") + "\n"
               for f in scripts)
    for stage, new in (("04", "+class FlatDDP"), ("05", "+class OverlapDDP"),
                       ("06", "+class BucketedDDP")):
        r = subprocess.run(["make", "--no-print-directory", "diff", f"S={stage}"], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and new in r.stdout, r.stdout[-2000:] + r.stderr
        changed = [line for line in r.stdout.splitlines() if line[:1] in "+-"]
        shared = ["def broadcast_module_state"] + (["def weak_hook"] if stage == "06" else [])
        assert not any(name in line for name in shared for line in changed)  # not the lesson
        assert "def main" not in r.stdout  # no harness
