"""Stage 07b: FSDP (ZeRO-3) from scratch. Every rank keeps 1/N of every weight matrix and
gathers a unit's full weights just before the unit runs, forward and backward.

Data parallelism (03-06) keeps the whole model on every rank: 16 bytes per parameter with
float32 AdamW (weights 4, gradients 4, two moments 8). Fully sharded data parallelism keeps
16/N (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", stage 3; Zhao et al., 2023, "PyTorch FSDP"): each weight is cut along
dim 0 into N shards, the optimizer steps on the shard, and the full weight exists only while
its unit computes. A unit's life in one training step:

    forward:   all-gather its shards -> full weights -> run -> free the full weights
    backward:  all-gather again -> run its backward -> reduce-scatter the full gradients
               into this rank's averaged shard gradient -> free the full weights and gradients

with the next unit's all-gather already in flight while this one computes (prefetch, in the
order recorded from the first forward). Parameters with fewer than 2 dimensions (biases,
norm gains) are small: they stay whole on every rank and their gradients are all-reduced.

Run it:

    python 07_parallelism/fsdp.py --world-size 2      # verify against one process, print a table
    python 07_parallelism/fsdp.py --profile           # timeline: all-gathers during compute
    torchrun --nproc-per-node=2 07_parallelism/fsdp.py

The class needs torch alone: copy this file into another project and ``from fsdp import FSDP``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

# --------------------------------------------------------------------------- the algorithm


def broadcast_module_state(module: nn.Module, group=None) -> None:
    """Every rank starts from rank 0's parameters and buffers (the same code as 03-06)."""
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.detach(), src=src, group=group)


def all_gather_async(out, shard, group):
    """out <- every rank's shard, rank after rank. Looked up at call time, so a counter that
    swaps torch.distributed's functions (common/ledger.py) sees the call."""
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    return gather(out, shard, group=group, async_op=True)


def reduce_scatter_async(out, full, group):
    """out <- this rank's 1/N block of the sum over ranks of ``full``."""
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    return scatter(out, full, group=group, async_op=True)


def copy_from_blocks(dst: torch.Tensor, blocks: torch.Tensor) -> None:
    """dst (1-D, m values) <- the first m values of ``blocks`` read row by row. Row r is rank
    r's shard of one parameter, so its rows in order are the parameter; the padding that
    made dim 0 divisible by N sits at the end and is dropped."""
    n = blocks.shape[1]
    q, rem = divmod(dst.numel(), n)
    dst[:q * n].view(q, n).copy_(blocks[:q])
    if rem:
        dst[q * n:].copy_(blocks[q, :rem])


def copy_into_blocks(blocks: torch.Tensor, src: torch.Tensor) -> None:
    """The reverse: a full gradient (1-D) into rank-major blocks; the padding stays zero."""
    n = blocks.shape[1]
    q, rem = divmod(src.numel(), n)
    blocks[:q].copy_(src[:q * n].view(q, n))
    if rem:
        blocks[q, :rem].copy_(src[q * n:])


def plan_units(module: nn.Module, unit_modules) -> list[tuple[list, list]]:
    """Group the sharded parameters (2+ dimensions) into units: [(roots, slots)], where the
    roots are the modules whose forward starts a unit and a slot (owner, name, param) is a
    place that holds a sharded parameter. A parameter belongs to the nearest named unit above
    its owner, else to a unit of its own owner; units that share a parameter (tied weights)
    merge, so each parameter lives in exactly one flat shard."""
    named, home = {id(m) for m in unit_modules}, {}

    def walk(m, current):
        home[id(m)] = current = m if id(m) in named else current
        for child in m.children():
            walk(child, current)
    walk(module, None)
    groups, by_root, by_param = [], {}, {}
    for owner in module.modules():
        for name, p in owner._parameters.items():
            if p is None or p.dim() < 2:
                continue
            root = home[id(owner)] or owner
            g, other = by_root.get(id(root)), by_param.get(id(p))
            if g is None:
                g = other or {"roots": [], "slots": []}
                if other is None:
                    groups.append(g)
                g["roots"].append(root)
            elif other is not None and other is not g:  # a weight shared by two units: merge
                g["roots"] += other["roots"]
                g["slots"] += other["slots"]
                groups.remove(other)
                by_root.update({id(r): g for r in other["roots"]})
                by_param.update({id(q): g for _, _, q in other["slots"]})
            g["slots"].append((owner, name, p))
            by_root[id(root)], by_param[id(p)] = g, g
    return [(g["roots"], g["slots"]) for g in groups]


class _Unit:
    """One unit's flat shard (the module's parameters become views of it), its full-size
    parameters (storage allocated only while gathered) and its communication state."""

    def __init__(self, index, roots, slots, rank, world_size, gather_dtype, casts):
        self.index, self.roots, self.slots, self.casts = index, roots, slots, casts
        self.params = list({id(p): p for _, _, p in slots}.values())  # a tied weight once
        self.position = {id(p): i for i, p in enumerate(self.params)}
        self.shapes = [p.shape for p in self.params]
        rows = [math.ceil(p.shape[0] / world_size) for p in self.params]  # k = ceil(d0 / N)
        self.numels = [k * (p.numel() // p.shape[0]) for k, p in zip(rows, self.params)]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.params))]
        p0 = self.params[0]
        self.dtype, self.device, self.gather_dtype = p0.dtype, p0.device, gather_dtype or p0.dtype
        self.flat_shard = torch.zeros(sum(self.numels), dtype=self.dtype, device=self.device)
        self.full = []
        for p, k, off, numel in zip(self.params, rows, self.offsets, self.numels):
            mine = p.detach()[rank * k:(rank + 1) * k].flatten()  # rows [r k, (r+1) k)
            self.flat_shard[off:off + mine.numel()].copy_(mine)
            p.data = self.flat_shard[off:off + numel].view(k, *p.shape[1:])  # same Parameter
            full = nn.Parameter(torch.empty(self.shapes[len(self.full)], dtype=self.gather_dtype,
                                            device=self.device), requires_grad=p.requires_grad)
            full.untyped_storage().resize_(0)  # allocated only while gathered
            self.full.append(full)
        self.full_bytes = sum(f.numel() * f.element_size() for f in self.full)
        self.trainable = sum(p.requires_grad for p in self.params)
        self.pending, self.arrived = self.trainable, [False] * len(self.params)
        self.gathered, self.work, self.buffer, self.grad_buffer = False, None, None, None


def _weak(obj, method: str, *bound):
    """A hook calling ``obj.method(*bound, *hook_args)`` that does not keep ``obj`` alive:
    autograd holds hooks in C++, where Python's garbage collector cannot break a cycle."""
    ref = weakref.ref(obj)

    def hook(*args, **kwargs):
        live = ref()
        return None if live is None else getattr(live, method)(*bound, *args, **kwargs)
    return hook


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


class FSDP(nn.Module):
    """Fully sharded data parallelism. Build the optimizer on ``fsdp.parameters()`` (the
    shards) after wrapping; per step: forward, ``backward()``, then
    ``finish_gradient_synchronization()``, then ``optimizer.step()``.

    ``units``: modules whose weights are gathered together (e.g. each Transformer block);
    default (and for every weight outside them): each module that owns weight matrices.
    ``compute_dtype`` (float16/bfloat16): weights are cast before the all-gather (half the
    bytes), forward and backward run in it, masters stay float32; a module owning weight
    matrices also gets its inputs and its own biases cast (one dtype per matmul), other
    parameters (norm gains) stay float32. ``reduce_dtype``: the dtype of the reduce-scatter
    (float32 by default); gradients land as float32 shards either way.
    Every rank must run the same units in the same order (the collectives pair up by order).
    """

    def __init__(self, module: nn.Module, compute_dtype=None, reduce_dtype=torch.float32,
                 units=None, process_group=None):
        super().__init__()
        for what, dtype in (("compute_dtype", compute_dtype), ("reduce_dtype", reduce_dtype)):
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise TypeError(f"FSDP: {what} must be a floating dtype (torch.float16, "
                                f"torch.bfloat16, torch.float32) or None, got {dtype!r}")
        if not any(p.dim() >= 2 for p in module.parameters()):
            raise ValueError(f"FSDP: {type(module).__name__} has no parameter with 2 or more "
                             "dimensions, so there is nothing to shard; use a DDP (03-06)")
        units = list(units or [])
        if any(all(u is not m for m in module.modules()) for u in units):
            raise ValueError("FSDP: every unit must be a submodule of the wrapped module")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("FSDP needs an initialised process group: call "
                               "torch.distributed.init_process_group(...) first")
        self.module, self.group = module, process_group
        self.world_size, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self.compute_dtype, self.reduce_dtype = compute_dtype, reduce_dtype or torch.float32
        broadcast_module_state(module, process_group)
        sharded = {id(p) for p in module.parameters() if p.dim() >= 2}
        self.units = []
        for index, (roots, slots) in enumerate(plan_units(module, units)):
            owners = {id(m): m for m, _, _ in slots}.values()
            casts = [(m, n, p) for m in owners for n, p in m._parameters.items() if compute_dtype
                     and p is not None and id(p) not in sharded and p.is_floating_point()]
            unit = _Unit(index, roots, slots, self.rank, self.world_size, compute_dtype, casts)
            self.units.append(unit)
            for root in roots:
                root.register_forward_pre_hook(_weak(self, "_pre_forward", unit))
                root.register_forward_hook(_weak(self, "_post_forward", unit), always_call=True)
            for i, full in enumerate(unit.full):
                if full.requires_grad:
                    full.register_post_accumulate_grad_hook(_weak(self, "_on_full_grad", unit, i))
            if compute_dtype is not None:
                for owner in owners:
                    owner.register_forward_pre_hook(_weak(self, "_cast_inputs"), with_kwargs=True)
        self._replicated = [p for p in module.parameters() if p.dim() < 2 and p.requires_grad]
        self._uses, self._post_uses, self._recording, self._next_in_backward = [], [], True, {}
        self._pos = self._post_pos = 0
        self._backward_task, self._reducing, self._require_sync = None, [], True
        self.gathered_bytes = self.peak_gathered_bytes = 0  # full weights + gather buffers

    def forward(self, *args, **kwargs):
        self._pos = self._post_pos = 0
        out = self.module(*args, **kwargs)
        if self._recording:  # the first forward fixed the order: backward runs it in reverse
            self._recording = False
            order = list(dict.fromkeys(reversed(self._post_uses)))
            self._next_in_backward = dict(zip(order, order[1:]))
        return out

    # -- gather and free -----------------------------------------------------------------

    def _count(self, nbytes: int) -> None:
        self.gathered_bytes += nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _gather(self, u: _Unit, wait: bool = True) -> None:
        """Start the unit's all-gather (if not in flight); with ``wait``, fill its full weights."""
        if u.gathered:
            return
        if u.work is None:
            send = u.flat_shard.to(u.gather_dtype)  # cast first: 16-bit weights travel in 16 bits
            u.buffer = torch.empty(self.world_size * send.numel(), dtype=send.dtype, device=send.device)
            u.work = all_gather_async(u.buffer, send, self.group)
            self._count(u.buffer.numel() * u.buffer.element_size())
        if wait:
            u.work.wait()
            blocks = u.buffer.view(self.world_size, -1)
            for full, off, numel in zip(u.full, u.offsets, u.numels):
                full.untyped_storage().resize_(full.numel() * full.element_size())
                # .data: filling a tensor autograd saved must not bump its version counter
                copy_from_blocks(full.data.view(-1), blocks[:, off:off + numel])
            self._count(u.full_bytes - u.buffer.numel() * u.buffer.element_size())
            u.gathered, u.work, u.buffer = True, None, None

    def _reshard(self, u: _Unit) -> None:
        if u.gathered:
            for full in u.full:
                full.untyped_storage().resize_(0)
            self._count(-u.full_bytes)
            u.gathered = False

    def _swap(self, u: _Unit, to_full: bool) -> None:
        """Point the owners at the full weights (and compute-dtype biases), or back at the shards."""
        for owner, name, p in u.slots:
            owner._parameters[name] = u.full[u.position[id(p)]] if to_full else p
        for owner, name, p in u.casts:
            owner._parameters[name] = p.to(self.compute_dtype) if to_full else p

    # -- forward -------------------------------------------------------------------------

    def _pre_forward(self, u: _Unit, module, args) -> None:
        nxt = None
        if torch._C._current_graph_task_id() != -1:  # inside backward: a checkpoint's recompute
            self._enter_backward()  # gather if needed, but record, prefetch and free nothing
        elif self._recording:
            self._uses.append(u.index)
        elif self._pos < len(self._uses) and self._uses[self._pos] == u.index:
            nxt = self._uses[self._pos + 1] if self._pos + 1 < len(self._uses) else None
            self._pos += 1
        self._gather(u)
        if nxt is not None:  # prefetch: the next unit's all-gather runs while this one computes
            self._gather(self.units[nxt], wait=False)
        self._swap(u, to_full=True)

    def _cast_inputs(self, module, args, kwargs):
        cast = lambda t: t.to(self.compute_dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
        return tuple(map(cast, args)), {k: cast(v) for k, v in kwargs.items()}

    def _post_forward(self, u: _Unit, module, args, output):
        self._swap(u, to_full=False)
        if torch._C._current_graph_task_id() != -1:
            return None  # recompute: keep the weights, this unit's backward comes right after
        if self._recording:
            self._post_uses.append(u.index)
        self._post_pos += 1
        last = (not self._recording and self._post_pos == len(self._post_uses)
                and self._post_uses[-1] == u.index)
        if not (last and torch.is_grad_enabled()):  # backward starts with the last unit: keep it
            self._reshard(u)
        for t in _tensors(output):
            if t.requires_grad:  # fires when this output's gradient is ready: the unit's backward is next
                t.register_hook(_weak(self, "_pre_backward", u))
        return None

    # -- backward ------------------------------------------------------------------------

    def _enter_backward(self) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._backward_task:  # first hook of this backward: clean up after its end
            self._backward_task = task
            torch.autograd.Variable._execution_engine.queue_callback(_weak(self, "_end_backward"))

    def _pre_backward(self, u: _Unit, grad) -> None:
        self._enter_backward()
        self._gather(u)
        nxt = self._next_in_backward.get(u.index)
        if nxt is not None:
            self._gather(self.units[nxt], wait=False)

    def _collect(self, u: _Unit, i: int) -> None:
        """Copy full gradient i into the unit's reduce-scatter input (in reduce_dtype); free it."""
        if u.grad_buffer is None:
            u.grad_buffer = torch.zeros(self.world_size * u.flat_shard.numel(),
                                        dtype=self.reduce_dtype, device=u.device)
        blocks = u.grad_buffer.view(self.world_size, -1)
        copy_into_blocks(blocks[:, u.offsets[i]:u.offsets[i] + u.numels[i]], u.full[i].grad.view(-1))
        u.full[i].grad, u.arrived[i] = None, True

    def _on_full_grad(self, u: _Unit, i: int, full) -> None:
        """A full weight's gradient is complete (all its uses summed by autograd)."""
        u.pending -= 1
        if self._require_sync:  # under no_sync() the full gradient stays and accumulates
            self._collect(u, i)
        if u.pending == 0:  # the unit's backward is over
            u.pending = u.trainable
            self._reshard(u)
            if self._require_sync:
                self._reduce_scatter(u)

    def _reduce_scatter(self, u: _Unit) -> None:
        out = torch.empty(u.flat_shard.numel(), dtype=self.reduce_dtype, device=u.device)
        work = reduce_scatter_async(out, u.grad_buffer, self.group)
        self._reducing.append((u, work, out, u.grad_buffer, u.arrived))
        u.grad_buffer, u.arrived = None, [False] * len(u.params)
        while len(self._reducing) > 1:  # one in flight: it overlaps the next unit's backward
            self._land(*self._reducing.pop(0))

    def _land(self, u: _Unit, work, out, grad_buffer, arrived) -> None:
        """Wait for a reduce-scatter; the averaged shard gradients become (or add to) .grad."""
        work.wait()
        out = out.div_(self.world_size).to(u.dtype)  # sum -> mean over ranks, float32 shards
        for p, off, numel, got in zip(u.params, u.offsets, u.numels, arrived):
            if got:
                g = out[off:off + numel].view_as(p)
                p.grad = g if p.grad is None else p.grad.add_(g)

    def _end_backward(self) -> None:
        """End of backward (autograd's callback): reduce units whose gradients did not all
        arrive (an unused weight), finish prefetches nobody used, free every full weight."""
        for u in self.units:  # in unit order: the same collectives in the same order everywhere
            if self._require_sync and (u.grad_buffer is not None
                                       or any(f.grad is not None for f in u.full)):
                for i, f in enumerate(u.full):
                    if f.grad is not None:
                        self._collect(u, i)
                self._reduce_scatter(u)
            if u.work is not None:
                self._gather(u)
            self._reshard(u)
            u.pending = u.trainable

    def finish_gradient_synchronization(self) -> None:
        """Land the reduce-scatters still in flight; all-reduce the replicated gradients."""
        if not self._require_sync:
            return
        while self._reducing:
            self._land(*self._reducing.pop(0))
        if not self._replicated:
            return
        ps = self._replicated  # one all-reduce: every gradient (zeros if none), then "had one" flags
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().float()
                          for p in ps] + [torch.tensor([float(p.grad is not None) for p in ps],
                                                       device=ps[0].device)])
        dist.all_reduce(flat, group=self.group)
        grads = flat[:-len(ps)].div_(self.world_size).split([p.numel() for p in ps])
        for p, g, had in zip(ps, grads, flat[-len(ps):].tolist()):
            if had > 0:  # someone had a gradient: the mean; nobody: .grad stays None
                p.grad = g.view_as(p).to(p.dtype)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation without communication: full gradients stay and add up (4
        bytes per parameter of every unit); the first backward outside reduce-scatters them."""
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    # -- for checkpoints, tests and the ledger -------------------------------------------

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter under the module's own names, full size, in the master dtype
        (a collective: call it on every rank)."""
        full = {}
        for u in self.units:
            out = torch.empty(self.world_size * u.flat_shard.numel(), dtype=u.dtype, device=u.device)
            all_gather_async(out, u.flat_shard, self.group).wait()
            for p, shape, off, numel in zip(u.params, u.shapes, u.offsets, u.numels):
                full[id(p)] = torch.empty(shape, dtype=u.dtype, device=u.device)
                copy_from_blocks(full[id(p)].view(-1), out.view(self.world_size, -1)[:, off:off + numel])
        return {name: full[id(p)] if id(p) in full else p.detach().clone()
                for name, p in self.module.named_parameters(remove_duplicate=False)}

    def gathered_storage_keys(self) -> set:
        """(device, data_ptr) of every full weight allocated now: saved-for-backward tensors
        with these storages are gathered weights, not activations."""
        return {(f.device, f.untyped_storage().data_ptr()) for u in self.units if u.gathered
                for f in u.full}


# --------------------------------------------------------------------------- harness


def _repo() -> None:
    """The harness needs the repository's common/ package; the algorithm above does not."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "common" / "launch.py").exists():
        raise SystemExit(f"{Path(__file__).name}: the classes above work on their own; the "
                         "demo and benchmark need the repository around this file (common/)")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


# Tolerances against one process, float32: the ranks sum the batch in another order.
F32_TOL = {"toy": (1e-5, 1e-6), "lm": (1e-4, 1e-5)}
# Mixed precision: both sides round the same casts, but the ranks round each local gradient
# to 16 bits where the reference rounds the whole batch's once, and the roundings travel
# through every layer of the backward. Allow 16 units of the dtype's rounding error u (bf16
# 2^-8, fp16 2^-11) relative to the largest parameter, over a few SGD steps.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def cast_reference(model: nn.Module, dtype) -> nn.Module:
    """The one-process yardstick for ``compute_dtype``: every module owning a weight matrix
    runs on 16-bit casts of its float32 parameters and inputs (autograd takes the gradients
    back to float32 through the casts); everything else runs as it is."""
    def pre(module, args, kwargs):
        module._masters = dict(module._parameters)
        module._parameters.update({n: p.to(dtype) for n, p in module._masters.items()
                                   if p is not None and p.is_floating_point()})
        cast = lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
        return tuple(map(cast, args)), {k: cast(v) for k, v in kwargs.items()}
    for m in model.modules():
        if any(p is not None and p.dim() >= 2 for p in m._parameters.values()):
            m.register_forward_pre_hook(pre, with_kwargs=True)
            m.register_forward_hook(lambda module, a, out: module._parameters.update(module._masters))
    return model


def compare_with_one_process(ctx, build, *, lm=False, steps=3, adamw=False, per_block=False,
                             compute_dtype=None, micro_batches=1, no_sync=False) -> dict:
    """Train ``FSDP(build())`` and ``build()`` on the whole batch side by side; after every
    step compare gather_full_params() with the reference and across ranks (bitwise)."""
    from common import ledger, models
    torch.manual_seed(1000 + ctx.rank)  # different on every rank: the wrap broadcasts rank 0's
    model = build().to(ctx.device)
    torch.manual_seed(1000)
    reference = build().to(ctx.device)
    if compute_dtype is not None:
        cast_reference(reference, compute_dtype)
    fsdp = FSDP(model, compute_dtype=compute_dtype, units=list(model.blocks) if per_block else None)
    # AdamW divides by sqrt(v) + eps: on the LM a gradient element near eps (rare tokens)
    # turns float32 summation-order noise into updates of order lr, and torch DDP drifts
    # from one process exactly as far; eps 1e-6 keeps the comparison about the gradients.
    make_opt = (lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-6 if lm else 1e-8)) if adamw \
        else (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    opt, ref_opt = make_opt(fsdp.parameters()), make_opt(reference.parameters())
    rtol, atol = F32_TOL["lm" if lm else "toy"]
    if compute_dtype is not None:
        rtol = atol = 16 * UNIT_ROUNDOFF[compute_dtype] * max(p.abs().max().item() for p in reference.parameters())
    local = 2 if lm else 4
    found = dict(max_diff=0.0, bitwise=True, ok=True, tolerance=atol, fsdp=fsdp, reference=reference)
    loss_fn = models.lm_loss if lm else nn.functional.mse_loss
    with ledger.CommCounter() as comm:
        for step in range(steps):
            if lm:
                x, y = models.random_tokens(local * ctx.world_size * micro_batches, 32, seed=step, device=ctx.device)
            else:
                x, y = (t.to(ctx.device) for t in models.random_regression_data(
                    local * ctx.world_size * micro_batches, seed=step))
            opt.zero_grad(set_to_none=True)
            for k in range(micro_batches):  # rank r's share of micro-batch k
                start = (k * ctx.world_size + ctx.rank) * local
                sync = contextlib.nullcontext() if not no_sync or k == micro_batches - 1 else fsdp.no_sync()
                with sync:
                    (loss_fn(fsdp(x[start:start + local]).float(), y[start:start + local]) / micro_batches).backward()
                    fsdp.finish_gradient_synchronization()
            opt.step()
            ref_opt.zero_grad(set_to_none=True)
            loss_fn(reference(x).float(), y).backward()
            ref_opt.step()
            got, want = fsdp.gather_full_params(), dict(reference.named_parameters())
            for name, q in want.items():
                found["max_diff"] = max(found["max_diff"], (got[name] - q.detach()).abs().max().item())
                found["ok"] &= torch.allclose(got[name], q.detach(), rtol=rtol, atol=atol)
            mine = torch.cat([t.flatten() for t in got.values()])
            everyone = [torch.empty_like(mine) for _ in range(ctx.world_size)]
            dist.all_gather(everyone, mine)
            found["bitwise"] &= all(torch.equal(everyone[0], t) for t in everyone)
            if step == 0:
                found["gathers_per_step"] = sum(c["op"] == "all_gather" for c in comm.calls)
    return found


def verify_main(ctx) -> None:
    """Plain run: FSDP against one process on a few models; a table; exit 1 on any failure."""
    from common import models, results
    tiny = functools.partial(models.TransformerLM, "tiny", context_length=32)
    cases = [
        ("ToyModel (frozen param, no-grad bias), SGD", models.ToyModel, {}),
        ("TiedModel (a layer used twice), AdamW", models.TiedModel, dict(adamw=True, steps=10)),
        ("LM tiny, a unit per block, AdamW", tiny, dict(lm=True, adamw=True, steps=10, per_block=True)),
        ("LM tiny, per block, activation checkpointing",
         functools.partial(tiny, checkpoint_activations=True), dict(lm=True, adamw=True, per_block=True)),
        ("LM tiny, per block, 2 micro-batches", tiny, dict(lm=True, per_block=True, micro_batches=2)),
        ("LM tiny, per block, bfloat16 compute, SGD", tiny,
         dict(lm=True, per_block=True, compute_dtype=torch.bfloat16)),
    ]
    rows, all_ok = [], True
    ctx.print(f"FSDP on {ctx.world_size} ranks ({ctx.backend}/{ctx.device.type}) vs one process "
              f"on the whole batch ({results.machine_name()}):", all_ranks=False)
    for label, build, kw in cases:
        f = compare_with_one_process(ctx, build, **kw)
        ok = f["ok"] and f["bitwise"]
        flag = torch.tensor([float(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        all_ok &= bool(flag.item())
        if not ok:
            ctx.print(f"FAIL {label}: max |diff| {f['max_diff']:.2e} (tolerance {f['tolerance']:.1e}), "
                      f"bitwise across ranks {f['bitwise']}")
        sharded = sum(u.flat_shard.numel() * u.flat_shard.element_size() for u in f["fsdp"].units)
        full = sum(p.numel() * p.element_size() for p in f["reference"].parameters() if p.dim() >= 2)
        rows.append({"case": label, "steps": kw.get("steps", 3), "max_abs_diff": f["max_diff"],
                     "bitwise_across_ranks": f["bitwise"], "units": len(f["fsdp"].units),
                     "all_gathers_per_step": f["gathers_per_step"], "weights_full_kB": full / 1e3,
                     "shard_per_rank_kB": sharded / 1e3,
                     "peak_gathered_kB": f["fsdp"].peak_gathered_bytes / 1e3, "ok": ok})
    if ctx.is_main:
        results.print_table(rows, floatfmt=".3g")
        print("all checks passed" if all_ok else "SOME CHECKS FAILED", flush=True)
    if not all_ok:
        raise SystemExit(1)


def fsdp_per_block(model: nn.Module, compute_dtype=None) -> FSDP:
    """A picklable factory for the profiler: the LM with one unit per Transformer block."""
    return FSDP(model, compute_dtype=compute_dtype, units=list(model.blocks))


def profile_main(ctx, args) -> None:
    from common import profiling
    dtype = getattr(torch, args.compute_dtype) if args.compute_dtype != "float32" else None
    summaries = profiling.profile_ddp(
        ctx, [("fsdp (07)", functools.partial(fsdp_per_block, compute_dtype=dtype))], args, name="07_fsdp")
    if ctx.is_main:
        profiling.print_summary(summaries)


def main(argv=None) -> None:
    _repo()
    from common import launch, profiling, step_bench
    parser = launch.make_parser(__doc__)
    parser.add_argument("--compute-dtype", choices=["float32", "bfloat16", "float16"],
                        default="float32", help="--profile: FSDP's compute dtype")
    step_bench.add_step_bench_args(parser)
    profiling.add_profile_args(parser)
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    if args.profile:
        step_bench.check_step_bench_args(args, config)
        launch.launch(profile_main, config, args)
    else:
        launch.launch(verify_main, config)


if __name__ == "__main__":
    main()
