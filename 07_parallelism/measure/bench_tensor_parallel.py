"""Not a lesson: lesson 3's (tensor and sequence parallelism) measurements.

What tensor and sequence parallelism send and keep, counted and set beside the formulas
derived in ``07_parallelism/03_tensor_parallel/README.md`` (the formulas live here, with the
counters they are checked against, not in the file people copy):

1. The MLP, both variants (Megatron's column-then-row pair, the all-gather after every layer):
   the bytes each layer communicates forward and backward, counted by watching the collectives
   (``counters.CommCounter``, with hooks naming the layer and phase as forward and backward
   reach it), beside ``predicted_comm``. Rows in results/tensor_parallel.csv.
2. A Transformer block of the course LM, plain TP and TP + SP: the bytes per layer beside
   ``predicted_block_comm`` (the same total for both), the bytes autograd saves for backward,
   the LayerNorms apart, beside ``saved_formula``; torch's ``parallelize_module`` on the same
   block as the control (its bytes and saved bytes beside ours). Rows in
   results/sequence_parallel.csv.

Every configuration is also checked against one process (output, input gradient, every
parameter gradient), and its rows are written as soon as it lands, so a run stopped at a
deadline keeps what it measured. Any difference fails the run on every rank together, after
the rows are written. torch's control is left out, in one line, on a pair that cannot carry
its coalesced collectives (``common.launch.carries_point_to_point``: Gloo with CUDA tensors).

    python 07_parallelism/measure/bench_tensor_parallel.py --world-size 4 --d-model 128 --heads 8

The demo's flags, and ``--bench`` (accepted and ignored). ``tests/checks_tensor_parallel.py``
runs these checks beside the bugs they must catch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from common import import_stage, models  # noqa: E402 (after the path)

from bench import results  # noqa: E402

from bench import supervisor as launch
from common.launch import carries_point_to_point  # noqa: E402
from counters import (CommCounter, FunctionalCommCounter, SavedActivations,  # noqa: E402
                      ring_send_bytes)

tp = import_stage("07_parallelism/03_tensor_parallel/tensor_parallel")
torch_tp = import_stage("07_parallelism/03_tensor_parallel/torch_tensor_parallel")

# float32 sums in another order (t partial sums instead of one): differences of a few 1e-7
# relative; a missing collective or a wrong slice is off by the size of the values.
RTOL = 1e-4
ATOL = 1e-5
BLOCK_LAYERS = ("attn.qkv", "attn.out", "mlp.0", "mlp.2")
FLOAT32 = 4

# --------------------------------------------------------------------------- the formulas


def predicted_comm(variant: str, tokens: int, d_model: int, d_ff: int,
                   element_size: int = FLOAT32) -> dict[tuple[str, str], tuple[str, int]]:
    """What each MLP layer must communicate: {(layer, phase): (op, bytes)}, tokens = batch x seq.

    Megatron: fc1's forward nothing (f is the identity), its backward all-reduces dX (tokens x
    d_model); fc2's forward all-reduces Y (tokens x d_model), its backward nothing (g's is the
    identity). All-gather: each layer gathers its output forward and all-reduces dX backward.
    """
    activation = tokens * d_model * element_size  # one [tokens, d_model] tensor
    hidden = tokens * d_ff * element_size         # one [tokens, d_ff] tensor
    if variant == "megatron":
        return {("fc1", "forward"): ("-", 0),
                ("fc1", "backward"): ("all_reduce", activation),
                ("fc2", "forward"): ("all_reduce", activation),
                ("fc2", "backward"): ("-", 0)}
    if variant == "allgather":
        return {("fc1", "forward"): ("all_gather", hidden),
                ("fc1", "backward"): ("all_reduce", activation),
                ("fc2", "forward"): ("all_gather", activation),
                ("fc2", "backward"): ("all_reduce", hidden)}
    raise ValueError(f"unknown variant {variant!r}; allowed: {', '.join(tp.VARIANTS)}")


def predicted_block_comm(tokens: int, d_model: int, sequence_parallel: bool,
                         element_size: int = FLOAT32) -> dict[tuple[str, str], tuple[str, int]]:
    """What each parallel layer of a block communicates: {(layer, phase): (op, payload bytes)},
    tokens = batch x seq, the payload being the full [tokens, d_model] tensor each time.

    Plain: the column-parallel layers (attn.qkv, mlp.0) all-reduce dX backward (``f``), the
    row-parallel ones (attn.out, mlp.2) all-reduce Y forward (``g``). Sequence parallel: each
    all-reduce becomes a reduce-scatter in the same place, and an all-gather appears where
    ``f`` and ``g`` did nothing. A ring sends 2 (t-1)/t of the payload per all-reduce and
    (t-1)/t per all-gather or reduce-scatter: the same bytes either way.
    """
    activation = tokens * d_model * element_size
    predicted = {}
    for layer in ("attn.qkv", "mlp.0"):     # column-parallel: the input side
        if sequence_parallel:
            predicted[(layer, "forward")] = ("all_gather", activation)
            predicted[(layer, "backward")] = ("reduce_scatter", activation)
        else:
            predicted[(layer, "forward")] = ("-", 0)
            predicted[(layer, "backward")] = ("all_reduce", activation)
    for layer in ("attn.out", "mlp.2"):     # row-parallel: the output side
        if sequence_parallel:
            predicted[(layer, "forward")] = ("reduce_scatter", activation)
            predicted[(layer, "backward")] = ("all_gather", activation)
        else:
            predicted[(layer, "forward")] = ("all_reduce", activation)
            predicted[(layer, "backward")] = ("-", 0)
    return predicted


def predicted_replicated_grads(d_model: int, sequence_parallel: bool,
                               element_size: int = FLOAT32) -> int:
    """Bytes ``all_reduce_replicated_grads`` all-reduces per block: with sequence parallelism
    norm1's and norm2's weight and bias and mlp.2's bias, d_model each (attn.out has no bias);
    without it nothing."""
    if not sequence_parallel:
        return 0
    return 5 * d_model * element_size


def saved_formula(cfg: dict, world_size: int, sequence_parallel: bool) -> tuple[int, int]:
    """(LayerNorms', everything else's) bytes saved for backward by one block on one rank,
    float32, no dropout; world_size 1 is the block on one process. b batch, s sequence, h
    d_model, f d_ff, a heads, t world size (the README derives it):

    LayerNorms: each keeps its input (bsh) and a mean and 1/std per token (2bs): 2bsh + 4bs,
    divided by t with sequence parallelism. The rest: the inputs of qkv and fc1 (2bsh, whole
    on every rank), and per rank: q, k, v (3bsh/t), attention's output (bsh/t; the fused
    kernel writes it [batch, seq, heads, head_dim], so the out-projection reads that very
    storage), the log-sum-exp of each head's scores (abs/t), fc1's output and GELU's
    (2bsf/t)."""
    b = cfg["batch"]
    s = cfg["seq"]
    h = cfg["d_model"]
    f = cfg["d_ff"]
    a = cfg["heads"]
    t = world_size
    layernorms = 2 * b * s * h + 4 * b * s
    if sequence_parallel:
        layernorms = layernorms // t
    rest = 2 * b * s * h + (4 * b * s * h + a * b * s + 2 * b * s * f) // t
    return FLOAT32 * layernorms, FLOAT32 * rest


# --------------------------------------------------------------------------- counting


def label_layers(comm, module: nn.Module, names) -> list:
    """Hooks that name the layer and phase in ``comm.current`` as forward reaches each layer
    and as backward does; returns the handles (remove them when done)."""
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


def count_saved(block: nn.Module, run) -> tuple[int, int]:
    """(bytes saved inside norm1 and norm2, bytes saved elsewhere) while ``run()`` runs the
    forward: each LayerNorm call gets a counter of its own, opened and closed by hooks."""
    inside = []

    def open_counter(module, args):
        counter = SavedActivations(block)
        counter.__enter__()
        inside.append(counter)

    def close_counter(module, args, output):
        inside[-1].__exit__(None, None, None)

    handles = []
    for norm in (block.norm1, block.norm2):
        handles.append(norm.register_forward_pre_hook(open_counter))
        handles.append(norm.register_forward_hook(close_counter))
    with SavedActivations(block) as elsewhere:
        run()
    for handle in handles:
        handle.remove()
    return sum(counter.bytes for counter in inside), elsewhere.bytes


def compare(what: str, got: torch.Tensor, want: torch.Tensor) -> dict:
    return {"checked": what, "max_abs_diff": (got - want).abs().max().item(),
            "ok": torch.allclose(got, want, rtol=RTOL, atol=ATOL)}


def compare_bytes(counted: dict, predicted: dict, world_size: int,
                  what: str) -> tuple[list[dict], list[str]]:
    """Each layer and phase's collectives, counted (``CommCounter.by_label``) against the
    prediction {(layer, phase): (op, payload bytes)}: (rows, failures)."""
    rows = []
    failures = []
    for (layer, phase), (op, want) in predicted.items():
        got = counted.get(f"{layer} {phase}", {"ops": [], "payload_bytes": 0})
        want_ops = []
        if want:
            want_ops = [op]
        if got["payload_bytes"] != want or got["ops"] != want_ops:
            failures.append(f"{what} {layer} {phase}: counted {got['ops']} "
                            f"{got['payload_bytes']} B, predicted {op} {want} B")
        sent = 0
        if want:
            sent = ring_send_bytes(op, want, world_size)
        rows.append({"layer": layer, "phase": phase, "collective": op,
                     "bytes_counted": got["payload_bytes"], "bytes_predicted": want,
                     "ring_bytes_sent_per_rank": sent})
    return rows, failures


def failed_rows(label: str, rows: list[dict]) -> list[str]:
    failures = []
    for row in rows:
        if not row["ok"]:
            failures.append(f"{label} {row['checked']}: max abs diff {row['max_abs_diff']:.3g}")
    return failures


def my_tokens(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank's contiguous seq/t tokens of [batch, seq, hidden]: the sequence-parallel layout."""
    return x.chunk(world_size, dim=1)[rank]


# --------------------------------------------------------------------------- 1. the MLP


def check_variant(ctx, cfg: dict, variant: str) -> dict:
    """One forward + backward of the TP MLP and of the one-process MLP on the same data:
    {"checks": a row per output and gradient compared, "bytes": a row per layer and phase,
    counted beside predicted, "failures"}."""
    torch.manual_seed(0)  # every rank builds the same full MLP and data, then keeps its shards
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
    checks = [compare("output", out, reference(x_ref)),
              compare("input.grad", x_tp.grad, x_ref.grad)]
    for name, param in model.named_parameters():  # each against its part of the full gradient
        layer_name, param_name = name.split(".")
        layer = getattr(model, layer_name)
        full_grad = getattr(getattr(reference, layer_name), param_name).grad
        checks.append(compare(f"{name}.grad", param.grad, layer.local_part(full_grad)))
    for row in checks:
        row["variant"] = variant
    tokens = cfg["batch"] * cfg["seq"]
    predicted = predicted_comm(variant, tokens, cfg["d_model"], cfg["d_ff"])
    rows, failures = compare_bytes(comm.by_label, predicted, ctx.world_size, variant)
    byte_rows = []
    for row in rows:
        byte_rows.append({"variant": variant, **row})
    return {"checks": checks, "bytes": byte_rows,
            "failures": failed_rows(variant, checks) + failures}


def check_mlp(ctx, cfg: dict, land=None) -> tuple[list[dict], list[dict], list[str]]:
    """Every variant in ``cfg["variants"]``: (check rows, byte rows, this rank's failures).
    ``land(ctx, cfg, result)`` is called with each variant's result as it lands."""
    checks = []
    byte_rows = []
    failures = []
    for variant in cfg["variants"]:
        result = check_variant(ctx, cfg, variant)
        if land is not None:
            land(ctx, cfg, result)
        checks += result["checks"]
        byte_rows += result["bytes"]
        failures += result["failures"]
    return checks, byte_rows, failures


# --------------------------------------------------------------------------- 2. the block


def one_process_block(ctx, cfg: dict) -> dict:
    """The full block on this rank, one forward + backward with a random probe as dL/d(output),
    so every gradient is used; the saved bytes counted. Every rank builds the same (seed 0)."""
    torch.manual_seed(0)
    full = models.Block(cfg["d_model"], cfg["d_ff"], cfg["heads"]).to(ctx.device)
    x = torch.randn(cfg["batch"], cfg["seq"], cfg["d_model"], device=ctx.device)
    probe = torch.randn_like(x)
    x_ref = x.clone().requires_grad_(True)
    outputs = []

    def forward():
        outputs.append(full(x_ref))

    saved = count_saved(full, forward)
    outputs[0].backward(probe)
    return {"full": full, "x": x, "probe": probe, "out": outputs[0].detach(),
            "x_grad": x_ref.grad, "saved": saved}


def saved_row(cfg: dict, label: str, world_size: int, sequence_parallel: bool,
              saved: tuple[int, int]) -> dict:
    layernorms_formula, rest_formula = saved_formula(cfg, world_size, sequence_parallel)
    return {"block": label, "t": world_size, "layernorms": saved[0],
            "layernorms formula": layernorms_formula, "rest": saved[1],
            "rest formula": rest_formula, "total": saved[0] + saved[1]}


def saved_failures(ctx, row: dict) -> list[str]:
    """The saved bytes against the formula, on the CPU (a GPU's attention kernel saves other
    tensors: there they are reported, not checked)."""
    if ctx.device.type != "cpu":
        return []
    if row["layernorms"] == row["layernorms formula"] and row["rest"] == row["rest formula"]:
        return []
    return [f"{row['block']}: saved {row['layernorms']} B in the LayerNorms and {row['rest']} B "
            f"elsewhere; the formula says {row['layernorms formula']} and {row['rest formula']}"]


def phase_totals(label: str, calls: list[dict], world_size: int) -> list[dict]:
    """Per phase: the collectives, their payload and what a ring sends per rank for them, from
    calls labelled with their phase ("forward", "backward")."""
    table = []
    for phase in ("forward", "backward"):
        ops = []
        payload = 0
        sent = 0.0
        for call in calls:
            if call["label"] == phase and call["payload_bytes"]:
                ops.append(call["op"])
                payload += call["payload_bytes"]
                sent += ring_send_bytes(call["op"], call["payload_bytes"], world_size)
        table.append({"block": label, "phase": phase, "collectives": " ".join(ops),
                      "payload bytes": payload, "ring bytes sent per rank": sent})
    return table


def check_parallel_block(ctx, cfg: dict, group, reference: dict, sequence_parallel: bool) -> dict:
    """Our TP (or TP + SP) block from the full one, one forward + backward on the same data as
    ``reference``: {"label", "checks", "bytes" (per layer), "totals" (per phase), "saved",
    "failures"}."""
    rank = dist.get_rank(group)
    world_size = dist.get_world_size(group)
    label = "TP"
    if sequence_parallel:
        label = "TP + SP"
    full = reference["full"]
    block = tp.TensorParallelBlock(full, group, sequence_parallel=sequence_parallel)
    x_mine = reference["x"]
    probe_mine = reference["probe"]
    want_out = reference["out"]
    want_x_grad = reference["x_grad"]
    if sequence_parallel:  # this rank's seq/t tokens in, and out
        x_mine = my_tokens(x_mine, rank, world_size)
        probe_mine = my_tokens(probe_mine, rank, world_size)
        want_out = my_tokens(want_out, rank, world_size)
        want_x_grad = my_tokens(want_x_grad, rank, world_size)
    x_mine = x_mine.clone().requires_grad_(True)
    outputs = []

    def forward():
        outputs.append(block(x_mine))

    with CommCounter() as comm:
        handles = label_layers(comm, block, BLOCK_LAYERS)
        saved = count_saved(block, forward)
        outputs[0].backward(probe_mine)
        comm.current = "replicated grads"
        block.all_reduce_replicated_grads()
    for handle in handles:
        handle.remove()
    checks = [compare("output", outputs[0], want_out),
              compare("input.grad", x_mine.grad, want_x_grad)]
    for name, param in block.named_parameters():  # the names of the full block's parameters
        full_grad = full.get_parameter(name).grad
        owner = block.get_submodule(name.rsplit(".", 1)[0])
        want = full_grad
        if hasattr(owner, "local_part"):  # a parallel layer: its slice of the full gradient
            want = owner.local_part(full_grad)
        checks.append(compare(f"{name}.grad", param.grad, want))
    for row in checks:
        row["block"] = label
    tokens = cfg["batch"] * cfg["seq"]
    predicted = predicted_block_comm(tokens, cfg["d_model"], sequence_parallel)
    rows, failures = compare_bytes(comm.by_label, predicted, world_size, label)
    calls = []  # the layers' calls, for the totals per phase
    byte_rows = []
    for row in rows:
        byte_rows.append({"block": label, **row})
        calls.append({"label": row["phase"], "op": row["collective"],
                      "payload_bytes": row["bytes_counted"]})
    replicated = comm.by_label.get("replicated grads", {"payload_bytes": 0, "ops": []})
    want_replicated = predicted_replicated_grads(cfg["d_model"], sequence_parallel)
    if replicated["payload_bytes"] != want_replicated:
        failures.append(f"{label}: the replicated gradients' all-reduces carried "
                        f"{replicated['payload_bytes']} B, predicted {want_replicated}")
    collective = "-"
    if want_replicated:
        collective = "all_reduce"
    byte_rows.append({"block": label, "layer": "replicated grads", "phase": "after backward",
                      "collective": collective, "bytes_counted": replicated["payload_bytes"],
                      "bytes_predicted": want_replicated,
                      "ring_bytes_sent_per_rank": ring_send_bytes("all_reduce", want_replicated,
                                                                  world_size)})
    saved = saved_row(cfg, label, world_size, sequence_parallel, saved)
    return {"label": label, "checks": checks, "bytes": byte_rows, "saved": saved,
            "totals": phase_totals(label, calls, world_size),
            "failures": failed_rows(label, checks) + failures + saved_failures(ctx, saved)}


def check_torch_block(ctx, cfg: dict, group, reference: dict) -> dict:
    """torch's parallelize_module on the same block, sequence parallel: output and input
    gradient against one process, its functional collectives counted at dispatch per phase,
    its saved bytes (the same keys as ``check_parallel_block``; no per-layer rows)."""
    label = "torch TP + SP"
    rank = dist.get_rank(group)
    world_size = dist.get_world_size(group)
    block = torch_tp.parallelize_block(reference["full"], group, ctx.device.type)
    x_mine = my_tokens(reference["x"], rank, world_size).clone().requires_grad_(True)
    outputs = []

    def forward():
        outputs.append(block(x_mine))

    with FunctionalCommCounter() as comm:  # torch's DTensor collectives
        comm.current = "forward"
        saved = count_saved(block, forward)
        comm.current = "backward"
        outputs[0].backward(my_tokens(reference["probe"], rank, world_size))
    checks = [compare("output", outputs[0], my_tokens(reference["out"], rank, world_size)),
              compare("input.grad", x_mine.grad, my_tokens(reference["x_grad"], rank, world_size))]
    for row in checks:
        row["block"] = label
    failures = []
    for problem in failed_rows("", checks):
        failures.append(f"torch's parallelize_module{problem} from one process")
    return {"label": label, "checks": checks, "bytes": [],
            "saved": saved_row(cfg, label, world_size, True, saved),
            "totals": phase_totals(label, comm.calls, world_size), "failures": failures}


def check_block(ctx, cfg: dict, group=None, with_torch: bool = True, land=None) -> dict:
    """The block on one process, in TP, in TP + SP, and torch's TP + SP, on ``group``:
    {"checks", "bytes", "totals", "saved", "failures"} (failures of this rank only).
    ``land(ctx, cfg, part)`` is called with each configuration's part as it lands."""
    world_size = dist.get_world_size(group)
    reference = one_process_block(ctx, cfg)
    one_process = {"label": "one process", "checks": [], "bytes": [], "totals": [],
                   "saved": saved_row(cfg, "one process", 1, False, reference["saved"])}
    one_process["failures"] = saved_failures(ctx, one_process["saved"])
    parts = [one_process]
    if land is not None:
        land(ctx, cfg, one_process)
    configurations = [False, True]
    if with_torch:
        configurations.append("torch")
    for configuration in configurations:
        if configuration == "torch":
            part = check_torch_block(ctx, cfg, group, reference)
        else:
            part = check_parallel_block(ctx, cfg, group, reference, configuration)
        if land is not None:
            land(ctx, cfg, part)
        parts.append(part)
    result = {"checks": [], "bytes": [], "totals": [], "saved": [], "failures": []}
    for part in parts:
        result["checks"] += part["checks"]
        result["bytes"] += part["bytes"]
        result["totals"] += part["totals"]
        result["saved"].append(part["saved"])
        result["failures"] += part["failures"]
    result["world_size"] = world_size
    return result


def agree(failures: list[str], group=None) -> list[str]:
    """Every rank's problems on every rank, named by rank: one verdict (common/verify.py)."""
    from common import verify
    return verify.agree_on_problems(failures, group)


# --------------------------------------------------------------------------- rows, as they land


def mlp_columns(ctx, cfg: dict) -> dict:
    return {"backend": ctx.backend, "device": ctx.device.type, "world_size": ctx.world_size,
            "tokens": cfg["batch"] * cfg["seq"], "d_model": cfg["d_model"], "d_ff": cfg["d_ff"]}


def shown(path: Path) -> Path:
    """``path`` relative to the current folder when it is inside it (shorter to read)."""
    if path.is_relative_to(Path.cwd()):
        return path.relative_to(Path.cwd())
    return path


def land_variant(ctx, cfg: dict, result: dict) -> None:
    """One MLP variant's rows into results/tensor_parallel.csv (rank 0)."""
    if not ctx.is_main:
        return
    same = mlp_columns(ctx, cfg)
    rows = []
    for row in result["bytes"]:
        rows.append({**same, **row, "run_id": results.run_id()})
    path = results.upsert_csv("tensor_parallel.csv", rows,
                              key=[*same, "variant", "layer", "phase"])
    ctx.print(f"MLP, {rows[0]['variant']}: rows in {shown(path)}", all_ranks=False)


def land_block(ctx, cfg: dict, part: dict) -> None:
    """One block configuration's rows into results/sequence_parallel.csv (rank 0): its bytes
    per phase (none for one process) and its saved bytes beside the formula."""
    if not ctx.is_main:
        return
    same = {**mlp_columns(ctx, cfg), "heads": cfg["heads"]}
    rows = []
    for row in part["totals"]:
        rows.append({**same, "what": "bytes", "block": row["block"], "phase": row["phase"],
                     "collectives": row["collectives"], "bytes": row["payload bytes"],
                     "formula": "", "ring_bytes_sent_per_rank": row["ring bytes sent per rank"],
                     "run_id": results.run_id()})
    saved = part["saved"]
    for kind in ("layernorms", "rest"):
        rows.append({**same, "what": f"saved {kind}", "block": saved["block"], "phase": "forward",
                     "collectives": "", "bytes": saved[kind], "formula": saved[f"{kind} formula"],
                     "ring_bytes_sent_per_rank": "", "run_id": results.run_id()})
    path = results.upsert_csv("sequence_parallel.csv", rows,
                              key=[*same, "what", "block", "phase"])
    ctx.print(f"block, {part['label']}: rows in {shown(path)}", all_ranks=False)


# --------------------------------------------------------------------------- the run


def bench_main(ctx, cfg: dict) -> None:
    """Both MLP variants and the block, each counted, checked and written as it lands; then
    the tables and one verdict."""
    checks, mlp_bytes, failures = check_mlp(ctx, cfg, land=land_variant)
    block = check_block(ctx, cfg, with_torch=cfg["with_torch"], land=land_block)
    failures = agree(failures + block["failures"])
    if ctx.is_main:
        tokens = cfg["batch"] * cfg["seq"]
        where = f"{ctx.backend}/{ctx.device.type} ({results.machine_name()})"
        print(f"\nTensor-parallel MLP on {ctx.world_size} ranks: d_model {cfg['d_model']}, "
              f"d_ff {cfg['d_ff']}, {tokens} tokens, {where}")
        results.print_table(mlp_bytes, "\nBytes per layer, one forward + backward (float32):",
                            floatfmt=".0f")
        print(f"\nA Transformer block of the course LM (d_model {cfg['d_model']}, d_ff "
              f"{cfg['d_ff']}, {cfg['heads']} heads, batch {cfg['batch']}, seq {cfg['seq']}) on "
              f"{ctx.world_size} ranks, {where}:")
        results.print_table(block["bytes"], "\nBytes per parallel layer, one forward + "
                            "backward (float32; payload = the full tensor):", floatfmt=".0f")
        results.print_table(block["totals"], "\nPer block: ours beside torch's "
                            "parallelize_module (SequenceParallel, ColwiseParallel, "
                            "RowwiseParallel):", floatfmt=".0f")
        results.print_table(block["saved"], "\nBytes saved for backward per rank, counted "
                            "(saved-tensor hooks) beside the formula:", floatfmt=".0f")
    if failures:
        raise AssertionError("tensor-parallel check failed:\n  " + "\n  ".join(failures))
    ctx.print(f"all checks passed on every rank: {len(checks) + len(block['checks'])} outputs "
              "and gradients against one process, bytes as predicted, saved activations as the "
              "formula says", all_ranks=False)


def add_flags(parser) -> None:
    """The demo's flags (run_tensor_parallel.py), and ``--bench``."""
    for flag, default, what in (("--d-model", 64, "MLP and block input/output width"),
                                ("--d-ff", 256, "MLP hidden width"),
                                ("--batch", 8, "sequences per batch"),
                                ("--seq", 16, "tokens per sequence"),
                                ("--heads", 4, "attention heads of the block")):
        parser.add_argument(flag, type=launch.positive_int, default=default, help=what)
    parser.add_argument("--variants", type=launch.choice_list(list(tp.VARIANTS)),
                        default=list(tp.VARIANTS), help="subset of " + ",".join(tp.VARIANTS))
    parser.add_argument("--bench", action="store_true", help="accepted (make bench passes it)")


def refuse_bad_sizes(parser, args, world_size: int) -> None:
    """One line and exit 2 for sizes the split cannot take, before any worker starts."""
    if args.d_ff % world_size:
        parser.error(f"--d-ff {args.d_ff} is not divisible by the tensor-parallel size "
                     f"(world size) {world_size}")
    if "allgather" in args.variants and args.d_model % world_size:
        parser.error(f"--d-model {args.d_model} is not divisible by the world size {world_size} "
                     "(the all-gather variant splits fc2's outputs)")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    if args.heads % world_size:
        parser.error(f"--heads {args.heads} is not divisible by the world size {world_size} "
                     "(each rank holds whole heads)")
    if args.seq % world_size:
        parser.error(f"--seq {args.seq} is not divisible by the world size {world_size} "
                     "(sequence parallelism gives each rank seq / t tokens)")


def refuse_too_large(config, args) -> None:
    """One line and exit 2 when a rank's rough peak (float32: the full MLP and block, their
    gradients, its slices and torch's copy, the activations of three blocks) cannot fit."""
    weights = 2 * args.d_model * args.d_ff + 4 * args.d_model * args.d_model
    tokens = args.batch * args.seq
    activations = tokens * (12 * args.d_model + 3 * args.d_ff) + args.batch * args.heads * args.seq
    need = 4 * (6 * weights + 4 * activations)
    launch.check_fits(config, need, f"{need / 2**30:.1f} GiB each for --d-model {args.d_model} "
                      f"--d-ff {args.d_ff} --batch {args.batch} --seq {args.seq}")


def main(argv=None) -> None:
    parser = launch.make_parser(__doc__, world_size=2)
    add_flags(parser)
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    refuse_bad_sizes(parser, args, config.world_size)
    refuse_too_large(config, args)
    results.check_writable()
    cfg = vars(args)
    cfg["with_torch"] = carries_point_to_point(config.backend, config.device)
    if not cfg["with_torch"]:
        print(f"torch's parallelize_module control: left out on {config.backend}/{config.device}, "
              "which cannot carry DTensor's coalesced collectives", flush=True)
    launch.launch(bench_main, config, cfg)


if __name__ == "__main__":
    main()
