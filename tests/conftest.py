"""Make every stage's module importable by its file name (``import collectives``) and the
repo's ``common`` package importable, and keep test results out of ``results/``."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STAGE_DIRS = sorted(p for p in REPO.iterdir() if p.is_dir() and p.name[:2].isdigit())
# 07's lessons are folders inside 07_parallelism (01_zero, 02_fsdp, ...), plus its measure/.
LESSON_DIRS = sorted(p for p in (REPO / "07_parallelism").iterdir()
                     if p.is_dir() and (p.name[:2].isdigit() or p.name == "measure"))
for path in [REPO, *STAGE_DIRS, *LESSON_DIRS]:
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

# Spawned workers inherit sys.path from the parent, so they can import the same modules.


@pytest.fixture(autouse=True)
def _results_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("RESULTS_DIR", str(tmp_path / "results"))


END_TO_END_TEST = "test_make_bench_end_to_end_on_tiny_sizes"


@pytest.fixture(scope="session", autouse=True)
def end_to_end(request, tmp_path_factory):
    """``make bench`` end to end at tiny sizes (tests/end_to_end_bench.py), started in the
    background with the session's first test when test_bench.py's end-to-end test is
    selected, awaited by that test: (process, folder), else None. A test left unfinished
    stops it as a user would (SIGTERM)."""
    if not any(item.name == END_TO_END_TEST for item in request.session.items):
        yield None
        return
    root = tmp_path_factory.mktemp("end_to_end")
    out = root / "results"
    out.mkdir()
    (out / "allreduce_fit.json").write_text("{")  # a corrupt fit left by an older run
    (root / "tmp").mkdir()
    env = {**os.environ, "RESULTS_DIR": str(out), "TMPDIR": str(root / "tmp"),
           "BENCH_BUDGET_S": "1500"}  # about 250 s a step: a loaded box too
    with open(root / "stdout", "w") as stdout, open(root / "stderr", "w") as stderr:
        proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "end_to_end_bench.py")],
                                cwd=REPO, env=env, stdout=stdout, stderr=stderr)
    yield proc, root
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
