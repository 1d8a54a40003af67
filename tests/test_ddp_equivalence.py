"""One equivalence suite for every DDP in the repo, with torch's DistributedDataParallel as control.

To add a DDP: add one line to ``DDP_CASES`` below (and its ``import``). Nothing else.

What every case must do (SPEC 4/03-4/06, issue 4), checked on world sizes 2 and 3:
* each rank seeds differently before building the model; after wrapping, every rank holds
  rank 0's parameters and buffers bitwise (the broadcast), incl. a BatchNorm model's
  float and int64 buffers; the frozen parameter never changes;
* ToyModel (frozen parameter, no-grad bias), TiedModel (one weight used twice) and
  BranchModel (a branch skipped on some ranks, then on all), each with SGD (momentum) and
  AdamW, 5 steps on a freshly shuffled random dataset split across ranks: after every
  step the averaged gradients and the parameters equal single-process training on the
  whole global batch (allclose at float32 tolerance) and are bitwise identical across
  ranks; a gradient that no rank produced stays ``None`` (torch DDP with
  ``find_unused_parameters=True`` is the control);
* wrapping a model with no trainable parameters raises a clear error.

Speed: one process launch per world size runs every case x model x optimizer x step inside
the workers (a launch costs seconds on a small machine); each rank computes the
single-process reference itself (same seed, whole batch), so no extra launch. Each rank
writes its findings to a JSON file; the parametrised tests read them, one test per
(DDP, world size). ``DDP_EQUIV_CASES=overlap,flat`` runs a subset (e.g. while debugging).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import bucketed_ddp
import flat_ddp
import naive_ddp
import overlap_ddp
from common import launch
from common.models import BatchNormModel, BranchModel, TiedModel, ToyModel, random_regression_data


class TorchDDPControl(nn.parallel.DistributedDataParallel):
    """torch's DDP with the repo's contract: it has already synchronised inside backward()."""

    def finish_gradient_synchronization(self) -> None:
        pass


def bucket_size_mb_for(params: list[torch.Tensor], n_buckets: int) -> float:
    """The smallest cap (MiB) at which ``assign_buckets`` makes at most ``n_buckets``
    buckets (a bucket always closes after a contiguous run, so the answer is one of the
    contiguous runs' sizes: tried in increasing order; quadratic, meant for small models)."""
    if not params:
        return 1.0  # nothing to bucket; any valid cap will do
    sizes = [p.numel() * p.element_size() for p in reversed(params)]
    runs = sorted({sum(sizes[i:j]) for i in range(len(sizes)) for j in range(i + 1, len(sizes) + 1)})
    for cap in runs:
        if len(bucketed_ddp.assign_buckets(params, cap / 2**20)) <= n_buckets:
            return cap / 2**20
    return runs[-1] / 2**20


# name -> factory(module) -> wrapper with .module and finish_gradient_synchronization().
DDP_CASES = {
    "naive": lambda m: naive_ddp.NaiveDDP(m),
    "flat": lambda m: flat_ddp.FlatDDP(m),
    "overlap": lambda m: overlap_ddp.OverlapDDP(m),
    # bucket sizes that give the toy models one bucket, two, and one per parameter
    "bucketed_one": lambda m: bucketed_ddp.BucketedDDP(m, bucket_size_mb=None),
    "bucketed_two": lambda m: bucketed_ddp.BucketedDDP(m, bucket_size_mb=bucket_size_mb_for(
        [p for p in m.parameters() if p.requires_grad], n_buckets=2)),
    "bucketed_per_param": lambda m: bucketed_ddp.BucketedDDP(m, bucket_size_mb=1e-9),
    "torch_ddp": lambda m: TorchDDPControl(m, find_unused_parameters=True),
}

WORLD_SIZES = [2, 3]
STEPS = 5
LOCAL_BATCH = 4
RTOL, ATOL = 1e-5, 1e-6  # float32 tolerance: the sums run in a different order
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
}
MODELS = {"toy": ToyModel, "tied": TiedModel, "branch": BranchModel}


def branch_used(step: int, rank: int, world_size: int) -> bool:
    """BranchModel's schedule: every rank, rank 0 only, no rank, the last rank only, every rank."""
    return [True, rank == 0, False, rank == world_size - 1, True][step % 5]


def selected_cases() -> list[str]:
    names = os.environ.get("DDP_EQUIV_CASES")
    return [n for n in DDP_CASES if not names or n in names.split(",")]


# --------------------------------------------------------------------------- in the workers


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


def _bitwise_same_across_ranks(tensors: list[torch.Tensor]) -> bool:
    mine = torch.cat([t.detach().flatten().double() for t in tensors])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], other) for other in everyone)


def _check_broadcast(ctx, factory, fail) -> None:
    """BatchNorm model: every rank's buffers (float and int64) differ before wrapping."""
    torch.manual_seed(100 + ctx.rank)
    model = BatchNormModel()
    model.bn.running_mean.copy_(torch.randn(16))
    model.bn.running_var.copy_(torch.rand(16) + 0.5)
    model.bn.num_batches_tracked.fill_(7 + ctx.rank)
    torch.manual_seed(100)  # rank 0's model, rebuilt here as the expected state
    expected = BatchNormModel()
    expected.bn.running_mean.copy_(torch.randn(16))
    expected.bn.running_var.copy_(torch.rand(16) + 0.5)
    expected.bn.num_batches_tracked.fill_(7)
    wrapped = factory(model)
    if wrapped.module is not model:
        fail("batchnorm: .module is not the wrapped model")
    for (name, got), want in zip([*model.named_parameters(), *model.named_buffers()],
                                 _state(expected)):
        if not torch.equal(got, want):
            fail(f"batchnorm: {name} differs from rank 0's after wrapping "
                 f"(max |diff| {(got.double() - want.double()).abs().max().item():.3g})")


def _check_no_trainable(factory, fail) -> None:
    model = ToyModel()
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        factory(model)
    except Exception as e:  # noqa: BLE001 - any clear error will do
        if "grad" not in str(e).lower():
            fail(f"no trainable params: error does not say why: {type(e).__name__}: {e}")
    else:
        fail("no trainable params: wrapping did not raise")


def _check_training(ctx, factory, model_name, opt_name, fail) -> None:
    ws, rank = ctx.world_size, ctx.rank
    build, make_opt = MODELS[model_name], OPTIMIZERS[opt_name]
    where = f"{model_name}+{opt_name}"
    torch.manual_seed(10 + rank)  # a different model on every rank ...
    model = build()
    torch.manual_seed(10)  # ... and rank 0's, trained alone as the reference
    reference = build()
    initial = _state(reference)
    ddp = factory(model)
    if ddp.module is not model:
        fail(f"{where}: .module is not the wrapped model")
    for (name, got), want in zip([*model.named_parameters(), *model.named_buffers()], initial):
        if not torch.equal(got, want):
            fail(f"{where}: after wrapping, {name} is not rank 0's")
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    ref_opt = make_opt([p for p in reference.parameters() if p.requires_grad])
    data_x, data_y = random_regression_data(8 * LOCAL_BATCH * ws, seed=3)
    n = LOCAL_BATCH * ws
    for step in range(STEPS):
        # A fresh shuffle every step, the same on every rank; rank r takes slice r.
        order = torch.randperm(len(data_x), generator=torch.Generator().manual_seed(step))[:n]
        x, y = data_x[order], data_y[order]
        chunks = [slice(r * LOCAL_BATCH, (r + 1) * LOCAL_BATCH) for r in range(ws)]
        kwargs = [dict(use_branch=branch_used(step, r, ws)) if model_name == "branch" else {}
                  for r in range(ws)]

        opt.zero_grad(set_to_none=True)
        F.mse_loss(ddp(x[chunks[rank]], **kwargs[rank]), y[chunks[rank]]).backward()
        ddp.finish_gradient_synchronization()
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        opt.step()

        ref_opt.zero_grad(set_to_none=True)
        if model_name == "branch":  # each slice with its rank's choice: mean of equal-size means
            loss = sum(F.mse_loss(reference(x[c], **k), y[c]) for c, k in zip(chunks, kwargs)) / ws
        else:
            loss = F.mse_loss(reference(x), y)  # the whole global batch at once
        loss.backward()
        ref_grads = [None if p.grad is None else p.grad.clone() for p in reference.parameters()]
        ref_opt.step()

        at = f"{where} step {step}"
        for (name, p), q, g, rg in zip(model.named_parameters(), reference.parameters(),
                                       grads, ref_grads):
            if (g is None) != (rg is None):
                fail(f"{at}: {name}.grad is {'None' if g is None else 'set'} but single-process "
                     f"training has it {'None' if rg is None else 'set'}")
            elif g is not None and not torch.allclose(g, rg, rtol=RTOL, atol=ATOL):
                fail(f"{at}: {name}.grad differs from single process, max |diff| "
                     f"{(g - rg).abs().max().item():.3g}")
            if not torch.allclose(p, q, rtol=RTOL, atol=ATOL):
                fail(f"{at}: {name} differs from single process, max |diff| "
                     f"{(p - q).abs().max().item():.3g}")
        if not _bitwise_same_across_ranks(list(model.parameters())):
            fail(f"{at}: parameters are not bitwise identical across ranks")
        if hasattr(model, "frozen_scale") and not torch.equal(
                model.frozen_scale, initial[[n for n, _ in reference.named_parameters()]
                                            .index("frozen_scale")]):
            fail(f"{at}: the frozen parameter changed")


def equivalence_worker(ctx, case_names: list[str], out_dir: str) -> None:
    torch.set_num_threads(1)
    findings = {}
    for name in case_names:
        factory, failures, checks = DDP_CASES[name], [], 0
        try:
            _check_broadcast(ctx, factory, failures.append)
            _check_no_trainable(factory, failures.append)
            checks += 2
            for model_name in MODELS:
                for opt_name in OPTIMIZERS:
                    _check_training(ctx, factory, model_name, opt_name, failures.append)
                    checks += 1
        except Exception as e:  # noqa: BLE001 - record it; the same error on every rank
            failures.append(f"raised {type(e).__name__}: {e}")
        findings[name] = dict(failures=failures, checks=checks)
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{ctx.rank}.json"), "w") as f:
        json.dump(findings, f)


# --------------------------------------------------------------------------- the tests

_RUNS: dict[int, dict] = {}


@pytest.fixture(scope="module")
def findings_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ddp_equivalence")


def findings_for(world_size: int, base) -> dict:
    """One launch per world size for all cases; {case: [failures from any rank]}."""
    if world_size not in _RUNS:
        out = base / f"ws{world_size}"
        out.mkdir()
        launch.launch(equivalence_worker, launch.LaunchConfig(world_size, "gloo", "cpu"),
                      selected_cases(), str(out), timeout_s=240)
        merged: dict = {}
        for rank in range(world_size):
            for case, f in json.loads((out / f"rank{rank}.json").read_text()).items():
                entry = merged.setdefault(case, dict(failures=[], checks=f["checks"]))
                entry["failures"] += [f"rank {rank}: {msg}" for msg in f["failures"]]
        _RUNS[world_size] = merged
    return _RUNS[world_size]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", list(DDP_CASES))
def test_ddp_matches_single_process(case, world_size, findings_dir):
    if case not in selected_cases():
        pytest.skip("not in DDP_EQUIV_CASES")
    found = findings_for(world_size, findings_dir)[case]
    assert found["checks"] == 2 + len(MODELS) * len(OPTIMIZERS), found["failures"]
    assert not found["failures"], "\n".join(found["failures"][:20])


def test_branch_schedule_covers_some_and_all_ranks():
    """The unused-branch schedule really has steps skipped by some ranks and by all."""
    for ws in WORLD_SIZES:
        used = [[branch_used(s, r, ws) for r in range(ws)] for s in range(STEPS)]
        assert any(any(u) and not all(u) for u in used)  # some ranks only
        assert any(not any(u) for u in used)  # no rank
