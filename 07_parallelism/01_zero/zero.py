"""Stage 07, lesson 1: ZeRO-1 and ZeRO-2, shard the optimizer state, then the gradients.

What it teaches. Data parallelism (03-06) keeps a full copy of everything on every rank.
ZeRO (Rajbhandari, Rasley, Ruwase and He, 2020) removes the copies one kind at a time while
every rank still runs the whole model on its own slice of the batch. Each parameter gets one
owner rank; only the owner keeps that parameter's optimizer state and updates it.

* ZeRO-1, ``ShardedOptimizer``: a ``torch.optim.Optimizer`` whose inner optimizer covers only
  the parameters this rank owns, so only those get state. ``step()`` updates them, then every
  owner broadcasts its updated parameters to the other ranks. Behind any DDP of 03-06 (every
  rank holds every averaged gradient, and uses the ones it owns) that is ZeRO-1.
* ZeRO-2, ``Zero2DDP``: a DDP that follows the same ownership. Gradients go into one bucket
  per owner, each bucket is *reduced* to its owner (not all-reduced), and every other rank
  frees its copy: a rank holds only the averaged gradients of what it owns.

The memory per rank, for P float32 parameters trained with AdamW on N ranks (weights 4 bytes
each, gradients 4, AdamW's two moments 8):

    DDP      4P weights + 4P   gradients + 8P   moments = 16P
    ZeRO-1   4P         + 4P             + 8P/N         = 8P + 8P/N
    ZeRO-2   4P         + 4P/N           + 8P/N         = 4P + 12P/N

Use it in your own loop (this file needs only torch; copy it anywhere):

    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    ddp = Zero2DDP(model, optimizer)        # ZeRO-2; or any DDP of 03-06 for ZeRO-1
    loss_fn(ddp(x_local), y_local).backward()
    ddp.finish_gradient_synchronization()   # each owner now holds its averaged gradients
    optimizer.step()                        # owners update, then broadcast the parameters

Gradient accumulation over k micro-batches: run the first k - 1 backwards inside
``ddp.no_sync()`` (full-size local gradients until the last backward: 4P bytes held again
meanwhile), or call ``finish_gradient_synchronization()`` after every backward (gradients
stay at 4P/N, k times the traffic).

Checkpoints: ``optimizer.consolidate_state_dict(to=0)`` on every rank, then
``optimizer.state_dict()`` on rank 0 is exactly what a plain ``torch.optim.AdamW`` over the
same parameters would save. ``optimizer.load_state_dict(saved)`` on every rank loads such a
dict (or a plain optimizer's) back, at any world size.

Run it against one process with the demo beside this file:
    python 07_parallelism/01_zero/run_zero.py --world-size 3
"""

from __future__ import annotations

import contextlib
import copy
import math
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

# --------------------------------------------------------------------------- who owns what


def global_rank(group, rank: int) -> int:
    """Collectives name their source or destination by its rank in the default group."""
    if group is None:
        return rank
    return dist.get_global_rank(group, rank)


def parameter_bytes(param: torch.Tensor) -> int:
    """What a parameter weighs when owners are dealt: its bytes, or 0 if it is frozen (no
    gradient, no optimizer state)."""
    if not param.requires_grad:
        return 0
    return param.numel() * param.element_size()


def assign_owners(params, loads: list[int]) -> dict:
    """Deal ``params`` to ranks, largest first, each to the rank with the fewest bytes so far
    (ties: the lowest rank). ``loads[rank]`` holds the bytes each rank owns already, and is
    updated. Dealing largest first leaves no rank more than one parameter above the mean."""
    owners = {}
    for param in sorted(params, key=parameter_bytes, reverse=True):
        lightest = loads.index(min(loads))
        owners[param] = lightest
        loads[lightest] += parameter_bytes(param)
    return owners


def group_options(group: dict) -> dict:
    """A param group's options (lr, betas, weight_decay, ...) without its parameters."""
    return {key: value for key, value in group.items() if key not in ("params", "param_names")}


# --------------------------------------------------------------------------- ZeRO-1


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1: each rank keeps the optimizer state of the parameters it owns, and no other.

    ``ShardedOptimizer(params, torch.optim.AdamW, lr=1e-3)`` takes what a plain optimizer
    takes (parameters or param groups, then its options). ``param_groups`` are a plain
    optimizer's, every option filled in, so learning-rate schedulers work; ``.optim`` is the
    inner ``optimizer_cls`` over the owned parameters only, which holds the only state
    (``.state`` is its state). Call ``step()`` once every rank holds the averaged gradients
    of the parameters it owns.
    """

    def __init__(self, params, optimizer_cls, process_group=None, **kwargs):
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.owner = {}                      # parameter -> the rank that keeps its state
        self._loads = [0] * self.world_size  # bytes each rank owns so far
        self.optim = None                    # the inner optimizer, built once the groups are dealt
        self._consolidated = None            # the gathered state dict, on the rank it went to

        super().__init__(params, dict(kwargs))  # calls add_param_group for each group
        self.optim = optimizer_cls([self._owned(group) for group in self.param_groups], **kwargs)
        self.defaults = self.optim.defaults
        self.state = self.optim.state  # this rank's shard of the state
        for group in self.param_groups:  # every option filled in, as in a plain optimizer's groups
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def _owned(self, group: dict) -> dict:
        """The same group, with only the parameters this rank owns (possibly none)."""
        owned = [param for param in group["params"] if self.owner[param] == self.rank]
        return {**group_options(group), "params": owned}

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        new_group = self.param_groups[-1]
        self.owner.update(assign_owners(new_group["params"], self._loads))
        if self.optim is not None:  # a group added after __init__: the inner optimizer gets its share
            self.optim.add_param_group(self._owned(new_group))

    def step(self, closure=None):
        for group, inner_group in zip(self.param_groups, self.optim.param_groups):
            inner_group.update(group_options(group))  # a scheduler changed lr here: pass it on
        loss = self.optim.step(closure)  # the owned parameters, from the owned state
        self._consolidated = None
        self.broadcast_parameters()
        return loss

    @torch.no_grad()
    def broadcast_parameters(self) -> None:
        """Every trainable parameter from its owner: the owner packs its parameters into one
        flat buffer, one broadcast per owner (per dtype and device: a buffer holds one dtype,
        on one device), and the others unpack it. Every rank walks the owners in the same
        order, so the broadcasts pair up."""
        by_owner = [{} for _ in range(self.world_size)]  # rank -> (dtype, device) -> its parameters
        for group in self.param_groups:
            for param in group["params"]:
                if param.requires_grad:
                    key = (param.dtype, param.device)
                    by_owner[self.owner[param]].setdefault(key, []).append(param)
        for owner in range(self.world_size):
            for (dtype, device), params in by_owner[owner].items():
                sizes = [param.numel() for param in params]
                if owner == self.rank:
                    flat = torch.cat([param.reshape(-1) for param in params])
                else:
                    flat = torch.empty(sum(sizes), dtype=dtype, device=device)
                dist.broadcast(flat, global_rank(self.process_group, owner), group=self.process_group)
                if owner != self.rank:
                    for param, value in zip(params, flat.split(sizes)):
                        param.copy_(value.view_as(param))

    def _parameter_index(self) -> dict:
        """Parameter -> its number in a state dict: 0, 1, ... over the groups in order, as a
        plain optimizer numbers them."""
        index = {}
        for group in self.param_groups:
            for param in group["params"]:
                index[param] = len(index)
        return index

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's shard of the state on rank ``to`` (call it on every rank: it is
        a collective); ``state_dict()`` on rank ``to`` then returns what a plain
        ``optimizer_cls`` over the same parameters would save."""
        index = self._parameter_index()
        mine = {}  # parameter number -> a CPU copy of its state (AdamW: step, exp_avg, exp_avg_sq)
        for param, state in self.optim.state.items():
            mine[index[param]] = {key: value.to("cpu", copy=True) if torch.is_tensor(value) else value
                                  for key, value in state.items()}
        shards = [None] * self.world_size if self.rank == to else None
        dist.gather_object(mine, shards, global_rank(self.process_group, to), self.process_group)
        if self.rank != to:
            return
        gathered = {}
        for shard in shards:
            gathered.update(shard)
        groups = [{**group, "params": [index[param] for param in group["params"]]}
                  for group in self.param_groups]
        self._consolidated = {"state": dict(sorted(gathered.items())), "param_groups": groups}

    def state_dict(self) -> dict:
        if self._consolidated is None:
            raise RuntimeError("ShardedOptimizer.state_dict(): each rank holds a shard; call "
                               "consolidate_state_dict(to=r) on every rank, then this on rank r")
        return self._consolidated

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a consolidated state dict, or a plain optimizer's (the same format), on every
        rank, at any world size: the dict numbers the parameters 0, 1, ... over the groups as
        a plain optimizer does, so each rank keeps a copy of the entries of the parameters it
        owns now, whoever owned them when it was saved. Every rank loads the groups' options
        (lr, betas, ...). Training then resumes exactly where it stopped."""
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        saved_sizes = [len(group["params"]) for group in saved_groups]
        sizes = [len(group["params"]) for group in self.param_groups]
        if saved_sizes != sizes:  # zip() below would silently drop the difference
            raise ValueError(f"ShardedOptimizer.load_state_dict: param groups of {saved_sizes} "
                             f"parameters in the state dict, {sizes} here")
        # The inner optimizer numbers only the owned parameters, group by group: renumber.
        inner_state = {}
        inner_groups = []
        inner_number = 0
        for group, saved_group in zip(self.param_groups, saved_groups):
            group.update(group_options(saved_group))  # the plain groups, as schedulers see them
            first = inner_number
            for param, saved_number in zip(group["params"], saved_group["params"]):
                if self.owner[param] != self.rank:
                    continue
                if saved_number in saved_state:  # (a parameter never stepped has no state)
                    inner_state[inner_number] = copy.deepcopy(saved_state[saved_number])
                inner_number += 1
            inner_groups.append({**group_options(saved_group), "params": list(range(first, inner_number))})
        self.optim.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        self.state = self.optim.state  # loading made a new dict there
        self._consolidated = None


# --------------------------------------------------------------------------- ZeRO-2


def broadcast_module_state(module: nn.Module, group=None) -> None:
    """Make every rank start from rank 0's parameters and buffers, as 03-06 do (repeated on
    purpose, so that this file stays copyable on its own)."""
    src = global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.detach(), src=src, group=group)


def weak_method_hook(obj, method_name: str, *bound):
    """A hook calling ``obj.<method_name>(*bound, *hook_args)`` that does not keep ``obj``
    alive (05's weak_hook, for any method). Hooks live in autograd's C++ state, where Python's
    garbage collector cannot see: a hook holding the wrapper (which holds the model, which
    holds the hook) would be a cycle never freed."""
    obj_ref = weakref.ref(obj)

    def hook(*hook_args):
        live = obj_ref()
        if live is None:  # the wrapper is gone: leave the gradient alone
            return None
        return getattr(live, method_name)(*bound, *hook_args)

    return hook


class Bucket:
    """One owner's gradients: reduced to that owner in one call, from one flat buffer."""

    def __init__(self, owner: int, params: list[torch.Tensor]):
        self.owner = owner
        self.params = params
        self.reset()

    def reset(self) -> None:
        """Empty again for the next step. The buffer is dropped here; the owner's lives on
        as its parameters' .grad."""
        self.buffer = None  # allocated at the first gradient, freed once reduced
        self.views = []     # views[slot]: params[slot]'s gradient, inside the buffer
        self.had = [False] * len(self.params)  # had[slot]: this rank had a gradient for it
        self.pending = len(self.params)        # gradients still to come this step
        self.work = None    # the reduce in flight

    def view(self, slot: int) -> torch.Tensor:
        """params[slot]'s place in the buffer, the buffer allocated on first use."""
        if self.buffer is None:
            sizes = [param.numel() for param in self.params]
            self.buffer = self.params[0].new_empty(sum(sizes))
            self.views = []
            for flat_view, param in zip(self.buffer.split(sizes), self.params):
                self.views.append(flat_view.view_as(param))
        return self.views[slot]


def owner_buckets(params: list[torch.Tensor], owner: dict, bucket_size_mb: float | None) -> list[Bucket]:
    """Stage 06's bucket rule, per owner (and per dtype and device): parameters taken in
    reverse registration order (roughly the order backward produces their gradients), a
    bucket closed when the next parameter would take it past ``bucket_size_mb`` MiB. Buckets
    are sorted by the position of their last parameter: the order they complete in, so
    every rank launches them in that same order."""
    cap_bytes = math.inf if bucket_size_mb is None else bucket_size_mb * 2**20
    filling = {}  # (owner, dtype, device) -> the bucket being filled for it
    closed = []
    for position, param in enumerate(reversed(params)):
        key = (owner[param], param.dtype, param.device)
        nbytes = param.numel() * param.element_size()
        if key in filling and filling[key]["bytes"] + nbytes > cap_bytes:
            closed.append(filling.pop(key))  # full: close it, the parameter opens a new one
        if key not in filling:
            filling[key] = {"owner": owner[param], "params": [], "bytes": 0}
        bucket = filling[key]
        bucket["params"].append(param)
        bucket["bytes"] += nbytes
        bucket["last"] = position
    closed.extend(filling.values())
    closed.sort(key=lambda bucket: bucket["last"])
    return [Bucket(bucket["owner"], bucket["params"]) for bucket in closed]


class Zero2DDP(nn.Module):
    """ZeRO-2: after ``finish_gradient_synchronization()`` each rank holds the averaged
    gradients of the parameters it owns in ``optimizer`` (a :class:`ShardedOptimizer` over
    the module's parameters), and no other gradients.

    Used as the DDPs of 05 and 06: ``loss.backward()``, ``finish_gradient_synchronization()``,
    ``optimizer.step()``; ``no_sync()`` for gradient accumulation. Inside backward, each
    gradient is copied, divided by N, into its owner's bucket, and ``.grad`` is freed; a
    complete bucket is reduced to its owner (at most two in flight), and once reduced it is
    freed on every other rank.
    """

    def __init__(self, module: nn.Module, optimizer: ShardedOptimizer, bucket_size_mb: float | None = 25.0):
        super().__init__()
        params = [param for param in module.parameters() if param.requires_grad]
        self.module = module
        self.process_group = optimizer.process_group
        self.rank = optimizer.rank
        self.world_size = optimizer.world_size
        broadcast_module_state(module, self.process_group)

        self.buckets = owner_buckets(params, optimizer.owner, bucket_size_mb)
        for index, bucket in enumerate(self.buckets):
            for slot, param in enumerate(bucket.params):
                # before autograd adds a new gradient to .grad (see _set_aside) ...
                param.register_hook(weak_method_hook(self, "_set_aside", index, slot))
                # ... and after: the gradient is final, it goes into the bucket
                param.register_post_accumulate_grad_hook(weak_method_hook(self, "_on_grad_ready", index, slot))
        # The flags of finish() are bookkeeping: on the host under Gloo (no GPU round trip),
        # on the gradients' device under NCCL (which moves GPU memory only).
        if dist.get_backend(self.process_group) == "nccl":
            self._flag_device = params[0].device
        else:
            self._flag_device = "cpu"
        self._require_sync = True
        self._next = 0  # index of the next bucket to reduce
        self._averaged = weakref.WeakValueDictionary()  # id(param) -> the .grad finish gave it
        self._kept = {}  # param -> that average, set aside while a later backward runs

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate full-size local gradients (no communication) for the backwards run
        inside; the next synchronised backward reduces the sum."""
        previous = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = previous

    # -- inside backward ---------------------------------------------------------------

    def _set_aside(self, index: int, slot: int, grad=None) -> None:
        """The accumulation trap: the owner's ``.grad`` holds an average from an earlier
        synchronised micro-batch; autograd would add the next local gradient to it, and
        reducing that sum would count the average again. Keep it apart until ``finish``
        adds it back."""
        param = self.buckets[index].params[slot]
        if param.grad is not None and self._averaged.get(id(param)) is param.grad:
            self._kept[param] = param.grad
            param.grad = None

    def _fill(self, index: int, slot: int) -> None:
        """This rank's share of the mean into the bucket: its gradient / N, or zeros."""
        bucket = self.buckets[index]
        param = bucket.params[slot]
        self._set_aside(index, slot)
        bucket.had[slot] = param.grad is not None
        view = bucket.view(slot)
        if param.grad is not None:
            torch.div(param.grad, self.world_size, out=view)  # the reduce sums the shares: the mean
        else:
            view.zero_()
        param.grad = None  # freed on every rank: the bucket holds it now

    def _on_grad_ready(self, index: int, slot: int, param: torch.Tensor) -> None:
        if not self._require_sync:  # inside no_sync(): the gradient stays in .grad
            return
        self._fill(index, slot)
        self.buckets[index].pending -= 1
        # In index order on every rank, whatever order this rank's gradients come in.
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch()

    def _launch(self) -> None:
        """Reduce the next bucket to its owner, asynchronously."""
        bucket = self.buckets[self._next]
        self._next += 1
        owner = global_rank(self.process_group, bucket.owner)
        bucket.work = dist.reduce(bucket.buffer, owner, group=self.process_group, async_op=True)
        if self._next > 2:  # at most two reduces in flight: wait for the one before them
            done = self.buckets[self._next - 3]
            done.work.wait()
            if done.owner != self.rank:  # not ours: freed now, not at the end of backward
                done.buffer = None
                done.views = []

    # -- after backward ----------------------------------------------------------------

    def finish_gradient_synchronization(self) -> None:
        """Reduce what backward did not, wait, and give each owner its averaged gradients."""
        if not self._require_sync:
            return
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            for slot, had in enumerate(bucket.had):
                if not had:  # no gradient in this backward: what no_sync() left, else zeros
                    self._fill(self._next, slot)
            self._launch()
        # One flag per parameter, summed over ranks: 0 means no rank had a gradient for it,
        # and its .grad stays None, as in single-process training.
        had_here = []
        for bucket in self.buckets:
            had_here.extend(bucket.had)
        flags = torch.tensor(had_here, dtype=torch.int32, device=self._flag_device)
        dist.all_reduce(flags, group=self.process_group)
        ranks_that_had = flags.tolist()
        position = 0
        for bucket in self.buckets:
            bucket.work.wait()
            for slot, param in enumerate(bucket.params):
                param.grad = self._kept.pop(param, None)  # None, unless an earlier average was set aside
                if ranks_that_had[position] > 0 and bucket.owner == self.rank:
                    mean = bucket.views[slot]
                    if param.grad is not None:
                        mean.add_(param.grad)
                    param.grad = mean
                    self._averaged[id(param)] = mean
                position += 1
            bucket.reset()  # the buffer is dropped here; the owner's lives on as .grad
        self._next = 0
