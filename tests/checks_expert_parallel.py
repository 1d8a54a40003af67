"""The checks of stage 07's expert parallelism, and the bugs each one must catch.

``verify(ctx, cfg)`` runs, on every rank, against the same ``MoE`` on one process:
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

``PLANTED`` lists the negative controls: each replaces one attribute of ``expert_parallel``
(inside the worker, with ``pytest.MonkeyPatch``: forked or spawned ranks do not see the
parent's patches) for the expert-parallel layer only, never for the one-process reference, and
names the check that must fail. ``tests/test_07_expert_parallel.py`` launches the workers below.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import bench_expert_parallel as bench        # 07_parallelism/measure: the byte formula
import expert_parallel as ep
from common import import_stage, models, verify

AUX_WEIGHT = 0.01  # the load-balancing loss's weight, Switch Transformer's alpha = 10^-2
SKEW = 2.0         # "skewed" routing: expert 0's router row leans towards the inputs' mean
# float32 tolerance, relative to the largest value compared (see the README): the layers differ
# only in how rows are batched into the experts' matrix products and in the order in which
# per-row contributions to a weight gradient are summed. Measured: at most 4e-7 (float32's
# epsilon is 1.2e-7); 1e-5 leaves a margin of 25 and still catches a gradient off by 0.1%.
RTOL = 1e-5
# The LM trains with plain SGD, whose step is linear in the gradient: its weights differ from
# one process's as little as the gradients do (AdamW would turn rounding noise into ~lr/10 steps).
LM_LR = 0.1
LM_RTOL = 1e-5


# --------------------------------------------------------------------------- verdicts


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


@contextlib.contextmanager
def planted(plant):
    """``plant(monkeypatch)`` replaces attributes of ``expert_parallel`` until the block ends."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        if plant is not None:
            plant(monkeypatch)
        yield


# --------------------------------------------------------------------------- the layer


def case(routing: str, top_k: int, capacity_factor) -> dict:
    return {"routing": routing, "top_k": top_k, "capacity_factor": capacity_factor}


def layer_cases() -> list[dict]:
    """Routings x top-1/top-2 x dropless/capacity 1.0/1.25, and a balanced routing."""
    cases = []
    for routing in ("random", "skewed"):
        for top_k in (1, 2):
            for capacity_factor in (None, 1.0, 1.25):
                cases.append(case(routing, top_k, capacity_factor))
    cases.append(case("balanced", 2, None))
    return cases


def case_label(which: dict) -> str:
    capacity = which["capacity_factor"]
    cap = "dropless" if capacity is None else f"capacity {capacity:g}"
    return f"{which['routing']} top-{which['top_k']} {cap}"


def build_moe(cfg: dict, which: dict, device) -> ep.MoE:
    """The same full MoE on every rank (seeded). "skewed": expert 0's router row leans towards
    the inputs' mean, so it is most tokens' first choice and overflows. "balanced": token i
    goes to experts i mod E and i + 1 mod E (needs d_model >= E), so that every rank sends
    every rank the same number of rows."""
    torch.manual_seed(0)
    moe = ep.MoE(cfg["d_model"], cfg["d_ff"], cfg["num_experts"], which["top_k"],
                 which["capacity_factor"])
    with torch.no_grad():
        if which["routing"] == "skewed":
            moe.router.weight[0] += SKEW / cfg["d_model"]
        if which["routing"] == "balanced":
            moe.router.weight.zero_()
            for expert in range(cfg["num_experts"]):
                moe.router.weight[expert, expert] = 1.0
    return moe.to(device)


def layer_input(cfg: dict, which: dict, rank: int, device) -> torch.Tensor:
    """This rank's tokens: [2, 5 + rank, d_model] (ranks hold different counts), or for the
    balanced routing [2E, d_model], token i pointing at experts i mod E, then i + 1 mod E."""
    generator = torch.Generator().manual_seed(100 + rank)
    d_model = cfg["d_model"]
    if which["routing"] == "balanced":
        tokens = 2 * cfg["num_experts"]
        x = 0.1 * torch.randn(tokens, d_model, generator=generator)
        for token in range(tokens):
            x[token, token % cfg["num_experts"]] += 4.0
            x[token, (token + 1) % cfg["num_experts"]] += 3.0
        return x.to(device)
    x = torch.randn(2, 5 + rank, d_model, generator=generator)
    if which["routing"] == "skewed":
        x += 1.0
    return x.to(device)


def layer_loss(out: torch.Tensor, target: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target) + AUX_WEIGHT * aux_loss


def check_layer(ctx, cfg: dict, which: dict, group=None, plant=None):
    """One forward + backward of ``ExpertParallelMoE(moe)`` (twice) against ``moe`` on this
    rank's tokens. Returns (a table row, the failures of every rank)."""
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    moe = build_moe(cfg, which, ctx.device)
    x = layer_input(cfg, which, rank, ctx.device)
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(200 + rank)).to(ctx.device)

    x_ref = x.clone().requires_grad_(True)                      # the reference: one process,
    out_ref = moe(x_ref)                                        # this rank's tokens
    layer_loss(out_ref, target, moe.aux_loss).backward()
    average_over(list(moe.experts.parameters()), group)        # and its data-parallel mean

    runs = []
    with planted(plant):
        layers = [ep.ExpertParallelMoE(moe, group), ep.ExpertParallelMoE(moe, group)]
        for layer in layers:                                    # two runs: determinism
            x_ep = x.clone().requires_grad_(True)
            out = layer(x_ep)
            layer_loss(out, target, layer.aux_loss).backward()
            runs.append({"output": out.detach(), "input grad": x_ep.grad,
                         "router grad": layer.router.weight.grad})
            for index, expert in layer.experts.items():
                for name, param in expert.named_parameters():
                    runs[-1][f"expert {index} {name} grad"] = param.grad

    check = Comparison(f"{case_label(which)}, {world_size} ranks")
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
    capacity = ep.expert_capacity(which["capacity_factor"], tokens, which["top_k"],
                                  cfg["num_experts"])
    if capacity is not None:
        check.at_most("the most tokens kept by one expert", max(layer.tokens_per_expert.tolist()),
                      capacity)
    expert_worst = [diff for what, diff in check.worst.items() if what.startswith("expert")]
    row = {"routing": which["routing"], "top_k": which["top_k"],
           "capacity": "dropless" if capacity is None else f"{which['capacity_factor']:g} (C={capacity})",
           "dropped": layer.dropped, "output": check.worst["output"],
           "input grad": check.worst["input grad"], "router grad": check.worst["router grad"],
           "expert grads": max(expert_worst)}
    return row, verify.agree_on_problems(check.failures, group)


class DetachedRouter(nn.Module):
    """The router on a detached input: the input's gradient then comes from the experts'
    path alone (dispatch, expert, combine), which the identity check reads exactly."""

    def __init__(self, router: nn.Module):
        super().__init__()
        self.router = router

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.router(x.detach())


def gate_weighted(copies: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """sum_k gates[t, k] * copies[t, k], written out (the check must not use ep.combine)."""
    return (gates.unsqueeze(-1) * copies).sum(dim=1)


def check_identity(ctx, cfg: dict, top_k: int, capacity_factor, group=None, plant=None):
    """Identity experts: the output must be sum_k gate_k * kept_k * x and the input's gradient
    sum_k gate_k * kept_k * dL/dout, bitwise: rows travel out and back to where they started."""
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    which = case("random", top_k, capacity_factor)
    moe = build_moe(cfg, which, ctx.device)
    moe.experts = nn.ModuleList(nn.Identity() for _ in range(cfg["num_experts"]))
    moe.router = DetachedRouter(moe.router)
    x = layer_input(cfg, which, rank, ctx.device).flatten(0, 1).requires_grad_(True)
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(300 + rank))
    grad_out = grad_out.to(ctx.device)
    with planted(plant):
        layer = ep.ExpertParallelMoE(moe, group)
        out = layer(x)
        (out * grad_out).sum().backward()                             # dL/dout = grad_out

    capacity = ep.expert_capacity(capacity_factor, x.shape[0], top_k, cfg["num_experts"])
    routing = ep.route(moe.router(x), top_k, capacity)
    kept = routing.kept.unsqueeze(-1).to(x.dtype)                     # [tokens, top_k, 1]
    copies = x.detach().unsqueeze(1) * kept                          # [tokens, top_k, d_model]
    grad_copies = grad_out.unsqueeze(1) * kept
    check = Comparison(f"identity experts top-{top_k} capacity {capacity_factor}, "
                       f"{world_size} ranks")
    check.bitwise("output = x * gate", out.detach(), gate_weighted(copies, routing.gates.detach()))
    check.bitwise("input grad = dL/dout * gate", x.grad,
                  gate_weighted(grad_copies, routing.gates.detach()))
    return verify.agree_on_problems(check.failures, group)


# --------------------------------------------------------------------------- bytes


def check_bytes(ctx, cfg: dict, group=None, plant=None):
    """Counted bytes of one forward + backward beside the formula, per exchange, exactly; and
    the expert parameters held per rank, exactly 1/W of the full layer's. -> (rows, failures)."""
    counters = import_stage("07_parallelism/measure/counters")
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    check = Comparison(f"bytes, {world_size} ranks")
    rows = []
    for which in (case("skewed", 2, 1.25), case("random", 1, None)):
        moe = build_moe(cfg, which, ctx.device)
        x = layer_input(cfg, which, rank, ctx.device)
        with planted(plant):
            layer = ep.ExpertParallelMoE(moe, group)
            counted = bench.count_bytes(layer, x, torch.zeros_like(x), layer_loss)
        want = bench.predicted_sent_bytes(bench.gathered_send_counts(layer, group), rank,
                                          layer.experts_per_rank, cfg["d_model"])
        check.equal(f"{case_label(which)}: bytes sent per all-to-all", counted, want)
        rows.append({"routing": case_label(which),
                     "counted (B)": " ".join(f"{b:.0f}" for b in counted),
                     "formula (B)": " ".join(str(b) for b in want)})
    moe = build_moe(cfg, layer_cases()[0], ctx.device)
    with planted(plant):
        layer = ep.ExpertParallelMoE(moe, group)
    router = counters.state_bytes(layer.router.parameters())
    held = counters.state_bytes(layer.parameters()) - router   # everything but the router
    check.equal("router bytes", router, counters.state_bytes(moe.router.parameters()))
    check.equal("expert parameter bytes held x W", held * world_size,
                counters.state_bytes(moe.experts.parameters()))
    return rows, verify.agree_on_problems(check.failures, group)


# --------------------------------------------------------------------------- the LM


def moe_blocks(num_experts: int, top_k: int, capacity_factor):
    """``make_mlp`` for common.models.TransformerLM: every block's MLP an MoE."""
    def make_mlp(d_model: int, d_ff: int) -> ep.MoE:
        return ep.MoE(d_model, d_ff, num_experts, top_k, capacity_factor)
    return make_mlp


def aux_loss_of(model: nn.Module) -> torch.Tensor:
    """The load-balancing losses of every block, summed."""
    return sum(block.mlp.aux_loss for block in model.blocks)


def expert_and_data_groups(world_size: int, rank: int, ep_size: int):
    """Expert-parallel groups of ``ep_size`` neighbouring ranks, and data-parallel groups of the
    ranks holding the same experts (rank r and r + ep_size, ...). Every rank creates every
    group, in the same order."""
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
    """The replicated parameters through stage 04's FlatDDP (over every rank), the experts over
    the ranks that hold the same experts only."""
    flat_ddp = import_stage("04_flat_ddp/flat_ddp")
    replicated = flat_ddp.FlatDDP(nn.ParameterList(ep.replicated_parameters(model)))
    experts = ep.expert_parameters(model)

    def sync() -> None:
        replicated.finish_gradient_synchronization()
        average_over(experts, dp_group)
    return sync


def sync_every_parameter(model, dp_group):
    """Planted: stage 04's FlatDDP over the whole model, experts included."""
    return import_stage("04_flat_ddp/flat_ddp").FlatDDP(model).finish_gradient_synchronization


def sync_replicated_only(model, dp_group):
    """Planted: the experts' copies (EP x DP) never averaged over the data-parallel group."""
    ddp = import_stage("04_flat_ddp/flat_ddp").FlatDDP(
        nn.ParameterList(ep.replicated_parameters(model)))
    return ddp.finish_gradient_synchronization


def sgd_step(model: nn.Module) -> None:
    """w -= lr * grad, then the gradients cleared (written out: torch.optim imports
    torch._dynamo, seconds per rank that the tests need not pay)."""
    with torch.no_grad():
        for param in model.parameters():
            param -= LM_LR * param.grad
            param.grad = None


def check_lm(ctx, cfg: dict, ep_size: int, make_sync=data_parallel_sync, plant=None):
    """The course LM with MoE blocks trained ``cfg["lm_steps"]`` SGD steps with expert parallel
    over ``ep_size`` ranks x data parallel over the rest, beside one process that runs the same
    global batch as the same groups of tokens (each rank's batch is a routing group). Every
    gradient after the data-parallel sync is compared at every step, the weights at the end."""
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
    label = f"LM {cfg['lm']} EP {ep_size} x DP {dp_size}"
    check = Comparison(label)
    batch = cfg["batch"]
    mine = slice(ctx.rank * batch, (ctx.rank + 1) * batch)
    with planted(plant):
        for block in model.blocks:
            block.mlp = ep.ExpertParallelMoE(block.mlp, ep_group)   # the full MoE dropped here
        sync = make_sync(model, dp_group)
        want = dict(reference.named_parameters())   # the same names: experts["3"] ~ experts[3]
        for step in range(cfg["lm_steps"]):
            generator = torch.Generator().manual_seed(step)   # the global batch, everywhere
            tokens = torch.randint(cfg["vocab"], (world_size * batch, cfg["seq"] + 1),
                                   generator=generator).to(ctx.device)
            inputs = tokens[:, :-1]                            # [global batch, seq]
            targets = tokens[:, 1:]                            # the next token of each
            loss = models.lm_loss(model(inputs[mine]), targets[mine])
            (loss + AUX_WEIGHT * aux_loss_of(model)).backward()
            sync()
            total = 0.0                                        # one process: the groups' mean
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
    copies = [("replicated parameters", ep.replicated_parameters(model), None),
              ("experts", ep.expert_parameters(model), dp_group)]
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
    return row, verify.agree_on_problems(check.failures)


# --------------------------------------------------------------------------- every check


def verify_all(ctx, cfg: dict) -> None:
    """Every check above on every rank; one AssertionError on every rank if any failed."""
    failures = []
    for which in layer_cases():
        failures += check_layer(ctx, cfg, which)[1]
    for top_k, capacity_factor in ((1, None), (1, 1.0), (2, 1.0)):
        failures += check_identity(ctx, cfg, top_k, capacity_factor)
    failures += check_bytes(ctx, cfg)[1]
    ep_sizes = [ctx.world_size]
    if ctx.world_size > 2 and ctx.world_size % 2 == 0:
        ep_sizes.append(2)
    for ep_size in ep_sizes:
        failures += check_lm(ctx, cfg, ep_size)[1]
    assert not failures, ("expert-parallel checks failed:\n  " + "\n  ".join(failures))


# --------------------------------------------------------------------------- planted bugs
# Each replaces one attribute of expert_parallel (the module or its ExpertParallelMoE class).

ORIGINAL_SORT = ep.ExpertParallelMoE.sort_by_destination
ORIGINAL_INIT = ep.ExpertParallelMoE.__init__


def forgets_gates(expert_out, gates):
    return expert_out.sum(dim=1)                     # the experts' outputs, unweighted


def unsorted_dispatch(self, routing):               # rows left in token order, not by rank
    token, choice = torch.nonzero(routing.kept, as_tuple=True)
    return token, choice, routing.experts[token, choice]


def no_regroup(self, received, recv_per_expert):
    # takes the received rows (rank by rank) as if they came expert by expert
    chunks = received.split(recv_per_expert.sum(dim=0).tolist())
    return torch.cat([expert(chunk) for expert, chunk in zip(self.experts.values(), chunks)])


class ExchangeWithoutReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, send_splits, recv_splits, group):
        return ep.exchange_rows(rows, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None                # keeps the gradient where it is


def not_divided(self, grad):
    return grad                                      # the sum over ranks, not the mean


def divided_by_experts_per_rank(self, grad):
    return grad / self.experts_per_rank              # E/W, not W: equal only where E = W^2


def off_by_a_thousandth(self, grad):
    return grad / self.world_size * 1.001


def sends_dropped(self, routing):                   # dispatches the dropped assignments too
    everything = copy.copy(routing)
    everything.kept = torch.ones_like(routing.kept)
    return ORIGINAL_SORT(self, everything)


def ignores_capacity(self, moe, group=None):
    ORIGINAL_INIT(self, moe, group)
    self.capacity_factor = None                      # routes dropless whatever the MoE says


def keeps_all_experts(self, moe, group=None):
    ORIGINAL_INIT(self, moe, group)
    self.spare = copy.deepcopy(moe.experts)          # never frees the other ranks' experts


def on_class(name, replacement):
    return lambda monkeypatch: monkeypatch.setattr(ep.ExpertParallelMoE, name, replacement)


def on_module(name, replacement):
    return lambda monkeypatch: monkeypatch.setattr(ep, name, replacement)


# (name, plant, the layer case it runs on, what the failures must name)
PLANTED_LAYER = [
    ("combine forgets the gates", on_module("combine", forgets_gates),
     case("random", 2, None), ["output differs"]),
    ("rows not sorted by destination", on_class("sort_by_destination", unsorted_dispatch),
     case("random", 2, None), ["output differs"]),
    ("rows not regrouped by expert", on_class("run_local_experts", no_regroup),
     case("random", 2, None), ["output differs"]),
    ("backward does not reverse the exchange", on_module("AllToAll", ExchangeWithoutReverse),
     case("balanced", 2, None), ["input grad differs", "0.weight grad differs"]),
    ("expert gradient not divided by W", on_class("mean_over_ranks", not_divided),
     case("skewed", 2, 1.25), ["2.bias grad differs"]),
    ("expert gradient divided by E/W", on_class("mean_over_ranks", divided_by_experts_per_rank),
     case("random", 2, None), ["2.bias grad differs"]),
    ("expert gradient off by 0.1%", on_class("mean_over_ranks", off_by_a_thousandth),
     case("random", 1, 1.0), ["2.bias grad differs"]),
    ("dropped assignments dispatched", on_class("sort_by_destination", sends_dropped),
     case("skewed", 1, 1.0), ["output differs"]),
    ("capacity ignored", on_class("__init__", ignores_capacity),
     case("skewed", 1, 1.0), ["the most tokens kept by one expert is", "dropped is 0, expected"]),
]


def expect_caught(ctx, failures, what, *needles):
    """A planted bug's gathered verdict: non-empty, naming the check (the same on every rank)."""
    assert failures, f"rank {ctx.rank}: the checks missed a planted bug: {what}"
    for needle in needles:
        assert any(needle in failure for failure in failures), (what, needle, failures)


def negative_controls(ctx, cfg: dict) -> None:
    """Every planted bug, each caught by the check that is there for it, on every rank: at
    W = 2 all but one (each check they must fail is the same at any W); at W >= 4 the experts'
    copies not averaged (it needs EP x DP), and the gradient divided by E/W once more."""
    if ctx.world_size >= 4:
        for what, plant, which, needles in PLANTED_LAYER:
            if what == "expert gradient divided by E/W":
                expect_caught(ctx, check_layer(ctx, cfg, which, plant=plant)[1], what, *needles)
        expect_caught(ctx, check_lm(ctx, cfg, 2, sync_replicated_only)[1],
                      "expert copies not averaged (EP x DP)", "mlp.experts", "grad differs",
                      "experts' copy 1 (against copy 0) not bitwise")
        return
    for what, plant, which, needles in PLANTED_LAYER:
        expect_caught(ctx, check_layer(ctx, cfg, which, plant=plant)[1], what, *needles)
    expect_caught(ctx, check_identity(ctx, cfg, 2, None, plant=on_module("combine", forgets_gates)),
                  "identity: combine forgets the gates", "output = x * gate")
    expect_caught(ctx, check_bytes(ctx, cfg, plant=on_class("sort_by_destination",
                                                           sends_dropped))[1],
                  "bytes: dropped assignments dispatched", "bytes sent per all-to-all")
    expect_caught(ctx, check_bytes(ctx, cfg, plant=on_class("__init__", keeps_all_experts))[1],
                  "every expert kept", "expert parameter bytes held x W")
    expect_caught(ctx, check_lm(ctx, cfg, ctx.world_size, sync_every_parameter)[1],
                  "a DDP over the whole model", "grad differs", "after 3 steps")
