"""Stage 07, lesson 6, runnable: ExpertParallelMoE (expert_parallel.py) beside the one-process MoE.

Every rank routes its own tokens (a different number each, so the all-to-alls are uneven) through
the same MoE whole and with its experts spread over the ranks: random, skewed (one expert
overflows) and balanced routings, top-1 and top-2, dropless and with a capacity. Then the tiny
LM with an MoE per block trains a few SGD steps with expert parallelism (on 4+ ranks also EP 2 x
DP W/2) beside one process. It prints how far apart outputs, gradients and weights are; every
rank reaches one verdict, and a difference is named and exits 1. --num-experts divides by the
world size, and --d-model is at least --num-experts (the balanced routing's directions).

    python 07_parallelism/06_expert_parallel/run_expert_parallel.py                  # 2 ranks
    python 07_parallelism/06_expert_parallel/run_expert_parallel.py --world-size 4   # + EP 2 x DP 2
    torchrun --nproc-per-node=4 07_parallelism/06_expert_parallel/run_expert_parallel.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from expert_parallel import ExpertParallelMoE, MoE, expert_parameters, replicated_parameters

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: common/
from common import launch, models, verify  # noqa: E402

AUX_WEIGHT = 0.01  # the load-balancing loss's weight, Switch Transformer's alpha = 10^-2
RTOL = 1e-5        # float32, relative to the largest value compared (the README says why)
LM_LR = 0.1        # plain SGD: its step is linear in the gradient, so weights differ as little
LM_STEPS = 3


def relative_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)


def build_moe(cfg: dict, routing: str, top_k: int, capacity_factor, device) -> MoE:
    """The same MoE on every rank (seeded). "skewed": expert 0's router row leans towards the
    inputs' mean, so it overflows. "balanced": token i goes to experts i and i + 1 (mod E)."""
    torch.manual_seed(0)
    moe = MoE(cfg["d_model"], cfg["d_ff"], cfg["num_experts"], top_k, capacity_factor)
    with torch.no_grad():
        if routing == "skewed":
            moe.router.weight[0] += 2.0 / cfg["d_model"]
        if routing == "balanced":
            moe.router.weight.zero_()
            for expert in range(cfg["num_experts"]):
                moe.router.weight[expert, expert] = 1.0
    return moe.to(device)


def layer_input(cfg: dict, routing: str, rank: int, device) -> torch.Tensor:
    """Rank r's tokens: [2, 5 + r, d_model]; balanced: [2E, d_model], token i pointing at i, i+1."""
    generator = torch.Generator().manual_seed(100 + rank)
    if routing == "balanced":
        tokens = 2 * cfg["num_experts"]
        x = 0.1 * torch.randn(tokens, cfg["d_model"], generator=generator)
        for token in range(tokens):
            x[token, token % cfg["num_experts"]] += 4.0
            x[token, (token + 1) % cfg["num_experts"]] += 3.0
        return x.to(device)
    x = torch.randn(2, 5 + rank, cfg["d_model"], generator=generator)
    if routing == "skewed":
        x += 1.0
    return x.to(device)


def compare_layer(ctx, cfg: dict, routing: str, top_k: int, capacity_factor):
    """One forward + backward of the MoE and of ExpertParallelMoE on this rank's tokens."""
    moe = build_moe(cfg, routing, top_k, capacity_factor, ctx.device)
    layer = ExpertParallelMoE(moe)                  # keeps this rank's experts (copies)
    x = layer_input(cfg, routing, ctx.rank, ctx.device)
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(200 + ctx.rank))
    target = target.to(ctx.device)
    x_ref = x.clone().requires_grad_(True)
    out_ref = moe(x_ref)
    (F.mse_loss(out_ref, target) + AUX_WEIGHT * moe.aux_loss).backward()
    for param in moe.experts.parameters():          # the data-parallel mean over ranks
        dist.all_reduce(param.grad)
        param.grad /= ctx.world_size
    x_ep = x.clone().requires_grad_(True)
    out = layer(x_ep)
    (F.mse_loss(out, target) + AUX_WEIGHT * layer.aux_loss).backward()

    expert_diff = max(relative_diff(param.grad, moe.experts[int(index)].get_parameter(name).grad)
                      for index, expert in layer.experts.items()  # experts["3"]: moe.experts[3]
                      for name, param in expert.named_parameters())
    capacity = "dropless" if capacity_factor is None else f"{capacity_factor:g}"
    row = {"routing": routing, "top_k": top_k, "capacity": capacity, "dropped": layer.dropped,
           "output": relative_diff(out, out_ref), "input grad": relative_diff(x_ep.grad, x_ref.grad),
           "router grad": relative_diff(layer.router.weight.grad, moe.router.weight.grad),
           "expert grads": expert_diff}
    compared = ("output", "input grad", "router grad", "expert grads")
    differed = [f"{routing} top-{top_k} {capacity}: {what} differs by {row[what]:.1e}"
                for what in compared if row[what] > RTOL]
    if layer.dropped != moe.dropped or not torch.equal(layer.aux_loss, moe.aux_loss):
        differed.append(f"{routing} top-{top_k} {capacity}: drops or load-balancing loss differ")
    return row, differed


def compare_lm(ctx, cfg: dict, ep_size: int):
    """The tiny LM, an MoE per block, LM_STEPS SGD steps: experts over EP groups of ``ep_size``
    neighbouring ranks, data parallel over the ranks holding the same experts; beside one
    process running the same global batch as the same W routing groups."""
    world_size = ctx.world_size
    # Expert-parallel groups of neighbouring ranks (the all-to-alls are the heavy traffic: keep
    # them inside a node); data-parallel groups of the ranks holding the same experts.
    ep_ranks = [list(range(start, start + ep_size)) for start in range(0, world_size, ep_size)]
    dp_ranks = [list(range(offset, world_size, ep_size)) for offset in range(ep_size)]
    ep_group, _ = dist.new_subgroups_by_enumeration(ep_ranks)
    dp_group, _ = dist.new_subgroups_by_enumeration(dp_ranks)

    def make_mlp(d_model: int, d_ff: int) -> MoE:
        return MoE(d_model, d_ff, cfg["num_experts"], cfg["top_k"], cfg["capacity_factor"])

    def build():
        torch.manual_seed(0)
        return models.TransformerLM(cfg["lm"], vocab_size=256, context_length=16,
                                    make_mlp=make_mlp).to(ctx.device)
    model = build()
    reference = build()
    for block in model.blocks:
        block.mlp = ExpertParallelMoE(block.mlp, ep_group)
    worst_grad = 0.0
    mine = slice(2 * ctx.rank, 2 * ctx.rank + 2)                # 2 sequences per rank
    for step in range(LM_STEPS):
        generator = torch.Generator().manual_seed(step)         # the same global batch everywhere
        tokens = torch.randint(256, (2 * world_size, 17), generator=generator).to(ctx.device)
        inputs = tokens[:, :-1]                                  # [global batch, 16]
        targets = tokens[:, 1:]
        loss = models.lm_loss(model(inputs[mine]), targets[mine])
        aux = sum(block.mlp.aux_loss for block in model.blocks)
        (loss + AUX_WEIGHT * aux).backward()
        for param in replicated_parameters(model):              # mean over every rank
            dist.all_reduce(param.grad)
            param.grad /= world_size
        for param in expert_parameters(model):                  # already the mean over EP:
            dist.all_reduce(param.grad, group=dp_group)         # the mean over their copies
            param.grad /= world_size // ep_size
        total = 0.0
        for group_index in range(world_size):                   # one process, group by group
            part = slice(2 * group_index, 2 * group_index + 2)
            group_loss = models.lm_loss(reference(inputs[part]), targets[part])
            group_aux = sum(block.mlp.aux_loss for block in reference.blocks)
            total = total + group_loss + AUX_WEIGHT * group_aux
        (total / world_size).backward()
        want = dict(reference.named_parameters())     # the same names: experts["3"] ~ experts[3]
        for name, param in model.named_parameters():
            worst_grad = max(worst_grad, relative_diff(param.grad, want[name].grad))
        with torch.no_grad():
            for param in [*model.parameters(), *reference.parameters()]:
                param -= LM_LR * param.grad
                param.grad = None
    want = dict(reference.named_parameters())
    worst_weight = max(relative_diff(param, want[name]) for name, param in model.named_parameters())
    row = {"model": f"{cfg['lm']} LM, {cfg['num_experts']} experts top-{cfg['top_k']}",
           "expert parallel": ep_size, "data parallel": world_size // ep_size,
           "SGD steps": LM_STEPS, "max grad diff": worst_grad, "max weight diff": worst_weight}
    differed = []
    if max(worst_grad, worst_weight) > RTOL:
        differed.append(f"LM EP {ep_size}: gradients differ by {worst_grad:.1e}, weights by "
                        f"{worst_weight:.1e} (relative)")
    return row, differed


def as_line(row: dict) -> str:
    return "  " + ", ".join(f"{key} {value:.1e}" if isinstance(value, float) else f"{key} {value}"
                            for key, value in row.items())


def demo(ctx, cfg: dict) -> None:
    cases = [(routing, top_k, capacity_factor) for routing in ("random", "skewed")
             for top_k in (1, 2) for capacity_factor in (None, 1.0, 1.25)]
    cases.append(("balanced", 2, None))
    ctx.print(f"Expert parallel MoE on {ctx.world_size} ranks: d_model {cfg['d_model']}, d_ff "
              f"{cfg['d_ff']}, {cfg['num_experts']} experts, {ctx.backend}/{ctx.device.type}; "
              "max relative diff from the one-process MoE (rank 0; expert grads against the "
              "data-parallel mean):", all_ranks=False)
    differed = []
    for routing, top_k, capacity_factor in cases:
        row, problems = compare_layer(ctx, cfg, routing, top_k, capacity_factor)
        differed += problems
        ctx.print(as_line(row), all_ranks=False)
    ep_sizes = [ctx.world_size]
    if ctx.world_size > 2 and ctx.world_size % 2 == 0:
        ep_sizes.append(2)
    ctx.print("The LM with MoE blocks against one process (max relative diff):", all_ranks=False)
    for ep_size in ep_sizes:
        row, problems = compare_lm(ctx, cfg, ep_size)
        differed += problems
        ctx.print(as_line(row), all_ranks=False)
    differed = verify.agree_on_problems(differed)           # one verdict on every rank
    for problem in differed:
        ctx.print(f"DIFFERS {problem}", all_ranks=False)
    if differed:
        raise SystemExit(1)
    ctx.print("all matched: outputs, every gradient, drops, the load-balancing loss, the LM",
              all_ranks=False)


def capacity_factor_type(text: str):
    """A flag type: none (dropless) or a finite number > 0."""
    if text.strip().lower() in ("none", "dropless"):
        return None
    return launch.positive_float(text)


def main(argv=None) -> None:
    parser = launch.make_parser(__doc__, world_size=2)
    for flag, default, what in (("--d-model", 16, "model width of the layer checks (>= experts)"),
                                ("--d-ff", 32, "expert hidden width of the layer checks"),
                                ("--num-experts", None, "experts (default: 2 x world size)"),
                                ("--top-k", 2, "experts per token in the LM")):
        parser.add_argument(flag, type=launch.positive_int, default=default, help=what)
    parser.add_argument("--capacity-factor", type=capacity_factor_type, default=1.25,
                        help="the LM's MoE blocks: a number > 0, or none (dropless)")
    parser.add_argument("--lm", choices=list(models.PRESETS), default="tiny",
                        help="the LM preset trained with MoE blocks")
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    cfg = {"d_model": args.d_model, "d_ff": args.d_ff,
           "num_experts": args.num_experts or 2 * config.world_size, "top_k": args.top_k,
           "capacity_factor": args.capacity_factor, "lm": args.lm}
    launch.launch(demo, config, cfg)


if __name__ == "__main__":
    main()
