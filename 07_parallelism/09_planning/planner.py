"""Stage 07, lesson 9: predict a training step before running it.

The lessons' formulas for what a rank holds and sends, put together with a machine, answer
the questions asked before a large run: will it fit, and how long will a step take. Each
step-time term is one lesson's idea:

    step = compute, kernel class by kernel class      matmuls, attention, memory-bound work,
                                                      the launch floor, recomputation
         + pipeline bubble                            lesson 4: (p-1)/(v m+p-1)
         + waiting for the slowest rank               a collective ends when its last rank comes
         + tensor-parallel collectives                lesson 3: on the critical path
         + ring-attention hops not hidden by compute  lesson 5
         + pipeline hops while the pipe fills         lesson 4
         + data-parallel communication left after     stage 06 (buckets), lessons 1-2 (ZeRO,
           backward, and its buffer copies            FSDP prefetch)
         + the loss all-reduce, the optimizer step    lesson 7; AdamW: 28 bytes a parameter

and each rank's memory. Standard library only: copy this file anywhere; ``run_planning.py``
beside it ranks grids (``make plan``). Units: bytes, seconds, FLOP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FLOAT32 = 4
INT64 = 8                  # token ids and positions
ADAMW_BYTES_TOUCHED = 28   # reads param, grad, two moments; writes param, two moments: 7 x 4
RECOMPUTE = ("none", "selective", "full")     # and "op", torchtitan's: for its Llama (gated), tp 1
RECOMPUTE_TOKENS = {"sel": "selective", "ckpt": "full", "op": "op"}


# --------------------------------------------------------------------------- what is trained


@dataclass(frozen=True)
class LM:
    """A decoder-only LM's shape (common/models.py's, or Llama's: no position embedding, gated
    MLP, grouped-query attention), and the batch one optimizer step trains on."""
    layers: int
    d_model: int
    d_ff: int
    heads: int
    vocab: int
    seq: int                       # tokens per sequence
    batch: int                     # sequences per optimizer step, all data-parallel ranks together
    kv_heads: int = 0              # grouped-query attention; 0: as many as ``heads``
    gated_mlp: bool = False        # SwiGLU: three d_model x d_ff matrices instead of two
    position_embedding: bool = True   # False: rotary positions
    compute_bytes: int = FLOAT32   # activations and what tp/cp/pp send: 4 float32, 2 bfloat16
    eager: bool = False            # Llama's norms, rotary, SwiGLU op by op (torchtitan's code)
    fused_norm: bool = False       # eager but for RMSNorm (torchtitan's fused_rmsnorm)


def block_parameter_shapes(lm: LM) -> list[tuple[int, ...]]:
    """One block's parameter tensors, in registration order (common/models.Block)."""
    h = lm.d_model
    f = lm.d_ff
    kv = h * (lm.kv_heads or lm.heads) // lm.heads     # k's and v's width (grouped-query)
    if lm.gated_mlp:               # Llama: RMSNorm weights, q, k, v, o, gate, up, down
        return [(h,), (h, h), (kv, h), (kv, h), (h, h), (h,), (f, h), (f, h), (h, f)]
    # LayerNorm weight and bias, qkv, out, LayerNorm, fc1 weight and bias, fc2 weight and bias
    return [(h,), (h,), (h + 2 * kv, h), (h, h), (h,), (h,), (f, h), (f,), (h, f), (h,)]


def parameter_shapes(lm: LM) -> list[tuple[int, ...]]:
    """Every parameter tensor of the LM, in registration order."""
    shapes = [(lm.vocab, lm.d_model)]                      # token embedding
    if lm.position_embedding:
        shapes.append((lm.seq, lm.d_model))
    for _ in range(lm.layers):
        shapes.extend(block_parameter_shapes(lm))
    if lm.gated_mlp:
        shapes.append((lm.d_model,))                       # final RMSNorm
    else:
        shapes.extend([(lm.d_model,), (lm.d_model,)])      # final LayerNorm
    shapes.append((lm.vocab, lm.d_model))                  # the head (untied)
    return shapes


def parameter_count(lm: LM) -> int:
    return sum(math.prod(shape) for shape in parameter_shapes(lm))


def attention_flops_per_token(lm: LM) -> float:
    """One layer's q k^T and weighted v for a token, 4 s h, halved: the causal half is skipped."""
    return 4 * lm.seq * lm.d_model / 2


def forward_flops_per_token(lm: LM) -> float:
    """2 x every weight matrix (embeddings are look-ups) plus attention's two products."""
    matrices = sum(math.prod(shape) for shape in block_parameter_shapes(lm) if len(shape) == 2)
    per_token = 2 * lm.layers * matrices + 2 * lm.vocab * lm.d_model
    return per_token + lm.layers * attention_flops_per_token(lm)


def training_flops_per_token(lm: LM, recompute: str = "none") -> float:
    """Forward, backward at twice it, and what is recomputed: ``full`` every block's forward
    (not the head's), ``selective`` (Korthikanti et al. 2022) the attention core's, ``op``
    (torchtitan's per-op policy, which keeps every other matmul's output) the other matmuls."""
    flops = 3 * forward_flops_per_token(lm)
    if recompute == "full":
        flops += forward_flops_per_token(lm) - 2 * lm.vocab * lm.d_model
    if recompute == "selective":
        flops += lm.layers * attention_flops_per_token(lm)
    if recompute == "op":                  # a block's second, fourth, ... matmul
        matrices = [math.prod(shape) for shape in block_parameter_shapes(lm) if len(shape) == 2]
        flops += 2 * lm.layers * sum(matrices[1::2])
    return flops


# --------------------------------------------------------------------------- how it is split


@dataclass(frozen=True)
class Grid:
    """How the ranks split the work: lesson 7's (pp, dp, cp, tp), tp innermost, and how the data-
    parallel axis shares the model's state (lessons 1-2)."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp_kind: str = "ddp"           # ddp, zero1, zero2, fsdp
    schedule: str = "1f1b"         # gpipe, 1f1b, interleaved, zbh1, zbv, dualpipev
    micro_batches: int = 1
    chunks: int = 1                # interleaved 1F1B: model chunks per pipeline rank
    recompute: str = "none"        # none, selective, full, op (training_flops_per_token)
    sp: bool = True                # sequence parallelism: norms and residuals on S/t tokens
    bucket_bytes: float = 25 * 2**20   # data-parallel gradient buckets (torch DDP's default)
    loss_all_reduce: bool = False  # the step averages its loss over every rank (lesson 7 does)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


def ring_share(ranks: int) -> float:
    """(n-1)/n: what one rank sends of a payload in a ring all-gather or reduce-scatter."""
    return (ranks - 1) / ranks


def bubble_share(grid: Grid) -> float:
    """The share of a step a pipeline rank idles (lesson 4; ZB-H1, ZB-V, DualPipeV: F = B = W,
    the V schedules' p-1 units of a chunk, half a stage, for m >= 2p)."""
    p, v, m = grid.pp, grid.chunks, grid.micro_batches
    if grid.schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if grid.schedule == "zbh1":
        return 1 - 3 * m / max(3 * m + p - 1, 2 * (m + p - 1) + 1)
    if grid.schedule in ("zbv", "dualpipev"):
        return (p - 1) / (6 * m + p - 1)
    return (p - 1) / (m + p - 1)


def micro_batches_in_flight(grid: Grid) -> float:
    """Micro-batches whose activations the first pipeline rank holds at once: GPipe m, 1F1B min(m, p);
    interleaved, lesson 4's 2(p-1) + (v-1)p + 1 chunks of 1/v: p (1 + (p-1)/(pv)), Korthikanti's."""
    p, v, m = grid.pp, grid.chunks, grid.micro_batches
    if grid.schedule == "interleaved":
        return min(2 * (p - 1) + (v - 1) * p + 1, m * v) / v
    return m if grid.schedule == "gpipe" else min(m, p)


# --------------------------------------------------------------------------- memory per rank


def split_over_tp(lm: LM) -> list[bool]:
    """Which of a block's tensors lesson 3 splits over tp: every matrix and fc1's bias."""
    return [len(shape) == 2 or (not lm.gated_mlp and index == 7)      # index 7: fc1's bias
            for index, shape in enumerate(block_parameter_shapes(lm))]


def fsdp_shard_values(lm: LM, dp: int) -> tuple[int, int]:
    """(W, R): lesson 2's padded shards of the tensors of 2+ dimensions, and the 1-D ones whole."""
    sharded = 0
    replicated = 0
    for shape in parameter_shapes(lm):
        if len(shape) >= 2:
            rows_per_rank = -(-shape[0] // dp)
            sharded += rows_per_rank * dp * math.prod(shape[1:])
        else:
            replicated += math.prod(shape)
    return sharded, replicated


def state_per_rank(lm: LM, grid: Grid) -> dict[str, float]:
    """Parameters, gradients and AdamW's moments (float32) on the most loaded rank: tp splits
    the matrices (lesson 3), pp gives L/p blocks and an end (lesson 4), dp: DDP 16P, ZeRO-1
    8P + 8P/d, ZeRO-2 4P + 12P/d, FSDP 16P/d, its padded shards exactly (lessons 1-2)."""
    blocks = lm.layers // grid.pp
    block_values = sum(math.prod(shape) // grid.tp if split else math.prod(shape)
                       for shape, split in zip(block_parameter_shapes(lm), split_over_tp(lm)))
    embeddings = lm.vocab * lm.d_model
    if lm.position_embedding:
        embeddings += lm.seq * lm.d_model
    head = lm.vocab * lm.d_model + 2 * lm.d_model
    ends = embeddings + head if grid.pp == 1 else max(embeddings, head)   # pp: one end a rank
    values = blocks * block_values + ends
    d = grid.dp * grid.cp           # the ranks holding the same parameters
    params = FLOAT32 * values
    grads = FLOAT32 * values
    moments = 2 * FLOAT32 * values
    if grid.dp_kind in ("zero1", "zero2", "fsdp"):
        moments = moments / d
    if grid.dp_kind in ("zero2", "fsdp"):
        grads = grads / d
    if grid.dp_kind == "fsdp":
        params = params / d
    if grid.dp_kind == "fsdp" and grid.tp == 1 and grid.pp == 1:
        sharded, replicated = fsdp_shard_values(lm, d)
        held = FLOAT32 * (sharded / d + replicated)
        return {"param": held, "grad": held, "optim": 2 * held}
    return {"param": params, "grad": grads, "optim": moments}


def block_activation_bytes(lm: LM, grid: Grid) -> int:
    """One block's saved activations, one micro-batch: lesson 7's table (S/t tokens between tp
    regions with sp); Llama's k, v at their grouped width and its MLP's three d_ff tensors."""
    h = lm.d_model
    kv = h * (lm.kv_heads or lm.heads) // lm.heads
    t = grid.tp
    rows, tokens = rows_and_tokens(lm, grid)
    between = t if grid.sp else 1
    per_block = 2 * rows * tokens * h // between                      # two norms' inputs
    per_block += 2 * rows * tokens * h                                # gathered inputs of qkv, fc1
    per_block += (2 * h + 2 * kv) * rows * tokens // t                # q, k, v, attention's out
    per_block += (3 if lm.gated_mlp else 2) * rows * tokens * lm.d_ff // t   # fc1's output, GELU's
    if grid.cp > 1:
        per_block += rows * tokens * h // t    # ring attention's [b, heads, S, hd], transposed
    stats = 4 * rows * tokens // between + rows * (lm.heads // t) * tokens   # norms' mean, 1/std; lse
    return lm.compute_bytes * per_block + FLOAT32 * stats             # the statistics in float32


def edge_activation_bytes(lm: LM, grid: Grid, first: bool, last: bool) -> int:
    """What the model's ends save, one micro-batch, S/t tokens: token ids and positions first;
    the final norm's input, the head's input, the log-softmax and the targets last."""
    rows = lm.batch // (grid.dp * grid.micro_batches)
    between = lm.seq // grid.cp // grid.tp
    saved = 0
    if first:
        saved += INT64 * (rows * between + between)
    if last:
        saved += lm.compute_bytes * rows * between * (2 * lm.d_model + 2)   # the norm's, the head's input
        saved += (FLOAT32 * lm.vocab + INT64) * rows * between + FLOAT32   # log-softmax (float32), targets
    return saved


def activations_per_rank(lm: LM, grid: Grid) -> float:
    """Bytes saved for backward on the first pipeline rank at its peak, times the micro-batches
    in flight. Full recomputation keeps each block's input, torchtitan's ``op`` more (each with
    one block's set alive in backward); selective drops only the [s, s] scores, which flash
    attention never keeps: as none here."""
    rows, tokens = rows_and_tokens(lm, grid)
    per_block_bytes = block_activation_bytes(lm, grid)
    edges = edge_activation_bytes(lm, grid, first=True, last=grid.pp == 1)
    blocks = lm.layers // grid.pp
    in_flight = micro_batches_in_flight(grid)
    kept = lm.compute_bytes * rows * tokens * lm.d_model // (grid.tp if grid.sp else 1)  # the input
    if grid.recompute == "op":      # and every other matmul's output, attention's and its lse (tp 1)
        widths = [shape[0] for shape in block_parameter_shapes(lm) if len(shape) == 2][0::2]
        kept += rows * tokens * (lm.compute_bytes * (sum(widths) + lm.d_model) + FLOAT32 * lm.heads)
    if grid.recompute in ("full", "op"):
        return in_flight * (blocks * kept + edges) + per_block_bytes
    return in_flight * (blocks * per_block_bytes + edges)


def rank_tensors(lm: LM, grid: Grid, pp_rank: int = 0) -> list[tuple[int, bool]]:
    """(values, split over tp) of each parameter tensor a pipeline rank holds, as lesson 7 lays
    them out: virtual stages chunk x p + pp_rank, the embeddings first, the head last."""
    p = grid.pp
    v = grid.chunks
    h = lm.d_model
    blocks_per_chunk = lm.layers // (p * v)
    block = list(zip(block_parameter_shapes(lm), split_over_tp(lm)))
    tensors = []
    for chunk in range(v):
        stage = chunk * p + pp_rank
        if stage == 0:
            tensors.append((lm.vocab * h, False))                  # token embedding
            if lm.position_embedding:
                tensors.append((lm.seq * h, False))
        for _ in range(blocks_per_chunk):
            for shape, split in block:
                tensors.append((math.prod(shape) // grid.tp if split else math.prod(shape), split))
        if stage == p * v - 1:
            tensors.append((h, False))                             # the final norm
            if not lm.gated_mlp:
                tensors.append((h, False))
            tensors.append((lm.vocab * h, False))                  # the head
    return tensors


def memory_per_rank(lm: LM, grid: Grid) -> dict[str, float]:
    """A bound, each term at its largest in the step, summed (not a block's gradients before FSDP's
    reduce-scatter, nor the allocator's cache); the loss: two float32 gradients of the logits beside
    their float32 log-softmax (autocast's and torchtitan's; with pp the last stage's, added)."""
    memory = {**state_per_rank(lm, grid), "activation": activations_per_rank(lm, grid)}
    if grid.dp_kind == "fsdp":     # lesson 2's: the root, the last block and one prefetched; pp: all
        memory["gathered"] = lm.compute_bytes * sum(fsdp_unit_values(lm, grid)[:3 if grid.pp == 1 else None])
    logits = math.prod(rows_and_tokens(lm, grid)) // grid.tp * lm.vocab       # [b, S/t, V]
    memory["loss"] = (2 if grid.pp == 1 else 3) * FLOAT32 * logits    # and the log-softmax with pp
    memory["total"] = sum(memory.values())
    return memory


# --------------------------------------------------------------------------- the machine


@dataclass(frozen=True)
class Link:
    """Stage 02's alpha-beta model: ``latency`` a call, the bus bandwidth (nccl-tests'), and
    ``step_latency`` a ring step (2(n-1) for an all-reduce): most of a call's cost where ranks
    outnumber cores and every step waits for its receiver to get one back."""
    latency: float                 # seconds per call
    busbw: float                   # bytes per second
    step_latency: float = 0.0      # seconds per message step of a ring


@dataclass(frozen=True)
class GPU:
    """A GPU's datasheet, and the shares of its peak that public measurements reached."""
    name: str
    peak: float                    # dense bfloat16 tensor-core FLOP/s (datasheet)
    memory: float                  # bytes (datasheet)
    memory_bandwidth: float        # bytes per second (datasheet)
    nvlink: float                  # bytes per second each way (datasheet)
    network: float                 # bytes per second per GPU between nodes (its NIC)
    matmul_share: float            # the best bf16 matmul measured, over the peak
    attention_share: float         # flash attention's forward and backward measured, over the peak
    launch_s: float = 5e-6         # the shortest a kernel takes, its launch included


@dataclass(frozen=True)
class Machine:
    name: str
    flops: float                   # FLOP/s: the peak for MFU; a measured machine's only rate
    memory: float                  # bytes per rank
    memory_bandwidth: float        # bytes per second per rank (the optimizer step is bound by it)
    ranks_per_node: int
    inside: Link                   # between ranks of one node
    across: Link                   # between nodes
    overlap: bool = True           # can communication run while the rank computes?
    # Measured on a box like this course's CPU one (check_prediction.py); 0 or None elsewhere:
    cores: int = 0                 # ranks take turns on this many cores
    copy_bandwidth: float = 0.0    # copying a buffer, bytes read and written a second
    straggler: float = 0.0         # the slowest of W ranks computes this share longer
    reduce_scatter_as_all_reduce: bool = False   # Gloo's
    point_to_point: Link | None = None   # sends after compute (ring attention's hops)
    gather: Link | None = None     # FSDP's all-gather and reduce-scatter of flat tensors
    scatter: Link | None = None
    gather_overlap: float | None = None   # their share that runs beside compute (None: ``overlap``)
    groups: tuple = ()             # (ranks, Link): a group of that many ranks among all of them
    source: str = ""
    ranks: int = 0                 # a cluster preset's GPUs in all (0: not a preset)
    gpu: GPU | None = None         # kernel classes at their rates (None: every FLOP at ``flops``)


def all_reduce_time(link: Link, ranks: int, nbytes: float) -> float:
    if ranks == 1:
        return 0.0
    return link.latency + 2 * (ranks - 1) * link.step_latency + 2 * ring_share(ranks) * nbytes / link.busbw


def all_gather_time(link: Link, ranks: int, nbytes: float) -> float:
    """An all-gather of a full tensor of ``nbytes`` (each rank contributes 1/n of it)."""
    if ranks == 1:
        return 0.0
    return link.latency + (ranks - 1) * link.step_latency + ring_share(ranks) * nbytes / link.busbw


def reduce_scatter_time(machine: Machine, link: Link, ranks: int, nbytes: float,
                        own: Link | None = None) -> float:
    """A ring's, Gloo's (an all-reduce), or at a link measured for it (``own``: FSDP's)."""
    if own is not None:
        return all_gather_time(own, ranks, nbytes)
    if machine.reduce_scatter_as_all_reduce:
        return all_reduce_time(link, ranks, nbytes)
    return all_gather_time(link, ranks, nbytes)


def send_time(link: Link, nbytes: float) -> float:
    """A send, a broadcast or a reduce of ``nbytes``: the whole payload through a link."""
    return link.latency + link.step_latency + nbytes / link.busbw


def broadcast_time(link: Link, ranks: int, nbytes: float) -> float:
    """One owner's ``nbytes`` to every rank, pipelined down a chain: n-1 steps."""
    if ranks == 1:
        return 0.0
    return link.latency + (ranks - 1) * link.step_latency + nbytes / link.busbw


def link_of(machine: Machine, grid: Grid, axis: str) -> Link:
    """The link an axis's group ("dp": dp x cp) crosses: ranks are laid out (pp, dp, cp, tp), tp
    innermost, and a group whose span is larger than a node crosses nodes; a measured box's
    link for a group of its size where it has one (ranks sharing cores: the size counts)."""
    inner = {"tp": 1, "cp": grid.tp, "dp": grid.tp, "pp": grid.tp * grid.cp * grid.dp}
    size = {"tp": grid.tp, "cp": grid.cp, "dp": grid.dp * grid.cp, "pp": grid.pp}
    link = machine.across if inner[axis] * size[axis] > machine.ranks_per_node else machine.inside
    return dict(machine.groups).get(size[axis], link)


# --------------------------------------------------------------------------- overlap


def overlapped_tail(compute: float, pieces: list[float], overlap: float) -> float:
    """Communication left after ``compute`` when piece i is ready at (i+1)/n of it, one at a time
    (stage 06's simulation), hiding the share ``overlap`` of what overlap can hide (1 all, 0 none)."""
    finish = 0.0
    for index, seconds in enumerate(pieces):
        ready = compute * (index + 1) / len(pieces)
        finish = max(finish, ready) + seconds
    hidden = sum(pieces) - max(0.0, finish - compute)
    return sum(pieces) - overlap * hidden


def prefetched_wait(unit_seconds: list[float], gathers: list[float], overlap: float) -> float:
    """How long compute waits for FSDP's gathers, one unit prefetched (lesson 2), hiding the share
    ``overlap`` of what the prefetch can hide (1 all, 0 none: every gather waited for)."""
    gather_done = compute_done = previous_start = 0.0
    for seconds, gather in zip(unit_seconds, gathers):
        gather_done = max(gather_done, previous_start) + gather
        start = max(compute_done, gather_done)
        previous_start = start
        compute_done = start + seconds
    return sum(gathers) - overlap * (sum(unit_seconds) + sum(gathers) - compute_done)


# --------------------------------------------------------------------------- step time, a term each


def rows_and_tokens(lm: LM, grid: Grid) -> tuple[int, int]:
    """(b, S): one micro-batch's rows on a rank and the tokens of its context shard."""
    return lm.batch // (grid.dp * grid.micro_batches), lm.seq // grid.cp


def turns(grid: Grid, machine: Machine) -> float:
    """W / cores where W ranks take turns on fewer cores (this course's CPU box), else 1."""
    return max(1.0, grid.world_size / machine.cores) if machine.cores else 1.0


def block_kernels(lm: LM, grid: Grid) -> list[tuple[str, float, float]]:
    """(class, FLOP, bytes) of each kernel of one block's forward, one micro-batch on one rank:
    the matmuls, attention, and the memory-bound work (two norms, two residual adds, the MLP's
    activation, rotary on q and k) read and written once, or ``eager``: op by op, as the code runs."""
    rows, tokens = rows_and_tokens(lm, grid)
    T = rows * tokens                         # tokens this rank runs attention and the MLP on
    t = grid.tp
    Tn = T // t if grid.sp else T             # tokens of the norms and residual adds
    h = lm.d_model
    kv = h * (lm.kv_heads or lm.heads) // lm.heads
    c = lm.compute_bytes
    kernels = []
    for out, inp in [shape for shape in block_parameter_shapes(lm) if len(shape) == 2]:
        # [T, in] @ [in, out / t] or [T, in / t] @ [in / t, out]
        kernels.append(("matmul", 2 * T * out * inp / t, c * (T * inp + out * inp + T * out) / t))
    kernels.append(("attention", T * attention_flops_per_token(lm) / t, c * T * (2 * h + 2 * kv) / t))
    norm = 2 * c if lm.fused_norm or not lm.eager else 4 * c + 28   # eager RMSNorm: 6 ops, float32
    touched = [norm * Tn * h, norm * Tn * h, 3 * c * Tn * h, 3 * c * Tn * h]
    touched.append(((5 if lm.eager else 3) if lm.gated_mlp else 2) * c * T * lm.d_ff / t)  # silu, * up
    if not lm.position_embedding:             # rotary on q and k: float(), complex multiply, type_as
        rotary = 2 * c + 16 if lm.eager else 2 * c
        touched.extend([rotary * T * h / t, rotary * T * kv / t])
    if lm.eager:                              # k, v copied to all heads; the output made contiguous
        touched.append(2 * c * T * (h + (kv + h) * (kv < h)) / t)
    kernels.extend(("memory-bound", 0.0, nbytes) for nbytes in touched)
    return kernels


def edge_kernels(lm: LM, grid: Grid, first: bool, last: bool) -> list[tuple[str, float, float]]:
    """The ends, one micro-batch: the embedding look-up; the final norm, head and cross-entropy."""
    rows, tokens = rows_and_tokens(lm, grid)
    T = rows * tokens / grid.tp               # the head's tokens (S/t with sp; else V/t each)
    c = lm.compute_bytes
    kernels = []
    if first:
        kernels.append(("memory-bound", 0.0, c * T * lm.d_model))
    if last:                                  # eager: the final RMSNorm, then the logits made float32
        norm = 2 * c if lm.fused_norm or not lm.eager else 4 * c + 28
        kernels.append(("memory-bound", 0.0, norm * T * lm.d_model))
        kernels.append(("matmul", 2 * T * lm.vocab * lm.d_model,
                        c * (T * lm.d_model + lm.vocab * lm.d_model + T * lm.vocab)))
        kernels.append(("memory-bound", 0.0, (c + 12 if lm.eager else 2 * c) * T * lm.vocab))
    return kernels


def kernel_seconds(kind: str, flops: float, nbytes: float, gpu: GPU) -> float:
    """A kernel at its class's rate: a matmul at the measured share of the peak, or its bytes at
    the bandwidth where longer (the roofline: small shapes fall below the share)."""
    if kind == "matmul":
        return max(flops / (gpu.peak * gpu.matmul_share), nbytes / gpu.memory_bandwidth)
    if kind == "attention":
        return flops / (gpu.peak * gpu.attention_share)
    return nbytes / gpu.memory_bandwidth


def compute_classes(lm: LM, grid: Grid, gpu: GPU | None, first: bool, last: bool) -> dict:
    """{class: [FLOP, bytes, kernels, seconds]} of one rank's step (``first``, ``last``: it holds
    the model's ends). Backward runs each forward kernel twice over; recomputation adds a forward,
    ``full`` of every block kernel, ``selective`` of attention's, ``op`` of the second, fourth, ...
    matmul and the memory-bound; the launch floor raises each kernel to ``gpu.launch_s``."""
    blocks = lm.layers // grid.pp
    runs = []                                 # (kernel, how many times it runs a step)
    for index, kernel in enumerate(block_kernels(lm, grid)):      # the matmuls first, in order
        again = {"none": False, "full": True, "selective": kernel[0] == "attention",
                 "op": kernel[0] == "memory-bound" or (kernel[0] == "matmul" and index % 2)}[grid.recompute]
        runs.append((kernel, grid.micro_batches * blocks * (3 + again)))
    runs += [(kernel, grid.micro_batches * 3) for kernel in edge_kernels(lm, grid, first, last)]
    classes = {kind: [0.0, 0.0, 0, 0.0] for kind in ("matmul", "attention", "memory-bound", "launch floor")}
    for (kind, flops, nbytes), count in runs:
        seconds = 0.0
        if gpu is not None:
            seconds = kernel_seconds(kind, flops, nbytes, gpu)
            if seconds < gpu.launch_s:
                classes["launch floor"][2] += count
                classes["launch floor"][3] += count * (gpu.launch_s - seconds)
        for column, value in enumerate((flops, nbytes, 1, seconds)):    # a kernel's, count times
            classes[kind][column] += count * value
    return classes


def compute_terms(lm: LM, grid: Grid, machine: Machine) -> list[tuple[str, float, str]]:
    """Each kernel class at its rate on the slower of the first and the last pipeline stage; a
    measured machine (this box's check): every FLOP at its rate, 1/W of them a rank."""
    if machine.gpu is None:
        per_token = training_flops_per_token(lm, grid.recompute)
        tokens_worth = lm.batch * lm.seq / grid.world_size
        seconds = per_token * tokens_worth / machine.flops * turns(grid, machine)
        source = (f"{per_token / 1e9:.3g} GFLOP a token x {tokens_worth:.0f} tokens' worth a "
                  f"rank / {machine.flops / 1e12:.3g} TFLOP/s")
        if turns(grid, machine) > 1:
            source += f", {grid.world_size} ranks taking turns on {machine.cores} cores"
        return [("compute", seconds, source)]
    gpu = machine.gpu
    stages = [compute_classes(lm, grid, gpu, True, grid.pp == 1),
              compute_classes(lm, grid, gpu, False, True)]
    classes = max(stages, key=lambda stage: sum(row[3] for row in stage.values()))
    sources = {"matmul": f"TFLOP at {gpu.matmul_share:.0%} of {gpu.peak / 1e12:.0f} TFLOP/s or bytes at the bandwidth",
               "attention": f"TFLOP at {gpu.attention_share:.0%} of {gpu.peak / 1e12:.0f} TFLOP/s",
               "memory-bound": f"GB at {gpu.memory_bandwidth / 1e12:.3g} TB/s",
               "launch floor": f"shorter than {gpu.launch_s * 1e6:.3g} us, raised to it"}
    terms = []
    for kind, (flops, nbytes, kernels, seconds) in classes.items():
        amount = {"matmul": flops / 1e12, "attention": flops / 1e12, "memory-bound": nbytes / 1e9}
        source = f"{kernels:,} kernels, " + (f"{amount[kind]:.4g} " if kind in amount else "")
        terms.append((f"compute: {kind}", seconds, source + sources[kind]))
    return terms


def straggler_term(grid: Grid, machine: Machine, compute: float) -> tuple[str, float, str]:
    """A collective ends when its last rank comes: the slowest of W ranks' compute (0: a GPU box)."""
    return ("waiting for the slowest rank", compute * machine.straggler,
            f"the slowest of {grid.world_size} ranks computes {machine.straggler:.0%} longer")


def bubble_term(grid: Grid, machine: Machine, compute: float) -> tuple[str, float, str]:
    """Lesson 4: compute stretched by 1 / (1 - bubble); ranks sharing cores fill each other's."""
    bubble = bubble_share(grid)
    if turns(grid, machine) > 1:
        return ("pipeline bubble", 0.0, f"{grid.schedule}: an idle rank's core runs another rank")
    return ("pipeline bubble", compute * bubble / (1 - bubble),
            f"{grid.schedule}: idle {bubble:.3f} of the step (lesson 4)")


def tensor_parallel_term(lm: LM, grid: Grid, machine: Machine) -> tuple[str, float, str]:
    """Lesson 3 with sequence parallelism: per block and micro-batch two all-gathers and two
    reduce-scatters of [b, S, h] forward, as many backward, on the critical path; then the
    gradients of the tensors every tp rank holds whole, all-reduced."""
    t = grid.tp
    link = link_of(machine, grid, "tp")
    rows, tokens = rows_and_tokens(lm, grid)
    payload = lm.compute_bytes * rows * tokens * lm.d_model
    calls = grid.micro_batches * (lm.layers // grid.pp) * 4
    seconds = calls * (all_gather_time(link, t, payload)
                       + reduce_scatter_time(machine, link, t, payload))
    replicated = max(sum(values for values, split in rank_tensors(lm, grid, pp_rank) if not split)
                     for pp_rank in (0, grid.pp - 1))     # the first and the last stage
    seconds += all_reduce_time(link, t, FLOAT32 * replicated)
    return ("tp collectives", seconds,
            f"{2 * calls} all-gathers and reduce-scatters of {payload / 2**20:.3g} MiB (lesson 3)")


def ring_attention_term(lm: LM, grid: Grid, machine: Machine) -> tuple[str, float, str]:
    """Lesson 5: 2c exchanges a layer by a chunk's attention each: K, V; K, V with dK, dV; dK, dV home."""
    c = grid.cp
    link = machine.point_to_point or link_of(machine, grid, "cp")
    rows, tokens = rows_and_tokens(lm, grid)
    kv = 2 * lm.compute_bytes * rows * tokens * lm.d_model / grid.tp
    exchanges = grid.micro_batches * (lm.layers // grid.pp) * 2 * c
    hop = send_time(link, kv * (3 * c - 2) / (2 * c))     # 3c - 2 blocks of K, V or dK, dV in all
    chunk = 4 * rows * tokens * tokens * lm.d_model / grid.tp / machine.flops   # q k^T, weighted v
    hidden = chunk if machine.overlap else 0.0
    return ("ring attention hops", exchanges * max(0.0, hop - hidden),
            f"{exchanges} exchanges of {kv / 2**20:.3g} MiB blocks, each by a chunk's attention (lesson 5)")


def pipeline_hops_term(lm: LM, grid: Grid, machine: Machine) -> tuple[str, float, str]:
    """Lesson 4: with overlap only the first micro-batch's trip down and back is waited for,
    without every send; ranks sharing cores send back to back (the axis's link)."""
    link = machine.point_to_point or link_of(machine, grid, "pp")
    if machine.cores and grid.world_size > machine.cores:
        link = link_of(machine, grid, "pp")
    rows, tokens = rows_and_tokens(lm, grid)
    activation = lm.compute_bytes * rows * tokens // grid.tp * lm.d_model
    sends = 2 * (grid.pp - 1) if machine.overlap else 2 * grid.micro_batches
    return ("pipeline hops", sends * send_time(link, activation),
            f"{sends} sends of {activation / 2**20:.3g} MiB (lesson 4)")


def rank_tensor_bytes(lm: LM, grid: Grid) -> list[int]:
    """float32 bytes of each parameter tensor on the first pipeline rank."""
    return [FLOAT32 * values for values, _ in rank_tensors(lm, grid, pp_rank=0)]


def gradient_buckets(sizes: list[int], cap: float) -> list[int]:
    """Stage 06's buckets, last tensor first, closed before ``cap`` bytes (0: a call a tensor)."""
    buckets = []
    current = 0
    for nbytes in reversed(sizes):
        if current and current + nbytes > cap:
            buckets.append(current)
            current = 0
        current += nbytes
    buckets.append(current)
    return buckets


def data_parallel_terms(lm: LM, grid: Grid, machine: Machine,
                        compute: float) -> list[tuple[str, float, str]]:
    """Lessons 1-2 and stage 06, over the dp x cp ranks that hold the same parameters."""
    replicas = grid.dp * grid.cp
    link = link_of(machine, grid, "dp")
    sizes = rank_tensor_bytes(lm, grid)
    whole = sum(sizes)
    backward = compute * 2 / 3
    terms = []
    if grid.dp_kind in ("ddp", "zero1"):
        buckets = gradient_buckets(sizes, grid.bucket_bytes)
        pieces = [all_reduce_time(link, replicas, nbytes) for nbytes in buckets]
        terms.append(("dp gradients left after backward",
                      overlapped_tail(backward, pieces, machine.overlap),
                      f"{len(buckets)} all-reduces, {whole / 2**20:.3g} MiB, under backward (stage 06)"))
    if grid.dp_kind == "zero2":     # every micro-batch's: a rank keeps only its shard (DeepSpeed's)
        buckets = gradient_buckets(sizes, whole / replicas)    # one bucket an owner
        pieces = [send_time(link, nbytes) for nbytes in buckets]
        m = grid.micro_batches
        terms.append(("dp gradients reduced to their owners, left after backward",
                      m * overlapped_tail(backward / m, pieces, machine.overlap),
                      f"{m} x {len(buckets)} reduces, {whole / 2**20:.3g} MiB, under backward (lesson 1)"))
    if grid.dp_kind in ("zero1", "zero2"):
        terms.append(("dp parameters broadcast by their owners",
                      replicas * broadcast_time(link, replicas, whole / replicas),
                      f"{replicas} broadcasts of {whole / replicas / 2**20:.3g} MiB after the "
                      "optimizer step, nothing to hide them under (lesson 1)"))
    if grid.dp_kind == "fsdp":
        terms.append(fsdp_term(lm, grid, machine, link, compute))
    terms.append(buffer_copies_term(lm, grid, machine))
    return terms


def buffer_copies_term(lm: LM, grid: Grid, machine: Machine) -> tuple[str, float, str]:
    """Bytes the data-parallel wrappers copy into their buffers and back, at the copy bandwidth:
    DDP 4G (in and out of buckets; a call a tensor 2G), ZeRO-2 2G a micro-batch, ZeRO-1/2 owners' flat
    buffers 2G/d + 2G, FSDP each gathered unit out of its buffer and gradients into theirs."""
    d = grid.dp * grid.cp
    gradients = sum(rank_tensor_bytes(lm, grid))
    copied = 0.0
    if grid.dp_kind in ("ddp", "zero1"):
        copied = (2 if grid.bucket_bytes == 0 else 4) * gradients    # a call a tensor: no buckets
    if grid.dp_kind == "zero2":
        copied = 2 * grid.micro_batches * gradients
    if grid.dp_kind in ("zero1", "zero2"):
        copied += 2 * gradients / d + 2 * gradients
    if grid.dp_kind == "fsdp":
        units = fsdp_unit_values(lm, grid)
        gathered = sum(units) + sum(units[1:-1])          # forward, and backward but the ends
        copied = 2 * lm.compute_bytes * gathered + 2 * FLOAT32 * sum(units)
    bandwidth = machine.copy_bandwidth or machine.memory_bandwidth
    seconds = copied / bandwidth * turns(grid, machine)
    return ("dp buffer copies", seconds,
            f"{copied / 2**20:.3g} MiB read and written / {bandwidth / 1e9:.3g} GB/s")


def fsdp_unit_values(lm: LM, grid: Grid) -> list[int]:
    """Lesson 2's units, in values a tp rank holds: the root (embeddings, head), then the blocks."""
    block_values = sum(math.prod(shape) // grid.tp for shape in block_parameter_shapes(lm) if len(shape) == 2)
    root_values = lm.vocab * lm.d_model * 2
    if lm.position_embedding:
        root_values += lm.seq * lm.d_model
    return [root_values] + [block_values] * (lm.layers // grid.pp)


def fsdp_term(lm: LM, grid: Grid, machine: Machine, link: Link,
              compute: float) -> tuple[str, float, str]:
    """Lesson 2: each unit gathered before forward and again before backward (the root and the
    last block stay gathered), one prefetched; gradients reduce-scattered as each block's
    backward ends, the root's after all of backward; the 1-D tensors' all-reduced once."""
    replicas = grid.dp * grid.cp
    blocks = lm.layers // grid.pp
    block_replicated = sum(math.prod(shape) for shape in block_parameter_shapes(lm) if len(shape) == 1)
    unit_values = fsdp_unit_values(lm, grid)
    forward_units = [0.0] + [compute / 3 / blocks] * blocks
    backward_units = [0.0] + [compute * 2 / 3 / blocks] * blocks
    gathers = [all_gather_time(machine.gather or link, replicas, lm.compute_bytes * v)
               for v in unit_values]
    share = machine.overlap if machine.gather_overlap is None else machine.gather_overlap
    waited = prefetched_wait(forward_units, gathers, share)
    regathered = gathers[1:-1]                           # not the root, not the last block
    waited += prefetched_wait(backward_units[1:-1], regathered, share)
    # The root's gradients are complete only with the token embedding's, as backward ends (a
    # pipeline stage's root is charged the same, a bound): its reduce-scatter comes after all.
    block_scatters = [reduce_scatter_time(machine, link, replicas, FLOAT32 * v, machine.scatter)
                      for v in unit_values[1:]]
    root_scatter = reduce_scatter_time(machine, link, replicas, FLOAT32 * unit_values[0],
                                       machine.scatter)
    waited += overlapped_tail(compute * 2 / 3, block_scatters, share) + root_scatter
    replicated = FLOAT32 * (block_replicated * blocks + 2 * lm.d_model)
    waited += all_reduce_time(link, replicas, replicated)
    return ("fsdp gathers and reduce-scatters not hidden", waited,
            f"{blocks} block units and the root, gathered for forward, again for backward, "
            "gradients reduce-scattered (lesson 2)")


def optimizer_term(lm: LM, grid: Grid, machine: Machine) -> tuple[str, float, str]:
    """AdamW: 28 bytes a parameter this rank updates, at the memory bandwidth."""
    owned = state_per_rank(lm, grid)["optim"] / (2 * FLOAT32)
    seconds = ADAMW_BYTES_TOUCHED * owned / machine.memory_bandwidth * turns(grid, machine)
    source = f"28 bytes x {owned / 1e6:.3g}M parameters / {machine.memory_bandwidth / 1e9:.3g} GB/s"
    if turns(grid, machine) > 1:
        source += f", {grid.world_size} ranks taking turns on {machine.cores} cores"
    return ("optimizer", seconds, source)


def loss_term(grid: Grid, machine: Machine) -> tuple[str, float, str]:
    """One float64 all-reduced over every rank, so each logs the global loss."""
    link = machine.across if grid.world_size > machine.ranks_per_node else machine.inside
    return ("loss all-reduce", all_reduce_time(link, grid.world_size, 8),
            f"8 bytes over all {grid.world_size} ranks")


def step_time(lm: LM, grid: Grid, machine: Machine) -> list[tuple[str, float, str]]:
    """One optimizer step on the slowest rank, as (term, seconds, where it comes from)."""
    terms = compute_terms(lm, grid, machine)
    compute = sum(term[1] for term in terms)
    if grid.world_size > 1 and machine.straggler:
        terms.append(straggler_term(grid, machine, compute))
    if grid.pp > 1:
        terms.append(bubble_term(grid, machine, compute))
        terms.append(pipeline_hops_term(lm, grid, machine))
    if grid.tp > 1:
        terms.append(tensor_parallel_term(lm, grid, machine))
    if grid.cp > 1:
        terms.append(ring_attention_term(lm, grid, machine))
    if grid.dp * grid.cp > 1:
        terms.extend(data_parallel_terms(lm, grid, machine, compute))
    if grid.loss_all_reduce:
        terms.append(loss_term(grid, machine))
    terms.append(optimizer_term(lm, grid, machine))
    return terms


def predict(lm: LM, grid: Grid, machine: Machine) -> dict:
    """Memory, step time and throughput of one grid: what ``run_planning.py`` ranks."""
    terms = step_time(lm, grid, machine)
    seconds = sum(term[1] for term in terms)
    memory = memory_per_rank(lm, grid)
    tokens_per_second = lm.batch * lm.seq / seconds
    useful = training_flops_per_token(lm) * tokens_per_second / grid.world_size
    return {"grid": grid, "terms": terms, "step_s": seconds, "memory": memory,
            "fits": memory["total"] <= machine.memory,
            "tokens_per_s_per_rank": tokens_per_second / grid.world_size,
            "mfu": useful / machine.flops}


def dp_crossover_tokens(lm: LM, rate: float, link: Link, ranks: int, floor: float = 0.0) -> float:
    """Tokens per rank above which DDP's all-reduce of float32 gradients (b = 4 bytes a parameter)
    hides under backward (about 4N FLOP a token at ``rate`` FLOP/s a rank, after ``floor`` s: fixed
    costs, 0 on a GPU): the Scaling Book's C/W rule; without latency, T* = 2(W-1)/W x b C / (4 busbw)."""
    all_reduce = all_reduce_time(link, ranks, FLOAT32 * parameter_count(lm))
    return max(0.0, all_reduce - floor) * rate / (training_flops_per_token(lm) * 2 / 3)


# --------------------------------------------------------------------------- every grid


DP_KINDS = ("ddp", "zero1", "zero2", "fsdp")


def divisors(n: int) -> list[int]:
    """Every k that divides n, in order, trying k up to sqrt(n) only."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


def candidate_grids(lm: LM, ranks: int, ranks_per_node: int):
    """Every grid of ``ranks`` the LM's shape allows (tp divides the heads within a node, pp the
    layers, cp > 1 the sequence in 2 cp halves, dp the batch), each with every data-parallel
    kind and recomputation; the loops run over the model's divisors, not the ranks'."""
    for tp in divisors(math.gcd(lm.kv_heads or lm.heads, ranks)):   # kv heads divide the heads
        if tp > ranks_per_node:
            continue
        for pp in divisors(math.gcd(lm.layers, ranks // tp)):
            for cp in divisors(math.gcd(lm.seq // 2 or 1, ranks // (tp * pp))):
                if cp > 1 and lm.seq % (2 * cp):
                    continue
                dp = ranks // (tp * pp * cp)
                if lm.batch % dp:
                    continue
                micro_batch_counts = [m for m in (pp, 2 * pp, 4 * pp) if lm.batch // dp % m == 0]
                kinds = DP_KINDS if dp * cp > 1 else ("ddp",)
                for m in micro_batch_counts if pp > 1 else [1]:
                    for kind in kinds:
                        for recompute in RECOMPUTE + ("op",) * (lm.gated_mlp and tp == 1):
                            yield Grid(dp=dp, tp=tp, pp=pp, cp=cp, dp_kind=kind, sp=tp > 1,
                                       micro_batches=m, recompute=recompute)


def label(grid: Grid) -> str:
    """'dp2 fsdp tp2 sp pp2 m8 ckpt': the axes and what they are set to; ``parse_label``
    reads it back."""
    parts = [f"dp{grid.dp} {grid.dp_kind}"]
    if grid.tp > 1:
        parts.append(f"tp{grid.tp}" + " sp" * grid.sp)
    if grid.pp > 1:
        parts.append(f"pp{grid.pp}" + f" v{grid.chunks}" * (grid.chunks > 1))
    if grid.micro_batches > 1:
        parts.append(f"m{grid.micro_batches}")
    if grid.cp > 1:
        parts.append(f"cp{grid.cp}")
    parts.append({"none": "", **{mode: token for token, mode in RECOMPUTE_TOKENS.items()}}[grid.recompute])
    return " ".join(parts).strip()


def parse_label(text: str) -> Grid:
    """A label's tokens in any order: dpN tpN ppN cpN (1 when absent), ddp zero1 zero2 fsdp, mN,
    vN (chunks: interleaved 1F1B), sp, and ckpt (full), sel (selective) or op (torchtitan's)."""
    sizes = {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "m": 1, "v": 1}
    grid = {"dp_kind": "ddp", "sp": False, "recompute": "none"}
    seen = set()
    for token in text.split():
        name = token.rstrip("0123456789")
        kind = "data-parallel kind" if token in DP_KINDS else "recomputation" if token in RECOMPUTE_TOKENS else name
        if kind in seen:
            raise ValueError(f"{token!r}: a second {kind} token")
        seen.add(kind)
        if token in DP_KINDS:
            grid["dp_kind"] = token
        elif token == "sp" or token in RECOMPUTE_TOKENS:
            grid.update({"sp": True} if token == "sp" else {"recompute": RECOMPUTE_TOKENS[token]})
        elif name in sizes and token[len(name):].isdigit() and 0 < int(token[len(name):]) < 10**7:
            sizes[name] = int(token[len(name):])
        else:
            raise ValueError(f"{token!r} is not a grid token (dpN tpN ppN cpN mN vN, "
                             f"{' '.join(DP_KINDS)}, sp, ckpt, sel, op)")
    schedule = "interleaved" if sizes["v"] > 1 else "1f1b"
    return Grid(dp=sizes["dp"], tp=sizes["tp"], pp=sizes["pp"], cp=sizes["cp"],
                micro_batches=sizes["m"], chunks=sizes["v"], schedule=schedule, **grid)


# --------------------------------------------------------------------------- presets
# Datasheet peaks and bandwidths; the matmul shares are the best bf16 shape stas00/ml-engineering's
# mamf-finder measured (H200: "the same" as H100); attention shares from the FlashAttention-2 and
# -3 papers (B200: none published, H100's assumed), which count a backward as 2.5 forwards (it
# recomputes the scores): 3/3.5 of their share is the share of the 3 forwards counted here.
# README.md beside this file cites each.
FA = 3 / 3.5

GPUS = {
    "A100": GPU("A100 80GB SXM", peak=312e12, memory=80e9, memory_bandwidth=2.039e12,
                nvlink=300e9, network=25e9, matmul_share=271.2 / 312, attention_share=0.6 * FA),
    "H100": GPU("H100 SXM", peak=989e12, memory=80e9, memory_bandwidth=3.35e12,
                nvlink=450e9, network=50e9, matmul_share=794.5 / 989, attention_share=0.35 * FA),
    "H100-HBM2e": GPU("H100 96GB HBM2e, 500 W", peak=989e12, memory=96e9, memory_bandwidth=2.4e12,
                      nvlink=450e9, network=50e9, matmul_share=794.5 / 989, attention_share=0.35 * FA),
    "H200": GPU("H200 SXM", peak=989e12, memory=141e9, memory_bandwidth=4.8e12,
                nvlink=450e9, network=50e9, matmul_share=794.5 / 989, attention_share=0.35 * FA),
    "B200": GPU("B200 (HGX)", peak=2250e12, memory=180e9, memory_bandwidth=7.7e12,
                nvlink=900e9, network=50e9, matmul_share=1745 / 2250, attention_share=0.35 * FA),
}


def cluster(gpu_name: str, gpus: int, gpus_per_node: int = 8) -> Machine:
    """``gpus`` of a GPU preset, ``gpus_per_node`` a node on NVLink, a NIC each between nodes;
    latencies of NCCL's order (10 us inside, 20 us across), not measured."""
    gpu = GPUS[gpu_name]
    return Machine(name=f"{gpus} x {gpu.name}, {gpus_per_node} a node", flops=gpu.peak,
                   memory=gpu.memory, memory_bandwidth=gpu.memory_bandwidth,
                   ranks_per_node=gpus_per_node, ranks=gpus, gpu=gpu,
                   inside=Link(latency=10e-6, busbw=gpu.nvlink),
                   across=Link(latency=20e-6, busbw=gpu.network),
                   source=f"{gpu.peak / 1e12:.0f} TFLOP/s bf16, {gpu.memory / 1e9:.0f} GB at "
                          f"{gpu.memory_bandwidth / 1e12:.3g} TB/s, NVLink {gpu.nvlink / 1e9:.0f} GB/s, "
                          f"{gpu.network * 8 / 1e9:.0f} Gb/s a GPU between nodes")


CLUSTERS = {"8xH100-nvlink": cluster("H100", 8), "16xH100-ib": cluster("H100", 16)}

# torchtitan's Llama 3.1 8B (bfloat16), at its published sequence and global batch on 8 GPUs.
LLAMA3_8B = LM(layers=32, d_model=4096, d_ff=14336, heads=32, kv_heads=8, vocab=128256,
               seq=8192, batch=16, gated_mlp=True, position_embedding=False, compute_bytes=2,
               eager=True)
