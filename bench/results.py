"""Result tables: print with ``tabulate``, keep as CSV/JSON under ``results/`` (``RESULTS_DIR``).

Writing is an upsert (a run replaces the rows whose key matches its own), under a lock, through
a temporary file swapped in whole: runs side by side lose no row, no reader sees half a file. An
unreadable file is named in a warning and read as empty; a file keeps its mode. Every row carries
``run_id()`` (``make bench`` sets ``RESULTS_RUN_ID``), so a report can pick one run's.
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

from common import REPO_ROOT, usage_error


def results_dir() -> Path:
    """``results/`` in the repository, or ``$RESULTS_DIR`` (set but empty is refused)."""
    folder = os.environ.get("RESULTS_DIR")
    if folder is None:
        return REPO_ROOT / "results"
    if not folder.strip():
        usage_error("RESULTS_DIR is set but empty: name a folder, or unset it for results/ in "
                    "the repository")
    return Path(folder)


@functools.cache  # the same for every call in one process
def run_id() -> str:
    """Names the run a row came from: ``$RESULTS_RUN_ID``, else this process's start and pid."""
    return os.environ.get("RESULTS_RUN_ID") or time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"


def machine_name() -> str:
    """One line naming the machine a number came from: CPU cores and GPU model if any; under
    torchrun across nodes, the job (nodes x ranks per node), not this node's GPUs alone."""
    cpu = f"{os.cpu_count()} CPU cores ({platform.machine()}), torch {torch.__version__}"
    world, local = (os.environ.get(name, "") for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"))
    nodes = ""
    if world.isdecimal() and local.isdecimal() and 0 < int(local) < int(world):
        nodes = f"{-(-int(world) // int(local))} nodes x {local} ranks, "
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
        if nodes:
            return f"{nodes}{gpu} (one per rank: {world} GPUs), {cpu} per node"
        return f"{torch.cuda.device_count()} x {gpu}, {cpu}"
    return f"{nodes}no GPU, {cpu}" + (" per node" if nodes else "")


def print_table(rows: list[dict], title: str | None = None, floatfmt: str = ".4g") -> str:
    """Print ``rows`` (dicts with the same keys) as a table; return the text too."""
    if tabulate is not None:
        text = tabulate(rows, headers="keys", floatfmt=floatfmt, tablefmt="github")
    else:
        keys = list(rows[0]) if rows else []
        text = "\n".join(["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)] + [
            "| " + " | ".join(format(r[k], floatfmt) if isinstance(r[k], float) else str(r[k])
                              for k in keys) + " |" for r in rows])
    if title:
        text = f"{title}\n{text}"
    print(text, flush=True)
    return text


def check_folder() -> Path:
    """The results folder, not created; one line and exit 2 where a results file or lock's name
    (``*.csv``, ``*.json``, ``.*.lock``) is not a plain file (it would cost a run's rows at its end)."""
    folder = results_dir()
    try:
        entries = list(os.scandir(folder)) if folder.is_dir() else []
    except OSError:
        entries = []  # unreadable: check_writable says so where a script writes
    for entry in entries:
        is_lock = entry.name.startswith(".") and entry.name.endswith(".lock")
        if (is_lock or entry.name.endswith((".csv", ".json"))) and not entry.is_file():
            kind = "a folder" if entry.is_dir() else "not a plain file"
            usage_error(f"{entry.path} is {kind}: results {'locks' if is_lock else 'files'} "
                        "go there; move it away, or set RESULTS_DIR to another folder")
    return folder


def check_writable() -> Path:
    """The results folder, or one line and exit 2 where it cannot be written (before any measurement)."""
    folder = check_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        usage_error(f"cannot write results to {folder}: {e.strerror or e}; set "
                    "RESULTS_DIR to a writable folder")
    return folder


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _new_file_mode() -> int:
    """0o666 less the umask (Linux shows it in /proc/self/status; elsewhere: set and reset)."""
    try:
        with open("/proc/self/status") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def _replace(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file 0600; the file it replaces keeps its mode, a new one gets the
        # umask's, so a results folder shared with others stays readable to them
        os.fchmod(fd, path.stat().st_mode & 0o7777 if path.exists() else _new_file_mode())
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
        old_columns, old_rows = _read_table(path)
        if old_columns is None and path.exists():  # unreadable: keep it aside
            aside = path.with_name(f"{name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
            path.rename(aside)
            print(f"warning: moved the unreadable {path} to {aside.name}", file=sys.stderr)
        columns = list(dict.fromkeys([*(old_columns or []), *(c for r in rows for c in r)]))
        new_keys = {tuple(str(r[k]) for k in key) for r in rows}
        kept = [r for r in old_rows if tuple(str(r.get(k, "")) for k in key) not in new_keys]

        def write(f):
            writer = csv.DictWriter(f, fieldnames=columns, restval="")
            writer.writeheader()
            writer.writerows(kept + rows)
        _replace(path, write)
    return path


def read_csv(name: str, folder: Path | None = None) -> list[dict]:
    """The rows of ``results/<name>``: [] when missing, a header alone, or unreadable (warned)."""
    return _read_table((folder or results_dir()) / name)[1]


def _read_table(path: Path) -> tuple[list[str] | None, list[dict]]:
    """(columns, rows); columns None when the file is missing or unreadable, [] when empty."""
    if not path.exists():
        return None, []
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            columns = list(reader.fieldnames or [])
    except (csv.Error, UnicodeDecodeError, OSError) as e:
        _warn(path, str(e))
        return None, []
    if any(None in r or None in r.values() for r in rows):  # ragged: a torn or mangled file
        _warn(path, "rows with a different number of fields than the header")
        return None, []
    return columns, rows


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
    """matplotlib's pyplot on the file-only Agg backend, or None where it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
