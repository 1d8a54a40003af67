"""Helpers for the tests: run a stage script in a fresh interpreter, with a timeout."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_script(*argv, timeout=180, env=None, cwd=REPO):
    """Run a stage script (or any command) in a fresh interpreter; never hangs the suite."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, *map(str, argv)], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
