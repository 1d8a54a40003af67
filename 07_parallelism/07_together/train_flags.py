"""Stage 07, lesson 7: train.py's command line. Every flag, and every check that refuses bad
input in one line (exit status 2) before any worker starts: a grid the model or the batch
cannot take, a backend and device that cannot carry the grid's collectives, text too short
for one training and one held-out window, folders that cannot be written, a run that would
not fit in memory.

``train.py`` parses with it; so do ``measure/grid_bench.py`` (``train.py --bench`` hands its
arguments over) and lesson 8's ``resume.py`` (``train.py --checkpoint-dir`` hands over).

    args, config = parse(argv)      # argparse's Namespace and common.launch's LaunchConfig
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import torch

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zbh1")
BENCH_SIZES = ("cpu", "gpu")     # measure/grid_bench.py's SIZES
MAX_SEED = 2**32 - 1             # batch_at seeds a generator with seed * 1_000_003 + step


def build_parser(doc: str | None):
    from bench import supervisor as launch  # TODO(lab)
    from common import models
    parser = launch.make_parser(doc, world_size=4)
    parser.prog = "train.py"       # also when grid_bench.py or resume.py parses train.py's flags
    group = parser.add_argument_group("measurements (--bench: measure/grid_bench.py)")
    group.add_argument("--bench", action="store_true",
                       help="instead of training: time and count a set of grids on 4 ranks (or "
                            "8), torch's composition and torch's pipelining beside ours, into "
                            "results/grid.csv; the training flags are not used")
    group.add_argument("--bench-sizes", choices=BENCH_SIZES, default=None,
                       help="the sizes of --bench (default: gpu with a GPU per rank, else cpu)")
    parser.add_argument("--dp", type=launch.positive_int, default=None,
                        help="data-parallel degree (default: the world size / (pp cp tp))")
    parser.add_argument("--pp", type=launch.positive_int, default=1, help="pipeline stages")
    parser.add_argument("--cp", type=launch.positive_int, default=1, help="context-parallel degree")
    parser.add_argument("--tp", type=launch.positive_int, default=1, help="tensor-parallel degree")
    parser.add_argument("--dp-shard", type=launch.positive_int, default=1,
                        help="HSDP: shard the weights, gradients and AdamW state over this many "
                             "neighbouring data-parallel ranks (lesson 2's FSDP) and replicate "
                             "over the rest (default 1: plain data parallel)")
    parser.add_argument("--dp-replicate", type=launch.positive_int, default=None,
                        help="HSDP: copies of the sharded model (default: --dp / --dp-shard); "
                             "--dp = --dp-replicate x --dp-shard")
    parser.add_argument("--fsdp", action="store_true",
                        help="shard the optimizer state over the data and context ranks (ZeRO-1)")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule")
    parser.add_argument("--chunks", type=launch.positive_int, default=1,
                        help="model chunks per pipeline rank (--schedule interleaved)")
    parser.add_argument("--micro-batches", type=launch.positive_int, default=1,
                        help="micro-batches per data-parallel rank and step")
    parser.add_argument("--model", choices=list(models.PRESETS), default="tiny", help="LM preset")
    parser.add_argument("--steps", type=launch.positive_int, default=300,
                        help="optimizer steps, counted from the start of training")
    parser.add_argument("--batch-size", type=launch.positive_int, default=16,
                        help="GLOBAL batch: sequences per step")
    parser.add_argument("--seq-len", type=launch.positive_int, default=64, help="tokens per sequence")
    parser.add_argument("--lr", type=launch.positive_float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=launch.non_negative_int, default=0,
                        help=f"the model's initial weights and the order of the batches (0 to "
                             f"{MAX_SEED})")
    parser.add_argument("--data", default=None,
                        help="a text file to train on (default: this Python's standard library)")
    parser.add_argument("--max-bytes", type=launch.positive_int, default=4_000_000,
                        help="read at most this much of --data (of the standard library: this "
                             "much training text)")
    parser.add_argument("--log-every", type=launch.positive_int, default=25,
                        help="a progress line (with a held-out loss) every this many steps")
    parser.add_argument("--eval-batches", type=launch.positive_int, default=4,
                        help="held-out batches averaged in each progress line")
    parser.add_argument("--check", action="store_true",
                        help="first train one process beside the grid for --check-steps steps "
                             "and fail unless they stay equal, then train as usual")
    parser.add_argument("--check-steps", type=launch.positive_int, default=3,
                        help="steps of --check")
    parser.add_argument("--save-full", default=None,
                        help="write the trained model's full state dict (TransformerLM's names) here")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="lesson 8 (08_checkpoints/resume.py takes the run over): resume from "
                             "the newest complete checkpoint in this folder (on any grid), save "
                             "into it at the end and every --checkpoint-every steps, keeping the "
                             "newest two")
    parser.add_argument("--checkpoint-every", type=launch.positive_int, default=None,
                        help="with --checkpoint-dir: save every this many steps")
    parser.add_argument("--crash-at-step", type=launch.positive_int, default=None,
                        help="with --checkpoint-dir, to watch a resume: the last rank kills "
                             "itself (SIGKILL) right after this step, on torchrun's first attempt "
                             "only, and torchrun restarts the group, which resumes: "
                             "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node=2 "
                             "--max-restarts=1 07_parallelism/07_together/train.py --dp 2 "
                             "--steps 4 --checkpoint-dir ckpt --checkpoint-every 2 "
                             "--crash-at-step 3 (without the variable the restarted ranks wait "
                             "for a store the dead group held)")
    return parser


def parse(argv=None, doc: str | None = None, bench: bool = False):
    """Parse train.py's flags and refuse bad input up front: (args, config). ``--bench`` (or
    ``bench``: measure/grid_bench.py parsing) skips the training checks: the bench checks its
    own grids."""
    from bench import supervisor as launch  # TODO(lab): memory checks move to the lab
    from bench import results
    parser = build_parser(doc)
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    if args.bench or bench:
        return args, config
    if args.dp is None and args.dp_replicate is not None:
        args.dp = args.dp_replicate * args.dp_shard
    if args.dp is None:
        args.dp = max(1, config.world_size // (args.pp * args.cp * args.tp))
    problem = first_problem(args, config)
    if problem is not None:
        parser.error(problem)
    args.dp_replicate = args.dp // args.dp_shard
    results.check_writable()
    return args, config


def first_problem(args, config) -> str | None:
    """The first thing wrong with ``args`` on ``config`` (one line), or None."""
    for check in (grid_problem, hsdp_problem, device_problem, run_problem, data_problem, folder_problem,
                  memory_problem):
        problem = check(args, config)
        if problem is not None:
            return problem
    return None


def grid_problem(args, config) -> str | None:
    """A grid the world, the model or the batch cannot take."""
    from common import models
    product = args.dp * args.pp * args.cp * args.tp
    if product != config.world_size:
        return (f"--dp {args.dp} x --pp {args.pp} x --cp {args.cp} x --tp {args.tp} = "
                f"{product}, but the world size is {config.world_size}; the product must equal it")
    preset = models.PRESETS[args.model]
    if preset["num_heads"] % args.tp != 0 or preset["d_ff"] % args.tp != 0:
        return (f"--tp {args.tp} must divide the {args.model} LM's {preset['num_heads']} "
                f"heads and its hidden size {preset['d_ff']}")
    if args.seq_len % (2 * args.cp * args.tp) != 0:
        return (f"--seq-len {args.seq_len} must divide by 2 x cp x tp = "
                f"{2 * args.cp * args.tp} (zig-zag context chunks, then sequence parallel)")
    if args.seq_len > 4096:
        return f"--seq-len {args.seq_len}: at most 4096 (the position table grows with it)"
    if args.schedule != "interleaved" and args.chunks != 1:
        return "--chunks is for --schedule interleaved only"
    layers = preset["num_layers"]
    if layers % (args.pp * args.chunks) != 0:
        return (f"the {args.model} LM's {layers} layers do not split into --pp {args.pp} x "
                f"--chunks {args.chunks} equal pieces")
    if args.batch_size % args.dp != 0:
        return f"--batch-size {args.batch_size} must divide by --dp {args.dp}"
    rows = args.batch_size // args.dp
    if rows % args.micro_batches != 0:
        return (f"--micro-batches {args.micro_batches} must divide each data-parallel "
                f"rank's {rows} rows (--batch-size / --dp)")
    if args.schedule == "interleaved" and args.micro_batches % args.pp != 0:
        return (f"--schedule interleaved needs --micro-batches a multiple of --pp "
                f"({args.micro_batches} is not a multiple of {args.pp})")
    return None


def hsdp_problem(args, config) -> str | None:
    """--dp-replicate x --dp-shard must make --dp; HSDP here composes with tensor parallelism
    only (FSDP's gathers per unit and micro-batch are what the pipeline's chunks and ring
    attention's ranks would multiply; not built), and ZeRO-1 would shard the state twice."""
    if args.dp % args.dp_shard != 0:
        return f"--dp-shard {args.dp_shard} must divide --dp {args.dp} (dp = replicate x shard)"
    replicate = args.dp // args.dp_shard
    if args.dp_replicate is not None and args.dp_replicate != replicate:
        return (f"--dp-replicate {args.dp_replicate} x --dp-shard {args.dp_shard} = "
                f"{args.dp_replicate * args.dp_shard}, but --dp is {args.dp}; the product must "
                "equal it")
    if args.dp_shard == 1:
        return None
    if args.pp > 1 or args.cp > 1:
        return (f"--dp-shard {args.dp_shard} (HSDP) with --pp {args.pp} --cp {args.cp}: HSDP "
                "composes with --tp only; use --pp 1 --cp 1")
    if args.fsdp:
        return (f"--dp-shard {args.dp_shard} with --fsdp: HSDP shards the AdamW state already; "
                "use one of them")
    return None


def device_problem(args, config) -> str | None:
    """A backend and device that cannot carry the grid's collectives. Gloo runs all-reduce,
    all-gather and reduce-scatter on CUDA tensors (through host memory), but its point-to-
    point sends take CPU tensors only: the pipeline's sends (lesson 4's executor and the
    evaluation) stage through host memory on a Gloo group, ring attention's
    batch_isend_irecv (--cp) does not, so --cp > 1 on CUDA needs NCCL."""
    if args.cp > 1 and config.backend == "gloo" and config.device == "cuda":
        return (f"--cp {args.cp} on --device cuda over Gloo: ring attention sends K and V with "
                "batch_isend_irecv, and Gloo's point-to-point takes CPU tensors only; use "
                "--device cpu, or --backend nccl with a GPU per rank")
    return None


def run_problem(args, config) -> str | None:
    """Flags that only mean something together, and numbers past what the run can use."""
    if args.checkpoint_dir is None and (args.checkpoint_every is not None
                                        or args.crash_at_step is not None):
        return "--checkpoint-every and --crash-at-step need --checkpoint-dir"
    if args.seed > MAX_SEED:
        return f"--seed {args.seed}: at most {MAX_SEED} (the batches' generator is seeded from it)"
    return None


def data_problem(args, config) -> str | None:
    """--data: readable, and long enough (of its first --max-bytes) for one training window
    and one held-out window of --seq-len + 1 bytes."""
    window = args.seq_len + 2            # batch_at needs more than seq_len + 1 tokens
    if args.data is None:
        if args.max_bytes < window:      # the standard library: --max-bytes of training text
            return (f"--max-bytes {args.max_bytes}: the training text needs at least {window} "
                    f"bytes (--seq-len {args.seq_len} + 2)")
        return None
    from common import import_stage
    text_data = import_stage("07_parallelism/07_together/text_data")
    if args.data == "":
        return "--data '': give a text file (or leave --data out: the standard library)"
    if Path(args.data).is_dir():
        return f"--data {args.data}: a folder; give a text file"
    try:
        data = text_data.read_head(args.data, args.max_bytes)
    except OSError as error:
        return f"--data {args.data}: cannot read it ({error.strerror or error})"
    train, held_out = text_data.split_bytes(data)
    if len(train) < window or len(held_out) < window:
        need = math.ceil(window / 0.05)  # the held-out part is the last 5%
        return (f"--data {args.data}: {len(data)} bytes read give {len(train)} training and "
                f"{len(held_out)} held-out bytes; each needs at least {window} (--seq-len "
                f"{args.seq_len} + 2): give at least {need} bytes or a shorter --seq-len")
    return None


def folder_problem(args, config) -> str | None:
    """--checkpoint-dir and --save-full: writable, tried (a file written and removed)."""
    if args.checkpoint_dir is not None:
        problem = folder_not_writable(args.checkpoint_dir)
        if problem is not None:
            return f"--checkpoint-dir {args.checkpoint_dir!r}: {problem}"
    if args.save_full is not None:
        problem = file_not_writable(args.save_full)
        if problem is not None:
            return f"--save-full {args.save_full!r}: {problem}"
    return None


def folder_not_writable(folder: str) -> str | None:
    """Why files cannot be written into ``folder`` (made if missing), or None: tried."""
    if folder == "":
        return "give a folder (an empty name would write into the current one)"
    path = Path(folder)
    if path.exists() and not path.is_dir():
        return "not a folder"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        return f"cannot write there ({error.strerror or error})"
    return None


def file_not_writable(file: str) -> str | None:
    """Why ``file`` cannot be written, or None: tried (an existing file opened for writing
    without truncating it; a new one created and removed)."""
    if file == "":
        return "give a file name"
    path = Path(file)
    if path.is_dir():
        return "a folder; give a file name"
    if not path.parent.is_dir():
        return f"no folder {str(path.parent)!r} to write it in"
    existed = path.exists()
    try:
        with open(path, "ab"):
            pass
    except OSError as error:
        return f"cannot write it ({error.strerror or error})"
    if not existed:
        os.unlink(path)
    return None


def memory_problem(args, config) -> str | None:
    """A run that would not fit: a rank's rough peak against the host's memory (ranks of one
    machine add up) or the GPU's (ranks sharing a GPU add up)."""
    from bench import supervisor as launch  # TODO(lab): memory checks move to the lab
    need = per_rank_bytes(args)
    what = (f"--model {args.model}, --batch-size {args.batch_size}, --seq-len {args.seq_len} "
            f"on dp {args.dp} x pp {args.pp} x cp {args.cp} x tp {args.tp}")
    ranks_here = launch.ranks_on_this_node(config.world_size)
    if config.device == "cuda":
        ranks_per_gpu = -(-ranks_here // torch.cuda.device_count())     # rounded up
        total = torch.cuda.get_device_properties(0).total_memory
        if ranks_per_gpu * need > 0.9 * total:
            return (f"{what} needs about {ranks_per_gpu * need / 2**30:.1f} GiB per GPU but a "
                    f"GPU has {total / 2**30:.1f} GiB; use a smaller model, batch or sequence")
        need = 4 * lm_parameters(args)      # the host still builds the full model once
    have = int(0.9 * launch.host_available_bytes())
    total_need = ranks_here * (launch.rank_baseline_bytes() + need)
    if total_need > have:
        return (f"{what}: {ranks_here} ranks need about {total_need / 2**30:.1f} GiB of host "
                f"memory ({need / 2**30:.2f} GiB each past start-up) but {have / 2**30:.1f} GiB "
                "is available; use a smaller model, batch or sequence")
    return None


def lm_parameters(args) -> int:
    from common import models
    return models.lm_parameter_count(args.model, context_length=args.seq_len)


def per_rank_bytes(args) -> int:
    """A rank's rough peak, float32: the full LM every rank builds (and slices), this rank's
    pieces with their gradients and AdamW's two moments (16 bytes a value), one process's
    model beside it with --check, and the activations the pipeline holds for backward."""
    from common import models
    preset = models.PRESETS[args.model]
    full = lm_parameters(args)
    mine = full // (args.pp * args.tp)
    need = 4 * full + 16 * mine
    if args.check:
        need += 16 * full
    rows = args.batch_size // (args.dp * args.micro_batches)        # one micro-batch
    tokens = rows * args.seq_len // args.cp
    held = args.micro_batches                                       # GPipe holds them all
    if args.schedule != "gpipe":
        held = min(args.micro_batches, args.pp * args.chunks)       # 1F1B: at most the stages
    layers = preset["num_layers"] // args.pp
    h = preset["d_model"]
    per_block = tokens * (12 * h + 2 * preset["d_ff"]) // args.tp
    scores = rows * preset["num_heads"] // args.tp * (args.seq_len // args.cp) ** 2
    logits = tokens * 3 * 256
    need += 4 * held * (layers * (per_block + scores) + logits)
    if args.check:                                                  # one process, whole batch
        whole = args.batch_size * args.seq_len
        need += 4 * preset["num_layers"] * (whole * (12 * h + 2 * preset["d_ff"])
                                            + args.batch_size * preset["num_heads"]
                                            * args.seq_len ** 2)
    return need
