"""Lesson 2's checks (FSDP, fsdp.py) and the sharding ledger's, and stage 07's one launch per
world size that runs them with lesson 1's (tests/checks_zero.py); read by
tests/test_07_fsdp.py and tests/test_07_zero.py.

``launch_07`` runs ``worker_07`` once per world size: every check inside the workers (warnings
are errors there, and torch.use_deterministic_algorithms(True) is on), recorded on every rank;
at the end the ranks merge their records, so a check passes only if it passed on every rank,
and rank 0 returns the findings. World size 3 pads every odd-sized weight. At world size 2 the
launch also runs a small ledger (``measure/ledger.py``, what ``measure/bench_fsdp.py --bench``
runs) and checks its counted bytes against the formulas, exactly, and its CSV rows.

Negative controls, run in the same launch: an FSDP that reduce-scatters in the compute dtype,
one whose backward prefetches two units ahead, and one that forgets to average the reduced
gradients (subclasses here, the algorithm file keeps no hook for them); each must make its
check fail. The counters (bytes held, full weights gathered at once, calls) wrap the FSDP from
outside (measure/counters.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import bench_fsdp
import checks_zero
import counters
import fsdp as fsdp_mod
import ledger
from common import models
from bench import results
from bench import supervisor as launch

FSDP = fsdp_mod.FSDP
# Mixed precision against the one-process cast reference. Both sides run the same casts and
# ops, but each rank rounds its local gradient to 16 bits where the reference rounds the whole
# batch's once, and roundings pile up through the layers of the backward. A gradient that is
# a sum over tokens (a bias, a norm gain) carries the rounding of every summand, which can
# exceed the sum itself when they cancel. So: 16 unit roundoffs u of the tensor's largest
# gradient (u = 2^-8 bfloat16, 2^-11 float16), plus, for float16, the absolute spacing
# 2^-24 of its subnormals once per summed token: gradients below float16's smallest normal,
# 2^-14 (common in an LM without loss scaling), keep only that absolute precision. bfloat16
# has float32's exponent range: no subnormals in play.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
SUBNORMAL_SPACING = {torch.bfloat16: 0.0, torch.float16: 2.0 ** -24}


def grad_tolerance(dtype, largest: float, tokens: int) -> float:
    return 16 * UNIT_ROUNDOFF[dtype] * largest + tokens * SUBNORMAL_SPACING[dtype]


# --------------------------------------------------------------------------- planted bugs


class ReduceInComputeDtype(FSDP):
    """Planted bug: the gradients are reduce-scattered in 16 bits (reduce_dtype ignored)."""

    def __init__(self, module, **kwargs):
        super().__init__(module, **kwargs)
        self.reduce_dtype = self.compute_dtype


class PrefetchTwoAhead(FSDP):
    """Planted bug: backward prefetches the unit after the next one."""

    def _pre_backward(self, unit, grad):
        self._gather(unit)
        after_next = self._next_in_backward.get(self._next_in_backward.get(unit))
        self._gather(after_next, wait=False)


class SumNotMean(FSDP):
    """Planted bug: the reduce-scattered gradients are summed over ranks, not averaged."""

    def _land(self, unit, work, out, grad_buffer):
        work.wait()
        summed = out.to(unit.flat_shard.dtype)  # the bug: no division by N
        for param, grad in zip(unit.params, summed.split(unit.numels)):
            if param.requires_grad:
                param.grad = grad.view_as(param)


# --------------------------------------------------------------------------- models


class NormToy(nn.Module):
    """fc1 -> LayerNorm -> a frozen 13 x 13 matrix -> ReLU -> * gate (1 x 13: fewer rows than
    ranks, so some ranks hold only padding) -> fc2. 13 and 5 rows divide by neither 2 nor 3."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 13)
        self.norm = nn.LayerNorm(13)
        self.fc2 = nn.Linear(13, 5)
        self.frozen = nn.Parameter(torch.randn(13, 13) / 4, requires_grad=False)
        self.gate = nn.Parameter(torch.randn(1, 13))

    def forward(self, x):
        return self.fc2(F.relu(self.norm(self.fc1(x)) @ self.frozen) * self.gate)


def distinct_units() -> nn.Sequential:
    """Four Linear layers, a unit each, of distinct sizes at 2 and 3 ranks: an all-gather's
    size names its unit."""
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 6), nn.ReLU(),
                         nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 3))


def tiny_lm(checkpoint=False, tied=False):
    lm = models.TransformerLM("tiny", context_length=32, checkpoint_activations=checkpoint)
    if tied:  # one matrix in two layers: their units merge
        lm.lm_head.weight = lm.token_embedding.weight
    return lm


def tiny_lm_checkpointed():
    return tiny_lm(checkpoint=True)


def tiny_lm_tied():
    return tiny_lm(tied=True)


def blocks(model):
    return list(model.blocks)


def cast_floating(value, dtype):
    if torch.is_tensor(value) and value.is_floating_point():
        return value.to(dtype)
    return value


def cast_reference(model: nn.Module, dtype) -> nn.Module:
    """The one-process yardstick for compute_dtype: every module that owns a weight matrix runs
    on `dtype` casts of its float32 parameters and of its floating inputs (autograd carries the
    gradients back through the casts to the float32 masters); everything else as it is."""
    def pre(module, args, kwargs):
        module._masters = dict(module._parameters)
        for name, param in module._masters.items():
            if param is not None and param.is_floating_point():
                module._parameters[name] = param.to(dtype)
        cast_args = tuple(cast_floating(arg, dtype) for arg in args)
        cast_kwargs = {key: cast_floating(value, dtype) for key, value in kwargs.items()}
        return cast_args, cast_kwargs

    def post(module, args, output):
        module._parameters.update(module._masters)

    for module in model.modules():
        if any(param is not None and param.dim() >= 2 for param in module._parameters.values()):
            module.register_forward_pre_hook(pre, with_kwargs=True)
            module.register_forward_hook(post)
    return model


def shard_of(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rows [r k, (r+1) k) of dim 0, k = ceil(d0 / N), zero-padded: what rank r should hold."""
    k = -(-t.shape[0] // world_size)
    out = t.new_zeros(k, *t.shape[1:])
    mine = t[rank * k:(rank + 1) * k]
    out[:len(mine)] = mine
    return out


def same_on_every_rank(t: torch.Tensor) -> bool:
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t.contiguous())
    return all(torch.equal(everyone[0], x) for x in everyone)


# --------------------------------------------------------------------------- against one process


def train(ctx, build, *, lm=False, adamw=False, steps=3, units=None, dtype=None, micro=1,
          local=None, lr=None, wrapper=FSDP):
    """Train wrapper(build()) on this rank's slices and build() on the whole batch; compare after
    every step. Returns findings, the FSDP object (for the memory checks) and its weights."""
    local = local or (2 if lm else 4)
    torch.manual_seed(100 + ctx.rank)  # a different start on every rank: the wrap broadcasts
    model = build()
    torch.manual_seed(100)
    reference = build()
    if dtype is not None:
        cast_reference(reference, dtype)
    fsdp = wrapper(model, compute_dtype=dtype, units=units(model) if units else ())
    if adamw:
        # eps 1e-6 on the LM: with 1e-8 Adam turns summation-order noise in near-zero
        # gradients into lr-sized steps
        eps = 1e-6 if lm else 1e-8
        opt = torch.optim.AdamW(fsdp.parameters(), lr=lr or 1e-2, eps=eps)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr or 1e-2, eps=eps)
    else:
        momentum = 0.0 if dtype else 0.9
        opt = torch.optim.SGD(fsdp.parameters(), lr=lr or 0.1, momentum=momentum)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=lr or 0.1, momentum=momentum)
    rtol, atol = (1e-4, 1e-5) if lm else (1e-5, 1e-6)
    loss_fn = models.lm_loss if lm else F.mse_loss
    found = dict(max_diff=0.0, allclose=True, bitwise=True, grad_ok=True, grad_detail="")
    drift = 0.0  # mixed precision: how far the parameters may drift, from the gradient bound
    n_global = local * ctx.world_size * micro
    # the most full weights held at once, read from outside (the FSDP keeps no count)
    with counters.GatheredWeights(fsdp) as gathered:
        for step in range(steps):
            if lm:
                x, y = models.random_tokens(n_global, 32, seed=step)
            else:
                x, y = models.random_regression_data(n_global, seed=step)
            opt.zero_grad(set_to_none=True)
            for k in range(micro):  # micro-batch k: rank r takes rows (k N + r) * local onwards
                first = (k * ctx.world_size + ctx.rank) * local
                rows = slice(first, first + local)
                (loss_fn(fsdp(x[rows]).float(), y[rows]) / micro).backward()
                fsdp.finish_gradient_synchronization()
            ref_opt.zero_grad(set_to_none=True)
            loss_fn(reference(x).float(), y).backward()
            tokens = local * (32 if lm else 1)  # summed into each gradient element on one rank
            if step == 0:
                check_gradients(ctx, model, reference, dtype, found, tokens)
            if dtype is not None:  # plain SGD: a step moves each weight lr * (gradient error) apart
                largest = max(p.grad.abs().max().item() for p in reference.parameters() if p.grad is not None)
                drift += opt.param_groups[0]["lr"] * grad_tolerance(dtype, largest, tokens)
            opt.step()
            ref_opt.step()
            got = fsdp.gather_full_params()
            for name, q in reference.named_parameters():
                found["max_diff"] = max(found["max_diff"], (got[name] - q).abs().max().item())
                if dtype is None:
                    found["allclose"] &= torch.allclose(got[name], q, rtol=rtol, atol=atol)
                else:
                    # the weights drift apart step by step, and each step's error moves the next
                    found["allclose"] &= bool((got[name] - q).abs().max() <= 2 * drift)
            found["bitwise"] &= same_on_every_rank(torch.cat([t.flatten() for t in got.values()]))
    found["tolerance"] = 2 * drift if dtype is not None else atol
    found["peak_gathered"] = gathered.peak_bytes
    return found, fsdp, got


def check_gradients(ctx, model, reference, dtype, found, tokens):
    """After the first backward (the same weights on both sides): every .grad has the shape and
    dtype of its .data (float32 shards), matches the reference's (its shard of it), and the
    replicated ones are bitwise identical across ranks."""
    ref = dict(reference.named_parameters())
    replicated = []
    for name, p in model.named_parameters():
        want = ref[name].grad
        if want is None or not p.requires_grad:
            found["grad_ok"] &= p.grad is None
            continue
        if p.grad is None or p.grad.shape != p.shape or p.grad.dtype != torch.float32:
            got = None if p.grad is None else (tuple(p.grad.shape), p.grad.dtype)
            found["grad_ok"] = False
            found["grad_detail"] = f"{name}: .grad {got}, .data {tuple(p.shape)}"
            continue
        if p.dim() >= 2 and ctx.world_size > 1:
            want = shard_of(want, ctx.rank, ctx.world_size)
        # float32: the order of the sums only; 16-bit compute: see grad_tolerance
        if dtype is None:
            tol = 1e-5 * want.abs().max().item() + 1e-7
        else:
            tol = grad_tolerance(dtype, want.abs().max().item(), tokens)
        err = (p.grad - want).abs().max().item()
        if err > tol:
            found["grad_ok"] = False
            found["grad_detail"] = f"{name}: max |diff| {err:.2e} > {tol:.2e}"
        if p.dim() < 2:
            replicated.append(p.grad.flatten())
    # every model here has replicated gradients (biases, norm gains): compare them
    found["replicated_same"] = bool(replicated) and same_on_every_rank(torch.cat(replicated))


def memory_after_step(fsdp) -> str:
    """'' when only shards and replicated parameters are allocated after a step, else what is not."""
    problems = []
    if counters.gathered_bytes(fsdp) != 0:
        problems.append(f"{counters.gathered_bytes(fsdp)} bytes of full weights still allocated")
    for unit in fsdp.units:
        if any(f.untyped_storage().nbytes() for f in unit.full) or any(f.grad is not None for f in unit.full):
            problems.append("a full weight or full gradient is still allocated")
        for p in unit.params:
            for t in (p, p.grad):
                if t is not None and t.untyped_storage().nbytes() != unit.flat_shard.nbytes:
                    problems.append(f"a weight or gradient of {tuple(p.shape)} lives in "
                                    f"{t.untyped_storage().nbytes()} bytes, not its shard buffer")
        for p, full in zip(unit.params, unit.full):  # a shard is ceil(rows / N) rows of the full weight
            if p.shape != (-(-full.shape[0] // fsdp.world_size), *full.shape[1:]):
                problems.append(f"shard {tuple(p.shape)} of a {tuple(full.shape)} weight")
    return "; ".join(problems)


def largest_unit_bytes(lm) -> int:
    """From the LM's own shapes, before any wrapping: a unit per block, a unit per other module
    that owns a weight matrix; the float32 bytes of the largest one's full weights."""
    sizes = []
    for block in lm.blocks:
        sizes.append(sum(4 * p.numel() for p in block.parameters() if p.dim() >= 2))
    for name, p in lm.named_parameters():
        if not name.startswith("blocks.") and p.dim() >= 2:
            sizes.append(4 * p.numel())
    return max(sizes)


# --------------------------------------------------------------------------- what is sent, and when


def gathers_per_step(build, units):
    """All-gathers in one steady-state step (forward + backward), counted at the call."""
    torch.manual_seed(0)
    model = build()
    fsdp = FSDP(model, units=units(model))
    counts = []
    for step in range(2):
        x, y = models.random_tokens(2, 32, seed=step)
        with counters.CommCounter() as comm:
            models.lm_loss(fsdp(x), y).backward()
            fsdp.finish_gradient_synchronization()
        counts.append(sum(1 for call in comm.calls if call["op"] == "all_gather"))
    return counts[1], len(fsdp.units)


def collective_order(ctx, wrapper=FSDP) -> list[tuple]:
    """(op, the unit it moves, label) of every collective in a steady-state step of
    ``distinct_units()``: labelled "start" before the forward, "forward i" once unit i began
    computing (a hook that runs after FSDP's own), "backward", then "finish"."""
    torch.manual_seed(0)
    net = distinct_units()
    linears = [module for module in net if isinstance(module, nn.Linear)]
    unit_of_bytes = {}  # an all-gather's or reduce-scatter's payload -> the unit, by its shapes
    for index, linear in enumerate(linears):
        rows, columns = linear.weight.shape
        numel = ctx.world_size * -(-rows // ctx.world_size) * columns
        unit_of_bytes[4 * numel] = index
    biases = 4 * sum(linear.bias.numel() for linear in linears)
    fsdp = wrapper(net)
    state = {"comm": None}

    def label_hook(index):
        def hook(module, args):
            if state["comm"] is not None:
                state["comm"].current = f"forward {index}"
        return hook

    for index, linear in enumerate(linears):
        linear.register_forward_pre_hook(label_hook(index))
    for step in range(2):  # the first forward records the order: count the second step
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        with counters.CommCounter() as comm:
            state["comm"] = comm
            comm.current = "start"
            out = fsdp(x)
            comm.current = "backward"
            out.square().mean().backward()
            comm.current = "finish"
            fsdp.finish_gradient_synchronization()
            state["comm"] = None
    order = []
    for call in comm.calls:
        if call["op"] == "all_reduce" and call["payload_bytes"] == biases:
            order.append((call["op"], "biases", call["label"]))
        else:
            order.append((call["op"], unit_of_bytes.get(call["payload_bytes"], "?"), call["label"]))
    return order


# Prefetch, unit by unit (4 Linear units, 0 to 3): the first forward fixed the order. Forward:
# unit 0 is gathered, and unit 1's all-gather starts before unit 0 computes; each unit's
# all-gather is in flight while the one before it computes. Unit 3 ends forward last and stays
# gathered: backward starts there, prefetching unit 2 first; each unit's reduce-scatter comes
# when its gradients are in, after the next unit's all-gather began; finish averages the biases.
EXPECTED_ORDER = [
    ("all_gather", 0, "start"), ("all_gather", 1, "start"), ("all_gather", 2, "forward 0"),
    ("all_gather", 3, "forward 1"),
    ("all_gather", 2, "backward"), ("reduce_scatter", 3, "backward"),
    ("all_gather", 1, "backward"), ("reduce_scatter", 2, "backward"),
    ("all_gather", 0, "backward"), ("reduce_scatter", 1, "backward"),
    ("reduce_scatter", 0, "backward"), ("all_reduce", "biases", "finish"),
]


def mixed_precision_calls(ctx, wrapper=FSDP) -> tuple[list, list]:
    """(what was sent, what must be) in a steady-state step of NormToy under
    compute_dtype=bfloat16, reduce_dtype=float32: every call as (op, dtype, payload bytes),
    sorted. Units, from the shapes: fc1 [13, 10]; the root's frozen [13, 13] and gate [1, 13];
    fc2 [5, 13]; a unit's shards are N ceil(rows / N) rows. Weights travel in bfloat16 (2
    bytes), gradients are reduce-scattered in float32 (4 bytes), and the replicated biases and
    norm (13 + 13 + 13 + 5 floats) all-reduced in float32. Backward gathers fc1 again, and only
    it: the root (whose forward runs the others) and fc2 end forward after the last unit began,
    and stay gathered."""
    n = ctx.world_size

    def padded(rows, columns):
        return n * -(-rows // n) * columns

    fc1 = padded(13, 10)
    root = padded(13, 13) + padded(1, 13)
    fc2 = padded(5, 13)
    want = []
    for numel in (root, fc1, fc2, fc1):  # forward, then backward
        want.append(("all_gather", torch.bfloat16, 2 * numel))
    for numel in (fc1, root, fc2):
        want.append(("reduce_scatter", torch.float32, 4 * numel))
    want.append(("all_reduce", torch.float32, 4 * (13 + 13 + 13 + 5)))
    torch.manual_seed(0)
    fsdp = wrapper(NormToy(), compute_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for step in range(2):  # count the second, steady-state step
        x, y = models.random_regression_data(4, seed=step)
        with counters.CommCounter() as comm:
            F.mse_loss(fsdp(x).float(), y).backward()
            fsdp.finish_gradient_synchronization()
    got = [(call["op"], call["dtype"], call["payload_bytes"]) for call in comm.calls]
    return sorted(got, key=str), sorted(want, key=str)


def saved_tensors_by_kind(model, weight_keys, x, y) -> dict:
    """Tensors autograd saves in one forward, as weights (their storage in ``weight_keys()``
    when saved) or not."""
    seen = {"weights": 0, "other": 0}

    def pack(t):
        key = (t.device, t.untyped_storage().data_ptr())
        if key in weight_keys():
            seen["weights"] += 1
        else:
            seen["other"] += 1
        return t

    def unpack(t):
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = models.lm_loss(model(x), y)
    loss.backward()
    return seen


def saved_weights_told_apart():
    """counters.gathered_storage_keys tells the gathered weights autograd saves from
    activations: the same counts as the plain LM's saved weight matrices and other tensors."""
    x, y = models.random_tokens(2, 32, seed=0)
    torch.manual_seed(0)
    plain = tiny_lm()

    def plain_weight_keys():
        return {(p.device, p.untyped_storage().data_ptr()) for p in plain.parameters() if p.dim() >= 2}

    want = saved_tensors_by_kind(plain, plain_weight_keys, x, y)
    torch.manual_seed(0)
    model = tiny_lm()
    fsdp = FSDP(model, units=list(model.blocks))
    fsdp(x)  # record the order

    def gathered_now():
        return counters.gathered_storage_keys(fsdp)

    got = saved_tensors_by_kind(fsdp, gathered_now, x, y)
    fsdp.finish_gradient_synchronization()
    linears = sum(1 for module in plain.modules() if isinstance(module, nn.Linear))
    return got, want, linears


def ddp_with_checkpointing(ctx):
    """Every data-parallel class of 03-06 trains the checkpointed LM to the plain LM's weights
    (one step: the gradients are what checkpointing could get wrong)."""
    from common import import_stage
    out = {}
    for path, cls in (("03_naive_ddp/naive_ddp", "NaiveDDP"), ("04_flat_ddp/flat_ddp", "FlatDDP"),
                      ("05_overlap_ddp/overlap_ddp", "OverlapDDP"),
                      ("06_bucketed_ddp/bucketed_ddp", "BucketedDDP")):
        wrapper = getattr(import_stage(path), cls)
        weights = []
        for checkpoint in (False, True):
            torch.manual_seed(0)
            model = tiny_lm(checkpoint=checkpoint)
            ddp = wrapper(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            x, y = models.random_tokens(2 * ctx.world_size, 32, seed=0)
            mine = slice(2 * ctx.rank, 2 * ctx.rank + 2)
            models.lm_loss(ddp(x[mine]), y[mine]).backward()
            ddp.finish_gradient_synchronization()
            opt.step()
            weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        out[cls] = (weights[0] - weights[1]).abs().max().item()
    return out


# --------------------------------------------------------------------------- the ledger

IMPLS = ("none", "ddp", "zero1", "zero2", "fsdp", "torch_zero1", "torch_fsdp")  # results/sharding.csv's


def zero_largest_rank(lm, world_size) -> tuple[int, int]:
    """Our ZeRO's largest rank, from the deal the lesson states (largest parameter first, each
    to the rank with the fewest bytes so far, the lowest on a tie), worked out here apart from
    zero.py: (its AdamW state bytes, two moments of what it owns + a 4-byte step counter per
    owned tensor; its gradient bytes)."""
    loads = [0] * world_size
    tensors = [0] * world_size
    sizes = sorted((4 * p.numel() for p in lm.parameters()), reverse=True)
    for nbytes in sizes:
        lightest = min(range(world_size), key=lambda rank: (loads[rank], rank))
        loads[lightest] += nbytes
        tensors[lightest] += 1
    state = [2 * loads[rank] + 4 * tensors[rank] for rank in range(world_size)]
    return max(state), max(loads)


def ledger_checks(ctx, record):
    """A small --bench run of the control and all six strategies (tiny LM, one step each), and
    FSDP with activation checkpointing: counted bytes against the formulas, exactly; the CSV
    rows; the control's optimizer time, which no other row has."""
    args = argparse.Namespace(model="tiny", batch_size=4, context_length=16, steps=1, warmup=0,
                              rounds=1, checkpointing=["off"])
    with warnings.catch_warnings():  # torch's fully_shard and ZeroRedundancyOptimizer warn
        warnings.simplefilter("default")
        strategies = ledger.strategies()
        rows = ledger.run_ledger(ctx, strategies, args, csv_name="sharding_test.csv")
        args.checkpointing = ["on"]
        fsdp_only = [strategy for strategy in strategies if strategy[0] == "fsdp"]
        rows += ledger.run_ledger(ctx, fsdp_only, args, csv_name="sharding_test.csv")
    by = {(r["impl"], r["checkpointing"]): r for r in rows}
    record("ledger_rows", set(by) == {*((i, "off") for i in IMPLS), ("fsdp", "on")}, sorted(by))
    n = ctx.world_size
    lm = models.TransformerLM("tiny", context_length=16)
    tensors = len(list(lm.parameters()))  # AdamW keeps a 4-byte step counter per tensor
    zero_state, zero_grads = zero_largest_rank(lm, n)
    flags = 2 * (n - 1) / n * 4 * tensors  # the replicas' all-reduce of one int32 flag per tensor
    for (impl, ck), r in by.items():
        gaps = {k: r[f"{k}_bytes"] - r[f"{k}_bytes_predicted"] for k in ("param", "grad", "optim", "sent")}
        if impl in ("zero1", "zero2"):  # the largest rank holds what the deal gave it, exactly
            want_grads = zero_grads if impl == "zero2" else r["grad_bytes_predicted"]
            exact = gaps["param"] == 0 and r["optim_bytes"] == zero_state and r["grad_bytes"] == want_grads
        elif impl == "torch_zero1":  # torch's own deal: within one parameter of the mean (5%)
            exact = gaps["param"] == 0 and abs(r["optim_bytes"] / r["optim_bytes_predicted"] - 1) < 0.05 \
                and abs(r["grad_bytes"] / r["grad_bytes_predicted"] - 1) < 0.05
        else:  # every rank the formula's bytes, and every tensor's step counter
            exact = gaps["param"] == 0 and gaps["grad"] == 0 and gaps["optim"] == 4 * tensors
        record(f"ledger_{impl}_{ck}_bytes_held", exact, (gaps, r["optim_bytes"], zero_state, zero_grads))
        want_extra = flags if impl in ("ddp", "zero1", "zero2") else 0
        record(f"ledger_{impl}_{ck}_bytes_sent", gaps["sent"] == want_extra, (gaps, want_extra))
        if ck == "off":  # the same model and batch save the same activations, however sharded
            same = r["activation_bytes"] == by["ddp", ck]["activation_bytes"] > 0
            record(f"ledger_{impl}_{ck}_activations", same, (r["activation_bytes"], by["ddp", ck]["activation_bytes"]))
    timed_alone = [impl for (impl, ck), r in by.items() if r["optimizer_ms"] != ""]
    control = by["none", "off"]
    record("ledger_control_optimizer_timed",
           timed_alone == ["none"] and control["optimizer_ms"] > 0  # (two timings never compared:
           # under load the optimizer timed alone can take longer than a whole step timed apart)
           and control["sent_bytes"] == 0, (timed_alone, control["optimizer_ms"], control["step_ms"]))
    f = by["fsdp", "off"]  # the shards, the step counters, and the kept units gathered at once
    record("ledger_fsdp_peak", f["peak_bytes"] - f["peak_bytes_predicted"] == 4 * tensors, f)
    record("ledger_checkpointing_saves_activations",
           by["fsdp", "on"]["activation_bytes"] < by["fsdp", "off"]["activation_bytes"], by["fsdp", "on"])
    if ctx.is_main:
        written = results.read_csv("sharding_test.csv")
        csv_ok = len(written) == 8 and all(w["run_id"] and w["machine"] and w["step_ms"] for w in written)
        csv_ok = csv_ok and [w["impl"] for w in written if w["optimizer_ms"]] == ["none"]
        record("ledger_csv", csv_ok, len(written))
    lines = ledger.target_lines(rows)
    starts = ["zero1 step / torch_zero1's, checkpointing off", "fsdp step / torch_fsdp's, checkpointing off",
              "fsdp param + grad + optim bytes per rank / 16P/N", "zero1 optim bytes per rank / 8P/N",
              "zero2 grad bytes per rank / 4P/N", "fsdp bytes sent / its prediction: 1.0000",
              "fsdp: checkpointing keeps"]
    printed = len(lines) == len(starts) and all(line.startswith(s) for line, s in zip(lines, starts))
    record("ledger_targets_printed", printed, lines)
    # on one rank nothing is sent: the bytes-sent ratios are said to need two (not 0 / 0)
    one_rank = [{**r, "world_size": 1, "sent_bytes": 0, "sent_bytes_predicted": 0} for r in rows]
    alone = ledger.target_lines(one_rank)
    said = [line for line in alone if line.startswith("bytes sent")]
    record("ledger_targets_one_rank", len(said) == 1 and said[0].startswith("bytes sent: none, on one rank"),
           alone)


# --------------------------------------------------------------------------- the launch


def counter_checks(ctx, record):
    """CommCounter reads arguments given by keyword (torch's ZeroRedundancyOptimizer passes
    them so) and names each call's dtype."""
    n = ctx.world_size
    t = torch.ones(10)
    with counters.CommCounter() as comm:
        dist.broadcast(tensor=t, src=0)
        dist.reduce(t, dst=0)
        dist.all_reduce(torch.ones(3, dtype=torch.bfloat16))
    got = [(call["op"], call["dtype"], call["sent_bytes"]) for call in comm.calls]
    share = (n - 1) / n  # of the payload, sent by each rank of a ring
    want = [("broadcast", torch.float32, share * 40), ("reduce", torch.float32, share * 40),
            ("all_reduce", torch.bfloat16, 2 * (share * 6))]
    record("counter_calls", got == want, (got, want))


def fsdp_checks(ctx, trace_dir, record):
    """Every FSDP case, at this world size."""
    from bench import profiling

    def equivalence(name, build, **kw):
        f, fsdp, _ = train(ctx, build, **kw)
        ok = f["allclose"] and f["bitwise"] and f["grad_ok"] and f["replicated_same"]
        record(name, ok, f"max |diff| {f['max_diff']:.2e} (tolerance {f['tolerance']:.1e}), bitwise across "
                         f"ranks {f['bitwise']}, gradients {f['grad_ok']} {f['grad_detail']}, replicated "
                         f"gradients identical {f['replicated_same']}")
        return f, fsdp

    for model_name, build, lm in (("norm_toy", NormToy, False), ("toy", models.ToyModel, False),
                                  ("tied_layer", models.TiedModel, False), ("tied_lm", tiny_lm_tied, True)):
        if lm and ctx.world_size != 2:  # the tied LM at two ranks (three pads the toys alike)
            continue
        _, fsdp = equivalence(f"{model_name}_sgd", build, lm=lm, steps=3)
        record(f"{model_name}_memory_after_step", not memory_after_step(fsdp), memory_after_step(fsdp))
        if not lm:  # tied weights with AdamW: TiedModel's layer used twice
            equivalence(f"{model_name}_adamw", build, adamw=True, steps=10)
    # the negative control of the equivalence: gradients summed, not averaged
    f, _, _ = train(ctx, NormToy, steps=1, wrapper=SumNotMean)
    record("sum_not_mean_is_caught", not (f["allclose"] and f["grad_ok"]), f)
    f, fsdp = equivalence("lm_per_block_adamw", tiny_lm, lm=True, adamw=True, steps=10, lr=1e-3,
                          units=blocks)
    record("lm_memory_after_step", not memory_after_step(fsdp), memory_after_step(fsdp))
    # one unit's full weights at a time: the next one's all-gather only starts while a unit
    # computes, and a unit is freed before the next is waited for
    want = largest_unit_bytes(tiny_lm())
    record("lm_peak_gathered_is_the_largest_unit", f["peak_gathered"] == want,
           f"peak gathered {f['peak_gathered']} bytes, the largest unit {want}")
    for dtype in (torch.bfloat16, torch.float16):  # the LM at two ranks only (it is the slow one)
        for model_name, build, lm, units in (("norm_toy", NormToy, False, None), ("lm", tiny_lm, True, blocks)):
            if not lm or ctx.world_size == 2:
                equivalence(f"{model_name}_{str(dtype)[6:]}", build, lm=lm, units=units, dtype=dtype,
                            lr=0.05, steps=2 if lm else 3)
    # mixed precision: what travels, in which dtype, how many bytes, per step
    got, want = mixed_precision_calls(ctx)
    record("mixed_precision_reduces_in_float32", got == want, f"sent {got}, want {want}")
    got, want = mixed_precision_calls(ctx, ReduceInComputeDtype)
    record("reduce_in_bfloat16_is_caught", got != want, f"sent {got}")
    # prefetch: the exact order of the collectives, forward and backward
    got = collective_order(ctx)
    record("prefetch_order", got == EXPECTED_ORDER, f"order {got}")
    got = collective_order(ctx, PrefetchTwoAhead)
    record("prefetch_two_ahead_is_caught", got != EXPECTED_ORDER, f"order {got}")
    if ctx.world_size != 2:  # the rest once, at two ranks
        return
    plain, _, plain_w = train(ctx, tiny_lm, lm=True, units=blocks, local=4, steps=2)
    accum, _, accum_w = train(ctx, tiny_lm, lm=True, units=blocks, micro=2, steps=2)
    diff = max((plain_w[n] - accum_w[n]).abs().max().item() for n in plain_w)
    record("gradient_accumulation", accum["allclose"] and accum["bitwise"] and diff < 1e-5,
           f"2 micro-batches vs one process {accum['max_diff']:.2e}, vs the plain run {diff:.2e}")
    ckpt, _, ckpt_w = train(ctx, tiny_lm_checkpointed, lm=True, units=blocks, local=4, steps=2)
    same = all(torch.equal(plain_w[n], ckpt_w[n]) for n in plain_w)
    record("checkpointing_equals_plain", ckpt["allclose"] and same,
           f"vs one process {ckpt['max_diff']:.2e}; bitwise equal to the plain run: {same}")
    plain_gathers, units = gathers_per_step(tiny_lm, blocks)
    ckpt_gathers, _ = gathers_per_step(tiny_lm_checkpointed, blocks)
    record("checkpointing_gathers_once", plain_gathers == ckpt_gathers == 2 * units - 1,
           f"all-gathers per step: plain {plain_gathers}, checkpointed {ckpt_gathers}, units {units} "
           f"(forward each unit once, backward all but the last, kept gathered)")
    got, want, linears = saved_weights_told_apart()
    record("gathered_weights_told_apart", got == want and got["weights"] == linears,
           f"FSDP {got}, the plain LM {want}, {linears} Linear layers")
    diffs = ddp_with_checkpointing(ctx)
    record("ddp_classes_with_checkpointing", max(diffs.values()) < 1e-6, diffs)
    args = argparse.Namespace(model="tiny", batch_size=4, context_length=16, trace_dir=trace_dir)
    summaries = profiling.profile_ddp(ctx, [("fsdp (07)", bench_fsdp.fsdp_per_block)], args, name="07_fsdp")
    if ctx.is_main:
        summary = summaries[0]
        # 5 units (2 blocks, 2 embeddings, the head): all-gathers 5 forward + 4 backward,
        # 5 reduce-scatters, 1 all-reduce (Gloo runs each as one traced collective)
        want = 3 * 5
        ok = summary["collectives"] == want and summary["comm_during_backward_ms"] > 0
        record("profile_shows_collectives_during_backward", ok, (summary, want))


def worker_07(ctx, out_path):
    """Stage 07's sharding checks at one world size: FSDP's, then ZeRO's, then (2 ranks) the
    ledger. Each check is recorded on every rank; the ranks then merge their records (one
    verdict per check, every rank's problems named), and rank 0 writes them."""
    findings = {}

    def record(name, ok, detail):
        findings[name] = [bool(ok), str(detail)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warning-free, as `python -W error` would check
        torch.use_deterministic_algorithms(True)
        counter_checks(ctx, record)
        fsdp_checks(ctx, str(Path(out_path).parent / "traces"), record)
        torch.use_deterministic_algorithms(False)
    smaller_group = dist.new_group(list(range(ctx.world_size - 1)))  # for the resumes
    checks_zero.zero_checks(ctx, record, smaller_group)
    if ctx.world_size == 2:
        ledger_checks(ctx, record)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, findings)
    merged = {}
    for rank, rank_findings in enumerate(everyone):
        for name, (ok, detail) in rank_findings.items():
            merged.setdefault(name, [True, ""])
            if not ok:
                merged[name][0] = False
                merged[name][1] += f" rank {rank}: {detail}"
            elif rank == 0 and merged[name][0]:
                merged[name][1] = detail
    if ctx.is_main:
        Path(out_path).write_text(json.dumps(merged))


_FINDINGS: dict[int, dict] = {}


def launch_07(world_size: int, tmp_dir: Path) -> dict:
    """The findings of the one launch at ``world_size`` (launched on first use). A launch that
    fails is not tried again by the next test: every test of that world size reports it."""
    if world_size not in _FINDINGS:
        out = tmp_dir / f"findings{world_size}.json"
        try:
            launch.launch(worker_07, launch.LaunchConfig(world_size, "gloo", "cpu"), str(out),
                          timeout_s=300)
        except SystemExit as e:
            _FINDINGS[world_size] = {"launch failed": f"the launch at world size {world_size} "
                                                      f"exited with status {e.code}: see its output"}
            raise
        _FINDINGS[world_size] = json.loads(out.read_text())
    if "launch failed" in _FINDINGS[world_size]:
        pytest.fail(_FINDINGS[world_size]["launch failed"])
    return _FINDINGS[world_size]


# --------------------------------------------------------------------------- the demos


def run_demo(demo: Path, *argvs: list[str], timeout: float = 180) -> list[subprocess.CompletedProcess]:
    """``python demo ARGV`` for each argument list, all at once (each interpreter's start-up
    waits on the others' less than in a row), as a learner runs the demo: a fresh interpreter,
    nothing of the tests imported. Returns each run's result, in order."""
    started = []
    for argv in argvs:
        started.append(subprocess.Popen([sys.executable, str(demo), *argv], cwd=demo.parents[2],
                                        env=dict(os.environ), text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    done = []
    try:
        for proc, argv in zip(started, argvs):
            stdout, stderr = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr))
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done
