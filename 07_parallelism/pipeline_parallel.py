"""Stage 07b: pipeline parallelism. Split the model's layers across ranks, stream micro-batches.

Tensor parallelism (tensor_parallel.py) splits every layer; pipeline parallelism splits the
*stack*: with p ranks ("stages") and L layers, rank r holds layers [r L/p, (r+1) L/p). A batch
flows rank 0 -> 1 -> ... -> p-1 forward (each rank sends its output activation to the next
with a point-to-point send) and back p-1 -> ... -> 0 (each rank sends the gradient of its
input to the previous one). Only one rank works on a batch at a time, so the batch is cut into
m micro-batches that follow each other down the pipe; gradients accumulate over them, and the
result is exactly the gradient of the whole batch.

The ranks still wait: at the start while the pipe fills and at the end while it drains. With
equal stages this "bubble" is (p-1)/(m+p-1) of the time for both schedules here (GPipe: Huang
et al., 2019; 1F1B: Narayanan et al., PipeDream, 2019, in its synchronous "flush" form used by
Megatron-LM). More micro-batches shrink it. What differs is memory: GPipe runs all m forwards
before any backward, so it holds the activations of m micro-batches at once; 1F1B starts
backwards as early as possible and holds at most p.

A schedule here is *data*: a pure function of (rank, stages, micro_batches) returning the
rank's ordered list of steps (forward i / backward i, with whom each receives from and sends
to). The same lists are checked without any process group, simulated in unit time (the ideal
bubble and the text timeline) and run by one small executor loop.

Run:
    python 07_parallelism/pipeline_parallel.py                      # 4 stages, gloo/cpu
    python 07_parallelism/pipeline_parallel.py --world-size 2 --micro-batches 1,2,4
    torchrun --nproc-per-node=4 07_parallelism/pipeline_parallel.py

The algorithm part (everything above the harness) needs torch only: copy this file into
another project and use ``one_f_one_b_schedule`` / ``run_schedule`` from it.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

FORWARD, BACKWARD = "F", "B"

# --------------------------------------------------------------------------- schedules as data


@dataclass(frozen=True)
class Step:
    """One unit of work on one rank.

    forward i: receive micro-batch i's input activation from ``recv_from`` (None on the first
    stage, which reads the data), run the stage, send the output to ``send_to`` (None on the
    last stage, which computes the loss instead).
    backward i: receive the gradient of the output from ``recv_from`` (None on the last stage,
    which starts from the loss), backpropagate, send the input's gradient to ``send_to``.
    """

    op: str               # FORWARD or BACKWARD
    micro_batch: int
    recv_from: int | None
    send_to: int | None

    def __str__(self) -> str:
        return f"{self.op}{self.micro_batch}"


def _forward(rank: int, stages: int, i: int) -> Step:
    return Step(FORWARD, i, rank - 1 if rank > 0 else None,
                rank + 1 if rank < stages - 1 else None)


def _backward(rank: int, stages: int, i: int) -> Step:
    return Step(BACKWARD, i, rank + 1 if rank < stages - 1 else None,
                rank - 1 if rank > 0 else None)


def gpipe_schedule(rank: int, stages: int, micro_batches: int) -> list[Step]:
    """GPipe: all m forwards, then all m backwards (here in the same micro-batch order)."""
    return ([_forward(rank, stages, i) for i in range(micro_batches)]
            + [_backward(rank, stages, i) for i in range(micro_batches)])


def one_f_one_b_schedule(rank: int, stages: int, micro_batches: int) -> list[Step]:
    """1F1B: a few warm-up forwards, then alternate one forward / one backward, then drain.

    Rank r runs p-1-r warm-up forwards: exactly enough that its first backward's gradient
    (which needs micro-batch 0 to reach the last stage and come back) arrives as soon as
    possible. From then on every backward frees one micro-batch's activations before the next
    forward stores another, so rank r never holds more than p-r (<= p) micro-batches.
    """
    warmup = min(stages - 1 - rank, micro_batches)
    steps = [_forward(rank, stages, i) for i in range(warmup)]
    for j in range(micro_batches - warmup):          # steady state: F(warmup + j), B(j)
        steps += [_forward(rank, stages, warmup + j), _backward(rank, stages, j)]
    steps += [_backward(rank, stages, j) for j in range(micro_batches - warmup, micro_batches)]
    return steps


SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}


def peak_in_flight(steps: list[Step]) -> int:
    """Most micro-batches whose forward has run and backward not yet: activations held."""
    held = peak = 0
    for s in steps:
        held += 1 if s.op == FORWARD else -1
        peak = max(peak, held)
    return peak


def simulate(schedule, stages: int, micro_batches: int) -> list[list[Step | None]]:
    """Run every rank's list in unit time; return the grid [rank][time slot] (None = idle).

    A step runs in the first slot after its rank's previous step in which the step it
    receives from (the same op and micro-batch on ``recv_from``) has finished. Checks on the
    way that every receive has a matching send, and raises if the lists deadlock.
    """
    lists = [schedule(r, stages, micro_batches) for r in range(stages)]
    for r, steps in enumerate(lists):
        for s in steps:
            if s.recv_from is not None:
                peer = lists[s.recv_from]
                if not any(q.op == s.op and q.micro_batch == s.micro_batch and q.send_to == r
                           for q in peer):
                    raise ValueError(f"rank {r} step {s} receives from rank {s.recv_from}, "
                                     f"which never sends it")
    finished: dict[tuple[int, str, int], int] = {}   # (rank, op, i) -> end of its slot
    pos = [0] * stages
    grid: list[list[Step | None]] = [[] for _ in range(stages)]
    t = 0
    while any(pos[r] < len(lists[r]) for r in range(stages)):
        ran = []
        for r in range(stages):
            step = lists[r][pos[r]] if pos[r] < len(lists[r]) else None
            ready = step is not None and (
                step.recv_from is None
                or finished.get((step.recv_from, step.op, step.micro_batch), t + 1) <= t)
            grid[r].append(step if ready else None)
            if ready:
                ran.append((r, step))
        if not ran:
            raise RuntimeError(f"schedule deadlocks at time {t}: " + ", ".join(
                f"rank {r} waits in {lists[r][pos[r]]}" for r in range(stages)
                if pos[r] < len(lists[r])))
        for r, step in ran:
            finished[(r, step.op, step.micro_batch)] = t + 1
            pos[r] += 1
        t += 1
    return grid


def ideal_bubble(grid: list[list[Step | None]]) -> list[float]:
    """Idle share per rank in the unit-time simulation: idle slots / all slots."""
    return [sum(s is None for s in row) / len(row) for row in grid]


def bubble_formula(stages: int, micro_batches: int) -> float:
    """(p-1)/(m+p-1): p-1 slots to fill the pipe and p-1 to drain it, out of m+p-1 per pass."""
    return (stages - 1) / (micro_batches + stages - 1)


def format_timeline(grid: list[list[Step | None]]) -> str:
    """One row per rank, one column per time slot: F3/B3 = forward/backward of micro-batch 3."""
    width = max(len(str(s)) for row in grid for s in row if s is not None)
    lines = [f"rank {r} | " + " ".join(f"{str(s) if s else '.':<{width}}" for s in row).rstrip()
             for r, row in enumerate(grid)]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the model


class Block(nn.Module):
    """x + fc2(gelu(fc1(x))): a residual MLP block, the unit the pipeline splits on."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


def build_model(layers: int, d_model: int, hidden: int, seed: int = 0) -> nn.Sequential:
    """The whole stack, the same on every rank for a given seed."""
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(d_model, hidden) for _ in range(layers)])


def stage_layers(layers: int, stages: int, rank: int) -> range:
    """Which layers rank ``rank`` holds: an even, contiguous share."""
    if layers % stages:
        raise ValueError(f"{layers} layers do not split evenly over {stages} stages")
    per = layers // stages
    return range(rank * per, (rank + 1) * per)


# --------------------------------------------------------------------------- the executor


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_schedule(stage: nn.Module, steps: list[Step], micro_inputs, micro_targets,
                 activation_shape, device: torch.device, loss_fn=F.mse_loss) -> dict:
    """Execute one rank's steps; gradients accumulate in ``stage``'s parameters.

    ``micro_inputs`` (first stage) and ``micro_targets`` (last stage) are lists of m tensors;
    other ranks pass None. Every micro-batch's loss is divided by m, so the accumulated
    gradient is that of the mean loss over the whole batch. Returns the busy seconds
    (compute only), the wall time between two barriers, the peak number of micro-batches
    held, and the summed loss (last stage).

    Communication: every step's incoming tensor is received before the step runs, and the
    outgoing one is posted together with the *next* step's receive. On NCCL the two go in
    one ``batch_isend_irecv`` group: in 1F1B a rank's activation send to rank r+1 and that
    rank's gradient send back can cross, and two blocking sends facing each other would
    deadlock; grouped with the matching receives they cannot (Megatron-LM's
    send_forward_recv_backward). On Gloo sends are asynchronous (isend) and waited for at the
    end, and tensors travel through CPU memory, which Gloo's point-to-point needs.
    """
    m = sum(s.op == FORWARD for s in steps)
    nccl = dist.get_backend() == "nccl"
    comm_device = device if nccl else torch.device("cpu")
    inputs, outputs = {}, {}            # micro-batch -> stage input / output (or loss)
    held = peak = 0
    busy = 0.0
    loss_sum = torch.zeros((), device=device)
    pending_send = None                 # (tensor, dst) from the previous step
    send_works = []                     # (work, tensor): kept alive until the sends finish

    def communicate(recv_from):
        nonlocal pending_send
        buf = None if recv_from is None else torch.empty(activation_shape, device=comm_device)
        ops = []
        if pending_send is not None:
            ops.append(dist.P2POp(dist.isend, pending_send[0], pending_send[1]))
        if buf is not None:
            ops.append(dist.P2POp(dist.irecv, buf, recv_from))
        if nccl and ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()             # orders our CUDA stream after it; the host goes on
        else:
            if pending_send is not None:
                send_works.append((dist.isend(*pending_send), pending_send[0]))
            if buf is not None:
                dist.recv(buf, src=recv_from)
        pending_send = None
        return None if buf is None else buf.to(device)

    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for step in steps:
        i = step.micro_batch
        received = communicate(step.recv_from)
        _sync(device)
        t0 = time.perf_counter()
        if step.op == FORWARD:
            x = micro_inputs[i] if received is None else received.requires_grad_(True)
            y = stage(x)
            if step.send_to is None:    # last stage: the output becomes this micro-batch's loss
                y = loss_fn(y, micro_targets[i]) / m
                loss_sum += y.detach()
            inputs[i], outputs[i] = x, y
            held += 1
            peak = max(peak, held)
        else:
            torch.autograd.backward(outputs[i], grad_tensors=received)  # None on the last stage
            x = inputs.pop(i)
            outputs.pop(i)              # frees this micro-batch's activations
            held -= 1
        _sync(device)
        busy += time.perf_counter() - t0
        if step.send_to is not None:
            out = y.detach() if step.op == FORWARD else x.grad
            pending_send = (out.to(comm_device).contiguous(), step.send_to)
    communicate(None)                   # flush the last step's send
    for work, _ in send_works:
        work.wait()
    _sync(device)
    dist.barrier()                      # the pass ends when the slowest rank ends
    total = time.perf_counter() - start
    return {"busy_s": busy, "total_s": total, "peak_held": peak, "loss": loss_sum.item()}


# --------------------------------------------------------------------------- harness


def _setup_common():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_data(batch: int, d_model: int, device: torch.device, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, d_model, generator=g)
    return x.to(device), torch.randn(batch, d_model, generator=g).to(device)


def reference_grads(cfg: dict, device: torch.device, layers: range) -> list[torch.Tensor]:
    """Single-process gradients of the whole model on the whole batch, for ``layers`` only."""
    model = build_model(cfg["layers"], cfg["d_model"], cfg["hidden"]).to(device)
    x, target = make_data(cfg["batch"], cfg["d_model"], device)
    F.mse_loss(model(x), target).backward()
    return [p.grad.clone() for i in layers for p in model[i].parameters()]


def pipeline_pass(stage: nn.Module, schedule: str, rank: int, stages: int, m: int,
                  cfg: dict, device: torch.device) -> dict:
    """Zero the stage's gradients and run one full pass of ``schedule`` with m micro-batches."""
    x, target = make_data(cfg["batch"], cfg["d_model"], device)
    steps = SCHEDULES[schedule](rank, stages, m)
    stage.zero_grad(set_to_none=True)
    return run_schedule(stage, steps,
                        list(x.chunk(m)) if rank == 0 else None,
                        list(target.chunk(m)) if rank == stages - 1 else None,
                        (cfg["batch"] // m, cfg["d_model"]), device)


def check_pass(stage: nn.Module, want: list[torch.Tensor], result: dict, schedule: str,
               rank: int, stages: int, m: int) -> list[str]:
    """What differs from single-process training and from the schedule's promised memory."""
    problems = []
    for k, (p, w) in enumerate(zip(stage.parameters(), want)):
        if not torch.allclose(p.grad, w, rtol=1e-4, atol=1e-6):
            problems.append(f"rank {rank} {schedule} m={m}: gradient of parameter {k} differs "
                            f"from single-process by up to {(p.grad - w).abs().max().item():.3g}")
    expected = m if schedule == "gpipe" else min(stages - rank, m)
    if result["peak_held"] != expected or (schedule == "1f1b" and result["peak_held"] > stages):
        problems.append(f"rank {rank} {schedule} m={m}: held {result['peak_held']} micro-batches "
                        f"at once, expected {expected}")
    return problems


def pipeline_parallel_main(ctx, cfg: dict) -> None:
    """Verify gradients for every (schedule, m), measure the bubble, print tables + timelines."""
    _setup_common()
    from common.results import machine_name, print_table, run_id, upsert_csv

    p, rank, device = ctx.world_size, ctx.rank, ctx.device
    model = build_model(cfg["layers"], cfg["d_model"], cfg["hidden"]).to(device)
    mine = stage_layers(cfg["layers"], p, rank)
    # A real system would build only its own layers; building all and keeping ours keeps the
    # weights identical to the single-process reference without sending them anywhere.
    stage = nn.Sequential(*[model[i] for i in mine])
    del model
    want = reference_grads(cfg, device, mine)

    problems, rows = [], []
    for schedule in cfg["schedules"]:
        for m in cfg["micro_batches"]:
            result = pipeline_pass(stage, schedule, rank, p, m, cfg, device)
            problems += check_pass(stage, want, result, schedule, rank, p, m)
            for _ in range(cfg["warmup"]):
                pipeline_pass(stage, schedule, rank, p, m, cfg, device)
            runs = [pipeline_pass(stage, schedule, rank, p, m, cfg, device)
                    for _ in range(cfg["iters"])]
            idle = statistics.median(1 - r["busy_s"] / r["total_s"] for r in runs)
            step_s = statistics.median(r["total_s"] for r in runs)
            mine_t = torch.tensor([idle, step_s, result["peak_held"]], dtype=torch.float64)
            everyone = [torch.empty_like(mine_t) for _ in range(p)]
            dist.all_gather(everyone, mine_t.to(device) if ctx.backend == "nccl" else mine_t)
            everyone = [t.cpu().tolist() for t in everyone]
            sim = ideal_bubble(simulate(SCHEDULES[schedule], p, m))
            rows.append(dict(schedule=schedule, m=m, idle=[e[0] for e in everyone],
                             step_ms=max(e[1] for e in everyone) * 1e3,
                             peak=[int(e[2]) for e in everyone], sim=sim,
                             formula=bubble_formula(p, m)))

    if ctx.is_main:
        print(f"Pipeline parallel: {p} stages x {cfg['layers'] // p} blocks "
              f"(d_model={cfg['d_model']}, hidden={cfg['hidden']}), batch {cfg['batch']}, "
              f"{ctx.backend}/{device.type} ({machine_name()})\n")
        table = [{"schedule": r["schedule"], "m": r["m"],
                  **{f"idle r{k}": r["idle"][k] for k in range(p)},
                  "idle mean": sum(r["idle"]) / p, "simulated": r["sim"][0],
                  "(p-1)/(m+p-1)": r["formula"], "step_ms": r["step_ms"],
                  "peak held per rank": " ".join(map(str, r["peak"]))} for r in rows]
        print_table(table, f"Bubble (idle share of the pass per rank, median of {cfg['iters']} "
                           f"passes) and micro-batches held at once:", floatfmt=".3f")
        for schedule in cfg["schedules"]:
            for m in cfg["micro_batches"]:
                print(f"\n{schedule}, p={p}, m={m} (unit-time simulation of the same step "
                      f"lists the executor runs):")
                print(format_timeline(simulate(SCHEDULES[schedule], p, m)))
        csv_rows = [{"backend": ctx.backend, "device": device.type, "world_size": p,
                     "layers": cfg["layers"], "d_model": cfg["d_model"],
                     "hidden": cfg["hidden"], "batch": cfg["batch"],
                     "schedule": r["schedule"], "micro_batches": r["m"], "rank": k,
                     "idle_share": r["idle"][k], "idle_share_simulated": r["sim"][k],
                     "idle_share_formula": r["formula"], "peak_held": r["peak"][k],
                     "step_ms": r["step_ms"], "run_id": run_id()}
                    for r in rows for k in range(p)]
        path = upsert_csv("pipeline_bubble.csv", csv_rows,
                          key=["backend", "device", "world_size", "layers", "d_model", "hidden",
                               "batch", "schedule", "micro_batches", "rank"])
        print(f"\nwrote {path}")
    if problems:
        raise AssertionError("pipeline check failed:\n  " + "\n  ".join(problems))
    ctx.print("gradients match single-process for every schedule and m; peak held as "
              "promised", all_ranks=False)


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        return []


def main(argv=None) -> None:
    _setup_common()
    from common import launch

    parser = launch.make_parser(__doc__, world_size=4)
    parser.add_argument("--layers", type=int, default=8,
                        help="residual MLP blocks in the model; must divide by the stages")
    parser.add_argument("--d-model", type=int, default=512, help="activation width")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden width inside a block")
    parser.add_argument("--batch", type=int, default=128,
                        help="rows per batch; must divide by every micro-batch count")
    parser.add_argument("--micro-batches", default="1,4,8",
                        help="comma-separated micro-batch counts m to run")
    parser.add_argument("--schedules", default="gpipe,1f1b",
                        help="comma-separated subset of: " + ", ".join(SCHEDULES))
    parser.add_argument("--warmup", type=int, default=0,
                        help="untimed passes per setting besides the checked pass, which "
                             "always runs first and warms up too")
    parser.add_argument("--iters", type=int, default=3, help="timed passes per setting")
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    p = config.world_size
    micro_batches = _int_list(args.micro_batches)
    if not micro_batches or min(micro_batches) < 1:
        parser.error(f"--micro-batches must be a comma-separated list of integers >= 1, "
                     f"got {args.micro_batches!r}")
    schedules = [s for s in args.schedules.split(",") if s]
    for s in schedules or [""]:
        if s not in SCHEDULES:
            parser.error(f"--schedules: unknown schedule {s!r}; allowed: {', '.join(SCHEDULES)}")
    for flag, value in (("--layers", args.layers), ("--d-model", args.d_model),
                        ("--hidden", args.hidden), ("--batch", args.batch),
                        ("--iters", args.iters)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.layers % p:
        parser.error(f"--layers {args.layers} is not divisible by the number of stages "
                     f"(world size) {p}")
    for m in micro_batches:
        if args.batch % m:
            parser.error(f"--batch {args.batch} is not divisible by --micro-batches value {m}")
    cfg = dict(layers=args.layers, d_model=args.d_model, hidden=args.hidden, batch=args.batch,
               micro_batches=micro_batches, schedules=schedules, warmup=args.warmup,
               iters=args.iters)
    launch.launch(pipeline_parallel_main, config, cfg)


if __name__ == "__main__":
    main()
