"""Fault injection: every way a run was seen to go wrong, as a test, so none can come back.

The launcher owns its workers: Ctrl-C to the parent alone ends every rank at once and keeps
the rows written so far, with one line and no traceback and no temporary file (SIGTERM and
SIGKILL, through ``make bench``: tests/test_bench.py); a rank that raises, dies or stalls
(SIGSTOP) ends the run and is named, the one that raised first by the time it raised, and a
segfaulted one with its Python stack (faulthandler); a closed output (``| head -1``) ends it
without a traceback; a rank waiting for its peers says so, once, and one that cannot join raises.
Results files survive corruption and concurrent writers, accept a header alone and keep the
umask's mode; a folder that cannot be written or holds a folder where a lock goes, a trace
folder that cannot be made, a world size that cannot fit, empty lists, NaN flags and
environment variables out of their range are refused before any worker starts. The processes
of one test run side by side: each costs seconds of start-up on a small machine.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import naive_ddp
import fault_worker
from bench import allreduce_sweep, ddp_step, profile_ddp, results
from bench import supervisor as launch
from helpers import REPO, alive, assert_main_usage_error, children, start_script, wait_for_line

FAULTS = REPO / "tests" / "fault_worker.py"


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
              "parent": _start_without_a_reader(["-c", "from bench import supervisor as launch\n"
                                                 "launch.make_parser(None)\n"
                                                 "for i in range(3):\n    print(i, flush=True)"],
                                                tmp_path / "unread_parent")}
    runs = {fault: start_script([FAULTS, "--world-size", "2", "--fault", fault, "--bad-rank", "1",
                           "--backend", "gloo", "--device", "cpu"], tmp_path / fault,
                          env={"DIST_TIMEOUT_S": "6"})
            for fault in ("raise", "kill", "segv", "stop")}
    for fault, proc in runs.items():
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 1, (fault, out, err)
        assert "passed the second barrier" not in out
        want = {"raise": "rank 1 failed first:", "kill": "rank 1 was killed by SIGKILL",
                "segv": "rank 1 was killed by SIGSEGV (a crash in native code: its Python stack, "
                        "from faulthandler, is above)",
                "stop": "rank(s) [1] stalled (stopped by a signal, SIGSTOP?)"}[fault]
        assert want in err, (fault, err[-3000:])
        if fault == "raise":  # its traceback, without the note the launcher orders failures by
            assert "ValueError: planted failure on rank 1" in err and launch.RAISED_AT not in err
        if fault == "segv":  # faulthandler's stack of the crashed rank, down to the bad line
            assert "Fatal Python error: Segmentation fault" in err, err[-3000:]
            assert 'fault_worker.py", line' in err and "in faulty_main" in err, err[-3000:]
        planted = float(out.split(f"planting {fault} at ")[1].split()[0])
        if fault != "stop":  # the others notice in well under the collective timeout
            assert time.time() - planted < 30, (fault, time.time() - planted)
        assert not list((tmp_path / fault).iterdir()), f"{fault}: temporary files left"
    for who, proc in unread.items():
        err = proc.communicate(timeout=90)[1]
        assert proc.returncode == 1 and err == "", (who, proc.returncode, err[-3000:])
        assert not list((tmp_path / f"unread_{who}").iterdir()), f"{who}: temporary files left"


def test_joining_a_rank_that_waits_says_what_for_and_one_that_cannot_raises(monkeypatch, capfd):
    """A rank whose peers never come (an unreachable MASTER_ADDR, rank 0 not started) used to
    wait DIST_TIMEOUT_S (300 s) without a word. Now it says, once, after half of that (at most
    10 s), where it waits and for how long; then torch's timeout ends the wait. A rank that
    cannot even join (rank 0's port taken) raises, so torch's wrapper records it and the
    launcher names it (as the raising rank above); both in this process, as one rank of two,
    each error carrying the time the launcher orders failures by."""
    port = launch.free_port()  # nobody listens there: rank 0 never comes
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("DIST_TIMEOUT_S", "1")
    with pytest.raises(RuntimeError, match="timed out") as e:
        launch._run_worker(print, 1, 2, 1, "gloo", "cpu", ())
    notes = [line for line in capfd.readouterr().err.splitlines() if "still waiting" in line]
    assert notes == [f"[rank 1] still waiting, after 0.5 s, for the other 1 rank(s) to join the "
                     f"process group at 127.0.0.1:{port} (rank 0 listens there); torch's limit "
                     "for this wait is DIST_TIMEOUT_S = 1 s"], notes
    notes = getattr(e.value, "__notes__", None)  # Python 3.11 on
    assert sys.version_info < (3, 11) or notes[0].startswith(launch.RAISED_AT), notes
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        with pytest.raises(RuntimeError, match="EADDRINUSE") as e:
            launch._run_worker(print, 0, 2, 0, "gloo", "cpu", ())
    notes = getattr(e.value, "__notes__", None)
    assert sys.version_info < (3, 11) or notes[0].startswith(launch.RAISED_AT), notes


def test_the_rank_that_raised_first_is_named_not_the_first_seen(tmp_path, capsys):
    """On a busy machine the launcher can see a peer's exit first (it failed because the first
    rank went away): the first is named by the time each rank raised, noted on its error, not
    by rank order or by the order of exits. Here rank 1 raised before rank 0."""
    files = []
    for rank, (when, error) in enumerate([(200.0, "RuntimeError: Connection closed by peer"),
                                          (100.0, "ValueError: the real cause")]):
        path = tmp_path / f"rank{rank}.pickle"
        path.write_bytes(pickle.dumps(f"Traceback:\n{error}\n{launch.RAISED_AT}{when!r}\n"))
        files.append(str(path))
    with pytest.raises(SystemExit) as e:
        launch._report_failure([1, 1], files, [])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.startswith("error: rank 1 failed first:\nTraceback:\n"
                                                 "ValueError: the real cause\n"), err
    assert launch.RAISED_AT not in err and "(then rank(s) [0] failed too" in err, err


RELAUNCH_WITH_A_BUSY_THREAD = """
import os, sys, threading, torch
sys.path.insert(0, sys.argv[1])
from bench import supervisor as launch

def worker(ctx):
    ctx.print("started")

if __name__ == "__main__":
    config = launch.LaunchConfig(world_size=2, backend="gloo", device="cpu")
    launch.launch(worker, config)
    busy = threading.Thread(target=lambda: [torch.randn(2_000_000) for _ in iter(int, 1)],
                            daemon=True)
    busy.start()
    launch.launch(worker, config, timeout_s=60)
    print("second launch done", flush=True)
    os._exit(0)  # the busy thread would be inside torch at the interpreter's teardown
"""


def test_ranks_never_inherit_a_lock_from_a_thread_of_the_launcher(tmp_path):
    """A process that launched once, then runs a thread of its own that holds torch's CPU
    generator lock most of the time (``torch.randn``), launches again. Ranks forked from the
    launcher itself inherited that lock held and waited in ``torch.seed()`` forever, before
    any timeout applied; started from the fork server they never see the thread. Bounded:
    the old launcher hangs here until the 120 s limit."""
    script = tmp_path / "relaunch.py"
    script.write_text(RELAUNCH_WITH_A_BUSY_THREAD)
    assert launch._start_method() == "forkserver"
    result = subprocess.run([sys.executable, str(script), str(REPO)], cwd=tmp_path, text=True,
                            capture_output=True, timeout=120, env={**os.environ,
                                                                   "DIST_TIMEOUT_S": "15"})
    assert result.returncode == 0 and "second launch done" in result.stdout, result.stderr[-2000:]
    assert result.stdout.count("started") == 4, result.stdout


def test_a_rank_that_cannot_start_shows_why(monkeypatch):
    """When a process's start() raises (here: an argument the fork server cannot pickle; also
    a script without the ``if __name__ == "__main__":`` guard, under spawn), the launcher used
    to join processes never started and raise AssertionError, hiding the real error. (Ranks
    every rank is forked from the fork server, which pickles its arguments.)"""
    with pytest.raises(Exception) as e:
        launch.launch(fit_file_worker, launch.LaunchConfig(2, "gloo", "cpu"), lambda: None)
    assert not isinstance(e.value, AssertionError) and "pickle" in str(e.value), repr(e.value)


def test_ctrl_c_to_the_parent_alone_ends_every_rank_and_keeps_finished_rows(tmp_path):
    results_dir = tmp_path / "results"
    proc = start_script([REPO / "bench" / "allreduce_sweep.py", "--backend", "gloo",
                   "--device", "cpu", "--sizes", "4KB,64KB,1MB,4MB,16MB,64MB,256MB",
                   "--world-sizes", "2", "--warmup", "1", "--iters", "3"], tmp_path / "tmp",
                  env={"RESULTS_DIR": str(results_dir)})
    lines = []
    wait_for_line(proc, r"ws=2 64KB ring_pipelined:", lines)
    # the ranks: forked from the launcher (it had started no thread; one thread a rank), else
    # from its fork server; never its resource tracker
    launcher = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    servers = [pid for pid in children(proc.pid)
               if b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    ranks = [pid for pid in children(proc.pid)
             if Path(f"/proc/{pid}/cmdline").read_bytes() == launcher]
    if servers:
        assert len(servers) == 1 and not ranks, (servers, ranks)
        ranks = children(servers[0])
    proc.send_signal(signal.SIGINT)  # the parent only: not a terminal's process-group Ctrl-C
    assert proc.wait(timeout=60) == 130
    out, err = "".join(lines) + proc.stdout.read(), proc.stderr.read()
    assert "Traceback" not in err and "stopped by SIGINT: all 2 ranks ended; results written " \
        "before this point are kept" in err.splitlines(), err
    assert len(ranks) == 2 and not any(alive(pid) for pid in ranks), ranks  # ended, joined
    assert not list((tmp_path / "tmp").iterdir()), "temporary files left"
    rows = results.read_csv("allreduce.csv", results_dir)
    assert 6 <= len(rows) < 21 and all(float(r["busbw_gbps"]) > 0 for r in rows), out
    assert "fit of the backend's times" in out  # the report of what finished


def _rank_pids(proc, world_size: int = 2) -> list[int]:
    """The pids the ranks of a fault_worker.py run print once they have all joined."""
    lines = []
    while len(re.findall(r"\] pid \d+", "".join(lines))) < world_size:
        wait_for_line(proc, r"\] pid \d+", lines)
    return [int(pid) for pid in re.findall(r"\] pid (\d+)", "".join(lines))]


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    """Wait up to ``seconds`` for every pid to end; the ones still alive (SIGKILLed, to leave
    nothing behind)."""
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in pids if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def test_ranks_end_when_their_launcher_is_killed(tmp_path):
    """SIGKILL to the launcher while its ranks wait inside collectives (in C++, where no Python
    signal handler runs): under the course's launcher they went on till the collectives'
    timeout, holding the fork server, their parent, alive. Now every rank ends within 20 s,
    under the course's launcher and the lab's, whose ranks here ignore SIGINT (the
    parent-death signal torch asks for; the lab's asks for SIGKILL)."""
    common = [FAULTS, "--fault", "hang", "--backend", "gloo", "--device", "cpu"]
    runs = {"course": start_script([*common, "--launcher", "course"], tmp_path / "course"),
            "lab": start_script([*common, "--ignore-sigint"], tmp_path / "lab")}
    ranks = {name: _rank_pids(proc) for name, proc in runs.items()}
    for proc in runs.values():
        proc.kill()
        proc.wait(timeout=30)
    left = _gone_within(ranks["course"] + ranks["lab"], 20)
    assert left == [], (left, ranks)


ORPHANED_RANK = """
import multiprocessing, os, sys
sys.path.insert(0, sys.argv[1])
from bench import supervisor
multiprocessing.forkserver._forkserver._forkserver_alive_fd = os.open(os.devnull, os.O_RDONLY)

class Gone:
    def is_alive(self):
        return False

multiprocessing.parent_process = Gone
environ = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(supervisor.free_port()), "WORLD_SIZE": "1"}
supervisor._rank(0, print, supervisor.LaunchConfig(1, "gloo", "cpu"), ("the worker ran",), environ,
                 supervisor._Streams())
"""


def test_a_rank_whose_launcher_died_before_it_started_never_runs(tmp_path):
    """The launcher can die while a rank is being forked, before the rank asked Linux for its
    parent-death signal: the rank checks, once asked, that the launcher is still there."""
    result = subprocess.run([sys.executable, "-c", ORPHANED_RANK, str(REPO)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "the worker ran" not in result.stdout, result


def test_ctrl_c_ends_ranks_that_ignore_sigint(tmp_path):
    """A terminal's Ctrl-C (SIGINT to the launcher, its fork server and its ranks at once) with
    ranks that ignore SIGINT: the launcher still ends every one (SIGKILL), exits 130 and says
    so. (The Ctrl-C test above: ranks that SIGINT alone would end.)"""
    proc = subprocess.Popen([sys.executable, FAULTS, "--fault", "busy", "--ignore-sigint",
                             "--backend", "gloo", "--device", "cpu"], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    ranks = _rank_pids(proc)
    os.killpg(proc.pid, signal.SIGINT)
    code, err = proc.wait(timeout=60), proc.stderr.read()
    left = _gone_within(ranks, 5)
    assert code == 130 and "stopped by SIGINT: all 2 ranks ended" in err, (code, err[-2000:])
    assert left == [], left


def fit_file_worker(ctx, folder: str):
    from bench import ddp_step as bucket_model  # the fit from the sweep lives in the lab
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
    code = ("import sys; from bench import results\n"
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
    for main, argv in [(allreduce_sweep.main, ["--sizes", "4KB"]), (ddp_step.main, [])]:
        with pytest.raises(SystemExit) as e:
            main(["--backend", "gloo", "--device", "cpu", *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, err
        assert f"cannot write results to {blocker / 'results'}" in err


@pytest.mark.parametrize("main, argv, needle", [
    (naive_ddp.main, ["--world-size", "1000"], "1000 ranks need about"),
    (ddp_step.main, ["--world-size", "96", "--batch-size", "96"], "96 ranks need"),
    (ddp_step.main, ["--model", "2.7B", "--batch-size", "2"],  # the model's share
     "GiB each for --model 2.7B"),
    (ddp_step.main, ["--case-budget-s", "nan"], "'nan' is not a finite number > 0"),
    (profile_ddp.main, ["--bucket-size-mb", "inf", "--stage", "06"], "'inf' is not a finite"),
    (ddp_step.main, ["--bucket-sizes", ""], "empty list"),
    (allreduce_sweep.main, ["--budget-s", "nan"], "'nan' is not a finite number > 0"),
    (allreduce_sweep.main, ["--world-sizes", ""], "empty list"),
])
def test_limits_nan_and_empty_lists_are_refused(main, argv, needle, capsys, monkeypatch):
    from bench import supervisor as launch
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
    # torchrun's variables: each was a traceback, or silence past a minute (RANK=-1)
    ("RANK=-1 WORLD_SIZE=2 LOCAL_RANK=0", None, "RANK='-1': give a whole number >= 0"),
    ("WORLD_SIZE=abc RANK=0 LOCAL_RANK=0", None, "WORLD_SIZE='abc'"),
    ("LOCAL_WORLD_SIZE=abc RANK=0 WORLD_SIZE=2 LOCAL_RANK=0", None, "LOCAL_WORLD_SIZE='abc'"),
    ("RANK=2 WORLD_SIZE=2 LOCAL_RANK=0", None, "a rank counts from 0 to WORLD_SIZE - 1"),
    ("RANK=1 WORLD_SIZE=2 LOCAL_RANK=1", None, "MASTER_ADDR or MASTER_PORT is not"),
])
def test_environment_variables_out_of_range_are_refused(name, value, needle, monkeypatch,
                                                        capsys):
    for unset in ("MASTER_ADDR", "MASTER_PORT") if value is None else ():
        monkeypatch.delenv(unset, raising=False)
    for pair in name.split() if value is None else [f"{name}={value}"]:
        monkeypatch.setenv(*pair.split("=", 1))
    assert_main_usage_error(fault_worker.main, ["--backend", "gloo", "--device", "cpu"], capsys,
                            needle)


def test_a_held_master_port_and_a_rank_0_that_never_comes_are_one_line(monkeypatch, capsys):
    """A MASTER_PORT another process holds was an EADDRINUSE traceback; a rank under torchrun
    whose rank 0 never listens waited minutes in silence, then printed C++ frames."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        monkeypatch.setenv("MASTER_PORT", str(held.getsockname()[1]))
        assert_main_usage_error(fault_worker.main, ["--backend", "gloo"], capsys,
                                "another process holds it")
        env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(held.getsockname()[1] + 1), "DIST_TIMEOUT_S": "2"}
    began = time.monotonic()
    result = subprocess.run([sys.executable, FAULTS, "--fault", "none", "--backend", "gloo"],
                            cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={**os.environ, **env})
    assert result.returncode == 1 and time.monotonic() - began < 30, result.stderr[-2000:]
    assert "rank 0 never listened at 127.0.0.1" in result.stderr.splitlines()[-1], result.stderr


def test_a_lock_or_trace_folder_that_cannot_work_is_refused_up_front(tmp_path, monkeypatch,
                                                                     capsys):
    """A folder where a results lock goes: the whole run, then its rows lost (IsADirectoryError).
    A trace folder that cannot be made: the profiled steps, then a traceback."""
    monkeypatch.setenv("RESULTS_DIR", str(tmp_path))
    (tmp_path / ".ddp_profile.csv.lock").mkdir()
    assert_main_usage_error(profile_ddp.main, ["--backend", "gloo", "--device", "cpu"], capsys,
                            f"{tmp_path / '.ddp_profile.csv.lock'} is a folder: results locks "
                            "go there")
    (tmp_path / ".ddp_profile.csv.lock").rmdir()
    assert_main_usage_error(profile_ddp.main, ["--trace-dir", "/dev/null/x"], capsys,
                            "argument --trace-dir: '/dev/null/x': /dev/null is not a folder")


def test_a_sweep_with_nothing_measured_ends_with_a_reason(capfd):
    """A sweep that skipped everything exits non-zero, with the reasons."""
    with pytest.raises(SystemExit) as e:  # 4 KB over a 1 ns budget: every configuration skipped
        allreduce_sweep.main(["--backend", "gloo", "--device", "cpu", "--sizes", "4KB",
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


def test_check_fits_adds_up_the_ranks_that_share_a_gpu(capsys, monkeypatch):
    """launch.check_fits, the one memory rule of every lesson: on CUDA the ranks sharing a GPU
    add up (2 ranks of 0.6 GiB do not fit a 1 GiB GPU, one does); on the CPU, host memory."""
    import torch

    class Props:
        total_memory = 2**30
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: Props())
    need = int(0.6 * 2**30)
    launch.check_fits(launch.LaunchConfig(1, "gloo", "cuda"), need, "the test's sizes")
    with pytest.raises(SystemExit) as refused:
        launch.check_fits(launch.LaunchConfig(2, "gloo", "cuda"), need, "the test's sizes")
    err = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(err) == 1, err
    assert "the test's sizes needs about 1.2 GiB per GPU but a GPU has 1.0 GiB" in err[0], err
    launch.check_fits(launch.LaunchConfig(2, "gloo", "cpu"), need, "the test's sizes")  # host


def test_a_killed_rank_beside_a_refusal_is_named_not_hidden(tmp_path, capsys):
    """A rank that said its bad input in one line exits 2, and the run exits 2 without another
    word; but a rank killed beside it is a failure of its own: it is named, and the run exits
    1. (Counting "any rank exited 2" as "all" hid the kill.)"""
    missing = [str(tmp_path / f"rank{rank}.err") for rank in range(2)]
    with pytest.raises(SystemExit) as e:
        launch._report_failure([2, -signal.SIGKILL], missing, [])
    assert e.value.code == 1
    assert "rank 1 was killed by SIGKILL" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        launch._report_failure([2, 2], missing, [])
    assert e.value.code == 2 and capsys.readouterr().err == ""  # the refusals said it already


def test_one_gpu_visible_to_each_process_is_a_gpu_per_rank(capsys, monkeypatch):
    """Slurm's --gpus-per-task=1 under torchrun: each of 8 ranks on a node sees one GPU, its
    own (SLURM_GPUS_PER_TASK=1). That defaulted to Gloo, refused NCCL and counted 8 ranks on
    one GPU; now it is a GPU per rank. The negative controls: one GPU visible to every rank,
    named by CUDA_VISIBLE_DEVICES=0 or by nothing, is one GPU shared by 8 ranks."""
    from common import launch as course

    class Props:
        total_memory = 2**30
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: Props())
    for name, value in {"RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3",
                        "LOCAL_WORLD_SIZE": "8", "SLURM_GPUS_PER_TASK": "1"}.items():
        monkeypatch.setenv(name, value)
    args = course.make_parser(None).parse_args([])
    config = course.resolve(args)
    assert (config.world_size, config.backend, config.device) == (16, "nccl", "cuda"), config
    assert course.resolve(course.make_parser(None).parse_args(["--backend", "nccl"])) == config
    launch.check_fits(config, int(0.6 * 2**30), "the test's sizes")  # one rank on this GPU
    monkeypatch.delenv("SLURM_GPUS_PER_TASK")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # the same device named for every rank
    assert course.resolve(args).backend == "gloo"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert course.resolve(args).backend == "gloo"  # one GPU for 8 ranks
    with pytest.raises(SystemExit) as refused:
        launch.check_fits(config, int(0.6 * 2**30), "the test's sizes")
    assert refused.value.code == 2 and "4.8 GiB per GPU" in capsys.readouterr().err
    assert_main_usage_error(course.resolve, args.__class__(world_size=2, backend="nccl",
                                                           device=None), capsys,
                            "--backend nccl needs --device cuda and one GPU per rank: 8 ranks")
