"""Stage 07, lesson 10: nine ways a distributed job stops or goes quietly wrong, each planted
in a few lines of ordinary training code behind ``plant=True`` (False runs the same code
without the bug: the control that must not raise an alarm).

Every scenario is ``scenario(rank, world_size, group, plant)`` on every rank of ``group``, and
rank 1 carries the plant. run_hangs.py runs them under torch's Flight Recorder and diagnoses
each; read a scenario, then its line there. Torch alone: copy this file and call one.
"""

import time

import torch
import torch.distributed as dist


def skip_collective(rank, world_size, group, plant):
    """Uneven data: rank 1's shard is one batch shorter, so it leaves the loop a step early
    and never calls the last all-reduce; the others wait for it."""
    batches = 3
    if plant and rank == 1:
        batches = 2
    for _ in range(batches):
        grad = torch.full((4,), float(rank))
        dist.all_reduce(grad, group=group)


def wrong_order(rank, world_size, group, plant):
    """Rank 1 broadcasts rank 0's weights before it averages the gradients; the others after:
    its first collective is another op than its peers' first."""
    grad = torch.ones(4)
    weights = torch.ones(4)
    if plant and rank == 1:
        dist.broadcast(weights, 0, group=group)
        dist.all_reduce(grad, group=group)
    else:
        dist.all_reduce(grad, group=group)
        dist.broadcast(weights, 0, group=group)


def dtype_mismatch(rank, world_size, group, plant):
    """Rank 1 counts its tokens as an integer, the others as a float: the same 8 bytes, so
    Gloo sums them without a word and every rank gets a wrong count. No hang: only the
    recorder's dtypes show it."""
    tokens = 512
    count = torch.tensor([float(tokens)], dtype=torch.float64)
    if plant and rank == 1:
        count = torch.tensor([tokens])  # int64
    dist.all_reduce(count, group=group)


def divergent_branch(rank, world_size, group, plant):
    """Gradient clipping decided on each rank's own norm: rank 1's is large, so only rank 1
    all-reduces the norm. Its extra call pairs with the others' loss all-reduce (same shape),
    and its own loss all-reduce then waits for a partner that never comes."""
    grad = torch.ones(4)
    dist.all_reduce(grad, group=group)
    local_norm = grad.norm() / world_size  # the averaged gradient's: 2 on any number of ranks
    if plant and rank == 1:
        local_norm = local_norm * 100
    if local_norm > 10.0:
        squared = local_norm.square().reshape(1)
        dist.all_reduce(squared, group=group)  # the branch only rank 1 takes
    loss = torch.ones(1)
    dist.all_reduce(loss, group=group)


def send_recv_deadlock(rank, world_size, group, plant):
    """Neighbours 0-1, 2-3, ... swap a tensor. Planted: both send first; a blocking send waits
    for its receiver (Gloo always; NCCL once the message outgrows its buffers), so both wait
    forever. The control posts both at once, as NCCL wants it: the next scenario's batch."""
    if not plant:
        return send_recv_rejected(rank, world_size, group, plant)
    dist.send(torch.full((4,), float(rank)), rank ^ 1, group=group)
    dist.recv(torch.empty(4), rank ^ 1, group=group)


def send_recv_rejected(rank, world_size, group, plant):
    """The same swap as one batch, but rank 1 writes its receive without ``group`` (P2POp's
    default: the world group). On NCCL a batch is one group call on one communicator, so torch
    refuses a batch on two groups (a ValueError, on every backend) before posting anything:
    rank 1 stops there, and rank 0 waits for a message that never comes."""
    recv_group = None if plant and rank == 1 else group
    ops = [dist.P2POp(dist.isend, torch.full((4,), float(rank)), rank ^ 1, group),
           dist.P2POp(dist.irecv, torch.empty(4), rank ^ 1, recv_group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()


def pipeline_fewer_micro_batches(rank, world_size, group, plant):
    """1F1B (lesson 4's three loops: sends that do not wait, receives that do) with as many
    stages as ranks and fewer micro-batches than stages. Planted: the warm-up forgets
    ``min(..., micro_batches)``, so rank 0 runs one forward too many and then waits for a
    backward that rank 1 never sends."""
    stages = world_size
    micro_batches = stages // 2  # < stages - 1 from 4 stages up
    warmup = min(stages - 1 - rank, micro_batches)
    if plant:
        warmup = stages - 1 - rank
    sends = []

    def forward():
        activation = torch.zeros(2)
        if rank > 0:
            dist.recv(activation, rank - 1, group=group)
        if rank < stages - 1:
            sends.append(dist.isend(activation + 1, rank + 1, group=group))

    def backward():
        grad = torch.zeros(2)
        if rank < stages - 1:
            dist.recv(grad, rank + 1, group=group)
        if rank > 0:
            sends.append(dist.isend(grad + 1, rank - 1, group=group))

    for _ in range(warmup):
        forward()
    for _ in range(micro_batches - warmup):
        forward()
        backward()
    for _ in range(warmup):
        backward()
    for request in sends:
        request.wait()


def all_to_all_splits(rank, world_size, group, plant):
    """Expert parallelism's token exchange: every rank sends 2 rows to every rank. Rank 1
    counts one more row from rank 0 than rank 0 sends (its own guess, not the exchanged
    counts): Gloo fills what arrives and leaves the rest, no error, no hang."""
    send_splits = [2] * world_size
    recv_splits = [2] * world_size
    if plant and rank == 1:
        recv_splits[0] = 3
    tokens = torch.full((sum(send_splits),), float(rank))
    received = torch.zeros(sum(recv_splits))
    dist.all_to_all_single(received, tokens, recv_splits, send_splits, group=group)


def straggler(rank, world_size, group, plant):
    """Four steps of 20 ms compute and an all-reduce; rank 1 computes 10x longer. Not a hang:
    every collective completes, the others just wait for rank 1 at each one."""
    compute_s = 0.02
    if plant and rank == 1:
        compute_s = 0.2
    for _ in range(4):
        time.sleep(compute_s)
        grad = torch.ones(4)
        dist.all_reduce(grad, group=group)


SCENARIOS = {f.__name__: f for f in (
    skip_collective, wrong_order, dtype_mismatch, divergent_branch, send_recv_deadlock,
    send_recv_rejected, pipeline_fewer_micro_batches, all_to_all_splits, straggler)}
