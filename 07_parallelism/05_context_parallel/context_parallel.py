"""Stage 07, lesson 5: context parallelism. Split the sequence over ranks; attend with a ring.

Data, tensor and pipeline parallelism split the batch, the weights and the depth. None of them
splits the sequence, and a long sequence is what fills memory first: every activation grows
with it, attention's score matrix with its square. Context parallelism gives each of W ranks
a shard of every sequence. Everything in a Transformer works token by token (embeddings,
LayerNorm, the MLP, the loss) except attention, where every query needs every earlier key. Ring
attention (Liu et al., 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context") supplies them: the ranks stand in a ring and pass their key/value shard to the next
rank, W - 1 times, so that every query shard meets every key/value shard once, while each rank
keeps only its own queries and one visiting block.

The math. Softmax over keys that arrive one block at a time is the online softmax, the same
idea as ``distributed_softmax`` in 01_collectives/collectives.py (a global maximum, then a sum
of exponentials), done block by block. For query i, keep the output so far and the
log-sum-exp of its scores so far, lse_i = log sum_j exp(s_ij) (s_ij = q_i . k_j / sqrt(d)). A
new block b brings its own softmax output o_b and log-sum-exp l_b over its keys; then

    lse_new = log(exp(lse) + exp(l_b))
    out_new = out * exp(lse - lse_new) + o_b * exp(l_b - lse_new)

and after the last block ``out`` is exactly softmax over all keys times V. Backward needs no
score matrix either: with the final lse saved, P_ij = exp(s_ij - lse_i) is recomputed block
by block, and with D_i = sum_d dO_id O_id (a row sum of dO * O),

    dV_b = P^T dO,   dP = dO V_b^T,   dS = P * (dP - D),   dQ += dS K_b / sqrt(d),
    dK_b = dS^T Q / sqrt(d).

dQ stays home; dK_b and dV_b belong to the rank that owns block b: they travel around the ring
with the block, each rank adding its share, and one last hop takes them home.

Causal attention and load balance. Query i sees key j only if j <= i, by GLOBAL position. Cut
the sequence into W contiguous shards and rank r's queries see r earlier shards in full, its
own under the causal mask, and nothing later: rank W-1 works about 2W-1 times as much as rank
0, and the slowest rank sets the pace (W - 1/2 blocks of work where W/2 would do: 2 - 1/W
times the balanced time). The zig-zag layout cuts the sequence into 2W chunks and gives rank r
chunk r and chunk 2W-1-r, one early and one late: every rank then does the same work. Both are
here (``layout="contiguous"`` or ``"zigzag"``), and the causal mask always compares global
positions, so any layout gives the same answer.

Use it (q, k, v: this rank's shards, [batch, heads, local_seq, head_dim]):

    x_local = shard_sequence(x, dim=1, rank=rank, world_size=world_size, layout="zigzag")
    y_local = ring_attention(q, k, v, group=None, causal=True, layout="zigzag")
    y = unshard_sequence(y_local, dim=2, layout="zigzag")          # the full tensor, in order

and for a language model whose attention modules have an ``attend`` attribute (the course LM
in common/models.py): ``use_ring_attention(model, group, layout)``, feed each rank its tokens
with their global positions (``shard_positions``), and average the gradients over the data
AND context ranks together (``average_gradients``): each rank's loss is the mean over its own
tokens only.

Ulysses (``ulysses_attention``, after the ring) splits the other way round, for attention only:
one all-to-all gives each rank every token of H/W heads, plain attention runs on them, one
all-to-all gives the tokens back. The same contract on contiguous shards; for the LM
``use_ulysses_attention(model, group)``.

The demo beside this file runs both against one process. This file needs torch alone: copy it
anywhere.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

LAYOUTS = ("contiguous", "zigzag")


# --------------------------------------------------------------------------- the layouts


def chunks_per_rank(layout: str) -> int:
    """contiguous: the sequence is cut into W chunks, one per rank; zigzag: 2W, two per rank."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; allowed: {', '.join(LAYOUTS)}")
    if layout == "zigzag":
        return 2
    return 1


def chunks_of_rank(rank: int, world_size: int, layout: str) -> list[int]:
    """Which chunks of the sequence ``rank`` holds, in the order it holds them.

    contiguous, W = 4:  chunks 0 | 1 | 2 | 3          -> rank 0: [0], rank 3: [3]
    zigzag, W = 4:      chunks 0 1 2 3 4 5 6 7        -> rank 0: [0, 7], rank 1: [1, 6],
                                                         rank 2: [2, 5], rank 3: [3, 4]
    """
    if chunks_per_rank(layout) == 1:
        return [rank]
    return [rank, 2 * world_size - 1 - rank]


def shard_sequence(x: torch.Tensor, dim: int, rank: int, world_size: int,
                   layout: str) -> torch.Tensor:
    """This rank's part of the full tensor ``x`` along ``dim`` (a copy), in ``layout``."""
    seq_len = x.shape[dim]
    num_chunks = world_size * chunks_per_rank(layout)
    if seq_len % num_chunks != 0:
        raise ValueError(f"sequence length {seq_len} does not divide into {num_chunks} equal "
                         f"chunks ({layout} layout over {world_size} ranks)")
    chunks = x.chunk(num_chunks, dim=dim)
    return torch.cat([chunks[index] for index in chunks_of_rank(rank, world_size, layout)], dim=dim)


def unshard_sequence(x_local: torch.Tensor, dim: int, group=None,
                     layout: str = "zigzag") -> torch.Tensor:
    """The full tensor, in the original order, on every rank of ``group`` (an all-gather of
    the shards, then each chunk put back in its place). Not differentiable."""
    world_size = dist.get_world_size(group)
    per_rank = chunks_per_rank(layout)
    if x_local.shape[dim] % per_rank != 0:
        raise ValueError(f"a {layout} shard holds {per_rank} equal chunks; its length "
                         f"{x_local.shape[dim]} does not divide by {per_rank}")
    x_local = x_local.contiguous()
    shards = [torch.empty_like(x_local) for _ in range(world_size)]
    dist.all_gather(shards, x_local, group=group)
    chunks = [None] * (world_size * per_rank)
    for rank, shard in enumerate(shards):
        pieces = shard.chunk(per_rank, dim=dim)
        places = chunks_of_rank(rank, world_size, layout)
        for piece, place in zip(pieces, places):
            chunks[place] = piece
    return torch.cat(chunks, dim=dim)


def shard_positions(local_len: int, rank: int, world_size: int, layout: str,
                    device=None) -> torch.Tensor:
    """The global positions (0 .. seq-1) of the ``local_len`` tokens ``rank`` holds: the same
    cut as the data's, applied to 0, 1, 2, ... The causal mask compares these."""
    all_positions = torch.arange(local_len * world_size, device=device)
    return shard_sequence(all_positions, 0, rank, world_size, layout)


# --------------------------------------------------------------------------- one block of attention


# Exact attention of a chunk of queries against a chunk of keys/values, forward and backward,
# written out with matmuls (a fused kernel such as FlashAttention does the same tile by tile,
# without holding the [q_len, k_len] scores). Shapes: q [batch, heads, q_len, head_dim], k and
# v [batch, heads, k_len, head_dim]; ``allowed`` [q_len, k_len], True where query i may see
# key j, or None when it sees them all.


def chunk_scores(q, k, allowed, scale):
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # [batch, heads, q_len, k_len]
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))  # exp(-inf) = 0: never seen
    return scores


def chunk_attention(q, k, v, allowed, scale):
    """(softmax over this chunk's keys times V, log-sum-exp of the scores per query)."""
    scores = chunk_scores(q, k, allowed, scale)
    lse = torch.logsumexp(scores, dim=-1)            # [batch, heads, q_len]
    probs = torch.exp(scores - lse.unsqueeze(-1))    # softmax within this chunk
    out = torch.matmul(probs, v)                     # [batch, heads, q_len, head_dim]
    return out, lse


def chunk_attention_backward(grad_out, q, k, v, lse, delta, allowed, scale):
    """(dQ, dK, dV) of this chunk pair, given the FINAL lse of the queries (so P is the true
    attention weight over all keys) and delta = rowsum(dO * O)."""
    scores = chunk_scores(q, k, allowed, scale)
    probs = torch.exp(scores - lse.unsqueeze(-1))                 # P
    grad_v = torch.matmul(probs.transpose(-2, -1), grad_out)      # dV = P^T dO
    grad_probs = torch.matmul(grad_out, v.transpose(-2, -1))      # dP = dO V^T
    grad_scores = probs * (grad_probs - delta.unsqueeze(-1))      # dS = P * (dP - D)
    grad_q = torch.matmul(grad_scores, k) * scale                 # dQ = dS K / sqrt(d)
    grad_k = torch.matmul(grad_scores.transpose(-2, -1), q) * scale  # dK = dS^T Q / sqrt(d)
    return grad_q, grad_k, grad_v


def merge(out, lse, chunk_out, chunk_lse):
    """The online-softmax step: fold one chunk's (output, log-sum-exp) into the running ones.

    Both outputs are softmax-weighted averages over their own keys; weighting each by its share
    of the total exp-sum, exp(lse - lse_new), gives the average over all the keys. (An lse of
    -inf, nothing seen yet, weighs 0.)"""
    new_lse = torch.logaddexp(lse, chunk_lse)                   # log(e^lse + e^chunk_lse)
    old_weight = torch.exp(lse - new_lse).unsqueeze(-1)         # rescale what we had ...
    chunk_weight = torch.exp(chunk_lse - new_lse).unsqueeze(-1)  # ... and the newcomer
    return out * old_weight + chunk_out * chunk_weight, new_lse


def visible_pairs(q_positions, k_positions, chunk_len: int, causal: bool) -> list:
    """The (query rows, key columns, allowed mask) of every pair of chunks in which some query
    sees some key. Causal: a key is visible when its global position is not after the query's;
    a pair with no visible key is skipped (no compute at all), a pair where every key is
    visible needs no mask (None), the others get the mask. The chunks of both layouts are
    aligned in the global sequence, so a partly visible pair is a chunk against itself, and each
    of its queries sees at least its own key (no row of a computed pair is all masked)."""
    if not causal:
        return [(slice(None), slice(None), None)]
    pairs = []
    for q_start in range(0, len(q_positions), chunk_len):
        rows = slice(q_start, q_start + chunk_len)
        for k_start in range(0, len(k_positions), chunk_len):
            cols = slice(k_start, k_start + chunk_len)
            # [q_chunk, k_chunk]: key j at or before query i, by global position
            allowed = k_positions[cols].unsqueeze(0) <= q_positions[rows].unsqueeze(1)
            if not allowed.any():
                continue          # entirely in the future
            if allowed.all():
                allowed = None    # entirely in the past
            pairs.append((rows, cols, allowed))
    return pairs


# --------------------------------------------------------------------------- the ring


def global_rank(group, group_rank: int) -> int:
    """A point-to-point operation names its peer by its rank in the whole world."""
    if group is None:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def post_exchange(send: list, receive: list, group=None) -> list:
    """Start sending ``send`` to the next rank of the ring and receiving ``receive`` from the
    previous one, all in one batch; returns the requests to wait on. Every rank posts the same
    list in the same order, so the i-th send meets the i-th receive."""
    rank = dist.get_rank(group)
    world_size = dist.get_world_size(group)
    next_rank = global_rank(group, (rank + 1) % world_size)
    previous_rank = global_rank(group, (rank - 1) % world_size)
    operations = [dist.P2POp(dist.isend, tensor, next_rank, group) for tensor in send]
    operations += [dist.P2POp(dist.irecv, tensor, previous_rank, group) for tensor in receive]
    return dist.batch_isend_irecv(operations)


def wait_all(requests: list) -> None:
    for request in requests:
        request.wait()


def send_home(grad_k, grad_v, group=None):
    """The last hop of backward: after its turn on every rank, each block's (dK, dV) is on the
    rank just before its owner; one more step of the ring delivers it."""
    home_k = torch.empty_like(grad_k)
    home_v = torch.empty_like(grad_v)
    wait_all(post_exchange([grad_k, grad_v], [home_k, home_v], group))
    return home_k, home_v


class RingAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d) + mask) v over the whole sequence, each rank holding a shard."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout):
        rank = dist.get_rank(group)
        world_size = dist.get_world_size(group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        q = q.contiguous()
        k = k.contiguous()  # they are sent as they are: a send needs contiguous memory
        v = v.contiguous()
        local_len = q.shape[2]
        chunk_len = local_len // chunks_per_rank(layout)
        q_positions = shard_positions(local_len, rank, world_size, layout, q.device)
        out = torch.zeros_like(q)  # running output, [batch, heads, local_seq, head_dim]
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        k_block = k
        v_block = v
        for step in range(world_size):
            # At step i this rank holds the K/V shard of rank (rank - i): it came i hops.
            source = (rank - step) % world_size
            requests = []
            if step < world_size - 1:  # post the next block's transfer before computing
                next_k = torch.empty_like(k)
                next_v = torch.empty_like(v)
                requests = post_exchange([k_block, v_block], [next_k, next_v], group)
            k_positions = shard_positions(local_len, source, world_size, layout, q.device)
            for rows, cols, allowed in visible_pairs(q_positions, k_positions, chunk_len, causal):
                chunk_out, chunk_lse = chunk_attention(q[:, :, rows], k_block[:, :, cols],
                                                       v_block[:, :, cols], allowed, scale)
                merged_out, merged_lse = merge(out[:, :, rows], lse[:, :, rows], chunk_out,
                                               chunk_lse)
                out[:, :, rows] = merged_out
                lse[:, :, rows] = merged_lse
            wait_all(requests)
            if step < world_size - 1:
                k_block = next_k
                v_block = next_v
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        ctx.causal = causal
        ctx.layout = layout
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        rank = dist.get_rank(group)
        world_size = dist.get_world_size(group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        local_len = q.shape[2]
        chunk_len = local_len // chunks_per_rank(ctx.layout)
        q_positions = shard_positions(local_len, rank, world_size, ctx.layout, q.device)
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(dim=-1)  # D = rowsum(dO * O), [batch, heads, local_seq]
        grad_q = torch.zeros_like(q)
        k_block = k
        v_block = v
        travelling_k = None  # dK, dV of the block held at the previous step, summed over the
        travelling_v = None  # ranks it has visited so far: passed on with the next K/V block
        for step in range(world_size):
            source = (rank - step) % world_size
            send = []
            receive = []
            if step < world_size - 1:  # K/V again, as in forward
                next_k = torch.empty_like(k)
                next_v = torch.empty_like(v)
                send += [k_block, v_block]
                receive += [next_k, next_v]
            if step > 0:  # the previous block's gradients move on, with its K/V one step ahead
                arriving_k = torch.empty_like(k)
                arriving_v = torch.empty_like(v)
                send += [travelling_k, travelling_v]
                receive += [arriving_k, arriving_v]
            requests = []
            if send:
                requests = post_exchange(send, receive, group)
            grad_k_block = torch.zeros_like(k)
            grad_v_block = torch.zeros_like(v)
            k_positions = shard_positions(local_len, source, world_size, ctx.layout, q.device)
            for rows, cols, allowed in visible_pairs(q_positions, k_positions, chunk_len,
                                                     ctx.causal):
                chunk_dq, chunk_dk, chunk_dv = chunk_attention_backward(
                    grad_out[:, :, rows], q[:, :, rows], k_block[:, :, cols],
                    v_block[:, :, cols], lse[:, :, rows], delta[:, :, rows], allowed, scale)
                grad_q[:, :, rows] += chunk_dq
                grad_k_block[:, :, cols] += chunk_dk
                grad_v_block[:, :, cols] += chunk_dv
            wait_all(requests)
            if step > 0:  # what the ranks before us added to this block's gradients
                grad_k_block += arriving_k
                grad_v_block += arriving_v
            travelling_k = grad_k_block
            travelling_v = grad_v_block
            if step < world_size - 1:
                k_block = next_k
                v_block = next_v
        if world_size > 1:
            grad_k, grad_v = send_home(travelling_k, travelling_v, group)
        else:
            grad_k = travelling_k
            grad_v = travelling_v
        return grad_q, grad_k, grad_v, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                   causal: bool = True, layout: str = "zigzag") -> torch.Tensor:
    """This rank's shard of softmax(q k^T / sqrt(head_dim) + causal mask) v over the whole
    sequence. q, k, v: this rank's shards in ``layout``, [batch, heads, local_seq, head_dim]
    (as ``shard_sequence(..., dim=2, ...)`` cuts them); the result has q's shape and layout.
    Differentiable. Tensors of float32 or float64: the running sums are kept in the inputs'
    dtype."""
    chunks = chunks_per_rank(layout)  # raises on an unknown layout
    if q.shape[2] % chunks:  # the last rows would be in no pair of chunks: silently zero
        raise ValueError(f"a {layout} shard holds {chunks} equal chunks; local sequence length "
                         f"{q.shape[2]} does not divide by {chunks}")
    return RingAttention.apply(q, k, v, group, causal, layout)


# --------------------------------------------------------------------------- Ulysses: swap the split
#
# DeepSpeed-Ulysses (Jacobs et al., 2023) takes the other road. Attention is independent across
# heads, so a rank that holds every token of a few heads needs nothing from anyone. One
# all-to-all turns "my tokens, every head" into "every token, my heads" (H/W of them), plain
# attention runs on the whole sequence, and one all-to-all turns the output back. Each rank
# sends (W-1)/W of its q, k, v and output: when the sequence and the ranks grow together, that
# stays the same per rank, while a ring's K and V hops grow with W. The price: the heads must
# divide by W, and W is capped by the number of heads.


def swap_split(x: torch.Tensor, group, to_heads: bool) -> torch.Tensor:
    """One all-to-all: [b, H, S/W, d] (this rank's tokens, every head) -> [b, H/W, S, d]
    (every token, this rank's heads) when ``to_heads``, and back when not. Block j of what a
    rank sends goes to rank j: its head group j (to_heads), or its sequence shard j."""
    world_size = dist.get_world_size(group)
    if to_heads:
        batch, heads, local_seq, head_dim = x.shape
        # [b, H, S/W, d] -> [W, b, H/W, S/W, d]
        send = x.reshape(batch, world_size, heads // world_size, local_seq, head_dim)
        send = send.transpose(0, 1).contiguous()
    else:
        batch, my_heads, seq, head_dim = x.shape
        # [b, H/W, S, d] -> [W, b, H/W, S/W, d]
        send = x.reshape(batch, my_heads, world_size, seq // world_size, head_dim)
        send = send.permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    if to_heads:
        # block j: rank j's tokens of this rank's heads; in rank order, the whole sequence
        # [W, b, H/W, S/W, d] -> [b, H/W, S, d]
        received = received.permute(1, 2, 0, 3, 4)
        return received.reshape(batch, heads // world_size, world_size * local_seq, head_dim)
    # block j: this rank's tokens of rank j's heads; [W, b, H/W, S/W, d] -> [b, H, S/W, d]
    received = received.transpose(0, 1)
    return received.reshape(batch, world_size * my_heads, seq // world_size, head_dim)


class SwapSplit(torch.autograd.Function):
    """``swap_split`` for autograd. The swap only moves elements between ranks, so its
    gradient is the gradient moved back: the swap the other way."""

    @staticmethod
    def forward(ctx, x, group, to_heads):
        ctx.group = group
        ctx.to_heads = to_heads
        return swap_split(x, group, to_heads)

    @staticmethod
    def backward(ctx, grad):
        return swap_split(grad.contiguous(), ctx.group, not ctx.to_heads), None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                      causal: bool = True) -> torch.Tensor:
    """Attention over the whole sequence with Ulysses' all-to-alls. q, k, v: this rank's
    contiguous sequence shards [batch, heads, local_seq, head_dim] (``shard_sequence(...,
    layout="contiguous")``); returns this rank's shard of the output, the same shape."""
    world_size = dist.get_world_size(group)
    heads = q.shape[1]
    if heads % world_size:
        raise ValueError(f"Ulysses splits the heads: {heads} heads do not divide by "
                         f"{world_size} ranks")
    q_heads = SwapSplit.apply(q, group, True)
    k_heads = SwapSplit.apply(k, group, True)
    v_heads = SwapSplit.apply(v, group, True)
    out = heads_attention(q_heads, k_heads, v_heads, causal)
    return SwapSplit.apply(out, group, False)


def heads_attention(q, k, v, causal: bool) -> torch.Tensor:
    """Every token of this rank's heads, in order: plain attention, the causal mask as on one
    process (torch's fused kernel)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


# --------------------------------------------------------------------------- a model on the ring


def use_ring_attention(model: torch.nn.Module, group=None, layout: str = "zigzag") -> int:
    """Make every module of ``model`` that has an ``attend(q, k, v)`` attribute (the course
    LM's CausalSelfAttention) attend with causal ring attention over ``group``; returns how
    many. The model must then be fed each rank's tokens with their global positions."""
    chunks_per_rank(layout)  # raises on an unknown layout

    def attend(q, k, v):
        return ring_attention(q, k, v, group=group, causal=True, layout=layout)

    return swap_attention(model, attend)


def use_ulysses_attention(model: torch.nn.Module, group=None) -> int:
    """The same with Ulysses' all-to-alls: feed each rank its contiguous shard of the tokens
    (``shard_sequence(..., layout="contiguous")``) with their global positions."""

    def attend(q, k, v):
        return ulysses_attention(q, k, v, group=group, causal=True)

    return swap_attention(model, attend)


def swap_attention(model: torch.nn.Module, attend) -> int:
    modules = [module for module in model.modules() if hasattr(module, "attend")]
    if not modules:  # each shard would attend to itself alone: silently wrong
        raise ValueError("no module of the model has an 'attend' attribute to swap")
    for module in modules:
        module.attend = attend
    return len(modules)


def average_gradients(model: torch.nn.Module, group=None) -> None:
    """Average every gradient over ``group``: the data AND context ranks together.

    Each rank's loss is the mean over its own tokens; all shards hold the same number of
    tokens, so the mean over the whole global batch is the mean of those means, and its
    gradient the mean of the ranks' gradients. Averaging over the data ranks only would leave
    each context rank with the gradient of its part of the sequence alone."""
    world_size = dist.get_world_size(group)
    for param in model.parameters():
        if param.grad is None:
            continue
        dist.all_reduce(param.grad, group=group)
        param.grad /= world_size
