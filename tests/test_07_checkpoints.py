"""Stage 07, lesson 8: sharded checkpoints, resharded loads, crash-safe saves, exact resumes,
untrusted folders.

One 4-rank launch runs the lesson's checks (``checks_checkpoint.run_checks``: FSDP 4 -> FSDP 3
and one process, (dp, tp) = (2, 2) -> (pp, dp) = (2, 2) and one process, ZeRO-1 at 3 -> plain
AdamW; bitwise loads, continued training equal to training that never stopped, bytes written
and read counted against formulas, damaged checkpoints refused), then, for each planted bug
(negative controls), the check that must catch it, run with the bug in place, then a save
during which rank 1 is killed. In one process: manifests that point outside their folder,
damaged manifests, pruning beside a user's folders, the lock, a save stopped inside its
manifest, manifests and lock files made to stall or exhaust a load (issue 44), and resume.py's
TrainingCheckpoints directly (random state, data order, refusals). resume.py and the demo run
as subprocesses (nothing here imports a run script): a run killed mid-training and restarted,
beside lesson 7's train.py that never stopped, and a run under ``torchrun --max-restarts=1``
that restarts itself. Bad flags are refused before any worker starts.
"""

from __future__ import annotations

import argparse
import base64
import csv
import datetime
import json
import os
import resource
import random
import runpy
import shutil
import socket
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import checkpoint
import checks_checkpoint as checks
import layouts
import resume
import safety
from common import import_stage
from bench import supervisor as launch
from common import launch as course_launch
from helpers import REPO

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


ORIGINAL_FSDP_LAYOUT = checks.fsdp_layout
ORIGINAL_AGREE = checkpoint.agree


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
    "replicas written by every rank": (checks, "fsdp_layout", fsdp_layout_every_rank_writes),
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
    everyone = checkpoint.agree(None, None, (file_name, size, records))
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
    return checks.bitwise_problems("after the crash", got, truth)


def fsdp_model_for_crash(ctx, fsdp_mod):
    model = checks.tiny_lm(seed=1)
    full_shapes = {}
    for name, p in model.named_parameters():
        full_shapes[name] = list(p.shape)
    fsdp = fsdp_mod.FSDP(model)
    optimizer = torch.optim.AdamW(fsdp.parameters(), lr=checks.LR)
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
            result["problems"], _ = checks.damaged_case(ctx, folder, root)
        elif label == "replicas written by every rank":
            result["refused_on"], result["refused"] = save_verdicts(ctx, root, fsdp, optimizer,
                                                                    full_shapes)
        else:
            found, _, _ = checks.fsdp_smaller_problems(ctx, folder, truth, full_shapes)
            result["problems"] = checks.agree(found)
    except checkpoint.CheckpointError as error:
        result["refused"] = str(error)
    finally:
        setattr(owner, attribute, original)
    return result


def save_verdicts(ctx, root: Path, fsdp, optimizer, full_shapes: dict) -> tuple:
    """Save a layout that writes every replica on every rank (checkpoint.save must refuse it):
    the ranks on which save raised, gathered from every rank, and this rank's message (a
    verdict raised on rank 0 alone, the others returning "saved", is a bug: they train on)."""
    layout = checks.fsdp_layout(fsdp, optimizer, full_shapes)
    message = None
    try:
        checkpoint.save(root, layout, 1, "fsdp")
    except checkpoint.CheckpointError as error:
        message = str(error)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, message)
    refused_on = [rank for rank, theirs in enumerate(everyone) if theirs is not None]
    return refused_on, message


def agree_on_rank_0_only(problem, group, mine=None):
    """Planted: a verdict raised on rank 0 alone; every other rank returns (the collective
    still runs: the ranks stay in step, only the verdict is not shared)."""
    everyone = ORIGINAL_AGREE(None, group, mine)
    if problem is not None and dist.get_rank() == 0:
        raise checkpoint.CheckpointError(problem, found_by=[0])
    return everyone


def crash_worker(ctx, root_text: str) -> None:
    """The lesson's checks; the check each planted bug must fail, with it; manifest-first with
    a rank that dies; then a real save during which rank 1 is killed (the launch ends there)."""
    root = Path(root_text)
    _, fsdp_mod, _, _ = checks.lessons()
    findings = {"correct": checks.run_checks(ctx, root / "correct")}
    # the state the planted runs and the crash scenarios save at step 1 (made whole without
    # the library: the truth)
    fsdp, optimizer, full_shapes = fsdp_model_for_crash(ctx, fsdp_mod)
    checks.fsdp_step(fsdp, optimizer, 0, 2 * ctx.world_size, None)
    truth = checks.fsdp_full_state(fsdp, optimizer, full_shapes, None)
    meta = checks.meta_for(list(full_shapes), optimizer)
    layout = checks.fsdp_layout(fsdp, optimizer, full_shapes)
    for name in ("base", "manifest_first", "crash"):
        checkpoint.save(root / name, layout, 1, "fsdp", meta)
    base = checkpoint.latest_checkpoint(root / "base")
    for label in PLANTS:
        findings[label] = planted_run(ctx, label, root / label.replace(" ", "_"), base, truth,
                                      full_shapes, fsdp, optimizer)
    original_agree = checkpoint.agree               # planted: the verdict on rank 0 only
    checkpoint.agree = agree_on_rank_0_only
    try:
        findings["verdict on rank 0 only"] = planted_run(
            ctx, "replicas written by every rank", root / "rank_0_only", base, truth,
            full_shapes, fsdp, optimizer)
    finally:
        checkpoint.agree = original_agree
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
    checks.fsdp_step(fsdp, optimizer, 1, 2 * ctx.world_size, None)
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
    assert correct["worst"] < checks.WEIGHT_ATOL
    by_case = {}
    for row in correct["rows"]:
        assert row["bytes"] == row["expected"], row
        by_case.setdefault(row["case"], []).append(row["bytes"])
    full = checks.full_state_bytes()
    # every element written once: the ranks' files add up to the whole state, exactly
    for case in ("save FSDP 4", "save dp 2 x tp 2", "save HSDP 2 x 2"):
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
    twice = findings["replicas written by every rank"]
    assert twice["refused"] is not None and "a replica written twice" in twice["refused"], twice
    # the save's verdict reached every rank; with it raised on rank 0 alone, the check sees it
    assert twice["refused_on"] == [0, 1, 2, 3], twice
    assert findings["verdict on rank 0 only"]["refused_on"] == [0], findings
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
    model = checks.tiny_lm(seed=9)
    model.load_state_dict(state["model"])
    for step in (2, 3):
        checkpoint.save(crash, layouts.replicated_layout(model), step, "one process")
    assert [step for step, _ in checkpoint.list_checkpoints(crash)] == [2, 3]
    assert sorted(path.name for path in crash.iterdir()) == ["step_000000002", "step_000000003"]
    with pytest.raises(checkpoint.CheckpointError, match="never overwritten"):
        checkpoint.save(crash, layouts.replicated_layout(model), 3, "one process")


# --------------------------------------------------------------------------- untrusted files


def small_checkpoint(root: Path, step: int = 2) -> tuple[Path, torch.nn.Module]:
    """One process's checkpoint of a small model with its AdamW state, under ``root``."""
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    optimizer.step()
    checkpoint.save(root, layouts.replicated_layout(model, optimizer), step, "one process")
    return checkpoint.checkpoint_folder(root, step), model


def edit_manifest(folder: Path, change) -> None:
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
    change(manifest)
    (folder / checkpoint.MANIFEST).write_text(json.dumps(manifest))


def refused_everywhere(folder: Path, model: torch.nn.Module, *needles) -> str:
    """``folder`` refused by consolidate and by load, one line with every needle, and the
    layout loaded into untouched."""
    with pytest.raises(checkpoint.CheckpointError) as refused:
        checkpoint.consolidate(folder)
    message = str(refused.value)
    assert "\n" not in message and all(needle in message for needle in needles), message
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load(folder, layouts.replicated_layout(model))
    for p, value in zip(model.parameters(), before):
        assert torch.equal(p, value)
    return message


def test_a_checkpoint_never_reads_outside_its_folder(tmp_path):
    """A manifest naming a file outside the folder (a copy of the right bytes, so size and
    CRC32 match), an absolute path, ``..``, a name not of the format, and a shard replaced by
    a symbolic link: refused in one line naming the file, nothing loaded."""
    folder, model = small_checkpoint(tmp_path / "root")
    outside = tmp_path / "outside.bin"
    shutil.copy(folder / "rank_00000.bin", outside)
    shard_size = outside.stat().st_size
    names = {"an absolute path": str(outside), "..": "../../outside.bin",
             "a sub-folder": "sub/rank_00000.bin", "another name": "notes.txt"}
    for label, name in names.items():
        copy = tmp_path / label.replace(" ", "_") / folder.name
        shutil.copytree(folder, copy)
        (copy / "sub").mkdir()
        shutil.copy(outside, copy / "sub" / "rank_00000.bin")

        def point_outside(manifest, name=name):
            manifest["files"] = {name: shard_size}
            for info in manifest["tensors"].values():
                for saved in info["slices"]:
                    saved["file"] = name
        edit_manifest(copy, point_outside)
        refused_everywhere(copy, model, repr(name), "a shard is rank_<digits>.bin")
    link = tmp_path / "symlink" / folder.name
    shutil.copytree(folder, link)
    (link / "rank_00000.bin").unlink()
    (link / "rank_00000.bin").symlink_to(outside)
    refused_everywhere(link, model, str(link / "rank_00000.bin"), "symbolic link")
    manifest_link = tmp_path / "manifest_link" / folder.name
    shutil.copytree(folder, manifest_link)
    (tmp_path / "manifest.json").write_text((folder / checkpoint.MANIFEST).read_text())
    (manifest_link / checkpoint.MANIFEST).unlink()
    (manifest_link / checkpoint.MANIFEST).symlink_to(tmp_path / "manifest.json")
    refused_everywhere(manifest_link, model, "symbolic link")
    checkpoint.consolidate(folder)              # the original, untouched, loads


def set_key(path, value):
    """A change to the manifest: the key at ``path`` (keys and list indexes) set to ``value``
    (or removed, for the marker REMOVE)."""
    def change(manifest):
        node = manifest
        for key in path[:-1]:
            node = node[key] if not isinstance(node, dict) or key in node else node[key]
        if value is REMOVE:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    return change


REMOVE = object()
FIRST = ("tensors", "model.0.weight")
SLICE = (*FIRST, "slices", 0)
DAMAGED_MANIFESTS = {   # label: (change, words in the message)
    "no tensors": (set_key(("tensors",), REMOVE), "tensors"),
    "no step": (set_key(("step",), REMOVE), "step None"),
    "tensors a list": (set_key(("tensors",), []), "tensors"),
    "a slice a list": (set_key(SLICE, []), "not an object"),
    "a box of one pair": (set_key((*SLICE, "box"), [[0, 5]]), "box"),
    "a box past the shape": (set_key((*SLICE, "box"), [[0, 50], [0, 6]]), "not inside"),
    "a bad crc32": (set_key((*SLICE, "crc32"), "not base64!"), "crc32"),
    "too few crc32s": (set_key((*SLICE, "crc32"), "AAAAAA=="), "CRC32s"),
    "a negative offset": (set_key((*SLICE, "offset"), -4), "offset"),
    "a string offset": (set_key((*SLICE, "offset"), "0"), "offset"),
    "an offset past the file": (set_key((*SLICE, "offset"), 10**6), "past the"),
    "a string step": (set_key(("step",), "2"), "step '2'"),
    "a float step": (set_key(("step",), 2.0), "step 2.0"),
    "step -3": (set_key(("step",), -3), "step -3"),
    "step 1e30": (set_key(("step",), 1e30), "step 1e+30"),
    "another folder's step": (set_key(("step",), 1), "says step 1, its folder step 2"),
    "block_columns 0": (set_key((*FIRST, "block_columns"), 0), "block_columns 0"),
    "a dtype torch has but the format does not": (set_key((*FIRST, "dtype"), "save"), "dtype"),
    "a shape of strings": (set_key((*FIRST, "shape"), ["5", "6"]), "shape"),
    "meta a list": (set_key(("meta",), []), "meta"),
    "files sizes a string": (set_key(("files", "rank_00000.bin"), "1"), "size"),
    "world_size 0": (set_key(("world_size",), 0), "world_size"),
    "a dtype that is a list": (set_key((*FIRST, "dtype"), []), "dtype"),
    "two boxes sharing bytes": (set_key(("tensors", "model.0.bias", "slices", 0, "offset"), 0),
                                "share bytes"),
}


def test_a_damaged_manifest_is_refused_in_one_line_before_anything_is_read(tmp_path):
    folder, model = small_checkpoint(tmp_path / "root")
    for label, (change, words) in DAMAGED_MANIFESTS.items():
        copy = tmp_path / label.replace(" ", "_") / folder.name
        shutil.copytree(folder, copy)
        edit_manifest(copy, change)
        message = refused_everywhere(copy, model, str(copy / checkpoint.MANIFEST))
        assert words in message, (label, message)
    renamed = tmp_path / "renamed" / "best"           # not a checkpoint's folder name
    shutil.copytree(folder, renamed)
    refused_everywhere(renamed, model, "not a checkpoint's folder")


def test_pruning_touches_only_the_folders_this_format_made(tmp_path):
    root = tmp_path / "ckpt"
    user = root / "step_000000001"                  # the user's, named like a checkpoint
    user.mkdir(parents=True)
    (user / "notes.txt").write_text("mine")
    (root / "step_000000002").mkdir()              # the user's, with a manifest of its own
    (root / "step_000000002" / checkpoint.MANIFEST).write_text("{}")
    linked = tmp_path / "elsewhere"
    shutil.copytree(root / "step_000000002", linked)
    (linked / checkpoint.MARKER).write_text(checkpoint.FORMAT)
    (root / "step_000000000").symlink_to(linked)    # a link to a folder that looks ours
    folder, model = small_checkpoint(root, step=3)
    (folder.parent / "step_000000004").mkdir()       # ours, a save that crashed: no manifest
    (folder.parent / "step_000000004" / checkpoint.MARKER).write_text(checkpoint.FORMAT)
    for step in (5, 6, 7):
        checkpoint.save(root, layouts.replicated_layout(model), step, "one process")
    assert [step for step, _ in checkpoint.list_checkpoints(root)] == [6, 7]
    assert (user / "notes.txt").read_text() == "mine"
    assert (root / "step_000000002" / checkpoint.MANIFEST).exists() and linked.is_dir()
    assert not (root / "step_000000004").exists() and not folder.exists()
    # a save onto the user's folder refuses and leaves it alone
    with pytest.raises(checkpoint.CheckpointError, match="not made by this format"):
        checkpoint.save(root, layouts.replicated_layout(model), 1, "one process")
    assert (user / "notes.txt").read_text() == "mine"


def made(folder: Path) -> Path:
    folder.mkdir(parents=True)
    return folder


def test_one_run_per_checkpoint_directory(tmp_path):
    """The lock: a second holder refused in one line naming the first; a killed holder's lock
    file left behind is taken again (flock dies with its process)."""
    root = made(tmp_path / "ckpt")
    held = checkpoint.lock(root)
    with pytest.raises(checkpoint.CheckpointError, match=f"held by process {os.getpid()}"):
        checkpoint.lock(root)
    checkpoint.unlock(held)
    child = os.fork()
    if child == 0:                              # a run that takes the lock and is killed
        checkpoint.lock(root)
        os.kill(os.getpid(), signal.SIGKILL)
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert (root / checkpoint.LOCK).read_text().strip() == str(child)    # left behind
    checkpoint.unlock(checkpoint.lock(root))
    (tmp_path / "a_file").write_text("x")                  # not a folder: one line
    with pytest.raises(checkpoint.CheckpointError, match="a_file/checkpoint.lock: cannot be"):
        checkpoint.lock(tmp_path / "a_file")


def test_the_lock_file_is_never_a_pipe_or_a_hard_link(tmp_path):
    """Issue 44: a FIFO in the lock file's place crashed with a traceback; a hard link in its
    place was truncated and overwritten with the PID. Both refused in one line, untouched."""
    fifo = made(tmp_path / "fifo")
    os.mkfifo(fifo / checkpoint.LOCK)
    with pytest.raises(checkpoint.CheckpointError, match="not a plain file of its own"):
        within(10, checkpoint.lock, fifo)
    linked = made(tmp_path / "linked")
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's")
    os.link(victim, linked / checkpoint.LOCK)
    with pytest.raises(checkpoint.CheckpointError, match="hard link"):
        checkpoint.lock(linked)
    assert victim.read_text() == "the user's"


def within(seconds: int, function, *args):
    """``function(*args)``, stopped with TimeoutError after ``seconds`` (SIGALRM)."""
    def stop(signum, frame):
        raise TimeoutError(f"{function.__name__} took more than {seconds} s")
    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        return function(*args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def by_hand(folder: Path, shard: bytes, tensors: dict, shard_size: int | None = None) -> Path:
    """A checkpoint written without save(): ``shard`` as rank_00000.bin (or an empty sparse
    file of ``shard_size`` bytes), and a manifest holding ``tensors``."""
    folder.mkdir(parents=True)
    (folder / checkpoint.MARKER).write_text(checkpoint.FORMAT)
    (folder / "rank_00000.bin").write_bytes(shard)
    if shard_size is not None:
        os.truncate(folder / "rank_00000.bin", shard_size)
    manifest = {"format": checkpoint.FORMAT, "step": 1, "layout": "by hand", "world_size": 1,
                "meta": {}, "files": {"rank_00000.bin": shard_size or len(shard)},
                "tensors": tensors}
    (folder / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    return folder


def crc32s(*units: bytes) -> str:
    return base64.b64encode(b"".join(zlib.crc32(u).to_bytes(4, "little") for u in units)).decode()


def refused(folder: Path, *needles) -> None:
    with pytest.raises(checkpoint.CheckpointError) as error:
        within(20, checkpoint.consolidate, folder)
    message = str(error.value)
    assert "\n" not in message and all(needle in message for needle in needles), message


def test_a_manifest_of_many_dimensions_or_unprintable_names_is_refused_at_once(tmp_path):
    """A 1-byte tensor of shape [1] x 24 passed the corner cap (2^24) and made the tiling check
    take minutes and some 10 GB; a name holding a newline made a two-line error."""
    one = {"file": "rank_00000.bin", "offset": 0, "crc32": crc32s(b"x")}
    folder = by_hand(tmp_path / "dims" / "step_000000001", b"x", {
        "deep": {"shape": [1] * 24, "dtype": "uint8", "block_columns": 1,
                 "slices": [{**one, "box": [[0, 1]] * 24}]}})
    refused(folder, "deep: shape", "at most 8 whole numbers")
    folder = by_hand(tmp_path / "eight" / "step_000000001", b"x", {
        "deep": {"shape": [1] * 8, "dtype": "uint8", "block_columns": 1,
                 "slices": [{**one, "box": [[0, 1]] * 8}]}})
    assert within(20, checkpoint.read_manifest, folder)["tensors"]["deep"]["shape"] == [1] * 8   # 8 pass
    folder = by_hand(tmp_path / "name" / "step_000000001", b"x", {
        "a\nforged line": {"shape": [1], "dtype": "uint8", "block_columns": 1,
                            "slices": [{**one, "box": [[0, 1]]}]}})
    refused(folder, "naming tensors printably")


def test_an_untrusted_manifest_cannot_stall_a_load_or_exhaust_memory(tmp_path, monkeypatch):
    """Issue 44, each case under a time limit. A manifest of 20,000 one-byte slices is checked
    (their tiling was checked pair by pair: 221 s), and a cap on slices x 2^dims is refused; a manifest larger
    than MAX_MANIFEST_BYTES, or nested 200,000 deep (RecursionError), is refused in one line;
    a 64 GiB tensor claimed by a small manifest and an empty sparse shard is refused before
    anything is allocated (consolidate allocated 64 GiB)."""
    count = 20_000
    data = bytes(range(256)) * (count // 256) + bytes(count % 256)
    slices = [{"file": "rank_00000.bin", "offset": i, "box": [[i, i + 1]],
               "crc32": crc32s(data[i:i + 1])} for i in range(count)]
    folder = by_hand(tmp_path / "slices" / "step_000000001", data, {
        "bytes": {"shape": [count], "dtype": "uint8", "block_columns": 1, "slices": slices}})
    manifest = within(20, checkpoint.read_manifest, folder)     # checked, and in linear time
    assert len(manifest["tensors"]["bytes"]["slices"]) == count
    with monkeypatch.context() as capped:
        capped.setattr(safety, "MAX_CORNERS", 2 * count - 1)
        refused(folder, "too many slices")
    folder, model = small_checkpoint(tmp_path / "big")
    text = (folder / checkpoint.MANIFEST).read_text()
    (folder / checkpoint.MANIFEST).write_text(text.ljust(safety.MAX_MANIFEST_BYTES + 1))
    refused_everywhere(folder, model, "more than the", str(safety.MAX_MANIFEST_BYTES))
    folder, model = small_checkpoint(tmp_path / "deep")
    (folder / checkpoint.MANIFEST).write_text("[" * 200_000 + "]" * 200_000)
    refused_everywhere(folder, model, "nested too deep")
    numel = 2**34                                               # float32: 64 GiB
    folder = by_hand(tmp_path / "sparse" / "step_000000001", b"", {
        "huge": {"shape": [numel], "dtype": "float32", "block_columns": numel,
                 "slices": [{"file": "rank_00000.bin", "offset": 0, "box": [[0, numel]],
                             "crc32": crc32s(b"")}]}}, shard_size=4 * numel)
    with open("/proc/self/status") as f:        # 1 GiB more address space than now, at most
        now = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
    limits = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (now + (1 << 30), limits[1]))
    try:
        refused(folder, "rank_00000.bin: sparse")
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limits)


# --------------------------------------------------------------------------- an atomic manifest


def commit_manifest_in_place(folder, manifest):
    """Planted: the manifest written straight into manifest.json (no temporary, no rename)."""
    text = json.dumps(manifest, indent=1)
    (folder / checkpoint.MANIFEST).write_text(text)
    return len(text)


class StopInsideTheManifest:
    """An audit hook (sys.addaudithook; it cannot be removed, so it is armed only for one
    save): after a file named manifest.json* is opened for writing, the next file operation
    of the save halves that file and raises, as a crash halfway through writing it would
    leave it, whatever the code that writes it looks like."""

    armed = False
    written = None

    def __call__(self, event, args):
        if not StopInsideTheManifest.armed:
            return
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = Path(os.fsdecode(args[0]))
            writing = (args[1] or "r") != "r" and (args[1] or "r") != "rb"
            if args[1] is None:
                writing = bool(args[2] & (os.O_WRONLY | os.O_RDWR))
            if path.name.startswith(checkpoint.MANIFEST) and writing:
                StopInsideTheManifest.written = path
                return
        if event in ("open", "os.rename", "os.replace", "os.scandir", "os.listdir",
                     "os.remove", "shutil.rmtree") and StopInsideTheManifest.written is not None:
            if event == "open" and isinstance(args[0], int):
                return                          # open(fd): the same file, not a new operation
            path = StopInsideTheManifest.written
            StopInsideTheManifest.armed = False
            StopInsideTheManifest.written = None
            os.truncate(path, path.stat().st_size // 2)
            raise KeyboardInterrupt(f"stopped halfway through writing {path}")


STOP = StopInsideTheManifest()
sys.addaudithook(STOP)


def stopped_mid_manifest_problems(root: Path) -> list[str]:
    """Save step 2, then a save of step 3 stopped halfway through its manifest: the newest
    checkpoint must still be step 2's, and the half manifest never taken for a checkpoint."""
    folder, model = small_checkpoint(root, step=2)
    StopInsideTheManifest.armed = True
    try:
        checkpoint.save(root, layouts.replicated_layout(model), 3, "one process")
        return ["the save stopped inside its manifest returned"]
    except KeyboardInterrupt:
        pass
    finally:
        StopInsideTheManifest.armed = False
    problems = []
    if checkpoint.latest_checkpoint(root) != folder:
        problems.append(f"the newest checkpoint is {checkpoint.latest_checkpoint(root)}, not "
                        "step 2's")
    if [step for step, _ in checkpoint.list_checkpoints(root)] != [2]:
        problems.append("a half-written manifest listed as a checkpoint")
    return problems


def test_a_save_stopped_inside_its_manifest_leaves_the_previous_checkpoint(tmp_path,
                                                                           monkeypatch):
    assert stopped_mid_manifest_problems(tmp_path / "atomic") == []
    monkeypatch.setattr(checkpoint, "commit_manifest", commit_manifest_in_place)
    planted = stopped_mid_manifest_problems(tmp_path / "in_place")
    assert planted and "not step 2's" in planted[0], planted


# --------------------------------------------------------------------------- resume


def resume_problems(tmp_path: Path, label: str, seed: int = 0) -> list[str]:
    """resume.py's TrainingCheckpoints on a one-rank group, directly: save at step 2 with the
    random state S, draw (as training would), then resume as a restarted run would: the step
    it returns must be 2, the random state S again (the same draws follow), and the batch it
    trains next the batch the run that never stopped trained at step 2."""
    grid_mod = import_stage("07_parallelism/07_together/grid")
    parallel_lm = import_stage("07_parallelism/07_together/parallel_lm")
    text_data = import_stage("07_parallelism/07_together/text_data")
    from common import models
    args = argparse.Namespace(model="tiny", seed=seed, batch_size=4, seq_len=16, lr=1e-3,
                              data=None, max_bytes=100_000, dp=1, pp=1, cp=1, tp=1, fsdp=False,
                              steps=4, checkpoint_dir=str(tmp_path / label), checkpoint_every=2,
                              crash_at_step=None)
    tokens = torch.randint(256, (1000,), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    full_lm = models.TransformerLM("tiny", vocab_size=256, context_length=args.seq_len)
    grid = grid_mod.ProcessGrid()
    chunks = parallel_lm.build_chunks(full_lm, grid, args.seq_len)
    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    first = resume.TrainingCheckpoints(args, chunks, grid, optimizer, parallel_lm, full_lm)
    problems = []
    if first.resume() != 0:
        problems.append("a fresh directory did not start at step 0")
    torch.manual_seed(1234)
    saved_state = torch.get_rng_state()
    first.after_step(2)                                     # --checkpoint-every 2: a save
    draws = torch.rand(8)
    next_batch = text_data.batch_at(tokens, 2, args.batch_size, args.seq_len, args.seed)
    first.give_back_directory()                             # the run ends
    restarted = resume.TrainingCheckpoints(args, chunks, grid, optimizer, parallel_lm, full_lm)
    step = restarted.resume()
    restarted.give_back_directory()
    if step != 2:
        problems.append(f"resumed at step {step}, saved at 2")
    if not torch.equal(torch.get_rng_state(), saved_state):
        problems.append("the random state after the resume is not the saved one")
    if not torch.equal(torch.rand(8), draws):
        problems.append("the draws after the resume differ from the run that never stopped")
    batch = text_data.batch_at(tokens, step, args.batch_size, args.seq_len, args.seed)
    if not torch.equal(batch[0], next_batch[0]):
        problems.append("the batch after the resume is not the one the run would have trained")
    return problems


@pytest.fixture
def one_rank_group(tmp_path):
    store = tmp_path / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def test_resume_restores_the_random_state_and_the_data_order(tmp_path, one_rank_group,
                                                            monkeypatch, capfd):
    assert resume_problems(tmp_path, "correct") == []
    # planted: the random state loaded but not restored; then a resume that restarts the data
    with monkeypatch.context() as planted:
        planted.setattr(torch, "set_rng_state", lambda state: None)
        found = resume_problems(tmp_path, "no_set_rng_state")
    assert any("random state" in problem for problem in found), found
    original = resume.TrainingCheckpoints.resume
    with monkeypatch.context() as planted:
        planted.setattr(resume.TrainingCheckpoints, "resume", lambda self: original(self) * 0)
        found = resume_problems(tmp_path, "data_restarted")
    assert any("batch after the resume" in problem for problem in found), found
    # refused in one line, exit 2, as train.py's run would be: a directory another run holds,
    # a damaged checkpoint, another run's (--seed 1), a file given as the directory
    (tmp_path / "a_file").write_text("not a directory")
    resume_refused(tmp_path, "a_file", capfd, "a_file", "cannot be opened")
    held = checkpoint.lock(made(tmp_path / "held"))
    try:
        resume_refused(tmp_path, "held", capfd, "held by process", str(os.getpid()))
    finally:
        checkpoint.unlock(held)
    shutil.copytree(tmp_path / "correct", tmp_path / "damaged")
    newest = checkpoint.latest_checkpoint(tmp_path / "damaged")
    checks.flip_byte(newest / "rank_00000.bin", 100)
    resume_refused(tmp_path, "damaged", capfd, "rank_00000.bin: corrupted")
    shutil.copytree(tmp_path / "correct", tmp_path / "another_run")
    resume_refused(tmp_path, "another_run", capfd, "saved by a run with --seed 0, this one has 1",
                   seed=1)


def resume_refused(tmp_path: Path, label: str, capfd, *needles, seed: int = 0) -> None:
    capfd.readouterr()
    with pytest.raises(SystemExit) as refused:
        resume_problems(tmp_path, label, seed)
    assert refused.value.code == 2
    one_line(capfd.readouterr().err, *needles)


# --------------------------------------------------------------------------- train.py


TEXT = (REPO / "README.md").read_text() * 3
STEPS = 6
TRAIN = REPO / "07_parallelism" / "07_together" / "train.py"
DEMO = REPO / "07_parallelism" / "08_checkpoints" / "run_checkpoint.py"
RESUME = REPO / "07_parallelism" / "08_checkpoints" / "resume.py"
# Weights of a pipeline (pp 2) against one process after STEPS AdamW steps: they sum a few
# gradients in another order (measured: 1.2e-7, float32 rounding); a resume that restarts the
# data order moves them by about the learning rate times the steps (3e-3).
TRAIN_ATOL = 1e-5


def train_argv(data: Path, *extra) -> list[str]:
    return ["--backend", "gloo", "--device", "cpu", "--batch-size", "8", "--seq-len", "32",
            "--steps", str(STEPS), "--log-every", str(STEPS), "--eval-batches", "1", "--data",
            str(data), *extra]


def start(tmp_path: Path, name: str, argv: list, env: dict | None = None) -> subprocess.Popen:
    """A script as a subprocess (tests import no run script), its results in a folder of its
    own: ``tmp_path / name``."""
    environment = {**os.environ, "RESULTS_DIR": str(tmp_path / name), **(env or {})}
    return subprocess.Popen([sys.executable, *map(str, argv)], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment)


def quiet_ports(count: int) -> list[int]:
    """``count`` ports free now and below 32768, where Linux draws no outgoing connection's port.
    Runs started side by side take their rendezvous port from the ephemeral range (the course
    launcher's free_port), where one run's connection can take another's between its check and
    its bind (EADDRINUSE, seen once in some ten suites): here each gets a port of its own."""
    ports = []
    for port in random.sample(range(20000, 32768), 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:    # nothing listens there
                ports.append(port)
        if len(ports) == count:
            return ports
    raise AssertionError("no free port below 32768")


def finish(process: subprocess.Popen, code: int) -> tuple[str, str]:
    out, err = process.communicate(timeout=240)
    assert process.returncode == code, (process.args, process.returncode, out[-3000:],
                                        err[-3000:])
    return out, err


def curve_losses(results: Path) -> dict:
    """step -> loss, from a train.py run's train_curve.csv."""
    losses = {}
    with open(results / "train_curve.csv") as f:
        for row in csv.DictReader(f):
            losses[int(row["step"])] = float(row["loss"])
    return losses


def largest_difference(path: Path, want: dict) -> float:
    got = torch.load(path)
    largest = 0.0
    for name, value in want.items():
        largest = max(largest, (got[name] - value).abs().max().item())
    return largest


def one_line(err: str, *needles) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and all(needle in lines[0] for needle in needles), err[-2000:]


RECIPE = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node=2 --max-restarts=1 "
          "07_parallelism/08_checkpoints/resume.py --dp 2 --checkpoint-every 2 --crash-at-step 3")


def start_recipe(tmp_path: Path, name: str, extra: list) -> subprocess.Popen:
    """resume.py's torchrun recipe (its docstring's, on 2 ranks) run in a shell, torchrun on
    the PATH, the repository's 07_parallelism/ under the current folder, the test's own flags
    appended (argparse takes the last of a repeated flag)."""
    assert RECIPE.split(" --nproc")[0] in resume.__doc__
    recipe = RECIPE
    (tmp_path / "07_parallelism").symlink_to(REPO / "07_parallelism")
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir()
    torchrun = bin_folder / "torchrun"       # torchrun of the interpreter running the tests
    torchrun.write_text(f"#!/bin/sh\nexec {sys.executable} -m torch.distributed.run \"$@\"\n")
    torchrun.chmod(0o755)
    environment = {**os.environ, "PATH": f"{bin_folder}:{os.environ['PATH']}",
                   "RESULTS_DIR": str(tmp_path / name)}
    command = recipe + " " + " ".join(map(str, extra))
    return subprocess.Popen(["bash", "-c", command], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment)


def test_resume_py_resumes_after_a_crash_as_the_same_run(tmp_path):
    """resume.py as a user runs it: killed mid-training and restarted, beside lesson 7's
    train.py that never stopped (bitwise: losses and weights); under torchrun --max-restarts=1
    (against the run that never stopped, at float32 tolerance: another grid); the lesson's
    demo, run_checkpoint.py, beside. (Its refusals are tested on TrainingCheckpoints, above.)"""
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    torchrun = start_recipe(tmp_path, "torchrun_results", train_argv(
        data, "--checkpoint-dir", tmp_path / "torchrun", "--save-full", tmp_path / "torchrun.pt"))
    crashed = tmp_path / "crashed"
    # 1. the worker killed after step 5 (checkpoints at steps 2 and 4): the run ends
    finish(start(tmp_path, "crashed_results", [RESUME, *train_argv(
        data, "--world-size", "1", "--checkpoint-dir", crashed, "--checkpoint-every", "2",
        "--crash-at-step", "5")]), 1)
    assert [step for step, _ in checkpoint.list_checkpoints(crashed)] == [2, 4]
    # 2. restarted beside the run that never stopped, and the demo
    shutil.copytree(crashed, tmp_path / "resumed")
    ports = [{"MASTER_PORT": str(port)} for port in quiet_ports(3)]   # three runs side by side
    resumed = start(tmp_path, "resumed_results", [RESUME, *train_argv(
        data, "--world-size", "1", "--checkpoint-dir", tmp_path / "resumed", "--save-full",
        tmp_path / "resumed.pt")], env=ports[0])
    never = start(tmp_path, "never_results", [TRAIN, *train_argv(
        data, "--world-size", "1", "--save-full", tmp_path / "never_stopped.pt")], env=ports[1])
    demo = start(tmp_path, "demo_results", [DEMO, "--world-size", "2", "--backend", "gloo",
                                            "--device", "cpu"], env=ports[2])
    finish(resumed, 0)
    finish(never, 0)
    out, _ = finish(demo, 0)
    assert "bitwise equal to what was saved; resumed training equal" in out, out[-2000:]
    resumed_losses = curve_losses(tmp_path / "resumed_results")
    never_stopped_losses = curve_losses(tmp_path / "never_results")
    never_stopped = torch.load(tmp_path / "never_stopped.pt")
    assert sorted(resumed_losses) == [5, 6]
    for step in (5, 6):
        assert resumed_losses[step] == never_stopped_losses[step]
    assert largest_difference(tmp_path / "resumed.pt", never_stopped) == 0.0
    # 3. torchrun's restarted run: against one process at float32 tolerance (TRAIN_ATOL)
    out, err = finish(torchrun, 0)
    output = out + err
    assert "[rank 1] --crash-at-step 3: killing this worker" in output, output[-3000:]
    assert "resumed from" in output and "(step 2, saved from grid" in output, output[-3000:]
    difference = largest_difference(tmp_path / "torchrun.pt", never_stopped)
    assert difference < TRAIN_ATOL, difference


BENCH = REPO / "07_parallelism" / "measure" / "bench_checkpoint.py"
SPANS_NODES = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
BAD_FLAGS = [   # script, flags, the words of its one line, environment
    (RESUME, [], "checkpoint-dir", {}),
    (DEMO, [], "give an even number of ranks, 2 or more", {}),
    (DEMO, ["--world-size", "3"], "give an even number of ranks", {}),
    (BENCH, ["--bench", "--world-size", "2"], "give 3 ranks or more", {}),
    (BENCH, ["--iters", "0"], "is not a whole number >= 1", {}),
    (BENCH, ["--world-size", "4", "--dir", "README.md"], "not a folder", {}),
    (BENCH, ["--world-size", "4", "--dir", "07_parallelism"], "already used", {}),
    # issue 45 item 11: rank 0's temporary folder is not on another node
    (DEMO, [], "spans nodes", SPANS_NODES),
    (BENCH, [], "spans nodes", SPANS_NODES),
]


@pytest.mark.parametrize("script, argv, needle, environment", BAD_FLAGS)
def test_bad_flags_are_refused_before_any_worker_starts(script, argv, needle, environment,
                                                         capsys, monkeypatch):
    """The script run as __main__ in this process (runpy: run, not imported as a library; a
    subprocess each would cost a torch start-up): exit 2, one line, no launch."""
    def no_launch(*args, **kwargs):
        raise AssertionError("bad flags reached the launch")
    monkeypatch.setattr(launch, "launch", no_launch)
    monkeypatch.setattr(course_launch, "launch", no_launch)
    monkeypatch.chdir(REPO)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", [str(script), "--world-size", "1", *argv])
    with pytest.raises(SystemExit) as refused:
        runpy.run_path(str(script), run_name="__main__")
    out, err = capsys.readouterr()
    assert refused.value.code == 2, err
    one_line(err, needle)
    assert "[rank" not in out


# --------------------------------------------------------------------------- staging on a GPU


def test_what_a_save_copies_to_the_host_is_counted(tmp_path):
    """staging_counts, on the CPU, for the same layouts in CPU memory and on a device (meta:
    shapes and strides, no data, as a GPU's tensors to the plan): in CPU memory only the
    non-contiguous boxes (a block of columns) are copied; on a device every written box, once,
    the bytes exactly what the rank writes. And a CPU save writes the same bytes either way."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    layout = layouts.replicated_layout(model, optimizer)
    columns = layouts.entry("model.columns", torch.randn(6, 8), [6, 8],     # two column blocks
                            [([[0, 6], [0, 4]], [[0, 6], [0, 4]]),
                             ([[0, 6], [4, 8]], [[0, 6], [4, 8]])], True)
    layout.append(columns)
    written_boxes = 0
    for item in layout:
        if item["write"]:
            written_boxes += len(item["boxes"])
    on_cpu = checks.staging_counts(layout)
    assert on_cpu == {"bytes_staged": 2 * 6 * 4 * 4, "copies": 2}, on_cpu
    on_device = []
    for item in layout:
        on_device.append({**item, "tensor": item["tensor"].to("meta")})
    counted = checks.staging_counts(on_device)
    assert counted == {"bytes_staged": checks.layout_bytes(layout, written_only=True),
                       "copies": written_boxes}, counted
    stats = checkpoint.save(tmp_path, layout, 1, "one process")
    assert stats["bytes_written"] == checks.layout_bytes(layout, written_only=True)
    state = checkpoint.consolidate(checkpoint.latest_checkpoint(tmp_path))
    assert torch.equal(state["model"]["columns"], columns["tensor"])
