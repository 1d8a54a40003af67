"""Stage 07, lesson 4: pipeline parallelism, one executor for every schedule.

What it teaches. ``one_f_one_b.py`` wrote 1F1B as three loops; here the order of work is data
(``pipeline_schedules.py``) and ``run_schedule`` runs any rank's list of steps: post the
messages planned before the step, wait for its input, then forward one micro-batch (F),
backward one (B) or compute one's weight gradients (W), and leave the output for its send.
Beyond the loops: messages go in groups (``schedules.p2p_plan``) that cannot deadlock even
where a send completes only once its receive is posted (NCCL); ``DeferredLinear``'s backward
returns dL/dx = dL/dy W (B) and leaves (x, dL/dy) for W to make dL/dW = dL/dy^T x later (the
split backward of ZB-H1, ZB-V, DualPipeV); a step names its chunk and virtual stage, so a
rank may hold several (interleaved, the V). The last stage adds ``loss_fn(output, target) / m``
per micro-batch: for a mean loss and equal micro-batches, the m backwards add up in ``.grad``
to one process's gradient.

Use it (torch and ``pipeline_schedules.py`` beside it: copy the folder whole):

    schedule = schedules.all_ranks("1f1b", stages=4, micro_batches=8)   # every rank's steps
    result = run_schedule(my_chunks, schedule, micro_inputs, micro_targets,
                          activation_shape=(rows, seq, d_model), device=device)
    optimizer.step()          # the chunks' .grad hold the whole batch's gradient
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

try:
    import pipeline_schedules as schedules      # beside this file: the schedules, as data
except ModuleNotFoundError as missing:
    if missing.name != "pipeline_schedules":
        raise
    raise ModuleNotFoundError("pipeline_parallel.py needs pipeline_schedules.py beside it: copy "
                              "the folder 04_pipeline_parallel/ whole", name=missing.name) from None

FORWARD, BACKWARD, WEIGHT = schedules.FORWARD, schedules.BACKWARD, schedules.WEIGHT


class _LinearDeferredW(torch.autograd.Function):
    """y = x W^T + b. Backward returns dL/dx = dL/dy W (B) and hands dL/dW, dL/db to
    ``layer.weight_grad`` (W): right away, or later from the layer's store."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ctx.save_for_backward(x, weight)
        ctx.layer = layer
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output @ weight              # dL/dx = dL/dy W: [..., in]
        if ctx.layer.weight_grad_store is None:
            ctx.layer.weight_grad(x, grad_output)          # W right away: an ordinary backward
        else:
            ctx.layer.weight_grad_store.append((ctx.layer, x, grad_output))   # W later
        return grad_input, None, None, None                # autograd accumulates nothing itself


class DeferredLinear(nn.Linear):
    """nn.Linear whose weight gradient can be deferred (same parameters, same init)."""
    weight_grad_store: list | None = None        # where B leaves W's work; None: W inside B

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearDeferredW.apply(x, self.weight, self.bias, self)

    @torch.no_grad()
    def weight_grad(self, x: torch.Tensor, grad_output: torch.Tensor) -> None:
        """The W work: weight.grad += dL/dy^T x, bias.grad += sum(dL/dy)."""
        grad_output = grad_output.reshape(-1, grad_output.shape[-1])   # [rows, out]
        x = x.reshape(-1, x.shape[-1])                                 # [rows, in]
        for parameter, grad in ((self.weight, grad_output.T @ x), (self.bias, grad_output.sum(0))):
            if parameter is None or not parameter.requires_grad:
                continue
            if parameter.grad is None:
                parameter.grad = grad
            else:
                parameter.grad.add_(grad)


def set_weight_grad_store(module: nn.Module, store: list | None) -> None:
    """Route every DeferredLinear's weight-gradient work into ``store`` (None: do it now)."""
    for layer in module.modules():
        if isinstance(layer, DeferredLinear):
            layer.weight_grad_store = store


class Block(nn.Module):
    """x + fc2(gelu(fc1(x))): a residual MLP block, the unit the pipeline splits on."""

    def __init__(self, d_model: int, hidden: int, linear=DeferredLinear):
        super().__init__()
        self.fc1 = linear(d_model, hidden)
        self.fc2 = linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


def build_model(layers: int, d_model: int, hidden: int, seed: int = 0,
                linear=DeferredLinear) -> nn.Sequential:
    """The whole stack, the same on every rank for a given seed (and either linear class)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(d_model, hidden, linear) for _ in range(layers)])


def chunk_layers(layers: int, stages: int, rank: int, chunks: int = 1,
                 layout: str = schedules.LOOP) -> list[range]:
    """The layers of each of ``rank``'s chunks: the stack cut into p*v equal pieces, chunk c
    being piece ``schedules.stage_of(rank, c, p, layout)``."""
    if layers % (stages * chunks):
        raise ValueError(f"{layers} layers do not split into {stages} stages x {chunks} chunks")
    per_piece = layers // (stages * chunks)
    pieces = []
    for chunk in range(chunks):
        virtual_stage = schedules.stage_of(rank, chunk, stages, layout)
        pieces.append(range(virtual_stage * per_piece, (virtual_stage + 1) * per_piece))
    return pieces


class ScheduleRunner:
    """One rank's steps: tensors held between steps by (chunk, micro-batch), messages in
    flight by ``schedules.message``."""

    def __init__(self, chunks, schedule, micro_inputs, micro_targets, activation_shape,
                 device, loss_fn, group, dtype):
        self.chunks = list(chunks)
        self.group = group
        self.rank = dist.get_rank(group)                  # this rank's place in the pipeline
        self.steps = schedule[self.rank]
        self.plan = schedules.p2p_plan(schedule)[self.rank]   # [k]: message groups before step k
        self.micro_batches = sum(1 for s in self.steps if s.op == FORWARD and s.chunk == 0)
        self.micro_inputs = micro_inputs                  # the first stage's data, else None
        self.micro_targets = micro_targets                # the last stage's targets, else None
        self.activation_shape = tuple(activation_shape)   # what crosses every stage boundary
        self.dtype = dtype
        self.device = device
        self.loss_fn = loss_fn
        self.nccl = dist.get_backend(group) == "nccl"
        self.wire = device if self.nccl else torch.device("cpu")   # Gloo sends CPU memory
        self.defer_weight_grads = any(step.op == WEIGHT for step in self.steps)
        self.inputs = {}          # the chunk's input; B sends its gradient back
        self.outputs = {}         # the chunk's output, or the loss / m on the last stage
        self.weight_work = {}     # what B left for W: (layer, x, dL/dy) per DeferredLinear
        self.inbox = {}           # receive buffers (and messages to itself)
        self.outbox = {}          # outputs waiting for their planned send
        self.arriving = {}        # Gloo: posted receives, waited for when their step comes
        self.sending = []         # Gloo: posted sends
        self.sent = []            # the tensors they send
        self.most_held = 0
        self.loss_sum = torch.zeros((), device=device)

    def post_messages(self, groups: list) -> None:
        """Post the groups ``p2p_plan`` puts before this step, each one ``batch_isend_irecv``."""
        for group in groups:
            ops = []
            for kind, peer, message in group:
                peer = peer if self.group is None else dist.get_global_rank(self.group, peer)
                if kind == "send":
                    tensor = self.outbox.pop(message)
                    self.sent.append(tensor)                # alive until every send completes
                    ops.append(dist.P2POp(dist.isend, tensor, peer, self.group))
                else:
                    self.inbox[message] = torch.empty(self.activation_shape, dtype=self.dtype,
                                                      device=self.wire)
                    ops.append(dist.P2POp(dist.irecv, self.inbox[message], peer, self.group))
            works = dist.batch_isend_irecv(ops)
            if self.nccl:
                for work in works:
                    work.wait()           # one coalesced op: the CUDA stream waits, not the host
                continue
            for (kind, _, message), work in zip(group, works):   # Gloo: one work per op
                if kind == "recv":
                    self.arriving[message] = work       # waited for when its step comes
                else:
                    self.sending.append(work)           # waited for at the end

    def wait_for_input(self, step) -> torch.Tensor | None:
        """The activation (F) or dL/d(output) (B) a neighbour sends; None for the data, the
        loss and W."""
        if step.recv_from is None:
            return None
        message = schedules.message(step)
        if message in self.arriving:                       # from another rank
            self.arriving.pop(message).wait()
        return self.inbox.pop(message).to(self.device)

    def forward_one(self, step, received: torch.Tensor | None):
        """F: one micro-batch through one chunk; the activation to send, or None on the last
        stage, where the output becomes the micro-batch's loss / m."""
        key = (step.chunk, step.micro_batch)
        if received is None:
            x = self.micro_inputs[step.micro_batch]        # the data: any dtype, token ids too
        else:
            x = received.requires_grad_()                  # B sends its gradient back
        self.inputs[key] = x
        y = self.chunks[step.chunk](x)
        if step.send_to is not None:
            self.outputs[key] = y
            return y.detach()
        loss = self.loss_fn(y, self.micro_targets[step.micro_batch]) / self.micro_batches
        self.loss_sum += loss.detach()
        self.outputs[key] = loss
        return None

    def backward_one(self, step, received: torch.Tensor | None):
        """B: one micro-batch back through one chunk from dL/d(output) (or the loss), weight
        gradients left for W under a split backward; returns dL/d(input) (None first)."""
        key = (step.chunk, step.micro_batch)
        x = self.inputs.pop(key)
        y = self.outputs.pop(key)                          # frees all but what W needs
        store = None
        if self.defer_weight_grads:
            store = []
            self.weight_work[key] = store
        set_weight_grad_store(self.chunks[step.chunk], store)
        torch.autograd.backward(y, grad_tensors=received)
        set_weight_grad_store(self.chunks[step.chunk], None)
        return x.grad

    def weight_grad_one(self, step) -> None:
        """W: the weight gradients this micro-batch's B left behind."""
        for layer, x, grad_output in self.weight_work.pop((step.chunk, step.micro_batch)):
            layer.weight_grad(x, grad_output)

    def hand_on(self, step, output: torch.Tensor) -> None:
        """Leave a step's output for its planned send (in the inbox when the next virtual
        stage is on this rank too)."""
        message = schedules.message(step, True)
        if step.send_to == self.rank:
            self.inbox[message] = output.to(self.wire)
        else:
            self.outbox[message] = output.to(self.wire).contiguous()

    def finish(self) -> None:
        """Wait for the last sends; a message or tensor left over is a broken schedule."""
        for work in self.sending:
            work.wait()
        self.sent = []
        left = [self.outputs, self.weight_work, self.inbox, self.outbox, self.arriving]
        if any(left):
            raise RuntimeError(f"rank {self.rank}: the steps left work behind: "
                               + ", ".join(str(list(held)) for held in left))


def run_schedule(chunks, schedule, micro_inputs, micro_targets, activation_shape,
                 device: torch.device, loss_fn=F.mse_loss, group=None,
                 dtype: torch.dtype = torch.float32) -> dict:
    """Run this rank's steps of ``schedule`` (every rank's, peers being ranks of ``group``);
    the gradients accumulate in ``chunks``' .grad (a list indexed by ``Step.chunk``). The m
    ``micro_inputs`` on group rank 0, their ``micro_targets`` on ``schedules.loss_rank``,
    None elsewhere; ``activation_shape``, ``dtype``: what crosses every stage boundary.
    Returns ``peak_held`` ((chunk, micro-batch) pairs held at once) and ``loss`` (the batch's
    mean on the loss rank, 0.0 elsewhere)."""
    if isinstance(chunks, nn.Module):
        chunks = [chunks]
    runner = ScheduleRunner(chunks, schedule, micro_inputs, micro_targets, activation_shape,
                            device, loss_fn, group, dtype)
    for index, step in enumerate(runner.steps):
        runner.post_messages(runner.plan[index])
        received = runner.wait_for_input(step)
        output = None
        if step.op == FORWARD:
            output = runner.forward_one(step, received)
        elif step.op == BACKWARD:
            output = runner.backward_one(step, received)
        else:
            runner.weight_grad_one(step)
        held = len(runner.outputs) + len(runner.weight_work)   # from F until B (or W)
        runner.most_held = max(runner.most_held, held)
        if step.send_to is not None:
            runner.hand_on(step, output)
    runner.post_messages(runner.plan[len(runner.steps)])       # the last sends
    runner.finish()
    return {"peak_held": runner.most_held, "loss": runner.loss_sum.item()}
