"""Make every stage's module importable by its file name (``import collectives``) and the
repo's ``common`` package importable, and keep test results out of ``results/``."""

import os
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


@pytest.fixture(autouse=True)
def _no_exec_in_pytest(monkeypatch):
    """A script run in this process (runpy) that hands over to another (common.hand_over: an
    exec) would replace pytest itself and end the suite without a word: make it an error."""
    def refuse(path, argv):
        raise RuntimeError(f"a test ran a hand-over to {argv[1:2]} inside pytest: run the "
                           "script as a subprocess, or call the measurement's main")
    monkeypatch.setattr(os, "execv", refuse)
