"""Result tables: print with ``tabulate``, keep as CSV/JSON under ``results/``.

Result files are shared by several stages (SPEC section 3), so writing is an upsert: a run
replaces the rows whose key columns match its own and keeps every other row. Every row a
benchmark writes carries ``run_id()``, so a report can pick out the rows of one run
(``make bench`` sets ``RESULTS_RUN_ID`` for every script it starts).
``RESULTS_DIR`` in the environment redirects the folder (the tests use a temporary one).
"""

from __future__ import annotations

import csv
import json
import os
import platform
import time
from pathlib import Path

import torch

try:
    from tabulate import tabulate
except ImportError:  # a GPU box whose Python has torch but not tabulate: plain tables
    tabulate = None

REPO_ROOT = Path(__file__).resolve().parent.parent


def results_dir() -> Path:
    path = Path(os.environ.get("RESULTS_DIR", REPO_ROOT / "results"))
    path.mkdir(parents=True, exist_ok=True)
    return path


_RUN_ID = None


def run_id() -> str:
    """Names the run a result row came from: ``$RESULTS_RUN_ID``, else this process's start
    time and pid (the same for every call in one process)."""
    global _RUN_ID
    if _RUN_ID is None:
        _RUN_ID = os.environ.get("RESULTS_RUN_ID") or (
            time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}")
    return _RUN_ID


def machine_name() -> str:
    """One line naming the machine a number came from: CPU cores and GPU model if any."""
    cpu = f"{os.cpu_count()} CPU cores ({platform.machine()})"
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        return f"{gpus} x {torch.cuda.get_device_name(0)}, {cpu}, torch {torch.__version__}"
    return f"no GPU, {cpu}, torch {torch.__version__}"


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


def upsert_csv(name: str, rows: list[dict], key: list[str]) -> Path:
    """Write ``rows`` into ``results/<name>``, replacing existing rows with the same ``key``.

    Columns are the union of the old file's and the new rows' keys, old ones first, so a
    file written by several stages keeps a stable column order.
    """
    path = results_dir() / name
    old_rows: list[dict] = []
    columns: list[str] = []
    if path.exists():
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            columns = list(reader.fieldnames or [])
            old_rows = list(reader)
    new_keys = {tuple(str(r[k]) for k in key) for r in rows}
    kept = [r for r in old_rows if tuple(str(r.get(k, "")) for k in key) not in new_keys]
    for r in rows:
        columns += [c for c in r if c not in columns]
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(kept + rows)
    tmp.replace(path)  # atomic: a reader never sees half a file
    return path


def read_csv(name: str, folder: Path | None = None) -> list[dict]:
    path = (folder or results_dir()) / name
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def write_json(name: str, obj) -> Path:
    path = results_dir() / name
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def read_json(name: str, folder: Path | None = None):
    path = (folder or results_dir()) / name
    return json.loads(path.read_text()) if path.exists() else None


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
