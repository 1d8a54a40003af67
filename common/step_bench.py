"""The training-step harness shared by the DDP stages 03-06: verify a DDP, and time its step.

A "DDP wrapper" here is anything with the contract of stages 03-06: ``wrapper = factory(module)``
is an ``nn.Module`` whose forward calls ``module``, that has broadcast rank 0's state, and
whose ``finish_gradient_synchronization()`` is called after ``backward()`` and before
``optimizer.step()``. ``torch.nn.parallel.DistributedDataParallel`` fits too (it has no
such method; the harness then calls nothing: torch DDP has finished inside ``backward``).
Factories are called inside the workers; pass module-level functions or
``functools.partial`` objects if they travel through ``launch`` (spawn pickles them).

Verification (a stage's plain run)::

    ok = verify_ddp(ctx, factory, "NaiveDDP")   # on every rank; prints on rank 0

trains ToyModel (frozen parameter, no-grad bias), TiedModel, BranchModel (a branch skipped
on some ranks, then on all) and the tiny LM for a few steps under the wrapper and, in the
same process, a single-process reference on the whole global batch; checks parameters
allclose to the reference after every step, bitwise identical across ranks, rank 0's
state after wrapping (BatchNormModel for buffers), and the frozen parameter unchanged.
Returns True when every check passed on every rank.

Benchmark (a stage's ``--bench``)::

    add_step_bench_args(parser)          # --model --batch-size --context-length --steps --warmup
                                         # --rounds --case-budget-s
    check_step_bench_args(args, config)  # in main(), before launch: one-line error, exit 2
    rows = run_step_bench(ctx, [("naive", None, make_naive_ddp),
                                ("bucketed", 10, partial(make_bucketed, bucket_size_mb=10)),
                                ("torch_ddp", 10, torch_ddp_factory(10))], args)

``run_step_bench`` adds the two references to the same run unless listed: ``none`` (no
wrapper, no communication: each rank steps on its local batch) and ``torch_ddp`` with
torch's default bucket size (25 MB, ``bucket_mb`` column 25), which is the denominator of
``ratio_vs_torch_ddp``. For each case ``time_steps`` builds the LM (seed 0 on every rank),
AdamW, the rank's slice of one random global batch, runs ``--warmup`` untimed steps, then
``--steps`` timed ones, each split as

    fwd_bwd_ms              zero_grad + forward + loss + backward
    comm_after_backward_ms  end of backward -> end of finish_gradient_synchronization()
    optimizer_ms            optimizer.step()
    step_ms                 all of the above

(with ``torch.cuda.synchronize`` before every clock read on GPU). ``--rounds R`` runs the
whole list R times and pools each case's timed steps, so background load on a shared
machine hits every case alike. ``make_row`` turns the pooled times into the row; each
figure is the slowest rank's median (common.timing.gather_times); ``comm_share`` =
comm_after_backward / step. Communication that overlaps backward (stages 05, 06, torch DDP) hides inside
fwd_bwd_ms; what is left after backward is what the step pays for it. Rank 0 prints the
table and upserts ``results/ddp_step.csv`` (SPEC section 3) keyed on
``backend, device, world_size, model, impl, bucket_mb``.
"""

from __future__ import annotations

import functools
import gc
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import launch, models, results, timing

CSV_NAME = "ddp_step.csv"
# The plain runs of 05/06 (``make run``) end with a quick demo benchmark on small defaults.
# Its rows go to their own file, so a demo never replaces the rows of a real ``--bench``
# of the same model (same CSV key) in ddp_step.csv; same columns, same key.
DEMO_CSV_NAME = "ddp_step_demo.csv"
CSV_COLUMNS = ["backend", "device", "world_size", "model", "impl", "bucket_mb", "step_ms",
               "fwd_bwd_ms", "comm_after_backward_ms", "optimizer_ms", "comm_share",
               "ratio_vs_torch_ddp"]
CSV_KEY = ["backend", "device", "world_size", "model", "impl", "bucket_mb"]
IMPLS = ("none", "naive", "flat", "overlap", "bucketed", "torch_ddp")
TORCH_DDP_DEFAULT_BUCKET_MB = 25  # torch.nn.parallel.DistributedDataParallel's bucket_cap_mb
BYTES_PER_PARAM = 20  # fp32 weights 4 + grads 4 + AdamW moments 8 + a flat/bucket copy 4


# --------------------------------------------------------------------------- torch DDP reference


def wrap_torch_ddp(module, bucket_mb=None, find_unused_parameters=False):
    """``DistributedDataParallel`` on ``module``'s device, torch's defaults unless given."""
    device = next(module.parameters()).device
    kwargs = dict(find_unused_parameters=find_unused_parameters)
    if bucket_mb is not None:
        kwargs["bucket_cap_mb"] = bucket_mb
    return torch.nn.parallel.DistributedDataParallel(
        module, device_ids=[device.index] if device.type == "cuda" else None, **kwargs)


def torch_ddp_factory(bucket_mb=None, find_unused_parameters=False):
    """A picklable factory for :func:`wrap_torch_ddp` (a ``functools.partial``)."""
    return functools.partial(wrap_torch_ddp, bucket_mb=bucket_mb,
                             find_unused_parameters=find_unused_parameters)


def finish_fn(wrapper):
    """The wrapper's ``finish_gradient_synchronization``, or a no-op (torch DDP, no wrapper)."""
    return getattr(wrapper, "finish_gradient_synchronization", None) or (lambda: None)


# --------------------------------------------------------------------------- verification


def _flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _state(model) -> list[torch.Tensor]:
    return [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]


def _bitwise_same_across_ranks(t: torch.Tensor) -> bool:
    """True on every rank iff ``t`` is bitwise equal on all ranks (compared to rank 0's)."""
    mine = t.detach().contiguous()
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], other) for other in everyone)


def _all_ranks_ok(ok: bool, device) -> bool:
    flag = torch.tensor([1.0 if ok else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _branch_used(step: int, rank: int, world_size: int) -> bool:
    """Which ranks run BranchModel's branch: all, only rank 0, none, only the last rank."""
    return [True, rank == 0, False, rank == world_size - 1][step % 4]


def _train_and_compare(ctx, factory, build, make_opt, steps, kind, rtol, atol):
    """Train ``factory(build())`` and a single-process reference side by side; return a
    dict of findings (max_diff, bitwise, broadcast, frozen, grads_none)."""
    dev, ws, rank = ctx.device, ctx.world_size, ctx.rank
    torch.manual_seed(1000 + rank)  # every rank starts from a different random model ...
    model = build().to(dev)
    if kind == "bn":  # ... and different buffers
        for b in model.buffers():
            if b.is_floating_point():
                b.copy_(torch.rand_like(b) + rank)
    torch.manual_seed(1000)  # ... the reference starts from rank 0's
    reference = build().to(dev)
    if kind == "bn":
        for b in reference.buffers():
            if b.is_floating_point():
                b.copy_(torch.rand_like(b))
    ref_init = _state(reference)
    ddp = factory(model)
    found = dict(max_diff=0.0, bitwise=True, grads_none=True,
                 broadcast=all(torch.equal(a, b) for a, b in zip(_state(model), ref_init)))
    if kind == "bn":
        return found
    finish = finish_fn(ddp)
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    ref_opt = make_opt([p for p in reference.parameters() if p.requires_grad])
    local = 4 if kind != "lm" else 2
    n_global = local * ws
    if kind != "lm":
        data_x, data_y = models.random_regression_data(16 * n_global, seed=7)
        data_x, data_y = data_x.to(dev), data_y.to(dev)
    for step in range(steps):
        if kind == "lm":
            x, y = models.random_tokens(n_global, 32, seed=step, device=dev)
        else:  # a fresh shuffle each step, the same on every rank; rank r takes the r-th slice
            order = torch.randperm(len(data_x), generator=torch.Generator().manual_seed(step))
            idx = order[:n_global].to(dev)
            x, y = data_x[idx], data_y[idx]
        mine = slice(rank * local, (rank + 1) * local)
        loss_fn = models.lm_loss if kind == "lm" else F.mse_loss
        # the data-parallel step
        opt.zero_grad(set_to_none=True)
        if kind == "branch":
            out = ddp(x[mine], use_branch=_branch_used(step, rank, ws))
        else:
            out = ddp(x[mine])
        loss_fn(out, y[mine]).backward()
        finish()
        opt.step()
        # the single-process reference on the whole global batch
        ref_opt.zero_grad(set_to_none=True)
        if kind == "branch":  # each rank's samples with that rank's choice; equal slices, so
            ref_loss = sum(loss_fn(reference(x[r * local:(r + 1) * local],  # mean of means
                                             use_branch=_branch_used(step, r, ws)),
                                   y[r * local:(r + 1) * local]) for r in range(ws)) / ws
            unused = not any(_branch_used(step, r, ws) for r in range(ws))
            if unused:
                found["grads_none"] &= all(p.grad is None for p in model.branch.parameters())
            else:
                found["grads_none"] &= all(p.grad is not None for p in model.branch.parameters())
        else:
            ref_loss = loss_fn(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            diff = (p.detach() - q.detach()).abs().max().item()
            found["max_diff"] = max(found["max_diff"], diff)
            if not torch.allclose(p, q, rtol=rtol, atol=atol):
                found.setdefault("first_bad", f"step {step}")
        found["bitwise"] &= _bitwise_same_across_ranks(_flat_params(model))
    if hasattr(model, "frozen_scale"):
        found["frozen"] = torch.equal(model.frozen_scale, ref_init[
            [n for n, _ in reference.named_parameters()].index("frozen_scale")])
    return found


def verify_ddp(ctx, factory, name: str, steps: int = 5) -> bool:
    """Train small models under ``factory`` and compare with one process (see module doc)."""
    rtol, atol = 1e-5, 1e-6
    checks = [
        ("ToyModel (frozen param, no-grad bias) + SGD", models.ToyModel,
         lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), steps, "toy"),
        ("TiedModel (one weight used twice) + AdamW", models.TiedModel,
         lambda ps: torch.optim.AdamW(ps, lr=1e-2), steps, "toy"),
        ("BranchModel (branch skipped on some/all ranks) + AdamW", models.BranchModel,
         lambda ps: torch.optim.AdamW(ps, lr=1e-2), max(steps, 4), "branch"),
        ("BatchNormModel: buffers broadcast at wrap", models.BatchNormModel, None, 0, "bn"),
        ("TransformerLM tiny (context 32) + AdamW", lambda: models.TransformerLM("tiny", context_length=32),
         lambda ps: torch.optim.AdamW(ps, lr=1e-3), 3, "lm"),
    ]
    all_ok = True
    ctx.print(f"{name} on {ctx.world_size} ranks ({ctx.backend}/{ctx.device.type}) vs one "
              f"process on the whole batch, float32 tolerance rtol={rtol:g} atol={atol:g}:",
              all_ranks=False)
    for label, build, make_opt, n_steps, kind in checks:
        f = _train_and_compare(ctx, factory, build, make_opt, n_steps, kind,
                               rtol=1e-4 if kind == "lm" else rtol,
                               atol=1e-5 if kind == "lm" else atol)
        ok = (f["broadcast"] and f["bitwise"] and f["grads_none"] and "first_bad" not in f
              and f.get("frozen", True))
        ok = _all_ranks_ok(ok, ctx.device)
        all_ok &= ok
        if kind == "bn":
            detail = f"rank 0's parameters and buffers on every rank: {f['broadcast']}"
        else:
            detail = (f"{n_steps} steps, params allclose to single process every step: "
                      f"{'first_bad' not in f} (max |diff| {f['max_diff']:.2e}); "
                      f"bitwise equal across ranks: {f['bitwise']}; "
                      f"broadcast at wrap: {f['broadcast']}")
            if "frozen" in f:
                detail += f"; frozen param unchanged: {f['frozen']}"
            if kind == "branch":
                detail += f"; grad None where no rank used it, else averaged: {f['grads_none']}"
        ctx.print(f"  [{'ok' if ok else 'FAIL'}] {label}: {detail}",
                  all_ranks=not ok)  # a failure is printed by every rank, with its numbers
    ctx.print("all checks passed" if all_ok else "SOME CHECKS FAILED", all_ranks=False)
    return all_ok


# --------------------------------------------------------------------------- benchmark flags


def add_step_bench_args(parser, model: str = "tiny", batch_size: int = 8,
                        context_length: int = 64, steps: int = 10, warmup: int = 5):
    """Add --model, --batch-size, --context-length, --steps, --warmup (defaults: quick on CPU)."""
    g = parser.add_argument_group("training-step benchmark (--bench)")
    g.add_argument("--model", choices=list(models.PRESETS), default=model,
                   help="Transformer LM preset (SPEC section 6)")
    g.add_argument("--batch-size", type=int, default=batch_size,
                   help="GLOBAL batch (sequences per step), split evenly across ranks")
    g.add_argument("--context-length", type=int, default=context_length,
                   help="tokens per sequence")
    g.add_argument("--steps", type=int, default=steps, help="timed training steps")
    g.add_argument("--warmup", type=int, default=warmup, help="untimed warm-up steps first")
    g.add_argument("--rounds", type=int, default=1,
                   help="run the whole list of cases this many times and pool the timed steps "
                        "(fairer ratios on a machine with background load)")
    g.add_argument("--case-budget-s", type=float, default=120.0,
                   help="at most this many seconds per case (all rounds together): when the "
                        "warm-up steps say the timed steps would take longer, fewer are timed")
    return g


def _available_bytes(config) -> tuple[int, int, str]:
    """(bytes one place can hold, ranks sharing that place, what it is)."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", config.world_size)) \
        if launch.under_torchrun() else config.world_size
    if config.device == "cuda":
        n_gpus = torch.cuda.device_count()
        total = torch.cuda.get_device_properties(0).total_memory
        return int(total * 0.9), math.ceil(ranks_here / n_gpus), "GPU memory"
    return int(launch.host_available_bytes() * 0.9), ranks_here, "available RAM"


def estimate_bytes_per_rank(model: str, local_batch: int, context_length: int) -> int:
    """Rough peak memory of one rank: 20 bytes/parameter plus fp32 activations kept for backward."""
    p = models.PRESETS[model]
    d, f, n, h = p["d_model"], p["d_ff"], p["num_layers"], p["num_heads"]
    params = models.lm_parameter_count(model, context_length=context_length)
    acts = 4 * local_batch * context_length * (n * (12 * d + 2 * f + h * context_length)
                                               + 3 * models.VOCAB_SIZE)
    return params * BYTES_PER_PARAM + acts


def check_step_bench_args(args, config) -> None:
    """Reject bad benchmark flags before any worker starts: one line, exit 2 (SPEC section 3)."""
    ws = config.world_size
    if args.batch_size < 1:
        launch.usage_error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.batch_size % ws:
        launch.usage_error(f"--batch-size {args.batch_size} is not divisible by world size {ws}: "
                           f"each rank needs an equal slice (try {ws * max(1, args.batch_size // ws)})")
    if args.context_length < 1:
        launch.usage_error(f"--context-length must be >= 1, got {args.context_length}")
    if args.steps < 1:
        launch.usage_error(f"--steps must be >= 1, got {args.steps}")
    if args.rounds < 1:
        launch.usage_error(f"--rounds must be >= 1, got {args.rounds}")
    if args.warmup < 0:
        launch.usage_error(f"--warmup must be >= 0, got {args.warmup}")
    if args.case_budget_s <= 0:
        launch.usage_error(f"--case-budget-s must be > 0, got {args.case_budget_s:g}")
    if args.model not in models.PRESETS:
        launch.usage_error(f"unknown --model {args.model!r}; choose from {', '.join(models.PRESETS)}")
    need = estimate_bytes_per_rank(args.model, args.batch_size // ws, args.context_length)
    have, sharing, where = _available_bytes(config)
    if need * sharing > have:
        launch.usage_error(
            f"--model {args.model} with batch {args.batch_size}, context {args.context_length} "
            f"needs about {need / 2**30:.1f} GiB per rank x {sharing} rank(s) = "
            f"{need * sharing / 2**30:.1f} GiB but {where} is {have / 2**30:.1f} GiB; "
            f"use a smaller --model, --batch-size or --world-size")


# --------------------------------------------------------------------------- benchmark


def steps_within_budget(steps: int, warmup_step_s: float, budget_s: float) -> int:
    """How many timed steps fit in ``budget_s`` at the warm-up's pace (at least 2, at most
    ``steps``). Every rank must pass the same ``warmup_step_s`` (the slowest rank's): ranks
    that time different numbers of steps would wait on each other's collectives forever."""
    if warmup_step_s <= 0:
        return steps
    return max(2, min(steps, int(budget_s / warmup_step_s)))


def time_steps(ctx, factory, model_name: str, args) -> tuple[list[float], ...]:
    """Build the LM under ``factory`` (None: no wrapper), run ``args.warmup`` untimed and
    ``args.steps`` timed steps; return this rank's (fwd_bwd, comm, optimizer, step) seconds.

    ``args.case_budget_s`` (per round: divided by ``args.rounds``) caps the timed steps at
    the pace of the last warm-up step, so no configuration runs for more than its budget."""
    dev, ws, rank = ctx.device, ctx.world_size, ctx.rank
    torch.manual_seed(0)  # the same model on every rank, as after a broadcast
    model = models.TransformerLM(model_name, context_length=args.context_length).to(dev)
    wrapper = factory(model) if factory is not None else model
    finish = finish_fn(wrapper)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    local = args.batch_size // ws
    x, y = models.random_tokens(args.batch_size, args.context_length, seed=0, device=dev)
    x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]

    def one_step() -> tuple[float, float, float, float]:
        timing.synchronize(dev)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        models.lm_loss(wrapper(x), y).backward()
        timing.synchronize(dev)
        t1 = time.perf_counter()
        finish()  # the gradient communication left after backward
        timing.synchronize(dev)
        t2 = time.perf_counter()
        optimizer.step()
        timing.synchronize(dev)
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, t3 - t0

    last_warmup = 0.0
    for _ in range(args.warmup):
        last_warmup = one_step()[3]
    pace = torch.tensor([last_warmup], dtype=torch.float64,
                        device=dev if ctx.backend == "nccl" else "cpu")
    dist.all_reduce(pace, op=dist.ReduceOp.MAX)  # the slowest rank's pace, same on every rank
    budget = args.case_budget_s / args.rounds
    steps = steps_within_budget(args.steps, pace.item(), budget)
    if steps < args.steps:
        ctx.print(f"  note: {steps} timed steps instead of {args.steps}: at "
                  f"{pace.item():.2f} s/step the case would pass its {budget:.0f} s budget",
                  all_ranks=False)
    dist.barrier()  # start the timed steps together (this all-reduce also lines them up)
    times = tuple(list(t) for t in zip(*(one_step() for _ in range(steps))))
    del wrapper, model, optimizer
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return times


def make_row(ctx, model_name: str, args, impl: str, bucket_mb, times) -> dict:
    """The CSV row for one case from its (fwd_bwd, comm, optimizer, step) lists of seconds.

    Calls gather_times, so every rank must call it; every rank gets the same row."""
    s_fb, s_comm, s_opt, s_step = (timing.gather_times(list(t)) for t in times)
    params = models.lm_parameter_count(model_name, context_length=args.context_length)
    ms = 1e3
    return {
        "backend": ctx.backend, "device": ctx.device.type, "world_size": ctx.world_size,
        "model": model_name, "impl": impl, "bucket_mb": "" if bucket_mb is None else bucket_mb,
        "step_ms": s_step.median * ms, "fwd_bwd_ms": s_fb.median * ms,
        "comm_after_backward_ms": s_comm.median * ms, "optimizer_ms": s_opt.median * ms,
        "comm_share": s_comm.median / s_step.median, "ratio_vs_torch_ddp": None,
        # more columns may follow the contract's twelve
        "step_ms_min": s_step.min * ms, "step_ms_max": s_step.max * ms,
        "slowest_rank": s_step.slowest_rank, "batch_size": args.batch_size,
        "context_length": args.context_length, "steps": len(times[0]), "warmup": args.warmup,
        "params": params, "machine": results.machine_name(), "run_id": results.run_id(),
    }


def _with_references(cases) -> list[tuple]:
    """The cases, after the ``none`` and default ``torch_ddp`` references unless listed."""
    cases = list(cases)
    for impl, _, _ in cases:
        if impl not in IMPLS:
            raise ValueError(f"impl {impl!r} is not one of {IMPLS} (the ddp_step.csv contract)")
    impls = [(impl, b) for impl, b, _ in cases]
    refs = []
    if ("none", None) not in impls:
        refs.append(("none", None, None))
    if ("torch_ddp", TORCH_DDP_DEFAULT_BUCKET_MB) not in impls:
        refs.append(("torch_ddp", TORCH_DDP_DEFAULT_BUCKET_MB, torch_ddp_factory()))
    return refs + cases


def _rows_so_far(ctx, cases, pooled, args) -> list[dict]:
    """One row per case from its pooled steps, with the ratio to torch DDP at 25 MB."""
    rows = [make_row(ctx, args.model, args, impl, bucket_mb, pool)
            for (impl, bucket_mb, _), pool in zip(cases, pooled)]
    ref = next(r for r in rows
               if r["impl"] == "torch_ddp" and r["bucket_mb"] == TORCH_DDP_DEFAULT_BUCKET_MB)
    for r in rows:
        r["ratio_vs_torch_ddp"] = r["step_ms"] / ref["step_ms"]
    return rows


def run_step_bench(ctx, cases, args, csv_name: str = CSV_NAME) -> list[dict]:
    """Benchmark every case plus the ``none`` and ``torch_ddp`` references in one run.

    ``cases``: a list of ``(impl, bucket_mb, factory)``. Prints the table on rank 0, upserts ``results/<csv_name>`` (default
    ``ddp_step.csv``; the plain-run demos pass ``DEMO_CSV_NAME``), returns rows.
    """
    cases = _with_references(cases)
    params = models.lm_parameter_count(args.model, context_length=args.context_length)
    ctx.print(f"step benchmark: LM {args.model} ({params / 1e6:.1f}M params, "
              f"{params * 4 / 2**20:.1f} MB of fp32 gradients), global batch {args.batch_size} "
              f"({args.batch_size // ctx.world_size}/rank), context {args.context_length}, "
              f"{args.warmup} warm-up + {args.steps} timed steps, AdamW, {ctx.world_size} ranks, "
              f"{ctx.backend}/{ctx.device.type}", all_ranks=False)
    # With --rounds R the whole list runs R times (a fresh model each time) and each case's
    # timed steps are pooled: background load then hits every case alike, not just one.
    rounds = args.rounds
    pooled = [([], [], [], []) for _ in cases]
    for round_ in range(rounds):
        for (impl, bucket_mb, factory), pool in zip(cases, pooled):
            t = time.perf_counter()
            times = time_steps(ctx, factory, args.model, args)
            for acc, new in zip(pool, times):
                acc.extend(new)
            ctx.print(f"  {'' if rounds == 1 else f'round {round_ + 1}: '}{impl}"
                      f"{'' if bucket_mb is None else f' ({bucket_mb} MB)'}: "
                      f"{statistics.median(times[3]) * 1e3:.1f} ms/step on rank 0 "
                      f"({time.perf_counter() - t:.1f} s)", all_ranks=False)
        rows = _rows_so_far(ctx, cases, pooled, args)
        if ctx.is_main and round_ < rounds - 1:  # a run stopped later keeps these rounds
            results.upsert_csv(csv_name, rows, key=CSV_KEY)
    if ctx.is_main:
        shown = [{"impl": r["impl"], "bucket_mb": r["bucket_mb"], "step_ms": r["step_ms"],
                  "fwd_bwd_ms": r["fwd_bwd_ms"], "comm_after_bwd_ms": r["comm_after_backward_ms"],
                  "optimizer_ms": r["optimizer_ms"], "comm_share": f"{r['comm_share']:.0%}",
                  "vs_torch_ddp": f"{r['ratio_vs_torch_ddp']:.2f}x"} for r in rows]
        results.print_table(shown, title=f"\nTraining step, slowest rank's median "
                                         f"({results.machine_name()}):")
        path = results.upsert_csv(csv_name, rows, key=CSV_KEY)
        print(f"wrote {len(rows)} rows to {path}", flush=True)
    return rows
