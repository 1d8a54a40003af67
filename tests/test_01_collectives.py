"""Stage 01: every collective at several world sizes, the ring all-reduce against
dist.all_reduce, the file on its own, and the launcher's behaviour under faults."""

import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import collectives
from common import launch
from helpers import REPO, run_script

SCRIPT = REPO / "01_collectives" / "collectives.py"
GLOO_CPU = dict(backend="gloo", device="cpu")


def test_collectives_pass_at_world_sizes_1_to_4_launched_at_once():
    """Odd world sizes catch off-by-one chunking; launching all four together also proves
    that simultaneous runs pick different ports and do not collide."""
    procs = {n: subprocess.Popen([sys.executable, str(SCRIPT), "--world-size", str(n),
                                  "--backend", "gloo", "--device", "cpu"],
                                 cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in (1, 2, 3, 4)}
    for n, proc in procs.items():
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out[-3000:]
        assert f"all {len(collectives.DEMOS)} collective checks passed on {n} rank(s)" in out
        # every rank printed its before/after line for the all-reduce
        assert sum(line.startswith(f"[rank {r}] all_reduce(SUM)") for r in range(n)
                   for line in out.splitlines()) == n


def ring_matches_all_reduce(ctx, sizes, dtypes):
    for numel in sizes:
        for dtype in dtypes:
            g = torch.Generator().manual_seed(1000 * numel + ctx.rank)  # fresh data per rank
            if dtype.is_floating_point:
                x = torch.randn(numel, generator=g, dtype=dtype)
            else:
                x = torch.randint(-2**40, 2**40, (numel,), generator=g, dtype=dtype)
            ours, reference = x.clone(), x.clone()
            returned = collectives.ring_all_reduce(ours)
            dist.all_reduce(reference)
            assert returned is ours  # in place, like dist.all_reduce
            if dtype.is_floating_point:  # summed in another order: equal up to rounding
                torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5 * ctx.world_size)
            else:
                assert torch.equal(ours, reference)
            everyone = [torch.empty_like(ours) for _ in range(ctx.world_size)]
            dist.all_gather(everyone, ours)
            assert all(torch.equal(e, ours) for e in everyone), "ranks differ bitwise"

    # A non-contiguous tensor is reduced in place too.
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6) * (ctx.rank + 1)
    view = base.t()
    collectives.ring_all_reduce(view)
    scale = ctx.world_size * (ctx.world_size + 1) / 2
    assert torch.equal(base, torch.arange(24, dtype=torch.float64).reshape(4, 6) * scale)

    # Within a sub-group (global ranks 1..n-1), the ring maps group ranks to global ones.
    members = list(range(1, ctx.world_size))
    group = dist.new_group(members)
    if ctx.rank in members:
        t = torch.full((5,), float(ctx.rank))
        collectives.ring_all_reduce(t, group=group)
        assert torch.equal(t, torch.full((5,), float(sum(members))))

    # Many segments per chunk (the pipelined exchange), including a last, shorter segment:
    # tiny segments make the 1000003-element case run thousands of them.
    for numel, segment_numel in ((1000, 7), (1000003, 4096)):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(ctx.rank), dtype=torch.float64)
        reference = x.clone()
        dist.all_reduce(reference)
        collectives.ring_all_reduce(x, segment_numel=segment_numel)
        torch.testing.assert_close(x, reference, rtol=1e-12, atol=1e-12)

    # The batched exchange the ring uses on NCCL (batch_isend_irecv), run here on Gloo, which
    # supports it too: no GPU needed to check that path's arithmetic.
    collectives._grouped_p2p = lambda group: True  # this spawned rank's copy only
    for numel in (1, 1001):
        x = torch.arange(numel, dtype=torch.float64) + ctx.rank
        reference = x.clone()
        dist.all_reduce(reference)
        assert torch.equal(collectives.ring_all_reduce(x), reference), numel


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_all_reduce_equals_all_reduce(world_size):
    launch.launch(ring_matches_all_reduce, launch.LaunchConfig(world_size, **GLOO_CPU),
                  [1, 7, 1000, 1_000_003], [torch.float32, torch.float64, torch.int64],
                  timeout_s=180)


def test_copied_file_works_alone(tmp_path):
    """collectives.py copied into an empty folder imports with torch alone and its ring runs."""
    (tmp_path / "collectives.py").write_text(SCRIPT.read_text())
    (tmp_path / "use_ring.py").write_text(textwrap.dedent("""
        import os, torch, torch.distributed as dist, torch.multiprocessing as mp
        from collectives import ring_all_reduce

        def worker(rank, port):
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                    rank=rank, world_size=2)
            t = torch.arange(11.0) * (rank + 1)
            ring_all_reduce(t)
            assert torch.equal(t, torch.arange(11.0) * 3), t
            dist.destroy_process_group()

        if __name__ == "__main__":
            import socket
            s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
            mp.spawn(worker, args=(port,), nprocs=2)
            print("ring ok")
    """))
    result = run_script("use_ring.py", cwd=tmp_path, timeout=120,
                        env={"PYTHONPATH": ""})  # nothing from the repo on the path
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ring ok" in result.stdout


# --------------------------------------------------------------------------- launcher faults

FAULTS = REPO / "tests" / "fault_worker.py"


@pytest.mark.parametrize("fault,expected", [("raise", "ValueError: planted failure on rank 1"),
                                             ("kill", "signal")])
def test_a_failing_rank_ends_the_run(fault, expected):
    result = run_script(FAULTS, "--world-size", "3", "--fault", fault, "--bad-rank", "1",
                        "--backend", "gloo", "--device", "cpu", timeout=120)
    ended = time.time()
    assert result.returncode != 0
    planted = float(result.stdout.split(f"planting {fault} at ")[1].split()[0])
    elapsed = ended - planted  # from the failure to the end of the whole run
    assert expected in result.stderr, result.stderr[-3000:]
    assert "passed the second barrier" not in result.stdout
    assert elapsed < 30, f"the run took {elapsed:.0f}s to notice the failed rank"


@pytest.mark.parametrize("argv,message", [
    (["--world-size", "0"], "--world-size must be >= 1, got 0"),
    (["--backend", "mpi"], "invalid choice: 'mpi'"),
    (["--backend", "nccl"], "--backend nccl needs"),
])
def test_bad_flags_exit_2_with_one_line(argv, message):
    if argv == ["--backend", "nccl"] and torch.cuda.device_count() >= 4:
        pytest.skip("this box can run nccl")
    result = run_script(SCRIPT, *argv, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "[rank" not in result.stdout  # no worker started


# --------------------------------------------------------------------------- torchrun

def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", *args, str(SCRIPT),
            "--backend", "gloo", "--device", "cpu"]


def test_torchrun_standalone():
    result = subprocess.run(torchrun("--standalone", "--nproc-per-node=2"), cwd=REPO,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "collective checks passed on 2 rank(s)" in result.stdout


def test_torchrun_two_nodes_on_loopback():
    port = launch.free_port()
    node = torchrun("--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=test01")
    procs = [subprocess.Popen(node, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outs)
    assert any("collective checks passed on 2 rank(s)" in o for o in outs)
