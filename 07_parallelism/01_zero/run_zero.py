"""Stage 07, lesson 1, runnable: ZeRO-1 and ZeRO-2 (zero.py) checked against one process.

Trains the tiny LM for 3 AdamW steps with two param groups of their own options, as ZeRO-1
(stage 06's BucketedDDP + ShardedOptimizer) and as ZeRO-2 (Zero2DDP, 2 micro-batches under
no_sync()), each beside AdamW on one process with the whole batch. It checks the weights
(allclose at float32 tolerance, bitwise equal across ranks), the consolidated checkpoint (equal
to the one-process AdamW's state) and a resume: the checkpoint loaded into a new
ShardedOptimizer goes on bitwise equal to the uninterrupted run. Every rank reaches the same
verdict; a failure names what differed and by how much, and exits 1.

    python 07_parallelism/01_zero/run_zero.py --world-size 3
    torchrun --nproc-per-node=2 07_parallelism/01_zero/run_zero.py
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from zero import ShardedOptimizer, Zero2DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: common/
from common import import_stage, launch, models, verify  # noqa: E402

STEPS = 3


def tiny_lm_and_adamw(seed: int, sharded: bool, device):
    """The tiny LM and AdamW over two param groups with options of their own. eps 1e-5: with
    the default 1e-8, Adam turns summation-order noise in near-zero gradients (the embedding
    rows of tokens a batch barely uses) into steps of about lr."""
    torch.manual_seed(seed)
    lm = models.TransformerLM("tiny", context_length=16).to(device)
    params = list(lm.parameters())
    groups = [{"params": params[:12], "weight_decay": 0.1},
              {"params": params[12:], "betas": (0.8, 0.9)}]
    if sharded:
        return lm, ShardedOptimizer(groups, torch.optim.AdamW, lr=1e-3, eps=1e-5)
    return lm, torch.optim.AdamW(groups, lr=1e-3, eps=1e-5)


def wrap(model, optimizer, micro_batches: int):
    """ZeRO-1 is any DDP of 03-06 before a ShardedOptimizer; ZeRO-2 is Zero2DDP."""
    if micro_batches == 1:
        return import_stage("06_bucketed_ddp/bucketed_ddp").BucketedDDP(model)
    return Zero2DDP(model, optimizer)


def train_step(ctx, ddp, optimizer, step: int, micro_batches: int) -> None:
    """One step on this rank's share of the global batch: 2 sequences per rank and micro-batch."""
    n = ctx.world_size
    x, y = models.random_tokens(2 * n * micro_batches, 16, seed=step, device=ctx.device)
    for micro_batch in range(micro_batches):
        first = 2 * (micro_batch * n + ctx.rank)  # rank r's 2 sequences of this micro-batch
        last = micro_batch == micro_batches - 1
        with contextlib.nullcontext() if last else ddp.no_sync():
            loss = models.lm_loss(ddp(x[first:first + 2]), y[first:first + 2]) / micro_batches
            loss.backward()
    ddp.finish_gradient_synchronization()
    optimizer.step()
    optimizer.zero_grad()


def check_one_way(ctx, way: str, micro_batches: int) -> tuple[list[str], float]:
    """Train one way beside one process: (what went wrong (empty: all matched), the largest
    difference of a weight from one process's)."""
    model, optimizer = tiny_lm_and_adamw(1 + ctx.rank, True, ctx.device)  # ranks start apart:
    reference, ref_optimizer = tiny_lm_and_adamw(1, False, ctx.device)    # the wrappers broadcast
    ddp = wrap(model, optimizer, micro_batches)
    for step in range(STEPS):
        train_step(ctx, ddp, optimizer, step, micro_batches)
        x, y = models.random_tokens(2 * ctx.world_size * micro_batches, 16, seed=step,
                                    device=ctx.device)
        models.lm_loss(reference(x), y).backward()  # one process: the whole global batch
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    problems = []
    max_diff = 0.0
    # the weights: allclose to one process (float32: the sums run in another order) ...
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        diff = (param - ref_param).abs().max().item()
        max_diff = max(max_diff, diff)
        if not torch.allclose(param, ref_param, rtol=1e-4, atol=1e-5):
            problems.append(f"{name} differs from one process by {diff:.2e}")
    # ... and bitwise equal across ranks
    flat = torch.cat([param.detach().flatten() for param in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, flat)
    for rank, other in enumerate(everyone):
        if not torch.equal(other, flat):
            problems.append(f"weights differ from rank {rank}'s")
    # the checkpoint, on rank 0: what AdamW on one process holds (a CPU copy: compared there)
    optimizer.consolidate_state_dict(to=0)
    saved = [None]
    if ctx.rank == 0:
        saved = [optimizer.state_dict()]
        want = ref_optimizer.state_dict()
        if saved[0]["param_groups"] != want["param_groups"]:
            problems.append("checkpoint: param_groups differ from one process's")
        if saved[0]["state"].keys() != want["state"].keys():
            problems.append("checkpoint: state for other parameters than one process's")
        for number, state in want["state"].items():
            for key, value in state.items():
                got = saved[0]["state"].get(number, {}).get(key)
                if got is None or not torch.allclose(got, value.cpu(), rtol=1e-4, atol=1e-7):
                    problems.append(f"checkpoint: parameter {number}'s {key} differs from one "
                                    "process's")
    # the resume: every rank loads the checkpoint into a new ShardedOptimizer over a copy of
    # the model; both go on one step, and must stay bitwise equal
    dist.broadcast_object_list(saved, src=0)
    resumed, resumed_optimizer = tiny_lm_and_adamw(1, True, ctx.device)
    resumed.load_state_dict(model.state_dict())
    resumed_optimizer.load_state_dict(saved[0])
    resumed_ddp = wrap(resumed, resumed_optimizer, micro_batches)
    train_step(ctx, ddp, optimizer, STEPS, micro_batches)
    train_step(ctx, resumed_ddp, resumed_optimizer, STEPS, micro_batches)
    for (name, param), resumed_param in zip(model.named_parameters(), resumed.parameters()):
        if not torch.equal(param, resumed_param):
            problems.append(f"resumed from the checkpoint, {name} differs from the "
                            "uninterrupted run")
    return [f"{way}: {problem}" for problem in problems], max_diff


def demo(ctx) -> None:
    ctx.print(f"{ctx.world_size} ranks ({ctx.backend}, tensors on {ctx.device}) vs AdamW on "
              f"one process, tiny LM, {STEPS} steps:", all_ranks=False)
    failures = []
    for way, micro_batches in (("ZeRO-1, BucketedDDP (06) + ShardedOptimizer", 1),
                               ("ZeRO-2, Zero2DDP, 2 micro-batches", 2)):
        problems, max_diff = check_one_way(ctx, way, micro_batches)
        problems = verify.agree_on_problems(problems)
        ctx.print(f"  {way}: max |diff| {max_diff:.1e}; weights allclose and bitwise equal across "
                  f"ranks, checkpoint = one process's, resumed bitwise: {not problems}",
                  all_ranks=False)
        failures += problems
    for failure in failures:
        ctx.print(failure, all_ranks=False)
    ctx.print("all checks passed" if not failures else "SOME CHECKS FAILED", all_ranks=False)
    if failures:
        raise SystemExit(1)


def main(argv=None) -> None:
    parser = launch.make_parser(__doc__)
    launch.launch(demo, launch.resolve(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
