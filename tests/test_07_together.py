"""Stage 07, everything together: the grid of ranks, the text, and training over the grid.

The grid's groups are checked against torch's ``init_device_mesh`` without spawning: torch's
fake process group lets one process play any rank of any world size (and counts the groups a
grid makes). Training over grids of four ranks, beside one process, with planted bugs, runs in
one launch (``checks_together.py``); train.py itself runs as a subprocess (under torchrun on
two "nodes"); its refusals and the training loop on a one-rank group (a NaN loss, a save that
fails) run in this process.
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
HSDP_SHAPES = [(2, 2, 1, 1, 1), (2, 2, 1, 1, 2), (1, 2, 2, 1, 1), (2, 1, 1, 2, 1),
               (2, 2, 2, 1, 1)]  # (dp_replicate, dp_shard, pp, cp, tp)

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
            if got != want or ours.members[axis] != want or ours.rank(axis) != want.index(rank):
                problems.append(f"rank {rank} axis {axis}: ours {got}, the mesh's {want}")
        dist.destroy_process_group()
    return problems


for shape in SHAPES:
    problems = differences(*shape, mesh_order=("pp", "dp", "cp", "tp"))
    print(f"{shape}: " + ("; ".join(problems) if problems else "groups equal"))
# negative control: a mesh with data and context swapped must differ from our grid
problems = differences(2, 1, 2, 2, mesh_order=("pp", "cp", "dp", "tp"))
print("control: " + ("differs" if problems else "NO DIFFERENCE"))


def hsdp_differences(replicate, shard, pp, cp, tp, mesh_order):
    """HSDP: our dp_replicate, dp_shard and dp groups against a 5-D mesh's (the right order:
    ("pp", "dp_replicate", "dp_shard", "cp", "tp"), the shard index inside the replica's)."""
    sizes = {"pp": pp, "dp_replicate": replicate, "dp_shard": shard, "cp": cp, "tp": tp}
    world_size = replicate * shard * pp * cp * tp
    problems = []
    for rank in range(world_size):
        dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
        mesh = init_device_mesh("cpu", tuple(sizes[axis] for axis in mesh_order),
                                mesh_dim_names=mesh_order)
        ours = grid.ProcessGrid(dp=replicate * shard, pp=pp, cp=cp, tp=tp, dp_shard=shard)
        theirs = {}
        for axis in ("dp_replicate", "dp_shard", "pp", "cp", "tp"):
            theirs[axis] = dist.get_process_group_ranks(mesh.get_group(axis))
        data = tuple(axis for axis in mesh_order if axis.startswith("dp_"))
        theirs["dp"] = dist.get_process_group_ranks(mesh[data]._flatten("dp").get_group())
        for axis, want in theirs.items():
            got = dist.get_process_group_ranks(ours.group(axis))
            if got != want or ours.rank(axis) != want.index(rank):
                problems.append(f"rank {rank} axis {axis}: ours {got}, the mesh's {want}")
        dist.destroy_process_group()
    return problems


right = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
for shape in HSDP_SHAPES:
    problems = hsdp_differences(*shape, mesh_order=right)
    print(f"hsdp {shape}: " + ("; ".join(problems) if problems else "groups equal"))
# negative control: shards outside the replicas (a replica's ranks neighbours) must differ
swapped = ("pp", "dp_shard", "dp_replicate", "cp", "tp")
problems = hsdp_differences(2, 2, 1, 1, 2, mesh_order=swapped)
print("hsdp control: " + ("differs" if problems else "NO DIFFERENCE"))

# every size-1 axis shares one set of one-rank groups, and destroy() frees every group this
# rank holds
calls = []
real_new_group = dist.new_group


def counting_new_group(*args, **kwargs):
    calls.append(args)
    return real_new_group(*args, **kwargs)


dist.new_group = counting_new_group
dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
live = len(dist.distributed_c10d._world.pg_map)
ours = grid.ProcessGrid(dp=2, pp=2, cp=1, tp=2)
made = len(calls)
ours.destroy()
print(f"new_group {made}, left {len(dist.distributed_c10d._world.pg_map) - live}")
dist.destroy_process_group()
'''


def test_grid_groups_equal_init_device_mesh():
    """Every rank of every shape, in one interpreter (torch's fake process group); HSDP's
    sub-axes of the data axis against a 5-D mesh."""
    code = (f"SHAPES = {SHAPES!r}\nHSDP_SHAPES = {HSDP_SHAPES!r}\n"
            f"GRID_FOLDER = {str(REPO / '07_parallelism' / '07_together')!r}\n")
    result = subprocess.run([sys.executable, "-c", code + textwrap.dedent(MESH_CHECK)],
                            capture_output=True, text=True, timeout=120)
    lines = result.stdout.strip().splitlines()
    want = [f"{shape}: groups equal" for shape in SHAPES] + ["control: differs"]
    want += [f"hsdp {shape}: groups equal" for shape in HSDP_SHAPES] + ["hsdp control: differs"]
    # 4 groups each on pp, dp, tp, dp_cp, dp_replicate; 8 of one rank for cp and dp_shard
    # together (36 before: 8 for each size-1 axis)
    want += ["new_group 28, left 0"]
    assert result.returncode == 0 and lines == want, result.stdout[-3000:] + result.stderr[-3000:]


def test_grid_coordinates_without_processes():
    sizes = {"pp": 2, "dp": 2, "cp": 1, "tp": 2}
    for rank in range(8):
        assert grid_mod.grid_rank(grid_mod.grid_coordinate(rank, sizes), sizes) == rank
    assert grid_mod.grid_coordinate(5, sizes) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}
    assert grid_mod.groups_along(("tp",), sizes) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid_mod.groups_along(("pp",), sizes) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid_mod.groups_along(("dp", "cp"), sizes) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    hsdp = {"pp": 1, "dp": 4, "cp": 1, "tp": 2, "dp_shard": 2}   # shards neighbours, tp inside
    assert grid_mod.groups_along(("dp_shard",), hsdp) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid_mod.groups_along(("dp_replicate",), hsdp) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid_mod.groups_along(("dp",), hsdp) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    drawn = grid_mod.draw_grid(dp=2, pp=2, cp=1, tp=2).splitlines()
    assert drawn[1] == "pp 0  dp 1 | cp 0: 2 3" and drawn[3] == "pp 1  dp 1 | cp 0: 6 7"
    drawn = grid_mod.draw_grid(dp=6, dp_shard=3).splitlines()    # replica 0 holds shards 0-2
    assert drawn[2] == "pp 0  dp 2 (replica 0, shard 2) | cp 0: 2", drawn
    assert drawn[3] == "pp 0  dp 3 (replica 1, shard 0) | cp 0: 3", drawn


# --------------------------------------------------------------------------- training over grids

import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import checks_together  # noqa: E402
import text_data  # noqa: E402
import train as train_py  # noqa: E402
from bench import supervisor as launch  # noqa: E402
from helpers import assert_main_usage_error  # noqa: E402

TEXT = (REPO / "README.md").read_text() * 3  # a small real text: the tests read no stdlib
TRAIN_PY = REPO / "07_parallelism" / "07_together" / "train.py"


def test_grids_of_four_ranks_equal_one_process_and_planted_bugs_are_caught(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    out = tmp_path / "findings.json"
    launch.launch(checks_together.grid_worker, launch.LaunchConfig(4, "gloo", "cpu"), str(data),
                  str(out), timeout_s=240)
    findings = json.loads(out.read_text())
    for label, grid, planted in checks_together.FOUR_RANK_CASES:
        found = findings[label]
        if planted is None:
            assert found["problems"] == [], (label, found["problems"][:5])
            assert found["worst"] < 1e-4, (label, found["worst"])
        else:
            assert found["problems"], f"{label}: the planted bug was not caught"
    unscaled = findings["dp2 cp2, loss not divided by R"]["problems"]
    assert any("reports loss" in problem or "the held-out loss, forward only" in problem
               for problem in unscaled), unscaled[:3]
    dp_only = findings["dp2 cp2, summed over dp only"]["problems"]
    assert any("gradient differs" in problem for problem in dp_only), dp_only[:3]
    twice = findings["dp2 tp2, summed over tp twice"]["problems"]
    assert any("norm1.weight gradient differs" in problem for problem in twice), twice[:3]
    hsdp = findings["HSDP 2 x 2, summed over the whole data axis"]["problems"]
    assert any("gradient differs" in problem for problem in hsdp), hsdp[:3]
    replicas = findings["dp2 tp2, replicas saved on every tp rank"]["problems"]
    assert any("blocks.0.norm1.weight: marked to be saved by ranks [0, 1]" in problem
               for problem in replicas), replicas[:3]
    # a NaN loss: every rank exits 2, rank 0 alone says one line naming the step
    stops = findings["nan stop"]
    assert [stop["code"] for stop in stops] == [2, 2, 2, 2], stops
    assert stops[0]["stderr"].count("\n") == 1 and "step 7: the loss is nan" in stops[0]["stderr"]
    assert all(stop["stderr"] == "" for stop in stops[1:]), stops


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
            str(TRAIN_PY), "--backend", "gloo",
            "--device", "cpu", "--dp", "2", "--pp", "2", "--tp", "2", "--micro-batches", "2",
            "--batch-size", "8", "--seq-len", "32", "--steps", "2", "--log-every", "1",
            "--eval-batches", "1", "--check", "--check-steps", "2", "--data", str(data),
            "--save-full", str(saved)]
    procs = [subprocess.Popen(node, cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    except subprocess.TimeoutExpired:     # both nodes stopped (torchrun stops its ranks), both shown
        for p in procs:
            p.terminate()
        try:
            outs = [p.communicate(timeout=60)[0] for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            outs = [p.communicate()[0] for p in procs]
        pytest.fail("two nodes still running after 240 s:\n" + "\n".join(o[-3000:] for o in outs))
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    text = "\n".join(outs)
    assert "check: 2 steps on the grid equal 2 steps of one process" in text, text[-3000:]
    assert "step     2  loss" in text and "sample" in text, text[-3000:]
    from common import models
    lm = models.TransformerLM("tiny", vocab_size=256, context_length=32)
    lm.load_state_dict(torch.load(saved))  # the single-process LM's names and shapes


def test_ranks_probing_one_save_full_path_at_once_do_not_trip_each_other(tmp_path, monkeypatch):
    """Every rank parses --save-full and checks that it can write there: two ranks at once, any
    file removal held 0.2 s (8 ranks on two torchrun nodes raced on one probe's name, and one
    rank's error hung the other node) both pass, and nothing is left behind."""
    argv = ["--world-size", "1", "--save-full", str(tmp_path / "model.pt")]
    remove = os.remove
    monkeypatch.setattr(os, "remove", lambda path: (time.sleep(0.2), remove(path)))
    failed = []

    def rank():
        try:
            train_py.parse(argv)
        except SystemExit as stopped:
            failed.append(stopped.code)

    ranks = [threading.Thread(target=rank) for _ in range(2)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join()
    assert failed == [] and list(tmp_path.iterdir()) == [], failed


def one_rank(args, checkpoints_class=None) -> None:
    """train.py's training on a 1-rank group in this process (no worker to start)."""
    store = Path(tempfile.mkdtemp(prefix="one-rank-")) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        train_py.train_main(launch.Dist(0, 1, 0, "gloo", torch.device("cpu")), args)
    finally:
        dist.destroy_process_group()


def test_a_nan_loss_stops_training_with_one_line_naming_the_step(tmp_path, capsys):
    """--lr 1e6: the loss goes to NaN within a few steps; the run stops there, one line, exit 2
    (in this process, on one rank: the loop itself, no worker to start)."""
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    args, _ = train_py.parse(["--world-size", "1", "--lr", "1e6", "--steps", "50",
                                 "--log-every", "50", "--batch-size", "8", "--seq-len", "32",
                                 "--data", str(data), "--backend", "gloo", "--device", "cpu"])
    with pytest.raises(SystemExit) as stopped:
        one_rank(args)
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "the loss is nan; training stopped" in lines[0], lines
    step = int(lines[0].split("step ")[1].split(":")[0])
    assert 1 < step < 50, lines


def test_a_save_that_fails_at_the_end_says_one_line_and_keeps_the_old_file(tmp_path, capsys,
                                                                           monkeypatch):
    """A disk that fills while the model is written: one line, exit 2, and the file that was
    there before still whole (the model goes to a file beside it, renamed over it when done)."""
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    saved = tmp_path / "model.pt"
    saved.write_bytes(b"the model of an earlier run")
    args, _ = train_py.parse(["--world-size", "1", "--steps", "1", "--batch-size", "8",
                              "--seq-len", "32", "--eval-batches", "1", "--data", str(data),
                              "--save-full", str(saved)])
    monkeypatch.setattr(train_py, "plot", lambda *args: None)        # not what this test is on

    real_save = torch.save

    def disk_full(state, path, *args, **kwargs):
        if not isinstance(path, str) or not path.startswith(str(saved)):
            return real_save(state, path, *args, **kwargs)      # gather_object pickles so
        Path(path).write_bytes(b"half a mod")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(SystemExit) as stopped:
        one_rank(args)
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0], lines
    assert saved.read_bytes() == b"the model of an earlier run"
    assert not (tmp_path / "model.pt.tmp").exists()


def test_bad_input_is_refused_before_any_worker_starts(tmp_path, capsys, monkeypatch):
    """What would train a wrong model silently, hang, or lose the model at the end: one line,
    exit 2, in this process (no launch)."""
    def no_launch(*args, **kwargs):
        raise AssertionError("bad input reached the launch")
    monkeypatch.setattr(launch, "launch", no_launch)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cases = [
        (["--world-size", "4", "--dp", "3", "--tp", "2"], "must equal the world size 4"),
        (["--world-size", "4", "--dp-shard", "3"], "--dp-shard must divide --dp 4"),
        (["--world-size", "4", "--dp", "2", "--pp", "2", "--dp-shard", "2"], "HSDP"),
        (["--world-size", "4", "--dp", "2", "--cp", "2", "--dp-shard", "2"], "HSDP"),
        (["--world-size", "4", "--dp-shard", "2", "--fsdp"], "HSDP"),
        (["--world-size", "2", "--dp", "2", "--batch-size", "8", "--micro-batches", "3"],
         "--batch-size must divide by --dp x --micro-batches"),
        (["--world-size", "2", "--dp", "1", "--tp", "2", "--seq-len", "30"], "2 x --cp x --tp"),
        (["--data", str(fifo)], "not a regular file"),            # it hung, reading
        (["--data", "x" * 5000], "not a regular file"),           # OSError: File name too long
        (["--data", str(tmp_path)], "not a regular file"),
        (["--save-full", str(fifo)], "not a regular file"),       # it hung, writing
        (["--save-full", "/dev/full"], "not a regular file"),     # it trained, then lost it
        (["--save-full", "x" * 5000], "File name too long"),
        (["--save-full", str(tmp_path / "missing" / "model.pt")], "No such file or directory"),
    ]
    for argv, needle in cases:
        full = ["--world-size", "1", "--backend", "gloo", "--device", "cpu", *argv]
        assert_main_usage_error(train_py.parse, full, capsys, needle)
    # HSDP: --dp is the whole data axis, --dp-shard its part
    args, _ = train_py.parse(["--world-size", "4", "--dp-shard", "2", "--tp", "2"])
    assert (args.dp, args.dp_shard) == (2, 2)
    # nothing of the tries is left behind
    train_py.parse(["--world-size", "1", "--save-full", str(tmp_path / "model.pt")])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["fifo"]


def test_text_is_read_in_bounded_pieces(tmp_path):
    """--max-bytes far past the file (1e11) reads the file, not 100 GB set aside first (a
    MemoryError); a 3 GB sparse file is read only as far as --max-bytes."""
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    assert text_data.read_head(str(data), 10**11) == TEXT.encode()
    sparse = tmp_path / "three_gb.txt"           # 3 GB that take no disk
    with open(sparse, "wb") as f:
        f.truncate(3 * 2**30)
    assert len(text_data.read_head(str(sparse), 100_000)) == 100_000


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_refused(tmp_path, capsys):
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o500)
    assert_main_usage_error(train_py.parse, ["--world-size", "1", "--save-full",
                                             str(read_only / "m.pt")], capsys, "Permission denied")


# --------------------------------------------------------------------------- the text


def file_split_problems(train: bytes, held_out: bytes, whole: bytes) -> list[str]:
    """A file's two parts: the training text then the held-out text, one after the other, are
    the text read: no byte in both, none left out."""
    problems = []
    if not train or not held_out:
        problems.append(f"a part is empty: {len(train)} training, {len(held_out)} held-out bytes")
    if train + held_out != whole:
        problems.append(f"training ({len(train)} bytes) then held-out ({len(held_out)}) is not "
                        f"the {len(whole)} bytes read")
    return problems


def split_problems(train: bytes, held_out: bytes, pieces: list[bytes]) -> list[str]:
    """The standard library's two parts: every file (``pieces``, each whole and different) in
    exactly one of them, and nothing else."""
    problems = []
    if not train or not held_out:
        problems.append(f"a part is empty: {len(train)} training, {len(held_out)} held-out bytes")
    if len(train) + len(held_out) != sum(len(piece) for piece in pieces):
        problems.append(f"{len(train)} + {len(held_out)} bytes, the text has "
                        f"{sum(len(piece) for piece in pieces)}")
    for piece in pieces:
        if (piece in train) == (piece in held_out):
            problems.append(f"a piece is in both parts or in neither: {piece[:30]!r}")
    return problems


def test_held_out_text_is_disjoint_from_the_training_text_and_covers_it(tmp_path, monkeypatch):
    """Both paths of text_data: a file (cut at 95%, at most --max-bytes read) and the standard
    library's (whole files dealt to one part or the other; here a folder of made-up files).
    A planted bug, the training text returned as the held-out text, fails the same check."""
    data = tmp_path / "text.txt"
    data.write_bytes(bytes(range(256)) * 40)
    whole = data.read_bytes()
    train, held_out = text_data.load_text(str(data))
    assert file_split_problems(train, held_out, whole) == []
    assert len(held_out) == len(whole) - int(len(whole) * 0.95)
    train, held_out = text_data.load_text(str(data), max_bytes=5000)
    assert file_split_problems(train, held_out, whole[:5000]) == [] and len(held_out) == 250
    files = []
    for index in range(40):
        path = tmp_path / f"module_{index}.py"
        path.write_text(f"# module {index}\n" + f"value_{index} = {index}\n" * (index + 1))
        files.append(path)
    monkeypatch.setattr(text_data, "stdlib_files", lambda: list(files))
    pieces = [path.read_bytes() for path in files]
    train, held_out = text_data.load_text()
    assert split_problems(train, held_out, pieces) == []
    assert held_out.count(b"# module ") == 2          # 5% of 40 files, whole
    # the planted bugs: the training part returned as the held-out part, on either path
    real_split_files = text_data.split_files
    monkeypatch.setattr(text_data, "split_files",
                        lambda *a, **k: (real_split_files(*a, **k)[0],) * 2)
    train, held_out = text_data.load_text()
    assert split_problems(train, held_out, pieces), "a held-out part equal to training passed"
    monkeypatch.setattr(text_data, "split_bytes", lambda data, share=0.05: (data, data))
    train, held_out = text_data.load_text(str(data))
    assert file_split_problems(train, held_out, whole)


# --------------------------------------------------------------------------- who saves what


class StubGrid:
    """A rank of a dp_cp x tp grid, without processes: what placement_of asks."""

    def __init__(self, dp_cp_rank: int, tp_rank: int, tp: int):
        self.ranks = {"dp_cp": dp_cp_rank, "tp": tp_rank}
        self.sizes = {"dp_cp": 2, "tp": tp}

    def rank(self, axis: str) -> int:
        return self.ranks[axis]

    def size(self, axis: str) -> int:
        return self.sizes[axis]


def test_each_piece_is_saved_by_exactly_one_rank_of_a_grid():
    """placement_of's ``replica``, on every rank of dp_cp 2 x tp 2 (no processes): a
    tp-replicated parameter (a LayerNorm) by one rank of all four, a tp-split weight by one
    rank per tp slice; a planted bug (replicas on every tp rank) is caught by the same count."""
    parallel_lm = train_py.lessons()[1]
    import tensor_parallel
    layer = torch.nn.Linear(8, 8)
    norm_weight = torch.nn.Parameter(torch.ones(8))
    column = tensor_parallel.ColumnParallelLinear.__new__(tensor_parallel.ColumnParallelLinear)
    column.stacked = 1
    plant = checks_together.replica_on_every_tp_rank(parallel_lm.placement_of)

    def savers(placement_of, p, module) -> list:
        found = []
        for dp_cp_rank in range(2):
            for tp_rank in range(2):
                grid = StubGrid(dp_cp_rank, tp_rank, 2)
                if placement_of("w", p, module, grid)["replica"]:
                    found.append((dp_cp_rank, tp_rank))
        return found
    assert savers(parallel_lm.placement_of, norm_weight, None) == [(0, 0)]
    assert savers(parallel_lm.placement_of, layer.weight, column) == [(0, 0), (0, 1)]
    assert savers(plant, norm_weight, None) == [(0, 0), (0, 1)]      # caught: two savers


class StubHSDPGrid:
    """A rank of HSDP (dp_replicate 2 x dp_shard 3) x tp 2, without processes."""

    def __init__(self, replicate_rank: int, shard_rank: int, tp_rank: int):
        self.ranks = {"dp_replicate": replicate_rank, "dp_shard": shard_rank, "tp": tp_rank,
                      "dp_cp": replicate_rank * 3 + shard_rank}
        self.sizes = {"dp_replicate": 2, "dp_shard": 3, "tp": 2, "dp_cp": 6}

    def rank(self, axis: str) -> int:
        return self.ranks[axis]

    def size(self, axis: str) -> int:
        return self.sizes[axis]


def test_hsdp_row_blocks_are_saved_once_each():
    """placement_of under HSDP, no processes, on every rank of (dp_replicate 2 x dp_shard 3)
    x tp 2: the stacked q, k, v weight (24 rows; a tp half 12, FSDP blocks of 4), a column-
    parallel weight whose blocks are padded (20 rows; a tp half 10, blocks of ceil(10/3) = 4,
    the last one 2 real rows) and a 1-D parameter (whole, not sharded): the boxes marked to be
    saved cover every row of the full tensor exactly once, each inside its rank's block.
    Planted: the boxes not cut to the rank's block (every shard rank saves its whole tp half)
    is caught by the same count."""
    parallel_lm = train_py.lessons()[1]
    import tensor_parallel

    def column(stacked):
        module = tensor_parallel.ColumnParallelLinear.__new__(tensor_parallel.ColumnParallelLinear)
        module.stacked = stacked
        return module

    def coverage(placement_of, full_rows, module, fsdp_rows) -> list[int]:
        """Per full row, how many saved boxes hold it; -1 everywhere if a box leaves its block."""
        count = [0] * full_rows
        for replicate_rank in range(2):
            for shard_rank in range(3):
                for tp_rank in range(2):
                    grid = StubHSDPGrid(replicate_rank, shard_rank, tp_rank)
                    held = torch.nn.Parameter(torch.zeros(full_rows))        # 1-D: whole
                    if fsdp_rows is not None:
                        held = torch.nn.Parameter(torch.zeros(fsdp_rows[1], 8))  # the block
                    entry = placement_of("w", held, module, grid, fsdp_rows)
                    if not entry["replica"]:
                        continue
                    for local_box, full_box in entry["boxes"]:
                        if local_box[0][1] > held.shape[0]:
                            return [-1] * full_rows
                        for row in range(full_box[0][0], full_box[0][1]):
                            count[row] += 1
        return count

    def not_cut(boxes, rows_per_block, block):
        return boxes
    right = parallel_lm.placement_of
    assert coverage(right, 24, column(3), (12, 4)) == [1] * 24
    assert coverage(right, 20, column(1), (10, 4)) == [1] * 20
    assert coverage(right, 8, None, None) == [1] * 8
    original = parallel_lm.rows_of_block
    parallel_lm.rows_of_block = not_cut
    try:
        assert coverage(right, 24, column(3), (12, 4)) != [1] * 24                   # caught
    finally:
        parallel_lm.rows_of_block = original


# --------------------------------------------------------------------------- the measurements

import copy  # noqa: E402
import types  # noqa: E402

import torch.nn as nn  # noqa: E402

import grid_bench  # noqa: E402
from bench import results  # noqa: E402

# grid_bench at test sizes: four grids that use every axis and ZeRO-1, torch's
# composition beside ours, two pipeline schedules against torch's (1F1B, and ZB-V on the V
# layout: 4 blocks, pieces r and 3-r), real and emulated
BENCH_SIZES = {"model": "tiny", "batch_size": 8, "seq_len": 32, "warmup": 0, "iters": 1,
               "rounds": 2, "lr": 3e-3,
               "pipeline": {"stages": [2], "schedules": ["1f1b", "zbv"],
                            "compute": ["real", "emulated"], "layers": 4, "rows": 1,
                            "seq_len": 16, "micro_batches": 2, "emulate_ms": 1.0}}
BENCH_GRIDS = [grid_bench.grid_spec(dp=2, tp=2, fsdp=True),
               grid_bench.grid_spec(pp=2, cp=2, micro_batches=2),
               grid_bench.grid_spec(cp=2, tp=2),
               grid_bench.grid_spec(dp=2, tp=2, dp_shard=2, micro_batches=2)]   # HSDP with tp
BENCH_COLUMNS = ["impl", "pair", "grid", "setting", "model", "batch_size", "seq_len", "micro_batches",
                 "world_size", "backend", "device", "step_ms", "tokens_per_s", "machine", "run_id"]
for _kind in [*grid_bench.KINDS, *(f"sent_{_axis}" for _axis in grid_bench.AXES)]:
    BENCH_COLUMNS += [f"{_kind}_bytes", f"{_kind}_bytes_formula"]


def forgets_tp_split(shape, spec, pp_rank, world_size):
    """Planted bug: a formula whose parameters forget that tensor parallelism splits them."""
    right = grid_bench.combined_formula(shape, spec, pp_rank, world_size)
    wrong = grid_bench.combined_formula(shape, {**spec, "tp": 1}, pp_rank, world_size)
    return {**right, "param": wrong["param"]}


def bench_past_the_deadline_then_whole(ctx, out: str, late: str) -> None:
    """Make bench's deadline for the step already past: the first grid only (issue 45); then the
    bench at test sizes, in the same launch."""
    os.environ["BENCH_STEP_DEADLINE"] = str(time.time() - 1)
    grid_bench.bench_worker(ctx, BENCH_SIZES, BENCH_GRIDS[2:], late)
    del os.environ["BENCH_STEP_DEADLINE"]
    grid_bench.bench_worker(ctx, BENCH_SIZES, BENCH_GRIDS, out)


def test_bench_counts_equal_the_combined_formula(tmp_path, capfd):
    """One 4-rank launch of the bench at tiny sizes: every rank's counted bytes equal the
    formula (ZeRO-1's optimizer state: lesson 1's whole-tensor deal; the group holds exactly the
    whole state, each rank within one tensor of the mean), torch's composition's bytes equal torch's formula, every first
    loss equals one process's, torch's pipeline computes our gradients; the CSV has its
    columns; a formula that forgets the tp split is caught. HSDP: shard 2 x tp 2 among the
    grids, and our HSDP 2 x 2 beside torch's (ours exact on every axis, torch's memory equal to
    its layout's formula; a formula that all-reduces the whole model over the replicas is
    caught). Past make bench's deadline, the first grid is measured and written, and the second
    grid, the rounds, torch's pairs and the pipelines are skipped in one line."""
    out = tmp_path / "bench.json"
    late = tmp_path / "late.json"
    launch.launch(bench_past_the_deadline_then_whole, launch.LaunchConfig(4, "gloo", "cpu"),
                  str(out), str(late), timeout_s=150)
    said = capfd.readouterr().out
    skipped = [line for line in said.splitlines() if "skipped" in line]
    assert len(skipped) == 1, said
    assert "grid dp_replicate1 dp_shard2 tp2, HSDP AdamW and what follows: skipped" in skipped[0]
    found = json.loads(late.read_text())
    assert [(row["grid"], row["steps_timed"]) for row in found["grid_rows"]] == [("cp2 tp2", 1)]
    assert found["torch_rows"] == found["pipeline_rows"] == [], found
    found = json.loads(out.read_text())
    # each of our grids timed in every round, its steps pooled into its row
    assert {row["steps_timed"] for row in found["grid_rows"]} == {2}, found["grid_rows"]
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
    assert caught == [(True, True)] * 4 + [(False, False)] * 4 + [(True, True)] * 8, caught
    torch_rows = found["torch_rows"]
    assert [(row["pair"], row["impl"], row["grid"]) for row in torch_rows] == [
        ("replicated_tp", "ours", "dp2 tp2"), ("replicated_tp", "torch", "dp2 tp2"),
        ("fsdp_tp", "ours", "dp2 tp2"), ("fsdp_tp", "torch", "dp2 tp2"),
        ("hsdp", "ours", "dp_replicate2 dp_shard2"), ("hsdp", "torch", "dp_replicate2 dp_shard2")]
    # HSDP (2, 2): every rank's every column equals the formula (all-gathers and reduce-
    # scatters on dp_shard, 1/2 of the model all-reduced on dp_replicate, nothing on dp_cp)
    ours_hsdp = torch_rows[4]
    assert ours_hsdp["worst_difference"] == 0, ours_hsdp
    assert ours_hsdp["sent_dp_shard_bytes"] > 0 and ours_hsdp["sent_dp_cp_bytes"] == 0
    # ... and a formula that all-reduces the whole model over the replicas is caught
    formula = grid_bench.combined_formula(shape, grid_bench.grid_spec(dp=4, dp_shard=2), 0, 4)
    whole_model = {**formula, "sent_dp_replicate": 2 * formula["sent_dp_replicate"]}
    counted = {kind: ours_hsdp[f"{kind}_bytes"] for kind in formula}
    assert grid_bench.worst_difference(counted, formula) == (0.0, "")
    assert grid_bench.worst_difference(counted, whole_model)[1] == "sent_dp_replicate"
    torch_hsdp = torch_rows[5]
    for kind in ("param", "grad", "optim"):    # fully_shard over 2 shard ranks, 1-D too
        assert torch_hsdp[f"{kind}_bytes"] == grid_bench.torch_formula(shape, 2, 1)[kind]
    assert torch_hsdp["sent_dp_shard_bytes"] > 0 and torch_hsdp["sent_dp_replicate_bytes"] > 0
    assert "ZeRO-1" in torch_rows[2]["setting"] and "ZeRO-1" not in torch_rows[0]["setting"]
    assert "replicate" in torch_rows[1]["setting"] and "fully_shard" in torch_rows[3]["setting"]
    for theirs, sharded in ((torch_rows[1], False), (torch_rows[3], True)):
        torch_formula = grid_bench.torch_formula(shape, 2, 2, sharded=sharded)
        for kind in ("param", "grad", "optim"):
            assert theirs[f"{kind}_bytes"] == torch_formula[kind], (kind, theirs)
        # its tensor-parallel collectives counted on tp (torch's plan sends more than ours:
        # vocabulary-parallel embeddings, whole logits), nothing on a group no axis names
        assert theirs["sent_tp_bytes"] > 0 and theirs["sent_other_bytes"] == 0, theirs
    losses = [row["first_loss"] for row in found["grid_rows"] + found["torch_rows"]]
    assert max(abs(loss - found["reference_loss"]) for loss in losses) < 1e-5, losses
    pipelines = found["pipeline_rows"]
    assert [(r["schedule"], r["impl"], r["compute"]) for r in pipelines] == [
        (schedule, impl, compute) for schedule in ("1f1b", "zbv") for compute in ("real", "emulated")
        for impl in ("ours", "torch")]
    for row in (pipelines[0], pipelines[4]):     # ZB-V: ours defers W, torch splits it itself
        assert row["gradient_max_difference"] < 1e-6, row
    assert pipelines[6]["ideal_ms"] > 0, pipelines[6]   # ZB-V, emulated: F, B and W each wait
    rows = results.read_csv("grid.csv")
    assert len(rows) == 4 + 6 + 8 and all(column in rows[0] for column in BENCH_COLUMNS), rows[0]
    assert sorted(row["pair"] for row in rows if row["pair"]) == (["fsdp_tp"] * 2 + ["hsdp"] * 2
                                                                  + ["replicated_tp"] * 2)
    assert rows[0]["machine"] == results.machine_name()


def test_bench_pipeline_sizes_suit_every_schedule():
    """Every pipeline schedule of the bench's sizes (the V ones too) takes its micro-batches
    and blocks on each pp; a count DualPipeV refuses (m < 2p) is named up front."""
    for name, sizes in grid_bench.SIZES.items():
        assert {"zbv", "dualpipev"} <= set(sizes["pipeline"]["schedules"]), name
        for world_size, grids in grid_bench.GRIDS.items():
            assert grid_bench.size_problems(sizes, grids, world_size) == [], (name, world_size)
    too_few = {**grid_bench.SIZES["cpu"]["pipeline"], "micro_batches": 4}     # 4 < 2 x 4
    problems = grid_bench.pipeline_schedule_problems(too_few, 4)
    assert len(problems) == 1 and problems[0].startswith("pipeline: dualpipev on 4 stages"), \
        problems
    # the launch's check that ours and torch's gradients agree can fail: one value off, caught
    ours = nn.Linear(3, 2)
    theirs = copy.deepcopy(ours)
    for module in (ours, theirs):
        module(torch.ones(1, 3)).sum().backward()
    built = {"our_chunks": [ours], "torch_stages": [types.SimpleNamespace(submod=theirs)]}
    assert grid_bench.gradient_difference(built) == 0.0
    theirs.bias.grad[1] += 0.5
    assert grid_bench.gradient_difference(built) == 0.5


def test_bench_refuses_a_world_size_without_grids(capsys, monkeypatch):
    """grid_bench.py's main, in this process: a world size it has no grids for, one line."""
    def no_launch(*args, **kwargs):
        raise AssertionError("a bad bench reached the launch")
    monkeypatch.setattr(launch, "launch", no_launch)
    assert_main_usage_error(grid_bench.main, ["--bench", "--world-size", "3"], capsys,
                            "--bench runs its grids on 4 or 8 ranks, not 3")
