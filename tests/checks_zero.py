"""Lesson 1's checks (ZeRO-1 ShardedOptimizer, ZeRO-2 Zero2DDP) against one process, run
inside stage 07's one launch per world size (``checks_fsdp.launch_07``) and read by
tests/test_07_zero.py.

``train_and_compare`` runs each case of ``CASES`` (10 AdamW steps, the LM 3, two param groups
with their own options) beside plain AdamW on one process: allclose at float32 tolerance,
bitwise equal across ranks, ZeRO-2 holding exactly the gradients it owns, the optimizer state
split without overlap. The checkpoint cases also resume: the consolidated state dict goes on
in plain AdamW, and (``ShardedOptimizer.load_state_dict``) in a ShardedOptimizer at another
world size; a plain AdamW's state dict goes on in a ShardedOptimizer. ``zero_checks`` runs
them all and the refusals, recording each verdict.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import counters
import zero
from common import import_stage, models
from helpers import BranchModel

CASES = [
    ("toy", "none", 1, False, True, 5),       # on its own: every rank has the same gradients;
    ("tied", "none", 1, False, False, 4),     # a checkpoint, resumed exactly at N-1 ranks, in AdamW
    ("toy", "ddp", 1, False, True, None),     # ZeRO-1 = stage 06 + ShardedOptimizer
    ("branch", "ddp", 1, False, False, 4),    # a branch unused on some ranks, or on all
    ("toy", "zero2", 2, False, False, 3),     # ZeRO-2, accumulation under no_sync()
    ("tied", "zero2", 2, True, False, None),  # ... synchronising every micro-batch
    ("branch", "zero2", 2, True, False, None),
]
LM_CASES = {2: ("lm_ckpt", "zero2", 2, False, False, None),  # checkpointing = the plain LM
            3: ("lm", "zero2", 2, False, False, None)}       # (one per world size, for time)
BUILD = {"toy": models.ToyModel, "tied": models.TiedModel, "branch": BranchModel}


def case_name(case) -> str:
    model, wrapper, micro_batches, sync_each, late_group, resume_at = case
    name = f"zero_{model}_{wrapper}_{micro_batches}mb"
    if sync_each:
        name += "_sync_each"
    if late_group:
        name += "_late_group"
    if resume_at is not None:
        name += f"_resume_at_{resume_at}"
    return name


def all_case_names(world_size: int) -> list[str]:
    return [case_name(case) for case in [*CASES, LM_CASES[world_size]]]


def adamw_groups(model, lr, parts=(0, 1)):
    """Two param groups with options of their own (ToyModel: the frozen parameter and the bias
    that does not train fall in group 1)."""
    params = list(model.parameters())
    half = len(params) // 2
    groups = [{"params": params[:half], "lr": lr, "weight_decay": 0.1},
              {"params": params[half:], "lr": lr / 3, "betas": (0.8, 0.9)}]
    return [groups[part] for part in parts]


def sharded_adamw(groups, process_group=None):
    # eps 1e-6: with 1e-8 Adam turns summation-order noise in near-zero gradients into lr-sized steps
    return zero.ShardedOptimizer(groups, torch.optim.AdamW, process_group=process_group,
                                 weight_decay=0.01, eps=1e-6)


def plain_adamw(groups):
    return torch.optim.AdamW(groups, weight_decay=0.01, eps=1e-6)


def copy_of(model_name: str, model):
    """A fresh model of the same kind holding ``model``'s weights (no wrapper's hooks)."""
    fresh = BUILD[model_name]()
    fresh.load_state_dict(model.state_dict())
    return fresh


def compare_checkpoint(saved: dict, want: dict) -> list[str]:
    problems = []
    if saved["param_groups"] != want["param_groups"]:
        problems.append("checkpoint: param_groups differ from one process's")
    if saved["state"].keys() != want["state"].keys():
        problems.append(f"checkpoint: state for {sorted(saved['state'])}, one process {sorted(want['state'])}")
        return problems
    for number, state in want["state"].items():
        for key, value in state.items():
            if not torch.allclose(saved["state"][number][key], value):
                diff = (saved["state"][number][key] - value).abs().max().item()
                problems.append(f"checkpoint: parameter {number}'s {key} differs by {diff:.2e}")
    return problems


def bitwise_problems(what: str, model, want_model) -> list[str]:
    problems = []
    for (name, param), want in zip(model.named_parameters(), want_model.parameters()):
        if not torch.equal(param, want):
            problems.append(f"{what}: {name} differs by {(param - want).abs().max().item():.2e}")
    return problems


def train_and_compare(ctx, model="toy", wrapper="ddp", micro_batches=1, sync_each=False,
                      late_group=False, resume_at=None, smaller_group=None) -> list[str]:
    """10 steps (LM: 3) of ShardedOptimizer(AdamW), two param groups with own options, under
    ``wrapper`` ("ddp": stage 06's BucketedDDP; "zero2"; "none": every rank computes the whole
    batch) beside plain AdamW on one process. Returns what went wrong on this rank.

    With ``resume_at``, after that step: the state consolidated on the last rank equals one
    process's; a plain AdamW there goes on from it. With "none" (the optimizer alone, so
    every continuation computes the very same gradients) the continuations must be bitwise:
    the consolidated checkpoint loaded by plain AdamW and by a ShardedOptimizer on
    ``smaller_group`` (ranks 0 .. N-2) equals the uninterrupted run, and the one-process
    AdamW's state dict loaded by a ShardedOptimizer on every rank equals the one process."""
    n = ctx.world_size
    rank = ctx.rank
    lm = model.startswith("lm")
    steps = 10
    lr = 1e-2
    if lm:
        steps = 3
        lr = 1e-3
    torch.manual_seed(1000 + rank)  # ranks start apart: the wrappers broadcast rank 0's start
    if lm:  # the reference never checkpoints activations
        net = models.TransformerLM(context_length=16, checkpoint_activations=model == "lm_ckpt")
    else:
        net = BUILD[model]()
    torch.manual_seed(1000)
    if lm:
        ref = models.TransformerLM(context_length=16)
    else:
        ref = BUILD[model]()
    first_parts = (0, 1)
    if late_group:
        first_parts = (0,)
    opt = sharded_adamw(adamw_groups(net, lr, first_parts))
    ref_opt = plain_adamw(adamw_groups(ref, lr, first_parts))
    if wrapper == "zero2":
        ddp = zero.Zero2DDP(net, opt, bucket_size_mb=1e-3)
    elif wrapper == "ddp":
        ddp = import_stage("06_bucketed_ddp/bucketed_ddp").BucketedDDP(net, 1e-3)
    else:
        ddp = net
        zero.broadcast_module_state(net)
    x_all, y_all = models.random_regression_data(64 * n, seed=7)

    def loss(m, step, micro_batch, r):  # rank r's 2 samples of a micro-batch, / micro_batches
        if lm:
            x, y = models.random_tokens(2, 16, seed=1000 * step + 10 * micro_batch + r)
            return models.lm_loss(m(x), y) / micro_batches
        order = torch.randperm(64 * n, generator=torch.Generator().manual_seed(step))
        first = (micro_batch * n + r) * 2
        rows = order[first:first + 2]
        kwargs = {}
        if model == "branch":  # the branch used by: all, rank 0, no rank, the last rank
            kwargs["use_branch"] = [True, r == 0, False, r == n - 1][step % 4]
        return F.mse_loss(m(x_all[rows], **kwargs), y_all[rows]) / micro_batches

    def whole_batch_gradient(m, step):  # what "none" computes on every rank, and one process
        for micro_batch in range(micro_batches):
            total = sum(loss(m, step, micro_batch, r) for r in range(n))
            (total / n).backward()

    def one_process_step(m, optimizer, step):
        optimizer.zero_grad()
        whole_batch_gradient(m, step)
        optimizer.step()

    problems = []
    continuations = []  # (what, model, optimizer, the model it must equal bitwise)
    resumed_plain = None
    max_diff = 0.0
    for step in range(steps):
        if late_group and step == 2:  # a group added after construction
            opt.add_param_group(adamw_groups(net, lr, (1,))[0])
            ref_opt.add_param_group(adamw_groups(ref, lr, (1,))[0])
        opt.zero_grad()
        if wrapper == "none":
            whole_batch_gradient(net, step)
        else:
            for micro_batch in range(micro_batches):
                sync = sync_each or micro_batch == micro_batches - 1
                if sync:
                    context = contextlib.nullcontext()
                else:
                    context = ddp.no_sync()
                with context:
                    loss(ddp, step, micro_batch, rank).backward()
                if sync:
                    ddp.finish_gradient_synchronization()
        if wrapper == "zero2":  # each rank holds the gradients it owns, all of them, no others
            owned_bytes = 0
            for param in net.parameters():
                owned = opt.owner[param] == rank
                if owned and param.requires_grad:
                    owned_bytes += param.numel() * param.element_size()
                if not owned and param.grad is not None:
                    problems.append(f"step {step}: a gradient it does not own is held")
            held = counters.state_bytes(param.grad for param in net.parameters())
            every_owned_used = model != "branch" or [True, True, False, True][step % 4]
            if every_owned_used and held != owned_bytes:
                problems.append(f"step {step}: {held} bytes of gradients held, {owned_bytes} owned")
        opt.step()
        one_process_step(ref, ref_opt, step)
        for _, continuation, optimizer, _ in continuations:
            if continuation is not None:  # (None: this rank is not in the smaller group)
                one_process_step(continuation, optimizer, step)
        if resumed_plain is not None:
            one_process_step(*resumed_plain, step)
        tolerance = {"rtol": 1e-5, "atol": 1e-6}
        if lm:
            tolerance = {"rtol": 1e-4, "atol": 1e-5}
        for (name, param), ref_param in zip(net.named_parameters(), ref.parameters()):
            max_diff = max(max_diff, (param - ref_param).abs().max().item())
            if not torch.allclose(param, ref_param, **tolerance):
                problems.append(f"step {step}: {name} differs from one process by "
                                f"{(param - ref_param).abs().max().item():.2e}")
        flat = torch.cat([param.detach().reshape(-1) for param in net.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(n)]
        dist.all_gather(everyone, flat)
        for other_rank, other in enumerate(everyone):
            if not torch.equal(other, flat):
                problems.append(f"step {step}: weights differ from rank {other_rank}'s")

        if step == resume_at:  # the checkpoint, on the last rank, equals the one-process state
            opt.consolidate_state_dict(to=n - 1)
            saved = [None]
            if rank == n - 1:
                saved = [opt.state_dict()]
                problems += compare_checkpoint(saved[0], ref_opt.state_dict())
                if wrapper != "none":  # one process goes on from it: close to the reference
                    resumed = copy_of(model, net)
                    plain = plain_adamw(adamw_groups(resumed, lr))
                    plain.load_state_dict(copy.deepcopy(saved[0]))  # (loading shares its tensors)
                    resumed_plain = (resumed, plain)
            if wrapper == "none":
                dist.broadcast_object_list(saved, src=n - 1)
                # Each new optimizer starts with another learning rate: loading must restore
                # the groups' options too.
                resumed = copy_of(model, net)
                plain = plain_adamw(adamw_groups(resumed, 0.5))
                plain.load_state_dict(copy.deepcopy(saved[0]))
                continuations.append(("consolidated -> plain AdamW", resumed, plain, net))
                resumed = None
                fewer = None
                if rank < n - 1:  # the consolidated checkpoint at N-1 ranks
                    resumed = copy_of(model, net)
                    fewer = sharded_adamw(adamw_groups(resumed, 0.5), process_group=smaller_group)
                    fewer.load_state_dict(saved[0])
                continuations.append((f"consolidated -> ShardedOptimizer at {n - 1} ranks", resumed, fewer, net))
                resumed = copy_of(model, ref)  # a plain AdamW's state dict, sharded at N ranks
                sharded = sharded_adamw(adamw_groups(resumed, 0.5))
                sharded.load_state_dict(ref_opt.state_dict())
                continuations.append((f"one process's AdamW -> ShardedOptimizer at {n} ranks",
                                      resumed, sharded, ref))
    for what, continuation, _, want in continuations:
        if continuation is not None:
            problems += bitwise_problems(f"resumed ({what})", continuation, want)
    if resume_at is not None and rank == n - 1 and wrapper != "none":
        for (name, param), ref_param in zip(resumed_plain[0].named_parameters(), ref.parameters()):
            if not torch.allclose(param, ref_param, rtol=1e-5, atol=1e-6):
                problems.append(f"resumed in plain AdamW: {name} differs from one process by "
                                f"{(param - ref_param).abs().max().item():.2e}")
    if resume_at is not None and wrapper == "none" and len(continuations) != 3:
        problems.append(f"{len(continuations)} continuations, not 3: no checkpoint was taken")

    # The state: each rank its shard; summed, the unsharded state; no rank more than one
    # parameter's moments (and step counters) above the mean.
    mine = torch.tensor([counters.optimizer_state_bytes(opt)], dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(everyone, mine)
    state_bytes = [int(held.item()) for held in everyone]
    if sum(state_bytes) != counters.optimizer_state_bytes(ref_opt):
        problems.append(f"state bytes {state_bytes} do not sum to the unsharded "
                        f"{counters.optimizer_state_bytes(ref_opt)}")
    largest_param = max(param.numel() for param in net.parameters())
    spread = max(state_bytes) - sum(state_bytes) / n
    if spread > 8 * largest_param + 4 * 64:
        problems.append(f"state unbalanced: {state_bytes}")
    return problems


def zero_checks(ctx, record, smaller_group) -> None:
    """Every ZeRO case at this world size, then the refusals (inside the workers: they need a
    process group)."""
    for case in [*CASES, LM_CASES[ctx.world_size]]:
        problems = train_and_compare(ctx, *case, smaller_group=smaller_group)
        record(case_name(case), not problems, problems)

    # the state dict needs consolidating first; a checkpoint of other groups is refused (a
    # zip over them would drop the difference silently)
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    opt = zero.ShardedOptimizer(net[0].parameters(), torch.optim.AdamW)
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        opt.state_dict()
    other = torch.optim.AdamW(net.parameters()).state_dict()
    with pytest.raises(ValueError, match=r"param groups of \[4\] parameters in the state dict, \[2\] here"):
        opt.load_state_dict(other)
    other["param_groups"].append(other["param_groups"][0])
    with pytest.raises(ValueError, match=r"\[4, 4\] parameters in the state dict, \[2\] here"):
        opt.load_state_dict(other)
