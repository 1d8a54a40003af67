"""Not a lesson: lesson 5's ring attention and Ulysses, measured.

A sequence-length sweep of one causal attention layer's forward + backward, float32: on one
rank (torch's fused ``scaled_dot_product_attention``, and our kernel as a ring of one), on
rings of 2 and 4 ranks in both layouts, and Ulysses: step time (real compute, and emulated:
each chunk only waits in proportion to its scores, backward twice as long), bytes sent, each
rank's work (max / mean) and activation memory saved for backward, each beside its formula
(and the GPU's peak, on a GPU). Rows go to ``results/context_parallel.csv`` after each length;
a length that cannot end before make bench's deadline (``BENCH_STEP_DEADLINE``) is skipped
with a note. The algorithm file has no counter and no clock: its kernels are replaced, for
the length of a ``with`` block, by ones that count the scores or only wait.

    python 07_parallelism/measure/bench_context_parallel.py --bench
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import results, step_bench, timing  # noqa: E402  (after the path)
from bench import supervisor as launch  # noqa: E402
from common import import_stage  # noqa: E402
from common.launch import carries_point_to_point  # noqa: E402

cp = import_stage("07_parallelism/05_context_parallel/context_parallel")
counters = import_stage("07_parallelism/measure/counters")

# --------------------------------------------------------------------------- the formulas
def ring_bytes(world_size: int, block_bytes: int) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends in ring attention; block_bytes: one K (or V)
    shard. Forward: W-1 hops of K and V. Backward: those again, and W hops of dK and dV."""
    if world_size == 1:
        return 0, 0
    forward = (world_size - 1) * 2 * block_bytes
    backward = (world_size - 1) * 2 * block_bytes + world_size * 2 * block_bytes
    return forward, backward


def ulysses_bytes(world_size: int, shard_bytes: int) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends in Ulysses (shard_bytes: its q): each all-to-all of
    q, k, v, the output and their four gradients keeps 1/W of its tensor and sends the rest."""
    if world_size == 1:
        return 0, 0
    per_swap = (world_size - 1) * shard_bytes // world_size
    return 4 * per_swap, 4 * per_swap


def visible_scores(rank: int, world_size: int, seq_len: int, layout: str, causal: bool,
                   batch_heads: int) -> int:
    """The (query, key) scores rank's queries see: causal, a query at position p sees p + 1."""
    if not causal:
        return batch_heads * (seq_len // world_size) * seq_len
    positions = cp.shard_positions(seq_len // world_size, rank, world_size, layout)
    return batch_heads * int((positions + 1).sum())


def imbalance_formula(world_size: int, layout: str, causal: bool) -> float:
    """max / mean work over ranks for long sequences: contiguous causal 2 - 1/W, else 1."""
    return 2 - 1 / world_size if causal and layout == "contiguous" else 1.0


def saved_bytes_formula(batch_heads: int, seq_len: int, head_dim: int, element_size: int) -> int:
    """What attention keeps for backward of seq_len queries: q, k, v, output, log-sum-exp."""
    return element_size * batch_heads * (4 * seq_len * head_dim + seq_len)


# --------------------------------------------------------------------------- kernels that count, wait
class ChunkKernels(contextlib.ContextDecorator):
    """While active, ``cp.chunk_attention`` and ``cp.chunk_attention_backward`` are this object's
    ``forward`` and ``backward``; by default the kernels that were there, so the wrappers nest."""

    def __enter__(self):
        self.inner_forward = cp.chunk_attention
        self.inner_backward = cp.chunk_attention_backward
        cp.chunk_attention = self.forward
        cp.chunk_attention_backward = self.backward
        return self

    def __exit__(self, *exc):
        cp.chunk_attention = self.inner_forward
        cp.chunk_attention_backward = self.inner_backward

    def forward(self, q, k, v, allowed, scale):
        return self.inner_forward(q, k, v, allowed, scale)

    def backward(self, grad_out, q, k, v, lse, delta, allowed, scale):
        return self.inner_backward(grad_out, q, k, v, lse, delta, allowed, scale)


class CountingAttention(ChunkKernels):
    """The exact kernel, counting the scores its forward computes and those a query sees."""

    def __init__(self):
        self.computed = 0
        self.visible = 0

    def forward(self, q, k, v, allowed, scale):
        batch_heads = q.shape[0] * q.shape[1]
        scores = batch_heads * q.shape[2] * k.shape[2]
        self.computed += scores
        if allowed is not None:
            scores = batch_heads * int(allowed.sum())
        self.visible += scores
        return self.inner_forward(q, k, v, allowed, scale)


class EmulatedAttention(ChunkKernels):
    """No arithmetic: each chunk waits for its scores (backward twice as long); sends stay real."""

    def __init__(self, seconds_per_score: float):
        self.seconds_per_score = seconds_per_score

    def wait(self, q, k, allowed, factor):
        scores = q.shape[2] * k.shape[2] if allowed is None else int(allowed.sum())
        time.sleep(factor * q.shape[0] * q.shape[1] * scores * self.seconds_per_score)

    def forward(self, q, k, v, allowed, scale):
        self.wait(q, k, allowed, 1)
        return torch.zeros_like(q), torch.zeros(q.shape[:-1], dtype=q.dtype, device=q.device)

    def backward(self, grad_out, q, k, v, lse, delta, allowed, scale):
        self.wait(q, k, allowed, 2)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


class HeadsAttention(contextlib.ContextDecorator):
    """As ``ChunkKernels`` for Ulysses' ``cp.heads_attention``, counting the scores it sees;
    given ``seconds_per_score``, no arithmetic: it waits (the all-to-alls stay real)."""

    def __init__(self, seconds_per_score: float | None = None):
        self.visible = 0
        self.seconds_per_score = seconds_per_score

    def __enter__(self):
        self.inner = cp.heads_attention
        cp.heads_attention = self.attention
        return self

    def __exit__(self, *exc):
        cp.heads_attention = self.inner

    def attention(self, q, k, v, causal):
        seen = scores_seen(q, causal)
        self.visible += seen
        if self.seconds_per_score is None:
            return self.inner(q, k, v, causal)
        return EmulatedWait.apply(q, k, v, seen * self.seconds_per_score)


def scores_seen(q, causal: bool) -> int:
    """The (query, key) scores of attention over the whole sequence of q's heads."""
    seq = q.shape[2]
    return q.shape[0] * q.shape[1] * (seq * (seq + 1) // 2 if causal else seq * seq)


class EmulatedWait(torch.autograd.Function):
    """Waits ``seconds`` forward and twice that backward; returns zeros of q's shape."""

    @staticmethod
    def forward(ctx, q, k, v, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return torch.zeros_like(q)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return torch.zeros_like(grad), torch.zeros_like(grad), torch.zeros_like(grad), None


# --------------------------------------------------------------------------- the benchmark
def attention_inputs(ctx, cfg: dict, seq: int, rank: int, world_size: int, layout: str):
    """This rank's float32 shards of q, k, v (leaves) and the output's gradient, cut alike everywhere."""
    shape = (cfg["batch"], cfg["heads"], seq, cfg["head_dim"])
    generator = torch.Generator().manual_seed(seq)
    q, k, v, grad_out = [cp.shard_sequence(torch.randn(shape, generator=generator,
                                                       dtype=torch.float32),
                                           2, rank, world_size, layout).to(ctx.device)
                         for _ in range(4)]
    return q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True), grad_out


def run_step(q, k, v, grad_out, attention, kernel=None):
    """One forward + backward of ``attention(q, k, v)``, with ``kernel`` active when given."""
    with kernel or contextlib.nullcontext():
        out = attention(q, k, v)
        out.backward(grad_out)


def measure_case(ctx, cfg: dict, step, members: list[int]) -> dict:
    """step_ms: the slowest member's median of ``step()``; step_ms_min, step_ms_max: the fastest
    and slowest step a member took. The others keep the barriers company."""
    inside = ctx.rank in members
    times = timing.measure(step if inside else lambda: None, ctx.device, warmup=cfg["warmup"],
                           iters=cfg["iters"], barrier=True)
    stats = timing.gather_times(times if inside else [0.0] * len(times))
    fastest = timing.gather_times(times if inside else [float("inf")] * len(times)).min
    return {"step_ms": stats.median * 1e3, "step_ms_min": fastest * 1e3, "step_ms_max": stats.max * 1e3}


def saved_and_peak(ctx, step) -> tuple[int, int]:
    """(bytes saved for backward, counted; peak GPU bytes above the start, 0 on a CPU)."""
    start = 0
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        start = torch.cuda.memory_allocated(ctx.device)
    with counters.SavedActivations() as saved:
        step()
    peak = torch.cuda.max_memory_allocated(ctx.device) - start if ctx.device.type == "cuda" else 0
    return saved.bytes, peak


def bench_sequence(ctx, cfg: dict, seq: int, rings: dict, single, rows: list, failures: list):
    """Every implementation at one sequence length: rows and problems appended."""
    batch_heads = cfg["batch"] * cfg["heads"]
    same = {"seq": seq, "batch": cfg["batch"], "heads": cfg["heads"], "head_dim": cfg["head_dim"]}
    # One rank, the whole sequence: torch's fused kernel, and ours (a ring of one).
    q, k, v, grad_out = attention_inputs(ctx, cfg, seq, 0, 1, "contiguous")
    impls = {"full, sdpa": functools.partial(F.scaled_dot_product_attention, is_causal=True),
             "full, our kernel": functools.partial(cp.ring_attention, group=single, causal=True,
                                                   layout="contiguous")}
    for impl, attention in impls.items():
        step = functools.partial(run_step, q, k, v, grad_out, attention)
        steps = measure_case(ctx, cfg, step, [0])
        saved, peak = saved_and_peak(ctx, step) if ctx.rank == 0 else (0, 0)
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, {"saved": saved, "peak": peak})
        rows.append({**same, "impl": impl, "W": 1, "layout": "-", "compute": "real",
                     **steps, "sent_bytes": 0, "bytes_formula": 0,
                     "imbalance": 1.0, "imbalance_formula": 1.0,
                     "saved_bytes": everyone[0]["saved"],
                     "saved_formula": saved_bytes_formula(batch_heads, seq, cfg["head_dim"], 4),
                     "peak_bytes": everyone[0]["peak"]})
    for world_size, ring in rings.items():
        shard_bytes = batch_heads * (seq // world_size) * cfg["head_dim"] * 4  # one rank's q, k or v
        for layout in cfg["layouts"]:
            ring_attention = functools.partial(cp.ring_attention, group=ring, causal=True, layout=layout)
            targets = {"bytes_formula": sum(ring_bytes(world_size, shard_bytes)),
                       "imbalance_formula": imbalance_formula(world_size, layout, True),
                       "saved_formula": saved_bytes_formula(batch_heads, seq // world_size,
                                                            cfg["head_dim"], 4)}
            bench_parallel(ctx, cfg, same, world_size, "ring", layout, ring_attention,
                           CountingAttention(), EmulatedAttention, targets, rows, failures)
        if cfg["heads"] % world_size == 0:
            ulysses = functools.partial(cp.ulysses_attention, group=ring, causal=True)
            targets = {"bytes_formula": sum(ulysses_bytes(world_size, shard_bytes)),
                       "imbalance_formula": 1.0,
                       "saved_formula": saved_bytes_formula(batch_heads // world_size, seq,
                                                            cfg["head_dim"], 4)}
            bench_parallel(ctx, cfg, same, world_size, "ulysses", "contiguous", ulysses,
                           HeadsAttention(), HeadsAttention, targets, rows, failures)


def bench_parallel(ctx, cfg: dict, same: dict, world_size: int, impl: str, layout: str,
                   attention, counting, emulated, targets: dict, rows: list, failures: list):
    """``impl`` (ring or ulysses) on the first ``world_size`` ranks at one length: its row beside
    ``targets`` (and at the longest, with ``emulated`` compute) to ``rows``, problems to ``failures``."""
    seq = same["seq"]
    members = list(range(world_size))
    inside = ctx.rank in members
    rank = ctx.rank if inside else 0  # ranks outside draw rank 0's shard, and only wait
    q, k, v, grad_out = attention_inputs(ctx, cfg, seq, rank, world_size, layout)
    real_step = functools.partial(run_step, q, k, v, grad_out, attention)
    sent = saved = peak = 0
    if inside:
        with counters.CommCounter() as comm:
            run_step(q, k, v, grad_out, attention, counting)
        sent = comm.sent_bytes
        saved, peak = saved_and_peak(ctx, real_step)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, {"inside": inside, "sent": sent, "saved": saved,
                                      "peak": peak, "visible": counting.visible})
    everyone = [numbers for numbers in everyone if numbers["inside"]]
    visible = [numbers["visible"] for numbers in everyone]
    sent_per_rank = [numbers["sent"] for numbers in everyone]
    formula = targets["bytes_formula"]
    if max(sent_per_rank) != formula or min(sent_per_rank) != formula:
        name = layout if impl == "ring" else impl
        failures.append(f"seq {seq} W={world_size} {name}: ranks sent {min(sent_per_rank):.0f} "
                        f"to {max(sent_per_rank):.0f} B; the formula says {formula}")
    row = {**same, "impl": impl, "W": world_size, "layout": layout, "compute": "real",
           "sent_bytes": int(max(sent_per_rank)), "bytes_formula": formula,
           "imbalance": max(visible) / (sum(visible) / len(visible)),
           "imbalance_formula": targets["imbalance_formula"],
           "saved_bytes": max(numbers["saved"] for numbers in everyone),
           "saved_formula": targets["saved_formula"],
           "peak_bytes": max(numbers["peak"] for numbers in everyone)}
    row.update(measure_case(ctx, cfg, real_step, members))
    rows.append(row)
    if seq == max(cfg["seqs"]):  # emulated compute: the same at every length
        all_scores = cfg["batch"] * cfg["heads"] * seq * (seq + 1) / 2
        kernel = emulated(cfg["emulate_ms"] / 1e3 / all_scores)
        emulated_step = functools.partial(run_step, q, k, v, grad_out, attention, kernel)
        emulated_row = dict(row)
        emulated_row["compute"] = f"emulated {cfg['emulate_ms']:g} ms"
        emulated_row.update(measure_case(ctx, cfg, emulated_step, members))
        rows.append(emulated_row)


def bench_main(ctx, cfg: dict) -> None:
    """The sweep; rank 0 prints, writes the CSV and the targets beside what was measured."""
    single = [dist.new_group([rank]) for rank in range(ctx.world_size)][ctx.rank]  # rings of one
    rings = {size: dist.new_group(list(range(size))) for size in cfg["ring_sizes"]}
    rows = []
    failures = []
    deadline = step_bench.Deadline(ctx)
    last = None  # (seq, seconds) of the previous length: the next one's estimate
    for seq in cfg["seqs"]:
        estimate = None if last is None else last[1] * (seq / last[0]) ** 2  # attention: seq^2
        if not deadline.allows(f"seq {seq} and longer", estimate):
            break
        started = time.perf_counter()
        bench_sequence(ctx, cfg, seq, rings, single, rows, failures)
        last = (seq, time.perf_counter() - started)
        if ctx.is_main:
            write_bench_rows(ctx, rows)
        ctx.print(f"seq {seq}: done", all_ranks=False)
    from common import verify
    failures = verify.agree_on_problems(failures)  # every rank's problems, on every rank
    if ctx.is_main:
        report_bench(ctx, cfg, rows)
    if failures:
        raise AssertionError("context-parallel benchmark check failed:\n  " + "\n  ".join(failures))


def ratio(rows: list[dict], world_size: int, compute: str) -> float | None:
    """zig-zag step time / contiguous step time at the longest sequence."""
    seq = max(row["seq"] for row in rows)
    times = {row["layout"]: row["step_ms"] for row in rows   # ring rows: Ulysses is contiguous too
             if row["impl"] == "ring" and row["seq"] == seq and row["W"] == world_size
             and row["compute"].startswith(compute)}
    return None if "zigzag" not in times or "contiguous" not in times else times["zigzag"] / times["contiguous"]


def write_bench_rows(ctx, rows: list[dict]):
    """Rank 0: upsert the rows measured so far into results/context_parallel.csv."""
    same = {"backend": ctx.backend, "device": ctx.device.type}
    stamp = {"machine": results.machine_name(), "run_id": results.run_id()}
    csv_rows = [{**same, **row, **stamp} for row in rows]
    return results.upsert_csv("context_parallel.csv", csv_rows,
                              key=["backend", "device", "seq", "batch", "heads", "head_dim",
                                   "impl", "W", "layout", "compute"])


def report_bench(ctx, cfg: dict, rows: list[dict]) -> None:
    machine = results.machine_name()
    print(f"\nOne causal attention layer, forward + backward, float32, batch {cfg['batch']}, "
          f"heads {cfg['heads']}, head_dim {cfg['head_dim']}; {ctx.backend}/{ctx.device.type}, "
          f"{machine}; median of {cfg['iters']} after {cfg['warmup']} warm-up, slowest rank:")
    hidden = {"batch", "heads", "head_dim"}              # in the title
    if ctx.device.type != "cuda":
        hidden.add("peak_bytes")                          # measured on a GPU only
    results.print_table([{key: value for key, value in row.items() if key not in hidden}
                         for row in rows], floatfmt=".3g")
    path = write_bench_rows(ctx, rows)
    if path.is_relative_to(Path.cwd()):
        path = path.relative_to(Path.cwd())
    print(f"\nwrote {path}\n\nTargets, measured in this run ({machine}):")
    longest = max(row["seq"] for row in rows)  # what ran: the deadline may have cut the plan
    if longest < max(cfg["seqs"]):
        print(f"  at seq {longest}: longer lengths were skipped at make bench's deadline")
    for row in rows:
        if row["impl"] != "ring" or row["compute"] != "real" or row["seq"] != longest:
            continue
        target = "1.00" if row["layout"] == "zigzag" else f"within 2% of 2 - 1/W = {row['imbalance_formula']:.3f}"
        print(f"  FLOP imbalance (max/mean), W={row['W']} {row['layout']}: "
              f"{row['imbalance']:.3f} (target {target})")
    exact = all(row["sent_bytes"] == row["bytes_formula"] for row in rows if row["impl"] == "ring")
    print(f"  ring bytes sent per rank equal the formula in every row: {exact}")
    ulysses = [row for row in rows if row["impl"] == "ulysses"]
    if ulysses:
        exact = all(row["sent_bytes"] == row["bytes_formula"] for row in ulysses)
        print(f"  Ulysses bytes sent per rank equal the formula in every row: {exact}")
        table = []  # per length and W: zig-zag ring beside Ulysses, same compute
        for row in ulysses:
            for ring in rows:
                same = (ring["seq"], ring["W"], ring["compute"]) == (row["seq"], row["W"], row["compute"])
                if ring["impl"] == "ring" and ring["layout"] == "zigzag" and same:
                    table.append({"seq": row["seq"], "W": row["W"], "compute": row["compute"],
                                  "ring bytes/rank": ring["sent_bytes"],
                                  "Ulysses bytes/rank": row["sent_bytes"],
                                  "ring ms": ring["step_ms"], "Ulysses ms": row["step_ms"],
                                  "Ulysses / ring": row["step_ms"] / ring["step_ms"]})
        if table:
            results.print_table(table, title="\nRing attention (zig-zag) beside Ulysses: bytes "
                                             "each rank sends, and step time", floatfmt=".3g")
    for world_size in cfg["ring_sizes"]:
        emulated = ratio(rows, world_size, "emulated")
        real = ratio(rows, world_size, "real")
        ideal = world_size / (2 * world_size - 1)
        if emulated is not None:
            print(f"  zig-zag / contiguous step time, W={world_size}, seq {longest}: emulated "
                  f"compute {emulated:.2f}, real compute {real:.2f} (target <= 0.75 at W=4; "
                  f"ideal W/(2W-1) = {ideal:.2f})")


# --------------------------------------------------------------------------- flags
def box_defaults(args, config) -> None:
    """The flags left out, filled in for this box (the host: CPU tensors); rings of 2 and 4."""
    on_host = config.device == "cpu"
    for flag, value in (("seqs", [256, 512, 1024] if on_host else [1024, 2048, 4096]),
                        ("warmup", 1 if on_host else 2), ("iters", 3 if on_host else 5),
                        ("ring_sizes", [size for size in (2, 4) if size <= config.world_size])):
        if getattr(args, flag) is None:
            setattr(args, flag, value)


def main(argv=None) -> None:
    parser = launch.make_parser(__doc__, world_size=4)
    parser.add_argument("--batch", type=launch.positive_int, default=4, help="sequences")
    parser.add_argument("--heads", type=launch.positive_int, default=4,
                        help="attention heads (Ulysses runs on the ring sizes that divide them)")
    parser.add_argument("--head-dim", type=launch.positive_int, default=24, help="width of one head")
    parser.add_argument("--layouts", type=launch.choice_list(list(cp.LAYOUTS)),
                        default=list(cp.LAYOUTS), help="subset of " + ",".join(cp.LAYOUTS))
    parser.add_argument("--bench", action="store_true", help="accepted (make bench passes it)")
    parser.add_argument("--seqs", type=launch.int_list, default=None,
                        help="sequence lengths (default 256,512,1024 on the host, "
                             "1024,2048,4096 on GPUs)")
    parser.add_argument("--ring-sizes", type=launch.int_list, default=None,
                        help="ring sizes W (default 2 and 4, up to the world size)")
    parser.add_argument("--emulate-ms", type=launch.positive_float, default=400.0,
                        help="emulated compute: causal attention's forward over the whole sequence "
                             "on one rank; each chunk waits its share, backward twice as long")
    parser.add_argument("--warmup", type=launch.non_negative_int, default=None,
                        help="untimed steps before the timed ones (default 1 on the host, 2 on GPUs)")
    parser.add_argument("--iters", type=launch.positive_int, default=None,
                        help="timed steps (default 3 on the host, 5 on GPUs)")
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    world_size = config.world_size
    if args.emulate_ms > 60_000:
        parser.error(f"--emulate-ms {args.emulate_ms:g}: at most 60000 (a minute of emulated "
                     "forward per step)")
    if not carries_point_to_point(config.backend, config.device):
        launch.usage_error(f"ring attention sends with batch_isend_irecv, which {config.backend} "
                           f"cannot carry for {config.device} tensors: use --device cpu (a rank "
                           "per CPU core), or NCCL with a GPU per rank")
    box_defaults(args, config)
    wrong = [ring_size for ring_size in args.ring_sizes if not 2 <= ring_size <= world_size]
    if wrong or not args.ring_sizes:
        parser.error(f"--ring-sizes {wrong or args.ring_sizes}: each must be between 2 and "
                     f"the world size {world_size}")
    for seq in args.seqs:
        for ring_size in args.ring_sizes:
            for layout in args.layouts:
                chunks = ring_size * cp.chunks_per_rank(layout)
                if seq % chunks != 0:
                    parser.error(f"--seqs {seq} does not divide into {chunks} equal chunks "
                                 f"({layout} layout over {ring_size} ranks)")
    # a rank's rough peak: the full tensors and chunk scores, with rank 0's seq x seq scores
    seq = max(args.seqs)
    need = 4 * args.batch * args.heads * (6 * seq * seq + 24 * seq * args.head_dim)
    launch.check_fits(config, need, f"{need / 2**30:.2f} GiB each for sequence length {seq}")
    results.check_writable()
    launch.launch(bench_main, config, vars(args))


if __name__ == "__main__":
    main()
