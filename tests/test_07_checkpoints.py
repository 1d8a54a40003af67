"""Stage 07, lesson 8: sharded checkpoints, resharded loads, crash-safe saves, exact resumes.

One 4-rank launch runs the lesson's own checks (``run_checkpoint.run_checks``: FSDP 4 -> FSDP 3
and one process, (dp, tp) = (2, 2) -> (pp, dp) = (2, 2) and one process, ZeRO-1 at 3 -> plain
AdamW; bitwise loads, continued training equal to training that never stopped, bytes written
and read counted against formulas, damaged checkpoints refused), then, for each planted bug
(negative controls), the check that must catch it, run with the bug in place, then a save
during which rank 1 is killed. A second test drives lesson 7's train.py: a run killed
mid-training and restarted by the test, a run under ``torchrun --max-restarts=1`` that restarts
itself (beside the rest), and a resume that restarts the data order (planted), against a run
that never stopped; then a damaged and a foreign checkpoint given to train.py, refused in one
line with exit status 2. Bad flags are refused before any worker starts.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import checkpoint
import layouts
import run_checkpoint
import train
from common import launch
from helpers import REPO, assert_main_usage_error

# --------------------------------------------------------------------------- planted bugs


def place_ignoring_offsets(staging, local_box, full_box, overlap):
    """Planted: every overlap put at the start of the local box, whatever its offset."""
    where = []
    for (local_start, _), (start, stop) in zip(local_box, overlap):
        where.append([local_start, local_start + stop - start])
    return staging[checkpoint.as_index(where)]


ORIGINAL_READ_OVERLAP = checkpoint.Reader.read_overlap


def read_whole_saved_boxes(self, name, saved, overlap, region):
    """Planted: each saved box read whole, then cut to the overlap (reads more than it holds)."""
    whole = torch.empty(checkpoint.box_shape(saved["box"]), dtype=region.dtype)
    ORIGINAL_READ_OVERLAP(self, name, saved, saved["box"], whole)
    index = []
    for (start, stop), (saved_start, _) in zip(overlap, saved["box"]):
        index.append(slice(start - saved_start, stop - saved_start))
    region.copy_(whole[tuple(index)])


def no_checksum_check(self, *args):
    """Planted: the bytes read are not checked against their CRC32."""


ORIGINAL_FSDP_LAYOUT = layouts.fsdp_layout


def fsdp_layout_every_rank_writes(*args, **kwargs):
    """Planted: replicas (the 1-D parameters, the steps) written by every rank."""
    layout = ORIGINAL_FSDP_LAYOUT(*args, **kwargs)
    for item in layout:
        item["write"] = True
    return layout


PLANTS = {  # label: (module or class, attribute, the planted function)
    "load ignores offsets": (checkpoint, "place", place_ignoring_offsets),
    "reads whole saved boxes": (checkpoint.Reader, "read_overlap", read_whole_saved_boxes),
    "checksums unchecked": (checkpoint.Reader, "check_units", no_checksum_check),
    "replicas written by every rank": (layouts, "fsdp_layout", fsdp_layout_every_rank_writes),
}


def save_manifest_first(root, layout, step, rank_that_dies):
    """Planted: the manifest committed BEFORE the shards are written; then ``rank_that_dies``
    dies before writing its own (simulated: it writes nothing)."""
    rank = dist.get_rank()
    folder = checkpoint.checkpoint_folder(root, step)
    if rank == 0:
        checkpoint.prepare_folder(folder)
    dist.barrier()
    pieces, records = checkpoint.pack(layout, {})
    size = 0
    for piece in pieces:
        size += piece.numel() * piece.element_size()
    file_name = f"rank_{rank:05d}.bin"
    everyone = checkpoint.gather_to_rank_0((file_name, size, records), None)
    if rank == 0:
        manifest, _ = checkpoint.build_manifest(step, "fsdp", dist.get_world_size(), {},
                                                everyone)
        checkpoint.commit_manifest(folder, manifest)
    dist.barrier()
    if rank != rank_that_dies:
        checkpoint.write_file(folder / file_name, pieces)
    dist.barrier()


# --------------------------------------------------------------------------- after a crash


def crash_problems(root: Path, step_before: int, truth: dict) -> list[str]:
    """After a crash during the save that followed ``step_before``'s: the newest complete
    checkpoint must be ``step_before``'s, load (consolidate), and hold ``truth`` bitwise."""
    folder = checkpoint.latest_checkpoint(root)
    if folder != checkpoint.checkpoint_folder(root, step_before):
        return [f"the newest complete checkpoint is {folder}, not step {step_before}'s"]
    try:
        state = checkpoint.consolidate(folder)
    except checkpoint.CheckpointError as error:
        return [f"step {step_before}'s checkpoint does not load: {error}"]
    got = {}
    for name, value in state["model"].items():
        got[f"model.{name}"] = value
    for index, name in enumerate(state["meta"]["parameter_order"]):
        for key, value in state["optimizer"]["state"][index].items():
            got[f"optimizer.{name}.{key}"] = value
    return run_checkpoint.bitwise_problems("after the crash", got, truth)


def fsdp_model_for_crash(ctx, fsdp_mod):
    model = run_checkpoint.tiny_lm(seed=1)
    full_shapes = {}
    for name, p in model.named_parameters():
        full_shapes[name] = list(p.shape)
    fsdp = fsdp_mod.FSDP(model)
    optimizer = torch.optim.AdamW(fsdp.parameters(), lr=run_checkpoint.LR)
    return fsdp, optimizer, full_shapes


def planted_run(ctx, label: str, root: Path, folder: Path, truth: dict, full_shapes: dict,
                fsdp, optimizer) -> dict:
    """The check that must catch ``label``'s planted bug, run with it: loading the FSDP
    checkpoint ``folder`` of W ranks at W - 1 (bitwise, bytes read), damaged copies of it, or
    saving a layout (replicas once)."""
    owner, attribute, planted = PLANTS[label]
    original = getattr(owner, attribute)
    setattr(owner, attribute, planted)
    result = {"problems": [], "refused": None}
    try:
        if label == "checksums unchecked":
            result["problems"], _ = run_checkpoint.damaged_case(ctx, folder, root)
        elif label == "replicas written by every rank":
            layout = layouts.fsdp_layout(fsdp, optimizer, full_shapes)
            checkpoint.save(root, layout, 1, "fsdp")
        else:
            found, _, _ = run_checkpoint.fsdp_smaller_problems(ctx, folder, truth, full_shapes)
            result["problems"] = run_checkpoint.agree(found)
    except checkpoint.CheckpointError as error:
        result["refused"] = str(error)
    finally:
        setattr(owner, attribute, original)
    return result


def crash_worker(ctx, root_text: str) -> None:
    """The lesson's checks; the check each planted bug must fail, with it; manifest-first with
    a rank that dies; then a real save during which rank 1 is killed (the launch ends there)."""
    root = Path(root_text)
    _, fsdp_mod, _, _ = run_checkpoint.lessons()
    findings = {"correct": run_checkpoint.run_checks(ctx, root / "correct")}
    # the state the planted runs and the crash scenarios save at step 1 (made whole without
    # the library: the truth)
    fsdp, optimizer, full_shapes = fsdp_model_for_crash(ctx, fsdp_mod)
    run_checkpoint.fsdp_step(fsdp, optimizer, 0, 2 * ctx.world_size, None)
    truth = run_checkpoint.fsdp_full_state(fsdp, optimizer, full_shapes, None)
    meta = run_checkpoint.meta_for(list(full_shapes), optimizer)
    layout = layouts.fsdp_layout(fsdp, optimizer, full_shapes)
    for name in ("base", "manifest_first", "crash"):
        checkpoint.save(root / name, layout, 1, "fsdp", meta)
    base = checkpoint.latest_checkpoint(root / "base")
    for label in PLANTS:
        findings[label] = planted_run(ctx, label, root / label.replace(" ", "_"), base, truth,
                                      full_shapes, fsdp, optimizer)
    save_manifest_first(root / "manifest_first", layout, 2, rank_that_dies=1)
    if ctx.is_main:
        findings["manifest first"] = crash_problems(root / "manifest_first", 1, truth)
        torch.save(truth, root / "truth.pt")
        (root / "findings.json").write_text(json.dumps(findings))
    dist.barrier()
    if ctx.rank == 1:                       # killed while writing its file: half of it on disk
        def write_half_then_die(path, pieces):
            with open(path, "wb") as f:
                for piece in pieces[:len(pieces) // 2]:
                    f.write(checkpoint.memory_of(piece))
            os.kill(os.getpid(), signal.SIGKILL)
        checkpoint.write_file = write_half_then_die
    run_checkpoint.fsdp_step(fsdp, optimizer, 1, 2 * ctx.world_size, None)
    checkpoint.save(root / "crash", layout, 2, "fsdp", meta)
    raise AssertionError("the save during which rank 1 was killed returned")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """One 4-rank launch (it ends with rank 1 killed mid-save, by design)."""
    root = tmp_path_factory.mktemp("checkpoints")
    with pytest.raises(SystemExit) as ended:
        launch.launch(crash_worker, launch.LaunchConfig(4, "gloo", "cpu"), str(root),
                      timeout_s=300)
    assert ended.value.code == 1
    findings_file = root / "findings.json"
    assert findings_file.exists(), "the launch ended before the checks finished"
    return root, json.loads(findings_file.read_text())


def test_layouts_reshard_bitwise_and_read_exactly_their_overlap(four_ranks):
    _, findings = four_ranks
    correct = findings["correct"]
    assert correct["problems"] == [], correct["problems"][:10]
    assert correct["worst"] < run_checkpoint.WEIGHT_ATOL
    by_case = {}
    for row in correct["rows"]:
        assert row["bytes"] == row["expected"], row
        by_case.setdefault(row["case"], []).append(row["bytes"])
    full = run_checkpoint.full_state_bytes()
    # every element written once: the ranks' files add up to the whole state, exactly
    for case in ("save FSDP 4", "save dp 2 x tp 2"):
        assert sum(by_case[case]) == full, (case, by_case[case], full)
    assert len(by_case["save ZeRO-1 3"]) == 3 and sum(by_case["save ZeRO-1 3"]) == full
    assert len(by_case["load FSDP 3"]) == 3 and len(by_case["load pp 2 x dp 2"]) == 4


def test_damaged_checkpoints_are_refused_in_one_line_and_nothing_is_loaded(four_ranks):
    _, findings = four_ranks
    damaged = findings["correct"]["damaged"]
    expected_finders = {"truncated": [3], "corrupted rows": [1],
                        "corrupted replica": [0, 1, 2, 3], "missing file": [3],
                        "no manifest": [0, 1, 2, 3], "another model": [0, 1, 2, 3],
                        "cannot hold": [0, 1, 2, 3]}
    assert sorted(damaged) == sorted(expected_finders)
    for label, finders in expected_finders.items():
        result = damaged[label]
        assert result["message"] is not None and "\n" not in result["message"], label
        assert result["found_by"] == finders and result["unchanged"], (label, result)


def test_planted_bugs_are_caught(four_ranks):
    _, findings = four_ranks
    offsets = findings["load ignores offsets"]["problems"]
    assert any("not bitwise equal to what was saved" in p for p in offsets), offsets[:3]
    whole = findings["reads whole saved boxes"]["problems"]
    assert any("FSDP 4 -> FSDP 3: read" in p for p in whole), whole[:3]
    unchecked = findings["checksums unchecked"]["problems"]
    assert any("damaged (corrupted rows): loaded without an error" in p for p in unchecked)
    twice = findings["replicas written by every rank"]["refused"]
    assert twice is not None and "a replica written twice" in twice, twice
    assert findings["reads whole saved boxes"]["refused"] is None
    manifest_first = findings["manifest first"]
    assert manifest_first and "not step 1's" in manifest_first[0], manifest_first


def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint(four_ranks):
    root, _ = four_ranks
    crash = root / "crash"
    truth = torch.load(root / "truth.pt")
    assert crash_problems(crash, 1, truth) == []
    partial = checkpoint.checkpoint_folder(crash, 2)
    assert not (partial / checkpoint.MANIFEST).exists()
    half = (partial / "rank_00001.bin").stat().st_size      # the save had begun: rank 1's
    assert 0 < half < (checkpoint.checkpoint_folder(crash, 1) / "rank_00001.bin").stat().st_size
    # a new save of step 2 (one process) replaces the partial folder; the newest two are kept
    state = checkpoint.consolidate(checkpoint.latest_checkpoint(crash))
    model = run_checkpoint.tiny_lm(seed=9)
    model.load_state_dict(state["model"])
    for step in (2, 3):
        checkpoint.save(crash, layouts.replicated_layout(model), step, "one process")
    assert [step for step, _ in checkpoint.list_checkpoints(crash)] == [2, 3]
    assert sorted(path.name for path in crash.iterdir()) == ["step_000000002", "step_000000003"]
    with pytest.raises(checkpoint.CheckpointError, match="never overwritten"):
        checkpoint.save(crash, layouts.replicated_layout(model), 3, "one process")


# --------------------------------------------------------------------------- train.py


TEXT = (REPO / "README.md").read_text() * 3
STEPS = 6
# Weights of a pipeline (pp 2) against one process after STEPS AdamW steps: they sum a few
# gradients in another order (measured: 1.2e-7, float32 rounding); a resume that restarts the
# data order moves them by about the learning rate times the steps (3e-3).
TRAIN_ATOL = 1e-5


def train_argv(data: Path, *extra) -> list[str]:
    return ["--backend", "gloo", "--device", "cpu", "--batch-size", "8", "--seq-len", "32",
            "--steps", str(STEPS), "--log-every", str(STEPS), "--eval-batches", "1", "--data",
            str(data), *extra]


def train_args(data: Path, **changes) -> argparse.Namespace:
    """train.py's flags for one rank, as its main() would make them."""
    parser_args = dict(dp=1, pp=1, cp=1, tp=1, fsdp=False, schedule="1f1b", chunks=1,
                       micro_batches=1, model="tiny", steps=STEPS, batch_size=8, seq_len=32,
                       lr=3e-3, seed=0, data=str(data), max_bytes=4_000_000, log_every=STEPS,
                       eval_batches=1, check=False, check_steps=3, save_full=None,
                       checkpoint_dir=None, checkpoint_every=None, crash_at_step=None)
    parser_args.update(changes)
    return argparse.Namespace(**parser_args)


def curve_losses() -> dict:
    """step -> loss, from the last train.py run's results/train_curve.csv (then removed)."""
    path = Path(os.environ["RESULTS_DIR"]) / "train_curve.csv"
    losses = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            losses[int(row["step"])] = float(row["loss"])
    path.unlink()
    return losses


def one_rank_run(args) -> None:
    """train.py's training on a 1-rank group in this process (no worker to start)."""
    store = Path(tempfile.mkdtemp(prefix="one-rank-")) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        context = launch.Dist(0, 1, 0, "gloo", torch.device("cpu"))
        train.train_main(context, args)
    finally:
        dist.destroy_process_group()


def planted_data_order_restart(args) -> None:
    """Planted: a resume that restarts the data order (batch 0 again after the resume)."""
    resume_module = train.checkpoints_lesson()
    original_resume = resume_module.TrainingCheckpoints.resume
    original_batch = train.Text.batch
    resumed_at = {}

    def resume_and_remember(self):
        resumed_at["step"] = original_resume(self)
        return resumed_at["step"]

    def batch_from_the_start(self, step):
        return original_batch(self, step - resumed_at["step"])
    resume_module.TrainingCheckpoints.resume = resume_and_remember
    train.Text.batch = batch_from_the_start
    try:
        one_rank_run(args)
    finally:
        resume_module.TrainingCheckpoints.resume = original_resume
        train.Text.batch = original_batch


def largest_difference(path: Path, want: dict) -> float:
    got = torch.load(path)
    largest = 0.0
    for name, value in want.items():
        largest = max(largest, (got[name] - value).abs().max().item())
    return largest


def start_torchrun(data: Path, folder: Path) -> subprocess.Popen:
    """train.py under torchrun --max-restarts=1, two ranks (pp 2): rank 1 killed after step 3,
    the group restarted by torchrun and resumed from step 2's checkpoint. (With
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: torch 2.13's restarted workers otherwise meet in the
    store of the attempt before and cannot connect; see the README.)"""
    port = launch.free_port()
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
            "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            str(REPO / "07_parallelism" / "07_together" / "train.py"),
            *train_argv(data, "--pp", "2", "--checkpoint-dir", str(folder / "torchrun"),
                        "--checkpoint-every", "2", "--crash-at-step", "3", "--save-full",
                        str(folder / "torchrun.pt"))]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "RESULTS_DIR": str(folder / "torchrun_results")}
    return subprocess.Popen(argv, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)


def test_train_py_resumes_after_a_crash_as_the_same_run(tmp_path, capfd, monkeypatch):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    # the runs in this process skip the picture and the generated sample (presentation only)
    monkeypatch.setattr(train, "plot_curve", lambda *args: None)
    monkeypatch.setattr(train, "sample", lambda *args: "")
    torchrun = start_torchrun(data, tmp_path)       # runs beside the rest of this test
    crashed = tmp_path / "crashed"
    # 1. the worker killed after step 5 (checkpoints at steps 2 and 4): the run ends
    with pytest.raises(SystemExit) as ended:
        train.main(train_argv(data, "--world-size", "1", "--checkpoint-dir", str(crashed),
                              "--checkpoint-every", "2", "--crash-at-step", "5"))
    assert ended.value.code == 1
    assert [step for step, _ in checkpoint.list_checkpoints(crashed)] == [2, 4]
    # 2. restarted by the test (one rank, in this process) beside the run that never stopped:
    #    bitwise equal, losses and weights; a resume that restarts the data order (planted) not
    for name in ("resumed", "planted"):
        shutil.copytree(crashed, tmp_path / name)
    one_rank_run(train_args(data, checkpoint_dir=str(tmp_path / "resumed"),
                            save_full=str(tmp_path / "resumed.pt")))
    resumed_losses = curve_losses()
    planted_data_order_restart(train_args(data, checkpoint_dir=str(tmp_path / "planted"),
                                          save_full=str(tmp_path / "planted.pt")))
    curve_losses()
    one_rank_run(train_args(data, save_full=str(tmp_path / "never_stopped.pt")))
    never_stopped_losses = curve_losses()
    never_stopped = torch.load(tmp_path / "never_stopped.pt")
    assert sorted(resumed_losses) == [5, 6]
    for step in (5, 6):
        assert resumed_losses[step] == never_stopped_losses[step]
    assert largest_difference(tmp_path / "resumed.pt", never_stopped) == 0.0
    planted = largest_difference(tmp_path / "planted.pt", never_stopped)
    assert planted > 100 * TRAIN_ATOL, planted
    # 3. a damaged checkpoint (through the launcher: the run exits 2), and one of another run
    #    (here): one line, exit status 2
    newest = checkpoint.latest_checkpoint(tmp_path / "resumed")
    run_checkpoint.flip_byte(newest / "rank_00000.bin", 100)
    capfd.readouterr()
    with pytest.raises(SystemExit) as refused:
        train.main(train_argv(data, "--world-size", "1", "--checkpoint-dir",
                              str(tmp_path / "resumed")))
    assert refused.value.code == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "rank_00000.bin: corrupted" in lines[0], lines
    with pytest.raises(SystemExit) as refused:
        one_rank_run(train_args(data, checkpoint_dir=str(crashed), seed=1))
    assert refused.value.code == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "saved by a run with --seed 0, this one has 1" in lines[0], lines
    # 4. torchrun's restarted run: against one process at float32 tolerance (TRAIN_ATOL)
    output = torchrun.communicate(timeout=240)[0]
    assert torchrun.returncode == 0, output[-4000:]
    assert "[rank 1] --crash-at-step 3: killing this worker" in output, output[-3000:]
    assert "(step 2, saved from grid dp 1 x pp 2" in output, output[-3000:]
    difference = largest_difference(tmp_path / "torchrun.pt", never_stopped)
    assert difference < TRAIN_ATOL, difference


@pytest.mark.parametrize("main, argv, needle", [
    (train.main, ["--checkpoint-every", "2"], "need --checkpoint-dir"),
    (train.main, ["--crash-at-step", "2"], "need --checkpoint-dir"),
    (train.main, ["--checkpoint-dir", "README.md"], "not a folder"),
    (run_checkpoint.main, [], "give 2 ranks or more"),
    (run_checkpoint.main, ["--bench", "--world-size", "2"], "give 3 ranks or more"),
    (run_checkpoint.main, ["--iters", "0"], "is not a whole number >= 1"),
])
def test_bad_flags_are_refused_before_any_worker_starts(main, argv, needle, capsys,
                                                         monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("bad flags reached the launch")
    monkeypatch.setattr(launch, "launch", no_launch)
    monkeypatch.chdir(REPO)
    assert_main_usage_error(main, ["--world-size", "1", *argv], capsys, needle)
