"""Stage 07, lesson 2: FSDP (ZeRO-3), shard the parameters too.

What it teaches. ZeRO-2 (lesson 1) still keeps every weight on every rank. Fully sharded data
parallelism keeps only 1/N of each weight matrix per rank, and gathers a unit's full weights
just before the unit runs, in forward and again in backward; after backward its gradients are
reduce-scattered, so each rank receives the averaged gradient of its own shard only. Float32
AdamW on N ranks, P parameters: weights 4P/N + gradients 4P/N + moments 8P/N = 16P/N bytes per
rank, plus the full weights of the units gathered at the moment.

The shard layout. Every parameter with 2+ dimensions is cut along dim 0 into N blocks of
k = ceil(rows / N) rows: rank r holds rows [r k, (r+1) k), zero-padded past the last row. The
module's own ``nn.Parameter`` becomes this rank's block (``.data`` swapped), so an optimizer
over ``fsdp.parameters()`` sees, and keeps moments for, shards only. Biases and norm gains
(1-D) stay whole on every rank; their gradients are all-reduced, in one call.

A unit's life. A unit is the weights gathered together: by default each module that owns weight
matrices, or the modules you name (``units=[*lm.blocks]``: a block each). Its shards sit in one
flat buffer, so one collective moves the whole unit each way:

    forward    all-gather -> full weights -> the unit runs -> free the full weights
    backward   all-gather -> its backward runs -> last gradient in -> reduce-scatter into this
               rank's float32 shard gradient (sum over ranks, / N) -> free weights, gradients

Prefetch: the first forward records the order the units run in; after it, the next unit's
all-gather is in flight while one computes (forward in that order, backward in reverse). Units
whose forward ends after the last one began stay gathered: backward starts with them.
Weights shared by two units (a tied embedding and output layer) merge them into one unit.

Mixed precision: ``compute_dtype=torch.bfloat16`` (or float16) casts each shard before the
all-gather (half the bytes), runs the units' modules in 16 bits (weights, biases, inputs), and
reduces the gradients in ``reduce_dtype`` (float32) into float32 shard gradients: the masters
stay float32, since an update is often smaller than the gap between 16-bit neighbours.

Activation checkpointing (non-reentrant, e.g. the LM's ``checkpoint_activations=True``)
re-runs a block's forward inside backward, hooks included. The hooks see autograd running
(``torch._C._current_graph_task_id() != -1``): such a recompute gathers only if the unit is not
gathered already, and frees nothing, so backward needs no third all-gather.

Use it in your own loop (this file needs only torch; copy it anywhere):

    fsdp = FSDP(model, units=list(model.blocks))     # after dist.init_process_group(...)
    optimizer = torch.optim.AdamW(fsdp.parameters()) # the shards
    loss_fn(fsdp(x_local), y_local).backward()
    fsdp.finish_gradient_synchronization()           # the reduce-scatters still in flight
    optimizer.step()
    weights = fsdp.gather_full_params()              # name -> full tensor (a collective)

Every rank must run the same units in the same order (collectives pair up by order).
Gradient accumulation: k times backward() + finish_gradient_synchronization(), then step().

Run it against one process with the demo beside this file:
    python 07_parallelism/02_fsdp/run_fsdp.py --world-size 2
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

# --------------------------------------------------------------------------- the layout


def all_gather(out: torch.Tensor, shard: torch.Tensor, group):
    """Start an all-gather, out <- [rank 0's shard, rank 1's shard, ...]; returns the work."""
    if hasattr(dist, "all_gather_single"):  # newer torch's name
        return dist.all_gather_single(out, shard, group=group, async_op=True)
    return dist.all_gather_into_tensor(out, shard, group=group, async_op=True)


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, group):
    """Start a reduce-scatter, out <- rank r's block of the sum of ``full`` over ranks."""
    if hasattr(dist, "reduce_scatter_single"):
        return dist.reduce_scatter_single(out, full, group=group, async_op=True)
    return dist.reduce_scatter_tensor(out, full, group=group, async_op=True)


def rows_per_rank(rows: int, world_size: int) -> int:
    """k = ceil(rows / N): every rank holds k rows, the last ones padded with zeros."""
    return -(-rows // world_size)


def copy_rows(full: torch.Tensor, blocks: torch.Tensor, into_blocks: bool) -> None:
    """Copy a flat full tensor into its N shards, or back.

    ``blocks`` is [N, shard_numel], row r rank r's shard of this tensor (shard_numel = k x the
    elements of one row). Flattened, the tensor fills the blocks in order: its first shard_numel
    elements are rank 0's, and so on; the end of the last partly filled block, and any block
    after it, is padding, never copied.
    """
    shard_numel = blocks.shape[1]
    full_blocks, rest = divmod(full.numel(), shard_numel)
    whole = full[:full_blocks * shard_numel].view(full_blocks, shard_numel)  # [full_blocks, shard_numel]
    if into_blocks:
        blocks[:full_blocks].copy_(whole)
    else:
        whole.copy_(blocks[:full_blocks])
    if rest > 0:  # a block partly filled: the tensor's last elements, then padding
        tail = full[full_blocks * shard_numel:]  # [rest]
        if into_blocks:
            blocks[full_blocks, :rest].copy_(tail)
        else:
            tail.copy_(blocks[full_blocks, :rest])


def count_modules(module: nn.Module) -> int:
    return len(list(module.modules()))


def plan_units(module: nn.Module, unit_modules) -> list[tuple[list, list]]:
    """Which weights are gathered together, and by whose forward.

    Returns one ``(roots, slots)`` per unit. A slot ``(owner, name, weight)`` is a weight of
    2+ dimensions, held by module ``owner`` under ``name``. It belongs to the nearest module of
    ``unit_modules`` above its owner, else to its owner alone. The roots are the modules whose
    forward gathers the unit. Two units that share a weight (tied embedding and output layer)
    merge into one, gathered before either runs.
    """
    home = {}  # id(module) -> the named unit it sits in
    for unit in sorted(unit_modules, key=count_modules, reverse=True):  # outer units first,
        for inner in unit.modules():                                     # so an inner one wins
            home[id(inner)] = unit

    parent = {}  # union-find over ids of roots and weights: each set becomes one unit

    def find(key):
        parent.setdefault(key, key)
        while parent[key] != key:
            key = parent[key]
        return key

    slots = []
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None and param.dim() >= 2:
                slots.append((owner, name, param))
    roots = {}  # id(root) -> root
    for owner, name, param in slots:
        root = home.get(id(owner), owner)
        roots[id(root)] = root
        root_set = find(id(root))
        weight_set = find(id(param))
        parent[weight_set] = root_set  # the weight joins its root's unit (a tied one: both)

    units = {}  # the set's key -> (roots, slots)
    for slot in slots:
        key = find(id(slot[2]))
        units.setdefault(key, ([], []))
        units[key][1].append(slot)
    for root_id, root in roots.items():
        units[find(root_id)][0].append(root)
    return list(units.values())


class Unit:
    """One unit: its shards in one flat buffer, its full weights (storage only while gathered),
    and the state of its communication."""

    def __init__(self, slots, rank: int, world_size: int, compute_dtype):
        self.params = []  # the sharded parameters, a tied one once
        for _, _, param in slots:
            if not any(param is known for known in self.params):
                self.params.append(param)
        self.slots = []  # (owner, name, index into params): where each full weight is put
        for owner, name, param in slots:
            index = next(i for i, known in enumerate(self.params) if known is param)
            self.slots.append((owner, name, index))
        self.owners = []  # the modules holding the weights, each once
        for owner, _, _ in slots:
            if not any(owner is known for known in self.owners):
                self.owners.append(owner)
        self.casts = []  # (owner, name, parameter): the 1-D weights cast for 16-bit compute
        if compute_dtype is not None:
            for owner in self.owners:
                for name, param in owner._parameters.items():
                    if param is not None and param.dim() < 2 and param.is_floating_point():
                        self.casts.append((owner, name, param))

        # The layout: weight i's shard is k_i rows, numels[i] = k_i x (elements per row); this
        # rank's shards of every weight, one after the other, form flat_shard.
        rows = [rows_per_rank(param.shape[0], world_size) for param in self.params]
        self.numels = [k * param[0].numel() for k, param in zip(rows, self.params)]
        self.flat_shard = self.params[0].new_zeros(sum(self.numels))  # zeros: the padding
        self.full = []  # the full weights the modules compute with, in compute_dtype
        for param in self.params:
            dtype = compute_dtype if compute_dtype is not None else param.dtype
            full = nn.Parameter(torch.empty_like(param, dtype=dtype), requires_grad=param.requires_grad)
            self.full.append(full)
        shards = self.flat_shard.split(self.numels)
        for param, full, k, shard in zip(self.params, self.full, rows, shards):
            mine = param.detach()[rank * k:(rank + 1) * k].flatten()  # rows [r k, (r+1) k)
            shard[:mine.numel()].copy_(mine)
            param.data = shard.view(k, *param.shape[1:])  # now the shard: a view of flat_shard
            full.untyped_storage().resize_(0)  # storage only while gathered
        self.trainable = len([param for param in self.params if param.requires_grad])
        self.pending = self.trainable  # gradients still to come in this backward
        self.gathered = False     # the full weights hold the gathered values
        self.work = None          # an all-gather in flight
        self.buffer = None        # ... and the buffer it fills
        self.grad_buffer = None   # the full gradients, laid out for the reduce-scatter

    def columns(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        """Weight ``index``'s block of every rank's shard, in a buffer of N flat shards:
        [N, numels[index]], row r rank r's."""
        shards = buffer.view(-1, self.flat_shard.numel())  # [N, flat shard numel]
        return shards.split(self.numels, dim=1)[index]


def weak_method_hook(obj, method_name: str, *bound):
    """A hook calling ``obj.<method_name>(*bound, *hook_args)`` that does not keep ``obj``
    alive (05's weak_hook, for any method, as in zero.py: repeated so each file copies alone)."""
    obj_ref = weakref.ref(obj)

    def hook(*hook_args):
        live = obj_ref()
        if live is None:
            return None
        return getattr(live, method_name)(*bound, *hook_args)

    return hook


def cast_floating(value, dtype):
    """A floating-point tensor cast to ``dtype``; anything else as it is."""
    if torch.is_tensor(value) and value.is_floating_point():
        return value.to(dtype)
    return value


def autograd_is_running() -> bool:
    """True inside backward: a forward running now is an activation checkpoint's recompute."""
    return torch._C._current_graph_task_id() != -1


# --------------------------------------------------------------------------- FSDP


class FSDP(nn.Module):
    """Fully sharded data parallel. The optimizer takes ``fsdp.parameters()`` (the shards); a
    step is forward, backward(), ``finish_gradient_synchronization()``, step().

    ``units``: modules whose weights are gathered as one (e.g. the Transformer blocks; the
    weights outside them get a unit per module that owns them). ``compute_dtype``: cast the
    weights before the all-gather, and the units' inputs and biases (masters stay float32).
    ``reduce_dtype``: the dtype the gradients are reduce-scattered in. The wrapped model is
    ``.module``. ``average=False`` leaves the gradients summed over the ranks, not averaged
    (for a caller that scales the loss itself: lesson 7's grid, which sums every gradient).
    """

    def __init__(self, module: nn.Module, compute_dtype=None, reduce_dtype=torch.float32,
                 units=(), process_group=None, average: bool = True):
        super().__init__()
        self.module = module
        self.group = process_group
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype if reduce_dtype is not None else torch.float32
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.divisor = self.world_size if average else 1  # average=False: the sum over ranks
        # Every rank starts from rank 0's parameters and buffers (as 03-06 do).
        source = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.detach(), src=source, group=process_group)

        self.units = []
        for roots, slots in plan_units(module, units):
            unit = Unit(slots, self.rank, self.world_size, compute_dtype)
            self.units.append(unit)
            for root in roots:
                root.register_forward_pre_hook(weak_method_hook(self, "_pre_forward", unit))
                root.register_forward_hook(weak_method_hook(self, "_post_forward", unit), always_call=True)
            for index, full in enumerate(unit.full):
                if full.requires_grad:
                    full.register_post_accumulate_grad_hook(weak_method_hook(self, "_on_full_grad", unit, index))
            if compute_dtype is not None:
                for owner in unit.owners:
                    owner.register_forward_pre_hook(weak_method_hook(self, "_cast_inputs"), with_kwargs=True)
        self._replicated = [param for param in module.parameters() if param.dim() < 2 and param.requires_grad]
        self._forward_order = []     # the units in the order the first forward ran them
        self._recording = True       # until the first forward ends
        self._position = 0           # how far this forward is along _forward_order
        self._next_in_backward = {}  # unit -> the unit whose backward comes next
        self._reducing = []          # reduce-scatters in flight: (unit, work, out, grad_buffer)

    def forward(self, *args, **kwargs):
        self._position = 0
        out = self.module(*args, **kwargs)
        if self._recording:  # the first forward fixed the order; backward runs it reversed
            self._recording = False
            backward_order = list(dict.fromkeys(reversed(self._forward_order)))  # each unit once
            self._next_in_backward = dict(zip(backward_order, backward_order[1:]))
        return out

    # -- gather and free ---------------------------------------------------------------

    def _gather(self, unit: Unit | None, wait: bool = True) -> None:
        """Start the unit's all-gather unless it is in flight; with ``wait``, fill its full
        weights. (None: no unit to prefetch.)"""
        if unit is None or unit.gathered:
            return
        if unit.work is None:
            send = unit.flat_shard.to(unit.full[0].dtype)  # cast first: 16-bit weights travel in 16 bits
            unit.buffer = send.new_empty(self.world_size * send.numel())  # [N x flat shard]
            unit.work = all_gather(unit.buffer, send, self.group)
        if not wait:
            return
        unit.work.wait()
        for index, full in enumerate(unit.full):
            # Refill the same storage, through .data: autograd saved this very tensor for
            # backward, and a refill must not bump its version counter.
            full.untyped_storage().resize_(full.nbytes)
            copy_rows(full.data.view(-1), unit.columns(unit.buffer, index), into_blocks=False)
        unit.gathered = True
        unit.work = None
        unit.buffer = None

    def _reshard(self, unit: Unit) -> None:
        """Free the unit's full weights: their storage shrinks to 0 bytes, the tensors stay."""
        if not unit.gathered:
            return
        for full in unit.full:
            full.untyped_storage().resize_(0)
        unit.gathered = False

    def _swap(self, unit: Unit, to_full: bool) -> None:
        """Put the full weights (and the cast biases) into the modules, or the shards back."""
        for owner, name, index in unit.slots:
            owner._parameters[name] = unit.full[index] if to_full else unit.params[index]
        for owner, name, param in unit.casts:  # (autograd casts the gradient back)
            owner._parameters[name] = param.to(self.compute_dtype) if to_full else param

    # -- the hooks, in the order they fire ---------------------------------------------

    def _cast_inputs(self, module, args, kwargs):
        cast_args = tuple(cast_floating(arg, self.compute_dtype) for arg in args)
        cast_kwargs = {key: cast_floating(value, self.compute_dtype) for key, value in kwargs.items()}
        return cast_args, cast_kwargs

    def _pre_forward(self, unit: Unit, module, args) -> None:
        self._gather(unit)
        if not autograd_is_running():  # (a checkpoint's recompute only gathers)
            if self._recording:
                self._forward_order.append(unit)
            else:
                on_recorded_path = (self._position < len(self._forward_order)
                                    and self._forward_order[self._position] is unit)
                if on_recorded_path:
                    self._position += 1
                    if self._position < len(self._forward_order):
                        # prefetch: the next unit's all-gather runs while this one computes
                        self._gather(self._forward_order[self._position], wait=False)
        self._swap(unit, to_full=True)

    def _post_forward(self, unit: Unit, module, args, output) -> None:
        self._swap(unit, to_full=False)
        if autograd_is_running():
            return  # a recompute in backward: keep the weights, this unit's backward is next
        # A unit whose forward ends after the last unit began is where backward starts: keep
        # it gathered (not while recording: the order is not known yet).
        last_began = not self._recording and self._position == len(self._forward_order)
        if not (last_began and torch.is_grad_enabled()):
            self._reshard(unit)
        for tensor in output if isinstance(output, (tuple, list)) else [output]:
            if torch.is_tensor(tensor) and tensor.requires_grad:  # fires when backward reaches the unit
                tensor.register_hook(weak_method_hook(self, "_pre_backward", unit))

    def _pre_backward(self, unit: Unit, grad) -> None:
        self._gather(unit)
        self._gather(self._next_in_backward.get(unit), wait=False)  # prefetch the next backward's

    def _on_full_grad(self, unit: Unit, index: int, full: nn.Parameter) -> None:
        """Full weight ``index`` has its gradient (every use summed): into the reduce-scatter's
        input, laid out as the shards are."""
        if unit.grad_buffer is None:  # zeros: padding, and weights without a gradient, send zeros
            numel = self.world_size * unit.flat_shard.numel()
            unit.grad_buffer = unit.flat_shard.new_zeros(numel, dtype=self.reduce_dtype)
        copy_rows(full.grad.view(-1), unit.columns(unit.grad_buffer, index), into_blocks=True)
        full.grad = None
        unit.pending -= 1
        if unit.pending == 0:  # all its gradients are in
            if unit.trainable == len(unit.full):  # (a frozen weight may still be needed by the
                self._reshard(unit)               # backward: then free it in finish())
            self._reduce_scatter(unit)

    def _reduce_scatter(self, unit: Unit) -> None:
        out = unit.flat_shard.new_empty(unit.flat_shard.numel(), dtype=self.reduce_dtype)
        work = reduce_scatter(out, unit.grad_buffer, self.group)
        self._reducing.append((unit, work, out, unit.grad_buffer))
        unit.grad_buffer = None
        unit.pending = unit.trainable
        while len(self._reducing) > 1:  # one in flight: it overlaps the next unit's backward
            self._land(*self._reducing.pop(0))

    def _land(self, unit: Unit, work, out: torch.Tensor, grad_buffer: torch.Tensor) -> None:
        """Wait for a reduce-scatter; the mean over ranks becomes (or adds to) the shards' .grad."""
        work.wait()
        mean = out.div_(self.divisor).to(unit.flat_shard.dtype)  # sum / N, in the masters' dtype
        for param, grad in zip(unit.params, mean.split(unit.numels)):
            if not param.requires_grad:
                continue
            if param.grad is None:
                param.grad = grad.view_as(param)
            else:
                param.grad.add_(grad.view_as(param))  # accumulation over micro-batches

    # -- after backward ----------------------------------------------------------------

    def finish_gradient_synchronization(self) -> None:
        """After each backward: the reduce-scatters left, full weights freed, the replicated
        parameters' gradients averaged."""
        for unit in self.units:  # in unit order: the same collectives in the same order everywhere
            if unit.grad_buffer is not None:  # some weights had no gradient: zeros for them
                self._reduce_scatter(unit)
            if unit.work is not None:
                self._gather(unit)
            self._reshard(unit)
        while self._reducing:
            self._land(*self._reducing.pop(0))
        with_grad = [param for param in self._replicated if param.grad is not None]
        if with_grad:
            flat = torch.cat([param.grad.flatten() for param in with_grad])
            dist.all_reduce(flat, group=self.group)
            means = flat.div_(self.divisor).split([param.numel() for param in with_grad])
            for param, mean in zip(with_grad, means):
                param.grad.copy_(mean.view_as(param))

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter under the module's own names, full size, in the masters' dtype (a
        collective: call it on every rank)."""
        full_by_id = {}
        for unit in self.units:
            out = unit.flat_shard.new_empty(self.world_size * unit.flat_shard.numel())  # [N x flat shard]
            all_gather(out, unit.flat_shard, self.group).wait()
            for index, param in enumerate(unit.params):
                full = out.new_empty(unit.full[index].shape)
                copy_rows(full.view(-1), unit.columns(out, index), into_blocks=False)
                full_by_id[id(param)] = full
        gathered = {}
        for name, param in self.module.named_parameters(remove_duplicate=False):
            if id(param) in full_by_id:
                gathered[name] = full_by_id[id(param)]
            else:
                gathered[name] = param.detach().clone()  # replicated: whole already
        return gathered
