"""Stage 07, lesson 7: the training run over a grid, and its check against one process.

``train.py`` runs it (``train_main``); lesson 8's ``resume.py`` runs the same loop with its
checkpoints, and ``measure/grid_bench.py`` builds its grids with the same model and optimizer.
What a run does, in order:

1. The model. Every rank builds the same full LM from the seed (``build_full_lm``) and keeps
   only its pieces of it (``parallel_lm.build_chunks``): no broadcast is needed.
2. The text (``Text``): bytes as tokens, a training part and a held-out part that share no
   byte; batch ``step`` is a function of (seed, step) alone, the same on every rank and grid.
3. The loop: ``parallel_lm.train_step`` (forward and backward through the pipeline,
   gradients summed), AdamW; every ``--log-every`` steps the held-out loss. A loss that is not
   finite stops the run with one line naming the step.
4. The end, on rank 0: the loss curve to ``results/train_curve.csv``, its picture, a sample of
   generated text, and with ``--save-full`` the full model.

``check_against_one_process`` (``--check``, and the tests) trains one process beside the
grid on the same batches and compares the loss, every gradient and every weight after each
step, that every replica of a piece is bitwise equal to its copies, and that the pieces
marked to be saved cover the full model exactly once.

    python 07_parallelism/07_together/train.py --dp 2 --tp 2 --steps 20 --check
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch
import torch.distributed as dist


def lessons():
    """The lessons' algorithm files this one composes, on the path (and so in every worker):
    (grid, parallel_lm, text_data)."""
    from common import import_stage
    import_stage("07_parallelism/02_fsdp/fsdp")
    import_stage("07_parallelism/03_tensor_parallel/tensor_parallel")
    import_stage("07_parallelism/04_pipeline_parallel/pipeline_parallel")
    import_stage("07_parallelism/05_context_parallel/context_parallel")
    grid = import_stage("07_parallelism/07_together/grid")
    parallel_lm = import_stage("07_parallelism/07_together/parallel_lm")
    text_data = import_stage("07_parallelism/07_together/text_data")
    return grid, parallel_lm, text_data


CURVE_CSV = "train_curve.csv"
SINGLE_PROCESS = "dp 1 x pp 1 x cp 1 x tp 1"

# AdamW's eps, here and in the reference: with torch's 1e-8, rounding noise in a near-zero
# gradient becomes a step of about the learning rate (m / sqrt(v) ~ sign(g) when |g| ~ eps), and
# weights that should agree to float32 rounding differ by lr. 1e-6 keeps such noise below it.
ADAM_EPS = 1e-6


# --------------------------------------------------------------------------- the model and data


def build_full_lm(args):
    """The single-process LM, the same on every rank for a given seed: every grid slices it."""
    from common import models
    torch.manual_seed(args.seed)
    return models.TransformerLM(args.model, vocab_size=256, context_length=args.seq_len)


def make_grid(grid_mod, args):
    """The grid of ``args``: --dp split into --dp-replicate x --dp-shard (1 unless asked)."""
    return grid_mod.ProcessGrid(dp=args.dp, pp=args.pp, cp=args.cp, tp=args.tp,
                                dp_shard=dp_shard_of(args))


def dp_shard_of(args) -> int:
    """--dp-shard, 1 where the caller's arguments have none (a test's, a bench's)."""
    return getattr(args, "dp_shard", 1)


def build_chunks(args, grid, parallel_lm, full_lm, device) -> list:
    """This rank's chunks of ``full_lm`` on ``device``; under HSDP (--dp-shard > 1) each
    wrapped in FSDP over the grid's dp_shard group (``parallel_lm.shard_chunks``)."""
    chunks = []
    for chunk in parallel_lm.build_chunks(full_lm, grid, args.seq_len, args.chunks):
        chunks.append(chunk.to(device))
    if dp_shard_of(args) > 1:
        parallel_lm.shard_chunks(chunks, grid)
    return chunks


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


def train_main(ctx, args, checkpoints_class=None) -> None:
    """The training run: progress lines, then (rank 0) the curve, the picture, the sample.
    ``checkpoints_class``: lesson 8's ``TrainingCheckpoints`` when it runs this loop (its
    ``resume()`` gives the first step, ``after_step(step)`` saves when a save is due)."""
    from bench import results
    if args.check:
        check_main(ctx, args)
    grid_mod, parallel_lm, _ = lessons()
    grid = make_grid(grid_mod, args)
    text = Text(args)
    full_lm = build_full_lm(args)
    chunks = build_chunks(args, grid, parallel_lm, full_lm, ctx.device)
    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = make_optimizer(params, args, grid)
    checkpoints = None
    first_step = 0
    if checkpoints_class is not None:
        checkpoints = checkpoints_class(args, chunks, grid, optimizer, parallel_lm, full_lm)
        first_step = checkpoints.resume()
        if first_step >= args.steps:
            ctx.print(f"{args.checkpoint_dir} is at step {first_step}: nothing left of --steps "
                      f"{args.steps}", all_ranks=False)
            return
    grid_text = f"dp {args.dp} x pp {args.pp} x cp {args.cp} x tp {args.tp}"
    if dp_shard_of(args) > 1:
        grid_text = (f"dp {args.dp} (replicate {args.dp // args.dp_shard} x shard "
                     f"{args.dp_shard}) x pp {args.pp} x cp {args.cp} x tp {args.tp}")
    tokens_per_step = args.batch_size * args.seq_len
    parameter_count = sum(p.numel() for p in full_lm.parameters())
    ctx.print(f"training the {args.model} LM ({parameter_count} parameters, bytes as tokens) on "
              f"{grid_text}, {args.schedule} with {args.micro_batches} micro-batch(es), "
              f"{args.steps} steps of {tokens_per_step} tokens; text: {len(text.train)} training "
              f"bytes, unigram loss {text.unigram:.3f} ({results.machine_name()})",
              all_ranks=False)
    ctx.print("the grid (rank numbers; tp innermost):\n"
              + grid_mod.draw_grid(args.dp, args.pp, args.cp, args.tp, dp_shard_of(args)),
              all_ranks=False)
    curve = []
    start = time.perf_counter()
    for step in range(first_step, args.steps):
        inputs, targets = text.batch(step)
        result = parallel_lm.train_step(chunks, grid, args.schedule, args.micro_batches, inputs,
                                        targets, ctx.device)
        stop_unless_finite(result["loss"], step + 1)    # the same loss on every rank
        optimizer.step()
        if checkpoints is not None:
            checkpoints.after_step(step + 1)
        row = {"step": step + 1, "loss": result["loss"], "held_out_loss": float("nan")}
        last = step == args.steps - 1
        if (step + 1) % args.log_every == 0 or last:
            held_out = []
            for index in range(args.eval_batches):   # the same held-out batches every time
                held_inputs, held_targets = text.held_out_batch(index)
                held_out.append(parallel_lm.evaluate(chunks, grid, held_inputs, held_targets,
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


def stop_unless_finite(loss: float, step: int) -> None:
    """A loss of NaN or infinity (a learning rate far too large, say) stops the run: one line
    from rank 0 naming the step, exit status 2 on every rank (every rank has the same loss,
    so every rank stops here)."""
    if math.isfinite(loss):
        return
    if dist.get_rank() == 0:
        print(f"{os.path.basename(sys.argv[0])}: error: step {step}: the loss is {loss}; "
              "training stopped (try a smaller --lr)", file=sys.stderr, flush=True)
    dist.barrier()                  # the line is out before any rank exits
    raise SystemExit(2)


def finish(args, text, curve: list[dict], state: dict, grid_text: str) -> None:
    """Rank 0: the curve to results/, the picture, the sample, the saved model."""
    from common import models
    from bench import results
    if not curve:
        return
    rows = []
    for row in curve:
        rows.append({"model": args.model, "seed": args.seed, "seq_len": args.seq_len,
                     "batch_size": args.batch_size, "lr": args.lr, "data": args.data or "stdlib",
                     "grid": grid_text, **row, "run_id": results.run_id()})
    path = results.upsert_csv(CURVE_CSV, rows, key=["model", "seed", "seq_len", "batch_size", "lr",
                                                    "data", "grid", "step"])
    print(f"wrote {path}", flush=True)
    final = curve[-1]["held_out_loss"]          # the last step always evaluates
    verdict = "below"
    if not final < text.unigram:
        verdict = "NOT below"
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
    from bench import results
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


# --------------------------------------------------------------------------- against one process


def check_main(ctx, args) -> None:
    """--check: ``--check-steps`` steps beside one process; every rank raises on a difference."""
    problems, worst = check_against_one_process(ctx, args, args.check_steps)
    if problems:
        raise AssertionError("the grid differs from one process:\n  " + "\n  ".join(problems[:20]))
    ctx.print(f"check: {args.check_steps} steps on the grid equal {args.check_steps} steps of one "
              f"process (weights allclose, largest difference {worst:.2e}; the same loss; "
              "replicas bitwise equal; the saved pieces cover the model once)", all_ranks=False)


def check_against_one_process(ctx, args, steps: int) -> tuple[list[str], float]:
    """Train the grid of ``args`` and one process side by side for ``steps`` steps on the same
    global batches. Before the first step: the pieces marked to be saved cover every element
    of the full model exactly once, and the forward-only evaluation of a held-out batch gives
    one process's loss. After each backward: the gradients (gathered whole) and
    the loss the grid reports against one process's; after each step: the weights, and every
    replica bitwise equal to its copies. Returns the problems, the same list on every rank, and
    the largest weight difference. Stops at the first step with a problem."""
    from common import models
    grid_mod, parallel_lm, _ = lessons()
    grid = make_grid(grid_mod, args)
    text = Text(args)
    chunks = build_chunks(args, grid, parallel_lm, build_full_lm(args), ctx.device)
    optimizer = make_optimizer([p for chunk in chunks for p in chunk.parameters()], args, grid)
    reference = build_full_lm(args).to(ctx.device)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr, weight_decay=0.0,
                                            eps=ADAM_EPS)
    problems = saved_once_problems(chunks, grid, parallel_lm, reference)
    inputs, targets = text.held_out_batch(0)
    evaluated = parallel_lm.evaluate(chunks, grid, inputs, targets, ctx.device)
    with torch.no_grad():
        reference_loss = models.lm_loss(reference(inputs.to(ctx.device)), targets.to(ctx.device))
    if not math.isclose(evaluated, reference_loss.item(), rel_tol=1e-5, abs_tol=1e-6):
        problems.append(f"the held-out loss, forward only: the grid {evaluated:.7f}, one process "
                        f"{reference_loss.item():.7f}")
    agreed = agree(problems)
    if agreed:
        return agreed, 0.0
    worst = 0.0
    for step in range(steps):
        inputs, targets = text.batch(step)
        result = parallel_lm.train_step(chunks, grid, args.schedule, args.micro_batches, inputs,
                                        targets, ctx.device)
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
        # float32 sums of the same terms in another order (over dp x cp ranks and their
        # shards): 1.4e-5 of a tensor's largest gradient seen on this 2-core VM; a wrong
        # reduction (a sum for a mean, a missing axis) is off by 1/2 or more
        found, _ = full_differences(gradients, reference_gradients, "gradient", step, 5e-5, 1e-12)
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
    # rank 0 compared the gathered weights: its worst difference, on every rank (a device
    # tensor: NCCL reduces GPU memory only)
    worst_everywhere = torch.tensor([worst], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(worst_everywhere, op=dist.ReduceOp.MAX)
    return [], worst_everywhere.item()


def agree(problems: list[str]) -> list[str]:
    """Every rank's problems on every rank, named by rank: one verdict (common/verify.py)."""
    from common import verify
    return verify.agree_on_problems(problems)


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


def replica_differences(chunks, grid, parallel_lm) -> list[str]:
    """Copies of one piece held by several ranks must be bitwise equal: over dp and cp for
    every piece (under HSDP a weight's row block over dp_replicate: the dp_shard ranks hold
    different blocks), and over tp too for the pieces tensor parallelism does not split."""
    problems = []
    for entry in parallel_lm.placements(chunks, grid):
        groups = ["dp_cp"]
        if entry["dp_sharded"]:
            groups = ["dp_replicate"]
        if entry["tp_whole"]:
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


def saved_once_problems(chunks, grid, parallel_lm, reference) -> list[str]:
    """The pieces marked ``replica`` (the copy to save, to gather, to checkpoint) must cover
    every element of the full model exactly once: a piece marked on two ranks is written twice,
    a piece marked on none is lost. Rank 0 counts, per element, how many ranks mark it (the
    boxes travel as objects: bookkeeping, not tensors); the others return no problem."""
    mine = []
    for entry in parallel_lm.placements(chunks, grid):
        if entry["replica"]:
            full_boxes = [full_box for _, full_box in entry["boxes"]]
            mine.append((entry["name"], full_boxes))
    gathered = None
    if dist.get_rank() == 0:
        gathered = [None] * dist.get_world_size()
    dist.gather_object(mine, gathered, dst=0)
    if gathered is None:
        return []
    counts = {}
    for name, p in reference.named_parameters():
        counts[name] = torch.zeros(p.shape, dtype=torch.int32)
    holders = {}
    for rank, entries in enumerate(gathered):
        for name, full_boxes in entries:
            holders.setdefault(name, []).append(rank)
            for full_box in full_boxes:
                index = tuple(slice(start, stop) for start, stop in full_box)
                counts[name][index] += 1
    problems = []
    for name, count in counts.items():
        if not bool((count == 1).all()):
            problems.append(f"{name}: marked to be saved by ranks {holders.get(name, [])}, "
                            f"covering its elements {int(count.min())} to {int(count.max())} "
                            "times; each must be saved exactly once")
    return problems
