"""Proof of overlap: profile a few training steps, draw compute and communication on one axis.

``profile_ddp(ctx, [(label, factory), ...], args, name)``: every rank profiles two LM steps per
case into ``<trace-dir>/<name>/<label>_rank<r>.json`` (https://ui.perfetto.dev), cut into
``ddp:forward``, ``ddp:backward``, ``ddp:finish`` and ``ddp:optimizer``. Gloo runs a collective
on a thread (``gloo:all_reduce``...), NCCL as a kernel (``ncclDevKernel_...``). Rank 0 prints the
communication during and after backward (results/ddp_profile.csv), a text timeline and a PNG.
"""

import argparse
import json
import os
import re
import time
from pathlib import Path

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from bench import results, step_bench
from common import models

# range name: (legend, colour, mark in the text timeline)
PHASES = {"ddp:forward": ("forward", "#9ecae1", "f"), "ddp:backward": ("backward", "#3182bd", "B"),
          "ddp:finish": ("wait for comm", "#fdae6b", "w"), "ddp:optimizer": ("optimizer", "#a1d99b", "o")}
COMM_COLOR = "#e6550d"
PROFILE_CSV = "ddp_profile.csv"
GLOO_COLLECTIVE = re.compile(r"gloo:.*(all_?reduce|all_?gather|reduce_?scatter)")  # lower case
# what the CSV and the table keep of a step's timeline (the rest is for drawing it)
SUMMARY = ("step_ms", "backward_ms", "collectives", "comm_during_backward_ms", "comm_after_backward_ms")


def add_profile_args(parser):
    g = parser.add_argument_group("profiling")
    g.add_argument("--profile", action="store_true",
                   help="profile a few LM training steps per rank (bench/profile_ddp.py: always)")
    # a Path, not a str: argparse checks a given --trace-dir with the type, never the default
    g.add_argument("--trace-dir", type=writable_folder, default=results.REPO_ROOT / "traces",
                   help="where the traces and the timeline picture go")


def writable_folder(text: str) -> Path:
    """A flag type: a folder that can be written or made, checked when parsed, made when used."""
    existing = Path(text).absolute()
    while not existing.exists():
        existing = existing.parent  # ends at the root, which exists
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: {existing} cannot be written")
    return Path(text)


def profile_case(ctx, factory, args, trace_path: Path) -> None:
    _, wrapper, finish, optimizer, x, y = step_bench.setup_case(ctx, factory, args)

    def step():  # each range waits for its kernels: the compute stream's, all at the end
        with record_function("ddp:forward"):
            optimizer.zero_grad(set_to_none=True)
            loss = models.lm_loss(wrapper(x), y)
            step_bench.wait_for(ctx.device, compute_only=True)
        for name, work in (("ddp:backward", loss.backward), ("ddp:finish", finish),
                           ("ddp:optimizer", optimizer.step)):
            with record_function(name):
                work()
                step_bench.wait_for(ctx.device, compute_only=name != "ddp:optimizer")

    for _ in range(3):
        step()
    dist.barrier()
    on_gpu = [ProfilerActivity.CUDA] if ctx.device.type == "cuda" else []
    with profile(activities=[ProfilerActivity.CPU, *on_gpu]) as prof:
        for _ in range(2):
            step()
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace_path))


def profile_ddp(ctx, cases, args, name: str) -> list[dict]:
    """Profile each ``(label, factory)`` on every rank; rank 0 writes its summary and picture as
    each case lands, then prints the text timelines and the table."""
    out_dir = Path(args.trace_dir) / name
    timelines, summaries = [], []
    for label, factory in step_bench.until_deadline(ctx, cases, "the cases left"):
        start = time.perf_counter()
        slug = re.sub(r"[^a-z0-9.]+", "_", label.lower()).strip("_.")
        path = out_dir / f"{slug}_rank{ctx.rank}.json"
        profile_case(ctx, factory, args, path)
        ctx.print(f"profiled {label}: {path} ({time.perf_counter() - start:.1f} s)")
        if ctx.is_main:
            timelines.append((label, step_timeline(path)))
            summaries = write_summary(ctx, args, name, timelines, out_dir)
    dist.barrier()  # every rank's trace is on disk
    if not ctx.is_main:
        return []
    for label, tl in timelines:
        print(text_timeline(label, tl), flush=True)
    results.print_table(summaries, title=f"\nCommunication in the last profiled step, rank 0 "
                                         f"({results.machine_name()}):")
    return summaries


def write_summary(ctx, args, name: str, timelines, out_dir: Path) -> list[dict]:
    """Rank 0: the cases profiled so far into ``results/ddp_profile.csv`` and the picture."""
    summaries = [{"case": label, **{k: tl[k] for k in SUMMARY}} for label, tl in timelines]
    png = draw_timeline(timelines, out_dir / "timeline.png",
                        f"{name}: one step of LM '{args.model}' (batch {args.batch_size}, context "
                        f"{args.context_length}), rank 0 of {ctx.world_size}, "
                        f"{ctx.backend}/{ctx.device.type}")
    results.upsert_csv(PROFILE_CSV, [
        {"backend": ctx.backend, "device": ctx.device.type, "world_size": ctx.world_size,
         "model": args.model, "batch_size": args.batch_size, "context_length": args.context_length,
         "stage": name, **s, "timeline_png": str(png or ""), "run_id": results.run_id()}
        for s in summaries], key=["backend", "device", "world_size", "model", "stage", "case"])
    return summaries


def step_timeline(trace_path: Path) -> dict:
    """The last profiled step of a trace: phases and communication intervals (ms from the
    step's start), and how much communication ran during and after backward."""
    events = [e for e in json.loads(Path(trace_path).read_text())["traceEvents"]
              if e.get("ph") == "X" and "dur" in e]
    phases = [e for e in events if e["name"] in PHASES]
    start = max(e["ts"] for e in phases if e["name"] == "ddp:forward")
    phases = sorted((e for e in phases if e["ts"] >= start), key=lambda e: e["ts"])
    end = max(e["ts"] + e["dur"] for e in phases)
    bwd = next(e for e in phases if e["name"] == "ddp:backward")
    comm = sorted((e["ts"], e["ts"] + e["dur"], e.get("tid")) for e in events
                  if e["ts"] < end and e["ts"] + e["dur"] > start and (
                      GLOO_COLLECTIVE.match(str(e["name"]).lower())
                      or (e.get("cat") == "kernel" and "nccl" in str(e["name"]).lower())))

    def busy_ms(lo, hi):  # the union of the communication intervals inside [lo, hi]
        total, reach = 0.0, lo
        for a, b, _ in comm:
            a, b = max(a, reach), min(b, hi)
            if b > a:
                total, reach = total + b - a, b
        return total / 1e3  # trace times are microseconds

    lanes = sorted({tid for _, _, tid in comm}, key=str)
    return {"step_ms": (end - start) / 1e3, "backward_ms": bwd["dur"] / 1e3,
            "phases": [(e["name"], (e["ts"] - start) / 1e3, e["dur"] / 1e3) for e in phases],
            "comm": [((a - start) / 1e3, (b - a) / 1e3, lanes.index(t)) for a, b, t in comm],
            "lanes": max(1, len(lanes)), "collectives": len(comm),
            "comm_during_backward_ms": busy_ms(bwd["ts"], bwd["ts"] + bwd["dur"]),
            "comm_after_backward_ms": busy_ms(bwd["ts"] + bwd["dur"], end)}


def text_timeline(label: str, tl: dict, width: int = 72) -> str:
    """Two rows of characters on one time axis: the main thread's phases, and communication."""
    scale = width / max(tl["step_ms"], 1e-9)
    text = (f"{label}: step {tl['step_ms']:.1f} ms; communication during backward "
            f"{tl['comm_during_backward_ms']:.1f} ms, after it {tl['comm_after_backward_ms']:.1f} ms")
    for row, spans in (("compute", [(t, d, PHASES[n][2]) for n, t, d in tl["phases"]]),
                       ("comm   ", [(t, d, "#") for t, d, _ in tl["comm"]])):
        cells = [" "] * width
        for t0, dur, mark in spans:  # a span covers at least its first character
            first = int(t0 * scale)
            for i in range(first, min(width, max(first + 1, int((t0 + dur) * scale)))):
                cells[i] = mark
        text += f"\n  {row} |{''.join(cells)}|"
    return text + ("\n           f forward, B backward, w waiting for communication, o optimizer, "
                   "# collective running")


def draw_timeline(timelines, out_png: Path, title: str) -> Path | None:
    """One panel per case: the phases on top, each communication thread below (matplotlib)."""
    plt = results.pyplot()
    if plt is None:
        print("(matplotlib not installed: text timeline only)", flush=True)
        return None
    from matplotlib.patches import Patch
    span = max(tl["step_ms"] for _, tl in timelines)
    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 1.0 + 1.25 * len(timelines)),
                             sharex=True, squeeze=False)
    for ax, (label, tl) in zip(axes[:, 0], timelines):  # row 0: compute, row 1 + i: lane i
        rows = ["compute"] + [f"comm {i + 1}" for i in range(tl["lanes"])]
        for name, t0, dur in tl["phases"]:
            ax.broken_barh([(t0, dur)], (0.15, 0.7), color=PHASES[name][1])
        for t0, dur, lane in tl["comm"]:
            ax.broken_barh([(t0, dur)], (lane + 1.15, 0.7), color=COMM_COLOR, edgecolor="white",
                           linewidth=0.3)
        ax.set_yticks([i + 0.5 for i in range(len(rows))], rows, fontsize=8)
        ax.set(ylim=(len(rows), 0), xlim=(0, span * 1.01))  # row 0 on top
        ax.set_title(f"{label}: communication during backward {tl['comm_during_backward_ms']:.0f} "
                     f"ms, after it {tl['comm_after_backward_ms']:.0f} ms (step "
                     f"{tl['step_ms']:.0f} ms)", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("time since the start of the step (ms)")
    fig.legend(handles=[Patch(color=c, label=l) for l, c, _ in PHASES.values()]
               + [Patch(color=COMM_COLOR, label="collective running (Gloo thread / NCCL kernel)")],
               loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    print(f"timeline picture: {out_png}", flush=True)
    return out_png
