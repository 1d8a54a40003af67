"""Stages 03, 05 and 06 as scripts: the --profile proof of overlap, and bad input.

``03 --profile`` and ``05 --profile`` (tiny LM, tiny batch) are parsed and checked by the
scripts' own ``main(argv)`` and then run together in ONE launch (a launch costs seconds).
The trace assertions are the ones that cannot flake on a loaded machine: WHERE each
all-reduce is launched (the ``c10d::allreduce_`` op on the main thread, inside the
``ddp:backward`` range or not) is decided by the code, not by timing. Whether the Gloo thread
actually ran during backward is timing: it is asserted only over both ranks and both
profiled steps together (at least once); the exact-zero case (NaiveDDP launches after
backward, so nothing can run during it) is asserted everywhere. The bad-input cases call
``main(argv)`` in this process (the checks run before any worker starts), plus one through a
real interpreter for the exit status.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import bucketed_ddp
import naive_ddp
import overlap_ddp
from common import launch, profiling, results
from helpers import REPO, run_script

TINY = ["--backend", "gloo", "--device", "cpu", "--world-size", "2", "--model", "tiny",
        "--batch-size", "4", "--context-length", "16"]


def _steps(trace: Path) -> list[dict]:
    """Per profiled step of one rank's trace: the ddp:backward interval, the all-reduce
    launches (main thread) and the Gloo all-reduce intervals (worker threads), in us."""
    data = json.loads(trace.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    forwards = sorted(e["ts"] for e in xs if e["name"] == "ddp:forward")
    backwards = sorted((e for e in xs if e["name"] == "ddp:backward"), key=lambda e: e["ts"])
    launches = [e for e in xs if e["name"] == "c10d::allreduce_"]
    gloo = [e for e in xs if e["name"] == "gloo:all_reduce"]
    assert forwards and len(forwards) == len(backwards), f"{trace.name}: ddp ranges missing"
    assert launches and gloo, f"{trace.name}: no all-reduce (c10d launch / gloo thread) recorded"
    steps = []
    for i, bwd in enumerate(backwards):
        lo, hi = forwards[i], (forwards[i + 1] if i + 1 < len(forwards) else float("inf"))
        b0, b1 = bwd["ts"], bwd["ts"] + bwd["dur"]
        mine = [e for e in launches if lo <= e["ts"] < hi]
        steps.append({
            "launches": len(mine),
            "launched_in_backward": sum(b0 <= e["ts"] and e["ts"] + e["dur"] <= b1 for e in mine),
            "gloo_during_backward_us": sum(max(0.0, min(e["ts"] + e["dur"], b1) - max(e["ts"], b0))
                                           for e in gloo if lo <= e["ts"] < hi),
        })
    return steps


def _check_outputs(stdout: str, out: Path, cases: list[str]):
    for case in cases:
        for rank in (0, 1):  # file names are slugs of the labels: no spaces or parentheses
            path = out / f"{case}_rank{rank}.json"
            assert path.is_file(), f"missing {path}; have {sorted(p.name for p in out.iterdir())}"
    assert not [p for p in out.iterdir() if re.search(r"[\s()]", p.name)], list(out.iterdir())
    # the text timeline is always printed; the picture when matplotlib is there
    assert "compute |" in stdout and "comm    |" in stdout, stdout[-3000:]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib not installed" in stdout
    else:
        png = out / "timeline.png"
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _parsed_run(monkeypatch, main, argv):
    """What ``main(argv)`` would launch: (worker, config, args), parsed and checked by the
    script's own main() but not started, so that several runs can share one launch."""
    calls = []
    with monkeypatch.context() as m:  # (undo() would also drop conftest's RESULTS_DIR)
        m.setattr(launch, "launch", lambda worker, config, *args, **kw:
                  calls.append((worker, config, args)))
        main(argv)
    assert len(calls) == 1, calls
    return calls[0]


def profile_both_worker(ctx, runs):
    for worker, args in runs:
        worker(ctx, *args)


def test_profile_03_and_05(tmp_path, monkeypatch, capfd):
    """03 --profile and 05 --profile as their main() parses them, run in ONE launch."""
    w3, config, a3 = _parsed_run(monkeypatch, naive_ddp.main,
                                 ["--profile", *TINY, "--trace-dir", str(tmp_path)])
    w5, config5, a5 = _parsed_run(monkeypatch, overlap_ddp.main,
                                  ["--profile", *TINY, "--trace-dir", str(tmp_path)])
    assert w3 is naive_ddp.profile_main and w5 is overlap_ddp.profile_main
    assert config == config5 and config.world_size == 2
    launch.launch(profile_both_worker, config, [(w3, a3), (w5, a5)], timeout_s=150)
    stdout = capfd.readouterr().out
    out3, out5 = tmp_path / "03_naive_ddp", tmp_path / "05_overlap_ddp"
    _check_outputs(stdout, out3, ["naive_03"])
    _check_outputs(stdout, out5, ["naive_03", "overlap_05"])
    assert stdout.count("Communication in the profiled step") == 2, stdout[-3000:]

    # 03 and the naive case of 05: every all-reduce launched after backward, none ran in it
    for trace in [out3 / "naive_03_rank0.json", out3 / "naive_03_rank1.json",
                  out5 / "naive_03_rank0.json", out5 / "naive_03_rank1.json"]:
        for step in _steps(trace):
            assert step["launches"] >= 1 and step["launched_in_backward"] == 0, (trace, step)
            assert step["gloo_during_backward_us"] == 0, (trace, step)
    # 05: every parameter's all-reduce is issued by its hook inside backward; only the small
    # "had a gradient" flags all-reduce of finish_gradient_synchronization() comes after it
    gloo_overlap_us = 0.0
    for rank in (0, 1):
        for step in _steps(out5 / f"overlap_05_rank{rank}.json"):
            assert step["launched_in_backward"] >= step["launches"] - 1 >= 1, step
            gloo_overlap_us += step["gloo_during_backward_us"]
    # Timing, so summed over both ranks and both profiled steps: Gloo ran some all-reduce
    # while backward was still computing (the summary shows rank 0's last step only).
    assert gloo_overlap_us > 0, "Gloo never ran an all-reduce during backward (any rank, step)"
    during = re.findall(r"(naive \(03\)|overlap \(05\)): step .*?communication during "
                        r"backward ([\d.]+) ms", stdout)
    assert sorted(label for label, _ in during) == ["naive (03)", "naive (03)", "overlap (05)"]
    assert all(float(ms) == 0.0 for label, ms in during if label == "naive (03)"), during
    # the same summary, as rows for the make bench report
    rows = {(r["stage"], r["case"]): r for r in results.read_csv(profiling.PROFILE_CSV)}
    assert set(rows) == {("03_naive_ddp", "naive (03)"), ("05_overlap_ddp", "naive (03)"),
                         ("05_overlap_ddp", "overlap (05)")}
    for (stage, case), r in rows.items():
        assert float(r["step_ms"]) > 0 and int(r["all_reduces"]) >= 1, r
        if case == "naive (03)":
            assert float(r["comm_during_backward_ms"]) == 0.0, r


@pytest.mark.parametrize("main, argv, needle", [
    (bucketed_ddp.main, ["--bucket-sizes", "0"], "'0'"),
    (bucketed_ddp.main, ["--bucket-sizes", "abc"], "'abc'"),
    (bucketed_ddp.main, ["--bucket-sizes", "1,-5"], "'-5'"),
    (bucketed_ddp.main, ["--bucket-size-mb", "-1"], "-1"),
    (bucketed_ddp.main, ["--bucket-size-mb", "0", "--profile"], "0"),
    (overlap_ddp.main, ["--batch-size", "3"], "3"),
    (overlap_ddp.main, ["--batch-size", "3", "--profile"], "3"),
])
def test_bad_input_one_line_exit_2(capsys, main, argv, needle):
    with pytest.raises(SystemExit) as exc:
        main(["--backend", "gloo", "--device", "cpu", "--world-size", "2", *argv])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0] and needle in lines[0], captured.err
    assert "[rank" not in captured.out  # rejected before any worker started


def test_bad_input_exit_2_as_a_process():
    """One case through a real interpreter: the exit status and the single stderr line."""
    r = run_script(REPO / "06_bucketed_ddp" / "bucketed_ddp.py", "--bucket-sizes", "abc",
                   "--backend", "gloo", "--device", "cpu", timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "'abc'" in lines[0], r.stderr


def test_plain_run_demos_do_not_touch_bench_results(monkeypatch, tmp_path):
    """The plain runs' quick demos (make run) write ddp_step_demo.csv and
    bucket_model_demo.json; only --bench writes ddp_step.csv and bucket_model.json.
    No process group: the benchmark itself is replaced by a recorder."""
    import types

    import torch

    from common import results, step_bench
    csv_names = []

    def fake_run_step_bench(ctx, cases, args, csv_name=step_bench.CSV_NAME):
        csv_names.append(csv_name)
        return [{"impl": "bucketed", "bucket_mb": size, "step_ms": 10.0 + size,
                 "comm_after_backward_ms": 1.0, "ratio_vs_torch_ddp": 1.0}
                for size in args.bucket_sizes] + \
               [{"impl": "torch_ddp", "bucket_mb": 25, "step_ms": 10.0}]

    monkeypatch.setattr(step_bench, "run_step_bench", fake_run_step_bench)
    monkeypatch.setattr(step_bench, "verify_ddp", lambda *a, **k: True)
    monkeypatch.setattr(bucketed_ddp, "latency_bandwidth",
                        lambda ctx, res: {"a_s": 1e-4, "w_bytes_per_s": 1e9, "source": "test"})
    ctx = types.SimpleNamespace(is_main=True, rank=0, world_size=2, backend="gloo",
                                device=torch.device("cpu"), print=lambda *a, **k: None)
    args = types.SimpleNamespace(model="tiny", context_length=16, bucket_sizes=[0.25, 1.0, 4.0])

    overlap_ddp.data_parallel_main(ctx, args)
    bucketed_ddp.data_parallel_main(ctx, args)
    assert csv_names == [step_bench.DEMO_CSV_NAME] * 2 != [step_bench.CSV_NAME] * 2
    assert results.read_json("bucket_model_demo.json")
    assert not results.read_json("bucket_model.json")

    overlap_ddp.step_bench_main(ctx, args)
    bucketed_ddp.step_bench_main(ctx, args)
    assert csv_names[2:] == [step_bench.CSV_NAME] * 2
    assert results.read_json("bucket_model.json")
