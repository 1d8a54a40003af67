"""Stage 07: FSDP (07_parallelism/02_fsdp/fsdp.py) against single-process training, and the ledger.

One launch per world size (``launch_07``, shared with tests/test_07_zero.py, whose ZeRO cases
run in it too) checks everything inside the workers (warnings are errors there, and
torch.use_deterministic_algorithms(True) is on); rank 0 returns the findings, and one test per
(case, world size) reads them. World size 3 pads every odd-sized weight. At world size 2 the
launch also runs a small ledger (``fsdp.py --bench``'s code) and checks its counted bytes
against the formulas and its CSV rows.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fsdp as fsdp_mod
import ledger
from common import launch, models, results
from helpers import REPO, assert_main_usage_error

SCRIPT = REPO / "07_parallelism" / "02_fsdp" / "fsdp.py"
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


class NormToy(nn.Module):
    """fc1 -> LayerNorm -> a frozen 13 x 13 matrix -> ReLU -> * gate (1 x 13: fewer rows than
    ranks, so some ranks hold only padding) -> fc2. 13 and 5 rows divide by neither 2 nor 3."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(10, 13), nn.LayerNorm(13), nn.Linear(13, 5)
        self.frozen = nn.Parameter(torch.randn(13, 13) / 4, requires_grad=False)
        self.gate = nn.Parameter(torch.randn(1, 13))

    def forward(self, x):
        return self.fc2(F.relu(self.norm(self.fc1(x)) @ self.frozen) * self.gate)


def tiny_lm(checkpoint=False, tied=False):
    lm = models.TransformerLM("tiny", context_length=32, checkpoint_activations=checkpoint)
    if tied:  # one matrix in two layers: their units merge
        lm.lm_head.weight = lm.token_embedding.weight
    return lm


def cast_reference(model: nn.Module, dtype) -> nn.Module:
    """The one-process yardstick for compute_dtype: every module that owns a weight matrix runs
    on `dtype` casts of its float32 parameters and of its floating inputs (autograd carries the
    gradients back through the casts to the float32 masters); everything else as it is."""
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


def train(ctx, build, *, lm=False, adamw=False, steps=3, units=None, dtype=None, micro=1,
          local=None, lr=None):
    """Train FSDP(build()) on this rank's slices and build() on the whole batch; compare after
    every step. Returns findings and the FSDP object (for the memory checks)."""
    local = local or (2 if lm else 4)
    torch.manual_seed(100 + ctx.rank)  # a different start on every rank: the wrap broadcasts
    model = build()
    torch.manual_seed(100)
    reference = build()
    if dtype is not None:
        cast_reference(reference, dtype)
    fsdp = FSDP(model, compute_dtype=dtype, units=units(model) if units else ())
    if adamw:  # eps 1e-6 on the LM: see verify_main in fsdp.py
        make = lambda ps: torch.optim.AdamW(ps, lr=lr or 1e-2, eps=1e-6 if lm else 1e-8)  # noqa: E731
    else:
        make = lambda ps: torch.optim.SGD(ps, lr=lr or 0.1, momentum=0.0 if dtype else 0.9)  # noqa: E731
    opt, ref_opt = make(fsdp.parameters()), make(reference.parameters())
    rtol, atol = (1e-4, 1e-5) if lm else (1e-5, 1e-6)
    loss_fn = models.lm_loss if lm else F.mse_loss
    found = dict(max_diff=0.0, allclose=True, bitwise=True, grad_ok=True, grad_detail="")
    drift = 0.0  # mixed precision: how far the parameters may drift, from the gradient bound
    n_global = local * ctx.world_size * micro
    for step in range(steps):
        if lm:
            x, y = models.random_tokens(n_global, 32, seed=step)
        else:
            x, y = models.random_regression_data(n_global, seed=step)
        opt.zero_grad(set_to_none=True)
        for k in range(micro):  # micro-batch k: rank r takes rows (k N + r) * local onwards
            rows = slice((k * ctx.world_size + ctx.rank) * local, (k * ctx.world_size + ctx.rank + 1) * local)
            (loss_fn(fsdp(x[rows]).float(), y[rows]) / micro).backward()
            fsdp.finish_gradient_synchronization()
        ref_opt.zero_grad(set_to_none=True)
        loss_fn(reference(x).float(), y).backward()
        tokens = local * (32 if lm else 1)  # summed into each gradient element on one rank
        if step == 0:
            check_gradients(ctx, fsdp, model, reference, dtype, found, tokens)
        if dtype is not None:  # plain SGD: a step moves each weight lr * (gradient error) apart
            drift += opt.param_groups[0]["lr"] * grad_tolerance(dtype, max(
                p.grad.abs().max().item() for p in reference.parameters() if p.grad is not None), tokens)
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
    return found, fsdp, got


def check_gradients(ctx, fsdp, model, reference, dtype, found, tokens):
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
            found["grad_ok"], found["grad_detail"] = False, f"{name}: .grad {got}, .data {tuple(p.shape)}"
            continue
        want = shard_of(want, ctx.rank, ctx.world_size) if p.dim() >= 2 and ctx.world_size > 1 else want
        # float32: the order of the sums only; 16-bit compute: see grad_tolerance
        tol = 1e-5 * want.abs().max().item() + 1e-7 if dtype is None else \
            grad_tolerance(dtype, want.abs().max().item(), tokens)
        err = (p.grad - want).abs().max().item()
        if err > tol:
            found["grad_ok"], found["grad_detail"] = False, f"{name}: max |diff| {err:.2e} > {tol:.2e}"
        if p.dim() < 2:
            replicated.append(p.grad.flatten())
    found["replicated_same"] = same_on_every_rank(torch.cat(replicated)) if replicated else True


def memory_after_step(fsdp, model) -> str:
    """'' when only shards and replicated parameters are allocated after a step, else what is not."""
    problems = []
    if fsdp.gathered_bytes != 0:
        problems.append(f"{fsdp.gathered_bytes} gathered bytes still counted")
    for u in fsdp.units:
        if any(f.untyped_storage().nbytes() for f in u.full) or any(f.grad is not None for f in u.full):
            problems.append("a full weight or full gradient is still allocated")
        for p in u.params:
            for t in (p, p.grad):
                if t is not None and t.untyped_storage().nbytes() != u.flat_shard.nbytes:
                    problems.append(f"a weight or gradient of {tuple(p.shape)} lives in "
                                    f"{t.untyped_storage().nbytes()} bytes, not its shard buffer")
        for p, full in zip(u.params, u.full):  # a shard is ceil(rows / N) rows of the full weight
            if p.shape != (-(-full.shape[0] // fsdp.world_size), *full.shape[1:]):
                problems.append(f"shard {tuple(p.shape)} of a {tuple(full.shape)} weight")
    return "; ".join(problems)


def gathers_per_step(ctx, build, units):
    """All-gathers in one steady-state step (forward + backward), counted at the call."""
    torch.manual_seed(0)
    model = build()
    fsdp = FSDP(model, units=units(model))
    counts = []
    for step in range(2):
        x, y = models.random_tokens(2, 32, seed=step)
        with ledger.CommCounter() as comm:
            models.lm_loss(fsdp(x), y).backward()
            fsdp.finish_gradient_synchronization()
        counts.append(sum(c["op"] == "all_gather" for c in comm.calls))
    return counts[1], len(fsdp.units)


def saved_weights_told_apart(ctx):
    """gathered_storage_keys() tells the gathered weights autograd saves from activations."""
    torch.manual_seed(0)
    model = tiny_lm()
    fsdp = FSDP(model, units=list(model.blocks))
    x, y = models.random_tokens(2, 32, seed=0)
    fsdp(x)  # record the order
    seen = {"weights": 0, "other": 0}

    def pack(t):
        key = (t.device, t.untyped_storage().data_ptr())
        seen["weights" if key in fsdp.gathered_storage_keys() else "other"] += 1
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = models.lm_loss(fsdp(x), y)
    loss.backward()
    fsdp.finish_gradient_synchronization()
    return seen


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


IMPLS = ("ddp", "zero1", "zero2", "fsdp", "torch_zero1", "torch_fsdp")  # results/sharding.csv's


def ledger_checks(ctx, record):
    """A small --bench run of all six strategies (tiny LM, one step each), and DDP and FSDP
    with activation checkpointing: counted bytes against the formulas, the CSV rows."""
    args = argparse.Namespace(model="tiny", batch_size=4, context_length=16, steps=1, warmup=0,
                              rounds=1, checkpointing=["off"])
    with warnings.catch_warnings():  # torch's fully_shard and ZeroRedundancyOptimizer warn
        warnings.simplefilter("default")
        strategies = ledger.strategies()
        rows = ledger.run_ledger(ctx, strategies, args, csv_name="sharding_test.csv")
        args.checkpointing = ["on"]
        rows += ledger.run_ledger(ctx, [s for s in strategies if s[0] == "fsdp"], args,
                                  csv_name="sharding_test.csv")
    by = {(r["impl"], r["checkpointing"]): r for r in rows}
    record("ledger_rows", set(by) == {*((i, "off") for i in IMPLS), ("fsdp", "on")}, sorted(by))
    for (impl, ck), r in by.items():
        tensors = 25  # AdamW's step counters: 4 bytes per parameter tensor, on its owner
        gaps = {k: r[f"{k}_bytes"] - r[f"{k}_bytes_predicted"] for k in ("param", "grad", "optim", "sent")}
        exact = gaps["param"] == gaps["grad"] == 0 and 0 <= gaps["optim"] <= 4 * tensors
        if impl in ("zero1", "zero2", "torch_zero1"):  # the largest rank: one parameter above the mean
            exact = gaps["param"] == 0 and abs(r["optim_bytes"] / r["optim_bytes_predicted"] - 1) < 0.05 \
                and abs(r["grad_bytes"] / r["grad_bytes_predicted"] - 1) < 0.05
        record(f"ledger_{impl}_{ck}_bytes_held", exact, gaps)
        flags = 0 if "fsdp" in impl else 8 * tensors  # replicas: + an all-reduce of int32 flags
        record(f"ledger_{impl}_{ck}_bytes_sent", -1 < gaps["sent"] <= flags, gaps)
        if ck == "off":  # the same model and batch save the same activations, however sharded
            same = r["activation_bytes"] == by["ddp", ck]["activation_bytes"] > 0
            record(f"ledger_{impl}_{ck}_activations", same, (r["activation_bytes"], by["ddp", ck]["activation_bytes"]))
    f = by["fsdp", "off"]
    record("ledger_fsdp_peak", 0 <= f["peak_bytes"] - f["peak_bytes_predicted"] <= 4 * 25 and
           f["peak_bytes"] > f["param_bytes"] + f["grad_bytes"] + f["optim_bytes"], f)
    record("ledger_checkpointing_saves_activations",
           by["fsdp", "on"]["activation_bytes"] < by["fsdp", "off"]["activation_bytes"], by["fsdp", "on"])
    written = results.read_csv("sharding_test.csv") if ctx.is_main else []
    record("ledger_csv", not ctx.is_main or (len(written) == 7 and all(
        w["run_id"] and w["machine"] and w["step_ms"] for w in written)), len(written))
    lines = ledger.target_lines(rows)
    record("ledger_targets_printed", any("fsdp step / torch_fsdp's" in t for t in lines), lines)


def fsdp_checks(ctx, trace_dir, record):
    """Every FSDP case of the issue, at this world size."""
    from common import profiling
    blocks = lambda m: list(m.blocks)  # noqa: E731

    def equivalence(name, build, **kw):
        f, fsdp, _ = train(ctx, build, **kw)
        record(name, f["allclose"] and f["bitwise"] and f["grad_ok"] and f["replicated_same"],
               f"max |diff| {f['max_diff']:.2e} (tolerance {f['tolerance']:.1e}), bitwise across "
               f"ranks {f['bitwise']}, gradients {f['grad_ok']} {f['grad_detail']}, replicated "
               f"gradients identical {f['replicated_same']}")
        return f, fsdp

    for model_name, build, lm in (("norm_toy", NormToy, False), ("toy", models.ToyModel, False),
                                  ("tied_layer", models.TiedModel, False),
                                  ("tied_lm", lambda: tiny_lm(tied=True), True)):
        if lm and ctx.world_size != 2:  # the tied LM at two ranks (three pads the toys alike)
            continue
        _, fsdp = equivalence(f"{model_name}_sgd", build, lm=lm, steps=3)
        record(f"{model_name}_memory_after_step", not memory_after_step(fsdp, fsdp.module),
               memory_after_step(fsdp, fsdp.module))
        if not lm:  # tied weights with AdamW: TiedModel's layer used twice
            equivalence(f"{model_name}_adamw", build, adamw=True, steps=10)
    _, fsdp = equivalence("lm_per_block_adamw", tiny_lm, lm=True, adamw=True, steps=10, lr=1e-3,
                          units=blocks)
    record("lm_memory_after_step", not memory_after_step(fsdp, fsdp.module), memory_after_step(fsdp, fsdp.module))
    full = sum(u.full_bytes for u in fsdp.units)
    record("lm_peak_gathered_below_full_model", 0 < fsdp.peak_gathered_bytes < full,
           f"peak gathered {fsdp.peak_gathered_bytes} bytes of {full}")
    for dtype in (torch.bfloat16, torch.float16):  # the LM at two ranks only (it is the slow one)
        for model_name, build, lm, units in (("norm_toy", NormToy, False, None), ("lm", tiny_lm, True, blocks)):
            if not lm or ctx.world_size == 2:
                equivalence(f"{model_name}_{str(dtype)[6:]}", build, lm=lm, units=units, dtype=dtype,
                            lr=0.05, steps=2 if lm else 3)
    if ctx.world_size != 2:  # the rest once, at two ranks
        return
    plain, _, plain_w = train(ctx, tiny_lm, lm=True, units=blocks, local=4, steps=2)
    accum, _, accum_w = train(ctx, tiny_lm, lm=True, units=blocks, micro=2, steps=2)
    diff = max((plain_w[n] - accum_w[n]).abs().max().item() for n in plain_w)
    record("gradient_accumulation", accum["allclose"] and accum["bitwise"] and diff < 1e-5,
           f"2 micro-batches vs one process {accum['max_diff']:.2e}, vs the plain run {diff:.2e}")
    ckpt, _, ckpt_w = train(ctx, lambda: tiny_lm(checkpoint=True), lm=True, units=blocks, local=4, steps=2)
    same = all(torch.equal(plain_w[n], ckpt_w[n]) for n in plain_w)
    record("checkpointing_equals_plain", ckpt["allclose"] and same,
           f"vs one process {ckpt['max_diff']:.2e}; bitwise equal to the plain run: {same}")
    counts = [gathers_per_step(ctx, lambda c=c: tiny_lm(checkpoint=c), blocks) for c in (False, True)]
    (plain_n, units), (ckpt_n, _) = counts
    record("checkpointing_gathers_once", plain_n == ckpt_n == 2 * units - 1,
           f"all-gathers per step: plain {plain_n}, checkpointed {ckpt_n}, units {units} "
           f"(forward each unit once, backward all but the last, kept gathered)")
    seen = saved_weights_told_apart(ctx)
    record("gathered_weights_told_apart", seen["weights"] > 0 and seen["other"] > 0, seen)
    diffs = ddp_with_checkpointing(ctx)
    record("ddp_classes_with_checkpointing", max(diffs.values()) < 1e-6, diffs)
    args = argparse.Namespace(model="tiny", batch_size=4, context_length=16, trace_dir=trace_dir)
    summaries = profiling.profile_ddp(ctx, [("fsdp (07)", lambda m: FSDP(m, units=list(m.blocks)))],
                                      args, name="07_fsdp")
    if ctx.is_main:
        s = summaries[0]
        record("profile_shows_collectives_during_backward",
               s["collectives"] >= 9 and s["comm_during_backward_ms"] > 0, s)
    fsdp_mod.verify_main(ctx, None)  # the plain run's checks and table, in this launch
    record("plain_run_verifies", True, "verify_main returned")


def worker_07(ctx, out_path):
    """Stage 07's sharding checks at one world size: FSDP's, then ZeRO's, then (2 ranks) the ledger."""
    import test_07_zero
    findings = {}

    def record(name, ok, detail):
        findings[name] = [bool(ok), str(detail)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warning-free, as `python -W error` would check
        torch.use_deterministic_algorithms(True)
        fsdp_checks(ctx, str(Path(out_path).parent / "traces"), record)
        torch.use_deterministic_algorithms(False)
    try:
        test_07_zero.cases_worker(ctx)
        record("zero", True, "")
    except AssertionError as e:  # (the same on every rank: no collective is left waiting)
        record("zero", False, e)
    if ctx.world_size == 2:
        ledger_checks(ctx, record)
    if ctx.is_main:
        Path(out_path).write_text(json.dumps(findings))


_FINDINGS: dict[int, dict] = {}


def launch_07(world_size: int, tmp_dir: Path) -> dict:
    """The findings of the one launch at ``world_size`` (launched on first use)."""
    if world_size not in _FINDINGS:
        out = tmp_dir / f"findings{world_size}.json"
        launch.launch(worker_07, launch.LaunchConfig(world_size, "gloo", "cpu"), str(out),
                      timeout_s=300)
        _FINDINGS[world_size] = json.loads(out.read_text())
    return _FINDINGS[world_size]


@pytest.fixture
def findings(tmp_path):
    return lambda world_size: launch_07(world_size, tmp_path)


CASES_ALL = ["norm_toy_sgd", "norm_toy_memory_after_step", "norm_toy_adamw", "toy_sgd",
             "toy_memory_after_step", "toy_adamw", "tied_layer_sgd", "tied_layer_memory_after_step",
             "tied_layer_adamw", "lm_per_block_adamw", "lm_memory_after_step",
             "lm_peak_gathered_below_full_model", "norm_toy_bfloat16", "norm_toy_float16"]
CASES_TWO = ["tied_lm_sgd", "tied_lm_memory_after_step", "lm_bfloat16", "lm_float16",
             "gradient_accumulation", "checkpointing_equals_plain",
             "checkpointing_gathers_once", "gathered_weights_told_apart", "ddp_classes_with_checkpointing",
             "profile_shows_collectives_during_backward", "plain_run_verifies", "ledger_rows",
             "ledger_fsdp_peak", "ledger_checkpointing_saves_activations", "ledger_csv",
             "ledger_targets_printed"] + [f"ledger_{impl}_{ck}_{what}" for impl, ck in [
                 *((i, "off") for i in IMPLS), ("fsdp", "on")] for what in ("bytes_held", "bytes_sent", "activations")
                 if ck == "off" or what != "activations"]


@pytest.mark.parametrize("world_size, case", [(2, c) for c in CASES_ALL + CASES_TWO]
                         + [(3, c) for c in CASES_ALL])
def test_fsdp(findings, world_size, case):
    found = findings(world_size)
    assert case in found, f"{case} was not checked at world size {world_size}"
    ok, detail = found[case]
    assert ok, f"{case} at world size {world_size}: {detail}"


def test_bad_input_one_line(capsys, tmp_path, monkeypatch):
    for kwargs, needle in (({"compute_dtype": torch.int64}, "torch.int64"),
                           ({"compute_dtype": "bfloat16"}, "'bfloat16'"),
                           ({"reduce_dtype": torch.bool}, "reduce_dtype")):
        with pytest.raises(TypeError) as e:
            FSDP(nn.Linear(2, 2), **kwargs)
        assert needle in str(e.value) and "float16, bfloat16, float32" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="no 2. dimensional weight to shard") as e:
        FSDP(nn.Sequential(nn.LayerNorm(4), nn.ReLU()))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="submodule"):
        FSDP(nn.Linear(2, 2), units=[nn.Linear(2, 2)])
    # flags, and --bench's up-front checks: one line, exit 2, no worker started
    for argv, needle in ((["--world-size", "0"], "--world-size"), (["--steps", "0"], "'0' is not a whole number"),
                         (["--rounds", "nan"], "'nan' is not a whole number"), (["--model", "huge"], "'huge'"),
                         (["--checkpointing", "maybe"], "'maybe' is not allowed"),
                         (["--checkpointing", ","], "subset of off, on"),
                         (["--bench", "--batch-size", "3"], "--batch-size 3 is not divisible"),
                         (["--profile", "--batch-size", "3"], "--batch-size 3 is not divisible"),
                         (["--bench", "--model", "2.7B", "--batch-size", "2", "--context-length", "100000"],
                          "GiB")):
        ranks = [] if argv[0] == "--world-size" else ["--world-size", "2"]
        assert_main_usage_error(fsdp_mod.main, [*argv, *ranks, "--backend", "gloo", "--device", "cpu"],
                                capsys, needle)
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("RESULTS_DIR", str(tmp_path / "a_file"))
    assert_main_usage_error(fsdp_mod.main, ["--bench", "--world-size", "2", "--backend", "gloo", "--device",
                                            "cpu"], capsys, "cannot write results")


def test_units_plan():
    """Named units take the weights below them; the rest get a unit per owner; a weight shared
    by two units merges them (the tied embedding and output layer)."""
    lm = tiny_lm(tied=True)
    plan = fsdp_mod.plan_units(lm, list(lm.blocks))
    roots = [[type(r).__name__ for r in roots] for roots, _ in plan]
    assert roots == [["Embedding", "Linear"], ["Embedding"], ["Block"], ["Block"]], roots
    assert [len(slots) for _, slots in plan] == [2, 1, 4, 4]
    flat = torch.arange(10.0)  # copy_rows: a 5 x 2 tensor over 3 ranks, k = 2 rows each
    blocks = torch.zeros(3, 4)
    fsdp_mod.copy_rows(flat, blocks, into_blocks=True)
    assert blocks.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 0]]
    back = torch.zeros(10)
    fsdp_mod.copy_rows(back, blocks, into_blocks=False)
    assert torch.equal(back, flat)


def test_copy_one_file(tmp_path):
    """The file alone, on a one-rank group: FSDP trains a model to the single-process weights,
    in float32 and with bfloat16 compute; the harness says it needs the repository."""
    shutil.copy(SCRIPT, tmp_path / "fsdp.py")
    code = textwrap.dedent(f"""
        import torch, torch.distributed as dist, torch.nn as nn
        from fsdp import FSDP
        import fsdp
        dist.init_process_group("gloo", init_method="file://{tmp_path}/rdzv", rank=0, world_size=1)
        make = lambda: nn.Sequential(nn.Linear(6, 7), nn.LayerNorm(7), nn.ReLU(), nn.Linear(7, 3))
        for dtype in (None, torch.bfloat16):
            torch.manual_seed(0); model = FSDP(make(), compute_dtype=dtype)
            torch.manual_seed(0); ref = make()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
            x, y = torch.randn(8, 6), torch.randn(8, 3)
            for _ in range(2):
                for m, o in ((model, opt), (ref, ref_opt)):
                    o.zero_grad(); nn.functional.mse_loss(m(x).float(), y).backward()
                    getattr(m, "finish_gradient_synchronization", lambda: None)(); o.step()
            got = model.gather_full_params()
            tol = 1e-6 if dtype is None else 2e-2
            for name, p in ref.named_parameters():
                assert torch.allclose(got[name], p, atol=tol), (dtype, name)
        try:
            fsdp.main([])
            raise AssertionError("the harness ran without common/")
        except SystemExit as e:
            assert "common/" in str(e), e
        dist.destroy_process_group()
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
