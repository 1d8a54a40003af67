"""Not a lesson: the counters 07's lessons measure with (torch alone; copy it anywhere).

They read the tensors and the calls, never a formula, so a count can stand beside the
formula a lesson derives: ``state_bytes`` (bytes held, each storage once), ``SavedActivations``
(bytes saved for backward), ``CommCounter`` (each ``torch.distributed`` collective and the
bytes this rank sends), ``FunctionalCommCounter`` (the same for DTensor's functional
collectives) and ``GatheredWeights`` (the most full weights lesson 2's FSDP holds at once).

    with CommCounter(axes={"tp": tp_group, "dp": dp_group}) as comm:
        loss = model(x).sum()
        loss.backward()
    print(comm.sent_bytes, comm.by_label, comm.by_axis)
"""

import contextlib
import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode


def local_part(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def storage_key(t: torch.Tensor) -> tuple:
    """Views of one storage share this key."""
    return (t.device, local_part(t).untyped_storage().data_ptr())


def state_bytes(tensors) -> int:
    """Bytes held by ``tensors`` (None skipped), each storage counted once."""
    size_of = {storage_key(t): local_part(t).untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(size_of.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` (AdamW: exp_avg, exp_avg_sq, step)."""
    return state_bytes(value for state in optimizer.state.values() for value in state.values()
                       if isinstance(value, torch.Tensor))


class SavedActivations(contextlib.ExitStack):
    """``with SavedActivations(model) as saved: loss = model(x)`` -> ``saved.bytes``.

    Each storage autograd saves for backward, once, at its size when saved; not ``model``'s
    parameters, nor the storages ``exclude_now()`` names when a tensor is saved (FSDP's
    gathered weights). An activation checkpoint's inputs, which it keeps alive, are counted.
    """

    def __init__(self, model: nn.Module | None = None, exclude_now=set):
        super().__init__()
        self.weights = set()  # the storage keys of model's parameters
        if model is not None:
            self.weights = {storage_key(p) for p in model.parameters()}
        self.exclude_now = exclude_now
        self.seen = {}  # storage key -> bytes

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())

    def count(self, t):
        if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
            key = storage_key(t)
            if key not in self.weights and key not in self.exclude_now() and key not in self.seen:
                self.seen[key] = local_part(t).untyped_storage().nbytes()
        return t

    def __enter__(self):
        self.enter_context(torch.autograd.graph.saved_tensors_hooks(self.count, lambda t: t))
        # The LM looks checkpoint up at call time: wrapped, it counts each block's inputs.
        original = torch.utils.checkpoint.checkpoint

        def counted_checkpoint(function, *args, **kwargs):
            for arg in args:
                self.count(arg)
            return original(function, *args, **kwargs)

        torch.utils.checkpoint.checkpoint = counted_checkpoint
        self.callback(setattr, torch.utils.checkpoint, "checkpoint", original)
        return self


def gathered_bytes(fsdp) -> int:
    """Bytes of full weights lesson 2's FSDP holds now (a freed one's storage is 0 bytes)."""
    return sum(full.untyped_storage().nbytes() for unit in fsdp.units for full in unit.full)


def gathered_storage_keys(fsdp) -> set:
    """Storage keys of the full weights lesson 2's FSDP holds now: weights, not activations."""
    return {storage_key(full) for unit in fsdp.units for full in unit.full
            if full.untyped_storage().nbytes() > 0}


class GatheredWeights(contextlib.ExitStack):
    """``with GatheredWeights(fsdp) as gathered: ...`` -> ``gathered.peak_bytes``: the most
    bytes of full weights lesson 2's FSDP held at once, read after each of this object's
    ``_gather`` calls (weights are only allocated there)."""

    def __init__(self, fsdp):
        super().__init__()
        self.fsdp = fsdp
        self.peak_bytes = 0

    def __enter__(self):
        self.peak_bytes = gathered_bytes(self.fsdp)
        original = self.fsdp._gather

        def counted_gather(*args, **kwargs):
            out = original(*args, **kwargs)
            self.peak_bytes = max(self.peak_bytes, gathered_bytes(self.fsdp))
            return out

        self.fsdp._gather = counted_gather  # found before the class's method, deleted on exit
        self.callback(delattr, self.fsdp, "_gather")
        return self


def ring_send_bytes(op: str, payload: int, world_size: int) -> float:
    """Bytes one rank sends of an N-byte payload on a ring of n ranks: all_reduce 2 (n-1)/n N;
    all_gather, reduce_scatter (N: the full tensor), broadcast, reduce (n-1)/n N; send N."""
    if op == "send":
        return float(payload)
    share = (world_size - 1) / world_size * payload  # 0.0 on one rank
    return 2 * share if op == "all_reduce" else share


def tensor_bytes(t) -> int:
    """Bytes of a tensor, or of a list of tensors."""
    return sum(tensor_bytes(x) for x in t) if isinstance(t, (list, tuple)) else t.numel() * t.element_size()


def tensor_dtype(t):
    """The dtype of a tensor, or of the first of a list of tensors (None for an empty list)."""
    return (tensor_dtype(t[0]) if t else None) if isinstance(t, (list, tuple)) else t.dtype


# name on torch.distributed -> (the kind of collective, the argument whose size is the payload)
RING_COLLECTIVES = {
    "all_reduce": ("all_reduce", "tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "broadcast": ("broadcast", "tensor"),
    "reduce": ("reduce", "tensor"),
    "send": ("send", "tensor"),
}


def all_to_all_single_sent(arguments: dict) -> tuple:
    """(payload, bytes sent to other ranks, tensors moved) of ``all_to_all_single``: rank j
    gets ``input_split_sizes[j]`` rows (equal shares if not given); its own stay home."""
    data = arguments["input"]
    group = arguments.get("group")
    payload = tensor_bytes(data)
    splits = arguments.get("input_split_sizes")
    if not splits:
        return payload, payload - payload // dist.get_world_size(group), data
    bytes_per_row = payload // max(1, data.shape[0])
    return payload, bytes_per_row * (sum(splits) - splits[dist.get_rank(group)]), data


def all_to_all_sent(arguments: dict) -> tuple:
    """(payload, bytes sent, tensors moved) of ``all_to_all``: every input but this rank's own."""
    inputs = arguments["input_tensor_list"]
    rank = dist.get_rank(arguments.get("group"))
    payload = tensor_bytes(inputs)
    return payload, payload - tensor_bytes(inputs[rank]), inputs


def total(calls: list[dict], key: str) -> dict[str, dict]:
    """Calls summed by ``key``: {value: {"ops": [op, ...], "payload_bytes", "sent_bytes"}}."""
    out = {}
    for call in calls:
        entry = out.setdefault(call[key], {"ops": [], "payload_bytes": 0, "sent_bytes": 0.0})
        entry["ops"].append(call["op"])
        entry["payload_bytes"] += call["payload_bytes"]
        entry["sent_bytes"] += call["sent_bytes"]
    return out


def batch_sent(arguments: dict) -> tuple:
    """(payload, bytes sent, tensors sent) of ``batch_isend_irecv``: its isend operations'.
    Counted here, not at ``dist.isend``: a ``P2POp`` accepts only torch's own ``isend``."""
    sent = [op.tensor for op in arguments["p2p_op_list"] if op.op.__name__ == "isend"]
    return tensor_bytes(sent), tensor_bytes(sent), sent


# name on torch.distributed -> (kind, function of the bound arguments -> (payload, sent, tensors))
OTHER_COLLECTIVES = {
    "all_to_all_single": ("all_to_all", all_to_all_single_sent),
    "all_to_all": ("all_to_all", all_to_all_sent),
    "batch_isend_irecv": ("send", batch_sent),
}


class CommCounter(contextlib.ExitStack):
    """``with CommCounter(axes) as comm: ...`` -> ``comm.calls``, ``comm.sent_bytes``,
    ``comm.by_label``, ``comm.by_axis``.

    Each call is a dict: ``op``, ``payload_bytes``, ``sent_bytes`` (what this rank sends:
    :func:`ring_send_bytes` for the ring collectives, the rows bound elsewhere for an
    all-to-all), ``dtype``, ``label`` (``comm.current`` at the call; a hook may set it) and
    ``axis`` (its group's name in ``axes``, {name: process group}; "world" for the default
    group, "other" for one not named). Plain ``dist.isend`` / ``dist.irecv`` are not counted.
    """

    def __init__(self, axes: dict | None = None):
        super().__init__()
        self.calls = []
        self.current = ""
        self.axes = dict(axes or {})

    @property
    def sent_bytes(self) -> float:
        return sum(call["sent_bytes"] for call in self.calls)

    @property
    def by_label(self) -> dict[str, dict]:
        return total(self.calls, "label")

    @property
    def by_axis(self) -> dict[str, dict]:
        return total(self.calls, "axis")

    def axis_of(self, group) -> str:
        for name, axis_group in self.axes.items():
            if group is axis_group:      # the same object: two axes may hold the same ranks
                return name
        return "world" if group is None or group is dist.GroupMember.WORLD else "other"

    def wrap(self, name: str, original):
        signature = inspect.signature(original)

        def counted(*args, **kwargs):
            arguments = signature.bind(*args, **kwargs).arguments  # read by name, however passed
            group = arguments.get("group")
            if name in RING_COLLECTIVES:
                kind, argument = RING_COLLECTIVES[name]
                moved = arguments[argument]
                payload = tensor_bytes(moved)
                sent = ring_send_bytes(kind, payload, dist.get_world_size(group))
            else:
                kind, measure = OTHER_COLLECTIVES[name]
                payload, sent, moved = measure(arguments)
            if name == "batch_isend_irecv" and arguments["p2p_op_list"]:  # one group a batch
                group = arguments["p2p_op_list"][0].group
            self.calls.append({"op": kind, "payload_bytes": payload, "sent_bytes": sent,
                               "dtype": tensor_dtype(moved), "label": self.current,
                               "axis": self.axis_of(group)})
            return original(*args, **kwargs)
        return counted

    def __enter__(self):
        for name in [*RING_COLLECTIVES, *OTHER_COLLECTIVES]:
            if hasattr(dist, name):  # all_gather_single and reduce_scatter_single are newer than some torch
                original = getattr(dist, name)
                setattr(dist, name, self.wrap(name, original))
                self.callback(setattr, dist, name, original)  # put back on exit
        return self


class FunctionalCommCounter(TorchDispatchMode):
    """``with FunctionalCommCounter(axes) as comm: ...``: the collectives torch's DTensor issues.

    They run below the Python functions CommCounter wraps, so they are caught at dispatch and
    recorded as CommCounter records them, the axis matched by its group's name."""

    KINDS = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
             "all_reduce": "all_reduce"}

    def __init__(self, axes: dict | None = None):
        super().__init__()
        self.current = ""
        self.calls = []
        self.axes = dict(axes or {})

    sent_bytes = CommCounter.sent_bytes
    by_axis = CommCounter.by_axis

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name in self.KINDS:
            payload = args[0].numel() * args[0].element_size()
            if name == "all_gather_into_tensor":
                payload = payload * args[1]  # args: input, group size, group name
            group_name = args[-1]            # the last argument of all three
            # The group's size: its name is all these ops carry (a private lookup, torch 2.x)
            group = dist.distributed_c10d._resolve_process_group(group_name)
            kind = self.KINDS[name]
            axis = next((axis for axis, g in self.axes.items() if g.group_name == group_name), "other")
            sent = ring_send_bytes(kind, payload, dist.get_world_size(group))
            self.calls.append({"op": kind, "payload_bytes": payload, "sent_bytes": sent,
                               "label": self.current, "axis": axis})
            # Waited for at once: a Gloo collective left in flight under this mode crashed
            # (SIGSEGV in wait_tensor) in a loaded run; torch's later wait finds it done.
            out = func(*args, **(kwargs or {}))
            return torch.ops._c10d_functional.wait_tensor(out)
        return func(*args, **(kwargs or {}))
