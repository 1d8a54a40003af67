"""Stage 01: the script at an odd world size, both rings against dist.all_reduce on awkward
sizes, dtypes, a sub-group and many segments (one launch), torchrun across two "nodes", and
bad flags. The copied-alone check is in test_copy_one_file.py, faults in test_faults.py."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import collectives
from common import verify
from bench import supervisor as launch
from helpers import REPO, assert_main_usage_error

SCRIPT = REPO / "01_collectives" / "collectives.py"


def test_every_collective_at_world_size_3():
    """Odd world size: catches off-by-one chunking. The script's own setup (spawn) runs it."""
    result = subprocess.run([sys.executable, str(SCRIPT), "--world-size", "3", "--backend", "gloo",
                             "--device", "cpu"], cwd=REPO, capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "all collective checks passed on 3 rank(s)" in out
    # every rank's before -> after on one line: all_reduce(SUM) of 1, 2, 3 gives 6 everywhere
    assert any(line.startswith("all_reduce(SUM)") and "1 2 3" in line and "6 6 6" in line
               for line in out.splitlines()), out


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def ring_missing_last_step(tensor, group=None):
    """A plausible bug: the all-gather phase one step short, so each rank keeps one chunk
    that is only partly summed."""
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    flat = tensor.view(-1)
    chunks = torch.tensor_split(flat, n)
    incoming = torch.empty_like(chunks[0])
    right = (rank + 1) % n
    left = (rank - 1) % n
    for step in range(n - 1):
        send, recv = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
        collectives._exchange(send, incoming[: recv.numel()], right, left, group)
        recv += incoming[: recv.numel()]
    for step in range(n - 2):  # n - 1 steps are needed
        send, recv = chunks[(rank + 1 - step) % n], chunks[(rank - step) % n]
        collectives._exchange(send, recv, right, left, group)
    return tensor


def agree(problem: str | None) -> None:
    """One verdict for a check each rank made: every rank raises together, or none."""
    problems = verify.agree_on_problems([problem] if problem else [])
    if problems:
        raise AssertionError("; ".join(problems))


def rings_match_all_reduce(ctx):
    """Every check is agreed: every rank raises together, or none."""
    for ring in (collectives.ring_all_reduce, collectives.pipelined_ring_all_reduce):
        for numel in (1, 2, 7, 1000, 100_003):  # fewer elements than ranks, and not divisible
            for dtype in (torch.float32, torch.float64, torch.int64):
                g = torch.Generator().manual_seed(1000 * numel + ctx.rank)  # fresh data per rank
                x = (torch.randn(numel, generator=g, dtype=dtype) if dtype.is_floating_point
                     else torch.randint(-2**40, 2**40, (numel,), generator=g, dtype=dtype))
                ours = x.clone()
                reference = x.clone()
                returned = ring(ours)
                dist.all_reduce(reference)
                where = f"{ring.__name__} {numel} {dtype}"
                if returned is not ours:  # in place, like dist.all_reduce
                    problem = f"{where}: did not return its input"
                elif dtype.is_floating_point:  # summed in another order: equal up to rounding
                    ok = torch.allclose(ours, reference, rtol=1e-5, atol=1e-5 * ctx.world_size)
                    problem = None if ok else f"{where}: off by {max_diff(ours, reference):.3g}"
                else:
                    ok = torch.equal(ours, reference)
                    problem = None if ok else f"{where}: off by {max_diff(ours, reference):g}"
                agree(problem)
                everyone = [torch.empty_like(ours) for _ in range(ctx.world_size)]
                dist.all_gather(everyone, ours)
                differ = [r for r, e in enumerate(everyone) if not torch.equal(e, ours)]
                agree(f"{where}: ranks {differ} differ bitwise" if differ else None)
        # a non-contiguous tensor is reduced in place too
        base = torch.arange(24, dtype=torch.float64).reshape(4, 6) * (ctx.rank + 1)
        ring(base.t())
        want = torch.arange(24, dtype=torch.float64).reshape(4, 6) * (ctx.world_size * (ctx.world_size + 1) / 2)
        agree(None if torch.equal(base, want) else
                     f"{ring.__name__} transposed: off by {max_diff(base, want):g}")
        # within a sub-group (global ranks 1..n-1): group ranks map to global ones
        members = list(range(1, ctx.world_size))
        group = dist.new_group(members)
        problem = None
        if ctx.rank in members:  # rank 0 is not in the group: nothing to check there
            t = torch.full((5,), float(ctx.rank))
            ring(t, group=group)
            if not torch.equal(t, torch.full((5,), float(sum(members)))):
                problem = f"{ring.__name__} in group {members}: got {t.tolist()}, want {sum(members)}"
        agree(problem)
    # the pipelined ring with many segments per chunk, the last one shorter
    for numel, segment_numel in ((1000, 7), (100_003, 4096)):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(ctx.rank), dtype=torch.float64)
        reference = x.clone()
        dist.all_reduce(reference)
        collectives.pipelined_ring_all_reduce(x, segment_numel=segment_numel)
        ok = torch.allclose(x, reference, rtol=1e-12, atol=1e-12)
        agree(None if ok else f"segments of {segment_numel}: off by {max_diff(x, reference):.3g}")
    # the softmax over ranks against torch.softmax
    logits = torch.randn(ctx.world_size, generator=torch.Generator().manual_seed(5),
                         dtype=torch.float64) * 30
    p = collectives.distributed_softmax(logits[ctx.rank:ctx.rank + 1])
    want = torch.softmax(logits, 0)[ctx.rank:ctx.rank + 1]
    ok = torch.allclose(p, want, rtol=1e-12, atol=1e-15)
    agree(None if ok else f"softmax: off by {max_diff(p, want):.3g}")
    # Negative control: the script's own check catches a ring one all-gather step short, on
    # every rank at once, naming the ring, how many elements differ and by how much.
    saved = collectives.ring_all_reduce
    collectives.ring_all_reduce = ring_missing_last_step
    try:
        with pytest.raises(AssertionError, match=r"rings against dist.all_reduce: rank 0: "
                                                 r"ring_missing_last_step on 7 torch.float64: "
                                                 r"\d+ of 7 elements differ from dist.all_reduce, "
                                                 r"max \|diff\| \d+"):
            collectives.collectives_demo(ctx.rank, ctx.world_size, ctx.backend)
    finally:
        collectives.ring_all_reduce = saved


def test_rings_equal_all_reduce_at_world_size_4():
    """4 ranks, and the sub-group makes a ring of 3 inside the same launch; then stage 01's
    demo with a broken ring planted must fail its own check on every rank."""
    launch.launch(rings_match_all_reduce, launch.LaunchConfig(4, "gloo", "cpu"), timeout_s=180)


def test_torchrun_two_nodes_on_loopback():
    """Two single-process "nodes" meeting at a c10d rendezvous: the multi-node path, with
    the torchrun branch of the script's setup."""
    port = launch.free_port()
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=test01",
            str(SCRIPT), "--backend", "gloo", "--device", "cpu"]
    procs = [subprocess.Popen(node, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outs)
    assert any("collective checks passed on 2 rank(s)" in o for o in outs)


@pytest.mark.parametrize("argv, needle", [
    (["--world-size", "0"], "'0' is not a whole number >= 1"),
    (["--backend", "mpi"], "invalid choice: 'mpi'"),
    (["--backend", "nccl"], "--backend nccl needs"),
    (["--world-size", "100000"], "100000 ranks need about"),
])
def test_bad_flags_exit_2_with_one_line(argv, needle, capsys):
    if argv == ["--backend", "nccl"] and torch.cuda.device_count() >= 4:
        pytest.skip("this box can run nccl")
    assert_main_usage_error(collectives.main, argv, capsys, needle)


@pytest.mark.parametrize("device, on_device", [("cpu", True), ("cuda", False)])
def test_gloo_sends_go_through_the_host_only_for_gpu_tensors(monkeypatch, device, on_device):
    """Issue 45: Gloo carries every collective of the demo on GPU tensors; only its sends and
    receives (and the textbook ring built on them) go through the host, by the one shared rule
    (common.launch.carries_point_to_point). Faked: a GPU, the launch recorded, nothing run."""
    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(collectives, "spawn", lambda *a: calls.append(a))
    collectives.main(["--world-size", "2", "--backend", "gloo", "--device", device])
    assert calls == [(collectives.collectives_demo, 2, "gloo", device, on_device)]
