"""Not a lesson: lesson 4's bubble, measured (each rank's idle share per schedule and m).

The executor carries no clock: a subclass of its ``ScheduleRunner`` (``TimedRunner``) reads
the clock around each step's compute, and the pass is timed between two barriers: idle =
1 - busy / pass. Then the same with emulated compute: each chunk only waits (F, B, and W under
a split backward), the messages keep their real size and order, so the measured idle tests the
executor against the unit-time simulation on any machine (four ranks on two cores cannot show
a bubble with real compute). Writes ``results/pipeline_bubble.csv`` as each setting is
measured; prints the table, the verdict (within 0.05 of the simulation) and the timelines.
Then ZB-V and DualPipeV beside torch's own (``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``,
two ``PipelineStage``s per rank) on the same chunks, real (the same weights: how far the
gradients differ) and emulated; passes alternate, the ratio of medians is this run's (target:
ours at most 1.10x torch's). Writes ``results/pipeline_vs_torch.csv``. ``make bench`` runs it.

Run:  python 07_parallelism/measure/bench_pipeline.py --micro-batches 4,8,16 --emulate-ms 50
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from common import import_stage  # noqa: E402  (after the path)

from bench import results, timing

from bench import supervisor as launch

pipeline_parallel = import_stage("07_parallelism/04_pipeline_parallel/pipeline_parallel")
schedules = import_stage("07_parallelism/04_pipeline_parallel/pipeline_schedules")
schedule_check = import_stage("07_parallelism/measure/schedule_check")

MAX_EMULATE_MS = 60_000.0               # a minute per step: more is a typo, not a measurement
SIZE_COLUMNS = ("layers", "d_model", "hidden", "batch")


# --------------------------------------------------------------------------- timing from outside


class TimedRunner(pipeline_parallel.ScheduleRunner):
    """The executor's runner with a clock around each step's compute. The synchronize before
    and after each step drains the GPU there, which a real run never does: that is the price
    of knowing when a step's compute ended, and why the executor itself has none."""

    latest = None                       # the runner of the last pass: its busy time

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.busy_s = 0.0
        TimedRunner.latest = self

    def timed(self, work, *args):
        timing.synchronize(self.device)
        start = time.perf_counter()
        output = work(*args)
        timing.synchronize(self.device)
        self.busy_s += time.perf_counter() - start
        return output

    def forward_one(self, step, received):
        return self.timed(super().forward_one, step, received)

    def backward_one(self, step, received):
        return self.timed(super().backward_one, step, received)

    def weight_grad_one(self, step):
        return self.timed(super().weight_grad_one, step)


def timed_pass(chunks, schedule, micro_inputs, micro_targets, activation_shape,
               device: torch.device) -> dict:
    """``run_schedule`` with a clock around each step and one around the pass (barrier to
    barrier: the pass ends with its slowest rank). Adds busy_s and total_s to its result."""
    original = pipeline_parallel.ScheduleRunner
    pipeline_parallel.ScheduleRunner = TimedRunner
    try:
        timing.synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        result = pipeline_parallel.run_schedule(chunks, schedule, micro_inputs, micro_targets,
                                                activation_shape, device)
        timing.synchronize(device)
        dist.barrier()
        total_s = time.perf_counter() - start
    finally:
        pipeline_parallel.ScheduleRunner = original
    return {**result, "busy_s": TimedRunner.latest.busy_s, "total_s": total_s}


class Wait(torch.autograd.Function):
    """Stands in for a chunk's compute: the forward waits, and so does the backward (B)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class WaitingLinear(pipeline_parallel.DeferredLinear):
    """A 1 x 1 DeferredLinear (applied to every element) whose weight-gradient work waits
    ``w_seconds``: ZB-H1's W step, emulated (the executor defers it as it would a real one)."""

    def __init__(self, w_seconds: float):
        super().__init__(1, 1)
        self.w_seconds = w_seconds

    def weight_grad(self, x, grad_output):
        time.sleep(self.w_seconds)
        super().weight_grad(x, grad_output)


class EmulatedChunk(nn.Module):
    """A model chunk that only waits: F, B (and W when the schedule splits the backward) each
    take ``seconds``; the activation it hands on keeps its shape, so the messages are real."""

    def __init__(self, seconds: float, split_backward: bool):
        super().__init__()
        self.seconds = seconds
        w_seconds = 0.0
        if split_backward:
            w_seconds = seconds
        self.linear = WaitingLinear(w_seconds)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x.unsqueeze(-1)).squeeze(-1)   # [rows, d_model, 1] -> [rows, d_model]
        return Wait.apply(y, self.seconds)


# --------------------------------------------------------------------------- the bubble


def layers_of(cfg: dict, name: str, ctx) -> list[range]:
    """This rank's layers, one range per chunk, as schedule ``name`` lays them out."""
    return pipeline_parallel.chunk_layers(cfg["layers"], ctx.world_size, ctx.rank, cfg["v"][name],
                                          schedules.layout_of(name))


def one_pass(ctx, cfg: dict, model: nn.Sequential, name: str, m: int, emulated_ms: float) -> dict:
    """One timed pass of schedule ``name`` with m micro-batches: this rank's chunks of the
    model (real compute), or as many emulated chunks."""
    stages = ctx.world_size
    v = cfg["v"][name]
    schedule = schedules.all_ranks(name, stages, m, v)
    chunks = []
    if emulated_ms > 0:
        split_backward = any(step.op == schedules.WEIGHT for step in schedule[ctx.rank])
        for _ in range(v):
            chunks.append(EmulatedChunk(emulated_ms / 1e3, split_backward).to(ctx.device))
    else:
        model.zero_grad(set_to_none=True)
        for layers in layers_of(cfg, name, ctx):
            chunks.append(model[layers.start:layers.stop])
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(cfg["batch"], cfg["d_model"], generator=generator).to(ctx.device)
    targets = torch.randn(cfg["batch"], cfg["d_model"], generator=generator).to(ctx.device)
    micro_inputs = None
    if ctx.rank == 0:
        micro_inputs = list(inputs.chunk(m))           # m x [batch / m, d_model]
    micro_targets = None
    if ctx.rank == schedules.loss_rank(name, stages, v):
        micro_targets = list(targets.chunk(m))
    activation_shape = (cfg["batch"] // m, cfg["d_model"])
    return timed_pass(chunks, schedule, micro_inputs, micro_targets, activation_shape, ctx.device)


def measure_bubble(ctx, cfg: dict, model: nn.Sequential) -> list[dict]:
    """Every schedule and m: each rank's idle share (median over the timed passes), with real
    compute, then emulated; the step time; the most micro-batches held. Rank 0 writes the
    rows measured so far after each setting."""
    stages = ctx.world_size
    rows = []
    for name in cfg["schedules"]:
        v = cfg["v"][name]
        for m in cfg["micro_batches"]:
            if schedule_refuses(name, stages, m, v):
                continue                       # left out up front (main says which)
            simulated = schedule_check.simulated_idle(name, stages, m, v)
            peak = None
            for emulated_ms in (0.0, cfg["emulate_ms"]):    # real compute, then emulated
                passes = cfg["iters"]
                if emulated_ms == 0.0:
                    passes += cfg["warmup"]
                measured = []
                for _ in range(passes):
                    measured.append(one_pass(ctx, cfg, model, name, m, emulated_ms))
                timed = measured[-cfg["iters"]:]            # the warm-up passes are not timed
                if peak is None:
                    held = timing.gather_times([timed[0]["peak_held"]]).rank_medians
                    peak = [int(count) for count in held]
                idle_shares = []
                for result in timed:
                    idle_shares.append(1 - result["busy_s"] / result["total_s"])
                idle = timing.gather_times(idle_shares).rank_medians
                gap = 0.0
                for measured_share, unit_time in zip(idle, simulated):
                    gap = max(gap, abs(measured_share - unit_time))
                pass_seconds = [result["total_s"] for result in timed]
                rows.append({"schedule": name, "m": m, "v": v, "emulated_ms": emulated_ms,
                             "peak": peak, "idle": idle, "sim": simulated, "gap": gap,
                             "formula": schedule_check.bubble_formula(name, stages, m, v),
                             "step_ms": timing.gather_times(pass_seconds).median * 1e3})
                if ctx.is_main:
                    write_rows(ctx, cfg, rows)
    return rows


# --------------------------------------------------------------------------- beside torch's

TORCH_SCHEDULES = {"zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
TARGET_RATIO = 1.10                     # our executor at most 1.10x torch's, same chunks


class WeightWait(torch.autograd.Function):
    """A parameter's path that only waits, in the backward: a W step for torch's executor,
    which finds B and W in the autograd graph itself (an input's path is B, a parameter's W)."""

    @staticmethod
    def forward(ctx, weight, seconds):
        ctx.seconds = seconds
        return torch.zeros_like(weight)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class TorchEmulatedChunk(nn.Module):
    """``EmulatedChunk`` for torch's executor, in plain autograd: F waits, B waits on the
    input's path, W waits on a parameter's path (``seconds`` each, as ours)."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(()))
        self.weight = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = Wait.apply(x * self.scale, self.seconds)          # F, and B on the input's path
        return y + WeightWait.apply(self.weight, self.seconds)   # W on the parameter's path


def torch_schedule_class(name: str):
    """torch's class for schedule ``name``, or None where this torch has none."""
    import torch.distributed.pipelining as pipelining
    return getattr(pipelining, TORCH_SCHEDULES[name], None)


def build_both(ctx, cfg: dict, model: nn.Sequential, torch_model: nn.Sequential, name: str,
               m: int, emulated_ms: float) -> dict:
    """Our executor and torch's, on the same chunks of the V (real: the same weights; emulated:
    the same waits), the same micro-batches: one timed pass of each, and their chunks."""
    from torch.distributed.pipelining import PipelineStage
    stages = ctx.world_size
    v = cfg["v"][name]
    layout = schedules.layout_of(name)
    ours = []
    theirs = []
    torch_stages = []
    for chunk, layers in enumerate(layers_of(cfg, name, ctx)):
        if emulated_ms > 0:
            ours.append(EmulatedChunk(emulated_ms / 1e3, True).to(ctx.device))
            module = TorchEmulatedChunk(emulated_ms / 1e3).to(ctx.device)
        else:
            ours.append(model[layers.start:layers.stop])
            module = torch_model[layers.start:layers.stop]
        theirs.append(module)
        virtual_stage = schedules.stage_of(ctx.rank, chunk, stages, layout)
        torch_stages.append(PipelineStage(module, virtual_stage, stages * v, ctx.device))
    torch_schedule = torch_schedule_class(name)(torch_stages, m, loss_fn=nn.functional.mse_loss)
    schedule = schedules.all_ranks(name, stages, m, v)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(cfg["batch"], cfg["d_model"], generator=generator).to(ctx.device)
    targets = torch.randn(cfg["batch"], cfg["d_model"], generator=generator).to(ctx.device)
    holds_ends = ctx.rank == 0                      # the V: the data and the loss on rank 0
    micro_inputs = None
    micro_targets = None
    if holds_ends:
        micro_inputs = list(inputs.chunk(m))           # m x [batch / m, d_model]
        micro_targets = list(targets.chunk(m))
    activation_shape = (cfg["batch"] // m, cfg["d_model"])

    def ours_pass() -> None:
        for chunk in ours:
            chunk.zero_grad(set_to_none=True)
        pipeline_parallel.run_schedule(ours, schedule, micro_inputs, micro_targets,
                                       activation_shape, ctx.device)

    def torch_pass() -> None:
        for chunk in theirs:
            chunk.zero_grad(set_to_none=True)
        if holds_ends:
            torch_schedule.step(inputs, target=targets, losses=[])
        else:
            torch_schedule.step()

    return {"ours": ours_pass, "torch": torch_pass, "our_chunks": ours, "torch_chunks": theirs}


def pass_seconds(ctx, run) -> float:
    """One pass, barrier to barrier: it ends with the slowest rank."""
    timing.synchronize(ctx.device)
    dist.barrier()
    start = time.perf_counter()
    run()
    timing.synchronize(ctx.device)
    dist.barrier()
    return time.perf_counter() - start


def largest_gradient_difference(built: dict) -> float:
    """|our gradient - torch's|, largest over this rank's parameters, after a pass of each."""
    largest = 0.0
    for ours, theirs in zip(built["our_chunks"], built["torch_chunks"]):
        for mine, other in zip(ours.parameters(), theirs.parameters()):
            largest = max(largest, (mine.grad - other.grad).abs().max().item())
    return largest


def compare_with_torch(ctx, cfg: dict, model: nn.Sequential) -> list[dict]:
    """Each V schedule of ``cfg`` at its largest m, real and emulated compute: a pass of ours,
    then of torch's, ``iters`` times after one untimed pass each (torch infers the shapes in
    its first); the medians of the slowest rank, and (real) how far the gradients differ."""
    stages = ctx.world_size
    torch_model = pipeline_parallel.build_model(cfg["layers"], cfg["d_model"], cfg["hidden"],
                                                linear=nn.Linear).to(ctx.device)
    from common.launch import carries_point_to_point
    rows = []
    if not carries_point_to_point(ctx.backend, ctx.device.type):
        if ctx.is_main:
            print(f"torch.distributed.pipelining: skipped ({ctx.backend} cannot send "
                  f"{ctx.device.type} tensors point to point)", flush=True)
        return rows
    for name in cfg["schedules"]:
        if name not in TORCH_SCHEDULES:
            continue
        if torch_schedule_class(name) is None:
            if ctx.is_main:
                print(f"torch {torch.__version__} has no {TORCH_SCHEDULES[name]}: no row for it")
            continue
        m = max(cfg["micro_batches"])
        if schedule_refuses(name, stages, m, cfg["v"][name]):
            continue
        for emulated_ms in (0.0, cfg["emulate_ms"]):
            built = build_both(ctx, cfg, model, torch_model, name, m, emulated_ms)
            built["ours"]()
            built["torch"]()
            difference = float("nan")
            if emulated_ms == 0.0:
                difference = largest_gradient_difference(built)
                difference = max(timing.gather_times([difference]).rank_medians)
            seconds = {"ours": [], "torch": []}
            for _ in range(cfg["iters"]):
                for impl in ("ours", "torch"):
                    seconds[impl].append(pass_seconds(ctx, built[impl]))
            ours_s = timing.gather_times(seconds["ours"]).median
            torch_s = timing.gather_times(seconds["torch"]).median
            ideal_ms = float("nan")             # real compute: no unit to count in
            if emulated_ms > 0:
                timed = schedules.simulate(schedules.all_ranks(name, stages, m, cfg["v"][name]))
                ideal_ms = emulated_ms * max(end for row in timed for _, end, _ in row)
            rows.append({"schedule": name, "m": m, "v": cfg["v"][name],
                         "emulated_ms": emulated_ms, "ours_ms": ours_s * 1e3,
                         "torch_ms": torch_s * 1e3, "ratio": ours_s / torch_s,
                         "ideal_ms": ideal_ms,
                         "gradient_max_difference": difference,
                         "torch_class": TORCH_SCHEDULES[name]})
    return rows


def bench_main(ctx, cfg: dict) -> None:
    """The worker: every schedule and m measured, the V schedules beside torch's; rank 0
    prints and writes the results."""
    # Each rank builds all layers from one seed (the same weights, nothing sent), runs its own.
    model = pipeline_parallel.build_model(cfg["layers"], cfg["d_model"], cfg["hidden"])
    model = model.to(ctx.device)
    rows = measure_bubble(ctx, cfg, model)
    if ctx.is_main:
        report(ctx, cfg, rows)                   # written before torch's rows: a run stopped
    torch_rows = []                              # at its cap keeps what it measured
    if cfg.get("beside_torch", True):          # the tests run it on their own (its import is slow)
        torch_rows = compare_with_torch(ctx, cfg, model)
    if ctx.is_main:
        report_torch(ctx, cfg, torch_rows)


def report_torch(ctx, cfg: dict, rows: list[dict]) -> None:
    """Rank 0: our executor beside torch's on the V schedules; results/pipeline_vs_torch.csv."""
    if not rows:
        return
    table = []
    csv_rows = []
    for row in rows:
        compute = "real"
        if row["emulated_ms"]:
            compute = f"emulated {row['emulated_ms']:g} ms"
        table.append({"schedule": row["schedule"], "torch": row["torch_class"], "m": row["m"],
                      "compute": compute, "ours_ms": row["ours_ms"], "torch_ms": row["torch_ms"],
                      "ours / torch": row["ratio"], "unit-time ideal_ms": row["ideal_ms"],
                      "max |grad ours - torch|": row["gradient_max_difference"]})
        csv_row = dict(backend=ctx.backend, device=ctx.device.type, world_size=ctx.world_size)
        for key in SIZE_COLUMNS:
            csv_row[key] = cfg[key]
        csv_row.update(schedule=row["schedule"], torch_schedule=row["torch_class"],
                       micro_batches=row["m"], chunks=row["v"], emulated_ms=row["emulated_ms"],
                       ours_ms=row["ours_ms"], torch_ms=row["torch_ms"], ratio=row["ratio"],
                       ideal_ms=row["ideal_ms"],
                       gradient_max_difference=row["gradient_max_difference"],
                       run_id=results.run_id(), machine=results.machine_name())
        csv_rows.append(csv_row)
    results.print_table(table, f"\nOur executor beside torch.distributed.pipelining on the same "
                        f"chunks (two PipelineStages per rank), pass time, slowest rank's median "
                        f"of {cfg['iters']}; {ctx.backend}/{ctx.device.type}:", floatfmt=".3g")
    worst = max(row["ratio"] for row in rows)
    verdict = "yes"
    if worst > TARGET_RATIO:
        verdict = "no"
    print(f"ours at most {TARGET_RATIO:.2f}x torch's in every row: {verdict} (largest "
          f"{worst:.2f}x; a ratio within this run, on this machine)")
    key = ["backend", "device", "world_size", *SIZE_COLUMNS, "schedule", "micro_batches",
           "emulated_ms"]
    path = results.upsert_csv("pipeline_vs_torch.csv", csv_rows, key=key)
    print(f"wrote {path}")


def write_rows(ctx, cfg: dict, rows: list[dict]):
    """Rank 0: upsert the settings measured so far into results/pipeline_bubble.csv."""
    size = {}
    for key in SIZE_COLUMNS:
        size[key] = cfg[key]
    csv_rows = []
    for row in rows:
        for rank in range(ctx.world_size):
            csv_rows.append(dict(
                backend=ctx.backend, device=ctx.device.type, world_size=ctx.world_size, **size,
                schedule=row["schedule"], micro_batches=row["m"], rank=rank,
                idle_share=row["idle"][rank], idle_share_simulated=row["sim"][rank],
                idle_share_formula=row["formula"], peak_held=row["peak"][rank],
                step_ms=row["step_ms"], run_id=results.run_id(), emulated_ms=row["emulated_ms"],
                chunks=row["v"], machine=results.machine_name()))
    key = ["backend", "device", "world_size", *size, "schedule", "micro_batches", "chunks",
           "emulated_ms", "rank"]
    return results.upsert_csv("pipeline_bubble.csv", csv_rows, key=key)


def report(ctx, cfg: dict, rows: list[dict]) -> None:
    """Rank 0: the table, the emulated-compute verdict, the timelines, the CSV."""
    stages = ctx.world_size
    size_text = ", ".join(f"{key} {cfg[key]}" for key in SIZE_COLUMNS)
    print(f"\nPipeline parallel, {stages} stages, {size_text}; {ctx.backend}/{ctx.device.type}, "
          f"{results.machine_name()}\n")
    table = []
    for row in rows:
        compute = "real"
        if row["emulated_ms"]:
            compute = f"emulated {row['emulated_ms']:g} ms"
        table.append({"schedule": row["schedule"], "m": row["m"], "v": row["v"],
                      "compute": compute,
                      "idle per rank": " ".join(f"{share:.3f}" for share in row["idle"]),
                      "simulated": statistics.fmean(row["sim"]), "formula": row["formula"],
                      "max gap": row["gap"], "step_ms": row["step_ms"],
                      "peak held per rank": " ".join(str(count) for count in row["peak"])})
    results.print_table(table, f"Idle share per rank (median of {cfg['iters']} passes) beside "
                        "the unit-time simulation and the formula; activations held at once:",
                        floatfmt=".3f")
    emulated_gaps = [row["gap"] for row in rows if row["emulated_ms"]]
    gap = max(emulated_gaps)
    if gap <= 0.05:
        verdict = f"yes (largest gap {gap:.3f})"
    else:
        verdict = (f"no, {gap:.3f} (each message's delay on a busy box adds to it; a larger "
                   "--emulate-ms shrinks its share)")
    print("\nemulated compute: measured idle within 0.05 of the simulation on every rank: "
          + verdict)
    for name in cfg["schedules"]:
        m = max(cfg["micro_batches"])
        if not schedule_refuses(name, stages, m, cfg["v"][name]):
            print("\n" + schedule_check.describe(name, stages, m, cfg["v"][name]))
    path = write_rows(ctx, cfg, rows)
    print(f"\nwrote {path}")


# --------------------------------------------------------------------------- flags
# The lesson's flags (as run_pipeline.py has them) and the measurement's.


def emulate_ms_flag(text: str) -> float:
    """--emulate-ms: a finite number of milliseconds in (0, MAX_EMULATE_MS]."""
    allowed = f"a number of milliseconds > 0 and <= {MAX_EMULATE_MS:g}"
    try:
        value = launch.positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {allowed}") from None
    if value > MAX_EMULATE_MS:
        raise argparse.ArgumentTypeError(f"{text!r} is not {allowed}")
    return value


def check_memory(args, config) -> None:
    """A rank's rough peak, float32: the whole stack built on every rank with its gradients
    and copies (5 x the parameters; 7 x with torch's copy and its gradients, beside the V
    schedules), and the activations of the micro-batches held."""
    parameters = args.layers * (2 * args.d_model * args.hidden + args.d_model + args.hidden)
    activations = 2 * args.layers * args.batch * (args.d_model + 2 * args.hidden)
    copies = 5
    for name in args.schedules:
        if name in TORCH_SCHEDULES:
            copies = 7
    need = 4 * (copies * parameters + activations)
    what = (f"--layers {args.layers} --d-model {args.d_model} --hidden {args.hidden} "
            f"--batch {args.batch}")
    launch.check_fits(config, need, f"{need / 2**30:.2f} GiB each for {what}")


def schedule_refuses(name: str, stages: int, m: int, v: int) -> str:
    """Why schedule ``name`` cannot run m micro-batches on these stages ('' when it can): its
    own rule, such as m a multiple of p for interleaved or m >= 2p for DualPipeV."""
    try:
        schedule_check.check_setting(name, stages, m, v)
    except ValueError as error:
        return str(error)
    return ""


def main(argv=None) -> None:
    names = list(schedules.SCHEDULES)
    parser = launch.make_parser(__doc__, world_size=4)
    parser.add_argument("--layers", type=launch.positive_int, default=8,
                        help="residual MLP blocks; must divide by p (x v)")
    parser.add_argument("--d-model", type=launch.positive_int, default=256,
                        help="activation width")
    parser.add_argument("--hidden", type=launch.positive_int, default=1024,
                        help="hidden width inside a block")
    parser.add_argument("--batch", type=launch.positive_int, default=64,
                        help="rows per batch; must divide by every m")
    parser.add_argument("--micro-batches", type=launch.int_list, default=None,
                        help="micro-batch counts m; default: 2p")
    parser.add_argument("--schedules", type=launch.choice_list(names), default=None,
                        help="subset of " + ",".join(names) + "; default: all, each at the m "
                        "it allows")
    parser.add_argument("--chunks", type=launch.positive_int, default=2,
                        help="v, model chunks per rank (interleaved only); at most layers / p")
    parser.add_argument("--emulate-ms", type=emulate_ms_flag, default=20.0,
                        help="measure also with every F, B, W replaced by a wait of this many ms "
                        f"(emulated compute; the messages stay real); at most {MAX_EMULATE_MS:g}")
    parser.add_argument("--warmup", type=launch.non_negative_int, default=0,
                        help="untimed passes before the timed ones (real compute)")
    parser.add_argument("--iters", type=launch.positive_int, default=3,
                        help="timed passes per setting")
    parser.add_argument("--bench", action="store_true",
                        help="accepted for make bench's sake: this script only measures")
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    stages = config.world_size
    if args.micro_batches is None:
        args.micro_batches = [2 * stages]
    schedules_named = args.schedules is not None
    if not schedules_named:
        args.schedules = names
    args.v = {}
    for name in args.schedules:
        args.v[name] = schedules.chunks_per_rank(name, args.chunks)
    if "interleaved" in args.schedules:
        layers_per_stage = args.layers // stages           # a chunk holds one layer at least
        if args.layers % stages == 0 and args.chunks > layers_per_stage:
            launch.usage_error(f"--chunks {args.chunks} with --layers {args.layers} on {stages} "
                               f"stages: a stage holds {layers_per_stage} layer(s), so at most "
                               f"{layers_per_stage} chunk(s) (allowed: 1 to {layers_per_stage})")
    for name in args.schedules:
        for m in args.micro_batches:
            refusal = schedule_refuses(name, stages, m, args.v[name])
            if refusal and not schedules_named:    # all schedules, by default: skip this one
                print(f"bench_pipeline.py: {name} left out at m={m}: {refusal}")
                continue
            try:
                schedule_check.check_setting(name, stages, m, args.v[name], args.layers, args.batch)
            except ValueError as error:
                launch.usage_error(f"--schedules {name} --micro-batches {m} --layers "
                                   f"{args.layers} --batch {args.batch}: {error}")
    check_memory(args, config)
    results.check_writable()
    launch.launch(bench_main, config, vars(args))


if __name__ == "__main__":
    main()
