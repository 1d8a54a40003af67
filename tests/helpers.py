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


def assert_usage_error(result, *needles):
    """Bad input: exit status 2 and exactly one line on stderr that contains every needle."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and all(n in lines[0] for n in needles), result.stderr
