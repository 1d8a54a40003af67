"""Stage 07, lesson 11: Muon (muon.py) against torch.optim.Muon and its designs against one process.

One launch per world size (2 and 4) runs, on every rank: each design (``DESIGNS`` and
``FSDPMuon``) on four matrices (wide, tall, square, wide; rows not a multiple of N), float64,
5 steps, beside Muon on one process (within 1e-10); three negative controls, each off by one
mistake, which must fail that check; the bytes each design's step sends (CommCounter, summed
over the ranks) against the lesson's formula; the Newton-Schulz FLOPs each rank runs (counted
at the call) against the owners' dealing; and (2 ranks) the tiny LM trained with Muon + AdamW
by each design beside one process. In-process: the control beside torch.optim.Muon and the dealing's
balance on the course LM.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import counters
import muon
import run_muon
from common import models
from bench import supervisor as launch
from helpers import REPO, run_script

TOLERANCE = run_muon.TOLERANCE
_FINDINGS = {}

# --------------------------------------------------------------------------- negative controls


class OwnerOrthogonalizesItsShard(muon.Sharded):
    """Each rank orthogonalizes its own rows of the update, not the whole matrix."""

    def orthogonalized_rows(self, params, updates):
        return [muon.newton_schulz(update) for update in updates]


class MomentumNotReduced(muon.Replicated):
    """Each rank orthogonalizes the momentum of its own gradient; the results are averaged."""

    @torch.no_grad()
    def step(self):
        muon.Muon.step(self)
        for param, _ in self.matrices():
            dist.all_reduce(param, group=self.group)
            param /= dist.get_world_size(self.group)


class RowsToTheWrongRank(muon.FSDPMuon):
    """The all-to-all back sends rank s the rows of rank s - 1."""

    def from_owners(self, params, orthogonal):
        rolled = {param: matrix.roll(self.rows(param), 0) for param, matrix in orthogonal.items()}
        return super().from_owners(params, rolled)


class GradientsSummedNotAveraged(muon.Replicated):
    """The all-reduced gradients left as the sum: the weights come out as one process's (the
    iteration scales its input to norm 1), the momentum N times one process's."""

    @torch.no_grad()
    def step(self):
        for param, _ in self.matrices():
            dist.all_reduce(param.grad, group=self.group)
        muon.Muon.step(self)


class RanksRoundApart(muon.Replicated):
    """Each rank's weights nudged by rank x 1e-15 a step: within the tolerance of one process,
    but no longer bitwise the same on every rank."""

    @torch.no_grad()
    def step(self):
        super().step()
        for param, _ in self.matrices():
            param.add_(dist.get_rank(self.group) * 1e-15)


CONTROLS = {
    "owner orthogonalizes its shard": (OwnerOrthogonalizesItsShard, False),
    "momentum not reduced before the iteration": (MomentumNotReduced, False),
    "all-to-all returns rows to the wrong rank": (RowsToTheWrongRank, True),
    "gradients summed, not averaged": (GradientsSummedNotAveraged, False),
}

# --------------------------------------------------------------------------- the launch


def counted_step(ctx, name, make) -> tuple[float, int]:
    """One step of design ``name`` after 2, its bytes (CommCounter) and Newton-Schulz FLOPs
    (counted at each call) on this rank."""
    flops = []
    original = muon.newton_schulz

    def counted(G, steps=5, eps=1e-7):
        flops.append(muon.ns_flops(G.shape, steps))
        return original(G, steps, eps)

    model = run_muon.matrices_model(ctx.device)
    if name == "fsdp":
        model = run_muon.fsdp_class()(model, reduce_dtype=torch.float64)
        optimizer = make(list(model.parameters()), model)
    else:
        optimizer = make(list(model.parameters()))
    mine = slice(4 * ctx.rank, 4 * ctx.rank + 4)
    for step in range(3):
        x, y = run_muon.batch(step, ctx.world_size, ctx.device)
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        if name == "fsdp":
            model.finish_gradient_synchronization()
        if step < 2:
            optimizer.step()
            continue
        muon.newton_schulz = counted
        try:
            with counters.CommCounter() as comm:
                optimizer.step()
        finally:
            muon.newton_schulz = original
    return comm.sent_bytes, sum(flops)


def subgroup_diffs(ctx) -> dict:
    """Each of ``DESIGNS`` on ranks 1 .. N-1 only (``group=``), 3 steps beside one process:
    the designs name ranks by their place in the group."""
    members = list(range(1, ctx.world_size))
    group = dist.new_group(members)  # (every rank calls it)
    if ctx.rank not in members:
        return {}
    me = members.index(ctx.rank)
    diffs = {}
    for name, design in muon.DESIGNS.items():
        reference = run_muon.matrices_model(ctx.device)
        model = run_muon.matrices_model(ctx.device)
        one_process = muon.Muon(reference.parameters(), lr=run_muon.LR)
        optimizer = design(list(model.parameters()), lr=run_muon.LR, group=group)
        for step in range(3):
            x, y = run_muon.batch(step, len(members), ctx.device)
            torch.nn.functional.mse_loss(reference(x), y).backward()
            one_process.step()
            one_process.zero_grad()
            mine = slice(4 * me, 4 * me + 4)
            torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            optimizer.step()
            optimizer.zero_grad()
        diffs[name] = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
        for param, ref in zip(model.parameters(), reference.parameters()):   # and the momentum: a
            if param in optimizer.state:       # design that divides by the world's size, not the group's, passes the weights
                buf = optimizer.state[param]["momentum_buffer"]
                want = one_process.state[ref]["momentum_buffer"]
                if isinstance(optimizer, muon.Sharded):   # its rows, by its place in the group
                    want = optimizer.padded(param, want)[me * len(buf):(me + 1) * len(buf)]
                diffs[name] = max(diffs[name], (buf - want).abs().max().item())
    return diffs


def ranks_differ(weights: torch.Tensor) -> int:
    """How many ranks' flat weights are not bitwise this rank's."""
    everyone = [torch.empty_like(weights) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, weights)
    return sum(not torch.equal(theirs, weights) for theirs in everyone)


def worker(ctx, out_path):
    findings = {}
    shapes = [tuple(m.weight.shape) for m in run_muon.matrices_model("cpu") if hasattr(m, "weight")]
    dealt = run_muon.flops_per_rank(shapes, ctx.world_size)
    for name, make in run_muon.design_makers().items():
        trained = run_muon.train_matrices(ctx, make, fsdp=name == "fsdp")
        findings[f"{name} equals one process"] = max(trained["diff"], trained["momentum_diff"])
        findings[f"{name} ranks differ"] = ranks_differ(trained["weights"])
        sent, flops = counted_step(ctx, name, make)
        findings[f"{name} bytes"] = sent
        findings[f"{name} flops"] = [flops, dealt[name][ctx.rank]]
    for name, (design, fsdp) in CONTROLS.items():
        if fsdp:
            def make(params, wrapped, design=design):
                return design(params, wrapped, lr=run_muon.LR, weight_decay=0.1)
        else:
            def make(params, design=design):
                return design(params, lr=run_muon.LR, weight_decay=0.1)
        trained = run_muon.train_matrices(ctx, make, fsdp=fsdp)
        findings[name] = max(trained["diff"], trained["momentum_diff"])
        findings[f"{name}, weights alone"] = trained["diff"]
    rounded = run_muon.train_matrices(ctx, lambda params: RanksRoundApart(params, lr=run_muon.LR, weight_decay=0.1))
    findings["ranks round apart"] = [rounded["diff"], ranks_differ(rounded["weights"])]
    findings["subgroup"] = subgroup_diffs(ctx) if ctx.world_size == 4 else {}
    newer = {name: getattr(dist, name) for name in ("reduce_scatter_single", "all_gather_single")}
    for name in newer:                   # torch before these names (a GPU box's 2.11, say)
        delattr(dist, name)
    try:
        older = run_muon.train_matrices(ctx, run_muon.design_makers()["sharded"])
    finally:
        for name, function in newer.items():
            setattr(dist, name, function)
    findings["sharded on an older torch"] = max(older["diff"], older["momentum_diff"])
    if ctx.world_size == 2:
        for name in run_muon.design_makers():
            findings[f"{name} LM"] = run_muon.train_lm(ctx, name, steps=2)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, findings)
    if ctx.is_main:
        Path(out_path).write_text(json.dumps({"shapes": shapes, "ranks": everyone}))


def found(world_size: int, tmp_path) -> dict:
    if world_size not in _FINDINGS:
        out = tmp_path / f"muon{world_size}.json"
        _FINDINGS[world_size] = None
        launch.launch(worker, launch.LaunchConfig(world_size, "gloo", "cpu"), str(out), timeout_s=240)
        _FINDINGS[world_size] = json.loads(out.read_text())
    if _FINDINGS[world_size] is None:
        pytest.fail(f"the launch at world size {world_size} failed: see its output")
    return _FINDINGS[world_size]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("design", ["replicated", "owner", "sharded", "fsdp"])
def test_design_equals_one_process(world_size, design, tmp_path):
    """The weights and each rank's momentum (its rows, where sharded) within the tolerance of one
    process, and the weights bitwise the same on every rank."""
    for rank, findings in enumerate(found(world_size, tmp_path)["ranks"]):
        diff = findings[f"{design} equals one process"]
        assert diff <= TOLERANCE, f"{design}, {world_size} ranks, rank {rank}: off by {diff:.2e}"
        assert findings[f"{design} ranks differ"] == 0, f"{design}, rank {rank}: ranks not bitwise equal"


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("control", list(CONTROLS))
def test_negative_control_fails(world_size, control, tmp_path):
    diffs = [findings[control] for findings in found(world_size, tmp_path)["ranks"]]
    assert max(diffs) > 1e3 * TOLERANCE, f"the control '{control}' passed the check: off by {max(diffs):.2e}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_runs_on_a_torch_without_the_single_names(world_size, tmp_path):
    """``dist.reduce_scatter_single`` and ``all_gather_single`` are torch 2.13's; without them
    (older torch) the designs take ``reduce_scatter_tensor`` and ``all_gather_into_tensor``."""
    for findings in found(world_size, tmp_path)["ranks"]:
        assert findings["sharded on an older torch"] <= TOLERANCE


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_momentum_and_bitwise_checks_catch_what_the_weights_miss(world_size, tmp_path):
    """Gradients summed, not averaged: the weights pass, the momentum does not. Ranks a rounding
    apart: within the tolerance, not bitwise."""
    ranks = found(world_size, tmp_path)["ranks"]
    summed = [f["gradients summed, not averaged, weights alone"] for f in ranks]
    rounded = [f["ranks round apart"] for f in ranks]
    assert max(summed) <= TOLERANCE, summed
    assert all(diff <= TOLERANCE and differ > 0 for diff, differ in rounded), rounded


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("design", ["replicated", "owner", "sharded", "fsdp"])
def test_bytes_and_flops_equal_their_formulas(world_size, design, tmp_path):
    result = found(world_size, tmp_path)
    shapes = result["shapes"]
    sent = sum(findings[f"{design} bytes"] for findings in result["ranks"])
    want = run_muon.step_bytes(design, shapes, world_size)
    assert math.isclose(sent, want, rel_tol=1e-12), f"{design}: {sent} bytes sent, the formula {want}"
    counted = [findings[f"{design} flops"][0] for findings in result["ranks"]]
    dealt = [findings[f"{design} flops"][1] for findings in result["ranks"]]
    assert counted == dealt
    total = sum(muon.ns_flops(shape) for shape in shapes)
    assert sum(counted) == (world_size * total if design == "replicated" else total)


def test_designs_on_a_subgroup(tmp_path):
    """At 4 ranks, each design on the group of ranks 1, 2, 3 equals one process."""
    ranks = found(4, tmp_path)["ranks"]
    assert ranks[0]["subgroup"] == {}
    for rank in (1, 2, 3):
        for design, diff in ranks[rank]["subgroup"].items():
            assert diff <= TOLERANCE, f"{design} on a subgroup, rank {rank}: off by {diff:.2e}"
        assert sorted(ranks[rank]["subgroup"]) == sorted(muon.DESIGNS)


@pytest.mark.parametrize("design", ["replicated", "owner", "sharded", "fsdp"])
def test_lm_equals_one_process(design, tmp_path):
    """The tiny LM, float64, Muon on the blocks' matrices and AdamW on the rest, 2 ranks."""
    for rank, findings in enumerate(found(2, tmp_path)["ranks"]):
        diffs = findings[f"{design} LM"]
        assert max(diffs.values()) <= TOLERANCE, f"{design}, rank {rank}: {diffs}"

# --------------------------------------------------------------------------- one process


def test_control_beside_torch_muon():
    lines, problems = run_muon.control("cpu")
    assert not problems, problems
    assert "bfloat16 " in lines[0] and lines[0].endswith("0.00e+00")  # bitwise


def test_newton_schulz_orthogonalizes_in_its_dtype():
    torch.manual_seed(0)
    for shape in ((16, 16), (32, 8), (8, 32)):
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            G = torch.randn(shape, dtype=dtype)
            before = G.clone()
            X = muon.newton_schulz(G)
            assert X.dtype == dtype and X.shape == G.shape and torch.equal(G, before)
            singular = torch.linalg.svdvals(X.double())
            assert 0.4 < singular.min() and singular.max() < 1.3, (shape, dtype, singular)


def test_dealing_balances_the_course_lm():
    """Each matrix dealt once; per-rank Newton-Schulz FLOPs <= 1.2 x the ideal 1/N."""
    with torch.device("meta"):
        lm = models.TransformerLM("course")
    shapes = [p.shape for name, p in lm.named_parameters() if p.ndim == 2 and name.startswith("blocks.")]
    total = sum(muon.ns_flops(shape) for shape in shapes)
    for world_size in (2, 4, 8):
        per_rank = run_muon.flops_per_rank(shapes, world_size)
        assert sum(per_rank["owner"]) == total
        assert max(per_rank["owner"]) <= 1.2 * total / world_size, (world_size, per_rank["owner"])
        assert per_rank["replicated"] == [total] * world_size


def test_bench_stops_before_make_benchs_deadline(tmp_path):
    """bench_muon.py: once the launch before took longer than is left before
    BENCH_STEP_DEADLINE, the rest is skipped in one line, exit 0, its rows kept (the control,
    no deadline and every launch runs, is test_bench's test of step_bench.until_deadline)."""
    deadline_s = 1.0
    deadline = f"{time.time() + deadline_s:.3f}"
    out = run_script(REPO / "07_parallelism" / "measure" / "bench_muon.py", "--world-sizes",
                     "2,3", "--steps", 1, timeout=180,
                     env={"BENCH_STEP_DEADLINE": deadline, "RESULTS_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 ranks, tiny LM" in out.stdout, out.stdout
    assert ("3 ranks, tiny LM" in out.stdout) != bool(deadline_s), out.stdout
    assert ("skipped: past make bench's deadline" in out.stdout) == bool(deadline_s), out.stdout
    assert "fsdp" in (tmp_path / "muon.csv").read_text()


def test_muon_refuses_what_would_run_silently_wrong():
    matrix = torch.nn.Parameter(torch.zeros(3, 3))
    for bad in (dict(lr=-1), dict(lr=float("nan")), dict(lr=0.1, momentum=1), dict(lr=0.1, momentum=-0.1),
                dict(lr=0.1, weight_decay=-1), dict(lr=0.1, ns_steps=0), dict(lr=0.1, ns_steps=2.5)):
        with pytest.raises(ValueError, match="want lr >= 0"):
            muon.Muon([matrix], **bad)
    for bad in (dict(lr=float("inf")), dict(lr=0.1, weight_decay=float("inf")), dict(lr=0.1, ns_steps=True)):
        with pytest.raises(ValueError, match="want lr >= 0"):
            muon.Muon([matrix], **bad)
    optimizer = muon.Muon([matrix], lr=0.1, momentum=0, weight_decay=0)   # the edges are fine
    with pytest.raises(ValueError, match="2-D parameters only"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    with pytest.raises(ValueError, match="want lr >= 0"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, 2))], "lr": -1})
    assert len(optimizer.param_groups) == 1     # a refused group is not left behind to step
    with pytest.raises(ValueError, match="2-D parameters only"):
        muon.Muon([torch.nn.Parameter(torch.zeros(2, 2, 2))], lr=0.1)
