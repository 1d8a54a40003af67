"""Not a lesson: lesson 4's bubble, measured (each rank's idle share per schedule and m).

``TimedRunner`` (the executor's runner) clocks each step's compute, two barriers the pass:
idle = 1 - busy / pass. Then with emulated compute (each F, B, W only waits; the messages stay real), which
tests the executor against the unit-time simulation on any machine (verdict: within 0.05). Writes
``results/pipeline_bubble.csv`` as each setting lands; prints the table and timelines. Then ZB-V and
DualPipeV beside torch's ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` on the same chunks (target:
ours at most 1.10x torch's): ``results/pipeline_vs_torch.csv``. A setting that cannot end before make
bench's deadline (``BENCH_STEP_DEADLINE``) is skipped with a line.

Run:  python 07_parallelism/measure/bench_pipeline.py --micro-batches 4,8,16 --emulate-ms 50
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import results, step_bench, timing  # noqa: E402  (after the path)
from bench import supervisor as launch  # noqa: E402
from common import import_stage  # noqa: E402
from common.launch import carries_point_to_point  # noqa: E402

pipeline_parallel = import_stage("07_parallelism/04_pipeline_parallel/pipeline_parallel")
schedules = import_stage("07_parallelism/04_pipeline_parallel/pipeline_schedules")
schedule_check = import_stage("07_parallelism/measure/schedule_check")

MAX_EMULATE_MS = 60_000.0               # a minute per step: more is a typo, not a measurement
SIZE_COLUMNS = ("layers", "d_model", "hidden", "batch")
TORCH_SCHEDULES = {"zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
TARGET_RATIO = 1.10                     # our executor at most 1.10x torch's, same chunks


class TimedRunner(pipeline_parallel.ScheduleRunner):
    """The executor's runner with each step's compute clocked (draining the GPU: a cost)."""

    latest = None                       # the runner of the last pass: its busy time

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.busy_s = 0.0
        TimedRunner.latest = self
        for step_kind in ("forward_one", "backward_one", "weight_grad_one"):   # F, B, W
            setattr(self, step_kind, functools.partial(self.timed, getattr(super(), step_kind)))

    def timed(self, work, *args):
        timing.synchronize(self.device)
        start = time.perf_counter()
        output = work(*args)
        timing.synchronize(self.device)
        self.busy_s += time.perf_counter() - start
        return output


def pass_seconds(device: torch.device, run) -> tuple:
    """(run(), its seconds), barrier to barrier: a pass ends with its slowest rank."""
    timing.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    output = run()
    timing.synchronize(device)
    dist.barrier()
    return output, time.perf_counter() - start


class Wait(torch.autograd.Function):
    """Stands in for compute: x, after ``seconds``; its gradient after ``backward_s``."""

    @staticmethod
    def forward(ctx, x, seconds, backward_s):
        ctx.backward_s = backward_s
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class EmulatedChunk(pipeline_parallel.DeferredLinear):
    """A model chunk that only waits: F, B (and W of this 1 x 1 DeferredLinear, when the schedule
    splits the backward) each take ``seconds``; what it hands on keeps its shape."""

    def __init__(self, seconds: float, split_backward: bool):
        super().__init__(1, 1)
        self.seconds = seconds
        self.w_seconds = seconds if split_backward else 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x.unsqueeze(-1)).squeeze(-1)   # [rows, d_model, 1] -> [rows, d_model]
        return Wait.apply(y, self.seconds, self.seconds)

    def weight_grad(self, x, grad_output):
        time.sleep(self.w_seconds)
        super().weight_grad(x, grad_output)


class TorchEmulatedChunk(nn.Module):
    """``EmulatedChunk`` in plain autograd, for torch's executor (either executor without W)."""

    def __init__(self, seconds: float, split_backward: bool = True):
        super().__init__()
        self.seconds = seconds
        self.w_seconds = seconds if split_backward else 0.0
        self.scale = nn.Parameter(torch.ones(()))
        self.weight = nn.Parameter(torch.zeros(()))         # 0: adds nothing, W waits on it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = Wait.apply(x * self.scale, self.seconds, self.seconds)   # F; B on the input's path
        return y + Wait.apply(self.weight, 0.0, self.w_seconds)     # W on the parameter's path


def torch_schedule_class(name: str):
    """torch's class for schedule ``name``, or None where this torch has none."""
    import torch.distributed.pipelining as pipelining
    return getattr(pipelining, TORCH_SCHEDULES[name], None)


def beside_torch(ctx, name: str, m: int, ours: list, modules: list, inputs, targets, stages: int,
                 rank: int, group=None) -> dict:
    """Schedule ``name`` on m micro-batches of ``inputs`` and ``targets``: our executor on ``ours``,
    torch's on ``modules`` (the same chunks); a pass of each, and the unit-time makespan."""
    from torch.distributed import pipelining
    v = len(ours)
    schedule = schedules.all_ranks(name, stages, m, v)
    loss_rank = schedules.loss_rank(name, stages, v)           # p - 1, or 0 on the V
    torch_stages = [pipelining.PipelineStage(
        module, schedules.stage_of(rank, chunk, stages, schedules.layout_of(name)), stages * v,
        ctx.device, group=group) for chunk, module in enumerate(modules)]
    if name in ("gpipe", "1f1b"):                              # one stage a rank
        single = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[name]
        theirs = single(torch_stages[0], m, loss_fn=nn.functional.mse_loss)
    else:
        multi = getattr(pipelining, TORCH_SCHEDULES.get(name, "ScheduleInterleaved1F1B"))
        theirs = multi(torch_stages, m, loss_fn=nn.functional.mse_loss)
    micro_inputs = list(inputs.chunk(m)) if rank == 0 else None
    micro_targets = list(targets.chunk(m)) if rank == loss_rank else None
    activation_shape = (inputs.shape[0] // m, *inputs.shape[1:])

    def ours_step() -> None:
        for chunk in ours:
            chunk.zero_grad(set_to_none=True)
        pipeline_parallel.run_schedule(ours, schedule, micro_inputs, micro_targets,
                                       activation_shape, ctx.device, group=group)

    def torch_step() -> None:
        for module in modules:
            module.zero_grad(set_to_none=True)
        first = [inputs] if rank == 0 else []                   # the V: both on rank 0
        loss = {"target": targets, "losses": []} if rank == loss_rank else {}
        theirs.step(*first, **loss)

    timed = schedules.simulate(schedule)
    makespan = max(end for row in timed for _, end, _ in row)
    return {"ours": ours_step, "torch": torch_step, "our_chunks": ours,
            "torch_stages": torch_stages, "makespan": makespan}


def gradient_difference(built: dict) -> float:
    """Largest |our gradient - torch's| on this rank after a step of each (real compute)."""
    worst = 0.0
    for chunk, stage in zip(built["our_chunks"], built["torch_stages"]):
        for ours, theirs in zip(chunk.parameters(), stage.submod.parameters()):
            worst = max(worst, (ours.grad - theirs.grad).abs().max().item())
    return worst


def layers_of(cfg: dict, name: str, ctx) -> list[range]:
    """This rank's layers, one range per chunk, as schedule ``name`` lays them out."""
    return pipeline_parallel.chunk_layers(cfg["layers"], ctx.world_size, ctx.rank, cfg["v"][name],
                                          schedules.layout_of(name))


def batch_of(ctx, cfg: dict, m: int, loss_rank: int) -> tuple:
    """(inputs, targets), the same on every rank, and their m micro-batches where they are used."""
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(cfg["batch"], cfg["d_model"], generator=generator).to(ctx.device)
    targets = torch.randn(cfg["batch"], cfg["d_model"], generator=generator).to(ctx.device)
    micro_inputs = list(inputs.chunk(m)) if ctx.rank == 0 else None   # m x [batch / m, d_model]
    micro_targets = list(targets.chunk(m)) if ctx.rank == loss_rank else None
    return inputs, targets, micro_inputs, micro_targets


def one_pass(ctx, cfg: dict, model: nn.Sequential, name: str, m: int, emulated_ms: float) -> dict:
    """One timed pass of schedule ``name`` with m micro-batches on this rank's chunks of the
    model (real compute) or as many emulated chunks: run_schedule's result, busy_s, total_s."""
    stages = ctx.world_size
    v = cfg["v"][name]
    schedule = schedules.all_ranks(name, stages, m, v)
    if emulated_ms > 0:
        split_backward = any(step.op == schedules.WEIGHT for step in schedule[ctx.rank])
        chunks = [EmulatedChunk(emulated_ms / 1e3, split_backward).to(ctx.device) for _ in range(v)]
    else:
        model.zero_grad(set_to_none=True)
        chunks = [model[layers.start:layers.stop] for layers in layers_of(cfg, name, ctx)]
    _, _, micro_inputs, micro_targets = batch_of(ctx, cfg, m, schedules.loss_rank(name, stages, v))
    activation_shape = (cfg["batch"] // m, cfg["d_model"])
    original = pipeline_parallel.ScheduleRunner
    pipeline_parallel.ScheduleRunner = TimedRunner
    try:
        result, total_s = pass_seconds(ctx.device, lambda: pipeline_parallel.run_schedule(
            chunks, schedule, micro_inputs, micro_targets, activation_shape, ctx.device))
    finally:
        pipeline_parallel.ScheduleRunner = original
    return {**result, "busy_s": TimedRunner.latest.busy_s, "total_s": total_s}


def measure_bubble(ctx, cfg: dict, model: nn.Sequential, deadline: step_bench.Deadline) -> list[dict]:
    """Every schedule and m, real compute then emulated: each rank's idle share (median of the
    timed passes), the step time, the most micro-batches held; written after each setting."""
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
                if not deadline.allows(f"{name} m={m}, {compute_of(emulated_ms)} and what follows"):
                    return rows
                passes = cfg["iters"] + (cfg["warmup"] if emulated_ms == 0.0 else 0)
                measured = [one_pass(ctx, cfg, model, name, m, emulated_ms) for _ in range(passes)]
                timed = measured[-cfg["iters"]:]            # the warm-up passes are not timed
                if peak is None:
                    held = timing.gather_times([timed[0]["peak_held"]]).rank_medians
                    peak = [int(count) for count in held]
                shares = [1 - result["busy_s"] / result["total_s"] for result in timed]
                idle = timing.gather_times(shares).rank_medians
                totals = [result["total_s"] for result in timed]
                gap = max((abs(share - unit) for share, unit in zip(idle, simulated)), default=0.0)
                rows.append({"schedule": name, "m": m, "v": v, "emulated_ms": emulated_ms,
                             "peak": peak, "idle": idle, "sim": simulated, "gap": gap,
                             "formula": schedule_check.bubble_formula(name, stages, m, v),
                             "step_ms": timing.gather_times(totals).median * 1e3})
                if ctx.is_main:
                    write_rows(ctx, cfg, rows)
    return rows


def compare_with_torch(ctx, cfg: dict, model: nn.Sequential, deadline=None) -> list[dict]:
    """Each V schedule at its largest m, real and emulated, ours and torch's on the same chunks:
    ``iters`` alternating passes after an untimed one each (torch infers shapes in it), the
    slowest rank's medians, and (real) how far the gradients differ."""
    stages = ctx.world_size
    torch_model = pipeline_parallel.build_model(cfg["layers"], cfg["d_model"], cfg["hidden"],
                                                linear=nn.Linear).to(ctx.device)
    if not carries_point_to_point(ctx.backend, ctx.device.type):
        if ctx.is_main:
            print(f"torch.distributed.pipelining: skipped ({ctx.backend} cannot send "
                  f"{ctx.device.type} tensors point to point)", flush=True)
        return []
    deadline = deadline or step_bench.Deadline(ctx)
    rows = []
    for name in cfg["schedules"]:
        if name not in TORCH_SCHEDULES:
            continue
        if torch_schedule_class(name) is None:
            if ctx.is_main:
                print(f"torch {torch.__version__} has no {TORCH_SCHEDULES[name]}: no row for it")
            continue
        v = cfg["v"][name]
        m = max(cfg["micro_batches"])
        if schedule_refuses(name, stages, m, v):
            continue
        for emulated_ms in (0.0, cfg["emulate_ms"]):
            if not deadline.allows(f"{name} beside torch's, {compute_of(emulated_ms)} and what follows"):
                return rows
            ours, theirs = [], []
            for layers in layers_of(cfg, name, ctx):
                if emulated_ms > 0:
                    ours.append(EmulatedChunk(emulated_ms / 1e3, True).to(ctx.device))
                    theirs.append(TorchEmulatedChunk(emulated_ms / 1e3).to(ctx.device))
                else:
                    ours.append(model[layers.start:layers.stop])
                    theirs.append(torch_model[layers.start:layers.stop])
            inputs, targets, _, _ = batch_of(ctx, cfg, m, 0)
            built = beside_torch(ctx, name, m, ours, theirs, inputs, targets, stages, ctx.rank)
            built["ours"]()
            built["torch"]()
            difference = float("nan")
            if emulated_ms == 0.0:  # the largest over the ranks
                difference = max(timing.gather_times([gradient_difference(built)]).rank_medians)
            seconds = {"ours": [], "torch": []}
            for _ in range(cfg["iters"]):
                for impl in ("ours", "torch"):
                    seconds[impl].append(pass_seconds(ctx.device, built[impl])[1])
            ours_s = timing.gather_times(seconds["ours"]).median
            torch_s = timing.gather_times(seconds["torch"]).median
            ideal_ms = emulated_ms * built["makespan"] if emulated_ms else float("nan")
            rows.append(dict(
                backend=ctx.backend, device=ctx.device.type, world_size=ctx.world_size,
                **{key: cfg[key] for key in SIZE_COLUMNS}, schedule=name,
                torch_schedule=TORCH_SCHEDULES[name], micro_batches=m, chunks=v, emulated_ms=emulated_ms,
                ours_ms=ours_s * 1e3, torch_ms=torch_s * 1e3, ratio=ours_s / torch_s, ideal_ms=ideal_ms,
                gradient_max_difference=difference, run_id=results.run_id(), machine=results.machine_name()))
    return rows


def bench_main(ctx, cfg: dict) -> None:
    """The worker: every schedule and m, then the V schedules beside torch's; rank 0 reports."""
    # Each rank builds all layers from one seed (the same weights, nothing sent), runs its own.
    model = pipeline_parallel.build_model(cfg["layers"], cfg["d_model"], cfg["hidden"]).to(ctx.device)
    deadline = step_bench.Deadline(ctx)
    rows = measure_bubble(ctx, cfg, model, deadline)
    if ctx.is_main:
        report(ctx, cfg, rows)                   # written before torch's rows: a run stopped
    torch_rows = []                              # at its cap keeps what it measured
    if cfg.get("beside_torch", True):          # the tests run it on their own (its import is slow)
        torch_rows = compare_with_torch(ctx, cfg, model, deadline)
    if ctx.is_main:
        report_torch(ctx, cfg, torch_rows)


def compute_of(emulated_ms: float) -> str:
    return f"emulated {emulated_ms:g} ms" if emulated_ms else "real"


def report_torch(ctx, cfg: dict, rows: list[dict]) -> None:
    """Rank 0: our executor beside torch's on the V schedules; results/pipeline_vs_torch.csv."""
    if not rows:
        return
    table = [{"schedule": row["schedule"], "torch": row["torch_schedule"],
              "m": row["micro_batches"], "compute": compute_of(row["emulated_ms"]),
              "ours_ms": row["ours_ms"], "torch_ms": row["torch_ms"],
              "ours / torch": row["ratio"], "unit-time ideal_ms": row["ideal_ms"],
              "max |grad ours - torch|": row["gradient_max_difference"]} for row in rows]
    results.print_table(table, f"\nOur executor beside torch.distributed.pipelining on the same "
                        f"chunks (two PipelineStages per rank), pass time, slowest rank's median "
                        f"of {cfg['iters']}; {ctx.backend}/{ctx.device.type}:", floatfmt=".3g")
    worst = max(row["ratio"] for row in rows)
    verdict = "yes" if worst <= TARGET_RATIO else "no"
    print(f"ours at most {TARGET_RATIO:.2f}x torch's in every row: {verdict} (largest "
          f"{worst:.2f}x; a ratio within this run, on this machine)")
    key = ["backend", "device", "world_size", *SIZE_COLUMNS, "schedule", "micro_batches", "emulated_ms"]
    print(f"wrote {results.upsert_csv('pipeline_vs_torch.csv', rows, key=key)}")


def write_rows(ctx, cfg: dict, rows: list[dict]):
    """Rank 0: upsert the settings measured so far into results/pipeline_bubble.csv."""
    csv_rows = [dict(backend=ctx.backend, device=ctx.device.type, world_size=ctx.world_size,
                     **{key: cfg[key] for key in SIZE_COLUMNS}, schedule=row["schedule"],
                     micro_batches=row["m"], rank=rank, idle_share=row["idle"][rank],
                     idle_share_simulated=row["sim"][rank], idle_share_formula=row["formula"],
                     peak_held=row["peak"][rank], step_ms=row["step_ms"], run_id=results.run_id(),
                     emulated_ms=row["emulated_ms"], chunks=row["v"], machine=results.machine_name())
                for row in rows for rank in range(ctx.world_size)]
    key = ["backend", "device", "world_size", *SIZE_COLUMNS, "schedule", "micro_batches",
           "chunks", "emulated_ms", "rank"]
    return results.upsert_csv("pipeline_bubble.csv", csv_rows, key=key)


def report(ctx, cfg: dict, rows: list[dict]) -> None:
    """Rank 0: the table, the emulated-compute verdict, the timelines, the CSV."""
    stages = ctx.world_size
    size_text = ", ".join(f"{key} {cfg[key]}" for key in SIZE_COLUMNS)
    print(f"\nPipeline parallel, {stages} stages, {size_text}; {ctx.backend}/{ctx.device.type}, "
          f"{results.machine_name()}\n")
    table = [{"schedule": row["schedule"], "m": row["m"], "v": row["v"],
              "compute": compute_of(row["emulated_ms"]),
              "idle per rank": " ".join(f"{share:.3f}" for share in row["idle"]),
              "simulated": statistics.fmean(row["sim"]), "formula": row["formula"],
              "max gap": row["gap"], "step_ms": row["step_ms"],
              "peak held per rank": " ".join(str(count) for count in row["peak"])} for row in rows]
    results.print_table(table, f"Idle share per rank (median of {cfg['iters']} passes) beside the unit-time "
                        "simulation and the formula; activations held at once:", floatfmt=".3f")
    gap = max((row["gap"] for row in rows if row["emulated_ms"]), default=None)
    if gap is not None:        # none where make bench's deadline stopped the emulated settings
        verdict = f"yes (largest gap {gap:.3f})"
        if gap > 0.05:
            verdict = (f"no, {gap:.3f} (each message's delay on a busy box adds to it; a larger "
                       "--emulate-ms shrinks its share)")
        print(f"\nemulated compute: measured idle within 0.05 of the simulation on every rank: {verdict}")
    for name in cfg["schedules"]:
        m = max(cfg["micro_batches"])
        if not schedule_refuses(name, stages, m, cfg["v"][name]):
            print("\n" + schedule_check.describe(name, stages, m, cfg["v"][name]))
    print(f"\nwrote {write_rows(ctx, cfg, rows)}")


def emulate_ms_flag(text: str) -> float:
    """--emulate-ms: a finite number of milliseconds in (0, MAX_EMULATE_MS]."""
    if launch.positive_float(text) > MAX_EMULATE_MS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of milliseconds > 0 and <= "
                                         f"{MAX_EMULATE_MS:g}")
    return float(text)


def schedule_refuses(name: str, stages: int, m: int, v: int) -> str:
    """Why schedule ``name`` cannot run m micro-batches on these stages ('' when it can)."""
    try:
        schedule_check.check_setting(name, stages, m, v)
    except ValueError as error:
        return str(error)
    return ""


def main(argv=None) -> None:
    """The lesson's flags (as run_pipeline.py has them) and the measurement's."""
    names = list(schedules.SCHEDULES)
    parser = launch.make_parser(__doc__, world_size=4)
    for flag, default, what in (("--layers", 8, "residual MLP blocks; must divide by p (x v)"),
                                ("--d-model", 256, "activation width"),
                                ("--hidden", 1024, "hidden width inside a block"),
                                ("--batch", 64, "rows per batch; must divide by every m")):
        parser.add_argument(flag, type=launch.positive_int, default=default, help=what)
    parser.add_argument("--micro-batches", type=launch.int_list, default=None,
                        help="micro-batch counts m; default: 2p")
    parser.add_argument("--schedules", type=launch.choice_list(names), default=None,
                        help="subset of " + ",".join(names) + "; default: all, each at the m it allows")
    parser.add_argument("--chunks", type=launch.positive_int, default=2,
                        help="v, model chunks per rank (interleaved only); at most layers / p")
    parser.add_argument("--emulate-ms", type=emulate_ms_flag, default=20.0,
                        help="measure also with every F, B, W replaced by a wait of this many ms "
                        f"(emulated compute; the messages stay real); at most {MAX_EMULATE_MS:g}")
    parser.add_argument("--warmup", type=launch.non_negative_int, default=0,
                        help="untimed passes before the timed ones (real compute)")
    parser.add_argument("--iters", type=launch.positive_int, default=3, help="timed passes per setting")
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
    args.v = {name: schedules.chunks_per_rank(name, args.chunks) for name in args.schedules}
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
    # A rank's rough peak: the whole stack, gradients, copies (7 x with torch's), activations
    parameters = args.layers * (2 * args.d_model * args.hidden + args.d_model + args.hidden)
    activations = 2 * args.layers * args.batch * (args.d_model + 2 * args.hidden)
    copies = 7 if any(name in TORCH_SCHEDULES for name in args.schedules) else 5
    need = 4 * (copies * parameters + activations)
    launch.check_fits(config, need, f"{need / 2**30:.2f} GiB each for --layers {args.layers} "
                      f"--d-model {args.d_model} --hidden {args.hidden} --batch {args.batch}")
    results.check_writable()
    launch.launch(bench_main, config, vars(args))


if __name__ == "__main__":
    main()
