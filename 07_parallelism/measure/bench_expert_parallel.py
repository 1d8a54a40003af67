"""Stage 07, expert parallelism, measured: what an ExpertParallelMoE costs and what it saves.

Per token count, smallest first (each row to results/expert_parallel.csv as it lands; with
--budget-s, the counts predicted to end past it are skipped): the step of the replicated MoE
(no communication) against expert parallel's, and the bytes each all-to-all sends, counted
beside the formula. Then the expert bytes per rank (exactly 1/W) and the load at the largest
count for each routing and capacity factor, drawn to results/expert_parallel_load.png.
Under Gloo the exchange times describe its host path; the bytes and loads are exact anywhere.

    python 07_parallelism/measure/bench_expert_parallel.py --bench --world-size 4 --num-experts 8
"""

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
for folder in (REPO, REPO / "07_parallelism" / "06_expert_parallel"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from bench import results, step_bench, timing  # noqa: E402
from bench import supervisor as launch  # noqa: E402
from common import import_stage, verify  # noqa: E402
from expert_parallel import ExpertParallelMoE, MoE, expert_capacity  # noqa: E402

counters = import_stage("07_parallelism/measure/counters")

AUX_WEIGHT = 0.01  # Switch Transformer's alpha, as in the lesson
SKEW = 2.0         # "skewed": expert 0's router row leans towards the inputs' mean
CSV = "expert_parallel.csv"
KEY = ["backend", "device", "world_size", "d_model", "d_ff", "num_experts", "top_k",
       "measure", "tokens_per_rank", "routing", "capacity_factor"]


def predicted_sent_bytes(send_counts: torch.Tensor, rank: int, experts_per_rank: int,
                         d_model: int, element_size: int = 4) -> list[int]:
    """What ``rank`` sends in each all-to-all of one forward + backward, given ``send_counts``
    [W, E] (the rows every rank sends every expert): the counts (E/W int64 to each other
    rank), dispatch, combine; then backward's two reversed."""
    world_size = send_counts.shape[0]
    my_experts = slice(rank * experts_per_rank, (rank + 1) * experts_per_rank)
    to_others = send_counts[rank].sum().item() - send_counts[rank, my_experts].sum().item()
    from_others = send_counts[:, my_experts].sum().item() - send_counts[rank, my_experts].sum().item()
    row = d_model * element_size
    counts = (world_size - 1) * experts_per_rank * 8
    return [counts, to_others * row, from_others * row, to_others * row, from_others * row]


def gathered_send_counts(layer, group=None) -> torch.Tensor:
    """[W, E]: every rank's ``tokens_per_expert``, gathered apart from the layer's exchange."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, layer.tokens_per_expert.tolist(), group=group)
    return torch.tensor(everyone)


def moe_loss(out: torch.Tensor, target: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target) + AUX_WEIGHT * aux_loss


def count_bytes(layer, x: torch.Tensor, target: torch.Tensor, loss_fn=moe_loss) -> list[float]:
    """Bytes this rank sends in each all-to-all of one forward + backward, counted. ``x`` needs
    a gradient, as in a model: without one, backward skips the dispatch's reverse."""
    x = x.detach().requires_grad_(True)
    with counters.CommCounter() as comm:
        out = layer(x)
        loss_fn(out, target, layer.aux_loss).backward()
    return [call["sent_bytes"] for call in comm.calls if call["op"] == "all_to_all"]


def bench_moe(cfg: dict, routing: str, capacity_factor, device) -> MoE:
    """The same MoE on every rank (seeded); "skewed" favours expert 0, which overflows."""
    torch.manual_seed(0)
    moe = MoE(cfg["d_model"], cfg["d_ff"], cfg["num_experts"], cfg["top_k"], capacity_factor)
    if routing == "skewed":
        with torch.no_grad():
            moe.router.weight[0] += SKEW / cfg["d_model"]
    return moe.to(device)


def bench_input(cfg: dict, routing: str, tokens: int, rank: int, device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, cfg["d_model"], generator=generator)
    if routing == "skewed":
        x += 1.0
    return x.to(device)


def step(layer, x: torch.Tensor) -> None:
    out = layer(x)
    moe_loss(out, torch.zeros_like(out), layer.aux_loss).backward()


def time_one(ctx, cfg: dict, tokens: int, failures: list[str]) -> dict:
    """Step time of the replicated MoE and of expert parallel on ``tokens`` tokens per rank;
    the bytes sent, counted and from the formula; the output against the replicated MoE's."""
    moe = bench_moe(cfg, "random", None, ctx.device)
    layer = ExpertParallelMoE(moe)
    x = bench_input(cfg, "random", tokens, ctx.rank, ctx.device)
    with torch.no_grad():
        want_out = moe(x)
        out_diff = (layer(x) - want_out).abs().max().item() / max(want_out.abs().max().item(), 1e-30)
    replicated = timing.gather_times(timing.measure(lambda: step(moe, x), ctx.device,
                                                    cfg["warmup"], cfg["iters"], barrier=True))
    expert_parallel = timing.gather_times(timing.measure(lambda: step(layer, x), ctx.device,
                                                         cfg["warmup"], cfg["iters"], barrier=True))
    counted = count_bytes(layer, x, torch.zeros_like(x))
    want = predicted_sent_bytes(gathered_send_counts(layer), ctx.rank, layer.experts_per_rank,
                                cfg["d_model"], x.element_size())
    if counted != want:
        failures.append(f"{tokens} tokens: bytes counted {counted}, formula {want}")
    if out_diff > 1e-5:
        failures.append(f"{tokens} tokens: output differs from the replicated MoE by {out_diff:.1e}")
    return {"tokens_per_rank": tokens,
            "replicated_ms": 1e3 * replicated.median,
            "expert_parallel_ms": 1e3 * expert_parallel.median,
            "expert_parallel_min_ms": 1e3 * expert_parallel.min,    # the fastest step on any rank
            "expert_parallel_max_ms": 1e3 * expert_parallel.max,    # and the slowest
            "ep_over_replicated": expert_parallel.median / replicated.median,
            "bytes_sent_counted": sum(counted), "bytes_sent_formula": sum(want),
            "dispatch_bytes": counted[1],  # beside uniform routing's: top_k T d (W-1)/W bytes
            "uniform_bytes_per_exchange": (cfg["top_k"] * tokens * cfg["d_model"] * (ctx.world_size - 1)
                                           / ctx.world_size * x.element_size()),
            "output_diff": out_diff}


def load_one(ctx, cfg: dict, routing: str, capacity_factor) -> dict:
    """Tokens per expert (kept, all ranks'), max / mean, share dropped, rows per rank."""
    tokens = cfg["load_tokens"]
    moe = bench_moe(cfg, routing, capacity_factor, ctx.device)
    layer = ExpertParallelMoE(moe)
    with torch.no_grad():
        layer(bench_input(cfg, routing, tokens, ctx.rank, ctx.device))
    per_expert = gathered_send_counts(layer).sum(dim=0)             # [E], all ranks
    dropped = [None] * ctx.world_size
    dist.all_gather_object(dropped, layer.dropped)
    assignments = ctx.world_size * tokens * cfg["top_k"]
    capacity = expert_capacity(capacity_factor, tokens, cfg["top_k"], cfg["num_experts"])
    per_rank = per_expert.view(ctx.world_size, -1).sum(dim=1)       # rows each rank's experts run
    return {"routing": routing,
            "capacity_factor": "dropless" if capacity_factor is None else capacity_factor,
            "capacity_per_rank": "-" if capacity is None else capacity,
            "tokens_per_expert": " ".join(str(n) for n in per_expert.tolist()),
            "rows_per_rank": " ".join(str(n) for n in per_rank.tolist()),
            "max_over_mean": per_expert.max().item() / per_expert.float().mean().item(),
            "dropped_share": sum(dropped) / assignments}


def plot_load(load_rows: list[dict], cfg: dict, world_size: int, title: str):
    """Tokens per expert, coloured by rank, a panel per routing and capacity factor (W x C
    dashed). None without matplotlib."""
    plt = results.pyplot()
    if plt is None or not load_rows:
        return None
    columns = math.ceil(len(load_rows) / 2)
    figure, axes = plt.subplots(2, columns, figsize=(3 * columns, 5), sharey="row", squeeze=False)
    per_rank = cfg["num_experts"] // world_size
    colours = [f"C{expert // per_rank}" for expert in range(cfg["num_experts"])]
    for axis, row in zip(axes.flatten(), load_rows):
        counts = [int(n) for n in row["tokens_per_expert"].split()]
        axis.bar(range(len(counts)), counts, color=colours)
        if row["capacity_per_rank"] != "-":    # each rank sends an expert at most C rows
            axis.axhline(world_size * row["capacity_per_rank"], color="grey", linestyle="--",
                         linewidth=1)
        axis.set_title(f"{row['routing']}, {row['capacity_factor']}\n"
                       f"dropped {100 * row['dropped_share']:.1f}%", fontsize=8)
        axis.set_xlabel("expert (colour: its rank)", fontsize=8)
    axes[0][0].set_ylabel("tokens routed (all ranks)")
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    path = results.results_dir() / "expert_parallel_load.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def bench_main(ctx, cfg: dict) -> None:
    n = ctx.world_size
    same = {"backend": ctx.backend, "device": ctx.device.type, "world_size": n,
            "d_model": cfg["d_model"], "d_ff": cfg["d_ff"], "num_experts": cfg["num_experts"],
            "top_k": cfg["top_k"], "machine": results.machine_name(), "run_id": results.run_id()}
    if ctx.is_main:
        print(f"Expert parallel on {n} ranks: d_model {cfg['d_model']}, d_ff {cfg['d_ff']}, "
              f"{cfg['num_experts']} experts, top-{cfg['top_k']}, {ctx.backend}/{ctx.device.type} "
              f"({results.machine_name()})", flush=True)
        if ctx.backend == "gloo" and ctx.device.type == "cuda":
            print("(Gloo on CUDA: every all-to-all goes GPU -> host memory -> loopback -> GPU; "
                  "its times describe that path, not an interconnect)", flush=True)
    failures = []
    start = time.monotonic()
    moe = bench_moe(cfg, "random", None, ctx.device)   # expert bytes per rank: exactly 1/W
    layer = ExpertParallelMoE(moe)
    full = counters.state_bytes(moe.experts.parameters())
    router = counters.state_bytes(layer.router.parameters())
    held = counters.state_bytes(layer.parameters()) - router
    if held * ctx.world_size != full:
        failures.append(f"expert bytes per rank {held} x {ctx.world_size} != {full}")
    memory = {"expert_bytes_replicated": full, "expert_bytes_per_rank": held,
              "share": held / full, "router_bytes": router}
    time_rows = []
    deadline = step_bench.Deadline(ctx)  # make bench's, as --budget-s: rank 0 decides for every rank
    for tokens in sorted(cfg["tokens"]):      # smallest first; each row saved as it lands
        predicted_s = None
        if time_rows:  # predicted in proportion from the last
            last = time_rows[-1]
            per_step_s = (last["replicated_ms"] + last["expert_parallel_ms"]) / 1e3
            predicted_s = (cfg["warmup"] + cfg["iters"]) * per_step_s * tokens / last["tokens_per_rank"]
        if predicted_s is not None and cfg["budget_s"] is not None:
            decision = [time.monotonic() - start + predicted_s <= cfg["budget_s"]]
            dist.broadcast_object_list(decision, src=0)   # rank 0 decides, every rank follows
            if not decision[0]:
                ctx.print(f"{tokens} tokens per rank and more skipped: about {predicted_s:.0f} s "
                          f"predicted, past --budget-s {cfg['budget_s']:g}", all_ranks=False)
                break
        if not deadline.allows(f"{tokens} tokens per rank and more, and the loads",
                               predicted_s):
            break
        row = time_one(ctx, cfg, tokens, failures)
        time_rows.append(row)
        if ctx.is_main:
            results.upsert_csv(CSV, [{**same, "measure": "step", "routing": "random",
                                      "capacity_factor": "dropless", **row, **memory}], key=KEY)
            print(f"  {tokens} tokens per rank: replicated {row['replicated_ms']:.3g} ms, "
                  f"expert parallel {row['expert_parallel_ms']:.3g} ms", flush=True)
    cfg = {**cfg, "load_tokens": time_rows[-1]["tokens_per_rank"]}   # the largest measured
    load_rows = []
    for routing, capacity_factor in [(r, c) for r in ("random", "skewed")
                                     for c in cfg["capacity_factors"]]:
        what = f"load, {routing} routing, capacity factor {capacity_factor}, and after"
        if not deadline.allows(what, time_rows[-1]["expert_parallel_ms"] / 1e3):  # > a forward
            break
        row = load_one(ctx, cfg, routing, capacity_factor)
        load_rows.append(row)
        if ctx.is_main:
            results.upsert_csv(CSV, [{**same, "measure": "load",
                                      "tokens_per_rank": cfg["load_tokens"], **row}], key=KEY)
    failures = verify.agree_on_problems(failures)
    if ctx.is_main:  # the tables, targets and picture (the rows are already in the CSV)
        results.print_table(time_rows, "\nStep (forward + backward), slowest rank's median; bytes "
                                       "rank 0 sends per step (5 all-to-alls; dispatch: the first "
                                       "forward one):", floatfmt=".4g")
        results.print_table([memory], "\nParameter bytes per rank (float32):", floatfmt=".3g")
        results.print_table(load_rows, f"\nLoad, {cfg['load_tokens']} tokens per rank:", floatfmt=".3g")
        formula_ok = all(r["bytes_sent_counted"] == r["bytes_sent_formula"] for r in time_rows)
        worst_out = max(r["output_diff"] for r in time_rows)
        targets = [
            {"target": "counted all-to-all bytes == formula (every row)",
             "measured": "equal" if formula_ok else "DIFFERENT", "met": formula_ok},
            {"target": f"expert bytes per rank == 1/{n} of the layer's",
             "measured": f"{held} of {full} B ({memory['share']:.4g})", "met": held * n == full},
            {"target": "output equal to the replicated MoE (float32, rtol 1e-5)",
             "measured": f"{worst_out:.1e}", "met": worst_out <= 1e-5},
        ]
        results.print_table(targets, f"\nTargets ({results.machine_name()}):")
        path = plot_load(load_rows, cfg, n, f"Tokens per expert, {n} ranks x {cfg['load_tokens']} "
                                            f"tokens, top-{cfg['top_k']}")
        if path is not None:
            print(f"\nplot: {os.path.relpath(path)}")
    if failures:
        raise AssertionError("expert-parallel bench checks failed:\n  " + "\n  ".join(failures))


def capacity_factor_type(text: str):
    """A flag type: 'none' (dropless) or a finite number > 0."""
    if text.strip().lower() in ("none", "dropless"):
        return None
    try:
        return launch.positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a capacity factor: give a finite "
                                         "number > 0, or none (dropless)") from None


def parse(argv=None):
    """The flags; bad input one line, exit 2."""
    parser = launch.make_parser(__doc__, world_size=2)
    parser.add_argument("--bench", action="store_true", help="accepted (make bench passes it)")
    for flag, default, what in (("--d-model", 128, "model width"),
                                ("--d-ff", 512, "expert hidden width"),
                                ("--num-experts", None, "experts (default: 2 x world size)"),
                                ("--top-k", 2, "experts per token"),
                                ("--warmup", 2, "untimed steps"),
                                ("--iters", 5, "timed steps")):
        parser.add_argument(flag, type=launch.positive_int, default=default, help=what)
    parser.add_argument("--tokens", type=launch.int_list, default=[256, 1024, 2048],
                        help="tokens per rank, a sweep (the largest also for the load)")
    parser.add_argument("--capacity-factors", type=launch.list_of(capacity_factor_type),
                        default=[1.0, 1.25, 2.0, None], help="load statistics for each")
    parser.add_argument("--budget-s", type=launch.positive_float, default=None,
                        help="skip the token counts predicted to end past this many seconds "
                             "(each predicted from the one before; default: run them all)")
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    n = config.world_size
    num_experts = args.num_experts or 2 * n
    if num_experts % n:
        parser.error(f"--num-experts {num_experts} is not divisible by the number of ranks {n}: "
                     "each rank holds num_experts / ranks experts")
    if args.top_k > num_experts:
        parser.error(f"--top-k {args.top_k} is more than --num-experts {num_experts}")
    cfg = {**vars(args), "num_experts": num_experts}  # d_model, d_ff, top_k, tokens, ...
    # A rank's rough peak, float32: the MoE, its gradients and this rank's copies; the routing's
    # int64 one-hot [top_k x tokens, E] and its count; both layers' activations.
    d_model, d_ff = args.d_model, args.d_ff
    experts = num_experts * (2 * d_model * d_ff + d_model + d_ff)
    tokens = max(args.tokens)
    rows = args.top_k * tokens
    activations = 4 * (2 * rows * (6 * d_model + 3 * d_ff) + 4 * tokens * d_model)
    need = 4 * 3 * experts + 2 * 8 * rows * num_experts + activations
    what = (f"--num-experts {num_experts} --d-model {args.d_model} --d-ff {args.d_ff} --tokens "
            f"{max(args.tokens)} ({need / 2**30:.2f} GiB a rank)")
    launch.check_fits(config, need, what)
    results.check_writable()
    return config, cfg


def main(argv=None) -> None:
    config, cfg = parse(argv)
    launch.launch(bench_main, config, cfg)


if __name__ == "__main__":
    main()
