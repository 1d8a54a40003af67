"""Stage 07, lesson 1, runnable: ZeRO-1 and ZeRO-2 (zero.py) checked against one process, and
the ZeRO rows of the sharding ledger.

The plain run trains the tiny LM for 3 AdamW steps with two param groups of their own options,
as ZeRO-1 (stage 06's BucketedDDP + ShardedOptimizer) and as ZeRO-2 (Zero2DDP, 2 micro-batches
under no_sync()), each beside AdamW on one process with the whole batch. It checks the weights
(allclose at float32 tolerance, bitwise equal across ranks), the consolidated checkpoint (equal
to the one-process AdamW's state), and a resume: the checkpoint loaded into a new
ShardedOptimizer (load_state_dict) goes on exactly as the uninterrupted run. Model, data and
optimizer state live on the device the run names (--device). Every rank reaches the same
verdict; a failure names what differed and by how much, and exits 1.

    python 07_parallelism/01_zero/run_zero.py --world-size 3    # the checks
    torchrun --nproc-per-node=2 07_parallelism/01_zero/run_zero.py
    python 07_parallelism/01_zero/run_zero.py --bench           # the ledger's ZeRO rows
    python 07_parallelism/02_fsdp/run_fsdp.py --bench           # the whole ledger, FSDP too

--bench hands the command line over to 07_parallelism/measure/bench_zero.py.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from zero import ShardedOptimizer, Zero2DDP

STEPS = 3
RESUMED_STEPS = 1


def _repo() -> None:
    """The harness needs common/, the algorithm does not (the same in every runnable script,
    on purpose: each lesson's folder runs from where it lies)."""
    root = Path(__file__).resolve().parent
    while not (root / "common" / "launch.py").exists():
        if root == root.parent:
            raise SystemExit(f"{Path(__file__).name}: the algorithm works on its own; this "
                             "script needs the repository around it (common/)")
        root = root.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


def tiny_lm_and_adamw(seed: int, sharded: bool, device):
    """The tiny LM and AdamW over two param groups with options of their own. eps 1e-6: with
    1e-8 Adam turns summation-order noise in near-zero gradients into lr-sized steps."""
    from common import models
    torch.manual_seed(seed)
    lm = models.TransformerLM("tiny", context_length=16).to(device)
    params = list(lm.parameters())
    groups = [{"params": params[:12], "weight_decay": 0.1},
              {"params": params[12:], "betas": (0.8, 0.9)}]
    if sharded:
        optimizer = ShardedOptimizer(groups, torch.optim.AdamW, lr=1e-3, eps=1e-6)
    else:
        optimizer = torch.optim.AdamW(groups, lr=1e-3, eps=1e-6)
    return lm, optimizer


def wrap(model, optimizer, micro_batches: int):
    """ZeRO-1 is any DDP of 03-06 before a ShardedOptimizer; ZeRO-2 is Zero2DDP."""
    from common import import_stage
    if micro_batches == 1:
        return import_stage("06_bucketed_ddp/bucketed_ddp").BucketedDDP(model)
    return Zero2DDP(model, optimizer)


def data_parallel_step(ctx, ddp, step: int, micro_batches: int) -> None:
    """One step on this rank's share of the global batch: 2 sequences per rank and micro-batch."""
    from common import models
    n = ctx.world_size
    x, y = models.random_tokens(2 * n * micro_batches, 16, seed=step, device=ctx.device)
    for micro_batch in range(micro_batches):
        first = 2 * (micro_batch * n + ctx.rank)  # rank r's 2 sequences of this micro-batch
        mine = slice(first, first + 2)
        if micro_batch < micro_batches - 1:
            context = ddp.no_sync()
        else:
            context = contextlib.nullcontext()
        with context:
            loss = models.lm_loss(ddp(x[mine]), y[mine]) / micro_batches
            loss.backward()
    ddp.finish_gradient_synchronization()


def one_process_step(ctx, reference, ref_optimizer, step: int, micro_batches: int) -> None:
    """The same step on one process: the whole global batch at once."""
    from common import models
    x, y = models.random_tokens(2 * ctx.world_size * micro_batches, 16, seed=step, device=ctx.device)
    models.lm_loss(reference(x), y).backward()
    ref_optimizer.step()
    ref_optimizer.zero_grad()


def compare_checkpoint(saved: dict, want: dict) -> list[str]:
    """What differs between a consolidated state dict and the one-process AdamW's (rtol 1e-4,
    atol 1e-7: the moments of weights that agree at float32 tolerance). The consolidated
    state is a CPU copy: compared on the CPU."""
    problems = []
    if saved["param_groups"] != want["param_groups"]:
        problems.append("checkpoint: param_groups differ from one process's")
    if saved["state"].keys() != want["state"].keys():
        problems.append(f"checkpoint: state for parameters {sorted(saved['state'])}, one process "
                        f"{sorted(want['state'])}")
        return problems
    for number, state in want["state"].items():
        for key, value in state.items():
            got = saved["state"][number][key]
            value = value.cpu()
            if not torch.allclose(got, value, rtol=1e-4, atol=1e-7):
                diff = (got - value).abs().max().item()
                problems.append(f"checkpoint: parameter {number}'s {key} differs from one "
                                f"process's by {diff:.2e}")
    return problems


def bytes_held(tensors) -> int:
    """Bytes of the tensors that exist (None: a gradient freed or never made)."""
    total = 0
    for tensor in tensors:
        if tensor is not None:
            total += tensor.nbytes
    return total


def check_one_way(ctx, way: str, micro_batches: int) -> tuple[dict, list[str], list[str]]:
    """Train one way beside one process. Returns its table row, what went wrong here in the
    weights and the checkpoint, and what went wrong in the resume."""
    model, optimizer = tiny_lm_and_adamw(1 + ctx.rank, True, ctx.device)  # ranks start apart: the
    reference, ref_optimizer = tiny_lm_and_adamw(1, False, ctx.device)    # wrappers broadcast rank 0's
    ddp = wrap(model, optimizer, micro_batches)
    for step in range(STEPS):
        data_parallel_step(ctx, ddp, step, micro_batches)
        grad_bytes = bytes_held(param.grad for param in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        one_process_step(ctx, reference, ref_optimizer, step, micro_batches)
    problems = []

    # the weights: allclose to one process (float32: the sums run in another order) ...
    max_diff = 0.0
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
            problems.append(f"weights differ from rank {rank}'s by {(other - flat).abs().max().item():.2e}")
    # the optimizer state each rank holds: its shard only (exp_avg, exp_avg_sq, step)
    state_tensors = []
    for state in optimizer.optim.state.values():
        state_tensors.extend(value for value in state.values() if torch.is_tensor(value))
    held = torch.tensor([bytes_held(state_tensors)], device=ctx.device)  # (NCCL: no CPU tensors)
    everyone_held = [torch.zeros_like(held) for _ in range(ctx.world_size)]
    dist.all_gather(everyone_held, held)
    state_kb = []
    for nbytes in everyone_held:
        state_kb.append(f"{nbytes.item() / 1e3:.0f}")
    # the checkpoint, on rank 0: what AdamW on one process holds
    optimizer.consolidate_state_dict(to=0)
    saved = [None]
    if ctx.rank == 0:
        saved = [optimizer.state_dict()]
        problems += compare_checkpoint(saved[0], ref_optimizer.state_dict())

    # the resume: every rank loads the checkpoint into a new ShardedOptimizer over a copy of
    # the model; both go on, and must stay bitwise equal
    dist.broadcast_object_list(saved, src=0)
    resumed, resumed_optimizer = tiny_lm_and_adamw(1, True, ctx.device)
    resumed.load_state_dict(model.state_dict())
    resumed_optimizer.load_state_dict(saved[0])
    resumed_ddp = wrap(resumed, resumed_optimizer, micro_batches)
    for step in range(STEPS, STEPS + RESUMED_STEPS):
        data_parallel_step(ctx, ddp, step, micro_batches)
        optimizer.step()
        optimizer.zero_grad()
        data_parallel_step(ctx, resumed_ddp, step, micro_batches)
        resumed_optimizer.step()
        resumed_optimizer.zero_grad()
    resume_problems = []
    for (name, param), resumed_param in zip(model.named_parameters(), resumed.parameters()):
        if not torch.equal(param, resumed_param):
            diff = (param - resumed_param).abs().max().item()
            resume_problems.append(f"resumed from the checkpoint, {name} differs from the "
                                   f"uninterrupted run by {diff:.2e}")
    row = {"way": way, "max |diff|": max_diff,
           "allclose, bitwise across ranks, checkpoint = one process's": None,  # once ranks agree
           "AdamW state kB per rank": "/".join(state_kb),
           f"grads kB held, rank {ctx.rank}": grad_bytes / 1e3}
    return row, problems, resume_problems


def check_against_one_process(ctx) -> list[str]:
    """The plain run (see the docstring at the top): prints the table; returns the problems
    every rank agreed on (empty: all passed)."""
    from common import verify
    from bench import results
    rows = []
    failures = []
    resumed_exactly = []
    for way, micro_batches in (("ZeRO-1: BucketedDDP (06) + ShardedOptimizer", 1), ("ZeRO-2: Zero2DDP", 2)):
        row, problems, resume_problems = check_one_way(ctx, way, micro_batches)
        problems = verify.agree_on_problems(problems)  # every rank's problems, on every rank
        resume_problems = verify.agree_on_problems(resume_problems)
        row["allclose, bitwise across ranks, checkpoint = one process's"] = not problems
        rows.append(row)
        resumed_exactly.append(str(not resume_problems))
        for problem in problems + resume_problems:
            failures.append(f"{way}, {problem}")
    ok = not failures
    if ctx.is_main or not ok:
        results.print_table(rows, floatfmt=".3g", title=f"{ctx.world_size} ranks ({ctx.backend}, "
                            f"tensors on {ctx.device}) vs AdamW on one process, tiny LM, {STEPS} steps "
                            f"({results.machine_name()}):")
    ctx.print(f"resumed from the consolidated checkpoint (ShardedOptimizer.load_state_dict): "
              f"{RESUMED_STEPS} more step bitwise equal to the uninterrupted run: "
              f"{' / '.join(resumed_exactly)}", all_ranks=False)
    for failure in failures:
        ctx.print(failure, all_ranks=False)
    return failures


def check_main(ctx) -> None:
    """The plain run; exits 1, on every rank, on a difference."""
    failures = check_against_one_process(ctx)
    ctx.print("all checks passed" if not failures else "SOME CHECKS FAILED", all_ranks=bool(failures))
    if failures:
        raise SystemExit(1)


def main(argv=None) -> None:
    _repo()
    from common import hand_over, launch
    parser = launch.make_parser(__doc__)
    parser.add_argument("--bench", action="store_true", help="the sharding ledger's ZeRO rows: hands "
                        "this command line to 07_parallelism/measure/bench_zero.py (its --help lists "
                        "its flags)")
    args, measure_flags = parser.parse_known_args(argv)
    if args.bench:
        hand_over("07_parallelism/measure/bench_zero.py")
    if measure_flags:
        parser.error(f"unrecognized arguments: {' '.join(measure_flags)} (flags of --bench only)")
    config = launch.resolve(args)  # a backend/device pair nothing can carry: one line, exit 2
    launch.launch(check_main, config)


if __name__ == "__main__":
    main()
