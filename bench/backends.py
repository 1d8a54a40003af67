"""Which collectives each backend/device pair on this box carries (Gloo/CPU; with a GPU Gloo/CUDA;
with two, NCCL): each op a 2-rank job of its own, all started at once, so a segfault or a hang is a
row in results/backends.csv: ok, error: its first line, crashed: the signal, or timeout (60 s for
all); a job make bench's deadline for the step cuts is left out, said in one line. The report sets
it beside ``common.launch.carries_point_to_point``. Run: ``python bench/backends.py``
"""

import multiprocessing
import os
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench import results  # noqa: E402

WORLD_SIZE = 2
OPS = ("broadcast", "all_reduce", "reduce", "all_gather", "gather", "scatter", "all_gather_into_tensor",
       "reduce_scatter_tensor", "reduce_scatter", "all_to_all_single", "send/recv", "isend/irecv", "batch_isend_irecv")


def try_op(op: str, r: int, n: int, dev: torch.device) -> tuple[list, list]:
    """Run ``op`` on rank r of n; return what it gave and what it should have given."""
    mine = torch.tensor([r + 1.0], device=dev)                     # rank r holds r + 1
    one, row = torch.zeros(1, device=dev), torch.zeros(n, device=dev)
    parts = list(torch.arange(1.0, n + 1, device=dev).split(1))  # 1, 2, ..., n
    total, everyone = [n * (n + 1) / 2], list(range(1, n + 1))
    right, left = (r + 1) % n, (r - 1) % n  # a ring: send right, receive from the left
    # uneven all-to-all: rank r sends r + j + 1 copies of 10 r + j to rank j
    send = torch.tensor([10.0 * r + j for j in range(n) for _ in range(r + j + 1)], device=dev)
    out = torch.zeros(sum(i + r + 1 for i in range(n)), device=dev)
    calls = {  # op: (the call, the tensor it fills, what that should hold; None: unspecified)
        "broadcast": (lambda: dist.broadcast(mine, src=0), mine, [1]),
        "all_reduce": (lambda: dist.all_reduce(mine), mine, total),
        "reduce": (lambda: dist.reduce(mine, dst=0), mine, total if r == 0 else None),
        "all_gather": (lambda: dist.all_gather(list(row.split(1)), mine), row, everyone),
        "gather": (lambda: dist.gather(mine, list(row.split(1)) if r == 0 else None, dst=0), row,
                   everyone if r == 0 else [0] * n),
        "scatter": (lambda: dist.scatter(one, parts if r == 0 else None, src=0), one, [r + 1]),
        "all_gather_into_tensor": (lambda: dist.all_gather_into_tensor(row, mine), row, everyone),
        "reduce_scatter_tensor": (lambda: dist.reduce_scatter_tensor(one, torch.cat(parts)), one, [n * (r + 1)]),
        "reduce_scatter": (lambda: dist.reduce_scatter(one, parts), one, [n * (r + 1)]),
        "all_to_all_single": (lambda: dist.all_to_all_single(out, send, [i + r + 1 for i in range(n)],
                                                             [r + j + 1 for j in range(n)]),
                              out, [10 * i + r for i in range(n) for _ in range(i + r + 1)]),
        "send/recv": (lambda: dist.send(mine, dst=1) if r == 0 else dist.recv(one, src=0), one, [min(r, 1)]),  # 0 to 1
        "isend/irecv": (lambda: [q.wait() for q in (dist.isend(mine, right), dist.irecv(one, left))], one,
                        [left + 1]),
        "batch_isend_irecv": (lambda: [q.wait() for q in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, mine, right), dist.P2POp(dist.irecv, one, left)])], one, [left + 1]),
    }
    call, result, want = calls[op]
    call()
    return result.tolist(), result.tolist() if want is None else want


def rank_main(run, op, backend, device, rank, folder):
    """One rank of one op's job: exit 0 on the right answer, else 1, the error's first line in a file."""
    warnings.simplefilter("ignore")  # torch's deprecation notes, once per rank
    dev = torch.device("cuda", rank % torch.cuda.device_count()) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(dev)
    try:
        dist.init_process_group(backend, init_method=f"file://{folder}/store", rank=rank, world_size=WORLD_SIZE)
        got, want = run(op, rank, WORLD_SIZE, dev)
        if got != want:
            raise AssertionError(f"wrong result: {got}, expected {want}")
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - the error is the row
        Path(folder, f"error.{rank}").write_text(f"{type(e).__name__}: {e}".splitlines()[0][:200])
        os._exit(1)


def outcome(codes: list, folder: str) -> str:
    """A job's outcome from its ranks' exit codes (None: running at the deadline): a crash, the first error,
    a timeout."""
    for code in codes:
        if code is not None and code < 0:
            return f"crashed: {signal.Signals(-code).name}"
    errors = sorted(Path(folder).glob("error.*"), key=lambda path: path.stat().st_mtime_ns)  # the first: the cause
    if errors or any(codes):
        return "error: " + (errors[0].read_text() if errors else f"exit {max(c or 0 for c in codes)}")
    return "timeout" if None in codes else "ok"


def try_all(pairs, ops=OPS, run=try_op, timeout_s=60.0) -> list[dict]:
    """Start every (pair, op) job at once, wait for all or the deadline, classify each."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed"])
    jobs = []
    with tempfile.TemporaryDirectory() as tmp:
        for backend, device in pairs:
            for op in ops:
                folder = tempfile.mkdtemp(dir=tmp)
                ranks = [context.Process(target=rank_main, args=(run, op, backend, device, rank, folder))
                         for rank in range(WORLD_SIZE)]
                for p in ranks:
                    p.start()
                jobs.append((backend, device, op, folder, ranks))
        from bench.step_bench import SKIPPED, seconds_left  # not in every rank's process
        left = seconds_left() - 1  # to make bench's deadline for this step, less a second to write
        deadline = time.monotonic() + min(timeout_s, left)
        rows, unfinished = [], []
        for backend, device, op, folder, ranks in jobs:
            for p in ranks:
                p.join(max(0.0, deadline - time.monotonic()))
            codes = [p.exitcode for p in ranks]
            for p in ranks:
                p.kill()
                p.join()
            if left < timeout_s and None in codes:  # cut by make bench's deadline, not timed out
                unfinished.append(f"{op} on {backend}/{device}")
                continue
            rows.append({"backend": backend, "device": device, "op": op, "outcome": outcome(codes, folder)})
    if unfinished:
        print(f"{', '.join(unfinished)}: {SKIPPED}; the other rows are written", flush=True)
    return rows


def main() -> None:
    gpus = torch.cuda.device_count()  # no CUDA context here: the jobs fork from a server
    pairs = [("gloo", "cpu")] + [("gloo", "cuda")] * (gpus >= 1) + [("nccl", "cuda")] * (gpus >= 2)
    rows = [{**row, "machine": results.machine_name(), "run_id": results.run_id()} for row in try_all(pairs)]
    results.print_table(rows, title=f"{WORLD_SIZE} ranks per op:")
    results.upsert_csv("backends.csv", rows, key=["backend", "device", "op"])


if __name__ == "__main__":
    main()
