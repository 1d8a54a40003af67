"""Compute on one device at world size 1: what a rank's GPU does between its collectives.

    python bench/compute.py --device cuda --models course,small --batch-size 4 --context-length 256
    python bench/compute.py --device cpu --models tiny --batch-size 4 --context-length 64

On a box where ranks share one GPU over Gloo, the step times of stages 03-07 measure Gloo's
path through host memory as much as the GPU. This measures the GPU alone, at one rank's shapes:

1. the peak it is measured against: a large float32 matmul (the dtype every stage trains in),
   timed in this run, not read off a spec sheet (a wrong peak is how MFU comes out above 100%);
   and the device's copy bandwidth (a large tensor copied: bytes read + written per second),
   the limit of memory-bound work such as the optimizer step;
2. the Transformer LM: forward, backward and the AdamW step timed apart (synchronised, median
   of the timed steps), ``torch.cuda.max_memory_allocated`` over a step, tokens/s, achieved
   TFLOP/s and model FLOPs utilisation.

FLOPs per token, the convention of PaLM (appendix B), torchtitan and picotron:

    6 N + 12 L H Q T

N: the parameters outside the embedding tables (each weight's multiply-add is 2 FLOPs forward
and 4 backward); L layers, H heads, Q head dimension, T context: attention's two matmuls
(counted whole, as the convention does, although a causal mask skips half).
MFU = FLOPs per token x tokens/s / peak FLOP/s.

Writes ``results/compute.csv`` (a row per model, as each lands) and ``results/matmul_peak.json``.
Models are measured in the order given (smallest first); one that would not end before make
bench's deadline for this step (``BENCH_STEP_DEADLINE``) is skipped with a note.
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


def median_seconds(fn, device: torch.device, warmup: int, iters: int) -> float:
    return statistics.median(timing.measure(fn, device, warmup=warmup, iters=iters))


def matmul_peak(device: torch.device, n: int) -> float:
    """FLOP/s of an n x n x n float32 matmul (2 n^3 FLOPs), the median of 10 after warm-up."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    seconds = median_seconds(lambda: a @ b, device, warmup=3, iters=10)
    return 2 * n ** 3 / seconds


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a large copy: each byte read once and written once."""
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, warmup=3, iters=10)
    return 2 * nbytes / seconds


def measure_lm(preset: str, batch_size: int, context_length: int, device: torch.device,
               warmup: int, steps: int) -> dict:
    """Forward, backward, optimizer seconds (medians) and the peak memory of one rank's step."""
    torch.manual_seed(0)
    model = models.TransformerLM(preset, context_length=context_length).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = models.random_tokens(batch_size, context_length, seed=0, device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    phases = {"forward": [], "backward": [], "optimizer": []}
    for i in range(warmup + steps):
        timing.synchronize(device)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = models.lm_loss(model(x), y)
        timing.synchronize(device)
        t1 = time.perf_counter()
        loss.backward()
        timing.synchronize(device)
        t2 = time.perf_counter()
        optimizer.step()
        timing.synchronize(device)
        t3 = time.perf_counter()
        if i >= warmup:
            phases["forward"].append(t1 - t0)
            phases["backward"].append(t2 - t1)
            phases["optimizer"].append(t3 - t2)
    memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    params = sum(p.numel() for p in model.parameters())
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    medians = {k: statistics.median(v) for k, v in phases.items()}
    return {**medians, "params": params, "max_memory_allocated": memory}


def make_row(preset: str, batch_size: int, context_length: int, device: torch.device,
             measured: dict, peak: dict) -> dict:
    step_s = measured["forward"] + measured["backward"] + measured["optimizer"]
    tokens_per_s = batch_size * context_length / step_s
    per_token = flops_per_token(preset, context_length)
    achieved = per_token * tokens_per_s
    optimizer_bytes_per_s = ADAMW_BYTES_PER_PARAM * measured["params"] / measured["optimizer"]
    memory = measured["max_memory_allocated"]
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" \
        else None
    return {
        "device": device.type, "dtype": "float32", "model": preset,
        "params": measured["params"],
        "nonembedding_params": nonembedding_parameters(preset, context_length),
        "batch_size": batch_size, "context_length": context_length,
        "fwd_ms": measured["forward"] * 1e3, "bwd_ms": measured["backward"] * 1e3,
        "optimizer_ms": measured["optimizer"] * 1e3, "step_ms": step_s * 1e3,
        "tokens_per_s": tokens_per_s, "flops_per_token": per_token,
        "achieved_tflops": achieved / 1e12, "peak_tflops": peak["matmul_flops_per_s"] / 1e12,
        "mfu": achieved / peak["matmul_flops_per_s"],
        "optimizer_gbps": optimizer_bytes_per_s / 1e9,
        "copy_gbps": peak["copy_bytes_per_s"] / 1e9,
        "max_memory_allocated_bytes": "" if memory is None else memory,
        "memory_total_bytes": "" if total is None else total,
        "machine": results.machine_name(), "run_id": results.run_id()}


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, checked: a bad one is one line and exit 2, before anything is measured."""
    from bench import launch
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    args.presets = presets
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    presets = args.presets
    results.check_writable()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    deadline = float(os.environ.get("BENCH_STEP_DEADLINE", "0") or 0)
    machine = results.machine_name()
    n = args.matmul_n or (8192 if device.type == "cuda" else 1024)
    # float32 as the stages run it: TF32 off unless the user turned it on (then both are TF32)
    peak = {"device": device.type, "dtype": "float32", "matmul_n": n,
            "tf32": bool(device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32),
            "matmul_flops_per_s": matmul_peak(device, n),
            "copy_bytes_per_s": copy_bandwidth(device, 2 ** 30 if device.type == "cuda"
                                               else 2 ** 26),
            "machine": machine, "run_id": results.run_id()}
    results.update_json(PEAK_JSON, {device.type: peak})
    print(f"{machine}: float32 matmul {n}^3: {peak['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s "
          f"(the peak MFU is measured against); copy: "
          f"{peak['copy_bytes_per_s'] / 1e9:.1f} GB/s", flush=True)
    last = None  # (params, seconds) of the previous model: the next one's estimate
    for preset in presets:
        params = models.lm_parameter_count(preset, context_length=args.context_length)
        if last is not None and deadline:
            estimate = last[1] * params / last[0]
            left = deadline - time.time()
            if estimate > left:
                print(f"{preset}: skipped: about {estimate:.0f} s from the previous model, "
                      f"{left:.0f} s left before make bench stops this step", flush=True)
                continue
        start = time.perf_counter()
        try:
            measured = measure_lm(preset, args.batch_size, args.context_length, device,
                                  args.warmup, args.steps)
        except torch.cuda.OutOfMemoryError:
            print(f"{preset}: skipped: out of GPU memory at batch {args.batch_size}", flush=True)
            continue
        last = (params, time.perf_counter() - start)
        row = make_row(preset, args.batch_size, args.context_length, device, measured, peak)
        results.upsert_csv(CSV_NAME, [row], key=["device", "model", "batch_size",
                                                 "context_length"])
        memory = row["max_memory_allocated_bytes"]
        print(f"{preset}: forward {row['fwd_ms']:.1f} ms, backward {row['bwd_ms']:.1f} ms, "
              f"AdamW {row['optimizer_ms']:.1f} ms; {row['tokens_per_s']:.0f} tokens/s, "
              f"{row['achieved_tflops']:.2f} TFLOP/s = MFU {row['mfu']:.1%}"
              + ("" if memory == "" else f"; max memory allocated {memory / 2**30:.2f} GiB"),
              flush=True)
    print(f"rows in {results.results_dir() / CSV_NAME}", flush=True)


if __name__ == "__main__":
    main()
