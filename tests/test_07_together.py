"""Stage 07, everything together: the grid of ranks, the text, and training over the grid.

The grid's groups are checked against torch's ``init_device_mesh`` without spawning: torch's
fake process group lets one process play any rank of any world size, so every rank of every
shape is checked in a few fresh interpreters (one per shape).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
import sys
import textwrap

import pytest

import grid as grid_mod
from helpers import REPO

SHAPES = [(2, 1, 1, 2), (1, 2, 1, 2), (2, 2, 1, 1), (1, 1, 2, 2), (1, 2, 2, 1), (2, 2, 1, 2),
          (2, 1, 2, 2)]  # (dp, pp, cp, tp), up to 8 ranks

MESH_CHECK = r'''
import sys
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
sys.path.insert(0, GRID_FOLDER)
import grid


def differences(dp, pp, cp, tp, mesh_order):
    """Every (rank, axis) where our groups differ from init_device_mesh's laid out in
    ``mesh_order`` (the right one is ("pp", "dp", "cp", "tp"))."""
    sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
    world_size = dp * pp * cp * tp
    problems = []
    for rank in range(world_size):
        dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
        shape = tuple(sizes[axis] for axis in mesh_order)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=mesh_order)
        ours = grid.ProcessGrid(dp=dp, pp=pp, cp=cp, tp=tp)
        theirs = {}
        for axis in grid.AXES:
            theirs[axis] = dist.get_process_group_ranks(mesh.get_group(axis))
        data_and_context = tuple(axis for axis in mesh_order if axis in ("dp", "cp"))
        flat = mesh[data_and_context]._flatten("dp_cp")
        theirs["dp_cp"] = dist.get_process_group_ranks(flat.get_group())
        for axis, want in theirs.items():
            got = dist.get_process_group_ranks(ours.group(axis))
            if got != want or ours.ranks(axis) != want or ours.rank(axis) != want.index(rank):
                problems.append(f"rank {rank} axis {axis}: ours {got}, the mesh's {want}")
        dist.destroy_process_group()
    return problems


for shape in SHAPES:
    problems = differences(*shape, mesh_order=("pp", "dp", "cp", "tp"))
    print(f"{shape}: " + ("; ".join(problems) if problems else "groups equal"))
# negative control: a mesh with data and context swapped must differ from our grid
problems = differences(2, 1, 2, 2, mesh_order=("pp", "cp", "dp", "tp"))
print("control: " + ("differs" if problems else "NO DIFFERENCE"))
'''


def test_grid_groups_equal_init_device_mesh():
    """Every rank of every shape, in one interpreter (torch's fake process group)."""
    code = (f"SHAPES = {SHAPES!r}\n"
            f"GRID_FOLDER = {str(REPO / '07_parallelism' / '07_together')!r}\n")
    result = subprocess.run([sys.executable, "-c", code + textwrap.dedent(MESH_CHECK)],
                            capture_output=True, text=True, timeout=120)
    lines = result.stdout.strip().splitlines()
    want = [f"{shape}: groups equal" for shape in SHAPES] + ["control: differs"]
    assert result.returncode == 0 and lines == want, result.stdout[-3000:] + result.stderr[-3000:]


def test_grid_coordinates_without_processes():
    sizes = {"pp": 2, "dp": 2, "cp": 1, "tp": 2}
    for rank in range(8):
        assert grid_mod.grid_rank(grid_mod.grid_coordinate(rank, sizes), sizes) == rank
    assert grid_mod.grid_coordinate(5, sizes) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}
    assert grid_mod.groups_along(("tp",), sizes) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid_mod.groups_along(("pp",), sizes) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid_mod.groups_along(("dp", "cp"), sizes) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    drawn = grid_mod.draw_grid(dp=2, pp=2, cp=1, tp=2).splitlines()
    assert drawn[1] == "pp 0  dp 1 | cp 0: 2 3" and drawn[3] == "pp 1  dp 1 | cp 0: 6 7"


# --------------------------------------------------------------------------- training over grids

import argparse  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402

import train  # noqa: E402
from common import launch  # noqa: E402
from helpers import assert_main_usage_error  # noqa: E402

TEXT = (REPO / "README.md").read_text() * 3  # a small real text: the tests read no stdlib


def small_args(data: str, **grid) -> argparse.Namespace:
    """train.py's flags for a fast check: the tiny LM, 8 sequences of 32 bytes."""
    args = dict(dp=1, pp=1, cp=1, tp=1, fsdp=False, schedule="1f1b", chunks=1, micro_batches=1,
                model="tiny", batch_size=8, seq_len=32, lr=3e-3, seed=0, data=data,
                max_bytes=None)
    args.update(grid)
    return argparse.Namespace(**args)


def replicated_parameters(chunks) -> list:
    params = []
    for chunk in chunks:
        for block in chunk.blocks:
            params.extend(block.replicated_parameters())
        for module in (chunk.embedding, chunk.head):
            if module is not None:
                params.extend(module.parameters())
    return [p for p in params if p.grad is not None]


def sum_over_dp_only(chunks, grid):
    """Planted bug (torchtitan #3280's kind): gradients summed over the data ranks, not over
    data and context: each context rank steps with its part of the sequence alone."""
    parallel_lm = train.lessons()[1]
    everything = [p for chunk in chunks for p in chunk.parameters() if p.grad is not None]
    parallel_lm.all_reduce_sum(replicated_parameters(chunks), grid.group("tp"))
    parallel_lm.all_reduce_sum(everything, grid.group("dp"))


def no_sum_over_tp(chunks, grid):
    """Planted bug: the tp-replicated parameters (LayerNorms, biases, embeddings, head) keep
    the gradient of this rank's tokens only (sequence parallelism split them)."""
    parallel_lm = train.lessons()[1]
    everything = [p for chunk in chunks for p in chunk.parameters() if p.grad is not None]
    parallel_lm.all_reduce_sum(everything, grid.group("dp_cp"))


def twice_over_tp(chunks, grid):
    """Planted bug: the tp-replicated gradients summed over tp twice (2x too big: AdamW would
    hide it in the weights, the gradient check must not)."""
    parallel_lm = train.lessons()[1]
    parallel_lm.all_reduce_sum(replicated_parameters(chunks), grid.group("tp"))
    parallel_lm.sum_gradients(chunks, grid)


def unscaled_loss(logits, targets):
    """Planted bug: each rank's mean loss not divided by R, the ranks holding different tokens."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


# (label, grid, planted bug or None): four ranks; every correct grid must equal one process,
# every planted bug must be caught
FOUR_RANK_CASES = [
    ("dp2 tp2", dict(dp=2, tp=2), None),
    ("pp2 tp2, 1f1b, 2 micro-batches", dict(pp=2, tp=2, micro_batches=2), None),
    ("dp2 pp2, gpipe, 4 micro-batches", dict(dp=2, pp=2, schedule="gpipe", micro_batches=4), None),
    ("cp2 tp2", dict(cp=2, tp=2), None),
    ("dp2 cp2, ZeRO-1 (--fsdp)", dict(dp=2, cp=2, fsdp=True), None),
    ("pp2 tp2, zbh1, 4 micro-batches", dict(pp=2, tp=2, schedule="zbh1", micro_batches=4), None),
    ("dp2 cp2, summed over dp only", dict(dp=2, cp=2), "dp only"),
    ("dp2 tp2, no sum over tp", dict(dp=2, tp=2), "no tp sum"),
    ("dp2 tp2, summed over tp twice", dict(dp=2, tp=2), "twice over tp"),
    ("dp2 cp2, loss not divided by R", dict(dp=2, cp=2), "unscaled"),
]
PLANTED = {"dp only": (None, sum_over_dp_only), "no tp sum": (None, no_sum_over_tp),
           "twice over tp": (None, twice_over_tp), "unscaled": (unscaled_loss, None)}


def grid_worker(ctx, data: str, out: str) -> None:
    findings = {}
    for label, grid, planted in FOUR_RANK_CASES:
        loss_fn = None
        sum_grads = None
        if planted is not None:
            loss_fn, sum_grads = PLANTED[planted]
        problems, worst = train.check_against_one_process(ctx, small_args(data, **grid), 2,
                                                          loss_fn, sum_grads)
        findings[label] = {"problems": problems, "worst": worst}
    if ctx.is_main:
        Path(out).write_text(json.dumps(findings))


def test_grids_of_four_ranks_equal_one_process_and_planted_bugs_are_caught(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    out = tmp_path / "findings.json"
    launch.launch(grid_worker, launch.LaunchConfig(4, "gloo", "cpu"), str(data), str(out),
                  timeout_s=240)
    findings = json.loads(out.read_text())
    for label, grid, planted in FOUR_RANK_CASES:
        found = findings[label]
        if planted is None:
            assert found["problems"] == [], (label, found["problems"][:5])
            assert found["worst"] < 1e-4, (label, found["worst"])
        else:
            assert found["problems"], f"{label}: the planted bug was not caught"
    unscaled = findings["dp2 cp2, loss not divided by R"]["problems"]
    assert any("reports loss" in problem for problem in unscaled), unscaled[:3]
    dp_only = findings["dp2 cp2, summed over dp only"]["problems"]
    assert any("gradient differs" in problem for problem in dp_only), dp_only[:3]
    twice = findings["dp2 tp2, summed over tp twice"]["problems"]
    assert any("norm1.weight gradient differs" in problem for problem in twice), twice[:3]


def test_eight_ranks_on_two_torchrun_nodes_train_equal_to_one_process(tmp_path):
    """The script itself, unchanged under torchrun, on two "nodes" of four processes meeting
    at a c10d rendezvous: (dp, pp, cp, tp) = (2, 2, 1, 2), tensor parallel inside a node,
    pipeline across the two. --check compares 2 steps with one process; then 2 steps of
    training write the curve and the full model, which loads into one process's LM."""
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    saved = tmp_path / "full.pt"
    port = launch.free_port()
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=4",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=test07",
            str(REPO / "07_parallelism" / "07_together" / "train.py"), "--backend", "gloo",
            "--device", "cpu", "--dp", "2", "--pp", "2", "--tp", "2", "--micro-batches", "2",
            "--batch-size", "8", "--seq-len", "32", "--steps", "2", "--log-every", "1",
            "--eval-batches", "1", "--check", "--check-steps", "2", "--data", str(data),
            "--save-full", str(saved)]
    procs = [subprocess.Popen(node, cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    text = "\n".join(outs)
    assert "check: 2 steps on the grid equal 2 steps of one process" in text, text[-3000:]
    assert "step     2  loss" in text and "sample" in text, text[-3000:]
    from common import models
    lm = models.TransformerLM("tiny", vocab_size=256, context_length=32)
    lm.load_state_dict(torch.load(saved))  # the single-process LM's names and shapes


@pytest.mark.parametrize("argv, needle", [
    (["--world-size", "4", "--dp", "3", "--tp", "2"], "= 6, but the world size is 4"),
    (["--world-size", "3", "--dp", "1", "--tp", "3", "--seq-len", "36"], "must divide the tiny"),
    (["--world-size", "2", "--dp", "1", "--tp", "2", "--seq-len", "30"], "divide by 2 x cp x tp"),
    (["--world-size", "4", "--dp", "1", "--pp", "4"], "layers do not split"),
    (["--world-size", "2", "--dp", "1", "--pp", "2", "--schedule", "interleaved",
      "--micro-batches", "3", "--batch-size", "6", "--chunks", "1"], "multiple of --pp"),
    (["--world-size", "2", "--dp", "2", "--batch-size", "8", "--micro-batches", "3"],
     "must divide each data-parallel"),
    (["--world-size", "2", "--dp", "1", "--cp", "2", "--fsdp", "--data", "/no/such/file"],
     "no such file"),
    (["--bench", "--world-size", "3"], "--bench runs its grids on 4 or 8 ranks, not 3"),
])
def test_bad_grids_are_refused_before_any_worker_starts(argv, needle, capsys, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a bad grid reached the launch")
    monkeypatch.setattr(launch, "launch", no_launch)
    assert_main_usage_error(train.main, argv, capsys, needle)


# --------------------------------------------------------------------------- the measurements

import grid_bench  # noqa: E402
from common import results  # noqa: E402

# train.py --bench at test sizes: three grids that use every axis and ZeRO-1, torch's
# composition beside ours, one pipeline schedule against torch's, real and emulated
BENCH_SIZES = {"model": "tiny", "batch_size": 8, "seq_len": 32, "warmup": 0, "iters": 1,
               "rounds": 1, "lr": 3e-3,
               "pipeline": {"stages": [2], "schedules": ["1f1b"], "compute": ["real", "emulated"],
                            "layers": 2, "rows": 1, "seq_len": 16, "micro_batches": 2,
                            "emulate_ms": 1.0}}
BENCH_GRIDS = [grid_bench.grid_spec(dp=2, tp=2, fsdp=True),
               grid_bench.grid_spec(pp=2, cp=2, micro_batches=2),
               grid_bench.grid_spec(cp=2, tp=2)]
BENCH_COLUMNS = ["impl", "grid", "setting", "model", "batch_size", "seq_len", "micro_batches",
                 "world_size", "backend", "device", "step_ms", "tokens_per_s", "machine", "run_id"]
for _kind in [*grid_bench.KINDS, *(f"sent_{_axis}" for _axis in grid_bench.AXES)]:
    BENCH_COLUMNS += [f"{_kind}_bytes", f"{_kind}_bytes_formula"]


def forgets_tp_split(shape, spec, pp_rank, world_size):
    """Planted bug: a formula whose parameters forget that tensor parallelism splits them."""
    right = grid_bench.combined_formula(shape, spec, pp_rank, world_size)
    wrong = grid_bench.combined_formula(shape, {**spec, "tp": 1}, pp_rank, world_size)
    return {**right, "param": wrong["param"]}


def test_bench_counts_equal_the_combined_formula(tmp_path):
    """One 4-rank launch of the bench at tiny sizes: every rank's counted bytes equal the
    formula (ZeRO-1's optimizer state: lesson 1's whole-tensor deal; the group holds exactly the
    whole state, each rank within one tensor of the mean), torch's composition's bytes equal torch's formula, every first
    loss equals one process's, torch's pipeline computes our gradients; the CSV has its
    columns; a formula that forgets the tp split is caught."""
    out = tmp_path / "bench.json"
    launch.launch(grid_bench.bench_worker, launch.LaunchConfig(4, "gloo", "cpu"), BENCH_SIZES,
                  BENCH_GRIDS, str(out), timeout_s=120)
    found = json.loads(out.read_text())
    shape = grid_bench.lm_shape(BENCH_SIZES)
    exact = [*grid_bench.KINDS, *(f"sent_{axis}" for axis in grid_bench.AXES)]
    caught = []
    for detail in found["details"]:
        spec = detail["spec"]
        for rank in detail["per_rank"]:
            for kind in exact:  # ZeRO-1's optimizer state too: lesson 1's deal, worked out
                assert rank["counted"][kind] == rank["formula"][kind], (detail["grid"], rank)
            planted = forgets_tp_split(shape, spec, rank["coordinate"]["pp"], 4)
            difference, kind = grid_bench.worst_difference(rank["counted"], planted)
            caught.append((spec["tp"] > 1, kind == "param" and difference > 0.05))
        if spec["fsdp"]:                     # dp2 tp2: each tp rank's dp pair shares one state
            for tp_rank in (0, 1):
                pair = [r for r in detail["per_rank"] if r["coordinate"]["tp"] == tp_rank]
                whole = grid_bench.combined_formula(shape, {**spec, "fsdp": False}, 0, 4)
                assert sum(r["counted"]["optim"] for r in pair) == whole["optim"], pair
                mean = whole["optim"] / 2
                bound = grid_bench.zero1_deal_bound(shape, spec, 0)
                for r in pair:
                    assert r["counted"]["optim"] <= mean * (1 + bound), r
    assert caught == [(True, True)] * 4 + [(False, False)] * 4 + [(True, True)] * 4, caught
    ours, theirs = found["torch_rows"]
    assert (ours["impl"], theirs["impl"], theirs["grid"]) == ("ours", "torch", "dp2 tp2")
    torch_formula = grid_bench.torch_formula(shape, 2, 2)
    for kind in ("param", "grad", "optim"):
        assert theirs[f"{kind}_bytes"] == torch_formula[kind], (kind, theirs)
    losses = [row["first_loss"] for row in found["grid_rows"] + found["torch_rows"]]
    assert max(abs(loss - found["reference_loss"]) for loss in losses) < 1e-5, losses
    pipelines = found["pipeline_rows"]
    assert [(r["impl"], r["compute"]) for r in pipelines] == [
        ("ours", "real"), ("torch", "real"), ("ours", "emulated"), ("torch", "emulated")]
    assert pipelines[0]["gradient_max_difference"] < 1e-6, pipelines[0]
    rows = results.read_csv("grid.csv")
    assert len(rows) == 3 + 2 + 4 and all(column in rows[0] for column in BENCH_COLUMNS), rows[0]
    assert rows[0]["machine"] == results.machine_name()
