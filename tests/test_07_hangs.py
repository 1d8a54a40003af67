"""Lesson 07/10 (hangs): every planted failure named in one line (the rank, the op and the
collective's number that were planted), no alarm on the same code without its plant, the
straggler called slow and not hung, no process left behind; and diagnose.py's contract on
hand-made dump folders (agree: exit 0; disagree: exit 1; one line either way; a file that is
not a dump: exit 2, one line)."""

import os
import pickle
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from helpers import REPO, run_script

LESSON = REPO / "07_parallelism" / "10_hangs"
sys.path.insert(0, str(LESSON))
import diagnose  # noqa: E402  (the lesson's folder is not a package)

TIMEOUT_S = 2.0  # each scenario's group: a stuck rank gives up after this

# What was planted, said independently of run_hangs.py's own table: (rank, op, number).
PLANTED = {
    "skip_collective": ["#3", "gloo:all_reduce", "rank 1 never did"],
    "wrong_order": ["#1", "op differs", "gloo:broadcast on rank 1"],
    "dtype_mismatch": ["#1", "dtype differs", "['Long'] on rank 1", "plants.py"],
    "divergent_branch": ["#3", "rank 1 called gloo:all_reduce", "split at #2",
                         "rank 1 at plants.py"],
    "send_recv_deadlock": ["ranks 0, 1, 2, 3 gave up waiting in send at plants.py"],
    "send_recv_rejected": ["rank 1 was refused in batch_isend_irecv at plants.py",
                           "All ops need to use the same group",
                           "rank 0 gave up waiting in request.wait() at plants.py",
                           "ranks 2, 3 finished"],
    "pipeline_fewer_micro_batches": ["rank 0 gave up waiting in recv at plants.py",
                                     "ranks 1, 2, 3 finished"],
    "all_to_all_splits": ["#1", "split sizes disagree", "rank 1 sends 8, expects 9"],
    "straggler": ["agree", "rank 1 calls each collective", "a straggler, slow, not a hang"],
}


def demo_processes(token: str) -> list[int]:
    """The live processes whose environment holds ``HANGS_RUN=<token>``: the launcher, the
    forkserver it starts and the ranks forked from it (a rank's command line is the
    forkserver's, so the run's arguments cannot find it; the environment it started with can)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"HANGS_RUN={token}".encode() in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


def test_demo_processes_finds_a_process_of_the_run():
    """The negative control of the check that the demo leaves nothing running."""
    token = uuid.uuid4().hex
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                               env={**os.environ, "HANGS_RUN": token})
    try:
        assert demo_processes(token) == [sleeper.pid]
    finally:
        sleeper.kill()
        sleeper.wait()
    assert demo_processes(token) == []


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One launch of the demo: all nine plants and their controls, on 4 ranks."""
    dumps = tmp_path_factory.mktemp("hangs")
    start = time.monotonic()
    token = uuid.uuid4().hex
    out = run_script(LESSON / "run_hangs.py", "--timeout", TIMEOUT_S, "--dumps", dumps,
                     timeout=180, env={"DIST_TIMEOUT_S": "60", "HANGS_RUN": token})
    assert not demo_processes(token), "the demo left processes running"
    lines = {}
    for line in out.stdout.splitlines():
        name, _, rest = line.partition(" ")
        kind, _, said = rest.strip().partition(": ")
        lines[(name, kind)] = said
    return out, lines, dumps, time.monotonic() - start


def test_every_plant_named_and_no_false_alarm(run):
    out, lines, _, elapsed = run
    assert out.returncode == 0, out.stdout + out.stderr
    for name, parts in PLANTED.items():
        said = lines[(name, "planted")]
        assert all(part in said for part in parts), (name, said)
        control = lines[(name, "control")]
        assert "agree" in control and "straggler" not in control, (name, control)
        assert not any(alarm in control for alarm in ("gave up", "refused", "disagree")), control
    # bounded: 6 scenarios wait out their timeout, the rest finish at once (plus start-up)


def test_cli_on_the_demo_dumps(run):
    """The files the ranks wrote, read back by diagnose.py: one line each, exit 1 and 0."""
    _, _, dumps, _ = run
    bad = run_script(LESSON / "diagnose.py", dumps / "wrong_order", timeout=60)
    good = run_script(LESSON / "diagnose.py", dumps / "wrong_order_clean", timeout=60)
    assert bad.returncode == 1 and len(bad.stdout.splitlines()) == 1, bad
    assert "#1" in bad.stdout and "gloo:broadcast on rank 1" in bad.stdout
    assert good.returncode == 0 and len(good.stdout.splitlines()) == 1, good


# --------------------------------------------------------------------------- hand-made dumps
def entry(seq, op="all_reduce", sizes=((4,),), dtype="Float", ms=0.0, line=10, out=None):
    sizes = [list(s) for s in sizes]
    return {"process_group": ("0", "default_pg"), "collective_seq_id": seq, "is_p2p": False,
            "profiling_name": f"gloo:{op}", "input_sizes": sizes, "input_dtypes": [dtype],
            "output_sizes": out or sizes, "state": "scheduled",
            "time_created_ns": int(ms * 1e6),
            "frames": [{"filename": "/x/torch/distributed/distributed_c10d.py", "line": 1,
                        "name": op},
                       {"filename": "/home/me/train.py", "line": line, "name": "step"}]}


def write(folder, ranks: dict, prefix="rank_"):
    folder.mkdir()
    for rank, entries in ranks.items():
        (folder / f"{prefix}{rank}").write_bytes(pickle.dumps({"entries": entries}))
    return folder


def test_cli_contract_on_hand_made_dumps(tmp_path):
    """diagnose.py copied alone (the standard library only), on folders of hand-made dumps."""
    (tmp_path / "alone").mkdir()
    lone = tmp_path / "alone" / "diagnose.py"
    shutil.copy(LESSON / "diagnose.py", lone)
    same = [entry(1), entry(2, op="broadcast")]
    agree = write(tmp_path / "agree", {0: same, 1: same}, prefix="trace_")
    out = run_script(lone, agree, "--prefix", "trace_", timeout=60, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.count("\n") == 1, out
    assert "ranks 0, 1 agree on all 2 collectives" in out.stdout
    stopped = write(tmp_path / "stopped", {0: same, 1: same[:1]})
    out = run_script(lone, stopped, timeout=60, cwd=tmp_path)
    assert out.returncode == 1 and out.stdout.count("\n") == 1, out
    assert "#2" in out.stdout and "rank 1 never did" in out.stdout
    assert "train.py:10 in step" in out.stdout
    out = run_script(lone, agree, timeout=60, cwd=tmp_path)  # no rank_* files there
    assert out.returncode == 2 and "no files named rank_<rank>" in out.stderr


@pytest.mark.parametrize("rank1, want", [
    ([entry(1), entry(2, sizes=[(3,)])], "#2 of group 0 (default_pg): shape differs: "
                                         "[[4]] on ranks 0, 2 at train.py:10 in step, "
                                         "[[3]] on rank 1"),
    ([entry(1), entry(2, dtype="Double")], "dtype differs"),
    ([entry(1, line=11), entry(2), entry(3)], "rank 1 called gloo:all_reduce at train.py:10 "
                                               "in step; ranks 0, 2 never did (stopped after "
                                               "#2); the paths split at #1"),
    ([entry(1), entry(2, op="all_to_all", sizes=[(4,)], out=[(5,)])],
     "split sizes disagree: the ranks send 12 rows in all but expect 13"),
])
def test_each_difference_named(rank1, want):
    others = [entry(1), entry(2)]
    if "all_to_all" in rank1[1]["profiling_name"]:
        others = [entry(1), entry(2, op="all_to_all")]
    agree, line = diagnose.diagnose({0: {"entries": others}, 1: {"entries": rank1},
                                     2: {"entries": others}})
    assert not agree and want in line, line


def test_straggler_is_slow_not_hung_and_ring_buffer_start():
    fast = [entry(seq, ms=100 * seq) for seq in range(3, 8)]  # the ring dropped #1, #2
    slow = [entry(seq, ms=100 * seq + 90) for seq in range(1, 8)]
    agree, line = diagnose.diagnose({0: {"entries": fast}, 1: {"entries": slow}})
    assert agree and "rank 1 calls each collective 90 ms after the first rank" in line, line
    agree, line = diagnose.diagnose({0: {"entries": fast}, 1: {"entries": fast}})
    assert agree and "straggler" not in line, line
    agree, line = diagnose.diagnose({0: {"entries": fast}, 1: {"entries": slow[:2]}})
    assert not agree and "#3" in line and "rank 1 never did (stopped after #2)" in line, line


def test_recorder_bench():
    """bench_hangs.py: no alarm from diagnose on lesson 7's grid with the recorder on; each
    setting's median and spread, and a verdict. (Its stop at make bench's deadline is
    step_bench.until_deadline's, tested with bench_muon.)"""
    out = run_script(REPO / "07_parallelism" / "measure" / "bench_hangs.py", "--iters", 2,
                     "--rounds", 1, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "TORCH_FR_BUFFER_SIZE=2000  step" in out.stdout
    assert "ranks 0, 1, 2, 3 agree on all" in out.stdout and "disagree" not in out.stdout
    assert "the median of 1 launches; spread" in out.stdout
    assert "one launch a setting, too few to tell" in out.stdout  # --rounds 1: no verdict


def test_a_rank_that_never_reached_a_groups_first_collective_is_named(tmp_path):
    """The dumps' table of groups (``pg_config``) lists a group's ranks: one with no entry at
    all is a rank that never got there (without the table, it looked like no member: "agree")."""
    group = {"1": {"name": "1", "desc": "mine", "ranks": "[0, 1, 2]"}}
    called = [dict(entry(1), process_group=("1", "mine"))]
    dumps = {0: {"entries": called, "pg_config": group}, 1: {"entries": [], "pg_config": group},
             2: {"entries": called, "pg_config": group}}
    agree, line = diagnose.diagnose(dumps)
    assert not agree and "#1 of group 1 (mine)" in line and "rank 1 never did (stopped after #0)" in line, line
    for dump in dumps.values():
        del dump["pg_config"]
    assert diagnose.diagnose(dumps)[0]    # the control: without the table, no way to tell


def test_groups_are_read_in_number_order_not_name_order():
    """Group "2" before group "10": the first difference in time, not in the alphabet."""
    early = [dict(entry(1), process_group=("2", "early")), dict(entry(1), process_group=("10", "late"))]
    odd = [dict(entry(1, dtype="Long"), process_group=("2", "early")),
           dict(entry(1, sizes=[(3,)]), process_group=("10", "late"))]
    agree, line = diagnose.diagnose({0: {"entries": early}, 1: {"entries": odd}})
    assert not agree and "group 2 (early): dtype differs" in line, line


def test_a_file_that_is_not_a_dump_is_refused_in_one_line(tmp_path):
    for name, data in (("truncated", pickle.dumps({"entries": []})[:-3]), ("text", b"hello"),
                       ("a list", pickle.dumps([1, 2]))):
        folder = tmp_path / name.replace(" ", "_")
        folder.mkdir()
        (folder / "rank_0").write_bytes(data)
        (folder / "rank_0.bak").write_bytes(b"ignored")   # not <prefix><rank>
        out = run_script(LESSON / "diagnose.py", folder, timeout=60)
        err = out.stderr.strip().splitlines()
        assert out.returncode == 2 and "is not a Flight Recorder dump" in err[-1] and "Traceback" not in out.stderr, out


def test_the_demo_refuses_a_timeout_out_of_range_in_one_line():
    """0.001 s failed in making the group, 1e300 s in timedelta: both tracebacks."""
    import argparse
    from common import launch
    seconds = launch.number(float, 0.5, "seconds from 0.5 to 3600", 3600)
    assert seconds("0.5") == 0.5 and seconds("3600") == 3600
    for value in ("0.1", "1e300", "nan", "3600.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="seconds from 0.5 to 3600"):
            seconds(value)
    with pytest.raises(argparse.ArgumentTypeError, match="whole number"):   # every course's --steps:
        launch.positive_int("9" * 400)          # was an OverflowError traceback (too large for a float)
    out = run_script(LESSON / "run_hangs.py", "--timeout", "1e300", timeout=60)   # the demo's flag
    assert out.returncode == 2 and "seconds from 0.5 to 3600" in out.stderr and "Traceback" not in out.stderr, out


def test_a_table_of_groups_torch_may_write_is_read_and_a_broken_one_refused(tmp_path):
    """``pg_config`` ranks as torch writes them ("[0, 1, 2]"), twice encoded (torch's own reader
    allows for it), absent (None); one that is not a list: one line, exit 2, not 1 ("disagree")."""
    called = [dict(entry(1), process_group=("1", "mine"))]
    for ranks in ("[0, 1, 2]", repr("[0, 1, 2]")):
        table = {"1": {"name": "1", "desc": "mine", "ranks": ranks}}
        dumps = {rank: {"entries": [] if rank == 1 else called, "pg_config": table} for rank in range(3)}
        agree, line = diagnose.diagnose(dumps)
        assert not agree and "rank 1 never did" in line, (ranks, line)
    assert diagnose.diagnose({0: {"entries": called, "pg_config": None}})[0]
    folder = write(tmp_path / "broken", {0: called})
    (folder / "rank_0").write_bytes(pickle.dumps({"entries": called, "pg_config": {"1": {"ranks": "0-3"}}}))
    out = run_script(LESSON / "diagnose.py", folder, timeout=60)
    assert out.returncode == 2 and "error:" in out.stderr.strip().splitlines()[-1] and "Traceback" not in out.stderr, out
