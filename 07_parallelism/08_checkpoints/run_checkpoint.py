"""Stage 07, lesson 8: checkpoints, run. The tiny LM trained two steps on lesson 7's grid at
(dp, tp) = (W/2, 2), saved sharded, loaded into (dp, tp) = (W, 1) and into one process
(``consolidate``), each bitwise equal to what was saved, then trained two more steps equal to
the run that never stopped (float32 tolerance); exit 1 on a difference.

    python 07_parallelism/08_checkpoints/run_checkpoint.py                  # 4 ranks
    python 07_parallelism/08_checkpoints/run_checkpoint.py --world-size 2 --dir ckpt
    torchrun --nproc-per-node=4 07_parallelism/08_checkpoints/run_checkpoint.py
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import checkpoint
import layouts

LR = 1e-3
ADAM_EPS = 1e-6     # as lesson 7's train.py: keeps rounding noise below float32 tolerance
SEQ = 16
# Another layout sums gradients in another order (below 1e-6); a bug moves weights by ~LR.
WEIGHT_ATOL = 1e-5
WEIGHT_RTOL = 1e-4
LOSS_RTOL = 1e-5


def build(parallel_lm, grid, seed: int, device):
    """The tiny LM cut for ``grid``, its AdamW, and its checkpoint layout."""
    from common import models
    torch.manual_seed(seed)
    lm = models.TransformerLM("tiny", vocab_size=256, context_length=SEQ)
    chunks = [chunk.to(device) for chunk in parallel_lm.build_chunks(lm, grid, SEQ)]
    optimizer = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=LR, eps=ADAM_EPS)
    layout = layouts.grid_layout(parallel_lm.placements(chunks, grid), grid, optimizer)
    return chunks, optimizer, layout


def train(parallel_lm, chunks, grid, optimizer, steps, device) -> list[float]:
    """Steps ``steps``, a step's batch the same in every layout: 2 rows per rank."""
    losses = []
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        tokens = torch.randint(256, (2 * dist.get_world_size(), SEQ + 1), generator=generator)
        result = parallel_lm.train_step(chunks, grid, "1f1b", 1, tokens[:, :-1], tokens[:, 1:],
                                        device)
        optimizer.step()
        losses.append(result["loss"])
    return losses


def whole_state(layout: list[dict], host) -> dict | None:
    """Rank 0: the full tensors, pieced together from the boxes their writers hold."""
    mine = [(item["name"], item["full_shape"],
             [(full, item["tensor"][checkpoint.as_index(local)].cpu())
              for local, full in item["boxes"]]) for item in layout if item["write"]]
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0, group=host)
    state = {}
    for name, full_shape, pieces in [piece for theirs in everyone or [] for piece in theirs]:
        state.setdefault(name, torch.zeros(full_shape, dtype=pieces[0][1].dtype))
        for full_box, values in pieces:
            state[name][checkpoint.as_index(full_box)] = values
    return state


def differences(label: str, got: dict, want: dict, exact: bool) -> list[str]:
    problems = []
    for name, expected in want.items():
        same = (torch.equal(got[name], expected) if exact
                else torch.allclose(got[name], expected, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL))
        if not same:
            difference = (got[name].double() - expected.double()).abs().max().item()
            problems.append(f"{label}: {name} differs by {difference:.3g}")
    return problems


def demo(ctx, args) -> None:
    from common import import_stage, models
    grid_mod, parallel_lm, _ = import_stage("07_parallelism/07_together/train").lessons()
    host = dist.new_group(backend="gloo")
    shared = [args.dir or (tempfile.mkdtemp(prefix="checkpoints-") if ctx.is_main else None)]
    dist.broadcast_object_list(shared, src=0, group=host)
    root = Path(shared[0])
    W = ctx.world_size
    names = [name for name, _ in models.TransformerLM("tiny", 256, SEQ).named_parameters()]
    # 1. two steps at (dp, tp) = (W/2, 2), a save, two more steps: the run that never stops
    source = grid_mod.ProcessGrid(dp=W // 2, tp=2)
    chunks, optimizer, layout = build(parallel_lm, source, 1, ctx.device)
    train(parallel_lm, chunks, source, optimizer, (0, 1), ctx.device)
    saved = whole_state(layout, host)
    meta = {"parameter_order": names, "optimizer": layouts.optimizer_options(optimizer)}
    block_columns = layouts.lm_block_columns(names, models.PRESETS["tiny"])
    stats = checkpoint.save(root, layout, 2, f"grid dp {W // 2} x tp 2", meta, block_columns,
                            group=host)
    never_stopped_losses = train(parallel_lm, chunks, source, optimizer, (2, 3), ctx.device)
    never_stopped = whole_state(layout, host)
    # 2. loaded into (dp, tp) = (W, 1); 3. two more steps from there
    target = grid_mod.ProcessGrid(dp=W)
    target_chunks, target_optimizer, target_layout = build(parallel_lm, target, 2, ctx.device)
    loaded = checkpoint.load(stats["folder"], target_layout, group=host)
    state = whole_state(target_layout, host)
    losses = train(parallel_lm, target_chunks, target, target_optimizer, (2, 3), ctx.device)
    resumed = whole_state(target_layout, host)
    if ctx.is_main:
        problems = differences(f"loaded into dp {W}", state, saved, exact=True)
        problems += differences("resumed", resumed, never_stopped, exact=False)
        for step, (loss, expected) in enumerate(zip(losses, never_stopped_losses), start=3):
            if not math.isclose(loss, expected, rel_tol=LOSS_RTOL):
                problems.append(f"resumed: loss {loss:.7f} at step {step}, {expected:.7f} in "
                                "the run that never stopped")
        # 4. one process: the whole checkpoint as plain tensors, under the layout's names
        whole = checkpoint.consolidate(stats["folder"])
        plain = {f"model.{name}": value for name, value in whole["model"].items()}
        for index, name in enumerate(names):
            for key, value in whole["optimizer"]["state"][index].items():
                plain[f"optimizer.{name}.{key}"] = value
        problems += differences("one process", plain, saved, exact=True)
        print(f"saved at (dp, tp) = ({W // 2}, 2): {stats['folder']}, rank 0 wrote "
              f"{stats['bytes_written']} bytes; loaded at (dp, tp) = ({W}, 1): rank 0 read "
              f"{loaded['bytes_read']} bytes ({ctx.device})", flush=True)
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
        if problems:                            # rank 0 fails the run: exit 1
            raise AssertionError("checkpoint demo: what differed:\n  " + "\n  ".join(problems))
        ctx.print("loaded into dp and into one process: bitwise equal to what was saved; "
                  "resumed training equal to the run that never stopped (losses and weights)")


def main(argv=None) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))     # the repository: common/
    from common import launch
    parser = launch.make_parser(__doc__, world_size=4)
    parser.add_argument("--dir", help="where the checkpoint goes (kept); default: a temp folder")
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    if config.world_size < 2 or config.world_size % 2 != 0:
        parser.error(f"--world-size {config.world_size}: the demo saves at (dp, tp) = (W/2, 2): "
                     "give an even number of ranks, 2 or more")
    if args.dir is None and launch.under_torchrun() and (os.environ.get("LOCAL_WORLD_SIZE")
                                                         != os.environ["WORLD_SIZE"]):
        parser.error("the job spans nodes (WORLD_SIZE > LOCAL_WORLD_SIZE): rank 0's temporary "
                     "folder is not on the others; give --dir, a folder every node sees")
    launch.launch(demo, config, args)


if __name__ == "__main__":
    main()
