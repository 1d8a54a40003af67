"""Stage 07, lesson 8: sharded checkpoints that survive a crash and a change of layout.

A run of lessons 1-7 holds its state in pieces: FSDP keeps a block of rows of every weight on
each rank, tensor parallelism a slice of every layer, a pipeline whole layers, ZeRO-1 the
optimizer state of the parameters each rank owns. Gathering it all on one rank to save it
needs one rank's memory for the whole state and leaves every other rank idle; and a run that
comes back on a different number of ranks needs the pieces cut another way. So:

* **Save sharded.** Each rank writes only what it holds, to a file of its own, and describes
  each piece by its place in the full tensor: a *box*, one ``[start, stop)`` per dimension.
  A piece several ranks hold (a replica) is written by one of them. No rank waits for another
  to finish writing, and no rank ever holds more than its own state.
* **A manifest, written last.** Rank 0 gathers every rank's descriptions (after each rank's
  file is on disk) and writes ``manifest.json``: names, full shapes, dtypes, which file holds
  which box at which offset, the checksums, the step, the layout it was saved from. It writes
  it under a temporary name and renames it: a rename is atomic, so a checkpoint either has
  its whole manifest or none, and one without a manifest does not exist. A crash at any
  moment of a save leaves the previous checkpoint as it was (each checkpoint has a folder of
  its own; the two newest are kept).
* **Load resharded: it is only overlapping boxes.** A rank that will hold a box ``T`` of a
  tensor reads, from every saved box ``S`` of it, the intersection ``S n T`` (per dimension,
  ``[max(starts), min(stops))``), and puts it at its place in ``T``. Any saved layout loads
  into any other: FSDP's padded row blocks at 4 ranks into blocks at 3, a tensor-parallel
  slice into a pipeline stage's whole layers, everything into one process (``consolidate``).
  Each rank reads only the bytes it will hold.

The tension, and the choice made here. Checking a checksum needs every byte it covers, while a
rank should read only the bytes it will hold. So the checksummed *unit* is made as small as
the ways a target can cut a tensor: one *row* of a saved box (all indices but the last fixed),
cut further at multiples of ``block_columns`` along the last dimension when a layout may cut
there (tensor parallelism cuts some weights by columns). Every layout cuts along rows or on
those column blocks, so every read is of whole units and is exactly the overlap; each unit's
CRC32 is checked as it is read, by every rank that reads it. A target that cuts inside a unit
still works: it reads that unit whole (counted apart, as ``bytes_read - bytes_needed``).
Truncation is caught before any read by one ``stat`` per file (the manifest has each size).

    root/
      step_000000200/
        rank_00000.bin    rank 0's boxes back to back: raw bytes, row-major, no header
        rank_00001.bin
        manifest.json     {"step": 200, "layout": "fsdp at 2 ranks", "files": {name: bytes},
                           "tensors": {"model.lm_head.weight": {"shape": [256, 64],
                             "dtype": "float32", "block_columns": 64, "slices": [
                               {"file": "rank_00001.bin", "offset": 0, "box": [[128, 256],
                                [0, 64]], "crc32": "<base64: one CRC32 per unit>"}, ...]}}}
      step_000000300/

A *layout* is what one rank holds: a list of entries ``{"name", "tensor", "full_shape",
"boxes", "write"}``: the local tensor, the full tensor's shape, a list of ``(local_box,
full_box)`` pairs (this part of the local tensor is that part of the full one) and whether
this rank writes it. Names: ``model.<parameter>``, ``optimizer.<parameter>.<state key>``
(AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``); anything else is extra state.
``layouts.py`` beside this file builds them for DDP, ZeRO-1, FSDP and the grid of lesson 7.

    stats = save("ckpt", layout, step=200, layout_name="fsdp at 4 ranks")   # every rank
    folder = latest_checkpoint("ckpt")        # None when there is no complete checkpoint
    stats = load(folder, other_layout)        # every rank of the other layout
    state = consolidate(folder)               # one process: {"model", "optimizer", "step", ...}

A damaged checkpoint (a truncated or corrupted file, a missing one, another model's, one this
layout cannot hold) raises ``CheckpointError`` on every rank with one line naming the file and
what is wrong, and nothing is loaded: every rank reads into buffers first, the ranks agree,
and only then are the buffers copied into the layout's tensors.

A checkpoint is untrusted input (people download and share them). Loading one reads nothing
outside its folder: the manifest is validated against its schema first (``manifest_problem``:
types, ranges, the step equal to the folder's number), it may name only ``rank_<digits>.bin``
files, and each is opened inside the folder without following a symbolic link. Saving never
deletes what it did not make: every folder it makes holds a marker (``MARKER``), and pruning
touches only folders with it. One run per directory: ``lock(root)`` (a flock, which dies with
its process), and ``check_directory(root)`` tries the directory before a run relies on it:

    check_directory("ckpt")                   # made if missing, written to once; or one line
    held = lock("ckpt")                       # a second run: CheckpointError, one line

Torch alone (and Python's standard library): copy this file anywhere.
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import json
import os
import re
import shutil
import stat
import struct
import tempfile
import zlib
from pathlib import Path

try:
    import fcntl                # flock, for the lock on a checkpoint directory (not on Windows)
except ImportError:
    fcntl = None

import torch
import torch.distributed as dist

FORMAT = "distributed-training-from-scratch/checkpoint/1"
MANIFEST = "manifest.json"
FOLDER = re.compile(r"step_(\d+)")                 # a checkpoint's folder: step_000000200
SHARD = re.compile(r"rank_\d{5,}\.bin")            # the only files a manifest may name
MARKER = "checkpoint-format.txt"    # in every folder save() makes: proof that it is ours
LOCK = "checkpoint.lock"            # in the checkpoint directory, held by one run at a time
# The dtypes a manifest may name (a name is looked up in this table, never in torch itself).
DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
          "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}
# Files handed to us are opened without following a symbolic link (where the system has it).
NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)


class CheckpointError(Exception):
    """A checkpoint that cannot be used: one line naming the file and what is wrong.
    ``found_by``: the ranks that found the problem themselves (the others were told)."""

    def __init__(self, message: str, found_by=()):
        super().__init__(message)
        self.found_by = list(found_by)


# --------------------------------------------------------------------------- boxes


def box_shape(box) -> list[int]:
    return [stop - start for start, stop in box]


def box_numel(box) -> int:
    count = 1
    for size in box_shape(box):
        count *= size
    return count


def intersect(box_a, box_b):
    """The box both hold, or None: per dimension [max(starts), min(stops))."""
    overlap = []
    for (start_a, stop_a), (start_b, stop_b) in zip(box_a, box_b):
        start = max(start_a, start_b)
        stop = min(stop_a, stop_b)
        if start >= stop:
            return None
        overlap.append([start, stop])
    return overlap


def as_index(box) -> tuple:
    """A box as an index: tensor[as_index(box)] is that part of the tensor."""
    return tuple(slice(start, stop) for start, stop in box)


def rows_and_columns(box) -> tuple[int, list[int]]:
    """A box seen as a matrix: its rows (every index but the last) and its last dimension's
    [start, stop). A 1-D box is one row; a scalar (0-D) one row of one column."""
    if len(box) == 0:
        return 1, [0, 1]
    rows = 1
    for start, stop in box[:-1]:
        rows *= stop - start
    return rows, list(box[-1])


def unit_cuts(columns: list[int], block_columns: int) -> list[int]:
    """Where a saved box's rows are cut into checksummed units, in the box's own columns: 0,
    every multiple of ``block_columns`` (in the full tensor's columns) inside it, its width.
    E.g. columns [20, 70) with blocks of 32 -> [0, 12, 44, 50]: three units per row."""
    start, stop = columns
    cuts = [0]
    multiple = (start // block_columns + 1) * block_columns
    while multiple < stop:
        cuts.append(multiple - start)
        multiple += block_columns
    cuts.append(stop - start)
    return cuts


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    return DTYPES[name]


def rank_and_size(group) -> tuple[int, int]:
    """This rank and the group's size; one process (0, 1) when there is no process group."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


# --------------------------------------------------------------------------- checksums


def unit_checksums(data: memoryview, box, block_columns: int, element_size: int) -> list[int]:
    """The CRC32 of every unit of one saved box (its bytes ``data``, row-major): row by row,
    each row cut at ``unit_cuts``."""
    rows, columns = rows_and_columns(box)
    cuts = unit_cuts(columns, block_columns)
    row_bytes = (columns[1] - columns[0]) * element_size
    checksums = []
    for row in range(rows):
        row_start = row * row_bytes
        for left, right in zip(cuts, cuts[1:]):
            unit = data[row_start + left * element_size:row_start + right * element_size]
            checksums.append(zlib.crc32(unit))
    return checksums


def encode_checksums(checksums: list[int]) -> str:
    packed = struct.pack(f"<{len(checksums)}I", *checksums)   # 4 bytes each, little-endian
    return base64.b64encode(packed).decode("ascii")


def decode_checksums(text: str) -> tuple[int, ...]:
    packed = base64.b64decode(text)
    return struct.unpack(f"<{len(packed) // 4}I", packed)


# --------------------------------------------------------------------------- the directory


def check_directory(root) -> Path:
    """A checkpoint directory that can be used: named (``''`` would be the current folder), a
    folder (made if missing), and writable, tried by writing a file in it, not guessed from
    its permissions. Raises CheckpointError in one line; returns the folder."""
    if root is None or str(root) == "":
        raise CheckpointError("the checkpoint directory is '': give a folder (one of its own: "
                              "checkpoints are saved into it and old ones pruned)")
    folder = Path(root)
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder (a checkpoint directory is a folder)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CheckpointError(f"{folder}: cannot be made ({error.strerror})") from None
    try:
        handle, trial = tempfile.mkstemp(dir=folder, prefix=".write-test-")
        try:
            os.write(handle, b"checkpoint")
            os.fsync(handle)
        finally:
            os.close(handle)
            os.unlink(trial)
    except OSError as error:
        raise CheckpointError(f"{folder}: not writable ({error.strerror})") from None
    return folder


def lock(root):
    """Take the checkpoint directory for this run: an exclusive ``flock`` on its lock file,
    held while the returned file is open. A second run gets CheckpointError, one line naming
    the process that holds it. The kernel drops a flock when its process dies, however it
    dies, so a killed run's lock file left behind is not held: it is simply taken again."""
    path = Path(root) / LOCK
    try:
        handle = os.open(path, os.O_RDWR | os.O_CREAT | NO_FOLLOW, 0o644)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be opened ({error.strerror})") from None
    held = open(handle, "r+b", buffering=0)
    if fcntl is None:           # no flock on this system: the lock is a no-op there
        return held
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
    """Give the directory back (closing the file drops the flock)."""
    held.close()


# --------------------------------------------------------------------------- save


def checkpoint_folder(root, step: int) -> Path:
    return Path(root) / f"step_{step:09d}"


def is_ours(folder: Path) -> bool:
    """A folder this format made: a real folder (not a link to one) with our marker file in
    it. Only such folders are ever deleted; anything else in the directory is the user's."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    marker = folder / MARKER
    if marker.is_symlink() or not marker.is_file():
        return False
    with open(marker, "rb") as f:
        return f.read(len(FORMAT) + 2).decode(errors="replace").strip() == FORMAT


def our_folders(root) -> list[tuple[int, Path]]:
    """(step, folder) of every folder under ``root`` that this format made, complete or not,
    oldest first."""
    found = []
    root = Path(root)
    if not root.is_dir():
        return found
    for folder in root.iterdir():
        match = FOLDER.fullmatch(folder.name)
        if match is not None and is_ours(folder):
            found.append((int(match.group(1)), folder))
    return sorted(found)


def list_checkpoints(root) -> list[tuple[int, Path]]:
    """(step, folder) of every COMPLETE checkpoint under ``root`` (ours, with its manifest),
    oldest first. A folder without a manifest is a save that did not finish: not listed."""
    found = []
    for step, folder in our_folders(root):
        if (folder / MANIFEST).is_file():
            found.append((step, folder))
    return found


def latest_checkpoint(root) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    found = list_checkpoints(root)
    if not found:
        return None
    return found[-1][1]


def memory_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy: a view that a file can be written
    from or read into, and that zlib can check (ctypes sees the tensor's memory as bytes).
    Valid while the tensor lives."""
    size = tensor.numel() * tensor.element_size()
    if size == 0:
        return memoryview(bytearray())
    array = (ctypes.c_char * size).from_address(tensor.data_ptr())
    return memoryview(array).cast("B")


def staging_plan(layout: list[dict]) -> list[tuple]:
    """The boxes this rank writes, in file order, as (entry, its box in the full tensor, the
    view of the local tensor, whether it must be copied to the host first). A box already
    contiguous in CPU memory is written as it is; any other (a GPU's, or a non-contiguous
    slice, e.g. a tensor-parallel block of columns) is copied. Decided from devices and
    strides alone, so a CPU can count what a GPU's save copies (``staging_counts``)."""
    plan = []
    for entry in layout:
        if not entry["write"]:
            continue
        tensor = entry["tensor"].detach()
        for local_box, full_box in entry["boxes"]:
            view = tensor[as_index(local_box)]
            copy = view.device.type != "cpu" or not view.is_contiguous()
            plan.append((entry, full_box, view, copy))
    return plan


def staging_counts(layout: list[dict]) -> dict:
    """What a save of ``layout`` copies to the host before writing: {"bytes_staged",
    "copies"} (one copy per box that is not already contiguous in CPU memory)."""
    counts = {"bytes_staged": 0, "copies": 0}
    for _, _, view, copy in staging_plan(layout):
        if copy:
            counts["bytes_staged"] += view.numel() * view.element_size()
            counts["copies"] += 1
    return counts


def stage(plan: list[tuple]) -> list[torch.Tensor]:
    """The pieces of the plan in host memory, ready to checksum and write. A GPU's box goes to
    a pinned (page-locked) buffer with ``non_blocking=True``: the GPU's copy engine moves it by
    DMA while the CPU issues the next copy, instead of one blocking copy through a pageable
    bounce buffer per box (torch.distributed.checkpoint stages the same way). Then one wait
    for all of them, before anything reads the buffers."""
    pieces = []
    devices = set()
    for _, _, view, copy in plan:
        if not copy:
            pieces.append(view)
            continue
        host = torch.empty(view.shape, dtype=view.dtype, pin_memory=view.is_cuda)
        host.copy_(view, non_blocking=view.is_cuda)
        if view.is_cuda:
            devices.add(view.device)
        pieces.append(host)
    for device in devices:
        torch.cuda.synchronize(device)      # the copies have landed: the buffers may be read
    return pieces


def pack(layout: list[dict], block_columns: dict) -> tuple[list, list[dict]]:
    """What this rank writes: the pieces (its boxes, contiguous, on the host: ``stage``), in
    file order, and a record of each (name, full shape, dtype, box, offset, one CRC32 per
    unit). Nothing is written yet."""
    plan = staging_plan(layout)
    pieces = stage(plan)
    records = []
    offset = 0
    for (entry, full_box, _, _), piece in zip(plan, pieces):
        element_size = piece.element_size()
        blocks = block_columns.get(entry["name"], max(1, shape_last(entry["full_shape"])))
        checksums = unit_checksums(memory_of(piece), full_box, blocks, element_size)
        records.append({"name": entry["name"], "shape": list(entry["full_shape"]),
                        "dtype": dtype_name(piece.dtype), "block_columns": blocks,
                        "box": [list(pair) for pair in full_box], "offset": offset,
                        "crc32": encode_checksums(checksums)})
        offset += piece.numel() * element_size
    return pieces, records


def shape_last(shape) -> int:
    """The full tensor's last dimension (1 for a scalar)."""
    if len(shape) == 0:
        return 1
    return shape[-1]


def create(path: Path):
    """A new file, opened for writing: never one that is there already, never through a
    symbolic link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | NO_FOLLOW
    return open(os.open(path, flags, 0o644), "wb")


def write_file(path: Path, pieces: list) -> None:
    """Write the pieces back to back, and fsync: on disk before the manifest can name them."""
    with create(path) as f:
        for piece in pieces:
            f.write(memory_of(piece))
        f.flush()
        os.fsync(f.fileno())


def commit_manifest(folder: Path, manifest: dict) -> int:
    """Write the manifest under a temporary name, fsync it, rename it into place (atomic:
    readers see all of it or nothing), fsync the folder so that the rename is on disk too.
    Returns its size in bytes."""
    text = json.dumps(manifest, indent=1)
    temporary = folder / (MANIFEST + ".tmp")
    with create(temporary) as f:
        f.write(text.encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, folder / MANIFEST)
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return len(text.encode())


def prepare_folder(folder: Path) -> str | None:
    """Rank 0, before a save: a fresh folder for it, with our marker in it. What a crashed
    save of ours left there (our folder without a manifest) is removed; a complete checkpoint
    is never overwritten, and a folder that is not ours is never touched."""
    if (folder / MANIFEST).exists():
        return (f"{folder}: already holds a complete checkpoint; a checkpoint is never "
                "overwritten (move it away, or save to another directory)")
    if folder.exists() or folder.is_symlink():
        if not is_ours(folder):
            return (f"{folder}: is there and was not made by this format (no {MARKER} in it); "
                    "it is left alone: move it, or save to another directory")
        shutil.rmtree(folder)
    try:
        folder.mkdir(parents=True)
        with create(folder / MARKER) as f:
            f.write(f"{FORMAT}\n".encode())
    except OSError as error:
        return f"{folder}: cannot be made ({error.strerror})"
    return None


def build_manifest(step: int, layout_name: str, world_size: int, meta: dict,
                   everyone: list) -> tuple[dict, str | None]:
    """Rank 0: every rank's (file name, file size, records) -> the manifest, and the first
    problem: ranks that disagree on a tensor's shape, dtype or units, or boxes that do not
    tile a tensor."""
    files = {}
    tensors = {}
    problem = None
    for file_name, file_size, records in everyone:
        if file_name is not None:
            files[file_name] = file_size
        for record in records:
            name = record["name"]
            described = {"shape": record["shape"], "dtype": record["dtype"],
                         "block_columns": record["block_columns"]}
            if name not in tensors:
                tensors[name] = {**described, "slices": []}
            for key, value in described.items():
                if tensors[name][key] != value and problem is None:
                    problem = (f"{name}: {file_name} says {key} {value}, an earlier file "
                               f"{tensors[name][key]}")
            tensors[name]["slices"].append({"file": file_name, "offset": record["offset"],
                                            "box": record["box"], "crc32": record["crc32"]})
    for name, info in tensors.items():
        if problem is None:
            problem = tiling_problem(name, info)
    manifest = {"format": FORMAT, "step": step, "layout": layout_name,
                "world_size": world_size, "meta": meta, "files": files, "tensors": tensors}
    return manifest, problem


def tiling_problem(name: str, info: dict) -> str | None:
    """The saved boxes of one tensor must tile it: inside it, no two overlapping (a replica
    written twice), and together every element (no rank's part missing)."""
    shape = info["shape"]
    whole = [[0, size] for size in shape]
    covered = 0
    boxes = [piece["box"] for piece in info["slices"]]
    for index, box in enumerate(boxes):
        if len(box) != len(shape) or intersect(box, whole) != box:
            return f"{name}: the box {box} is not inside its shape {shape}"
        for other in boxes[:index]:
            if intersect(box, other) is not None:
                return (f"{name}: the boxes {other} and {box} overlap (a replica written "
                        "twice)")
        covered += box_numel(box)
    numel = box_numel(whole)
    if covered != numel:
        return f"{name}: its saved boxes cover {covered} of its {numel} elements"
    return None


def save(root, layout: list[dict], step: int, layout_name: str, meta: dict | None = None,
         block_columns: dict | None = None, keep: int = 2, group=None) -> dict:
    """Save ``layout`` (this rank's entries; call on every rank of ``group``) as the checkpoint
    of ``step`` under ``root``, keeping the ``keep`` newest. ``meta``: anything JSON the caller
    wants back (optimizer settings, the parameters' order). ``block_columns``: {name: width}
    for tensors a layout may cut along their last dimension (see the module docstring).
    Returns this rank's {"folder", "bytes_written", "manifest_bytes"}. On any problem on any
    rank, every rank raises the same CheckpointError (each rank's verdict is gathered)."""
    if keep < 1:
        raise ValueError(f"save: keep={keep}; keep at least the checkpoint being saved (1)")
    if type(step) is not int or step < 0:
        raise ValueError(f"save: step={step!r}; a step is a whole number >= 0")
    rank, world_size = rank_and_size(group)
    folder = checkpoint_folder(root, step)
    # 1. Rank 0 makes the folder; every rank hears its verdict.
    problem = None
    if rank == 0:
        problem = prepare_folder(folder)
    agree(problem, group)
    # 2. Every rank writes the boxes it writes (a replica: one rank) to its own file.
    pieces, records = pack(layout, block_columns or {})
    size = 0
    for piece in pieces:
        size += piece.numel() * piece.element_size()
    file_name = None
    problem = None
    if size > 0:
        file_name = f"rank_{rank:05d}.bin"
        try:
            write_file(folder / file_name, pieces)
        except OSError as error:
            problem = f"{folder / file_name}: not saved: {error.strerror}"
    agree(problem, group)
    # 3. Rank 0 gathers every description: each rank sends it after its file is on disk, so
    #    when rank 0 has them all, every file is complete. Then, LAST, the manifest.
    mine = (file_name, size, records)
    everyone = gather_to_rank_0(mine, group)
    manifest_bytes = 0
    problem = None
    if rank == 0:
        manifest, problem = build_manifest(step, layout_name, world_size, meta or {}, everyone)
        if problem is not None:
            problem = f"{folder}: not saved: {problem}"
        else:
            try:
                manifest_bytes = commit_manifest(folder, manifest)
                prune(root, keep)
            except OSError as error:
                problem = f"{folder}: not saved: {error.filename}: {error.strerror}"
    agree(problem, group)
    return {"folder": folder, "bytes_written": size, "manifest_bytes": manifest_bytes}


def prune(root, keep: int) -> None:
    """Remove all but the ``keep`` newest complete checkpoints, and what crashed saves older
    than the newest left behind: only folders this format made (``is_ours``), whatever else
    is in the directory."""
    complete = list_checkpoints(root)
    for _, folder in complete[:-keep]:
        shutil.rmtree(folder)
    newest = complete[-1][0]
    for step, folder in our_folders(root):
        if step < newest and not (folder / MANIFEST).exists():
            shutil.rmtree(folder)


def gather_to_rank_0(mine, group) -> list | None:
    """Every rank's ``mine`` on the group's rank 0 (None elsewhere)."""
    rank, world_size = rank_and_size(group)
    if world_size == 1:
        return [mine]
    everyone = None
    if rank == 0:
        everyone = [None] * world_size
    dist.gather_object(mine, everyone, dst=dist.get_global_rank(group_or_world(group), 0),
                       group=group)
    return everyone


def group_or_world(group):
    if group is None:
        return dist.group.WORLD
    return group


def agree(problem: str | None, group) -> None:
    """Every rank's verdict on every rank (all_gather): if any rank has a problem, every rank
    raises the first one, naming the ranks that found it; else none does."""
    _, world_size = rank_and_size(group)
    everyone = [problem]
    if world_size > 1:
        everyone = [None] * world_size
        dist.all_gather_object(everyone, problem, group=group)
    found_by = [rank for rank, theirs in enumerate(everyone) if theirs is not None]
    if found_by:
        raise CheckpointError(everyone[found_by[0]], found_by=found_by)


# --------------------------------------------------------------------------- load


def open_inside(folder: Path, file_name: str):
    """Open a file the checkpoint names, for reading, only if it is what this format writes:
    a plain file directly inside ``folder`` (a shard's name matches ``SHARD``, so no ``/``,
    no ``..``, no absolute path), not a symbolic link (O_NOFOLLOW), not a device or a pipe
    (O_NONBLOCK: a pipe does not block the open; then fstat says what it is). A checkpoint
    is something people download and share: nothing outside its folder is ever read.
    Returns (the file, unbuffered, and its size)."""
    path = folder / file_name
    if file_name != MANIFEST and SHARD.fullmatch(file_name) is None:
        raise CheckpointError(f"{folder / MANIFEST}: names the file {file_name!r}; a shard is "
                              "rank_<digits>.bin inside the checkpoint's folder")
    try:
        handle = os.open(path, os.O_RDONLY | NO_FOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError as error:
        if path.is_symlink():
            raise CheckpointError(f"{path}: a symbolic link; a checkpoint's files are read "
                                  "only as plain files inside its folder") from None
        if not path.exists():
            raise CheckpointError(f"{path}: missing") from None
        raise CheckpointError(f"{path}: unreadable ({error.strerror})") from None
    status = os.fstat(handle)
    if not stat.S_ISREG(status.st_mode):
        os.close(handle)
        raise CheckpointError(f"{path}: not a plain file; a checkpoint's files are read only "
                              "as plain files inside its folder")
    return open(handle, "rb", buffering=0), status.st_size


def read_manifest(folder) -> dict:
    """The manifest of the checkpoint in ``folder``, validated (``manifest_problem``) before
    anything it names is read."""
    folder = Path(folder)
    path = folder / MANIFEST
    match = FOLDER.fullmatch(folder.name)
    if match is None:
        raise CheckpointError(f"{folder}: not a checkpoint's folder (step_<digits>, as save() "
                              "names them)")
    if not path.exists() and not path.is_symlink():
        raise CheckpointError(f"{path}: missing: {folder} is not a complete checkpoint (a save "
                              "that did not finish leaves no manifest)")
    f, _ = open_inside(folder, MANIFEST)
    try:
        with f:
            manifest = json.loads(f.read().decode())
    except (OSError, ValueError) as error:
        message = str(error).splitlines()[0]
        raise CheckpointError(f"{path}: unreadable ({message})") from None
    problem = manifest_problem(manifest, int(match.group(1)))
    if problem is not None:
        raise CheckpointError(f"{path}: {problem}")
    return manifest


def is_count(value) -> bool:
    """A whole number >= 0 (JSON's 1e30 and 2.0 are floats; True is not a count)."""
    return type(value) is int and value >= 0


def manifest_problem(manifest, folder_step: int) -> str | None:
    """The manifest against its schema: the first thing wrong, in words, or None. Types and
    ranges of every field, the step equal to the folder's number, every shard name one this
    format writes, every box inside its tensor and inside its file, the checksums one per
    unit, and the boxes of each tensor tiling it."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"not a manifest of this format ({FORMAT})"
    step = manifest.get("step")
    if not is_count(step):
        return f"step {step!r}: not a whole number >= 0"
    if step != folder_step:
        return f"says step {step}, its folder step {folder_step}"
    if not isinstance(manifest.get("layout"), str):
        return "layout: not a string"
    world_size = manifest.get("world_size")
    if not is_count(world_size) or world_size < 1:
        return f"world_size {world_size!r}: not a whole number >= 1"
    if not isinstance(manifest.get("meta"), dict):
        return "meta: not an object"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return "files: not an object"
    for file_name, size in files.items():
        if SHARD.fullmatch(file_name) is None:
            return (f"names the file {file_name!r}; a shard is rank_<digits>.bin inside the "
                    "checkpoint's folder")
        if not is_count(size):
            return f"files: {file_name} has size {size!r}, not a whole number >= 0"
    tensors = manifest.get("tensors")
    if not isinstance(tensors, dict) or not tensors:
        return "tensors: not an object naming at least one tensor"
    for name, info in tensors.items():
        problem = tensor_problem(name, info, files)
        if problem is not None:
            return problem
    return None


def tensor_problem(name: str, info, files: dict) -> str | None:
    """One tensor's entry of the manifest: shape, dtype, block_columns, and its slices."""
    if not isinstance(info, dict):
        return f"{name}: not an object"
    shape = info.get("shape")
    if not isinstance(shape, list) or not all(is_count(size) for size in shape):
        return f"{name}: shape {shape!r} is not a list of whole numbers >= 0"
    if info.get("dtype") not in DTYPES:
        return f"{name}: dtype {info.get('dtype')!r} is not one of {', '.join(DTYPES)}"
    block_columns = info.get("block_columns")
    if not is_count(block_columns) or block_columns < 1:
        return f"{name}: block_columns {block_columns!r} is not a whole number >= 1"
    slices = info.get("slices")
    if not isinstance(slices, list) or not slices:
        return f"{name}: slices is not a list of at least one slice"
    element_size = torch.empty((), dtype=DTYPES[info["dtype"]]).element_size()
    for saved in slices:
        problem = slice_problem(name, saved, shape, block_columns, element_size, files)
        if problem is not None:
            return problem
    return tiling_problem(name, info)


def slice_problem(name: str, saved, shape, block_columns: int, element_size: int,
                  files: dict) -> str | None:
    """One saved box: in a file the manifest lists, at an offset where it fits in that file,
    a box inside the tensor ([start, stop) with 0 <= start < stop <= size per dimension),
    and one CRC32 per unit."""
    if not isinstance(saved, dict):
        return f"{name}: a slice is not an object"
    file_name = saved.get("file")
    if file_name not in files:
        return f"{name}: a slice is in {file_name!r}, which is not in the manifest's files"
    offset = saved.get("offset")
    if not is_count(offset):
        return f"{name}: offset {offset!r} in {file_name} is not a whole number >= 0"
    box = saved.get("box")
    if not isinstance(box, list) or len(box) != len(shape):
        return f"{name}: the box {box!r} is not one [start, stop) per dimension of {shape}"
    for pair, size in zip(box, shape):
        if not isinstance(pair, list) or len(pair) != 2 or not all(is_count(v) for v in pair):
            return f"{name}: the box {box!r} is not one [start, stop) per dimension of {shape}"
        if not pair[0] < pair[1] <= size:
            return f"{name}: the box {box} is not inside its shape {shape}"
    end = offset + box_numel(box) * element_size
    if end > files[file_name]:
        return (f"{name}: the box {box} at offset {offset} ends at byte {end}, past the "
                f"{files[file_name]} bytes of {file_name}")
    text = saved.get("crc32")
    try:
        packed = base64.b64decode(text, validate=True)
    except (TypeError, ValueError, binascii.Error):
        return f"{name}: crc32 in {file_name} is not base64"
    rows, columns = rows_and_columns(box)
    units = rows * (len(unit_cuts(columns, block_columns)) - 1)
    if len(packed) != 4 * units:
        return (f"{name}: {len(packed) // 4} CRC32s in {file_name} for the {units} units of "
                f"the box {box}")
    return None


def check_layout(manifest: dict, layout: list[dict], path: Path) -> None:
    """Before reading anything: every tensor this rank will hold is in the checkpoint with the
    same full shape and dtype (that its saved boxes tile it, read_manifest has checked)."""
    for entry in layout:
        name = entry["name"]
        info = manifest["tensors"].get(name)
        if info is None:
            raise CheckpointError(f"{path}: has no {name}, which this layout holds (a layout "
                                  "this checkpoint cannot fill)")
        if list(info["shape"]) != list(entry["full_shape"]):
            raise CheckpointError(f"{path}: {name} is {info['shape']} there and "
                                  f"{list(entry['full_shape'])} in this layout (a checkpoint "
                                  "of another model?)")
        if info["dtype"] != dtype_name(entry["tensor"].dtype):
            raise CheckpointError(f"{path}: {name} was saved as {info['dtype']}; this layout "
                                  f"holds {dtype_name(entry['tensor'].dtype)}")


class Reader:
    """Reads the bytes of saved boxes, checking each file's size once and every unit's CRC32,
    and counts what it reads."""

    def __init__(self, folder: Path, manifest: dict):
        self.folder = folder
        self.manifest = manifest
        self.files = {}             # file name -> open file
        self.checksums = {}         # id(saved slice) -> its decoded CRC32s
        self.bytes_read = 0         # bytes read from the files
        self.bytes_needed = 0       # bytes of the overlaps themselves
        self.reads = 0

    def open(self, file_name: str):
        if file_name in self.files:
            return self.files[file_name]
        path = self.folder / file_name
        expected = self.manifest["files"][file_name]
        if not path.exists() and not path.is_symlink():
            raise CheckpointError(f"{path}: missing (the manifest lists it with {expected} "
                                  "bytes)")
        f, size = open_inside(self.folder, file_name)     # no read-ahead: we count
        if size != expected:
            f.close()
            raise CheckpointError(f"{path}: truncated or overwritten: {size} bytes, the "
                                  f"manifest says {expected}")
        self.files[file_name] = f
        return f

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files = {}

    def read_overlap(self, name: str, saved: dict, overlap, region: torch.Tensor) -> None:
        """Fill ``region`` (where this rank holds it) with the values of ``overlap`` (a box
        inside the saved box), read from the file: the rows of the overlap, each row only the
        columns it needs, widened to whole units if the overlap cuts one (no layout here does:
        see the module docstring); every unit checked. Whole rows into a contiguous region
        are read straight into it; anything else through a buffer."""
        info = self.manifest["tensors"][name]
        dtype = dtype_from_name(info["dtype"])
        element_size = torch.empty((), dtype=dtype).element_size()
        box = saved["box"]
        _, saved_columns = rows_and_columns(box)
        _, wanted_columns = rows_and_columns(overlap)
        width = saved_columns[1] - saved_columns[0]
        cuts = unit_cuts(saved_columns, info["block_columns"])
        first = wanted_columns[0] - saved_columns[0]     # in the saved box's own columns
        last = wanted_columns[1] - saved_columns[0]
        first_unit = max(index for index, cut in enumerate(cuts) if cut <= first)
        last_unit = min(index for index, cut in enumerate(cuts) if cut >= last)
        left = cuts[first_unit]                          # what is read of each row
        right = cuts[last_unit]
        rows = saved_rows(box, overlap)
        whole_rows = left == 0 and right == width
        straight = whole_rows and region.is_contiguous()
        if straight:
            buffer = region
        else:
            buffer = torch.empty(len(rows) * (right - left), dtype=dtype)
        view = memory_of(buffer)
        f = self.open(saved["file"])
        position = 0
        for first_row, row_count in row_runs(rows, whole_rows):
            start = saved["offset"] + (first_row * width + left) * element_size
            size = row_count * (right - left) * element_size
            got = read_into(f, start, view[position:position + size])
            if got != size:
                raise CheckpointError(f"{self.folder / saved['file']}: ends at byte "
                                      f"{start + got}; {name} needs bytes up to {start + size}")
            position += size
            self.bytes_read += size
            self.reads += 1
        self.check_units(name, saved, view, rows, cuts, first_unit, last_unit, element_size)
        self.bytes_needed += box_numel(overlap) * element_size
        if not straight:
            values = buffer.view(len(rows), right - left)[:, first - left:last - left]
            region.copy_(values.reshape(box_shape(overlap)))

    def check_units(self, name, saved, view, rows, cuts, first_unit, last_unit,
                    element_size) -> None:
        """Every unit read, against its CRC32 in the manifest."""
        key = id(saved)
        if key not in self.checksums:
            self.checksums[key] = decode_checksums(saved["crc32"])
        checksums = self.checksums[key]
        units_per_row = len(cuts) - 1
        read_width = (cuts[last_unit] - cuts[first_unit]) * element_size
        for index, row in enumerate(rows):
            for unit in range(first_unit, last_unit):
                start = index * read_width + (cuts[unit] - cuts[first_unit]) * element_size
                stop = start + (cuts[unit + 1] - cuts[unit]) * element_size
                if zlib.crc32(view[start:stop]) != checksums[row * units_per_row + unit]:
                    where = saved["offset"] + (row * cuts[-1] + cuts[unit]) * element_size
                    raise CheckpointError(
                        f"{self.folder / saved['file']}: corrupted: {name}, box {saved['box']}, "
                        f"row {row}, bytes {where}..{where + stop - start} fail their CRC32 "
                        "check")


def read_into(f, start: int, view: memoryview) -> int:
    """Read ``len(view)`` bytes from ``start`` of an unbuffered file; returns how many there
    were (fewer only at the end of the file)."""
    f.seek(start)
    got = 0
    while got < len(view):
        count = f.readinto(view[got:])
        if not count:
            break
        got += count
    return got


def saved_rows(box, overlap) -> list[int]:
    """The rows of the saved ``box`` (counted row-major inside it) that ``overlap`` touches."""
    rows = [0]
    for (start, stop), (overlap_start, overlap_stop) in zip(box[:-1], overlap[:-1]):
        size = stop - start
        widened = []
        for row in rows:
            for index in range(overlap_start - start, overlap_stop - start):
                widened.append(row * size + index)
        rows = widened
    return rows


def row_runs(rows: list[int], whole_rows: bool) -> list[tuple[int, int]]:
    """(first row, count) of each read: consecutive whole rows are consecutive bytes, one read;
    rows read in part are one read each."""
    runs = []
    for row in rows:
        if whole_rows and runs and runs[-1][0] + runs[-1][1] == row:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((row, 1))
    return runs


def place(staging: torch.Tensor, local_box, full_box, overlap) -> torch.Tensor:
    """Where the overlap sits in this rank's tensor: its offset inside the full box, moved to
    the local box. Returns that region of ``staging`` (a view)."""
    where = []
    for (local_start, _), (full_start, _), (start, stop) in zip(local_box, full_box, overlap):
        where.append([start - full_start + local_start, stop - full_start + local_start])
    return staging[as_index(where)]


def read_layout(folder: Path, manifest: dict, layout: list[dict]) -> tuple[list, Reader]:
    """Every tensor of the layout, assembled in a buffer of its own (on the CPU; zeros where no
    box is: FSDP's padding): for each of its boxes, the overlap with each saved box."""
    reader = Reader(folder, manifest)
    staged = []
    try:
        for entry in layout:
            tensor = entry["tensor"]
            held = 0
            for local_box, _ in entry["boxes"]:
                held += box_numel(local_box)
            if held == tensor.numel():
                staging = torch.empty(tensor.shape, dtype=tensor.dtype)
            else:                               # zeros where no box is (FSDP's padding)
                staging = torch.zeros(tensor.shape, dtype=tensor.dtype)
            saved_boxes = manifest["tensors"][entry["name"]]["slices"]
            for local_box, full_box in entry["boxes"]:
                for saved in saved_boxes:
                    overlap = intersect(saved["box"], full_box)
                    if overlap is None:
                        continue
                    region = place(staging, local_box, full_box, overlap)
                    reader.read_overlap(entry["name"], saved, overlap, region)
            staged.append(staging)
    finally:
        reader.close()
    return staged, reader


def read_checked(folder: Path, layout: list[dict]) -> tuple[list, dict, str | None, dict]:
    """This rank's part of a load, alone (no collective): the manifest, the layout checked
    against it, every overlap read and checked into buffers. Returns (the buffers, the
    counts, the first problem or None, the manifest or None)."""
    stats = {"bytes_read": 0, "bytes_needed": 0, "reads": 0, "manifest_bytes": 0, "step": None}
    try:
        manifest = read_manifest(folder)
        stats["step"] = manifest["step"]
        stats["manifest_bytes"] = (folder / MANIFEST).stat().st_size
        check_layout(manifest, layout, folder / MANIFEST)
        staged, reader = read_layout(folder, manifest, layout)
    except CheckpointError as error:
        return [], stats, str(error), None
    stats["bytes_read"] = reader.bytes_read
    stats["bytes_needed"] = reader.bytes_needed
    stats["reads"] = reader.reads
    return staged, stats, None, manifest


def load(folder, layout: list[dict], group=None, strict: bool = True) -> dict:
    """Fill ``layout`` (this rank's entries; call on every rank of ``group``) from the
    checkpoint in ``folder``: each rank reads only the saved bytes that overlap its boxes.
    ``strict``: every saved tensor must be held by some rank of the group. All or nothing:
    on any problem on any rank, every rank raises the same CheckpointError and no tensor of
    the layout has changed. Returns this rank's {"bytes_read", "bytes_needed", "reads",
    "manifest_bytes", "step"}."""
    folder = Path(folder)
    _, world_size = rank_and_size(group)
    staged, stats, problem, manifest = read_checked(folder, layout)
    names = sorted(set(entry["name"] for entry in layout))
    everyone = [(problem, names)]
    if world_size > 1:                  # one verdict: every rank's problem and what it holds
        everyone = [None] * world_size
        dist.all_gather_object(everyone, (problem, names), group=group)
    found_by = [rank for rank, (theirs, _) in enumerate(everyone) if theirs is not None]
    if found_by:
        raise CheckpointError(everyone[found_by[0]][0], found_by=found_by)
    if strict:
        held = set()
        for _, theirs in everyone:
            held.update(theirs)
        problem = unheld_problem(manifest, held, folder)
        if problem is not None:
            raise CheckpointError(problem, found_by=list(range(world_size)))
    commit(layout, staged)
    return stats


def commit(layout: list[dict], staged: list) -> None:
    """Every rank has everything: now, and only now, the buffers go into the layout."""
    with torch.no_grad():
        for entry, staging in zip(layout, staged):
            entry["tensor"].copy_(staging)


def unheld_problem(manifest: dict, held: set, folder: Path) -> str | None:
    missing = [name for name in manifest["tensors"] if name not in held]
    if not missing:
        return None
    return (f"{folder / MANIFEST}: {len(missing)} saved tensor(s) that no rank of this layout "
            f"holds, e.g. {missing[0]} (a layout that cannot hold this checkpoint)")


# --------------------------------------------------------------------------- one file


def consolidate(folder) -> dict:
    """The whole checkpoint in one process, every unit checked: {"model": the plain model's
    state_dict, "optimizer": a plain AdamW's state_dict (or None), "extra": other tensors,
    "step", "meta"}. The optimizer's parameter order: ``meta["parameter_order"]`` when the
    saver gave it, else the manifest's order of the model's tensors."""
    manifest = read_manifest(folder)
    for file_name, expected in manifest["files"].items():    # before allocating what it says
        f, size = open_inside(Path(folder), file_name)
        f.close()
        if size != expected:
            raise CheckpointError(f"{Path(folder) / file_name}: truncated or overwritten: {size} "
                                  f"bytes, the manifest says {expected}", found_by=[0])
    layout = []
    for name, info in manifest["tensors"].items():
        whole = [[0, size] for size in info["shape"]]
        tensor = torch.zeros(info["shape"], dtype=dtype_from_name(info["dtype"]))
        layout.append({"name": name, "tensor": tensor, "full_shape": info["shape"],
                       "boxes": [(whole, whole)], "write": True})
    staged, _, problem, _ = read_checked(Path(folder), layout)   # this process alone
    if problem is not None:
        raise CheckpointError(problem, found_by=[0])
    commit(layout, staged)
    tensors = {}
    for entry in layout:
        tensors[entry["name"]] = entry["tensor"]
    meta = manifest.get("meta", {})
    model = {}
    for name, tensor in tensors.items():
        if name.startswith("model."):
            model[name.removeprefix("model.")] = tensor
    order = meta.get("parameter_order", list(model))
    optimizer_state = {}
    for index, parameter in enumerate(order):
        state = {}
        for key in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            name = f"optimizer.{parameter}.{key}"
            if name in tensors:
                state[key] = tensors[name]
        if state:
            optimizer_state[index] = state
    optimizer = None
    if optimizer_state:
        options = dict(meta.get("optimizer", {}))
        options["params"] = list(range(len(order)))
        optimizer = {"state": optimizer_state, "param_groups": [options]}
    extra = {}
    for name, tensor in tensors.items():
        if not name.startswith(("model.", "optimizer.")):
            extra[name] = tensor
    return {"model": model, "optimizer": optimizer, "extra": extra, "step": manifest["step"],
            "meta": meta}
