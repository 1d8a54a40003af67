"""Each stage's algorithm works from its file alone: every file is copied into an empty folder
of its own and, in one fresh interpreter with nothing of the repo on the path, imported from
there and used (on a one-rank Gloo group; two spawned ranks for the rings, ring attention and
sequence parallelism). From such a lone copy, a file with a demo says in one line that it
needs the repository. Stage 07's measure/counters.py is support, not a script: its counters are
checked to work alone too, and so is 07's expert_parallel.py (the algorithm; its runnable script
lives beside it). (One interpreter for
all of them: each one costs seconds of torch import on a small machine.)"""

import shutil
import subprocess
import sys
import textwrap

from helpers import REPO

FILES = ["01_collectives/collectives.py", "02_allreduce_bench/allreduce_bench.py",
         "03_naive_ddp/naive_ddp.py", "04_flat_ddp/flat_ddp.py", "05_overlap_ddp/overlap_ddp.py",
         "06_bucketed_ddp/bucketed_ddp.py", "07_parallelism/03_tensor_parallel/tensor_parallel.py",
         "07_parallelism/05_context_parallel/context_parallel.py",
         "07_parallelism/08_checkpoints/checkpoint.py"]

# 07's lessons whose algorithm file has no harness (their run_<lesson>.py has it)
ALGORITHM_ONLY = ["07_parallelism/01_zero/zero.py", "07_parallelism/02_fsdp/fsdp.py",
                  "07_parallelism/06_expert_parallel/expert_parallel.py",
                  "07_parallelism/10_hangs/plants.py", "07_parallelism/11_muon/muon.py"]

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
        wrong = None if torch.equal(t, torch.arange(11.0) * 3) else t.tolist()
        verdicts = [None, None]  # agreed: both ranks raise, or neither
        dist.all_gather_object(verdicts, wrong)
        assert verdicts == [None, None], (ring.__name__, "each rank's wrong sum:", verdicts)

    cp = load("07_parallelism/05_context_parallel", "context_parallel")  # ring attention, 2 ranks
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    want.backward(torch.ones_like(want))
    mine = [cp.shard_sequence(t.detach(), 2, rank, 2, "zigzag").requires_grad_() for t in (q, k, v)]
    got = cp.ring_attention(*mine)
    got.backward(torch.ones_like(got))
    assert torch.allclose(cp.unshard_sequence(got.detach(), 2), want, atol=1e-12)
    assert torch.allclose(cp.unshard_sequence(mine[1].grad, 2), k.grad, atol=1e-12)
    q.grad = None                                                  # Ulysses, 2 ranks, 2 heads
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    want.backward(torch.ones_like(want))
    mine = [cp.shard_sequence(t.detach(), 2, rank, 2, "contiguous").requires_grad_() for t in (q, k, v)]
    got = cp.ulysses_attention(*mine)
    got.backward(torch.ones_like(got))
    assert torch.allclose(cp.unshard_sequence(got.detach(), 2, layout="contiguous"), want, atol=1e-12)
    assert torch.allclose(cp.unshard_sequence(mine[0].grad, 2, layout="contiguous"), q.grad, atol=1e-12)

    tp = load("07_parallelism/03_tensor_parallel", "tensor_parallel")  # sequence parallel, 2 ranks
    full = tp.MLP(4, 8)
    x = torch.randn(2, 6, 4, requires_grad=True)
    full(x).square().sum().backward()
    fc1 = tp.ColumnParallelLinear(full.fc1, sequence_parallel=True)
    fc2 = tp.RowParallelLinear(full.fc2, sequence_parallel=True)
    x_mine = x.detach().chunk(2, dim=1)[rank].requires_grad_()
    y_mine = fc2(torch.nn.functional.gelu(fc1(x_mine)))
    y_mine.square().sum().backward()
    assert torch.allclose(y_mine, full(x).chunk(2, dim=1)[rank], atol=1e-6)
    assert torch.allclose(x_mine.grad, x.grad.chunk(2, dim=1)[rank], atol=1e-6)
    assert torch.allclose(fc1.weight.grad, fc1.local_part(full.fc1.weight.grad), atol=1e-5)
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

    moe_module = load("06_expert_parallel", "expert_parallel")  # the algorithm alone, no main()
    torch.manual_seed(0)
    moe = moe_module.MoE(8, 16, num_experts=4, top_k=2, capacity_factor=1.0)
    layer = moe_module.ExpertParallelMoE(moe)  # one rank: every expert here, exchanges to itself
    assert list(layer.experts) == ["0", "1", "2", "3"]
    x = torch.randn(2, 5, 8)
    x_ref = x.clone().requires_grad_(True)
    x_ep = x.clone().requires_grad_(True)
    (moe(x_ref).square().mean() + moe.aux_loss).backward()
    (layer(x_ep).square().mean() + layer.aux_loss).backward()
    assert layer.dropped == moe.dropped and torch.equal(layer.aux_loss, moe.aux_loss)

    plants = load("10_hangs", "plants")  # 10's plants: torch alone, no main()
    for name, scenario in plants.SCENARIOS.items():
        if not name.startswith("send_recv"):  # pairs ranks: needs 2
            scenario(0, 1, None, False)
    assert "common" not in sys.modules, "10's plants imported the repository's common"

    muon = load("11_muon", "muon")  # on one rank every design is Muon, bitwise
    torch.manual_seed(0)
    weights = [torch.randn(5, 3, dtype=torch.float64), torch.randn(3, 7, dtype=torch.float64)]
    for design in muon.DESIGNS.values():
        ours = [w.clone().requires_grad_() for w in weights]
        ref = [w.clone().requires_grad_() for w in weights]
        optimizer = design(ours, lr=0.02, weight_decay=0.1)
        reference = muon.Muon(ref, lr=0.02, weight_decay=0.1)
        for step in range(2):
            for p, q in zip(ours, ref):
                p.grad = torch.full_like(p, step + 1.0)
                q.grad = p.grad.clone()
            optimizer.step()
            reference.step()
        assert all(torch.equal(p, q) for p, q in zip(ours, ref)), design
    assert "common" not in sys.modules, "muon.py imported the repository's common"
    assert torch.allclose(x_ep.grad, x_ref.grad, atol=1e-6)
    for index, expert in layer.experts.items():
        for got, want in zip(expert.parameters(), moe.experts[int(index)].parameters()):
            assert torch.allclose(got.grad, want.grad, atol=1e-6), index
    assert "common" not in sys.modules, "expert_parallel imported the repository's common"

    ck = modules["checkpoint"]  # a sharded checkpoint of one rank, consolidated, then damaged
    lay = load("layouts_alone", "layouts")  # 08's layouts: a file of their own, copied alone
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net(torch.randn(3, 4)).square().mean().backward()
    opt.step()
    meta = {"parameter_order": [n for n, _ in net.named_parameters()],
            "optimizer": lay.optimizer_options(opt)}
    stats = ck.save("ckpt", lay.replicated_layout(net, opt), 1, "one process", meta)
    assert stats["bytes_written"] == (8 * 4 + 8 + 2 * 8 + 2) * 4 * 3 + 4 * 4, stats
    state = ck.consolidate(ck.latest_checkpoint("ckpt"))
    twin = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    twin.load_state_dict(state["model"])
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    twin_opt.load_state_dict(state["optimizer"])
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), twin.parameters()))
    assert all(torch.equal(opt.state[a]["exp_avg"], twin_opt.state[b]["exp_avg"])
               for a, b in zip(net.parameters(), twin.parameters()))
    shard = "ckpt/step_000000001/rank_00000.bin"
    damaged = bytearray(open(shard, "rb").read())
    damaged[5] ^= 1
    open(shard, "wb").write(damaged)
    try:
        ck.consolidate(ck.latest_checkpoint("ckpt"))
        raise SystemExit("a corrupted checkpoint was loaded")
    except ck.CheckpointError as e:
        assert "rank_00000.bin: corrupted" in str(e) and "\n" not in str(e), e
    assert "common" not in sys.modules, "08's checkpoint or layouts imported the repository's common"
    dist.destroy_process_group()

    for name, module in modules.items():  # the demo, run from a lone copy: one line
        if not hasattr(module, "main"):
            continue  # 07's algorithm files: the demo is the run_*.py script beside them
        saved = sys.stderr
        sys.stderr = io.StringIO()
        message = None
        try:
            module.main(["--help"])
        except SystemExit as e:
            message = str(e.code)
        finally:
            sys.stderr = saved
        assert message is not None, f"{name}: main(['--help']) returned without the repository"
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
    shutil.copy(REPO / "07_parallelism" / "08_checkpoints" / "safety.py",
                tmp_path / "07_parallelism" / "08_checkpoints")  # checkpoint.py's rules, beside it
    (tmp_path / "measure").mkdir()
    shutil.copy(REPO / "07_parallelism" / "measure" / "counters.py", tmp_path / "measure")  # no main()
    for path in ALGORITHM_ONLY:  # 07's algorithm files beside their scripts: no main() either
        folder = tmp_path / path.split("/")[-2]
        folder.mkdir()
        shutil.copy(REPO / path, folder)
    (tmp_path / "layouts_alone").mkdir()
    shutil.copy(REPO / "07_parallelism" / "08_checkpoints" / "layouts.py",
                tmp_path / "layouts_alone")  # no main(): the checkpoints' layouts, alone
    (tmp_path / "check.py").write_text(f"MODULES = {modules!r}\n" + textwrap.dedent(CHECK))
    r = subprocess.run([sys.executable, "check.py"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=240,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 0 and "copy ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


# --------------------------------------------------------------------------- 07's pipeline lesson
# Its executor needs the schedules beside it, so the lesson is copied as a folder; each file
# copied alone either works (the schedules, the plain 1F1B loops) or says in one line which
# file is missing and that the folder goes whole (the executor, the script).

PIPELINE = "07_parallelism/04_pipeline_parallel"
PIPELINE_FILES = ["one_f_one_b.py", "pipeline_parallel.py", "pipeline_schedules.py",
                  "run_pipeline.py"]

PIPELINE_CHECK = r'''
import ast, importlib, os, sys, tempfile
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F

LESSON = ("one_f_one_b", "pipeline_parallel", "pipeline_schedules", "run_pipeline")


def fresh_import(folder, name):
    """Import ``name`` from ``folder`` alone: the lesson's modules forgotten, only that folder."""
    for module in LESSON:
        sys.modules.pop(module, None)
    for path in [p for p in sys.path if p.endswith(("_alone", "whole"))]:
        sys.path.remove(path)
    sys.path.insert(0, os.path.abspath(folder))
    module = importlib.import_module(name)
    assert os.path.dirname(module.__file__) == os.path.abspath(folder), module.__file__
    return module


def one_line(text):
    return text.strip() and "\n" not in text.strip()


def reference(x, y):
    model = pp.build_model(4, 8, 16, linear=nn.Linear)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return model, loss.item()


if __name__ == "__main__":
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    x, y = torch.randn(6, 8), torch.randn(6, 8)

    # The executor alone: one line, naming the missing file, saying the folder goes whole.
    try:
        fresh_import("executor_alone", "pipeline_parallel")
        raise SystemExit("pipeline_parallel.py imported without pipeline_schedules.py")
    except ModuleNotFoundError as e:
        assert one_line(str(e)) and "pipeline_schedules.py" in str(e) and "whole" in str(e), e
    # The script alone: one line too (it exits, as a script does).
    try:
        fresh_import("script_alone", "run_pipeline")
        raise SystemExit("run_pipeline.py imported without its lesson")
    except SystemExit as e:
        message = str(e.code)
        assert one_line(message) and ".py is missing" in message and "whole" in message, message

    # The schedules alone: plain Python, no torch.
    ps = fresh_import("schedules_alone", "pipeline_schedules")
    tree = ast.parse(open(ps.__file__).read())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "dataclasses"}, imported
    rank_3 = ps.simulate(ps.all_ranks("zbh1", 4, 8))[3]            # [(start, end, step)]
    assert [(start, step.op, step.micro_batch) for start, _, step in rank_3[:2]] == \
        [(3, "F", 0), (4, "B", 0)], rank_3[:2]
    assert len(ps.p2p_plan(ps.all_ranks("dualpipev", 4, 8))) == 4

    # The plain 1F1B loops alone, on one rank: the gradients and loss of one process.
    plain = fresh_import("loops_alone", "one_f_one_b")
    torch.manual_seed(0)
    ref_model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    ref_loss = F.mse_loss(ref_model(x), y)
    ref_loss.backward()
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    model.load_state_dict(ref_model.state_dict())
    stage = plain.Stage(model, (2, 8), torch.device("cpu"), F.mse_loss, micro_batches=3)
    out = plain.one_f_one_b(stage, list(x.chunk(3)), list(y.chunk(3)))
    assert abs(out["loss"] - ref_loss.item()) < 1e-5 and out["peak_held"] == 1, out
    for q, w in zip(model.parameters(), ref_model.parameters()):
        assert torch.allclose(q.grad, w.grad, atol=1e-6)

    # The folder whole: every schedule on one rank equals one process, on the default group
    # and on an explicit pipeline group; the script says in one line it needs the repository.
    pp = fresh_import("whole", "pipeline_parallel")
    ps = importlib.import_module("pipeline_schedules")
    assert os.path.dirname(ps.__file__) == os.path.abspath("whole")
    ref, ref_loss = reference(x, y)
    group = dist.new_group([0])
    for name, v, on_group in (("gpipe", 1, None), ("1f1b", 1, group), ("zbh1", 1, None),
                              ("interleaved", 2, group), ("zbv", 2, None)):
        model = pp.build_model(4, 8, 16)
        chunks = [model[r.start:r.stop] for r in pp.chunk_layers(4, 1, 0, v)]
        out = pp.run_schedule(chunks, ps.all_ranks(name, 1, 3, v), list(x.chunk(3)),
                              list(y.chunk(3)), (2, 8), torch.device("cpu"), group=on_group)
        assert abs(out["loss"] - ref_loss) < 1e-5, (name, out)
        for q, w in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(q.grad, w.grad, atol=1e-6), name
    script = importlib.import_module("run_pipeline")
    try:
        script.main(["--help"])
        raise SystemExit("run_pipeline.py --help ran without the repository")
    except SystemExit as e:
        message = str(e.code)
    assert "repository" in message and one_line(message), message
    dist.destroy_process_group()
    print("pipeline copy ok")
'''


def test_pipeline_lesson_copied_alone_and_whole(tmp_path):
    lesson = REPO / PIPELINE
    for folder, files in [("executor_alone", ["pipeline_parallel.py"]),
                          ("script_alone", ["run_pipeline.py"]),
                          ("schedules_alone", ["pipeline_schedules.py"]),
                          ("loops_alone", ["one_f_one_b.py"]),
                          ("whole", PIPELINE_FILES + ["README.md"])]:
        (tmp_path / folder).mkdir()
        for name in files:
            shutil.copy(lesson / name, tmp_path / folder)
    assert sorted(p.name for p in lesson.glob("*.py")) == PIPELINE_FILES  # a new file: add it
    (tmp_path / "check.py").write_text(PIPELINE_CHECK)
    r = subprocess.run([sys.executable, "check.py"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=240,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 0 and "pipeline copy ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
