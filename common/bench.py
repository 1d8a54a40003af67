"""``make bench``: run every measurement worth making on this box, then write a report.

    python -m common.bench            # full sizes on a GPU box, small ones on a CPU-only box
    BENCH_QUICK=1 python -m common.bench

Each stage script runs as its own process with a time limit (02 skips any configuration
estimated past 100 s, and each script gets a wall-clock cap here), progress is
printed as it goes, and at the end ``results/README.md`` collects every table written under
``results/`` with the machine it ran on and the plots. This driver only runs the stages'
scripts; it imports none of them.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # allow `python common/bench.py` as well as `-m common.bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.results import REPO_ROOT, machine_name, results_dir  # noqa: E402


def plan(gpus: int, quick: bool) -> list[tuple[str, list[str], int]]:
    """(title, script + arguments, wall-clock cap in seconds) for each measurement."""
    if gpus:
        lm = "small" if not quick else "course"
        sizes = "1MB,10MB,100MB,1GB" if not quick else "1MB,10MB,100MB"
        world_sizes = "2,4,6" if not quick else "2,4"
        ddp = ["--model", lm, "--batch-size", "8", "--context-length", "256", "--steps", "5" if quick else "10"]
        buckets = "1,10,100,1000" if not quick else "1,25,100"
    else:  # CPU only: the same measurements at sizes a laptop finishes in minutes
        sizes, world_sizes = "64KB,1MB,10MB", "2,4"
        ddp = ["--model", "tiny", "--batch-size", "4", "--context-length", "64", "--steps", "5"]
        buckets = "0.05,0.25,1,10"
    # 06's --bench times stages 03, 04 and 05 too, with torch DDP and no-communication, in
    # the same run as the bucket sweep (ratios are only fair within one run), so 03-05 need
    # no runs of their own here.
    return [
        ("02 all-reduce sweep", ["02_allreduce_bench/allreduce_bench.py", "--sizes", sizes,
                                 "--world-sizes", world_sizes, "--budget-s", "100"], 240),
        ("03-06 DDP step times, bucket sweep and model",
         ["06_bucketed_ddp/bucketed_ddp.py", "--bench", *ddp, "--bucket-sizes", buckets], 240),
        ("07 tensor parallel", ["07_parallelism/tensor_parallel.py"], 60),
        ("07 pipeline parallel", ["07_parallelism/pipeline_parallel.py"], 60),
    ]


def run_all(steps) -> list[tuple[str, str, float]]:
    outcomes = []
    for i, (title, argv, cap) in enumerate(steps, 1):
        print(f"\n[bench {i}/{len(steps)}] {title}: {' '.join(argv)}", flush=True)
        start = time.monotonic()
        try:
            rc = subprocess.run([sys.executable, *argv], cwd=REPO_ROOT, timeout=cap).returncode
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            status = f"stopped after {cap}s"
        elapsed = time.monotonic() - start
        print(f"[bench {i}/{len(steps)}] {title}: {status} in {elapsed:.0f}s", flush=True)
        outcomes.append((title, status, elapsed))
    return outcomes


def markdown_table(path: Path) -> str:
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        return "(empty)\n"
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines) + "\n"


def write_report(outcomes, quick: bool) -> Path:
    out = results_dir()
    parts = [
        "# Benchmark report\n",
        f"Machine: {machine_name()}.  Mode: {'BENCH_QUICK' if quick else 'full'}.  "
        f"Written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `make bench`.\n",
        "Times are the slowest rank's median after warm-up; bandwidths in GB/s = 1e9 bytes/s; "
        "sizes in binary units (1 MB = 2^20 bytes). Each stage's README explains its columns.\n",
        "## Runs\n",
        "| measurement | outcome | wall time (s) |\n|---|---|---|",
        *[f"| {t} | {s} | {e:.0f} |" for t, s, e in outcomes],
        "",
    ]
    for csv_path in sorted(out.glob("*.csv")):
        parts += [f"## {csv_path.name}\n", markdown_table(csv_path)]
    for png in sorted(out.glob("*.png")):
        parts += [f"## {png.name}\n", f"![{png.stem}]({png.name})\n"]
    report = out / "README.md"
    report.write_text("\n".join(parts))
    return report


def main() -> None:
    import torch
    quick = os.environ.get("BENCH_QUICK", "") not in ("", "0")
    gpus = torch.cuda.device_count()
    print(f"make bench on {machine_name()} ({'quick' if quick else 'full'} mode)", flush=True)
    start = time.monotonic()
    outcomes = run_all(plan(gpus, quick))
    report = write_report(outcomes, quick)
    print(f"\nbench finished in {time.monotonic() - start:.0f}s; report: {report}", flush=True)
    if any(s != "ok" for _, s, _ in outcomes):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
