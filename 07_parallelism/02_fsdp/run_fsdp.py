"""Stage 07, lesson 2, runnable: FSDP (fsdp.py) checked against one process.

The plain run trains the tiny LM (its embedding and output layer tied: one matrix in two
layers, one unit; a unit per block; activation checkpointing) under FSDP and on one process
with the whole batch, 3 AdamW steps, on the device the run names (--device): the weights
allclose at float32 tolerance after every step, and bitwise equal across ranks. Every rank
reaches the same verdict; a failure names what differed and by how much, and exits 1.

    python 07_parallelism/02_fsdp/run_fsdp.py --world-size 2
    torchrun --nproc-per-node=2 07_parallelism/02_fsdp/run_fsdp.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp import FSDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: common/
from common import launch, models, verify  # noqa: E402

STEPS = 3


def tied_tiny_lm(seed: int, device):
    """The tiny LM with activation checkpointing, its output layer tied to the embedding."""
    torch.manual_seed(seed)
    lm = models.TransformerLM("tiny", context_length=32, checkpoint_activations=True)
    lm.lm_head.weight = lm.token_embedding.weight  # one matrix in two layers: one unit
    return lm.to(device)


def check_against_one_process(ctx) -> list[str]:
    """The plain run. Prints the summary; returns the problems every rank agreed on (empty:
    all passed)."""
    model = tied_tiny_lm(1 + ctx.rank, ctx.device)  # ranks start apart: FSDP broadcasts rank 0's
    reference = tied_tiny_lm(1, ctx.device)
    fsdp = FSDP(model, units=list(model.blocks))  # a unit per block, one for the tied embedding
    # eps 1e-6: with 1e-8 Adam turns summation-order noise in near-zero gradients into lr-sized steps
    optimizer = torch.optim.AdamW(fsdp.parameters(), lr=1e-3, eps=1e-6)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    mine = slice(2 * ctx.rank, 2 * ctx.rank + 2)  # this rank's 2 sequences of the global batch
    problems = []
    max_diff = 0.0
    for step in range(STEPS):
        x, y = models.random_tokens(2 * ctx.world_size, 32, seed=step, device=ctx.device)
        optimizer.zero_grad(set_to_none=True)  # FSDP: this rank's sequences
        models.lm_loss(fsdp(x[mine]), y[mine]).backward()
        fsdp.finish_gradient_synchronization()
        optimizer.step()
        ref_optimizer.zero_grad(set_to_none=True)  # one process: the whole batch
        models.lm_loss(reference(x), y).backward()
        ref_optimizer.step()

        got = fsdp.gather_full_params()
        # allclose to one process (float32: the sums run in another order) ...
        for name, want in reference.named_parameters():
            diff = (got[name] - want).abs().max().item()
            max_diff = max(max_diff, diff)
            if not torch.allclose(got[name], want, rtol=1e-4, atol=1e-5):
                problems.append(f"step {step}: {name} differs from one process by {diff:.2e}")
        # ... and bitwise equal across ranks
        flat = torch.cat([tensor.flatten() for tensor in got.values()])
        everyone = [torch.empty_like(flat) for _ in range(ctx.world_size)]
        dist.all_gather(everyone, flat)
        for rank, other in enumerate(everyone):
            if not torch.equal(other, flat):
                problems.append(f"step {step}: weights differ from rank {rank}'s by "
                                f"{(other - flat).abs().max().item():.2e}")
    problems = verify.agree_on_problems(problems)  # every rank's problems, on every rank
    verdict = "allclose, and bitwise equal across ranks" if not problems else "DIFFERENT"
    shard_kb = sum(param.nbytes for param in fsdp.parameters()) / 1e3
    ctx.print(f"FSDP vs one process, tiny LM in {len(fsdp.units)} units, {ctx.world_size} ranks "
              f"({ctx.backend}, tensors on {ctx.device}), {STEPS} AdamW steps:", all_ranks=False)
    ctx.print(f"  max |diff| {max_diff:.1e}: {verdict}; per rank {shard_kb:.0f} kB of shards",
              all_ranks=False)
    for problem in problems:
        ctx.print(problem, all_ranks=False)
    return problems


def check_main(ctx) -> None:
    """The plain run; exits 1, on every rank, on a difference."""
    problems = check_against_one_process(ctx)
    ctx.print("all checks passed" if not problems else "SOME CHECKS FAILED", all_ranks=bool(problems))
    if problems:
        raise SystemExit(1)


def main(argv=None) -> None:
    parser = launch.make_parser(__doc__)
    launch.launch(check_main, launch.resolve(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
