"""The checks of lesson 5 (context parallelism) that the tests run, each returning what it
found so that a test can run it on the real code and beside a planted bug:

* ``ring_case``: one forward + backward of ring attention beside scaled_dot_product_attention
  on the whole sequence (output, dq, dk, dv, the unsharded output), the bytes each rank sends
  counted beside the ring's formula, and the (query, key) scores its kernel saw beside those
  its queries see; ``check_ring_attention`` runs every dtype, layout and causal setting, with
  the work per rank (max / mean) beside the load-balance formula;
* ``ulysses_case``: the same for Ulysses on contiguous shards, its all-to-all bytes beside
  their formula; ``check_ulysses`` runs every dtype and causal setting;
* ``check_lm``: the course LM trained a few SGD steps on dp x cp ranks (ring attention or
  Ulysses) beside one process, with the reduction of the gradients and the loss a test may
  replace.

run_context_parallel.py has its own plain loops for the learner; this is the version the
tests bend. The formulas and the counting kernel are the measurement's
(measure/bench_context_parallel.py).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

import bench_context_parallel as bench
import context_parallel as cp
import counters
from common import models, verify

DTYPES = {"float64": torch.float64, "float32": torch.float32}
# (rtol, atol). float64: the ring adds the same terms as one process in another order, so
# only rounding at 1e-16 separates them. float32 rounds at 6e-8 relative; an output or
# gradient element sums up to seq x head_dim products of size about 1, and the chunks' partial
# results are rescaled by exp(lse - lse_new) before adding: a few 1e-7 to 1e-6 at the sizes
# checked. A wrong merge or mask moves results by 1e-2 or more.
TOLERANCE = {torch.float64: (1e-10, 1e-12), torch.float32: (1e-4, 1e-5)}
LM_PRESET = "tiny"
LM_VOCAB = 256
LM_STEPS = 3
LM_LR = 0.05
LM_TOLERANCE = (1e-5, 1e-6)  # SGD: a difference in the gradient is not amplified (AdamW's is)


def agree(failures: list[str]) -> list[str]:
    """Every rank's problems on every rank, named by rank: one verdict (common/verify.py)."""
    return verify.agree_on_problems(failures)


def gather_from_ranks(mine: dict, group=None) -> list[dict]:
    """Each rank's ``mine`` (numbers by name), in the order of the ranks of ``group``."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def make_groups(ctx, dp: int, cp_size: int) -> dict:
    """Process groups for a grid of dp data x cp_size context ranks, repeated over the world as
    independent copies: rank = copy * dp * cp + data_rank * cp + context_rank (the context
    ranks of one data rank are neighbours). Every rank creates every group, in the same order,
    as ``new_group`` requires; it keeps its own."""
    grid = dp * cp_size
    mine = {}
    for copy_index in range(ctx.world_size // grid):
        base = copy_index * grid
        ranks = list(range(base, base + grid))
        group = dist.new_group(ranks)
        if ctx.rank in ranks:
            mine["data_and_context"] = group
        for data_rank in range(dp):
            ranks = []
            for context_rank in range(cp_size):
                ranks.append(base + data_rank * cp_size + context_rank)
            group = dist.new_group(ranks)
            if ctx.rank in ranks:
                mine["context"] = group
        for context_rank in range(cp_size):
            ranks = []
            for data_rank in range(dp):
                ranks.append(base + data_rank * cp_size + context_rank)
            group = dist.new_group(ranks)
            if ctx.rank in ranks:
                mine["data"] = group
    mine["dp"] = dp
    mine["cp"] = cp_size
    mine["data_rank"] = (ctx.rank % grid) // cp_size
    mine["context_rank"] = ctx.rank % cp_size
    return mine


# --------------------------------------------------------------------------- check 1: the ring


def random_attention(cfg: dict, seq: int, dtype, device, seed: int):
    """Full q, k, v (leaves that require grad) and an output gradient, [batch, heads, seq,
    head_dim], the same on every rank for a given seed."""
    shape = (cfg["batch"], cfg["heads"], seq, cfg["head_dim"])
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(shape, generator=generator, dtype=dtype).to(device).requires_grad_(True)
    k = torch.randn(shape, generator=generator, dtype=dtype).to(device).requires_grad_(True)
    v = torch.randn(shape, generator=generator, dtype=dtype).to(device).requires_grad_(True)
    grad_out = torch.randn(shape, generator=generator, dtype=dtype).to(device)
    return q, k, v, grad_out


def compare_with_one_process(case: str, compared: list, rtol: float, atol: float,
                             row: dict) -> list[str]:
    """(name, this rank's tensor, one process's) triples: each largest difference into ``row``,
    and a failure for each pair not allclose."""
    failures = []
    for name, got, want in compared:
        difference = (got - want).abs().max().item()
        row[f"{name} max diff"] = difference
        if not torch.allclose(got, want, rtol=rtol, atol=atol):
            failures.append(f"{case}: {name} differs from one process by {difference:.3g} "
                            f"(rtol {rtol:g}, atol {atol:g})")
    return failures


def bytes_beside_formula(case: str, comm, formula: tuple[int, int], row: dict) -> list[str]:
    """The bytes this rank sent forward and backward (``comm``, labelled) beside the
    (forward, backward) formula, into ``row``; a failure unless both are exact."""
    counted = comm.by_label
    forward = counted.get("forward", {"sent_bytes": 0})["sent_bytes"]
    backward = counted.get("backward", {"sent_bytes": 0})["sent_bytes"]
    row["fwd bytes"] = int(forward)
    row["fwd formula"] = formula[0]
    row["bwd bytes"] = int(backward)
    row["bwd formula"] = formula[1]
    if (forward, backward) != tuple(formula):
        return [f"{case}: sent {forward:.0f} B forward, {backward:.0f} B backward; the formula "
                f"says {formula[0]} and {formula[1]}"]
    return []


def ring_case(ctx, group, cfg: dict, dtype, layout: str, causal: bool) -> tuple[dict, list]:
    """One forward + backward of ring attention on this rank's shards, beside
    scaled_dot_product_attention on the full sequence (every rank draws the same full q, k, v
    and output gradient, then keeps its shard). Returns (a row for the table, failures)."""
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    q_ref, k_ref, v_ref, grad_out = random_attention(cfg, cfg["seq"], dtype, ctx.device, seed=0)
    out_ref = F.scaled_dot_product_attention(q_ref, k_ref, v_ref, is_causal=causal)
    out_ref.backward(grad_out)

    def mine(t):
        return cp.shard_sequence(t.detach(), 2, rank, world_size, layout)

    q = mine(q_ref).requires_grad_(True)
    k = mine(k_ref).requires_grad_(True)
    v = mine(v_ref).requires_grad_(True)
    kernel = bench.CountingAttention()
    with kernel, counters.CommCounter() as comm:
        comm.current = "forward"
        out = cp.ring_attention(q, k, v, group=group, causal=causal, layout=layout)
        comm.current = "backward"
        out.backward(mine(grad_out))
    rtol, atol = TOLERANCE[dtype]
    compared = [("output", out, mine(out_ref)), ("dq", q.grad, mine(q_ref.grad)),
                ("dk", k.grad, mine(k_ref.grad)), ("dv", v.grad, mine(v_ref.grad)),
                ("unsharded output", cp.unshard_sequence(out.detach(), 2, group, layout), out_ref)]
    case = f"W={world_size} {str(dtype)[6:]} {layout} causal={causal}"
    row = {"W": world_size, "dtype": str(dtype)[6:], "layout": layout, "causal": causal}
    failures = compare_with_one_process(case, compared, rtol, atol, row)
    block_bytes = k.numel() * k.element_size()
    failures += bytes_beside_formula(case, comm, bench.ring_bytes(world_size, block_bytes), row)
    want_visible = bench.visible_scores(rank, world_size, cfg["seq"], layout, causal,
                                  cfg["batch"] * cfg["heads"])
    if kernel.visible != want_visible:
        failures.append(f"{case}: the kernel saw {kernel.visible} (query, key) scores; this "
                        f"rank's queries see {want_visible}")
    row["visible"] = kernel.visible
    row["computed"] = kernel.computed
    row["ok"] = not failures
    return row, failures


def balance_rows(ctx, group, case_rows: list[dict]) -> list[dict]:
    """Per (W, layout, causal): each rank's visible scores, max/mean beside the formula."""
    rows = []
    for row in case_rows:
        if row["dtype"] != "float64":
            continue  # the work does not depend on the dtype
        per_rank = gather_from_ranks({"visible": row["visible"], "computed": row["computed"]},
                                     group)
        visible = [counts["visible"] for counts in per_rank]
        computed = [counts["computed"] for counts in per_rank]
        rows.append({"W": row["W"], "layout": row["layout"], "causal": row["causal"],
                     "visible scores per rank": " ".join(f"{int(x)}" for x in visible),
                     "max/mean": max(visible) / (sum(visible) / len(visible)),
                     "formula (long seq)": bench.imbalance_formula(row["W"], row["layout"],
                                                             row["causal"]),
                     "computed max/mean": max(computed) / (sum(computed) / len(computed))})
    return rows


def check_ring_attention(ctx, group, cfg: dict) -> tuple[list[dict], list[dict], list[str]]:
    """Every dtype, layout and causal setting on ``group``: (case rows, balance rows, failures)."""
    rows = []
    failures = []
    for dtype in DTYPES.values():
        for layout in cfg["layouts"]:
            for causal in (True, False):
                row, problems = ring_case(ctx, group, cfg, dtype, layout, causal)
                rows.append(row)
                failures += problems
    return rows, balance_rows(ctx, group, rows), failures


def ulysses_case(ctx, group, cfg: dict, dtype, causal: bool) -> tuple[dict, list]:
    """One forward + backward of Ulysses on this rank's contiguous shards beside
    scaled_dot_product_attention on the full sequence, and the bytes its all-to-alls send
    beside the formula. Returns (a row for the table, failures)."""
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    q_ref, k_ref, v_ref, grad_out = random_attention(cfg, cfg["seq"], dtype, ctx.device, seed=0)
    out_ref = F.scaled_dot_product_attention(q_ref, k_ref, v_ref, is_causal=causal)
    out_ref.backward(grad_out)

    def mine(t):
        return cp.shard_sequence(t.detach(), 2, rank, world_size, "contiguous")

    q = mine(q_ref).requires_grad_(True)
    k = mine(k_ref).requires_grad_(True)
    v = mine(v_ref).requires_grad_(True)
    with counters.CommCounter() as comm:
        comm.current = "forward"
        out = cp.ulysses_attention(q, k, v, group=group, causal=causal)
        comm.current = "backward"
        out.backward(mine(grad_out))
    rtol, atol = TOLERANCE[dtype]
    compared = [("output", out, mine(out_ref)), ("dq", q.grad, mine(q_ref.grad)),
                ("dk", k.grad, mine(k_ref.grad)), ("dv", v.grad, mine(v_ref.grad))]
    case = f"Ulysses W={world_size} {str(dtype)[6:]} causal={causal}"
    row = {"W": world_size, "dtype": str(dtype)[6:], "causal": causal}
    failures = compare_with_one_process(case, compared, rtol, atol, row)
    shard_bytes = q.numel() * q.element_size()
    failures += bytes_beside_formula(case, comm, bench.ulysses_bytes(world_size, shard_bytes), row)
    row["ok"] = not failures
    return row, failures


def check_ulysses(ctx, group, cfg: dict) -> tuple[list[dict], list[str]]:
    """Every dtype and causal setting on ``group``: (case rows, failures)."""
    rows = []
    failures = []
    for dtype in DTYPES.values():
        for causal in (True, False):
            row, problems = ulysses_case(ctx, group, cfg, dtype, causal)
            rows.append(row)
            failures += problems
    return rows, failures


# --------------------------------------------------------------------------- check 2: the LM


def reduce_over_data_and_context(model, loss, groups) -> torch.Tensor:
    """The right reduction: gradients and the reported loss averaged over the data AND context
    ranks together (each rank's loss is the mean over its own tokens, all shards equal)."""
    group = groups["data_and_context"]
    cp.average_gradients(model, group)
    total = loss.clone()
    dist.all_reduce(total, group=group)
    return total / dist.get_world_size(group)


def lm_batch(step: int, batch: int, seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step ``step``: (tokens, next tokens), [batch, seq] each."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(LM_VOCAB, (batch, seq + 1), generator=generator).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def check_lm(ctx, groups: dict, cfg: dict, layout: str,
             reduce=reduce_over_data_and_context, kind: str = "ring") -> tuple[list[dict], list[str]]:
    """The course LM trained LM_STEPS SGD steps on the dp x cp ranks of ``groups``
    (``make_groups``: ring attention, or Ulysses on contiguous shards, over the context ranks,
    global positions, ``reduce`` for the gradients and the loss) beside the same LM trained on
    the whole batch in one process. (rows, failures)."""
    dp = groups["dp"]
    cp_size = groups["cp"]
    context_rank = groups["context_rank"]
    seq = cfg["seq"]
    torch.manual_seed(0)
    model = models.TransformerLM(LM_PRESET, vocab_size=LM_VOCAB, context_length=seq)
    model = model.to(ctx.device)
    reference = copy.deepcopy(model)  # the one-process LM, from the same weights
    if kind == "ulysses":
        cp.use_ulysses_attention(model, groups["context"])
    else:
        cp.use_ring_attention(model, groups["context"], layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=LM_LR, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LM_LR, momentum=0.9)
    positions = cp.shard_positions(seq // cp_size, context_rank, cp_size, layout, ctx.device)
    rows_per_rank = cfg["batch"] // dp
    my_rows = slice(groups["data_rank"] * rows_per_rank, (groups["data_rank"] + 1) * rows_per_rank)
    rtol, atol = LM_TOLERANCE
    rows = []
    failures = []
    for step in range(LM_STEPS):
        tokens, targets = lm_batch(step, cfg["batch"], seq, ctx.device)
        my_tokens = cp.shard_sequence(tokens[my_rows], 1, context_rank, cp_size, layout)
        my_targets = cp.shard_sequence(targets[my_rows], 1, context_rank, cp_size, layout)
        optimizer.zero_grad(set_to_none=True)
        loss = models.lm_loss(model(my_tokens, positions), my_targets)  # mean over my tokens
        loss.backward()
        reported = reduce(model, loss.detach(), groups).item()
        optimizer.step()

        ref_optimizer.zero_grad(set_to_none=True)
        ref_loss = models.lm_loss(reference(tokens), targets)
        ref_loss.backward()
        ref_optimizer.step()

        worst = 0.0
        close = True
        for param, ref_param in zip(model.parameters(), reference.parameters()):
            worst = max(worst, (param - ref_param).abs().max().item())
            close = close and torch.allclose(param, ref_param, rtol=rtol, atol=atol)
        loss_close = abs(reported - ref_loss.item()) <= rtol * abs(ref_loss.item())
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        replicas = []
        for _ in range(dist.get_world_size(groups["data_and_context"])):
            replicas.append(torch.empty_like(flat))
        dist.all_gather(replicas, flat, group=groups["data_and_context"])
        same = True
        for replica in replicas:
            same = same and torch.equal(replica, flat)
        case = f"LM dp={dp} cp={cp_size} {kind} {layout} step {step}"
        if not close:
            failures.append(f"{case}: weights differ from one process by up to {worst:.3g}")
        if not loss_close:
            failures.append(f"{case}: reported loss {reported:.6f}, one process "
                            f"{ref_loss.item():.6f}")
        if not same:
            failures.append(f"{case}: the replicas' weights are not bitwise equal")
        rows.append({"dp": dp, "cp": cp_size, "kind": kind, "layout": layout, "step": step,
                     "loss": reported, "one-process loss": ref_loss.item(),
                     "max |weight - one process|": worst, "replicas bitwise equal": same,
                     "ok": close and loss_close and same})
    return rows, failures


