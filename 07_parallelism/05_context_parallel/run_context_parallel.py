"""Stage 07, lesson 5, runnable: ring attention, Ulysses and a context-parallel LM against one
process.

Ring attention (context_parallel.py) on W = world size / --dp ranks beside torch's
scaled_dot_product_attention on the whole sequence: the output and the gradients of q, k and
v, float64 and float32, causal and not, both layouts; then Ulysses the same way, on contiguous
shards. Then the course LM trained a few SGD steps on --dp data x W context ranks with each
(--kinds) beside the same LM on one process: the weights and the loss equal, and bitwise equal
across ranks. One verdict on every rank; exit 1 on a difference. Where the pair cannot carry
point-to-point sends (Gloo with CUDA tensors) the ring is left out, in one line.

Run:  python 07_parallelism/05_context_parallel/run_context_parallel.py          # 4 ranks (make 07)
      python 07_parallelism/05_context_parallel/run_context_parallel.py --dp 2   # 2 data x 2 context
      torchrun --nproc-per-node=4 07_parallelism/05_context_parallel/run_context_parallel.py
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import context_parallel as cp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: common/
from common import launch, models, verify  # noqa: E402

# (rtol, atol). float64: the ring adds the same terms as one process in another order, so
# only rounding at 1e-16 separates them. float32 rounds at 6e-8 relative; an element sums up
# to seq x head_dim products of size about 1, rescaled by exp(lse - lse_new) before adding: a
# few 1e-7 to 1e-6. A wrong merge or mask moves results by 1e-2 or more.
TOLERANCE = {torch.float64: (1e-10, 1e-12), torch.float32: (1e-4, 1e-5)}
LM_STEPS = 3
LM_VOCAB = 256
LM_TOLERANCE = (1e-5, 1e-6)  # SGD: a difference in the gradient is not amplified (AdamW's is)
KINDS = ("ring", "ulysses")


def make_groups(ctx, dp: int):
    """dp data x cp context ranks; the context ranks of one data rank are neighbours:
    rank = data_rank * cp + context_rank. Every rank creates every group, as new_group asks."""
    cp_size = ctx.world_size // dp
    context_group = None
    for data_rank in range(dp):
        ranks = list(range(data_rank * cp_size, (data_rank + 1) * cp_size))
        group = dist.new_group(ranks)
        if ctx.rank in ranks:
            context_group = group
    return context_group, ctx.rank // cp_size, ctx.rank % cp_size


def check_attention(ctx, group, args, dtype, kind: str, layout: str,
                    causal: bool) -> tuple[dict, list[str]]:
    """One forward + backward of ring attention (or Ulysses) on this rank's shards beside
    scaled_dot_product_attention on the whole sequence (every rank draws the same q, k, v and
    output gradient, then keeps its shard): (the largest differences, the problems)."""
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    shape = (args.batch, args.heads, args.seq, args.head_dim)   # [batch, heads, seq, head_dim]
    generator = torch.Generator().manual_seed(0)
    q_full, k_full, v_full, grad_full = [    # q, k, v, the output gradient: the same everywhere
        torch.randn(shape, generator=generator, dtype=dtype).to(ctx.device) for _ in range(4)]
    for tensor in (q_full, k_full, v_full):
        tensor.requires_grad_(True)
    out_full = F.scaled_dot_product_attention(q_full, k_full, v_full, is_causal=causal)
    out_full.backward(grad_full)

    def mine(tensor):
        return cp.shard_sequence(tensor.detach(), 2, rank, world_size, layout)

    q, k, v = [mine(tensor).requires_grad_(True) for tensor in (q_full, k_full, v_full)]
    if kind == "ulysses":
        out = cp.ulysses_attention(q, k, v, group=group, causal=causal)
    else:
        out = cp.ring_attention(q, k, v, group=group, causal=causal, layout=layout)
    out.backward(mine(grad_full))
    compared = [("output", out, mine(out_full)), ("dq", q.grad, mine(q_full.grad)),
                ("dk", k.grad, mine(k_full.grad)), ("dv", v.grad, mine(v_full.grad)),
                ("unsharded output", cp.unshard_sequence(out.detach(), 2, group, layout),
                 out_full)]
    rtol, atol = TOLERANCE[dtype]
    case = f"{kind} {str(dtype)[6:]} {layout} causal={causal}"
    differences = {}
    problems = []
    for name, got, want in compared:
        difference = (got - want).abs().max().item()
        differences[name] = difference
        if not torch.allclose(got, want, rtol=rtol, atol=atol):
            problems.append(f"{case}: {name} differs from one process by {difference:.3g} "
                            f"(rtol {rtol:g}, atol {atol:g})")
    return differences, problems


def check_lm(ctx, args, kind: str, layout: str) -> tuple[list[str], list[str]]:
    """The course LM, LM_STEPS SGD steps, on dp x cp ranks (ring attention or Ulysses over the
    context ranks, each rank its tokens with their global positions, gradients averaged over
    the data AND context ranks) beside the same LM on one process: (lines to print, problems)."""
    context_group, data_rank, context_rank = make_groups(ctx, args.dp)
    cp_size = ctx.world_size // args.dp
    torch.manual_seed(0)
    model = models.TransformerLM("tiny", vocab_size=LM_VOCAB, context_length=args.seq)
    model = model.to(ctx.device)
    reference = copy.deepcopy(model)                 # the one-process LM, the same weights
    if kind == "ulysses":
        cp.use_ulysses_attention(model, context_group)
    else:
        cp.use_ring_attention(model, context_group, layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    positions = cp.shard_positions(args.seq // cp_size, context_rank, cp_size, layout, ctx.device)
    rows = args.batch // args.dp
    my_rows = slice(data_rank * rows, (data_rank + 1) * rows)
    rtol, atol = LM_TOLERANCE
    lines = []
    problems = []
    for step in range(LM_STEPS):
        generator = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(LM_VOCAB, (args.batch, args.seq + 1), generator=generator)
        tokens = tokens.to(ctx.device)
        inputs = tokens[:, :-1]                              # [batch, seq]
        targets = tokens[:, 1:]
        my_inputs = cp.shard_sequence(inputs[my_rows], 1, context_rank, cp_size, layout)
        my_targets = cp.shard_sequence(targets[my_rows], 1, context_rank, cp_size, layout)
        optimizer.zero_grad(set_to_none=True)
        loss = models.lm_loss(model(my_inputs, positions), my_targets)   # mean over my tokens
        loss.backward()
        cp.average_gradients(model)                  # over every rank: data AND context
        total = loss.detach().clone()
        dist.all_reduce(total)
        reported = total.item() / ctx.world_size
        optimizer.step()
        ref_optimizer.zero_grad(set_to_none=True)
        ref_loss = models.lm_loss(reference(inputs), targets)
        ref_loss.backward()
        ref_optimizer.step()

        case = f"LM dp={args.dp} cp={cp_size} {kind} {layout} step {step}"
        pairs = list(zip(model.parameters(), reference.parameters()))
        worst = max((param - ref_param).abs().max().item() for param, ref_param in pairs)
        if not all(torch.allclose(param, ref, rtol=rtol, atol=atol) for param, ref in pairs):
            problems.append(f"{case}: weights differ from one process by up to {worst:.3g}")
        if abs(reported - ref_loss.item()) > rtol * abs(ref_loss.item()):
            problems.append(f"{case}: loss {reported:.6f}, one process {ref_loss.item():.6f}")
        flat = torch.cat([param.detach().flatten() for param in model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(ctx.world_size)]
        dist.all_gather(everyone, flat)
        for rank, other in enumerate(everyone):
            if not torch.equal(other, flat):
                problems.append(f"{case}: weights differ from rank {rank}'s")
        lines.append(f"  {case}: loss {reported:.6f} (one process {ref_loss.item():.6f}), max "
                     f"|weight - one process| {worst:.1e}")
    return lines, problems


def context_parallel_main(ctx, args) -> None:
    cp_size = ctx.world_size // args.dp
    context_group = make_groups(ctx, args.dp)[0]
    problems = []
    if ctx.is_main:
        print(f"Ring attention on {cp_size} context ranks (x {args.dp} data), batch {args.batch}, "
              f"heads {args.heads}, seq {args.seq}, head_dim {args.head_dim}, "
              f"{ctx.backend}/{ctx.device.type}; max |difference| from "
              "scaled_dot_product_attention on the whole sequence (rank 0's shard):")
    for kind, layout in kinds_and_layouts(args):
        for dtype in TOLERANCE:
            for causal in (True, False):
                differences, found = check_attention(ctx, context_group, args, dtype, kind,
                                                     layout, causal)
                problems += found
                shown = ", ".join(f"{name} {value:.1e}" for name, value in differences.items())
                ctx.print(f"  {kind:7} {str(dtype)[6:]} {layout:10} causal={causal!s:5}: {shown}",
                          all_ranks=False)
    ctx.print(f"The course LM (tiny, SGD) on {args.dp} data x {cp_size} context ranks beside one "
              "process on the whole batch:", all_ranks=False)
    for kind, layout in kinds_and_layouts(args):
        lines, found = check_lm(ctx, args, kind, layout)
        problems += found
        for line in lines:
            ctx.print(line, all_ranks=False)
    problems = verify.agree_on_problems(problems)
    if problems:
        ctx.print("context-parallel check FAILED:\n  " + "\n  ".join(problems), all_ranks=False)
        raise SystemExit(1)
    ctx.print(f"all checks passed on every rank: {' and '.join(args.kinds)} equal one process "
              "(outputs, dq, dk, dv), the LM trains as one process", all_ranks=False)


def kinds_and_layouts(args) -> list[tuple[str, str]]:
    """The ring in every layout asked for; Ulysses on contiguous shards (its only layout)."""
    return [(kind, layout) for kind in args.kinds
            for layout in (["contiguous"] if kind == "ulysses" else args.layouts)]


def main(argv=None) -> None:
    parser = launch.make_parser(__doc__, world_size=4)
    parser.add_argument("--batch", type=launch.positive_int, default=4,
                        help="sequences per batch (the LM's global batch: divides by --dp)")
    parser.add_argument("--heads", type=launch.positive_int, default=4,
                        help="attention heads (Ulysses: they divide by the context ranks)")
    parser.add_argument("--kinds", type=launch.choice_list(list(KINDS)), default=list(KINDS),
                        help="context-parallel attention to check: subset of " + ",".join(KINDS))
    parser.add_argument("--head-dim", type=launch.positive_int, default=24,
                        help="width of one head")
    parser.add_argument("--seq", type=launch.positive_int, default=64, help="sequence length")
    parser.add_argument("--layouts", type=launch.choice_list(list(cp.LAYOUTS)),
                        default=list(cp.LAYOUTS), help="subset of " + ",".join(cp.LAYOUTS))
    parser.add_argument("--dp", type=launch.positive_int, default=1,
                        help="data-parallel degree of the LM check; context ranks = world / dp")
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    if config.world_size % args.dp or args.batch % args.dp:  # ranks or rows left out of the check
        parser.error(f"--dp {args.dp} must divide the world size {config.world_size} and --batch")
    if "ring" in args.kinds and not launch.carries_point_to_point(config.backend, config.device):
        print(f"ring attention: left out on {config.backend}/{config.device}, which cannot carry "
              "its point-to-point sends; Ulysses runs", flush=True)
        args.kinds = [kind for kind in args.kinds if kind != "ring"] or ["ulysses"]
    launch.launch(context_parallel_main, config, args)


if __name__ == "__main__":
    main()
