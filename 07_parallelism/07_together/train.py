"""Stage 07, lesson 7: train the course LM on real text over a grid of data, pipeline, context
and tensor parallel ranks, and check it against one process.

    python 07_parallelism/07_together/train.py --dp 2 --tp 2           # 4 ranks, a few minutes
    python 07_parallelism/07_together/train.py --dp 1 --pp 1 --cp 1 --tp 1   # one process
    python 07_parallelism/07_together/train.py --dp 2 --pp 2 --tp 2 --steps 20 --check
    torchrun --nproc-per-node=4 07_parallelism/07_together/train.py --dp 2 --tp 2
    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT \\
        07_parallelism/07_together/train.py --dp 2 --pp 2 --tp 2          # tp inside a node
    python 07_parallelism/07_together/train.py --bench     # measure/grid_bench.py's numbers

The text is the Python standard library's source on this machine (``--data FILE`` for any
other), bytes as tokens. The global batch of each step is the same whatever the grid, so
every grid trains the same model: ``--check`` trains one process beside the grid and compares
the weights after every step. A line every ``--log-every`` steps gives the loss, the held-out
loss, tokens per second and the time left; at the end a picture of the loss curve (the single-
process curve of the same seed on top when one was run before: ``results/train_curve.csv``)
and a short sample of generated text. ``--save-full PATH`` writes the trained model as the
single-process ``TransformerLM``'s state dict.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _repo() -> None:
    """The harness needs common/, the algorithm above does not (same in every stage, on purpose)."""
    root = Path(__file__).resolve().parent
    while not (root / "common" / "launch.py").exists():
        if root == root.parent:
            raise SystemExit(f"{Path(__file__).name}: the algorithm above works on its own; the "
                             "demo and benchmark need the repository around this file (common/)")
        root = root.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


def lessons():
    """The lessons' algorithm files this one composes, on the path (and so in every worker)."""
    from common import import_stage
    import_stage("07_parallelism/03_tensor_parallel/tensor_parallel")
    import_stage("07_parallelism/04_pipeline_parallel/pipeline_parallel")
    import_stage("07_parallelism/05_context_parallel/context_parallel")
    grid = import_stage("07_parallelism/07_together/grid")
    parallel_lm = import_stage("07_parallelism/07_together/parallel_lm")
    text_data = import_stage("07_parallelism/07_together/text_data")
    return grid, parallel_lm, text_data


def checkpoints_lesson():
    """Lesson 8's checkpoints (--checkpoint-dir): save, resume, on any grid."""
    from common import import_stage
    return import_stage("07_parallelism/08_checkpoints/resume")


SCHEDULES = ("1f1b", "gpipe", "interleaved", "zbh1")
CURVE_CSV = "train_curve.csv"
SINGLE_PROCESS = "dp 1 x pp 1 x cp 1 x tp 1"


# --------------------------------------------------------------------------- the model and data


def build_full_lm(args):
    """The single-process LM, the same on every rank for a given seed: every grid slices it."""
    from common import models
    torch.manual_seed(args.seed)
    return models.TransformerLM(args.model, vocab_size=256, context_length=args.seq_len)


def make_optimizer(params, args, grid):
    """AdamW over this rank's pieces. AdamW works element by element, so AdamW on slices of
    the weights is AdamW on the weights. ``--fsdp``: ZeRO-1 over the data-and-context ranks
    (lesson 1's ShardedOptimizer): each keeps the AdamW state of the pieces it owns."""
    from common import import_stage
    if args.fsdp:
        zero = import_stage("07_parallelism/01_zero/zero")
        return zero.ShardedOptimizer(params, torch.optim.AdamW, process_group=grid.group("dp_cp"),
                                     lr=args.lr, weight_decay=0.0, eps=ADAM_EPS)
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, eps=ADAM_EPS)


class Text:
    """The training and held-out tokens, and the global batch of any step."""

    def __init__(self, args):
        _, _, text_data = lessons()
        train, held_out = text_data.load_text(args.data, max_bytes=args.max_bytes)
        self.train = text_data.as_tokens(train)
        self.held_out = text_data.as_tokens(held_out)
        self.unigram = text_data.unigram_loss(self.train, self.held_out)
        self.text_data = text_data
        self.args = args

    def batch(self, step: int):
        return self.text_data.batch_at(self.train, step, self.args.batch_size, self.args.seq_len,
                                       self.args.seed)

    def held_out_batch(self, index: int):
        return self.text_data.batch_at(self.held_out, index, self.args.batch_size,
                                       self.args.seq_len, self.args.seed + 1)


# --------------------------------------------------------------------------- training


def evaluate(chunks, grid, parallel_lm, inputs, targets, device) -> float:
    """The mean loss of one global batch, forward only: each virtual stage in turn, the
    activation sent on to the next one's rank (no pipelining: it is only an evaluation)."""
    pp = grid.size("pp")
    pp_group = grid.group("pp")
    loss_fn = parallel_lm.scaled_loss_fn(grid)
    x = parallel_lm.local_tokens(inputs, grid).to(device)
    my_targets = parallel_lm.local_tokens(targets, grid).to(device)
    d_model = chunks[0].blocks[0].norm1.normalized_shape[0]
    shape = (x.shape[0], x.shape[1], d_model)
    share = torch.zeros(1, dtype=torch.float64, device=device)
    virtual_stages = pp * len(chunks)
    with torch.no_grad():
        for stage in range(virtual_stages):
            owner = stage % pp                  # virtual stage s lives on pipeline rank s % pp
            if owner != grid.rank("pp"):
                continue
            if stage > 0:
                x = torch.empty(shape, device=device)
                dist.recv(x, dist.get_global_rank(pp_group, (stage - 1) % pp), group=pp_group)
            out = chunks[stage // pp](x)
            if stage < virtual_stages - 1:
                dist.send(out.contiguous(), dist.get_global_rank(pp_group, (stage + 1) % pp),
                          group=pp_group)
            else:
                share[0] = loss_fn(out, my_targets)
    dist.all_reduce(share)                      # the shares of the R token holders, and zeros
    return share.item()


def train_main(ctx, args) -> None:
    """The training run: progress lines, then (rank 0) the curve, the picture, the sample."""
    from common import results
    if args.check:
        check_main(ctx, args)
    grid_mod, parallel_lm, _ = lessons()
    grid = grid_mod.ProcessGrid(dp=args.dp, pp=args.pp, cp=args.cp, tp=args.tp)
    text = Text(args)
    full_lm = build_full_lm(args)
    chunks = [chunk.to(ctx.device) for chunk in
              parallel_lm.build_chunks(full_lm, grid, args.seq_len, args.chunks)]
    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = make_optimizer(params, args, grid)
    # lesson 8: resume from the newest checkpoint (step 0 without one), save as it goes
    checkpoints = None
    first_step = 0
    if args.checkpoint_dir is not None:
        checkpoints = checkpoints_lesson().TrainingCheckpoints(args, chunks, grid, optimizer,
                                                               parallel_lm, full_lm)
        first_step = checkpoints.resume()
        if first_step >= args.steps:
            ctx.print(f"{args.checkpoint_dir} is at step {first_step}: nothing left of --steps "
                      f"{args.steps}", all_ranks=False)
            return
    grid_text = f"dp {args.dp} x pp {args.pp} x cp {args.cp} x tp {args.tp}"
    tokens_per_step = args.batch_size * args.seq_len
    parameter_count = sum(p.numel() for p in full_lm.parameters())
    ctx.print(f"training the {args.model} LM ({parameter_count} parameters, bytes as tokens) on "
              f"{grid_text}, "
              f"{args.schedule} with {args.micro_batches} micro-batch(es), {args.steps} steps of "
              f"{tokens_per_step} tokens; text: {len(text.train)} training bytes, unigram loss "
              f"{text.unigram:.3f} ({results.machine_name()})", all_ranks=False)
    ctx.print(parallel_lm_grid_picture(grid_mod, args), all_ranks=False)
    curve = []
    start = time.perf_counter()
    for step in range(first_step, args.steps):
        inputs, targets = text.batch(step)
        result = parallel_lm.train_step(chunks, grid, args.schedule, args.micro_batches, inputs,
                                        targets, ctx.device)
        optimizer.step()
        if checkpoints is not None:
            checkpoints.after_step(step + 1)
        row = {"step": step + 1, "loss": result["loss"], "held_out_loss": float("nan")}
        last = step == args.steps - 1
        if (step + 1) % args.log_every == 0 or last:
            held_out = []
            for index in range(args.eval_batches):   # the same held-out batches every time
                held_inputs, held_targets = text.held_out_batch(index)
                held_out.append(evaluate(chunks, grid, parallel_lm, held_inputs, held_targets,
                                         ctx.device))
            row["held_out_loss"] = sum(held_out) / len(held_out)
            elapsed = time.perf_counter() - start
            tokens_per_s = (step + 1 - first_step) * tokens_per_step / elapsed
            left = elapsed / (step + 1 - first_step) * (args.steps - step - 1)
            ctx.print(f"step {step + 1:5d}  loss {row['loss']:.3f}  held-out "
                      f"{row['held_out_loss']:.3f}  {tokens_per_s:8.0f} tokens/s  "
                      f"{left:5.0f} s left", all_ranks=False)
        curve.append(row)
    state = parallel_lm.full_state_dict(chunks, grid)
    if ctx.is_main:
        finish(args, text, curve, state, grid_text)


# AdamW's eps, here and in the reference: with torch's 1e-8, rounding noise in a near-zero
# gradient becomes a step of about the learning rate (m / sqrt(v) ~ sign(g) when |g| ~ eps), and
# weights that should agree to float32 rounding differ by lr. 1e-6 keeps such noise below it.
ADAM_EPS = 1e-6


def full_differences(state: dict | None, want: dict, what: str, step: int,
                     relative_atol: float, atol: float) -> tuple[list[str], float]:
    """Compare a gathered full state (on rank 0; None elsewhere) with the reference's: allclose
    at rtol 1e-4 and an atol of ``atol`` plus ``relative_atol`` times the tensor's largest value
    (gradients: relative, their scale varies from tensor to tensor; weights: float32 rounding
    through a few AdamW steps of the learning rate)."""
    problems = []
    worst = 0.0
    if state is None:
        return problems, worst
    for name, expected in want.items():
        got = state[name].to(expected.device)
        difference = (got - expected).abs().max().item()
        worst = max(worst, difference)
        tolerance = atol + relative_atol * expected.abs().max().item()
        if not torch.allclose(got, expected, rtol=1e-4, atol=tolerance):
            problems.append(f"step {step + 1}: {name} {what} differs from one process by "
                            f"{difference:.3g} (largest value {expected.abs().max().item():.3g})")
    return problems, worst


def agree(problems: list[str]) -> list[str]:
    """Every rank's problems on every rank, named by rank: one verdict (common/verify.py)."""
    from common import verify
    return verify.agree_on_problems(problems)


def check_against_one_process(ctx, args, steps: int, loss_fn=None,
                              sum_grads=None) -> tuple[list[str], float]:
    """Train the grid of ``args`` and one process side by side for ``steps`` steps on the same
    global batches. After each backward: the gradients (gathered whole) and the loss the grid
    reports against one process's; after each step: the weights, and every replica bitwise
    equal to its copies. ``loss_fn`` and ``sum_grads`` replace the lesson's own (the tests
    plant bugs there). Returns the problems, the same list on every rank, and the largest
    weight difference. Stops at the first step with a problem."""
    from common import models
    grid_mod, parallel_lm, _ = lessons()
    grid = grid_mod.ProcessGrid(dp=args.dp, pp=args.pp, cp=args.cp, tp=args.tp)
    text = Text(args)
    chunks = [chunk.to(ctx.device) for chunk in
              parallel_lm.build_chunks(build_full_lm(args), grid, args.seq_len, args.chunks)]
    optimizer = make_optimizer([p for chunk in chunks for p in chunk.parameters()], args, grid)
    reference = build_full_lm(args).to(ctx.device)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr, weight_decay=0.0,
                                            eps=ADAM_EPS)
    if sum_grads is None:
        sum_grads = parallel_lm.sum_gradients
    worst = 0.0
    for step in range(steps):
        inputs, targets = text.batch(step)
        result = parallel_lm.train_step(chunks, grid, args.schedule, args.micro_batches, inputs,
                                        targets, ctx.device, loss_fn=loss_fn, sum_grads=sum_grads)
        reference_optimizer.zero_grad(set_to_none=True)
        reference_loss = models.lm_loss(reference(inputs.to(ctx.device)), targets.to(ctx.device))
        reference_loss.backward()
        problems = []
        if not math.isclose(result["loss"], reference_loss.item(), rel_tol=1e-5, abs_tol=1e-6):
            problems.append(f"step {step + 1}: the grid reports loss {result['loss']:.7f}, one "
                            f"process {reference_loss.item():.7f}")
        gradients = parallel_lm.full_state_dict(chunks, grid, gradients=True)
        reference_gradients = {}
        for name, p in reference.named_parameters():
            reference_gradients[name] = p.grad
        found, _ = full_differences(gradients, reference_gradients, "gradient", step, 1e-5, 1e-12)
        problems.extend(found)
        optimizer.step()
        reference_optimizer.step()
        weights = parallel_lm.full_state_dict(chunks, grid)
        found, difference = full_differences(weights, reference.state_dict(), "weight", step, 0.0,
                                            1e-5)
        problems.extend(found)
        worst = max(worst, difference)
        problems.extend(replica_differences(chunks, grid, parallel_lm))
        agreed = agree(problems)
        if agreed:
            return agreed, worst     # every rank has the same list: every rank stops here
    worst_everywhere = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(worst_everywhere, op=dist.ReduceOp.MAX)
    return [], worst_everywhere.item()


def check_main(ctx, args) -> None:
    """--check: ``--check-steps`` steps beside one process; every rank raises on a difference."""
    problems, worst = check_against_one_process(ctx, args, args.check_steps)
    if problems:
        raise AssertionError("the grid differs from one process:\n  " + "\n  ".join(problems[:20]))
    ctx.print(f"check: {args.check_steps} steps on the grid equal {args.check_steps} steps of one "
              f"process (weights allclose, largest difference {worst:.2e}; the same loss; "
              "replicas bitwise equal)", all_ranks=False)


def replica_differences(chunks, grid, parallel_lm) -> list[str]:
    """Copies of one piece held by several ranks must be bitwise equal: over dp and cp for
    every piece, and over tp too for the pieces tensor parallelism does not split."""
    problems = []
    for entry in parallel_lm.placements(chunks, grid):
        groups = ["dp_cp"]
        if len(entry["boxes"]) == 1 and entry["boxes"][0][0] == entry["boxes"][0][1] \
                and list(entry["tensor"].shape) == list(entry["full_shape"]):
            groups.append("tp")
        for axis in groups:
            if grid.size(axis) == 1:
                continue
            mine = entry["tensor"].detach().contiguous()
            copies = [torch.empty_like(mine) for _ in range(grid.size(axis))]
            dist.all_gather(copies, mine, group=grid.group(axis))
            for index, copy in enumerate(copies):
                if not torch.equal(copy, mine):
                    problems.append(f"{entry['name']}: the copy on {axis} rank {index} differs "
                                    f"from rank {grid.rank(axis)}'s")
    return problems


def parallel_lm_grid_picture(grid_mod, args) -> str:
    return "the grid (rank numbers; tp innermost):\n" + grid_mod.draw_grid(args.dp, args.pp,
                                                                           args.cp, args.tp)


def finish(args, text, curve: list[dict], state: dict, grid_text: str) -> None:
    """Rank 0: the curve to results/, the picture, the sample, the saved model."""
    from common import models, results
    rows = []
    for row in curve:
        rows.append({"model": args.model, "seed": args.seed, "seq_len": args.seq_len,
                     "batch_size": args.batch_size, "lr": args.lr, "data": args.data or "stdlib",
                     "grid": grid_text, **row, "run_id": results.run_id()})
    path = results.upsert_csv(CURVE_CSV, rows, key=["model", "seed", "seq_len", "batch_size", "lr",
                                                    "data", "grid", "step"])
    print(f"wrote {path}", flush=True)
    final = [r for r in curve if not math.isnan(r["held_out_loss"])][-1]["held_out_loss"]
    verdict = "below" if final < text.unigram else "NOT below"
    print(f"held-out loss {final:.3f} nats/byte, {verdict} the unigram baseline "
          f"{text.unigram:.3f} (predicting each byte by its frequency alone)", flush=True)
    plot_curve(args, grid_text, text.unigram)
    lm = models.TransformerLM(args.model, vocab_size=256, context_length=args.seq_len)
    lm.load_state_dict(state)
    print("sample (the held-out text's first bytes, then the model's, at temperature 0.7):\n"
          + sample(lm, text, args), flush=True)
    if args.save_full:
        torch.save(state, args.save_full)
        print(f"saved the full model to {args.save_full}: "
              "TransformerLM(...).load_state_dict(torch.load(PATH))", flush=True)


def plot_curve(args, grid_text: str, unigram: float) -> None:
    from common import results
    plt = results.pyplot()
    if plt is None:
        print("(no picture: matplotlib is not installed)", flush=True)
        return
    same_run = {"model": args.model, "seed": str(args.seed), "seq_len": str(args.seq_len),
                "batch_size": str(args.batch_size), "lr": str(args.lr),
                "data": args.data or "stdlib"}
    by_grid = {}
    for row in results.read_csv(CURVE_CSV):
        if all(row.get(key) == value for key, value in same_run.items()):
            by_grid.setdefault(row["grid"], []).append(row)
    figure, axes = plt.subplots(figsize=(8, 4.5))
    names = sorted(by_grid, key=lambda name: name != SINGLE_PROCESS)  # one process first
    for name in names:
        rows = by_grid[name]
        rows.sort(key=lambda row: int(row["step"]))
        steps = [int(row["step"]) for row in rows]
        losses = [float(row["loss"]) for row in rows]
        # One process underneath, wide and pale; the grid on top, thin: where they agree, the
        # thin line runs inside the wide one.
        width = 1
        alpha = 1.0
        if name == SINGLE_PROCESS:
            width = 4
            alpha = 0.35
        line = axes.plot(steps, losses, linewidth=width, alpha=alpha,
                         label=f"training loss, {name}")
        held_steps = []
        held_losses = []
        for row in rows:
            if row["held_out_loss"] not in ("", "nan"):
                held_steps.append(int(row["step"]))
                held_losses.append(float(row["held_out_loss"]))
        axes.plot(held_steps, held_losses, "o", color=line[0].get_color(), alpha=alpha,
                  markersize=4 + width, label=f"held-out loss, {name}")
    axes.axhline(unigram, color="gray", linestyle=":", label="unigram baseline")
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats per byte)")
    axes.legend()
    path = results.results_dir() / "train_loss.png"
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)
    print(f"wrote {path}", flush=True)


def sample(lm, text, args, new_bytes: int = 200, temperature: float = 0.7) -> str:
    """A continuation of the start of the held-out text, sampled at ``temperature`` (seeded)."""
    prompt = text.held_out[:args.seq_len // 2].tolist()
    tokens = torch.tensor([prompt])
    generator = torch.Generator().manual_seed(args.seed)
    lm.eval()
    with torch.no_grad():
        for _ in range(new_bytes):
            window = tokens[:, -args.seq_len:]
            logits = lm(window)[0, -1]                     # the next byte's logits [256]
            probabilities = torch.softmax(logits / temperature, dim=-1)
            next_token = torch.multinomial(probabilities, 1, generator=generator)
            tokens = torch.cat([tokens, next_token.view(1, 1)], dim=1)
    produced = bytes(tokens[0].tolist())
    return produced.decode("utf-8", errors="replace")


# --------------------------------------------------------------------------- command line


def check_grid(args, world_size: int, parser) -> None:
    """Refuse, before any worker starts, a grid the model or the batch cannot take."""
    from common import models
    grid_lm, _, _ = lessons()
    product = args.dp * args.pp * args.cp * args.tp
    if product != world_size:
        parser.error(f"--dp {args.dp} x --pp {args.pp} x --cp {args.cp} x --tp {args.tp} = "
                     f"{product}, but the world size is {world_size}; the product must equal it")
    preset = models.PRESETS[args.model]
    if preset["num_heads"] % args.tp != 0 or preset["d_ff"] % args.tp != 0:
        parser.error(f"--tp {args.tp} must divide the {args.model} LM's {preset['num_heads']} "
                     f"heads and its hidden size {preset['d_ff']}")
    if args.seq_len % (2 * args.cp * args.tp) != 0:
        parser.error(f"--seq-len {args.seq_len} must divide by 2 x cp x tp = "
                     f"{2 * args.cp * args.tp} (zig-zag context chunks, then sequence parallel)")
    if args.seq_len > 4096:
        parser.error(f"--seq-len {args.seq_len}: at most 4096 (the position table grows with it)")
    if args.schedule != "interleaved" and args.chunks != 1:
        parser.error("--chunks is for --schedule interleaved only")
    layers = preset["num_layers"]
    if layers % (args.pp * args.chunks) != 0:
        parser.error(f"the {args.model} LM's {layers} layers do not split into --pp {args.pp} x "
                     f"--chunks {args.chunks} equal pieces")
    if args.batch_size % args.dp != 0:
        parser.error(f"--batch-size {args.batch_size} must divide by --dp {args.dp}")
    rows = args.batch_size // args.dp
    if rows % args.micro_batches != 0:
        parser.error(f"--micro-batches {args.micro_batches} must divide each data-parallel "
                     f"rank's {rows} rows (--batch-size / --dp)")
    if args.schedule == "interleaved" and args.micro_batches % args.pp != 0:
        parser.error(f"--schedule interleaved needs --micro-batches a multiple of --pp "
                     f"({args.micro_batches} is not a multiple of {args.pp})")


def main(argv=None) -> None:
    _repo()
    from common import import_stage, launch, models, results
    bench = import_stage("07_parallelism/measure/grid_bench")
    parser = launch.make_parser(__doc__, world_size=4)
    bench.add_bench_args(parser)
    parser.add_argument("--dp", type=launch.positive_int, default=None,
                        help="data-parallel degree (default: the world size / (pp cp tp))")
    parser.add_argument("--pp", type=launch.positive_int, default=1, help="pipeline stages")
    parser.add_argument("--cp", type=launch.positive_int, default=1, help="context-parallel degree")
    parser.add_argument("--tp", type=launch.positive_int, default=1, help="tensor-parallel degree")
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
                        help="the model's initial weights and the order of the batches")
    parser.add_argument("--data", default=None,
                        help="a text file to train on (default: this Python's standard library)")
    parser.add_argument("--max-bytes", type=launch.positive_int, default=4_000_000,
                        help="read at most this much training text")
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
                        help="lesson 8: resume from the newest complete checkpoint in this folder "
                             "(on any grid), save into it at the end and every "
                             "--checkpoint-every steps, keeping the newest two")
    parser.add_argument("--checkpoint-every", type=launch.positive_int, default=None,
                        help="with --checkpoint-dir: save every this many steps")
    parser.add_argument("--crash-at-step", type=launch.positive_int, default=None,
                        help="with --checkpoint-dir, to watch a resume: the last rank kills "
                             "itself (SIGKILL) right after this step, on torchrun's first "
                             "attempt only (torchrun --max-restarts=1 restarts and resumes)")
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    if args.bench:
        bench.run(args, config, parser)     # the measurements instead of a training run
        return
    if args.checkpoint_dir is None and (args.checkpoint_every is not None
                                        or args.crash_at_step is not None):
        parser.error("--checkpoint-every and --crash-at-step need --checkpoint-dir")
    if args.checkpoint_dir is not None and Path(args.checkpoint_dir).exists() \
            and not Path(args.checkpoint_dir).is_dir():
        parser.error(f"--checkpoint-dir {args.checkpoint_dir}: not a folder")
    if args.dp is None:
        args.dp = max(1, config.world_size // (args.pp * args.cp * args.tp))
    check_grid(args, config.world_size, parser)
    if args.data is not None and not Path(args.data).is_file():
        parser.error(f"--data {args.data}: no such file")
    results.check_writable()
    launch.launch(train_main, config, args)


if __name__ == "__main__":
    main()
