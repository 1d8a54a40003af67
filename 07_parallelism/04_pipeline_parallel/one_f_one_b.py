"""Stage 07, lesson 4, read this first: the 1F1B pipeline schedule in three plain loops.

What it teaches. Pipeline parallelism gives each of p ranks a few consecutive layers of the
model (a "stage") and cuts the batch into m micro-batches. A micro-batch's activation goes
forward rank 0 -> 1 -> ... -> p-1 with point-to-point sends; the last rank computes the loss;
the gradient of the loss with respect to each stage's input goes back p-1 -> ... -> 0. What
the ranks add up to is exactly one process's gradient on the whole batch, because

    loss(batch) = mean over micro-batches of loss(micro-batch) = sum_i loss_i / m

for a mean loss and equal micro-batches: each micro-batch's loss is divided by m, and the
gradients of the m backwards accumulate in ``.grad`` as they would in one process.

1F1B ("one forward, one backward", Narayanan et al., 2019, PipeDream; synchronous as in
Megatron-LM) orders each rank's work in three loops:

1. warm-up: p-1-r forwards (rank r). Just enough that when this rank is ready for its first
   backward, the gradient of micro-batch 0 is on its way back from the last rank;
2. steady state: one forward, then one backward, until every micro-batch has gone forward;
3. drain: the backwards left, p-1-r of them.

A backward frees its micro-batch's saved activations before the next forward saves new ones,
so rank r never holds more than p-r micro-batches, however large m is: m can grow to shrink
the pipeline's idle share (p-1)/(m+p-1) at no cost in memory. (GPipe, all forwards then all
backwards, idles as much but holds all m.)

Messages. Sends are posted with ``dist.isend`` and waited for at the end; receives block
(``dist.recv``). On Gloo, which these loops are written for, posting a send never waits, so
ranks cannot block one another. On NCCL a send can wait until its peer posts the matching
receive, and in the steady state rank r sends forward while rank r+1 sends backward: both
would wait. ``pipeline_parallel.py`` runs any schedule, 1F1B included, with messages planned
so that they cannot deadlock on NCCL either. Gloo moves CPU memory: tensors travel through it.

Use it (this file needs torch alone; ``run_pipeline.py`` checks it against one process):

    stage = Stage(my_layers, activation_shape=(rows, d_model), device=device,
                  loss_fn=F.mse_loss, micro_batches=m)          # after init_process_group
    one_f_one_b(stage, micro_inputs, micro_targets)             # inputs on rank 0, targets on p-1
    optimizer.step()                                            # my_layers' .grad are ready
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
import torch.nn as nn


class Stage:
    """This rank's layers, its neighbours, and the micro-batches it holds between forward
    and backward."""

    def __init__(self, module: nn.Module, activation_shape, device: torch.device, loss_fn,
                 micro_batches: int, dtype: torch.dtype = torch.float32):
        self.module = module
        self.activation_shape = tuple(activation_shape)    # what crosses every boundary
        self.dtype = dtype
        self.device = device
        self.loss_fn = loss_fn
        self.micro_batches = micro_batches
        self.rank = dist.get_rank()
        self.stages = dist.get_world_size()
        self.is_first = self.rank == 0
        self.is_last = self.rank == self.stages - 1
        self.previous_rank = self.rank - 1
        self.next_rank = self.rank + 1
        if dist.get_backend() == "gloo":
            self.wire = torch.device("cpu")                 # Gloo sends CPU tensors
        else:
            self.wire = device
        # (input, output) of every micro-batch forwarded and not yet backwarded, oldest
        # first: 1F1B finishes micro-batches in the order it starts them.
        self.held = deque()
        self.most_held = 0
        self.pending_sends = []
        self.loss = 0.0                                     # the batch's loss, last stage only

    def send(self, tensor: torch.Tensor, to_rank: int) -> None:
        message = tensor.detach().to(self.wire).contiguous()
        self.pending_sends.append(dist.isend(message, dst=to_rank))

    def receive(self, from_rank: int) -> torch.Tensor:
        buffer = torch.empty(self.activation_shape, dtype=self.dtype, device=self.wire)
        dist.recv(buffer, src=from_rank)
        return buffer.to(self.device)

    def forward(self, micro_batch: int, micro_inputs, micro_targets) -> None:
        """Forward one micro-batch: take its input (the data, or the activation the previous
        rank sends), run this rank's layers, pass the output on (or turn it into the loss)."""
        if self.is_first:
            stage_input = micro_inputs[micro_batch]
        else:
            stage_input = self.receive(self.previous_rank)
            stage_input.requires_grad_()                    # its gradient goes back
        stage_output = self.module(stage_input)
        if self.is_last:
            target = micro_targets[micro_batch]
            # divided by m: the m micro-batch losses add up to the batch's mean loss
            loss = self.loss_fn(stage_output, target) / self.micro_batches
            self.loss += loss.item()
            stage_output = loss
        else:
            self.send(stage_output, self.next_rank)
        self.held.append((stage_input, stage_output))
        self.most_held = max(self.most_held, len(self.held))

    def backward(self) -> None:
        """Backward the oldest micro-batch held: receive dL/d(output) from the next rank (the
        last rank starts from its loss), backpropagate through this rank's layers (the weight
        gradients accumulate in .grad), send dL/d(input) to the previous rank."""
        stage_input, stage_output = self.held.popleft()
        if self.is_last:
            stage_output.backward()                         # from the loss
        else:
            grad_output = self.receive(self.next_rank)      # dL/d(output), same shape as it
            stage_output.backward(grad_output)
        if not self.is_first:
            self.send(stage_input.grad, self.previous_rank)  # dL/d(input)

    def wait_for_sends(self) -> None:
        for work in self.pending_sends:
            work.wait()
        self.pending_sends = []


def warmup_forwards(rank: int, stages: int, micro_batches: int) -> int:
    """p-1-r: micro-batch 0 needs p-1-r more forwards downstream and p-1-r backwards back
    upstream before rank r can run its backward; those forwards fill that wait."""
    return min(stages - 1 - rank, micro_batches)


def one_f_one_b(stage: Stage, micro_inputs, micro_targets) -> dict:
    """Run one training step's forwards and backwards on this rank in 1F1B order.

    ``micro_inputs``: the m micro-batches on the first rank (None elsewhere);
    ``micro_targets``: their targets on the last rank (None elsewhere). Gradients accumulate
    in the stage's parameters (zero them before, as for any backward). Returns the loss
    (the batch's mean, on the last rank; 0.0 on the others) and the most micro-batches held.
    """
    micro_batches = stage.micro_batches
    warmup = warmup_forwards(stage.rank, stage.stages, micro_batches)
    stage.loss = 0.0                                        # this step's, not the last one's
    stage.most_held = 0

    # 1. warm-up: fill the pipe
    for micro_batch in range(warmup):
        stage.forward(micro_batch, micro_inputs, micro_targets)

    # 2. steady state: one forward, one backward (of the oldest micro-batch held)
    for micro_batch in range(warmup, micro_batches):
        stage.forward(micro_batch, micro_inputs, micro_targets)
        stage.backward()

    # 3. drain: the backwards left
    for _ in range(warmup):
        stage.backward()

    stage.wait_for_sends()
    return {"loss": stage.loss, "peak_held": stage.most_held}
