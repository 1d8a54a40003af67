"""Measurement, not a lesson: lesson 9's planner checked against this box, and published runs.

The planner is fed this machine, every input measured (compute at one rank's shapes, the straggler,
a copy, stage 02's all-reduce fit, a call in a burst (also launched asynchronously) and a hop after
compute at each group's size, FSDP's collectives) beside the steps make bench measured
(results/ddp_step.csv, sharding.csv, grid.csv, context_parallel.csv, expert_parallel.csv) in
results/prediction.csv: every term a column, each error beside the measured step's spread, and the
median and 90th percentile of |error|. ``--device cuda`` or ``--project`` also projects onto the
cluster presets (results/projection.csv); ``--published`` prints the published runs beside the
planner's cold predictions (lesson 9's README). A configuration that cannot end before make bench's
deadline (``BENCH_STEP_DEADLINE``) is skipped with a line.

Run:  python 07_parallelism/measure/check_prediction.py          (after make bench, or its steps)
      python 07_parallelism/measure/check_prediction.py --published
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import functools
import itertools
import json
import os
import statistics
import sys
import tempfile
import types
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "07_parallelism" / "09_planning"))
import planner  # noqa: E402
from common import import_stage, models  # noqa: E402
from bench import results, step_bench, timing
from bench.compute import copy_bandwidth, kernel_text, measure_lm
from bench import supervisor as launch

cp = import_stage("07_parallelism/05_context_parallel/context_parallel")

CSV_NAME = "prediction.csv"
TARGET = 0.25              # predicted within 25% of measured
GRID_VOCAB = 256           # lesson 7 trains on bytes
# bucket cap in bytes (None: no communication; 0: a call a tensor); bucketed and torch DDP: the row's
DDP_IMPLS = {"none": None, "naive": 0.0, "flat": float("inf"), "overlap": 0.0}
BURST_BYTES = 64 * 2**10    # a small all-reduce: what a call costs, its bytes aside
BURST_CALLS = 20            # (both as timing.call_in_burst's defaults, which the DDP bench uses)
HOP_SIZES = (16 * 2**10, 256 * 2**10, 2**20)   # bytes: the lessons' K/V blocks and activations
HOP_SLICE_S = 2e-3         # the compute a hop follows, about one block's share of a step here
SHORT_SLICE_S = HOP_SLICE_S / 8   # and below lesson 5's shortest chunk here (about 0.5 ms)
REPEATS = 15
ADAMW_STEP_BYTES = 4       # torch's AdamW keeps a float32 step count for each parameter tensor
FLAT_SIZES = (4 * 2**20, 16 * 2**20)   # bytes of a gathered unit where no LM names them


# --------------------------------------------------------------------------- this machine
def exchange_alone(send, receive, group=None) -> list:
    """A hop on one process: each receive a copy of its send, nothing left to wait for."""
    for tensor, into in zip(send, receive):
        into.copy_(tensor)
    return []


def ring_alone(ranks: int, rank: int = 0):
    """Lesson 5's ring attention on one process as rank ``rank`` of ``ranks`` computes it: its
    chunk kernels and merges, ``ranks`` steps forward and back (its hops: the planner's term)."""
    ring = types.SimpleNamespace(get_rank=lambda group=None: rank, get_world_size=lambda group=None: ranks)
    return mock.patch.multiple(cp, dist=ring, post_exchange=exchange_alone)


@functools.lru_cache(maxsize=None)
def time_compute(preset: str, batch: int, seq: int, vocab: int, threads: int, checkpointing: bool = False,
                 device: str = "cpu", repeats: int = 9, ring: int = 1) -> tuple[float, float, tuple[float, ...]]:
    """(forward + backward s, AdamW step s, every forward + backward timed) of the LM on one
    process (bench/compute.py's), medians after two warm-ups; once per shape: equal shapes get equal
    compute. ``ring`` > 1: its attention a context-parallel rank's (``ring_alone``, zig-zag)."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    setup = (lambda lm: cp.use_ring_attention(lm, layout="zigzag")) if ring > 1 else None
    with ring_alone(ring) if ring > 1 else contextlib.nullcontext():
        measured = measure_lm(preset, batch, seq, torch.device(device), 2, repeats, vocab=vocab,
                              checkpointing=checkpointing, setup=setup)
    torch.set_num_threads(threads_before)
    return statistics.median(measured["forward_backward"]), measured["optimizer"], measured["forward_backward"]


@functools.lru_cache(maxsize=None)
def time_copy(nbytes: int, threads: int, device: str = "cpu", repeats: int = 5) -> float:
    """Bytes read and written per second copying ``nbytes`` (at the wrappers' size: caches count)."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    rate = copy_bandwidth(torch.device(device), nbytes, repeats)
    torch.set_num_threads(threads_before)
    return rate


def launch_and_read(worker, world_size: int, backend: str, device: str, what: str,
                    instead: str, *args) -> dict | None:
    """``worker(ctx, out_path, *args)`` on ``world_size`` ranks; rank 0's JSON, or None with one
    line (``what`` not timed; ``instead``) where the ranks failed. Ctrl-C and SIGTERM pass on."""
    with tempfile.TemporaryDirectory() as folder:
        out_path = os.path.join(folder, "timings.json")
        try:
            launch.launch(worker, launch.LaunchConfig(world_size, backend, device), out_path, *args,
                          timeout_s=120)
        except SystemExit as stopped:
            if stopped.code in (130, 143):
                raise
            print(f"check_prediction: {what} not timed ({world_size} ranks failed, their error above); {instead}")
            return None
        with open(out_path) as f:
            return json.load(f)


def write_slowest(ctx, mine: dict, out_path: str) -> None:
    """Rank 0 writes the slowest rank's figure of each name: a collective ends with its last rank."""
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    if ctx.is_main:
        with open(out_path, "w") as f:
            json.dump({name: max(rank[name] for rank in everyone) for name in mine}, f)


def line_through(seconds: dict) -> tuple[float, float]:
    """(a, w) of t = a + N / w through two timings (bytes -> s); a < 0 (noise): a = 0, w through
    the largest; the larger no slower: w infinite."""
    smallest, largest = min(seconds), max(seconds)
    rate = float("inf")
    if seconds[largest] > seconds[smallest]:
        rate = (largest - smallest) / (seconds[largest] - seconds[smallest])
    latency = seconds[smallest] - smallest / rate
    if latency < 0:
        latency = 0.0
        rate = largest / seconds[largest]
    return latency, rate


def link_through(seconds: dict, ranks: int) -> planner.Link:
    """The planner's all-gather form, latency + (n-1)/n N / busbw, through ``line_through``."""
    latency, rate = line_through(seconds)
    return planner.Link(latency=latency, busbw=rate * (ranks - 1) / ranks)


@dataclasses.dataclass(frozen=True)
class StepCalls:
    """Calls timed as a step makes them (``time_step_calls``)."""
    all_reduce_s: float    # one all-reduce of BURST_BYTES inside a burst of back-to-back calls
    hop: planner.Link | None   # a point-to-point hop after HOP_SLICE_S of compute (None: not timed)
    short_hop: planner.Link | None = None   # the same after SHORT_SLICE_S

    def hop_after(self, slice_s: float) -> planner.Link | None:
        """The hop after ``slice_s`` of compute: its latency on the line through the two slices
        timed (its partner may end a longer slice later), held within them."""
        if self.short_hop is None or self.hop is None:
            return self.hop
        share = min(1.0, max(0.0, (slice_s - SHORT_SLICE_S) / (HOP_SLICE_S - SHORT_SLICE_S)))
        latency = self.short_hop.latency + share * (self.hop.latency - self.short_hop.latency)
        return dataclasses.replace(self.hop, latency=latency)


def matmul_alone(ctx, weights: torch.Tensor) -> float:
    """Median s of ``weights @ weights``, each rank timing it while the others wait (no turns in it)."""
    for turn in range(ctx.world_size):
        dist.barrier()
        if ctx.rank == turn:
            seconds = statistics.median(timing.measure(lambda: weights @ weights, ctx.device, warmup=3, iters=20))
    return seconds


def hop_after_turns(slice_and_hop: float, slice_alone: float, ranks: int, cores: int) -> float:
    """A hop timed with the compute slice before it, less that slice as the planner charges it:
    W / cores turns of its time alone where W ranks share fewer cores (at least a microsecond)."""
    return max(1e-6, slice_and_hop - max(1.0, ranks / cores) * slice_alone)


def step_calls_worker(ctx, out_path: str) -> None:
    """Bursts of 64 KiB all-reduces, then at each of ``HOP_SIZES`` a hop (send to the next rank,
    receive from the previous) after ``HOP_SLICE_S`` of matmuls (rank 0's count), and after
    ``SHORT_SLICE_S``, timed with the slice, less the slice as the planner charges compute: its
    time alone x the turns ranks take on the cores (else a hop would also carry the wait for a
    neighbour's turn)."""
    torch.set_num_threads(1)              # a rank's share of this box's cores
    cores = torch.cuda.device_count() if ctx.device.type == "cuda" else os.cpu_count() or 1
    timing.call_in_burst(ctx.device, BURST_BYTES, BURST_CALLS, bursts=2)         # warm-up
    per_call = timing.call_in_burst(ctx.device, BURST_BYTES, BURST_CALLS, bursts=REPEATS)
    weights = torch.randn(128, 128, device=ctx.device)      # small: a slice close to its length
    one_matmul = matmul_alone(ctx, weights)
    mine = {"all_reduce": statistics.median(per_call)}
    slices = {"hop": HOP_SLICE_S, "short hop": SHORT_SLICE_S}
    for (name, slice_s), nbytes in itertools.product(slices.items(), HOP_SIZES):
        count = torch.tensor([max(1, round(slice_s / one_matmul))], device=ctx.device)
        dist.broadcast(count, 0)
        matmuls = int(count.item())
        send = torch.ones(nbytes // 4, device=ctx.device)
        receive = torch.empty_like(send)
        operations = [dist.P2POp(dist.isend, send, (ctx.rank + 1) % ctx.world_size),
                      dist.P2POp(dist.irecv, receive, (ctx.rank - 1) % ctx.world_size)]

        def slice_then_hop():
            for _ in range(matmuls):
                weights @ weights
            for request in dist.batch_isend_irecv(operations):
                request.wait()

        seconds = []
        for _ in range(2 + REPEATS):
            dist.barrier()
            seconds += timing.measure(slice_then_hop, ctx.device, warmup=0, iters=1)
        mine[f"{name} {nbytes}"] = hop_after_turns(statistics.median(seconds[2:]), matmuls * one_matmul,
                                                   ctx.world_size, cores)       # two to warm up
    write_slowest(ctx, mine, out_path)


@functools.lru_cache(maxsize=None)
def time_step_calls(world_size: int, backend: str, device: str) -> StepCalls | None:
    """Calls as a step makes them, slowest rank's medians: a 64 KiB all-reduce in a burst of 20
    (not lined up by a barrier, as stage 02's are) and a hop after a long and a short slice of
    compute (ranks sharing cores wait for one). None, with a line, where Gloo cannot send the tensors."""
    if backend == "gloo" and device == "cuda":
        print("check_prediction: calls not timed (Gloo sends CPU tensors only): stage 02's fit")
        return None
    slowest = launch_and_read(step_calls_worker, world_size, backend, device,
                              "calls as a step makes them", "the links are stage 02's fit")
    if slowest is None:
        return None
    hops = {nbytes: slowest[f"hop {nbytes}"] for nbytes in HOP_SIZES}
    short = {nbytes: slowest[f"short hop {nbytes}"] for nbytes in HOP_SIZES}
    print(f"check_prediction: calls as a step makes them, {world_size} ranks: a 64 KiB all-reduce in a burst "
          f"{slowest['all_reduce'] * 1e3:.2f} ms; a hop after {HOP_SLICE_S * 1e3:.3g} ms of compute (KiB: ms) "
          f"{ms_at(hops, 2**10, 2)}; after {SHORT_SLICE_S * 1e3:.3g} ms {ms_at(short, 2**10, 2)}")
    return StepCalls(all_reduce_s=slowest["all_reduce"], hop=planner.Link(*line_through(hops)),
                     short_hop=planner.Link(*line_through(short)))


def ms_at(seconds: dict, unit: int, digits: int) -> str:
    return ", ".join(f"{size / unit:.4g}: {value * 1e3:.{digits}f}" for size, value in seconds.items())


def flat_sizes(lm: planner.LM, grid: planner.Grid) -> tuple[int, int]:
    """FSDP's smallest and largest unit's gathered bytes (Gloo's time is not a line in the size
    on this VM: from 32 MiB glibc maps each buffer afresh). Units of one size: it and twice it."""
    units = [lm.compute_bytes * values for values in planner.fsdp_unit_values(lm, grid)]
    return min(units), max(units) if max(units) > min(units) else 2 * min(units)


def flat_collectives_worker(ctx, out_path: str, sizes: tuple[int, ...]) -> None:
    """All-gather and reduce-scatter of flat tensors at each of ``sizes``, as lesson 2 makes them:
    alone, and what each adds launched (``async_op``) beside as many matmuls as it took alone."""
    torch.set_num_threads(1)              # a rank's share of this box's cores
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    weights = torch.randn(256, 256, device=ctx.device)
    one_matmul = matmul_alone(ctx, weights)
    mine = {}
    for nbytes in sizes:
        shard_numel = -(-(nbytes // 4) // ctx.world_size)  # rounded up: lesson 2 pads to the ranks
        seconds = {"gather": [], "scatter": []}
        for _ in range(1 + REPEATS // 3):
            shard = torch.ones(shard_numel, device=ctx.device)
            gathered = torch.empty(shard_numel * ctx.world_size, device=ctx.device)
            calls = (("gather", all_gather, gathered, shard),
                     ("scatter", reduce_scatter, torch.empty_like(shard), gathered))
            for name, call, out, given in calls:
                seconds[name] += timing.measure(lambda: call(out, given), ctx.device, warmup=0,
                                                iters=1, barrier=True)
        for name, taken in seconds.items():
            mine[f"{name} {nbytes}"] = statistics.median(taken[1:])     # one to warm up
        for name, call, out, given in calls:
            count = torch.tensor([max(1, round(mine[f"{name} {nbytes}"] / one_matmul))], device=ctx.device)
            dist.broadcast(count, 0)

            def compute():
                for _ in range(int(count.item())):
                    weights @ weights

            def beside():
                work = call(out, given, async_op=True)
                compute()
                work.wait()

            alone, both = (timing.measure(f, ctx.device, warmup=1, iters=REPEATS // 3, barrier=True)
                           for f in (compute, beside))
            mine[f"beside {name} {nbytes}"] = statistics.median(both) - statistics.median(alone)
    write_slowest(ctx, mine, out_path)


@functools.lru_cache(maxsize=None)
def time_flat_collectives(world_size: int, backend: str, device: str,
                          sizes: tuple[int, int] = FLAT_SIZES) -> tuple[planner.Link, planner.Link, float] | None:
    """(all-gather, reduce-scatter) links for FSDP, timed at ``sizes`` (Gloo is no ring: 2 ranks,
    39 MiB: 44-55 ms to gather, 53-57 to scatter, 27-28 to all-reduce), the share hidden beside compute. None, with a line."""
    slowest = launch_and_read(flat_collectives_worker, world_size, backend, device,
                              "FSDP's collectives", "they are assumed to be rings on the "
                              "all-reduce's link", sizes)
    if slowest is None:
        return None
    gather, scatter = ({n: slowest[f"{name} {n}"] for n in sizes} for name in ("gather", "scatter"))
    alone, added = (sum(seconds for name, seconds in slowest.items() if name.startswith("beside") == beside)
                    for beside in (False, True))
    share = min(1.0, max(0.0, 1 - added / alone))
    print(f"check_prediction: FSDP's flat collectives, {world_size} ranks (MiB: ms): all-gather "
          f"{ms_at(gather, 2**20, 1)}; reduce-scatter {ms_at(scatter, 2**20, 1)}; {share:.0%} hidden beside compute")
    return link_through(gather, world_size), link_through(scatter, world_size), share


def straggler_share(samples: tuple[float, ...], ranks: int) -> float:
    """The median over every ``ranks`` of the timings of their largest, over the median, less 1."""
    if ranks < 2 or len(samples) < ranks:
        return 0.0
    slowest = [max(draw) for draw in itertools.combinations(samples, ranks)]
    return max(0.0, statistics.median(slowest) / statistics.median(samples) - 1)


def link_from_fit(fit: dict, ranks: int, calls: StepCalls | None = None, nbytes: float = 0) -> planner.Link:
    """Stage 02's t = a + N / w as the planner's all-reduce: busbw w x 2 (n-1)/n, a spread over
    the ring's 2 (n-1) steps; with ``calls``, a is a 64 KiB call's in a burst less its bytes;
    with ``nbytes``, w through stage 02's two timings around it (a call's rate at its size)."""
    w = fit["w_bytes_per_s"]
    points = sorted((point["bytes"], point["time_s"]) for point in fit.get("points", ()))
    if nbytes and len(points) > 1:
        index = min(max(bisect.bisect(points, (nbytes,)), 1), len(points) - 1)
        w = line_through(dict(points[index - 1:index + 1]))[1]
    latency = fit["a_s"] if calls is None else max(0.0, calls.all_reduce_s - BURST_BYTES / w)
    return planner.Link(latency=0.0, busbw=w * 2 * (ranks - 1) / ranks, step_latency=latency / (2 * (ranks - 1)))


def this_box(lm: planner.LM, grid: planner.Grid, compute_s: float, optimizer_s: float,
             link: planner.Link, cores: int, samples: tuple[float, ...] = (),
             device: str = "cpu", hop: planner.Link | None = None, groups: tuple = ()) -> planner.Machine:
    """The machine as measured: compute and AdamW as timed, a copy, the straggler of ``samples``."""
    rate = (planner.training_flops_per_token(lm, grid.recompute) * lm.batch * lm.seq / (grid.dp * grid.cp)
            / compute_s / (grid.tp * grid.pp))   # one data rank's tokens, its tp x pp ranks sharing them
    return planner.Machine(
        name="this box", flops=rate, memory=float("inf"),
        memory_bandwidth=planner.ADAMW_BYTES_TOUCHED * planner.parameter_count(lm) / optimizer_s,
        copy_bandwidth=time_copy(sum(planner.rank_tensor_bytes(lm, grid)), launch.rank_threads(grid.world_size), device),
        ranks_per_node=grid.world_size, inside=link, across=link, overlap=False,
        cores=cores, straggler=straggler_share(samples, grid.world_size),
        reduce_scatter_as_all_reduce=True, point_to_point=hop, groups=groups)


# --------------------------------------------------------------------------- the rows
def this_run(name: str) -> list[dict]:
    """``results/<name>``'s rows of this run (``RESULTS_RUN_ID``, else the newest); bad: a line."""
    rows = results.read_csv(name)
    run = os.environ.get("RESULTS_RUN_ID") or (rows[-1].get("run_id") if rows else None)
    rows = [row for row in rows if row.get("run_id") == run]
    for problem in filter(None, map(unreadable, rows)):
        print(f"check_prediction: results/{name}: a row skipped: {problem}")
    return [row for row in rows if not unreadable(row)]


def unreadable(row: dict) -> str:
    """What in a result row the check cannot use ('' if nothing; lessons 5 and 6 name no model)."""
    if "model" in row and row["model"] not in models.PRESETS and not row.get("schedule"):  # lesson 4's
        return f"model {str(row.get('model'))[:40]!r} is not a course preset"
    for column in ("world_size", "batch_size", "context_length", "seq_len"):
        if column in row and not str(row[column]).isdigit():
            return f"{column} {str(row[column])[:40]!r} is not a whole number"
    try:
        float(row.get("step_ms", row.get("expert_parallel_ms") or "0"))   # 6's loads: no step
    except ValueError:
        return f"step_ms {str(row.get('step_ms'))[:40]!r} is not a number"
    return ""


def course_lm(preset: str, batch: int, seq: int, vocab: int = models.VOCAB_SIZE) -> planner.LM:
    shape = models.PRESETS[preset]
    return planner.LM(layers=shape["num_layers"], d_model=shape["d_model"], d_ff=shape["d_ff"],
                      heads=shape["num_heads"], vocab=vocab, seq=seq, batch=batch)


def predicted_row(config: str, source: str, lm, grid, machine, measured: dict, terms=None) -> dict:
    """The planner's terms (or ``terms``) beside the bench row's step (median), fastest, slowest."""
    terms = terms or planner.step_time(lm, grid, machine)
    predicted = sum(seconds for _, seconds, _ in terms) * 1e3
    row = {"config": config, "source": source, "world_size": grid.world_size,
           "predicted_ms": round(predicted, 3), "measured_ms": round(float(measured["step_ms"]), 3),
           "ratio": round(predicted / float(measured["step_ms"]), 3),
           "measured_min_ms": measured.get("step_ms_min", ""), "measured_max_ms": measured.get("step_ms_max", "")}
    row.update({name.replace(" ", "_") + "_ms": round(seconds * 1e3, 3) for name, seconds, _ in terms})
    row.update(machine=results.machine_name(), run_id=results.run_id())
    return row


DDP_SETTINGS = ("backend", "device", "world_size", "model", "batch_size", "context_length")
LEDGER_SETTINGS = (*DDP_SETTINGS, "checkpointing")


def same_launch_control(rows: list[dict], row: dict, settings: tuple) -> dict | None:
    """The compute-only control (``none``) at ``row``'s ``settings``, from the same launch."""
    return next((control for control in rows if control["impl"] == "none"
                 and all(control[key] == row[key] for key in settings)), None)


def ledger_control(rows: list[dict], row: dict) -> tuple[float, float] | None:
    """The ledger control's (step less AdamW s, AdamW s); None without one, or for noise."""
    control = same_launch_control(rows, row, LEDGER_SETTINGS) or {}
    optimizer_ms = float(control.get("optimizer_ms") or "nan")
    compute_ms = float(control.get("step_ms") or "nan") - optimizer_ms
    return (compute_ms / 1e3, optimizer_ms / 1e3) if compute_ms > 0 else None    # not NaN, not noise


def control_burst(rows: list[dict], row: dict, column: str = "call_ms") -> float | None:
    """A small all-reduce's seconds in a burst beside the DDP control (``call_ms``, or ``column``), or None."""
    control = same_launch_control(rows, row, DDP_SETTINGS) or {}
    return float(control[column]) / 1e3 if control.get(column) else None


def compute_for(control: tuple[float, float] | None, row: dict, cores: int,
                checkpointing: bool = False) -> tuple[float, float, tuple, int]:
    """(compute s, optimizer s, timings, cores taken turns on): the launch's control if any (its
    straggler and turns already in it), else the LM timed here at one rank's shapes."""
    ranks = int(row["world_size"])
    if control is not None:
        return control[0], control[1], (), max(cores, ranks)
    return (*time_compute(row["model"], int(row["batch_size"]) // ranks, int(row["context_length"]),
                          models.VOCAB_SIZE, launch.rank_threads(ranks), checkpointing,
                          device=row["device"]), cores)


def on_this_backend(rows: list[dict], backend_device: str, fits: dict):
    """(row, ranks, fit) for each row on ``backend_device`` with a fit for as many ranks."""
    for row in rows:
        ranks = int(row["world_size"])
        key = f"{backend_device}/{ranks}"   # the fit with as many ranks sharing the cores
        if f"{row['backend']}/{row['device']}" == backend_device and key in fits:
            yield row, ranks, fits[key]


def ddp_rows(fits: dict, backend_device: str, cores: int, pace: step_bench.Deadline):
    """Stages 03-06 and torch DDP from ``ddp_step.csv``, compute and a call's cost from the same
    launch's control (compute drifts 10-20% between moments here), else timed here."""
    run_rows = this_run("ddp_step.csv")
    for row, ranks, fit in on_this_backend(run_rows, backend_device, fits):
        impl = row["impl"]
        if impl not in (*DDP_IMPLS, "bucketed", "torch_ddp"):
            continue
        cap = float(row["bucket_mb"]) * 2**20 if row["bucket_mb"] else DDP_IMPLS[impl]
        batch, seq = int(row["batch_size"]), int(row["context_length"])
        lm = course_lm(row["model"], batch, seq)
        control = same_launch_control(run_rows, row, DDP_SETTINGS) or {}
        if control.get("fwd_bwd_ms") and cap is None:
            continue                                   # the control itself: the input
        control = (float(control["fwd_bwd_ms"]) / 1e3, float(control["optimizer_ms"]) / 1e3
                   ) if control.get("fwd_bwd_ms") else None
        bucket = f" {row['bucket_mb']} MB" if row["bucket_mb"] else ""
        config = f"ddp_step {impl}{bucket}, {row['model']}, {ranks} ranks"
        if not pace.allows(f"check_prediction: {config} and what follows"):
            return
        compute_s, optimizer_s, samples, shared_by = compute_for(control, row, cores)
        if cap is None:
            grid = planner.Grid()                      # no communication: one rank's work
            lm = course_lm(row["model"], batch // ranks, seq)
        else:
            grid = planner.Grid(dp=ranks, bucket_bytes=cap)
        # a call's cost as the rows were measured: stage 05 launches one a gradient, faster than one
        # ends, and Gloo runs them back to back (buckets, few and spread out, are each waited for)
        burst = control_burst(run_rows, row, "async_call_ms" if impl == "overlap" else "call_ms")
        if impl == "overlap" and burst is None:
            print(f"check_prediction: {config}: no async_call_ms beside its control: its calls charged as waited for")
        calls = StepCalls(burst, None) if burst else time_step_calls(ranks, row["backend"], row["device"])
        largest = max(planner.gradient_buckets(planner.rank_tensor_bytes(lm, grid), grid.bucket_bytes))
        machine = this_box(lm, grid, compute_s, optimizer_s, link_from_fit(fit, ranks, calls, largest),
                           shared_by, samples, row["device"])
        yield predicted_row(config, "ddp_step.csv", lm, grid, machine, row)


def ledger_rows(fits: dict, backend_device: str, cores: int, pace: step_bench.Deadline):
    """The ledger's strategies (ours) from ``sharding.csv``, compute from the launch's control."""
    run_rows = this_run("sharding.csv")
    for row, ranks, fit in on_this_backend(run_rows, backend_device, fits):
        if row["impl"] not in planner.DP_KINDS:
            continue
        checkpointing = row["checkpointing"] == "on"
        config = f"ledger {row['impl']}{' checkpointing' * checkpointing}, {row['model']}, {ranks} ranks"
        if not pace.allows(f"check_prediction: {config} and what follows"):
            return
        lm = course_lm(row["model"], int(row["batch_size"]), int(row["context_length"]))
        grid = planner.Grid(dp=ranks, dp_kind=row["impl"], recompute="full" if checkpointing else "none")
        control = ledger_control(run_rows, row)
        compute_s, optimizer_s, samples, shared_by = compute_for(control, row, cores, checkpointing)
        calls = time_step_calls(ranks, row["backend"], row["device"])
        largest = max(planner.gradient_buckets(planner.rank_tensor_bytes(lm, grid), grid.bucket_bytes))
        machine = this_box(lm, grid, compute_s, optimizer_s, link_from_fit(fit, ranks, calls, largest),
                           shared_by, samples, row["device"])
        if grid.dp_kind == "fsdp":
            flat = time_flat_collectives(ranks, row["backend"], row["device"], flat_sizes(lm, grid))
            if flat is not None:
                machine = dataclasses.replace(machine, gather=flat[0], scatter=flat[1], gather_overlap=flat[2])
        prediction = predicted_row(config, "sharding.csv", lm, grid, machine, row)
        share = machine.gather_overlap       # measured for FSDP's rows only
        yield prediction | ({} if share is None else {"fsdp_hidden_share": round(share, 3)})


def time_rank_compute(model: str, grid: planner.Grid, batch: int, seq: int, threads: int,
                      device: str) -> tuple[float, float, tuple[float, ...]]:
    """``time_compute`` at one rank's shapes, a micro-batch at a time (forward, backward x m)."""
    rows = batch // grid.dp // grid.micro_batches
    compute_s, optimizer_s, samples = time_compute(model, rows, seq // grid.cp, GRID_VOCAB,
                                                   threads, device=device, ring=grid.cp)
    scaled = tuple(grid.micro_batches * seconds for seconds in samples)
    return grid.micro_batches * compute_s, optimizer_s, scaled


def grid_rows(fits: dict, backend_device: str, cores: int, pace: step_bench.Deadline):
    """Lesson 7's grids (ours) from ``grid.csv``; a label that is not a grid's is skipped."""
    for row, ranks, fit in on_this_backend(this_run("grid.csv"), backend_device, fits):
        if row.get("impl") != "ours" or not row.get("micro_batches") or row.get("schedule") or row.get("pair"):
            continue                 # torch's, the pipeline comparison, torch's controls: not our grids
        try:
            grid = planner.parse_label(row["grid"])    # 'dp_replicate2 dp_shard2' is no grid's
        except ValueError:
            continue
        schedule = next((name for name in ("zbh1", "interleaved", "1f1b", "gpipe")
                         if name in row["setting"]), "1f1b")
        # the data axis all-reduces every gradient in one call; lesson 7 logs the global loss
        grid = dataclasses.replace(grid, dp_kind="zero1" if row["setting"].startswith("ZeRO-1") else "ddp",
                                   schedule=schedule, micro_batches=int(row["micro_batches"]), sp=True,
                                   bucket_bytes=float("inf"), loss_all_reduce=True)
        if grid.world_size != ranks:
            continue
        config = f"grid {row['grid']}, {row['setting']}, {row['model']}"
        if not pace.allows(f"check_prediction: {config} and what follows"):
            return
        batch, seq = int(row["batch_size"]), int(row["seq_len"])
        lm = course_lm(row["model"], batch, seq, GRID_VOCAB)
        compute_s, optimizer_s, samples = time_rank_compute(row["model"], grid, batch, seq,
                                                            launch.rank_threads(ranks), row["device"])
        # each group at its own size's calls and fit: ranks sharing cores, a group no larger
        # than the cores waits less for one at each step than the world does
        calls = {size: time_step_calls(size, row["backend"], row["device"])
                 for size in {ranks, grid.tp, grid.cp, grid.dp * grid.cp, grid.pp}
                 if size > 1 and f"{backend_device}/{size}" in fits}
        groups = tuple((size, link_from_fit(fits[f"{backend_device}/{size}"], size, calls[size]))
                       for size in calls)
        hop = calls.get(grid.cp if grid.cp > 1 else grid.pp, calls[ranks])
        machine = this_box(lm, grid, compute_s, optimizer_s, link_from_fit(fit, ranks, calls[ranks]),
                           cores, samples, row["device"], hop and hop.hop, groups)
        yield predicted_row(config, "grid.csv", lm, grid, machine, row)


def pipeline_rows(fits: dict, backend_device: str, cores: int, pace: step_bench.Deadline):
    """Lesson 4's schedules, ours and torch's, from ``grid.csv`` where a chunk's F, B (and W) each
    wait a set time: a waiting rank takes no core, so sends run beside the waits."""
    for row, ranks, fit in on_this_backend(this_run("grid.csv"), backend_device, fits):
        p = int(row.get("stages") or 0)
        if row.get("compute") != "emulated" or f"{backend_device}/{p}" not in fits:
            continue
        config = f"pipeline {row['grid']}, {row['setting']}, {row['impl']}"
        if not pace.allows(f"check_prediction: {config} and what follows"):
            return
        v = 2 if row["schedule"] in ("interleaved", "zbv", "dualpipev") else 1
        grid = planner.Grid(pp=p, schedule=row["schedule"], micro_batches=int(row["micro_batches"]), chunks=v)
        wait_s = float(row["setting"].split("emulated ")[1].split(" ms")[0]) / 1e3
        compute_s = grid.micro_batches * v * wait_s * (3 if row["schedule"] in ("zbv", "dualpipev") else 2)
        blocks, preset, _ = row["model"].split()                     # '8 tiny blocks'
        lm = dataclasses.replace(course_lm(preset, int(row["batch_size"]), int(row["seq_len"])),
                                 layers=int(blocks))
        calls = time_step_calls(p, row["backend"], row["device"])
        machine = this_box(lm, grid, compute_s, 1.0, link_from_fit(fits[f"{backend_device}/{p}"], p, calls),
                           0, (), row["device"], calls and calls.hop)
        machine = dataclasses.replace(machine, overlap=True, memory_bandwidth=float("inf"))   # no AdamW
        yield predicted_row(config, "grid.csv, pipelines", lm, grid, machine, row)


@functools.lru_cache(maxsize=None)
def time_ring_attention(batch: int, heads: int, seq: int, head_dim: int, ranks: int, layout: str,
                        threads: int, device: str = "cpu") -> float:
    """Median s of lesson 5's causal ring attention, forward + backward, float32, as its busiest
    rank (contiguous: the last; zig-zag: any) computes it alone (``ring_alone``)."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(batch, heads, seq // ranks, head_dim, generator=generator).to(device)
                         for _ in "qkvo")
    leaves = [tensor.requires_grad_() for tensor in (q, k, v)]
    with ring_alone(ranks, ranks - 1 if layout == "contiguous" else 0):
        seconds = timing.measure(lambda: cp.ring_attention(*leaves, layout=layout).backward(grad_out),
                                 torch.device(device), warmup=1, iters=5)
    torch.set_num_threads(threads_before)
    return statistics.median(seconds)


def context_parallel_rows(fits: dict, backend_device: str, cores: int, pace: step_bench.Deadline):
    """Lesson 5's ring attention alone (``context_parallel.csv``): its busiest rank's compute timed
    here, the planner's term at the hop after a chunk (W chunks, backward 2x forward: a hop follows
    a chunk's forward or backward, on average a 2W-th of the compute)."""
    for row in this_run("context_parallel.csv"):
        ranks, batch, heads, seq, width = (int(row[key]) for key in ("W", "batch", "heads", "seq", "head_dim"))
        fit = fits.get(f"{backend_device}/{ranks}")
        if (row["impl"], row["compute"], f"{row['backend']}/{row['device']}") != ("ring", "real", backend_device) or not fit:
            continue
        config = f"ring attention W={ranks} {row['layout']}, seq {seq}"
        if not pace.allows(f"check_prediction: {config} and what follows"):
            return
        compute_s = time_ring_attention(batch, heads, seq, width, ranks, row["layout"], launch.rank_threads(ranks),
                                        row["device"])
        calls = time_step_calls(ranks, row["backend"], row["device"])
        hop = calls and calls.hop_after(compute_s / (2 * ranks)) or link_from_fit(fit, ranks)
        lm = planner.LM(layers=1, d_model=heads * width, d_ff=0, heads=heads, vocab=0, seq=seq, batch=batch)
        grid = planner.Grid(cp=ranks)
        machine = planner.Machine("this box", 12 * batch * seq**2 * lm.d_model / ranks / compute_s, 0, 0,
                                  ranks, hop, hop, overlap=False, cores=cores)
        terms = [("compute", compute_s * planner.turns(grid, machine), "chunk kernels and merges timed alone"),
                 planner.ring_attention_term(lm, grid, machine)]
        yield predicted_row(config, "context_parallel.csv", lm, grid, machine, row, terms)


def all_to_all_time(link: planner.Link, ranks: int, nbytes: float) -> float:
    """An all-to-all of ``nbytes`` a rank as Gloo's ``alltoallv`` runs it: the n-1 sends of
    nbytes / n posted at once, then waited for (one latency, (n-1)/n of the bytes); 0 alone."""
    return planner.send_time(link, (ranks - 1) / ranks * nbytes) if ranks > 1 else 0.0


def expert_parallel_rows(fits: dict, backend_device: str, cores: int, pace: step_bench.Deadline):
    """Lesson 6's layer, forward + backward (``expert_parallel.csv``): the replicated MoE's step (the
    same launch, no exchange) and five all-to-alls at the hop measured: the counts (E int64), then
    dispatch and combine forward and back, each a quarter of the rows' bytes a rank sent (counted)."""
    for row, ranks, fit in on_this_backend(this_run("expert_parallel.csv"), backend_device, fits):
        if row["measure"] != "step":
            continue
        config = f"expert parallel ep{ranks}, {row['tokens_per_rank']} tokens a rank"
        if not pace.allows(f"check_prediction: {config} and what follows"):
            return
        calls = time_step_calls(ranks, row["backend"], row["device"])
        hop = calls and calls.hop or link_from_fit(fit, ranks)
        counts = 8 * int(row["num_experts"])
        rows = (float(row["bytes_sent_counted"]) - counts * (ranks - 1) / ranks) / 4 * ranks / (ranks - 1)
        terms = [("compute", float(row["replicated_ms"]) / 1e3, "the replicated MoE's step, the same launch"),
                 ("expert all-to-alls", all_to_all_time(hop, ranks, counts) + 4 * all_to_all_time(hop, ranks, rows),
                  f"the counts, then 4 of {rows / 2**20:.3g} MiB a rank")]
        measured = {"step_ms": row["expert_parallel_ms"], "step_ms_min": row.get("expert_parallel_min_ms", ""),
                    "step_ms_max": row.get("expert_parallel_max_ms", "")}
        yield predicted_row(config, "expert_parallel.csv", None, planner.Grid(dp=ranks), None, measured, terms)


# --------------------------------------------------------------------------- the projection
PROJECTION_CSV = "projection.csv"
PROJECTION_MODEL = "small"     # make plan's default LM, sequence and rows a GPU
PROJECTION_SEQ = 256
PROJECTION_ROWS = 2
PROJECTION_TOP = 3             # grids a preset


def measured_gpu(table: dict, preset: planner.GPU, where: str) -> planner.GPU:
    """A preset's GPU (its memory, NVLink and network) at the rates of bench/compute.py's kernel table."""
    peak = table["peak_flops_per_s"]
    return dataclasses.replace(preset, name=f"{where}, measured here", peak=peak, launch_s=table["launch_s"],
                               memory_bandwidth=table["memory_bound_bytes_per_s"], matmul_share=table["matmul_flops_per_s"] / peak,
                               attention_share=table["attention_flops_per_s"] / peak)


def projection_rows(device: str) -> list[dict]:
    """The planner on each cluster preset with this device's kernel table (bench/compute.py's, this
    run's) and the preset's links; without one, the LM at world size 1 (float32, one thread) as one
    rate; a device that cannot run it: one line, no rows."""
    where = torch.cuda.get_device_name(0) if device == "cuda" else results.machine_name()
    entry = results.read_json("matmul_peak.json").get(device, {})
    run = os.environ.get("RESULTS_RUN_ID")
    here = entry.get("machine") == results.machine_name() and not (run and entry.get("run_id") != run)
    table = entry.get("kernels") if here else None
    bytes_ = 2 if table and table["dtype"] == "bfloat16" else planner.FLOAT32
    if table:
        rate, bandwidth = table["peak_flops_per_s"], table["memory_bound_bytes_per_s"]
        compute_from = f"{where}, measured here at {table['model']}'s shapes, {table['dtype']}: {kernel_text(table)}"
    else:
        try:
            compute_s, optimizer_s, _ = time_compute(PROJECTION_MODEL, PROJECTION_ROWS, PROJECTION_SEQ,
                                                     models.VOCAB_SIZE, 1, device=device)
        except (RuntimeError, MemoryError) as error:       # a CUDA error, out of memory included
            print(f"check_prediction: projection skipped: the {PROJECTION_MODEL} LM at {PROJECTION_ROWS} x "
                  f"{PROJECTION_SEQ} did not run on {device}: {str(error).splitlines()[0]}")
            return []
        one_rank = course_lm(PROJECTION_MODEL, PROJECTION_ROWS, PROJECTION_SEQ)
        rate = (planner.training_flops_per_token(one_rank) * PROJECTION_ROWS * PROJECTION_SEQ / compute_s)
        bandwidth = planner.ADAMW_BYTES_TOUCHED * planner.parameter_count(one_rank) / optimizer_s
        compute_from = (f"{where}, world size 1, float32: {rate / 1e12:.3g} TFLOP/s, AdamW at "
                        f"{bandwidth / 1e9:.3g} GB/s (measured), every FLOP at that rate: no kernel table of this "
                        "run and machine in results/matmul_peak.json")
    rows = []
    for name, cluster in planner.CLUSTERS.items():
        lm = dataclasses.replace(course_lm(PROJECTION_MODEL, PROJECTION_ROWS * cluster.ranks, PROJECTION_SEQ),
                                 compute_bytes=bytes_)
        machine = dataclasses.replace(cluster, flops=rate, memory_bandwidth=bandwidth,
                                      gpu=measured_gpu(table, cluster.gpu, where) if table else None)
        predictions = [planner.predict(lm, grid, machine)
                       for grid in planner.candidate_grids(lm, cluster.ranks, cluster.ranks_per_node)]
        fitting = sorted((one for one in predictions if one["fits"]), key=lambda one: one["step_s"])
        for prediction in fitting[:PROJECTION_TOP]:
            grid = planner.label(prediction["grid"])
            rows.append({"config": f"{name}: {grid}", "cluster": name, "grid": grid,
                         "ranks": cluster.ranks, "model": PROJECTION_MODEL, "batch_size": lm.batch,
                         "seq_len": lm.seq, "label": "predicted",
                         "predicted_ms": round(prediction["step_s"] * 1e3, 3),
                         "tokens_per_s_per_gpu": round(prediction["tokens_per_s_per_rank"]),
                         "share_of_measured_rate": round(prediction["mfu"], 3),
                         "memory_gib": round(prediction["memory"]["total"] / 2**30, 3),
                         "compute_from": compute_from, "device": device,
                         "machine": results.machine_name(), "run_id": results.run_id()})
    return rows


# --------------------------------------------------------------------------- bytes, exactly
def data_parallel_bytes_sent(lm: planner.LM, grid: planner.Grid) -> float:
    """Bytes a rank sends a step on the data axis alone, as a ring: DDP the all-reduce, ZeRO-1 1.5x,
    FSDP units gathered twice less those kept, gradients reduce-scattered, 1-D ones all-reduced."""
    d = grid.dp * grid.cp           # the ranks holding the same parameters
    whole = planner.FLOAT32 * planner.parameter_count(lm)
    if grid.dp_kind == "fsdp":
        sharded, replicated = planner.fsdp_shard_values(lm, d)
        kept = 0
        shapes = planner.parameter_shapes(lm)
        last_block = len(shapes) - len(planner.block_parameter_shapes(lm)) - 3   # before the final norm, head
        for index, shape in enumerate(shapes):
            if len(shape) == 2 and (index < 2 or index >= last_block):    # the ends, the last block
                kept += -(-shape[0] // d) * d * shape[1]
        W, K, R = (planner.FLOAT32 * values for values in (sharded, kept, replicated))
        return planner.ring_share(d) * (3 * W - K) + 2 * planner.ring_share(d) * R
    sent = 2 * planner.ring_share(d) * whole
    return 1.5 * sent if grid.dp_kind == "zero1" else sent


def rank_bytes(lm: planner.LM, grid: planner.Grid, pp_rank: int = 0, data_rank: int = 0) -> dict[str, float]:
    """One rank of lesson 7's grid as it builds it: parameters, gradients, AdamW state, one
    micro-batch's activations, the bytes sent on each axis (``pp_rank``, ``data_rank``: its place)."""
    if grid.dp_kind not in ("ddp", "zero1"):
        raise ValueError(f"lesson 7's grids run DDP or ZeRO-1 on the data axis, not {grid.dp_kind}")
    p, v, t, c, m = grid.pp, grid.chunks, grid.tp, grid.cp, grid.micro_batches
    tensors = planner.rank_tensors(lm, grid, pp_rank)
    params = sum(values for values, _ in tensors)
    replicated = sum(values for values, split in tensors if not split)
    optim = 2 * planner.FLOAT32 * params + ADAMW_STEP_BYTES * len(tensors)
    if grid.dp_kind == "zero1":
        # lesson 1's deal, as grid_bench.py's: whole tensors, largest first, each to the rank
        # holding the fewest bytes (ties: the lowest), which keeps AdamW's moments and step count
        loads, owned = [0] * (grid.dp * c), [0] * (grid.dp * c)
        sizes = [values for values, _ in tensors]
        for index in sorted(range(len(sizes)), key=lambda index: -sizes[index]):
            rank = loads.index(min(loads))
            loads[rank] += planner.FLOAT32 * sizes[index]
            owned[rank] += 2 * planner.FLOAT32 * sizes[index] + ADAMW_STEP_BYTES
        optim = owned[data_rank]
    stages = [chunk * p + pp_rank for chunk in range(v)]
    blocks = lm.layers // p
    activation = (blocks * planner.block_activation_bytes(lm, grid)
                  + planner.edge_activation_bytes(lm, grid, 0 in stages, p * v - 1 in stages))
    rows, tokens = planner.rows_and_tokens(lm, grid)
    gathered = lm.compute_bytes * rows * tokens * lm.d_model      # one [b, S, h] tensor
    sent_tp = m * blocks * 8 * planner.ring_share(t) * gathered          # lesson 3, forward and back
    sent_tp += 2 * planner.ring_share(t) * planner.FLOAT32 * replicated          # whole tensors' gradients
    sent_cp = m * blocks * (4 * (c - 1) + 2 * c) * (gathered / t) if c > 1 else 0.0  # lesson 5's K/V hops
    messages = 0
    for stage in stages:
        if stage < p * v - 1 and (stage + 1) % p != pp_rank:
            messages += m                                        # activations forward
        if stage > 0 and (stage - 1) % p != pp_rank:
            messages += m                                        # gradients backward
    sent_pp = messages * lm.compute_bytes * rows * (tokens // t) * lm.d_model
    sent_dp_cp = 2 * planner.ring_share(grid.dp * c) * planner.FLOAT32 * params  # every gradient
    if grid.dp_kind == "zero1":
        sent_dp_cp += planner.ring_share(grid.dp * c) * planner.FLOAT32 * params  # the owners' broadcasts
    sent_world = 2 * planner.ring_share(grid.world_size) * 8             # the loss, float64
    return {"param": planner.FLOAT32 * params, "grad": planner.FLOAT32 * params, "optim": optim,
            "activation": activation, "sent_tp": sent_tp, "sent_cp": sent_cp,
            "sent_pp": sent_pp, "sent_dp_cp": sent_dp_cp, "sent_world": sent_world}


# --------------------------------------------------------------------------- published runs
# Published training runs, predicted cold from the planner's presets (lesson 9's README cites
# each): (run, model, GPU preset, GPUs, global batch, sequence, grid, published tokens/s a GPU,
# published memory GiB or None). None of these tuned a preset. torchtitan ran without
# torch.compile (eager) but for the long-sequence row; its A100 8B run with a fused RMSNorm.
LLAMA3_70B = dataclasses.replace(planner.LLAMA3_8B, layers=80, d_model=8192, heads=64, d_ff=28672)
PUBLISHED = [
    ("torchtitan, Llama 3.1 8B, 8 x H100, FSDP, local batch 2", planner.LLAMA3_8B, "H100-HBM2e", 8,
     16, 8192, "dp8 fsdp op", 5762, 82.4),
    ("torchtitan, Llama 3.1 8B, 128 x H100, FSDP, local batch 2", planner.LLAMA3_8B, "H100-HBM2e",
     128, 256, 8192, "dp128 fsdp op", 5605, 67.0),
    ("torchtitan, Llama 3.1 8B, 8 x H100, FSDP 1 x CP 8, sequence 262,144",
     dataclasses.replace(planner.LLAMA3_8B, eager=False), "H100-HBM2e", 8, 1, 262144,
     "dp1 fsdp cp8 ckpt", 548, 84.5),
    ("torchtitan, Llama 3 8B, 64 x A100, FSDP, local batch 1", dataclasses.replace(
        planner.LLAMA3_8B, fused_norm=True), "A100", 64, 64, 8192, "dp64 fsdp op", 2973, None),
    ("torchtitan, Llama 3 70B, 64 x A100, FSDP, local batch 1", LLAMA3_70B, "A100", 64, 64, 8192,
     "dp64 fsdp ckpt", 331, None),
]
NVL_PEAK = 835e12   # H100 NVL's datasheet bf16: torchtitan's H100s peak "between SXM and NVL"


def published_rows() -> list[dict]:
    """Each published run as the planner predicts it from the presets alone; on torchtitan's
    H100s also at the NVL's peak, the low end of what torchtitan says theirs is."""
    rows = []
    for run, lm, gpu, gpus, batch, seq, label, published, memory in PUBLISHED:
        lm = dataclasses.replace(lm, batch=batch, seq=seq)
        grid = planner.parse_label(label)
        machine = planner.cluster(gpu, gpus)
        prediction = planner.predict(lm, grid, machine)
        low = None
        if gpu == "H100-HBM2e":
            nvl = dataclasses.replace(machine, gpu=dataclasses.replace(machine.gpu, peak=NVL_PEAK))
            low = planner.predict(lm, grid, nvl)["tokens_per_s_per_rank"]
        terms = sorted(prediction["terms"], key=lambda term: -term[1])
        rows.append({"run": run, "grid": label, "gpu": gpu, "published": published,
                     "predicted": prediction["tokens_per_s_per_rank"], "predicted_nvl": low,
                     "error": prediction["tokens_per_s_per_rank"] / published - 1,
                     "memory": memory, "predicted_memory": prediction["memory"]["total"] / 2**30,
                     "largest": f"{terms[0][0]} {terms[0][1] * 1e3:.0f} ms"})
    return rows


def within_target(ratio: float) -> bool:
    """Predicted within 25% of measured, either way: |ratio - 1| <= 0.25."""
    return abs(ratio - 1) <= TARGET


def summary(rows: list[dict]) -> str:
    """The line a report quotes: median and 90th percentile of |predicted / measured - 1|."""
    errors = sorted(abs(row["ratio"] - 1) for row in rows)
    p90 = statistics.quantiles(errors, n=10, method="inclusive")[-1] if len(errors) > 1 else errors[0]
    worst = max(rows, key=lambda row: abs(row["ratio"] - 1))
    return (f"median |error| {statistics.median(errors):.0%}, 90th percentile {p90:.0%} over "
            f"{len(rows)} configurations; within {TARGET:.0%}: "
            f"{sum(within_target(row['ratio']) for row in rows)}; the worst: {worst['config']} "
            f"({worst['ratio'] - 1:+.0%})")


def parse_args(argv=None) -> argparse.Namespace:
    from common.launch import Parser
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"],
                        help="whose rows to check (default: gloo)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="whose rows to check (default: cpu)")
    parser.add_argument("--project", action="store_true",
                        help="also project onto the cluster presets with this device's compute "
                             "(always on with --device cuda)")
    parser.add_argument("--published", action="store_true",
                        help="print the published runs beside the planner's cold predictions")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("check_prediction: --device cuda: this box has no CUDA device (torch "
              f"{torch.__version__}); check its rows with --device cpu")
        return 2
    if args.published:
        print("| run | grid | GPU preset | published tokens/s/GPU | predicted | error | at the NVL's "
              "peak | memory GiB published / predicted | largest term |\n|---|---|---|---|---|---|---|---|---|")
        for row in published_rows():
            nvl = "-"
            if row["predicted_nvl"]:
                nvl = f"{row['predicted_nvl']:,.0f} ({row['predicted_nvl'] / row['published'] - 1:+.0%})"
            print(f"| {row['run']} | `{row['grid']}` | {row['gpu']} | {row['published']:,} | "
                  f"{row['predicted']:,.0f} | {row['error']:+.0%} | {nvl} | {row['memory'] or '-'} / "
                  f"{row['predicted_memory']:.1f} | {row['largest']} |")
        return 0
    backend_device = f"{args.backend}/{args.device}"
    if args.device == "cuda" or args.project:
        projected = projection_rows(args.device)
        if projected:
            results.upsert_csv(PROJECTION_CSV, projected, key=["cluster"])
            print(f"PREDICTED on the cluster presets, compute from {projected[0]['compute_from']}:")
            for row in projected:
                print(f"  {row['config']:34} {row['predicted_ms']:9.2f} ms "
                      f"{row['tokens_per_s_per_gpu']:>9,} tokens/s a GPU")
    else:
        print("check_prediction: no projection onto the GPU presets without a GPU (--project: anyway)")
    run = os.environ.get("RESULTS_RUN_ID")      # make bench: only this run's fit counts
    fits = {key: fit for key, fit in results.read_json("allreduce_fit.json").items()
            if key.startswith(backend_device + "/") and isinstance(fit, dict) and "a_s" in fit
            and not (run and fit.get("run_id") != run)}
    if not fits:
        print(f"check_prediction: no all-reduce fit for {backend_device} in "
              "results/allreduce_fit.json: run stage 02 first (make 02, or make bench)")
        return 1
    cores = torch.cuda.device_count() if args.device == "cuda" else os.cpu_count() or 1   # ranks take turns on them
    rows = []
    pace = step_bench.Deadline()
    for make_rows in (ddp_rows, ledger_rows, grid_rows, pipeline_rows, context_parallel_rows,
                      expert_parallel_rows):
        new_rows = []
        for row in make_rows(fits, backend_device, cores, pace):
            new_rows.append(row)
            # this run's rows replace every older row from the same source file
            results.upsert_csv(CSV_NAME, new_rows, key=["source"])
        rows.extend(new_rows)
    if not rows:
        print("check_prediction: nothing to check: no row of this run that the planner models")
        return 0
    print(f"predicted beside measured, {backend_device}, {results.machine_name()} (ms; error: predicted / measured - 1;"
          f" spread: the measured steps' fastest and slowest, over their median):\n{'configuration':58} "
          f"{'predicted':>10} {'measured':>10} {'error':>6} {'spread':>12}")
    for row in rows:
        low, high = (f"{float(row[key]) / row['measured_ms'] - 1:+.0%}" if row[key] != "" else "?"
                     for key in ("measured_min_ms", "measured_max_ms"))
        print(f"{row['config']:58} {row['predicted_ms']:10.2f} {row['measured_ms']:10.2f} "
              f"{row['ratio'] - 1:+6.0%} {low:>5}..{high}")
    print(f"{summary(rows)}\nwrote results/{CSV_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
