"""Counting what a parallel strategy holds and sends: the tools behind stage 07's byte tables.

Three counters, each read from the tensors and calls themselves, never from a formula, so a
table can set "counted" beside "predicted" and a wrong implementation shows up as a gap:

* :func:`state_bytes`: bytes of a set of tensors, each storage once (a tied weight, or two
  views of one flat buffer, count once);
* :class:`SavedActivations`: bytes autograd saves for backward inside the ``with`` block
  (``torch.autograd.graph.saved_tensors_hooks``), parameters left out, plus the inputs that
  ``torch.utils.checkpoint`` keeps alive for its recomputation;
* :class:`CommCounter`: every call this rank makes to a ``torch.distributed`` collective or
  send inside the ``with`` block, with its payload and the bytes this rank sends when the
  collective runs as a ring (the algorithm of stage 01; nccl-tests counts the same way).

The collectives are counted by swapping the functions on the ``torch.distributed`` module
for wrappers while the block runs: code that calls ``dist.all_reduce(...)`` (ours, torch's
``ZeroRedundancyOptimizer`` and ``fully_shard``) is counted; torch's C++ DDP reducer is not
(count it with a DDP communication hook instead).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint


def storage_key(t: torch.Tensor) -> tuple:
    """Identifies the memory behind ``t``: views of one storage share it."""
    return (t.device, t.untyped_storage().data_ptr())


def state_bytes(tensors) -> int:
    """Bytes held by ``tensors`` (None skipped), each distinct storage counted once."""
    seen = {}
    for t in tensors:
        if t is not None and t.untyped_storage().nbytes() > 0:
            seen[storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` (AdamW: exp_avg, exp_avg_sq, step)."""
    return state_bytes(v for per_param in optimizer.state.values() for v in per_param.values()
                       if isinstance(v, torch.Tensor))


class SavedActivations:
    """``with SavedActivations(model) as saved: loss = model(x)`` -> ``saved.bytes``.

    Counts each storage once, at the size it has when autograd saves it; tensors that are
    parameters of ``model`` (or in ``exclude``, a set of :func:`storage_key`) are weights, not
    activations, and are left out. Inside a non-reentrant checkpoint autograd saves nothing
    (the checkpoint's own hooks take over) and the region's inputs are what stays alive; they
    are counted as the checkpoint is entered.
    """

    def __init__(self, model: nn.Module | None = None, exclude=()):
        self.exclude = set(exclude)
        if model is not None:
            self.exclude |= {storage_key(p) for p in model.parameters()}
        self.seen: dict[tuple, int] = {}

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())

    def _count(self, t: torch.Tensor) -> None:
        if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
            key = storage_key(t)
            if key not in self.exclude:
                self.seen.setdefault(key, t.untyped_storage().nbytes())

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


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def ring_send_bytes(op: str, payload: int, world_size: int) -> float:
    """Bytes one rank sends for a collective of ``payload`` bytes run as a ring of n ranks.

    all_reduce = reduce-scatter + all-gather: 2(n-1)/n N. all_gather, reduce_scatter and a
    (pipelined, chain) broadcast: (n-1)/n N, N being the full tensor (the output of a gather,
    the input of a reduce-scatter); for broadcast that is the average over ranks (every rank
    but the last in the chain forwards N). send: N.
    """
    n = world_size
    if op == "send":
        return float(payload)
    if n == 1:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
              "reduce_scatter": (n - 1) / n, "broadcast": (n - 1) / n}
    return factor[op] * payload


# name on torch.distributed -> (kind, payload in bytes from the call's arguments)
_PAYLOAD = {
    "all_reduce": ("all_reduce", lambda t, *a, **k: _nbytes(t)),
    "all_gather": ("all_gather", lambda out, t, *a, **k: sum(map(_nbytes, out))),
    "all_gather_into_tensor": ("all_gather", lambda out, t, *a, **k: _nbytes(out)),
    "all_gather_single": ("all_gather", lambda out, t, *a, **k: _nbytes(out)),
    "reduce_scatter": ("reduce_scatter", lambda out, ins, *a, **k: sum(map(_nbytes, ins))),
    "reduce_scatter_tensor": ("reduce_scatter", lambda out, t, *a, **k: _nbytes(t)),
    "reduce_scatter_single": ("reduce_scatter", lambda out, t, *a, **k: _nbytes(t)),
    "broadcast": ("broadcast", lambda t, *a, **k: _nbytes(t)),
    "send": ("send", lambda t, *a, **k: _nbytes(t)),
    "isend": ("send", lambda t, *a, **k: _nbytes(t)),
}


def _group_size(kwargs) -> int:
    return dist.get_world_size(kwargs.get("group"))


class CommCounter:
    """``with CommCounter() as comm: ...`` -> ``comm.calls``, ``comm.sent_bytes``, ``comm.by_label``.

    Each call is a dict: op (all_reduce, all_gather, reduce_scatter, broadcast, send), payload
    bytes, the bytes this rank sends under the ring model (:func:`ring_send_bytes`), and the
    label active when it was made (``with comm.label("fc1 backward"): ...``, or set
    ``comm.current`` from a hook). A group passed positionally is not seen: pass ``group=``.
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
            entry = out[c["label"]]
            entry["ops"].append(c["op"])
            entry["payload_bytes"] += c["payload_bytes"]
            entry["sent_bytes"] += c["sent_bytes"]
        return dict(out)

    def _wrap(self, name: str, original):
        kind, payload_of = _PAYLOAD[name]

        def counted(*args, **kwargs):
            payload = payload_of(*args, **kwargs)
            self.calls.append({"op": kind, "payload_bytes": payload, "label": self.current,
                               "sent_bytes": ring_send_bytes(kind, payload, _group_size(kwargs))})
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
