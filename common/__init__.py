"""The course's shared code: the launcher (launch.py), the models and data (models.py) and the
proof that data parallelism equals one process (verify.py). Nothing here imports a lesson, and
a lesson's algorithm never imports this (it stays copyable alone): only its demo does."""

import importlib
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def usage_error(message: str, prog: str | None = None) -> None:
    """Bad input: one line on stderr naming it, then exit status 2."""
    print(f"{prog or os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def import_stage(script: str):
    """Import a lesson's file, e.g. ``import_stage("03_naive_ddp/naive_ddp")``: lesson folders
    are not packages, so the folder goes on ``sys.path`` and the file is imported by name."""
    folder, name = script.rsplit("/", 1)
    path = str(REPO_ROOT / folder)
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)
