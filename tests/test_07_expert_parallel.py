"""Stage 07, expert parallelism (07_parallelism/06_expert_parallel).

In this process: the routing rules (capacity, priority, drops) on a hand-made routing, the
load-balancing loss's value on it (counted before drops), the reference MoE against a
token-by-token sum, a deep copy after a forward, bad arguments and bad flags (the demo's and the
measurement's: one line, exit 2, nothing launched). One launch per world size (2 and 4) runs
every check of tests/checks_expert_parallel.py, with 6 and 8 experts so that W and E/W differ at
both sizes; then the negative controls: each planted bug must fail the check that is there to
catch it, with the same verdict on every rank (at W = 2, and the EP x DP one at W = 4). The
W = 2 launch also runs a small --bench (stopped once half way: the rows measured stay; once with
a budget that leaves out the larger token count) and the demo's own worker (once
with a planted bug: it prints what differed and exits 1).
"""

import copy
import math
import runpy
import sys

import pytest
import torch
import torch.distributed as dist

import bench_expert_parallel as bench
import checks_expert_parallel as checks
import expert_parallel as ep
from bench import results
from bench import supervisor as launch
from helpers import REPO, assert_main_usage_error

DEMO = REPO / "07_parallelism" / "06_expert_parallel" / "run_expert_parallel.py"
# Experts per world size such that W and E/W differ (a gradient divided by E/W instead of W
# must fail): W = 2 -> 6 (E/W = 3), W = 4 -> 8 (E/W = 2). d_model >= E (the balanced routing).
EXPERTS = {2: 6, 4: 8}
CFG = {"d_model": 12, "d_ff": 16, "top_k": 2, "capacity_factor": 1.25, "lm": "tiny", "vocab": 256,
       "seq": 16, "batch": 2, "lm_steps": 3}
BENCH = {"d_model": 16, "d_ff": 32, "tokens": [16, 48], "warmup": 1, "iters": 2,
         "capacity_factors": [1.0, None], "profile": False, "budget_s": None}

# --------------------------------------------------------------------------- routing rules

# Three experts A=0, B=1, C=2; first choices A A A B, second choices B C B A.
HAND_MADE = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
# Capacity 2, first choices before second choices: t0-A t1-A kept, t2-A dropped (A full), t3-B
# kept; then t0-B kept (B's second), t1-C kept, t2-B dropped (B full), t3-A dropped (A full).
HAND_MADE_KEPT = [[True, True], [True, True], [False, False], [True, False]]


def hand_made_logits() -> torch.Tensor:
    """Logits whose top-2 are HAND_MADE's choices, the first choice most probable."""
    logits = torch.full((4, 3), -5.0)
    for token, (first, second) in enumerate(HAND_MADE.tolist()):
        logits[token, first] = 2.0
        logits[token, second] = 1.0
    return logits


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
    routing = ep.route(hand_made_logits(), 2, ep.expert_capacity(0.75, 4, 2, 3))
    assert routing.experts.tolist() == HAND_MADE.tolist()
    assert routing.kept.tolist() == HAND_MADE_KEPT
    assert torch.allclose(routing.gates.sum(dim=-1), torch.ones(4))
    assert torch.equal(ep.route(hand_made_logits(), 1, None).gates, torch.ones(4, 1))  # p / p = 1


def test_a_huge_capacity_factor_is_dropless():
    # C is capped at the token count (an expert takes each token once at most): 1e300 and
    # 1e308 (whose product overflows to inf) neither overflow ceil() nor the int64 comparison.
    assert ep.expert_capacity(1e300, 4, 2, 3) == 4
    assert ep.expert_capacity(1e308, 4, 2, 3) == 4
    assert ep.expert_capacity(1.0, 4, 2, 1) == 4               # one expert: all of them fit
    torch.manual_seed(0)
    huge = ep.MoE(6, 12, 4, 2, 1e300)
    dropless = copy.deepcopy(huge)
    dropless.capacity_factor = None
    x = torch.randn(15, 6)
    assert torch.equal(huge(x), dropless(x)) and huge.dropped == 0


def aux_loss_failures(loss_fn) -> list[str]:
    """The load-balancing loss on the hand-made routing with capacity 2 (three assignments
    dropped): f must count every routed assignment, before drops, f = (4, 3, 1) / 8; counted
    after drops it would be (2, 2, 1) / 8 (or / 5). P_e: the mean router probability."""
    routing = ep.route(hand_made_logits(), 2, 2)
    assert routing.kept.tolist() == HAND_MADE_KEPT            # the drops are really there
    probs = torch.softmax(hand_made_logits(), dim=-1).mean(dim=0)
    want = 3 * sum(f * p for f, p in zip([4 / 8, 3 / 8, 1 / 8], probs.tolist()))
    got = loss_fn(routing).item()
    if not math.isclose(got, want, rel_tol=1e-6):
        return [f"aux loss {got:.6f}, expected {want:.6f} (f counted before drops)"]
    return []


def kept_only_loss(routing):
    """Planted bug: f_e from the kept assignments only."""
    num_experts = routing.probs.shape[-1]
    kept = routing.experts[routing.kept]
    share = torch.bincount(kept, minlength=num_experts).to(routing.probs.dtype) / kept.numel()
    return num_experts * (share * routing.probs.mean(dim=0)).sum()


def test_load_balancing_loss_counts_assignments_before_drops():
    assert aux_loss_failures(ep.load_balancing_loss) == []
    assert aux_loss_failures(kept_only_loss)                   # negative control
    # and the layer's own aux_loss, routed by its router through the capacity rule
    moe = ep.MoE(3, 4, 3, top_k=2, capacity_factor=0.75)       # C = ceil(0.75 * 4 * 2 / 3) = 2
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(3))                  # router(x) = x: the logits
    moe(hand_made_logits())
    assert moe.dropped == 3
    assert aux_loss_failures(lambda routing: moe.aux_loss) == []


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


def test_moe_deep_copies_after_a_forward():
    torch.manual_seed(0)
    moe = ep.MoE(6, 12, 4, 2, 1.0)
    x = torch.randn(10, 6, requires_grad=True)
    out = moe(x)
    copied = copy.deepcopy(moe)                   # the aux_loss holds this call's graph
    assert moe.aux_loss.grad_fn is not None       # the original still trains with it
    assert copied.aux_loss.grad_fn is None and torch.equal(copied.aux_loss, moe.aux_loss)
    assert copied.dropped == moe.dropped
    assert torch.equal(copied.tokens_per_expert, moe.tokens_per_expert)
    assert torch.equal(copied(x.detach()), out.detach())
    (out.sum() + moe.aux_loss).backward()         # the original's graph is intact
    assert moe.router.weight.grad is not None


@pytest.mark.parametrize("kwargs, needle", [   # each would drop every token, silently
    ({"num_experts": 4, "capacity_factor": 0.0}, "capacity_factor=0.0"),
    ({"num_experts": 4, "capacity_factor": -1.0}, "capacity_factor=-1.0"),
    ({"num_experts": 4, "capacity_factor": float("nan")}, "capacity_factor=nan"),
])
def test_bad_arguments_value_error(kwargs, needle):
    with pytest.raises(ValueError) as error:
        ep.MoE(8, 16, **kwargs)
    assert needle in str(error.value) and "\n" not in str(error.value)


def demo_main(argv):
    """The demo's main in this process, as ``python run_expert_parallel.py argv...`` (run, not
    imported: nothing imports a run script)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(sys, "argv", [str(DEMO), *argv])
        runpy.run_path(str(DEMO), run_name="__main__")


CPU = ["--backend", "gloo", "--device", "cpu"]


@pytest.mark.parametrize("argv, needle", [
    (["--capacity-factor", "0"], "'0' is not a finite number > 0"),
    (["--capacity-factor", "-1"], "'-1' is not a finite number > 0"),
    (["--capacity-factor", "nan"], "'nan' is not a finite number > 0"),
    (["--tokens", "16"], "unrecognized arguments: --tokens 16"),   # the measurement's flag
])
def test_demo_bad_input_one_line_exit_2(argv, needle, capsys):
    assert_main_usage_error(demo_main, [*argv, *CPU], capsys, needle)


@pytest.mark.parametrize("argv, needle", [
    (["--tokens", "0"], "'0' is not a whole number >= 1"),
    (["--tokens", "100000000"], "--tokens 100000000"),                 # memory
    (["--num-experts", "100000"], "--num-experts 100000"),
    (["--capacity-factors", "1.0,0"], "'0' is not a capacity factor"),
    (["--capacity-factors", "1e300,none", "--budget-s", "nan"], "'nan' is not a finite number"),
    (["--world-size", "4", "--num-experts", "6"], "--num-experts 6 is not divisible"),
])
def test_bench_bad_input_one_line_exit_2(argv, needle, capsys):
    assert_main_usage_error(bench.main, [*argv, *CPU], capsys, needle)


# --------------------------------------------------------------------------- the launches


class Stop(Exception):
    """A planted stop half way through a bench (as a cap's Ctrl-C would stop it)."""


def worker(ctx):
    cfg = {**CFG, "num_experts": EXPERTS[ctx.world_size]}
    assert cfg["num_experts"] // ctx.world_size != ctx.world_size
    with pytest.raises(ValueError, match=f"{ctx.world_size + 1} experts cannot be split evenly"):
        ep.ExpertParallelMoE(ep.MoE(8, 16, ctx.world_size + 1))
    layer = ep.ExpertParallelMoE(checks.build_moe(cfg, checks.case("random", 2, None), ctx.device))
    per_rank = cfg["num_experts"] // ctx.world_size
    assert list(layer.experts) == [str(per_rank * ctx.rank + i) for i in range(per_rank)]
    assert [p.shape for p in layer.parameters()][0] == (cfg["num_experts"], cfg["d_model"])
    checks.verify_all(ctx, cfg)     # every check; raises on every rank on a failure
    checks.negative_controls(ctx, cfg)
    if ctx.world_size != 2:
        return
    demo = runpy.run_path(str(DEMO))                     # the demo's worker, not its main
    demo_cfg = {**cfg, "num_experts": 2 * ctx.world_size}
    demo["demo"](ctx, demo_cfg)
    with checks.planted(checks.on_class("mean_over_ranks", checks.not_divided)):
        with pytest.raises(SystemExit) as stopped:       # the demo says so, and exits 1
            demo["demo"](ctx, demo_cfg)
    assert stopped.value.code == 1
    small = {**cfg, **BENCH, "num_experts": 8}
    original = bench.time_one
    calls = []

    def first_then_stop(*args):
        calls.append(args)
        if len(calls) > 1:
            raise Stop("a planted stop after the first configuration")
        return original(*args)
    with pytest.MonkeyPatch.context() as monkeypatch:    # stopped after its first row
        monkeypatch.setattr(bench, "time_one", first_then_stop)
        with pytest.raises(Stop):
            bench.bench_main(ctx, small)
    dist.barrier()
    if ctx.is_main:
        steps = [r for r in results.read_csv("expert_parallel.csv") if r["measure"] == "step"]
        assert [int(r["tokens_per_rank"]) for r in steps] == [16], steps
    bench.bench_main(ctx, {**small, "budget_s": 1e-9})   # 48 tokens skipped: past the budget
    dist.barrier()
    if ctx.is_main:
        rows = results.read_csv("expert_parallel.csv")
        assert [int(r["tokens_per_rank"]) for r in rows if r["measure"] == "step"] == [16]
        assert {int(r["tokens_per_rank"]) for r in rows if r["measure"] == "load"} == {16}
    bench.bench_main(ctx, small)


@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel_checks_and_negative_controls(world_size):
    launch.launch(worker, launch.LaunchConfig(world_size, "gloo", "cpu"), timeout_s=300)
    if world_size != 2:
        return
    rows = results.read_csv("expert_parallel.csv")      # the small --bench: its CSV
    steps = [r for r in rows if r["measure"] == "step"]
    loads = [r for r in rows if r["measure"] == "load" and r["tokens_per_rank"] == "48"]
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
