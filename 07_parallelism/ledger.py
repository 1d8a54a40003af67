"""Counting what a parallel strategy holds and sends, and stage 07's table of it.

Each counter reads the tensors and calls themselves, never a formula, so a table can set
"counted" beside "predicted" and a wrong implementation shows up as a gap. Bytes: each storage
once (:func:`state_bytes`: tied weights and views of one flat buffer count once; a DTensor its
shard). Saved activations: :class:`SavedActivations` (``saved_tensors_hooks``). Bytes sent:
:class:`CommCounter`, every ``torch.distributed`` call made from Python (ours, torch's
``ZeroRedundancyOptimizer`` and ``fully_shard``), as a ring would send them (torch's C++ DDP
reducer is not Python: give it a communication hook that all-reduces from Python).
:func:`run_ledger` times and counts strategies on the LM into ``results/sharding.csv``.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint

from common import launch, models, results, timing


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard


def storage_key(t: torch.Tensor) -> tuple:
    """Identifies the memory behind ``t``: views of one storage share it."""
    return (t.device, _local(t).untyped_storage().data_ptr())


def state_bytes(tensors) -> int:
    """Bytes held by ``tensors`` (None skipped), each distinct storage counted once."""
    seen = {storage_key(t): _local(t).untyped_storage().nbytes() for t in tensors
            if t is not None}
    return sum(seen.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` (AdamW: exp_avg, exp_avg_sq, step)."""
    return state_bytes(v for per_param in optimizer.state.values() for v in per_param.values()
                       if isinstance(v, torch.Tensor))


class SavedActivations:
    """``with SavedActivations(model) as saved: loss = model(x)`` -> ``saved.bytes``.

    Each storage once, at its size when saved; ``model``'s parameters (and ``exclude``, a set
    of :func:`storage_key`) are weights, not activations. Inside a non-reentrant checkpoint
    autograd saves nothing; the region's inputs stay alive and are counted on entry.
    """

    def __init__(self, model: nn.Module | None = None, exclude=()):
        self.exclude = set(exclude) | {storage_key(p) for p in (model.parameters() if model
                                                                 else ())}
        self.seen: dict[tuple, int] = {}

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())

    def _count(self, t: torch.Tensor) -> None:
        if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
            if storage_key(t) not in self.exclude:
                self.seen.setdefault(storage_key(t), _local(t).untyped_storage().nbytes())

    def __enter__(self):
        def pack(t):
            self._count(t)
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        self._checkpoint = torch.utils.checkpoint.checkpoint

        def counted_checkpoint(fn, *args, **kwargs):
            for a in args:
                self._count(a)
            return self._checkpoint(fn, *args, **kwargs)

        torch.utils.checkpoint.checkpoint = counted_checkpoint
        return self

    def __exit__(self, *exc):
        torch.utils.checkpoint.checkpoint = self._checkpoint
        self._hooks.__exit__(*exc)
        return False


def ring_send_bytes(op: str, payload: int, world_size: int) -> float:
    """Bytes one rank sends for a collective of ``payload`` bytes run as a ring of n ranks:
    all_reduce (reduce-scatter + all-gather) 2(n-1)/n N; all_gather, reduce_scatter (N the
    full tensor) and a pipelined chain broadcast or reduce (averaged over ranks) (n-1)/n N;
    send N."""
    n = world_size
    if op == "send" or n == 1:
        return float(payload) if op == "send" else 0.0
    return (2 if op == "all_reduce" else 1) * (n - 1) / n * payload


# name on torch.distributed -> (kind, the argument whose size is the payload)
_PAYLOAD = {
    "all_reduce": ("all_reduce", "tensor"), "all_gather": ("all_gather", "tensor_list"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"), "broadcast": ("broadcast", "tensor"),
    "reduce": ("reduce", "tensor"), "send": ("send", "tensor"), "isend": ("send", "tensor"),
}


def _nbytes(t) -> int:
    return sum(map(_nbytes, t)) if isinstance(t, (list, tuple)) else t.numel() * t.element_size()


class CommCounter:
    """``with CommCounter() as comm: ...``; then ``comm.calls``, ``sent_bytes``, ``by_label``.

    Each call: op (all_reduce, all_gather, reduce_scatter, broadcast, reduce, send), payload
    bytes, the bytes this rank sends under :func:`ring_send_bytes`, and the label active then
    (``with comm.label("fc1 backward"): ...``, or set ``comm.current`` from a hook).
    Arguments are read by name, positional or keyword.
    """

    def __init__(self):
        self.calls: list[dict] = []
        self.current = ""

    @contextlib.contextmanager
    def label(self, name: str):
        previous, self.current = self.current, name
        try:
            yield
        finally:
            self.current = previous

    @property
    def sent_bytes(self) -> float:
        return sum(c["sent_bytes"] for c in self.calls)

    @property
    def by_label(self) -> dict[str, dict]:
        """label -> {"ops": [op, ...], "payload_bytes": ..., "sent_bytes": ...}."""
        out = defaultdict(lambda: {"ops": [], "payload_bytes": 0, "sent_bytes": 0.0})
        for c in self.calls:
            out[c["label"]]["ops"].append(c["op"])
            out[c["label"]]["payload_bytes"] += c["payload_bytes"]
            out[c["label"]]["sent_bytes"] += c["sent_bytes"]
        return dict(out)

    def _wrap(self, name: str, original):
        kind, arg = _PAYLOAD[name]
        signature = inspect.signature(original)

        def counted(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            payload, n = _nbytes(bound[arg]), dist.get_world_size(bound.get("group"))
            self.calls.append({"op": kind, "payload_bytes": payload, "label": self.current,
                               "sent_bytes": ring_send_bytes(kind, payload, n)})
            return original(*args, **kwargs)

        return counted

    def __enter__(self):
        self._originals = {name: getattr(dist, name) for name in _PAYLOAD if hasattr(dist, name)}
        for name, original in self._originals.items():
            setattr(dist, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)
        return False


# --------------------------------------------------------------------------- the ledger

CSV_KEY = ["backend", "device", "world_size", "model", "impl", "checkpointing"]
SHARDED = {"ddp": (), "zero1": ("optim",), "zero2": ("grad", "optim"),
           "fsdp": ("param", "grad", "optim")}  # what each strategy divides by N
SHARDED.update(torch_zero1=SHARDED["zero1"], torch_fsdp=SHARDED["fsdp"])
KINDS = ("param", "grad", "optim", "peak", "activation", "sent")


def predicted_bytes(impl: str, params: int, world_size: int) -> dict[str, float]:
    """Per rank, P float32 parameters, AdamW (two float32 moments), N ranks: weights 4P,
    gradients 4P, optimizer state 8P, each divided by N where ``impl`` shards it (DDP 16P,
    ZeRO-1 8P + 8P/N, ZeRO-2 4P + 12P/N, FSDP 16P/N); sent per step one all-reduce's volume
    2(N-1)/N 4P, FSDP 1.5x that (weights gathered for forward and again for backward)."""
    n, w = world_size, 4 * params
    out = {k: v / n if k in SHARDED[impl] else v for k, v in
           {"param": w, "grad": w, "optim": 2 * w}.items()}
    return {**out, "sent": 2 * (n - 1) / n * w * (1.5 if "fsdp" in impl else 1.0)}


def add_ledger_args(parser, checkpointing: str = "off"):
    """The ledger's flags (flag types from common.launch: bad values exit 2 with one line)."""
    g = parser.add_argument_group("memory and communication ledger (--bench)")
    g.add_argument("--model", choices=list(models.PRESETS), default="tiny", help="LM preset")
    g.add_argument("--batch-size", type=launch.positive_int, default=8,
                   help="GLOBAL batch (sequences per step), split evenly across ranks")
    g.add_argument("--context-length", type=launch.positive_int, default=64, help="tokens")
    g.add_argument("--steps", type=launch.positive_int, default=10, help="timed steps a round")
    g.add_argument("--warmup", type=launch.non_negative_int, default=3, help="untimed first")
    g.add_argument("--rounds", type=launch.positive_int, default=3,
                   help="run all cases this many times, interleaved, and pool the timed steps "
                        "(background load then hits every case alike)")
    g.add_argument("--checkpointing", type=launch.choice_list(["off", "on"]),
                   default=checkpointing, help="activation checkpointing per Transformer block")


def _case(ctx, build, checkpointing: bool, args, count: bool):
    """Time one strategy on a fresh LM (seed 0); with ``count``, count one more step."""
    dev, n, rank = ctx.device, ctx.world_size, ctx.rank
    torch.manual_seed(0)
    model = models.TransformerLM(args.model, context_length=args.context_length,
                                 checkpoint_activations=checkpointing).to(dev)
    counted = {"params": sum(p.numel() for p in model.parameters())}
    wrapper, optimizer = build(model)
    finish = getattr(wrapper, "finish_gradient_synchronization", lambda: None)
    x, y = models.random_tokens(args.batch_size, args.context_length, seed=0, device=dev)
    mine = slice(rank * args.batch_size // n, (rank + 1) * args.batch_size // n)

    def step(saved=None):
        optimizer.zero_grad(set_to_none=True)
        with saved or contextlib.nullcontext():
            loss = models.lm_loss(wrapper(x[mine]), y[mine])
        loss.backward()
        finish()
        if saved:  # gradients are held from here to the step: count them here
            counted["grad"] = state_bytes(p.grad for p in model.parameters())
        optimizer.step()

    seconds = timing.measure(step, dev, warmup=args.warmup, iters=args.steps, barrier=True)
    if count:  # one more step: what it saves for backward, sends, and holds (peak: on a GPU)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        with CommCounter() as comm:
            step(saved := SavedActivations(model))
        counted.update(param=state_bytes(model.parameters()), activation=saved.bytes,
                       optim=optimizer_state_bytes(getattr(optimizer, "optim", optimizer)),
                       sent=comm.sent_bytes, peak=torch.cuda.max_memory_allocated(dev)
                       if dev.type == "cuda" else getattr(wrapper, "peak_bytes", -1))
    del wrapper, optimizer, model
    gc.collect()
    return seconds, counted if count else None


def _row(ctx, args, impl: str, checkpointing: bool, seconds: list[float], counted: dict):
    """The slowest rank's median step time; the largest rank's bytes, beside the formula."""
    stats, want = timing.gather_times(seconds), predicted_bytes(impl, counted["params"],
                                                                ctx.world_size)
    largest = torch.tensor([float(counted[k]) for k in KINDS], dtype=torch.float64,
                           device=ctx.device if ctx.backend == "nccl" else "cpu")
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    row = {"backend": ctx.backend, "device": ctx.device.type, "world_size": ctx.world_size,
           "model": args.model, "impl": impl, "checkpointing": checkpointing,
           "step_ms": stats.median * 1e3}
    for k, got in zip(KINDS, largest.tolist()):  # (-1: not counted here)
        row.update({f"{k}_bytes": int(got) if got >= 0 else ""},
                   **({f"{k}_bytes_predicted": int(want[k])} if k in want else {}))
    return {**row, "step_ms_min": stats.min * 1e3, "step_ms_max": stats.max * 1e3,
            "params": counted["params"], "batch_size": args.batch_size, "steps": len(seconds),
            "context_length": args.context_length, "machine": results.machine_name(),
            "run_id": results.run_id()}


def run_ledger(ctx, strategies, args, csv_name: str = "sharding.csv") -> list[dict]:
    """Each ``(impl, build)`` of ``strategies``, with each ``args.checkpointing``, in one run.

    ``build(model) -> (wrapper, optimizer)``, called in the workers; ``wrapper`` follows the
    ``finish_gradient_synchronization()`` convention (torch's need none) and may say its
    ``peak_bytes``; a sharded optimizer's own state is read from its ``.optim``. Rank 0 prints
    the table and upserts the rows into ``results/<csv_name>``.
    """
    cases = [(impl, build, on == "on") for impl, build in strategies for on in args.checkpointing]
    seconds, counted = [[] for _ in cases], [None] * len(cases)
    for round_ in range(args.rounds):  # interleaved, so background load hits every case alike
        for i, (impl, build, checkpointing) in enumerate(cases):
            s, c = _case(ctx, build, checkpointing, args, count=counted[i] is None)
            seconds[i], counted[i] = seconds[i] + s, counted[i] or c
            ctx.print(f"  round {round_ + 1}/{args.rounds} {impl}{' checkpointed' * checkpointing}"
                      f": {sorted(s)[len(s) // 2] * 1e3:.1f} ms/step on rank 0", all_ranks=False)
        rows = [_row(ctx, args, impl, ck, s, c)
                for (impl, _, ck), s, c in zip(cases, seconds, counted)]
        if ctx.is_main:  # after every round: a run stopped later (Ctrl-C) keeps these rows
            path = results.upsert_csv(csv_name, rows, key=CSV_KEY)
    if ctx.is_main:
        def mib(r, k):  # "counted (predicted)"
            text = f"{r[k + '_bytes'] / 2**20:.2f}" if r[k + "_bytes"] != "" else "-"
            return text + (f" ({r[k + '_bytes_predicted'] / 2**20:.2f})"
                           if k + "_bytes_predicted" in r else "")
        results.print_table([{"impl": r["impl"], "checkpointing": r["checkpointing"],
                              "step_ms": r["step_ms"], **{f"{k} MiB": mib(r, k) for k in KINDS}}
                             for r in rows], floatfmt=".1f", title=(
            f"\nPer rank, counted (predicted): the largest rank's bytes, the slowest rank's median "
            f"step, {args.model} LM, AdamW ({results.machine_name()}):"))
        print(f"wrote {path}", flush=True)
    return rows
