"""Not a lesson: the counters 07's lessons measure with (torch alone; copy it anywhere).

They read the tensors and the calls themselves, never a formula, so a count can stand beside
the formula a lesson derives, and a wrong implementation shows up as a gap:

* ``state_bytes(tensors)``: bytes held, each storage once (tied weights, views of one buffer).
* ``SavedActivations``: bytes autograd saves for backward (``saved_tensors_hooks``).
* ``CommCounter``: every ``torch.distributed`` collective called from Python while it is
  active, with the bytes this rank sends (as a ring sends them, for the ring collectives),
  and, given the process groups by name, the axis each call ran on.
* ``FunctionalCommCounter``: the same for the functional collectives torch's DTensor issues
  (tensor parallelism's ``parallelize_module``), caught at dispatch.
* ``GatheredWeights``: the most bytes of full weights lesson 2's FSDP holds at once, and
  ``gathered_storage_keys``: where those weights live now. Both read its units' storages;
  the FSDP file itself keeps no count.

    with CommCounter(axes={"tp": tp_group, "dp": dp_group}) as comm:
        loss = model(x).sum()
        loss.backward()
    print(comm.sent_bytes, comm.by_label, comm.by_axis)
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode


def local_part(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor itself."""
    if hasattr(t, "to_local"):
        return t.to_local()
    return t


def storage_key(t: torch.Tensor) -> tuple:
    """Views of one storage share this key."""
    return (t.device, local_part(t).untyped_storage().data_ptr())


def state_bytes(tensors) -> int:
    """Bytes held by ``tensors`` (None skipped), each storage counted once."""
    size_of = {}
    for t in tensors:
        if t is None:
            continue
        size_of[storage_key(t)] = local_part(t).untyped_storage().nbytes()
    return sum(size_of.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` (AdamW: exp_avg, exp_avg_sq, step)."""
    tensors = []
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                tensors.append(value)
    return state_bytes(tensors)


class SavedActivations(contextlib.ExitStack):
    """``with SavedActivations(model) as saved: loss = model(x)`` -> ``saved.bytes``.

    Each storage autograd saves for backward, once, at its size when saved. Weights are not
    activations: ``model``'s parameters are left out, and so are the storages that
    ``exclude_now()`` names at the moment a tensor is saved (FSDP's gathered weights live in
    storage that changes at every gather). Inside a non-reentrant activation checkpoint
    autograd saves nothing; the checkpoint keeps its inputs alive, so those are counted.
    """

    def __init__(self, model: nn.Module | None = None, exclude_now=set):
        super().__init__()
        self.weights = set()
        if model is not None:
            for p in model.parameters():
                self.weights.add(storage_key(p))
        self.exclude_now = exclude_now
        self.seen = {}  # storage key -> bytes

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())

    def count(self, t):
        if not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter):
            return t
        key = storage_key(t)
        if key in self.weights or key in self.exclude_now():
            return t
        if key not in self.seen:
            self.seen[key] = local_part(t).untyped_storage().nbytes()
        return t

    def __enter__(self):
        hooks = torch.autograd.graph.saved_tensors_hooks(self.count, unpack_hook)
        self.enter_context(hooks)
        # The LM looks torch.utils.checkpoint.checkpoint up at call time: wrap it to count
        # the inputs each checkpointed block keeps alive.
        original = torch.utils.checkpoint.checkpoint

        def counted_checkpoint(function, *args, **kwargs):
            for arg in args:
                self.count(arg)
            return original(function, *args, **kwargs)

        torch.utils.checkpoint.checkpoint = counted_checkpoint
        self.callback(setattr, torch.utils.checkpoint, "checkpoint", original)
        return self


def unpack_hook(t):
    return t


def gathered_bytes(fsdp) -> int:
    """Bytes of full weights allocated now in lesson 2's FSDP: its units' full tensors, whose
    storage is resized to 0 bytes whenever they are freed."""
    total_bytes = 0
    for unit in fsdp.units:
        for full in unit.full:
            total_bytes += full.untyped_storage().nbytes()
    return total_bytes


def gathered_storage_keys(fsdp) -> set:
    """Storage keys of the full weights lesson 2's FSDP holds now: tensors autograd saves
    there are weights, not activations (``SavedActivations(exclude_now=...)``)."""
    keys = set()
    for unit in fsdp.units:
        for full in unit.full:
            if full.untyped_storage().nbytes() > 0:
                keys.add(storage_key(full))
    return keys


class GatheredWeights(contextlib.ExitStack):
    """``with GatheredWeights(fsdp) as gathered: ...`` -> ``gathered.peak_bytes``: the most
    bytes of full weights that lesson 2's FSDP held at once (not counting the receive buffer
    of an all-gather in flight). It wraps this one object's ``_gather`` from outside and reads
    the storages after every gather (weights are only allocated there); on exit the class's
    own method is back."""

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

        self.fsdp._gather = counted_gather  # an attribute of this object: found before the class's
        self.callback(delattr, self.fsdp, "_gather")
        return self


def ring_send_bytes(op: str, payload: int, world_size: int) -> float:
    """Bytes one rank sends for a collective whose payload is N bytes, run as a ring of n ranks.

    all_reduce (a reduce-scatter, then an all-gather): 2 (n-1)/n N. all_gather and
    reduce_scatter (N: the full tensor), and a pipelined chain broadcast or reduce (averaged
    over the ranks): (n-1)/n N. A point-to-point send: N.
    """
    if op == "send":
        return float(payload)
    if world_size == 1:
        return 0.0
    share = (world_size - 1) / world_size * payload
    if op == "all_reduce":
        return 2 * share
    return share


def tensor_bytes(t) -> int:
    """Bytes of a tensor, or of a list of tensors."""
    if isinstance(t, (list, tuple)):
        return sum(tensor_bytes(x) for x in t)
    return t.numel() * t.element_size()


def tensor_dtype(t):
    """The dtype of a tensor, or of the first of a list of tensors (None for an empty list)."""
    if isinstance(t, (list, tuple)):
        if not t:
            return None
        return tensor_dtype(t[0])
    return t.dtype


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


def all_to_all_single_sent(arguments: dict) -> tuple[int, int]:
    """(payload, bytes sent to other ranks) of ``all_to_all_single``: the input's rows for
    rank j are ``input_split_sizes[j]`` (equal shares if not given); its own stay home."""
    data = arguments["input"]
    group = arguments.get("group")
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    payload = tensor_bytes(data)
    splits = arguments.get("input_split_sizes")
    if not splits:
        return payload, payload - payload // world_size
    bytes_per_row = payload // max(1, data.shape[0])
    return payload, bytes_per_row * (sum(splits) - splits[rank])


def all_to_all_sent(arguments: dict) -> tuple[int, int]:
    """(payload, bytes sent to other ranks) of ``all_to_all``: every input but this rank's own."""
    inputs = arguments["input_tensor_list"]
    rank = dist.get_rank(arguments.get("group"))
    payload = tensor_bytes(inputs)
    return payload, payload - tensor_bytes(inputs[rank])


def group_of(name: str, arguments: dict):
    """The process group a call ran on (None: the default group). A batch of sends and
    receives names it in each ``P2POp``; every op of one batch is on one group here."""
    if name == "batch_isend_irecv":
        operations = arguments["p2p_op_list"]
        if not operations:
            return None
        return operations[0].group
    return arguments.get("group")


def total(calls: list[dict], key: str) -> dict[str, dict]:
    """Calls summed by ``key`` ("label" or "axis"):
    {value: {"ops": [op, ...], "payload_bytes": ..., "sent_bytes": ...}}."""
    out = {}
    for call in calls:
        if call[key] not in out:
            out[call[key]] = {"ops": [], "payload_bytes": 0, "sent_bytes": 0.0}
        entry = out[call[key]]
        entry["ops"].append(call["op"])
        entry["payload_bytes"] += call["payload_bytes"]
        entry["sent_bytes"] += call["sent_bytes"]
    return out


def batch_sent(arguments: dict) -> tuple[int, int]:
    """(payload, bytes sent) of ``batch_isend_irecv``: the tensors of its isend operations.

    Counted here, not at ``dist.isend``: a ``P2POp`` accepts only torch's own ``isend`` and
    ``irecv``, so a wrapped ``dist.isend`` would break every batch built with it."""
    sent = 0
    for op in arguments["p2p_op_list"]:
        if op.op.__name__ == "isend":
            sent += tensor_bytes(op.tensor)
    return sent, sent


def batch_tensors(arguments: dict) -> list:
    """The tensors a ``batch_isend_irecv`` sends."""
    sent = []
    for op in arguments["p2p_op_list"]:
        if op.op.__name__ == "isend":
            sent.append(op.tensor)
    return sent


def all_to_all_single_tensors(arguments: dict) -> torch.Tensor:
    return arguments["input"]


def all_to_all_tensors(arguments: dict) -> list:
    return arguments["input_tensor_list"]


# name on torch.distributed -> (kind, function of the bound arguments -> (payload, sent))
OTHER_COLLECTIVES = {
    "all_to_all_single": ("all_to_all", all_to_all_single_sent),
    "all_to_all": ("all_to_all", all_to_all_sent),
    "batch_isend_irecv": ("send", batch_sent),
}
# name on torch.distributed -> function of the bound arguments -> the tensors it moves (for the dtype)
OTHER_TENSORS = {
    "all_to_all_single": all_to_all_single_tensors,
    "all_to_all": all_to_all_tensors,
    "batch_isend_irecv": batch_tensors,
}


class CommCounter(contextlib.ExitStack):
    """``with CommCounter(axes) as comm: ...`` -> ``comm.calls``, ``comm.sent_bytes``,
    ``comm.by_label``, ``comm.by_axis``.

    Each call is a dict: ``op`` (all_reduce, all_gather, reduce_scatter, broadcast, reduce,
    send, all_to_all), ``payload_bytes``, ``sent_bytes`` (what this rank sends: a ring's share
    for the ring collectives, see :func:`ring_send_bytes`; the rows bound elsewhere for an
    all-to-all; the sent tensors of a batch of sends and receives), ``dtype`` (of the tensors
    moved; None for an empty batch), ``label``, whatever ``comm.current`` held at the call (a
    hook may set it: "fc1 backward"), and ``axis``: the name under which ``axes`` ({name:
    process group}) holds the group the call ran on, "world" for the default group, "other"
    for a group not named (``comm.by_axis`` sums them). Arguments are read by name,
    positional or keyword. Plain ``dist.isend`` / ``dist.irecv`` are not counted (see
    :func:`batch_sent`).
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
        """label -> {"ops": [op, ...], "payload_bytes": ..., "sent_bytes": ...}."""
        return total(self.calls, "label")

    @property
    def by_axis(self) -> dict[str, dict]:
        """axis -> {"ops": [op, ...], "payload_bytes": ..., "sent_bytes": ...}."""
        return total(self.calls, "axis")

    def axis_of(self, group) -> str:
        for name, axis_group in self.axes.items():
            if group is axis_group:      # the same object: two axes may hold the same ranks
                return name
        if group is None or group is dist.GroupMember.WORLD:
            return "world"
        return "other"

    def record(self, kind: str, payload: int, sent: float, dtype=None, group=None) -> None:
        self.calls.append({"op": kind, "payload_bytes": payload, "sent_bytes": sent,
                           "dtype": dtype, "label": self.current, "axis": self.axis_of(group)})

    def wrap_ring(self, name: str, original):
        kind, argument = RING_COLLECTIVES[name]
        signature = inspect.signature(original)

        def counted(*args, **kwargs):
            arguments = signature.bind(*args, **kwargs).arguments
            payload = tensor_bytes(arguments[argument])
            group = arguments.get("group")
            world_size = dist.get_world_size(group)
            dtype = tensor_dtype(arguments[argument])
            self.record(kind, payload, ring_send_bytes(kind, payload, world_size), dtype, group)
            return original(*args, **kwargs)
        return counted

    def wrap_other(self, name: str, original):
        kind, measure = OTHER_COLLECTIVES[name]
        moved = OTHER_TENSORS[name]
        signature = inspect.signature(original)

        def counted(*args, **kwargs):
            arguments = signature.bind(*args, **kwargs).arguments
            payload, sent = measure(arguments)
            self.record(kind, payload, sent, tensor_dtype(moved(arguments)),
                        group_of(name, arguments))
            return original(*args, **kwargs)
        return counted

    def __enter__(self):
        for name in [*RING_COLLECTIVES, *OTHER_COLLECTIVES]:
            if not hasattr(dist, name):
                continue  # all_gather_single and reduce_scatter_single are newer than some torch
            original = getattr(dist, name)
            if name in RING_COLLECTIVES:
                setattr(dist, name, self.wrap_ring(name, original))
            else:
                setattr(dist, name, self.wrap_other(name, original))
            self.callback(setattr, dist, name, original)  # put back on exit
        return self


class FunctionalCommCounter(TorchDispatchMode):
    """``with FunctionalCommCounter(axes) as comm: ...``: the collectives torch's DTensor issues.

    They are functional collectives (``torch.ops._c10d_functional``), below the Python
    ``torch.distributed`` functions that CommCounter wraps, so they are caught here, at
    dispatch. Each call as CommCounter records it: ``op``, ``payload_bytes`` (an all-gather's
    payload is its whole output), ``sent_bytes`` (the ring's share), ``label`` (``current``),
    ``axis`` (the name of its group in ``axes``, {name: process group}, matched by the group's
    name, which is how these ops name it; "other" if none)."""

    KINDS = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
             "all_reduce": "all_reduce"}

    def __init__(self, axes: dict | None = None):
        super().__init__()
        self.current = ""
        self.calls = []
        self.axes = dict(axes or {})

    @property
    def sent_bytes(self) -> float:
        return sum(call["sent_bytes"] for call in self.calls)

    @property
    def by_axis(self) -> dict[str, dict]:
        return total(self.calls, "axis")

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
            axis = "other"
            for axis_name, axis_group in self.axes.items():
                if axis_group.group_name == group_name:
                    axis = axis_name
                    break
            self.calls.append({"op": kind, "payload_bytes": payload,
                               "sent_bytes": ring_send_bytes(kind, payload,
                                                             dist.get_world_size(group)),
                               "label": self.current, "axis": axis})
            # Waited for here, at once: the count is of bytes, not of overlap, and a Gloo
            # collective left in flight under this mode crashed (SIGSEGV in wait_tensor) once
            # in a loaded run. The later wait torch issues finds nothing left to wait for.
            out = func(*args, **(kwargs or {}))
            return torch.ops._c10d_functional.wait_tensor(out)
        return func(*args, **(kwargs or {}))
