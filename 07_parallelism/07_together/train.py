"""Stage 07, lesson 7: train a Transformer LM (``--model``, default the ``tiny`` preset) on real
text over a grid of data, pipeline, context and tensor parallel ranks, and check it against one
process.

    python 07_parallelism/07_together/train.py --dp 2 --tp 2                 # 4 ranks
    python 07_parallelism/07_together/train.py --dp 2 --pp 2 --tp 2 --steps 20 --check
    python 07_parallelism/07_together/train.py --dp 4 --dp-shard 2 --check   # HSDP: 2 x 2
    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT \\
        07_parallelism/07_together/train.py --dp 2 --pp 2 --tp 2          # tp inside a node

The text: the standard library's source (``--data FILE`` for another), bytes as tokens. Batch s
depends on (seed, s) alone, whatever the grid, so every grid trains the same model: ``--check``
first trains one process beside the grid, comparing the loss, every gradient and every weight
after each step (exit 1 on a difference). At the end, rank 0 writes the loss curve (results/
train_curve.csv) and its picture (results/train_loss.png, over one process's curve of the same
seed when one was run), prints a sample, and with ``--save-full`` saves ``TransformerLM``'s
state dict. The pieces: ``grid.py``, ``parallel_lm.py``, ``text_data.py``; lesson 8 runs this
loop with checkpoints.
"""

from __future__ import annotations

import csv
import errno
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

# AdamW's eps, here and in the reference: with torch's 1e-8, rounding noise in a near-zero
# gradient becomes a step of about the learning rate (m / sqrt(v) ~ sign(g) when |g| ~ eps), and
# weights that should agree to float32 rounding differ by lr. 1e-6 keeps such noise below it.
ADAM_EPS = 1e-6
SINGLE_PROCESS = "dp 1 x pp 1 x cp 1 x tp 1"


def build_parser(doc: str | None = __doc__):
    from common import launch, models
    parser = launch.make_parser(doc, world_size=4)
    add = parser.add_argument
    add("--dp", type=launch.positive_int, help="data-parallel degree (default: the rest)")
    add("--pp", type=launch.positive_int, default=1, help="pipeline stages")
    add("--cp", type=launch.positive_int, default=1, help="context-parallel degree")
    add("--tp", type=launch.positive_int, default=1, help="tensor-parallel degree")
    add("--dp-shard", type=launch.positive_int, default=1,
        help="HSDP: shard over this many neighbouring data ranks, replicate over --dp / that")
    add("--fsdp", action="store_true", help="shard AdamW's state over dp x cp (ZeRO-1)")
    add("--schedule", choices=("1f1b", "gpipe", "interleaved", "zbh1"), default="1f1b")
    add("--chunks", type=launch.positive_int, default=1, help="per pipeline rank (interleaved)")
    add("--micro-batches", type=launch.positive_int, default=1, help="per data rank and step")
    add("--model", choices=list(models.PRESETS), default="tiny", help="LM preset")
    add("--steps", type=launch.positive_int, default=300)
    add("--batch-size", type=launch.positive_int, default=16, help="GLOBAL: sequences a step")
    add("--seq-len", type=launch.positive_int, default=64)
    add("--lr", type=launch.positive_float, default=3e-3)
    add("--seed", type=launch.non_negative_int, default=0)
    add("--data", help="a text file (default: this Python's standard library)")
    add("--max-bytes", type=launch.positive_int, default=4_000_000, help="of training text")
    add("--log-every", type=launch.positive_int, default=25)
    add("--eval-batches", type=launch.positive_int, default=4, help="held-out, per log line")
    add("--check", action="store_true", help="first, --check-steps beside one process")
    add("--check-steps", type=launch.positive_int, default=3)
    add("--save-full", help="write the model's state dict (TransformerLM's names) here")
    return parser


def parse(argv=None, parser=None):
    """(args, config). Refused here, one line each: what would train a wrong model silently,
    and files that would hang the run or lose the model at its end."""
    from common import launch
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    if args.dp is None:
        args.dp = max(1, config.world_size // (args.pp * args.cp * args.tp))
    if args.dp * args.pp * args.cp * args.tp != config.world_size:
        parser.error(f"--dp x --pp x --cp x --tp must equal the world size {config.world_size}")
    if args.dp % args.dp_shard != 0:
        parser.error(f"--dp-shard must divide --dp {args.dp} (dp = copies x shards)")
    if args.dp_shard > 1 and (args.pp > 1 or args.cp > 1 or args.fsdp):
        parser.error("--dp-shard (HSDP) composes with --dp and --tp only (no --pp, --cp, --fsdp)")
    if args.batch_size % (args.dp * args.micro_batches) != 0:
        parser.error("--batch-size must divide by --dp x --micro-batches")
    if args.seq_len % (2 * args.cp * args.tp) != 0:
        parser.error("--seq-len must divide by 2 x --cp x --tp (zig-zag, then sequence parallel)")
    if args.data is not None and not os.path.isfile(args.data):
        parser.error(f"--data {args.data[:200]!r}: not a regular file")
    if args.save_full is not None:
        try:      # a FIFO would hang the save, /dev/full lose the model; finish() writes .tmp first
            if os.path.lexists(args.save_full) and not os.path.isfile(args.save_full):
                raise OSError(0, "not a regular file")
            folder = os.path.dirname(args.save_full) or "."
            if len(os.path.basename(args.save_full) + ".tmp") > os.pathconf(folder, "PC_NAME_MAX"):
                raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG))
            tempfile.TemporaryFile(dir=folder).close()    # every rank parses: a file of its own
        except OSError as error:
            parser.error(f"--save-full {args.save_full[:200]!r}: {error.strerror}")
    return args, config


def lessons():
    """The lessons' files this one composes, on the path: (grid, parallel_lm, text_data)."""
    from common import import_stage
    import_stage("07_parallelism/02_fsdp/fsdp")
    import_stage("07_parallelism/03_tensor_parallel/tensor_parallel")
    import_stage("07_parallelism/04_pipeline_parallel/pipeline_parallel")
    import_stage("07_parallelism/05_context_parallel/context_parallel")
    return (import_stage("07_parallelism/07_together/grid"),
            import_stage("07_parallelism/07_together/parallel_lm"),
            import_stage("07_parallelism/07_together/text_data"))


def build_full_lm(args):
    """The single-process LM, the same on every rank for a seed: every grid slices it."""
    from common import models
    torch.manual_seed(args.seed)
    return models.TransformerLM(args.model, vocab_size=256, context_length=args.seq_len)


def build(ctx, args):
    """This rank's grid, its chunks of the full LM (FSDP-wrapped under HSDP), AdamW over them
    (ZeRO-1 over the data and context ranks with --fsdp: AdamW works element by element, so
    AdamW on slices of the weights is AdamW on the weights), and the full LM."""
    from common import import_stage
    grid_mod, parallel_lm, _ = lessons()
    grid = grid_mod.ProcessGrid(dp=args.dp, pp=args.pp, cp=args.cp, tp=args.tp,
                                dp_shard=args.dp_shard)
    full_lm = build_full_lm(args)
    chunks = [c.to(ctx.device) for c in parallel_lm.build_chunks(full_lm, grid, args.seq_len,
                                                                  args.chunks)]
    if args.dp_shard > 1:
        parallel_lm.shard_chunks(chunks, grid)
    params = [p for chunk in chunks for p in chunk.parameters()]
    if args.fsdp:
        zero = import_stage("07_parallelism/01_zero/zero")
        optimizer = zero.ShardedOptimizer(params, torch.optim.AdamW, lr=args.lr,
                                          process_group=grid.group("dp_cp"), weight_decay=0.0,
                                          eps=ADAM_EPS)
    else:
        optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, eps=ADAM_EPS)
    return grid, chunks, optimizer, full_lm


def load_text(args):
    """(training tokens, held-out tokens)."""
    text_data = lessons()[2]
    train, held_out = text_data.load_text(args.data, max_bytes=args.max_bytes)
    return text_data.as_tokens(train), text_data.as_tokens(held_out)


def batch(tokens, step: int, args, held_out: bool = False):
    """The global batch of ``step``: the same on every rank and grid (another seed held out)."""
    text_data = lessons()[2]
    return text_data.batch_at(tokens, step, args.batch_size, args.seq_len, args.seed + held_out)


def train_main(ctx, args, checkpoints_class=None) -> None:
    """The run: progress lines, then (rank 0) the curve, the picture, the sample, the model.
    ``checkpoints_class``: lesson 8's, whose ``resume()`` gives the first step and whose
    ``after_step(step)`` saves when a save is due."""
    if args.check:                 # --check-steps beside one process; exit 1 on a difference
        problems, worst = check_against_one_process(ctx, args, args.check_steps)
        if problems:
            ctx.print("the grid differs from one process:\n  " + "\n  ".join(problems[:20]),
                      all_ranks=False)
            raise SystemExit(1)
        ctx.print(f"check: {args.check_steps} steps on the grid equal {args.check_steps} steps "
                  f"of one process (the loss, every gradient; weights allclose, largest "
                  f"difference {worst:.2e})", all_ranks=False)
    grid_mod, parallel_lm, text_data = lessons()
    grid, chunks, optimizer, full_lm = build(ctx, args)
    train_tokens, held_out = load_text(args)
    first_step = 0
    checkpoints = None
    if checkpoints_class is not None:
        checkpoints = checkpoints_class(args, chunks, grid, optimizer, parallel_lm, full_lm)
        first_step = checkpoints.resume()
    grid_text = f"dp {args.dp} x pp {args.pp} x cp {args.cp} x tp {args.tp}"
    unigram = text_data.unigram_loss(train_tokens, held_out)
    parameters = sum(p.numel() for p in full_lm.parameters())
    ctx.print(f"training the {args.model} LM ({parameters} parameters) on {grid_text}, "
              f"{args.schedule} with {args.micro_batches} micro-batch(es), {args.steps} steps of "
              f"{args.batch_size * args.seq_len} tokens; {len(train_tokens)} training bytes, "
              f"unigram loss {unigram:.3f}\nthe grid (rank numbers; tp innermost):\n"
              + grid_mod.draw_grid(args.dp, args.pp, args.cp, args.tp, args.dp_shard),
              all_ranks=False)
    curve = []
    start = time.perf_counter()
    for step in range(first_step, args.steps):
        inputs, targets = batch(train_tokens, step, args)
        result = parallel_lm.train_step(chunks, grid, args.schedule, args.micro_batches, inputs,
                                        targets, ctx.device)
        stop_unless_finite(result["loss"], step + 1)    # the same loss on every rank
        optimizer.step()
        if checkpoints is not None:
            checkpoints.after_step(step + 1)
        row = {"step": step + 1, "loss": result["loss"], "held_out_loss": float("nan")}
        if (step + 1) % args.log_every == 0 or step == args.steps - 1:
            losses = []
            for index in range(args.eval_batches):     # the same held-out batches every time
                held_inputs, held_targets = batch(held_out, index, args, held_out=True)
                losses.append(parallel_lm.evaluate(chunks, grid, held_inputs, held_targets,
                                                   ctx.device))
            row["held_out_loss"] = sum(losses) / len(losses)
            elapsed = time.perf_counter() - start
            tokens_per_s = (step + 1 - first_step) * args.batch_size * args.seq_len / elapsed
            ctx.print(f"step {step + 1:5d}  loss {row['loss']:.3f}  held-out "
                      f"{row['held_out_loss']:.3f}  {tokens_per_s:8.0f} tokens/s",
                      all_ranks=False)
        curve.append(row)
    state = parallel_lm.full_state_dict(chunks, grid)
    if ctx.is_main and curve:
        finish(args, curve, state, grid_text, unigram, held_out)


def stop_unless_finite(loss: float, step: int) -> None:
    """A loss of NaN or infinity stops the run: one line from rank 0, exit 2 on every rank."""
    if math.isfinite(loss):
        return
    if dist.get_rank() == 0:
        print(f"{os.path.basename(sys.argv[0])}: error: step {step}: the loss is {loss}; "
              "training stopped (try a smaller --lr)", file=sys.stderr, flush=True)
    dist.barrier()                  # the line is out before any rank exits
    raise SystemExit(2)


def finish(args, curve: list[dict], state: dict, grid_text: str, unigram: float, held_out):
    """Rank 0: the curve to results/, the picture, the sample, the saved model."""
    from common import models
    results = Path(os.environ.get("RESULTS_DIR") or Path(__file__).parents[2] / "results")
    results.mkdir(parents=True, exist_ok=True)
    run = {"model": args.model, "seed": str(args.seed), "seq_len": str(args.seq_len),
           "batch_size": str(args.batch_size), "lr": str(args.lr), "data": args.data or "stdlib"}
    path = results / "train_curve.csv"
    rows = []
    if path.exists():
        with open(path) as f:     # every other run's rows, and this run's on other grids
            rows = [row for row in csv.DictReader(f)
                    if {key: row.get(key) for key in run} != run or row["grid"] != grid_text]
    rows += [{**run, "grid": grid_text, **row} for row in curve]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*run, "grid", "step", "loss", "held_out_loss"],
                                extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}", flush=True)
    final = curve[-1]["held_out_loss"]          # the last step always evaluates
    verdict = "below" if final < unigram else "NOT below"
    print(f"held-out loss {final:.3f} nats/byte, {verdict} the unigram baseline {unigram:.3f} "
          "(each byte predicted by its frequency alone)", flush=True)
    plot(results, [row for row in rows if {key: row.get(key) for key in run} == run], unigram)
    lm = models.TransformerLM(args.model, vocab_size=256, context_length=args.seq_len)
    lm.load_state_dict(state)
    print("sample (the held-out text's first bytes, then the model's, at temperature 0.7):\n"
          + sample(lm, held_out, args), flush=True)
    if args.save_full:
        try:                        # the old file stays whole until the new one is
            torch.save(state, args.save_full + ".tmp")
            os.replace(args.save_full + ".tmp", args.save_full)
        except OSError as error:
            Path(args.save_full + ".tmp").unlink(missing_ok=True)
            print(f"{os.path.basename(sys.argv[0])}: error: --save-full {args.save_full}: "
                  f"{error.strerror}", file=sys.stderr, flush=True)
            raise SystemExit(2)
        print(f"saved the full model to {args.save_full}", flush=True)


def plot(results: Path, rows: list[dict], unigram: float) -> None:
    """Every grid's curve of this run; one process wide and pale underneath, the grids thin on
    top: where they agree, the thin line runs inside the wide one."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no picture: matplotlib is not installed)", flush=True)
        return
    figure, axes = plt.subplots(figsize=(8, 4.5))
    grids = sorted({row["grid"] for row in rows}, key=lambda name: name != SINGLE_PROCESS)
    for name in grids:
        mine = sorted((row for row in rows if row["grid"] == name), key=lambda r: int(r["step"]))
        width, alpha = (4, 0.35) if name == SINGLE_PROCESS else (1, 1.0)
        axes.plot([int(r["step"]) for r in mine], [float(r["loss"]) for r in mine],
                  linewidth=width, alpha=alpha, label=f"training loss, {name}")
    axes.axhline(unigram, color="gray", linestyle=":", label="unigram baseline")
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats per byte)")
    axes.legend()
    figure.savefig(results / "train_loss.png", dpi=100, bbox_inches="tight")
    plt.close(figure)
    print(f"wrote {results / 'train_loss.png'}", flush=True)


def sample(lm, held_out, args, new_bytes: int = 200, temperature: float = 0.7) -> str:
    """A continuation of the start of the held-out text, sampled at ``temperature`` (seeded)."""
    tokens = held_out[:args.seq_len // 2].view(1, -1)
    generator = torch.Generator().manual_seed(args.seed)
    lm.eval()
    with torch.no_grad():
        for _ in range(new_bytes):
            logits = lm(tokens[:, -args.seq_len:])[0, -1]      # the next byte's logits [256]
            probabilities = torch.softmax(logits / temperature, dim=-1)
            next_token = torch.multinomial(probabilities, 1, generator=generator)
            tokens = torch.cat([tokens, next_token.view(1, 1)], dim=1)
    return bytes(tokens[0].tolist()).decode("utf-8", errors="replace")


def check_against_one_process(ctx, args, steps: int, more_checks=None) -> tuple[list, float]:
    """The grid of ``args`` and one process side by side for ``steps`` steps on the same batches:
    a held-out batch forward only, then after each step the loss, every gradient and weight
    (gathered whole on rank 0), and ``more_checks(chunks, grid)`` (the tests'). Returns the
    problems, the same list on every rank (it stops at the first step with one), and rank 0's
    largest weight difference."""
    from common import models, verify
    _, parallel_lm, _ = lessons()
    grid, chunks, optimizer, _ = build(ctx, args)
    train_tokens, held_out = load_text(args)
    reference = build_full_lm(args).to(ctx.device)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr, weight_decay=0.0,
                                            eps=ADAM_EPS)
    inputs, targets = batch(held_out, 0, args, held_out=True)
    evaluated = parallel_lm.evaluate(chunks, grid, inputs, targets, ctx.device)
    with torch.no_grad():
        want = models.lm_loss(reference(inputs.to(ctx.device)), targets.to(ctx.device)).item()
    problems = []
    if not math.isclose(evaluated, want, rel_tol=1e-5, abs_tol=1e-6):
        problems.append(f"the held-out loss, forward only: the grid {evaluated:.7f}, one "
                        f"process {want:.7f}")
    worst = 0.0
    for step in range(steps):
        agreed = verify.agree_on_problems(problems)
        if agreed:                 # every rank has the same list: every rank stops here
            grid.destroy()
            return agreed, worst
        inputs, targets = batch(train_tokens, step, args)
        result = parallel_lm.train_step(chunks, grid, args.schedule, args.micro_batches, inputs,
                                        targets, ctx.device)
        reference_optimizer.zero_grad(set_to_none=True)
        loss = models.lm_loss(reference(inputs.to(ctx.device)), targets.to(ctx.device))
        loss.backward()
        if not math.isclose(result["loss"], loss.item(), rel_tol=1e-5, abs_tol=1e-6):
            problems.append(f"step {step + 1}: the grid reports loss {result['loss']:.7f}, one "
                            f"process {loss.item():.7f}")
        gradients = parallel_lm.full_state_dict(chunks, grid, gradients=True)
        want = {name: p.grad for name, p in reference.named_parameters()}
        # float32 sums of the same terms in another order (over dp x cp ranks and their
        # shards): 1.4e-5 of a tensor's largest gradient seen on this 2-core VM; a wrong
        # reduction (a sum for a mean, a missing axis) is off by 1/2 or more
        problems += differences(gradients, want, step, "gradient", 5e-5, 1e-12)[0]
        optimizer.step()
        reference_optimizer.step()
        weights = parallel_lm.full_state_dict(chunks, grid)
        found, difference = differences(weights, reference.state_dict(), step, "weight", 0.0,
                                        1e-5)
        problems += found
        worst = max(worst, difference)       # on rank 0, which compares the gathered weights
        if more_checks is not None:
            problems += more_checks(chunks, grid)
    grid.destroy()
    return verify.agree_on_problems(problems), worst


def differences(state: dict | None, want: dict, step: int, what: str, relative_atol: float,
                atol: float) -> tuple[list[str], float]:
    """A gathered full state (on rank 0; None elsewhere) against the reference's: allclose at
    rtol 1e-4 and an atol of ``atol`` + ``relative_atol`` x the tensor's largest value."""
    if state is None:
        return [], 0.0
    problems = []
    worst = 0.0
    for name, expected in want.items():
        got = state[name].to(expected.device)
        difference = (got - expected).abs().max().item()
        worst = max(worst, difference)
        largest = expected.abs().max().item()
        if not torch.allclose(got, expected, rtol=1e-4, atol=atol + relative_atol * largest):
            problems.append(f"step {step + 1}: {name} {what} differs from one process by "
                            f"{difference:.3g} (largest value {largest:.3g})")
    return problems, worst


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: common/
    from common import launch
    arguments, launch_config = parse()
    lessons()                      # the lessons' folders on the path, for every worker
    launch.launch(train_main, launch_config, arguments)
