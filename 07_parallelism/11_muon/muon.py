"""Stage 07, lesson 11: Muon, the optimizer that does not shard like AdamW, four ways.

What it teaches. ZeRO and FSDP (lessons 1 and 2) rest on one property of AdamW: its update is
elementwise, so any rank can update any slice of a matrix. Muon (Jordan et al. 2024) keeps a
momentum per weight matrix, as SGD does, then replaces the update by an orthogonal matrix
near it, U V^T for the update's SVD U S V^T, which a Newton-Schulz iteration reaches with five
pairs of matrix products. The momentum is elementwise; the iteration is not: it needs the whole
matrix. Moonshot ("Muon is Scalable for LLM Training", 2025, arXiv 2502.16982) report about
twice AdamW's compute efficiency; so every trainer must say which rank orthogonalizes which
matrix, and how the matrix gets there:

* ``Muon``: one process. torch.optim.Muon's rule, with the iteration in the parameter's dtype.
* ``Replicated``: DDP's all-reduce; every rank orthogonalizes every matrix (N times the work).
* ``Owner``: each matrix's gradient is reduced to its owner rank, which keeps its momentum,
  orthogonalizes and updates it, then broadcasts it (modded-nanogpt's pattern).
* ``Sharded``: ZeRO-1's layout: rank r keeps the momentum of its rows of every matrix. The
  gradients are reduce-scattered into those rows; an all-to-all takes every rank's rows of the
  update to the matrix's owner, which orthogonalizes it whole; a second all-to-all sends the
  rows back; each rank updates its rows; an all-gather rebuilds the matrices.
* ``FSDPMuon``: the same two all-to-alls on lesson 2's FSDP shards, which are those rows
  already (torchtitan's pattern): no reduce-scatter, no all-gather of its own.

Owners are dealt by the iteration's cost, costliest matrix first, each to the rank with the
least so far. An m x n matrix (m <= n) costs ``ns_flops``: 5 steps x (4 m^2 n + 2 m^3) FLOPs.
The bytes each design sends per step, summed over N ranks (ring collectives: an all-reduce of
M bytes sends 2(N-1)/N M from each rank; a matrix's rows padded to N ceil(rows / N): M'):

    Replicated   all-reduce M                                    2(N-1) M
    Owner        reduce + broadcast, M each                      2(N-1) M
    Sharded      reduce-scatter, 2 all-to-alls, all-gather       2(N-1)(N+1)/N M'
    FSDPMuon     2 all-to-alls (FSDP moves the rest anyway)      2(N-1)/N M'

Use it in your own loop (this file needs only torch; copy it anywhere):

    matrices = [p for name, p in model.named_parameters() if p.ndim == 2 and "block" in name]
    muon = DESIGNS["owner"](matrices, lr=0.02)       # after dist.init_process_group(...)
    adamw = torch.optim.AdamW(others, lr=3e-4)       # embeddings, head, 1-D: average their grads
    loss_fn(model(x_local), y_local).backward()
    muon.step()                                      # averages its matrices' gradients itself
    adamw.step()

Run it against one process, and torch.optim.Muon, with the demo beside this file:
    python 07_parallelism/11_muon/run_muon.py --world-size 4
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

# --------------------------------------------------------------------------- one matrix


def newton_schulz(G: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The quintic Newton-Schulz iteration (Jordan et al. 2024): G's singular values move towards
    1 (most into about [0.7, 1.2]), its singular vectors stay. In G's dtype; G is not changed."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    tall = G.size(0) > G.size(1)
    X = G.T if tall else G  # the wide side: X X^T is the smaller square
    X = X / X.norm().clamp(min=eps)  # Frobenius norm 1, so every singular value <= 1
    for _ in range(steps):
        A = X @ X.T                                  # [m, m]
        B = torch.addmm(A, A, A, beta=b, alpha=c)    # b A + c A^2
        X = torch.addmm(X, B, X, beta=a)             # a X + B X: p(S) = a S + b S^3 + c S^5
    return X.T if tall else X


def ns_flops(shape, steps: int = 5) -> int:
    """FLOPs of ``newton_schulz`` on a matrix of ``shape``: per step X X^T, A A and B X."""
    m, n = sorted(shape[:2])
    return steps * (4 * m * m * n + 2 * m ** 3)


def momentum_update(buf: torch.Tensor, grad: torch.Tensor, momentum: float, nesterov: bool):
    """torch.optim.Muon's momentum: buf <- buf + (1 - mu)(grad - buf), and with Nesterov the
    update grad + mu (buf - grad). Elementwise: rows of the gradient give the same rows."""
    buf.lerp_(grad, 1 - momentum)
    if nesterov:
        return grad.lerp(buf, momentum)
    return buf


def apply_update(param, orthogonal, lr: float, weight_decay: float, shape) -> None:
    """Decoupled weight decay with the plain lr, then the step with lr sqrt(max(1, rows/cols))
    ("original": an update's RMS the same for tall matrices). ``shape``: the whole matrix's."""
    param.mul_(1 - lr * weight_decay)
    param.add_(orthogonal, alpha=-lr * math.sqrt(max(1, shape[0] / shape[1])))


def deal(params: list, costs: list[int], world_size: int) -> dict:
    """Owners: costliest first, each to the rank with the least cost so far (ties: the lowest
    rank, then the earlier parameter). Every rank deals the same list the same way."""
    loads = [0] * world_size
    owner = {}
    for index in sorted(range(len(params)), key=lambda i: -costs[i]):
        lightest = loads.index(min(loads))
        owner[params[index]] = lightest
        loads[lightest] += costs[index]
    return owner


# --------------------------------------------------------------------------- one process


class Muon(torch.optim.Optimizer):
    """Muon for 2-D parameters: torch.optim.Muon's rule (adjust_lr_fn "original"), but the
    iteration runs in the parameter's dtype (torch's runs in bfloat16)."""

    def __init__(self, params, lr, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, refusing what would run silently wrong (torch.optim.Muon refuses most of it)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        shapes = [tuple(param.shape) for param in group["params"] if param.ndim != 2]
        lr, momentum, decay, steps = (group[key] for key in ("lr", "momentum", "weight_decay", "ns_steps"))
        if shapes or not (0 <= lr < math.inf and 0 <= momentum < 1 and 0 <= decay < math.inf
                          and type(steps) is int and steps >= 1):
            self.param_groups.pop()  # refused: not left behind for a caller that catches the error
            raise ValueError(f"Muon: 2-D parameters only, got {shapes}; give them to AdamW" if shapes else
                             f"Muon: want lr >= 0, 0 <= momentum < 1, weight_decay >= 0 (finite) and a whole "
                             f"ns_steps >= 1; got {lr}, {momentum}, {decay}, {steps}")

    def matrices(self) -> list:
        """(parameter, its group) for every parameter, in order."""
        return [(param, group) for group in self.param_groups for param in group["params"]]

    def momentum(self, param, grad, group) -> torch.Tensor:
        """The update from this parameter's momentum (``grad``: the whole or rows of it)."""
        if "momentum_buffer" not in self.state[param]:
            self.state[param]["momentum_buffer"] = torch.zeros_like(grad)
        buf = self.state[param]["momentum_buffer"]
        return momentum_update(buf, grad, group["momentum"], group["nesterov"])

    @torch.no_grad()
    def step(self):
        self.update([param for param, _ in self.matrices()])

    def update(self, params) -> None:
        """Muon's rule on each of ``params`` that has a gradient, whole."""
        groups = dict(self.matrices())
        for param in params:
            if param.grad is not None:
                group = groups[param]
                update = self.momentum(param, param.grad, group)
                orthogonal = newton_schulz(update, group["ns_steps"])
                apply_update(param, orthogonal, group["lr"], group["weight_decay"], param.shape)


def copy_flat(flat: torch.Tensor, tensors: list) -> None:
    """One flat tensor back into ``tensors``, in order."""
    for tensor, part in zip(tensors, flat.split([tensor.numel() for tensor in tensors])):
        tensor.copy_(part.view_as(tensor))


# --------------------------------------------------------------------------- design 1


class Replicated(Muon):
    """Every gradient all-reduced (one flat call), then every rank runs Muon on everything."""

    def __init__(self, params, lr, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0,
                 group=None):
        super().__init__(params, lr, momentum, nesterov, ns_steps, weight_decay)
        self.group = group

    @torch.no_grad()
    def step(self):
        grads = [param.grad for param, _ in self.matrices() if param.grad is not None]
        flat = torch.cat([grad.flatten() for grad in grads])
        dist.all_reduce(flat, group=self.group)
        copy_flat(flat / dist.get_world_size(self.group), grads)
        super().step()


# --------------------------------------------------------------------------- design 2


class Owner(Muon):
    """One owner per matrix: it alone keeps the momentum and runs the iteration. Per owner,
    one flat reduce of its matrices' gradients and one flat broadcast of the new matrices."""

    def __init__(self, params, lr, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0,
                 group=None):
        super().__init__(params, lr, momentum, nesterov, ns_steps, weight_decay)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        params = [param for param, _ in self.matrices()]
        self.owner = deal(params, [ns_flops(param.shape) for param in params], self.world_size)

    def owned_by(self, rank: int) -> list:
        return [param for param, _ in self.matrices() if self.owner[param] == rank and param.grad is not None]

    @torch.no_grad()
    def step(self):
        for rank in range(self.world_size):  # each owner's gradients, summed on it
            grads = [param.grad for param in self.owned_by(rank)]
            if grads:
                flat = torch.cat([grad.flatten() for grad in grads])
                dist.reduce(flat, group=self.group, group_dst=rank)
                if rank == self.rank:
                    copy_flat(flat / self.world_size, grads)
        self.update(self.owned_by(self.rank))
        for rank in range(self.world_size):  # each owner's new matrices, to everyone
            params = self.owned_by(rank)
            if params:
                flat = torch.cat([param.flatten() for param in params])
                dist.broadcast(flat, group=self.group, group_src=rank)
                copy_flat(flat, params)


# --------------------------------------------------------------------------- designs 3 and 4


class Sharded(Muon):
    """ZeRO-1's layout: rank r keeps the momentum of rows [r k, (r+1) k) of every matrix,
    k = ceil(rows / N), zero-padded past the last row (lesson 2's shard layout)."""

    def __init__(self, params, lr, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0,
                 group=None):
        super().__init__(params, lr, momentum, nesterov, ns_steps, weight_decay)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.shape = {param: param.shape for param, _ in self.matrices()}  # the whole matrix's
        self.deal()

    def deal(self) -> None:
        params = [param for param, _ in self.matrices()]
        self.owner = deal(params, [ns_flops(self.shape[param]) for param in params], self.world_size)

    def rows(self, param) -> int:
        """k: the rows of ``param`` each rank holds."""
        return -(-self.shape[param][0] // self.world_size)

    def padded(self, param, matrix) -> torch.Tensor:
        """``matrix`` [rows, cols] with zero rows below: [N k, cols]."""
        out = matrix.new_zeros(self.world_size * self.rows(param), matrix.shape[1])
        out[:matrix.shape[0]] = matrix
        return out

    @torch.no_grad()
    def step(self):
        params = [param for param, _ in self.matrices() if param.grad is not None]
        scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)  # older torch: _tensor
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)      # (torch 2.13's names)
        grads = []    # this rank's rows of each averaged gradient: [k, cols]
        shards = []   # ... and of each matrix
        for param in params:
            k = self.rows(param)
            grad = param.grad.new_empty(k, param.shape[1])
            scatter(grad, self.padded(param, param.grad), group=self.group)
            grads.append(grad / self.world_size)
            shards.append(self.padded(param, param)[self.rank * k:(self.rank + 1) * k])
        self.update_shards(params, shards, grads)
        for param, shard in zip(params, shards):
            full = shard.new_empty(self.world_size * shard.shape[0], shard.shape[1])  # [N k, cols]
            gather(full, shard, group=self.group)
            param.copy_(full[:param.shape[0]])

    def update_shards(self, params, shards, grads) -> None:
        """Momentum on the rows, the iteration on the whole matrices, the step on the rows."""
        if not params:
            return
        groups = dict(self.matrices())
        updates = [self.momentum(param, grad, groups[param]) for param, grad in zip(params, grads)]
        for param, shard, rows in zip(params, shards, self.orthogonalized_rows(params, updates)):
            group = groups[param]
            apply_update(shard, rows, group["lr"], group["weight_decay"], self.shape[param])

    def orthogonalized_rows(self, params, updates) -> list:
        """This rank's rows of each orthogonalized update, each matrix whole at its owner."""
        groups = dict(self.matrices())
        whole = self.to_owners(params, updates)
        orthogonal = {}
        for param, matrix in whole.items():
            orthogonal[param] = newton_schulz(matrix, groups[param]["ns_steps"])
        return self.from_owners(params, orthogonal)

    def to_owners(self, params, updates) -> dict:
        """One all-to-all: every rank's rows of each matrix to its owner. Returns the matrices
        this rank owns, whole: parameter -> [rows, cols]."""
        order = sorted(range(len(params)), key=lambda i: self.owner[params[i]])  # by owner
        send_sizes = [0] * self.world_size  # elements for each rank
        for i in order:
            send_sizes[self.owner[params[i]]] += updates[i].numel()
        size = send_sizes[self.rank]  # each rank sends me as much as I send myself
        received = updates[0].new_empty(self.world_size * size)
        dist.all_to_all_single(received, torch.cat([updates[i].flatten() for i in order]),
                               [size] * self.world_size, send_sizes, group=self.group)
        mine = [i for i in order if self.owner[params[i]] == self.rank]
        blocks = received.view(self.world_size, size).split([updates[i].numel() for i in mine], dim=1)
        whole = {}
        for i, block in zip(mine, blocks):  # block [N, k cols]: row s rank s's rows
            whole[params[i]] = block.reshape(-1, updates[i].shape[1])[:self.shape[params[i]][0]]
        return whole

    def from_owners(self, params, orthogonal: dict) -> list:
        """One all-to-all back: the owner sends rank s its rows of each matrix. Returns this
        rank's rows of every matrix in ``params``: [k, cols] each."""
        order = sorted(params, key=self.owner.get)  # as they arrive: by owner
        sizes = [self.rows(param) * self.shape[param][1] for param in order]
        receive_sizes = [0] * self.world_size
        for param, size in zip(order, sizes):
            receive_sizes[self.owner[param]] += size
        send = [params[0].new_empty(self.world_size, 0)]  # per owned matrix [N, k cols], row s for rank s
        for param, matrix in orthogonal.items():
            send.append(self.padded(param, matrix).view(self.world_size, -1))
        received = params[0].new_empty(sum(receive_sizes))
        dist.all_to_all_single(received, torch.cat(send, dim=1).flatten(), receive_sizes,
                               [receive_sizes[self.rank]] * self.world_size, group=self.group)
        mine = dict(zip(order, received.split(sizes)))
        return [mine[param].view(self.rows(param), -1) for param in params]


class FSDPMuon(Sharded):
    """Muon over lesson 2's FSDP shards (``params``: some of ``fsdp``'s, each this rank's
    [k, cols] rows), after ``fsdp.finish_gradient_synchronization()`` averaged their gradients."""

    def __init__(self, params, fsdp, lr, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0):
        super().__init__(params, lr, momentum, nesterov, ns_steps, weight_decay, group=fsdp.group)
        for unit in fsdp.units:
            for shard, full in zip(unit.params, unit.full):
                if shard in self.shape:
                    self.shape[shard] = full.shape  # the full weight's shape (storage freed)
        self.deal()

    @torch.no_grad()
    def step(self):
        params = [param for param, _ in self.matrices() if param.grad is not None]
        self.update_shards(params, params, [param.grad for param in params])


DESIGNS = {"replicated": Replicated, "owner": Owner, "sharded": Sharded}
