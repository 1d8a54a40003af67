"""Helpers for the tests: run a script in a fresh interpreter with a timeout, check the
one-line usage errors (exit status 2) that bad input must get, and watch processes from
outside (the fault tests: start a script, wait for a line, see which processes are alive)."""

import os
import re
import subprocess
import sys
import time
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


def start_script(argv, tmp: Path, env=None) -> subprocess.Popen:
    """Start ``python argv...`` with its own TMPDIR (leftovers are easy to see), output piped."""
    tmp.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, *map(str, argv)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1",
                                 **(env or {})})


def wait_for_line(proc, pattern: str, lines: list[str], timeout: float = 90) -> None:
    """Read proc's stdout into ``lines`` until a line matches ``pattern``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"exited before {pattern!r}: {''.join(lines)}"
                                 f"{proc.stderr.read()[-2000:]}")
        lines.append(line)
        if re.search(pattern, line):
            return
    raise AssertionError(f"no {pattern!r} within {timeout} s: {''.join(lines)}")


def live_processes() -> dict[int, list[str]]:
    """Every live process: its /proc stat fields after the name (state, ppid, pgrp, session)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if fields[0] != "Z":
            found[int(stat.parent.name)] = fields
    return found


def alive(pid: int) -> bool:
    return pid in live_processes()


def session(sid: int) -> list[int]:
    """The live processes of session ``sid`` (a make bench step's: the script, its ranks...)."""
    return [pid for pid, fields in live_processes().items() if int(fields[3]) == sid]


def children(ppid: int) -> list[int]:
    return [pid for pid, fields in live_processes().items() if int(fields[1]) == ppid]


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
