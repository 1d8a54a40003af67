"""Stages 03-06 as a user meets them: a plain run, ``--profile`` as the proof of overlap, the
check that can fail, the demo files kept apart from --bench's, ``make diff``, and bad input.
(The classes' equivalence with single-process training is tests/test_ddp.py; ``06 --bench``,
with 03-05, torch DDP and the bucket model, runs in tests/test_bench.py's end-to-end run.)

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

import bucketed_ddp
import flat_ddp
import naive_ddp
import overlap_ddp
from common import verify
from bench import profiling, results, step_bench
from bench import supervisor as launch
from helpers import REPO, assert_main_usage_error, run_script

TINY = ["--backend", "gloo", "--device", "cpu", "--world-size", "2", "--model", "tiny",
        "--batch-size", "4", "--context-length", "16"]


def test_plain_run_of_03_prints_the_proof():
    r = run_script(REPO / "03_naive_ddp" / "naive_ddp.py", "--world-size", "2", "--backend",
                   "gloo", "--device", "cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("[ok]") == 3 and "FAIL" not in r.stdout, r.stdout
    for what in ("ToyModel + SGD", "TiedModel + AdamW", "TransformerLM tiny + AdamW",
                 "bitwise equal across ranks: True"):
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
PROOF_MODELS = [("ToyModel + SGD", verify.TOY_TOLERANCE),
                ("TiedModel + AdamW", verify.TOY_TOLERANCE),
                ("TransformerLM tiny + AdamW", verify.LM_TOLERANCE)]


def profiles_and_proof_worker(ctx, runs):
    for worker, args in runs:  # 03 --profile and 05 --profile, as their main() parsed them
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
    w3, config, a3 = _parsed_run(monkeypatch, naive_ddp.main,
                                 ["--profile", *TINY, "--trace-dir", str(tmp_path)])
    w5, _, a5 = _parsed_run(monkeypatch, overlap_ddp.main,
                            ["--profile", *TINY, "--trace-dir", str(tmp_path)])
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


def test_plain_run_demos_do_not_touch_bench_results(monkeypatch):
    """The plain runs' quick demos (make run) write ddp_step_demo.csv and
    bucket_model_demo.json; only --bench writes ddp_step.csv and bucket_model.json.
    No process group: the benchmark is replaced by a recorder."""
    import bucket_model
    csv_names = []

    def fake_run_step_bench(ctx, cases, args, csv_name=step_bench.CSV_NAME, after_case=None):
        csv_names.append(csv_name)
        return [{"impl": "bucketed", "bucket_mb": size, "step_ms": 10.0 + size,
                 "comm_after_backward_ms": 1.0, "ratio_vs_torch_ddp": 1.0}
                for size in args.bucket_sizes] + [{"impl": "torch_ddp", "bucket_mb": 25,
                                                   "step_ms": 10.0}]
    monkeypatch.setattr(step_bench, "run_step_bench", fake_run_step_bench)
    monkeypatch.setattr(verify, "verify_ddp", lambda *a, **k: True)
    monkeypatch.setattr(bucket_model, "latency_bandwidth",
                        lambda ctx: {"a_s": 1e-4, "w_bytes_per_s": 1e9, "source": "test"})
    ctx = types.SimpleNamespace(is_main=True, rank=0, world_size=2, backend="gloo",
                                device=torch.device("cpu"), print=lambda *a, **k: None)
    args = types.SimpleNamespace(model="tiny", context_length=16, bucket_sizes=[0.25, 1.0, 4.0],
                                 check=True)
    overlap_ddp.verify_main(ctx, args)  # --check (make check): the proof alone, no demo
    bucketed_ddp.verify_main(ctx, args)
    assert csv_names == []
    args.check = False
    overlap_ddp.verify_main(ctx, args)
    bucketed_ddp.verify_main(ctx, args)
    assert csv_names == [step_bench.DEMO_CSV_NAME] * 2
    assert results.read_json("bucket_model_demo.json") and not results.read_json("bucket_model.json")
    overlap_ddp.bench_main(ctx, args)
    bucketed_ddp.bench_main(ctx, args)
    assert csv_names[2:] == [step_bench.CSV_NAME] * 2 and results.read_json("bucket_model.json")


@pytest.mark.parametrize("main, argv, needle", [
    (naive_ddp.main, ["--bench", "--batch-size", "3"], "not divisible by world size 2"),
    (naive_ddp.main, ["--bench", "--model", "huge"], "invalid choice: 'huge'"),
    (naive_ddp.main, ["--bench", "--steps", "0"], "'0' is not a whole number >= 1"),
    (flat_ddp.main, ["--bench", "--model", "2.7B", "--world-size", "64", "--batch-size", "64"],
     "GiB"),
    (flat_ddp.main, ["--world-size", "1000"], "1000 ranks need about"),
    (overlap_ddp.main, ["--batch-size", "3", "--profile"], "3"),
    (overlap_ddp.main, ["--case-budget-s", "nan"], "'nan' is not a finite number > 0"),
    (bucketed_ddp.main, ["--bucket-sizes", "0"], "'0' is not a finite number > 0"),
    (bucketed_ddp.main, ["--bucket-sizes", "abc"], "'abc'"),
    (bucketed_ddp.main, ["--bucket-sizes", ""], "empty list"),
    (bucketed_ddp.main, ["--bucket-sizes", "1,-5"], "'-5'"),
    (bucketed_ddp.main, ["--bucket-size-mb", "inf", "--profile"], "'inf'"),
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
    files = [*REPO.glob("0*/*.py"), *REPO.glob("07_parallelism/[0-9]*/*.py")]  # measure/: fixed place
    runnable = [p.relative_to(REPO) for p in files if "\ndef main(" in p.read_text()]
    scripts = [p.relative_to(REPO) for p in files if "def _repo" in p.read_text()]
    assert scripts == runnable and len({source(f, "_repo") for f in scripts}) == 1, scripts
    for stage, new in (("04", "+class FlatDDP"), ("05", "+class OverlapDDP"),
                       ("06", "+class BucketedDDP")):
        r = subprocess.run(["make", "--no-print-directory", "diff", f"S={stage}"], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and new in r.stdout, r.stdout[-2000:] + r.stderr
        changed = [line for line in r.stdout.splitlines() if line[:1] in "+-"]
        shared = ["def broadcast_module_state"] + (["def weak_hook"] if stage == "06" else [])
        assert not any(name in line for name in shared for line in changed)  # not the lesson
        assert "def _repo" not in r.stdout and "def main" not in r.stdout  # no harness
