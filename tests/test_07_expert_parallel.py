"""Stage 07, expert parallelism (07_parallelism/06_expert_parallel).

In this process: the routing rules (capacity, priority, drops) on a hand-made routing, the
reference MoE against a token-by-token sum, the load-balancing loss's exact values, bad
arguments. One launch per world size (2 and 4, E = 2W) runs the script's own checks (every
routing, top-1/top-2, dropless and capacity, identity experts, bytes, parameters held, the LM
with EP, and at 4 ranks EP 2 x DP 2), then the negative controls: each planted bug below must
fail the check that is there to catch it, with the same verdict on every rank (at W = 2, and
the EP x DP one at W = 4); the W = 2 launch also runs a small --bench.
"""

import copy
import math

import pytest
import torch
import torch.nn as nn

import expert_parallel as ep
import run_expert_parallel as run
from common import import_stage, launch, results
from helpers import assert_main_usage_error

# d_model >= num_experts = 2W (the balanced routing needs one input direction per expert)
CFG = {"d_model": 8, "d_ff": 16, "top_k": 2, "capacity_factor": 1.25, "lm": "tiny", "vocab": 256,
       "seq": 16, "batch": 2, "lm_steps": 3}
BENCH = {"tokens": [16, 48], "warmup": 1, "iters": 2, "capacity_factors": [1.0, None]}

# --------------------------------------------------------------------------- routing rules

# Three experts A=0, B=1, C=2; first choices A A A B, second choices B C B A.
HAND_MADE = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
# Capacity 2, first choices before second choices: t0-A t1-A kept, t2-A dropped (A full), t3-B
# kept; then t0-B kept (B's second), t1-C kept, t2-B dropped (B full), t3-A dropped (A full).
HAND_MADE_KEPT = [[True, True], [True, True], [False, False], [True, False]]


def token_order_only(experts, num_experts, capacity):
    """Planted bug: priority by token index alone (token 0's choices, then token 1's, ...)."""
    tokens, top_k = experts.shape
    in_order = experts.reshape(-1)                                  # [tokens * top_k]
    one_hot = torch.nn.functional.one_hot(in_order, num_experts)
    place = one_hot.cumsum(dim=0).gather(1, in_order.unsqueeze(1)).squeeze(1) - 1
    return (place < capacity).view(tokens, top_k)


def drop_rule_failures(keep) -> list[str]:
    got = keep(HAND_MADE, 3, 2).tolist()
    if got != HAND_MADE_KEPT:
        return [f"kept {got}, expected {HAND_MADE_KEPT}"]
    return []


def test_drop_rule_on_a_hand_made_routing():
    assert ep.expert_capacity(0.75, 4, 2, 3) == 2              # ceil(0.75 * 4 * 2 / 3) = 2
    assert ep.expert_capacity(1.0, 4, 2, 3) == 3               # ceil(8 / 3)
    assert ep.expert_capacity(1.25, 16, 2, 4) == 10
    assert ep.expert_capacity(None, 16, 2, 4) is None
    assert drop_rule_failures(ep.keep_within_capacity) == []
    assert drop_rule_failures(token_order_only) == [          # negative control
        "kept [[True, True], [True, True], [False, True], [False, False]], expected "
        f"{HAND_MADE_KEPT}"]
    # route(): the same routing from logits, gates renormalised, capacity 2 from the factor
    logits = torch.full((4, 3), -5.0)
    for token, (first, second) in enumerate(HAND_MADE.tolist()):
        logits[token, first] = 2.0
        logits[token, second] = 1.0
    routing = ep.route(logits, 2, ep.expert_capacity(0.75, 4, 2, 3))
    assert routing.experts.tolist() == HAND_MADE.tolist()
    assert routing.kept.tolist() == HAND_MADE_KEPT
    assert torch.allclose(routing.gates.sum(dim=-1), torch.ones(4))
    assert torch.equal(ep.route(logits, 1, None).gates, torch.ones(4, 1))   # top-1: p / p = 1


def test_reference_moe_is_the_token_by_token_sum_and_keeps_its_statistics():
    torch.manual_seed(0)
    for top_k, capacity_factor in ((1, None), (2, None), (2, 1.0), (3, 0.5)):
        moe = ep.MoE(6, 12, 4, top_k, capacity_factor)
        x = torch.randn(3, 5, 6)
        out = moe(x)
        assert out.shape == x.shape
        assert torch.equal(moe(x.reshape(15, 6)), out.reshape(15, 6))   # [b, s, d] = [b*s, d]
        capacity = ep.expert_capacity(capacity_factor, 15, top_k, 4)
        routing = ep.route(moe.router(x.reshape(15, 6)), top_k, capacity)
        for token in range(15):                  # the definition, one token and choice at a time
            want = torch.zeros(6)
            for choice in range(top_k):
                if routing.kept[token, choice]:
                    expert = moe.experts[routing.experts[token, choice].item()]
                    want += routing.gates[token, choice] * expert(x.reshape(15, 6)[token])
            assert torch.allclose(out.reshape(15, 6)[token], want, atol=1e-6), (top_k, token)
        kept_count = int(routing.kept.sum())
        assert moe.tokens_per_expert.sum().item() == kept_count
        assert moe.dropped == 15 * top_k - kept_count
        if capacity is not None:
            assert max(moe.tokens_per_expert.tolist()) <= capacity


def test_load_balancing_loss_values():
    # Uniform probabilities: P_e = 1/E, sum_e f_e = 1, so aux = E * (1/E) = 1 whatever f is.
    uniform = ep.route(torch.zeros(8, 4), 2, None)
    assert ep.load_balancing_loss(uniform).item() == pytest.approx(1.0, abs=1e-6)
    # Every token on expert 0 with probability p: f = (1, 0, 0, 0), aux = E * p.
    logits = torch.tensor([[3.0, 0.0, 0.0, 0.0]] * 5)
    p = math.exp(3.0) / (math.exp(3.0) + 3)
    assert ep.load_balancing_loss(ep.route(logits, 1, None)).item() == pytest.approx(4 * p)
    # top-2: f counts both choices: expert 0 and 1 each half of the assignments.
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0]] * 5)
    probs = torch.softmax(logits[0], dim=0)
    want = 4 * (0.5 * probs[0] + 0.5 * probs[1]).item()
    assert ep.load_balancing_loss(ep.route(logits, 2, None)).item() == pytest.approx(want)


@pytest.mark.parametrize("kwargs, needle", [
    ({"num_experts": 4, "top_k": 5}, "top_k=5"),
    ({"num_experts": 4, "top_k": 0}, "top_k=0"),
    ({"num_experts": 4, "capacity_factor": 0.0}, "capacity_factor=0.0"),
    ({"num_experts": 4, "capacity_factor": -1.0}, "capacity_factor=-1.0"),
    ({"num_experts": 4, "capacity_factor": float("nan")}, "capacity_factor=nan"),
    ({"num_experts": 4, "capacity_factor": float("inf")}, "capacity_factor=inf"),
])
def test_bad_arguments_value_error(kwargs, needle):
    with pytest.raises(ValueError) as error:
        ep.MoE(8, 16, **kwargs)
    assert needle in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("argv, needle", [
    (["--world-size", "4", "--num-experts", "6"], "--num-experts 6 is not divisible"),
    (["--num-experts", "4", "--top-k", "5"], "--top-k 5 is more than --num-experts 4"),
    (["--capacity-factor", "0"], "'0' is not a capacity factor"),
    (["--capacity-factor", "-1"], "'-1' is not a capacity factor"),
    (["--capacity-factor", "nan"], "'nan' is not a capacity factor"),
    (["--bench", "--capacity-factors", "1.0,0"], "'0' is not a capacity factor"),
    (["--d-model", "4", "--num-experts", "8"], "--d-model 4 is less than --num-experts 8"),
    (["--tokens", "0"], "'0' is not a whole number >= 1"),
])
def test_bad_input_one_line_exit_2(argv, needle, capsys):
    assert_main_usage_error(run.main, [*argv, "--backend", "gloo", "--device", "cpu"], capsys,
                            needle)


# --------------------------------------------------------------------------- planted bugs


class ForgetsGates(ep.ExpertParallelMoE):
    def combine(self, expert_out, gates):
        return expert_out.sum(dim=1)                 # the experts' outputs, unweighted


class UnsortedDispatch(ep.ExpertParallelMoE):
    def sort_by_destination(self, routing):          # rows left in token order, not by rank
        token, choice = torch.nonzero(routing.kept, as_tuple=True)
        return token, choice, routing.experts[token, choice]


class NoRegroup(ep.ExpertParallelMoE):
    def run_local_experts(self, received, recv_per_expert):
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


class NoReverseBackward(ep.ExpertParallelMoE):
    all_to_all = ExchangeWithoutReverse


class NotDividedByW(ep.ExpertParallelMoE):
    def mean_over_ranks(self, grad):
        return grad                                  # the sum over ranks, not the mean


class OffByAThousandth(ep.ExpertParallelMoE):
    def mean_over_ranks(self, grad):
        return grad / self.world_size * 1.001


class SendsDropped(ep.ExpertParallelMoE):
    def sort_by_destination(self, routing):          # dispatches the dropped assignments too
        everything = copy.copy(routing)
        everything.kept = torch.ones_like(routing.kept)
        return super().sort_by_destination(everything)


class IgnoresCapacity(ep.ExpertParallelMoE):
    def __init__(self, moe, group=None):
        super().__init__(moe, group)
        self.capacity_factor = None                  # routes dropless whatever the MoE says


class KeepsAllExperts(ep.ExpertParallelMoE):
    def __init__(self, moe, group=None):
        super().__init__(moe, group)
        self.spare = copy.deepcopy(moe.experts)      # never frees the other ranks' experts


def sync_every_parameter(model, dp_group):
    """Planted: stage 04's FlatDDP over the whole model, experts included."""
    return import_stage("04_flat_ddp/flat_ddp").FlatDDP(model).finish_gradient_synchronization


def sync_replicated_only(model, dp_group):
    """Planted: the experts' copies (EP x DP) never averaged over the data-parallel group."""
    ddp = import_stage("04_flat_ddp/flat_ddp").FlatDDP(
        nn.ParameterList(ep.replicated_parameters(model)))
    return ddp.finish_gradient_synchronization


def case(routing, top_k, capacity_factor):
    return {"routing": routing, "top_k": top_k, "capacity_factor": capacity_factor}


def expect_caught(ctx, failures, *needles):
    """A planted bug's gathered verdict: non-empty, the same on every rank, naming the check."""
    assert failures, f"rank {ctx.rank}: the check missed a planted bug ({needles})"
    for needle in needles:
        assert any(needle in failure for failure in failures), (needle, failures)


# --------------------------------------------------------------------------- the launches


def worker(ctx):
    cfg = {**CFG, "num_experts": 2 * ctx.world_size, **BENCH}
    with pytest.raises(ValueError, match=f"{ctx.world_size + 1} experts cannot be split evenly"):
        ep.ExpertParallelMoE(ep.MoE(8, 16, ctx.world_size + 1))
    run.verify_main(ctx, cfg)       # every check of the script; raises on every rank on failure
    layer = ep.ExpertParallelMoE(run.build_moe(cfg, case("random", 2, None), ctx.device))
    assert list(layer.experts) == [str(2 * ctx.rank), str(2 * ctx.rank + 1)]
    assert [p.shape for p in layer.parameters()][0] == (cfg["num_experts"], cfg["d_model"])
    if ctx.world_size == 4:         # the one planted bug that needs EP x DP
        expect_caught(ctx, run.check_lm(ctx, cfg, 2, sync_replicated_only)[1],
                      "mlp.experts", "grad differs", "experts' copy 1 (against copy 0) not bitwise")
        return
    # The other planted bugs, once (W = 2): each check they must fail is the same at any W.
    random_top2 = case("random", 2, None)
    for bug, which, needles in [
            (ForgetsGates, random_top2, ["output differs"]),
            (UnsortedDispatch, random_top2, ["output differs"]),
            (NoRegroup, random_top2, ["output differs"]),
            (NoReverseBackward, case("balanced", 2, None), ["input grad differs",
                                                            "expert 0 0.weight grad differs"]),
            (NotDividedByW, case("skewed", 2, 1.25), ["expert 0 2.bias grad differs"]),
            (OffByAThousandth, case("random", 1, 1.0), ["expert 0 2.bias grad differs"]),
            (SendsDropped, case("skewed", 1, 1.0), ["output differs"]),
            (IgnoresCapacity, case("skewed", 1, 1.0), ["the most tokens kept by one expert is",
                                                      "dropped is 0, expected"])]:
        row, failures = run.check_layer(ctx, cfg, which, layer_class=bug)
        expect_caught(ctx, failures, *needles)
    expect_caught(ctx, run.check_identity(ctx, cfg, 2, None, layer_class=ForgetsGates),
                  "output = x * gate")
    expect_caught(ctx, run.check_bytes(ctx, cfg, layer_class=SendsDropped)[1],
                  "bytes sent per all-to-all")
    expect_caught(ctx, run.check_bytes(ctx, cfg, layer_class=KeepsAllExperts)[1],
                  "expert parameter bytes held x W")
    expect_caught(ctx, run.check_lm(ctx, cfg, ctx.world_size, sync_every_parameter)[1],
                  "grad differs", "after 3 steps")
    run.bench_main(ctx, {**cfg, "d_model": 16, "d_ff": 32})


@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel_checks_and_negative_controls(world_size):
    launch.launch(worker, launch.LaunchConfig(world_size, "gloo", "cpu"), timeout_s=240)
    if world_size == 2:             # the small --bench ran: its CSV
        rows = results.read_csv("expert_parallel.csv")
        steps = [r for r in rows if r["measure"] == "step"]
        loads = [r for r in rows if r["measure"] == "load"]
        assert [int(r["tokens_per_rank"]) for r in steps] == BENCH["tokens"]
        assert all(r["bytes_sent_counted"] == r["bytes_sent_formula"] for r in steps)
        assert all(int(r["expert_bytes_per_rank"]) * 2 == int(r["expert_bytes_replicated"])
                   for r in steps)
        assert [(r["routing"], r["capacity_factor"]) for r in loads] == [
            ("random", "1.0"), ("random", "dropless"), ("skewed", "1.0"), ("skewed", "dropless")]
        for r in loads:
            counts = [int(n) for n in r["tokens_per_expert"].split()]
            assigned = 2 * BENCH["tokens"][-1] * CFG["top_k"]
            dropped = round(float(r["dropped_share"]) * assigned)
            assert sum(counts) + dropped == assigned, r           # every assignment accounted
            if r["capacity_factor"] == "dropless":
                assert dropped == 0
