"""Stage 07, lesson 7: everything together. The Transformer LM split four ways at once.

Each earlier lesson split one thing: the batch (03-06), the weights inside a layer (lesson 3),
the depth (lesson 4), the sequence (lesson 5). This file composes them on a grid of ranks
(``grid.ProcessGrid``) and adds only what composing needs:

1. Who holds which tokens: of a global batch [batch, seq], rank (dp_i, cp_j, tp_k) holds rows
   dp_i, of the sequence the zig-zag shard cp_j, and between the tensor-parallel regions the
   tp_k-th slice of that (sequence parallelism): [batch/dp, seq/(cp tp)] tokens, with their
   GLOBAL positions (the position embedding and the causal mask need them).
2. Which piece of the model: the pipeline rank's blocks (one share, or v chunks interleaved),
   each lesson 3's ``TensorParallelBlock`` with lesson 5's ring attention over cp; the first
   virtual stage also holds the embeddings, the last the final norm and the head (both whole
   on every tp rank).
3. Where the loss is averaged. R = dp x cp x tp ranks hold different tokens of the batch, so

       loss = (1/R) sum_ranks mean_(my tokens) CE      (R = dp * cp * tp)

   and every gradient is a SUM: over tp for the parameters every tp rank holds whole (inside
   a tensor-parallel region the sequence-parallel collectives already sum), then everything
   over dp and cp together ("dp_cp"). Forget the cp part or the 1/R and the model trains
   wrong: the tests plant both and watch them fail.
4. Where each parameter sits in the full model (``placements``): the pieces put back together
   (``full_state_dict``) and checkpointed (lesson 8).
5. HSDP (dp = dp_replicate x dp_shard, ``shard_chunks``): each chunk in lesson 2's FSDP over
   "dp_shard"; each gradient block then summed over "dp_replicate" alone (over the whole
   data axis it would add other ranks' blocks into this one).

Torch alone, plus the lessons' files it composes (train.py puts them on the path):
``tensor_parallel.py``, ``pipeline_parallel.py``, ``pipeline_schedules.py``,
``context_parallel.py``, and for HSDP ``fsdp.py``.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import context_parallel
import pipeline_parallel
import pipeline_schedules
import tensor_parallel

LAYOUT = "zigzag"  # the context-parallel layout: every cp rank does the same attention work


def local_tokens(tokens: torch.Tensor, grid) -> torch.Tensor:
    """This rank's part of a global [batch, seq] tensor (inputs, targets or positions):
    rows over dp, the sequence over cp (zig-zag), then that over tp (contiguous slices)."""
    rows_per_rank = tokens.shape[0] // grid.size("dp")
    first_row = grid.rank("dp") * rows_per_rank
    mine = tokens[first_row:first_row + rows_per_rank]
    mine = context_parallel.shard_sequence(mine, 1, grid.rank("cp"), grid.size("cp"), LAYOUT)
    per_tp_rank = mine.shape[1] // grid.size("tp")      # sequence parallelism: seq / (cp tp)
    first = grid.rank("tp") * per_tp_rank
    return mine[:, first:first + per_tp_rank]


class Embedding(nn.Module):
    """Token + position embeddings of this rank's tokens (the first pipeline stage)."""

    def __init__(self, full_lm: nn.Module, positions: torch.Tensor):
        super().__init__()
        self.token_embedding = copy.deepcopy(full_lm.token_embedding)
        self.position_embedding = copy.deepcopy(full_lm.position_embedding)
        self.register_buffer("positions", positions.clone(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens [micro_batch, local_seq] -> [micro_batch, local_seq, d_model]
        return self.token_embedding(tokens) + self.position_embedding(self.positions)


class Head(nn.Module):
    """Final LayerNorm and vocabulary projection on this rank's tokens (the last stage)."""

    def __init__(self, full_lm: nn.Module):
        super().__init__()
        self.norm = copy.deepcopy(full_lm.norm)
        self.lm_head = copy.deepcopy(full_lm.lm_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))    # logits [micro_batch, local_seq, vocab]


class StageChunk(nn.Module):
    """One model chunk of this pipeline rank: some consecutive blocks, with the embeddings in
    front on the first virtual stage and the head after them on the last."""

    def __init__(self, embedding, blocks: list[nn.Module], layer_numbers: range, head):
        super().__init__()
        self.embedding = embedding                  # None except on the first virtual stage
        self.blocks = nn.ModuleList(blocks)
        self.layer_numbers = layer_numbers          # the blocks' places in the full model
        self.head = head                            # None except on the last virtual stage
        # HSDP: [the FSDP wrapping this chunk] (a list: a module may not hold its parent)
        self.sharded_by = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(x)
        return x


def build_chunks(full_lm: nn.Module, grid, seq_len: int, chunks_per_rank: int = 1) -> list:
    """This rank's model chunks, sliced from ``full_lm`` (the same on every rank); with
    ``chunks_per_rank`` > 1 (interleaved) virtual stage c * pp + r is chunk c of rank r."""
    pp = grid.size("pp")
    num_layers = len(full_lm.blocks)
    ranges = pipeline_parallel.chunk_layers(num_layers, pp, grid.rank("pp"), chunks_per_rank)
    last_virtual_stage = pp * chunks_per_rank - 1
    chunks = []
    for chunk_index, layer_numbers in enumerate(ranges):
        virtual_stage = chunk_index * pp + grid.rank("pp")
        embedding = None
        if virtual_stage == 0:     # the global positions of this rank's tokens, cut the same
            positions = torch.arange(seq_len).expand(grid.size("dp"), seq_len)   # [dp, seq]
            embedding = Embedding(full_lm, local_tokens(positions, grid)[0])
        head = None
        if virtual_stage == last_virtual_stage:
            head = Head(full_lm)
        blocks = []
        for layer in layer_numbers:
            block = tensor_parallel.TensorParallelBlock(full_lm.blocks[layer], grid.group("tp"),
                                                        sequence_parallel=True)
            if grid.size("cp") > 1:        # the block's attention: ring attention over cp
                block.attn.attend = functools.partial(context_parallel.ring_attention,
                                                      group=grid.group("cp"), causal=True,
                                                      layout=LAYOUT)
            blocks.append(block)
        chunks.append(StageChunk(embedding, blocks, layer_numbers, head))
    return chunks


def shard_chunks(chunks: list, grid) -> None:
    """HSDP: wrap each chunk in lesson 2's FSDP over the grid's "dp_shard" group (after the
    chunks are on their device, before the optimizer takes their parameters: they become
    this rank's row blocks). The units gathered as one: the embeddings, each block, the head.
    ``average=False``: FSDP's reduce-scatter leaves the sum over dp_shard, as this file sums.
    Imported here: only HSDP needs lesson 2's fsdp.py."""
    import fsdp
    if grid.size("pp") > 1 or grid.size("cp") > 1:   # the blocks summed over dp_replicate alone
        raise ValueError("parallel_lm.shard_chunks: HSDP is built for dp x tp grids only")
    for chunk in chunks:
        units = list(chunk.blocks)
        for module in (chunk.embedding, chunk.head):
            if module is not None:
                units.append(module)
        wrapper = fsdp.FSDP(chunk, units=units, process_group=grid.group("dp_shard"),
                            average=False)
        chunk.sharded_by.append(wrapper)


def runner(chunk):
    """What runs a chunk: its FSDP wrapper under HSDP (which gathers the units), else itself."""
    if chunk.sharded_by:
        return chunk.sharded_by[0]
    return chunk


def shard_layout(chunk) -> dict:
    """HSDP: {id(parameter): (rows before sharding, rows per block)}, off the FSDP units."""
    layout = {}
    for wrapper in chunk.sharded_by:
        for unit in wrapper.units:
            for param, full in zip(unit.params, unit.full):
                layout[id(param)] = (full.shape[0], param.shape[0])
    return layout


def scaled_loss_fn(grid):
    """Cross-entropy over this rank's tokens, scaled by 1/R: R ranks hold different tokens."""
    token_holders = grid.size("dp") * grid.size("cp") * grid.size("tp")

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # logits [micro_batch, local_seq, vocab] -> [micro_batch * local_seq, vocab]
        mean_here = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return mean_here / token_holders
    return loss_fn


def sum_gradients(chunks: list, grid) -> None:
    """After backward: the tp-replicated parameters over tp (they saw this rank's tokens only),
    then every gradient over dp and cp together, one flat all-reduce per group. Under HSDP:
    FSDP's reduce-scatters over dp_shard first, the last sum over dp_replicate alone."""
    for chunk in chunks:
        if chunk.sharded_by:
            chunk.sharded_by[0].finish_gradient_synchronization()
    replicated = []
    for chunk in chunks:
        for block in chunk.blocks:
            replicated.extend(block.replicated_parameters())
        for module in (chunk.embedding, chunk.head):
            if module is not None:
                replicated.extend(module.parameters())
    all_reduce_sum([p for p in replicated if p.grad is not None], grid.group("tp"))
    everything = [p for chunk in chunks for p in chunk.parameters() if p.grad is not None]
    if chunks[0].sharded_by:
        sum_over_replicas(everything, grid)
    else:
        all_reduce_sum(everything, grid.group("dp_cp"))


def sum_over_replicas(params: list[nn.Parameter], grid) -> None:
    """HSDP: this rank's gradient block sits on every rank of its "dp_replicate" group."""
    all_reduce_sum(params, grid.group("dp_replicate"))


def all_reduce_sum(params: list[nn.Parameter], group) -> None:
    """Sum the gradients of ``params`` over ``group``: one flat buffer, one all-reduce (04)."""
    if not params or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def train_step(chunks: list, grid, schedule_name: str, micro_batches: int, inputs, targets,
               device) -> dict:
    """Forward and backward of the global batch (``inputs``, ``targets``: [batch, seq], the same
    on every rank) through the pipeline, gradients summed (the optimizer step is the caller's).
    Returns the executor's result, ``loss`` the batch's mean loss on every rank."""
    loss_fn = scaled_loss_fn(grid)
    pp = grid.size("pp")
    pp_rank = grid.rank("pp")
    schedule = pipeline_schedules.all_ranks(schedule_name, pp, micro_batches, len(chunks))
    my_inputs = local_tokens(inputs, grid).to(device)
    my_targets = local_tokens(targets, grid).to(device)
    micro_inputs = list(my_inputs.chunk(micro_batches)) if pp_rank == 0 else None
    micro_targets = list(my_targets.chunk(micro_batches)) if pp_rank == pp - 1 else None
    d_model = chunks[0].blocks[0].norm1.normalized_shape[0]
    rows = my_inputs.shape[0] // micro_batches
    activation_shape = (rows, my_inputs.shape[1], d_model)   # [micro_batch, local_seq, d_model]
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    runners = [runner(chunk) for chunk in chunks]
    result = pipeline_parallel.run_schedule(runners, schedule, micro_inputs, micro_targets,
                                            activation_shape, device, loss_fn=loss_fn,
                                            group=grid.group("pp"))
    sum_gradients(chunks, grid)
    # The loss lives on the last pipeline stage, as this rank's share (1/R of its mean): the
    # sum over every rank, with zeros from the other stages, is the batch's mean loss.
    loss = torch.tensor([result["loss"]], dtype=torch.float64, device=device)
    dist.all_reduce(loss)
    result["loss"] = loss.item()
    return result


def evaluate(chunks: list, grid, inputs, targets, device) -> float:
    """The mean loss of one global batch, forward only: each virtual stage in turn, its
    activation sent on to the next stage's rank (through host memory on Gloo, whose point-to-
    point takes CPU tensors only, as lesson 4's executor does)."""
    pp = grid.size("pp")
    pp_group = grid.group("pp")
    wire = device if dist.get_backend(pp_group) == "nccl" else torch.device("cpu")
    loss_fn = scaled_loss_fn(grid)
    x = local_tokens(inputs, grid).to(device)
    my_targets = local_tokens(targets, grid).to(device)
    d_model = chunks[0].blocks[0].norm1.normalized_shape[0]
    shape = (x.shape[0], x.shape[1], d_model)            # [rows, local_seq, d_model]
    share = torch.zeros(1, dtype=torch.float64, device=device)
    virtual_stages = pp * len(chunks)
    me = grid.rank("pp")
    with torch.no_grad():
        for stage in range(virtual_stages):
            if stage % pp != me:                # virtual stage s lives on pipeline rank s % pp
                continue
            previous = (stage - 1) % pp
            if stage > 0 and previous != me:
                received = torch.empty(shape, device=wire)
                dist.recv(received, dist.get_global_rank(pp_group, previous), group=pp_group)
                x = received.to(device)
            x = runner(chunks[stage // pp])(x)  # after the last stage: the logits
            following = (stage + 1) % pp
            if stage < virtual_stages - 1 and following != me:
                dist.send(x.to(wire).contiguous(), dist.get_global_rank(pp_group, following),
                          group=pp_group)
        if me == (virtual_stages - 1) % pp:
            share[0] = loss_fn(x, my_targets)
    dist.all_reduce(share)                      # the shares of the R token holders, and zeros
    return share.item()


def placements(chunks: list, grid) -> list[dict]:
    """Where each of this rank's parameters sits in the full model: its full name
    (``TransformerLM``'s), the full shape, and the boxes of the full tensor it holds, each
    ``(local_slices, full_slices)``, a (start, stop) per dimension; ``replica``: this rank's
    copy is the one to save (``placement_of``)."""
    entries = []
    for chunk in chunks:
        sharded = shard_layout(chunk)
        named = []
        if chunk.embedding is not None:
            for name, p in chunk.embedding.named_parameters():
                named.append((name, p, None))
        for block, layer in zip(chunk.blocks, chunk.layer_numbers):
            for module_name, module in block.named_modules():
                for name, p in module.named_parameters(recurse=False):
                    full_name = f"blocks.{layer}.{module_name}.{name}"
                    named.append((full_name, p, module))
        if chunk.head is not None:
            for name, p in chunk.head.named_parameters():
                named.append((name, p, None))
        for full_name, p, module in named:
            entries.append(placement_of(full_name, p, module, grid, sharded.get(id(p))))
    return entries


def placement_of(full_name: str, p: torch.Tensor, module, grid, fsdp_rows=None) -> dict:
    """One parameter's entry of ``placements``. A column-parallel weight holds rows of each of
    its stacked blocks (q, k, v: three boxes), a row-parallel weight a block of columns, a
    replicated parameter all of it. ``fsdp_rows`` (HSDP): (rows before FSDP, rows per block):
    only the rows of this rank's block. The copy to save: dp_cp rank 0 (under HSDP dp_replicate
    rank 0), and tp rank 0 for a parameter every tp rank holds whole."""
    tp = grid.size("tp")
    tp_rank = grid.rank("tp")
    local_shape = list(p.shape)
    if fsdp_rows is not None:
        local_shape[0] = fsdp_rows[0]
    whole = [(0, size) for size in local_shape]
    sharded_dim = None
    stacked = 1
    if isinstance(module, tensor_parallel.ColumnParallelLinear):
        sharded_dim = 0                      # rows of the weight, and the bias
        stacked = module.stacked
    elif isinstance(module, tensor_parallel.RowParallelLinear) and p.dim() == 2:
        sharded_dim = 1                      # columns of the weight; the bias is whole
    full_shape = list(local_shape)
    boxes = []
    if sharded_dim is None:
        boxes.append((whole, whole))
    else:
        full_shape[sharded_dim] = local_shape[sharded_dim] * tp
        block_local = local_shape[sharded_dim] // stacked   # this rank's rows of one stacked block
        block_full = full_shape[sharded_dim] // stacked
        for block in range(stacked):
            local_box = list(whole)
            full_box = list(whole)
            local_box[sharded_dim] = (block * block_local, (block + 1) * block_local)
            start = block * block_full + tp_rank * block_local
            full_box[sharded_dim] = (start, start + block_local)
            boxes.append((local_box, full_box))
    first_copy = grid.rank("dp_cp") == 0
    if fsdp_rows is not None:
        boxes = rows_of_block(boxes, fsdp_rows[1], grid.rank("dp_shard"))
        first_copy = grid.rank("dp_replicate") == 0     # every dp_shard rank saves its block
    replica = first_copy and (sharded_dim is not None or tp_rank == 0)
    return {"name": full_name, "tensor": p, "full_shape": tuple(full_shape), "boxes": boxes,
            "replica": replica, "tp_whole": sharded_dim is None,
            "dp_sharded": fsdp_rows is not None}


def rows_of_block(boxes: list, rows_per_block: int, block: int) -> list:
    """The boxes cut to FSDP's row block ``block`` (local rows [block k, (block+1) k)), moved to
    start at 0; local and full rows run in step, and a box outside the block drops out."""
    first = block * rows_per_block
    last = first + rows_per_block
    cut = []
    for local_box, full_box in boxes:
        local_start, local_stop = local_box[0]
        start = max(local_start, first)
        stop = min(local_stop, last)
        if start >= stop:
            continue
        shift = full_box[0][0] - local_start            # full row = local row + shift
        new_local = [(start - first, stop - first)] + list(local_box[1:])
        new_full = [(start + shift, stop + shift)] + list(full_box[1:])
        cut.append((new_local, new_full))
    return cut


def full_state_dict(chunks: list, grid, to: int = 0, gradients: bool = False) -> dict | None:
    """The full model's parameters (``TransformerLM``'s names, float32) on global rank ``to``
    (None elsewhere), from the saving replicas; ``gradients``: theirs (zeros where none)."""
    mine = []
    for entry in placements(chunks, grid):
        if not entry["replica"]:
            continue
        values = entry["tensor"].detach()
        if gradients:
            values = entry["tensor"].grad
            if values is None:
                values = torch.zeros_like(entry["tensor"])
        pieces = []
        for local_box, full_box in entry["boxes"]:
            index = tuple(slice(start, stop) for start, stop in local_box)
            pieces.append((full_box, values[index].to("cpu", torch.float32)))
        mine.append((entry["name"], entry["full_shape"], pieces))
    return assemble_boxes(mine, to)


def assemble_boxes(mine: list, to: int = 0) -> dict | None:
    """Every rank's ``(name, full_shape, [(full_box, values), ...])`` gathered on global rank
    ``to`` and written into whole tensors there (None elsewhere)."""
    gathered = None
    if dist.get_rank() == to:
        gathered = [None] * dist.get_world_size()
    dist.gather_object(mine, gathered, dst=to)
    if gathered is None:
        return None
    state = {}
    for rank_entries in gathered:
        for name, full_shape, pieces in rank_entries:
            if name not in state:
                state[name] = torch.zeros(full_shape)
            for full_box, values in pieces:
                index = tuple(slice(start, stop) for start, stop in full_box)
                state[name][index] = values
    return state
