"""Timing done right for distributed code, and why each rule:
* warm-up: the first calls pay for lazy set-up (CUDA context, NCCL communicators, Gloo's
  buffers, allocator growth) that steady-state training never sees again;
* ``torch.cuda.synchronize()`` before reading a clock: CUDA calls return before the GPU has
  finished, so without it you time the launch, not the work;
* the median of several iterations: robust to the odd slow one (a page fault, a neighbour);
* the slowest rank: a collective or a step finishes when its last rank does.
"""

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so a clock read afterwards means something. No-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn, device: torch.device, warmup: int = 5, iters: int = 10,
            barrier: bool = False) -> list[float]:
    """Call ``fn()`` ``warmup`` times untimed, then ``iters`` times; return seconds per call.
    ``barrier=True`` lines the ranks up before each timed call, so no clock starts while its
    rank waits for a slower one."""
    for _ in range(warmup):
        fn()
    synchronize(device)  # else a barrier (Gloo's does not wait for the GPU) lines up nothing
    times = []
    for _ in range(iters):
        if barrier:
            dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def call_in_burst(device: torch.device, nbytes: int = 64 * 2**10, calls: int = 20,
                  bursts: int = 5, asynchronous: bool = False) -> list[float]:
    """Seconds an all-reduce of ``nbytes`` takes inside a burst of ``calls``, one figure per burst,
    the ranks lined up before each burst only: what each of a step's many small calls costs;
    ``asynchronous``: all launched (``async_op``, a tensor each) before any is waited for (stage 05)."""
    smalls = [torch.ones(nbytes // 4, device=device) for _ in range(calls if asynchronous else 1)]
    per_call = []
    for _ in range(bursts):
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        works = [dist.all_reduce(smalls[index % len(smalls)], async_op=asynchronous) for index in range(calls)]
        for work in filter(None, works):      # a synchronous call returns no work
            work.wait()
        synchronize(device)
        per_call.append((time.perf_counter() - start) / calls)
    return per_call


@dataclass(frozen=True)
class Stats:
    """One configuration's times across ranks, in seconds."""
    median: float  # the slowest rank's median: the headline figure
    min: float     # the fastest single iteration on any rank
    max: float     # the slowest single iteration on any rank
    slowest_rank: int
    rank_medians: tuple[float, ...]  # each rank's median, by rank


def gather_times(times: list[float]) -> Stats:
    """All-gather every rank's times (same length everywhere): the same :class:`Stats` everywhere."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL: this rank's GPU
    mine = torch.tensor(times, dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    per_rank = [t.tolist() for t in everyone]
    medians = [statistics.median(t) for t in per_rank]
    slowest = max(range(len(medians)), key=medians.__getitem__)
    return Stats(medians[slowest], min(map(min, per_rank)), max(map(max, per_rank)), slowest,
                 tuple(medians))
