"""Not a lesson: stage 07's memory and communication ledger, the table of
``python 07_parallelism/measure/bench_fsdp.py --bench`` (its ZeRO rows: ``bench_zero.py``).

Six ways to train the same LM on N ranks: DDP (stage 06), ZeRO-1, ZeRO-2, our FSDP, torch's
ZeroRedundancyOptimizer and fully_shard; and a control, ``none``, that sends nothing (the compute lesson 9's
check predicts the others from). For each, one step is counted with ``counters.py`` beside the lessons'
formula (``predicted_bytes``) and timed; the rows go to ``results/sharding.csv``. The bytes are counts, true
on any interconnect; under Gloo the step times measure its host path, and ``comm_path`` in the CSV says so.
"""

import contextlib
import gc

import torch
import torch.distributed as dist
import torch.nn as nn

from bench import results, step_bench, timing
from bench import supervisor as launch
from common import import_stage, models
from common.launch import carries_point_to_point
from counters import (CommCounter, GatheredWeights, SavedActivations, gathered_storage_keys,
                      optimizer_state_bytes, state_bytes, storage_key)

CSV_KEY = ["backend", "device", "world_size", "model", "impl", "checkpointing"]
KINDS = ("param", "grad", "optim", "peak", "activation", "sent")
LEARNING_RATE = 1e-4

def adamw(params):
    return torch.optim.AdamW(params, lr=LEARNING_RATE)


def sharded_adamw(params):
    zero = import_stage("07_parallelism/01_zero/zero")
    return zero.ShardedOptimizer(params, torch.optim.AdamW, lr=LEARNING_RATE)


def build_none(lm):
    return lm, adamw(lm.parameters())


def build_ddp(lm):
    bucketed_ddp = import_stage("06_bucketed_ddp/bucketed_ddp")
    return bucketed_ddp.BucketedDDP(lm), adamw(lm.parameters())


def build_zero1(lm):
    bucketed_ddp = import_stage("06_bucketed_ddp/bucketed_ddp")
    return bucketed_ddp.BucketedDDP(lm), sharded_adamw(lm.parameters())


def build_zero2(lm):
    zero = import_stage("07_parallelism/01_zero/zero")
    optimizer = sharded_adamw(lm.parameters())
    return zero.Zero2DDP(lm, optimizer), optimizer


def build_fsdp(lm):
    fsdp = import_stage("07_parallelism/02_fsdp/fsdp")
    wrapper = fsdp.FSDP(lm, units=[*lm.blocks, lm])
    return wrapper, adamw(wrapper.parameters())


def build_torch_zero1(lm):
    """ZeroRedundancyOptimizer over torch DDP, its all-reduce hook in Python: counted."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer
    wrapped = nn.parallel.DistributedDataParallel(lm)
    wrapped.register_comm_hook(None, allreduce_hook)
    return wrapped, ZeroRedundancyOptimizer(lm.parameters(), torch.optim.AdamW, lr=LEARNING_RATE)


def build_torch_fsdp(lm):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(lm.lm_head.weight.device.type, (dist.get_world_size(),))
    for block in lm.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(lm, mesh=mesh), adamw(lm.parameters())


def strategies() -> list[tuple]:
    """The control and the six rows, ``(impl, build)`` with ``build(lm) -> (wrapper, optimizer)``."""
    return [("none", build_none), ("ddp", build_ddp), ("zero1", build_zero1), ("zero2", build_zero2),
            ("fsdp", build_fsdp), ("torch_zero1", build_torch_zero1), ("torch_fsdp", build_torch_fsdp)]


def predicted_bytes(impl: str, lm: nn.Module, world_size: int) -> dict[str, float]:
    """Per rank, from the LM's shapes: float32, AdamW's two moments.

    Replicas, P parameters on N ranks: weights 4P, gradients 4P, moments 8P, each / N where
    ``impl`` shards it. Sent: one all-reduce, 2(N-1)/N 4P; ZeRO-1 also broadcasts the
    parameters: 1.5x that; the control (``none``) sends nothing.

    FSDP: sharded tensors padded to N ceil(rows/N) rows (W bytes), W/N a rank; ours keeps 1-D
    ones whole (R bytes): weights and gradients W/N + R, moments twice that. Each unit is
    gathered for forward and backward, but for the K bytes kept gathered between (ours: the
    root and the last block; torch's: the root), and reduce-scattered; R is all-reduced: sent
    (N-1)/N (3W - K) + 2(N-1)/N R. Peak (ours): the shards + K.
    """
    n = world_size
    all_bytes = 4 * sum(tensor.numel() for tensor in lm.parameters())  # 4P
    if "fsdp" not in impl:
        kind = impl.replace("torch_", "")  # torch's ZeRO-1 shards what ours does
        predicted = {"param": all_bytes, "grad": all_bytes, "optim": 2 * all_bytes}
        if kind in ("zero1", "zero2"):
            predicted["optim"] /= n
        if kind == "zero2":
            predicted["grad"] /= n
        traffic = {"none": 0, "zero1": 1.5}.get(kind, 1)  # zero1: + the parameters' broadcast
        predicted["sent"] = 2 * (n - 1) / n * all_bytes * traffic
        return predicted

    ours = impl == "fsdp"
    # id(tensor) -> float32 bytes of N ceil(rows / N) rows, for the sharded tensors
    padded = {id(tensor): 4 * -(-tensor.shape[0] // n) * n * tensor[0].numel()
              for tensor in lm.parameters() if tensor.dim() >= 2 or not ours}
    kept = [*(lm.blocks[-1].parameters() if ours else []),  # stay gathered, forward to backward
            *(tensor for name, tensor in lm.named_parameters() if not name.startswith("blocks."))]
    W = sum(padded.values())  # the sharded tensors' padded bytes
    K = sum(padded.get(id(tensor), 0) for tensor in kept)  # ... of those kept gathered
    sharded_unpadded = 4 * sum(tensor.numel() for tensor in lm.parameters() if id(tensor) in padded)
    R = all_bytes - sharded_unpadded  # the replicated ones' bytes
    held = W / n + R
    predicted = {"param": held, "grad": held, "optim": 2 * held}
    if ours:
        predicted["peak"] = 4 * held + K
    predicted["sent"] = (n - 1) / n * (3 * W - K) + 2 * (n - 1) / n * R
    return predicted


def add_ledger_args(parser) -> None:
    """The ledger's flags, for 2 cores; the course LM: its blocks dominate its saved activations."""
    group = parser.add_argument_group("memory and communication ledger (--bench, --profile)")
    group.add_argument("--bench", action="store_true", help="the ledger of DDP, ZeRO-1/2, FSDP, "
                       "torch's and a control (none): bytes and time per step to results/sharding.csv")
    group.add_argument("--model", choices=list(models.PRESETS), default="course", help="LM preset")
    group.add_argument("--batch-size", type=launch.positive_int, default=4,
                       help="GLOBAL batch (sequences per step), split evenly across ranks")
    group.add_argument("--context-length", type=launch.positive_int, default=32, help="tokens")
    group.add_argument("--steps", type=launch.positive_int, default=5, help="timed steps a round")
    group.add_argument("--warmup", type=launch.non_negative_int, default=1, help="untimed first")
    group.add_argument("--rounds", type=launch.positive_int, default=1, help="run all cases this many "
                       "times, interleaved (background load hits every case alike); pool the steps")
    group.add_argument("--checkpointing", type=launch.choice_list(["off", "on"]), default="off,on",
                       help="activation checkpointing per Transformer block")


def measure_case(ctx, impl: str, build, checkpointing: bool, args, count: bool):
    """Time one strategy on a fresh LM (seed 0); with ``count``, count one more step (held,
    saved, sent, peak). The control (``none``) also times its AdamW step alone. Returns
    (seconds per step, seconds per optimizer step or [], counts or None)."""
    torch.manual_seed(0)
    model = models.TransformerLM(args.model, context_length=args.context_length,
                                 checkpoint_activations=checkpointing).to(ctx.device)
    counted = {"predicted": predicted_bytes(impl, model, ctx.world_size), "peak": -1, "cuda_peak": -1}
    wrapper, optimizer = build(model)
    ours = impl == "fsdp"  # our FSDP: its gathered weights are counted (counters.GatheredWeights)
    x, y = models.random_tokens(args.batch_size, args.context_length, seed=0, device=ctx.device)
    mine = slice(ctx.rank * args.batch_size // ctx.world_size,
                 (ctx.rank + 1) * args.batch_size // ctx.world_size)

    def step(saved=None):
        optimizer.zero_grad(set_to_none=True)
        with saved or contextlib.nullcontext():
            loss = models.lm_loss(wrapper(x[mine]), y[mine])
        loss.backward()
        if hasattr(wrapper, "finish_gradient_synchronization"):
            wrapper.finish_gradient_synchronization()
        if saved is not None:  # gradients are held from here to the step: count them here
            counted["grad"] = state_bytes(param.grad for param in model.parameters())
        optimizer.step()

    seconds = timing.measure(step, ctx.device, warmup=args.warmup, iters=args.steps, barrier=True)
    # the control: the last step's gradients are still there, so the same AdamW step again
    optimizer_seconds = timing.measure(optimizer.step, ctx.device, warmup=0, iters=args.steps,
                                       barrier=True) if impl == "none" else []
    if count:
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)
        gathered = GatheredWeights(wrapper) if ours else contextlib.nullcontext()
        if ours:  # weights, not activations
            saved = SavedActivations(model, exclude_now=lambda: gathered_storage_keys(wrapper))
        else:  # torch's fully_shard puts its gathered weights into the modules while they run
            saved = SavedActivations(model, exclude_now=lambda: {storage_key(p) for p in model.parameters()})
        with CommCounter() as comm, gathered:
            step(saved)
        counted.update(param=state_bytes(model.parameters()), activation=saved.bytes,
                       sent=comm.sent_bytes,  # a sharded optimizer: its inner one holds our state
                       optim=optimizer_state_bytes(getattr(optimizer, "optim", optimizer)))
        if ours:  # the shards held, plus the most full weights gathered at once
            counted["peak"] = counted["param"] + counted["grad"] + counted["optim"] + gathered.peak_bytes
        if ctx.device.type == "cuda":
            counted["cuda_peak"] = torch.cuda.max_memory_allocated(ctx.device)
    del wrapper, optimizer, model
    gc.collect()
    return seconds, optimizer_seconds, counted if count else None


def make_row(ctx, args, impl: str, checkpointing: str, seconds: list[float], counted: dict,
             optimizer_seconds: list[float]) -> dict:
    """The slowest rank's median step; the largest rank's bytes beside the formula."""
    stats = timing.gather_times(seconds)
    kinds = [*KINDS, "cuda_peak"]
    device = ctx.device if ctx.backend == "nccl" else "cpu"  # Gloo: host memory
    largest = torch.tensor([float(counted[kind]) for kind in kinds], dtype=torch.float64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    row = {"backend": ctx.backend, "device": ctx.device.type, "world_size": ctx.world_size,
           "model": args.model, "impl": impl, "checkpointing": checkpointing, "step_ms": stats.median * 1e3}
    for kind, value in zip(kinds, largest.tolist()):
        row[f"{kind}_bytes"] = int(value) if value >= 0 else ""  # -1: not counted here
        if kind in counted["predicted"]:
            row[f"{kind}_bytes_predicted"] = int(counted["predicted"][kind])
    # the control's only; the same on every rank: the gather is a collective
    optimizer_ms = timing.gather_times(optimizer_seconds).median * 1e3 if optimizer_seconds else ""
    params = models.lm_parameter_count(args.model, context_length=args.context_length)
    row.update(step_ms_min=stats.min * 1e3, step_ms_max=stats.max * 1e3, optimizer_ms=optimizer_ms,
               params=params, batch_size=args.batch_size, context_length=args.context_length,
               steps=len(seconds), comm_path=comm_path(ctx), machine=results.machine_name(),
               run_id=results.run_id())
    return row


def comm_path(ctx) -> str:
    """What the step times' communication went through (the CSV's ``comm_path``)."""
    if ctx.backend == "nccl":
        return "nccl"
    path = "GPU -> host memory -> loopback TCP -> GPU" if ctx.device.type == "cuda" else \
        "host memory, loopback TCP"
    return f"gloo host path ({path})"


def run_ledger(ctx, strategies, args, csv_name: str = "sharding.csv") -> list[dict]:
    """Each ``(impl, build)`` with each ``args.checkpointing``; rank 0 upserts each row into
    ``results/<csv_name>`` as it lands (a run stopped at its cap keeps them), then prints the
    table and the targets."""
    if not carries_point_to_point(ctx.backend, ctx.device.type):  # fully_shard runs on DTensor
        ctx.print(f"torch_fsdp: left out on {ctx.backend}/{ctx.device.type}, which cannot carry "
                  "DTensor's coalesced collectives", all_ranks=False)
        strategies = [strategy for strategy in strategies if strategy[0] != "torch_fsdp"]
    cases = [(impl, build, checkpointing) for impl, build in strategies
             for checkpointing in args.checkpointing]
    # The first case timed runs slow: it runs once, untimed, first.
    impl, build, checkpointing = cases[0]
    measure_case(ctx, impl, build, checkpointing == "on", args, count=False)
    seconds = [[] for _ in cases]
    optimizer_seconds = [[] for _ in cases]
    counted = [None] * len(cases)
    rows = [None] * len(cases)
    deadline = step_bench.Deadline(ctx)
    for round_number in range(1, args.rounds + 1):  # interleaved: background load hits every case alike
        for index, (impl, build, checkpointing) in enumerate(cases):
            if not deadline.allows(f"round {round_number}, {impl}, checkpointing {checkpointing}, and after"):
                break
            count = counted[index] is None  # count each case once, in its first round
            case_seconds, case_optimizer, case_counted = measure_case(ctx, impl, build, checkpointing == "on",
                                                                      args, count)
            seconds[index] += case_seconds
            optimizer_seconds[index] += case_optimizer
            counted[index] = counted[index] or case_counted
            median_here = sorted(case_seconds)[len(case_seconds) // 2]
            ctx.print(f"  round {round_number}/{args.rounds} {impl}, checkpointing {checkpointing}: "
                      f"{median_here * 1e3:.1f} ms/step on rank 0", all_ranks=False)
            rows[index] = make_row(ctx, args, impl, checkpointing, seconds[index], counted[index],
                                   optimizer_seconds[index])
            if ctx.is_main:  # the rows so far, their rounds pooled
                path = results.upsert_csv(csv_name, [row for row in rows if row is not None], key=CSV_KEY)
    rows = [row for row in rows if row is not None]  # past make bench's deadline: the ones run
    if ctx.is_main:
        kinds = [*KINDS, "cuda_peak"] if ctx.device.type == "cuda" else KINDS
        table = [{"impl": row["impl"], "ckpt": row["checkpointing"], "step_ms": row["step_ms"],
                  **{f"{kind} MiB": mib(row, kind) for kind in kinds}} for row in rows]
        results.print_table(table, floatfmt=".1f",
                            title=f"\nPer rank, counted (predicted): the largest rank's bytes, the slowest "
                                  f"rank's median step; {args.model} LM, AdamW, {ctx.world_size} ranks, "
                                  f"{ctx.backend}/{ctx.device.type} ({results.machine_name()}):")
        if ctx.backend == "gloo":
            print(f"step_ms: the collectives ran over the {comm_path(ctx)}, not an interconnect: "
                  f"these step times do not rank one strategy against another. The bytes are counts, "
                  f"true on any interconnect.", flush=True)
        print(f"wrote {path}\n" + "\n".join(target_lines(rows)), flush=True)
    return rows


def mib(row: dict, kind: str) -> str:
    """Counted (predicted) MiB; '-' where not counted."""
    got, want = row[f"{kind}_bytes"], row.get(f"{kind}_bytes_predicted")
    return ("-" if got == "" else f"{got / 2**20:.2f}") + ("" if want is None else f" ({want / 2**20:.2f})")


def target_lines(rows: list[dict]) -> list[str]:
    """The ledger's targets, read off one run's rows: measured beside the target."""
    by_case = {(row["impl"], row["checkpointing"]): row for row in rows}
    first_checkpointing = rows[0]["checkpointing"]
    lines = []
    # step time against torch's in the same run: (torch's, target, what differs)
    rivals = {"fsdp": ("torch_fsdp", 1.25, "the same units and sharding over the same ranks; "
                       "ours keeps 1-D tensors whole and the last block gathered through "
                       "backward, torch's shards every tensor (the param and sent columns)"),
              "zero1": ("torch_zero1", 1.10, "the same job: AdamW state sharded, gradients "
                        "all-reduced, parameters sent from their owners")}
    for (impl, checkpointing), row in by_case.items():
        rival, cap, differs = rivals.get(impl, (None, None, None))
        if (rival, checkpointing) in by_case:
            ratio = row["step_ms"] / by_case[rival, checkpointing]["step_ms"]
            lines.append(f"{impl} step / {rival}'s, checkpointing {checkpointing}: {ratio:.2f}x "
                         f"(target <= {cap}x; {differs})")
    # bytes per rank against the textbook formula: (impl, what, formula, bytes per parameter / N)
    for impl, kinds, formula, bytes_per_parameter in (("fsdp", ("param", "grad", "optim"), "16P/N", 16),
                                                      ("zero1", ("optim",), "8P/N", 8),
                                                      ("zero2", ("grad",), "4P/N", 4)):
        row = by_case.get((impl, first_checkpointing))
        if row is None:
            continue
        held = sum(row[kind + "_bytes"] for kind in kinds)
        ratio = held / (bytes_per_parameter * row["params"] / row["world_size"])
        lines.append(f"{impl} {' + '.join(kinds)} bytes per rank / {formula}: {ratio:.4f} (target within 5%)")
    fsdp_row = by_case.get(("fsdp", first_checkpointing))
    ddp_row = by_case.get(("ddp", first_checkpointing))
    if fsdp_row is not None and ddp_row is not None:
        if ddp_row["world_size"] == 1:
            lines.append("bytes sent: none, on one rank (the ratios to the prediction and to "
                         "DDP's need two or more)")
        else:
            to_prediction = fsdp_row["sent_bytes"] / fsdp_row["sent_bytes_predicted"]
            to_ddp = fsdp_row["sent_bytes"] / ddp_row["sent_bytes"]
            lines.append(f"fsdp bytes sent / its prediction: {to_prediction:.4f} (target within "
                         f"5%); / DDP's: {to_ddp:.3f}x (1.5x less the all-gathers of what stays "
                         "gathered for backward)")
    # activation checkpointing
    for (impl, checkpointing), on in by_case.items():
        off = by_case.get((impl, "off"))
        if checkpointing != "on" or off is None:
            continue
        kept = on["activation_bytes"] / off["activation_bytes"]
        slower = on["step_ms"] / off["step_ms"]
        lines.append(f"{impl}: checkpointing keeps {kept:.2f}x the saved activations (target <= 0.50x), "
                     f"at {slower:.2f}x the step time")
    return lines
