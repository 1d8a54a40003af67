"""Proof of overlap: profile a few DDP training steps and draw compute and communication on one time axis.

Used by the ``--profile`` flag of stages 03, 05 and 06::

    add_profile_args(parser)                       # --profile, --trace-dir
    profile_ddp(ctx, [("naive", make_naive_ddp), ("overlap", make_overlap_ddp)], args,
                name="05_overlap_ddp")             # on every rank

For each case, every rank trains the Transformer LM of ``--model`` (the step-benchmark flags
of common/step_bench.py) for a few warm-up steps, then profiles ``PROFILED_STEPS`` steps with
``torch.profiler`` and writes a Chrome-format trace per rank,
``<trace-dir>/<name>/<slug>_rank<r>.json``, the slug being the case's label made safe for
a file name ("naive (03)" -> ``naive_03_rank0.json``; the picture keeps the label). Open a
trace in https://ui.perfetto.dev or chrome://tracing. Each step is labelled with
``record_function`` ranges ``ddp:forward``, ``ddp:backward``, ``ddp:finish`` (the wait for the
gradient communication left after backward) and ``ddp:optimizer``.

Where the communication shows up in a trace: Gloo runs each collective on one of its worker
threads and the profiler records it there as ``gloo:all_reduce`` (from when the thread picks
it up until it completes); NCCL runs it as a GPU kernel (``ncclDevKernel_AllReduce...``).
Rank 0 then renders the last profiled step of every case, one panel per case, as a PNG
(matplotlib, Agg backend) and always prints a text timeline, with the communication time
that ran during backward and after it; those figures also go to ``results/ddp_profile.csv``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from common import models, results, step_bench, timing

REPO_ROOT = Path(__file__).resolve().parent.parent
PHASES = ("ddp:forward", "ddp:backward", "ddp:finish", "ddp:optimizer")
PHASE_LABELS = {"ddp:forward": "forward", "ddp:backward": "backward",
                "ddp:finish": "wait for comm", "ddp:optimizer": "optimizer"}
PHASE_COLORS = {"ddp:forward": "#9ecae1", "ddp:backward": "#3182bd",
                "ddp:finish": "#fdae6b", "ddp:optimizer": "#a1d99b"}
COMM_COLOR = "#e6550d"
PROFILE_CSV = "ddp_profile.csv"  # rank 0's summary per case, for the make bench report
WARMUP_STEPS = 3
PROFILED_STEPS = 2


def slug(label: str) -> str:
    """A file-name-safe form of a case label: 'bucketed (06, 25 MB)' -> 'bucketed_06_25_mb'."""
    return re.sub(r"[^a-z0-9.]+", "_", label.lower()).strip("_.") or "case"


def add_profile_args(parser):
    g = parser.add_argument_group("profiling (--profile)")
    g.add_argument("--profile", action="store_true",
                   help="write a torch.profiler trace per rank (Perfetto/Chrome format) of a few "
                        "training steps of the LM (--model etc.) and render a timeline of "
                        "backward compute vs gradient communication")
    g.add_argument("--trace-dir", default=str(REPO_ROOT / "traces"),
                   help="where the traces and the timeline picture go")
    return g


# --------------------------------------------------------------------------- recording


def profile_case(ctx, factory, args, trace_path: Path) -> Path:
    """Profile a few LM training steps under ``factory``; write this rank's trace."""
    dev, ws, rank = ctx.device, ctx.world_size, ctx.rank
    torch.manual_seed(0)
    model = models.TransformerLM(args.model, context_length=args.context_length).to(dev)
    wrapper = factory(model)
    finish = step_bench.finish_fn(wrapper)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    local = args.batch_size // ws
    x, y = models.random_tokens(args.batch_size, args.context_length, seed=0, device=dev)
    x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]

    def step():
        # synchronize inside each range so that on a GPU a range covers its kernels too
        with record_function("ddp:forward"):
            optimizer.zero_grad(set_to_none=True)
            loss = models.lm_loss(wrapper(x), y)
            timing.synchronize(dev)
        with record_function("ddp:backward"):
            loss.backward()
            timing.synchronize(dev)
        with record_function("ddp:finish"):
            finish()
            timing.synchronize(dev)
        with record_function("ddp:optimizer"):
            optimizer.step()
            timing.synchronize(dev)

    for _ in range(WARMUP_STEPS):
        step()
    activities = [ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    dist.barrier()
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            step()
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace_path))
    del wrapper, model, optimizer
    return trace_path


def profile_ddp(ctx, cases, args, name: str) -> list[dict]:
    """Profile each ``(label, factory)`` case on every rank; rank 0 renders the timeline.

    Returns (on every rank) one summary dict per case: milliseconds of communication during
    and after backward in the last profiled step of rank 0.
    """
    out_dir = Path(args.trace_dir) / name
    paths = []
    for label, factory in cases:
        t = time.perf_counter()
        # the label ("naive (03)") names the case in the picture; the file gets a slug of it
        path = profile_case(ctx, factory, args, out_dir / f"{slug(label)}_rank{ctx.rank}.json")
        paths.append((label, path))
        ctx.print(f"profiled {label}: trace {path} ({time.perf_counter() - t:.1f} s)")
    dist.barrier()  # every rank's trace is on disk
    summaries = []
    if ctx.is_main:
        title = (f"{name}: one training step of LM '{args.model}' (batch {args.batch_size}, "
                 f"context {args.context_length}), rank 0, {ctx.world_size} ranks "
                 f"{ctx.backend}/{ctx.device.type}")
        summaries = render_timeline(paths, out_dir / "timeline.png", title)
        results.upsert_csv(PROFILE_CSV, [
            {"backend": ctx.backend, "device": ctx.device.type, "world_size": ctx.world_size,
             "model": args.model, "batch_size": args.batch_size,
             "context_length": args.context_length, "stage": name, **s,
             "timeline_png": str(out_dir / "timeline.png"), "run_id": results.run_id()}
            for s in summaries], key=["backend", "device", "world_size", "model", "stage", "case"])
    return summaries


# --------------------------------------------------------------------------- reading traces


def _events(trace_path: Path) -> list[dict]:
    data = json.loads(Path(trace_path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _is_comm(e: dict) -> bool:
    name = str(e.get("name", "")).lower()
    if name.startswith("gloo:") and any(op in name for op in (
            "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "reducescatter")):
        return True  # runs on a Gloo worker thread: the collective itself
    # the collective as a GPU kernel: ncclDevKernel_AllReduce_..., _AllGather_..., _ReduceScatter_...
    return e.get("cat") == "kernel" and "nccl" in name


def step_timeline(trace_path: Path) -> dict:
    """The last profiled step of a trace: phase intervals and communication intervals (ms,
    relative to the step's start), and the communication time during and after backward."""
    events = _events(trace_path)
    phases = [e for e in events if e["name"] in PHASES]
    forwards = sorted((e for e in phases if e["name"] == "ddp:forward"), key=lambda e: e["ts"])
    if not forwards:
        raise ValueError(f"{trace_path}: no 'ddp:forward' range; not a trace from profile_case")
    start = forwards[-1]["ts"]
    step_phases = sorted((e for e in phases if e["ts"] >= start), key=lambda e: e["ts"])
    end = max(e["ts"] + e["dur"] for e in step_phases)
    bwd = next(e for e in step_phases if e["name"] == "ddp:backward")
    bwd_start, bwd_end = bwd["ts"], bwd["ts"] + bwd["dur"]
    comm = sorted(((e["ts"], e["ts"] + e["dur"], e.get("tid")) for e in events
                   if _is_comm(e) and e["ts"] < end and e["ts"] + e["dur"] > start),
                  key=lambda c: c[0])
    ms = 1e-3  # trace times are microseconds

    def busy(lo, hi):  # length of the union of comm intervals inside [lo, hi]
        total, cur_lo, cur_hi = 0.0, None, None
        for a, b, _ in comm:
            a, b = max(a, lo), min(b, hi)
            if b <= a:
                continue
            if cur_hi is None or a > cur_hi:
                total += 0 if cur_hi is None else cur_hi - cur_lo
                cur_lo, cur_hi = a, b
            else:
                cur_hi = max(cur_hi, b)
        return (total + (0 if cur_hi is None else cur_hi - cur_lo)) * ms

    threads = sorted({c[2] for c in comm}, key=str)
    return {
        "step_ms": (end - start) * ms,
        "phases": [(e["name"], (e["ts"] - start) * ms, e["dur"] * ms) for e in step_phases],
        "comm": [((a - start) * ms, (b - a) * ms, threads.index(t)) for a, b, t in comm],
        "comm_lanes": max(1, len(threads)),
        "backward_ms": (bwd_end - bwd_start) * ms,
        "comm_during_backward_ms": busy(bwd_start, bwd_end),
        "comm_after_backward_ms": busy(bwd_end, end),
        "comm_calls": len(comm),
    }


# --------------------------------------------------------------------------- rendering


def text_timeline(label: str, tl: dict, width: int = 72) -> str:
    """Two rows of characters on one time axis: the main thread's phases, and communication."""
    scale = width / max(tl["step_ms"], 1e-9)
    main = [" "] * width
    marks = {"ddp:forward": "f", "ddp:backward": "B", "ddp:finish": "w", "ddp:optimizer": "o"}
    for name, t0, dur in tl["phases"]:
        for i in range(int(t0 * scale), min(width, max(int(t0 * scale) + 1, int((t0 + dur) * scale)))):
            main[i] = marks[name]
    comm = [" "] * width
    for t0, dur, _ in tl["comm"]:
        for i in range(int(t0 * scale), min(width, max(int(t0 * scale) + 1, int((t0 + dur) * scale)))):
            comm[i] = "#"
    return (f"{label}: step {tl['step_ms']:.1f} ms, backward {tl['backward_ms']:.1f} ms, "
            f"{tl['comm_calls']} all-reduce(s); communication during backward "
            f"{tl['comm_during_backward_ms']:.1f} ms, after backward {tl['comm_after_backward_ms']:.1f} ms\n"
            f"  compute |{''.join(main)}|\n"
            f"  comm    |{''.join(comm)}|\n"
            f"           f forward, B backward, w waiting for communication, o optimizer, # all-reduce running")


def render_timeline(paths, out_png: Path, title: str = "") -> list[dict]:
    """Print a text timeline per case; draw them as one PNG when matplotlib is there."""
    summaries = []
    timelines = []
    for label, path in paths:
        tl = step_timeline(path)
        timelines.append((label, tl))
        print(text_timeline(label, tl), flush=True)
        summaries.append({"case": label, "step_ms": tl["step_ms"], "backward_ms": tl["backward_ms"],
                          "all_reduces": tl["comm_calls"],
                          "comm_during_backward_ms": tl["comm_during_backward_ms"],
                          "comm_after_backward_ms": tl["comm_after_backward_ms"]})
    plt = results.pyplot()
    if plt is None:
        print("(matplotlib not installed: text timeline only)", flush=True)
        return summaries
    from matplotlib.patches import Patch
    span = max(tl["step_ms"] for _, tl in timelines)
    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 1.0 + 1.25 * len(timelines)),
                             sharex=True, squeeze=False)
    for ax, (label, tl) in zip(axes[:, 0], timelines):
        lanes = tl["comm_lanes"]
        for name, t0, dur in tl["phases"]:
            ax.broken_barh([(t0, dur)], (lanes + 0.15, 0.7), color=PHASE_COLORS[name])
        for t0, dur, lane in tl["comm"]:
            ax.broken_barh([(t0, dur)], (lanes - 1 - lane + 0.15, 0.7), color=COMM_COLOR,
                           edgecolor="white", linewidth=0.3)
        ax.set_yticks([lanes + 0.5] + [lanes - 1 - i + 0.5 for i in range(lanes)])
        ax.set_yticklabels(["compute"] + [f"all-reduce {i + 1}" if lanes > 1 else "all-reduce"
                                          for i in range(lanes)], fontsize=8)
        ax.set_ylim(0, lanes + 1)
        ax.set_xlim(0, span * 1.01)
        ax.set_title(f"{label}: comm during backward {tl['comm_during_backward_ms']:.0f} ms, "
                     f"after backward {tl['comm_after_backward_ms']:.0f} ms "
                     f"(step {tl['step_ms']:.0f} ms)", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("time since start of step (ms)")
    handles = [Patch(color=PHASE_COLORS[p], label=PHASE_LABELS[p]) for p in PHASES]
    handles.append(Patch(color=COMM_COLOR, label="all-reduce running (Gloo thread / NCCL kernel)"))
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    print(f"timeline picture: {out_png}", flush=True)
    return summaries


def print_summary(summaries: list[dict], machine: bool = True) -> None:
    if summaries:
        results.print_table(summaries, title="\nCommunication in the profiled step (rank 0)"
                            + (f" ({results.machine_name()})" if machine else "") + ":")
