"""Not a lesson: lesson 3's measurements, tensor and sequence parallelism counted beside the formulas of
``07_parallelism/03_tensor_parallel/README.md``: the MLP's bytes per layer and phase (both variants) beside
``predicted_comm`` (results/tensor_parallel.csv); a Transformer block's (TP, TP + SP, torch's
``parallelize_module`` as the control) beside ``predicted_block_comm``, its bytes saved for backward beside
``saved_formula`` (results/sequence_parallel.csv). Each is checked against one process and written as it
lands; torch's is left out where the pair cannot carry it. The demo's flags, and ``--bench``.

    python 07_parallelism/measure/bench_tensor_parallel.py --world-size 4 --d-model 128 --heads 8
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import results, step_bench  # noqa: E402 (after the path)
from bench import supervisor as launch  # noqa: E402
from common import import_stage, models  # noqa: E402
from common.launch import carries_point_to_point  # noqa: E402
from common.verify import agree_on_problems as agree  # noqa: E402  (one verdict on every rank)
from counters import (CommCounter, FunctionalCommCounter, SavedActivations,  # noqa: E402
                      ring_send_bytes)

tp = import_stage("07_parallelism/03_tensor_parallel/tensor_parallel")
torch_tp = import_stage("07_parallelism/03_tensor_parallel/torch_tensor_parallel")

RTOL = 1e-4  # t partial sums: a few 1e-7 off; a missing collective: off by the values
ATOL = 1e-5
BLOCK_LAYERS = ("attn.qkv", "attn.out", "mlp.0", "mlp.2")
BLOCK_LABELS = {None: "one process", False: "TP", True: "TP + SP", "torch": "torch TP + SP"}
FLOAT32 = 4


def predicted_comm(variant: str, tokens: int, d_model: int, d_ff: int,
                   element_size: int = FLOAT32) -> dict[tuple[str, str], tuple[str, int]]:
    """What each MLP layer must communicate: {(layer, phase): (op, bytes)}, tokens = batch x seq
    (Megatron: f's backward and g's forward all-reduce; all-gather: gather Y, all-reduce dX)."""
    activation = tokens * d_model * element_size  # one [tokens, d_model] tensor
    hidden = tokens * d_ff * element_size         # one [tokens, d_ff] tensor
    if variant == "megatron":
        return {("fc1", "forward"): ("-", 0), ("fc1", "backward"): ("all_reduce", activation),
                ("fc2", "forward"): ("all_reduce", activation), ("fc2", "backward"): ("-", 0)}
    if variant == "allgather":
        return {("fc1", "forward"): ("all_gather", hidden), ("fc1", "backward"): ("all_reduce", activation),
                ("fc2", "forward"): ("all_gather", activation), ("fc2", "backward"): ("all_reduce", hidden)}
    raise ValueError(f"unknown variant {variant!r}; allowed: {', '.join(tp.VARIANTS)}")


def predicted_block_comm(tokens: int, d_model: int, sequence_parallel: bool,
                         element_size: int = FLOAT32) -> dict[tuple[str, str], tuple[str, int]]:
    """{(layer, phase): (op, payload bytes)} of a block's parallel layers, the full [tokens,
    d_model] each time; sequence parallelism turns each all-reduce into a reduce-scatter and
    adds an all-gather where ``f`` and ``g`` did nothing (the same bytes on a ring)."""
    activation = tokens * d_model * element_size
    column = (("-", 0), ("all_reduce", activation))     # (forward, backward)
    row = (("all_reduce", activation), ("-", 0))
    if sequence_parallel:
        column = (("all_gather", activation), ("reduce_scatter", activation))
        row = (("reduce_scatter", activation), ("all_gather", activation))
    return {(layer, phase): op
            for layer, ops in (("attn.qkv", column), ("mlp.0", column), ("attn.out", row), ("mlp.2", row))
            for phase, op in zip(("forward", "backward"), ops)}


def predicted_replicated_grads(d_model: int, sequence_parallel: bool, element_size: int = FLOAT32) -> int:
    """Bytes ``all_reduce_replicated_grads`` all-reduces per block: with sequence parallelism
    norm1's and norm2's weight and bias and mlp.2's bias, d_model each; without it nothing."""
    return 5 * d_model * element_size if sequence_parallel else 0


def saved_formula(cfg: dict, world_size: int, sequence_parallel: bool) -> tuple[int, int]:
    """(LayerNorms', everything else's) bytes saved for backward by one block on one rank,
    float32, no dropout, world_size 1 being one process (the README derives it)."""
    b, s, h, f, a = (cfg[key] for key in ("batch", "seq", "d_model", "d_ff", "heads"))
    t = world_size
    layernorms = 2 * b * s * h + 4 * b * s
    if sequence_parallel:
        layernorms = layernorms // t
    rest = 2 * b * s * h + (4 * b * s * h + a * b * s + 2 * b * s * f) // t
    return FLOAT32 * layernorms, FLOAT32 * rest


def label_layers(comm, module: nn.Module, names) -> list:
    """Hooks naming layer and phase in ``comm.current`` as forward and backward reach it."""
    handles = []
    for name in names:
        layer = module.get_submodule(name)

        def forward_label(layer_module, args, name=name):
            comm.current = f"{name} forward"

        def backward_label(layer_module, grad_output, name=name):
            comm.current = f"{name} backward"
        handles.append(layer.register_forward_pre_hook(forward_label))
        handles.append(layer.register_full_backward_pre_hook(backward_label))
    return handles


def count_saved(block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """(block(x), (bytes saved for backward inside norm1 and norm2, elsewhere))."""
    inside = []

    def open_counter(module, args):
        inside.append(SavedActivations(block))
        inside[-1].__enter__()

    def close_counter(module, args, output):
        inside[-1].__exit__(None, None, None)

    handles = [hook for norm in (block.norm1, block.norm2) for hook in
               (norm.register_forward_pre_hook(open_counter), norm.register_forward_hook(close_counter))]
    with SavedActivations(block) as elsewhere:
        output = block(x)
    for handle in handles:
        handle.remove()
    return output, (sum(counter.bytes for counter in inside), elsewhere.bytes)


def compare(what: str, got: torch.Tensor, want: torch.Tensor) -> dict:
    return {"checked": what, "max_abs_diff": (got - want).abs().max().item(),
            "ok": torch.allclose(got, want, rtol=RTOL, atol=ATOL)}


def compare_bytes(counted: dict, predicted: dict, world_size: int, what: str) -> tuple[list[dict], list[str]]:
    """(rows, failures): each layer and phase's collectives, counted beside predicted."""
    rows, failures = [], []
    for (layer, phase), (op, want) in predicted.items():
        got = counted.get(f"{layer} {phase}", {"ops": [], "payload_bytes": 0})
        want_ops = [op] if want else []
        if got["payload_bytes"] != want or got["ops"] != want_ops:
            failures.append(f"{what} {layer} {phase}: counted {got['ops']} "
                            f"{got['payload_bytes']} B, predicted {op} {want} B")
        sent = ring_send_bytes(op, want, world_size) if want else 0
        rows.append({"layer": layer, "phase": phase, "collective": op, "bytes_counted": got["payload_bytes"],
                     "bytes_predicted": want, "ring_bytes_sent_per_rank": sent})
    return rows, failures


def failed_rows(label: str, rows: list[dict]) -> list[str]:
    return [f"{label} {row['checked']}: max abs diff {row['max_abs_diff']:.3g}"
            for row in rows if not row["ok"]]


def my_tokens(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank's contiguous seq/t tokens of [batch, seq, hidden]: the sequence-parallel layout."""
    return x.chunk(world_size, dim=1)[rank]


def check_mlp(ctx, cfg: dict, land=None, deadline=None) -> tuple[list[dict], list[dict], list[str]]:
    """Each of ``cfg["variants"]`` against one process, counted: (check rows, byte rows, this
    rank's failures); ``land(ctx, cfg, result)`` as each variant lands; each only if
    ``deadline`` (a ``step_bench.Deadline``) allows."""
    checks, byte_rows, failures = [], [], []
    for variant in cfg["variants"]:
        if deadline is not None and not deadline.allows(f"MLP, {variant}, and after"):
            break
        torch.manual_seed(0)  # every rank builds the same full MLP and data, keeps its shards
        reference = tp.MLP(cfg["d_model"], cfg["d_ff"]).to(ctx.device)
        x = torch.randn(cfg["batch"], cfg["seq"], cfg["d_model"], device=ctx.device)
        target = torch.randn_like(x)
        model = tp.VARIANTS[variant](reference)
        x_ref = x.clone().requires_grad_(True)  # dX matters: it feeds the layer below
        x_tp = x.clone().requires_grad_(True)
        F.mse_loss(reference(x_ref), target).backward()
        with CommCounter() as comm:
            handles = label_layers(comm, model, ("fc1", "fc2"))
            out = model(x_tp)
            F.mse_loss(out, target).backward()
        for handle in handles:
            handle.remove()
        mine = [compare("output", out, reference(x_ref)), compare("input.grad", x_tp.grad, x_ref.grad)]
        for name, param in model.named_parameters():  # each against its part of the full grad
            layer_name, param_name = name.split(".")
            full_grad = getattr(getattr(reference, layer_name), param_name).grad
            want = getattr(model, layer_name).local_part(full_grad)
            mine.append(compare(f"{name}.grad", param.grad, want))
        for row in mine:
            row["variant"] = variant
        predicted = predicted_comm(variant, cfg["batch"] * cfg["seq"], cfg["d_model"], cfg["d_ff"])
        rows, byte_failures = compare_bytes(comm.by_label, predicted, ctx.world_size, variant)
        result = {"checks": mine, "bytes": [{"variant": variant, **row} for row in rows],
                  "failures": failed_rows(variant, mine) + byte_failures}
        if land is not None:
            land(ctx, cfg, result)
        checks += result["checks"]
        byte_rows += result["bytes"]
        failures += result["failures"]
    return checks, byte_rows, failures


def saved_row(cfg: dict, label: str, world_size: int, sequence_parallel: bool, saved: tuple) -> dict:
    layernorms_formula, rest_formula = saved_formula(cfg, world_size, sequence_parallel)
    return {"block": label, "t": world_size, "layernorms": saved[0], "layernorms formula": layernorms_formula,
            "rest": saved[1], "rest formula": rest_formula, "total": saved[0] + saved[1]}


def saved_failures(ctx, row: dict) -> list[str]:
    """Saved bytes against the formula, on the CPU only (a GPU's attention saves others)."""
    if ctx.device.type != "cpu" or (row["layernorms"] == row["layernorms formula"]
                                    and row["rest"] == row["rest formula"]):
        return []
    return [f"{row['block']}: saved {row['layernorms']} B in the LayerNorms and {row['rest']} B "
            f"elsewhere; the formula says {row['layernorms formula']} and {row['rest formula']}"]


def phase_totals(label: str, calls: list[dict], world_size: int) -> list[dict]:
    """Per phase: the collectives of ``calls`` labelled with it, payload, ring bytes per rank."""
    table = []
    for phase in ("forward", "backward"):
        mine = [call for call in calls if call["label"] == phase and call["payload_bytes"]]
        sent = sum((ring_send_bytes(c["op"], c["payload_bytes"], world_size) for c in mine), 0.0)
        table.append({"block": label, "phase": phase, "collectives": " ".join(c["op"] for c in mine),
                      "payload bytes": sum(c["payload_bytes"] for c in mine),
                      "ring bytes sent per rank": sent})
    return table


def check_parallel_block(ctx, cfg: dict, group, reference: dict, configuration) -> dict:
    """Our TP (configuration False), TP + SP (True) or torch's TP + SP ("torch") block, one
    forward + backward on ``reference``'s data, checked against it and counted."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    ours = configuration != "torch"
    sequence_parallel = configuration is not False
    label = BLOCK_LABELS[configuration]

    def mine(key: str) -> torch.Tensor:  # with sequence parallelism, this rank's seq/t tokens
        return my_tokens(reference[key], rank, world_size) if sequence_parallel else reference[key]

    x_mine = mine("x").clone().requires_grad_(True)
    block = tp.TensorParallelBlock(reference["full"], group, sequence_parallel) if ours else \
        torch_tp.parallelize_block(reference["full"], group, ctx.device.type)
    with (CommCounter() if ours else FunctionalCommCounter()) as comm:  # torch's: DTensor's ops
        handles = label_layers(comm, block, BLOCK_LAYERS if ours else ())
        comm.current = "forward"
        out, saved = count_saved(block, x_mine)
        if not ours:  # ours: the layers' hooks name layer and phase
            comm.current = "backward"
        out.backward(mine("probe"))
        comm.current = "replicated grads"
        if ours:
            block.all_reduce_replicated_grads()
    for handle in handles:
        handle.remove()
    checks = [compare("output", out, mine("out")), compare("input.grad", x_mine.grad, mine("x_grad"))]
    for name, param in block.named_parameters() if ours else ():  # the full block's names
        full_grad = reference["full"].get_parameter(name).grad
        owner = block.get_submodule(name.rsplit(".", 1)[0])
        want = owner.local_part(full_grad) if hasattr(owner, "local_part") else full_grad  # a slice
        checks.append(compare(f"{name}.grad", param.grad, want))
    for row in checks:
        row["block"] = label
    saved = saved_row(cfg, label, world_size, sequence_parallel, saved)
    if not ours:
        failures = [f"torch's parallelize_module{problem} from one process"
                    for problem in failed_rows("", checks)]
        return {"label": label, "checks": checks, "bytes": [], "saved": saved,
                "totals": phase_totals(label, comm.calls, world_size), "failures": failures}
    predicted = predicted_block_comm(cfg["batch"] * cfg["seq"], cfg["d_model"], sequence_parallel)
    rows, failures = compare_bytes(comm.by_label, predicted, world_size, label)
    replicated = comm.by_label.get("replicated grads", {"payload_bytes": 0, "ops": []})
    want_replicated = predicted_replicated_grads(cfg["d_model"], sequence_parallel)
    if replicated["payload_bytes"] != want_replicated:
        failures.append(f"{label}: the replicated gradients' all-reduces carried "
                        f"{replicated['payload_bytes']} B, predicted {want_replicated}")
    calls = [{"label": row["phase"], "op": row["collective"], "payload_bytes": row["bytes_counted"]}
             for row in rows]  # the layers' calls, for the totals per phase
    rows.append({"layer": "replicated grads", "phase": "after backward",
                 "collective": "all_reduce" if want_replicated else "-",
                 "bytes_counted": replicated["payload_bytes"], "bytes_predicted": want_replicated,
                 "ring_bytes_sent_per_rank": ring_send_bytes("all_reduce", want_replicated, world_size)})
    return {"label": label, "checks": checks, "bytes": [{"block": label, **row} for row in rows],
            "saved": saved, "totals": phase_totals(label, calls, world_size),
            "failures": failed_rows(label, checks) + failures + saved_failures(ctx, saved)}


def check_block(ctx, cfg: dict, group=None, with_torch: bool = True, land=None, deadline=None) -> dict:
    """The block on one process (seed 0 on every rank; a random probe as dL/d(output) uses every gradient),
    in TP, TP + SP and torch's TP + SP, on ``group``: {"checks", "bytes", "totals", "saved", "failures" (this
    rank's)}; ``land(ctx, cfg, part)`` as each lands, each only if ``deadline`` allows."""
    torch.manual_seed(0)
    full = models.Block(cfg["d_model"], cfg["d_ff"], cfg["heads"]).to(ctx.device)
    x = torch.randn(cfg["batch"], cfg["seq"], cfg["d_model"], device=ctx.device)
    probe = torch.randn_like(x)
    x_ref = x.clone().requires_grad_(True)
    out, saved = count_saved(full, x_ref)
    out.backward(probe)
    reference = {"full": full, "x": x, "probe": probe, "out": out.detach(), "x_grad": x_ref.grad}
    one_process = {"label": "one process", "checks": [], "bytes": [], "totals": [],
                   "saved": saved_row(cfg, "one process", 1, False, saved)}
    one_process["failures"] = saved_failures(ctx, one_process["saved"])
    result = {"checks": [], "bytes": [], "totals": [], "saved": [], "failures": [],
              "world_size": dist.get_world_size(group)}
    for configuration in [None, False, True] + (["torch"] if with_torch else []):
        what = f"block, {BLOCK_LABELS[configuration]}, and after"
        if deadline is not None and not deadline.allows(what):
            break
        part = one_process
        if configuration is not None:
            part = check_parallel_block(ctx, cfg, group, reference, configuration)
        if land is not None:
            land(ctx, cfg, part)
        for key in ("checks", "bytes", "totals", "failures"):
            result[key] += part[key]
        result["saved"].append(part["saved"])
    return result


def mlp_columns(ctx, cfg: dict) -> dict:
    return {"backend": ctx.backend, "device": ctx.device.type, "world_size": ctx.world_size,
            "tokens": cfg["batch"] * cfg["seq"], "d_model": cfg["d_model"], "d_ff": cfg["d_ff"]}


def land_variant(ctx, cfg: dict, result: dict) -> None:
    """One MLP variant's rows into results/tensor_parallel.csv (rank 0)."""
    if not ctx.is_main:
        return
    same = mlp_columns(ctx, cfg)
    rows = [{**same, **row, "run_id": results.run_id()} for row in result["bytes"]]
    path = results.upsert_csv("tensor_parallel.csv", rows, key=[*same, "variant", "layer", "phase"])
    ctx.print(f"MLP, {rows[0]['variant']}: rows in {os.path.relpath(path)}", all_ranks=False)


def land_block(ctx, cfg: dict, part: dict) -> None:
    """One block configuration's bytes per phase and saved bytes: results/sequence_parallel.csv."""
    if not ctx.is_main:
        return
    same = {**mlp_columns(ctx, cfg), "heads": cfg["heads"]}
    saved = part["saved"]
    rows = [{**same, "what": "bytes", "block": row["block"], "phase": row["phase"],
             "collectives": row["collectives"], "bytes": row["payload bytes"], "formula": "",
             "ring_bytes_sent_per_rank": row["ring bytes sent per rank"]} for row in part["totals"]]
    rows += [{**same, "what": f"saved {kind}", "block": saved["block"], "phase": "forward",
              "collectives": "", "bytes": saved[kind], "formula": saved[f"{kind} formula"],
              "ring_bytes_sent_per_rank": ""} for kind in ("layernorms", "rest")]
    rows = [{**row, "run_id": results.run_id()} for row in rows]
    path = results.upsert_csv("sequence_parallel.csv", rows, key=[*same, "what", "block", "phase"])
    ctx.print(f"block, {part['label']}: rows in {os.path.relpath(path)}", all_ranks=False)


def bench_main(ctx, cfg: dict) -> None:
    """Both MLP variants and the block, each written as it lands; the tables; one verdict."""
    deadline = step_bench.Deadline(ctx)
    checks, mlp_bytes, failures = check_mlp(ctx, cfg, land=land_variant, deadline=deadline)
    block = check_block(ctx, cfg, with_torch=cfg["with_torch"], land=land_block, deadline=deadline)
    failures = agree(failures + block["failures"])
    if ctx.is_main:
        where = f"{ctx.backend}/{ctx.device.type} ({results.machine_name()})"
        print(f"\nTensor-parallel MLP on {ctx.world_size} ranks: d_model {cfg['d_model']}, "
              f"d_ff {cfg['d_ff']}, {cfg['batch'] * cfg['seq']} tokens, {where}")
        results.print_table(mlp_bytes, "\nBytes per layer, one forward + backward (float32):", floatfmt=".0f")
        print(f"\nA Transformer block of the course LM (d_model {cfg['d_model']}, d_ff {cfg['d_ff']}, "
              f"{cfg['heads']} heads, batch {cfg['batch']}, seq {cfg['seq']}) on {ctx.world_size} ranks, "
              f"{where}:")
        results.print_table(block["bytes"], "\nBytes per parallel layer, one forward + backward (float32; "
                            "payload = the full tensor):", floatfmt=".0f")
        results.print_table(block["totals"], "\nPer block: ours beside torch's parallelize_module "
                            "(SequenceParallel, ColwiseParallel, RowwiseParallel):", floatfmt=".0f")
        results.print_table(block["saved"], "\nBytes saved for backward per rank, counted (saved-tensor "
                            "hooks) beside the formula:", floatfmt=".0f")
    if failures:
        raise AssertionError("tensor-parallel check failed:\n  " + "\n  ".join(failures))
    ctx.print(f"all checks passed on every rank: {len(checks) + len(block['checks'])} outputs "
              "and gradients against one process, bytes as predicted, saved activations as the "
              "formula says", all_ranks=False)


def main(argv=None) -> None:
    launch.quiet_when_the_reader_leaves()
    demo = import_stage("07_parallelism/03_tensor_parallel/run_tensor_parallel")
    parser = demo.build_parser(__doc__)  # the lesson's flags, the same sizes
    parser.add_argument("--bench", action="store_true", help="accepted (make bench passes it)")
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    world_size = config.world_size
    # One line and exit 2 for sizes the split cannot take, before any worker starts.
    world = "the world size"
    for flag, size, name, by, why in (
            ("--d-ff", args.d_ff, "the tensor-parallel size (world size)", world_size, ""),
            ("--d-model", args.d_model if "allgather" in args.variants else 0, world, world_size,
             " (the all-gather variant splits fc2's outputs)"),
            ("--d-model", args.d_model, "--heads", args.heads, ""),
            ("--heads", args.heads, world, world_size, " (each rank holds whole heads)"),
            ("--seq", args.seq, world, world_size, " (sequence parallelism gives each rank seq / t tokens)")):
        if size % by:
            parser.error(f"{flag} {size} is not divisible by {name} {by}{why}")
    # A rank's rough peak: MLP, block, gradients, slices, torch's copy, 3 blocks' activations
    weights = 2 * args.d_model * args.d_ff + 4 * args.d_model * args.d_model
    tokens = args.batch * args.seq
    activations = tokens * (12 * args.d_model + 3 * args.d_ff) + args.batch * args.heads * args.seq
    need = 4 * (6 * weights + 4 * activations)
    launch.check_fits(config, need, f"{need / 2**30:.1f} GiB each for --d-model {args.d_model} "
                      f"--d-ff {args.d_ff} --batch {args.batch} --seq {args.seq}")
    results.check_writable()
    cfg = vars(args)
    cfg["with_torch"] = carries_point_to_point(config.backend, config.device)
    if not cfg["with_torch"]:
        print(f"torch's parallelize_module control: left out on {config.backend}/{config.device}, "
              "which cannot carry DTensor's coalesced collectives", flush=True)
    launch.launch(bench_main, config, cfg)


if __name__ == "__main__":
    main()
