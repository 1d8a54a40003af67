"""Helpers for the tests: run a script in a fresh interpreter with a timeout, and check the
one-line usage errors (exit status 2) that bad input must get."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent


def run_script(*argv, timeout=180, env=None, cwd=REPO):
    """Run a stage script (or any command) in a fresh interpreter; never hangs the suite."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, *map(str, argv)], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def assert_usage_error(result, *needles):
    """Bad input (a finished subprocess): exit status 2 and exactly one line on stderr that
    contains every needle."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and all(n in lines[0] for n in needles), result.stderr


def assert_main_usage_error(main, argv, capsys, *needles):
    """Bad input, in this process: ``main(argv)`` exits 2 with one stderr line containing
    every needle, before any worker starts (a launch would print rank lines to stdout)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert e.value.code == 2, err
    assert len(lines) == 1 and all(n in lines[0] for n in needles), err
    assert "[rank" not in out
    return lines[0]


class BranchModel(nn.Module):
    """trunk -> [+ tanh(branch(h)) only if use_branch] -> head: on a step where a rank passes
    use_branch=False the branch gets no gradient there (torch DDP's unused parameters)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(10, 16)
        self.branch = nn.Linear(16, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x, use_branch=True):
        h = F.relu(self.trunk(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)
