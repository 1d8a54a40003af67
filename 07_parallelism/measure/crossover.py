"""Not a lesson: lesson 9's DDP crossover on this box, predicted then measured.

The planner (``run_planning.box_crossover``) predicts the tokens per rank T* above which DDP's
gradient all-reduce hides under backward (the Scaling Book's C/W rule with backward's floor),
from the DDP bench's control (backward at one row and at two rows, an all-reduce after a
backward: results/ddp_step.csv). This sweeps T around T* on the LM with a plain DDP step
(backward, then one all-reduce of the flat gradients, each timed alone: warm-up, medians, the
slowest rank; the all-reduce also back to back, as stage 02 times it), finds where backward
takes as long as the all-reduce (the points' median: the same bytes at each; log-space
interpolation between the two points that bracket it) and prints measured / predicted, split
into its two terms: the all-reduce measured over predicted, and backward's tokens/s at T*
measured over predicted.

    python 07_parallelism/measure/crossover.py                    # 2 ranks, Gloo, CPU, LM tiny
    python 07_parallelism/measure/crossover.py --tokens 8,32,128    # exactly these points
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: common/

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import import_stage, models  # noqa: E402
from bench import results, timing
from bench import supervisor as launch
from bench.step_bench import Deadline

run_planning = import_stage("07_parallelism/09_planning/run_planning")
TARGET = 1.25  # measured within x1.25 of predicted


def crossing(tokens: list[float], backward: list[float], all_reduce: float) -> float | None:
    """The tokens where backward first takes as long as the all-reduce, interpolated in log space
    between the two points that bracket it; None where no neighbours do (nothing invented)."""
    gaps = [math.log(seconds / all_reduce) for seconds in backward]
    for i in range(len(tokens) - 1):
        if gaps[i] < 0 <= gaps[i + 1]:
            low, high = math.log(tokens[i]), math.log(tokens[i + 1])
            return math.exp(low + (high - low) * -gaps[i] / (gaps[i + 1] - gaps[i]))
    return None


def sweep(center: float, points: int = 7, span: float = 4.0) -> list[int]:
    """``points`` token counts log-spaced from center / span to center x span."""
    return sorted({max(1, round(center * span ** (2 * i / (points - 1) - 1))) for i in range(points)})


def beyond(points: list[dict]) -> list[int]:
    """The next point where none of ``points`` (sorted) crosses the all-reduce (their median):
    twice the largest where backward is shorter everywhere, half the smallest where longer."""
    all_reduce = statistics.median(point["all_reduce_ms"] for point in points)
    slower = [point["backward_ms"] >= all_reduce for point in points]
    if not any(slower):
        return [2 * points[-1]["tokens_per_rank"]]
    if all(slower) and points[0]["tokens_per_rank"] > 1:
        return [points[0]["tokens_per_rank"] // 2]
    return []


def time_point(ctx, lm, tokens: int, args) -> dict:
    """Backward and the all-reduce after it, ms, at ``tokens`` a rank in rows of at most
    ``args.seq``; the all-reduce also back to back, as stage 02 times it."""
    rows = -(-tokens // args.seq)
    x, y = models.random_tokens(rows, tokens // rows, seed=ctx.rank, device=ctx.device)
    flat = torch.empty(sum(param.numel() for param in lm.parameters()), device=ctx.device)
    backward, all_reduce = [], []
    for _ in range(args.warmup + args.steps):  # each timed once, the ranks lined up first
        lm.zero_grad()
        loss = models.lm_loss(lm(x), y)
        backward += timing.measure(loss.backward, ctx.device, warmup=0, iters=1, barrier=True)
        torch.cat([param.grad.flatten() for param in lm.parameters()], out=flat)  # one bucket
        all_reduce += timing.measure(lambda: dist.all_reduce(flat), ctx.device, warmup=0,
                                     iters=1, barrier=True)
    back_to_back = timing.measure(lambda: dist.all_reduce(flat), ctx.device, args.warmup, args.steps, barrier=True)
    named = (("backward_ms", backward), ("all_reduce_ms", all_reduce), ("all_reduce_back_to_back_ms", back_to_back))
    return {"tokens_per_rank": rows * (tokens // rows), "rows": rows, "seq": tokens // rows,
            **{name: timing.gather_times(times[-args.steps:]).median * 1e3 for name, times in named}}


def worker(ctx, args, tokens: list[int], box: dict | None, extra: int) -> None:
    """Each point (a point is at most twice the last: stopped where that would pass make bench's
    deadline), then up to ``extra`` more where none crosses (``beyond``); rank 0 writes."""
    torch.manual_seed(0)
    lm = models.TransformerLM(args.model, context_length=args.seq).to(ctx.device)
    points = []
    deadline = Deadline(ctx)
    last_s = 0.0
    while tokens:  # a point takes up to 3x the one before: at most twice its tokens, + start-up
        if not deadline.allows(f"crossover: {tokens[0]} tokens a rank and more", 3 * last_s):
            break
        start = time.perf_counter()
        points.append(time_point(ctx, lm, tokens.pop(0), args))
        last_s = time.perf_counter() - start
        points.sort(key=lambda point: point["tokens_per_rank"])
        if ctx.is_main:  # each point as it lands: a sweep stopped at its cap keeps them
            results.upsert_csv("crossover.csv", numbered(ctx, args, points), key=KEY)
        if not tokens and extra > 0:
            extra -= 1
            tokens.extend(beyond(points))
    if ctx.is_main:
        write(ctx, args, points, box)


KEY = ["backend", "device", "world_size", "model", "point"]


def row_of(ctx, args, row: dict) -> dict:
    """A CSV row: where it ran, then ``row``, then the machine and the run."""
    return {"backend": ctx.backend, "device": ctx.device.type, "world_size": ctx.world_size,
            "model": args.model, **row,
            "machine": results.machine_name(), "run_id": results.run_id()}


def numbered(ctx, args, points: list[dict]) -> list[dict]:
    return [row_of(ctx, args, {"point": index, **point}) for index, point in enumerate(points)]


def write(ctx, args, points: list[dict], box: dict | None) -> None:
    """The table, the crossover measured beside the predicted and its two terms, the CSV."""
    results.print_table(numbered(ctx, args, points), floatfmt=".4g",
                        title=f"DDP crossover sweep, {results.machine_name()}:")
    # the same gradients at every point: one all-reduce figure, the median of the points'
    all_reduce = statistics.median(p["all_reduce_ms"] for p in points)
    measured = crossing([p["tokens_per_rank"] for p in points], [p["backward_ms"] for p in points], all_reduce)
    row = {"point": "crossover", "tokens_per_rank": measured, "all_reduce_ms": all_reduce,
           "all_reduce_back_to_back_ms": statistics.median(p["all_reduce_back_to_back_ms"] for p in points),
           "backward_tokens_per_s": measured and measured / all_reduce * 1e3}
    ratio = measured / box["tokens"] if box and measured else None
    print("crossover measured: " + (f"{measured:.0f} tokens a rank" if measured else "none in the sweep"))
    if box:
        row.update(predicted_tokens=box["tokens"], ratio=ratio, within=bool(ratio) and 1 / TARGET <= ratio <= TARGET,
                   predicted_all_reduce_ms=box["all_reduce_s"] * 1e3,
                   predicted_backward_tokens_per_s=box["tokens"] / box["all_reduce_s"])
        print(f"crossover predicted: {box['tokens']:.0f} tokens a rank (results/ddp_step.csv's control)")
    if ratio:
        link = all_reduce / row["predicted_all_reduce_ms"]
        back = row["all_reduce_back_to_back_ms"] / row["predicted_all_reduce_ms"]
        rate = row["backward_tokens_per_s"] / row["predicted_backward_tokens_per_s"]
        verdict = "within" if row["within"] else "NOT within"
        print(f"measured / predicted {ratio:.2f}: {verdict} x{TARGET}; the all-reduce "
              f"{link:.2f}x the predicted (back to back {back:.2f}x), backward's tokens/s "
              f"{rate:.2f}x")
    results.upsert_csv("crossover.csv", [*numbered(ctx, args, points), row_of(ctx, args, row)], key=KEY)
    print("wrote results/crossover.csv")


def main(argv=None) -> None:
    parser = launch.make_parser(__doc__)
    parser.add_argument("--model", choices=list(models.PRESETS), default="tiny")
    parser.add_argument("--seq", type=launch.positive_int, default=64, help="the LM's context, a row's most tokens")
    parser.add_argument("--tokens", type=launch.int_list,
                        help="exactly these tokens a rank (default: 7 around the prediction, more where none crosses)")
    parser.add_argument("--warmup", type=launch.non_negative_int, default=3)
    parser.add_argument("--steps", type=launch.positive_int, default=9)
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    box = run_planning.box_crossover(config.world_size)
    if box and (box["model"] != args.model or (config.backend, config.device) != ("gloo", "cpu")):
        print(f"crossover: no prediction for LM {args.model} on {config.backend}/{config.device}: "
              f"results/ holds LM {box['model']} on gloo/cpu")
        box = None
    tokens = args.tokens or sweep(box["tokens"] if box else 64)
    launch.launch(worker, config, args, sorted(tokens), box, 0 if args.tokens else 6)


if __name__ == "__main__":
    main()
