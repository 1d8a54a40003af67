"""Timing a data-parallel training step: bench/ddp_step.py's table (stages 03-06).

A case is ``(impl, bucket_mb, factory)``, ``factory(module)`` wrapping the LM as a stage does,
beside ``none`` (no wrapper) and ``torch_ddp`` at 25 MB (``ratio_vs_torch_ddp``'s denominator).
A step is split into forward + backward (where overlapped communication hides: that clock waits
for the compute stream only), the communication left after it and the optimizer; ``--rounds``
pools each case's steps. Beside ``none``: small all-reduces in a burst, each waited for (``call_ms``)
and all launched at once (``async_call_ms``), for lesson 9's prediction; backward at one row and at
two with an all-reduce after it (lesson 9's crossover: ``backward_at``). Slowest rank's medians,
upserted into results/ddp_step.csv.
"""

import gc
import math
import os
import statistics
import time

import torch
import torch.distributed as dist

from common import models

from bench import results, timing
from bench.compute import step_bytes

from bench import supervisor as launch

CSV_NAME = "ddp_step.csv"
CSV_KEY = ["backend", "device", "world_size", "model", "impl", "bucket_mb"]
TORCH_DDP_DEFAULT_BUCKET_MB = 25  # DistributedDataParallel's bucket_cap_mb


def torch_ddp_factory(bucket_mb=None):
    def wrap(module):
        device = next(module.parameters()).device
        return torch.nn.parallel.DistributedDataParallel(
            module, device_ids=[device.index] if device.type == "cuda" else None,
            **({} if bucket_mb is None else {"bucket_cap_mb": bucket_mb}))
    return wrap


def add_step_bench_args(parser):
    g = parser.add_argument_group("training-step benchmark")
    g.add_argument("--model", choices=list(models.PRESETS), default="tiny", help="LM preset")
    g.add_argument("--batch-size", type=launch.positive_int, default=8,
                   help="GLOBAL batch (sequences per step), split evenly across ranks")
    g.add_argument("--context-length", type=launch.positive_int, default=64, help="tokens")
    g.add_argument("--steps", type=launch.positive_int, default=10, help="timed steps")
    g.add_argument("--warmup", type=launch.non_negative_int, default=5, help="untimed steps first")
    g.add_argument("--rounds", type=launch.positive_int, default=1,
                   help="run the whole list of cases this many times and pool the timed steps")
    g.add_argument("--case-budget-s", type=launch.positive_float, default=120.0,
                   help="seconds per case at most: fewer timed steps where the warm-up says so")


def check_step_bench_args(args, config) -> None:
    """One line and exit 2 before any worker starts: an uneven batch, a model too big, no results."""
    ws = config.world_size
    if args.batch_size % ws:
        launch.usage_error(f"--batch-size {args.batch_size} is not divisible by world size "
                           f"{ws}: each rank needs an equal slice (try "
                           f"{ws * max(1, args.batch_size // ws)})")
    need = step_bytes(args.model, args.batch_size // ws, args.context_length)  # a rank's peak
    what = f"--model {args.model}, batch {args.batch_size}, context {args.context_length}"
    ranks_here = launch.ranks_on_this_node(ws)
    if config.device == "cuda":
        per_gpu = launch.ranks_per_gpu(ws) * need
        total = torch.cuda.get_device_properties(0).total_memory
        if per_gpu > 0.9 * total:
            launch.usage_error(f"{what} needs about {per_gpu / 2**30:.1f} GiB per GPU but a GPU "
                               f"has {total / 2**30:.1f} GiB; use a smaller model or batch")
    else:
        launch.check_ranks_fit(ranks_here, need, f"{need / 2**30:.2f} GiB each for {what}")
    results.check_writable()


def setup_case(ctx, factory, args):
    """The LM (the same on every rank), ``factory(model)`` (None: none), its finish call, AdamW,
    and this rank's slice of the batch."""
    torch.manual_seed(0)
    model = models.TransformerLM(args.model, context_length=args.context_length).to(ctx.device)
    wrapper = factory(model) if factory is not None else model
    finish = getattr(wrapper, "finish_gradient_synchronization", None) or (lambda: None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = args.batch_size // ctx.world_size      # this rank's slice of the global batch
    first = ctx.rank * rows
    x, y = models.random_tokens(args.batch_size, args.context_length, seed=0, device=ctx.device)
    return model, wrapper, finish, optimizer, x[first:first + rows], y[first:first + rows]


def wait_for(device: torch.device, compute_only: bool) -> None:
    """On a GPU, wait for the queued work: the compute stream's (``compute_only``: NCCL's streams
    may still be reducing, overlapping backward), or all of it."""
    if device.type != "cuda":
        return
    if compute_only:
        torch.cuda.current_stream(device).synchronize()
    else:
        torch.cuda.synchronize(device)


def time_steps(ctx, factory, args) -> tuple[list[float], ...]:
    """This rank's (fwd_bwd, comm, optimizer, step) seconds for one case's timed steps: as many
    as fit in ``case_budget_s / rounds`` at the slowest rank's warm-up pace (the same on every rank)."""
    model, wrapper, finish, optimizer, x, y = setup_case(ctx, factory, args)

    def clock(compute_only: bool = False) -> float:
        wait_for(ctx.device, compute_only)
        return time.perf_counter()

    def one_step() -> tuple[float, float, float, float]:
        t0 = clock()
        optimizer.zero_grad(set_to_none=True)
        models.lm_loss(wrapper(x), y).backward()
        t1 = clock(compute_only=True)
        finish()  # the communication left after backward; the compute stream waits for it
        t2 = clock(compute_only=True)
        optimizer.step()
        t3 = clock()
        return t1 - t0, t2 - t1, t3 - t2, t3 - t0

    pace = 0.0
    for _ in range(args.warmup):
        pace = one_step()[3]
    pace = timing.gather_times([pace]).max  # the slowest rank's; also lines the ranks up
    budget = args.case_budget_s / args.rounds
    steps = args.steps if pace <= 0 else max(2, min(args.steps, int(budget / pace)))
    if steps < args.steps:
        ctx.print(f"  note: {steps} timed steps instead of {args.steps}: at {pace:.2f} "
                  f"s/step the case would pass its {budget:.0f} s budget", all_ranks=False)
    times = tuple(list(t) for t in zip(*(one_step() for _ in range(steps))))
    del wrapper, model, optimizer
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return times


def backward_at(ctx, args, repeats: int = 7) -> dict:
    """Lesson 9's crossover, beside the control: a rank's backward at one row and at two rows of
    ``context_length`` (a line: a floor and a slope), and the all-reduce of the flat gradients right
    after the two rows', the ranks sharing the box as in a step, lined up before each: seconds."""
    model = models.TransformerLM(args.model, context_length=args.context_length).to(ctx.device)
    flat = torch.empty(sum(param.numel() for param in model.parameters()), device=ctx.device)
    seconds = {"bwd_one_row_ms": [], "bwd_two_rows_ms": [], "all_reduce_after_backward_ms": []}
    for _ in range(2 + repeats):  # two to warm up
        for name, rows in (("bwd_one_row_ms", 1), ("bwd_two_rows_ms", 2)):
            x, y = models.random_tokens(rows, args.context_length, seed=ctx.rank, device=ctx.device)
            model.zero_grad()
            loss = models.lm_loss(model(x), y)
            seconds[name] += timing.measure(loss.backward, ctx.device, warmup=0, iters=1, barrier=True)
        torch.cat([param.grad.flatten() for param in model.parameters()], out=flat)
        seconds["all_reduce_after_backward_ms"] += timing.measure(
            lambda: dist.all_reduce(flat), ctx.device, warmup=0, iters=1, barrier=True)
    return {name: times[2:] for name, times in seconds.items()}


def make_row(ctx, args, impl: str, bucket_mb, times) -> dict:
    """The CSV row for one case from its pooled seconds; a collective (every rank gets it)."""
    s_fb, s_comm, s_opt, s_step = (timing.gather_times(list(t)) for t in times)
    return {
        "backend": ctx.backend, "device": ctx.device.type, "world_size": ctx.world_size,
        "model": args.model, "impl": impl, "bucket_mb": "" if bucket_mb is None else bucket_mb,
        "step_ms": s_step.median * 1e3, "fwd_bwd_ms": s_fb.median * 1e3,
        "comm_after_backward_ms": s_comm.median * 1e3, "optimizer_ms": s_opt.median * 1e3,
        "comm_share": s_comm.median / s_step.median, "ratio_vs_torch_ddp": None,
        "step_ms_min": s_step.min * 1e3, "step_ms_max": s_step.max * 1e3,
        "slowest_rank": s_step.slowest_rank, "batch_size": args.batch_size,
        "context_length": args.context_length, "steps": len(times[0]), "warmup": args.warmup,
        "params": models.lm_parameter_count(args.model, context_length=args.context_length),
        "machine": results.machine_name(), "run_id": results.run_id(),
    }


def seconds_left() -> float:
    """Seconds to make bench's deadline for this step (``BENCH_STEP_DEADLINE``; none: inf)."""
    deadline = float(os.environ.get("BENCH_STEP_DEADLINE", "0") or 0)
    return deadline - time.time() if deadline else math.inf


def time_left_for(ctx, seconds: float) -> bool:
    """Whether ``seconds`` more fit before make bench's deadline for this step (inside a launch:
    rank 0's verdict; ``ctx`` None: the launcher's)."""
    verdict = [seconds <= seconds_left()]
    if ctx is not None:  # always: a rank that lacks the variable still takes rank 0's verdict
        dist.broadcast_object_list(verdict, src=0)
    return verdict[0]


SKIPPED = "skipped: past make bench's deadline for this step"


class Deadline:
    """Make bench's deadline for this step: a configuration starts while the previous one's
    seconds (or ``estimate``) still fit (``time_left_for``); the first that does not ends the
    step, said in one line. ``ctx`` None: outside a launch."""

    def __init__(self, ctx=None):
        self.ctx = ctx
        self.started = None              # when the previous configuration started
        self.stopped = False

    def allows(self, what: str, estimate: float | None = None) -> bool:
        now = time.perf_counter()
        if self.started is not None and not self.stopped:
            estimate = now - self.started if estimate is None else estimate
            self.stopped = not time_left_for(self.ctx, estimate)
            if self.stopped:
                line = f"{what}: {SKIPPED}; the rows above are written (about {estimate:.0f} s more)"
                if self.ctx is None:
                    print(line, flush=True)
                else:
                    self.ctx.print(line, all_ranks=False)
        self.started = now
        return not self.stopped


def until_deadline(ctx, configurations, what: str = "the rest"):
    """Yield each configuration while ``Deadline`` allows it."""
    deadline = Deadline(ctx)
    for configuration in configurations:
        if not deadline.allows(what):
            return
        yield configuration


def run_step_bench(ctx, cases, args, after_case=None) -> list[dict]:
    """Time every case beside ``none`` and ``torch_ddp`` (25 MB); rank 0 upserts the rows after
    each case, then prints them; ``after_case(rows so far)`` runs on every rank after each case."""
    refs = [("none", None, None), ("torch_ddp", TORCH_DDP_DEFAULT_BUCKET_MB, torch_ddp_factory())]
    cases = [r for r in refs if r[:2] not in {c[:2] for c in cases}] + list(cases)
    params = models.lm_parameter_count(args.model, context_length=args.context_length)
    ctx.print(f"step benchmark: LM {args.model} ({params / 1e6:.1f}M params), global batch "
              f"{args.batch_size}, context {args.context_length}, {args.warmup} warm-up + "
              f"{args.steps} timed steps x {args.rounds} round(s), AdamW, {ctx.world_size} "
              f"ranks, {ctx.backend}/{ctx.device.type}", all_ranks=False)
    pooled = [([], [], [], []) for _ in cases]
    bursts = ([], [])  # seconds a call, waited and asynchronous, beside the control, every round
    crossover = {}  # backward_at's seconds, every round's
    by_case = [None] * len(cases)  # each case's row from its steps so far
    rows = []
    deadline = Deadline(ctx)
    took = [None] * len(cases)  # each case's last seconds: its next round's estimate
    for i in [i for _ in range(args.rounds) for i in range(len(cases))]:
        if not deadline.allows("the cases and rounds left", took[i]):
            break
        impl, bucket_mb, factory = cases[i]
        start = time.perf_counter()
        times = time_steps(ctx, factory, args)
        took[i] = time.perf_counter() - start
        for acc, new in zip(pooled[i], times):
            acc.extend(new)
        ctx.print(f"  {impl}{'' if bucket_mb is None else f' ({bucket_mb} MB)'}: "
                  f"{statistics.median(times[3]) * 1e3:.1f} ms/step on rank 0", all_ranks=False)
        by_case[i] = make_row(ctx, args, impl, bucket_mb, pooled[i])
        if impl == "none":  # the same ranks, the same moment: what a small call costs now
            for column, asynchronous, seconds in zip(("call_ms", "async_call_ms"), (False, True), bursts):
                timing.call_in_burst(ctx.device, bursts=1, asynchronous=asynchronous)   # warm-up
                seconds += timing.call_in_burst(ctx.device, asynchronous=asynchronous)
                by_case[i][column] = timing.gather_times(seconds).median * 1e3
            for name, seconds in backward_at(ctx, args).items():  # every round's pooled
                crossover[name] = crossover.get(name, []) + seconds
                by_case[i][name] = timing.gather_times(crossover[name]).median * 1e3
        rows = [r for r in by_case if r is not None]
        ref = next((r for r in rows if (r["impl"], r["bucket_mb"]) == refs[1][:2]), None)
        for r in rows:  # none until torch DDP's case has run
            r["ratio_vs_torch_ddp"] = r["step_ms"] / ref["step_ms"] if ref else None
        if ctx.is_main:  # after every case: a run stopped later keeps what it measured
            results.upsert_csv(CSV_NAME, rows, key=CSV_KEY)
        if after_case is not None:
            after_case(rows)
    if ctx.is_main:
        results.print_table([{
            "impl": r["impl"], "bucket_mb": r["bucket_mb"], "step_ms": r["step_ms"],
            "fwd_bwd_ms": r["fwd_bwd_ms"], "comm_after_bwd_ms": r["comm_after_backward_ms"],
            "optimizer_ms": r["optimizer_ms"], "comm_share": f"{r['comm_share']:.0%}",
            "vs_torch_ddp": r["ratio_vs_torch_ddp"] and f"{r['ratio_vs_torch_ddp']:.2f}x"}
            for r in rows],
            title=f"\nTraining step, slowest rank's median ({results.machine_name()}):")
        print(f"rows in {results.results_dir() / CSV_NAME}", flush=True)
    return rows
