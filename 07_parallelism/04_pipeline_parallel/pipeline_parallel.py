"""Stage 07: pipeline parallelism. Split the model's layers across ranks, stream micro-batches.

Tensor parallelism splits every layer; pipeline parallelism splits the *stack*: each of p
ranks holds some layers, an activation goes rank 0 -> 1 -> ... -> p-1 by point-to-point
sends and its gradient comes back. The batch is cut into m micro-batches so that several
ranks work at once; their gradients add up to exactly the whole batch's. Ranks still idle
while the pipe fills and drains (the bubble); four schedules trade it against memory:

* GPipe: all forwards, then all backwards; idle (p-1)/(m+p-1), holds m micro-batches.
* 1F1B: the same idle, holds at most p (each backward frees one before a forward stores one).
* interleaved 1F1B: v chunks of layers per rank; idle (p-1)/(vm+p-1).
* ZB-H1 (zero bubble): the backward split into B, the input's gradient that the previous
  stage waits for, and W, the weight gradients nobody waits for, which fill the bubble: idle
  (p-1)/(3m+p-1) with equal F, B, W. ``DeferredLinear``'s backward returns the input's
  gradient and keeps (input, output gradient) for W to turn into weight gradients later.

The schedules are data (pipeline_schedules.py, no torch: checks, unit-time simulator, text
timelines); ``run_schedule`` executes any of them. ``--emulate-ms`` turns each step into a
fixed wait, so the measured bubble tests the executor against the simulation on any box.

Run:  python 07_parallelism/04_pipeline_parallel/pipeline_parallel.py                   # 4 stages, m = 8, gloo/cpu
      python 07_parallelism/04_pipeline_parallel/pipeline_parallel.py --micro-batches 4,8,16 --emulate-ms 50
      torchrun --nproc-per-node=4 07_parallelism/04_pipeline_parallel/pipeline_parallel.py

The algorithm (above the harness) needs torch and pipeline_schedules.py: copy both files.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import pipeline_schedules as schedules      # next to this file: the schedules, as data
FORWARD, BACKWARD, WEIGHT = schedules.FORWARD, schedules.BACKWARD, schedules.WEIGHT

# --------------------------------------------------------------------------- the model


class _LinearDeferredW(torch.autograd.Function):
    """y = x W^T + b. Backward returns dL/dx = dy W (B) and leaves dL/dW = dy^T x, dL/db =
    sum(dy) to ``layer.weight_grad`` (W): now, or later from the layer's store."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ctx.save_for_backward(x, weight)
        ctx.layer = layer
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        if ctx.layer.weight_grad_store is None:
            ctx.layer.weight_grad(x, dy)                 # W right away: an ordinary backward
        else:
            ctx.layer.weight_grad_store.append((ctx.layer, x, dy))   # W later
        return dx, None, None, None                      # autograd accumulates nothing itself


class DeferredLinear(nn.Linear):
    """nn.Linear whose weight gradient can be deferred (same parameters, same init)."""
    weight_grad_store: list | None = None        # where B leaves W's work; None: W in B

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearDeferredW.apply(x, self.weight, self.bias, self)

    @torch.no_grad()
    def weight_grad(self, x: torch.Tensor, dy: torch.Tensor) -> None:
        """The W work: accumulate dy^T x into weight.grad and sum(dy) into bias.grad."""
        dy, x = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        for p, g in ((self.weight, dy.T @ x), (self.bias, dy.sum(0))):
            if p is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)


def set_weight_grad_store(module: nn.Module, store: list | None) -> None:
    """Route every DeferredLinear's weight-gradient work into ``store`` (None: do it now)."""
    for layer in module.modules():
        if isinstance(layer, DeferredLinear):
            layer.weight_grad_store = store


class Block(nn.Module):
    """x + fc2(gelu(fc1(x))): a residual MLP block, the unit the pipeline splits on."""

    def __init__(self, d_model: int, hidden: int, linear=DeferredLinear):
        super().__init__()
        self.fc1, self.fc2 = linear(d_model, hidden), linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


def build_model(layers: int, d_model: int, hidden: int, seed: int = 0,
                linear=DeferredLinear) -> nn.Sequential:
    """The whole stack, the same on every rank for a given seed (and either linear class)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(d_model, hidden, linear) for _ in range(layers)])


def chunk_layers(layers: int, stages: int, rank: int, chunks: int = 1) -> list[range]:
    """The layers of each of rank's chunks: the stack cut into p*v equal pieces ("virtual
    stages"), piece c*p + r on rank r as its chunk c (v = 1: one contiguous share per rank)."""
    if layers % (stages * chunks):
        raise ValueError(f"{layers} layers do not split into {stages} stages x {chunks} chunks")
    per = layers // (stages * chunks)
    return [range(s * per, (s + 1) * per) for s in (c * stages + rank for c in range(chunks))]


# --------------------------------------------------------------------------- the executor


def run_schedule(chunks, schedule: list[list[schedules.Step]], micro_inputs, micro_targets,
                 activation_shape, device: torch.device, loss_fn=F.mse_loss,
                 emulate_s: float = 0.0) -> dict:
    """Run this rank's steps of ``schedule`` (all ranks' step lists); gradients accumulate.

    ``chunks``: the rank's model chunk(s), a module or a list indexed by ``Step.chunk``;
    ``micro_inputs`` / ``micro_targets``: m tensors on the first / last stage, else None.
    Each micro-batch's loss is divided by m, so the gradients add up to the mean loss's.
    ``emulate_s`` > 0: every F, B, W only waits that long (the messages stay real). Returns
    busy and wall seconds, the most (chunk, micro-batch) pairs held at once, the summed loss.

    Messages follow ``p2p_plan``: groups posted as one ``batch_isend_irecv`` each, in an
    order that cannot deadlock even where a send waits for its receive (NCCL); a receive is
    waited for right before its step. Gloo sends through CPU memory: tensors go there.
    """
    chunks = [chunks] if isinstance(chunks, nn.Module) else list(chunks)
    rank, p, nccl = dist.get_rank(), len(schedule), dist.get_backend() == "nccl"
    steps, plan = schedule[rank], schedules.p2p_plan(schedule)[rank]
    m = sum(s.op == FORWARD and s.chunk == 0 for s in steps)
    comm_device = device if nccl else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    defer = any(s.op == WEIGHT for s in steps)   # ZB: B leaves the weight gradients to W
    inputs, outputs, stored = {}, {}, {}         # (chunk, micro-batch) -> x / y / W's work
    inbox, outbox, arriving, sends = {}, {}, {}, []   # message -> tensor / tensor / recv work
    placeholder = torch.zeros(activation_shape, device=device)
    peak, busy, loss_sum = 0, 0.0, torch.zeros((), device=device)

    def post(groups):
        for group in groups:
            ops = [dist.P2POp(dist.isend, outbox.pop(msg), peer) if kind == "send" else
                   dist.P2POp(dist.irecv, inbox.setdefault(
                       msg, torch.empty(activation_shape, device=comm_device)), peer)
                   for kind, peer, msg in group]
            for (kind, _, msg), op, work in zip(group, ops, dist.batch_isend_irecv(ops)):
                if nccl:
                    work.wait()                  # orders our CUDA stream after it; the host goes on
                if kind == "recv":
                    arriving[msg] = work
                else:
                    sends.append((work, op.tensor))

    sync()
    dist.barrier()
    start = time.perf_counter()
    for k, step in enumerate(steps):
        key, chunk = (step.chunk, step.micro_batch), chunks[step.chunk]
        post(plan[k])
        msg = schedules.message(step, rank, p)
        if msg in arriving:                      # from another rank (else from itself, p = 1)
            arriving.pop(msg).wait()
        received = inbox.pop(msg).to(device) if step.recv_from is not None else None
        sync()
        t0 = time.perf_counter()
        if emulate_s:
            time.sleep(emulate_s)                # stands in for the compute below
        if step.op == FORWARD:
            x = micro_inputs[step.micro_batch] if received is None else received.requires_grad_()
            y = placeholder if emulate_s else chunk(x)
            if step.send_to is None and not emulate_s:   # last stage: the output becomes the loss
                y = loss_fn(y, micro_targets[step.micro_batch]) / m
                loss_sum += y.detach()
            inputs[key], outputs[key], out = x, y, y.detach()
        elif step.op == BACKWARD:
            x, y, store = inputs.pop(key), outputs.pop(key), []   # frees all but W's tensors
            if not emulate_s:
                set_weight_grad_store(chunk, store if defer else None)
                torch.autograd.backward(y, grad_tensors=received)  # None on the last stage
                set_weight_grad_store(chunk, None)
            if defer:
                stored[key] = store
            out = placeholder if emulate_s else x.grad
        else:                                    # W: the weight gradients B left behind
            for layer, x, dy in stored.pop(key):
                layer.weight_grad(x, dy)
        peak = max(peak, len(outputs) + len(stored))
        sync()
        busy += time.perf_counter() - t0
        if step.send_to is not None:
            box = inbox if step.send_to == rank else outbox
            box[schedules.message(step, rank, p, True)] = out.to(comm_device).contiguous()
    post(plan[len(steps)])                       # the last sends
    for work, _ in sends:
        work.wait()
    if outputs or stored or inbox or outbox:
        raise RuntimeError(f"rank {rank}: the steps left work behind: {sorted(outputs)}, "
                           f"{sorted(stored)}, {list(inbox)}, {list(outbox)}")
    sync()
    dist.barrier()                               # the pass ends when the slowest rank ends
    return {"busy_s": busy, "total_s": time.perf_counter() - start, "peak_held": peak,
            "loss": loss_sum.item()}


# --------------------------------------------------------------------------- harness


def _repo() -> None:
    """The harness needs common/, the algorithm above does not (same in every stage, on purpose)."""
    root = Path(__file__).resolve().parent
    while not (root / "common" / "launch.py").exists():
        if root == root.parent:
            raise SystemExit(f"{Path(__file__).name}: the algorithm above works on its own; the "
                             "demo and benchmark need the repository around this file (common/)")
        root = root.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


def make_data(batch: int, d_model: int, device: torch.device, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, d_model, generator=g).to(device) for _ in range(2)]


def reference_grads(cfg: dict, device: torch.device) -> list[list[torch.Tensor]]:
    """Per layer: the gradients of one process on the whole batch, plain nn.Linear."""
    model = build_model(cfg["layers"], cfg["d_model"], cfg["hidden"], linear=nn.Linear)
    x, target = make_data(cfg["batch"], cfg["d_model"], device)
    F.mse_loss(model.to(device)(x), target).backward()
    return [[p.grad.clone() for p in block.parameters()] for block in model]


def pipeline_pass(model: nn.Sequential, name: str, ctx, m: int, cfg: dict, emulate_ms=0.0):
    """Zero the gradients, run one pass of ``name`` on this rank's chunks of the model."""
    p, rank, v = ctx.world_size, ctx.rank, cfg["v"][name]
    x, target = make_data(cfg["batch"], cfg["d_model"], ctx.device)
    model.zero_grad(set_to_none=True)
    return run_schedule([model[r.start:r.stop] for r in chunk_layers(cfg["layers"], p, rank, v)],
                        schedules.all_ranks(name, p, m, v),
                        list(x.chunk(m)) if rank == 0 else None,
                        list(target.chunk(m)) if rank == p - 1 else None,
                        (cfg["batch"] // m, cfg["d_model"]), ctx.device, emulate_s=emulate_ms / 1e3)


def pipeline_parallel_main(ctx, cfg: dict) -> None:
    """Every schedule and m: gradients and memory checked, the bubble measured (real, emulated)."""
    _repo()
    from common.timing import gather_times
    p, rank, problems, rows = ctx.world_size, ctx.rank, [], []
    # Each rank builds all layers from one seed (same weights, nothing sent), runs its own.
    model = build_model(cfg["layers"], cfg["d_model"], cfg["hidden"]).to(ctx.device)
    want = reference_grads(cfg, ctx.device)
    for name, m in [(name, m) for name in cfg["schedules"] for m in cfg["micro_batches"]]:
        result, v = pipeline_pass(model, name, ctx, m, cfg), cfg["v"][name]
        problems += [f"{name} m={m}: layer {i} parameter {k} differs from one process by "
                     f"{'all' if q.grad is None else (q.grad - w).abs().max().item()}"
                     for r in chunk_layers(cfg["layers"], p, rank, v) for i in r
                     for k, (q, w) in enumerate(zip(model[i].parameters(), want[i]))
                     if q.grad is None or not torch.allclose(q.grad, w, rtol=1e-4, atol=1e-6)]
        promised = schedules.peak_held(schedules.schedule_steps(name, rank, p, m, v))
        if result["peak_held"] != promised:
            problems.append(f"{name} m={m}: held {result['peak_held']}, schedule {promised}")
        peak = [int(x) for x in gather_times([result["peak_held"]]).rank_medians]
        for ms in (0.0, cfg["emulate_ms"]):   # real compute, then emulated; warm by then
            runs = [pipeline_pass(model, name, ctx, m, cfg, ms) for _ in range(
                cfg["iters"] + (0 if ms else cfg["warmup"]))][-cfg["iters"]:]   # the timed ones
            idle = gather_times([1 - r["busy_s"] / r["total_s"] for r in runs]).rank_medians
            sim = schedules.simulated_idle(name, p, m, v)
            rows.append(dict(schedule=name, m=m, v=v, emulated_ms=ms, peak=peak, idle=idle,
                             sim=sim, formula=schedules.bubble_formula(name, p, m, v),
                             gap=max(abs(a - b) for a, b in zip(idle, sim)),
                             step_ms=gather_times([r["total_s"] for r in runs]).median * 1e3))
    if ctx.is_main:
        report(ctx, cfg, rows)
    if problems:
        raise AssertionError(f"rank {rank}: pipeline check failed:\n  " + "\n  ".join(problems))
    ctx.print("gradients match one process for every schedule and m; activations held as "
              "each schedule says", all_ranks=False)


def report(ctx, cfg: dict, rows: list[dict]) -> None:
    """Rank 0: the table, the emulated-compute verdict, the timelines, the CSV."""
    from common.results import machine_name, print_table, run_id, upsert_csv
    p, size = ctx.world_size, {k: cfg[k] for k in ("layers", "d_model", "hidden", "batch")}
    print(f"Pipeline parallel, {p} stages, " + ", ".join(f"{k} {v}" for k, v in size.items())
          + f"; {ctx.backend}/{ctx.device.type}, {machine_name()}\n")
    print_table([{"schedule": r["schedule"], "m": r["m"], "v": r["v"],
                  "compute": f"emulated {r['emulated_ms']:g} ms" if r["emulated_ms"] else "real",
                  "idle per rank": " ".join(f"{x:.3f}" for x in r["idle"]),
                  "simulated": statistics.fmean(r["sim"]), "formula": r["formula"],
                  "max gap": r["gap"], "step_ms": r["step_ms"],
                  "peak held per rank": " ".join(map(str, r["peak"]))} for r in rows],
                f"Idle share per rank (median of {cfg['iters']} passes) beside the unit-time "
                "simulation and the formula; activations held at once:", floatfmt=".3f")
    gap = max(r["gap"] for r in rows if r["emulated_ms"])
    print("\nemulated compute: measured idle within 0.05 of the simulation on every rank: "
          + (f"yes (largest gap {gap:.3f})" if gap <= 0.05 else f"no, {gap:.3f} (each message's "
             "delay on a busy box adds to it; a larger --emulate-ms shrinks its share)"))
    for name in cfg["schedules"]:
        print("\n" + schedules.describe(name, p, max(cfg["micro_batches"]), cfg["v"][name]))
    path = upsert_csv("pipeline_bubble.csv", [dict(
        backend=ctx.backend, device=ctx.device.type, world_size=p, **size, schedule=r["schedule"],
        micro_batches=r["m"], rank=k, idle_share=r["idle"][k], idle_share_simulated=r["sim"][k],
        idle_share_formula=r["formula"], peak_held=r["peak"][k], step_ms=r["step_ms"],
        run_id=run_id(), emulated_ms=r["emulated_ms"], chunks=r["v"], machine=machine_name())
        for r in rows for k in range(p)], key=["backend", "device", "world_size", *size,
                                               "schedule", "micro_batches", "chunks",
                                               "emulated_ms", "rank"])
    print(f"\nwrote {path}")


def main(argv=None) -> None:
    _repo()
    from common import launch, results
    parser, names = launch.make_parser(__doc__, world_size=4), list(schedules.SCHEDULES)
    for flag, kind, default, text in [
        ("--layers", launch.positive_int, 8, "residual MLP blocks; must divide by p (x v)"),
        ("--d-model", launch.positive_int, 256, "activation width"),
        ("--hidden", launch.positive_int, 1024, "hidden width inside a block"),
        ("--batch", launch.positive_int, 64, "rows per batch; must divide by every m"),
        ("--micro-batches", launch.int_list, None, "micro-batch counts m; default: 2p"),
        ("--schedules", launch.choice_list(names), names, "subset of " + ",".join(names)),
        ("--chunks", launch.positive_int, 2, "v, model chunks per rank (interleaved only)"),
        ("--emulate-ms", launch.positive_float, 20.0, "measure also with every F, B, W "
         "replaced by a wait of this many ms (emulated compute; the messages stay real)"),
        ("--warmup", launch.non_negative_int, 0, "untimed passes besides the checked one"),
        ("--iters", launch.positive_int, 3, "timed passes per setting")]:
        parser.add_argument(flag, type=kind, default=default, help=text)
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    p = config.world_size
    args.micro_batches = args.micro_batches or [2 * p]
    args.v = {name: args.chunks if name == "interleaved" else 1 for name in args.schedules}
    for name, m in [(name, m) for name in args.schedules for m in args.micro_batches]:
        try:
            schedules.check_setting(name, p, m, args.v[name], args.layers, args.batch)
        except ValueError as e:
            launch.usage_error(f"--schedules {name} --micro-batches {m}: {e}")
    results.check_writable()
    launch.launch(pipeline_parallel_main, config, vars(args))


if __name__ == "__main__":
    main()
