"""Not a lesson: lesson 11's bench, Muon's designs beside AdamW + ZeRO-1, to results/muon.csv.

At each world size, the LM (``--model``, float32), the same gradients from one backward, and
one optimizer per row, its step timed (the slowest rank's median): each Muon design on the
blocks' matrices with AdamW on the rest (their gradients all-reduced in the step), FSDPMuon on
lesson 2's FSDP (its reduce-scatter runs in backward: not in the step), and AdamW + ZeRO-1
(lesson 1's ShardedOptimizer after one flat all-reduce) on everything. Each row's bytes are
counted (CommCounter, all ranks) beside the formula, the Muon part's from run_muon.step_bytes,
ZeRO-1's 3 (N-1) P; a count off its formula exits 1. ``ns_gflop_max`` is the busiest rank's
Newton-Schulz work, ``ns_imbalance`` that over the ideal 1/N. A world size that no longer fits
before make bench's ``BENCH_STEP_DEADLINE`` is skipped, said so, the rows before it kept.

    python 07_parallelism/measure/bench_muon.py --world-sizes 2,4 --model tiny
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: common/

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import counters  # noqa: E402 (this folder is on the path: Python puts a script's folder there)
from common import import_stage, models  # noqa: E402
from bench import results, step_bench, timing
from bench import supervisor as launch

run_muon = import_stage("07_parallelism/11_muon/run_muon")
muon = import_stage("07_parallelism/11_muon/muon")
zero = import_stage("07_parallelism/01_zero/zero")
FSDP = import_stage("07_parallelism/02_fsdp/fsdp").FSDP


def all_reduce_mean(params) -> None:
    grads = [param.grad for param in params]
    flat = torch.cat([grad.flatten() for grad in grads])
    dist.all_reduce(flat)
    muon.copy_flat(flat / dist.get_world_size(), grads)


def build(impl: str, args, device):
    """The LM, a step() for ``impl``, the Muon optimizer (None for ZeRO-1) and the shapes of
    its matrices."""
    torch.manual_seed(0)
    lm = models.TransformerLM(args.model, context_length=args.seq).to(device)
    shapes = [tuple(param.shape) for param in run_muon.block_matrices(lm)]
    if impl == "adamw+zero1":
        optimizer = zero.ShardedOptimizer(lm.parameters(), torch.optim.AdamW, lr=1e-3)

        def step():
            all_reduce_mean(list(lm.parameters()))
            optimizer.step()
        return lm, step, None, shapes
    model = FSDP(lm, units=list(lm.blocks)) if impl == "fsdp" else lm
    matrices = run_muon.block_matrices(model)
    if impl == "fsdp":
        muon_optimizer = muon.FSDPMuon(matrices, model, lr=0.02)
    else:
        muon_optimizer = muon.DESIGNS[impl](matrices, lr=0.02)
    others = [param for param in model.parameters() if not any(param is m for m in matrices)]
    adamw = torch.optim.AdamW(others, lr=1e-3)

    def step():
        muon_optimizer.step()
        if impl != "fsdp":
            all_reduce_mean(others)
        adamw.step()
    return model, step, muon_optimizer, shapes


def bench_one(ctx, impl: str, args) -> dict:
    model, step, muon_optimizer, shapes = build(impl, args, ctx.device)
    x, y = models.random_tokens(args.batch * ctx.world_size, args.seq, seed=0, device=ctx.device)
    mine = slice(args.batch * ctx.rank, args.batch * (ctx.rank + 1))
    models.lm_loss(model(x[mine]), y[mine]).backward()
    if impl == "fsdp":
        model.finish_gradient_synchronization()
    step()
    counted = step if muon_optimizer is None else muon_optimizer.step  # Muon's part alone
    with counters.CommCounter() as counter:
        counted()
    seconds = timing.measure(step, ctx.device, warmup=args.warmup, iters=args.steps, barrier=True)
    total = torch.tensor([counter.sent_bytes], dtype=torch.float64)
    dist.all_reduce(total)
    n = ctx.world_size
    if muon_optimizer is None:
        formula = 3 * (n - 1) * sum(param.numel() * param.element_size() for param in model.parameters())
        ns_flops = [0] * n
    else:
        formula = run_muon.step_bytes(impl, shapes, n, element_size=4)
        ns_flops = run_muon.flops_per_rank(shapes, n)[impl]
    busiest = max(ns_flops)
    return {"impl": impl, "world_size": n, "model": args.model, "device": ctx.device.type,
            "step_ms": timing.gather_times(seconds).median * 1e3,
            "bytes_counted": total.item(), "bytes_formula": float(formula),
            "ns_gflop_max": busiest / 1e9,
            "ns_imbalance": busiest / (sum(ns_flops) / n) if busiest and impl != "replicated" else None,
            "machine": results.machine_name(), "run_id": results.run_id()}


def bench_main(ctx, args) -> None:
    rows = [bench_one(ctx, impl, args) for impl in ["adamw+zero1", *muon.DESIGNS, "fsdp"]]
    if ctx.is_main:
        results.print_table(rows, floatfmt=".3g", title=f"{ctx.world_size} ranks, {args.model} LM, "
                            f"optimizer step ({ctx.backend}/{ctx.device.type}):")
        results.upsert_csv("muon.csv", rows, key=["impl", "world_size", "model", "device"])
    wrong = [row["impl"] for row in rows if abs(row["bytes_counted"] - row["bytes_formula"]) > 1e-6 * row["bytes_formula"]]
    if wrong:
        ctx.print(f"bytes counted differ from the formula: {', '.join(wrong)}", all_ranks=False)
        raise SystemExit(1)


def main(argv=None) -> None:
    parser = launch.make_parser(__doc__)
    parser.add_argument("--world-sizes", type=launch.int_list, default=[2, 4])
    parser.add_argument("--model", choices=list(models.PRESETS), default="tiny")
    parser.add_argument("--batch", type=launch.positive_int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=launch.positive_int, default=64)
    parser.add_argument("--warmup", type=launch.non_negative_int, default=1)
    parser.add_argument("--steps", type=launch.positive_int, default=5)
    args = parser.parse_args(argv)
    for world_size in step_bench.until_deadline(None, args.world_sizes, "bench_muon"):
        args.world_size = world_size
        launch.launch(bench_main, launch.resolve(args), args)


if __name__ == "__main__":
    main()
