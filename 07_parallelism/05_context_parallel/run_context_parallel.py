"""Stage 07, lesson 5: context parallelism, checked, measured and drawn.

The checks (the default): ring attention (context_parallel.py) against torch's
scaled_dot_product_attention on the whole sequence, outputs and the gradients of q, k and v, in
float64 and float32, causal and not, both layouts, on W = world size / --dp ranks; the bytes
each rank sends counted beside the formula; each rank's attention work counted beside the
load-balance formula; and the course LM trained a few steps on context (x data) ranks beside
the same LM trained on one process. Every check reaches one verdict on every rank.

``--bench``: a sequence-length sweep of one attention layer's forward + backward, on one rank
and on rings of 2 and 4 ranks in both layouts: step time (real compute, and emulated compute
where each chunk of work only waits in proportion to its FLOPs), bytes sent, FLOP balance,
activation memory; rows in results/context_parallel.csv. ``--profile``: a timeline of one step
per rank, the K/V transfers drawn under the compute they overlap.

Run:
    python 07_parallelism/05_context_parallel/run_context_parallel.py          # 4 ranks
    python 07_parallelism/05_context_parallel/run_context_parallel.py --dp 2   # 2 context x 2 data
    python 07_parallelism/05_context_parallel/run_context_parallel.py --bench
    python 07_parallelism/05_context_parallel/run_context_parallel.py --profile
    torchrun --nproc-per-node=4 07_parallelism/05_context_parallel/run_context_parallel.py
"""

from __future__ import annotations

import copy
import json
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import context_parallel as cp


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


_repo()
from common import import_stage, launch, models, results, timing  # found by _repo()

counters = import_stage("07_parallelism/measure/counters")

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


# --------------------------------------------------------------------------- the formulas


def ring_bytes(world_size: int, block_bytes: int) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends in ring attention; block_bytes: one K (or V)
    shard. Forward: W-1 hops of K and V. Backward: W-1 hops of K and V again, and W hops of
    dK and dV (W-1 travelling with the K/V blocks, one last hop home). A ring of one sends
    nothing."""
    if world_size == 1:
        return 0, 0
    forward = (world_size - 1) * 2 * block_bytes
    backward = (world_size - 1) * 2 * block_bytes + world_size * 2 * block_bytes
    return forward, backward


def visible_scores(rank: int, world_size: int, seq_len: int, layout: str, causal: bool,
                   batch_heads: int) -> int:
    """The (query, key) scores rank's queries see, over all keys: causal, a query at global
    position p sees p + 1 keys; otherwise all seq_len."""
    if not causal:
        return batch_heads * (seq_len // world_size) * seq_len
    positions = cp.shard_positions(seq_len // world_size, rank, world_size, layout)
    return batch_heads * int((positions + 1).sum())


def imbalance_formula(world_size: int, layout: str, causal: bool) -> float:
    """max / mean work over ranks for long sequences: contiguous causal 2 - 1/W, else 1."""
    if causal and layout == "contiguous":
        return 2 - 1 / world_size
    return 1.0


def saved_bytes_formula(batch_heads: int, seq_len: int, head_dim: int, element_size: int) -> int:
    """What one attention layer keeps for backward on a rank holding seq_len queries: q, k, v,
    the output ([batch, heads, seq, head_dim] each) and the log-sum-exp per query."""
    return element_size * batch_heads * (4 * seq_len * head_dim + seq_len)


# --------------------------------------------------------------------------- kernels that count, wait


class CountingAttention(cp.ChunkAttention):
    """The exact kernel, counting the scores its forward computes and those a query sees."""

    def __init__(self):
        self.computed = 0
        self.visible = 0

    def forward(self, q, k, v, allowed, scale):
        batch_heads = q.shape[0] * q.shape[1]
        self.computed += batch_heads * q.shape[2] * k.shape[2]
        if allowed is None:
            self.visible += batch_heads * q.shape[2] * k.shape[2]
        else:
            self.visible += batch_heads * int(allowed.sum())
        return super().forward(q, k, v, allowed, scale)


class EmulatedAttention(cp.ChunkAttention):
    """No arithmetic: each chunk waits in proportion to the scores a causal kernel would compute
    (backward twice as long as forward), then returns zeros. The sends stay real."""

    def __init__(self, seconds_per_score: float):
        self.seconds_per_score = seconds_per_score

    def wait(self, q, k, allowed, factor):
        scores = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
        if allowed is not None:
            scores = q.shape[0] * q.shape[1] * int(allowed.sum())
        time.sleep(factor * scores * self.seconds_per_score)

    def forward(self, q, k, v, allowed, scale):
        self.wait(q, k, allowed, 1)
        return torch.zeros_like(q), torch.zeros(q.shape[:-1], dtype=q.dtype, device=q.device)

    def backward(self, grad_out, q, k, v, lse, delta, allowed, scale):
        self.wait(q, k, allowed, 2)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


class TimedAttention(cp.ChunkAttention):
    """Wraps another kernel and records when each chunk's compute starts and ends."""

    def __init__(self, inner, device):
        self.inner = inner
        self.device = device
        self.spans = []  # (start, end, "forward" | "backward")

    def forward(self, q, k, v, allowed, scale):
        start = time.perf_counter()
        result = self.inner.forward(q, k, v, allowed, scale)
        timing.synchronize(self.device)
        self.spans.append((start, time.perf_counter(), "forward"))
        return result

    def backward(self, grad_out, q, k, v, lse, delta, allowed, scale):
        start = time.perf_counter()
        result = self.inner.backward(grad_out, q, k, v, lse, delta, allowed, scale)
        timing.synchronize(self.device)
        self.spans.append((start, time.perf_counter(), "backward"))
        return result


class TransferClock:
    """While active, times every ``batch_isend_irecv`` from posting to completion: a thread
    polls its requests (``is_completed``), so the main thread's own wait is untouched."""

    def __init__(self):
        self.spans = []  # (start, end)
        self.threads = []
        self.original = None

    def __enter__(self):
        self.original = dist.batch_isend_irecv
        dist.batch_isend_irecv = self.post
        return self

    def post(self, operations):
        start = time.perf_counter()
        requests = self.original(operations)
        thread = threading.Thread(target=self.watch, args=(requests, start), daemon=True)
        thread.start()
        self.threads.append(thread)
        return requests

    def watch(self, requests, start):
        while not all(request.is_completed() for request in requests):
            time.sleep(20e-6)
        self.spans.append((start, time.perf_counter()))

    def __exit__(self, *exc):
        dist.batch_isend_irecv = self.original
        for thread in self.threads:
            thread.join(timeout=30)
        return False


# --------------------------------------------------------------------------- verdicts and groups


def shown_path(path: Path) -> Path:
    """``path`` relative to the current folder when it is inside it (shorter to read)."""
    if path.is_relative_to(Path.cwd()):
        return path.relative_to(Path.cwd())
    return path


def agree(failures: list[str]) -> list[str]:
    """Every rank's problems on every rank, named by rank: one verdict (common/verify.py)."""
    from common import verify
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
    kernel = CountingAttention()
    with counters.CommCounter() as comm:
        comm.current = "forward"
        out = cp.ring_attention(q, k, v, group=group, causal=causal, layout=layout, kernel=kernel)
        comm.current = "backward"
        out.backward(mine(grad_out))
    rtol, atol = TOLERANCE[dtype]
    compared = [("output", out, mine(out_ref)), ("dq", q.grad, mine(q_ref.grad)),
                ("dk", k.grad, mine(k_ref.grad)), ("dv", v.grad, mine(v_ref.grad)),
                ("unsharded output", cp.unshard_sequence(out.detach(), 2, group, layout), out_ref)]
    case = f"W={world_size} {str(dtype)[6:]} {layout} causal={causal}"
    row = {"W": world_size, "dtype": str(dtype)[6:], "layout": layout, "causal": causal}
    failures = []
    for name, got, want in compared:
        difference = (got - want).abs().max().item()
        close = torch.allclose(got, want, rtol=rtol, atol=atol)
        if name != "unsharded output":
            row[f"{name} max diff"] = difference
        if not close:
            failures.append(f"{case}: {name} differs from one process by {difference:.3g} "
                            f"(rtol {rtol:g}, atol {atol:g})")
    block_bytes = k.numel() * k.element_size()
    forward_formula, backward_formula = ring_bytes(world_size, block_bytes)
    counted = comm.by_label
    forward_counted = counted.get("forward", {"sent_bytes": 0})["sent_bytes"]
    backward_counted = counted.get("backward", {"sent_bytes": 0})["sent_bytes"]
    row["fwd bytes"] = int(forward_counted)
    row["fwd formula"] = forward_formula
    row["bwd bytes"] = int(backward_counted)
    row["bwd formula"] = backward_formula
    if forward_counted != forward_formula or backward_counted != backward_formula:
        failures.append(f"{case}: sent {forward_counted:.0f} B forward, {backward_counted:.0f} B "
                        f"backward; the formula says {forward_formula} and {backward_formula}")
    want_visible = visible_scores(rank, world_size, cfg["seq"], layout, causal,
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
                     "formula (long seq)": imbalance_formula(row["W"], row["layout"],
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
             reduce=reduce_over_data_and_context) -> tuple[list[dict], list[str]]:
    """The course LM trained LM_STEPS SGD steps on the dp x cp ranks of ``groups``
    (``make_groups``: ring attention over the context ranks, global positions, ``reduce`` for
    the gradients and the loss) beside the same LM trained on the whole batch in one process.
    (rows, failures)."""
    dp = groups["dp"]
    cp_size = groups["cp"]
    context_rank = groups["context_rank"]
    seq = cfg["seq"]
    torch.manual_seed(0)
    model = models.TransformerLM(LM_PRESET, vocab_size=LM_VOCAB, context_length=seq)
    model = model.to(ctx.device)
    reference = copy.deepcopy(model)  # the one-process LM, from the same weights
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
        case = f"LM dp={dp} cp={cp_size} {layout} step {step}"
        if not close:
            failures.append(f"{case}: weights differ from one process by up to {worst:.3g}")
        if not loss_close:
            failures.append(f"{case}: reported loss {reported:.6f}, one process "
                            f"{ref_loss.item():.6f}")
        if not same:
            failures.append(f"{case}: the replicas' weights are not bitwise equal")
        rows.append({"dp": dp, "cp": cp_size, "layout": layout, "step": step,
                     "loss": reported, "one-process loss": ref_loss.item(),
                     "max |weight - one process|": worst, "replicas bitwise equal": same,
                     "ok": close and loss_close and same})
    return rows, failures


# --------------------------------------------------------------------------- the checks, together


def check_main(ctx, cfg: dict) -> None:
    """Ring attention and the LM on dp x (world / dp) ranks; one verdict; tables on rank 0."""
    cp_size = ctx.world_size // cfg["dp"]
    groups = make_groups(ctx, cfg["dp"], cp_size)
    case_rows, balance, failures = check_ring_attention(ctx, groups["context"], cfg)
    lm_rows = []
    for layout in cfg["layouts"]:
        rows, problems = check_lm(ctx, groups, cfg, layout)
        lm_rows += rows
        failures += problems
    failures = agree(failures)
    if ctx.is_main:
        where = f"{ctx.backend}/{ctx.device.type} ({results.machine_name()})"
        print(f"Ring attention on {cp_size} context ranks (x {cfg['dp']} data): batch "
              f"{cfg['batch']}, heads {cfg['heads']}, seq {cfg['seq']}, head_dim "
              f"{cfg['head_dim']}; {where}")
        table = []
        for row in case_rows:
            shown = dict(row)
            del shown["visible"]
            del shown["computed"]
            table.append(shown)
        results.print_table(table, "\nAgainst scaled_dot_product_attention on the whole sequence "
                                   "(rank 0's shard; every rank checks its own), and the bytes "
                                   "rank 0 sent beside the formula:", floatfmt=".2g")
        results.print_table(balance, "\nWork per rank: (query, key) scores its queries see "
                                     "(forward FLOPs = 4 x head_dim x scores); our kernel "
                                     "computes a diagonal chunk whole (computed):",
                            floatfmt=".3f")
        results.print_table(lm_rows, f"\nThe course LM ({LM_PRESET}, vocabulary {LM_VOCAB}, SGD) "
                                     f"on {cfg['dp']} data x {cp_size} context ranks against "
                                     "one process on the whole batch:", floatfmt=".7g")
    if failures:
        raise AssertionError("context-parallel check failed:\n  " + "\n  ".join(failures))
    ctx.print("all checks passed on every rank: ring attention equals one process (outputs, "
              "dq, dk, dv), bytes and work as the formulas say, the LM trains as one process",
              all_ranks=False)


# --------------------------------------------------------------------------- the benchmark


def attention_inputs(ctx, cfg: dict, seq: int, rank: int, world_size: int, layout: str):
    """This rank's float32 shards of q, k, v (leaves that require grad) and of the output
    gradient at sequence length ``seq``."""
    q, k, v, grad_out = random_attention(cfg, seq, torch.float32, "cpu", seed=seq)

    def mine(t):
        shard = cp.shard_sequence(t.detach(), 2, rank, world_size, layout)
        return shard.to(ctx.device)

    return (mine(q).requires_grad_(True), mine(k).requires_grad_(True),
            mine(v).requires_grad_(True), mine(grad_out))


def full_attention_step(q, k, v, grad_out):
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(grad_out)


def ring_step(q, k, v, grad_out, group, layout, kernel):
    out = cp.ring_attention(q, k, v, group=group, causal=True, layout=layout, kernel=kernel)
    out.backward(grad_out)


def do_nothing():
    return None


def measure_case(ctx, cfg: dict, step, members: list[int]) -> float:
    """The slowest member's median seconds of ``step()``; ranks outside ``members`` only keep
    the barriers company (and report 0 s)."""
    if ctx.rank not in members:
        step = do_nothing
    times = timing.measure(step, ctx.device, warmup=cfg["warmup"], iters=cfg["iters"],
                           barrier=True)
    if ctx.rank not in members:
        times = [0.0] * len(times)
    return timing.gather_times(times).median


def saved_and_peak(ctx, step) -> tuple[int, int]:
    """(bytes saved for backward, counted; peak GPU bytes above the start, 0 on a CPU)."""
    start = 0
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        start = torch.cuda.memory_allocated(ctx.device)
    with counters.SavedActivations() as saved:
        step()
    peak = 0
    if ctx.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(ctx.device) - start
    return saved.bytes, peak


def bench_sequence(ctx, cfg: dict, seq: int, rings: dict, single: dict) -> tuple[list, list]:
    """Every implementation at one sequence length: (rows, failures)."""
    rows = []
    failures = []
    batch_heads = cfg["batch"] * cfg["heads"]
    element_size = 4
    same = {"seq": seq, "batch": cfg["batch"], "heads": cfg["heads"], "head_dim": cfg["head_dim"]}
    # One rank, the whole sequence: torch's fused kernel, and ours (a ring of one).
    q, k, v, grad_out = attention_inputs(ctx, cfg, seq, 0, 1, "contiguous")

    def sdpa_step():
        full_attention_step(q, k, v, grad_out)

    def ours_step():
        ring_step(q, k, v, grad_out, single["group"], "contiguous", cp.ChunkAttention())

    for impl, step in (("full, sdpa", sdpa_step), ("full, our kernel", ours_step)):
        seconds = measure_case(ctx, cfg, step, [0])
        saved = 0
        peak = 0
        if ctx.rank == 0:
            saved, peak = saved_and_peak(ctx, step)
        rank_0 = gather_from_ranks({"saved": saved, "peak": peak})[0]
        rows.append({**same, "impl": impl, "W": 1, "layout": "-", "compute": "real",
                     "step_ms": seconds * 1e3, "sent_bytes": 0, "bytes_formula": 0,
                     "imbalance": 1.0, "imbalance_formula": 1.0,
                     "saved_bytes": rank_0["saved"],
                     "saved_formula": saved_bytes_formula(batch_heads, seq, cfg["head_dim"],
                                                          element_size),
                     "peak_bytes": rank_0["peak"]})
    for world_size, ring in rings.items():
        members = list(range(world_size))
        for layout in cfg["layouts"]:
            inside = ctx.rank in members
            rank = 0  # ranks outside the ring draw rank 0's shard, and only wait
            if inside:
                rank = ctx.rank
            q, k, v, grad_out = attention_inputs(ctx, cfg, seq, rank, world_size, layout)
            counting = CountingAttention()
            sent = 0
            saved = 0
            peak = 0
            if inside:
                with counters.CommCounter() as comm:
                    ring_step(q, k, v, grad_out, ring, layout, counting)
                sent = comm.sent_bytes

                def step_for_memory():
                    ring_step(q, k, v, grad_out, ring, layout, cp.ChunkAttention())
                saved, peak = saved_and_peak(ctx, step_for_memory)
            everyone = gather_from_ranks({"inside": inside, "sent": sent, "saved": saved,
                                          "peak": peak, "visible": counting.visible})
            ring_ranks = []
            for numbers in everyone:
                if numbers["inside"]:
                    ring_ranks.append(numbers)
            visible = [numbers["visible"] for numbers in ring_ranks]
            sent_per_rank = [numbers["sent"] for numbers in ring_ranks]
            local_len = seq // world_size
            block_bytes = batch_heads * local_len * cfg["head_dim"] * element_size
            formula = sum(ring_bytes(world_size, block_bytes))
            if max(sent_per_rank) != formula or min(sent_per_rank) != formula:
                failures.append(f"seq {seq} W={world_size} {layout}: ranks sent "
                                f"{min(sent_per_rank):.0f} to {max(sent_per_rank):.0f} B; the "
                                f"formula says {formula}")
            imbalance = max(visible) / (sum(visible) / len(visible))
            row = {**same, "impl": "ring", "W": world_size, "layout": layout, "compute": "real",
                   "sent_bytes": int(max(sent_per_rank)), "bytes_formula": formula,
                   "imbalance": imbalance,
                   "imbalance_formula": imbalance_formula(world_size, layout, True),
                   "saved_bytes": max(numbers["saved"] for numbers in ring_ranks),
                   "saved_formula": saved_bytes_formula(batch_heads, local_len, cfg["head_dim"],
                                                        element_size),
                   "peak_bytes": max(numbers["peak"] for numbers in ring_ranks)}

            def real_step():
                ring_step(q, k, v, grad_out, ring, layout, cp.ChunkAttention())

            row["step_ms"] = measure_case(ctx, cfg, real_step, members) * 1e3
            rows.append(row)
            if seq == max(cfg["seqs"]):  # emulated compute: the same at every length
                all_scores = batch_heads * seq * (seq + 1) / 2
                emulated = EmulatedAttention(cfg["emulate_ms"] / 1e3 / all_scores)

                def emulated_step():
                    ring_step(q, k, v, grad_out, ring, layout, emulated)

                emulated_row = dict(row)
                emulated_row["compute"] = f"emulated {cfg['emulate_ms']:g} ms"
                emulated_row["step_ms"] = measure_case(ctx, cfg, emulated_step, members) * 1e3
                rows.append(emulated_row)
    return rows, failures


def bench_main(ctx, cfg: dict) -> None:
    """The sweep; rank 0 prints, writes the CSV and the targets beside what was measured."""
    single = {"group": None}
    for rank in range(ctx.world_size):  # a ring of one per rank (every rank creates each)
        group = dist.new_group([rank])
        if rank == ctx.rank:
            single["group"] = group
    rings = {}
    for world_size in cfg["ring_sizes"]:
        group = dist.new_group(list(range(world_size)))
        rings[world_size] = group
    rows = []
    failures = []
    for seq in cfg["seqs"]:
        seq_rows, problems = bench_sequence(ctx, cfg, seq, rings, single)
        rows += seq_rows
        failures += problems
        if ctx.is_main:
            write_bench_rows(ctx, rows)
        ctx.print(f"seq {seq}: done", all_ranks=False)
    failures = agree(failures)
    if ctx.is_main:
        report_bench(ctx, cfg, rows)
    if failures:
        raise AssertionError("context-parallel benchmark check failed:\n  " + "\n  ".join(failures))


def ratio(rows: list[dict], world_size: int, compute: str) -> float | None:
    """zig-zag step time / contiguous step time at the longest sequence."""
    seq = max(row["seq"] for row in rows)
    times = {}
    for row in rows:
        if row["seq"] == seq and row["W"] == world_size and row["compute"].startswith(compute):
            times[row["layout"]] = row["step_ms"]
    if "zigzag" not in times or "contiguous" not in times:
        return None
    return times["zigzag"] / times["contiguous"]


def write_bench_rows(ctx, rows: list[dict]):
    """Rank 0: upsert the rows measured so far into results/context_parallel.csv (after each
    sequence length, so a run stopped at make bench's cap keeps them)."""
    same = {"backend": ctx.backend, "device": ctx.device.type}
    csv_rows = []
    for row in rows:
        csv_rows.append({**same, **row, "machine": results.machine_name(),
                         "run_id": results.run_id()})
    return results.upsert_csv("context_parallel.csv", csv_rows,
                              key=["backend", "device", "seq", "batch", "heads", "head_dim",
                                   "impl", "W", "layout", "compute"])


def report_bench(ctx, cfg: dict, rows: list[dict]) -> None:
    machine = results.machine_name()
    print(f"\nOne causal attention layer, forward + backward, float32, batch {cfg['batch']}, "
          f"heads {cfg['heads']}, head_dim {cfg['head_dim']}; {ctx.backend}/{ctx.device.type}, "
          f"{machine}; median of {cfg['iters']} after {cfg['warmup']} warm-up, slowest rank:")
    shown = []
    for row in rows:
        short = dict(row)
        for size in ("batch", "heads", "head_dim"):  # in the title
            del short[size]
        if ctx.device.type != "cuda":
            del short["peak_bytes"]  # measured on a GPU only
        shown.append(short)
    results.print_table(shown, floatfmt=".3g")
    path = write_bench_rows(ctx, rows)
    print(f"\nwrote {shown_path(path)}")
    print(f"\nTargets, measured in this run ({machine}):")
    longest = max(cfg["seqs"])
    for row in rows:
        if row["impl"] != "ring" or row["compute"] != "real" or row["seq"] != longest:
            continue
        if row["layout"] == "zigzag":
            target = "1.00"
        else:
            target = f"within 2% of 2 - 1/W = {row['imbalance_formula']:.3f}"
        print(f"  FLOP imbalance (max/mean), W={row['W']} {row['layout']}: "
              f"{row['imbalance']:.3f} (target {target})")
    exact = all(row["sent_bytes"] == row["bytes_formula"] for row in rows)
    print(f"  ring bytes sent per rank equal the formula in every row: {exact}")
    for world_size in cfg["ring_sizes"]:
        emulated = ratio(rows, world_size, "emulated")
        real = ratio(rows, world_size, "real")
        ideal = world_size / (2 * world_size - 1)
        if emulated is not None:
            print(f"  zig-zag / contiguous step time, W={world_size}, seq {longest}: emulated "
                  f"compute {emulated:.2f}, real compute {real:.2f} (target <= 0.75 at W=4; "
                  f"ideal W/(2W-1) = {ideal:.2f})")


# --------------------------------------------------------------------------- the timeline


def profile_one(ctx, cfg: dict, ring, layout: str, kernel) -> dict:
    """One timed step (after two untimed ones) of ring attention: this rank's compute spans
    and transfer spans, in ms since a common start (a barrier just before)."""
    world_size = ctx.world_size
    seq = max(cfg["seqs"])
    q, k, v, grad_out = attention_inputs(ctx, cfg, seq, ctx.rank, world_size, layout)
    for _ in range(2):
        ring_step(q, k, v, grad_out, ring, layout, kernel)
    timed = TimedAttention(kernel, ctx.device)
    dist.barrier()
    origin = time.perf_counter()
    with TransferClock() as clock:
        ring_step(q, k, v, grad_out, ring, layout, timed)
        timing.synchronize(ctx.device)
        end = time.perf_counter()
    compute = []
    for start, stop, phase in timed.spans:
        compute.append(((start - origin) * 1e3, (stop - origin) * 1e3, phase))
    transfers = []
    for start, stop in sorted(clock.spans):
        transfers.append(((start - origin) * 1e3, (stop - origin) * 1e3))
    return {"compute": compute, "transfers": transfers, "step_ms": (end - origin) * 1e3}


def hidden_ms(transfers, compute) -> float:
    """How much of the transfers' time ran while this rank was computing."""
    total = 0.0
    for t_start, t_end in transfers:
        for c_start, c_end, _ in compute:
            total += max(0.0, min(t_end, c_end) - max(t_start, c_start))
    return total


def text_timeline(title: str, timelines: list[dict], width: int = 80) -> str:
    """Two rows per rank on one time axis: compute (f forward, b backward) and K/V transfers."""
    span = max(tl["step_ms"] for tl in timelines)
    scale = width / span
    lines = [f"{title}: step {span:.1f} ms (slowest rank)"]
    for rank, tl in enumerate(timelines):
        rows = {"compute": [" "] * width, "K/V    ": [" "] * width}
        for start, stop, phase in tl["compute"]:
            first = int(start * scale)
            for i in range(first, min(width, max(first + 1, int(stop * scale)))):
                rows["compute"][i] = phase[0]
        for index, (start, stop) in enumerate(tl["transfers"]):
            first = int(start * scale)
            for i in range(first, min(width, max(first + 1, int(stop * scale)))):
                rows["K/V    "][i] = "#="[index % 2]  # one batch #, the next =, ...
        transfer_ms = sum(stop - start for start, stop in tl["transfers"])
        hidden = hidden_ms(tl["transfers"], tl["compute"])
        lines.append(f"  rank {rank} compute |{''.join(rows['compute'])}|")
        lines.append(f"         K/V     |{''.join(rows['K/V    '])}| {hidden:.1f} of "
                     f"{transfer_ms:.1f} ms in flight under compute")
    lines.append("  f forward chunk, b backward chunk; # and = alternate: one ring step's batch "
                 "of K/V (and dK/dV) sends and receives, in flight from posting to completion")
    return "\n".join(lines)


def chrome_trace(timelines: list[dict], path: Path) -> None:
    """The same spans as a trace Perfetto opens (https://ui.perfetto.dev): one process a rank."""
    events = []
    for rank, tl in enumerate(timelines):
        for start, stop, phase in tl["compute"]:
            events.append({"name": f"{phase} chunk", "ph": "X", "pid": rank, "tid": 0,
                           "ts": start * 1e3, "dur": (stop - start) * 1e3})
        for start, stop in tl["transfers"]:
            events.append({"name": "K/V transfer", "ph": "X", "pid": rank, "tid": 1,
                           "ts": start * 1e3, "dur": (stop - start) * 1e3})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events}))


def draw(panels: list[tuple[str, list[dict]]], path: Path, title: str) -> Path | None:
    plt = results.pyplot()
    if plt is None:
        print("(matplotlib not installed: text timeline only)")
        return None
    figure, axes = plt.subplots(len(panels), 1, figsize=(10, 1.2 + 1.1 * len(panels[0][1]) *
                                                           len(panels) / 2), squeeze=False)
    colours = {"forward": "#9ecae1", "backward": "#3182bd"}
    span = max(tl["step_ms"] for _, timelines in panels for tl in timelines)
    for ax, (label, timelines) in zip(axes[:, 0], panels):
        names = []
        for rank, tl in enumerate(timelines):
            row = 2 * rank
            for start, stop, phase in tl["compute"]:
                ax.broken_barh([(start, stop - start)], (row + 0.1, 0.8), color=colours[phase])
            for index, (start, stop) in enumerate(tl["transfers"]):
                shade = ("#e6550d", "#fdae6b")[index % 2]  # one ring step, the next, ...
                ax.broken_barh([(start, stop - start)], (row + 1.2, 0.6), color=shade)
            names += [f"rank {rank} compute", f"rank {rank} K/V"]
        ax.set_yticks([i + 0.5 for i in range(len(names))], names, fontsize=7)
        ax.set_ylim(len(names), 0)
        ax.set_xlim(0, span * 1.01)
        ax.set_title(label, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms since the step started (forward: light, backward: dark; "
                           "orange, dark and light in turn: each ring step's transfers in flight)")
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)
    print(f"timeline picture: {shown_path(path)}")
    return path


def profile_main(ctx, cfg: dict) -> None:
    """Both layouts, real and emulated compute, at the longest --seqs on all ranks."""
    ring = dist.new_group(list(range(ctx.world_size)))
    seq = max(cfg["seqs"])
    batch_heads = cfg["batch"] * cfg["heads"]
    emulated = EmulatedAttention(cfg["emulate_ms"] / 1e3 / (batch_heads * seq * (seq + 1) / 2))
    panels = []
    for compute, kernel in (("real", cp.ChunkAttention()),
                            (f"emulated {cfg['emulate_ms']:g} ms", emulated)):
        for layout in cfg["layouts"]:
            mine = profile_one(ctx, cfg, ring, layout, kernel)
            everyone = [None] * ctx.world_size
            dist.all_gather_object(everyone, mine)
            panels.append((f"{layout}, {compute} compute", everyone))
    if not ctx.is_main:
        return
    out_dir = Path(cfg["trace_dir"]) / "context_parallel"
    for label, timelines in panels:
        print(text_timeline(label, timelines) + "\n")
        slug = label.replace(",", "").replace(" ", "_")
        chrome_trace(timelines, out_dir / f"{slug}.json")
    print(f"traces (open in https://ui.perfetto.dev): {shown_path(out_dir)}/*.json")
    draw(panels, out_dir / "timeline.png",
         f"ring attention, one causal step, seq {seq}, {ctx.world_size} ranks, "
         f"{ctx.backend}/{ctx.device.type}, {results.machine_name()}")


# --------------------------------------------------------------------------- flags


def per_rank_bytes(args, ring_sizes: list[int]) -> int:
    """A rank's rough peak: the check's float64 full tensors and chunk scores; the benchmark's
    float32 ones, with rank 0's whole-sequence attention by our kernel (seq x seq scores)."""
    batch_heads = args.batch * args.heads
    if args.bench or args.profile:
        seq = max(args.seqs)
        return 4 * batch_heads * (6 * seq * seq + 24 * seq * args.head_dim)
    smallest_ring = min(ring_sizes)
    chunk = args.seq // smallest_ring
    return 8 * batch_heads * (6 * chunk * chunk + 24 * args.seq * args.head_dim)


def check_fits(config, need: int, what: str) -> None:
    """One line and exit 2, before any worker starts, when ``need`` bytes per rank (described by
    ``what``) cannot fit: in the GPUs' memory (ranks sharing a GPU add up), else the host's."""
    ranks_here = launch.ranks_on_this_node(config.world_size)
    if config.device != "cuda":
        launch.check_ranks_fit(ranks_here, need, what)
        return
    ranks_per_gpu = -(-ranks_here // torch.cuda.device_count())  # rounded up
    total = torch.cuda.get_device_properties(0).total_memory
    if ranks_per_gpu * need > 0.9 * total:
        launch.usage_error(f"{what} needs about {ranks_per_gpu * need / 2**30:.1f} GiB per GPU "
                           f"but a GPU has {total / 2**30:.1f} GiB; use smaller sizes")


def main(argv=None) -> None:
    parser = launch.make_parser(__doc__, world_size=4)
    parser.add_argument("--batch", type=launch.positive_int, default=4,
                        help="sequences per batch (the LM's global batch: divides by --dp)")
    parser.add_argument("--heads", type=launch.positive_int, default=3, help="attention heads")
    parser.add_argument("--head-dim", type=launch.positive_int, default=24,
                        help="width of one head")
    parser.add_argument("--seq", type=launch.positive_int, default=64,
                        help="sequence length of the checks (ring attention and the LM)")
    parser.add_argument("--layouts", type=launch.choice_list(list(cp.LAYOUTS)),
                        default=list(cp.LAYOUTS), help="subset of " + ",".join(cp.LAYOUTS))
    parser.add_argument("--dp", type=launch.positive_int, default=1,
                        help="data-parallel degree of the LM check; context ranks = world / dp")
    parser.add_argument("--bench", action="store_true",
                        help="measure step time, bytes, FLOP balance and memory instead")
    parser.add_argument("--profile", action="store_true",
                        help="draw one step's compute and K/V transfers per rank instead")
    parser.add_argument("--seqs", type=launch.int_list, default=None,
                        help="sequence lengths of --bench (default 256,512,1024 on a CPU, "
                             "1024,2048,4096 on a GPU); --profile uses the longest")
    parser.add_argument("--ring-sizes", type=launch.int_list, default=None,
                        help="ring sizes W of --bench (default 2 and 4, up to the world size)")
    parser.add_argument("--emulate-ms", type=launch.positive_float, default=400.0,
                        help="emulated compute: the forward of causal attention over the whole "
                             "sequence on one rank takes this long; each chunk waits its share "
                             "of it, backward twice as long")
    parser.add_argument("--warmup", type=launch.non_negative_int, default=2,
                        help="untimed steps before the timed ones")
    parser.add_argument("--iters", type=launch.positive_int, default=5, help="timed steps")
    parser.add_argument("--trace-dir", default=str(results.REPO_ROOT / "traces"),
                        help="where --profile writes its traces and picture")
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    world_size = config.world_size
    if args.bench and args.profile:
        parser.error("--bench and --profile: choose one")
    if args.emulate_ms > 60_000:
        parser.error(f"--emulate-ms {args.emulate_ms:g}: at most 60000 (a minute of emulated "
                     "forward per step)")
    if args.profile:
        try:
            (Path(args.trace_dir) / "context_parallel").mkdir(parents=True, exist_ok=True)
        except OSError as error:
            parser.error(f"--trace-dir {args.trace_dir}: cannot write there ({error.strerror})")
    if config.backend == "gloo" and config.device == "cuda":
        parser.error("ring attention sends with batch_isend_irecv, and Gloo sends CPU tensors "
                     "only: use --device cpu (a rank per CPU core), or NCCL with a GPU per rank")
    if world_size % args.dp != 0:
        parser.error(f"--dp {args.dp} does not divide the world size {world_size}")
    if args.batch % args.dp != 0:
        parser.error(f"--batch {args.batch} does not divide into --dp {args.dp} equal parts")
    if args.seqs is None:
        args.seqs = [256, 512, 1024]
        if config.device == "cuda":
            args.seqs = [1024, 2048, 4096]
    if args.ring_sizes is None:
        args.ring_sizes = []
        for ring_size in (2, 4):
            if ring_size <= world_size:
                args.ring_sizes.append(ring_size)
    if args.bench:
        wrong = []
        for ring_size in args.ring_sizes:
            if ring_size < 2 or ring_size > world_size:
                wrong.append(ring_size)
        if wrong or not args.ring_sizes:
            parser.error(f"--ring-sizes {wrong or args.ring_sizes}: each must be between 2 and "
                         f"the world size {world_size}")
    cp_size = world_size // args.dp
    if args.bench or args.profile:
        sizes = {"--seqs": args.seqs}
        ring_sizes = args.ring_sizes
        if args.profile:
            ring_sizes = [world_size]
    else:
        sizes = {"--seq": [args.seq]}
        ring_sizes = [cp_size]
    for flag, lengths in sizes.items():
        for seq in lengths:
            for ring_size in ring_sizes:
                for layout in args.layouts:
                    chunks = ring_size * cp.chunks_per_rank(layout)
                    if seq % chunks != 0:
                        parser.error(f"{flag} {seq} does not divide into {chunks} equal chunks "
                                     f"({layout} layout over {ring_size} ranks)")
    need = per_rank_bytes(args, ring_sizes)
    longest = args.seq
    if args.bench or args.profile:
        longest = max(args.seqs)
    check_fits(config, need, f"{need / 2**30:.2f} GiB each for sequence length {longest}")
    results.check_writable()
    cfg = vars(args)
    if args.bench:
        launch.launch(bench_main, config, cfg)
    elif args.profile:
        launch.launch(profile_main, config, cfg)
    else:
        launch.launch(check_main, config, cfg)


if __name__ == "__main__":
    main()
