"""``make check`` (bench/check.py) as a user meets it: a refusal is not a failure, a wrong
``--only`` is one line, and a stop (SIGTERM, SIGINT, SIGKILL) leaves no script, rank or
scratch folder behind."""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import check
from helpers import REPO, children, live_processes, wait_for_line

REFUSES = ["-c", "import sys; print('x.py: error: --device cuda needs a GPU', file=sys.stderr);"
                 " sys.exit(2)"]
FAILS = ["-c", "import sys; sys.exit(3)"]


def test_a_refusal_is_shown_and_does_not_fail_make_check(monkeypatch, capsys):
    monkeypatch.setattr(check, "CHECKS", [("01 refuses", REFUSES)])
    assert check.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "refused" in out and "x.py: error: --device cuda needs a GPU" in out
    monkeypatch.setattr(check, "CHECKS", [("01 refuses", REFUSES), ("02 fails", FAILS)])
    assert check.main(["--device", "cpu"]) == 1  # the negative control: a real failure
    assert "FAILED" in capsys.readouterr().out


def test_an_unknown_stage_is_one_line(capsys):
    assert check.main(["--only", "zz"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'zz' names no stage" in err[0]


BUSY_CHECK = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from bench import check
check.CHECKS = [("01 busy", ["tests/fault_worker.py", "--fault", "busy", "--world-size", "2",
                             "--backend", "gloo"])]
raise SystemExit(check.main(["--device", "cpu"]))
"""


def _start_busy(tmp):
    return subprocess.Popen([sys.executable, "-c", BUSY_CHECK], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"})


def _descendants(pid):
    found, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def test_stopping_make_check_ends_its_script_and_ranks(tmp_path):
    """SIGTERM and SIGINT: exit 128 + signal with one line, no process and no scratch folder
    left. SIGKILL: the script and its ranks follow (parent-death signal), and the next run
    removes the scratch folder left behind."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL):
        tmp = tmp_path / signum.name
        tmp.mkdir()
        proc = _start_busy(tmp)
        wait_for_line(proc, r"pid \d+ busy", [], timeout=120)
        below = _descendants(proc.pid)
        assert below, "the script and its ranks should be running"
        proc.send_signal(signum)
        err = proc.communicate(timeout=60)[1]
        deadline = time.monotonic() + 20
        while any(pid in live_processes() for pid in below) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in below if pid in live_processes()], signum.name
        if signum == signal.SIGKILL:
            assert proc.returncode == -signal.SIGKILL
            assert list(tmp.glob("make-check-*")), "a killed run cannot clean up"
            tempfile.tempdir = None
            os.environ["TMPDIR"], saved = str(tmp), os.environ.get("TMPDIR")
            try:
                tempfile.tempdir = None
                check.sweep_stale_scratch()
            finally:
                tempfile.tempdir = None
                if saved is None:
                    os.environ.pop("TMPDIR")
                else:
                    os.environ["TMPDIR"] = saved
        else:
            assert proc.returncode == 128 + signum, err
            assert "Traceback" not in err and f"stopped by {signum.name}" in err, err
        assert not list(tmp.glob("make-check-*")), signum.name


def test_the_machine_is_named_as_the_job_across_nodes(monkeypatch):
    """On 2 nodes x 8 GPUs the report said "8 x H100" for 16 ranks: it names the job."""
    from bench import results
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 8)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert results.machine_name().startswith("2 nodes x 8 ranks, NVIDIA H100 80GB HBM3 (one per "
                                             "rank: 16 GPUs)")
    monkeypatch.setenv("WORLD_SIZE", "8")  # one node: its GPUs, as before
    assert results.machine_name().startswith("8 x NVIDIA H100 80GB HBM3")


def _write_csv(path, rows):
    import csv
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_the_report_counts_within_25_percent_both_ways_and_labels_nccl_as_nccl(tmp_path):
    """Two headlines a mutation could break unseen: "within 25%" must not count a row
    predicted at half its measured time (ratio 0.5), and an NCCL all-reduce is not "Gloo's
    host path"."""
    from bench import report
    where = report.Where(out=tmp_path, draw=tmp_path, run_id=None, machine="test box")
    base = {"run_id": "r1", "predicted_ms": "1", "measured_ms": "1"}
    _write_csv(tmp_path / "prediction.csv", [
        {**base, "config": "fits", "ratio": "1.1"},
        {**base, "config": "half", "ratio": "0.5"},
        {**base, "config": "double", "ratio": "2.0"}])
    text, headline, _ = report.prediction_section(where)
    assert "1 of 3" in headline[0][1], headline
    row = {"run_id": "r1", "backend": "nccl", "device": "cuda", "world_size": "2",
           "bytes": str(2**30), "impl": "backend", "time_ms_median": "10", "time_ms_min": "9",
           "time_ms_max": "11", "algbw_gbps": "100", "busbw_gbps": "100"}
    _write_csv(tmp_path / "allreduce.csv", [row])
    _, headline, _ = report.allreduce_section(where)
    assert "host path" not in headline[0][1], headline
    _write_csv(tmp_path / "allreduce.csv", [{**row, "backend": "gloo"}])
    _, headline, _ = report.allreduce_section(where)
    assert "Gloo's host path" in headline[0][1], headline  # the negative control


def test_the_labs_scripts_say_a_bad_flag_in_one_line(capsys):
    """make check, compute.py and the prediction check printed argparse's two-line usage error
    where every other script prints one line."""
    import pytest
    from bench import compute
    import check_prediction
    for parse in (check.main, compute.parse_args, check_prediction.parse_args):
        with pytest.raises(SystemExit) as e:
            parse(["--device", "tpu"])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and "tpu" in err[0], (parse, err)
