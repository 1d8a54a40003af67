"""Stage 07, lesson 8: sharded checkpoints that survive a crash and a change of layout.

Each rank writes what it holds to a file of its own, each piece described by a *box*: one
``[start, stop)`` per dimension of the full tensor (a replica: by one rank). Rank 0 then
renames ``manifest.json`` into place, last and atomic: no manifest, no checkpoint. A rank
loading box ``T`` reads from each saved box ``S`` only ``S n T``, checking a CRC32 per *unit*
(a row of a box, cut at multiples of ``block_columns``). See layouts.py, safety.py. Torch alone.

    save("ckpt", layout, step=200, layout_name="fsdp at 4 ranks")   # every rank
    load(latest_checkpoint("ckpt"), other_layout)          # every rank of another layout
    state = consolidate(folder)           # one process: {"model", "optimizer", "step", ...}
"""

from __future__ import annotations

import base64
import ctypes
import json
import math
import os
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from safety import (DTYPES, FORMAT, LOCK, MANIFEST, MARKER,  # noqa: F401
                    CheckpointError, lock, open_inside, our_folders, prepare_folder, prune,
                    read_manifest, tiling_problem, unlock)


def box_shape(box) -> list[int]:
    return [stop - start for start, stop in box]


def as_index(box) -> tuple:
    return tuple(slice(start, stop) for start, stop in box)


def unit_cuts(box, block_columns: int) -> list[int]:
    """Where a row of a saved box is cut into units, in its own columns: columns [20, 70),
    blocks of 32 -> [0, 12, 44, 50]. (A scalar is one row of one column.)"""
    start, stop = box[-1] if box else (0, 1)
    inside = range((start // block_columns + 1) * block_columns, stop, block_columns)
    return [0] + [cut - start for cut in inside] + [stop - start]


def memory_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, no copy (valid while the tensor lives)."""
    size = tensor.numel() * tensor.element_size()
    if size == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * size).from_address(tensor.data_ptr())).cast("B")


def checkpoint_folder(root, step: int) -> Path:
    return Path(root) / f"step_{step:09d}"


def list_checkpoints(root) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint (ours, with its manifest), oldest first."""
    return [(step, folder) for step, folder in our_folders(root) if (folder / MANIFEST).is_file()]


def latest_checkpoint(root) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def staging_plan(layout: list[dict]) -> list[tuple]:
    """(entry, full box, view, copy?) of each box this rank writes; copy: not contiguous on CPU."""
    plan = []
    for entry in layout:
        for local_box, full_box in entry["boxes"] if entry["write"] else []:
            view = entry["tensor"].detach()[as_index(local_box)]
            copy = view.device.type != "cpu" or not view.is_contiguous()
            plan.append((entry, full_box, view, copy))
    return plan


def pack(layout: list[dict], block_columns: dict) -> tuple[list, list[dict]]:
    """This rank's pieces on the host, in file order, and a record of each (name, shape,
    dtype, box, offset, CRC32s). A GPU's box: pinned memory, non_blocking, one synchronize."""
    plan = staging_plan(layout)
    pieces = [view for _, _, view, _ in plan]
    for index, (_, _, view, copy) in enumerate(plan):
        if copy:
            pieces[index] = torch.empty(view.shape, dtype=view.dtype, pin_memory=view.is_cuda)
            pieces[index].copy_(view, non_blocking=view.is_cuda)
    if any(view.is_cuda for _, _, view, _ in plan):
        torch.cuda.synchronize()
    records = []
    offset = 0
    for (entry, full_box, _, _), piece in zip(plan, pieces):
        shape = list(entry["full_shape"])
        blocks = block_columns.get(entry["name"], max(1, shape[-1] if shape else 1))
        cuts = unit_cuts(full_box, blocks)
        data = memory_of(piece)
        size = piece.element_size()
        crcs = [zlib.crc32(data[row + left * size:row + right * size])     # row by row
                for row in range(0, len(data), cuts[-1] * size)
                for left, right in zip(cuts, cuts[1:])]
        packed = b"".join(crc.to_bytes(4, "little") for crc in crcs)
        records.append({"name": entry["name"], "shape": shape, "block_columns": blocks,
                        "dtype": str(piece.dtype).removeprefix("torch."), "offset": offset,
                        "box": [list(pair) for pair in full_box],
                        "crc32": base64.b64encode(packed).decode()})
        offset += len(data)
    return pieces, records


def write_file(path: Path, pieces: list) -> None:
    """The pieces (tensors or bytes) in a new file, no link followed, fsynced."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    with open(os.open(path, flags, 0o644), "wb") as f:
        for piece in pieces:
            f.write(memory_of(piece) if torch.is_tensor(piece) else piece)
        f.flush()
        os.fsync(f.fileno())


def commit_manifest(folder: Path, manifest: dict) -> int:
    """The manifest under a temporary name, renamed (atomic), the folder fsynced: its size."""
    text = json.dumps(manifest, indent=1).encode()
    write_file(folder / (MANIFEST + ".tmp"), [text])
    os.replace(folder / (MANIFEST + ".tmp"), folder / MANIFEST)
    directory = os.open(folder, os.O_RDONLY)
    os.fsync(directory)
    os.close(directory)
    return len(text)


def build_manifest(step: int, layout_name: str, world_size: int, meta: dict,
                   everyone: list) -> tuple[dict, str | None]:
    """Rank 0: every rank's (file, size, records) -> the manifest, and the first problem
    (ranks disagreeing on a tensor, or boxes that do not tile it)."""
    files = {name: size for name, size, _ in everyone if name is not None}
    tensors = {}
    problem = None
    for file_name, _, records in everyone:
        for record in records:
            described = {key: record[key] for key in ("shape", "dtype", "block_columns")}
            info = tensors.setdefault(record["name"], {**described, "slices": []})
            if {key: info[key] for key in described} != described and problem is None:
                problem = f"{record['name']}: ranks disagree on its shape, dtype or units"
            info["slices"].append({"file": file_name, "offset": record["offset"],
                                   "box": record["box"], "crc32": record["crc32"]})
    for name, info in tensors.items():
        problem = problem or tiling_problem(name, info["shape"], [s["box"] for s in info["slices"]])
    return {"format": FORMAT, "step": step, "layout": layout_name, "world_size": world_size,
            "meta": meta, "files": files, "tensors": tensors}, problem


def save(root, layout: list[dict], step: int, layout_name: str, meta: dict | None = None,
         block_columns: dict | None = None, keep: int = 2, group=None) -> dict:
    """Every rank of ``group``: save its ``layout`` as ``step`` under ``root``, keeping the
    ``keep`` newest; ``meta``: JSON given back. On any rank's problem every rank raises."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    folder = checkpoint_folder(root, step)
    agree(prepare_folder(folder) if rank == 0 else None, group)     # 1. rank 0: the folder
    pieces, records = pack(layout, block_columns or {})             # 2. every rank: its file
    size = sum(piece.numel() * piece.element_size() for piece in pieces)
    file_name = f"rank_{rank:05d}.bin" if size > 0 else None
    problem = None
    try:
        if file_name is not None:
            write_file(folder / file_name, pieces)
    except OSError as error:
        problem = f"{folder / file_name}: not saved: {error.strerror}"
    # 3. each rank's records reach rank 0 after its file is on disk; then, LAST, the manifest
    everyone = agree(problem, group, (file_name, size, records))
    manifest_bytes = 0
    if rank == 0:
        manifest, problem = build_manifest(step, layout_name, len(everyone), meta or {}, everyone)
        try:
            if problem is None:
                manifest_bytes = commit_manifest(folder, manifest)
                prune(root, keep)
        except OSError as error:
            problem = f"{error.filename}: {error.strerror}"
        problem = problem and f"{folder}: not saved: {problem}"
    agree(problem, group)
    return {"folder": folder, "bytes_written": size, "manifest_bytes": manifest_bytes}


def agree(problem: str | None, group, mine=None) -> list:
    """Any rank's problem is raised on every rank (naming who found it); else everyone's mine."""
    everyone = [(problem, mine)]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, (problem, mine), group=group)
    found_by = [rank for rank, (theirs, _) in enumerate(everyone) if theirs is not None]
    if found_by:
        raise CheckpointError(everyone[found_by[0]][0], found_by=found_by)
    return [theirs for _, theirs in everyone]


class Reader:
    """Reads overlaps of saved boxes: each file's size checked once, every unit's CRC32."""

    def __init__(self, folder: Path, manifest: dict):
        self.folder = folder
        self.manifest = manifest
        self.files = {}
        self.stats = {"bytes_read": 0, "bytes_needed": 0, "step": manifest["step"],
                      "manifest_bytes": (folder / MANIFEST).stat().st_size}

    def read_overlap(self, name: str, saved: dict, overlap, region: torch.Tensor) -> None:
        """Fill ``region`` with ``overlap``: of the rows it touches, the units holding its
        columns; whole rows into a contiguous region are read straight into it."""
        box = saved["box"]
        cuts = unit_cuts(box, self.manifest["tensors"][name]["block_columns"])
        first, last = 0, 1                                  # the overlap's columns in the box
        if box:
            first, last = overlap[-1][0] - box[-1][0], overlap[-1][1] - box[-1][0]
        first_unit = max(i for i, cut in enumerate(cuts) if cut <= first)
        last_unit = min(i for i, cut in enumerate(cuts) if cut >= last)
        left, right = cuts[first_unit], cuts[last_unit]     # the columns read of each row
        rows = [0]                                          # the saved rows it touches
        for (start, stop), (saved_start, saved_stop) in zip(overlap[:-1], box[:-1]):
            rows = [row * (saved_stop - saved_start) + index - saved_start
                    for row in rows for index in range(start, stop)]
        whole_rows = left == 0 and right == cuts[-1]
        straight = whole_rows and region.is_contiguous()
        buffer = region
        if not straight:
            buffer = torch.empty(len(rows) * (right - left), dtype=region.dtype)
        view = memory_of(buffer)
        size = buffer.element_size()
        if saved["file"] not in self.files:
            self.files[saved["file"]] = open_checked(self.folder, saved["file"], self.manifest)
        position = 0
        runs = []                   # [first row, count]: whole rows in a row are one read
        for row in rows:
            if whole_rows and runs and sum(runs[-1]) == row:
                runs[-1][1] += 1
            else:
                runs.append([row, 1])
        for first_row, count in runs:
            start = saved["offset"] + (first_row * cuts[-1] + left) * size
            length = count * (right - left) * size
            chunk = view[position:position + length]
            if os.preadv(self.files[saved["file"]].fileno(), [chunk], start) != length:
                raise CheckpointError(f"{self.folder / saved['file']}: ends before byte "
                                      f"{start + length}")
            position += length
        self.stats["bytes_read"] += position
        self.check_units(name, saved, view, rows, cuts, first_unit, last_unit, size)
        self.stats["bytes_needed"] += math.prod(box_shape(overlap)) * size
        if not straight:
            values = buffer.view(len(rows), right - left)[:, first - left:last - left]
            region.copy_(values.reshape(box_shape(overlap)))

    def check_units(self, name, saved, view, rows, cuts, first_unit, last_unit, size) -> None:
        """Every unit read against its CRC32 in the manifest."""
        checksums = base64.b64decode(saved["crc32"])
        width = (cuts[last_unit] - cuts[first_unit]) * size
        for index, row in enumerate(rows):
            for unit in range(first_unit, last_unit):
                start = index * width + (cuts[unit] - cuts[first_unit]) * size
                stop = start + (cuts[unit + 1] - cuts[unit]) * size
                at = 4 * (row * (len(cuts) - 1) + unit)
                if zlib.crc32(view[start:stop]) != int.from_bytes(checksums[at:at + 4], "little"):
                    raise CheckpointError(f"{self.folder / saved['file']}: corrupted: {name}, "
                                          f"box {saved['box']}, row {row}, columns {cuts[unit]}.."
                                          f"{cuts[unit + 1]} fail their CRC32 check")


def place(staging: torch.Tensor, local_box, full_box, overlap) -> torch.Tensor:
    """The overlap's place in this rank's tensor (a view of ``staging``)."""
    return staging[as_index([[start - full[0] + local[0], stop - full[0] + local[0]]
                             for local, full, (start, stop) in zip(local_box, full_box, overlap)])]


def open_checked(folder: Path, file_name: str, manifest: dict):
    """A shard (``safety.open_inside``) of the size the manifest says."""
    f, size = open_inside(folder, file_name)
    if size != manifest["files"][file_name]:
        f.close()
        raise CheckpointError(f"{folder / file_name}: truncated or overwritten: {size} bytes, "
                              f"the manifest says {manifest['files'][file_name]}")
    return f


def read_checked(folder: Path, layout: list[dict], manifest=None) -> tuple:
    """This rank's load into zeroed buffers: (buffers, counts, problem or None, manifest)."""
    staged = []
    try:
        reader = Reader(folder, manifest or read_manifest(folder))
        try:
            for entry in layout:
                info = reader.manifest["tensors"].get(entry["name"])
                dtype = str(entry["tensor"].dtype).removeprefix("torch.")
                want = (list(entry["full_shape"]), dtype)
                if info is None or (info["shape"], info["dtype"]) != want:
                    there = "missing" if info is None else f"{info['dtype']} {info['shape']}"
                    raise CheckpointError(f"{folder / MANIFEST}: {entry['name']} is {there} there, "
                                          f"{dtype} {entry['full_shape']} here: it cannot fill "
                                          "this layout (another model's?)")
                staging = torch.zeros(entry["tensor"].shape, dtype=entry["tensor"].dtype)
                for local_box, full_box in entry["boxes"]:
                    for saved in info["slices"]:            # the overlap: per dimension
                        overlap = [[max(a, c), min(b, d)]   # [max(starts), min(stops))
                                   for (a, b), (c, d) in zip(saved["box"], full_box)]
                        if all(start < stop for start, stop in overlap):
                            region = place(staging, local_box, full_box, overlap)
                            reader.read_overlap(entry["name"], saved, overlap, region)
                staged.append(staging)
        finally:
            for f in reader.files.values():
                f.close()
    except CheckpointError as error:
        return [], {}, str(error), None
    return staged, reader.stats, None, reader.manifest


def load(folder, layout: list[dict], group=None) -> dict:
    """Every rank of ``group``: fill its ``layout`` from ``folder``, every saved tensor held by
    some rank. All or nothing: on any rank's problem every rank raises, no tensor changed."""
    folder = Path(folder)
    staged, stats, problem, manifest = read_checked(folder, layout)
    everyone = agree(problem, group, [entry["name"] for entry in layout])
    missing = set(manifest["tensors"]).difference(*everyone)
    if missing:
        raise CheckpointError(f"{folder / MANIFEST}: {len(missing)} saved tensor(s) that no rank "
                              f"of this layout holds, e.g. {min(missing)} (a layout that cannot "
                              "hold this checkpoint)", found_by=list(range(len(everyone))))
    with torch.no_grad():               # every rank has everything: now, and only now, copy
        for entry, staging in zip(layout, staged):
            entry["tensor"].copy_(staging)
    return stats


def consolidate(folder) -> dict:
    """The whole checkpoint in one process: plain state_dicts of the model and of AdamW (in
    ``meta["parameter_order"]``, else the model's), "extra", "step", "meta"."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    for file_name in manifest["files"]:             # before allocating what it says
        open_checked(folder, file_name, manifest).close()
    layout = []
    for name, info in manifest["tensors"].items():
        whole = [[0, size] for size in info["shape"]]
        tensor = torch.empty(info["shape"], dtype=DTYPES[info["dtype"]], device="meta")
        layout.append({"name": name, "tensor": tensor, "full_shape": info["shape"],
                       "boxes": [(whole, whole)], "write": True})
    staged, _, problem, _ = read_checked(folder, layout, manifest)
    if problem is not None:
        raise CheckpointError(problem, found_by=[0])
    tensors = {entry["name"]: tensor for entry, tensor in zip(layout, staged)}
    model = {name[6:]: t for name, t in tensors.items() if name.startswith("model.")}
    order = manifest["meta"].get("parameter_order", list(model))
    state = {index: {key: tensors[f"optimizer.{parameter}.{key}"]
                     for key in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
                     if f"optimizer.{parameter}.{key}" in tensors}
             for index, parameter in enumerate(order)}
    group = dict(manifest["meta"].get("optimizer", {}), params=list(range(len(order))))
    optimizer = {"state": {i: s for i, s in state.items() if s}, "param_groups": [group]}
    extra = {name: t for name, t in tensors.items()
             if not name.startswith(("model.", "optimizer."))}
    return {"model": model, "optimizer": optimizer if any(state.values()) else None,
            "extra": extra, "step": manifest["step"], "meta": manifest["meta"]}
