"""Stage 07, lesson 4: pipeline parallelism, the executor that runs any schedule.

Read ``one_f_one_b.py`` first: 1F1B as three loops over sends and receives. This file
generalises it in three ways.

1. The order of work is data. ``pipeline_schedules.py`` (no torch) gives every rank its list
   of ``Step``s for six schedules (p stages, m micro-batches, v chunks per rank):

   * GPipe: all forwards, then all backwards; idle (p-1)/(m+p-1), holds m micro-batches.
   * 1F1B: the same idle, holds at most p (each backward frees one before a forward stores one).
   * interleaved 1F1B: v chunks of layers per rank; idle (p-1)/(vm+p-1).
   * ZB-H1 (zero bubble): the backward split into B, the input's gradient that the previous
     stage waits for, and W, the weight gradients nobody waits for, which fill the bubble:
     idle (p-1)/(3m+p-1) with equal F, B, W.
   * ZB-V and DualPipeV: two chunks per rank in a V (rank r holds pieces r and 2p-1-r of
     the model, so the loss is on rank 0), split backwards; idle (p-1)/(6m+p-1) (ZB-V:
     when m >= (3p-1)/2; DualPipeV runs from m = 2p).

   ``run_schedule`` executes any such list, one step at a time, in named parts: post the
   messages planned before the step, wait for the step's input, then forward one
   micro-batch (F), backward one (B) or compute one's weight gradients (W), and hand the
   output to the send that the plan posts next.

2. The messages are planned (``pipeline_schedules.p2p_plan``): sends and receives are posted
   in groups, each one ``batch_isend_irecv``, in an order that cannot deadlock even where a
   send waits for its receive (NCCL); a receive is posted early and waited for right before
   its step.

3. The split backward (ZB-H1, ZB-V, DualPipeV). ``DeferredLinear`` is an ``nn.Linear``
   whose backward returns the input's gradient, dL/dx = dL/dy W (B), and leaves (x, dL/dy)
   in a store for W to turn into dL/dW = dL/dy^T x and dL/db = sum(dL/dy) later: real work
   moved in time, not a second backward. Layers of other kinds get their weight gradients
   in B, as usual.

The V layout (ZB-V, DualPipeV) needs nothing more of the executor: the steps carry the
virtual stage each runs, so a message to the next stage goes to whichever rank holds it
(kept in this rank's inbox when that is itself, as on rank p-1, where the V turns); the
rank whose forward sends nothing computes the loss (rank 0); ``chunk_layers(...,
layout=schedules.V)`` gives each rank its two pieces.

Loss scaling. The last stage computes ``loss_fn(output, target) / m`` for each micro-batch:
with a ``loss_fn`` that averages over its micro-batch and equal micro-batches, the m
backwards add up in ``.grad`` to the gradient of the mean loss over the whole batch, which
is what one process computes. Data-parallel replicas, if any, average on top of that.

The executor runs the schedule and nothing else: no clock, no barrier, no wait for the GPU
between steps (that would drain the queue after every step and remove the overlap the
schedules exist for). ``run_pipeline.py`` beside it checks it against one process;
``07_parallelism/measure/bench_pipeline.py`` times it from outside (a timer around each
step, emulated compute as chunks that only wait).

Use it (this file needs torch and ``pipeline_schedules.py``: copy the folder whole):

    import pipeline_schedules as schedules
    from pipeline_parallel import run_schedule
    schedule = schedules.all_ranks("1f1b", stages=4, micro_batches=8)   # every rank's steps
    model_chunk.zero_grad()
    result = run_schedule(model_chunk, schedule, micro_inputs, micro_targets,
                          activation_shape=(rows, seq, d_model), device=device,
                          loss_fn=my_loss, group=pipeline_group)
    optimizer.step()          # model_chunk's .grad hold the whole batch's gradient

The model below (residual MLP ``Block``s, ``build_model``, ``chunk_layers``) is the lesson's
demo; a chunk may be any ``nn.Module``: the first may embed token ids, the last may end in
logits for ``loss_fn``.
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

FORWARD = schedules.FORWARD
BACKWARD = schedules.BACKWARD
WEIGHT = schedules.WEIGHT

# --------------------------------------------------------------------------- the model


class _LinearDeferredW(torch.autograd.Function):
    """y = x W^T + b. Backward returns dL/dx = dL/dy W (B) and leaves dL/dW and dL/db to
    ``layer.weight_grad`` (W): right away, or later from the layer's store."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ctx.save_for_backward(x, weight)
        ctx.layer = layer
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        layer = ctx.layer
        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output @ weight              # dL/dx = dL/dy W: [..., in]
        if layer.weight_grad_store is None:
            layer.weight_grad(x, grad_output)              # W right away: an ordinary backward
        else:
            layer.weight_grad_store.append((layer, x, grad_output))   # W later
        return grad_input, None, None, None                # autograd accumulates nothing itself


def _accumulate(parameter: nn.Parameter, grad: torch.Tensor) -> None:
    if parameter.grad is None:
        parameter.grad = grad
    else:
        parameter.grad.add_(grad)


class DeferredLinear(nn.Linear):
    """nn.Linear whose weight gradient can be deferred (same parameters, same init)."""
    weight_grad_store: list | None = None        # where B leaves W's work; None: W inside B

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearDeferredW.apply(x, self.weight, self.bias, self)

    @torch.no_grad()
    def weight_grad(self, x: torch.Tensor, grad_output: torch.Tensor) -> None:
        """The W work: accumulate dL/dy^T x into weight.grad and sum(dL/dy) into bias.grad."""
        grad_output = grad_output.reshape(-1, grad_output.shape[-1])   # [rows, out]
        x = x.reshape(-1, x.shape[-1])                                 # [rows, in]
        if self.weight.requires_grad:
            _accumulate(self.weight, grad_output.T @ x)                # [out, in]
        if self.bias is not None and self.bias.requires_grad:
            _accumulate(self.bias, grad_output.sum(0))                 # [out]


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
    blocks = [Block(d_model, hidden, linear) for _ in range(layers)]
    return nn.Sequential(*blocks)


def chunk_layers(layers: int, stages: int, rank: int, chunks: int = 1,
                 layout: str = schedules.LOOP) -> list[range]:
    """The layers of each of rank's chunks: the stack cut into p*v equal pieces ("virtual
    stages"), rank r's chunk c being piece ``schedules.stage_of(r, c, p, layout)``: piece
    c*p + r on the loop layout (v = 1: one contiguous share per rank), pieces r and 2p-1-r
    on the V layout (``schedules.layout_of(name)`` says which a schedule runs)."""
    if layers % (stages * chunks):
        raise ValueError(f"{layers} layers do not split into {stages} stages x {chunks} chunks")
    per_piece = layers // (stages * chunks)
    pieces = []
    for chunk in range(chunks):
        virtual_stage = schedules.stage_of(rank, chunk, stages, layout)
        pieces.append(range(virtual_stage * per_piece, (virtual_stage + 1) * per_piece))
    return pieces


# --------------------------------------------------------------------------- the executor


class ScheduleRunner:
    """One rank running its steps of a schedule: its chunks, what it holds between steps,
    and the messages in flight. ``run_schedule`` drives it one step at a time."""

    def __init__(self, chunks, schedule: list[list[schedules.Step]], micro_inputs, micro_targets,
                 activation_shape, device: torch.device, loss_fn, group, dtype: torch.dtype):
        if isinstance(chunks, nn.Module):
            chunks = [chunks]
        self.chunks = list(chunks)
        self.group = group
        self.rank = dist.get_rank(group)                  # this rank's place in the pipeline
        self.stages = len(schedule)
        self.steps = schedule[self.rank]
        self.plan = schedules.p2p_plan(schedule)[self.rank]   # [k]: message groups before step k
        self.micro_batches = 0
        for step in self.steps:
            if step.op == FORWARD and step.chunk == 0:
                self.micro_batches += 1
        self.micro_inputs = micro_inputs                  # the first stage's data, else None
        self.micro_targets = micro_targets                # the last stage's targets, else None
        self.activation_shape = tuple(activation_shape)   # what crosses every stage boundary
        self.dtype = dtype
        self.device = device
        self.loss_fn = loss_fn
        self.nccl = dist.get_backend(group) == "nccl"
        if self.nccl:
            self.wire = device                            # NCCL sends GPU memory
        else:
            self.wire = torch.device("cpu")               # Gloo sends through CPU memory
        self.defer_weight_grads = any(step.op == WEIGHT for step in self.steps)
        # What this rank holds, keyed by (chunk, micro_batch):
        self.inputs = {}          # the chunk's input; B sends its gradient back
        self.outputs = {}         # the chunk's output, or the loss on the last stage
        self.weight_work = {}     # what B left for W: (layer, x, dL/dy) per DeferredLinear
        # Messages, keyed by schedules.message: (op, micro-batch, virtual stage receiving it).
        self.inbox = {}           # receive buffers (and, on one rank, messages to itself)
        self.outbox = {}          # outputs waiting for their planned send
        self.arriving = {}        # Gloo: posted receives not waited for yet
        self.sends_in_flight = []     # Gloo: posted sends, waited for at the end
        self.sent_tensors = []        # kept alive until every send has completed
        self.most_held = 0
        self.loss_sum = torch.zeros((), device=device)

    def global_rank(self, peer: int) -> int:
        """Peers in the schedule are ranks within the pipeline group; P2P ops take global ones."""
        if self.group is None:
            return peer
        return dist.get_global_rank(self.group, peer)

    def post_messages(self, groups: list) -> None:
        """Post the sends and receives that ``p2p_plan`` puts before this step, each group as
        one ``batch_isend_irecv``. Nothing waits here."""
        for group in groups:
            ops = []
            for kind, peer, message in group:
                if kind == "send":
                    tensor = self.outbox.pop(message)
                    self.sent_tensors.append(tensor)
                    ops.append(dist.P2POp(dist.isend, tensor, self.global_rank(peer), self.group))
                else:
                    buffer = torch.empty(self.activation_shape, dtype=self.dtype, device=self.wire)
                    self.inbox[message] = buffer
                    ops.append(dist.P2POp(dist.irecv, buffer, self.global_rank(peer), self.group))
            works = dist.batch_isend_irecv(ops)
            if self.nccl:
                # One coalesced operation: waiting on it makes this rank's CUDA stream wait
                # (the host goes on), so every later use of a buffer runs after it.
                for work in works:
                    work.wait()
                continue
            for index, work in enumerate(works):          # Gloo: one work per operation
                kind = group[index][0]
                message = group[index][2]
                if kind == "recv":
                    self.arriving[message] = work
                else:
                    self.sends_in_flight.append(work)

    def wait_for_input(self, step: schedules.Step) -> torch.Tensor | None:
        """The tensor a step starts from when a neighbour sends it: an activation (F) or the
        gradient of the step's output (B). None when it reads the data or the loss, and for W."""
        if step.recv_from is None:
            return None
        message = schedules.message(step)
        if message in self.arriving:                       # from another rank
            self.arriving.pop(message).wait()
        return self.inbox.pop(message).to(self.device)

    def forward_one(self, step: schedules.Step, received: torch.Tensor | None):
        """F: one micro-batch through one chunk. Returns the activation to send on, or None
        on the last stage, where the output becomes the micro-batch's loss / m."""
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
        target = self.micro_targets[step.micro_batch]
        loss = self.loss_fn(y, target) / self.micro_batches     # the m losses add up to the mean
        self.loss_sum += loss.detach()
        self.outputs[key] = loss
        return None

    def backward_one(self, step: schedules.Step, received: torch.Tensor | None):
        """B: backpropagate one micro-batch through one chunk, from the gradient of its output
        (received; None on the last stage: from the loss). Under a schedule with W's the
        DeferredLinear layers leave their weight gradients for W. Returns dL/d(input) for the
        previous stage."""
        key = (step.chunk, step.micro_batch)
        x = self.inputs.pop(key)
        y = self.outputs.pop(key)                          # frees all but what W needs
        chunk = self.chunks[step.chunk]
        if self.defer_weight_grads:
            store = []
            set_weight_grad_store(chunk, store)
            torch.autograd.backward(y, grad_tensors=received)
            set_weight_grad_store(chunk, None)
            self.weight_work[key] = store
        else:
            torch.autograd.backward(y, grad_tensors=received)
        return x.grad                                      # None on the first stage: not sent

    def weight_grad_one(self, step: schedules.Step) -> None:
        """W: the weight gradients that this micro-batch's B left behind."""
        key = (step.chunk, step.micro_batch)
        for layer, x, grad_output in self.weight_work.pop(key):
            layer.weight_grad(x, grad_output)

    def held(self) -> int:
        """(chunk, micro-batch) pairs whose tensors this rank holds now: from F to B (to W)."""
        return len(self.outputs) + len(self.weight_work)

    def hand_on(self, step: schedules.Step, output: torch.Tensor | None) -> None:
        """Leave a step's output for the send that ``p2p_plan`` posts next (in the inbox when
        the next virtual stage is on this rank too: one rank, or the V's turn on rank p-1)."""
        _check_boundary(self, step, output)
        message = schedules.message(step, True)
        on_wire = output.to(self.wire).contiguous()
        if step.send_to == self.rank:
            self.inbox[message] = on_wire
        else:
            self.outbox[message] = on_wire

    def finish(self) -> None:
        """Wait for the last sends; refuse a schedule that left work behind."""
        for work in self.sends_in_flight:
            work.wait()
        self.sends_in_flight = []
        self.sent_tensors = []
        if self.outputs or self.weight_work or self.inbox or self.outbox:
            raise RuntimeError(f"rank {self.rank}: the steps left work behind: "
                               f"{sorted(self.outputs)}, {sorted(self.weight_work)}, "
                               f"{list(self.inbox)}, {list(self.outbox)}")


def run_schedule(chunks, schedule: list[list[schedules.Step]], micro_inputs, micro_targets,
                 activation_shape, device: torch.device, loss_fn=F.mse_loss,
                 group: dist.ProcessGroup | None = None,
                 dtype: torch.dtype = torch.float32) -> dict:
    """Run this rank's steps of ``schedule``; the gradients accumulate in the chunks' .grad.

    ``chunks``: this rank's model chunk(s), an ``nn.Module`` or a list indexed by
    ``Step.chunk`` (interleaved: v of them). ``schedule``: every rank's steps
    (``pipeline_schedules.all_ranks``); peers in it are ranks within ``group``, the pipeline's
    process group (None: the default group). ``micro_inputs``: the m micro-batches on the
    rank holding the first stage (group rank 0), else None; ``micro_targets``: their targets
    on the rank holding the last (group rank p-1; rank 0 on the V layout), else None.
    ``activation_shape`` and ``dtype``: the tensor that crosses every stage boundary, forward
    (the activation) and backward (its gradient). The last stage adds
    ``loss_fn(output, target) / m`` per micro-batch.

    Returns ``peak_held`` (most (chunk, micro-batch) pairs held at once) and ``loss`` (the
    batch's mean loss on the last stage's rank, 0.0 elsewhere).
    """
    _check_arguments(chunks, schedule, micro_inputs, micro_targets, group)
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
        runner.most_held = max(runner.most_held, runner.held())
        if step.send_to is not None:
            runner.hand_on(step, output)
    runner.post_messages(runner.plan[len(runner.steps)])   # the last sends
    runner.finish()
    return {"peak_held": runner.most_held, "loss": runner.loss_sum.item()}


# --------------------------------------------------------------------------- argument checks
# What a wrong call gets instead of a hang or a shape error deep inside a send: one line,
# alike on every rank, before any message is posted.


def _check_arguments(chunks, schedule: list[list[schedules.Step]], micro_inputs, micro_targets,
                     group) -> None:
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"rank {dist.get_rank()} is not in the pipeline group it was given")
    stages = len(schedule)
    if stages != dist.get_world_size(group):
        raise ValueError(f"the schedule has {stages} stages but the pipeline group has "
                         f"{dist.get_world_size(group)} ranks")
    # A broken schedule (an F after its B, a wrong peer, a message received out of order).
    schedules.check_order(schedule)
    steps = schedule[rank]
    if isinstance(chunks, nn.Module):
        chunks = [chunks]
    chunks_in_schedule = 1 + max(step.chunk for step in steps)
    if len(chunks) != chunks_in_schedule:
        raise ValueError(f"rank {rank}: {len(chunks)} model chunk(s) given, the schedule runs "
                         f"{chunks_in_schedule}")
    micro_batches = 0
    reads_data = False        # a forward that receives nothing: the first stage is here
    computes_loss = False     # a forward that sends nothing: the last stage is here
    for step in steps:
        if step.op == FORWARD and step.chunk == 0:
            micro_batches += 1
        if step.op == FORWARD and step.recv_from is None:
            reads_data = True
        if step.op == FORWARD and step.send_to is None:
            computes_loss = True
    if reads_data and len(micro_inputs or []) != micro_batches:
        raise ValueError(f"rank {rank} holds the first stage: it needs micro_inputs, "
                         f"{micro_batches} of them")
    if computes_loss and len(micro_targets or []) != micro_batches:
        raise ValueError(f"rank {rank} holds the last stage: it needs micro_targets, "
                         f"{micro_batches} of them")


def _check_boundary(runner: ScheduleRunner, step: schedules.Step, output) -> None:
    """What a step hands on must be the tensor every stage boundary carries."""
    if output is None or output.shape != runner.activation_shape or output.dtype != runner.dtype:
        made = "nothing" if output is None else f"{tuple(output.shape)} {output.dtype}"
        raise ValueError(f"rank {runner.rank}: {step.op}{step.micro_batch} of chunk "
                         f"{step.chunk} made {made}, but every stage boundary carries "
                         f"activation_shape {runner.activation_shape} {runner.dtype}")
