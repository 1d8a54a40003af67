"""Fault injection: every way a run was seen to go wrong, as a test, so none can come back.

``make bench`` owns its steps as the launcher owns its ranks: SIGTERM or SIGINT to it reach
the running step's launcher alone (one line, no traceback), SIGKILL to it kills the step's
launcher (Linux's parent-death signal), and either way no step process or rank is alive six
seconds later and no temporary file is left; the report of the steps that finished is written,
or, after SIGKILL, the previous one is left whole. A rank that raises, dies or stalls (SIGSTOP)
ends the run and is named; a closed output (``| head -1``) ends it without a traceback; a rank
waiting for its peers says so, once; Ctrl-C keeps the rows written so far. Results files
survive corruption and concurrent writers and keep the umask's mode; a folder that cannot be
written or holds a folder where a lock goes, a trace folder that cannot be made, a world size
that cannot fit, empty lists, NaN flags and environment variables out of their range are
refused before any worker starts. The processes of one test run side by side: each costs
seconds of start-up on a small machine.
"""

from __future__ import annotations

import os
import re
import signal
import socket
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


def _live_processes() -> dict[int, list[str]]:
    """Every live process: its /proc stat fields after the name (state, ppid, pgrp, session)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if fields[0] != "Z":
            found[int(stat.parent.name)] = fields
    return found


def _session(sid: int) -> list[int]:
    """The live processes of session ``sid`` (a step's: the script, its ranks, their helpers)."""
    return [pid for pid, fields in _live_processes().items() if int(fields[3]) == sid]


def _children(ppid: int) -> list[int]:
    return [pid for pid, fields in _live_processes().items() if int(fields[1]) == ppid]


def test_sigterm_or_sigkill_to_make_bench_stop_its_step_and_every_rank(tmp_path):
    """SIGTERM or SIGKILL to ``make bench`` used to leave the running step and its ranks alive
    (in their own session) and the report's pictures deleted, and a ``launch-errors-*`` folder.
    Now, 6 s after the signal, nothing of the step is alive and no temporary file is left.
    (SIGINT takes SIGTERM's path in make bench: tests/test_bench.py; the launcher's answer to
    SIGINT: the Ctrl-C test below.)"""
    (tmp_path / "rows.py").write_text(ROWS_STEP)
    runs = {}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        out = tmp_path / sig.name / "results"
        out.mkdir(parents=True)
        for name, text in PREVIOUS_REPORT.items():
            (out / name).write_text(text)
        runs[sig] = _start(["-c", BENCH_DRIVER, tmp_path / "rows.py"], tmp_path / sig.name / "tmp",
                           env={"RESULTS_DIR": str(out), "BENCH_BUDGET_S": "100"})
    stages = {}  # signal: the step's pid, which is also its session's id
    ranks = {}
    signalled = {}
    for sig, proc in runs.items():
        lines = []
        _wait_for(proc, r"\[rank 1\] pid \d+ busy", lines)
        if "[rank 0]" not in "".join(lines):
            _wait_for(proc, r"\[rank 0\] pid \d+ busy", lines)
        ranks[sig] = [int(p) for p in re.findall(r"pid (\d+) busy", "".join(lines))]
        rank_stat = Path(f"/proc/{ranks[sig][0]}/stat").read_text()
        stages[sig] = int(rank_stat.rsplit(")", 1)[1].split()[1])  # the rank's parent
        in_session = _session(stages[sig])
        assert stages[sig] in in_session and set(ranks[sig]) <= set(in_session), in_session
        proc.send_signal(sig)  # to make bench alone: the step is in a session of its own
        signalled[sig] = time.monotonic()
    for sig, proc in runs.items():
        code = proc.wait(timeout=30)
        out, err = proc.communicate()
        assert code == (-9 if sig == signal.SIGKILL else 128 + sig), (sig, code, err[-3000:])
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
    for sig in runs:
        time.sleep(max(0.0, signalled[sig] + 6 - time.monotonic()))
        assert _session(stages[sig]) == [] and not any(_alive(p) for p in ranks[sig]), sig
        assert not list((tmp_path / sig.name / "tmp").iterdir()), f"{sig.name}: temporary files"
        assert [p.name for p in (tmp_path / sig.name / "results").iterdir()
                if p.name.startswith(".")] == [], f"{sig.name}: the report's temporary folder"


def _start_without_a_reader(argv, tmp: Path) -> subprocess.Popen:
    """Start ``argv`` with its stdout a pipe whose reader has already gone: ``| head -1`` once
    head has its line, so that the first print hits the closed pipe for sure."""
    tmp.mkdir(parents=True)
    reader, writer = os.pipe()
    os.close(reader)
    proc = subprocess.Popen([sys.executable, *map(str, argv)], cwd=REPO, text=True, stdout=writer,
                            stderr=subprocess.PIPE, env={**os.environ, "TMPDIR": str(tmp)})
    os.close(writer)
    return proc


def test_a_failing_stalled_or_unread_rank_ends_the_run(tmp_path):
    """A rank that raises, is killed or stalls ends the run and is named. A closed output
    (``python script.py | head -1``): the next print raises BrokenPipeError, in a rank (the
    launcher used to report it as the rank's failure, with its traceback) or in the parent (a
    traceback); now the run ends without a word, as a Unix tool does. (One test: the runs start
    side by side, and the closed outputs' ends overlap the stalled rank's timeout.)"""
    one_rank = [FAULTS, "--world-size", "1", "--bad-rank", "0", "--fault", "none", "--backend",
                "gloo", "--device", "cpu"]
    unread = {"rank": _start_without_a_reader(one_rank, tmp_path / "unread_rank"),
              "parent": _start_without_a_reader(["-c", "from common import launch\n"
                                                 "for i in range(3):\n    print(i, flush=True)"],
                                                tmp_path / "unread_parent")}
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
    for who, proc in unread.items():
        err = proc.communicate(timeout=90)[1]
        assert proc.returncode == 1 and err == "", (who, proc.returncode, err[-3000:])
        assert not list((tmp_path / f"unread_{who}").iterdir()), f"{who}: temporary files left"


def test_joining_a_rank_that_waits_says_what_for_and_one_that_cannot_is_recorded(
        monkeypatch, capfd):
    """A rank whose peers never come (an unreachable MASTER_ADDR, rank 0 not started) used to
    wait DIST_TIMEOUT_S (300 s) without a word. Now it says, once, after half of that (at most
    10 s), where it waits and for how long; then torch's timeout ends the wait. A rank that
    cannot even join (rank 0's port taken) is recorded like any failure, so the launcher names
    it (as the raising rank above); both in this process, as one rank of two."""
    port = launch.free_port()  # nobody listens there: rank 0 never comes
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("DIST_TIMEOUT_S", "1")
    with pytest.raises(RuntimeError, match="timed out"):
        launch._run_worker(print, 1, 2, 1, "gloo", "cpu", ())
    notes = [line for line in capfd.readouterr().err.splitlines() if "still waiting" in line]
    assert notes == [f"[rank 1] still waiting, after 0.5 s, for the other 1 rank(s) to join the "
                     f"process group at 127.0.0.1:{port} (rank 0 listens there); torch's limit "
                     "for this wait is DIST_TIMEOUT_S = 1 s"], notes
    recorded = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        with pytest.raises(RuntimeError, match="EADDRINUSE"):
            launch._run_worker(print, 0, 2, 0, "gloo", "cpu", (), lambda: recorded.append(1))
    assert recorded == [1]


def test_a_rank_that_cannot_start_shows_why():
    """When a process's start() raises (here: an argument spawn cannot pickle; also a script
    without the ``if __name__ == "__main__":`` guard), the launcher used to join processes
    never started and raise AssertionError, hiding the real error."""
    with pytest.raises(Exception) as e:
        launch.launch(fit_file_worker, launch.LaunchConfig(2, "gloo", "cpu"), lambda: None)
    assert not isinstance(e.value, AssertionError) and "pickle" in str(e.value), repr(e.value)


def test_ctrl_c_to_the_parent_alone_ends_every_rank_and_keeps_finished_rows(tmp_path):
    results_dir = tmp_path / "results"
    proc = _start([REPO / "02_allreduce_bench" / "allreduce_bench.py", "--backend", "gloo",
                   "--device", "cpu", "--sizes", "4KB,64KB,1MB,4MB,16MB,64MB,256MB",
                   "--world-sizes", "2"], tmp_path / "tmp", env={"RESULTS_DIR": str(results_dir)})
    lines = []
    _wait_for(proc, r"ws=2 64KB ring_pipelined:", lines)
    ranks = [pid for pid in _children(proc.pid)  # not multiprocessing's resource tracker
             if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    proc.send_signal(signal.SIGINT)  # the parent only: not a terminal's process-group Ctrl-C
    assert proc.wait(timeout=60) == 130
    out, err = "".join(lines) + proc.stdout.read(), proc.stderr.read()
    assert "Traceback" not in err and "stopped by SIGINT: all 2 ranks ended; results written " \
        "before this point are kept" in err.splitlines(), err
    assert len(ranks) == 2 and not any(_alive(pid) for pid in ranks), ranks  # ended, joined
    assert not list((tmp_path / "tmp").iterdir()), "temporary files left"
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


@pytest.mark.parametrize("name, value, needle", [
    ("DIST_TIMEOUT_S", "1e30", "DIST_TIMEOUT_S='1e30': give the seconds a rank waits for its "
                               "peers, from 0.001 to 604800 (a week)"),  # an OverflowError
    ("DIST_TIMEOUT_S", "0.0004", "from 0.001"),  # torch's whole milliseconds: an instant timeout
    ("DIST_TIMEOUT_S", "nan", "from 0.001"),
    ("MASTER_PORT", "abc", "MASTER_PORT='abc': give a TCP port from 1 to 65535"),  # a traceback
    ("MASTER_PORT", "70000", "MASTER_PORT='70000'"),  # the workers started, then a traceback
    ("MASTER_PORT", "0", "MASTER_PORT='0'"),
    ("MASTER_ADDR", "bad..host", "MASTER_ADDR='bad..host' does not resolve"),
    ("RESULTS_DIR", "", "RESULTS_DIR is set but empty"),  # wrote into the current folder
])
def test_environment_variables_out_of_range_are_refused(name, value, needle, monkeypatch,
                                                        capsys):
    monkeypatch.setenv(name, value)
    assert_main_usage_error(naive_ddp.main, ["--backend", "gloo", "--device", "cpu"], capsys,
                            needle)


def test_a_lock_or_trace_folder_that_cannot_work_is_refused_up_front(tmp_path, monkeypatch,
                                                                     capsys):
    """A folder where a results lock goes: the whole run, then its rows lost (IsADirectoryError).
    A trace folder that cannot be made: the profiled steps, then a traceback."""
    monkeypatch.setenv("RESULTS_DIR", str(tmp_path))
    (tmp_path / ".ddp_profile.csv.lock").mkdir()
    for argv, needle in [([], f"{tmp_path / '.ddp_profile.csv.lock'} is a folder: results locks "
                              "go there"),
                         (["--bench"], ".ddp_profile.csv.lock is a folder")]:
        assert_main_usage_error(overlap_ddp.main, ["--backend", "gloo", "--device", "cpu", *argv],
                                capsys, needle)
    (tmp_path / ".ddp_profile.csv.lock").rmdir()
    assert_main_usage_error(overlap_ddp.main, ["--profile", "--trace-dir", "/dev/null/x"], capsys,
                            "argument --trace-dir: '/dev/null/x': /dev/null is not a folder")


def test_a_sweep_with_nothing_measured_ends_with_a_reason(capfd):
    """A sweep that skipped everything exits non-zero, with the reasons."""
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


def test_a_header_alone_is_valid_and_files_keep_the_umasks_mode(tmp_path, monkeypatch, capsys):
    """A CSV with a header and no rows was called unreadable and moved aside; every CSV and JSON
    write left the file 0600, so a shared results folder became unreadable to others."""
    monkeypatch.setenv("RESULTS_DIR", str(tmp_path))
    (tmp_path / "ddp_step.csv").write_text("impl,step_ms,note\n")
    assert results.read_csv("ddp_step.csv") == []
    results.upsert_csv("ddp_step.csv", [{"impl": "flat", "step_ms": 2.0}], key=["impl"])
    assert capsys.readouterr().err == "" and list(tmp_path.glob("*.corrupt-*")) == []
    assert (tmp_path / "ddp_step.csv").read_text().splitlines() == ["impl,step_ms,note",
                                                                    "flat,2.0,"]
    old_umask = os.umask(0o027)
    try:
        results.write_json("new.json", {})
        results.upsert_csv("new.csv", [{"a": 1}], key=["a"])
        os.chmod(tmp_path / "ddp_step.csv", 0o664)  # a mode of the user's own choosing: kept
        results.upsert_csv("ddp_step.csv", [{"impl": "naive", "step_ms": 1.0}], key=["impl"])
    finally:
        os.umask(old_umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir() if p.suffix != ".lock"}
    assert modes == {"new.json": 0o640, "new.csv": 0o640, "ddp_step.csv": 0o664}, modes
