"""Stage 07, lesson 7: train the course LM on real text over a grid of data, pipeline, context
and tensor parallel ranks, and check it against one process.

    python 07_parallelism/07_together/train.py --dp 2 --tp 2           # 4 ranks, a few minutes
    python 07_parallelism/07_together/train.py --dp 1 --pp 1 --cp 1 --tp 1   # one process
    python 07_parallelism/07_together/train.py --dp 2 --pp 2 --tp 2 --steps 20 --check
    python 07_parallelism/07_together/train.py --dp-replicate 2 --dp-shard 2 --check   # HSDP
    torchrun --nproc-per-node=4 07_parallelism/07_together/train.py --dp 2 --tp 2
    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT \\
        07_parallelism/07_together/train.py --dp 2 --pp 2 --tp 2          # tp inside a node
    python 07_parallelism/07_together/train.py --bench     # measure/grid_bench.py's numbers
    python 07_parallelism/07_together/train.py --dp 2 --tp 2 --checkpoint-dir ckpt   # lesson 8

The text is the Python standard library's source on this machine (``--data FILE`` for any
other), bytes as tokens. The global batch of each step is the same whatever the grid, so
every grid trains the same model: ``--check`` trains one process beside the grid and compares
the weights after every step. A line every ``--log-every`` steps gives the loss, the held-out
loss, tokens per second and the time left; at the end a picture of the loss curve (the single-
process curve of the same seed on top when one was run before: ``results/train_curve.csv``)
and a short sample of generated text. ``--save-full PATH`` writes the trained model as the
single-process ``TransformerLM``'s state dict.

Where things are: the grid (``grid.py``), the LM split over it (``parallel_lm.py``), the text
(``text_data.py``), the training run and its check against one process (``training.py``),
the flags and the checks of bad input (``train_flags.py``). Two flags hand the whole run over
to a later part of the course (the process becomes that script, with the same arguments):
``--bench`` to ``measure/grid_bench.py``, and ``--checkpoint-dir`` to lesson 8's
``resume.py``, which runs this same training loop with checkpoints. Checkpoints are lesson 8's
subject, built on this lesson; this lesson does not import it.
"""

from __future__ import annotations

import sys
from pathlib import Path


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


# Two flags hand the whole run over (the process becomes that script, with the same arguments,
# which parses them with the same flags): measurement, and lesson 8's checkpoints.
HAND_OVER = {"--bench": "07_parallelism/measure/grid_bench.py",
             "--checkpoint-dir": "07_parallelism/08_checkpoints/resume.py"}


def hand_over_to(argv: list[str]) -> str | None:
    """The script that takes the run over, read from the arguments before torch is imported
    (else a hand-over would import it twice)."""
    for flag, script in HAND_OVER.items():
        for argument in argv:
            if argument == flag or argument.startswith(flag + "="):
                return script
    return None


def main(argv=None) -> None:
    _repo()
    from common import hand_over
    if argv is None:
        script = hand_over_to(sys.argv[1:])
        if script is not None:
            hand_over(script)
    from common import import_stage, launch
    train_flags = import_stage("07_parallelism/07_together/train_flags")
    training = import_stage("07_parallelism/07_together/training")
    args, config = train_flags.parse(argv, __doc__)    # bad input: one line, exit 2, here
    script = None
    if args.bench:                                     # an abbreviated flag, say (--ben)
        script = HAND_OVER["--bench"]
    elif args.checkpoint_dir is not None:
        script = HAND_OVER["--checkpoint-dir"]
    if script is not None and argv is not None:        # called in a process (a test, say)
        raise RuntimeError(f"main(argv) cannot hand the run over to {script}: call its main")
    if script is not None:
        hand_over(script)
    training.lessons()                                 # the lessons' files on the path
    launch.launch(training.train_main, config, args)


if __name__ == "__main__":
    main()
