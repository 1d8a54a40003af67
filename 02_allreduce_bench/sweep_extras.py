"""Stage 02, off the reading path: what the sweep needs beside the lesson (fill -> check ->
time -> row in ``allreduce_bench.py``). Whether a configuration's memory fits, agreed by every
rank, and the bus-bandwidth plot. Only stage 02 needs them, so they live here, not in common/
(imported inside the functions, as in every stage file). Run through ``allreduce_bench.py``.
"""

import math
from pathlib import Path

import torch
import torch.distributed as dist


def memory_shortfall(ctx, host_per_rank: int, gpu_per_rank: int = 0) -> str | None:
    """Why ``host_per_rank`` bytes on the host (and ``gpu_per_rank`` on each rank's GPU) would
    not fit for the ranks on this node, or None. Checked inside a run, every rank for its own
    GPU, all getting the same answer: one rank short means all skip, or their collectives
    would not match."""
    from bench import supervisor as launch  # TODO(lab): memory checks move to the lab
    gib = launch.GIB
    ranks_here = launch.ranks_on_this_node(ctx.world_size)
    have = launch.host_available_bytes()
    host = ranks_here * (launch.rank_baseline_bytes() + host_per_rank)
    why = None
    if host > 0.9 * have:
        why = f"needs about {host / gib:.1f} GiB of host memory, {have / gib:.1f} GiB available"
    elif ctx.device.type == "cuda" and gpu_per_rank:
        torch.cuda.empty_cache()  # else the last configuration's cached blocks count as used
        free = torch.cuda.mem_get_info(ctx.device)[0]  # + 1 GiB for context and buffers:
        per_gpu = math.ceil(ranks_here / torch.cuda.device_count()) * (gpu_per_rank + gib)
        if per_gpu > 0.9 * free:
            why = f"needs about {per_gpu / gib:.1f} GiB per GPU, {free / gib:.1f} GiB free"
    flag = torch.tensor([float(why is not None)],
                        device=ctx.device if ctx.backend == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return (why or "memory is short on another rank") if flag.item() else None


def plot_lines(path: Path, lines: dict, xlabel: str, ylabel: str, title: str,
               xticks: dict | None = None) -> Path | None:
    """A log-x line plot: ``lines`` maps a label to (xs, ys, matplotlib format string).
    ``xticks``: {x: label}. Returns the path, or None (with a note) without matplotlib."""
    from bench import results
    plt = results.pyplot()
    if plt is None:
        print(f"plot: matplotlib is not installed, so no {Path(path).name}", flush=True)
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (xs, ys, fmt) in lines.items():
        ax.plot(xs, ys, fmt, marker="o", label=label)
    ax.set_xscale("log")
    if xticks:
        ax.set_xticks(list(xticks), list(xticks.values()), minor=False)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}", flush=True)
    return Path(path)
