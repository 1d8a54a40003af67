"""Stages 05 and 06: OverlapDDP and BucketedDDP under what real training throws at them.

One process launch per world size (a launch costs seconds on a small machine), looping over
every case inside the worker and asserting there: training equals single-process training,
tied weights, unused branches on some ranks or all (no hang: the launch has a timeout),
rank-dependent gradient arrival order, no_sync() accumulation, many steps with and without
set_to_none, float64 beside float32, that every all-reduce is launched inside backward
(before finish_gradient_synchronization()) and none inside no_sync(), and that rank 0 alone
decides whether stage 06 reads stage 02's fit or measures. Pure checks (bucket assignment,
the overhead model, bad bucket sizes) and the copy-one-file checks run without a process
group.
"""

from __future__ import annotations

import copy
import gc
import math
import shutil
import textwrap
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import bucketed_ddp
from bucketed_ddp import BucketedDDP, assign_buckets, best_bucket_size_bytes, check_bucket_size_mb
from common import launch
from common.models import TiedModel, ToyModel, random_regression_data
from helpers import run_script
from overlap_ddp import OverlapDDP

# name -> wrapper. Bucket sizes chosen for the toy models (a few hundred bytes each):
# one bucket, a handful, and one bucket per parameter.
WRAPPERS = {
    "overlap": lambda m: OverlapDDP(m),
    "bucketed_one": lambda m: BucketedDDP(m, bucket_size_mb=None),
    "bucketed_big": lambda m: BucketedDDP(m, bucket_size_mb=25.0),
    "bucketed_small": lambda m: BucketedDDP(m, bucket_size_mb=700 / 2**20),
    "bucketed_per_param": lambda m: BucketedDDP(m, bucket_size_mb=1e-9),
}


# --------------------------------------------------------------------------- models


class BranchModel(nn.Module):
    """fc_in -> [+ branch] -> [+ unused] -> fc_out; which optional paths run is per call."""

    def __init__(self):
        super().__init__()
        self.fc_in = nn.Linear(10, 16)
        self.branch = nn.Linear(16, 16)
        self.unused = nn.Linear(16, 16)  # between the others in launch order on purpose
        self.fc_out = nn.Linear(16, 5)

    def forward(self, x, use_branch=True, use_unused=False):
        h = F.relu(self.fc_in(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        if use_unused:
            h = h + self.unused(h)
        return self.fc_out(h)


class TwoPathModel(nn.Module):
    """Two independent paths; the one computed last in forward gets its gradient first."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(10, 7)
        self.b = nn.Linear(10, 3)

    def forward(self, x, a_first=True):
        if a_first:
            ya = self.a(x)
            yb = self.b(x)
        else:
            yb = self.b(x)
            ya = self.a(x)
        return torch.cat([ya, yb], dim=1)[:, :5]


class MixedDtypeModel(nn.Module):
    """A float64 layer between float32 ones: separate buckets per dtype."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 8)
        self.fc64 = nn.Linear(8, 8).double()
        self.fc2 = nn.Linear(8, 5)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        return self.fc2(torch.tanh(self.fc64(h.double())).float())


# --------------------------------------------------------------------------- helpers


def assert_bitwise_equal_across_ranks(tensors, what):
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    for r, other in enumerate(everyone):
        assert torch.equal(other, everyone[0]), f"{what}: rank {r} differs from rank 0"


def check_training(ctx, name, wrap, make_model, steps=4, set_to_none=True, per_rank=3, lr=0.1):
    """Train wrapped vs single-process on the full batch; parameters must match."""
    torch.manual_seed(1234)
    model = make_model()
    reference = copy.deepcopy(model)
    ddp = wrap(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    mine = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
    for step in range(steps):
        x, y = random_regression_data(per_rank * ctx.world_size, seed=100 + step)
        opt.zero_grad(set_to_none=set_to_none)
        F.mse_loss(ddp(x[mine]), y[mine]).backward()
        ddp.finish_gradient_synchronization()
        opt.step()
        ref_opt.zero_grad(set_to_none=set_to_none)
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
    for (pname, p), q in zip(ddp.module.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), \
            f"{name}: {pname} differs from single-process by {(p - q).abs().max().item():.3g}"
    assert_bitwise_equal_across_ranks(list(ddp.module.parameters()), name)


def expected_grads(module, per_rank_calls, priors):
    """Mean over ranks of (prior .grad + this backward's gradient), zeros where a rank has
    neither, None where no rank has either: computed in this one process, no collectives."""
    totals = []  # per rank: name -> tensor or None
    for call in per_rank_calls:
        local = copy.deepcopy(module)
        for p in local.parameters():
            p.grad = None
        call(local)
        totals.append({})
        for name, p in local.named_parameters():
            prior = priors[name]
            parts = [t for t in (prior, p.grad) if t is not None]
            totals[-1][name] = sum(parts) if parts else None
    out = {}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        have = [t[name] for t in totals if t[name] is not None]
        out[name] = None if not have else sum(have) / len(totals)
    return out


def check_grads(what, module, expected):
    for name, p in module.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, f"{what}: frozen {name} got a gradient"
            continue
        want = expected[name]
        if want is None:
            assert p.grad is None, f"{what}: {name} should have no gradient (missing on every rank)"
        else:
            assert p.grad is not None, f"{what}: {name} has no gradient"
            assert torch.allclose(p.grad, want, rtol=1e-5, atol=1e-7), \
                f"{what}: {name} gradient off by {(p.grad - want).abs().max().item():.3g}"


def check_unused_parameters(ctx, name, wrap, set_to_none):
    """Branches used on some ranks, on all, on none; many steps; exact None-ness."""
    ws, rank = ctx.world_size, ctx.rank
    torch.manual_seed(7)
    ddp = wrap(BranchModel())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    # per step: (ranks using `branch`, ranks using `unused`)
    schedule = [(set(range(ws)), set()), ({0}, set()), ({ws - 1}, {0}), (set(), set()),
                (set(range(ws)), set(range(ws))), ({0}, {ws - 1})]
    per_rank = 2
    for step, (branch_ranks, unused_ranks) in enumerate(schedule):
        x, y = random_regression_data(per_rank * ws, seed=500 + step)
        opt.zero_grad(set_to_none=set_to_none)
        priors = {n: (None if p.grad is None else p.grad.clone())
                  for n, p in ddp.module.named_parameters()}

        def call_for(r):
            def call(m):
                s = slice(r * per_rank, (r + 1) * per_rank)
                F.mse_loss(m(x[s], use_branch=r in branch_ranks, use_unused=r in unused_ranks),
                           y[s]).backward()
            return call

        expected = expected_grads(ddp.module, [call_for(r) for r in range(ws)], priors)
        s = slice(rank * per_rank, (rank + 1) * per_rank)
        out = ddp(x[s], use_branch=rank in branch_ranks, use_unused=rank in unused_ranks)
        F.mse_loss(out, y[s]).backward()
        ddp.finish_gradient_synchronization()
        check_grads(f"{name} unused step {step} set_to_none={set_to_none}", ddp.module, expected)
        assert_bitwise_equal_across_ranks(
            [p.grad for p in ddp.module.parameters() if p.grad is not None], f"{name} grads")
        opt.step()


def check_arrival_order(ctx, name, wrap):
    """Gradients arrive in a different order on each rank; launches must not follow them."""
    torch.manual_seed(3)
    ddp = wrap(TwoPathModel())
    reference = copy.deepcopy(ddp.module)
    x, y = random_regression_data(2 * ctx.world_size, seed=9)
    s = slice(ctx.rank * 2, (ctx.rank + 1) * 2)
    F.mse_loss(ddp(x[s], a_first=ctx.rank % 2 == 0), y[s]).backward()
    ddp.finish_gradient_synchronization()
    F.mse_loss(reference(x), y).backward()
    for (pname, p), q in zip(ddp.module.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), f"{name}: {pname} order case"


def check_no_sync(ctx, name, wrap, k=3, per_micro=2):
    """k micro-batches inside no_sync(), one synced: equals one step on the whole batch."""
    torch.manual_seed(11)
    model = ToyModel()
    reference = copy.deepcopy(model)
    ddp = wrap(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    micro = k + 1
    n = micro * per_micro * ctx.world_size
    for step in range(2):
        x, y = random_regression_data(n, seed=900 + step)
        xr = x.view(ctx.world_size, micro * per_micro, -1)[ctx.rank]
        yr = y.view(ctx.world_size, micro * per_micro, -1)[ctx.rank]
        opt.zero_grad()
        with ddp.no_sync():
            for i in range(k):
                sl = slice(i * per_micro, (i + 1) * per_micro)
                (F.mse_loss(ddp(xr[sl]), yr[sl]) / micro).backward()
        sl = slice(k * per_micro, (k + 1) * per_micro)
        (F.mse_loss(ddp(xr[sl]), yr[sl]) / micro).backward()
        ddp.finish_gradient_synchronization()
        opt.step()
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
    for (pname, p), q in zip(ddp.module.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), \
            f"{name} no_sync: {pname} off by {(p - q).abs().max().item():.3g}"


def check_tied_hook_count(ctx, name, wrap):
    torch.manual_seed(5)
    ddp = wrap(TiedModel())
    fired = []
    ddp.module.shared.weight.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    x, y = random_regression_data(4, seed=1)
    for _ in range(3):
        ddp.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        ddp.finish_gradient_synchronization()
    assert len(fired) == 3, f"{name}: tied weight's hook fired {len(fired)} times in 3 backwards"
    if isinstance(ddp, BucketedDDP):
        n_slots = sum(len(b.params) for b in ddp.buckets)
        assert n_slots == len(list(ddp.module.parameters())), "tied weight bucketed twice"


def launched_in_backward(ddp) -> tuple[int, int]:
    """(collectives launched so far this step, collectives a synced step launches in all),
    read from the classes' own state: OverlapDDP launches one all-reduce per parameter,
    BucketedDDP one per bucket."""
    if isinstance(ddp, BucketedDDP):
        works = [b.work for b in ddp.buckets]
        assert ddp._next == sum(w is not None for w in works), "bucket cursor vs handles"
        return sum(w is not None for w in works), len(ddp.buckets)
    assert ddp._next == len(ddp._works), "parameter cursor vs handles"
    assert all(isinstance(w, dist.Work) for _, _, w in ddp._works)
    return len(ddp._works), len(ddp._params)


def check_launched_during_backward(ctx, name, wrap, make_model):
    """Communication starts INSIDE backward: when loss.backward() returns (every gradient
    arrived), every all-reduce has already been launched, before
    finish_gradient_synchronization() is called. Inside no_sync() nothing is launched."""
    torch.manual_seed(21)
    ddp = wrap(make_model())
    x, y = random_regression_data(4, seed=22)
    for step in range(2):  # the per-step state resets
        ddp.zero_grad(set_to_none=step == 0)
        with ddp.no_sync():
            F.mse_loss(ddp(x), y).backward()
            assert launched_in_backward(ddp)[0] == 0, f"{name}: launched inside no_sync()"
        assert launched_in_backward(ddp)[0] == 0, f"{name}: launched after no_sync() backward"
        F.mse_loss(ddp(x), y).backward()
        done, total = launched_in_backward(ddp)
        assert total > 0 and done == total, \
            f"{name} {make_model.__name__}: only {done} of {total} all-reduces launched in backward"
        ddp.finish_gradient_synchronization()
        assert launched_in_backward(ddp)[0] == 0, f"{name}: state not reset after finish"


def check_latency_bandwidth_decided_by_rank0(ctx):
    """Stage 06's harness: only rank 0's results/ decides between stage 02's fit and measuring
    (multi-node: each node has its own results/; a split decision would hang)."""
    import os
    import tempfile

    from common import results
    saved = os.environ.get("RESULTS_DIR")
    key = f"{ctx.backend}/{ctx.device.type}/{ctx.world_size}"
    fit = {key: {"a_s": 1e-4, "w_bytes_per_s": 2e9}}
    made_dirs = []
    try:
        for rank0_has_fit in (True, False):
            # each rank its own results folder; only one side has a usable fit in it
            os.environ["RESULTS_DIR"] = made = tempfile.mkdtemp()
            made_dirs.append(made)
            if ctx.is_main == rank0_has_fit:
                results.write_json("allreduce_fit.json", fit)
            got = bucketed_ddp.latency_bandwidth(ctx, results)
            everyone = [None] * ctx.world_size
            dist.all_gather_object(everyone, got["source"])
            assert len(set(everyone)) == 1, f"ranks decided differently: {everyone}"
            if rank0_has_fit:
                assert "stage 02" in got["source"] and got["a_s"] == 1e-4, got
            else:
                assert got["source"] == "measured in this run" and got["w_bytes_per_s"] > 0, got
        # under make bench (RESULTS_RUN_ID set) a fit written by another run is not used
        if ctx.is_main:
            results.write_json("allreduce_fit.json", {key: {**fit[key], "run_id": "old"}})
        os.environ["RESULTS_RUN_ID"] = "new"
        try:
            got = bucketed_ddp.latency_bandwidth(ctx, results)
        finally:
            os.environ.pop("RESULTS_RUN_ID")
        assert got["source"] == "measured in this run", got
    finally:
        for made in made_dirs:
            shutil.rmtree(made, ignore_errors=True)
        if saved is None:
            os.environ.pop("RESULTS_DIR", None)
        else:
            os.environ["RESULTS_DIR"] = saved


def ddp_cases_worker(ctx):
    check_latency_bandwidth_decided_by_rank0(ctx)
    for name, wrap in WRAPPERS.items():
        for make_model in (ToyModel, TiedModel, MixedDtypeModel):
            check_launched_during_backward(ctx, name, wrap, make_model)
        for set_to_none in (True, False):
            check_training(ctx, f"{name} toy", wrap, ToyModel, set_to_none=set_to_none)
            check_unused_parameters(ctx, name, wrap, set_to_none)
        check_training(ctx, f"{name} tied", wrap, TiedModel)
        check_training(ctx, f"{name} float64", wrap, MixedDtypeModel)
        check_arrival_order(ctx, name, wrap)
        check_no_sync(ctx, name, wrap)
        check_tied_hook_count(ctx, name, wrap)
    # float64 really sits in its own bucket, whatever the cap
    for size in (None, 25.0, 1e-9):
        ddp = BucketedDDP(MixedDtypeModel(), bucket_size_mb=size)
        for bucket in ddp.buckets:
            assert len({p.dtype for p in bucket.params}) == 1
        assert {b.buffer.dtype for b in ddp.buckets} == {torch.float32, torch.float64}
    # A dropped wrapper and its model are freed: the hooks (held by autograd in C++, out of
    # the garbage collector's sight) must not keep them alive in a reference cycle.
    for name, wrap in WRAPPERS.items():
        model = ToyModel()
        ddp = wrap(model)
        x, y = random_regression_data(4, seed=3)
        F.mse_loss(ddp(x), y).backward()
        ddp.finish_gradient_synchronization()
        refs = [weakref.ref(model), weakref.ref(ddp)]
        del model, ddp
        gc.collect()
        assert all(r() is None for r in refs), f"{name}: a dropped wrapper stays alive (leak)"
    # Forgetting finish_gradient_synchronization() is an error, not silent corruption.
    ddp = OverlapDDP(ToyModel())
    x, y = random_regression_data(4, seed=2)
    F.mse_loss(ddp(x), y).backward()
    with pytest.raises(RuntimeError, match="ready twice"):
        F.mse_loss(ddp(x), y).backward()
    # The first backward's all-reduces are still in flight: wait for them before the worker
    # returns, or Gloo tears down under running work and aborts the process.
    ddp.finish_gradient_synchronization()
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_cases(world_size):
    launch.launch(ddp_cases_worker, launch.LaunchConfig(world_size, "gloo", "cpu"),
                  timeout_s=150)


# --------------------------------------------------------------------------- no process group


def test_bucket_size_validation():
    for bad in (0, -1, -0.5, float("nan")):
        with pytest.raises(ValueError, match="bucket_size_mb"):
            BucketedDDP(ToyModel(), bucket_size_mb=bad)
    for bad in ("25", True, [25]):
        with pytest.raises(TypeError, match="bucket_size_mb"):
            BucketedDDP(ToyModel(), bucket_size_mb=bad)
    assert check_bucket_size_mb(None) is None and check_bucket_size_mb(25) == 25.0


def test_bucket_assignment_counts_mib_and_order():
    mib = 2**20 // 4  # float32 elements in one MiB
    params = [torch.empty(mib // 2), torch.empty(mib // 2), torch.empty(3 * mib), torch.empty(mib // 4),
              torch.empty(mib // 4, dtype=torch.float64)]
    # reversed: [4 f64 0.5MiB], [3 0.25], [2 3MiB], [1 0.5], [0 0.5]
    assert assign_buckets(params, 1.0) == [[4], [3], [2], [1, 0]]
    assert assign_buckets(params, None) == [[4], [3, 2, 1, 0]]
    assert assign_buckets(params, 4.0) == [[4], [3, 2, 1], [0]]
    assert assign_buckets(params, 1e-9) == [[4], [3], [2], [1], [0]]
    # exactly the cap fits: two 0.5 MiB tensors make one 1 MiB bucket
    assert assign_buckets(params[:2], 1.0) == [[1, 0]]


def test_overhead_model_minimum():
    s, w, o = 400e6, 1e9, 2e-3
    best_bytes, n_best = best_bucket_size_bytes(s, o, w)
    assert math.isclose(best_bytes * n_best, s)
    f = lambda n: bucketed_ddp.comm_after_backward_model(n, s, o, w)  # noqa: E731
    assert f(n_best) < f(n_best * 1.1) and f(n_best) < f(n_best / 1.1)
    assert math.isclose(f(n_best), 2 * math.sqrt(s * o / w))


COPY_ONE_FILE = """
import os, tempfile, torch, torch.distributed as dist
import {module} as m
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
ref = [p.detach().clone() for p in net.parameters()]
ddp = m.{cls}(net{extra})
x = torch.randn(5, 4)
ddp(x).square().sum().backward()
ddp.finish_gradient_synchronization()
local = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
with torch.no_grad():
    for p, r in zip(local.parameters(), ref): p.copy_(r)
local(x).square().sum().backward()
for p, q in zip(net.parameters(), local.parameters()):
    assert torch.allclose(p.grad, q.grad), "grad differs"
dist.destroy_process_group()
print("ok")
"""


@pytest.mark.parametrize("stage_file,cls,extra", [
    ("05_overlap_ddp/overlap_ddp.py", "OverlapDDP", ""),
    ("06_bucketed_ddp/bucketed_ddp.py", "BucketedDDP", ", bucket_size_mb=1e-4"),
])
def test_copy_one_file(tmp_path, stage_file, cls, extra):
    from helpers import REPO
    shutil.copy(REPO / stage_file, tmp_path)
    module = stage_file.split("/")[-1][:-3]
    code = textwrap.dedent(COPY_ONE_FILE.format(module=module, cls=cls, extra=extra))
    result = run_script("-c", code, cwd=tmp_path, timeout=120,
                        env={"PYTHONPATH": "", "MASTER_ADDR": "", "MASTER_PORT": ""})
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]
