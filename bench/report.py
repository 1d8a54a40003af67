"""Write ``results/README.md`` from the rows of the run ``results/bench_run.json`` names (without it, each
file's last run); a section this run did not fill keeps the old report's, marked. ``python bench/report.py``"""

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
from common.launch import carries_point_to_point  # noqa: E402

RUN_FILE = "bench_run.json"
RUN_KEYS = ("run_id", "quick", "model", "setup", "machine", "started_utc", "total_s", "steps")
MB = 2 ** 20
NO_ROWS = "_No rows from this run: the step failed, was stopped or skipped (see Runs above)._\n"
NO_FILE_ROWS = "_No rows in the results files for this section._\n"
NOT_PLANNED = ("_Not in this run's plan, so no rows (`BENCH_QUICK=1` leaves out the steps whose scripts "
               "have no quicker size; see Runs above)._\n")
CARRIED = "_Carried over from run `{run}` on {machine}: this run did not fill this section._\n\n"
EMPTY_TEXTS = (NO_ROWS, NO_FILE_ROWS, NOT_PLANNED, "_This section failed")
FOOTER = "\n---\nWritten by `bench/report.py`"
STAGE_PICTURES = ("bench_allreduce_busbw.png", "bench_overlap_timeline.png",
                  "bench_expert_parallel_load.png")  # drawn by the stages; the others drawn here
IMPL_LABEL = {"none": "no communication", "torch_ddp": "torch DDP (25 MB buckets)", "naive": "naive (03)",
              "flat": "flat (04)", "overlap": "overlap (05)", "bucketed": "bucketed (06)"}
HOST_PATH = ("> **Gloo's host path, not an interconnect.** These ranks share one GPU over Gloo, so every "
             "collective here goes GPU -> pinned host memory -> loopback TCP -> CPU reduction -> GPU "
             "(a few GB/s, not NVLink's hundreds); {claim}\n\n")
SECTIONS: list[tuple[str, object]] = []   # (title, section(where)), in the report's order
OPTIONAL: list[tuple[str, object]] = []   # shown only where their files have rows
FED_BY: dict[str, list[str]] = {}         # title: the make bench steps (make_bench.py's keys) feeding it


@dataclass
class Where:
    out: Path             # the results folder: the CSV/JSON files
    draw: Path            # where this report's pictures go (swapped into ``out`` at the end)
    run_id: str | None    # the run to report; None: each section takes its file's last run
    machine: str          # for the plots' titles ("" without a run record: the rows say)


def rows_of(where: Where, name: str, stage: str | None = None) -> list[dict]:
    """The rows of ``where.run_id`` (of ``stage``); with no run named, those of the last run that wrote them."""
    rows = [r for r in results.read_csv(name, where.out) if stage is None or r.get("stage") == stage]
    run_id = rows[-1].get("run_id") if where.run_id is None and rows else where.run_id
    return [r for r in rows if r.get("run_id") == run_id]


def entries_of(where: Where, name: str, run_id: str) -> list[dict]:
    return [v for _, v in sorted(results.read_json(name, where.out).items())
            if isinstance(v, dict) and v.get("run_id") == run_id]


def section(title: str, csv: str | None = None, steps: tuple = (), optional: bool = False, stage=None):
    def register(fn):
        def read(where):
            rows = rows_of(where, csv, stage)
            return fn(where, rows) if rows else None
        run = read if csv else fn
        (OPTIONAL if optional else SECTIONS).append((title, run))
        FED_BY[title] = list(steps)
        return run
    return register


def reading(text: str, words: list[str], headline: list, rows: list[dict]):
    return text + ("\n" + " ".join(words) + "\n" if words else ""), headline, rows


def machine_of(where: Where, rows: list[dict]) -> str:
    return where.machine or rows[0].get("machine") or "machine not recorded"


def num(row: dict, key: str) -> float:
    return float(row[key])


def on(r: dict) -> str:
    return f"{r['backend']}/{r['device']}"


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def times(ratio: float) -> str:
    return f"{ratio:.2f}x"


def group(rows: list[dict], key) -> dict:
    groups: dict = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    return groups


def host_path_note(rows: list[dict], claim: str) -> str:
    return HOST_PATH.format(claim=claim) if any(on(r) == "gloo/cuda" for r in rows if "backend" in r) else ""


def measured_peak(where: Where, run_id: str | None, device: str) -> dict | None:
    entry = results.read_json("matmul_peak.json", where.out).get(device)
    return entry if isinstance(entry, dict) and run_id is not None and entry.get("run_id") == run_id else None


def model_flops_utilisation(row: dict, peak: dict) -> tuple[float, float]:
    """(tokens/s, MFU) of a DDP row, over the devices doing the work (NCCL: one a rank; else one)."""
    tokens_per_s = num(row, "batch_size") * num(row, "context_length") / (num(row, "step_ms") / 1e3)
    devices = int(row["world_size"]) if row.get("backend") == "nccl" else 1
    per_token = flops_per_token(row["model"], int(row["context_length"]))
    return tokens_per_s, per_token * tokens_per_s / (peak["matmul_flops_per_s"] * devices)


def size_text(nbytes: float) -> str:
    for unit, scale in (("GB", 2 ** 30), ("MB", MB), ("KB", 2 ** 10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g}{unit}"
    return f"{nbytes:g}B"


def with_formula(counted, formula) -> str:
    text = "-" if counted in ("", None) else size_text(float(counted))
    return text + (f" ({size_text(float(formula))})" if formula not in ("", None) else "")


def md_table(headers: list[str], rows: list[list]) -> str:
    def cell(v):
        return (f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}") if isinstance(v, float) else str(v)
    return "\n".join(["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
                     + ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]) + "\n"


def picture(where: Where, name: str, alt: str) -> str:
    if (where.draw / name).exists():
        return f"![{alt}]({name})\n"
    return f"_(no picture: `{name}` was not drawn: matplotlib missing, or the step did not finish)_\n"


def bars(where: Where, name: str, labels: list[str], stacks: list[tuple[str, list[float]]], xlabel: str, title: str) -> str:
    plt = results.pyplot()
    if plt is not None and labels:
        fig, ax = plt.subplots(figsize=(8, 0.5 * len(labels) + 1.6))
        left = [0.0] * len(labels)
        for (part, values), color in zip(stacks, ("#3182bd", "#e6550d", "#a1d99b")):
            ax.barh(labels, values, left=left, color=color, label=part)
            left = [a + b for a, b in zip(left, values)]
        ax.invert_yaxis()
        ax.set(xlabel=xlabel)
        ax.set_title(title, fontsize=9)
        fig.legend(fontsize=7, loc="lower center", ncol=len(stacks), frameon=False)
        fig.tight_layout(rect=(0, 0.08, 1, 1))
        fig.savefig(where.draw / name, dpi=110)
        plt.close(fig)
    return picture(where, name, title.split("\n")[0])


# --------------------------------------------------------------------------- sections
# Each returns None where it has no rows, else (its text, its headline rows, the rows it read).


@section("Compute on one device: the measured peak, forward, backward, optimizer, memory, MFU", "compute.csv", ("compute",))
def compute_section(where: Where, rows: list[dict]):
    r0 = rows[0]
    peak = measured_peak(where, r0.get("run_id"), r0["device"])
    text = (f"One process ({machine_of(where, rows)}) at one rank's shapes of stages 03-06, nothing communicated; "
            "MFU = (6 N + 12 L H Q T) FLOPs per token x tokens/s / the peak it names (N: non-embedding "
            "parameters); AdamW, which streams its state, beside the copy bandwidth.\n\n")
    if peak:
        text += (f"Peak, measured: a {peak['matmul_n']}^3 float32 matmul at {peak['matmul_flops_per_s'] / 1e12:.2f} "
                 f"TFLOP/s; a large copy at {peak['copy_bytes_per_s'] / 1e9:.1f} GB/s (read + written).\n\n")

    def mfu(r):
        sheet = f"; {num(r, 'mfu_of_datasheet'):.1%} of {r['datasheet']}" if r.get("datasheet") else ""
        return f"{num(r, 'mfu'):.1%}" + (f" of {r['mfu_of']}" if r.get("mfu_of") else "") + sheet

    def memory(r):
        used, total = r.get("max_memory_allocated_bytes"), r.get("memory_total_bytes")
        return "-" if used in ("", None) else size_text(float(used)) + (f" of {size_text(float(total))}" if total else "")
    text += md_table(["LM", "params", "batch x context", "forward ms", "backward ms", "AdamW ms", "tokens/s",
                      "TFLOP/s (of peak)", "MFU", "AdamW GB/s (of copy)", "max memory allocated"],
                     [[r["model"] + ("" if r.get("dtype", "float32") == "float32" else f" {r['dtype']}"),
                       f"{num(r, 'params') / 1e6:.1f}M", f"{r['batch_size']} x {r['context_length']}", num(r, "fwd_ms"),
                       num(r, "bwd_ms"), num(r, "optimizer_ms"), f"{num(r, 'tokens_per_s'):.0f}",
                       f"{num(r, 'achieved_tflops'):.3g} of {num(r, 'peak_tflops'):.3g}", mfu(r),
                       f"{num(r, 'optimizer_gbps'):.3g} of {num(r, 'copy_gbps'):.3g}", memory(r)] for r in rows])
    best = max(rows, key=lambda r: num(r, "mfu"))
    return text, [["compute at one rank's shapes: MFU", f"{mfu(best)} (LM {best['model']}, {r0['device']})"]], rows


@section("All-reduce: time and bus bandwidth (stage 02)", "allreduce.csv", ("allreduce",))
def allreduce_section(where: Where, rows: list[dict]):
    cells = {k: {r["impl"]: r for r in rs} for k, rs in group(rows, lambda r: (
        r["backend"], r["device"], int(r["world_size"]), int(r["bytes"]))).items()}
    impls = [i for i in ("backend", "ring", "ring_pipelined") if any(i in c for c in cells.values())]
    text = host_path_note(rows, "the bus bandwidth below is that path's.") + md_table(
        ["backend/device", "ranks", "size", *[f"{i} busbw GB/s" for i in impls], "backend ms"],
        [[f"{b}/{d}", ws, size_text(n), *[num(c[i], "busbw_gbps") if i in c else "" for i in impls],
          num(c["backend"], "time_ms_median") if "backend" in c else ""] for (b, d, ws, n), c in sorted(cells.items())])
    largest = max(n for *_, n in cells)
    best = max((c["backend"] for k, c in cells.items() if k[3] == largest and "backend" in c),
               key=lambda r: num(r, "busbw_gbps"), default=None)
    words, headline = [], []
    if best:
        busbw = f"{num(best, 'busbw_gbps'):.2f} GB/s ({on(best)}, {best['world_size']} ranks"
        words.append(f"At {size_text(largest)} the best bus bandwidth (algbw x 2(n-1)/n) is {busbw}).")
        path = "; Gloo's host path, not an interconnect" if on(best) == "gloo/cuda" else ""
        headline.append([f"all-reduce bus bandwidth, {size_text(largest)}", f"{busbw}{path})"])
    ratios = {i: [num(c[i], "busbw_gbps") / num(c["backend"], "busbw_gbps") for k, c in cells.items()
                  if k[3] >= 10 * MB and i in c and "backend" in c] for i in ("ring", "ring_pipelined")}
    if ratios["ring"] and ratios["ring_pipelined"]:
        span = {i: f"{min(v):.2f}-{max(v):.2f}x" for i, v in ratios.items()}
        words.append(f"Stage 01's rings at 10 MB and above: textbook {span['ring']} the backend's busbw, pipelined "
                     f"{span['ring_pipelined']}.")
    fits = [f"{on(f)} x {f['world_size']}: a = {f['a_s'] * 1e6:.0f} us, w = {f['w_bytes_per_s'] / 1e9:.2f} GB/s"
            for f in entries_of(where, "allreduce_fit.json", rows[0]["run_id"])]
    words += [f"Fitted t = a + N / w (stage 06's o and w): {'; '.join(fits)}."] if fits else []
    words.append("\n\n" + picture(where, "bench_allreduce_busbw.png", "all-reduce bus bandwidth"))
    return reading(text, words, headline, rows)


@section("Data-parallel training step (stages 03-06, torch DDP beside them)", "ddp_step.csv", ("ddp",))
def ddp_section(where: Where, rows: list[dict]):
    r0 = rows[0]
    picked = {"torch_ddp": next((r for r in rows if r["impl"] == "torch_ddp" and float(r["bucket_mb"]) == 25), None),
              "bucketed": min((r for r in rows if r["impl"] == "bucketed"), key=lambda r: num(r, "step_ms"), default=None)}
    shown = [(label + (f", best bucket {r['bucket_mb']} MB" if impl == "bucketed" else ""), r)
             for impl, label in IMPL_LABEL.items()
             for r in [picked.get(impl, next((c for c in rows if c["impl"] == impl), None))] if r is not None]
    peak = measured_peak(where, r0.get("run_id"), r0["device"])

    def mfu(r):
        if not r.get("batch_size") or not r.get("context_length"):
            return ["-", "-"]
        tokens_per_s, mfu = model_flops_utilisation(r, peak)
        return [f"{tokens_per_s:.0f}", f"{mfu:.1%}"]
    text = (host_path_note(rows, "the step times say how the implementations compare on it, not what each costs on NCCL.")
            + f"LM `{r0['model']}` ({int(r0['params']) / 1e6:.1f}M parameters), global batch {r0['batch_size']}, context "
            f"{r0['context_length']}, AdamW, {r0['world_size']} ranks on {on(r0)}.\n\n"
            + md_table(["implementation", "step ms", "fwd+bwd ms", "comm after backward ms", "optimizer ms", "vs torch DDP",
                        *(["tokens/s", "MFU"] if peak else [])],
                       [[label, *[num(r, k) for k in ("step_ms", "fwd_bwd_ms", "comm_after_backward_ms", "optimizer_ms")],
                         times(num(r, "ratio_vs_torch_ddp")) if r.get("ratio_vs_torch_ddp") else "-",
                         *(mfu(r) if peak else [])] for label, r in shown]))
    best, torch_ddp = picked["bucketed"], picked["torch_ddp"]
    words, headline = [], []
    if best and torch_ddp:
        ratio = times(num(best, "step_ms") / num(torch_ddp, "step_ms"))
        words.append(f"BucketedDDP at its best bucket size ({best['bucket_mb']} MB) takes {ratio} torch DDP's step time.")
        headline.append(["BucketedDDP (best bucket) vs torch DDP, step time", f"{ratio} ({num(best, 'step_ms'):.1f} vs "
                         f"{num(torch_ddp, 'step_ms'):.1f} ms, LM {r0['model']})"])
    words.append("\n\n" + bars(where, "bench_ddp_step.png", [label for label, _ in shown], [
        (part, [num(r, key) for _, r in shown]) for part, key in (
            ("forward + backward (overlapped communication hides here)", "fwd_bwd_ms"),
            ("communication left after backward", "comm_after_backward_ms"), ("optimizer", "optimizer_ms"))],
        "ms per training step", f"DDP step time, LM {r0['model']}, {r0['world_size']} ranks {on(r0)}\n{machine_of(where, rows)}"))
    return reading(text, words, headline, rows)


@section("Bucket size: the sweep and the model (stage 06)", steps=("ddp",))
def bucket_section(where: Where):
    steps = rows_of(where, "ddp_step.csv")  # the model is written by the run that wrote these
    entries = entries_of(where, "bucket_model.json", steps[0]["run_id"]) if steps else []
    if not entries:
        return None
    m = entries[0]
    lo, hi = m["neighbour_range_mb"]
    text = md_table(["bucket cap MB", "buckets", "BucketedDDP step ms", "comm after backward ms, measured", "model ms"],
                    [[float(s["bucket_mb"]), s["buckets"], float(s["measured_step_ms"]),
                      float(s["measured_comm_after_bwd_ms"]), float(s["model_comm_after_bwd_ms"])] for s in m["sweep"]])
    inside = f"{'within' if m['prediction_within_neighbours'] else 'outside'} the best and its neighbours [{lo:g}, {hi:g}] MB"
    best = f"{m['predicted_best_bucket_mb']:.3g} MiB vs {m['measured_best_bucket_mb']:g} MB"
    return reading(text, [f"With s = {m['gradient_bytes'] / MB:.1f} MiB of gradients, o = {m['o_s'] * 1e6:.0f} us and "
                          f"w = {m['w_bytes_per_s'] / 1e9:.2f} GB/s ({m['fit_source']}), n_b o + s/(n_b w) is smallest "
                          f"at the model's best, measured best: {best}; the prediction lies {inside}."],
                   [["bucket size: model's best vs measured best", f"{best} ({inside.split()[0]} [{lo:g}, {hi:g}])"]], entries)


@section("Overlap, seen in a profile (stage 05 `--profile`)", "ddp_profile.csv", ("profile",), stage="05_overlap_ddp")
def overlap_section(where: Where, rows: list[dict]):
    keys = ["step_ms", "backward_ms", "collectives", "comm_during_backward_ms", "comm_after_backward_ms"]
    text = md_table(["case", *[k.replace("_ms", " ms").replace("_", " ") for k in keys]],
                    [[r["case"], *[float(r[k]) if k.endswith("_ms") else r[k] for k in keys]] for r in rows])
    shares = [f"{r['case']} {num(r, keys[3]) / max(1e-9, num(r, keys[3]) + num(r, keys[4])):.0%}" for r in rows]
    return reading(text, [f"Share of the communication that ran while backward computed (rank 0, one profiled step): "
                          f"{', '.join(shares)}.\n\n" + picture(where, "bench_overlap_timeline.png", "overlap timeline")],
                   [], rows)


@section("Tensor parallelism: bytes per MLP (stage 07)", "tensor_parallel.csv", ("tp",))
def tensor_parallel_section(where: Where, rows: list[dict]):
    sums = {k: {p: sum(int(r["bytes_counted"]) for r in rs if r["phase"] == p) for p in ("forward", "backward")}
            for k, rs in group(rows, lambda r: (int(r["world_size"]), r["variant"])).items()}
    r0 = rows[0]
    text = (f"MLP {r0['d_model']} -> {r0['d_ff']} -> {r0['d_model']} over {r0['tokens']} tokens, float32: the collectives' "
            "payloads, counted (the script checks the prediction).\n\n"
            + md_table(["ranks", "variant", "forward", "backward"],
                       [[ws, v, size_text(d["forward"]), size_text(d["backward"])] for (ws, v), d in sorted(sums.items())]))
    total = {v: d["forward"] + d["backward"] for (_, v), d in sums.items()}
    if not {"megatron", "allgather"} <= set(total):
        return text, [], rows
    return reading(text, [f"All-gathering after every layer moves {total['allgather'] / total['megatron']:.1f}x Megatron's "
                          "bytes: it also ships the d_ff-wide activation."],
                   [["tensor parallel MLP: bytes per forward+backward, Megatron vs all-gather",
                     f"{size_text(total['megatron'])} vs {size_text(total['allgather'])}"]], rows)


@section("Sequence parallelism: bytes and saved activations per block (stage 07)", "sequence_parallel.csv", ("tp",))
def sequence_parallel_section(where: Where, rows: list[dict]):
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
    text = (f"A Transformer block (d_model {r0['d_model']}, d_ff {r0['d_ff']}, {r0['heads']} heads, {r0['tokens']} tokens), "
            f"float32, on {on(r0)}: its collectives' payloads, a ring's bytes per rank for them, and the bytes autograd "
            "saves for backward per rank (formula in brackets).\n\n"
            + md_table(["ranks", "block", "payload forward", "payload backward", "ring sends per rank",
                        "saved in LayerNorms", "saved elsewhere", "saved in all"],
                       [[ranks, block, *([size_text(c[k]) for k in ("forward", "backward", "ring")] if "forward" in c
                                         else ["-"] * 3), with_formula(*c["saved layernorms"]),
                         with_formula(*c["saved rest"]), size_text(c["saved layernorms"][0] + c["saved rest"][0])]
                        for (ranks, block), c in sorted(blocks.items(), key=lambda kv: (kv[0][0], order.index(kv[0][1])))]))
    words, headline = [], []
    for ranks in sorted({ranks for ranks, _ in blocks}):
        plain, sequence = blocks.get((ranks, "TP")), blocks.get((ranks, "TP + SP"))
        if plain is None or sequence is None or "forward" not in plain:
            continue
        payload = (sequence["forward"] + sequence["backward"]) / (plain["forward"] + plain["backward"])
        layernorms = sequence["saved layernorms"][0] / plain["saved layernorms"][0]
        same_ring = sequence["ring"] == plain["ring"]
        words.append(f"On {ranks} ranks, sequence parallelism's all-gathers and reduce-scatters carry {payload:.1f}x the "
                     f"payload of plain TP's all-reduces, and a ring sends {'the same' if same_ring else 'other'} bytes per "
                     f"rank for them ({size_text(sequence['ring'])} vs {size_text(plain['ring'])}). The LayerNorms keep "
                     f"{layernorms:.2f}x plain TP's activations per rank (target 1/t = {1 / ranks:.2f}: "
                     f"{verdict(abs(layernorms - 1 / ranks) < 1e-9)}).")
        headline.append([f"sequence parallel, {ranks} ranks: LayerNorm activations saved per rank, TP + SP vs TP",
                         f"{layernorms:.2f}x (1/t = {1 / ranks:.2f}); ring bytes per rank "
                         f"{'equal' if same_ring else 'NOT equal'}"])
    exact = all(c[k][0] == c[k][1] for c in blocks.values() for k in ("saved layernorms", "saved rest"))
    words.append(f"{'Every' if exact else 'Not every'} saved count equals its formula.")
    return reading(text, words, headline, rows)


@section("Pipeline schedules: the bubble (stage 07)", "pipeline_bubble.csv", ("pp",))
def pipeline_section(where: Where, rows: list[dict]):
    order = ["gpipe", "1f1b", "interleaved", "zbh1", "zbv", "dualpipev"]
    table, gaps = [], []
    for (s, m, v, emu), rs in sorted(group(rows, lambda r: (r["schedule"], int(r["micro_batches"]), int(r["chunks"]),
                                                            float(r["emulated_ms"]))).items(),
                                     key=lambda kv: (kv[0][3], kv[0][1], order.index(kv[0][0]))):
        gap = max(abs(num(r, "idle_share") - num(r, "idle_share_simulated")) for r in rs)
        gaps += [gap] if emu else []
        table.append([s, v, m, f"emulated {emu:g} ms" if emu else "real", statistics.fmean(num(r, "idle_share") for r in rs),
                      num(rs[0], "idle_share_simulated"), num(rs[0], "idle_share_formula"), gap,
                      " ".join(r["peak_held"] for r in sorted(rs, key=lambda r: int(r["rank"])))])
    r0 = rows[0]
    text = (host_path_note(rows, "with real compute the sends cross it too; emulated, the idle shares are the schedules' own.")
            + f"{r0['world_size']} stages, batch {r0['batch']}, {on(r0)}. Idle share = 1 - busy / pass, mean over stages; "
            "emulated compute (every F, B and W a fixed wait) checks the executor against the simulation.\n\n"
            + md_table(["schedule", "v", "m", "compute", "idle, measured", "simulated", "formula", "max gap to simulated",
                        "held per stage"], table))
    if not gaps:
        return text, [], rows
    return reading(text, [f"With emulated compute every schedule's measured idle is within {max(gaps):.3f} of its "
                          "simulation (target 0.05)."],
                   [["pipeline, emulated compute: largest |measured - simulated| idle",
                     f"{max(gaps):.3f} over {len(gaps)} schedule settings"]], rows)


@section("Sharding: memory and communication per rank (stage 07)", "sharding.csv", ("ledger",))
def sharding_section(where: Where, rows: list[dict]):
    r0 = rows[0]
    order = ["none", "ddp", "zero1", "zero2", "fsdp", "torch_zero1", "torch_fsdp"]
    rows = sorted(rows, key=lambda r: (r["checkpointing"], order.index(r["impl"]) if r["impl"] in order else 9))
    kinds = ("param_bytes", "grad_bytes", "optim_bytes", "peak_bytes", "activation_bytes", "sent_bytes")
    text = (host_path_note(rows, "Gloo's reduce-scatter is an all-reduce underneath, so the step times here are not a "
                                 "comparison of strategies; the bytes per rank are.")
            + f"LM `{r0['model']}`, AdamW, {r0['world_size']} ranks on {on(r0)}: bytes per rank counted from the tensors "
            "(formula in brackets); `none` trains each rank's share and sends nothing.\n\n"
            + md_table(["impl", "checkpointing", "step ms", "params", "grads", "optimizer state", "peak", "activations",
                        "sent per step"], [[r["impl"], r["checkpointing"], num(r, "step_ms"), *[
                            with_formula(r.get(k), r.get(f"{k}_predicted")) for k in kinds]] for r in rows]))
    plain = [r for r in rows if r["checkpointing"] in ("off", "False", "0", "")] or rows
    return reading(text, [bars(where, "bench_sharding_bytes.png", [r["impl"] for r in plain],
                               [(part, [num(r, key) / MB for r in plain]) for part, key in zip(
                                   ("parameters", "gradients", "optimizer state"), kinds)], "MiB per rank, held between "
                               "steps", f"Bytes per rank, LM {r0['model']}, {r0['world_size']} ranks\n"
                               f"{machine_of(where, rows)}")], [], rows)


@section("Context parallelism: ring attention, contiguous and zig-zag (stage 07)", "context_parallel.csv", ("cp",))
def context_parallel_section(where: Where, rows: list[dict]):
    r0 = rows[0]
    real = [r for r in rows if r["compute"] == "real"]
    emulated = [r for r in rows if r["compute"] != "real"]

    def label(r):
        return {"ring": f"W={r['W']} {r['layout']}", "ulysses": f"W={r['W']} Ulysses"}.get(r["impl"], r["impl"])
    order = {"ring": 1, "ulysses": 2}                    # one rank's kernels, rings, Ulysses
    columns = list(dict.fromkeys(label(r) for r in sorted(real, key=lambda r: (order.get(r["impl"], 0), int(r["W"]),
                                                                                 r["layout"]))))
    steps = {seq: {label(r): num(r, "step_ms") for r in rs} for seq, rs in group(real, lambda r: int(r["seq"])).items()}
    text = (f"Causal attention, forward + backward, float32, batch {r0['batch']}, {r0['heads']} heads of {r0['head_dim']}, "
            f"on {on(r0)}: one rank's kernels, and ring attention on W ranks in both layouts. Step ms, real compute:\n\n"
            + md_table(["seq", *columns], [[seq, *[c.get(k, "") for k in columns]] for seq, c in sorted(steps.items())]))
    longest = max(int(r["seq"]) for r in rows)
    at_longest = sorted((r for r in real if int(r["seq"]) == longest and r["impl"] == "ring"),
                        key=lambda r: (int(r["W"]), r["layout"]))
    gpu = ["peak GPU memory"] if r0["device"] == "cuda" else []
    text += (f"\nAt sequence length {longest}, per rank: bytes sent, the imbalance (max / mean scores computed; formula "
             "2 - 1/W contiguous, 1 zig-zag), bytes saved for backward (formulas in brackets):\n\n"
             + md_table(["W", "layout", "sent per rank", "FLOP imbalance", "saved per rank", *gpu],
                        [[r["W"], r["layout"], with_formula(r["sent_bytes"], r["bytes_formula"]),
                          f"{num(r, 'imbalance'):.3f} ({num(r, 'imbalance_formula'):.3f})",
                          with_formula(r["saved_bytes"], r["saved_formula"]),
                          *[size_text(num(r, "peak_bytes")) for _ in gpu]] for r in at_longest]))
    emulation = sorted({r["compute"] for r in emulated})  # one wait, "emulated 400 ms"
    computes = ["real", *emulation]
    ratios = {}  # W: {compute: zig-zag / contiguous at the longest sequence}
    for w in sorted({int(r["W"]) for r in at_longest}):
        step = {(r["compute"], r["layout"]): num(r, "step_ms") for r in at_longest + emulated
                if r["impl"] == "ring" and int(r["W"]) == w and int(r["seq"]) == longest}
        ratios[w] = {c: step[(c, "zigzag")] / step[(c, "contiguous")] for c in computes
                     if (c, "zigzag") in step and (c, "contiguous") in step}
    text += (f"\nZig-zag / contiguous step time at sequence length {longest} (emulated: each block of scores waits in "
             "proportion to its FLOPs; ideal W/(2W-1)):\n\n"
             + md_table(["W", *[f"{c} compute" for c in computes], "ideal"],
                        [[w, *[by.get(c, "") for c in computes], w / (2 * w - 1)] for w, by in ratios.items()]))
    exact = all(num(r, "sent_bytes") == num(r, "bytes_formula") for r in rows)
    words = [f"Ring bytes sent per rank equal the formula in {'every' if exact else 'NOT every'} row."]
    headline = []
    w = max(ratios, default=None)  # the widest ring: W=4 in make bench
    imbalance = {r["layout"]: num(r, "imbalance") for r in at_longest if int(r["W"]) == w}
    if {"zigzag", "contiguous"} <= set(imbalance):
        formula = 2 - 1 / w
        off = abs(imbalance["contiguous"] / formula - 1)
        words.append(f"At W={w} zig-zag balances the causal work (imbalance {imbalance['zigzag']:.3f}, target 1.00) and "
                     f"contiguous is {imbalance['contiguous']:.3f}, {100 * off:.1f}% from 2 - 1/W = {formula:.3f} (target "
                     f"within 2%: {verdict(off <= 0.02)}).")
        headline.append([f"context parallel, FLOP imbalance at W={w}: zig-zag, contiguous",
                         f"{imbalance['zigzag']:.3f}, {imbalance['contiguous']:.3f} (targets 1.00 and {formula:.3f})"])
    measured = ratios.get(w, {})
    if emulation and emulation[0] in measured and "real" in measured:
        ratio = measured[emulation[0]]
        target = f"target <= 0.75 at W=4: {verdict(ratio <= 0.75)}" if w == 4 else "the 0.75 target is set at W=4"
        cpu = ", which on a CPU box measures the ranks sharing its cores more than the balance"
        words.append(f"With {emulation[0]} compute, zig-zag's step takes {ratio:.2f}x contiguous's at W={w} ({target}; "
                     f"ideal {w / (2 * w - 1):.2f}); with real compute {measured['real']:.2f}x"
                     + (cpu if r0["device"] == "cpu" else "") + ".")
        headline.append([f"context parallel, zig-zag / contiguous causal step, W={w}",
                         f"{ratio:.2f}x emulated compute ({target.split(':')[0]}), {measured['real']:.2f}x real"])
    ulysses = [[r["seq"], r["W"], r["compute"], with_formula(ring["sent_bytes"], ring["bytes_formula"]),
                with_formula(r["sent_bytes"], r["bytes_formula"]), num(ring, "step_ms"), num(r, "step_ms"),
                times(num(r, "step_ms") / num(ring, "step_ms"))] for r in rows if r["impl"] == "ulysses" for ring in rows
               if ring["impl"] == "ring" and ring["layout"] == "zigzag" and all(ring[k] == r[k] for k in ("seq", "W", "compute"))]
    if ulysses:
        text += ("\nUlysses (all-to-alls around attention over the heads) beside the zig-zag ring: bytes a rank sends "
                 "per layer, counted (formula), and step time:\n\n"
                 + md_table(["seq", "W", "compute", "ring bytes", "Ulysses bytes", "ring ms", "Ulysses ms", "Ulysses / ring"],
                            ulysses))
    return reading(text, words, headline, rows)


@section("Expert parallelism: all-to-all bytes, expert memory, load (stage 07)", "expert_parallel.csv", ("ep2", "ep4"))
def expert_parallel_section(where: Where, rows: list[dict]):
    steps = sorted((r for r in rows if r["measure"] == "step"), key=lambda r: (int(r["world_size"]), int(r["tokens_per_rank"])))
    loads = [r for r in rows if r["measure"] == "load"]
    r0 = rows[0]
    text = (host_path_note(rows, "the times include its all-to-alls over that path; the bytes, memory and load do not.")
            + f"A mixture-of-experts layer (d_model {r0['d_model']}, d_ff {r0['d_ff']}, {r0['num_experts']} experts, top-"
            f"{r0['top_k']}) on {on(r0)}, replicated against expert parallel, forward + backward, random routing; bytes "
            "rank 0 sends per step and in the first dispatch, counted (formula; the dispatch's uniform):\n\n"
            + md_table(["ranks", "tokens per rank", "replicated ms", "expert parallel ms", "EP / replicated",
                        "sent per step", "dispatch (uniform)"],
                       [[r["world_size"], r["tokens_per_rank"], num(r, "replicated_ms"), num(r, "expert_parallel_ms"),
                         times(num(r, "ep_over_replicated")), with_formula(r["bytes_sent_counted"], r["bytes_sent_formula"]),
                         with_formula(r["dispatch_bytes"], r["uniform_bytes_per_exchange"])] for r in steps]))
    exact = sum(num(r, "bytes_sent_counted") == num(r, "bytes_sent_formula") for r in steps)
    exactly = {True: "exactly", False: "NOT"}
    shares = [f"{num(r, 'share'):.4g} at W={w} ({exactly[num(r, 'expert_bytes_per_rank') * w == num(r, 'expert_bytes_replicated')]}"
              " 1/W)" for w, r in sorted({int(r["world_size"]): r for r in steps}.items())]
    words = [f"Counted all-to-all bytes equal the formula in {exact} of {len(steps)} rows."]
    if steps:
        words.append(f"Expert bytes per rank, of {size_text(num(steps[0], 'expert_bytes_replicated'))} for the layer (the "
                     f"router's {size_text(num(steps[0], 'router_bytes'))} replicated): " + ", ".join(shares) + ".")
    if loads:
        biggest = max(int(r["world_size"]) for r in loads)
        shown = [r for r in loads if int(r["world_size"]) == biggest]
        text += (f"\nLoad on {biggest} ranks, {shown[0]['tokens_per_rank']} tokens per rank, per capacity factor (skewed: "
                 "inputs shifted so the router favours a few experts):\n\n"
                 + md_table(["routing", "capacity factor", "max / mean", "dropped", "tokens per expert"],
                            [[r["routing"], r["capacity_factor"], num(r, "max_over_mean"),
                              f"{100 * num(r, 'dropped_share'):.1f}%", r["tokens_per_expert"]] for r in shown])
                 + "\n" + picture(where, "bench_expert_parallel_load.png", "tokens per expert"))
        case = {(r["routing"], r["capacity_factor"]): r for r in shown}
        tight, dropless = case.get(("skewed", "1.0")), case.get(("skewed", "dropless"))
        if tight is not None and dropless is not None:
            dropped = num(dropless, "dropped_share")
            kept = f"drops {100 * dropped:.1f}% (it should drop none)" if dropped else "keeps them all"
            words.append(f"Skewed routing at capacity factor 1.0 drops {100 * num(tight, 'dropped_share'):.1f}% of the "
                         f"assignments; dropless {kept}, at {num(dropless, 'max_over_mean'):.2f}x the mean load.")
    return reading(text, words, [["expert parallel: all-to-all bytes counted = formula; expert bytes per rank",
                                  f"{exact} of {len(steps)} rows; " + ", ".join(shares)]], rows)


@section("Everything together: grids, torch's composition and pipelining (stage 07)", "grid.csv", ("grid",))
def together_section(where: Where, rows: list[dict]):
    pipelines = [r for r in rows if r.get("schedule")]
    beside = [r for r in rows if not r.get("schedule") and (r["impl"] == "torch" or r.get("pair")
                                                            or "timed beside" in r["setting"])]
    grids = [r for r in rows if not r.get("schedule") and r not in beside]
    words, headline, text = [], [], ""
    if grids:
        r0 = grids[0]
        unit, scale = ("MiB", MB) if max(num(r, "param_bytes") for r in grids) > 64 * MB else ("KiB", 2 ** 10)

        def amount(r, kind):
            formula = r.get(kind + "_bytes_formula", "")
            return f"{num(r, kind + '_bytes') / scale:.1f}" + (f" ({float(formula) / scale:.1f})" if formula != "" else "")
        text += (f"The {r0['model']} LM, batch {r0['batch_size']} x {r0['seq_len']}, AdamW, {r0['world_size']} ranks "
                 f"({on(r0)}), a step per grid; per rank (the largest), {unit}, counted (the formulas combined):\n\n"
                 + md_table(["grid", "setting", "step ms", "tokens/s", "params", "grads", "AdamW state",
                             "saved, 1 micro-batch", "worst difference"],
                            [[r["grid"], r["setting"], num(r, "step_ms"), num(r, "tokens_per_s"),
                              *[amount(r, k) for k in ("param", "grad", "optim", "activation")],
                              f"{100 * num(r, 'worst_difference'):.2f}%"] for r in grids])
                 + f"\nBytes sent per step per rank by axis, {unit} (ring shares), counted (formula):\n\n"
                 + md_table(["grid", "setting", "tp", "cp", "pp", "dp x cp", "world"], [[r["grid"], r["setting"], *[
                     amount(r, k) for k in ("sent_tp", "sent_cp", "sent_pp", "sent_dp_cp", "sent_world")]] for r in grids]))
        worst = max(grids, key=lambda r: num(r, "worst_difference"))
        share = num(worst, "worst_difference")
        at = f"{worst['grid']}, {worst['setting']}, {worst['worst_where']}; " if share else "every count exact; "
        words.append(f"Counted bytes per rank against the combined formula, every grid, rank and column: worst "
                     f"{100 * share:.2f}% ({at}target within 5%: {verdict(share <= 0.05)}).")
        headline.append(["everything together: counted bytes per rank vs the combined formula",
                         f"worst {100 * share:.2f}% over {len(grids)} grids (target 5%)"])
    sides = [{r["impl"]: r for r in rs} for rs in group([r for r in beside if r.get("pair")], lambda r: r["pair"]).values()]
    pairs = [(s["ours"]["pair"], s["ours"], s["torch"]) for s in sides if {"ours", "torch"} <= set(s)]
    if pairs:
        text += ("\nTorch's composition (`parallelize_module`, `fully_shard`) beside ours, each `pair` timed in "
                 "alternating rounds:\n\n"
                 + md_table(["pair", "impl", "setting", "step ms", "params", "grads", "AdamW state", "saved", "first loss"],
                            [[pair, r["impl"], r["setting"], num(r, "step_ms"),
                              *[with_formula(r[k], r.get(f"{k}_formula")) for k in ("param_bytes", "grad_bytes", "optim_bytes")],
                              size_text(num(r, "activation_bytes")), f"{num(r, 'first_loss'):.6f}"]
                             for pair, ours, theirs in pairs for r in (ours, theirs)]))
    for pair, ours, theirs in pairs:
        ratio = num(ours, "step_ms") / num(theirs, "step_ms")
        words.append(f"{pair}: our {ours['grid']} step takes {times(ratio)} torch's ({num(ours, 'step_ms'):.1f} vs "
                     f"{num(theirs, 'step_ms'):.1f} ms; target <= 1.25x: {verdict(ratio <= 1.25)}).")
        headline.append([f"{pair}: our {ours['grid']} step vs torch's composition", f"{times(ratio)} (target <= 1.25x)"])
    losses = [num(r, "first_loss") for r in grids + beside if r.get("first_loss", "") != ""]
    if len(losses) > 1:
        words.append(f"First-step losses of every grid and of torch's differ by at most {max(losses) - min(losses):.1e}.")
    table, pp4 = [], []
    for (stages, schedule, compute), rs in group(pipelines, lambda r: (int(r["stages"]), r["schedule"],
                                                                       r["setting"].split(", ", 1)[-1])).items():
        ours, theirs = next((r for r in rs if r["impl"] == "ours"), None), next((r for r in rs if r["impl"] == "torch"), None)
        if ours and theirs:
            ratio = num(ours, "step_ms") / num(theirs, "step_ms")
            table.append([ours["grid"], schedule, compute, num(ours, "step_ms"), num(theirs, "step_ms"), times(ratio),
                          num(ours, "ideal_ms") if ours.get("ideal_ms") else "-"])
            pp4 += [(ratio, schedule, compute)] if stages == 4 and compute.startswith("emulated") else []
    if table:
        text += (f"\nThe pipeline axis alone, our executor (lesson 4) beside `torch.distributed.pipelining`, "
                 f"{pipelines[0]['micro_batches']} micro-batches; ideal: the unit-time simulation x the wait:\n\n"
                 + md_table(["stages", "schedule", "compute", "ours ms", "torch ms", "ours / torch", "ideal ms"], table))
    if pp4:
        worst = max(pp4)
        words.append(f"Our pipeline executor against torch.distributed.pipelining, pp 4, {worst[2]} compute: "
                     + ", ".join(f"{s} {times(ratio)}" for ratio, s, _ in pp4)
                     + f" (target <= 1.10x: {verdict(worst[0] <= 1.10)}).")
        headline.append(["our pipeline executor vs torch.distributed.pipelining, pp 4, emulated",
                         f"{times(worst[0])} at worst ({worst[1]}; target <= 1.10x)"])
    return reading(text, words, headline, rows)


@section("Checkpoints: save and load beside torch.distributed.checkpoint (stage 07)", "checkpoint.csv", ("checkpoint",))
def checkpoint_section(where: Where, rows: list[dict]):
    r0 = rows[0]
    table, ratios = [], []
    for (saved_at, loaded_at, op), rs in group(rows, lambda r: (int(r["saved_at"]), int(r["loaded_at"]), r["op"])).items():
        ours, theirs = next((r for r in rs if r["impl"] == "ours"), None), next((r for r in rs if r["impl"] == "torch_dcp"), None)
        if ours and theirs:
            ratios.append((num(ours, "time_ms_median") / num(theirs, "time_ms_median"), op, saved_at, loaded_at))
            table.append([f"{saved_at} -> {loaded_at}", op, ours["ranks"], num(ours, "time_ms_median"),
                          num(theirs, "time_ms_median"), times(ratios[-1][0]), *[size_text(num(ours, k)) for k in (
                              "data_bytes_max", "data_bytes_total", "manifest_bytes", "kernel_bytes_max")],
                          size_text(num(theirs, "kernel_bytes_max"))])
    text = (f"The {r0['model']} LM and its AdamW state saved at one number of ranks and loaded at another, by the lesson "
            f"and by `torch.distributed.checkpoint`, on {on(r0)}; kernel bytes: /proc/self/io, the largest rank.\n\n"
            + md_table(["saved at -> loaded at", "op", "ranks doing it", "ours ms", "torch ms", "ours / torch",
                        "data per rank", "data, all ranks", "manifest", "kernel bytes per rank, ours", "torch's"], table))
    words, headline = [], []
    if ratios:
        worst = max(ratios)
        words.append(f"Ours takes {times(min(ratios)[0])} to {times(worst[0])} torch's time (target <= 1.5x: met in "
                     f"{sum(ratio <= 1.5 for ratio, *_ in ratios)} of {len(ratios)}).")
        headline.append(["checkpoints: save and load time vs torch.distributed.checkpoint", f"{times(worst[0])} at "
                         f"worst ({worst[1]} {worst[2]} -> {worst[3]} ranks; target <= 1.5x; LM {r0['model']})"])
    written = {r["data_bytes_total"] for r in rows if r["impl"] == "ours" and r["op"] == "save" and r["data_bytes_total"]}
    words += [f"Saved at either number of ranks, all ranks together wrote the same {size_text(float(written.pop()))} of "
              "data."] if len(written) == 1 else []
    return reading(text, words, headline, rows)


@section("Predict, then measure: the planner beside this box's steps (stage 07)", steps=("prediction",))
def prediction_section(where: Where):
    rows = rows_of(where, "prediction.csv")
    planned = rows_of(where, "projection.csv")  # lesson 9's cluster presets, with the compute measured here
    projected = "" if not planned else (
        f"\n**Predicted, not measured**: each cluster preset's fastest grids that fit, its links from the spec sheet, its "
        f"compute measured here ({planned[0]['compute_from']}); LM `{planned[0]['model']}`, {planned[0]['seq_len']} tokens:\n\n"
        + md_table(["preset", "grid", "predicted step ms", "predicted tokens/s a GPU", "predicted GiB a GPU",
                    "of the measured rate"],
                   [[r["cluster"], r["grid"], num(r, "predicted_ms"), f"{num(r, 'tokens_per_s_per_gpu'):,.0f}",
                     f"{num(r, 'memory_gib'):.1f}", f"{num(r, 'share_of_measured_rate'):.0%}"] for r in planned]) + "\n")
    if not rows:
        return (projected, [], []) if projected else None
    within = sum(abs(num(r, "ratio") - 1) <= 0.25 for r in rows)
    far = max(rows, key=lambda r: abs(num(r, "ratio") - 1))
    worst, config = times(num(far, "ratio")), far["config"]
    text = ("Lesson 9's planner, fed with this box's measured compute and links, beside the step times measured "
            f"above ({machine_of(where, rows)}; `results/prediction.csv` holds every term):\n\n"
            + md_table(["configuration", "predicted ms", "measured ms", "predicted / measured"],
                       [[r["config"], num(r, "predicted_ms"), num(r, "measured_ms"), times(num(r, "ratio"))] for r in rows]))
    return reading(text, [f"Within 25%: {within} of {len(rows)}. The worst: {config}, predicted {worst} the measured "
                          "(the planner's README says what it cannot see on a box like this).\n" + projected],
                   [["planning: predicted step time within 25% of measured",
                     f"{within} of {len(rows)} configurations (worst {worst})"]], rows)


@section("The DDP crossover on this box: predicted, then swept (lesson 9)", "crossover.csv", ("crossover",), optional=True)
def crossover_section(where: Where, rows: list[dict]):
    points = [r for r in rows if r["point"] != "crossover"]
    found = next(r for r in rows if r["point"] == "crossover")
    text = ("Lesson 9's planner predicts the tokens per rank above which DDP's gradient all-reduce hides under backward "
            "(the Scaling Book's C/W rule with backward's floor, from backward at one row and at two rows "
            "and an all-reduce after a backward, timed beside the DDP step's control above); the lab sweeps them, "
            f"backward and the all-reduce each timed alone, the crossing where backward reaches the all-reduce's median "
            f"({machine_of(where, rows)}, {on(found)}, {found['world_size']} ranks, LM {found['model']}):\n\n" + md_table(
                ["tokens a rank", "rows x seq", "backward ms", "all-reduce ms"],
                [[r["tokens_per_rank"], f"{r['rows']} x {r['seq']}", num(r, "backward_ms"), num(r, "all_reduce_ms")] for r in points]))
    measured = f"{num(found, 'tokens_per_rank'):.0f} tokens a rank" if found["tokens_per_rank"] else "no crossing in the sweep"
    words = [f"Measured: {measured}; predicted: " + (f"{num(found, 'predicted_tokens'):.0f}." if found.get("predicted_tokens") else "none.")]
    if not found.get("ratio"):
        return reading(text, words, [["DDP crossover, measured / predicted", words[0]]], rows)
    ratio, ok = times(num(found, "ratio")), found["within"] == "True"
    link = times(num(found, "all_reduce_ms") / num(found, "predicted_all_reduce_ms"))
    rate = times(num(found, "backward_tokens_per_s") / num(found, "predicted_backward_tokens_per_s"))
    words.append(f"Measured / predicted {ratio}: within x1.25 {verdict(ok)}. Its two terms: the all-reduce took {link} the "
                 f"predicted ({times(num(found, 'all_reduce_back_to_back_ms') / num(found, 'predicted_all_reduce_ms'))} back to "
                 f"back, as stage 02 times it), backward ran {rate} the predicted tokens/s at the crossing.")
    return reading(text, words, [["DDP crossover: measured / predicted (within x1.25)", f"{ratio}, {verdict(ok)}"]], rows)


@section("Muon: four designs beside AdamW + ZeRO-1", "muon.csv", ("muon",), optional=True)
def muon_section(where: Where, rows: list[dict]):
    text = ("The optimizer step alone on the same gradients; bytes counted over all ranks (formula); Newton-Schulz "
            "GFLOP on the busiest rank, and that over the ideal 1/N.\n\n"
            + md_table(["impl", "ranks", "LM", "step ms", "bytes (formula)", "NS GFLOP, busiest rank", "NS imbalance"],
                       [[r["impl"], r["world_size"], r["model"], num(r, "step_ms"),
                         with_formula(r["bytes_counted"], r["bytes_formula"]), num(r, "ns_gflop_max"),
                         f"{num(r, 'ns_imbalance'):.2f}" if r.get("ns_imbalance") else "-"] for r in rows]))
    exact = sum(abs(num(r, "bytes_counted") - num(r, "bytes_formula")) <= 1e-6 * num(r, "bytes_formula") for r in rows)
    words, headline = [f"Counted bytes equal the formula in {exact} of {len(rows)} rows."], []
    for ranks, rs in group(rows, lambda r: int(r["world_size"])).items():
        adamw = [r for r in rs if r["impl"] == "adamw+zero1"]
        fastest = min((r for r in rs if r["impl"] != "adamw+zero1"), key=lambda r: num(r, "step_ms"), default=None)
        if adamw and fastest:
            ratio = f"{times(num(fastest, 'step_ms') / num(adamw[0], 'step_ms'))} AdamW + ZeRO-1's"
            words.append(f"On {ranks} ranks the fastest Muon step ({fastest['impl']}) takes {ratio}.")
            headline.append([f"Muon, {ranks} ranks: the fastest design's step", f"{ratio} ({fastest['impl']})"])
    return reading(text, words, headline, rows)


@section("Backends: which collectives each backend/device pair carries here", "backends.csv", ("backends",), optional=True)
def backends_section(where: Where, rows: list[dict]):
    table, differ = [], []
    for r in rows:
        says = carries_point_to_point(r["backend"], r["device"]) or r["op"] not in ("reduce_scatter", "send/recv", "isend/irecv", "batch_isend_irecv")
        agree = (r["outcome"] == "ok") == says
        table.append([on(r), r["op"], r["outcome"], "carried" if says else "not carried", "yes" if agree else "**no**"])
        differ += [] if agree else [f"{r['op']} on {on(r)}"]
    text = ("Each op a 2-rank job of its own (`ok`: the right answer) beside `carries_point_to_point`:\n\n"
            + md_table(["backend/device", "op", "outcome here", "the course says", "agree"], table))
    agree = f"{len(rows) - len(differ)} of {len(rows)}"
    return reading(text, [f"The course's rule matches {agree} tries" + (f"; not: {', '.join(differ)}." if differ else ".")],
                   [["backends: the course's rule vs what this box carries", f"{agree} agree"]], rows)


# --------------------------------------------------------------------------- the report


def write_report(out: Path, info: dict | None = None,
                 pictures: list[tuple[Path, str]] = ()) -> tuple[Path | None, list[str]]:
    """Rewrite ``out/README.md`` from run ``info`` (None: ``out``'s record), copying in ``pictures`` (source, name);
    returns its path (None: no section had data, the old report kept) and the titles of the sections without data."""
    from_make_bench = info is not None
    if not from_make_bench:
        info = results.read_json(RUN_FILE, out)  # {} when missing, corrupt or not an object
        missing = [k for k in RUN_KEYS if k not in info]
        if info and missing:
            print(f"warning: ignoring {out / RUN_FILE}: no {', '.join(missing)}", file=sys.stderr)
        info = None if missing else info
        pictures = [(out / name, name) for name in STAGE_PICTURES if info is not None]
    # the filled sections of the report now in ``out``, by title, each marked with its run and machine
    old = (out / "README.md").read_text(errors="replace") if (out / "README.md").is_file() else ""
    found = re.search(r"Machine: \*\*(.+?)\*\*\. Run `([^`]+)`", old)
    mark = CARRIED.format(run=found.group(2) if found else "unknown", machine=found.group(1) if found else "an unknown machine")
    earlier = {}
    for chunk in old.split("\n## ")[1:]:
        title, _, text = chunk.partition("\n\n")
        text = text.split(FOOTER)[0].rstrip("\n") + "\n"
        if title in FED_BY and not text.startswith(EMPTY_TEXTS):
            earlier[title] = text if text.startswith(("_Carried over from run", "_Run `")) else mark + text
    planned = {step.get("key") for step in info["steps"]} if info else set()
    draw = Path(tempfile.mkdtemp(dir=out, prefix=".report-"))  # beside: os.replace is atomic
    try:
        for source, name in pictures:
            if source.exists():
                shutil.copyfile(source, draw / name)
        where = Where(out, draw, info["run_id"] if info else None, info["machine"] if info else "")
        body, headline, empty, carried, measured = [], [], [], [], 0
        for title, fn in SECTIONS + OPTIONAL:
            try:
                found = fn(where)
            except Exception as e:  # noqa: BLE001 - one odd file must not cost the whole report
                found = (f"_This section failed: {type(e).__name__}: {e}_\n", [], None)
            measured += found is not None
            optional = (title, fn) in OPTIONAL
            empty += [title] if found is None and not optional else []
            carried += [title] if found is None and title in earlier else []  # the better run's section stays, marked
            if found is None and optional and title not in earlier:
                continue
            nothing = NO_FILE_ROWS if info is None else NOT_PLANNED if FED_BY[title] and not planned & set(FED_BY[title]) else NO_ROWS
            text, head, rows = found or (earlier.get(title) or nothing, [], None)
            if info is None and rows:  # no run record: name the run and machine shown
                text = f"_Run `{rows[0].get('run_id')}`, {machine_of(where, rows)}._\n\n{text}"
            body.append(f"## {title}\n\n{text}")
            headline += head
        if not measured:
            return None, empty  # nothing measured: the old report is better than an empty one
        top, runs = ["# Benchmark report (`make bench`)\n"], []
        if info is None:
            top.append(f"No run record (`results/{RUN_FILE}` is missing or unreadable, as on a fresh clone): each "
                       "section shows the last run that wrote its file, named under its title.\n")
        else:
            gpus = info["setup"]["gpus"]
            kind = ["> A CPU-only run: every figure measures this machine's cores through Gloo's loopback.\n",
                    "> A one-GPU run, read as such: compute, memory and MFU describe the GPU; the ranks' collectives "
                    "cross Gloo's host path (labelled where they appear), not an interconnect.\n",
                    "> A GPU per rank over NCCL: communication timings describe this box's interconnect.\n"]
            allocator = ", ".join(f"`{name}={value}`" for name, value in info.get("allocator", {}).items())
            kept = "every step's processes kept the blocks they freed" if info.get("keeps_freed_memory") else "glibc as the user set it"
            top += [f"Machine: **{info['machine']}**. Run `{info['run_id']}`, started {info['started_utc']}, "
                    f"{info['total_s']:.0f} s in all ({'quick' if info['quick'] else 'full'}); GPU: "
                    f"{f'{gpus} x ' + info['setup']['gpu_name'] if gpus else 'none'}; LM for stages 03-06: "
                    f"`{info['model']}`.\n\n{info['setup']['picked']}\n", kind[min(gpus, 2)],
                    f"Host memory: {kept} ({allocator}).\n" if allocator else ""]
            runs = ["## Runs\n\n" + md_table(["step", "outcome", "seconds", "command"], [
                [s["title"], s["status"], f"{s['seconds']:.0f}", "`python " + " ".join(s["argv"]) + "`"] for s in info["steps"]])]
        kept = [f"Sections this run did not fill, kept from the report before it (each names its run and machine): "
                f"{'; '.join(carried)}.\n"] if carried else []
        parts = [*top, "Times: the slowest rank's median after warm-up; GB/s = 10^9 bytes/s; 1 MB = 2^20 bytes.\n", *kept,
                 "## Headline\n\n" + md_table(["what", "measured"], headline), *runs, *body,
                 FOOTER.lstrip("\n") + " from `results/`. Regenerate: `make bench`, or `python bench/report.py`.\n"]
        readme = "\n".join(p for p in parts if p)
        (draw / "README.md").write_text(readme)
        if from_make_bench:
            (draw / RUN_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        # the pictures and run record first, the README last; then the old pictures the new README does not show
        new = sorted(p.name for p in draw.iterdir())
        for name in new:
            if name != "README.md":
                os.replace(draw / name, out / name)
        os.replace(draw / "README.md", out / "README.md")
        for picture_file in out.glob("bench_*.png"):
            if picture_file.name not in new and f"]({picture_file.name})" not in readme:
                picture_file.unlink(missing_ok=True)
        return out / "README.md", empty
    finally:
        shutil.rmtree(draw, ignore_errors=True)


def main() -> None:
    path, empty = write_report(results.results_dir())
    if path is None:
        print(f"nothing to report: no rows in {results.results_dir()} for any section; "
              f"{results.results_dir() / 'README.md'} is left as it was", file=sys.stderr)
        raise SystemExit(1)
    print(f"report: {path}" + (f" (no data for: {'; '.join(empty)})" if empty else ""))


if __name__ == "__main__":
    main()
