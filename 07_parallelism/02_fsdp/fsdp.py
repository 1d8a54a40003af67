"""Stage 07: FSDP (ZeRO-3) from scratch: every rank keeps 1/N of every weight matrix, cut along
dim 0: rank r holds rows [r k, (r+1) k), k = ceil(rows / N), zero-padded. A unit's full weights
are gathered just before the unit runs, in forward and again in backward, where its gradients
are then reduce-scattered into this rank's averaged float32 shard; the next unit's all-gather is
in flight meanwhile (prefetch). Biases and norm gains stay whole; their gradients are
all-reduced. The optimizer takes ``fsdp.parameters()`` (the shards); a step is forward,
backward(), ``finish_gradient_synchronization()``, step(). Every rank must run the same units
(collectives pair by order). The collectives are looked up on torch.distributed at each call,
so a counter that swaps its functions sees them. Torch alone: ``from fsdp import FSDP``.

    python 07_parallelism/02_fsdp/fsdp.py --world-size 2    # the tiny LM against one process
    python 07_parallelism/02_fsdp/fsdp.py --bench           # the ledger: DDP, ZeRO-1/2, FSDP, torch's
    python 07_parallelism/02_fsdp/fsdp.py --profile         # timeline: all-gathers during compute
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

# --------------------------------------------------------------------------- the algorithm


def all_gather(out, shard, group):  # async: out <- [rank 0's shard, rank 1's, ...]
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, shard, group=group, async_op=True)


def reduce_scatter(out, full, group):  # async: out <- this rank's block of the sum over ranks
    return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, full, group=group, async_op=True)


def copy_rows(full: torch.Tensor, blocks: torch.Tensor, into_blocks: bool) -> None:
    """Flat full tensor <-> its shards as rank-major rows (N x n): the tensor, then the padding."""
    n = blocks.shape[1]
    q, rem = divmod(full.numel(), n)
    for whole, parts in ((full[:q * n].view(q, n), blocks[:q]),
                         (full[q * n:], blocks[q:q + 1, :rem].flatten())):
        parts.copy_(whole) if into_blocks else whole.copy_(parts)


def plan_units(module: nn.Module, unit_modules) -> list[tuple[list, list]]:
    """[(roots, slots)]: roots gather the unit in their forward, a slot (owner, name, weight) holds
    a weight of 2+ dims, in the nearest named unit above its owner, else in its owner's own."""
    home, parent, roots, units = {}, {}, {}, {}
    for unit in sorted(unit_modules, key=lambda m: -len(list(m.modules()))):  # outer first
        home.update({id(m): unit for m in unit.modules()})  # an inner unit overrides

    def find(key):  # union-find over roots and weights: units sharing a weight (tied) merge
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key
    slots = [(m, name, p) for m in module.modules() for name, p in m._parameters.items()
             if p is not None and p.dim() >= 2]
    for owner, _, p in slots:
        root = home.get(id(owner), owner)
        roots[id(root)] = root
        parent[find(id(p))] = find(id(root))
    for slot in slots:
        units.setdefault(find(id(slot[2])), ([], []))[1].append(slot)
    for key, root in roots.items():
        units[find(key)][0].append(root)
    return list(units.values())


class _Unit:  # a unit's flat shard, its full weights, its communication state
    def __init__(self, slots, rank, world_size, compute_dtype):
        self.params = list({id(p): p for _, _, p in slots}.values())  # a tied weight once
        self.slots = [(m, name, [id(q) for q in self.params].index(id(p))) for m, name, p in slots]
        self.owners = list({id(m): m for m, _, _ in slots}.values())
        self.casts = [(m, n, p) for m in self.owners for n, p in m._parameters.items()  # biases
                      if compute_dtype and p is not None and p.dim() < 2 and p.is_floating_point()]
        rows = [-(-p.shape[0] // world_size) for p in self.params]  # k = ceil(d0 / N)
        self.numels = [k * p[0].numel() for k, p in zip(rows, self.params)]
        self.flat_shard = self.params[0].new_zeros(sum(self.numels))
        self.full = [nn.Parameter(torch.empty_like(p, dtype=compute_dtype or p.dtype),
                                  requires_grad=p.requires_grad) for p in self.params]
        for p, f, k, shard in zip(self.params, self.full, rows, self.flat_shard.split(self.numels)):
            mine = p.detach()[rank * k:(rank + 1) * k].flatten()
            shard[:mine.numel()].copy_(mine)  # zeros after: the padding
            p.data = shard.view(k, *p.shape[1:])  # now the shard, a view of the flat one
            f.untyped_storage().resize_(0)  # storage only while gathered
        self.full_bytes = sum(f.nbytes for f in self.full)
        self.trainable = self.pending = sum(p.requires_grad for p in self.params)
        self.gathered, self.work, self.buffer, self.grad_buffer = False, None, None, None

    def columns(self, buffer: torch.Tensor, i: int) -> torch.Tensor:  # weight i, every rank
        return buffer.view(-1, self.flat_shard.numel()).split(self.numels, dim=1)[i]


def _weak(obj, method: str, *bound):  # a hook that does not keep obj alive (05's weak_hook)
    ref = weakref.ref(obj)
    return lambda *a, **kw: None if ref() is None else getattr(ref(), method)(*bound, *a, **kw)


class FSDP(nn.Module):
    """An optimizer over ``fsdp.parameters()`` (the shards); a step: forward, backward(),
    ``finish_gradient_synchronization()``, step(). ``units``: modules gathered as one (e.g.
    Transformer blocks). ``compute_dtype`` casts the weights before the all-gather, and their
    modules' inputs and biases (masters stay float32)."""

    def __init__(self, module: nn.Module, compute_dtype=None, reduce_dtype=torch.float32,
                 units=(), process_group=None):
        super().__init__()
        for what, dtype in (("compute_dtype", compute_dtype), ("reduce_dtype", reduce_dtype)):
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise TypeError(f"FSDP: {what} must be torch.float16, bfloat16, float32 or None, got {dtype!r}")
        if not any(p.dim() >= 2 for p in module.parameters()):
            raise ValueError(f"FSDP: {type(module).__name__} has no 2+ dimensional weight to shard; use a DDP (03-06)")
        if any(all(u is not m for m in module.modules()) for u in units):
            raise ValueError("FSDP: every unit must be a submodule of the wrapped module")
        self.module, self.group, self.compute_dtype = module, process_group, compute_dtype
        self.reduce_dtype = reduce_dtype or torch.float32
        self.world_size, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        for t in [*module.parameters(), *module.buffers()]:  # start from rank 0's state (03-06)
            dist.broadcast(t.detach(), src=src, group=process_group)
        self.units = []
        for roots, slots in plan_units(module, units):
            self.units.append(u := _Unit(slots, self.rank, self.world_size, compute_dtype))
            for root in roots:
                root.register_forward_pre_hook(_weak(self, "_pre_forward", u))
                root.register_forward_hook(_weak(self, "_post_forward", u), always_call=True)
            for i, full in enumerate(u.full):
                if full.requires_grad:
                    full.register_post_accumulate_grad_hook(_weak(self, "_on_full_grad", u, i))
            for owner in u.owners if compute_dtype else ():
                owner.register_forward_pre_hook(_weak(self, "_cast_inputs"), with_kwargs=True)
        self._replicated = [p for p in module.parameters() if p.dim() < 2 and p.requires_grad]
        self._uses, self._recording, self._next_in_backward, self._reducing = [], True, {}, []
        self.gathered_bytes = self.peak_gathered_bytes = 0  # of full weights alive at once

    def forward(self, *args, **kwargs):
        self._pos = 0
        out = self.module(*args, **kwargs)
        if self._recording:  # the first forward fixed the order; backward runs it reversed
            self._recording, order = False, list(dict.fromkeys(reversed(self._uses)))
            self._next_in_backward = dict(zip(order, order[1:]))
        return out

    def _gather(self, u: _Unit | None, wait: bool = True) -> None:
        """Start the unit's all-gather unless in flight; with ``wait``, fill its full weights."""
        if u is None or u.gathered:  # (None: no unit to prefetch)
            return
        if u.work is None:
            send = u.flat_shard.to(u.full[0].dtype)  # cast first: 16-bit weights travel in 16 bits
            u.buffer = send.new_empty(self.world_size * send.numel())
            u.work = all_gather(u.buffer, send, self.group)
        if wait:
            u.work.wait()
            for i, full in enumerate(u.full):  # via .data: refilling a tensor autograd saved
                full.untyped_storage().resize_(full.nbytes)  # must not bump its version
                copy_rows(full.data.view(-1), u.columns(u.buffer, i), into_blocks=False)
            self.gathered_bytes += u.full_bytes
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
            u.gathered, u.work, u.buffer = True, None, None

    def _reshard(self, u: _Unit) -> None:
        for full in u.full if u.gathered else ():
            full.untyped_storage().resize_(0)
        self.gathered_bytes, u.gathered = self.gathered_bytes - u.full_bytes * u.gathered, False

    def _swap(self, u: _Unit, to_full: bool) -> None:
        for owner, name, i in u.slots:
            owner._parameters[name] = u.full[i] if to_full else u.params[i]
        for owner, name, p in u.casts:
            owner._parameters[name] = p.to(self.compute_dtype) if to_full else p

    def _cast_inputs(self, module, args, kwargs):
        cast = lambda t: t.to(self.compute_dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
        return tuple(map(cast, args)), {k: cast(v) for k, v in kwargs.items()}

    def _pre_forward(self, u: _Unit, module, args) -> None:
        self._gather(u)
        if torch._C._current_graph_task_id() == -1:  # else a checkpoint's recompute: gather only
            if self._recording:
                self._uses.append(u)
            elif self._uses[self._pos:self._pos + 1] == [u]:  # on the recorded path
                self._pos += 1
                if self._pos < len(self._uses):  # prefetch: its all-gather runs while u computes
                    self._gather(self._uses[self._pos], wait=False)
        self._swap(u, to_full=True)

    def _post_forward(self, u: _Unit, module, args, output) -> None:
        self._swap(u, to_full=False)
        if torch._C._current_graph_task_id() != -1:
            return  # a recompute in backward: keep the weights, this unit's backward is next
        if self._recording or self._pos < len(self._uses) or not torch.is_grad_enabled():
            self._reshard(u)  # else kept: it ends after the last unit began, backward starts here
        for t in output if isinstance(output, (tuple, list)) else [output]:
            if torch.is_tensor(t) and t.requires_grad:  # fires when backward reaches this unit
                t.register_hook(_weak(self, "_pre_backward", u))

    def _pre_backward(self, u: _Unit, grad) -> None:
        self._gather(u)
        self._gather(self._next_in_backward.get(u), wait=False)  # prefetch: the next backward's

    def _on_full_grad(self, u: _Unit, i: int, full: nn.Parameter) -> None:
        """Every use of full weight i is summed in its .grad: into the reduce-scatter input."""
        if u.grad_buffer is None:  # zeros: a weight without a gradient sends zeros
            u.grad_buffer = u.flat_shard.new_zeros(self.world_size * u.flat_shard.numel(), dtype=self.reduce_dtype)
        copy_rows(full.grad.view(-1), u.columns(u.grad_buffer, i), into_blocks=True)
        full.grad, u.pending = None, u.pending - 1
        if u.pending == 0:  # all its gradients are in; a frozen weight may still be needed
            if u.trainable == len(u.full):  # by the backward, so then free only in finish()
                self._reshard(u)
            self._reduce_scatter(u)

    def _reduce_scatter(self, u: _Unit) -> None:
        out = u.flat_shard.new_empty(u.flat_shard.numel(), dtype=self.reduce_dtype)
        self._reducing.append((u, reduce_scatter(out, u.grad_buffer, self.group), out, u.grad_buffer))
        u.grad_buffer, u.pending = None, u.trainable
        while len(self._reducing) > 1:  # one in flight: it overlaps the next unit's backward
            self._land(*self._reducing.pop(0))

    def _land(self, u: _Unit, work, out, grad_buffer) -> None:
        """Wait for a reduce-scatter; the mean over ranks becomes (or adds to) the shards' .grad."""
        work.wait()
        out = out.div_(self.world_size).to(u.flat_shard.dtype)
        for p, g in zip(u.params, out.split(u.numels)):
            if p.requires_grad:
                p.grad = g.view_as(p) if p.grad is None else p.grad.add_(g.view_as(p))

    def finish_gradient_synchronization(self) -> None:
        """After each backward: the reduce-scatters left, full weights freed, replicated grads averaged."""
        for u in self.units:  # in unit order: the same collectives in the same order everywhere
            if u.grad_buffer is not None:  # some weights had no gradient: zeros for them
                self._reduce_scatter(u)
            if u.work is not None:
                self._gather(u)
            self._reshard(u)
        while self._reducing:
            self._land(*self._reducing.pop(0))
        if ps := [p for p in self._replicated if p.grad is not None]:
            flat = torch.cat([p.grad.flatten() for p in ps])
            dist.all_reduce(flat, group=self.group)
            for p, g in zip(ps, flat.div_(self.world_size).split([p.numel() for p in ps])):
                p.grad.copy_(g.view_as(p))

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter under the module's own names, full size, float32 (a collective)."""
        full = {}
        for u in self.units:
            out = u.flat_shard.new_empty(self.world_size * u.flat_shard.numel())  # master dtype
            all_gather(out, u.flat_shard, self.group).wait()
            for i, p in enumerate(u.params):
                full[id(p)] = out.new_empty(u.full[i].shape)
                copy_rows(full[id(p)].view(-1), u.columns(out, i), into_blocks=False)
        return {name: full[id(p)] if id(p) in full else p.detach().clone()
                for name, p in self.module.named_parameters(remove_duplicate=False)}

    def gathered_storage_keys(self) -> set:
        """(device, data_ptr) of full weights allocated now: saved tensors there are not activations."""
        return {(f.device, f.untyped_storage().data_ptr()) for u in self.units if u.gathered for f in u.full}


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


def verify_main(ctx, args) -> None:
    """Plain run: the tiny LM (tied embedding and output layer, a unit per block, activation
    checkpointing) under FSDP and on one process with the whole batch, 3 AdamW steps: weights
    allclose at float32 tolerance after every step, bitwise equal across ranks."""
    from common import models, results
    nets = []
    for seed in (1 + ctx.rank, 1):  # ranks start apart: FSDP broadcasts rank 0's weights
        torch.manual_seed(seed)
        nets.append(lm := models.TransformerLM("tiny", context_length=32, checkpoint_activations=True))
        lm.lm_head.weight = lm.token_embedding.weight  # one matrix in two layers: one unit
    fsdp, reference = FSDP(nets[0], units=list(nets[0].blocks)), nets[1]
    # eps 1e-6: with 1e-8 Adam turns summation-order noise in near-zero gradients into lr-sized steps
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (fsdp, reference)]
    diff, ok, mine = 0.0, True, slice(2 * ctx.rank, 2 * ctx.rank + 2)
    for step in range(3):
        x, y = models.random_tokens(2 * ctx.world_size, 32, seed=step)
        for m, opt, xs, ys in ((fsdp, opts[0], x[mine], y[mine]), (reference, opts[1], x, y)):
            opt.zero_grad(set_to_none=True)
            models.lm_loss(m(xs), ys).backward()
            getattr(m, "finish_gradient_synchronization", lambda: None)()
            opt.step()
        got, want = fsdp.gather_full_params(), dict(reference.named_parameters())
        everyone = [torch.empty_like(flat := torch.cat([*map(torch.flatten, got.values())]))
                    for _ in range(ctx.world_size)]
        dist.all_gather(everyone, flat)
        ok &= all(torch.equal(everyone[0], t) for t in everyone)  # bitwise across ranks
        ok &= all(torch.allclose(got[n], want[n], rtol=1e-4, atol=1e-5) for n in want)
        diff = max(diff, *((got[n] - want[n]).abs().max().item() for n in want))
    ctx.print(f"FSDP vs one process, tiny LM in {len(fsdp.units)} units, {ctx.world_size} ranks ({ctx.backend}/"
              f"{ctx.device.type}), 3 AdamW steps ({results.machine_name()}):\n  max |diff| {diff:.1e}: "
              f"{'allclose, and bitwise equal across ranks' if ok else 'NOT allclose, or ranks differ'}; "
              f"per rank {sum(p.nbytes for p in fsdp.parameters()) / 1e3:.0f} kB of shards, at most "
              f"{fsdp.peak_gathered_bytes / 1e3:.0f} kB of full weights gathered at once", all_ranks=not ok)
    ctx.print("all checks passed" if ok else "SOME CHECKS FAILED", all_ranks=not ok)
    dist.barrier()
    if not ok:
        raise SystemExit(1)


def bench_main(ctx, args) -> None:
    """--bench: the ledger and the targets read off it (reported, not checked: one run's timing is a
    measurement, not a test). --profile: a unit per block in stage 05's timeline (common/profiling)."""
    from common import import_stage, profiling
    if args.profile:
        profiling.profile_ddp(ctx, [("fsdp (07)", lambda m: FSDP(m, units=list(m.blocks)))], args, name="07_fsdp")
    else:
        ledger = import_stage("07_parallelism/measure/ledger")
        ledger.run_ledger(ctx, ledger.strategies(), args)  # these six rows, all in one run


def main(argv=None) -> None:
    _repo()
    from common import import_stage, launch, profiling, step_bench
    parser = launch.make_parser(__doc__)
    import_stage("07_parallelism/measure/ledger").add_ledger_args(parser)
    profiling.add_profile_args(parser)
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    if args.bench or args.profile:  # the plain run has its own sizes
        step_bench.check_step_bench_args(args, config)  # batch, memory, results/: one line, exit 2
    launch.launch(bench_main if args.bench or args.profile else verify_main, config, args)


if __name__ == "__main__":
    main()
