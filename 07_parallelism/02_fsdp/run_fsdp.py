"""Stage 07, lesson 2, runnable: FSDP (fsdp.py) checked against one process, the sharding
ledger, and a profile.

The plain run trains the tiny LM (its embedding and output layer tied: one matrix in two
layers, one unit; a unit per block; activation checkpointing) under FSDP and on one process
with the whole batch, 3 AdamW steps: the weights allclose at float32 tolerance after every
step, and bitwise equal across ranks. Every rank reaches the same verdict; a failure names
what differed and by how much, and exits 1.

    python 07_parallelism/02_fsdp/run_fsdp.py --world-size 2    # the checks
    torchrun --nproc-per-node=2 07_parallelism/02_fsdp/run_fsdp.py
    python 07_parallelism/02_fsdp/run_fsdp.py --bench           # the ledger: DDP, ZeRO-1/2, FSDP, torch's
    python 07_parallelism/02_fsdp/run_fsdp.py --profile         # timeline: all-gathers during compute
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp import FSDP

STEPS = 3


def _repo() -> None:
    """The harness needs common/, the algorithm above does not (same in every stage, on purpose)."""
    root = Path(__file__).resolve().parent
    while not (root / "common" / "launch.py").exists():
        if root == root.parent:
            raise SystemExit(f"{Path(__file__).name}: the algorithm above works on its own; the "
                             "demo and benchmark need the repository around this file (common/)")
        root = root.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


def agree_on_problems(ctx, problems: list[str]) -> list[str]:
    """Every rank's problems on every rank, named by rank: one verdict (common/verify.py)."""
    from common import verify
    return verify.agree_on_problems(problems)


def tied_tiny_lm(seed: int):
    """The tiny LM with activation checkpointing, its output layer tied to the embedding."""
    from common import models
    torch.manual_seed(seed)
    lm = models.TransformerLM("tiny", context_length=32, checkpoint_activations=True)
    lm.lm_head.weight = lm.token_embedding.weight  # one matrix in two layers: one unit
    return lm


def fsdp_per_block(model):
    """FSDP with a unit per Transformer block (the rest: a unit per module that owns weights)."""
    return FSDP(model, units=list(model.blocks))


def check_against_one_process(ctx, wrap=fsdp_per_block) -> list[str]:
    """The plain run, with ``wrap`` building the FSDP (a test passes a broken one to see this
    fail). Prints the summary; returns the problems every rank agreed on (empty: all passed)."""
    from common import models, results
    model = tied_tiny_lm(1 + ctx.rank)  # ranks start apart: FSDP broadcasts rank 0's weights
    reference = tied_tiny_lm(1)
    fsdp = wrap(model)
    # eps 1e-6: with 1e-8 Adam turns summation-order noise in near-zero gradients into lr-sized steps
    optimizer = torch.optim.AdamW(fsdp.parameters(), lr=1e-3, eps=1e-6)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    mine = slice(2 * ctx.rank, 2 * ctx.rank + 2)  # this rank's 2 sequences of the global batch
    problems = []
    max_diff = 0.0
    for step in range(STEPS):
        x, y = models.random_tokens(2 * ctx.world_size, 32, seed=step)
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
    problems = agree_on_problems(ctx, problems)
    ok = not problems
    if ok:
        verdict = "allclose, and bitwise equal across ranks"
    else:
        verdict = "NOT allclose, or ranks differ"
    shard_kb = sum(param.nbytes for param in fsdp.parameters()) / 1e3
    ctx.print(f"FSDP vs one process, tiny LM in {len(fsdp.units)} units, {ctx.world_size} ranks "
              f"({ctx.backend}/{ctx.device.type}), {STEPS} AdamW steps ({results.machine_name()}):\n"
              f"  max |diff| {max_diff:.1e}: {verdict}; per rank {shard_kb:.0f} kB of shards, at most "
              f"{fsdp.peak_gathered_bytes / 1e3:.0f} kB of full weights gathered at once", all_ranks=not ok)
    for problem in problems:
        ctx.print(problem, all_ranks=False)
    return problems


def verify_main(ctx, args) -> None:
    """The plain run; exits 1, on every rank, on a difference."""
    problems = check_against_one_process(ctx)
    ctx.print("all checks passed" if not problems else "SOME CHECKS FAILED", all_ranks=bool(problems))
    if problems:
        raise SystemExit(1)


def bench_main(ctx, args) -> None:
    """--bench: the ledger and the targets read off it (reported, not checked: one run's timing
    is a measurement, not a test). --profile: a unit per block in stage 05's timeline."""
    from common import import_stage, profiling
    if args.profile:
        profiling.profile_ddp(ctx, [("fsdp (07)", fsdp_per_block)], args, name="07_fsdp")
    else:
        ledger = import_stage("07_parallelism/measure/ledger")
        ledger.run_ledger(ctx, ledger.strategies(), args)  # all six rows, in one run


def main(argv=None) -> None:
    _repo()
    from common import import_stage, launch, profiling, step_bench
    parser = launch.make_parser(__doc__)
    import_stage("07_parallelism/measure/ledger").add_ledger_args(parser)
    profiling.add_profile_args(parser)
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    if args.bench or args.profile:  # (the plain run has its own sizes)
        step_bench.check_step_bench_args(args, config)  # batch, memory, results/: one line, exit 2
        launch.launch(bench_main, config, args)
    else:
        launch.launch(verify_main, config, args)


if __name__ == "__main__":
    main()
