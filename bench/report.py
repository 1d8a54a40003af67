"""Write ``results/README.md``: the report of one ``make bench`` run: tables, plots, short readings.

    python bench/report.py            # rewrite the report of the last run from results/

Reads ``results/bench_run.json`` (what ran, on what, for how long) and, from each stage's
CSV/JSON file, only the rows carrying that run's ``run_id``. Every reading is computed from
the same numbers as its table, so the words cannot drift from the figures; the stages'
READMEs explain what each measurement means. Plots need matplotlib; without it the report
says so and keeps every table. One section that fails costs that section, not the report.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import results  # noqa: E402

RUN_FILE = "bench_run.json"
MB = 2 ** 20
NO_ROWS = "_No rows from this run: the step failed or was stopped (see Runs above)._\n"
IMPL_LABEL = {"none": "no communication", "torch_ddp": "torch DDP (25 MB buckets)",
              "naive": "naive (03)", "flat": "flat (04)", "overlap": "overlap (05)",
              "bucketed": "bucketed (06)"}


def rows_of(out: Path, name: str, run_id: str) -> list[dict]:
    return [r for r in results.read_csv(name, out) if r.get("run_id") == run_id]


def entries_of(out: Path, name: str, run_id: str) -> list[dict]:
    return [v for _, v in sorted(results.read_json(name, out).items())
            if isinstance(v, dict) and v.get("run_id") == run_id]


def num(row: dict, key: str) -> float:
    return float(row[key])


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


def picture(out: Path, name: str, alt: str) -> str:
    return f"![{alt}]({name})\n" if (out / name).exists() else \
        f"_(no picture: `{name}` was not drawn: matplotlib missing, or the step did not finish)_\n"


def bars(out: Path, name: str, labels: list[str], stacks: list[tuple[str, list[float]]],
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
    fig.savefig(out / name, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- sections


def allreduce_section(out: Path, run_id: str, info: dict):
    rows = rows_of(out, "allreduce.csv", run_id)
    if not rows:
        return NO_ROWS, []
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells.setdefault((r["backend"], r["device"], int(r["world_size"]), int(r["bytes"])),
                         {})[r["impl"]] = r
    impls = [i for i in ("backend", "ring", "ring_pipelined") if any(i in c for c in cells.values())]
    table = [[f"{b}/{d}", ws, size_text(n), *[num(c[i], "busbw_gbps") if i in c else ""
                                              for i in impls],
              num(c["backend"], "time_ms_median") if "backend" in c else ""]
             for (b, d, ws, n), c in sorted(cells.items())]
    text = md_table(["backend/device", "ranks", "size", *[f"{i} busbw GB/s" for i in impls],
                     "backend ms"], table)
    largest = max(n for *_, n in cells)
    best = max((c["backend"] for k, c in cells.items() if k[3] == largest and "backend" in c),
               key=lambda r: num(r, "busbw_gbps"), default=None)
    words, headline = [], []
    if best:
        words.append(f"At {size_text(largest)} the best bus bandwidth is "
                     f"{num(best, 'busbw_gbps'):.2f} GB/s ({best['backend']}/{best['device']}, "
                     f"{best['world_size']} ranks); busbw = algbw x 2(n-1)/n, comparable across "
                     "rank counts (nccl-tests' convention).")
        headline.append([f"all-reduce bus bandwidth, {size_text(largest)}",
                         f"{num(best, 'busbw_gbps'):.2f} GB/s ({best['backend']}/"
                         f"{best['device']}, {best['world_size']} ranks)"])
    ratios = {i: [num(c[i], "busbw_gbps") / num(c["backend"], "busbw_gbps") for k, c in
                  cells.items() if k[3] >= 10 * MB and i in c and "backend" in c]
              for i in ("ring", "ring_pipelined")}
    if ratios["ring"] and ratios["ring_pipelined"]:
        words.append(f"Stage 01's rings at 10 MB and above: textbook "
                     f"{min(ratios['ring']):.2f}-{max(ratios['ring']):.2f}x the backend's busbw, "
                     f"pipelined {min(ratios['ring_pipelined']):.2f}-"
                     f"{max(ratios['ring_pipelined']):.2f}x.")
    fits = entries_of(out, "allreduce_fit.json", run_id)
    if fits:
        text += "\nFitted `t = a + N / w` (stage 06 takes its o = a and w from these):\n\n" + md_table(
            ["backend/device", "ranks", "a (us)", "w (GB/s)", "worst point error"],
            [[f"{f['backend']}/{f['device']}", f["world_size"], f["a_s"] * 1e6,
              f["w_bytes_per_s"] / 1e9, f"{max(abs(p['rel_error']) for p in f['points']):.0%}"]
             for f in fits])
    return text + "\n" + " ".join(words) + "\n\n" + picture(
        out, "bench_allreduce_busbw.png", "all-reduce bus bandwidth against size"), headline


def ddp_section(out: Path, run_id: str, info: dict):
    rows = rows_of(out, "ddp_step.csv", run_id)
    if not rows:
        return NO_ROWS, []
    r0 = rows[0]
    torch_ddp = next((r for r in rows if r["impl"] == "torch_ddp" and float(r["bucket_mb"]) == 25), None)
    best = min((r for r in rows if r["impl"] == "bucketed"), key=lambda r: num(r, "step_ms"), default=None)
    shown = [(IMPL_LABEL[i] + (f", best bucket {r['bucket_mb']} MB" if i == "bucketed" else ""), r)
             for i in ("none", "torch_ddp", "naive", "flat", "overlap", "bucketed")
             for r in [torch_ddp if i == "torch_ddp" else best if i == "bucketed" else
                       next((x for x in rows if x["impl"] == i), None)] if r is not None]
    text = (f"LM `{r0['model']}` ({int(r0['params']) / 1e6:.1f}M parameters), global batch "
            f"{r0['batch_size']}, context {r0['context_length']}, AdamW, {r0['world_size']} ranks "
            f"on {r0['backend']}/{r0['device']}, all in one process group; slowest rank's "
            "medians.\n\n" + md_table(
                ["implementation", "step ms", "fwd+bwd ms", "comm after backward ms",
                 "optimizer ms", "vs torch DDP"],
                [[label, num(r, "step_ms"), num(r, "fwd_bwd_ms"), num(r, "comm_after_backward_ms"),
                  num(r, "optimizer_ms"), f"{num(r, 'ratio_vs_torch_ddp'):.2f}x"] for label, r in shown]))
    bars(out, "bench_ddp_step.png", [label for label, _ in shown],
         [(part, [num(r, key) for _, r in shown]) for part, key in (
             ("forward + backward (overlapped communication hides here)", "fwd_bwd_ms"),
             ("communication left after backward", "comm_after_backward_ms"),
             ("optimizer", "optimizer_ms"))], "ms per training step",
         f"LM {r0['model']}, {r0['world_size']} ranks {r0['backend']}/{r0['device']}\n{info['machine']}")
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
    return text + "\n" + picture(out, "bench_ddp_step.png", "DDP step time"), headline


def bucket_section(out: Path, run_id: str, info: dict):
    entries = entries_of(out, "bucket_model.json", run_id)
    if not entries:
        return NO_ROWS, []
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
                   f"({verdict} [{lo:g}, {hi:g}])"]]


def overlap_section(out: Path, run_id: str, info: dict):
    rows = [r for r in rows_of(out, "ddp_profile.csv", run_id) if r["stage"] == "05_overlap_ddp"]
    if not rows:
        return NO_ROWS, []
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
            + picture(out, "bench_overlap_timeline.png", "timeline of naive vs overlapped DDP")), []


def tensor_parallel_section(out: Path, run_id: str, info: dict):
    rows = rows_of(out, "tensor_parallel.csv", run_id)
    if not rows:
        return NO_ROWS, []
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
                       f"{size_text(total['megatron'])} vs {size_text(total['allgather'])}"]]
    return text, []


def pipeline_section(out: Path, run_id: str, info: dict):
    rows = rows_of(out, "pipeline_bubble.csv", run_id)
    if not rows:
        return NO_ROWS, []
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["schedule"], int(r["micro_batches"]), int(r["chunks"]),
                           float(r["emulated_ms"])), []).append(r)
    order = ["gpipe", "1f1b", "interleaved", "zbh1"]
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
    text = (f"{r0['world_size']} stages, batch {r0['batch']}, {r0['backend']}/{r0['device']}. Idle "
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
    return text, headline


def sharding_section(out: Path, run_id: str, info: dict):
    rows = rows_of(out, "sharding.csv", run_id)
    if not rows:
        return NO_ROWS, []
    r0 = rows[0]
    order = ["ddp", "zero1", "zero2", "fsdp", "torch_zero1", "torch_fsdp"]
    rows = sorted(rows, key=lambda r: (r["checkpointing"],
                                       order.index(r["impl"]) if r["impl"] in order else 9))

    def pair(r, key):  # counted (predicted); "-" where this box could not count it
        got, pred = r.get(key, ""), r.get(f"{key}_predicted", "")
        return ("-" if got in ("", None) else size_text(float(got))) + (
            f" ({size_text(float(pred))})" if pred not in ("", None) else "")
    text = (f"LM `{r0['model']}`, AdamW, {r0['world_size']} ranks on {r0['backend']}/{r0['device']}: "
            "bytes per rank counted from the tensors themselves (each storage once), predicted in "
            "brackets where a formula exists.\n\n"
            + md_table(["impl", "checkpointing", "step ms", "params", "grads", "optimizer state",
                        "peak", "activations", "sent per step"],
                       [[r["impl"], r["checkpointing"], num(r, "step_ms"), pair(r, "param_bytes"),
                         pair(r, "grad_bytes"), pair(r, "optim_bytes"), pair(r, "peak_bytes"),
                         pair(r, "activation_bytes"), pair(r, "sent_bytes")] for r in rows]))
    plain = [r for r in rows if r["checkpointing"] in ("off", "False", "0", "")] or rows
    bars(out, "bench_sharding_bytes.png", [r["impl"] for r in plain],
         [(part, [num(r, key) / MB for r in plain]) for part, key in (
             ("parameters", "param_bytes"), ("gradients", "grad_bytes"),
             ("optimizer state", "optim_bytes"))], "MiB per rank, held between steps",
         f"LM {r0['model']}, {r0['world_size']} ranks\n{info['machine']}")
    return text + "\n" + picture(out, "bench_sharding_bytes.png", "bytes per rank by strategy"), []


SECTIONS = [("All-reduce: time and bus bandwidth (stage 02)", allreduce_section),
            ("Data-parallel training step (stages 03-06, torch DDP beside them)", ddp_section),
            ("Bucket size: the sweep and the model (stage 06)", bucket_section),
            ("Overlap, seen in a profile (stage 05 `--profile`)", overlap_section),
            ("Tensor parallelism: bytes per MLP (stage 07)", tensor_parallel_section),
            ("Pipeline schedules: the bubble (stage 07)", pipeline_section),
            ("Sharding: memory and communication per rank (stage 07)", sharding_section)]


def write_report(out: Path) -> Path:
    info = results.read_json(RUN_FILE, out)
    run_id, setup = info["run_id"], info["setup"]
    body, headline = [], []
    for title, section in SECTIONS:
        try:
            text, head = section(out, run_id, info)
        except Exception as e:  # noqa: BLE001 - one odd file must not cost the whole report
            text, head = f"_This section failed: {type(e).__name__}: {e}_\n", []
        body.append(f"## {title}\n\n{text}")
        headline += head
    gpu = f"{setup['gpus']} x {setup['gpu_name']}" if setup["gpus"] else "none"
    parts = [
        "# Benchmark report (`make bench`)\n",
        f"Machine: **{info['machine']}**. Run `{run_id}`, started {info['started_utc']}, "
        f"{info['total_s']:.0f} s in all ({'quick' if info['quick'] else 'full'}); GPU: {gpu}; "
        f"LM for stages 03-06: `{info['model']}` (the ledger's: its step's title).\n\n"
        f"{setup['picked']}\n",
        "> A CPU-only run: every figure measures this machine's cores through Gloo's loopback, "
        "not a GPU interconnect.\n" if not setup["gpus"] else "",
        "Times are the slowest rank's median after warm-up; bandwidths in GB/s = 10^9 bytes/s; "
        "sizes in binary units (1 MB = 2^20 bytes).\n",
        "## Headline\n\n" + (md_table(["what", "measured"], headline) if headline else NO_ROWS),
        "## Runs\n\n" + md_table(["step", "outcome", "seconds", "command"],
                                 [[s["title"], s["status"], f"{s['seconds']:.0f}",
                                   "`python " + " ".join(s["argv"]) + "`"] for s in info["steps"]]),
        *body,
        "---\nWritten by `bench/report.py` from this run's rows in `results/*.csv` and "
        "`results/*.json`. Regenerate: `make bench`, or `python bench/report.py` alone.\n"]
    path = out / "README.md"
    path.write_text("\n".join(p for p in parts if p))
    return path


if __name__ == "__main__":
    print(f"report: {write_report(results.results_dir())}")
