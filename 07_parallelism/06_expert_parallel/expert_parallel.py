"""Stage 07: expert parallelism. A mixture-of-experts layer whose experts live on different ranks.

A mixture of experts (MoE; Shazeer et al., 2017) replaces a block's one MLP by E MLPs, the
experts, and a router that sends each token to only k of them. The model holds E times the
MLP's parameters, yet a token costs about k MLPs of compute. Expert parallelism (GShard,
Lepikhin et al., 2020) puts the experts on different ranks: rank r of W holds E/W of them.
Tokens then have to travel to their experts and back, every rank sending a different number
of rows to every other rank: an ``all_to_all`` with uneven splits, the collective stage 01
demonstrates and no lesson before this one needed.

Two layers, one contract: ``ExpertParallelMoE(moe)(x_local)`` returns exactly what
``moe(x_local)`` returns, the gradients included. ``MoE`` is the reference on one process: a
router picks each token's top_k experts (gates renormalised to sum to 1), with an optional
capacity per expert (``expert_capacity``, ``keep_within_capacity``). ``ExpertParallelMoE``,
built on every rank from the same full ``MoE``, keeps rank r's experts r*E/W .. (r+1)*E/W - 1
and a copy of the router; its forward routes this rank's tokens, sorts them by destination,
exchanges the counts, sends the rows, runs each local expert once, sends the results back and
combines them with the gates. Each exchange is an autograd function whose backward is the
reverse exchange.

Gradients and data parallelism. As in stages 03-06, every rank's loss is the mean over its own
tokens. An expert sees rows from every rank, and backward brings every rank's gradient rows
home to it: its weight gradient is their SUM over ranks; divided by W (a hook), it is already
the MEAN a data-parallel average would give. So the data-parallel average of the replicated
parameters must skip the experts: ``expert_parameters`` and ``replicated_parameters`` split a
model's parameters for that.

Use it (after dist.init_process_group; every rank builds the same MoE from the same seed):
    torch.manual_seed(0)
    moe = MoE(d_model=512, d_ff=2048, num_experts=8, top_k=2, capacity_factor=1.25)
    layer = ExpertParallelMoE(moe)          # keeps 8 / world_size experts; drop `moe` after
    out = layer(x_local)                    # [tokens, d_model] or [batch, seq, d_model]
    loss = task_loss(out) + 0.01 * layer.aux_loss   # Switch's load-balancing loss
    loss.backward()                         # expert gradients: already the mean over ranks
    # average replicated_parameters(model) over the ranks (a DDP of 03-06), then step

The demo beside this file runs it against one process. This file needs torch alone: copy it
anywhere.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# --------------------------------------------------------------------------- routing


def expert_mlp(d_model: int, d_ff: int) -> nn.Module:
    """One expert: d_model -> d_ff -> GELU -> d_model, the course LM's dense MLP."""
    return nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))


def expert_capacity(capacity_factor: float | None, tokens: int, top_k: int,
                    num_experts: int) -> int | None:
    """C = min(ceil(capacity_factor * tokens * top_k / num_experts), tokens): the assignments
    one expert takes at most. tokens * top_k / num_experts is its share when routing is
    uniform, so a factor of 1.0 leaves no slack and 1.25 a quarter. None: dropless."""
    if capacity_factor is None:
        return None
    share = capacity_factor * tokens * top_k / num_experts
    # An expert can take each token once at most: a capacity of `tokens` is already dropless.
    # (Capped before rounding: a huge factor would overflow ceil() or the int64 comparison.)
    if share >= tokens:
        return tokens
    return math.ceil(share)


@dataclass
class Routing:
    """Where each of ``tokens`` tokens goes: its ``top_k`` choices, most probable first."""
    probs: torch.Tensor    # [tokens, num_experts]  softmax of the router's logits
    experts: torch.Tensor  # [tokens, top_k]        the chosen experts (int64)
    gates: torch.Tensor    # [tokens, top_k]        their probabilities, renormalised to sum to 1
    kept: torch.Tensor     # [tokens, top_k]        False where the expert was already full


def keep_within_capacity(experts: torch.Tensor, num_experts: int,
                         capacity: int | None) -> torch.Tensor:
    """Which assignments fit, each expert taking at most ``capacity`` of them: first every
    token's first choice, then every token's second choice, ...; within a choice, the lower
    token index first. ``experts`` [tokens, top_k] -> kept [tokens, top_k] (bool)."""
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    tokens, top_k = experts.shape
    # Column c of `experts` holds every token's c-th choice: read the transpose row by row and
    # the assignments come in priority order, choice 0 of tokens 0 .. T-1, then choice 1, ...
    in_priority_order = experts.t().reshape(-1)                    # [top_k * tokens]
    one_hot = F.one_hot(in_priority_order, num_experts)            # [top_k * tokens, E]
    # An assignment's place in its expert's queue: how many before it chose the same expert.
    queued = one_hot.cumsum(dim=0)                                 # [top_k * tokens, E]
    place = queued.gather(1, in_priority_order.unsqueeze(1)).squeeze(1) - 1
    kept = place < capacity                                        # [top_k * tokens]
    return kept.view(top_k, tokens).t()                            # [tokens, top_k]


def route(logits: torch.Tensor, top_k: int, capacity: int | None) -> Routing:
    """Softmax over all experts, the top_k most probable, gates renormalised, then capacity.

    The renormalised gates p_i / sum_{j in top_k} p_j are a softmax over the top_k logits alone
    (the full softmax's denominator cancels), computed so: with top_k = 1 the gate is exactly 1
    and its gradient exactly 0, where p / p would leave rounding noise in the router's gradient."""
    probs = torch.softmax(logits, dim=-1)                          # [tokens, E]
    top_logits, experts = logits.topk(top_k, dim=-1)               # [tokens, top_k] each
    gates = torch.softmax(top_logits, dim=-1)                      # each row sums to 1
    kept = keep_within_capacity(experts, probs.shape[-1], capacity)
    return Routing(probs, experts, gates, kept)


def load_balancing_loss(routing: Routing) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al., 2021, section 2.2):

        aux = E * sum_e f_e * P_e

    f_e: the share of this call's assignments (every token's top_k choices, counted before
    capacity drops: tokens * top_k in all) that chose expert e; P_e: the mean over tokens of
    the router probability of e. Both sum to 1 over e; aux is 1 when both are uniform and grows
    as the router concentrates on a few experts. f_e is a count (no gradient); the gradient
    reaches the router through P_e. (Switch routes top-1, where the two definitions agree.)"""
    num_experts = routing.probs.shape[-1]
    chosen = torch.bincount(routing.experts.flatten(), minlength=num_experts)   # [E]
    share_routed = chosen.to(routing.probs.dtype) / routing.experts.numel()     # f_e
    mean_prob = routing.probs.mean(dim=0)                                       # P_e
    return num_experts * (share_routed * mean_prob).sum()


def route_tokens(layer: nn.Module, x: torch.Tensor) -> Routing:
    """Route ``x`` [tokens, d_model] with ``layer.router`` and keep the call's statistics on
    ``layer``: ``aux_loss``, ``tokens_per_expert`` ([E], kept assignments), ``dropped``
    (assignments over capacity). Both layers call this, so they route identically."""
    capacity = expert_capacity(layer.capacity_factor, x.shape[0], layer.top_k, layer.num_experts)
    routing = route(layer.router(x), layer.top_k, capacity)
    layer.aux_loss = load_balancing_loss(routing)
    kept_experts = routing.experts[routing.kept]                   # [kept assignments]
    layer.tokens_per_expert = torch.bincount(kept_experts, minlength=layer.num_experts)
    layer.dropped = routing.kept.numel() - kept_experts.numel()
    return routing


def without_graph(state: dict) -> dict:
    """A layer's state for a copy (``copy.deepcopy``, pickle): the last call's ``aux_loss``
    without that call's autograd graph. A tensor inside a graph cannot be deep-copied, and a
    copy of the weights (a reference model, an EMA) has no use for the graph."""
    if state.get("aux_loss") is not None:
        state["aux_loss"] = state["aux_loss"].detach()
    return state


def combine(expert_out: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_k gates[t, k] * expert_out[t, k]: [tokens, top_k, d_model] -> [tokens, d_model].
    A dropped assignment's row is zero and adds nothing. Both layers combine with this, so
    where their expert outputs are equal, their outputs are bitwise equal."""
    return (gates.unsqueeze(-1) * expert_out).sum(dim=1)


# --------------------------------------------------------------------------- the reference


class MoE(nn.Module):
    """A mixture-of-experts MLP on one process (the reference). ``forward`` takes
    [tokens, d_model] or [batch, seq, d_model] and returns the same shape. After each call:
    ``aux_loss`` (see :func:`load_balancing_loss`; add it to the loss), ``tokens_per_expert``,
    ``dropped``. ``copy.deepcopy`` works at any time: a copy's ``aux_loss`` is detached."""

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int = 2,
                 capacity_factor: float | None = None):
        super().__init__()
        if capacity_factor is not None and not capacity_factor > 0:  # (NaN too) it would drop
            raise ValueError(f"MoE: capacity_factor={capacity_factor}; a number > 0, or None "
                             "for dropless routing")                 # every token, silently
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleList(expert_mlp(d_model, d_ff) for _ in range(num_experts))
        self.aux_loss = None
        self.tokens_per_expert = None
        self.dropped = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                   # [tokens, d_model]
        routing = route_tokens(self, x)
        expert_out = x.new_zeros(x.shape[0], self.top_k, x.shape[1])   # [tokens, top_k, d_model]
        for index, expert in enumerate(self.experts):
            mine = routing.kept & (routing.experts == index)           # [tokens, top_k]
            token, choice = torch.nonzero(mine, as_tuple=True)
            # run even on no rows: the expert's gradient is then zero, not None
            expert_out[token, choice] = expert(x[token])
        return combine(expert_out, routing.gates).reshape(shape)

    def __getstate__(self) -> dict:
        return without_graph(super().__getstate__())


# --------------------------------------------------------------------------- the exchange


def exchange_rows(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                  group=None) -> torch.Tensor:
    """All-to-all of rows: the first send_splits[0] rows go to rank 0, the next send_splits[1]
    to rank 1, ...; recv_splits[j] rows arrive from rank j, stacked in rank order."""
    received = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
    dist.all_to_all_single(received, rows.contiguous(), output_split_sizes=recv_splits,
                           input_split_sizes=send_splits, group=group)
    return received


class AllToAll(torch.autograd.Function):
    """``exchange_rows`` with autograd. Row i of the output is some rank's row j; its gradient
    belongs to that rank's row j. The reverse exchange (the splits swapped) takes every
    gradient row back to where its row came from: backward of a permutation is its inverse."""

    @staticmethod
    def forward(ctx, rows, send_splits, recv_splits, group):
        ctx.send_splits = send_splits
        ctx.recv_splits = recv_splits
        ctx.group = group
        return exchange_rows(rows, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return exchange_rows(grad, ctx.recv_splits, ctx.send_splits, ctx.group), None, None, None


# --------------------------------------------------------------------------- expert parallel


class ExpertParallelMoE(nn.Module):
    """``moe``'s experts spread over the ranks of ``group``; ``forward(x_local)`` returns what
    ``moe(x_local)`` would. ``router``: replicated. ``experts``: an ``nn.ModuleDict`` of this
    rank's experts keyed by global index (``experts["3"]`` is a copy of ``moe.experts[3]``).
    ``received_per_expert`` [W, E/W]: rows this rank's experts got from each rank, last call."""

    def __init__(self, moe: MoE, group=None):
        super().__init__()
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if moe.num_experts % self.world_size:
            raise ValueError(f"ExpertParallelMoE: {moe.num_experts} experts cannot be split evenly "
                             f"over {self.world_size} ranks; use a multiple of {self.world_size}")
        self.num_experts = moe.num_experts
        self.top_k = moe.top_k
        self.capacity_factor = moe.capacity_factor
        self.experts_per_rank = moe.num_experts // self.world_size
        first = self.rank * self.experts_per_rank
        mine = range(first, first + self.experts_per_rank)
        self.router = copy.deepcopy(moe.router)
        # Copies of this rank's experts only: once `moe` is dropped, the others are freed.
        self.experts = nn.ModuleDict({str(index): copy.deepcopy(moe.experts[index])
                                      for index in mine})
        for param in self.experts.parameters():
            param.register_hook(self.mean_over_ranks)
        self.aux_loss = None
        self.tokens_per_expert = None
        self.dropped = None
        self.received_per_expert = None

    def __getstate__(self) -> dict:
        return without_graph(super().__getstate__())

    def mean_over_ranks(self, grad: torch.Tensor) -> torch.Tensor:
        """An expert's gradient arrives summed over every rank's tokens (backward brought the
        rows home); data parallelism's mean over ranks is that sum / W."""
        return grad / self.world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                   # [tokens, d_model]
        routing = route_tokens(self, x)                                # locally, as moe(x) would
        # 1. This rank's kept assignments, sorted by destination rank.
        token, choice, expert = self.sort_by_destination(routing)     # [assignments] each
        send_per_expert = torch.bincount(expert, minlength=self.num_experts)   # [E]
        # 2. The counts: how many rows each rank receives from each rank, per expert.
        recv_per_expert = self.exchange_counts(send_per_expert)        # [W, E/W]
        self.received_per_expert = recv_per_expert
        send_splits = send_per_expert.view(self.world_size, -1).sum(dim=1).tolist()  # per rank
        recv_splits = recv_per_expert.sum(dim=1).tolist()              # per rank
        # 3. Dispatch: the rows travel to their experts' owners.
        received = AllToAll.apply(x[token], send_splits, recv_splits, self.group)
        # 4. Every local expert runs once, over what every rank sent it.
        results = self.run_local_experts(received, recv_per_expert)    # [received, d_model]
        # 5. The results travel back: the same exchange, reversed.
        returned = AllToAll.apply(results, recv_splits, send_splits, self.group)
        # 6. Combine: each result to its (token, choice), then the gate-weighted sum.
        expert_out = x.new_zeros(x.shape[0], self.top_k, x.shape[1])   # [tokens, top_k, d_model]
        expert_out[token, choice] = returned
        return combine(expert_out, routing.gates).reshape(shape)

    def sort_by_destination(self, routing: Routing):
        """(token, choice, expert) of every kept assignment, sorted by expert. Rank r owns the
        contiguous block of experts r*E/W .. (r+1)*E/W - 1, so sorting by expert sorts by
        destination rank, and inside each rank's chunk the rows come expert by expert."""
        token, choice = torch.nonzero(routing.kept, as_tuple=True)     # [assignments]
        expert = routing.experts[token, choice]
        order = torch.argsort(expert, stable=True)                     # ties keep token order
        return token[order], choice[order], expert[order]

    def exchange_counts(self, send_per_expert: torch.Tensor) -> torch.Tensor:
        """One all-to-all of E counts (equal splits: E/W to each rank): row s of the result
        holds how many rows rank s sends each of this rank's experts. -> [W, E/W]."""
        received = torch.empty_like(send_per_expert)
        dist.all_to_all_single(received, send_per_expert, group=self.group)
        return received.view(self.world_size, self.experts_per_rank)

    def run_local_experts(self, received: torch.Tensor,
                          recv_per_expert: torch.Tensor) -> torch.Tensor:
        """``received`` comes rank by rank, and inside each rank's chunk expert by expert.
        Regroup the rows expert by expert (one call per expert, over all ranks' rows), run
        them, and put each result back in the row its input came from."""
        local_expert = torch.arange(self.experts_per_rank, device=received.device)
        block_expert = local_expert.repeat(self.world_size)            # [W * E/W], one per block
        row_expert = block_expert.repeat_interleave(recv_per_expert.flatten())   # [received]
        by_expert = torch.argsort(row_expert, stable=True)             # ranks in order inside
        rows_per_expert = recv_per_expert.sum(dim=0).tolist()          # [E/W]
        chunks = received[by_expert].split(rows_per_expert)
        outputs = [expert(chunk) for expert, chunk in zip(self.experts.values(), chunks)]
        results = received.new_empty(received.shape)
        results[by_expert] = torch.cat(outputs)                        # the inverse permutation
        return results


# --------------------------------------------------------------------------- with data parallel


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of every ``ExpertParallelMoE``'s experts in ``model``: their gradients
    are already the mean over the expert-parallel ranks, so a data-parallel average over those
    ranks must skip them (each rank holds different experts)."""
    params = []
    for module in model.modules():
        if isinstance(module, ExpertParallelMoE):
            params.extend(module.experts.parameters())
    return params


def replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every other parameter (routers included): the same on every rank, averaged as in 03-06."""
    experts = {id(param) for param in expert_parameters(model)}
    return [param for param in model.parameters() if id(param) not in experts]
