"""What two or more stages share: launch and limits, timing, models and data, results, the
DDP proof (verify) and step harness (step_bench), and profiling. Nothing here imports a stage,
and a stage's algorithm never imports this (it must stay copyable alone): only harnesses do.
"""

import importlib
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def import_stage(script: str):
    """Import a sibling stage's script, e.g. ``import_stage("03_naive_ddp/naive_ddp")``: stage
    folders are not packages, so the folder goes on ``sys.path`` (spawned workers inherit it,
    so classes from the script unpickle there too) and the script is imported by file name."""
    folder, name = script.rsplit("/", 1)
    path = str(REPO_ROOT / folder)
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)
