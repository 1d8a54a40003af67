"""Write ``results/README.md``: the report of one ``make bench`` run: tables, plots, short readings.

    python bench/report.py            # rewrite the report of the last run from results/

Reads ``results/bench_run.json`` (what ran, on what, for how long) and, from each stage's
CSV/JSON file, only the rows carrying that run's ``run_id``. Without that record (a fresh
clone, stage scripts run by hand) each section shows the last run that wrote its file, and
names it. Every reading is computed from the same numbers as its table, so the words cannot
drift from the figures; the stages' READMEs explain what each measurement means. Plots need
matplotlib; without it the report says so and keeps every table. One section that fails costs
that section, not the report.

The report is replaced only by a better one: it is written with its pictures into a temporary
folder beside the old one and swapped in at the end; where no section has any data the old
report stays as it was; and a section this run did not fill (a step stopped, skipped or not
planned) keeps the old report's section, marked with the run and machine it came from, and
the pictures it shows. So an interrupted ``make bench`` never loses what a better run measured.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compute import flops_per_token  # noqa: E402
from bench import results  # noqa: E402

RUN_FILE = "bench_run.json"
RUN_KEYS = ("run_id", "quick", "model", "setup", "machine", "started_utc", "total_s", "steps")
MB = 2 ** 20
NO_ROWS = "_No rows from this run: the step failed, was stopped or skipped (see Runs above)._\n"
NO_FILE_ROWS = "_No rows in the results files for this section._\n"
NOT_PLANNED = ("_Not in this run's plan, so no rows (`BENCH_QUICK=1` leaves out the steps "
               "whose scripts have no quicker size; see Runs above)._\n")
# Pictures a stage script draws, copied in under these names by make bench (the report draws
# the others itself).
STAGE_PICTURES = ("bench_allreduce_busbw.png", "bench_overlap_timeline.png",
                  "bench_expert_parallel_load.png")
IMPL_LABEL = {"none": "no communication", "torch_ddp": "torch DDP (25 MB buckets)",
              "naive": "naive (03)", "flat": "flat (04)", "overlap": "overlap (05)",
              "bucketed": "bucketed (06)"}


@dataclass
class Where:
    """What a section reads and where it draws."""
    out: Path             # the results folder: the CSV/JSON files
    draw: Path            # where this report's pictures go (swapped into ``out`` at the end)
    run_id: str | None    # the run to report; None: each section takes its file's last run
    machine: str          # for the plots' titles ("" without a run record: the rows say)


def one_run(rows: list[dict], run_id: str | None) -> list[dict]:
    """The rows of ``run_id``; with none named, those of the last run that wrote them (an upsert
    puts its rows last)."""
    if run_id is None and rows:
        run_id = rows[-1].get("run_id")
    return [r for r in rows if r.get("run_id") == run_id]


def rows_of(where: Where, name: str) -> list[dict]:
    return one_run(results.read_csv(name, where.out), where.run_id)


def entries_of(where: Where, name: str, run_id: str) -> list[dict]:
    return [v for _, v in sorted(results.read_json(name, where.out).items())
            if isinstance(v, dict) and v.get("run_id") == run_id]


def machine_of(where: Where, rows: list[dict]) -> str:
    return where.machine or rows[0].get("machine") or "machine not recorded"


def num(row: dict, key: str) -> float:
    return float(row[key])


HOST_PATH = ("> **Gloo's host path, not an interconnect.** These ranks share one GPU over Gloo, so "
             "every collective here goes GPU -> pinned host memory -> loopback TCP -> CPU "
             "reduction -> GPU. Communication timings describe that path (a few GB/s), not "
             "NVLink or InfiniBand (hundreds of GB/s); {claim}\n\n")


def host_path_note(rows: list[dict], claim: str) -> str:
    """The label over a section whose rows ran CUDA tensors over Gloo (ranks sharing a GPU)."""
    if any(r.get("backend") == "gloo" and r.get("device") == "cuda" for r in rows):
        return HOST_PATH.format(claim=claim)
    return ""


def measured_peak(where: Where, run_id: str | None, device: str) -> dict | None:
    """The float32 matmul peak and copy bandwidth ``bench/compute.py`` measured on ``device``
    in the run ``run_id`` (None: in no run of these rows, so no MFU is shown)."""
    entry = results.read_json("matmul_peak.json", where.out).get(device)
    if isinstance(entry, dict) and run_id is not None and entry.get("run_id") == run_id:
        return entry
    return None


def model_flops_utilisation(row: dict, peak: dict) -> tuple[float, float]:
    """(tokens/s, MFU) of a DDP row: all ranks' tokens per second, over the devices doing the
    work (one GPU per rank under NCCL; one device shared by every rank otherwise)."""
    tokens_per_s = num(row, "batch_size") * num(row, "context_length") / (num(row, "step_ms") / 1e3)
    devices = int(row["world_size"]) if row.get("backend") == "nccl" else 1
    per_token = flops_per_token(row["model"], int(row["context_length"]))
    return tokens_per_s, per_token * tokens_per_s / (peak["matmul_flops_per_s"] * devices)


def size_text(nbytes: float) -> str:
    """65536 -> '64KB' (binary units; stage 02's format_size, repeated: no stage is imported)."""
    for unit, scale in (("GB", 2 ** 30), ("MB", MB), ("KB", 2 ** 10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g}{unit}"
    return f"{nbytes:g}B"


def md_table(headers: list[str], rows: list[list]) -> str:
    def cell(v):
        return (f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}") if isinstance(v, float) else str(v)
    return "\n".join(["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
                     + ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]) + "\n"


def picture(where: Where, name: str, alt: str) -> str:
    return f"![{alt}]({name})\n" if (where.draw / name).exists() else \
        f"_(no picture: `{name}` was not drawn: matplotlib missing, or the step did not finish)_\n"


def bars(where: Where, name: str, labels: list[str], stacks: list[tuple[str, list[float]]],
         xlabel: str, title: str) -> None:
    """A horizontal stacked bar chart, one bar per label (matplotlib, when installed)."""
    plt = results.pyplot()
    if plt is None or not labels:
        return
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(labels) + 1.6))
    left = [0.0] * len(labels)
    for (part, values), color in zip(stacks, ("#3182bd", "#e6550d", "#a1d99b", "#756bb1", "#969696")):
        ax.barh(labels, values, left=left, color=color, label=part)
        left = [a + b for a, b in zip(left, values)]
    ax.invert_yaxis()
    ax.set(xlabel=xlabel)
    ax.set_title(title, fontsize=9)
    fig.legend(fontsize=7, loc="lower center", ncol=len(stacks), frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(where.draw / name, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- sections


# Each returns None where it has no rows, else (its text, its headline rows, the rows it read).


def allreduce_section(where: Where):
    rows = rows_of(where, "allreduce.csv")
    if not rows:
        return None
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells.setdefault((r["backend"], r["device"], int(r["world_size"]), int(r["bytes"])),
                         {})[r["impl"]] = r
    impls = [i for i in ("backend", "ring", "ring_pipelined") if any(i in c for c in cells.values())]
    table = [[f"{b}/{d}", ws, size_text(n), *[num(c[i], "busbw_gbps") if i in c else ""
                                              for i in impls],
              num(c["backend"], "time_ms_median") if "backend" in c else ""]
             for (b, d, ws, n), c in sorted(cells.items())]
    text = host_path_note(rows, "the bus bandwidth below is that path's.") + md_table(
        ["backend/device", "ranks", "size", *[f"{i} busbw GB/s" for i in impls], "backend ms"],
        table)
    largest = max(n for *_, n in cells)
    best = max((c["backend"] for k, c in cells.items() if k[3] == largest and "backend" in c),
               key=lambda r: num(r, "busbw_gbps"), default=None)
    words, headline = [], []
    if best:
        words.append(f"At {size_text(largest)} the best bus bandwidth is "
                     f"{num(best, 'busbw_gbps'):.2f} GB/s ({best['backend']}/{best['device']}, "
                     f"{best['world_size']} ranks); busbw = algbw x 2(n-1)/n, comparable across "
                     "rank counts (nccl-tests' convention).")
        path = ""
        if best["backend"] == "gloo" and best["device"] == "cuda":
            path = "; Gloo's host path, not an interconnect"
        headline.append([f"all-reduce bus bandwidth, {size_text(largest)}",
                         f"{num(best, 'busbw_gbps'):.2f} GB/s ({best['backend']}/"
                         f"{best['device']}, {best['world_size']} ranks{path})"])
    ratios = {i: [num(c[i], "busbw_gbps") / num(c["backend"], "busbw_gbps") for k, c in
                  cells.items() if k[3] >= 10 * MB and i in c and "backend" in c]
              for i in ("ring", "ring_pipelined")}
    if ratios["ring"] and ratios["ring_pipelined"]:
        words.append(f"Stage 01's rings at 10 MB and above: textbook "
                     f"{min(ratios['ring']):.2f}-{max(ratios['ring']):.2f}x the backend's busbw, "
                     f"pipelined {min(ratios['ring_pipelined']):.2f}-"
                     f"{max(ratios['ring_pipelined']):.2f}x.")
    fits = entries_of(where, "allreduce_fit.json", rows[0]["run_id"])
    if fits:
        text += "\nFitted `t = a + N / w` (stage 06 takes its o = a and w from these):\n\n" + md_table(
            ["backend/device", "ranks", "a (us)", "w (GB/s)", "worst point error"],
            [[f"{f['backend']}/{f['device']}", f["world_size"], f["a_s"] * 1e6,
              f["w_bytes_per_s"] / 1e9, f"{max(abs(p['rel_error']) for p in f['points']):.0%}"]
             for f in fits])
    return text + "\n" + " ".join(words) + "\n\n" + picture(
        where, "bench_allreduce_busbw.png", "all-reduce bus bandwidth against size"), headline, rows


def ratio_text(row: dict) -> str:
    """'0.94x', or '-' for a row written before torch DDP's (a step stopped early)."""
    return f"{num(row, 'ratio_vs_torch_ddp'):.2f}x" if row.get("ratio_vs_torch_ddp") else "-"


def ddp_section(where: Where):
    rows = rows_of(where, "ddp_step.csv")
    if not rows:
        return None
    r0 = rows[0]
    torch_ddp = next((r for r in rows if r["impl"] == "torch_ddp" and float(r["bucket_mb"]) == 25), None)
    best = min((r for r in rows if r["impl"] == "bucketed"), key=lambda r: num(r, "step_ms"), default=None)
    shown = [(IMPL_LABEL[i] + (f", best bucket {r['bucket_mb']} MB" if i == "bucketed" else ""), r)
             for i in ("none", "torch_ddp", "naive", "flat", "overlap", "bucketed")
             for r in [torch_ddp if i == "torch_ddp" else best if i == "bucketed" else
                       next((x for x in rows if x["impl"] == i), None)] if r is not None]
    peak = measured_peak(where, r0.get("run_id"), r0["device"])
    mfu_columns = ["tokens/s", "MFU"] if peak else []

    def mfu_cells(r):
        if not peak or not r.get("batch_size") or not r.get("context_length"):
            return ["-", "-"] if peak else []
        tokens_per_s, mfu = model_flops_utilisation(r, peak)
        return [f"{tokens_per_s:.0f}", f"{mfu:.1%}"]
    text = (host_path_note(rows, "the step times below are those of that path, so they say how "
                                 "the implementations compare on it, not what each costs on NCCL.")
            + f"LM `{r0['model']}` ({int(r0['params']) / 1e6:.1f}M parameters), global batch "
            f"{r0['batch_size']}, context {r0['context_length']}, AdamW, {r0['world_size']} ranks "
            f"on {r0['backend']}/{r0['device']}, all in one process group; slowest rank's "
            "medians." + (" Tokens/s: the global batch's tokens per step time; MFU: (6 N + 12 L "
                          "H Q T) FLOPs per token x tokens/s over the float32 matmul peak "
                          "measured in this run, times the devices doing the work." if peak
                          else "") + "\n\n" + md_table(
                ["implementation", "step ms", "fwd+bwd ms", "comm after backward ms",
                 "optimizer ms", "vs torch DDP", *mfu_columns],
                [[label, num(r, "step_ms"), num(r, "fwd_bwd_ms"), num(r, "comm_after_backward_ms"),
                  num(r, "optimizer_ms"), ratio_text(r), *mfu_cells(r)] for label, r in shown]))
    bars(where, "bench_ddp_step.png", [label for label, _ in shown],
         [(part, [num(r, key) for _, r in shown]) for part, key in (
             ("forward + backward (overlapped communication hides here)", "fwd_bwd_ms"),
             ("communication left after backward", "comm_after_backward_ms"),
             ("optimizer", "optimizer_ms"))], "ms per training step",
         f"LM {r0['model']}, {r0['world_size']} ranks {r0['backend']}/{r0['device']}\n"
         f"{machine_of(where, rows)}")
    headline = []
    if best and torch_ddp:
        ratio = num(best, "step_ms") / num(torch_ddp, "step_ms")
        comm = {label: num(r, "comm_after_backward_ms") for label, r in shown}
        text += (f"\nBucketedDDP at its best bucket size ({best['bucket_mb']} MB) takes {ratio:.2f}x "
                 f"torch DDP's step time. Communication left after backward: " + ", ".join(
                     f"{label} {ms:.1f} ms" for label, ms in comm.items() if "communication" not in label)
                 + ". Communication that runs during backward shows up in the fwd+bwd column.\n")
        headline.append(["BucketedDDP (best bucket) vs torch DDP, step time",
                         f"{ratio:.2f}x ({num(best, 'step_ms'):.1f} vs {num(torch_ddp, 'step_ms'):.1f}"
                         f" ms, LM {r0['model']})"])
    return text + "\n" + picture(where, "bench_ddp_step.png", "DDP step time"), headline, rows


def bucket_section(where: Where):
    steps = rows_of(where, "ddp_step.csv")  # the model is written by the run that wrote these
    entries = entries_of(where, "bucket_model.json", steps[0]["run_id"]) if steps else []
    if not entries:
        return None
    m = entries[0]
    lo, hi = m["neighbour_range_mb"]
    text = md_table(["bucket cap MB", "buckets", "BucketedDDP step ms",
                     "comm after backward ms, measured", "model ms"],
                    [[float(s["bucket_mb"]), s["buckets"], float(s["measured_step_ms"]),
                      float(s["measured_comm_after_bwd_ms"]), float(s["model_comm_after_bwd_ms"])]
                     for s in m["sweep"]])
    verdict = "within" if m["prediction_within_neighbours"] else "outside"
    text += (f"\nWith s = {m['gradient_bytes'] / MB:.1f} MiB of gradients, o = {m['o_s'] * 1e6:.0f} us "
             f"and w = {m['w_bytes_per_s'] / 1e9:.2f} GB/s ({m['fit_source']}), the model "
             f"n_b o + s/(n_b w) is smallest at {m['predicted_best_bucket_mb']:.3g} MiB buckets; the "
             f"measured best was {m['measured_best_bucket_mb']:g} MB, so the prediction lies "
             f"{verdict} the best and its neighbours [{lo:g}, {hi:g}] MB.\n")
    return text, [["bucket size: model's best vs measured best",
                   f"{m['predicted_best_bucket_mb']:.3g} MiB vs {m['measured_best_bucket_mb']:g} MB "
                   f"({verdict} [{lo:g}, {hi:g}])"]], entries


def overlap_section(where: Where):
    rows = one_run([r for r in results.read_csv("ddp_profile.csv", where.out)
                    if r.get("stage") == "05_overlap_ddp"], where.run_id)
    if not rows:
        return None
    text = md_table(["case", "step ms", "backward ms", "collectives", "comm during backward ms",
                     "comm after backward ms"],
                    [[r["case"], num(r, "step_ms"), num(r, "backward_ms"), r["collectives"],
                      num(r, "comm_during_backward_ms"), num(r, "comm_after_backward_ms")]
                     for r in rows])
    during = [(r["case"], num(r, "comm_during_backward_ms"), num(r, "comm_after_backward_ms"))
              for r in rows]
    shares = [f"{case} {d / max(1e-9, d + a):.0%}" for case, d, a in during]
    return (text + f"\nShare of the communication that ran while backward computed (rank 0, one "
                   f"profiled step): {', '.join(shares)}.\n\n"
            + picture(where, "bench_overlap_timeline.png", "timeline of naive vs overlapped DDP")), \
        [], rows


def tensor_parallel_section(where: Where):
    rows = rows_of(where, "tensor_parallel.csv")
    if not rows:
        return None
    sums: dict[tuple, dict] = {}
    for r in rows:
        d = sums.setdefault((int(r["world_size"]), r["variant"]), {"forward": 0, "backward": 0})
        d[r["phase"]] += int(r["bytes_counted"])
    r0 = rows[0]
    text = (f"MLP {r0['d_model']} -> {r0['d_ff']} -> {r0['d_model']} over {r0['tokens']} tokens, "
            f"float32: the collectives' payloads per forward and backward, counted (and equal to "
            f"the prediction, which the script checks).\n\n"
            + md_table(["ranks", "variant", "forward", "backward"],
                       [[ws, v, size_text(d["forward"]), size_text(d["backward"])]
                        for (ws, v), d in sorted(sums.items())]))
    total = {v: d["forward"] + d["backward"] for (_, v), d in sums.items()}
    if {"megatron", "allgather"} <= set(total):
        text += (f"\nAll-gathering after every layer moves {total['allgather'] / total['megatron']:.1f}x "
                 "Megatron's bytes: it also ships the d_ff-wide activation.\n")
        return text, [["tensor parallel MLP: bytes per forward+backward, Megatron vs all-gather",
                       f"{size_text(total['megatron'])} vs {size_text(total['allgather'])}"]], rows
    return text, [], rows


def pipeline_section(where: Where):
    rows = rows_of(where, "pipeline_bubble.csv")
    if not rows:
        return None
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["schedule"], int(r["micro_batches"]), int(r["chunks"]),
                           float(r["emulated_ms"])), []).append(r)
    order = ["gpipe", "1f1b", "interleaved", "zbh1", "zbv", "dualpipev"]
    table, gaps = [], []
    for (s, m, v, emu), rs in sorted(groups.items(),
                                     key=lambda kv: (kv[0][3], kv[0][1], order.index(kv[0][0]))):
        gap = max(abs(num(r, "idle_share") - num(r, "idle_share_simulated")) for r in rs)
        gaps += [gap] if emu else []
        table.append([s, v, m, f"emulated {emu:g} ms" if emu else "real",
                      statistics.fmean(num(r, "idle_share") for r in rs),
                      num(rs[0], "idle_share_simulated"), num(rs[0], "idle_share_formula"), gap,
                      " ".join(r["peak_held"] for r in sorted(rs, key=lambda r: int(r["rank"])))])
    r0 = rows[0]
    text = (host_path_note(rows, "with real compute the stages' sends cross it too; with "
                                 "emulated compute the idle shares are the schedules' own.")
            + f"{r0['world_size']} stages, batch {r0['batch']}, {r0['backend']}/{r0['device']}. Idle "
            "share = 1 - busy / pass per stage (mean over stages); with emulated compute every F, "
            "B and W is a fixed wait, so the measured idle checks the executor's sends, receives "
            "and order against the unit-time simulation without the ranks competing for cores.\n\n"
            + md_table(["schedule", "v", "m", "compute", "idle, measured", "simulated",
                        "formula", "max gap to simulated", "held per stage"], table))
    headline = []
    if gaps:
        text += (f"\nWith emulated compute every schedule's measured idle is within "
                 f"{max(gaps):.3f} of its simulation (target 0.05).\n")
        headline.append(["pipeline, emulated compute: largest |measured - simulated| idle",
                         f"{max(gaps):.3f} over {len(gaps)} schedule settings"])
    return text, headline, rows


def sharding_section(where: Where):
    rows = rows_of(where, "sharding.csv")
    if not rows:
        return None
    r0 = rows[0]
    order = ["none", "ddp", "zero1", "zero2", "fsdp", "torch_zero1", "torch_fsdp"]
    rows = sorted(rows, key=lambda r: (r["checkpointing"],
                                       order.index(r["impl"]) if r["impl"] in order else 9))

    def pair(r, key):  # counted (predicted); "-" where this box could not count it
        got, pred = r.get(key, ""), r.get(f"{key}_predicted", "")
        return ("-" if got in ("", None) else size_text(float(got))) + (
            f" ({size_text(float(pred))})" if pred not in ("", None) else "")
    text = (host_path_note(rows, "Gloo's reduce-scatter is an all-reduce underneath and each "
                                 "of its calls crosses host memory, so ZeRO-2's and FSDP's step "
                                 "times here are not a comparison of strategies; the bytes per "
                                 "rank (counted against formulas) are, on any interconnect.")
            + f"LM `{r0['model']}`, AdamW, {r0['world_size']} ranks on {r0['backend']}/{r0['device']}: "
            "bytes per rank counted from the tensors themselves (each storage once), predicted in "
            "brackets where a formula exists. `none` is the control: each rank trains its share "
            "and sends nothing (the compute the others' step times contain, measured beside them).\n\n"
            + md_table(["impl", "checkpointing", "step ms", "params", "grads", "optimizer state",
                        "peak", "activations", "sent per step"],
                       [[r["impl"], r["checkpointing"], num(r, "step_ms"), pair(r, "param_bytes"),
                         pair(r, "grad_bytes"), pair(r, "optim_bytes"), pair(r, "peak_bytes"),
                         pair(r, "activation_bytes"), pair(r, "sent_bytes")] for r in rows]))
    plain = [r for r in rows if r["checkpointing"] in ("off", "False", "0", "")] or rows
    bars(where, "bench_sharding_bytes.png", [r["impl"] for r in plain],
         [(part, [num(r, key) / MB for r in plain]) for part, key in (
             ("parameters", "param_bytes"), ("gradients", "grad_bytes"),
             ("optimizer state", "optim_bytes"))], "MiB per rank, held between steps",
         f"LM {r0['model']}, {r0['world_size']} ranks\n{machine_of(where, rows)}")
    return text + "\n" + picture(where, "bench_sharding_bytes.png", "bytes per rank by strategy"), \
        [], rows


def with_formula(counted, formula) -> str:
    """'2MB (2MB)': a count and, in brackets, its formula; '-' where nothing was counted."""
    text = "-" if counted in ("", None) else size_text(float(counted))
    if formula not in ("", None):
        text += f" ({size_text(float(formula))})"
    return text


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def sequence_parallel_section(where: Where):
    rows = rows_of(where, "sequence_parallel.csv")
    if not rows:
        return None
    r0 = rows[0]
    blocks: dict[tuple, dict] = {}  # (ranks, block): what it sent and what it saved
    for r in rows:
        cell = blocks.setdefault((int(r["world_size"]), r["block"]), {"ring": 0.0})
        if r["what"] == "bytes":
            cell[r["phase"]] = num(r, "bytes")
            cell["ring"] += num(r, "ring_bytes_sent_per_rank")
        else:  # "saved layernorms", "saved rest": counted, and the formula
            cell[r["what"]] = (num(r, "bytes"), num(r, "formula"))
    order = ["one process", "TP", "TP + SP", "torch TP + SP"]
    table = []
    exact = True
    for (ranks, block), cell in sorted(blocks.items(), key=lambda kv: (kv[0][0],
                                                                      order.index(kv[0][1]))):
        sent = ["-", "-", "-"]
        if "forward" in cell:
            sent = [size_text(cell["forward"]), size_text(cell["backward"]),
                    size_text(cell["ring"])]
        layernorms = cell["saved layernorms"]
        rest = cell["saved rest"]
        exact = exact and layernorms[0] == layernorms[1] and rest[0] == rest[1]
        table.append([ranks, block, *sent, with_formula(*layernorms), with_formula(*rest),
                      size_text(layernorms[0] + rest[0])])
    text = (f"A Transformer block of the course LM's shape (d_model {r0['d_model']}, d_ff "
            f"{r0['d_ff']}, {r0['heads']} heads, {r0['tokens']} tokens), float32, on "
            f"{r0['backend']}/{r0['device']}: the payloads of its collectives per forward and "
            "backward (what each call carries, counted and equal to the prediction, which the "
            "script checks), what a ring sends per rank for them, and the bytes autograd saves "
            "for backward per rank, counted with saved-tensor hooks (formula in brackets).\n\n"
            + md_table(["ranks", "block", "payload forward", "payload backward",
                        "ring sends per rank", "saved in LayerNorms", "saved elsewhere",
                        "saved in all"], table))
    words = []
    headline = []
    for ranks in sorted({ranks for ranks, _ in blocks}):
        plain = blocks.get((ranks, "TP"))
        sequence = blocks.get((ranks, "TP + SP"))
        if plain is None or sequence is None or "forward" not in plain:
            continue
        payload = (sequence["forward"] + sequence["backward"]) / (plain["forward"] + plain["backward"])
        layernorms = sequence["saved layernorms"][0] / plain["saved layernorms"][0]
        rest = sequence["saved rest"][0] / plain["saved rest"][0]
        same_ring = sequence["ring"] == plain["ring"]
        words.append(f"On {ranks} ranks, sequence parallelism's all-gathers and reduce-scatters "
                     f"carry {payload:.1f}x the payload of plain TP's all-reduces, and a ring "
                     f"sends {'the same' if same_ring else 'other'} bytes per rank for them "
                     f"({size_text(sequence['ring'])} vs {size_text(plain['ring'])}): an "
                     "all-reduce is a reduce-scatter then an all-gather. The LayerNorms keep "
                     f"{layernorms:.2f}x plain TP's activations per rank (target 1/t = "
                     f"{1 / ranks:.2f}: {verdict(abs(layernorms - 1 / ranks) < 1e-9)}); the "
                     f"rest is {rest:.2f}x.")
        headline.append([f"sequence parallel, {ranks} ranks: LayerNorm activations saved per "
                         "rank, TP + SP vs TP", f"{layernorms:.2f}x (1/t = {1 / ranks:.2f}); "
                         f"ring bytes per rank {'equal' if same_ring else 'NOT equal'}"])
    if exact:
        words.append("Every saved count equals its formula.")
    elif r0["device"] == "cuda":
        words.append("Not every saved count equals its formula (on a GPU the attention kernel "
                     "may save other tensors than the CPU's, which the formula describes).")
    else:
        words.append("Not every saved count equals its formula: see the bracketed columns.")
    return text + "\n" + " ".join(words) + "\n", headline, rows


def context_parallel_section(where: Where):
    rows = rows_of(where, "context_parallel.csv")
    if not rows:
        return None
    r0 = rows[0]
    real = [r for r in rows if r["compute"] == "real"]
    emulated = [r for r in rows if r["compute"] != "real"]

    def label(r):
        if r["impl"] == "ring":
            return f"W={r['W']} {r['layout']}"
        if r["impl"] == "ulysses":
            return f"W={r['W']} Ulysses"
        return r["impl"]
    columns = []
    order = {"ring": 1, "ulysses": 2}                    # one rank's kernels, rings, Ulysses
    for r in sorted(real, key=lambda r: (order.get(r["impl"], 0), int(r["W"]), r["layout"])):
        if label(r) not in columns:
            columns.append(label(r))
    times: dict[int, dict] = {}
    for r in real:
        times.setdefault(int(r["seq"]), {})[label(r)] = num(r, "step_ms")
    table = []
    for seq, cells in sorted(times.items()):
        table.append([seq, *[cells.get(column, "") for column in columns]])
    text = (f"One causal attention layer, forward + backward, float32, batch {r0['batch']}, "
            f"{r0['heads']} heads of {r0['head_dim']}, on {r0['backend']}/{r0['device']}: "
            "torch's fused kernel and ours on one rank (the whole sequence), and ring "
            "attention on rings of W ranks in both layouts. Step time in ms, real compute:\n\n"
            + md_table(["seq", *columns], table))
    longest = max(int(r["seq"]) for r in rows)
    at_longest = [r for r in real if int(r["seq"]) == longest and r["impl"] == "ring"]
    on_gpu = r0["device"] == "cuda"
    balance = []
    for r in sorted(at_longest, key=lambda r: (int(r["W"]), r["layout"])):
        line = [r["W"], r["layout"], with_formula(r["sent_bytes"], r["bytes_formula"]),
                f"{num(r, 'imbalance'):.3f} ({num(r, 'imbalance_formula'):.3f})",
                with_formula(r["saved_bytes"], r["saved_formula"])]
        if on_gpu:
            line.append(size_text(num(r, "peak_bytes")))
        balance.append(line)
    text += (f"\nAt sequence length {longest}, per rank: bytes sent (the formula: K and V W-1 "
             "hops forward and backward, dK and dV W hops), the work's imbalance, max / mean "
             "over ranks of the (query, key) scores computed (the formula: 2 - 1/W contiguous, "
             "1 zig-zag), and the bytes saved for backward:\n\n"
             + md_table(["W", "layout", "sent per rank", "FLOP imbalance", "saved per rank",
                         *(["peak GPU memory"] if on_gpu else [])], balance))
    emulation = sorted({r["compute"] for r in emulated})  # one wait, "emulated 400 ms"
    computes = ["real", *emulation]
    ratios = {}  # W: {compute: zig-zag / contiguous at the longest sequence}
    for world_size in sorted({int(r["W"]) for r in at_longest}):
        step = {}
        for r in [*at_longest, *emulated]:
            if r["impl"] != "ring":
                continue
            if int(r["W"]) == world_size and int(r["seq"]) == longest:
                step[(r["compute"], r["layout"])] = num(r, "step_ms")
        ratios[world_size] = {}
        for compute in computes:
            if (compute, "zigzag") in step and (compute, "contiguous") in step:
                ratios[world_size][compute] = step[(compute, "zigzag")] / step[(compute, "contiguous")]
    text += (f"\nZig-zag / contiguous step time at sequence length {longest} (emulated: every "
             "block of scores waits in proportion to its FLOPs, so the ranks do not compete "
             "for cores; ideal W/(2W-1)):\n\n"
             + md_table(["W", *[f"{c} compute" for c in computes], "ideal"],
                        [[world_size, *[by_compute.get(c, "") for c in computes],
                          world_size / (2 * world_size - 1)]
                         for world_size, by_compute in ratios.items()]))
    words = []
    headline = []
    exact = all(num(r, "sent_bytes") == num(r, "bytes_formula") for r in rows)
    words.append(f"Ring bytes sent per rank equal the formula in {'every' if exact else 'NOT every'} "
                 "row.")
    largest = max(ratios, default=None)  # the widest ring: W=4 in make bench
    imbalance = {}
    for r in at_longest:
        if int(r["W"]) == largest:
            imbalance[r["layout"]] = num(r, "imbalance")
    if {"zigzag", "contiguous"} <= set(imbalance):
        formula = 2 - 1 / largest
        off = abs(imbalance["contiguous"] / formula - 1)
        words.append(f"At W={largest} zig-zag balances the causal work (imbalance "
                     f"{imbalance['zigzag']:.3f}, target 1.00) and contiguous is "
                     f"{imbalance['contiguous']:.3f}, {100 * off:.1f}% from 2 - 1/W = "
                     f"{formula:.3f} (target within 2%: {verdict(off <= 0.02)}).")
        headline.append([f"context parallel, FLOP imbalance at W={largest}: zig-zag, contiguous",
                         f"{imbalance['zigzag']:.3f}, {imbalance['contiguous']:.3f} (targets "
                         f"1.00 and {formula:.3f})"])
    measured = ratios.get(largest, {})
    if emulation and emulation[0] in measured and "real" in measured:
        emulated_ratio = measured[emulation[0]]
        real_ratio = measured["real"]
        target = "the 0.75 target is set at W=4"
        short_target = target
        if largest == 4:
            target = f"target <= 0.75 at W=4: {verdict(emulated_ratio <= 0.75)}"
            short_target = "target <= 0.75"
        words.append(f"With {emulation[0]} compute, zig-zag's step takes {emulated_ratio:.2f}x "
                     f"contiguous's at W={largest} ({target}; ideal "
                     f"{largest / (2 * largest - 1):.2f}); with real compute {real_ratio:.2f}x"
                     + (", which on a CPU box measures the ranks sharing its cores more than the "
                        "balance (the lesson's README says what it can show)."
                        if r0["device"] == "cpu" else "."))
        headline.append([f"context parallel, zig-zag / contiguous causal step, W={largest}",
                         f"{emulated_ratio:.2f}x emulated compute ({short_target}), "
                         f"{real_ratio:.2f}x real"])
    text += ulysses_beside_ring(rows)
    return text + "\n" + " ".join(words) + "\n", headline, rows


def ulysses_beside_ring(rows: list[dict]) -> str:
    """Ulysses' rows beside the zig-zag ring's at the same sequence length, W and compute:
    bytes each rank sends (counted, formula) and step times."""
    table = []
    for r in rows:
        if r["impl"] != "ulysses":
            continue
        for ring in rows:
            same = all(ring[key] == r[key] for key in ("seq", "W", "compute"))
            if ring["impl"] == "ring" and ring["layout"] == "zigzag" and same:
                table.append([r["seq"], r["W"], r["compute"],
                              with_formula(ring["sent_bytes"], ring["bytes_formula"]),
                              with_formula(r["sent_bytes"], r["bytes_formula"]),
                              num(ring, "step_ms"), num(r, "step_ms"),
                              f"{num(r, 'step_ms') / num(ring, 'step_ms'):.2f}x"])
    if not table:
        return ""
    return ("\nUlysses (all-to-alls around plain attention over the heads) beside the zig-zag "
            "ring: bytes each rank sends per layer, counted (formula: ring 2(W-1)B forward + "
            "2(W-1)B + 2WB backward; Ulysses 4(W-1)/W B each way, B one shard of q), and step "
            "time:\n\n" + md_table(["seq", "W", "compute", "ring bytes", "Ulysses bytes",
                                    "ring ms", "Ulysses ms", "Ulysses / ring"], table))


def expert_parallel_section(where: Where):
    rows = rows_of(where, "expert_parallel.csv")
    if not rows:
        return None
    steps = [r for r in rows if r["measure"] == "step"]
    loads = [r for r in rows if r["measure"] == "load"]
    r0 = rows[0]
    text = (host_path_note(rows, "the expert-parallel times include its all-to-alls over "
                                 "that path; the bytes, memory and load are the device's own.")
            + f"A mixture-of-experts layer, d_model {r0['d_model']}, d_ff {r0['d_ff']}, "
            f"{r0['num_experts']} experts, top-{r0['top_k']}, on {r0['backend']}/{r0['device']}: "
            "the replicated layer on every rank (no communication) against expert parallel "
            "(each rank holds E/W experts; tokens go to them and back all-to-all). Step = "
            "forward + backward, random routing, dropless; bytes: what rank 0 sends per step "
            "in its 5 all-to-alls, counted (formula for the routing measured); dispatch: the "
            "first forward exchange (uniform formula: top_k x tokens x d_model x (W-1)/W x 4 B).\n\n")
    steps = sorted(steps, key=lambda r: (int(r["world_size"]), int(r["tokens_per_rank"])))
    table = []
    for r in steps:
        table.append([r["world_size"], r["tokens_per_rank"], num(r, "replicated_ms"),
                      num(r, "expert_parallel_ms"), f"{num(r, 'ep_over_replicated'):.2f}x",
                      with_formula(r["bytes_sent_counted"], r["bytes_sent_formula"]),
                      with_formula(r["dispatch_bytes"], r["uniform_bytes_per_exchange"])])
    text += md_table(["ranks", "tokens per rank", "replicated ms", "expert parallel ms",
                      "EP / replicated", "sent per step", "dispatch (uniform)"], table)
    memory = {}
    for r in steps:
        memory[int(r["world_size"])] = r
    text += "\nExpert parameters per rank (float32; the router is replicated):\n\n" + md_table(
        ["ranks", "experts, whole layer", "per rank", "share", "1/W", "router"],
        [[ranks, size_text(num(r, "expert_bytes_replicated")),
          size_text(num(r, "expert_bytes_per_rank")), num(r, "share"), 1 / ranks,
          size_text(num(r, "router_bytes"))] for ranks, r in sorted(memory.items())])
    words = []
    exact = 0
    for r in steps:
        if num(r, "bytes_sent_counted") == num(r, "bytes_sent_formula"):
            exact += 1
    words.append(f"Counted all-to-all bytes equal the formula in {exact} of {len(steps)} rows.")
    shares = []
    for ranks, r in sorted(memory.items()):
        exactly = num(r, "expert_bytes_per_rank") * ranks == num(r, "expert_bytes_replicated")
        shares.append(f"{num(r, 'share'):.4g} at W={ranks} ({'exactly' if exactly else 'NOT'} 1/W)")
    words.append("Expert bytes per rank: " + ", ".join(shares) + ".")
    if loads:
        biggest = max(int(r["world_size"]) for r in loads)
        shown = [r for r in loads if int(r["world_size"]) == biggest]
        text += (f"\nLoad on {biggest} ranks, {shown[0]['tokens_per_rank']} tokens per rank: "
                 "tokens per expert (all ranks, kept), max / mean, and the share of "
                 "assignments dropped, per capacity factor (skewed: the inputs shifted so the "
                 "router favours a few experts):\n\n" + md_table(
                     ["routing", "capacity factor", "max / mean", "dropped", "tokens per expert"],
                     [[r["routing"], r["capacity_factor"], num(r, "max_over_mean"),
                       f"{100 * num(r, 'dropped_share'):.1f}%", r["tokens_per_expert"]]
                      for r in shown]))
        by_case = {(r["routing"], r["capacity_factor"]): r for r in shown}
        tight = by_case.get(("skewed", "1.0"))
        dropless = by_case.get(("skewed", "dropless"))
        if tight is not None and dropless is not None:
            kept = "keeps them all"
            if num(dropless, "dropped_share") != 0:
                kept = f"drops {100 * num(dropless, 'dropped_share'):.1f}% (it should drop none)"
            words.append(f"Skewed routing at capacity factor 1.0 drops "
                         f"{100 * num(tight, 'dropped_share'):.1f}% of the assignments; "
                         f"dropless {kept}, at {num(dropless, 'max_over_mean'):.2f}x the "
                         "mean load on the busiest expert.")
        text += "\n" + picture(where, "bench_expert_parallel_load.png", "tokens per expert")
    headline = [["expert parallel: all-to-all bytes counted = formula; expert bytes per rank",
                 f"{exact} of {len(steps)} rows; " + ", ".join(shares)]]
    return text + "\n" + " ".join(words) + "\n", headline, rows


def together_section(where: Where):
    rows = rows_of(where, "grid.csv")
    if not rows:
        return None
    pipelines = [r for r in rows if r.get("schedule")]
    beside = [r for r in rows if not r.get("schedule") and (
        r["impl"] == "torch" or r.get("pair") or "timed beside" in r["setting"])]
    grids = [r for r in rows if not r.get("schedule") and r not in beside]
    words = []
    headline = []
    text = ""
    if grids:
        r0 = grids[0]
        unit = "KiB"
        scale = 2 ** 10
        if max(num(r, "param_bytes") for r in grids) > 64 * MB:
            unit = "MiB"
            scale = MB

        def amount(r, kind):
            counted = f"{num(r, kind + '_bytes') / scale:.1f}"
            if r.get(kind + "_bytes_formula", "") != "":
                counted += f" ({num(r, kind + '_bytes_formula') / scale:.1f})"
            return counted
        text += (f"The {r0['model']} LM, global batch {r0['batch_size']} x {r0['seq_len']} tokens, "
                 f"AdamW, on {r0['world_size']} ranks ({r0['backend']}/{r0['device']}), one "
                 f"training step per grid; per rank (the largest rank), in {unit}, counted "
                 "(the formula combining the lessons' formulas):\n\n" + md_table(
                     ["grid", "setting", "step ms", "tokens/s", "params", "grads",
                      "AdamW state", "saved, 1 micro-batch", "worst difference"],
                     [[r["grid"], r["setting"], num(r, "step_ms"), num(r, "tokens_per_s"),
                       amount(r, "param"), amount(r, "grad"), amount(r, "optim"),
                       amount(r, "activation"), f"{100 * num(r, 'worst_difference'):.2f}%"]
                      for r in grids]))
        text += (f"\nBytes sent per step per rank by axis, {unit} (ring shares), counted "
                 "(formula):\n\n" + md_table(
                     ["grid", "setting", "tp", "cp", "pp", "dp x cp", "world"],
                     [[r["grid"], r["setting"], amount(r, "sent_tp"), amount(r, "sent_cp"),
                       amount(r, "sent_pp"), amount(r, "sent_dp_cp"), amount(r, "sent_world")]
                      for r in grids]))
        worst = max(grids, key=lambda r: num(r, "worst_difference"))
        share = num(worst, "worst_difference")
        where_worst = f"{worst['grid']}, {worst['setting']}, {worst['worst_where']}; "
        if share == 0:
            where_worst = "every count equals its formula exactly; "
        words.append(f"Counted bytes per rank against the combined formula, every grid, rank and "
                     f"column: worst {100 * share:.2f}% ({where_worst}target within 5%: "
                     f"{verdict(share <= 0.05)}).")
        headline.append(["everything together: counted bytes per rank vs the combined formula",
                         f"worst {100 * share:.2f}% over {len(grids)} grids (target 5%)"])
    by_pair: dict[str, dict] = {}
    for r in beside:
        if r.get("pair"):
            by_pair.setdefault(r["pair"], {})[r["impl"]] = r
    pair_rows = []
    for pair, sides in by_pair.items():
        if "ours" in sides and "torch" in sides:
            pair_rows.append((pair, sides["ours"], sides["torch"]))
    if pair_rows:
        text += ("\nTorch's own composition beside ours on the same LM, batch and grid, in "
                 "pairs that each do one job on the data axis (the `pair` column), each pair "
                 "timed in alternating rounds: `replicated_tp`, ours with whole replicas over "
                 "dp beside torch's `parallelize_module` + `fully_shard` on a (dp, 1) mesh "
                 "(shards of one rank: replicas); `fsdp_tp`, ours with ZeRO-1 over dp beside "
                 "torch's `parallelize_module` + `fully_shard` over dp (torch also shards the "
                 "parameters and gradients: the nearest control, not the same memory); `hsdp`, "
                 "lesson 2's FSDP over dp_shard with the blocks summed over dp_replicate beside "
                 "torch's `fully_shard` on a 2-D (replicate, shard) mesh:\n\n"
                 + md_table(["pair", "impl", "setting", "step ms", "params", "grads",
                             "AdamW state", "saved", "first loss"],
                            [[pair, r["impl"], r["setting"], num(r, "step_ms"),
                              with_formula(r["param_bytes"], r.get("param_bytes_formula")),
                              with_formula(r["grad_bytes"], r.get("grad_bytes_formula")),
                              with_formula(r["optim_bytes"], r.get("optim_bytes_formula")),
                              size_text(num(r, "activation_bytes")), f"{num(r, 'first_loss'):.6f}"]
                             for pair, ours, theirs in pair_rows for r in (ours, theirs)]))
        for pair, ours, theirs in pair_rows:
            ratio = num(ours, "step_ms") / num(theirs, "step_ms")
            words.append(f"{pair}: our {ours['grid']} step takes {ratio:.2f}x torch's "
                         f"({num(ours, 'step_ms'):.1f} vs {num(theirs, 'step_ms'):.1f} ms; target "
                         f"<= 1.25x: {verdict(ratio <= 1.25)}).")
            headline.append([f"{pair}: our {ours['grid']} step vs torch's composition",
                             f"{ratio:.2f}x (target <= 1.25x)"])
    losses = [num(r, "first_loss") for r in grids + beside if r.get("first_loss", "") != ""]
    if len(losses) > 1:
        words.append(f"First-step losses of every grid and of torch's composition differ by at "
                     f"most {max(losses) - min(losses):.1e}.")
    pairs: dict[tuple, dict] = {}
    for r in pipelines:
        pairs.setdefault((int(r["stages"]), r["schedule"], r["setting"].split(", ", 1)[-1]),
                         {})[r["impl"]] = r
    table = []
    emulated_pp4 = []
    for (stages, schedule, compute), pair in pairs.items():
        if "ours" not in pair or "torch" not in pair:
            continue
        ratio = num(pair["ours"], "step_ms") / num(pair["torch"], "step_ms")
        ideal = num(pair["ours"], "ideal_ms") if pair["ours"].get("ideal_ms") else 0.0
        table.append([pair["ours"]["grid"], schedule, compute, num(pair["ours"], "step_ms"),
                      num(pair["torch"], "step_ms"), f"{ratio:.2f}x", ideal or "-"])
        if stages == 4 and compute.startswith("emulated"):
            emulated_pp4.append((ratio, schedule, compute))
    if table:
        r0 = pipelines[0]
        text += (f"\nThe pipeline axis alone, our executor (lesson 4) beside "
                 f"`torch.distributed.pipelining` (PipelineStage and its schedules): "
                 f"{r0['model']}, {r0['micro_batches']} micro-batches, forward + backward; "
                 "ideal: the unit-time simulation x the emulated wait:\n\n" + md_table(
                     ["stages", "schedule", "compute", "ours ms", "torch ms", "ours / torch",
                      "ideal ms"], table))
    if emulated_pp4:
        worst = max(emulated_pp4)
        words.append("Our pipeline executor against torch.distributed.pipelining, pp 4, "
                     f"{worst[2]} compute: " + ", ".join(
                         f"{schedule} {ratio:.2f}x" for ratio, schedule, _ in emulated_pp4)
                     + f" (target <= 1.10x: {verdict(worst[0] <= 1.10)}).")
        headline.append(["our pipeline executor vs torch.distributed.pipelining, pp 4, emulated",
                         f"{worst[0]:.2f}x at worst ({worst[1]}; target <= 1.10x)"])
    return text + "\n" + " ".join(words) + "\n", headline, rows


def checkpoint_section(where: Where):
    rows = rows_of(where, "checkpoint.csv")
    if not rows:
        return None
    r0 = rows[0]
    cases: dict[tuple, dict] = {}
    for r in rows:
        cases.setdefault((int(r["saved_at"]), int(r["loaded_at"]), r["op"]), {})[r["impl"]] = r
    table = []
    ratios = []
    for (saved_at, loaded_at, op), pair in cases.items():
        ours = pair.get("ours")
        theirs = pair.get("torch_dcp")
        if ours is None or theirs is None:
            continue
        ratio = num(ours, "time_ms_median") / num(theirs, "time_ms_median")
        ratios.append((ratio, op, saved_at, loaded_at))
        table.append([f"{saved_at} -> {loaded_at}", op, ours["ranks"],
                      num(ours, "time_ms_median"), num(theirs, "time_ms_median"),
                      f"{ratio:.2f}x", size_text(num(ours, "data_bytes_max")),
                      size_text(num(ours, "data_bytes_total")),
                      size_text(num(ours, "manifest_bytes")),
                      size_text(num(ours, "kernel_bytes_max")),
                      size_text(num(theirs, "kernel_bytes_max"))])
    text = (f"The {r0['model']} LM and its AdamW state in FSDP's row blocks, saved at one "
            f"number of ranks and loaded at another, by this lesson and by "
            f"`torch.distributed.checkpoint` on the same state, alternately, on "
            f"{r0['backend']}/{r0['device']}: time (the slowest rank's median), the data bytes "
            "this lesson wrote or read (the largest rank, and all ranks together), its "
            "manifest, and what the kernel counted each process writing or reading "
            "(/proc/self/io, the largest rank) for both.\n\n" + md_table(
                ["saved at -> loaded at", "op", "ranks doing it", "ours ms", "torch ms", "ours / torch",
                 "data per rank", "data, all ranks", "manifest", "kernel bytes per rank, ours",
                 "torch's"], table))
    words = []
    headline = []
    if ratios:
        worst = max(ratios)
        met = 0
        for ratio, *_ in ratios:
            if ratio <= 1.5:
                met += 1
        words.append(f"Ours takes {min(ratios)[0]:.2f}x to {worst[0]:.2f}x torch's time "
                     f"(target <= 1.5x: met in {met} of {len(ratios)}).")
        headline.append(["checkpoints: save and load time vs torch.distributed.checkpoint",
                         f"{worst[0]:.2f}x at worst ({worst[1]} {worst[2]} -> {worst[3]} ranks; "
                         f"target <= 1.5x; LM {r0['model']})"])
    written = set()
    for r in rows:
        if r["impl"] == "ours" and r["op"] == "save" and r["data_bytes_total"] != "":
            written.add(int(float(r["data_bytes_total"])))
    if len(written) == 1:
        words.append(f"Saved at either number of ranks, all ranks together wrote the same "
                     f"{size_text(written.pop())} of data (the script's own output compares it "
                     "with the state's size, and checks each load's bytes against the overlap "
                     "with what the rank holds).")
    return text + "\n" + " ".join(words) + "\n", headline, rows


def compute_section(where: Where):
    """bench/compute.py: the device alone at one rank's shapes, beside the peaks it measured."""
    rows = rows_of(where, "compute.csv")
    if not rows:
        return None
    r0 = rows[0]
    peak = measured_peak(where, r0.get("run_id"), r0["device"])
    on_gpu = r0["device"] == "cuda"
    text = (f"One process on the {'GPU' if on_gpu else 'CPU'} ({machine_of(where, rows)}), "
            "float32, at one rank's shapes of stages 03-06 (the per-rank batch), nothing "
            "communicated: forward, backward and the AdamW step timed apart (medians), "
            + ("`torch.cuda.max_memory_allocated` over the steps, " if on_gpu else "")
            + "tokens/s, achieved TFLOP/s and MFU = (6 N + 12 L H Q T) FLOPs per token x "
            "tokens/s / the matmul peak measured in this run (N: parameters outside the "
            "embedding tables; the convention of PaLM, torchtitan and picotron). Beside each "
            "figure, its limit measured in the same run: the peak for TFLOP/s, the copy "
            "bandwidth for the optimizer step, which streams its state and does little "
            "arithmetic.\n\n")
    if peak:
        text += (f"Peak, measured: a {peak['matmul_n']}^3 float32 matmul at "
                 f"{peak['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s; a large copy at "
                 f"{peak['copy_bytes_per_s'] / 1e9:.1f} GB/s (bytes read + written).\n\n")
    table = []
    for r in rows:
        memory = "-"
        if r.get("max_memory_allocated_bytes") not in ("", None):
            memory = size_text(num(r, "max_memory_allocated_bytes"))
            if r.get("memory_total_bytes") not in ("", None):
                memory += f" of {size_text(num(r, 'memory_total_bytes'))}"
        table.append([r["model"], f"{num(r, 'params') / 1e6:.1f}M",
                      f"{r['batch_size']} x {r['context_length']}", num(r, "fwd_ms"),
                      num(r, "bwd_ms"), num(r, "optimizer_ms"), f"{num(r, 'tokens_per_s'):.0f}",
                      f"{num(r, 'achieved_tflops'):.3g} of {num(r, 'peak_tflops'):.3g}",
                      f"{num(r, 'mfu'):.1%}",
                      f"{num(r, 'optimizer_gbps'):.3g} of {num(r, 'copy_gbps'):.3g}", memory])
    text += md_table(["LM", "params", "batch x context", "forward ms", "backward ms", "AdamW ms",
                      "tokens/s", "TFLOP/s (of peak)", "MFU", "AdamW GB/s (of copy)",
                      "max memory allocated"], table)
    best = max(rows, key=lambda r: num(r, "mfu"))
    headline = [["compute at one rank's shapes: MFU against the float32 matmul peak measured "
                 "in this run", f"{num(best, 'mfu'):.1%} (LM {best['model']}, "
                 f"{num(best, 'achieved_tflops'):.3g} of {num(best, 'peak_tflops'):.3g} TFLOP/s, "
                 f"{r0['device']})"]]
    return text, headline, rows


def projection_text(where: Where) -> str:
    """Lesson 9's projection: the cluster presets PREDICTED with the compute this run measured
    (check_prediction.py --project, on by default on a GPU box); "" without rows."""
    rows = rows_of(where, "projection.csv")
    if not rows:
        return ""
    table = []
    for r in rows:
        table.append([r["cluster"], r["grid"], num(r, "predicted_ms"),
                      f"{num(r, 'tokens_per_s_per_gpu'):,.0f}", f"{num(r, 'memory_gib'):.1f}",
                      f"{num(r, 'share_of_measured_rate'):.0%}"])
    return (f"\n**Predicted, not measured**: the planner on each cluster preset, its links the "
            f"preset's spec sheet, its compute measured here ({rows[0]['compute_from']}); LM "
            f"`{rows[0]['model']}`, {rows[0]['seq_len']} tokens a sequence, "
            f"{int(num(rows[0], 'batch_size')) // int(num(rows[0], 'ranks'))} sequences a GPU; "
            "the fastest grids that fit:\n\n"
            + md_table(["preset", "grid", "predicted step ms", "predicted tokens/s a GPU",
                        "predicted GiB a GPU", "of the measured rate"], table) + "\n")


def prediction_section(where: Where):
    """Lesson 9: the planner's step time beside the step measured, per configuration."""
    rows = rows_of(where, "prediction.csv")
    projected = projection_text(where)
    if not rows and projected:       # a GPU box's projection without a fit to check against
        return projected, [], []
    if not rows:
        return None
    table = []
    within = 0
    for r in rows:
        ratio = num(r, "ratio")
        if abs(ratio - 1) <= 0.25:
            within += 1
        table.append([r["config"], num(r, "predicted_ms"), num(r, "measured_ms"), f"{ratio:.2f}x"])
    worst = max(rows, key=lambda r: abs(num(r, "ratio") - 1))
    text = (f"Lesson 9's planner fed with this box's measured compute (for stages 03-06 and "
            "torch DDP, and for the ledger, the compute-only control of their own launch; for the "
            "grids, each configuration's forward, backward and AdamW timed at world size 1 with "
            "one rank's shapes, a pipeline's a micro-batch at a time), stage "
            "02's all-reduce fit with its latency from calls timed back to back, and for ring "
            "attention's hops a hop timed after a slice of compute, predicting the step times "
            "measured above "
            f"({machine_of(where, rows)}; `results/prediction.csv` holds every term):\n\n"
            + md_table(["configuration", "predicted ms", "measured ms", "predicted / measured"],
                       table))
    words = (f"Within 25%: {within} of {len(rows)}. The worst: {worst['config']}, predicted "
             f"{num(worst, 'ratio'):.2f}x the measured (the planner's README says what it "
             "cannot see on a box like this).")
    headline = [["planning: predicted step time within 25% of measured",
                 f"{within} of {len(rows)} configurations (worst {num(worst, 'ratio'):.2f}x)"]]
    return text + "\n" + words + "\n" + projected, headline, rows


SECTIONS = [("Compute on one device: the measured peak, forward, backward, optimizer, memory, "
             "MFU", compute_section),
            ("All-reduce: time and bus bandwidth (stage 02)", allreduce_section),
            ("Data-parallel training step (stages 03-06, torch DDP beside them)", ddp_section),
            ("Bucket size: the sweep and the model (stage 06)", bucket_section),
            ("Overlap, seen in a profile (stage 05 `--profile`)", overlap_section),
            ("Tensor parallelism: bytes per MLP (stage 07)", tensor_parallel_section),
            ("Sequence parallelism: bytes and saved activations per block (stage 07)",
             sequence_parallel_section),
            ("Pipeline schedules: the bubble (stage 07)", pipeline_section),
            ("Sharding: memory and communication per rank (stage 07)", sharding_section),
            ("Context parallelism: ring attention, contiguous and zig-zag (stage 07)",
             context_parallel_section),
            ("Expert parallelism: all-to-all bytes, expert memory, load (stage 07)",
             expert_parallel_section),
            ("Everything together: grids, torch's composition and pipelining (stage 07)",
             together_section),
            ("Checkpoints: save and load beside torch.distributed.checkpoint (stage 07)",
             checkpoint_section),
            ("Predict, then measure: the planner beside this box's steps (stage 07)",
             prediction_section)]

# The make bench steps whose rows each section reads (bench/make_bench.py's keys): a section
# none of whose steps was planned says so instead of "no rows".
FED_BY = {allreduce_section: ["allreduce"], ddp_section: ["ddp"], bucket_section: ["ddp"],
          overlap_section: ["profile"], tensor_parallel_section: ["tp"],
          sequence_parallel_section: ["tp"], pipeline_section: ["pp"],
          sharding_section: ["ledger"], context_parallel_section: ["cp"],
          expert_parallel_section: ["ep2", "ep4"], together_section: ["grid"],
          checkpoint_section: ["checkpoint"], compute_section: ["compute"],
          prediction_section: ["prediction"]}


CARRIED = ("_Carried over from run `{run}` on {machine}: this run did not fill this "
           "section._\n\n")
EMPTY_TEXTS = (NO_ROWS, NO_FILE_ROWS, NOT_PLANNED, "_This section failed")


def previous_sections(out: Path) -> dict[str, str]:
    """The filled sections of the report now in ``out``, by title, each opening with a line that
    names the run and machine it came from (one carried before keeps the line it has)."""
    path = out / "README.md"
    if not path.is_file():
        return {}
    text = path.read_text(errors="replace")
    found = re.search(r"Machine: \*\*(.+?)\*\*\. Run `([^`]+)`", text)
    run, machine = (found.group(2), found.group(1)) if found else ("unknown", "an unknown machine")
    titles = [title for title, _ in SECTIONS]
    sections = {}
    for chunk in text.split("\n## ")[1:]:
        title, _, body = chunk.partition("\n\n")
        body = body.split("\n---\nWritten by `bench/report.py`")[0].rstrip("\n") + "\n"
        if title not in titles or body.startswith(EMPTY_TEXTS):
            continue
        if not body.startswith(("_Carried over from run", "_Run `")):  # the latter: its own run
            body = CARRIED.format(run=run, machine=machine) + body
        sections[title] = body
    return sections


def no_rows_text(info: dict | None, section) -> str:
    """What a section without rows says: no run record, not planned, or planned and no rows."""
    if info is None:
        return NO_FILE_ROWS
    planned = []
    for step in info["steps"]:
        planned.append(step.get("key"))
    for key in FED_BY.get(section, []):
        if key in planned:
            return NO_ROWS
    if section in FED_BY:
        return NOT_PLANNED
    return NO_ROWS


def load_run(out: Path) -> dict | None:
    """The run record ``make bench`` wrote, or None (with a warning where it is unusable)."""
    info = results.read_json(RUN_FILE, out)  # {} when missing, corrupt or not an object
    missing = [k for k in RUN_KEYS if k not in info]
    if info and missing:
        print(f"warning: ignoring {out / RUN_FILE}: no {', '.join(missing)}", file=sys.stderr)
    return None if missing else info


def header(info: dict | None) -> list[str]:
    """The report's top: the machine and the run, or, without a run record, a word on that."""
    if info is None:
        return ["# Benchmark report (`make bench`)\n",
                f"No run record (`results/{RUN_FILE}` is missing or unreadable, as on a fresh "
                "clone): each section shows the last run that wrote its results file, named "
                "under its title with the machine its rows name.\n",
                "Times are the slowest rank's median after warm-up; bandwidths in GB/s = 10^9 "
                "bytes/s; sizes in binary units (1 MB = 2^20 bytes).\n"]
    setup = info["setup"]
    gpu = f"{setup['gpus']} x {setup['gpu_name']}" if setup["gpus"] else "none"
    return [
        "# Benchmark report (`make bench`)\n",
        f"Machine: **{info['machine']}**. Run `{info['run_id']}`, started {info['started_utc']}, "
        f"{info['total_s']:.0f} s in all ({'quick' if info['quick'] else 'full'}); GPU: {gpu}; "
        f"LM for stages 03-06: `{info['model']}` (the ledger's: its step's title).\n\n"
        f"{setup['picked']}\n",
        "> A CPU-only run: every figure measures this machine's cores through Gloo's loopback, "
        "not a GPU interconnect.\n" if not setup["gpus"] else "",
        "> A one-GPU run, read as such: the steps ran their kernels on the GPU, except those "
        "whose command in Runs says `--device cpu` (lessons whose collectives Gloo cannot carry "
        "for CUDA tensors ran on the host's cores); compute, memory and MFU (the first section, "
        "against the matmul peak measured in this run) describe the GPU; every communication "
        "timing describes Gloo's path through host memory (labelled where it appears), not an "
        "interconnect, and no section compares strategies by it. Step times on NCCL between "
        "GPUs are not measured on this box.\n"
        if setup["gpus"] == 1 else "",
        "> A GPU per rank over NCCL: communication timings describe this box's interconnect; "
        "MFU is against the matmul peak measured in this run on one GPU.\n"
        if setup["gpus"] > 1 else "",
        allocator_line(info),
        "Times are the slowest rank's median after warm-up; bandwidths in GB/s = 10^9 bytes/s; "
        "sizes in binary units (1 MB = 2^20 bytes).\n"]


def allocator_line(info: dict) -> str:
    """How the steps' processes kept freed host memory (make bench's ``KEEP_FREED_MEMORY``),
    where the run recorded it."""
    allocator = info.get("allocator")
    if not allocator:
        return ""
    settings = ", ".join(f"`{name}={value}`" for name, value in allocator.items())
    if not info.get("keeps_freed_memory"):
        return f"Host memory: glibc as the user set it ({settings}).\n"
    return ("Host memory: every step's processes kept the blocks they freed (" + settings + "), "
            "as CUDA's caching allocator does, so no step time includes the kernel zeroing "
            "fresh pages.\n")


def write_report(out: Path, info: dict | None = None,
                 pictures: list[tuple[Path, str]] = ()) -> tuple[Path | None, list[str]]:
    """Rewrite ``out/README.md`` from the rows of the run ``info`` names: ``make bench`` passes
    its run record (written beside the report) and the stage pictures to copy in as
    ``(source, name)``; alone, the record is read from ``out`` and the run's pictures there are
    kept. Returns the report's path, or None when no section had data (the old report is left
    as it was), and the titles of the sections without data."""
    from_make_bench = info is not None
    if not from_make_bench:
        info = load_run(out)
        pictures = [(out / name, name) for name in STAGE_PICTURES if info is not None]
    earlier = previous_sections(out)
    draw = Path(tempfile.mkdtemp(dir=out, prefix=".report-"))  # beside: os.replace is atomic
    try:
        for source, name in pictures:
            if source.exists():
                shutil.copyfile(source, draw / name)
        where = Where(out, draw, info["run_id"] if info else None, info["machine"] if info else "")
        body, headline, empty, carried = [], [], [], []
        for title, section in SECTIONS:
            try:
                found = section(where)
            except Exception as e:  # noqa: BLE001 - one odd file must not cost the whole report
                found = (f"_This section failed: {type(e).__name__}: {e}_\n", [], None)
            if found is None:
                empty.append(title)
                found = (no_rows_text(info, section), [], None)
                if title in earlier:  # the better run's section stays, marked as such
                    carried.append(title)
                    found = (earlier[title], [], None)
            text, head, rows = found
            if info is None and rows:  # no run record: name the run and machine shown
                text = f"_Run `{rows[0].get('run_id')}`, {machine_of(where, rows)}._\n\n{text}"
            body.append(f"## {title}\n\n{text}")
            headline += head
        if len(empty) == len(SECTIONS):
            return None, empty  # nothing measured: the old report is better than an empty one
        runs = [] if info is None else [
            "## Runs\n\n" + md_table(["step", "outcome", "seconds", "command"],
                                     [[s["title"], s["status"], f"{s['seconds']:.0f}",
                                       "`python " + " ".join(s["argv"]) + "`"]
                                      for s in info["steps"]])]
        kept = []
        if carried:
            kept = [f"Sections this run did not fill, kept from the report before it (each "
                    f"names its run and machine): {'; '.join(carried)}.\n"]
        parts = [
            *header(info),
            *kept,
            "## Headline\n\n" + (md_table(["what", "measured"], headline) if headline else
                                  "_Nothing to headline: see the sections below._\n"),
            *runs,
            *body,
            "---\nWritten by `bench/report.py` from the rows in `results/*.csv` and "
            "`results/*.json`. Regenerate: `make bench`, or `python bench/report.py` alone.\n"]
        (draw / "README.md").write_text("\n".join(p for p in parts if p))
        if from_make_bench:
            (draw / RUN_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        return swap_in(draw, out), empty
    finally:
        shutil.rmtree(draw, ignore_errors=True)


def swap_in(draw: Path, out: Path) -> Path:
    """Move the new report's files over the old ones: pictures and run record first, the
    README last; then remove the old pictures the new README does not show (a carried-over
    section's pictures it still shows)."""
    new = sorted(p.name for p in draw.iterdir())
    readme = (draw / "README.md").read_text()
    for name in new:
        if name != "README.md":
            os.replace(draw / name, out / name)
    os.replace(draw / "README.md", out / "README.md")
    for old in out.glob("bench_*.png"):
        if old.name not in new and f"]({old.name})" not in readme:
            old.unlink(missing_ok=True)
    return out / "README.md"


def main() -> None:
    path, empty = write_report(results.results_dir())
    if path is None:
        print(f"nothing to report: no rows in {results.results_dir()} for any section; "
              f"{results.results_dir() / 'README.md'} is left as it was", file=sys.stderr)
        raise SystemExit(1)
    print(f"report: {path}" + (f" (no data for: {'; '.join(empty)})" if empty else ""))


if __name__ == "__main__":
    main()
