"""Each stage's algorithm works from its file alone: every file is copied into an empty folder
of its own and, in one fresh interpreter with nothing of the repo on the path, imported from
there and used (on a one-rank Gloo group; two spawned ranks for the rings). From such a lone
copy, the script's demo says in one line that it needs the repository. Stage 07's measure/counters.py
is support, not a script: its counters are checked to work alone too. (One interpreter for
all of them: each one costs seconds of torch import on a small machine.)"""

import shutil
import subprocess
import sys
import textwrap

from helpers import REPO

FILES = ["01_collectives/collectives.py", "02_allreduce_bench/allreduce_bench.py",
         "03_naive_ddp/naive_ddp.py", "04_flat_ddp/flat_ddp.py", "05_overlap_ddp/overlap_ddp.py",
         "06_bucketed_ddp/bucketed_ddp.py", "07_parallelism/03_tensor_parallel/tensor_parallel.py"]

# 07's lessons whose algorithm file has no harness (their run_<lesson>.py has it)
ALGORITHM_ONLY = ["07_parallelism/01_zero/zero.py", "07_parallelism/02_fsdp/fsdp.py"]

CHECK = r'''
import importlib, io, os, socket, sys, tempfile, warnings
import torch, torch.distributed as dist, torch.multiprocessing as mp, torch.nn as nn

def load(folder, name):
    sys.path.insert(0, os.path.abspath(folder))
    module = importlib.import_module(name)
    assert os.path.dirname(module.__file__) == os.path.abspath(folder), module.__file__
    return module

def ring_worker(rank, port):
    collectives = load("01_collectives", "collectives")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for ring in (collectives.ring_all_reduce, collectives.pipelined_ring_all_reduce):
        t = torch.arange(11.0) * (rank + 1)
        ring(t)
        assert torch.equal(t, torch.arange(11.0) * 3), t
    dist.destroy_process_group()

def check_zero(zero):
    """ZeRO-2 with accumulation under no_sync() trains as AdamW on one process; the
    consolidated state dict loads into plain AdamW, and back into a ShardedOptimizer."""
    assert not hasattr(zero, "main"), "zero.py holds the algorithm alone"
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref.load_state_dict(net.state_dict())
    opt = zero.ShardedOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-2)
    ddp = zero.Zero2DDP(net, opt, bucket_size_mb=1e-5)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        x = torch.randn(6, 4)
        opt.zero_grad()
        ref_opt.zero_grad()
        with ddp.no_sync():
            ddp(x[:3]).square().mean().backward()
        ddp(x[3:]).square().mean().backward()
        ddp.finish_gradient_synchronization()
        opt.step()
        (ref(x[:3]).square().mean() + ref(x[3:]).square().mean()).backward()
        ref_opt.step()
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-6), (p - q).abs().max()
    opt.consolidate_state_dict(to=0)
    plain = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    plain.load_state_dict(opt.state_dict())
    for p in ref.parameters():
        assert torch.allclose(plain.state[p]["exp_avg_sq"], ref_opt.state[p]["exp_avg_sq"])
    again = zero.ShardedOptimizer(net.parameters(), torch.optim.AdamW, lr=1.0)
    again.load_state_dict(ref_opt.state_dict())
    assert again.param_groups[0]["lr"] == 1e-2
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.equal(again.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"])


def check_fsdp(fsdp):
    """FSDP trains a model to the single-process weights, in float32 and bfloat16 compute."""
    assert not hasattr(fsdp, "main"), "fsdp.py holds the algorithm alone"
    for dtype in (None, torch.bfloat16):
        torch.manual_seed(0)
        model = fsdp.FSDP(nn.Sequential(nn.Linear(6, 7), nn.LayerNorm(7), nn.ReLU(), nn.Linear(7, 3)),
                          compute_dtype=dtype)
        torch.manual_seed(0)
        ref = nn.Sequential(nn.Linear(6, 7), nn.LayerNorm(7), nn.ReLU(), nn.Linear(7, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        x = torch.randn(8, 6)
        y = torch.randn(8, 3)
        for _ in range(2):
            opt.zero_grad()
            nn.functional.mse_loss(model(x).float(), y).backward()
            model.finish_gradient_synchronization()
            opt.step()
            ref_opt.zero_grad()
            nn.functional.mse_loss(ref(x), y).backward()
            ref_opt.step()
        got = model.gather_full_params()
        tolerance = 1e-6 if dtype is None else 2e-2
        for name, p in ref.named_parameters():
            assert torch.allclose(got[name], p, atol=tolerance), (dtype, name)


if __name__ == "__main__":
    modules = {name: load(folder, name) for folder, name in MODULES}
    assert "common" not in sys.modules, "an algorithm imported the repository's common"
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(ring_worker, args=(port,), nprocs=2)

    b = modules["allreduce_bench"]
    a, w = b.fit_latency_bandwidth([2**20, 2**30], [1e-4 + n / 2e9 for n in (2**20, 2**30)])
    assert abs(a - 1e-4) < 1e-9 and abs(w / 2e9 - 1) < 1e-9
    assert b.busbw(b.algbw(b.parse_size("1GB"), 1.0), 4) == 2**30 / 1e9 * 1.5

    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    for name, cls in [("naive_ddp", "NaiveDDP"), ("flat_ddp", "FlatDDP"),
                      ("overlap_ddp", "OverlapDDP"), ("bucketed_ddp", "BucketedDDP")]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        net[2].bias.requires_grad_(False)
        ddp = getattr(modules[name], cls)(net)
        assert ddp.module is net
        ddp(torch.randn(6, 4)).square().mean().backward()
        want = [p.grad.clone() for p in net.parameters() if p.requires_grad]
        ddp.finish_gradient_synchronization()  # one rank: the average is the gradient itself
        got = [p.grad for p in net.parameters() if p.requires_grad]
        assert all(torch.equal(a, b) for a, b in zip(want, got)) and net[2].bias.grad is None
        try:
            getattr(modules[name], cls)(nn.Linear(2, 2).requires_grad_(False))
            raise SystemExit(f"{cls}: no error for a model without trainable parameters")
        except ValueError as e:
            assert "require grad" in str(e), e

    tp = modules["tensor_parallel"]
    torch.manual_seed(0)
    ref, x = tp.MLP(8, 16), torch.randn(2, 3, 8)
    x_ref = x.clone().requires_grad_(True)
    want = ref(x_ref)
    want.square().mean().backward()
    for cls in (tp.TensorParallelMLP, tp.AllGatherMLP):
        model, x_tp = cls(ref), x.clone().requires_grad_(True)
        got = model(x_tp)
        got.square().mean().backward()
        assert torch.allclose(got, want, atol=1e-6) and torch.allclose(x_tp.grad, x_ref.grad, atol=1e-6)
        for layer in ("fc1", "fc2"):
            for pname in ("weight", "bias"):
                g = getattr(getattr(model, layer), pname).grad
                r = getattr(getattr(ref, layer), pname).grad
                assert torch.allclose(g, r, rtol=1e-5, atol=1e-6), (cls, layer, pname)

    with warnings.catch_warnings():  # 07's ZeRO and FSDP: warning-free, as python -W error checks
        warnings.simplefilter("error")
        check_zero(load("01_zero", "zero"))
        check_fsdp(load("02_fsdp", "fsdp"))
    assert "common" not in sys.modules, "zero.py or fsdp.py imported the repository's common"

    counters = load("measure", "counters")  # 07's counters need torch alone
    w = torch.zeros(4, 4)
    assert counters.state_bytes([w, w[0], None, torch.zeros(3)]) == 64 + 12  # each storage once
    with counters.CommCounter() as comm:
        dist.all_reduce(torch.ones(10))
    assert [(c["op"], c["payload_bytes"]) for c in comm.calls] == [("all_reduce", 40)], comm.calls
    assert "common" not in sys.modules, "07's counters imported the repository's common"
    dist.destroy_process_group()

    for name, module in modules.items():  # the demo, run from a lone copy: one line
        err = io.StringIO()
        sys.stderr, saved = err, sys.stderr
        try:
            module.main(["--help"])
            raise SystemExit(f"{name}: --help ran without the repository")
        except SystemExit as e:
            message = str(e.code)
        finally:
            sys.stderr = saved
        assert "repository" in message and "\n" not in message.strip(), (name, message)
    print("copy ok")
'''


def test_every_stage_file_works_copied_alone(tmp_path):
    modules = []
    for path in FILES:
        folder, name = path.rsplit("/", 1)
        (tmp_path / folder).mkdir(parents=True)
        shutil.copy(REPO / path, tmp_path / folder)
        modules.append((folder, name[:-3]))
    (tmp_path / "measure").mkdir()
    shutil.copy(REPO / "07_parallelism" / "measure" / "counters.py", tmp_path / "measure")  # no main()
    for path in ALGORITHM_ONLY:  # 07's algorithm files beside their scripts: no main() either
        folder = tmp_path / path.split("/")[-2]
        folder.mkdir()
        shutil.copy(REPO / path, folder)
    (tmp_path / "check.py").write_text(f"MODULES = {modules!r}\n" + textwrap.dedent(CHECK))
    r = subprocess.run([sys.executable, "check.py"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=240,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 0 and "copy ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
