"""Stage 07: ZeRO-1 (ShardedOptimizer) and ZeRO-2 (Zero2DDP) against one process.

Every training case (``train_and_compare``: 10 AdamW steps, the LM 3, two param groups with
their own options, beside plain AdamW on one process, bitwise equal across ranks) runs in
stage 07's one launch per world size (``launch_07`` in tests/test_07_fsdp.py, which also runs
FSDP's cases and the ledger that sets these beside DDP and FSDP). Bad input is tested
in-process; the copy-one-file test trains from the lone file on a 1-rank group.
"""

from __future__ import annotations

import contextlib
import copy
import shutil
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ledger
import zero
from common import import_stage, models
from helpers import BranchModel
from helpers import REPO, assert_main_usage_error, run_script
from test_07_fsdp import launch_07

# (model, wrapper, micro-batches, synchronise each, group added late, resume after step)
CASES = [
    ("toy", "none", 1, False, True, None),    # on its own: every rank has the same gradients
    ("tied", "none", 1, False, False, 4),     # ... and a checkpoint, resumed by plain AdamW
    ("toy", "ddp", 1, False, True, None),     # ZeRO-1 = stage 06 + ShardedOptimizer
    ("branch", "ddp", 1, False, False, 4),    # a branch unused on some ranks, or on all
    ("toy", "zero2", 2, False, False, 3),     # ZeRO-2, accumulation under no_sync()
    ("tied", "zero2", 2, True, False, None),  # ... synchronising every micro-batch
    ("branch", "zero2", 2, True, False, None),
]
LM_CASES = {2: ("lm_ckpt", "zero2", 2, False, False, None),  # checkpointing = the plain LM
            3: ("lm", "zero2", 2, False, False, None)}       # (one per world size, for time)


def train_and_compare(ctx, model="toy", wrapper="ddp", micro_batches=1, sync_each=False,
                      late_group=False, resume_at=None) -> dict:
    """10 steps (LM: 3) of ShardedOptimizer(AdamW), two param groups with own options, under
    ``wrapper`` ("ddp": stage 06's BucketedDDP; "zero2"; "none": every rank computes the whole
    batch) beside plain AdamW on one process; returns what differed and the bytes held. With
    ``resume_at``: consolidate on the last rank there; a plain AdamW goes on from it."""
    n, rank, lm = ctx.world_size, ctx.rank, model.startswith("lm")
    steps = 3 if lm else 10
    build = {"toy": models.ToyModel, "tied": models.TiedModel, "branch": BranchModel,
             "lm": models.TransformerLM, "lm_ckpt": models.TransformerLM}[model]
    kw = {"context_length": 16} if lm else {}  # the reference never checkpoints activations
    torch.manual_seed(1000 + rank)  # ranks start apart: the wrappers broadcast rank 0's start
    net = build(**kw, **({"checkpoint_activations": True} if model == "lm_ckpt" else {}))
    torch.manual_seed(1000)
    ref, lr = build(**kw), 1e-3 if lm else 1e-2

    def groups(m, parts=(0, 1)):  # ToyModel: the frozen parameter and no-grad bias in group 1
        ps = list(m.parameters())
        return [[{"params": ps[:len(ps) // 2], "lr": lr, "weight_decay": 0.1},
                 {"params": ps[len(ps) // 2:], "lr": lr / 3, "betas": (0.8, 0.9)}][i]
                for i in parts]

    opt = zero.ShardedOptimizer(groups(net, [0] if late_group else (0, 1)), torch.optim.AdamW,
                                weight_decay=0.01, eps=1e-6)  # eps: see fsdp.py's verify_main
    ref_opt = torch.optim.AdamW(groups(ref, [0] if late_group else (0, 1)), weight_decay=0.01,
                                eps=1e-6)
    ddp = {"none": lambda: net, "zero2": lambda: zero.Zero2DDP(net, opt, bucket_size_mb=1e-3),
           "ddp": lambda: import_stage("06_bucketed_ddp/bucketed_ddp").BucketedDDP(net, 1e-3)}
    ddp = ddp[wrapper]()
    if wrapper == "none":
        zero.broadcast_module_state(net)
    x_all, y_all = models.random_regression_data(64 * n, seed=7)
    found = {"max_diff": 0.0, "bitwise": True, "allclose": True}

    def loss(m, step, mb, r):  # rank r's 2 samples of micro-batch mb, over micro_batches
        if lm:
            x, y = models.random_tokens(2, 16, seed=1000 * step + 10 * mb + r)
            return models.lm_loss(m(x), y) / micro_batches
        i = torch.randperm(64 * n, generator=torch.Generator().manual_seed(step))
        i = i[(mb * n + r) * 2:(mb * n + r + 1) * 2]  # the branch: all, 0, no, last rank
        kw = {"use_branch": [True, r == 0, False, r == n - 1][step % 4]} if model == "branch" \
            else {}
        return F.mse_loss(m(x_all[i], **kw), y_all[i]) / micro_batches

    def one_process_step(m, o, step):  # the whole batch, every rank's samples
        o.zero_grad()
        for mb in range(micro_batches):
            (sum(loss(m, step, mb, r) for r in range(n)) / n).backward()
        o.step()

    for step in range(steps):
        if late_group and step == 2:  # a group added after construction
            opt.add_param_group(groups(net, [1])[0])
            ref_opt.add_param_group(groups(ref, [1])[0])
        opt.zero_grad()
        for mb in range(micro_batches):
            sync = sync_each or mb == micro_batches - 1
            with contextlib.nullcontext() if sync else ddp.no_sync():
                ranks = range(n) if wrapper == "none" else [rank]
                (sum(loss(ddp, step, mb, r) for r in ranks) / len(ranks)).backward()
            if sync:
                getattr(ddp, "finish_gradient_synchronization", lambda: None)()
        owned = [opt.owner.get(p) == rank for p in net.parameters()]  # (late group: not yet)
        found.update(grad_bytes=ledger.state_bytes(p.grad for p in net.parameters()),
                     owned_grad_bytes=sum(p.numel() * p.element_size() for p, o in
                                          zip(net.parameters(), owned) if o and p.requires_grad),
                     others_freed=all(p.grad is None for p, o in zip(net.parameters(), owned)
                                      if not o))
        opt.step()
        one_process_step(ref, ref_opt, step)
        for p, q in zip(net.parameters(), ref.parameters()):
            found["max_diff"] = max(found["max_diff"], (p - q).abs().max().item())
            found["allclose"] &= torch.allclose(p, q, rtol=1e-4 if lm else 1e-5,
                                                atol=1e-5 if lm else 1e-6)
        flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(n)]
        dist.all_gather(everyone, flat)
        found["bitwise"] &= all(torch.equal(everyone[0], f) for f in everyone)
        if step == resume_at:  # the checkpoint, on the last rank, equals the one-process state
            opt.consolidate_state_dict(to=n - 1)
            if rank == n - 1:
                saved, want = opt.state_dict(), ref_opt.state_dict()
                found["checkpoint_equal"] = saved["param_groups"] == want["param_groups"] \
                    and saved["state"].keys() == want["state"].keys() and all(
                        torch.allclose(saved["state"][i][k], v)
                        for i, s in want["state"].items() for k, v in s.items())
                resumed = copy.deepcopy(net)  # a plain AdamW goes on from it (a copy: loading
                plain = torch.optim.AdamW(groups(resumed))  # shares the dict's tensors)
                plain.load_state_dict(copy.deepcopy(saved))
        elif resume_at is not None and step > resume_at and rank == n - 1:
            one_process_step(resumed, plain, step)
    if resume_at is not None and rank == n - 1:  # resumed = never stopped
        found["resumed_diff"] = max((p - q).abs().max().item()
                                    for p, q in zip(resumed.parameters(), ref.parameters()))
    mine = torch.tensor([ledger.optimizer_state_bytes(opt)], dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(everyone, mine)
    return {**found, "optim_bytes": [int(b.item()) for b in everyone],
            "ref_optim_bytes": ledger.optimizer_state_bytes(ref_opt),
            "largest_param": max(p.numel() for p in net.parameters())}


def case_problems(f: dict, wrapper: str) -> list[str]:
    """What ``train_and_compare`` found that is not as it must be (empty: all is well)."""
    spread = max(f["optim_bytes"]) - sum(f["optim_bytes"]) / len(f["optim_bytes"])
    return [what for what, ok in (
        ("weights differ from one process", f["allclose"]), ("ranks differ", f["bitwise"]),
        ("state bytes do not sum to the unsharded", sum(f["optim_bytes"]) == f["ref_optim_bytes"]),
        ("checkpoint differs", f.get("checkpoint_equal", True)),
        ("resumed run differs", f.get("resumed_diff", 0.0) < 1e-5),
        # within one parameter's moments (+ step counters) of the mean
        ("state unbalanced", spread <= 8 * f["largest_param"] + 4 * 64),
        ("ZeRO-2 holds gradients it does not own", wrapper != "zero2" or (
            f["others_freed"] and 0 < f["grad_bytes"] <= f["owned_grad_bytes"])))
        if not ok]


def cases_worker(ctx):
    failures = []
    for model, wrapper, k, sync_each, late, resume in [*CASES, LM_CASES[ctx.world_size]]:
        f = train_and_compare(ctx, model, wrapper, k, sync_each, late, resume)
        if problems := case_problems(f, wrapper):
            failures.append((model, wrapper, k, sync_each, late, resume, problems, f))
        if wrapper == "zero2" and model.startswith("lm") and f["grad_bytes"] != f["owned_grad_bytes"]:
            failures.append((model, "every parameter had a gradient: all owned ones held", f))
        if resume is not None and ctx.rank == ctx.world_size - 1 and "resumed_diff" not in f:
            failures.append((model, "no checkpoint was taken", f))
    assert not failures, f"rank {ctx.rank}: {failures}"

    # Zero2DDP refuses a module parameter its optimizer does not own, and a bad bucket size
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    opt = zero.ShardedOptimizer(net[0].parameters(), torch.optim.AdamW)
    with pytest.raises(ValueError, match=r"1\.weight, 1\.bias require grad"):
        zero.Zero2DDP(net, opt)
    with pytest.raises(ValueError, match="bucket_size_mb"):
        zero.Zero2DDP(net[0], opt, bucket_size_mb=0)
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        opt.state_dict()
    # CommCounter reads arguments given by keyword (torch's ZeroRedundancyOptimizer does)
    t = torch.ones(10)
    with ledger.CommCounter() as comm:
        dist.broadcast(tensor=t, src=0)
        dist.reduce(t, dst=0)
    n = ctx.world_size
    assert [c["op"] for c in comm.calls] == ["broadcast", "reduce"]
    assert comm.sent_bytes == pytest.approx(2 * 40 * (n - 1) / n)
    if n == 2:
        zero.check_main(ctx, None)  # the plain run's checks and table, in this launch


@pytest.mark.parametrize("world_size", [2, 3])  # 3 does not divide the parameters evenly
def test_zero_against_one_process(world_size, tmp_path):
    ok, detail = launch_07(world_size, tmp_path)["zero"]
    assert ok, detail


# --------------------------------------------------------------------------- no process group


def test_owners_balanced_and_buckets_ordered():
    sizes = [7, 300, 5, 64, 64, 1, 128, 90, 33, 2]
    params = [torch.zeros(s, requires_grad=True) for s in sizes]
    params.append(torch.zeros(1000))  # frozen: weighs nothing
    for world_size in (2, 3, 4):
        loads = [0] * world_size
        owner = zero.assign_owners(params, loads)
        assert sum(loads) == 4 * sum(sizes) and len(owner) == len(params)
        assert max(loads) - sum(loads) / world_size <= 4 * max(sizes)
        for rank in range(world_size):
            assert loads[rank] == sum(4 * p.numel() for p in params if owner[p] == rank
                                      and p.requires_grad)
        buckets = zero.owner_buckets(params[:-1], owner, bucket_size_mb=400 / 2**20)
        assert sorted(id(p) for b in buckets for p in b.params) == sorted(map(id, params[:-1]))
        for b in buckets:
            assert {owner[p] for p in b.params} == {b.owner}
            assert len(b.params) == 1 or sum(4 * p.numel() for p in b.params) <= 400
        # launch order = completion order: by the position (in reverse) of the last parameter
        position = {id(p): len(params) - 2 - i for i, p in enumerate(params[:-1])}
        last = [max(position[id(p)] for p in b.params) for b in buckets]
        assert last == sorted(last)


def test_bad_input_one_line(capsys):
    params = [torch.zeros(2, requires_grad=True)]
    for bad in ("adam", torch.nn.Linear, torch.optim.AdamW([torch.zeros(1, requires_grad=True)])):
        with pytest.raises(TypeError, match="optimizer_cls must be a torch.optim.Optimizer") as e:
            zero.ShardedOptimizer(params, bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="empty parameter list") as e:
        zero.ShardedOptimizer([], torch.optim.AdamW)
    assert "\n" not in str(e.value)
    with pytest.raises(TypeError, match="got one tensor"):
        zero.ShardedOptimizer(params[0], torch.optim.AdamW)
    for argv, says in ((["--world-size", "0"], "'0' is not a whole number >= 1"),
                       (["--world-size", "nan"], "'nan' is not a whole number >= 1"),
                       (["--bench", "--batch-size", "3"], "not divisible by world size 2")):
        assert_main_usage_error(zero.main, [*argv, "--backend", "gloo", "--device", "cpu"],
                                capsys, says)


COPY_ONE_FILE = """
import sys, tempfile, torch, torch.distributed as dist
import zero
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
ref.load_state_dict(net.state_dict())
opt = zero.ShardedOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-2)
ddp = zero.Zero2DDP(net, opt, bucket_size_mb=1e-5)
ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
for step in range(3):
    x = torch.randn(6, 4)
    opt.zero_grad(); ref_opt.zero_grad()
    with ddp.no_sync():
        ddp(x[:3]).square().mean().backward()
    ddp(x[3:]).square().mean().backward()
    ddp.finish_gradient_synchronization()
    opt.step()
    (ref(x[:3]).square().mean() + ref(x[3:]).square().mean()).backward(); ref_opt.step()
for p, q in zip(net.parameters(), ref.parameters()):
    assert torch.allclose(p, q, atol=1e-6), (p - q).abs().max()
opt.consolidate_state_dict(to=0)
plain = torch.optim.AdamW(ref.parameters(), lr=1e-2)
plain.load_state_dict(opt.state_dict())
assert all(torch.allclose(plain.state[p]["exp_avg_sq"], ref_opt.state[p]["exp_avg_sq"])
           for p in ref.parameters())
assert not any(m == "common" or m.startswith("common.") for m in sys.modules)
try:
    zero.main([])
    raise AssertionError("the harness ran without common/")
except SystemExit as e:
    assert "common/" in str(e), e
dist.destroy_process_group()
print("ok")
"""


def test_copy_one_file(tmp_path):
    shutil.copy(REPO / "07_parallelism" / "01_zero" / "zero.py", tmp_path)
    result = run_script("-W", "error", "-c", textwrap.dedent(COPY_ONE_FILE), cwd=tmp_path,
                        timeout=120, env={"PYTHONPATH": "", "MASTER_ADDR": "", "MASTER_PORT": ""})
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
