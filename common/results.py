"""Result tables: print with ``tabulate``, keep as CSV/JSON under ``results/``.

Files are shared by stages and runs, so writing is an upsert: a run replaces the rows whose
key matches its own and keeps the rest. Writers lock the file and replace it with a uniquely
named temporary one, so runs side by side lose no row and no reader sees half a file; a file
that cannot be read is named in a one-line warning and treated as empty. Every benchmark row
carries ``run_id()`` (``make bench`` sets ``RESULTS_RUN_ID``), so a report can pick one run's.
``RESULTS_DIR`` redirects the folder (the tests use a temporary one).
"""

import contextlib
import csv
import fcntl
import functools
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

try:
    from tabulate import tabulate
except ImportError:  # a GPU box whose Python has torch but not tabulate: plain tables
    tabulate = None

from common import REPO_ROOT
from common.launch import usage_error


def results_dir() -> Path:
    return Path(os.environ.get("RESULTS_DIR", REPO_ROOT / "results"))


@functools.cache  # the same for every call in one process
def run_id() -> str:
    """Names the run a row came from: ``$RESULTS_RUN_ID``, else this process's start and pid."""
    return os.environ.get("RESULTS_RUN_ID") or time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"


def machine_name() -> str:
    """One line naming the machine a number came from: CPU cores and GPU model if any."""
    cpu = f"{os.cpu_count()} CPU cores ({platform.machine()}), torch {torch.__version__}"
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, {cpu}"
    return f"no GPU, {cpu}"


def print_table(rows: list[dict], title: str | None = None, floatfmt: str = ".4g") -> str:
    """Print ``rows`` (dicts with the same keys) as a table; return the text too."""
    if tabulate is not None:
        text = tabulate(rows, headers="keys", floatfmt=floatfmt, tablefmt="github")
    else:
        keys = list(rows[0]) if rows else []

        def cell(v):
            return format(v, floatfmt) if isinstance(v, float) else str(v)
        text = "\n".join(["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
                         + ["| " + " | ".join(cell(r[k]) for k in keys) + " |" for r in rows])
    if title:
        text = f"{title}\n{text}"
    print(text, flush=True)
    return text


def check_writable() -> Path:
    """The results folder, or a one-line error (exit 2) when it cannot be written: called
    before the first configuration, not after it."""
    try:
        results_dir().mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=results_dir()).close()
    except OSError as e:
        usage_error(f"cannot write results to {results_dir()}: {e.strerror or e}; set "
                    "RESULTS_DIR to a writable folder")
    return results_dir()


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _replace(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _warn(path: Path, problem: str) -> None:
    print(f"warning: ignoring {path}: {problem}", file=sys.stderr, flush=True)


def upsert_csv(name: str, rows: list[dict], key: list[str]) -> Path:
    """Write ``rows`` into ``results/<name>``, replacing existing rows with the same ``key``.
    Columns: the old file's, then new ones, so a file several stages write keeps its order."""
    path = results_dir() / name
    with _locked(path):
        old_rows = read_csv(name)
        if not old_rows and path.exists() and path.stat().st_size:  # unreadable: keep it aside
            aside = path.with_name(f"{name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
            path.rename(aside)
            print(f"warning: moved the unreadable {path} to {aside.name}", file=sys.stderr)
        columns = list(dict.fromkeys(c for r in old_rows[:1] + rows for c in r))
        new_keys = {tuple(str(r[k]) for k in key) for r in rows}
        kept = [r for r in old_rows if tuple(str(r.get(k, "")) for k in key) not in new_keys]

        def write(f):
            writer = csv.DictWriter(f, fieldnames=columns, restval="")
            writer.writeheader()
            writer.writerows(kept + rows)
        _replace(path, write)
    return path


def read_csv(name: str, folder: Path | None = None) -> list[dict]:
    path = (folder or results_dir()) / name
    if not path.exists():
        return []
    try:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except (csv.Error, UnicodeDecodeError, OSError) as e:
        _warn(path, str(e))
        return []
    if any(None in r or None in r.values() for r in rows):  # ragged: a torn or mangled file
        _warn(path, "rows with a different number of fields than the header")
        return []
    return rows


def write_json(name: str, obj) -> Path:
    path = results_dir() / name
    _replace(path, lambda f: f.write(json.dumps(obj, indent=2, sort_keys=True) + "\n"))
    return path


def update_json(name: str, entries: dict) -> Path:
    """Merge ``entries`` into the dict in ``results/<name>`` under its lock (other keys kept)."""
    path = results_dir() / name
    with _locked(path):
        return write_json(name, {**read_json(name), **entries})


def read_json(name: str, folder: Path | None = None) -> dict:
    """The dict in a results JSON file; {} when it is missing, or corrupt (with a warning)."""
    path = (folder or results_dir()) / name
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        _warn(path, f"not valid JSON ({e})")
        return {}
    if not isinstance(data, dict):
        _warn(path, f"expected a JSON object, found {type(data).__name__}")
        return {}
    return data


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None where matplotlib is not
    installed (it is optional: the tables never need it)."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
