"""Not a lesson: stage 07's memory and communication ledger (the table of
``python 07_parallelism/02_fsdp/fsdp.py --bench``): DDP (06), ZeRO-1/2, FSDP and torch's own, each
counted with ``counters.py`` beside the formula, into ``results/sharding.csv``.
"""

from __future__ import annotations

import contextlib
import functools
import gc

import torch
import torch.distributed as dist
import torch.nn as nn

from counters import CommCounter, SavedActivations, optimizer_state_bytes, state_bytes, storage_key


# --------------------------------------------------------------------------- the ledger

CSV_KEY = ["backend", "device", "world_size", "model", "impl", "checkpointing"]
KINDS = ("param", "grad", "optim", "peak", "activation", "sent")


def strategies() -> list[tuple]:
    """The six rows, ``(impl, build)`` with ``build(lm) -> (wrapper, AdamW)``: DDP is stage 06
    at its default bucket size, ZeRO-1 it + ShardedOptimizer, ZeRO-2 Zero2DDP; torch's are
    ZeroRedundancyOptimizer over torch DDP (its default hook, called from Python so that the
    counter sees it) and fully_shard; both FSDPs get the same units: each block, and the root."""
    from common import import_stage
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    ddp, zero = import_stage("06_bucketed_ddp/bucketed_ddp").BucketedDDP, import_stage("07_parallelism/01_zero/zero")
    FSDP, adamw = import_stage("07_parallelism/02_fsdp/fsdp").FSDP, functools.partial(torch.optim.AdamW, lr=1e-4)

    def zero2(lm):
        return zero.Zero2DDP(lm, opt := zero.ShardedOptimizer(lm.parameters(), torch.optim.AdamW, lr=1e-4)), opt

    def torch_zero1(lm):
        (wrapped := nn.parallel.DistributedDataParallel(lm)).register_comm_hook(None, allreduce_hook)
        return wrapped, ZeroRedundancyOptimizer(lm.parameters(), torch.optim.AdamW, lr=1e-4)

    def torch_fsdp(lm):
        mesh = init_device_mesh(lm.lm_head.weight.device.type, (dist.get_world_size(),))
        for block in lm.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(lm, mesh=mesh), adamw(lm.parameters())
    return [("ddp", lambda lm: (ddp(lm), adamw(lm.parameters()))),
            ("zero1", lambda lm: (ddp(lm), zero.ShardedOptimizer(lm.parameters(), torch.optim.AdamW, lr=1e-4))),
            ("zero2", zero2), ("fsdp", lambda lm: (f := FSDP(lm, units=[*lm.blocks, lm]), adamw(f.parameters()))),
            ("torch_zero1", torch_zero1), ("torch_fsdp", torch_fsdp)]


def predicted_bytes(impl: str, lm: nn.Module, world_size: int) -> dict[str, float]:
    """Per rank, from the LM's shapes (before any sharding): float32, AdamW's two moments.

    Replicas, P parameters: weights 4P, gradients 4P, moments 8P, each divided by N where
    ``impl`` shards it (DDP 16P, ZeRO-1 8P + 8P/N, ZeRO-2 4P + 12P/N). Sent: one all-reduce,
    2(N-1)/N 4P; ZeRO-1 built on DDP's all-reduce also broadcasts the parameters: 1.5x that.
    FSDP: a sharded tensor is padded to N ceil(rows/N) rows (W bytes in all) and each rank
    holds W/N; ours keeps 1-D parameters whole (R bytes; torch's shards them too): weights
    and gradients W/N + R each, moments twice that. Each unit is all-gathered for forward and
    again for backward, except the K bytes kept gathered in between (ours: the root and the
    last block, which end forward last; torch's: the root), and reduce-scattered once, and R
    is all-reduced: sent (N-1)/N (3W - K) + 2(N-1)/N R. Peak (ours): the shards + K."""
    n, p = world_size, 4 * sum(t.numel() for t in lm.parameters())
    if "fsdp" not in impl:
        div = {"zero1": ("optim",), "zero2": ("grad", "optim")}.get(impl.replace("torch_", ""), ())
        out = {k: v / n if k in div else v for k, v in (("param", p), ("grad", p), ("optim", 2 * p))}
        return {**out, "sent": 2 * (n - 1) / n * p * (1.5 if "zero1" in impl else 1)}
    ours = impl == "fsdp"
    padded = {id(t): 4 * -(-t.shape[0] // n) * n * t[0].numel() for t in lm.parameters()
              if t.dim() >= 2 or not ours}  # full bytes, padded
    kept = [*(lm.blocks[-1].parameters() if ours else ()),
            *(t for name, t in lm.named_parameters() if not name.startswith("blocks."))]
    W, K = sum(padded.values()), sum(padded.get(id(t), 0) for t in kept)
    R = p - 4 * sum(t.numel() for t in lm.parameters() if id(t) in padded)
    held = W / n + R
    return {"param": held, "grad": held, "optim": 2 * held, **({"peak": 4 * held + K} if ours else {}),
            "sent": (n - 1) / n * (3 * W - K) + 2 * (n - 1) / n * R}


def add_ledger_args(parser) -> None:
    """The ledger's flags. The defaults are sized for ``make bench`` on a 2-core CPU; the LM is
    ``course``: the tiny LM's saved activations are mostly its vocabulary logits, which
    checkpointing per block cannot touch (the course LM's blocks dominate)."""
    from common import launch, models
    g = parser.add_argument_group("memory and communication ledger (--bench, --profile)")
    g.add_argument("--bench", action="store_true", help="the ledger of DDP (06), ZeRO-1/2, FSDP "
                   "and torch's: bytes and time per step to results/sharding.csv")
    g.add_argument("--model", choices=list(models.PRESETS), default="course", help="LM preset")
    g.add_argument("--batch-size", type=launch.positive_int, default=4,
                   help="GLOBAL batch (sequences per step), split evenly across ranks")
    g.add_argument("--context-length", type=launch.positive_int, default=32, help="tokens")
    g.add_argument("--steps", type=launch.positive_int, default=5, help="timed steps a round")
    g.add_argument("--warmup", type=launch.non_negative_int, default=1, help="untimed first")
    g.add_argument("--rounds", type=launch.positive_int, default=1, help="run all cases this many "
                   "times, interleaved (background load hits every case alike); pool the steps")
    g.add_argument("--checkpointing", type=launch.choice_list(["off", "on"]), default="off,on",
                   help="activation checkpointing per Transformer block")


def _case(ctx, impl: str, build, checkpointing: bool, args, count: bool):
    """Time one strategy on a fresh LM (seed 0); with ``count``, count one more step."""
    from common import models, timing
    dev, n, rank = ctx.device, ctx.world_size, ctx.rank
    torch.manual_seed(0)
    model = models.TransformerLM(args.model, context_length=args.context_length,
                                 checkpoint_activations=checkpointing).to(dev)
    counted = {"predicted": predicted_bytes(impl, model, n), "peak": -1, "cuda_peak": -1}
    wrapper, optimizer = build(model)
    ours = hasattr(wrapper, "gathered_storage_keys")  # our FSDP
    x, y = models.random_tokens(args.batch_size, args.context_length, seed=0, device=dev)
    mine = slice(rank * args.batch_size // n, (rank + 1) * args.batch_size // n)

    def step(saved=None):
        optimizer.zero_grad(set_to_none=True)
        with saved or contextlib.nullcontext():
            loss = models.lm_loss(wrapper(x[mine]), y[mine])
        loss.backward()
        getattr(wrapper, "finish_gradient_synchronization", lambda: None)()
        if saved:  # gradients are held from here to the step: count them here
            counted["grad"] = state_bytes(p.grad for p in model.parameters())
        optimizer.step()

    seconds = timing.measure(step, dev, warmup=args.warmup, iters=args.steps, barrier=True)
    if count:  # one more step: what it saves for backward, sends, holds, and its peak
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        if ours:
            wrapper.peak_gathered_bytes = wrapper.gathered_bytes
        # weights are not activations: our FSDP names the ones it gathered; torch's fully_shard
        # puts its gathered weights into the modules while they run
        now = wrapper.gathered_storage_keys if ours else lambda: set(map(storage_key, model.parameters()))
        with CommCounter() as comm:
            step(saved := SavedActivations(model, exclude_now=now))
        counted.update(param=state_bytes(model.parameters()), activation=saved.bytes, sent=comm.sent_bytes,
                       optim=optimizer_state_bytes(getattr(optimizer, "optim", optimizer)))
        if ours:  # the shards held, plus the most full weights gathered at once
            counted["peak"] = counted["param"] + counted["grad"] + counted["optim"] + wrapper.peak_gathered_bytes
        if dev.type == "cuda":
            counted["cuda_peak"] = torch.cuda.max_memory_allocated(dev)
    del wrapper, optimizer, model
    gc.collect()
    return seconds, counted if count else None


def _row(ctx, args, impl: str, checkpointing: str, seconds: list[float], counted: dict) -> dict:
    """The slowest rank's median step time; the largest rank's bytes, beside the formula."""
    from common import models, results, timing
    stats, kinds = timing.gather_times(seconds), [*KINDS, "cuda_peak"]
    largest = torch.tensor([float(counted[k]) for k in kinds], dtype=torch.float64,
                           device=ctx.device if ctx.backend == "nccl" else "cpu")
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    row = {"backend": ctx.backend, "device": ctx.device.type, "world_size": ctx.world_size,
           "model": args.model, "impl": impl, "checkpointing": checkpointing, "step_ms": stats.median * 1e3}
    for k, got in zip(kinds, largest.tolist()):  # (-1: not counted here)
        row[f"{k}_bytes"] = int(got) if got >= 0 else ""
        if k in counted["predicted"]:
            row[f"{k}_bytes_predicted"] = int(counted["predicted"][k])
    return {**row, "step_ms_min": stats.min * 1e3, "step_ms_max": stats.max * 1e3,
            "params": models.lm_parameter_count(args.model, context_length=args.context_length),
            "batch_size": args.batch_size, "context_length": args.context_length, "steps": len(seconds),
            "machine": results.machine_name(), "run_id": results.run_id()}


def run_ledger(ctx, strategies, args, csv_name: str = "sharding.csv") -> list[dict]:
    """Each ``(impl, build)`` of ``strategies`` (see :func:`strategies`) with each
    ``args.checkpointing``, in one run. Rank 0 upserts the rows into ``results/<csv_name>`` after
    every round (a run stopped later keeps them), then prints them and the targets."""
    from common import results
    cases = [(impl, build, ck) for impl, build in strategies for ck in args.checkpointing]
    seconds, counted = [[] for _ in cases], [None] * len(cases)
    for round_ in range(args.rounds):  # interleaved, so background load hits every case alike
        for i, (impl, build, ck) in enumerate(cases):
            s, c = _case(ctx, impl, build, ck == "on", args, count=counted[i] is None)
            seconds[i], counted[i] = seconds[i] + s, counted[i] or c
            ctx.print(f"  round {round_ + 1}/{args.rounds} {impl}, checkpointing {ck}: "
                      f"{sorted(s)[len(s) // 2] * 1e3:.1f} ms/step on rank 0", all_ranks=False)
        rows = [_row(ctx, args, impl, ck, s, c) for (impl, _, ck), s, c in zip(cases, seconds, counted)]
        if ctx.is_main:
            path = results.upsert_csv(csv_name, rows, key=CSV_KEY)
    if ctx.is_main:
        def mib(r, k):  # "counted (predicted)"
            got, want = r[f"{k}_bytes"], r.get(f"{k}_bytes_predicted")
            return ("-" if got == "" else f"{got / 2**20:.2f}") + (f" ({want / 2**20:.2f})" if want else "")
        kinds = [*KINDS, *(["cuda_peak"] if ctx.device.type == "cuda" else [])]
        results.print_table([{"impl": r["impl"], "ckpt": r["checkpointing"], "step_ms": r["step_ms"],
                              **{f"{k} MiB": mib(r, k) for k in kinds}} for r in rows], floatfmt=".1f",
                            title=f"\nPer rank, counted (predicted): the largest rank's bytes, the slowest "
                                  f"rank's median step; {args.model} LM, AdamW, {ctx.world_size} ranks "
                                  f"({results.machine_name()}):")
        print(f"wrote {path}\n" + "\n".join(target_lines(rows)), flush=True)
    return rows


def target_lines(rows: list[dict]) -> list[str]:
    """The issues' targets, read off one run's rows: measured beside the target."""
    by, first, lines = {(r["impl"], r["checkpointing"]): r for r in rows}, rows[0]["checkpointing"], []
    for (a, ck), r in by.items():  # step time against torch's, in the same run
        b, cap = {"fsdp": ("torch_fsdp", 1.25), "zero1": ("torch_zero1", 1.10)}.get(a, (None, 0))
        if (b, ck) in by:
            lines.append(f"{a} step / {b}'s, checkpointing {ck}: {r['step_ms'] / by[b, ck]['step_ms']:.2f}x "
                         f"(target <= {cap}x)")
    for impl, kinds, formula, per_p in (("fsdp", ("param", "grad", "optim"), "16P/N", 16),
                                        ("zero1", ("optim",), "8P/N", 8), ("zero2", ("grad",), "4P/N", 4)):
        if r := by.get((impl, first)):  # bytes per rank against the textbook formula
            got = sum(r[k + "_bytes"] for k in kinds) / (per_p * r["params"] / r["world_size"])
            lines.append(f"{impl} {' + '.join(kinds)} bytes per rank / {formula}: {got:.4f} (target within 5%)")
    if (f := by.get(("fsdp", first))) and (d := by.get(("ddp", first))):
        lines.append(f"fsdp bytes sent / its prediction: {f['sent_bytes'] / f['sent_bytes_predicted']:.4f} "
                     f"(target within 5%); / DDP's: {f['sent_bytes'] / d['sent_bytes']:.3f}x (1.5x less the "
                     "all-gathers of what stays gathered for backward)")
    for (impl, ck), on in by.items():  # activation checkpointing
        if ck == "on" and (off := by.get((impl, "off"))):
            lines.append(f"{impl}: checkpointing keeps {on['activation_bytes'] / off['activation_bytes']:.2f}x "
                         f"the saved activations (target <= 0.50x), at {on['step_ms'] / off['step_ms']:.2f}x "
                         "the step time")
    return lines
