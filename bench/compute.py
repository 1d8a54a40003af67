"""Compute on one device at world size 1: what a rank's GPU does between its collectives.

    python bench/compute.py --device cuda --models course,small --batch-size 4 --context-length 256
    python bench/compute.py --device cpu --models tiny --batch-size 4 --context-length 64

Where ranks share one GPU over Gloo, stages 03-07's step times measure Gloo's host path as much
as the GPU; this measures the device alone, at one rank's shapes. First the peaks MFU is against,
timed here (a spec sheet's wrong peak is how MFU comes out above 100%): a float32 matmul (on a
GPU TF32 and bfloat16 too) and the copy bandwidth, the limit of the optimizer step; lesson 9's
kernel table at the last LM's shapes (``kernel_table``). Then the LM's forward, backward and AdamW
timed apart, its peak memory, tokens/s and MFU labelled with its peak; on a GPU one more row at a
batch that saturates it (the course LM, 32 x 1024, bfloat16 autocast) against the bfloat16 peak
measured here and the datasheet's. FLOPs per token (PaLM appendix B, torchtitan, picotron):
6 N + 12 L H Q T. N: the parameters outside the embedding tables; L layers, H heads, Q head
dimension, T context (attention counted whole, although a causal mask skips half). MFU = FLOPs
per token x tokens/s / peak FLOP/s. Writes ``results/compute.csv`` (a row per model, as each
lands) and ``results/matmul_peak.json``; a model that would not end before make bench's deadline
for the step is skipped with a note.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common import models  # noqa: E402

from bench import results, timing

CSV_NAME = "compute.csv"
PEAK_JSON = "matmul_peak.json"
ADAMW_BYTES_PER_PARAM = 28  # float32: read+write param, exp_avg, exp_avg_sq (24), read grad (4)
SATURATING = ("course", 32, 1024)   # model, rows, tokens: enough work to fill a GPU
LARGE_BYTES = {"cuda": 2 ** 30, "cpu": 2 ** 26}   # a large copy's or add's tensors (a GPU's L2: tens of MB)
DATASHEET_BF16 = {"A100": 312e12, "H100": 989e12, "H200": 989e12, "B200": 2250e12}  # dense


# --------------------------------------------------------------------------- the arithmetic


def nonembedding_parameters(preset: str, context_length: int) -> int:
    """N: every parameter but the token and position embedding tables (the LM head counts)."""
    d_model = models.PRESETS[preset]["d_model"]
    total = models.lm_parameter_count(preset, context_length=context_length)
    return total - models.VOCAB_SIZE * d_model - context_length * d_model


def flops_per_token(preset: str, context_length: int) -> float:
    """6 N + 12 L H Q T: one training step's FLOPs per token (forward and backward)."""
    p = models.PRESETS[preset]
    head_dim = p["d_model"] // p["num_heads"]
    attention = 12 * p["num_layers"] * p["num_heads"] * head_dim * context_length
    return 6 * nonembedding_parameters(preset, context_length) + attention


def mfu(flops_per_token_: float, tokens_per_s: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation: the FLOPs the model needs per second / the device's peak."""
    return flops_per_token_ * tokens_per_s / peak_flops_per_s


# --------------------------------------------------------------------------- measuring


def matmul_peak(device: torch.device, n: int, dtype: torch.dtype = torch.float32,
                tf32: bool = False) -> float:
    """FLOP/s of an n^3 matmul (2 n^3 FLOPs) in ``dtype`` (``tf32``: on TF32 tensor cores), median of 10."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        seconds = statistics.median(timing.measure(lambda: a @ b, device, warmup=3, iters=10))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    return 2 * n ** 3 / seconds


def datasheet_peak(device: torch.device) -> tuple[str, float] | None:
    """(the GPU's name, its datasheet bf16 dense peak) where the box names a GPU we know."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next(((name, flops) for gpu, flops in DATASHEET_BF16.items() if gpu in name), None)


def step_bytes(preset: str, batch_size: int, context_length: int) -> int:
    """A step's rough peak: 20 bytes a parameter (weight, gradient, AdamW's two, a bucket) plus
    the float32 activations kept for backward."""
    shape = models.PRESETS[preset]
    acts = 4 * batch_size * context_length * (3 * models.VOCAB_SIZE + shape["num_layers"] * (
        12 * shape["d_model"] + 2 * shape["d_ff"] + shape["num_heads"] * context_length))
    return 20 * models.lm_parameter_count(preset, context_length=context_length) + acts


def copy_bandwidth(device: torch.device, nbytes: int, iters: int = 10) -> float:
    """Bytes/s of a copy: each byte read once and written once (the source written first: a page
    never written reads as the kernel's one zero page, from cache)."""
    src = torch.ones(max(1, nbytes // 4), device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / statistics.median(timing.measure(lambda: dst.copy_(src), device, warmup=3, iters=iters))


def kernel_table(preset: str, rows: int, seq: int, device: torch.device, peak: dict) -> dict:
    """Lesson 9's kernel classes timed at this LM's shapes in the dtype a GPU trains in (bfloat16; a
    CPU float32): a matmul [rows x seq, d_model] @ [d_model, d_ff]; causal attention's forward and
    backward, counted as the planner counts it (3 forwards of 4 s h a token a layer, halved); an add
    of two large tensors (bytes read and written a second); the launch floor, a tiny add in a burst."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = models.PRESETS[preset]
    d = shape["d_model"]
    tokens = rows * seq
    x = torch.randn(tokens, d, device=device, dtype=dtype)
    w = torch.randn(d, shape["d_ff"], device=device, dtype=dtype)
    heads = shape["num_heads"]
    q, k, v, grad = (torch.randn(rows, heads, seq, d // heads, device=device, dtype=dtype, requires_grad=True)
                     for _ in range(4))
    big = [torch.ones(LARGE_BYTES[device.type] // 4, device=device) for _ in range(3)]
    tiny = torch.zeros(1, device=device)

    def median(fn) -> float:
        return statistics.median(timing.measure(fn, device, warmup=3, iters=10))
    return {"model": preset, "rows": rows, "seq": seq, "dtype": str(dtype).removeprefix("torch."),
            "peak_flops_per_s": peak["bf16_flops_per_s" if device.type == "cuda" else "matmul_flops_per_s"],
            "matmul_flops_per_s": 2 * tokens * d * shape["d_ff"] / median(lambda: x @ w),
            "attention_flops_per_s": 3 * tokens * 4 * seq * d / 2 / median(lambda: torch.autograd.grad(
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad)),
            "memory_bound_bytes_per_s": 3 * big[0].nbytes / median(lambda: torch.add(*big[:2], out=big[2])),
            "launch_s": median(lambda: [tiny.add_(1) for _ in range(100)]) / 100}


def kernel_text(table: dict) -> str:
    """The kernel table in one line, each FLOP rate beside its share of the peak."""
    peak = table["peak_flops_per_s"]
    return ", ".join(f"{kind} {table[kind + '_flops_per_s'] / 1e12:.3g} TFLOP/s ({table[kind + '_flops_per_s'] / peak:.0%} "
                     f"of {peak / 1e12:.3g})" for kind in ("matmul", "attention")) + (
        f", add {table['memory_bound_bytes_per_s'] / 1e9:.4g} GB/s, launch floor {table['launch_s'] * 1e6:.3g} us")


def measure_lm(preset: str, batch_size: int, context_length: int, device: torch.device, warmup: int,
               steps: int, bf16: bool = False, vocab: int = models.VOCAB_SIZE, checkpointing: bool = False,
               setup=None) -> dict:
    """Forward, backward, optimizer median seconds and peak memory of a step (``bf16``: autocast),
    and each step's forward + backward seconds (``forward_backward``); ``setup(model)`` first."""
    torch.manual_seed(0)
    model = models.TransformerLM(preset, vocab_size=vocab, context_length=context_length,
                                 checkpoint_activations=checkpointing).to(device)
    if setup:
        setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = models.random_tokens(batch_size, context_length, seed=0, device=device, vocab_size=vocab)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    phases = {"forward": [], "backward": [], "optimizer": []}

    def clock() -> float:
        timing.synchronize(device)
        return time.perf_counter()
    for i in range(warmup + steps):
        t0 = clock()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = models.lm_loss(model(x), y)
        t1 = clock()
        loss.backward()
        t2 = clock()
        optimizer.step()
        t3 = clock()
        if i >= warmup:
            for phase, seconds in zip(phases.values(), (t1 - t0, t2 - t1, t3 - t2)):
                phase.append(seconds)
    memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    params = sum(p.numel() for p in model.parameters())
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    medians = {k: statistics.median(v) for k, v in phases.items()}
    forward_backward = tuple(f + b for f, b in zip(phases["forward"], phases["backward"]))
    return {**medians, "params": params, "max_memory_allocated": memory, "forward_backward": forward_backward}


def make_row(preset: str, batch_size: int, context_length: int, device: torch.device,
             measured: dict, peak: dict, dtype: str = "float32") -> dict:
    """A row; MFU against the measured peak of its dtype (``mfu_of``) and the datasheet's bf16 peak."""
    step_s = measured["forward"] + measured["backward"] + measured["optimizer"]
    tokens_per_s = batch_size * context_length / step_s
    per_token = flops_per_token(preset, context_length)
    achieved = per_token * tokens_per_s
    memory = measured["max_memory_allocated"]
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else ""
    key = "bf16_flops_per_s" if dtype == "bfloat16" else "matmul_flops_per_s"
    sheet = datasheet_peak(device) if dtype == "bfloat16" else None
    return {
        "device": device.type, "dtype": dtype, "model": preset, "params": measured["params"],
        "nonembedding_params": nonembedding_parameters(preset, context_length),
        "batch_size": batch_size, "context_length": context_length,
        "fwd_ms": measured["forward"] * 1e3, "bwd_ms": measured["backward"] * 1e3,
        "optimizer_ms": measured["optimizer"] * 1e3, "step_ms": step_s * 1e3,
        "tokens_per_s": tokens_per_s, "flops_per_token": per_token,
        "achieved_tflops": achieved / 1e12, "peak_tflops": peak[key] / 1e12,
        "mfu": achieved / peak[key], "mfu_of": f"the {dtype} matmul peak measured here",
        "mfu_of_datasheet": "" if sheet is None else achieved / sheet[1],
        "datasheet": "" if sheet is None else f"{sheet[0]}: {sheet[1] / 1e12:.0f} TFLOP/s bf16 dense",
        "optimizer_gbps": ADAMW_BYTES_PER_PARAM * measured["params"] / measured["optimizer"] / 1e9,
        "copy_gbps": peak["copy_bytes_per_s"] / 1e9,
        "max_memory_allocated_bytes": "" if memory is None else memory, "memory_total_bytes": total,
        "machine": results.machine_name(), "run_id": results.run_id()}


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, checked: a bad one (or a size that would not fit) is one line and exit 2."""
    from bench import supervisor as launch
    from common.launch import Parser
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--models", default="tiny",
                        help="comma-separated LM presets, measured in this order")
    parser.add_argument("--batch-size", type=launch.positive_int, default=4,
                        help="sequences per step: one rank's share of a stage's global batch")
    parser.add_argument("--context-length", type=launch.positive_int, default=256)
    parser.add_argument("--steps", type=launch.positive_int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=launch.non_negative_int, default=2)
    parser.add_argument("--matmul-n", type=launch.positive_int, default=None,
                        help="the peak's matmul size (default 8192 on a GPU, 1024 on a CPU)")
    args = parser.parse_args(argv)
    presets = [m.strip() for m in args.models.split(",") if m.strip()]
    for preset in presets:
        if preset not in models.PRESETS:
            launch.usage_error(f"--models: {preset!r} is not a preset; choose from "
                               f"{', '.join(models.PRESETS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        launch.usage_error("--device cuda needs a GPU and none is visible; use --device cpu")
    deadline = os.environ.get("BENCH_STEP_DEADLINE", "") or "0"
    try:
        args.deadline = float(deadline)
    except ValueError:
        launch.usage_error(f"BENCH_STEP_DEADLINE={deadline[:40]!r} is not a number (seconds "
                           "since the epoch by which this step must end)")
    args.matmul_n = args.matmul_n or (8192 if args.device == "cuda" else 1024)
    need = {f"--matmul-n {args.matmul_n}": 3 * 4 * args.matmul_n ** 2, **{
        f"--models {preset} at batch {args.batch_size} x {args.context_length}":
            step_bytes(preset, args.batch_size, args.context_length) for preset in presets}}
    what, most = max(need.items(), key=lambda item: item[1])
    have, where = 0.9 * launch.host_available_bytes(), "host memory"
    if args.device == "cuda":
        have, where = 0.9 * torch.cuda.get_device_properties(0).total_memory, "GPU memory"
    if most > have:
        launch.usage_error(f"{what} needs about {most / 2**30:.1f} GiB of {where}, and "
                           f"{have / 2**30:.1f} GiB can be had; use a smaller size")
    args.presets = presets
    return args


def measure_peaks(device: torch.device, n: int) -> dict:
    """The matmul peaks of this run (float32; TF32 and bfloat16 on a GPU) and the copy bandwidth."""
    peak = {"device": device.type, "dtype": "float32", "matmul_n": n,
            "matmul_flops_per_s": matmul_peak(device, n),
            "copy_bytes_per_s": copy_bandwidth(device, LARGE_BYTES[device.type]),
            "machine": results.machine_name(), "run_id": results.run_id()}
    said = f"float32 matmul {n}^3: {peak['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s"
    if device.type == "cuda":
        peak["tf32_flops_per_s"] = matmul_peak(device, n, tf32=True)
        peak["bf16_flops_per_s"] = matmul_peak(device, n, torch.bfloat16)
        said += (f", TF32 {peak['tf32_flops_per_s'] / 1e12:.1f}, bfloat16 "
                 f"{peak['bf16_flops_per_s'] / 1e12:.1f} TFLOP/s")
    else:
        said += " (a CPU: float32 only; TF32 and bfloat16 tensor-core peaks need a GPU)"
    print(f"{results.machine_name()}: {said}; copy {peak['copy_bytes_per_s'] / 1e9:.1f} GB/s",
          flush=True)
    return peak


def main(argv=None) -> int:
    """The run; Ctrl-C ends it with one line (the rows already written stay)."""
    try:
        run(argv)
    except KeyboardInterrupt:
        print("compute.py: stopped (Ctrl-C); the rows measured so far are in results/compute.csv",
              file=sys.stderr, flush=True)
        return 130
    return 0


def run(argv=None) -> None:
    args = parse_args(argv)
    results.check_writable()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    peak = measure_peaks(device, args.matmul_n)
    peak["kernels"] = kernel_table(args.presets[-1], args.batch_size, args.context_length, device, peak)
    print(f"kernels at {args.presets[-1]}'s shapes, {peak['kernels']['dtype']}: {kernel_text(peak['kernels'])}", flush=True)
    results.update_json(PEAK_JSON, {device.type: peak})
    cases = [(preset, args.batch_size, args.context_length, "float32") for preset in args.presets]
    if device.type == "cuda":
        cases.append((*SATURATING, "bfloat16"))
    last = None  # (params, seconds) of the previous model: the next one's estimate
    for preset, batch_size, context_length, dtype in cases:
        params = models.lm_parameter_count(preset, context_length=context_length)
        if last is not None and args.deadline:
            estimate = last[1] * params / last[0]
            left = args.deadline - time.time()
            if estimate > left:
                print(f"{preset}: skipped: about {estimate:.0f} s from the previous model, "
                      f"{left:.0f} s left before make bench stops this step", flush=True)
                continue
        start = time.perf_counter()
        try:
            measured = measure_lm(preset, batch_size, context_length, device,
                                  args.warmup, args.steps, bf16=dtype == "bfloat16")
        except torch.cuda.OutOfMemoryError:
            print(f"{preset}: skipped: out of GPU memory at batch {batch_size}", flush=True)
            continue
        last = (params, time.perf_counter() - start)
        row = make_row(preset, batch_size, context_length, device, measured, peak, dtype)
        results.upsert_csv(CSV_NAME, [row], key=["device", "model", "batch_size",
                                                 "context_length", "dtype"])
        memory = row["max_memory_allocated_bytes"]
        sheet = "" if row["datasheet"] == "" else \
            f", {row['mfu_of_datasheet']:.1%} of the datasheet's ({row['datasheet']})"
        print(f"{preset} {batch_size} x {context_length} {dtype}: forward {row['fwd_ms']:.1f} ms, "
              f"backward {row['bwd_ms']:.1f} ms, AdamW {row['optimizer_ms']:.1f} ms; "
              f"{row['tokens_per_s']:.0f} tokens/s, {row['achieved_tflops']:.2f} TFLOP/s = MFU "
              f"{row['mfu']:.1%} of {row['mfu_of']}{sheet}"
              + ("" if memory == "" else f"; max memory allocated {memory / 2**30:.2f} GiB"),
              flush=True)
    print(f"rows in {results.results_dir() / CSV_NAME}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
