"""Write ``results/README.md``: the report of one ``make bench`` run, with plots and readings.

    python bench/report.py            # rewrite the report of the last run from results/

Reads ``results/bench_run.json`` (what ran, on what, for how long; written by
``bench/make_bench.py``) and, from each stage's shared CSV/JSON file, only the rows carrying
this run's ``run_id``. The CSVs keep one row per configuration, so a later run of the same
configuration (``make 02`` after ``make bench``, say) replaces a row, and a report rewritten
after that shows the section shorter or empty: rewrite it right after the run. Each table and
plot gets a short reading computed from the same
numbers, so the words cannot drift from the figures. Plots (``bench_*.png``) need matplotlib;
without it the report says so and keeps every table.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import results  # noqa: E402

RUN_FILE = "bench_run.json"
REPORT = "README.md"
MB = 2 ** 20
IMPL_ORDER = ["none", "torch_ddp", "naive", "flat", "overlap", "bucketed"]
IMPL_LABEL = {"none": "no communication", "torch_ddp": "torch DDP (25 MB buckets)",
              "naive": "naive (03)", "flat": "flat (04)", "overlap": "overlap (05)",
              "bucketed": "bucketed (06)"}


# --------------------------------------------------------------------------- reading results


def load_rows(out: Path, name: str, run_id: str) -> list[dict]:
    """This run's rows of a shared CSV under ``out``."""
    return [r for r in results.read_csv(name, out) if r.get("run_id") == run_id]


def load_entries(out: Path, name: str, run_id: str) -> list[dict]:
    """This run's entries of a shared JSON file (a dict keyed by configuration) under ``out``."""
    data = results.read_json(name, out) or {}
    return [v for _, v in sorted(data.items()) if v.get("run_id") == run_id]


def num(row: dict, key: str) -> float:
    return float(row[key])


def size_text(nbytes: float) -> str:
    """65536 -> '64KB' (binary units). Stage 02's format_size, repeated: the report imports
    no stage."""
    for unit, scale in (("GB", 2 ** 30), ("MB", MB), ("KB", 2 ** 10)):
        if nbytes >= scale:
            v = nbytes / scale
            return f"{v:g}{unit}" if v == int(v) else f"{v:.3g}{unit}"
    return f"{nbytes:g}B"


def span(values, unit: str = "", fmt: str = ".3g") -> str:
    """'0.3-0.7 GB/s', or '0.5 GB/s' when they are all the same."""
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def md_table(headers: list[str], rows: list[list]) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def picture(out: Path, name: str, alt: str) -> str:
    if (out / name).exists():
        return f"![{alt}]({name})\n"
    return f"_(no picture: `{name}` was not drawn; matplotlib missing or the step did not finish)_\n"


NO_ROWS = "_No rows from this run: the step failed or was stopped (see Runs above)._\n"


# --------------------------------------------------------------------------- sections


def allreduce_section(out: Path, run_id: str) -> tuple[str, list]:
    rows = load_rows(out, "allreduce.csv", run_id)
    parts = ["## All-reduce: time and bus bandwidth (stage 02)\n"]
    if not rows:
        return "\n".join(parts + [NO_ROWS]), []
    cells: dict[tuple, dict] = {}
    for r in rows:
        key = (r["backend"], r["device"], int(r["world_size"]), int(r["bytes"]))
        cells.setdefault(key, {})[r["impl"]] = r
    table = []
    for (backend, device, ws, nbytes), by in sorted(cells.items()):
        b, ring = by.get("backend"), by.get("ring")
        ratio = num(ring, "busbw_gbps") / num(b, "busbw_gbps") if b and ring else None
        table.append([f"{backend}/{device}", ws, size_text(nbytes),
                      num(b, "time_ms_median") if b else "", num(b, "busbw_gbps") if b else "",
                      num(ring, "time_ms_median") if ring else "",
                      num(ring, "busbw_gbps") if ring else "",
                      f"{ratio:.2f}x" if ratio else ""])
    parts.append(md_table(["backend/device", "ranks", "size", "backend ms", "backend busbw GB/s",
                           "ring ms", "ring busbw GB/s", "ring / backend"], table))
    # reading
    backend_rows = [r for r in rows if r["impl"] == "backend"]
    largest = max(int(r["bytes"]) for r in backend_rows) if backend_rows else 0
    smallest = min(int(r["bytes"]) for r in backend_rows) if backend_rows else 0
    best = max((r for r in backend_rows if int(r["bytes"]) == largest),
               key=lambda r: num(r, "busbw_gbps"), default=None)
    low = [r for r in backend_rows if int(r["bytes"]) == smallest]
    ratios = [num(by["ring"], "busbw_gbps") / num(by["backend"], "busbw_gbps")
              for (_, _, _, nbytes), by in cells.items()
              if nbytes >= 10 * MB and "ring" in by and "backend" in by]
    words = []
    if best:
        words.append(f"At {size_text(largest)} the best bus bandwidth is "
                     f"{num(best, 'busbw_gbps'):.2f} GB/s ({best['backend']}/{best['device']}, "
                     f"{best['world_size']} ranks); busbw = algbw x 2(n-1)/n, the bytes each "
                     "link carries, so figures for different rank counts compare directly "
                     "(nccl-tests' convention).")
    if low and smallest < largest:
        words.append(f"At {size_text(smallest)} the same calls reach only "
                     f"{span([num(r, 'busbw_gbps') for r in low], ' GB/s')}: small messages pay a "
                     "fixed latency per call, which is why DDP groups gradients into buckets.")
    if ratios:
        words.append(f"Stage 01's ring all-reduce, built from sends and receives, reaches "
                     f"{span(ratios, 'x', '.2f')} the backend's bus bandwidth at 10 MB and "
                     "above.")
    parts += [" ".join(words) + "\n", picture(out, "bench_allreduce_busbw.png",
                                              "all-reduce bus bandwidth against size")]
    headline = []
    if best:
        headline.append([f"all-reduce bus bandwidth, {size_text(largest)}",
                         f"{num(best, 'busbw_gbps'):.2f} GB/s ({best['backend']}/{best['device']}, "
                         f"{best['world_size']} ranks)"])

    fits = load_entries(out, "allreduce_fit.json", run_id)
    if fits:
        ft = []
        for f in fits:
            worst = max(abs(p["rel_error"]) for p in f["points"])
            ft.append([f"{f['backend']}/{f['device']}", f["world_size"], f["a_s"] * 1e6,
                       f["w_bytes_per_s"] / 1e9, size_text(max(f["a_s"], 0) * f["w_bytes_per_s"]),
                       f"{worst:.0%}"])
        parts += ["### Latency-bandwidth fit: t = a + N / w\n",
                  md_table(["backend/device", "ranks", "a (us)", "w (GB/s)",
                            "N where a = N / w", "worst point error"], ft)]
        # describe the group the DDP stages ran on (stage 06 took its o and w from it)
        ddp = load_rows(out, "ddp_step.csv", run_id)
        ddp_key = (ddp[0]["backend"], ddp[0]["device"], int(ddp[0]["world_size"])) if ddp else None
        f0 = next((f for f in fits if (f["backend"], f["device"], f["world_size"]) == ddp_key),
                  fits[0])
        words = [f"Each group's times are fitted by t = a + N/w (least squares on relative "
                 f"error). For {f0['backend']}/{f0['device']} with {f0['world_size']} ranks"]
        if f0["a_s"] > 0:
            words.append(f"a call costs about {f0['a_s'] * 1e6:.0f} us before any byte moves "
                         f"and then {f0['w_bytes_per_s'] / 1e9:.2f} GB/s, so below about "
                         f"{size_text(f0['a_s'] * f0['w_bytes_per_s'])} latency dominates.")
        else:
            words.append(f"the bandwidth is {f0['w_bytes_per_s'] / 1e9:.2f} GB/s but the "
                         "latency could not be pinned down (a <= 0: even the smallest size "
                         "measured is bandwidth-bound; add smaller sizes).")
        if ddp_key == (f0["backend"], f0["device"], f0["world_size"]):
            words.append("Stage 06's bucket-size model takes o = a and w from this group.")
        parts.append(" ".join(words) + "\n")
    return "\n".join(parts), headline


def _bucket(r: dict) -> float | None:
    return float(r["bucket_mb"]) if r.get("bucket_mb") not in ("", None) else None


def plot_ddp(out: Path, shown: list[tuple[str, dict]], title: str) -> None:
    plt = results.pyplot()
    if plt is None or not shown:
        return
    labels = [label for label, _ in shown]
    parts = [("forward + backward (compute; overlapped comm hides here)", "fwd_bwd_ms", "#3182bd"),
             ("communication left after backward (exposed)", "comm_after_backward_ms", "#e6550d"),
             ("optimizer", "optimizer_ms", "#a1d99b")]
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(shown) + 1.6))
    left = [0.0] * len(shown)
    for name, key, color in parts:
        vals = [num(r, key) for _, r in shown]
        ax.barh(labels, vals, left=left, color=color, label=name)
        left = [a + b for a, b in zip(left, vals)]
    for i, (_, r) in enumerate(shown):
        ax.text(left[i], i, f" {num(r, 'step_ms'):.0f} ms", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per training step (slowest rank's median)")
    ax.set_xlim(0, max(left) * 1.18)
    ax.set_title(title, fontsize=9)
    fig.legend(fontsize=7, loc="lower center", ncol=3, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(out / "bench_ddp_step.png", dpi=110)
    plt.close(fig)


def ddp_reading(by: dict, torch_default, best_bucketed, r0: dict, info: dict):
    """The sentences under the DDP table and its headline rows, from the same rows."""
    step = {impl: num(by[impl][0], "step_ms") for impl in ("none", "naive", "flat", "overlap")
            if impl in by}
    comm = {impl: num(by[impl][0], "comm_after_backward_ms")
            for impl in ("naive", "flat", "overlap") if impl in by}
    words = []
    if "none" in step and torch_default:
        words.append(f"Without communication a step takes {step['none']:.1f} ms; torch DDP "
                     f"takes {num(torch_default, 'step_ms'):.1f} ms.")
    if len(comm) == 3 and best_bucketed:
        hidden = [f"{comm['naive'] - ms:.1f} ms for {name}" for name, ms in
                  (("overlap", comm["overlap"]),
                   ("bucketed", num(best_bucketed, "comm_after_backward_ms")))
                  if ms < comm["naive"]]
        words.append(
            f"After backward, naive DDP still waits {comm['naive']:.1f} ms (one all-reduce per "
            f"tensor, all started after backward), flat {comm['flat']:.1f} ms (one big "
            f"all-reduce), overlap {comm['overlap']:.1f} ms and bucketed "
            f"{num(best_bucketed, 'comm_after_backward_ms'):.1f} ms. Overlap and bucketed "
            "start their all-reduces inside backward; "
            + (f"against naive, that took {' and '.join(hidden)} off the wait."
               if hidden else "here that took nothing off naive's wait"
               + (", because communication and backward compete for the same cores."
                  if r0["backend"] == "gloo" else "."))
            + " Communication that runs during backward shows up as a longer fwd+bwd "
            "column, not in the exposed one.")
        if comm["overlap"] > comm["flat"]:
            words.append("Overlap still waits longer than flat: it issues one all-reduce per "
                         "parameter tensor, each paying the per-call latency a of stage 02's "
                         "fit, where flat pays it once; buckets get both benefits.")
    headline = []
    if best_bucketed and torch_default:
        ratio = num(best_bucketed, "step_ms") / num(torch_default, "step_ms")
        faster = all(x in step for x in ("naive", "flat", "overlap")) and \
            max(step["overlap"], num(best_bucketed, "step_ms")) < min(step["naive"], step["flat"])
        words.append(
            f"BucketedDDP at its best bucket size ({best_bucketed['bucket_mb']} MB) is "
            f"{ratio:.2f}x torch DDP's step time (target: within 1.05x, "
            f"{'met' if ratio <= 1.05 else 'missed'}); overlap and bucketed are "
            f"{'both faster' if faster else 'not both faster'} than naive and flat.")
        headline += [["BucketedDDP (best bucket) vs torch DDP, step time",
                      f"{ratio:.2f}x ({num(best_bucketed, 'step_ms'):.1f} vs "
                      f"{num(torch_default, 'step_ms'):.1f} ms, LM {r0['model']})"],
                     ["communication left after backward: " + ", ".join([*comm, "bucketed"]),
                      ", ".join(f"{v:.1f}" for v in comm.values())
                      + f", {num(best_bucketed, 'comm_after_backward_ms'):.1f} ms"]]
    if info["setup"]["gpus"] == 1 and r0["model"] == "course":
        words.append("For comparison, a plain training loop measured on one H100 before this "
                     "project (2 ranks over Gloo, d_model 512, 4 layers, context 256, batch 4) "
                     "took 8.4 ms/step without communication, 71.4 ms naive and 45.4 ms with "
                     "torch DDP.")
    return words, headline


def ddp_section(out: Path, run_id: str, info: dict) -> tuple[str, list]:
    rows = load_rows(out, "ddp_step.csv", run_id)
    parts = ["## Data-parallel training step (stages 03-06, torch DDP beside them)\n"]
    if not rows:
        return "\n".join(parts + [NO_ROWS]), []
    r0 = rows[0]
    by = {}
    for r in rows:
        by.setdefault(r["impl"], []).append(r)
    torch_default = next((r for r in by.get("torch_ddp", []) if _bucket(r) == 25), None)
    best_bucketed = min(by.get("bucketed", []), key=lambda r: num(r, "step_ms"), default=None)
    shown = []
    for impl in IMPL_ORDER:
        if impl == "torch_ddp":
            r = torch_default
        elif impl == "bucketed":
            r = best_bucketed
        else:
            r = by.get(impl, [None])[0]
        if r is not None:
            label = IMPL_LABEL[impl] + (f", best of sweep: {r['bucket_mb']} MB"
                                        if impl == "bucketed" else "")
            shown.append((label, r))
    parts.append(
        f"LM `{r0['model']}` ({int(r0['params']) / 1e6:.1f}M parameters), global batch "
        f"{r0['batch_size']}, context {r0['context_length']}, AdamW, {r0['world_size']} ranks on "
        f"{r0['backend']}/{r0['device']}; {span([int(r['steps']) for r in rows], '', 'd')} timed "
        f"steps per case (pooled over the run's rounds, each after {r0['warmup']} warm-up "
        "steps), slowest rank's median (each part's median, so the parts need not add up "
        "exactly to the step's). All cases ran in one process group, "
        "so their ratios are fair.\n")
    parts.append(md_table(
        ["implementation", "step ms", "fwd+bwd ms", "comm after backward ms", "optimizer ms",
         "comm share", "vs torch DDP"],
        [[label, num(r, "step_ms"), num(r, "fwd_bwd_ms"), num(r, "comm_after_backward_ms"),
          num(r, "optimizer_ms"), f"{num(r, 'comm_share'):.0%}",
          f"{num(r, 'ratio_vs_torch_ddp'):.2f}x"] for label, r in shown]))
    plot_ddp(out, shown, f"training step, LM {r0['model']}, {r0['world_size']} ranks "
                         f"{r0['backend']}/{r0['device']}\n{info['machine']}")
    words, headline = ddp_reading(by, torch_default, best_bucketed, r0, info)
    parts += [" ".join(words) + "\n",
              picture(out, "bench_ddp_step.png", "DDP step time, compute vs exposed communication")]
    return "\n".join(parts), headline


def plot_buckets(out: Path, sweep: list[dict], torch_steps: dict, model: dict, title: str):
    plt = results.pyplot()
    if plt is None or not sweep:
        return
    xs = [float(s["bucket_mb"]) for s in sweep]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.plot(xs, [float(s["measured_step_ms"]) for s in sweep], "o-", label="BucketedDDP (06)")
    tx = [x for x in xs if x in torch_steps]
    a1.plot(tx, [torch_steps[x] for x in tx], "s--", label="torch DDP, same bucket cap")
    a1.set_ylabel("ms per step")
    a1.set_title("step time", fontsize=9)
    a2.plot(xs, [float(s["measured_comm_after_bwd_ms"]) for s in sweep], "o-",
            label="measured")
    a2.plot(xs, [float(s["model_comm_after_bwd_ms"]) for s in sweep], "^:",
            label="model: n_b o + s / (n_b w)")
    a2.set_ylabel("ms of communication left after backward")
    a2.set_title("exposed communication", fontsize=9)
    for ax in (a1, a2):
        ax.set_xscale("log")
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.minorticks_off()
        ax.axvline(model["predicted_best_bucket_mb"], color="grey", linestyle="--",
                   label=f"model's best: {model['predicted_best_bucket_mb']:.3g} MiB")
        ax.set_xlabel("bucket cap (MB = 2^20 bytes)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "bench_bucket_sweep.png", dpi=110)
    plt.close(fig)


def bucket_section(out: Path, run_id: str, info: dict) -> tuple[str, list]:
    parts = ["## Bucket size: the sweep and the model (stage 06)\n"]
    entries = load_entries(out, "bucket_model.json", run_id)
    if not entries:
        return "\n".join(parts + [NO_ROWS]), []
    m = entries[0]
    torch_steps = {_bucket(r): num(r, "step_ms") for r in load_rows(out, "ddp_step.csv", run_id)
                   if r["impl"] == "torch_ddp"}
    sweep = sorted(m["sweep"], key=lambda s: float(s["bucket_mb"]))
    parts.append(md_table(
        ["bucket cap MB", "buckets", "BucketedDDP step ms", "torch DDP step ms",
         "comm after backward ms (measured)", "model ms"],
        [[float(s["bucket_mb"]), s["buckets"], float(s["measured_step_ms"]),
          torch_steps.get(float(s["bucket_mb"]), ""), float(s["measured_comm_after_bwd_ms"]),
          float(s["model_comm_after_bwd_ms"])] for s in sweep]))
    plot_buckets(out, sweep, torch_steps, m, f"LM {m['model']}, {m['world_size']} ranks "
                 f"{m['backend']}/{m['device']}\n{m['machine']}")
    lo, hi = m["neighbour_range_mb"]
    parts.append(
        f"The model: with s = {m['gradient_bytes'] / MB:.1f} MiB of gradients in n_b buckets, "
        f"the communication left after backward is about n_b o + s/(n_b w) (the last "
        f"bucket's transfer plus a per-call cost o that does not overlap), smallest at "
        f"n_b = sqrt(s/(w o)). With o = {m['o_s'] * 1e6:.0f} us and w = "
        f"{m['w_bytes_per_s'] / 1e9:.2f} GB/s from {m['fit_source']} it predicts "
        + (f"{m['predicted_best_n_buckets']:.1f} buckets of {m['predicted_best_bucket_mb']:.3g} MiB; "
           if m["predicted_best_n_buckets"] >= 1 else
           "a single bucket (the optimum n_b is below one: latency dominates); ") +
        f"the measured best step time was at {m['measured_best_bucket_mb']:g} MB, and the "
        f"prediction lies {'within' if m['prediction_within_neighbours'] else 'outside'} that "
        f"size and its neighbours [{lo:g}, {hi:g}] MB.")
    above = sum(float(x["measured_comm_after_bwd_ms"]) > float(x["model_comm_after_bwd_ms"])
                for x in sweep)
    if above:
        contention = ("backward and communication compete for the same cores"
                      if m["device"] == "cpu" else
                      "communication competes with backward for the GPU" +
                      (" and for the host copies Gloo makes" if m["backend"] == "gloo" else ""))
        parts[-1] += (f" The measured exposed communication sits above the model at {above} of "
                      f"{len(sweep)} sizes: {contention}, which the model, fitted on an idle "
                      "machine, does not see.")
    parts[-1] += "\n"
    parts.append(picture(out, "bench_bucket_sweep.png", "bucket sweep with the model"))
    headline = [["bucket size: model's best vs measured best",
                 f"{m['predicted_best_bucket_mb']:.3g} MiB vs {m['measured_best_bucket_mb']:g} MB "
                 f"({'within' if m['prediction_within_neighbours'] else 'outside'} "
                 f"[{lo:g}, {hi:g}])"]]
    return "\n".join(parts), headline


def overlap_section(out: Path, run_id: str) -> tuple[str, list]:
    parts = ["## Overlap, seen in a profile (stage 05 `--profile`)\n"]
    rows = [r for r in load_rows(out, "ddp_profile.csv", run_id)
            if r["stage"] == "05_overlap_ddp"]
    if not rows:
        return "\n".join(parts + [NO_ROWS]), []
    parts.append(md_table(
        ["case", "step ms", "backward ms", "all-reduces", "comm during backward ms",
         "comm after backward ms"],
        [[r["case"], num(r, "step_ms"), num(r, "backward_ms"), r["all_reduces"],
          num(r, "comm_during_backward_ms"), num(r, "comm_after_backward_ms")] for r in rows]))
    words = [f"One profiled training step on rank 0 (LM `{rows[0]['model']}`, "
             f"{rows[0]['world_size']} ranks {rows[0]['backend']}/{rows[0]['device']}), the "
             "all-reduces read from torch.profiler's trace (Gloo's worker thread or NCCL's "
             "kernels)."]
    for r in rows:
        total = num(r, "comm_during_backward_ms") + num(r, "comm_after_backward_ms")
        share = num(r, "comm_during_backward_ms") / total if total else 0.0
        words.append(f"{r['case']}: {share:.0%} of its {total:.1f} ms of communication ran "
                     "while backward was still computing.")
    parts += [" ".join(words) + "\n",
              picture(out, "bench_overlap_timeline.png", "timeline of naive vs overlapped DDP")]
    return "\n".join(parts), []


def tensor_parallel_section(out: Path, run_id: str) -> tuple[str, list]:
    parts = ["## Tensor parallelism: bytes and time per MLP (stage 07)\n"]
    byte_rows = load_rows(out, "tensor_parallel.csv", run_id)
    time_rows = load_rows(out, "tensor_parallel_time.csv", run_id)
    if not byte_rows:
        return "\n".join(parts + [NO_ROWS]), []
    sums: dict[tuple, dict] = {}
    for r in byte_rows:
        key = (int(r["world_size"]), r["variant"])
        d = sums.setdefault(key, {"forward": 0, "backward": 0})
        d[r["phase"]] += int(r["bytes_counted"])
    times = {(int(r["world_size"]), r["variant"]): r for r in time_rows}
    table = []
    for (ws, variant), d in sorted(sums.items()):
        t, single = times.get((ws, variant)), times.get((ws, "single"))  # each run's yardstick
        table.append([ws, variant, size_text(d["forward"]), size_text(d["backward"]),
                      num(t, "fwd_bwd_ms") if t else "",
                      num(single, "fwd_bwd_ms") if single else "",
                      f"{num(t, 'speedup_vs_single'):.2f}x" if t else ""])
    r0 = byte_rows[0]
    parts.append(f"MLP d_model {r0['d_model']} -> d_ff {r0['d_ff']} -> d_model over "
                 f"{r0['tokens']} tokens, float32, {r0['backend']}/{r0['device']}. Bytes are the "
                 "collectives' payloads per forward and per backward, counted by the autograd "
                 "functions (and equal to the prediction, which the script checks).\n")
    parts.append(md_table(["ranks", "variant", "forward bytes", "backward bytes",
                           "fwd+bwd ms", "one process ms", "vs one process"], table))
    mg = [d for (ws, v), d in sums.items() if v == "megatron"]
    ag = [d for (ws, v), d in sums.items() if v == "allgather"]
    words = []
    if mg and ag:
        m_b = mg[0]["forward"] + mg[0]["backward"]
        a_b = ag[0]["forward"] + ag[0]["backward"]
        words.append(f"Megatron's column-then-row split needs one all-reduce forward and one "
                     f"backward ({size_text(m_b)} per MLP in all); all-gathering after every "
                     f"layer moves {size_text(a_b)}, {a_b / m_b:.1f}x as much, because it also "
                     "ships the d_ff-wide activation.")
    if times:
        if r0["device"] == "cpu":
            words.append("Here the ranks share this machine's CPU cores (each rank, and the "
                         "single process on rank 0, runs cores / ranks threads), so compare the "
                         "variants with each other rather than with one process.")
        elif r0["backend"] == "gloo":
            words.append("Here the ranks share one GPU and talk through Gloo, so the times show "
                         "what the communication costs more than the speed-up tensor "
                         "parallelism brings across separate GPUs.")
        else:
            words.append("Each rank has its own GPU and the collectives run over NCCL.")
    parts.append(" ".join(words) + "\n")
    headline = []
    if mg and ag:
        headline.append(["tensor parallel MLP: bytes per forward+backward, Megatron vs all-gather",
                         f"{size_text(mg[0]['forward'] + mg[0]['backward'])} vs "
                         f"{size_text(ag[0]['forward'] + ag[0]['backward'])}"])
    return "\n".join(parts), headline


def plot_pipeline(out: Path, agg: dict, stages: int, title: str) -> None:
    plt = results.pyplot()
    if plt is None or not agg:
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for schedule, marker in (("gpipe", "o"), ("1f1b", "s")):
        pts = sorted((m, a["idle"]) for (s, m), a in agg.items() if s == schedule)
        if pts:
            ax.plot([m for m, _ in pts], [i for _, i in pts], marker=marker,
                    label=f"{schedule}, measured (mean over stages)")
    ms = sorted({m for _, m in agg})
    fine = [1 + i * (max(ms) - 1) / 100 for i in range(101)]
    ax.plot(fine, [(stages - 1) / (m + stages - 1) for m in fine], "k--",
            label="(p-1)/(m+p-1)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.minorticks_off()
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("idle share of the step")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "bench_pipeline_bubble.png", dpi=110)
    plt.close(fig)


def pipeline_section(out: Path, run_id: str, info: dict) -> tuple[str, list]:
    parts = ["## Pipeline parallelism: the bubble (stage 07)\n"]
    rows = load_rows(out, "pipeline_bubble.csv", run_id)
    if not rows:
        return "\n".join(parts + [NO_ROWS]), []
    agg: dict[tuple, dict] = {}
    for r in rows:
        a = agg.setdefault((r["schedule"], int(r["micro_batches"])),
                           {"idles": [], "peaks": [], "row": r})
        a["idles"].append(num(r, "idle_share"))
        a["peaks"].append(int(r["peak_held"]))
    for a in agg.values():
        a["idle"] = statistics.fmean(a["idles"])
    r0 = rows[0]
    p = int(r0["world_size"])
    order = sorted(agg, key=lambda k: (k[0] != "gpipe", k[1]))
    parts.append(f"{p} stages of a {r0['layers']}-block residual MLP (d_model {r0['d_model']}, "
                 f"hidden {r0['hidden']}), batch {r0['batch']} split into m micro-batches, "
                 f"{r0['backend']}/{r0['device']}. Idle share = 1 - busy / step per stage, median "
                 "of the timed passes, averaged over stages.\n")
    parts.append(md_table(
        ["schedule", "m", "idle (measured)", "idle (unit-time simulation)", "(p-1)/(m+p-1)",
         "micro-batches held, per stage", "step ms"],
        [[s, m, agg[(s, m)]["idle"], num(agg[(s, m)]["row"], "idle_share_simulated"),
          num(agg[(s, m)]["row"], "idle_share_formula"), " ".join(map(str, agg[(s, m)]["peaks"])),
          num(agg[(s, m)]["row"], "step_ms")] for s, m in order]))
    plot_pipeline(out, agg, p, f"pipeline bubble, {p} stages, {r0['backend']}/{r0['device']}\n"
                               f"{info['machine']}")
    m_max = max(m for _, m in agg)
    formula = num(agg[order[-1]]["row"], "idle_share_formula")  # (p-1)/(m+p-1) at m_max
    words = [f"With p = {p} stages the ideal schedule leaves each stage idle (p-1)/(m+p-1) of "
             f"the step: {(p - 1) / p:.2f} with one micro-batch, {formula:.2f} with {m_max}."]
    g, f = agg.get(("gpipe", m_max)), agg.get(("1f1b", m_max))
    if g and f:
        text = f"Measured at m = {m_max}: GPipe {g['idle']:.2f}, 1F1B {f['idle']:.2f}"
        if min(g["idle"], f["idle"]) > formula + 0.02:
            text += ("; above the formula, because sends, receives and per-micro-batch "
                     "overheads add time the unit-time model does not count" +
                     (f", and more so here where the stages share the same "
                      f"{'cores' if r0['device'] == 'cpu' else 'GPU'}."
                      if r0["backend"] == "gloo" else "."))
        else:
            text += ", close to the formula."
        words.append(text)
        same = abs(g["idle"] - f["idle"]) < 0.05
        words.append(("Their bubbles are about the same" if same else
                      f"{'1F1B' if f['idle'] < g['idle'] else 'GPipe'} idled less here") +
                     f"; the difference that matters is memory: GPipe holds all "
                     f"{max(g['peaks'])} micro-batches' activations at its peak and 1F1B at most "
                     f"{max(f['peaks'])}.")
    parts += [" ".join(words) + "\n",
              picture(out, "bench_pipeline_bubble.png", "pipeline idle share against micro-batches")]
    headline = []
    if g and f:
        headline.append([f"pipeline idle share, {p} stages, m = {m_max}: GPipe, 1F1B, formula",
                         f"{g['idle']:.2f}, {f['idle']:.2f}, {formula:.2f}"])
    return "\n".join(parts), headline


# --------------------------------------------------------------------------- the report


def machine_section(info: dict) -> str:
    setup = info["setup"]
    gpu = f"{setup['gpus']} x {setup['gpu_name']}" if setup["gpus"] else "none"
    backends = {"cpu": "gloo, CPU tensors", "cuda": f"{setup['backend']}, CUDA tensors"}
    rows = [["GPU", gpu], ["CPU cores", info["cpu_cores"]], ["torch", info["torch"]],
            ["backend for stages 03-07", backends[setup["device"]]],
            ["mode", "quick (BENCH_QUICK=1)" if info["quick"] else "full"],
            ["LM for stages 03-06", info["model"]],
            ["started", info["started_utc"]],
            ["whole run", f"{info['total_s']:.0f} s ({info['total_s'] / 60:.1f} min)"]]
    text = md_table(["machine", ""], rows) + "\n" + setup["picked"] + "\n"
    if setup["gpus"] == 0:
        text += ("\n> This is a CPU-only run: no GPU was available where it ran. Every figure "
                 "below measures this machine's cores and memory through Gloo's loopback, not "
                 "a GPU interconnect; run `make bench` on a GPU box to measure one.\n")
    return text


def write_report(out: Path) -> Path:
    info = results.read_json(RUN_FILE, out)
    run_id = info["run_id"]
    sections, headline = [], []
    for section, args in ((allreduce_section, ()), (ddp_section, (info,)),
                          (bucket_section, (info,)), (overlap_section, ()),
                          (tensor_parallel_section, ()), (pipeline_section, (info,))):
        try:
            text, head = section(out, run_id, *args)
        except Exception as e:  # one odd file must not cost the whole report
            text, head = (f"## {section.__name__}\n\n_This section failed: "
                          f"{type(e).__name__}: {e}_\n"), []
        sections.append(text)
        headline += head
    runs = md_table(["step", "outcome", "seconds", "command"],
                    [[s["title"], s["status"], f"{s['seconds']:.0f}",
                      "`python " + " ".join(s["argv"]) + "`"]
                     for s in info["steps"]])
    parts = [
        "# Benchmark report (`make bench`)\n",
        f"Machine: **{info['machine']}**. Run `{run_id}`.\n",
        machine_section(info),
        "Times are the slowest rank's median after warm-up; bandwidths in GB/s = 10^9 bytes/s; "
        "buffer and bucket sizes in binary units (1 MB = 2^20 bytes). Each stage's README "
        "explains its measurement in full.\n",
        "## Headline\n", md_table(["what", "measured"], headline) if headline else NO_ROWS,
        "## Runs\n", runs,
        *sections,
        "---\nWritten by `bench/report.py` from this run's rows in `results/*.csv` and "
        "`results/*.json` (rows of other runs are left out). Regenerate: `make bench`, or "
        "`python bench/report.py` for the report alone.\n",
    ]
    path = out / REPORT
    path.write_text("\n".join(parts))
    return path


if __name__ == "__main__":
    print(f"report: {write_report(results.results_dir())}")
