"""Stage 07, lesson 3: tensor and sequence parallelism, checked and counted.

1. The MLP (tensor_parallel.py): both variants, Megatron's column-then-row pair and the
   all-gather after every layer, against the same MLP on one process (output, the input's
   gradient, every parameter's gradient), and the bytes each layer communicates forward and
   backward, counted by watching the collectives, beside what the algorithm predicts. Rows in
   results/tensor_parallel.csv.
2. A Transformer block of the course LM (common/models.py ``Block``) split over the same ranks,
   plain tensor parallel (TP) and with sequence parallelism (TP + SP), against the block on one
   process; the bytes per layer beside the prediction (the same total for both); the bytes
   autograd saves for backward, LayerNorms apart from the rest, beside the formula derived in
   the README; and torch's own ``parallelize_module`` (SequenceParallel, ColwiseParallel,
   RowwiseParallel) on the same block as the control: same output, its bytes beside ours.
   Rows in results/sequence_parallel.csv.
Any difference fails the run, on every rank together.

Run:
    python 07_parallelism/03_tensor_parallel/run_tensor_parallel.py          # 2 ranks, gloo/cpu
    python 07_parallelism/03_tensor_parallel/run_tensor_parallel.py --world-size 4
    torchrun --nproc-per-node=4 07_parallelism/03_tensor_parallel/run_tensor_parallel.py
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tensor_parallel as tp


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


_repo()
from common import import_stage, launch, models, results  # found by _repo()

counters = import_stage("07_parallelism/measure/counters")

# float32 sums in another order (t partial sums instead of one): differences of a few 1e-7
# relative; a missing collective or a wrong slice is off by the size of the values.
RTOL = 1e-4
ATOL = 1e-5
BLOCK_LAYERS = ("attn.qkv", "attn.out", "mlp.0", "mlp.2")


def shown_path(path: Path) -> Path:
    """``path`` relative to the current folder when it is inside it (shorter to read)."""
    if path.is_relative_to(Path.cwd()):
        return path.relative_to(Path.cwd())
    return path


def agree(failures: list[str]) -> list[str]:
    """Every rank's problems on every rank, named by rank: one verdict (common/verify.py)."""
    from common import verify
    return verify.agree_on_problems(failures)


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
            sent = counters.ring_send_bytes(op, want, world_size)
        rows.append({"layer": layer, "phase": phase, "collective": op,
                     "bytes_counted": got["payload_bytes"], "bytes_predicted": want,
                     "ring_bytes_sent_per_rank": sent})
    return rows, failures


# --------------------------------------------------------------------------- 1. the MLP


def check_variant(ctx, variant: str, cfg: dict) -> tuple[list[dict], dict]:
    """One forward + backward of the TP MLP and of the one-process MLP on the same data:
    a row per output and gradient compared, and the collectives counted per layer and phase."""
    torch.manual_seed(0)  # every rank builds the same full MLP and data, then keeps its shards
    reference = tp.MLP(cfg["d_model"], cfg["d_ff"]).to(ctx.device)
    x = torch.randn(cfg["batch"], cfg["seq"], cfg["d_model"], device=ctx.device)
    target = torch.randn_like(x)
    model = tp.VARIANTS[variant](reference)
    x_ref = x.clone().requires_grad_(True)  # dX matters: it feeds the layer below
    x_tp = x.clone().requires_grad_(True)
    F.mse_loss(reference(x_ref), target).backward()
    with counters.CommCounter() as comm:
        handles = label_layers(comm, model, ("fc1", "fc2"))
        out = model(x_tp)
        F.mse_loss(out, target).backward()
    for handle in handles:
        handle.remove()
    rows = [compare("output", out, reference(x_ref)), compare("input.grad", x_tp.grad, x_ref.grad)]
    for name, param in model.named_parameters():  # each against its part of the full gradient
        layer_name, param_name = name.split(".")
        layer = getattr(model, layer_name)
        full_grad = getattr(getattr(reference, layer_name), param_name).grad
        rows.append(compare(f"{name}.grad", param.grad, layer.local_part(full_grad)))
    for row in rows:
        row["variant"] = variant
    return rows, comm.by_label


def check_mlp(ctx, cfg: dict) -> tuple[list[dict], list[dict], list[str]]:
    """Both variants: (check rows, byte rows, failures)."""
    tokens = cfg["batch"] * cfg["seq"]
    checks = []
    byte_rows = []
    failures = []
    for variant in cfg["variants"]:
        rows, counted = check_variant(ctx, variant, cfg)
        checks += rows
        for row in rows:
            if not row["ok"]:
                failures.append(f"{variant} {row['checked']}: max abs diff "
                                f"{row['max_abs_diff']:.3g}")
        predicted = tp.predicted_comm(variant, tokens, cfg["d_model"], cfg["d_ff"])
        rows, problems = compare_bytes(counted, predicted, ctx.world_size, variant)
        for row in rows:
            byte_rows.append({"variant": variant, **row})
        failures += problems
    return checks, byte_rows, failures


# --------------------------------------------------------------------------- 2. the block


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
    return 4 * layernorms, 4 * rest


def count_saved(block: nn.Module, run) -> tuple[int, int]:
    """(bytes saved inside norm1 and norm2, bytes saved elsewhere) while ``run()`` runs the
    forward: each LayerNorm call gets a counter of its own, opened and closed by hooks."""
    inside = []

    def open_counter(module, args):
        counter = counters.SavedActivations(block)
        counter.__enter__()
        inside.append(counter)

    def close_counter(module, args, output):
        inside[-1].__exit__(None, None, None)

    handles = []
    for norm in (block.norm1, block.norm2):
        handles.append(norm.register_forward_pre_hook(open_counter))
        handles.append(norm.register_forward_hook(close_counter))
    with counters.SavedActivations(block) as elsewhere:
        run()
    for handle in handles:
        handle.remove()
    return sum(counter.bytes for counter in inside), elsewhere.bytes


def my_tokens(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank's contiguous seq/t tokens of [batch, seq, hidden]: the sequence-parallel layout."""
    return x.chunk(world_size, dim=1)[rank]


def check_parallel_block(ctx, cfg, group, full, reference, sequence_parallel: bool,
                         reduce_replicated: bool = True) -> tuple[list[dict], dict, dict]:
    """TP (or TP + SP) block from ``full``, one forward + backward on the same data as
    ``reference`` (full block, run already): (check rows, bytes by label, saved bytes)."""
    rank = dist.get_rank(group)
    world_size = dist.get_world_size(group)
    block = tp.TensorParallelBlock(full, group, sequence_parallel=sequence_parallel)
    x = reference["x"]
    probe = reference["probe"]  # dL/d(output): a random direction, so every gradient is used
    if sequence_parallel:
        x_mine = my_tokens(x, rank, world_size).clone().requires_grad_(True)
        probe_mine = my_tokens(probe, rank, world_size)
    else:
        x_mine = x.clone().requires_grad_(True)
        probe_mine = probe
    outputs = []

    def forward():
        outputs.append(block(x_mine))

    with counters.CommCounter() as comm:
        handles = label_layers(comm, block, BLOCK_LAYERS)
        saved = count_saved(block, forward)
        outputs[0].backward(probe_mine)
        comm.current = "replicated grads"
        if reduce_replicated:
            block.all_reduce_replicated_grads()
    for handle in handles:
        handle.remove()
    want_out = reference["out"]
    want_x_grad = reference["x_grad"]
    if sequence_parallel:
        want_out = my_tokens(want_out, rank, world_size)
        want_x_grad = my_tokens(want_x_grad, rank, world_size)
    rows = [compare("output", outputs[0], want_out),
            compare("input.grad", x_mine.grad, want_x_grad)]
    for name, param in block.named_parameters():  # the names of the full block's parameters
        full_grad = full.get_parameter(name).grad
        owner = block.get_submodule(name.rsplit(".", 1)[0])
        want = full_grad
        if hasattr(owner, "local_part"):  # a parallel layer: its slice of the full gradient
            want = owner.local_part(full_grad)
        rows.append(compare(f"{name}.grad", param.grad, want))
    return rows, comm.by_label, {"layernorms": saved[0], "rest": saved[1]}


class SplitQKVAttention(nn.Module):
    """The block's attention with q, k, v as three Linears, for torch's ColwiseParallel (which
    cuts one Linear's outputs into t contiguous slices: on the fused projection a slice would
    mix q, k and v). Same weights; ``-1`` heads, so it runs on however many a rank holds."""

    def __init__(self, full_attn: nn.Module):
        super().__init__()
        width = full_attn.out.in_features
        self.head_dim = width // full_attn.num_heads
        self.attend = full_attn.attend
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, width, bias=False)
        self.v = nn.Linear(width, width, bias=False)
        q_weight, k_weight, v_weight = full_attn.qkv.weight.detach().chunk(3, dim=0)
        self.q.weight = nn.Parameter(q_weight.clone())
        self.k.weight = nn.Parameter(k_weight.clone())
        self.v.weight = nn.Parameter(v_weight.clone())
        self.out = copy.deepcopy(full_attn.out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        y = self.attend(q, k, v)
        return self.out(y.transpose(1, 2).reshape(batch, seq, -1))


class SplitQKVBlock(nn.Module):
    """The course block with SplitQKVAttention: what torch's tensor parallel is applied to."""

    def __init__(self, full: nn.Module):
        super().__init__()
        self.norm1 = copy.deepcopy(full.norm1)
        self.attn = SplitQKVAttention(full.attn)
        self.norm2 = copy.deepcopy(full.norm2)
        self.mlp = copy.deepcopy(full.mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def check_torch_block(ctx, cfg, group, full, reference) -> tuple[list[dict], list[dict], tuple]:
    """torch's parallelize_module on the same block, sequence parallel: (check rows, calls,
    saved bytes as ``count_saved`` gives them)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    rank = dist.get_rank(group)
    world_size = dist.get_world_size(group)
    mesh_group = group
    if mesh_group is None:
        mesh_group = dist.group.WORLD
    mesh = DeviceMesh.from_group(mesh_group, ctx.device.type)
    gather_sequence = PrepareModuleInput(input_layouts=(Shard(1),),
                                         desired_input_layouts=(Replicate(),))
    plan = {"norm1": SequenceParallel(), "attn": gather_sequence,
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.out": RowwiseParallel(output_layouts=Shard(1)),
            "norm2": SequenceParallel(), "mlp": copy.deepcopy(gather_sequence),
            "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel(output_layouts=Shard(1))}
    block = parallelize_module(SplitQKVBlock(full), mesh, plan)
    x_mine = my_tokens(reference["x"], rank, world_size).clone().requires_grad_(True)
    outputs = []

    def forward():
        outputs.append(block(x_mine))

    with counters.FunctionalCommCounter() as comm:  # torch's DTensor collectives
        comm.current = "forward"
        saved = count_saved(block, forward)
        comm.current = "backward"
        outputs[0].backward(my_tokens(reference["probe"], rank, world_size))
    rows = [compare("output", outputs[0], my_tokens(reference["out"], rank, world_size)),
            compare("input.grad", x_mine.grad, my_tokens(reference["x_grad"], rank, world_size))]
    return rows, comm.calls, saved


def phase_totals(calls: list[dict], world_size: int) -> dict:
    """{phase: (ops, payload bytes, ring bytes sent per rank)} from labelled calls."""
    totals = {}
    for call in calls:
        phase = call["label"].rsplit(" ", 1)[-1]
        if phase not in totals:
            totals[phase] = {"ops": [], "payload": 0, "sent": 0.0}
        totals[phase]["ops"].append(call["op"])
        totals[phase]["payload"] += call["payload_bytes"]
        totals[phase]["sent"] += counters.ring_send_bytes(call["op"], call["payload_bytes"],
                                                          world_size)
    return totals


def check_block(ctx, cfg: dict, group=None, reduce_replicated: bool = True,
                with_torch: bool = True) -> dict:
    """The block on one process, in TP, in TP + SP, and torch's TP + SP, on ``group``:
    {"checks", "bytes", "saved", "torch", "failures"} (failures of this rank only)."""
    world_size = dist.get_world_size(group)
    torch.manual_seed(0)  # every rank: the same full block and data
    full = models.Block(cfg["d_model"], cfg["d_ff"], cfg["heads"]).to(ctx.device)
    x = torch.randn(cfg["batch"], cfg["seq"], cfg["d_model"], device=ctx.device)
    probe = torch.randn_like(x)
    x_ref = x.clone().requires_grad_(True)
    outputs = []

    def forward():
        outputs.append(full(x_ref))

    one_process_saved = count_saved(full, forward)
    outputs[0].backward(probe)
    reference = {"x": x, "probe": probe, "out": outputs[0].detach(), "x_grad": x_ref.grad}
    tokens = cfg["batch"] * cfg["seq"]
    checks = []
    byte_rows = []
    saved_rows = []
    failures = []
    saved_rows.append(saved_row(cfg, "one process", 1, False, one_process_saved[0],
                                one_process_saved[1]))
    for sequence_parallel in (False, True):
        label = "TP"
        if sequence_parallel:
            label = "TP + SP"
        rows, counted, saved = check_parallel_block(ctx, cfg, group, full, reference,
                                                    sequence_parallel, reduce_replicated)
        for row in rows:
            row["block"] = label
            if not row["ok"]:
                failures.append(f"{label} {row['checked']}: max abs diff "
                                f"{row['max_abs_diff']:.3g}")
        checks += rows
        predicted = tp.predicted_block_comm(tokens, cfg["d_model"], sequence_parallel)
        rows, problems = compare_bytes(counted, predicted, world_size, label)
        for row in rows:
            byte_rows.append({"block": label, **row})
        failures += problems
        replicated = counted.get("replicated grads", {"payload_bytes": 0, "ops": []})
        want_replicated = 0
        if sequence_parallel:  # norm1, norm2 (weight and bias) and mlp.2's bias, d_model each
            want_replicated = 5 * cfg["d_model"] * 4
        if replicated["payload_bytes"] != want_replicated:
            failures.append(f"{label}: the replicated gradients' all-reduces carried "
                            f"{replicated['payload_bytes']} B, predicted {want_replicated}")
        collective = "-"
        if want_replicated:
            collective = "all_reduce"
        byte_rows.append({"block": label, "layer": "replicated grads", "phase": "after backward",
                          "collective": collective, "bytes_counted": replicated["payload_bytes"],
                          "bytes_predicted": want_replicated,
                          "ring_bytes_sent_per_rank": counters.ring_send_bytes(
                              "all_reduce", want_replicated, world_size)})
        row = saved_row(cfg, label, world_size, sequence_parallel, saved["layernorms"],
                        saved["rest"])
        saved_rows.append(row)
    for row in saved_rows:
        layernorms_exact = row["layernorms"] == row["layernorms formula"]
        exact = layernorms_exact and row["rest"] == row["rest formula"]
        if ctx.device.type == "cpu" and not exact:  # a GPU's attention kernel saves other tensors
            failures.append(f"{row['block']}: saved {row['layernorms']} B in the LayerNorms and "
                            f"{row['rest']} B elsewhere; the formula says "
                            f"{row['layernorms formula']} and {row['rest formula']}")
    torch_rows = []
    torch_calls = []
    if with_torch:
        torch_rows, torch_calls, torch_saved = check_torch_block(ctx, cfg, group, full,
                                                                 reference)
        saved_rows.append(saved_row(cfg, "torch TP + SP", world_size, True, torch_saved[0],
                                    torch_saved[1]))
        for row in torch_rows:
            row["block"] = "torch TP + SP"
            if not row["ok"]:
                failures.append(f"torch's parallelize_module {row['checked']}: max abs diff "
                                f"{row['max_abs_diff']:.3g} from one process")
        checks += torch_rows
    return {"checks": checks, "bytes": byte_rows, "saved": saved_rows,
            "torch_calls": torch_calls, "failures": failures}


def saved_row(cfg, label, world_size, sequence_parallel, layernorms, rest) -> dict:
    layernorms_formula, rest_formula = saved_formula(cfg, world_size, sequence_parallel)
    return {"block": label, "t": world_size, "layernorms": layernorms,
            "layernorms formula": layernorms_formula, "rest": rest, "rest formula": rest_formula,
            "total": layernorms + rest}


def block_totals_table(result: dict, world_size: int) -> list[dict]:
    """Bytes per block and phase: ours (TP, TP + SP) from the per-layer rows, torch's from its
    calls, each as payload and as what a ring sends per rank."""
    table = []
    for label in ("TP", "TP + SP"):
        for phase in ("forward", "backward"):
            ops = []
            payload = 0
            sent = 0.0
            for row in result["bytes"]:
                if row["block"] == label and row["phase"] == phase and row["bytes_counted"]:
                    ops.append(row["collective"])
                    payload += row["bytes_counted"]
                    sent += row["ring_bytes_sent_per_rank"]
            table.append({"block": label, "phase": phase, "collectives": " ".join(ops),
                          "payload bytes": payload, "ring bytes sent per rank": sent})
    torch_totals = phase_totals(result["torch_calls"], world_size)
    for phase in ("forward", "backward"):
        totals = torch_totals.get(phase, {"ops": [], "payload": 0, "sent": 0.0})
        table.append({"block": "torch TP + SP", "phase": phase,
                      "collectives": " ".join(totals["ops"]), "payload bytes": totals["payload"],
                      "ring bytes sent per rank": totals["sent"]})
    return table


# --------------------------------------------------------------------------- the run


def tensor_parallel_main(ctx, cfg: dict) -> None:
    """Both MLP variants and the block against one process; bytes counted; one verdict."""
    checks, mlp_bytes, failures = check_mlp(ctx, cfg)
    block = check_block(ctx, cfg)
    failures = agree(failures + block["failures"])
    n = ctx.world_size
    if ctx.is_main:
        tokens = cfg["batch"] * cfg["seq"]
        where = f"{ctx.backend}/{ctx.device.type} ({results.machine_name()})"
        print(f"Tensor-parallel MLP on {n} ranks: d_model {cfg['d_model']}, d_ff {cfg['d_ff']}, "
              f"{tokens} tokens, {where}")
        shown = []
        for row in checks:
            shown.append({"variant": row["variant"], "checked": row["checked"],
                          "max_abs_diff": row["max_abs_diff"], "ok": row["ok"]})
        results.print_table(shown, "\nAgainst the one-process MLP (rank 0's shards; every rank "
                                   "checks its own):", floatfmt=".3g")
        results.print_table(mlp_bytes, "\nBytes per layer, one forward + backward (float32):",
                            floatfmt=".0f")
        same = {"backend": ctx.backend, "device": ctx.device.type, "world_size": n,
                "tokens": tokens, "d_model": cfg["d_model"], "d_ff": cfg["d_ff"]}
        csv_rows = []
        for row in mlp_bytes:
            csv_rows.append({**same, **row, "run_id": results.run_id()})
        results.upsert_csv("tensor_parallel.csv", csv_rows,
                           key=[*same, "variant", "layer", "phase"])
        report_block(ctx, cfg, block)
    if failures:
        raise AssertionError("tensor-parallel check failed:\n  " + "\n  ".join(failures))
    ctx.print("all checks passed on every rank: outputs, every gradient, bytes as predicted, "
              "saved activations as the formula says", all_ranks=False)


def report_block(ctx, cfg: dict, block: dict) -> None:
    n = ctx.world_size
    print(f"\nA Transformer block of the course LM (d_model {cfg['d_model']}, d_ff {cfg['d_ff']}, "
          f"{cfg['heads']} heads, batch {cfg['batch']}, seq {cfg['seq']}) on {n} ranks:")
    shown = []
    for row in block["checks"]:
        shown.append({"block": row["block"], "checked": row["checked"],
                      "max_abs_diff": row["max_abs_diff"], "ok": row["ok"]})
    results.print_table(shown, "\nAgainst the one-process block (rank 0's part):",
                        floatfmt=".3g")
    results.print_table(block["bytes"], "\nBytes per parallel layer, one forward + backward "
                                        "(float32; payload = the full tensor):", floatfmt=".0f")
    totals = block_totals_table(block, n)
    results.print_table(totals, "\nPer block: ours beside torch's parallelize_module "
                                "(SequenceParallel, ColwiseParallel, RowwiseParallel):",
                        floatfmt=".0f")
    results.print_table(block["saved"], "\nBytes saved for backward per rank, counted "
                                        "(saved-tensor hooks) beside the formula:",
                        floatfmt=".0f")
    tokens = cfg["batch"] * cfg["seq"]
    same = {"backend": ctx.backend, "device": ctx.device.type, "world_size": n, "tokens": tokens,
            "d_model": cfg["d_model"], "d_ff": cfg["d_ff"], "heads": cfg["heads"]}
    csv_rows = []
    for row in totals:
        csv_rows.append({**same, "what": "bytes", "block": row["block"], "phase": row["phase"],
                         "collectives": row["collectives"], "bytes": row["payload bytes"],
                         "formula": "", "ring_bytes_sent_per_rank": row["ring bytes sent per rank"],
                         "run_id": results.run_id()})
    for row in block["saved"]:
        for part in ("layernorms", "rest"):
            csv_rows.append({**same, "what": f"saved {part}", "block": row["block"],
                             "phase": "forward", "collectives": "", "bytes": row[part],
                             "formula": row[f"{part} formula"], "ring_bytes_sent_per_rank": "",
                             "run_id": results.run_id()})
    path = results.upsert_csv("sequence_parallel.csv", csv_rows,
                              key=[*same, "what", "block", "phase"])
    print(f"\nwrote {shown_path(path)}")


def per_rank_bytes(args) -> int:
    """A rank's rough peak, float32: every rank builds the full MLP and block, their
    gradients and its slices (and torch's copy), and the activations of three blocks."""
    weights = 2 * args.d_model * args.d_ff + 4 * args.d_model * args.d_model
    tokens = args.batch * args.seq
    activations = tokens * (12 * args.d_model + 3 * args.d_ff) + args.batch * args.heads * args.seq
    return 4 * (6 * weights + 4 * activations)


def check_fits(config, need: int, what: str) -> None:
    """One line and exit 2, before any worker starts, when ``need`` bytes per rank (described by
    ``what``) cannot fit: in the GPUs' memory (ranks sharing a GPU add up), else the host's."""
    ranks_here = launch.ranks_on_this_node(config.world_size)
    if config.device != "cuda":
        launch.check_ranks_fit(ranks_here, need, what)
        return
    ranks_per_gpu = -(-ranks_here // torch.cuda.device_count())  # rounded up
    total = torch.cuda.get_device_properties(0).total_memory
    if ranks_per_gpu * need > 0.9 * total:
        launch.usage_error(f"{what} needs about {ranks_per_gpu * need / 2**30:.1f} GiB per GPU "
                           f"but a GPU has {total / 2**30:.1f} GiB; use smaller sizes")


def main(argv=None) -> None:
    parser = launch.make_parser(__doc__, world_size=2)
    for flag, default, what in (("--d-model", 64, "MLP and block input/output width"),
                                ("--d-ff", 256, "MLP hidden width"),
                                ("--batch", 8, "sequences per batch"),
                                ("--seq", 16, "tokens per sequence"),
                                ("--heads", 4, "attention heads of the block")):
        parser.add_argument(flag, type=launch.positive_int, default=default, help=what)
    parser.add_argument("--variants", type=launch.choice_list(list(tp.VARIANTS)),
                        default=list(tp.VARIANTS), help="comma-separated subset of: "
                        + ", ".join(tp.VARIANTS))
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    n = config.world_size
    if args.d_ff % n:
        parser.error(f"--d-ff {args.d_ff} is not divisible by the tensor-parallel size "
                     f"(world size) {n}")
    if "allgather" in args.variants and args.d_model % n:
        parser.error(f"--d-model {args.d_model} is not divisible by the world size {n} (the "
                     "all-gather variant splits fc2's outputs)")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    if args.heads % n:
        parser.error(f"--heads {args.heads} is not divisible by the world size {n} (each rank "
                     "holds whole heads)")
    if args.seq % n:
        parser.error(f"--seq {args.seq} is not divisible by the world size {n} (sequence "
                     "parallelism gives each rank seq / t tokens)")
    need = per_rank_bytes(args)
    check_fits(config, need, f"{need / 2**30:.1f} GiB each for --d-model {args.d_model} "
               f"--d-ff {args.d_ff} --batch {args.batch} --seq {args.seq}")
    results.check_writable()
    launch.launch(tensor_parallel_main, config, vars(args))


if __name__ == "__main__":
    main()
