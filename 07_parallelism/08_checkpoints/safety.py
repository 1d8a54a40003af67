"""Stage 07, lesson 8: the rules that make a checkpoint safe to load when someone else made it.

A folder someone else made is untrusted input. Each rule holds before anything a manifest
names is read or allocated, and a broken one is a one-line ``CheckpointError`` naming the file:
only plain ``rank_<digits>.bin`` files inside the folder, no link, no sparse file; a bounded
manifest whose fields are as the tables say, whose boxes tile each tensor and share no byte of
a file; only folders holding ``MARKER`` deleted; one run per directory holding ``LOCK``.
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import itertools
import json
import math
import os
import re
import shutil
import stat
from collections import Counter
from pathlib import Path

import torch

FORMAT = "distributed-training-from-scratch/checkpoint/1"
MANIFEST = "manifest.json"
MARKER = "checkpoint-format.txt"    # in every folder save() makes: proof that it is ours
LOCK = "checkpoint.lock"            # in the checkpoint directory, held by one run at a time
FOLDER = re.compile(r"step_(\d+)")                 # a checkpoint's folder: step_000000200
SHARD = re.compile(r"rank_\d{5,}\.bin")            # the only files a manifest may name
MAX_MANIFEST_BYTES = 64 << 20
MAX_CORNERS = 1 << 22               # slices x 2^dims: the tiling check's work (8 dims: 6 s, 0.6 GB)
DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
          "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}


class CheckpointError(Exception):
    """A checkpoint that cannot be used: one line. ``found_by``: the ranks that found it."""

    def __init__(self, message: str, found_by=()):
        super().__init__(message)
        self.found_by = list(found_by)


def is_count(value) -> bool:
    """A whole number >= 0 (JSON's 2.0 and 1e30 are floats; True is not a count)."""
    return type(value) is int and value >= 0


# What each field must be: (test, in words), checked in this order.
MANIFEST_FIELDS = {
    "format": (lambda v: v == FORMAT, f"this format ({FORMAT})"),
    "step": (is_count, "a whole number >= 0"),
    "layout": (lambda v: isinstance(v, str), "a string"),
    "world_size": (lambda v: is_count(v) and v >= 1, "a whole number >= 1"),
    "meta": (lambda v: isinstance(v, dict), "an object"),
    "files": (lambda v: isinstance(v, dict) and all(map(is_count, v.values())),
              "an object of file sizes (whole numbers >= 0)"),
    "tensors": (lambda v: isinstance(v, dict) and v and all(map(str.isprintable, v)), "an object naming tensors printably"),
}
TENSOR_FIELDS = {
    "shape": (lambda v: isinstance(v, list) and len(v) <= 8 and all(map(is_count, v)),
              "a list of at most 8 whole numbers"),
    "dtype": (lambda v: isinstance(v, str) and v in DTYPES, "one of " + ", ".join(DTYPES)),
    "block_columns": (lambda v: is_count(v) and v >= 1, "a whole number >= 1"),
    "slices": (lambda v: isinstance(v, list) and len(v) > 0, "a list of at least one slice"),
}
SLICE_FIELDS = {
    "file": (lambda v: isinstance(v, str), "a file name"),
    "offset": (is_count, "a whole number >= 0"),
    "box": (lambda v: isinstance(v, list) and all(isinstance(pair, list) and len(pair) == 2
                                                  and is_count(pair[0]) and is_count(pair[1])
                                                  and pair[0] < pair[1] for pair in v),
            "a list of [start, stop) with start < stop"),
    "crc32": (lambda v: isinstance(v, str), "a string"),
}


def fields_problem(where: str, value, fields: dict) -> str | None:
    if not isinstance(value, dict):
        return f"{where}{value!r:.80}: not an object"
    for key, (test, words) in fields.items():
        if not test(value.get(key)):
            return f"{where}{key} {value.get(key)!r:.80}: not {words}"
    return None


def read_manifest(folder) -> dict:
    """The manifest of the checkpoint in ``folder``, bounded and validated."""
    folder = Path(folder)
    path = folder / MANIFEST
    match = FOLDER.fullmatch(folder.name)
    if match is None:
        raise CheckpointError(f"{folder}: not a checkpoint's folder (step_<digits>)")
    f, size = open_inside(folder, MANIFEST)
    with f:
        text = f.read(MAX_MANIFEST_BYTES + 1) if size <= MAX_MANIFEST_BYTES else b""
    if max(size, len(text)) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path}: {max(size, len(text))} bytes, more than the "
                              f"{MAX_MANIFEST_BYTES} a manifest may have")
    try:
        manifest = json.loads(text)
    except RecursionError:
        raise CheckpointError(f"{path}: nested too deep to be a manifest") from None
    except ValueError as error:
        raise CheckpointError(f"{path}: unreadable ({str(error).splitlines()[0]})") from None
    problem = manifest_problem(manifest, int(match.group(1)))
    if problem is not None:
        raise CheckpointError(f"{path}: {problem}")
    return manifest


def manifest_problem(manifest, folder_step: int) -> str | None:
    """The first thing wrong with a manifest, in words, or None."""
    problem = fields_problem("", manifest, MANIFEST_FIELDS)
    if problem is not None:
        return problem
    if manifest["step"] != folder_step:
        return f"says step {manifest['step']}, its folder step {folder_step}"
    for file_name in manifest["files"]:
        if SHARD.fullmatch(file_name) is None:
            return (f"names the file {file_name!r}; a shard is rank_<digits>.bin inside the "
                    "checkpoint's folder")
    corners = 0
    extents = []                # (file, first byte, end, tensor) of every slice
    for name, info in manifest["tensors"].items():
        problem = fields_problem(f"{name}: ", info, TENSOR_FIELDS)
        if problem is not None:
            return problem
        corners += len(info["slices"]) * 2 ** len(info["shape"])
        if corners > MAX_CORNERS:
            return f"more than {MAX_CORNERS} box corners (slices x 2^dims): too many slices"
        for index, saved in enumerate(info["slices"]):
            problem = (fields_problem(f"{name}: slice {index} ", saved, SLICE_FIELDS)
                       or slice_problem(name, saved, info, manifest["files"]))
            if problem is not None:
                return problem
            end = saved["offset"] + numel(saved["box"]) * DTYPES[info["dtype"]].itemsize
            extents.append((saved["file"], saved["offset"], end, name))
        problem = tiling_problem(name, info["shape"], [saved["box"] for saved in info["slices"]])
        if problem is not None:
            return problem
    extents.sort()
    for (file_a, _, end_a, name_a), (file_b, start_b, _, name_b) in zip(extents, extents[1:]):
        if file_a == file_b and start_b < end_a:
            return f"{name_a} and {name_b} share bytes of {file_a} (byte {start_b})"
    return None


def slice_problem(name: str, saved: dict, info: dict, files: dict) -> str | None:
    """One saved box: inside its tensor and a listed file, one CRC32 per unit (unit_cuts)."""
    box = saved["box"]
    file_name = saved["file"]
    if file_name not in files:
        return f"{name}: a slice is in {file_name!r}, which is not in the manifest's files"
    if len(box) != len(info["shape"]):
        return f"{name}: the box {box} is not one [start, stop) per dimension of {info['shape']}"
    if any(stop > size for (_, stop), size in zip(box, info["shape"])):
        return f"{name}: the box {box} is not inside its shape {info['shape']}"
    end = saved["offset"] + numel(box) * DTYPES[info["dtype"]].itemsize
    if end > files[file_name]:
        return f"{name}: the box {box} ends at byte {end}, past the end of {file_name}"
    try:
        packed = base64.b64decode(saved["crc32"], validate=True)
    except (ValueError, binascii.Error):
        return f"{name}: crc32 in {file_name} is not base64"
    start, stop = box[-1] if box else (0, 1)
    per_row = (stop - 1) // info["block_columns"] - start // info["block_columns"] + 1
    if len(packed) != 4 * numel(box[:-1]) * per_row:
        return f"{name}: {len(packed) // 4} CRC32s for {numel(box[:-1]) * per_row} units of {box}"
    return None


def numel(box) -> int:
    return math.prod(stop - start for start, stop in box)


def tiling_problem(name: str, shape, boxes) -> str | None:
    """Each element in exactly one box, in linear time: with each box corner signed (-1)^(stops
    in it), boxes tile the tensor exactly when their signed corners add up to the whole's."""
    whole = [[0, size] for size in shape]
    covered = sum(numel(box) for box in boxes)
    if covered > numel(whole):
        return (f"{name}: its boxes cover {covered} elements of {numel(whole)}: boxes overlap "
                "(a replica written twice)")
    if covered < numel(whole):
        return f"{name}: its saved boxes cover {covered} of its {numel(whole)} elements"
    if signed_corners(boxes) != signed_corners([whole]):
        return f"{name}: its boxes overlap and leave elements out"
    return None


def signed_corners(boxes) -> dict:
    total = Counter()
    for box in boxes:
        for corner in itertools.product(*[((start, 1), (stop, -1)) for start, stop in box]):
            total[tuple(at for at, _ in corner)] += math.prod(sign for _, sign in corner)
    return {point: count for point, count in total.items() if count != 0}


def open_inside(folder: Path, file_name: str):
    """(file, size) of a shard or the manifest in ``folder``: a plain file, all on disk."""
    path = Path(folder) / file_name
    if file_name != MANIFEST and SHARD.fullmatch(file_name) is None:
        raise CheckpointError(f"{Path(folder) / MANIFEST}: names the file {file_name!r}; a "
                              "shard is rank_<digits>.bin inside the checkpoint's folder")
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as error:
        if path.is_symlink():
            raise CheckpointError(f"{path}: a symbolic link; a checkpoint's files are read "
                                  "only as plain files inside its folder") from None
        raise CheckpointError(f"{path}: {'unreadable' if path.exists() else 'missing'} "
                              f"({error.strerror})") from None
    status = os.fstat(handle)
    problem = None
    if not stat.S_ISREG(status.st_mode):
        problem = "not a plain file; a checkpoint's files are read only as plain files"
    elif status.st_blocks * 512 < status.st_size:
        problem = f"sparse: {status.st_size} bytes, {status.st_blocks * 512} on disk"
    if problem is not None:
        os.close(handle)
        raise CheckpointError(f"{path}: {problem}")
    return open(handle, "rb", buffering=0), status.st_size


def is_ours(folder: Path) -> bool:
    """A real folder (not a link) with our marker file in it: only these are ever deleted."""
    marker = folder / MARKER
    if folder.is_symlink() or not folder.is_dir() or marker.is_symlink() or not marker.is_file():
        return False
    with open(marker, "rb") as f:
        return f.read(len(FORMAT) + 2).decode(errors="replace").strip() == FORMAT


def our_folders(root) -> list[tuple[int, Path]]:
    """(step, folder) of every folder under ``root`` this format made, oldest first."""
    found = []
    for folder in Path(root).iterdir() if Path(root).is_dir() else []:
        match = FOLDER.fullmatch(folder.name)
        if match is not None and is_ours(folder):
            found.append((int(match.group(1)), folder))
    return sorted(found)


def prepare_folder(folder: Path) -> str | None:
    """Rank 0: a fresh folder with our marker; a complete checkpoint, or not ours, untouched."""
    if (folder / MANIFEST).exists():
        return f"{folder}: already holds a complete checkpoint; a checkpoint is never overwritten"
    if (folder.exists() or folder.is_symlink()) and not is_ours(folder):
        return (f"{folder}: is there and was not made by this format (no {MARKER} in it); it "
                "is left alone: move it, or save to another directory")
    shutil.rmtree(folder, ignore_errors=True)
    try:
        folder.mkdir(parents=True)
        handle = os.open(folder / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW)
        with open(handle, "wb") as f:
            f.write(f"{FORMAT}\n".encode())
    except OSError as error:
        return f"{folder}: cannot be made ({error.strerror})"
    return None


def prune(root, keep: int) -> None:
    """Remove all but the ``keep`` newest complete checkpoints, and older crashed saves."""
    complete = [(step, f) for step, f in our_folders(root) if (f / MANIFEST).is_file()]
    for _, folder in complete[:-keep]:
        shutil.rmtree(folder)
    for step, folder in our_folders(root):
        if step < complete[-1][0] and not (folder / MANIFEST).exists():
            shutil.rmtree(folder)


def lock(root):
    """This run takes the directory: a flock on ``LOCK`` held while the returned file is open
    (the kernel drops it when the process dies). A link, pipe or device there is refused."""
    path = Path(root) / LOCK
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        handle = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be opened ({error.strerror})") from None
    status = os.fstat(handle)
    if not stat.S_ISREG(status.st_mode) or status.st_nlink != 1:
        os.close(handle)
        raise CheckpointError(f"{path}: not a plain file of its own (a pipe, a device or a "
                              "hard link); remove it")
    held = open(handle, "r+b", buffering=0)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = held.read(32).decode(errors="replace").strip() or "another process"
        held.close()
        raise CheckpointError(f"{path}: held by process {holder}: another run is using "
                              f"{root} (one run per checkpoint directory)") from None
    held.truncate(0)
    held.write(f"{os.getpid()}\n".encode())
    return held


def unlock(held) -> None:
    held.close()            # closing the file drops the flock
