"""Fault injection: every way a run was seen to go wrong, as a test, so none can come back.

The launcher owns its workers: SIGTERM, SIGINT (to the parent alone) and SIGKILL to the parent
leave no worker alive five seconds later and no temporary files, with one line and no
traceback; a rank that raises, dies or stalls (SIGSTOP) ends the run and is named; Ctrl-C
keeps the rows written so far. Results files survive corruption and concurrent writers; a
folder that cannot be written, a world size that cannot fit, empty lists and NaN flags are
refused before any worker starts. The processes of one test run side by side: each costs
seconds of start-up on a small machine.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import allreduce_bench
import bucketed_ddp
import naive_ddp
import overlap_ddp
from common import launch, results
from helpers import REPO, assert_main_usage_error

FAULTS = REPO / "tests" / "fault_worker.py"


def _start(argv, tmp: Path, env=None) -> subprocess.Popen:
    tmp.mkdir(parents=True, exist_ok=True)  # its own TMPDIR: leftovers are easy to see
    return subprocess.Popen([sys.executable, *map(str, argv)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1",
                                 **(env or {})})


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(proc, pattern: str, lines: list[str], timeout: float = 90) -> None:
    """Read proc's stdout into ``lines`` until a line matches ``pattern``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"exited before {pattern!r}: {''.join(lines)}"
                                 f"{proc.stderr.read()[-2000:]}")
        lines.append(line)
        if re.search(pattern, line):
            return
    raise AssertionError(f"no {pattern!r} within {timeout} s: {''.join(lines)}")


def test_signals_to_the_parent_stop_every_worker(tmp_path):
    runs = {sig: _start([FAULTS, "--world-size", "2", "--fault", "busy", "--backend", "gloo",
                         "--device", "cpu"], tmp_path / sig.name)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)}
    pids = {}
    for sig, proc in runs.items():
        lines = []
        _wait_for(proc, r"\[rank 1\] pid \d+ busy", lines)
        _wait_for(proc, r"\[rank 0\] pid \d+ busy", lines) if "[rank 0]" not in "".join(lines) else None
        pids[sig] = [int(p) for p in re.findall(r"pid (\d+) busy", "".join(lines))]
        proc.send_signal(sig)  # to the parent alone, not its process group
    for sig, proc in runs.items():
        code = proc.wait(timeout=30)
        err = proc.stderr.read()
        assert code == (-9 if sig == signal.SIGKILL else 128 + sig), (sig, code, err)
        if sig != signal.SIGKILL:
            assert err.strip() == f"stopped by {sig.name}: all 2 ranks ended; results written " \
                                  "before this point are kept", err
    time.sleep(5)
    for sig in runs:
        assert len(pids[sig]) == 2 and not any(_alive(p) for p in pids[sig]), (sig, pids[sig])
        assert not list((tmp_path / sig.name).iterdir()), f"{sig.name}: temporary files left"


def test_a_failing_or_stalled_rank_ends_the_run_and_is_named(tmp_path):
    runs = {fault: _start([FAULTS, "--world-size", "2", "--fault", fault, "--bad-rank", "1",
                           "--backend", "gloo", "--device", "cpu"], tmp_path / fault,
                          env={"DIST_TIMEOUT_S": "6"})
            for fault in ("raise", "kill", "stop")}
    for fault, proc in runs.items():
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 1, (fault, out, err)
        assert "passed the second barrier" not in out
        want = {"raise": "rank 1 failed first:", "kill": "rank 1 was killed by SIGKILL",
                "stop": "rank(s) [1] stalled (stopped by a signal, SIGSTOP?)"}[fault]
        assert want in err, (fault, err[-3000:])
        if fault == "raise":
            assert "ValueError: planted failure on rank 1" in err
        planted = float(out.split(f"planting {fault} at ")[1].split()[0])
        if fault != "stop":  # the others notice in well under the collective timeout
            assert time.time() - planted < 30, (fault, time.time() - planted)
        assert not list((tmp_path / fault).iterdir()), f"{fault}: temporary files left"


def test_ctrl_c_to_the_parent_alone_keeps_finished_rows(tmp_path):
    results_dir = tmp_path / "results"
    proc = _start([REPO / "02_allreduce_bench" / "allreduce_bench.py", "--backend", "gloo",
                   "--device", "cpu", "--sizes", "4KB,64KB,1MB,4MB,16MB,64MB,256MB",
                   "--world-sizes", "2"], tmp_path / "tmp", env={"RESULTS_DIR": str(results_dir)})
    lines = []
    _wait_for(proc, r"ws=2 64KB ring_pipelined:", lines)
    proc.send_signal(signal.SIGINT)  # the parent only: not a terminal's process-group Ctrl-C
    assert proc.wait(timeout=60) == 130
    out, err = "".join(lines) + proc.stdout.read(), proc.stderr.read()
    assert "Traceback" not in err and "stopped by SIGINT" in err, err
    rows = results.read_csv("allreduce.csv", results_dir)
    assert 6 <= len(rows) < 21 and all(float(r["busbw_gbps"]) > 0 for r in rows), out
    assert "fit of the backend's times" in out  # the report of what finished


def fit_file_worker(ctx, folder: str):
    import bucket_model
    os.environ["RESULTS_DIR"] = folder  # rank 0's folder decides for everyone
    for text in ("{", '{"gloo/cpu/2": {"a_s": 1e-4, "w_bytes_per_s": "fast"}}', "[1, 2]"):
        if ctx.is_main:
            Path(folder, "allreduce_fit.json").write_text(text)
        fit = bucket_model.latency_bandwidth(ctx)
        assert fit["source"] == "measured in this run" and fit["w_bytes_per_s"] > 0, (text, fit)


def test_a_corrupt_or_malformed_fit_file_is_measured_around(tmp_path, capfd):
    launch.launch(fit_file_worker, launch.LaunchConfig(2, "gloo", "cpu"), str(tmp_path),
                  timeout_s=120)
    err = capfd.readouterr().err
    assert "warning: ignoring" in err and "allreduce_fit.json: not valid JSON" in err
    assert "expected a JSON object, found list" in err


def test_two_writers_of_one_csv_lose_no_row(tmp_path):
    code = ("import sys; from common import results\n"
            "for i in range(150):\n"
            "    results.upsert_csv('c.csv', [{'writer': sys.argv[1], 'i': i}], key=['writer', 'i'])\n")
    writers = [subprocess.Popen([sys.executable, "-c", code, w], cwd=REPO, stderr=subprocess.PIPE,
                                env={**os.environ, "RESULTS_DIR": str(tmp_path)}, text=True)
               for w in "ab"]
    for w in writers:
        assert w.wait(timeout=120) == 0, w.stderr.read()
    rows = results.read_csv("c.csv", tmp_path)
    assert sorted((r["writer"], int(r["i"])) for r in rows) == \
        [(w, i) for w in "ab" for i in range(150)]
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_results_folder_that_cannot_be_written_is_refused_up_front(tmp_path, monkeypatch,
                                                                     capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("RESULTS_DIR", str(blocker / "results"))
    for main, argv in [(allreduce_bench.main, ["--sizes", "4KB"]),
                       (bucketed_ddp.main, ["--bench"])]:
        with pytest.raises(SystemExit) as e:
            main(["--backend", "gloo", "--device", "cpu", *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, err
        assert f"cannot write results to {blocker / 'results'}" in err


@pytest.mark.parametrize("main, argv, needle", [
    (naive_ddp.main, ["--world-size", "1000"], "1000 ranks need about"),
    (bucketed_ddp.main, ["--bench", "--world-size", "96", "--batch-size", "96"], "96 ranks need"),
    (bucketed_ddp.main, ["--bench", "--model", "2.7B", "--batch-size", "2"],  # the model's share
     "GiB each for --model 2.7B"),
    (overlap_ddp.main, ["--case-budget-s", "nan"], "'nan' is not a finite number > 0"),
    (bucketed_ddp.main, ["--bucket-size-mb", "inf", "--profile"], "'inf' is not a finite"),
    (bucketed_ddp.main, ["--bucket-sizes", ""], "empty list"),
    (allreduce_bench.main, ["--budget-s", "nan"], "'nan' is not a finite number > 0"),
    (allreduce_bench.main, ["--world-sizes", ""], "empty list"),
])
def test_limits_nan_and_empty_lists_are_refused(main, argv, needle, capsys, monkeypatch):
    from common import launch
    monkeypatch.setattr(launch, "host_available_bytes", lambda: 20 * 2**30)  # any box: 20 GiB
    assert_main_usage_error(main, ["--backend", "gloo", "--device", "cpu", *argv], capsys,
                            needle)


def test_a_taken_port_and_a_sweep_with_nothing_measured_end_with_a_reason(tmp_path, capfd):
    """A rank that cannot even join the group is named; a sweep that skipped everything
    exits non-zero, with the reasons."""
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = subprocess.run([sys.executable, str(FAULTS), "--fault", "none", "--backend", "gloo",
                            "--device", "cpu"], cwd=REPO, capture_output=True, text=True,
                           timeout=120, env={**os.environ, "MASTER_PORT": str(taken.getsockname()[1])})
    assert r.returncode == 1 and "failed first" in r.stderr and "EADDRINUSE" in r.stderr, r.stderr
    with pytest.raises(SystemExit) as e:  # 4 KB over a 1 ns budget: every configuration skipped
        allreduce_bench.main(["--backend", "gloo", "--device", "cpu", "--sizes", "4KB",
                              "--world-sizes", "2", "--budget-s", "1e-9"])
    out, err = capfd.readouterr()
    assert e.value.code == 1 and "over the 1e-09 s budget" in out, out
    assert "nothing was measured: every configuration was skipped" in err


def test_an_unreadable_csv_is_moved_aside_not_overwritten(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RESULTS_DIR", str(tmp_path))
    (tmp_path / "ddp_step.csv").write_text("impl,step_ms\nnaive,1.0\nflat,2.0,extra,fields\n")
    assert results.read_csv("ddp_step.csv") == []  # a torn file reads as empty, with a warning
    results.upsert_csv("ddp_step.csv", [{"impl": "overlap", "step_ms": 3.0}], key=["impl"])
    err = capsys.readouterr().err
    assert "warning: ignoring" in err and "moved the unreadable" in err, err
    aside = list(tmp_path.glob("ddp_step.csv.corrupt-*"))
    assert len(aside) == 1 and "naive,1.0" in aside[0].read_text()  # nothing lost
    assert results.read_csv("ddp_step.csv") == [{"impl": "overlap", "step_ms": "3.0"}]
