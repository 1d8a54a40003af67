"""Stage 07: expert parallelism, run. Checks ExpertParallelMoE against the one-process MoE, and
measures it (--bench).

The plain run checks, on every rank, against the same MoE on one process:
* the layer (many routings: random, one expert favoured so that it overflows, balanced;
  top-1 and top-2; dropless and capacity factors 1.0 and 1.25): output, input gradient,
  router gradient, every expert's gradient (against the data-parallel mean), the
  load-balancing loss, tokens per expert and drops; two runs bitwise equal;
* identity experts: the layer returns its input times the gate, forward and backward, bitwise
  (dispatch and combine are inverse permutations);
* the bytes each all-to-all sends, counted, equal to the formula for the routing measured;
  the expert parameters each rank holds, exactly 1/W of them;
* the course LM with MoE blocks, a few SGD steps with expert parallelism over every rank
  (and, on 4+ ranks, expert parallel 2 x data parallel W/2), equal to one process.
Every check's verdict is gathered: all ranks fail together, naming what differed.

--bench: a token-count sweep of the step time (forward + backward) of the replicated MoE on
one rank against expert parallel; bytes sent per rank counted beside the formula; expert
parameter bytes per rank; load statistics for capacity factors 1.0, 1.25, 2.0 and dropless.
Rows go to results/expert_parallel.csv, a plot of tokens per expert to
results/expert_parallel_load.png (when matplotlib is there).

Run:
    python 07_parallelism/06_expert_parallel/run_expert_parallel.py                  # 2 ranks
    python 07_parallelism/06_expert_parallel/run_expert_parallel.py --world-size 4   # + EP 2 x DP 2
    python 07_parallelism/06_expert_parallel/run_expert_parallel.py --bench --world-size 4
    torchrun --nproc-per-node=4 07_parallelism/06_expert_parallel/run_expert_parallel.py
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from expert_parallel import (MoE, ExpertParallelMoE, combine, expert_capacity, expert_parameters,
                             replicated_parameters, route)

AUX_WEIGHT = 0.01  # the load-balancing loss's weight, Switch Transformer's alpha = 10^-2
SKEW = 2.0         # "skewed" routing: expert 0's router row leans towards the inputs' mean
# float32 tolerance, relative to the largest value compared (see the README): the layers differ
# only in how rows are batched into the experts' matrix products and in the order in which
# per-row contributions to a weight gradient are summed. Measured: at most 4e-7 (float32's
# epsilon is 1.2e-7); 1e-5 leaves a margin of 25 and still catches a gradient off by 0.1%.
RTOL = 1e-5
# The LM trains with plain SGD, whose step is linear in the gradient: its weights differ from
# one process's as little as the gradients do. (AdamW divides by sqrt(v) + eps: a gradient of 1e-9,
# rounding noise beside the largest gradients' 1e-2, becomes a step of ~lr/10 whose size
# depends on that noise, and weights differ by ~1e-5 after one step.)
LM_LR = 0.1
LM_RTOL = 1e-5


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


# --------------------------------------------------------------------------- verdicts


def agree(failures: list[str], group=None) -> list[str]:
    """Every rank's problems on every rank, named by rank: one verdict (common/verify.py)."""
    from common import verify
    return verify.agree_on_problems(failures, group)


def relative_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0 when both are zero)."""
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item()
    if scale == 0:
        return diff
    return diff / scale


class Comparison:
    """Named comparisons of one case; ``failures`` says what differed and by how much."""

    def __init__(self, label: str):
        self.label = label
        self.failures = []
        self.worst = {}

    def close(self, what: str, got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL) -> None:
        diff = relative_diff(got, want)
        self.worst[what] = max(self.worst.get(what, 0.0), diff)
        if diff > rtol:
            self.failures.append(f"{self.label}: {what} differs, max relative diff {diff:.2e} "
                                 f"(tolerance {rtol:g})")

    def bitwise(self, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(got, want):
            diff = (got.double() - want.double()).abs().max().item()
            self.failures.append(f"{self.label}: {what} not bitwise equal, max abs diff {diff:.2e}")

    def equal(self, what: str, got, want) -> None:
        if got != want:
            self.failures.append(f"{self.label}: {what} is {got}, expected {want}")

    def at_most(self, what: str, got, limit) -> None:
        if got > limit:
            self.failures.append(f"{self.label}: {what} is {got}, more than {limit}")


# --------------------------------------------------------------------------- the layer


def layer_cases() -> list[dict]:
    """Routings x top-1/top-2 x dropless/capacity 1.0/1.25, and a balanced routing."""
    cases = []
    for routing in ("random", "skewed"):
        for top_k in (1, 2):
            for capacity_factor in (None, 1.0, 1.25):
                cases.append({"routing": routing, "top_k": top_k,
                              "capacity_factor": capacity_factor})
    cases.append({"routing": "balanced", "top_k": 2, "capacity_factor": None})
    return cases


def case_label(case: dict) -> str:
    capacity = case["capacity_factor"]
    cap = "dropless" if capacity is None else f"capacity {capacity:g}"
    return f"{case['routing']} top-{case['top_k']} {cap}"


def build_moe(cfg: dict, case: dict, device) -> MoE:
    """The same full MoE on every rank (seeded). "skewed": expert 0's router row leans towards
    the inputs' mean, so it is most tokens' first choice and overflows. "balanced": token i
    goes to experts i mod E and i + 1 mod E (needs d_model >= E), so that every rank sends
    every rank the same number of rows."""
    torch.manual_seed(0)
    moe = MoE(cfg["d_model"], cfg["d_ff"], cfg["num_experts"], case["top_k"],
              case["capacity_factor"])
    with torch.no_grad():
        if case["routing"] == "skewed":
            moe.router.weight[0] += SKEW / cfg["d_model"]
        if case["routing"] == "balanced":
            moe.router.weight.zero_()
            for expert in range(cfg["num_experts"]):
                moe.router.weight[expert, expert] = 1.0
    return moe.to(device)


def layer_input(cfg: dict, case: dict, rank: int, device) -> torch.Tensor:
    """This rank's tokens: [2, 5 + rank, d_model] (ranks hold different counts), or for the
    balanced routing [2E, d_model], token i pointing at experts i mod E, then i + 1 mod E."""
    generator = torch.Generator().manual_seed(100 + rank)
    d_model = cfg["d_model"]
    if case["routing"] == "balanced":
        tokens = 2 * cfg["num_experts"]
        x = 0.1 * torch.randn(tokens, d_model, generator=generator)
        for token in range(tokens):
            x[token, token % cfg["num_experts"]] += 4.0
            x[token, (token + 1) % cfg["num_experts"]] += 3.0
        return x.to(device)
    x = torch.randn(2, 5 + rank, d_model, generator=generator)
    if case["routing"] == "skewed":
        x += 1.0
    return x.to(device)


def layer_loss(out: torch.Tensor, target: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target) + AUX_WEIGHT * aux_loss


def check_layer(ctx, cfg: dict, case: dict, group=None, layer_class=ExpertParallelMoE):
    """One forward + backward of ``layer_class(moe)`` (twice) against ``moe`` on this rank's
    tokens. Returns (a table row, the failures of every rank)."""
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    label = case_label(case)
    moe = build_moe(cfg, case, ctx.device)
    layers = [layer_class(moe, group), layer_class(moe, group)]   # two runs: determinism
    x = layer_input(cfg, case, rank, ctx.device)
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(200 + rank)).to(ctx.device)

    x_ref = x.clone().requires_grad_(True)                      # the reference: one process,
    out_ref = moe(x_ref)                                        # this rank's tokens
    layer_loss(out_ref, target, moe.aux_loss).backward()
    average_over(list(moe.experts.parameters()), group)        # and its data-parallel mean

    runs = []
    for layer in layers:
        x_ep = x.clone().requires_grad_(True)
        out = layer(x_ep)
        layer_loss(out, target, layer.aux_loss).backward()
        runs.append({"output": out.detach(), "input grad": x_ep.grad,
                     "router grad": layer.router.weight.grad})
        for index, expert in layer.experts.items():
            for name, param in expert.named_parameters():
                runs[-1][f"expert {index} {name} grad"] = param.grad

    check = Comparison(f"{label}, {world_size} ranks")
    layer = layers[0]
    want = {"output": out_ref.detach(), "input grad": x_ref.grad,
            "router grad": moe.router.weight.grad}
    for index, expert in layer.experts.items():
        for name, _ in expert.named_parameters():
            want[f"expert {index} {name} grad"] = moe.experts[int(index)].get_parameter(name).grad
    for what, got in runs[0].items():
        check.close(what, got, want[what])
        check.bitwise(f"{what} (second run)", runs[1][what], got)
    check.bitwise("aux_loss", layer.aux_loss, moe.aux_loss)
    check.equal("tokens_per_expert", layer.tokens_per_expert.tolist(),
                moe.tokens_per_expert.tolist())
    check.equal("dropped", layer.dropped, moe.dropped)
    tokens = x.numel() // x.shape[-1]
    capacity = expert_capacity(case["capacity_factor"], tokens, case["top_k"], cfg["num_experts"])
    if capacity is not None:
        check.at_most("the most tokens kept by one expert", max(layer.tokens_per_expert.tolist()),
                      capacity)
    expert_worst = [diff for what, diff in check.worst.items() if what.startswith("expert")]
    row = {"routing": case["routing"], "top_k": case["top_k"],
           "capacity": "dropless" if capacity is None else f"{case['capacity_factor']:g} (C={capacity})",
           "dropped": layer.dropped, "output": check.worst["output"],
           "input grad": check.worst["input grad"], "router grad": check.worst["router grad"],
           "expert grads": max(expert_worst)}
    return row, agree(check.failures, group)


class DetachedRouter(nn.Module):
    """The router on a detached input: the input's gradient then comes from the experts'
    path alone (dispatch, expert, combine), which the identity check reads exactly."""

    def __init__(self, router: nn.Module):
        super().__init__()
        self.router = router

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.router(x.detach())


def check_identity(ctx, cfg: dict, top_k: int, capacity_factor, group=None,
                   layer_class=ExpertParallelMoE) -> list[str]:
    """Identity experts: the output must be sum_k gate_k * kept_k * x and the input's gradient
    sum_k gate_k * kept_k * dL/dout, bitwise: rows travel out and back to where they started."""
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    case = {"routing": "random", "top_k": top_k, "capacity_factor": capacity_factor}
    moe = build_moe(cfg, case, ctx.device)
    moe.experts = nn.ModuleList(nn.Identity() for _ in range(cfg["num_experts"]))
    moe.router = DetachedRouter(moe.router)
    layer = layer_class(moe, group)
    x = layer_input(cfg, case, rank, ctx.device).flatten(0, 1).requires_grad_(True)
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(300 + rank))
    out = layer(x)
    (out * grad_out.to(ctx.device)).sum().backward()                  # dL/dout = grad_out

    capacity = expert_capacity(capacity_factor, x.shape[0], top_k, cfg["num_experts"])
    routing = route(moe.router(x), top_k, capacity)
    kept = routing.kept.unsqueeze(-1).to(x.dtype)                     # [tokens, top_k, 1]
    copies = x.detach().unsqueeze(1) * kept                          # [tokens, top_k, d_model]
    grad_copies = grad_out.to(ctx.device).unsqueeze(1) * kept
    check = Comparison(f"identity experts top-{top_k} capacity {capacity_factor}, "
                       f"{world_size} ranks")
    check.bitwise("output = x * gate", out.detach(), combine(copies, routing.gates.detach()))
    check.bitwise("input grad = dL/dout * gate", x.grad,
                  combine(grad_copies, routing.gates.detach()))
    return agree(check.failures, group)


# --------------------------------------------------------------------------- bytes


def predicted_sent_bytes(send_counts: torch.Tensor, rank: int, experts_per_rank: int,
                         d_model: int, element_size: int = 4) -> list[int]:
    """What rank ``rank`` sends in each all-to-all of one forward + backward, in call order,
    given ``send_counts`` [W, E]: the rows every rank sends every expert. Forward: the counts
    (E/W int64 to each other rank), the rows to other ranks' experts (dispatch), the rows
    other ranks sent here (combine); backward: the same two exchanges reversed."""
    world_size = send_counts.shape[0]
    my_experts = slice(rank * experts_per_rank, (rank + 1) * experts_per_rank)
    to_others = send_counts[rank].sum().item() - send_counts[rank, my_experts].sum().item()
    from_others = send_counts[:, my_experts].sum().item() - send_counts[rank, my_experts].sum().item()
    row = d_model * element_size
    counts = (world_size - 1) * experts_per_rank * 8
    return [counts, to_others * row, from_others * row, to_others * row, from_others * row]


def uniform_bytes_per_exchange(tokens: int, top_k: int, d_model: int, world_size: int,
                               element_size: int = 4) -> float:
    """Uniform routing, no drops: top_k * tokens * d_model * (W-1)/W * element size."""
    return top_k * tokens * d_model * (world_size - 1) / world_size * element_size


def gathered_send_counts(layer, group=None) -> torch.Tensor:
    """[W, E]: every rank's ``tokens_per_expert`` (the rows it sends each expert), gathered
    apart from the layer's own exchange so that the formula does not read what it checks."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, layer.tokens_per_expert.tolist(), group=group)
    return torch.tensor(everyone)


def count_bytes(ctx, layer, x: torch.Tensor, target: torch.Tensor) -> list[float]:
    """Bytes this rank sends in each all-to-all of one forward + backward, counted. ``x``
    needs a gradient, as a layer's input in a model does: without one, backward would skip
    the reverse of the dispatch (4 exchanges instead of 5)."""
    from common import import_stage
    counters = import_stage("07_parallelism/measure/counters")
    x = x.detach().requires_grad_(True)
    with counters.CommCounter() as comm:
        out = layer(x)
        layer_loss(out, target, layer.aux_loss).backward()
    return [call["sent_bytes"] for call in comm.calls if call["op"] == "all_to_all"]


def check_bytes(ctx, cfg: dict, group=None, layer_class=ExpertParallelMoE):
    """Counted bytes of one forward + backward beside the formula, per exchange, exactly; and
    the expert parameters held per rank, exactly 1/W of the full layer's. -> (rows, failures)."""
    from common import import_stage
    counters = import_stage("07_parallelism/measure/counters")
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    check = Comparison(f"bytes, {world_size} ranks")
    rows = []
    for case in ({"routing": "skewed", "top_k": 2, "capacity_factor": 1.25},
                 {"routing": "random", "top_k": 1, "capacity_factor": None}):
        moe = build_moe(cfg, case, ctx.device)
        layer = layer_class(moe, group)
        x = layer_input(cfg, case, rank, ctx.device)
        counted = count_bytes(ctx, layer, x, torch.zeros_like(x))
        want = predicted_sent_bytes(gathered_send_counts(layer, group), rank,
                                    layer.experts_per_rank, cfg["d_model"])
        check.equal(f"{case_label(case)}: bytes sent per all-to-all", counted, want)
        rows.append({"routing": case_label(case), "counted (B)": " ".join(f"{b:.0f}" for b in counted),
                     "formula (B)": " ".join(str(b) for b in want)})
    moe = build_moe(cfg, layer_cases()[0], ctx.device)
    layer = layer_class(moe, group)
    router = counters.state_bytes(layer.router.parameters())
    held = counters.state_bytes(layer.parameters()) - router   # everything but the router
    check.equal("router bytes", router, counters.state_bytes(moe.router.parameters()))
    check.equal("expert parameter bytes held x W", held * world_size,
                counters.state_bytes(moe.experts.parameters()))
    return rows, agree(check.failures, group)


# --------------------------------------------------------------------------- the LM


def moe_blocks(num_experts: int, top_k: int, capacity_factor):
    """``make_mlp`` for common.models.TransformerLM: every block's MLP an MoE."""
    def make_mlp(d_model: int, d_ff: int) -> MoE:
        return MoE(d_model, d_ff, num_experts, top_k, capacity_factor)
    return make_mlp


def aux_loss_of(model: nn.Module) -> torch.Tensor:
    """The load-balancing losses of every block, summed."""
    return sum(block.mlp.aux_loss for block in model.blocks)


def expert_and_data_groups(world_size: int, rank: int, ep_size: int):
    """Expert-parallel groups of ``ep_size`` neighbouring ranks (their all-to-alls are the heavy
    traffic: keep them inside a node), and data-parallel groups of the ranks holding the same
    experts (rank r and r + ep_size, ...). Every rank creates every group, in the same order."""
    ep_group = None
    dp_group = None
    for start in range(0, world_size, ep_size):
        ranks = list(range(start, start + ep_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            ep_group = group
    for offset in range(ep_size):
        ranks = list(range(offset, world_size, ep_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            dp_group = group
    return ep_group, dp_group


def average_over(params: list[nn.Parameter], group) -> None:
    """Stage 04's flat all-reduce, over ``group``: every gradient in one buffer, one call,
    divided by the group's size, copied back."""
    size = dist.get_world_size(group)
    flat = torch.cat([param.grad.flatten() for param in params])
    dist.all_reduce(flat, group=group)
    flat.div_(size)
    offset = 0
    for param in params:
        param.grad.copy_(flat[offset:offset + param.numel()].view_as(param))
        offset += param.numel()


def data_parallel_sync(model: nn.Module, dp_group):
    """How the gradients become the data-parallel mean: the replicated parameters through
    stage 04's FlatDDP (over every rank), the experts over the ranks that hold the same
    experts only (their gradients are already the mean over the expert-parallel ranks)."""
    from common import import_stage
    flat_ddp = import_stage("04_flat_ddp/flat_ddp")
    replicated = flat_ddp.FlatDDP(nn.ParameterList(replicated_parameters(model)))
    experts = expert_parameters(model)

    def sync() -> None:
        replicated.finish_gradient_synchronization()
        average_over(experts, dp_group)
    return sync


def sgd_step(model: nn.Module) -> None:
    """w -= lr * grad, then the gradients cleared. (Written out: constructing a torch.optim
    optimizer imports torch._dynamo, seconds per rank that the tests need not pay.)"""
    with torch.no_grad():
        for param in model.parameters():
            param -= LM_LR * param.grad
            param.grad = None


def check_lm(ctx, cfg: dict, ep_size: int, make_sync=data_parallel_sync):
    """The course LM with MoE blocks trained ``cfg["lm_steps"]`` SGD steps with expert parallel
    over ``ep_size`` ranks x data parallel over the rest, beside one process that runs the same
    global batch as the same groups of tokens (each rank's batch is a routing group: capacity
    and the load-balancing loss are per group). Every gradient after the data-parallel sync is
    compared at every step, the weights at the end. -> (row, failures)."""
    from common import models
    world_size = ctx.world_size
    dp_size = world_size // ep_size
    ep_group, dp_group = expert_and_data_groups(world_size, ctx.rank, ep_size)
    make_mlp = moe_blocks(cfg["num_experts"], cfg["top_k"], cfg["capacity_factor"])

    def build():
        torch.manual_seed(0)
        return models.TransformerLM(cfg["lm"], vocab_size=cfg["vocab"], context_length=cfg["seq"],
                                    make_mlp=make_mlp).to(ctx.device)
    model = build()
    reference = build()
    for block in model.blocks:
        block.mlp = ExpertParallelMoE(block.mlp, ep_group)   # the full MoE is dropped here
    sync = make_sync(model, dp_group)
    want = dict(reference.named_parameters())   # the same names: experts["3"] ~ experts[3]
    label = f"LM {cfg['lm']} EP {ep_size} x DP {dp_size}"
    check = Comparison(label)
    batch = cfg["batch"]
    mine = slice(ctx.rank * batch, (ctx.rank + 1) * batch)
    for step in range(cfg["lm_steps"]):
        generator = torch.Generator().manual_seed(step)   # the global batch, the same everywhere
        tokens = torch.randint(cfg["vocab"], (world_size * batch, cfg["seq"] + 1),
                               generator=generator).to(ctx.device)
        inputs = tokens[:, :-1]                            # [global batch, seq]
        targets = tokens[:, 1:]                            # the next token of each
        loss = models.lm_loss(model(inputs[mine]), targets[mine]) + AUX_WEIGHT * aux_loss_of(model)
        loss.backward()
        sync()
        # one process: the mean of the groups' losses
        total = 0.0
        for group_index in range(world_size):
            part = slice(group_index * batch, (group_index + 1) * batch)
            group_loss = models.lm_loss(reference(inputs[part]), targets[part])
            total = total + group_loss + AUX_WEIGHT * aux_loss_of(reference)
        (total / world_size).backward()

        for name, param in model.named_parameters():
            check.close(f"step {step} {name} grad", param.grad, want[name].grad)
        sgd_step(model)
        sgd_step(reference)

    worst = 0.0
    for name, param in model.named_parameters():
        check.close(f"{name} after {cfg['lm_steps']} steps", param.detach(), want[name].detach(),
                    LM_RTOL)
        worst = max(worst, (param - want[name]).abs().max().item())
    copies = [("replicated parameters", replicated_parameters(model), None),
              ("experts", expert_parameters(model), dp_group)]
    for what, params, group in copies:       # replicas bitwise equal: the same steps everywhere
        flat = torch.cat([param.detach().flatten() for param in params])
        everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, flat, group=group)
        for copy_index, other in enumerate(everyone):
            check.bitwise(f"{what}' copy {copy_index} (against copy 0)", other, everyone[0])
    grad_worst = max(diff for what, diff in check.worst.items() if what.startswith("step"))
    row = {"model": f"{cfg['lm']} LM, {cfg['num_experts']} experts top-{cfg['top_k']}",
           "expert parallel": ep_size, "data parallel": dp_size,
           "SGD steps": cfg["lm_steps"], "max grad diff (relative)": grad_worst,
           "max |weight - one process|": worst}
    return row, agree(check.failures)


# --------------------------------------------------------------------------- plain run


def verify_main(ctx, cfg: dict) -> None:
    from common import results
    failures = []
    layer_rows = []
    for case in layer_cases():
        row, failed = check_layer(ctx, cfg, case)
        layer_rows.append(row)
        failures += failed
    for top_k, capacity_factor in ((1, None), (1, 1.0), (2, 1.0)):
        failures += check_identity(ctx, cfg, top_k, capacity_factor)
    byte_rows, failed = check_bytes(ctx, cfg)
    failures += failed
    lm_rows = []
    ep_sizes = [ctx.world_size]
    if ctx.world_size > 2 and ctx.world_size % 2 == 0:
        ep_sizes.append(2)
    for ep_size in ep_sizes:
        row, failed = check_lm(ctx, cfg, ep_size)
        lm_rows.append(row)
        failures += failed
    if ctx.is_main:
        print(f"Expert parallel MoE on {ctx.world_size} ranks: d_model {cfg['d_model']}, d_ff "
              f"{cfg['d_ff']}, {cfg['num_experts']} experts, {ctx.backend}/{ctx.device.type} "
              f"({results.machine_name()})")
        results.print_table(layer_rows, "\nAgainst the one-process MoE (rank 0; max relative "
                                        "diff; expert grads against the data-parallel mean):",
                            floatfmt=".1e")
        results.print_table(byte_rows, "\nBytes rank 0 sends per all-to-all, one forward + "
                                       "backward (counts, dispatch, combine | combine, dispatch):")
        results.print_table(lm_rows, "\nThe LM with MoE blocks against one process:",
                            floatfmt=".1e")
    if failures:
        raise AssertionError(f"expert-parallel checks failed ({len(failures)}):\n  "
                             + "\n  ".join(failures))
    ctx.print("all checks passed: outputs, every gradient, drops, bytes, parameters held, the LM",
              all_ranks=False)


# --------------------------------------------------------------------------- --bench


def bench_layer(cfg: dict, routing: str, capacity_factor, device) -> MoE:
    case = {"routing": routing, "top_k": cfg["top_k"], "capacity_factor": capacity_factor}
    return build_moe(cfg, case, device)


def bench_input(cfg: dict, routing: str, tokens: int, rank: int, device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, cfg["d_model"], generator=generator)
    if routing == "skewed":
        x += 1.0
    return x.to(device)


def bench_step(layer, x: torch.Tensor) -> None:
    """One forward + backward, as training runs it."""
    out = layer(x)
    layer_loss(out, torch.zeros_like(out), layer.aux_loss).backward()


def bench_timing(ctx, cfg: dict, failures: list[str]) -> list[dict]:
    """Step time of the replicated MoE (every rank its own tokens, no communication) and of
    expert parallel, per token count; the bytes sent, counted and from the formula."""
    from common import timing
    rows = []
    for tokens in cfg["tokens"]:
        moe = bench_layer(cfg, "random", None, ctx.device)
        layer = ExpertParallelMoE(moe)
        x = bench_input(cfg, "random", tokens, ctx.rank, ctx.device)
        replicated = timing.gather_times(timing.measure(lambda: bench_step(moe, x), ctx.device,
                                                        cfg["warmup"], cfg["iters"], barrier=True))
        expert_parallel = timing.gather_times(timing.measure(lambda: bench_step(layer, x),
                                                             ctx.device, cfg["warmup"],
                                                             cfg["iters"], barrier=True))
        counted = count_bytes(ctx, layer, x, torch.zeros_like(x))
        want = predicted_sent_bytes(gathered_send_counts(layer), ctx.rank,
                                    layer.experts_per_rank, cfg["d_model"], x.element_size())
        if counted != want:
            failures.append(f"{tokens} tokens: bytes counted {counted}, formula {want}")
        rows.append({"tokens_per_rank": tokens,
                     "replicated_ms": 1e3 * replicated.median,
                     "expert_parallel_ms": 1e3 * expert_parallel.median,
                     "ep_over_replicated": expert_parallel.median / replicated.median,
                     "bytes_sent_counted": sum(counted), "bytes_sent_formula": sum(want),
                     "dispatch_bytes": counted[1],
                     "uniform_bytes_per_exchange": uniform_bytes_per_exchange(
                         tokens, cfg["top_k"], cfg["d_model"], ctx.world_size, x.element_size())})
    return rows


def bench_memory(ctx, cfg: dict, failures: list[str]) -> dict:
    """Expert parameter bytes per rank: exactly 1/W of the layer's, plus the whole router."""
    from common import import_stage
    counters = import_stage("07_parallelism/measure/counters")
    moe = bench_layer(cfg, "random", None, ctx.device)
    layer = ExpertParallelMoE(moe)
    full = counters.state_bytes(moe.experts.parameters())
    router = counters.state_bytes(layer.router.parameters())
    held = counters.state_bytes(layer.parameters()) - router
    if held * ctx.world_size != full:
        failures.append(f"expert bytes per rank {held} x {ctx.world_size} != {full}")
    return {"expert_bytes_replicated": full, "expert_bytes_per_rank": held,
            "share": held / full, "router_bytes": router}


def bench_load(ctx, cfg: dict) -> list[dict]:
    """Tokens per expert (kept, all ranks' tokens), max / mean, share of assignments dropped,
    and the rows each rank's experts receive, for each routing and capacity factor."""
    rows = []
    tokens = cfg["tokens"][-1]
    for routing in ("random", "skewed"):
        for capacity_factor in cfg["capacity_factors"]:
            moe = bench_layer(cfg, routing, capacity_factor, ctx.device)
            layer = ExpertParallelMoE(moe)
            with torch.no_grad():
                layer(bench_input(cfg, routing, tokens, ctx.rank, ctx.device))
            per_expert = gathered_send_counts(layer).sum(dim=0)        # [E], all ranks
            dropped = [None] * ctx.world_size
            dist.all_gather_object(dropped, layer.dropped)
            assignments = ctx.world_size * tokens * cfg["top_k"]
            capacity = expert_capacity(capacity_factor, tokens, cfg["top_k"], cfg["num_experts"])
            per_rank = per_expert.view(ctx.world_size, -1).sum(dim=1)   # rows each rank's experts run
            rows.append({"routing": routing,
                         "capacity_factor": "dropless" if capacity_factor is None
                         else capacity_factor,
                         "capacity_per_rank": "-" if capacity is None else capacity,
                         "tokens_per_expert": " ".join(str(n) for n in per_expert.tolist()),
                         "rows_per_rank": " ".join(str(n) for n in per_rank.tolist()),
                         "max_over_mean": per_expert.max().item() / per_expert.float().mean().item(),
                         "dropped_share": sum(dropped) / assignments})
    return rows


def plot_load(load_rows: list[dict], cfg: dict, world_size: int, title: str):
    """Bars of tokens per expert, coloured by the rank that holds the expert, one panel per
    routing and capacity factor, the capacity (W x C) dashed. None without matplotlib."""
    from common import results
    plt = results.pyplot()
    if plt is None:
        return None
    figure, axes = plt.subplots(2, len(load_rows) // 2, figsize=(3 * len(load_rows) // 2, 5),
                                sharey="row", squeeze=False)
    per_rank = cfg["num_experts"] // world_size
    colours = [f"C{expert // per_rank}" for expert in range(cfg["num_experts"])]
    for axis, row in zip(axes.flatten(), load_rows):
        counts = [int(n) for n in row["tokens_per_expert"].split()]
        axis.bar(range(len(counts)), counts, color=colours)
        if row["capacity_per_rank"] != "-":    # each rank sends an expert at most C rows
            axis.axhline(world_size * row["capacity_per_rank"], color="grey", linestyle="--",
                         linewidth=1)
        axis.set_title(f"{row['routing']}, {row['capacity_factor']}\n"
                       f"dropped {100 * row['dropped_share']:.1f}%", fontsize=8)
        axis.set_xlabel("expert (colour: its rank)", fontsize=8)
    axes[0][0].set_ylabel("tokens routed (all ranks)")
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    path = results.results_dir() / "expert_parallel_load.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def bench_main(ctx, cfg: dict) -> None:
    from common import results
    failures = []
    time_rows = bench_timing(ctx, cfg, failures)
    memory = bench_memory(ctx, cfg, failures)
    load_rows = bench_load(ctx, cfg)
    same_case = {"routing": "random", "top_k": cfg["top_k"], "capacity_factor": 1.25}
    check_row, checked = check_layer(ctx, cfg, same_case)   # deterministic, equal to the MoE
    failures = agree(failures) + checked
    if ctx.is_main:
        n = ctx.world_size
        where = f"{ctx.backend}/{ctx.device.type} ({results.machine_name()})"
        print(f"Expert parallel on {n} ranks: d_model {cfg['d_model']}, d_ff {cfg['d_ff']}, "
              f"{cfg['num_experts']} experts, top-{cfg['top_k']}, {where}")
        results.print_table(time_rows, "\nStep (forward + backward), slowest rank's median; "
                                       "bytes rank 0 sends per step (5 all-to-alls; dispatch: "
                                       "the first forward one):", floatfmt=".4g")
        results.print_table([memory], "\nParameter bytes per rank (float32):", floatfmt=".3g")
        results.print_table(load_rows, f"\nLoad, {cfg['tokens'][-1]} tokens per rank:",
                            floatfmt=".3g")
        formula_ok = all(r["bytes_sent_counted"] == r["bytes_sent_formula"] for r in time_rows)
        targets = [
            {"target": "counted all-to-all bytes == formula (every row)",
             "measured": f"{'equal' if formula_ok else 'DIFFERENT'}", "met": formula_ok},
            {"target": f"expert bytes per rank == 1/{n} of the layer's",
             "measured": f"{memory['expert_bytes_per_rank']} of {memory['expert_bytes_replicated']}"
                         f" B ({memory['share']:.4g})",
             "met": memory["expert_bytes_per_rank"] * n == memory["expert_bytes_replicated"]},
            {"target": "deterministic, and equal to the MoE (float32, rtol 1e-5)",
             "measured": f"output {check_row['output']:.1e}, expert grads "
                         f"{check_row['expert grads']:.1e}", "met": not checked},
        ]
        results.print_table(targets, f"\nTargets ({results.machine_name()}):")
        same = {"backend": ctx.backend, "device": ctx.device.type, "world_size": n,
                "d_model": cfg["d_model"], "d_ff": cfg["d_ff"], "num_experts": cfg["num_experts"],
                "top_k": cfg["top_k"], "machine": results.machine_name(), "run_id": results.run_id()}
        key = ["backend", "device", "world_size", "d_model", "d_ff", "num_experts", "top_k",
               "measure", "tokens_per_rank", "routing", "capacity_factor"]
        rows = []
        for row in time_rows:
            rows.append({**same, "measure": "step", "routing": "random", "capacity_factor": "dropless",
                         **row, **memory})
        for row in load_rows:
            rows.append({**same, "measure": "load", "tokens_per_rank": cfg["tokens"][-1], **row})
        results.upsert_csv("expert_parallel.csv", rows, key=key)
        path = plot_load(load_rows, cfg, n, f"Tokens per expert, {n} ranks x "
                                            f"{cfg['tokens'][-1]} tokens, top-{cfg['top_k']}")
        if path is not None:
            print(f"\nplot: {os.path.relpath(path)}")
    if failures:
        raise AssertionError("expert-parallel bench checks failed:\n  " + "\n  ".join(failures))


# --------------------------------------------------------------------------- flags


def capacity_factor_type(text: str):
    """A flag type: 'none' (dropless) or a finite number > 0."""
    from common import launch
    if text.strip().lower() in ("none", "dropless"):
        return None
    try:
        return launch.positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a capacity factor: give a finite "
                                         "number > 0, or none (dropless)") from None


def main(argv=None) -> None:
    _repo()
    from common import launch, models, results
    parser = launch.make_parser(__doc__, world_size=2)
    parser.add_argument("--bench", action="store_true",
                        help="measure step time, bytes, memory and load instead of verifying")
    for flag, default, what in (("--d-model", None, "model width (default: 16, --bench 128)"),
                                ("--d-ff", None, "expert hidden width (default: 32, --bench 512)"),
                                ("--num-experts", None, "experts (default: 2 x world size)"),
                                ("--top-k", 2, "experts per token (the LM and --bench)"),
                                ("--warmup", 2, "--bench: untimed steps"),
                                ("--iters", 5, "--bench: timed steps")):
        parser.add_argument(flag, type=launch.positive_int, default=default, help=what)
    parser.add_argument("--capacity-factor", type=capacity_factor_type, default=1.25,
                        help="the LM's MoE blocks: a number > 0, or none (dropless)")
    parser.add_argument("--capacity-factors", type=launch.list_of(capacity_factor_type),
                        default=[1.0, 1.25, 2.0, None], help="--bench: load statistics for each")
    parser.add_argument("--tokens", type=launch.int_list, default=[256, 1024, 2048],
                        help="--bench: tokens per rank, a sweep")
    parser.add_argument("--lm", choices=list(models.PRESETS), default="tiny",
                        help="the LM preset trained with MoE blocks")
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    n = config.world_size
    cfg = {"d_model": args.d_model or (128 if args.bench else 16),
           "d_ff": args.d_ff or (512 if args.bench else 32),
           "num_experts": args.num_experts or 2 * n, "top_k": args.top_k,
           "capacity_factor": args.capacity_factor, "capacity_factors": args.capacity_factors,
           "tokens": args.tokens, "warmup": args.warmup, "iters": args.iters,
           "lm": args.lm, "vocab": 256, "seq": 16, "batch": 2, "lm_steps": 3}
    if cfg["num_experts"] % n:
        parser.error(f"--num-experts {cfg['num_experts']} is not divisible by the number of "
                     f"ranks {n}: each rank holds num_experts / ranks experts")
    if cfg["top_k"] > cfg["num_experts"]:
        parser.error(f"--top-k {cfg['top_k']} is more than --num-experts {cfg['num_experts']}")
    if not args.bench and cfg["d_model"] < cfg["num_experts"]:
        parser.error(f"--d-model {cfg['d_model']} is less than --num-experts "
                     f"{cfg['num_experts']}: the balanced routing check needs one input "
                     "direction per expert")
    results.check_writable()
    if args.bench:
        launch.launch(bench_main, config, cfg)
    else:
        launch.launch(verify_main, config, cfg)


if __name__ == "__main__":
    main()
