"""Stage 07, lesson 8: lesson 7's train.py, checkpointed and resumed.

What a training run must save to be resumed as the same run: the model (the grid's pieces),
AdamW's state (moments and step counts: without them the first steps after a resume would be
bias-corrected from zero), the random state, and the step. What it need not save: the data
order, because the batch of step s is a pure function of (seed, s) (``text_data.batch_at``):
a run resumed at step s draws batches s, s + 1, ... exactly as the run that never stopped.

    python 07_parallelism/07_together/train.py --dp 2 --tp 2 --steps 300 \\
        --checkpoint-dir ckpt --checkpoint-every 50        # saves at 50, 100, ..., and 300
    python 07_parallelism/07_together/train.py --pp 2 --steps 300 --checkpoint-dir ckpt
                                                          # resumes at 300's newest, on pp 2
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node=4 --max-restarts=1 \\
        07_parallelism/07_together/train.py \\
        --dp 2 --tp 2 --checkpoint-dir ckpt --checkpoint-every 50 --crash-at-step 120
                                                          # a worker dies; the group restarts
                                                          # and resumes from step 100
(The variable: without it, torch's restarted workers look for the rendezvous store of the
attempt before and wait for it until they time out.)

Each save goes to a new folder under the checkpoint directory, the newest two are kept; a
resume takes the newest complete one (with its manifest) on whatever grid the run was
started with. A damaged checkpoint, or one of another run (another model, seed, batch...)
stops the run before it trains: one line, exit status 2. So does a directory another run is
using: rank 0 holds the directory's lock (``checkpoint.lock``) from the resume to the last
save; the kernel drops it when the process ends, however it ends.
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
    """train.py's checkpoints: ``resume()`` once, before the first step; ``after_step(step)``
    after each optimizer step (it saves when a save is due, and plays --crash-at-step)."""

    def __init__(self, args, chunks, grid, optimizer, parallel_lm, full_lm):
        from common import models
        self.args = args
        self.chunks = chunks
        self.grid = grid
        self.optimizer = optimizer
        self.parallel_lm = parallel_lm
        self.held = None            # rank 0: the directory's lock, from resume() to the end
        self.run = {}
        for flag in RUN_FLAGS:
            self.run[flag] = getattr(args, flag)
        names = [name for name, _ in full_lm.named_parameters()]
        preset = models.PRESETS[args.model]
        self.block_columns = layouts.lm_block_columns(names, preset["num_heads"],
                                                      preset["d_model"], preset["d_ff"])
        self.meta = {"run": self.run, "parameter_order": names,
                     "optimizer": layouts.optimizer_options(optimizer)}
        self.layout_name = (f"grid dp {args.dp} x pp {args.pp} x cp {args.cp} x tp {args.tp}, "
                            f"{dist.get_world_size()} ranks")
        if args.fsdp:
            self.layout_name += ", ZeRO-1 over dp x cp"

    def layout(self, rng_state: torch.Tensor) -> list[dict]:
        """This rank's pieces of the model and of AdamW's state, and the random state (the
        same on every rank here: train.py draws no random numbers of its own after building
        the model, each rank the same ones; written by rank 0)."""
        placements = self.parallel_lm.placements(self.chunks, self.grid)
        layout = layouts.grid_layout(placements, self.grid, self.optimizer)
        box = layouts.whole(rng_state.shape)
        layout.append(layouts.entry("extra.rng_state", rng_state, rng_state.shape, [(box, box)],
                                    dist.get_rank() == 0))
        return layout

    def take_directory(self) -> None:
        """Rank 0: the checkpoint directory usable (a folder, writable: tried) and locked for
        this run; every rank hears the verdict."""
        problem = None
        if dist.get_rank() == 0:
            try:
                checkpoint.check_directory(self.args.checkpoint_dir)
                self.held = checkpoint.lock(self.args.checkpoint_dir)
            except checkpoint.CheckpointError as error:
                problem = str(error)
        try:
            checkpoint.agree(problem, None)
        except checkpoint.CheckpointError as error:
            refuse(error)

    def give_back_directory(self) -> None:
        if self.held is not None:
            checkpoint.unlock(self.held)
            self.held = None

    def resume(self) -> int:
        """Take the directory (``take_directory``), load its newest complete checkpoint, if
        any; return its step (the first step to train), 0 without one. A bad one: one line,
        exit 2, on every rank."""
        self.take_directory()
        folder = checkpoint.latest_checkpoint(self.args.checkpoint_dir)
        if folder is None:
            return 0
        try:
            manifest = checkpoint.read_manifest(folder)
            saved_run = manifest["meta"].get("run")
            if not isinstance(saved_run, dict):
                saved_run = {}
            for flag in RUN_FLAGS:
                if saved_run.get(flag) != self.run[flag]:
                    raise checkpoint.CheckpointError(
                        f"{folder / checkpoint.MANIFEST}: saved by a run with --"
                        f"{flag.replace('_', '-')} {saved_run.get(flag)}, this one has "
                        f"{self.run[flag]}; a resumed run must be the same run")
            rng_state = torch.get_rng_state()           # a buffer of the right size
            checkpoint.load(folder, self.layout(rng_state))
        except checkpoint.CheckpointError as error:
            refuse(error)
        torch.set_rng_state(rng_state)
        if dist.get_rank() == 0:
            print(f"[rank 0] resumed from {folder} (step {manifest['step']}, saved from "
                  f"{manifest['layout']})", flush=True)
        if manifest["step"] >= self.args.steps:         # nothing left to train: done with it
            self.give_back_directory()
        return manifest["step"]

    def after_step(self, step: int) -> None:
        """After optimizer step ``step`` (counted from 1): save every --checkpoint-every steps
        and at the last step; then --crash-at-step."""
        every = self.args.checkpoint_every
        last = step == self.args.steps
        if last or (every is not None and step % every == 0):
            self.save(step)
        if last:
            self.give_back_directory()
        if step == self.args.crash_at_step:
            crash_once(step)

    def save(self, step: int) -> None:
        try:
            checkpoint.save(self.args.checkpoint_dir, self.layout(torch.get_rng_state()), step,
                            self.layout_name, self.meta, self.block_columns)
        except checkpoint.CheckpointError as error:
            refuse(error)


def refuse(error: checkpoint.CheckpointError) -> None:
    """Every rank has the same error (checkpoint.py agrees on it): rank 0 says it in one line,
    like a bad flag, and every rank exits with status 2 (so does the run: common/launch.py)."""
    if dist.get_rank() == 0:
        print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr, flush=True)
    dist.barrier()                  # the line is out before any rank exits
    raise SystemExit(2)


def crash_once(step: int) -> None:
    """--crash-at-step: the last rank dies by SIGKILL (as under the out-of-memory killer or a
    lost node: no clean-up, no message from it) right after ``step``, on torchrun's first
    attempt only (``TORCHELASTIC_RESTART_COUNT``), so that the restarted group trains on."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if dist.get_rank() == dist.get_world_size() - 1:
        print(f"[rank {dist.get_rank()}] --crash-at-step {step}: killing this worker (SIGKILL)",
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


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
    """``train.py --checkpoint-dir`` hands its run over here, with the same arguments: lesson
    7's training loop (``training.train_main``) with these checkpoints. Lesson 8 builds on
    lesson 7; lesson 7 imports nothing of lesson 8."""
    from common import import_stage, launch
    train_flags = import_stage("07_parallelism/07_together/train_flags")
    training = import_stage("07_parallelism/07_together/training")
    args, config = train_flags.parse(argv, __doc__)
    if args.checkpoint_dir is None:
        launch.usage_error("resume.py trains with checkpoints: give --checkpoint-dir")
    training.lessons()
    launch.launch(training.train_main, config, args, TrainingCheckpoints)


if __name__ == "__main__":
    _repo()
    main()
