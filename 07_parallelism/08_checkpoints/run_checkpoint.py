"""Stage 07, lesson 8: checkpoints, run. The tiny LM and its AdamW state trained on lesson 7's
grid at (dp, tp) = (W/2, 2), saved sharded, loaded into another layout, (dp, tp) = (W, 1)
(each rank pieces whole weights together from the tensor-parallel slices), and into one
process (``consolidate``); then training resumed from the loaded state. It prints what
matched: the state after each load (weights, AdamW's moments and steps) bitwise equal to what
was saved; two more steps from it equal to two more steps of the run that never stopped
(loss and weights, float32 tolerance: the layouts sum the gradients in another order).

Everything the model touches is on ``--device``; the checkpoint's own bookkeeping (each
rank's description of its file, the verdicts) is host-side, on a Gloo group, deliberately.
The checks with planted bugs are in tests/checks_checkpoint.py; ``--bench`` (beside
``torch.distributed.checkpoint``) is 07_parallelism/measure/bench_checkpoint.py.

Run:
    python 07_parallelism/08_checkpoints/run_checkpoint.py                  # 4 ranks
    python 07_parallelism/08_checkpoints/run_checkpoint.py --world-size 2 --dir ckpt
    python 07_parallelism/08_checkpoints/run_checkpoint.py --bench --model course
    torchrun --nproc-per-node=4 07_parallelism/08_checkpoints/run_checkpoint.py
"""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import checkpoint
import layouts

LR = 1e-3
ADAM_EPS = 1e-6         # as in lesson 7's train.py: keeps rounding noise below float32 tolerance
VOCAB = 256
SEQ = 16
# Training continued in another layout sums the gradients in another order: weights agree to
# float32 rounding carried through two AdamW steps (below 1e-6), the loss to float32's relative
# precision. A bug (a moment lost, a step counter reset, a box moved) moves weights by ~LR.
WEIGHT_ATOL = 1e-5
WEIGHT_RTOL = 1e-4
LOSS_RTOL = 1e-5


def tiny_lm(seed: int):
    from common import models
    torch.manual_seed(seed)
    return models.TransformerLM("tiny", vocab_size=VOCAB, context_length=SEQ)


def global_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``, the same on every rank: [batch_size, SEQ] inputs and targets."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(VOCAB, (batch_size, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def lessons():
    """Lesson 7's grid and the LM cut for it (which composes lessons 3-5)."""
    from common import import_stage
    for lesson in ("03_tensor_parallel/tensor_parallel", "04_pipeline_parallel/pipeline_parallel",
                   "05_context_parallel/context_parallel"):
        import_stage(f"07_parallelism/{lesson}")
    grid = import_stage("07_parallelism/07_together/grid")
    parallel_lm = import_stage("07_parallelism/07_together/parallel_lm")
    return grid, parallel_lm


def build(grid, seed: int, device):
    """The LM cut for ``grid`` on ``device``, its AdamW, and its checkpoint layout."""
    _, parallel_lm = lessons()
    chunks = [chunk.to(device) for chunk in parallel_lm.build_chunks(tiny_lm(seed), grid, SEQ)]
    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = torch.optim.AdamW(params, lr=LR, eps=ADAM_EPS)
    layout = layouts.grid_layout(parallel_lm.placements(chunks, grid), grid, optimizer)
    return chunks, optimizer, layout


def train(chunks, grid, optimizer, steps, batch_size: int, device) -> list[float]:
    _, parallel_lm = lessons()
    losses = []
    for step in steps:
        inputs, targets = global_batch(step, batch_size)
        result = parallel_lm.train_step(chunks, grid, "1f1b", 1, inputs, targets, device)
        optimizer.step()
        losses.append(result["loss"])
    return losses


def whole_state(layout: list[dict], host) -> dict | None:
    """The full tensors of a layout, pieced together on rank 0 from the boxes their writers
    hold, on the host (CPU copies over the Gloo group ``host``); None on other ranks."""
    mine = []
    for item in layout:
        if item["write"]:
            pieces = []
            for local_box, full_box in item["boxes"]:
                pieces.append((full_box, item["tensor"][checkpoint.as_index(local_box)].cpu()))
            mine.append((item["name"], item["full_shape"], pieces))
    everyone = None
    if dist.get_rank() == 0:
        everyone = [None] * dist.get_world_size()
    dist.gather_object(mine, everyone, dst=0, group=host)
    if everyone is None:
        return None
    state = {}
    for theirs in everyone:
        for name, full_shape, pieces in theirs:
            state.setdefault(name, torch.zeros(full_shape, dtype=pieces[0][1].dtype))
            for full_box, values in pieces:
                state[name][checkpoint.as_index(full_box)] = values
    return state


def compare(label: str, got: dict, want: dict, exact: bool) -> list[str]:
    """What differs between two full states: bitwise (``exact``) or at float32 tolerance."""
    problems = []
    for name, expected in want.items():
        if exact:
            same = torch.equal(got[name], expected)
        else:
            same = torch.allclose(got[name], expected, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)
        if not same:
            difference = (got[name].double() - expected.double()).abs().max().item()
            problems.append(f"{label}: {name} differs by {difference:.3g}")
    return problems


def demo(ctx, args) -> None:
    from common import models
    grid_mod, _ = lessons()
    host = dist.new_group(backend="gloo")     # host-side bookkeeping, whatever the device
    root = Path(args.dir) if args.dir else None
    if ctx.is_main and root is None:
        root = Path(tempfile.mkdtemp(prefix="checkpoints-"))
    shared = [root]
    dist.broadcast_object_list(shared, src=0, group=host)
    root = shared[0]
    world_size = ctx.world_size
    batch_size = 2 * world_size
    names = [name for name, _ in tiny_lm(0).named_parameters()]
    preset = models.PRESETS["tiny"]
    block_columns = layouts.lm_block_columns(names, preset["num_heads"], preset["d_model"],
                                             preset["d_ff"])
    meta = {"parameter_order": names}
    # 1. train two steps at (dp, tp) = (W/2, 2), save, and go on: the run that never stops
    source = grid_mod.ProcessGrid(dp=world_size // 2, tp=2)
    chunks, optimizer, layout = build(source, seed=1, device=ctx.device)
    train(chunks, source, optimizer, (0, 1), batch_size, ctx.device)
    saved = whole_state(layout, host)
    meta["optimizer"] = layouts.optimizer_options(optimizer)
    stats = checkpoint.save(root, layout, 2, f"grid dp {world_size // 2} x tp 2", meta,
                            block_columns, group=host)
    never_stopped_losses = train(chunks, source, optimizer, (2, 3), batch_size, ctx.device)
    never_stopped = whole_state(layout, host)
    # 2. load it into (dp, tp) = (W, 1): every rank reads the slices of every weight
    target = grid_mod.ProcessGrid(dp=world_size)
    target_chunks, target_optimizer, target_layout = build(target, seed=2, device=ctx.device)
    folder = checkpoint.latest_checkpoint(root)
    loaded = checkpoint.load(folder, target_layout, group=host)
    problems = []
    state = whole_state(target_layout, host)
    if ctx.is_main:
        problems += compare(f"load into dp {world_size}", state, saved, exact=True)
    # 3. resume: two more steps from the loaded state, against the run that never stopped
    losses = train(target_chunks, target, target_optimizer, (2, 3), batch_size, ctx.device)
    state = whole_state(target_layout, host)
    if ctx.is_main:
        problems += compare("resumed", state, never_stopped, exact=False)
        for step, (loss, expected) in enumerate(zip(losses, never_stopped_losses)):
            if not math.isclose(loss, expected, rel_tol=LOSS_RTOL):
                problems.append(f"resumed: loss {loss:.7f} at step {step + 3}, {expected:.7f} "
                                "in the run that never stopped")
        # 4. one process: the whole checkpoint in plain tensors
        problems += compare("one process", consolidated(folder), saved, exact=True)
        print(f"saved at (dp, tp) = ({world_size // 2}, 2): {folder}, rank 0 wrote "
              f"{stats['bytes_written']} bytes; loaded at (dp, tp) = ({world_size}, 1): rank 0 "
              f"read {loaded['bytes_read']} bytes ({ctx.device})", flush=True)
    everyone = [None] * world_size               # one verdict, on every rank
    dist.all_gather_object(everyone, problems, group=host)
    problems = [problem for theirs in everyone for problem in theirs]
    if problems:
        raise AssertionError("checkpoint demo: what differed:\n  " + "\n  ".join(problems))
    ctx.print("loaded into dp and into one process: bitwise equal to what was saved; resumed "
              "training equal to the run that never stopped (losses and weights)",
              all_ranks=False)
    dist.barrier(group=host)
    if ctx.is_main and not args.dir:
        shutil.rmtree(root, ignore_errors=True)


def consolidated(folder) -> dict:
    """consolidate()'s model and AdamW state under the layout's names."""
    state = checkpoint.consolidate(folder)
    tensors = {}
    for name, value in state["model"].items():
        tensors[f"model.{name}"] = value
    for index, name in enumerate(state["meta"]["parameter_order"]):
        for key, value in state["optimizer"]["state"][index].items():
            tensors[f"optimizer.{name}.{key}"] = value
    return tensors


def refuse_directory(parser, given: str) -> None:
    """--dir: a new folder or an empty one that can be written (tried, not guessed)."""
    folder = Path(given)
    if folder.is_dir() and any(folder.iterdir()):
        parser.error(f"--dir {given}: already used (not empty); give a new or empty folder")
    try:
        checkpoint.check_directory(folder)
    except checkpoint.CheckpointError as error:
        parser.error(f"--dir {error}")


def _repo() -> None:
    """The harness needs common/, the algorithm does not (the same in every runnable script,
    on purpose: each lesson's folder runs from where it lies)."""
    root = Path(__file__).resolve().parent
    while not (root / "common" / "launch.py").exists():
        if root == root.parent:
            raise SystemExit(f"{Path(__file__).name}: the algorithm works on its own; this "
                             "script needs the repository around it (common/)")
        root = root.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


def main(argv=None) -> None:
    _repo()
    from common import hand_over, launch, models
    parser = launch.make_parser(__doc__, world_size=4)
    parser.add_argument("--bench", action="store_true",
                        help="measure save and load against torch.distributed.checkpoint "
                             "(07_parallelism/measure/bench_checkpoint.py)")
    parser.add_argument("--model", choices=list(models.PRESETS), default="tiny",
                        help="--bench: the LM preset")
    parser.add_argument("--warmup", type=launch.non_negative_int, default=1,
                        help="--bench: untimed saves and loads")
    parser.add_argument("--iters", type=launch.positive_int, default=3,
                        help="--bench: timed saves and loads")
    parser.add_argument("--dir", default=None,
                        help="where checkpoints go (kept; a new or empty folder); default: a "
                             "temporary folder, removed")
    args = parser.parse_args(argv)
    if args.bench:
        hand_over("07_parallelism/measure/bench_checkpoint.py")
    config = launch.resolve(args)
    if config.world_size < 2:
        parser.error(f"--world-size {config.world_size}: checkpoints move between layouts of "
                     "different sizes; give 2 ranks or more")
    if config.world_size % 2 != 0:
        parser.error(f"--world-size {config.world_size}: the demo saves at (dp, tp) = (W/2, 2); "
                     "give an even number of ranks")
    if args.dir is not None:
        refuse_directory(parser, args.dir)
    launch.launch(demo, config, args)


if __name__ == "__main__":
    main()
