"""Stage 07: ZeRO-1 and ZeRO-2 (Rajbhandari et al., 2020): each parameter gets one owner rank
(dealt largest first: no rank ends more than one parameter above the mean). ZeRO-1,
``ShardedOptimizer(params, torch.optim.AdamW, lr=...)``: only the owner keeps the parameter's
optimizer state and updates it, then broadcasts it; step it once every rank has the mean
gradients of what it owns (behind any DDP of 03-06). ZeRO-2, ``Zero2DDP(model, optimizer)``,
used as 05/06: each gradient bucket is reduced to its owner and freed elsewhere. Accumulation:
under ``no_sync()`` (full-size local gradients until the last backward: 4P bytes held again), or
synchronise every micro-batch (k times the traffic). Float32 AdamW, P parameters, N ranks, bytes
per rank: DDP 16P, ZeRO-1 8P + 8P/N, ZeRO-2 4P + 12P/N. Torch alone: copy this file and
``from zero import ShardedOptimizer, Zero2DDP``.

    python 07_parallelism/01_zero/zero.py --world-size 3    # checks against one process
    torchrun --nproc-per-node=2 07_parallelism/01_zero/zero.py
    python 07_parallelism/01_zero/zero.py --bench           # the ledger's ZeRO rows (fsdp.py: all six)
"""

from __future__ import annotations

import contextlib
import math
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

# --------------------------------------------------------------------------- ZeRO-1


def _options(group: dict) -> dict:  # a param group without its parameters
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _global(group, rank: int) -> int:  # collectives take global ranks
    return rank if group is None else dist.get_global_rank(group, rank)


def assign_owners(params, loads: list[int]) -> dict:
    """Largest first, each parameter to the rank with the fewest bytes so far (ties: the lowest)."""
    owners = {}
    for p in sorted(params, key=lambda p: -p.numel() * p.element_size() * p.requires_grad):
        owners[p] = rank = min(range(len(loads)), key=loads.__getitem__)
        loads[rank] += p.numel() * p.element_size() * p.requires_grad  # frozen ones weigh nothing
    return owners


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1: ``.optim``, an ``optimizer_cls`` over the parameters this rank owns, holds the only
    state; ``param_groups`` are a plain one's (schedulers work), copied into it at each step()."""

    def __init__(self, params, optimizer_cls, process_group=None, **kwargs):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"ShardedOptimizer: optimizer_cls must be a torch.optim.Optimizer subclass such "
                            f"as torch.optim.AdamW, got {str(optimizer_cls).splitlines()[0]!r}")
        if torch.is_tensor(params):
            raise TypeError("ShardedOptimizer: params must be an iterable of tensors or param groups, got "
                            "one tensor; pass [tensor]")
        if not (params := list(params)):
            raise ValueError("ShardedOptimizer: got an empty parameter list; pass the model's parameters "
                             "(or param groups)")
        self.process_group, self.rank = process_group, dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.owner, self._loads, self.optim, self._consolidated = {}, [0] * self.world_size, None, None
        super().__init__(params, dict(kwargs))  # calls add_param_group for each group
        self.optim = optimizer_cls([self._owned(g) for g in self.param_groups], **kwargs)
        self.defaults, self.state = self.optim.defaults, self.optim.state  # state: this shard
        for group in self.param_groups:  # every option filled in, as a plain one's groups
            group.update({**self.defaults, **group})

    def _owned(self, group: dict) -> dict:
        return {**_options(group), "params": [p for p in group["params"] if self.owner[p] == self.rank]}

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self.owner.update(assign_owners(self.param_groups[-1]["params"], self._loads))
        if self.optim is not None:  # after __init__: the inner optimizer gets its share too
            self.optim.add_param_group(self._owned(self.param_groups[-1]))

    def step(self, closure=None):
        for group, inner in zip(self.param_groups, self.optim.param_groups):
            inner.update(_options(group))
        loss = self.optim.step(closure)  # the owned parameters, from the owned state
        self._consolidated = None
        self.broadcast_parameters()
        return loss

    @torch.no_grad()
    def broadcast_parameters(self) -> None:
        """Every trainable parameter from its owner: one flat buffer, one broadcast per owner."""
        flats = {}  # (owner, dtype, device) -> parameters in group order
        for p in (p for g in self.param_groups for p in g["params"] if p.requires_grad):
            flats.setdefault((self.owner[p], p.dtype, p.device), []).append(p)
        for (owner, dtype, device), params in sorted(flats.items(), key=lambda kv: kv[0][0]):
            flat = (torch.cat([p.reshape(-1) for p in params]) if owner == self.rank else
                    torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device))
            dist.broadcast(flat, _global(self.process_group, owner), self.process_group)
            for p, value in zip(params, flat.split([p.numel() for p in params]) if owner != self.rank else ()):
                p.copy_(value.view_as(p))

    def consolidate_state_dict(self, to: int = 0) -> None:  # a checkpoint
        """Gather every rank's shard of the state on rank ``to`` (call on every rank); its
        ``state_dict()`` is then what a plain ``optimizer_cls`` would save."""
        index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        mine = {index[p]: {k: v.to("cpu", copy=True) if torch.is_tensor(v) else v
                           for k, v in s.items()} for p, s in self.optim.state.items()}
        shards = [None] * self.world_size if self.rank == to else None
        dist.gather_object(mine, shards, _global(self.process_group, to), self.process_group)
        if self.rank == to:
            groups = [{**g, "params": [index[p] for p in g["params"]]} for g in self.param_groups]
            self._consolidated = {"state": dict(sorted(kv for shard in shards for kv in shard.items())),
                                  "param_groups": groups}

    def state_dict(self) -> dict:
        if self._consolidated is None:
            raise RuntimeError("ShardedOptimizer.state_dict(): each rank holds a shard; call "
                               "consolidate_state_dict(to=r) on every rank, then this on rank r")
        return self._consolidated

# --------------------------------------------------------------------------- ZeRO-2


def broadcast_module_state(module: nn.Module, group=None) -> None:  # 03-06's, shortened
    """Every rank starts from rank 0's parameters and buffers (detached: autograd stays out)."""
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.detach(), src=_global(group, 0), group=group)


def _weak(obj, method: str, *bound):  # a hook that does not keep obj alive (05's weak_hook):
    ref = weakref.ref(obj)  # autograd holds hooks in C++, where Python's GC cannot see cycles
    return lambda *a: None if ref() is None else getattr(ref(), method)(*bound, *a)


class _Bucket:  # one owner's gradients
    def __init__(self, owner: int, params: list[torch.Tensor]):
        self.owner, self.params, self.buffer, self.views = owner, params, None, []
        self.had = [False] * len(params)  # "this rank had a gradient for it", this step
        self.pending, self.work = len(params), None

    def view(self, slot: int) -> torch.Tensor:
        if self.buffer is None:  # one flat buffer, from the first gradient to the reduce's end
            sizes = [p.numel() for p in self.params]
            self.buffer = self.params[0].new_empty(sum(sizes))
            self.views = [v.view_as(p) for v, p in zip(self.buffer.split(sizes), self.params)]
        return self.views[slot]


def owner_buckets(params: list[torch.Tensor], owner: dict, bucket_size_mb: float | None):
    """Stage 06's rule, per owner (and dtype, device): at most ``bucket_size_mb`` MiB, filled in
    reverse registration order, sorted by their last parameter: the order they complete in."""
    cap, open_, closed = math.inf if bucket_size_mb is None else bucket_size_mb * 2**20, {}, []
    for position, p in enumerate(reversed(params)):
        key, nbytes = (owner[p], p.dtype, p.device), p.numel() * p.element_size()
        if key in open_ and open_[key]["bytes"] + nbytes > cap:
            closed.append(open_.pop(key))
        b = open_.setdefault(key, {"owner": owner[p], "params": [], "bytes": 0})
        b["params"].append(p)
        b["bytes"], b["last"] = b["bytes"] + nbytes, position
    closed = sorted([*closed, *open_.values()], key=lambda b: b["last"])
    return [_Bucket(b["owner"], b["params"]) for b in closed]


class Zero2DDP(nn.Module):
    """ZeRO-2: after ``finish_gradient_synchronization()`` each rank holds the mean gradients
    of the parameters it owns in ``optimizer`` (a :class:`ShardedOptimizer`), and no others."""

    def __init__(self, module: nn.Module, optimizer: ShardedOptimizer, bucket_size_mb: float | None = 25.0):
        super().__init__()
        if not isinstance(optimizer, ShardedOptimizer):
            raise TypeError(f"Zero2DDP: optimizer must be the ShardedOptimizer over the module's "
                            f"parameters, got {type(optimizer).__name__}")
        if bucket_size_mb is not None and not (type(bucket_size_mb) in (int, float) and 0 < bucket_size_mb < math.inf):
            raise ValueError(f"Zero2DDP: bucket_size_mb must be a positive number of MiB or None (one "
                             f"bucket per owner), got {bucket_size_mb!r}")
        if not (params := [p for p in module.parameters() if p.requires_grad]):
            raise ValueError("Zero2DDP: the module has no parameters that require grad")
        if unowned := [n for n, p in module.named_parameters() if p.requires_grad and p not in optimizer.owner]:
            raise ValueError(f"Zero2DDP: {', '.join(unowned)} require grad but are in no group of the "
                             f"ShardedOptimizer: add them there, or freeze them")
        self.module, self.process_group = module, optimizer.process_group
        self.rank, self.world_size = optimizer.rank, optimizer.world_size
        broadcast_module_state(module, self.process_group)
        self.buckets = owner_buckets(params, optimizer.owner, bucket_size_mb)
        for b, bucket in enumerate(self.buckets):
            for slot, p in enumerate(bucket.params):
                p.register_hook(_weak(self, "_set_aside", b, slot))  # before accumulation
                p.register_post_accumulate_grad_hook(_weak(self, "_on_grad_ready", b, slot))
        self._flag_device = params[0].device if dist.get_backend(self.process_group) == "nccl" else "cpu"
        self._require_sync, self._next = True, 0
        self._averaged = weakref.WeakValueDictionary()  # id(param) -> the .grad finish gave it
        self._kept = {}  # param -> that average, set aside while a later backward runs

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):  # accumulate full-size local gradients; the next synced backward reduces
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    def _set_aside(self, b: int, slot: int, *_) -> None:
        """The trap: autograd would add the next gradient to the owner's average, and reducing
        the sum would count that average again. Keep it apart until ``finish`` adds it back."""
        p = self.buckets[b].params[slot]
        if p.grad is not None and self._averaged.get(id(p)) is p.grad:
            self._kept[p], p.grad = p.grad, None

    def _fill(self, b: int, slot: int) -> None:
        """This rank's share of the mean (its gradient / N, or zeros) into the bucket."""
        bucket, p = self.buckets[b], self.buckets[b].params[slot]
        self._set_aside(b, slot)
        bucket.had[slot], view = p.grad is not None, bucket.view(slot)
        torch.div(p.grad, self.world_size, out=view) if p.grad is not None else view.zero_()  # the reduce sums
        p.grad = None  # freed on every rank: the bucket holds it now

    def _on_grad_ready(self, b: int, slot: int, p: torch.Tensor) -> None:
        if self._require_sync:
            self._fill(b, slot)
            self.buckets[b].pending -= 1
            while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
                self._launch()  # in index order on every rank, whatever order gradients come in

    def _launch(self) -> None:
        bucket, self._next = self.buckets[self._next], self._next + 1
        bucket.work = dist.reduce(bucket.buffer, _global(self.process_group, bucket.owner),
                                  group=self.process_group, async_op=True)
        if self._next > 2:  # at most two reduces in flight; a reduced bucket that is not ours
            done = self.buckets[self._next - 3]  # is freed at once, not at the end of backward
            done.work.wait()
            if done.owner != self.rank:
                done.buffer, done.views = None, []

    def finish_gradient_synchronization(self) -> None:
        """Reduce what backward did not, wait, and give each owner its averaged gradients."""
        if not self._require_sync:
            return
        while self._next < len(self.buckets):
            for slot, had in enumerate(self.buckets[self._next].had):
                if not had:  # no gradient in this backward: what no_sync() left, else zeros
                    self._fill(self._next, slot)
            self._launch()
        flags = torch.tensor([h for b in self.buckets for h in b.had], dtype=torch.int32,
                             device=self._flag_device)
        dist.all_reduce(flags, group=self.process_group)  # no rank had one: .grad stays None
        anyone_had = iter(flags.tolist())
        for bucket in self.buckets:
            bucket.work.wait()
            for slot, p in enumerate(bucket.params):
                p.grad = self._kept.pop(p, None)  # None, unless an earlier average was set aside
                if next(anyone_had) and bucket.owner == self.rank:  # the owner adds the mean
                    mean = bucket.views[slot]
                    if p.grad is not None:
                        mean.add_(p.grad)
                    p.grad = self._averaged[id(p)] = mean
            bucket.__init__(bucket.owner, bucket.params)  # buffer freed (the owner's: as grads)
        self._next = 0

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


def check_main(ctx, args) -> None:
    """The plain run: the tiny LM, AdamW with two param groups, 3 steps, as ZeRO-1 (06 +
    ShardedOptimizer) and ZeRO-2 (Zero2DDP, 2 micro-batches under no_sync()), each beside AdamW
    on one process with the whole batch, the consolidated state too. Exits 1 on a difference."""
    from common import import_stage, models, results
    n, rows, ledger = ctx.world_size, [], import_stage("07_parallelism/measure/ledger")

    def lm_and_adamw(seed, optimizer, **kw):  # eps 1e-6: see verify_main in fsdp.py
        torch.manual_seed(seed)
        ps = list((lm := models.TransformerLM("tiny", context_length=16)).parameters())
        return lm, optimizer([{"params": ps[:12], "weight_decay": 0.1},
                              {"params": ps[12:], "betas": (0.8, 0.9)}], lr=1e-3, eps=1e-6, **kw)
    for way, k in (("ZeRO-1: BucketedDDP (06) + ShardedOptimizer", 1), ("ZeRO-2: Zero2DDP", 2)):
        model, opt = lm_and_adamw(1 + ctx.rank, ShardedOptimizer, optimizer_cls=torch.optim.AdamW)
        ref, ref_opt = lm_and_adamw(1, torch.optim.AdamW)  # (ranks started apart: both wrappers
        ddp = Zero2DDP(model, opt) if k == 2 else \
            import_stage("06_bucketed_ddp/bucketed_ddp").BucketedDDP(model)  # broadcast rank 0's)
        for step in range(3):
            x, y = models.random_tokens(2 * n * k, 16, seed=step)
            for mb in range(k):  # rank r's 2 sequences of micro-batch mb
                mine = slice(2 * (mb * n + ctx.rank), 2 * (mb * n + ctx.rank) + 2)
                with ddp.no_sync() if mb < k - 1 else contextlib.nullcontext():
                    (models.lm_loss(ddp(x[mine]), y[mine]) / k).backward()
            ddp.finish_gradient_synchronization()
            grads = ledger.state_bytes(p.grad for p in model.parameters())
            models.lm_loss(ref(x), y).backward()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        flat, pairs = torch.cat([p.detach().flatten() for p in model.parameters()]), list(zip(
            model.parameters(), ref.parameters()))
        everyone, held = [torch.empty_like(flat) for _ in range(n)], [torch.zeros(1, dtype=torch.long)
                                                                      for _ in range(n)]
        dist.all_gather(everyone, flat)
        dist.all_gather(held, torch.tensor([ledger.optimizer_state_bytes(opt.optim)]))
        opt.consolidate_state_dict(to=0)
        rows.append({"way": way, "max |diff|": max((p - q).abs().max().item() for p, q in pairs),
                     "allclose, bitwise across ranks, checkpoint = one process's": all(
                         torch.allclose(p, q, rtol=1e-4, atol=1e-5) for p, q in pairs) and all(
                         torch.equal(everyone[0], f) for f in everyone) and (ctx.rank != 0 or all(
                         torch.allclose(opt.state_dict()["state"][i][key], v, 1e-4, 1e-7) for i, st in
                         ref_opt.state_dict()["state"].items() for key, v in st.items())),
                     "AdamW state kB per rank": "/".join(f"{h.item() / 1e3:.0f}" for h in held),
                     f"grads kB held, rank {ctx.rank}": grads / 1e3})
    ok = torch.tensor([float(all(list(r.values())[2] for r in rows))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank checked its own
    if ctx.is_main or not ok.item():
        results.print_table(rows, floatfmt=".3g", title=f"{n} ranks vs AdamW on one process, tiny LM, "
                            f"3 steps ({results.machine_name()}):")
    ctx.print("all checks passed" if ok.item() else "SOME CHECKS FAILED", all_ranks=not ok.item())
    if not ok.item():
        raise SystemExit(1)


def bench_main(ctx, args) -> None:
    """--bench: fsdp.py's ledger, its ZeRO rows (DDP, ZeRO-1/2, torch's ZeroRedundancyOptimizer)."""
    from common import import_stage
    ledger = import_stage("07_parallelism/measure/ledger")
    ledger.run_ledger(ctx, [s for s in ledger.strategies() if "fsdp" not in s[0]], args)


def main(argv=None) -> None:
    _repo()
    from common import import_stage, launch, step_bench
    parser = launch.make_parser(__doc__)
    import_stage("07_parallelism/measure/ledger").add_ledger_args(parser)
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    if args.bench:  # batch, memory, results/: one line, exit 2
        step_bench.check_step_bench_args(args, config)
    launch.launch(bench_main if args.bench else check_main, config, args)


if __name__ == "__main__":
    main()
