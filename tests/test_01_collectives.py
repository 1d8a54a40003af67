"""Stage 01: the script at an odd world size, both rings against dist.all_reduce on awkward
sizes, dtypes, a sub-group and many segments (one launch), torchrun across two "nodes", and
bad flags. The copied-alone check is in test_copy_one_file.py, faults in test_faults.py."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import collectives
from common import launch
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


def rings_match_all_reduce(ctx):
    for ring in (collectives.ring_all_reduce, collectives.pipelined_ring_all_reduce):
        for numel in (1, 2, 7, 1000, 100_003):  # fewer elements than ranks, and not divisible
            for dtype in (torch.float32, torch.float64, torch.int64):
                g = torch.Generator().manual_seed(1000 * numel + ctx.rank)  # fresh data per rank
                x = (torch.randn(numel, generator=g, dtype=dtype) if dtype.is_floating_point
                     else torch.randint(-2**40, 2**40, (numel,), generator=g, dtype=dtype))
                ours, reference = x.clone(), x.clone()
                assert ring(ours) is ours  # in place, like dist.all_reduce
                dist.all_reduce(reference)
                if dtype.is_floating_point:  # summed in another order: equal up to rounding
                    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5 * ctx.world_size)
                else:
                    assert torch.equal(ours, reference), (ring.__name__, numel)
                everyone = [torch.empty_like(ours) for _ in range(ctx.world_size)]
                dist.all_gather(everyone, ours)
                assert all(torch.equal(e, ours) for e in everyone), "ranks differ bitwise"
        # a non-contiguous tensor is reduced in place too
        base = torch.arange(24, dtype=torch.float64).reshape(4, 6) * (ctx.rank + 1)
        ring(base.t())
        scale = ctx.world_size * (ctx.world_size + 1) / 2
        assert torch.equal(base, torch.arange(24, dtype=torch.float64).reshape(4, 6) * scale)
        # within a sub-group (global ranks 1..n-1): group ranks map to global ones
        members = list(range(1, ctx.world_size))
        group = dist.new_group(members)
        if ctx.rank in members:
            t = torch.full((5,), float(ctx.rank))
            ring(t, group=group)
            assert torch.equal(t, torch.full((5,), float(sum(members))))
    # the pipelined ring with many segments per chunk, the last one shorter
    for numel, segment_numel in ((1000, 7), (100_003, 4096)):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(ctx.rank), dtype=torch.float64)
        reference = x.clone()
        dist.all_reduce(reference)
        collectives.pipelined_ring_all_reduce(x, segment_numel=segment_numel)
        torch.testing.assert_close(x, reference, rtol=1e-12, atol=1e-12)
    # the softmax over ranks against torch.softmax
    logits = torch.randn(ctx.world_size, generator=torch.Generator().manual_seed(5),
                         dtype=torch.float64) * 30
    p = collectives.distributed_softmax(logits[ctx.rank:ctx.rank + 1])
    torch.testing.assert_close(p, torch.softmax(logits, 0)[ctx.rank:ctx.rank + 1])


def test_rings_equal_all_reduce_at_world_size_4():
    """4 ranks, and the sub-group makes a ring of 3 inside the same launch."""
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
