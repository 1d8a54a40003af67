"""What two or more stages share: launch and limits, timing, models and data, results, the
DDP proof (verify) and step harness (step_bench), and profiling. Nothing here imports a stage,
and a stage's algorithm never imports this (it must stay copyable alone): only harnesses do.
"""

import importlib
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def usage_error(message: str, prog: str | None = None) -> None:
    """Bad input: one line on stderr naming it and what is allowed, then exit status 2 (the
    flags' parser, the launcher's checks and the results folder's all end this way)."""
    print(f"{prog or os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def import_stage(script: str):
    """Import a sibling stage's script, e.g. ``import_stage("03_naive_ddp/naive_ddp")``: stage
    folders are not packages, so the folder goes on ``sys.path`` (spawned workers inherit it,
    so classes from the script unpickle there too) and the script is imported by file name."""
    folder, name = script.rsplit("/", 1)
    path = str(REPO_ROOT / folder)
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)


def hand_over(script: str) -> None:
    """Become ``python <repo>/<script>`` with this process's own arguments, e.g. a lesson's
    ``run_pipeline.py --bench`` becomes ``07_parallelism/measure/bench_pipeline.py --bench``.
    Measurement sits above the lessons: a demo hands its ``--bench`` and ``--profile`` flags over
    to it rather than importing it, so imports run one way and the demo stays short. The process
    is replaced (``os.execv``), so this returns only if the exec fails, and under torchrun each
    rank hands over on its own with its environment intact."""
    path = REPO_ROOT / script
    if not path.is_file():
        raise SystemExit(f"{Path(sys.argv[0]).name}: {script} is missing: the measurement "
                         "needs the repository around this file")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, str(path), *sys.argv[1:]])
