"""Stage 07, lesson 8: lesson 7's training run, checkpointed and resumed as the same run.

A resume loads the newest checkpoint, on any grid: the model, AdamW's moments and step counts
(else the first steps are bias-corrected from zero) and the random state; the data order needs
nothing (the batch of step s is a function of the seed and s). A damaged checkpoint, another
run's, or a directory another run holds: one line, exit 2.

    python 07_parallelism/08_checkpoints/resume.py --dp 2 --tp 2 --steps 300 \
        --checkpoint-dir ckpt --checkpoint-every 50         # lesson 7's flags, and these
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node=4 --max-restarts=1 \
        07_parallelism/08_checkpoints/resume.py --dp 2 --tp 2 --checkpoint-dir ckpt \
        --checkpoint-every 50 --crash-at-step 120   # a worker dies; torchrun restarts all
(without the variable, torch 2.13's restarted workers wait for the last attempt's store)
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import checkpoint
import layouts

# What makes two runs the same run: a resume with another of these would train another model.
RUN_FLAGS = ("model", "seed", "batch_size", "seq_len", "lr", "data", "max_bytes")


class TrainingCheckpoints:
    """Lesson 7's loop calls ``resume()`` (the first step to train) and ``after_step(step)``."""

    def __init__(self, args, chunks, grid, optimizer, parallel_lm, full_lm):
        from common import models
        self.args = args
        self.chunks = chunks
        self.grid = grid
        self.optimizer = optimizer
        self.parallel_lm = parallel_lm
        self.held = None            # rank 0: the directory's lock
        self.run = {flag: getattr(args, flag) for flag in RUN_FLAGS}
        names = [name for name, _ in full_lm.named_parameters()]
        self.block_columns = layouts.lm_block_columns(names, models.PRESETS[args.model])
        self.meta = {"run": self.run, "parameter_order": names,
                     "optimizer": layouts.optimizer_options(optimizer)}
        self.layout_name = (f"grid dp {args.dp} x pp {args.pp} x cp {args.cp} x tp {args.tp}, "
                            f"{dist.get_world_size()} ranks")

    def layout(self, rng_state: torch.Tensor) -> list[dict]:
        """This rank's pieces of the model and AdamW, and the random state (the same on all)."""
        placements = self.parallel_lm.placements(self.chunks, self.grid)
        layout = layouts.grid_layout(placements, self.grid, self.optimizer)
        box = layouts.whole(rng_state.shape)
        layout.append(layouts.entry("extra.rng_state", rng_state, rng_state.shape, [(box, box)],
                                    dist.get_rank() == 0))
        return layout

    def resume(self) -> int:
        """Rank 0 locks the directory; the newest checkpoint is loaded: its step, else 0."""
        problem = None
        try:
            if dist.get_rank() == 0:
                self.held = checkpoint.lock(self.args.checkpoint_dir)
        except checkpoint.CheckpointError as error:
            problem = str(error)
        folder = checkpoint.latest_checkpoint(self.args.checkpoint_dir)
        rng_state = torch.get_rng_state()                   # a buffer of the right size
        try:
            checkpoint.agree(problem, None)
            if folder is None:
                return 0
            manifest = checkpoint.read_manifest(folder)
            saved_run = manifest["meta"].get("run")
            saved_run = saved_run if isinstance(saved_run, dict) else {}
            for flag in RUN_FLAGS:
                if saved_run.get(flag) != self.run[flag]:
                    raise checkpoint.CheckpointError(
                        f"{folder / checkpoint.MANIFEST}: saved by a run with --"
                        f"{flag.replace('_', '-')} {saved_run.get(flag)}, this one has "
                        f"{self.run[flag]}; a resumed run must be the same run")
            checkpoint.load(folder, self.layout(rng_state))
        except checkpoint.CheckpointError as error:
            refuse(error)
        torch.set_rng_state(rng_state)
        if dist.get_rank() == 0:
            print(f"[rank 0] resumed from {folder} (step {manifest['step']}, saved from "
                  f"{manifest['layout']})", flush=True)
        if manifest["step"] >= self.args.steps:             # nothing left to train
            self.give_back_directory()
        return manifest["step"]

    def after_step(self, step: int) -> None:
        """After step ``step`` (from 1): a save every --checkpoint-every steps and at the last."""
        every = self.args.checkpoint_every
        if step == self.args.steps or (every is not None and step % every == 0):
            try:
                checkpoint.save(self.args.checkpoint_dir, self.layout(torch.get_rng_state()),
                                step, self.layout_name, self.meta, self.block_columns)
            except checkpoint.CheckpointError as error:
                refuse(error)
        if step == self.args.steps:
            self.give_back_directory()
        last_rank = dist.get_rank() == dist.get_world_size() - 1
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"   # torchrun's
        if step == self.args.crash_at_step and first_attempt and last_rank:
            print(f"[rank {dist.get_rank()}] --crash-at-step {step}: killing this worker (SIGKILL)",
                  flush=True)      # as the out-of-memory killer would: no clean-up, no message
            os.kill(os.getpid(), signal.SIGKILL)

    def give_back_directory(self) -> None:
        if self.held is not None:
            checkpoint.unlock(self.held)
            self.held = None


def refuse(error: checkpoint.CheckpointError) -> None:
    """Every rank has the same error: rank 0 says it in one line, every rank exits 2."""
    if dist.get_rank() == 0:
        print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr, flush=True)
    dist.barrier()                  # the line is out before any rank exits
    raise SystemExit(2)


def main(argv=None) -> None:
    """Lesson 7's training loop (``train.train_main``) with these checkpoints."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))     # the repository: common/
    from common import import_stage, launch
    train = import_stage("07_parallelism/07_together/train")
    parser = train.build_parser(__doc__)
    parser.add_argument("--checkpoint-dir", required=True, help="resume from, and save to, here")
    parser.add_argument("--checkpoint-every", type=launch.positive_int, help="save every K steps")
    parser.add_argument("--crash-at-step", type=launch.positive_int, default=None,
                        help="the last rank kills itself after this step (first attempt only)")
    args, config = train.parse(argv, parser)
    if Path(args.checkpoint_dir).exists() and not Path(args.checkpoint_dir).is_dir():
        parser.error(f"--checkpoint-dir {args.checkpoint_dir}: not a folder")
    train.lessons()
    launch.launch(train.train_main, config, args, TrainingCheckpoints)


if __name__ == "__main__":
    main()
