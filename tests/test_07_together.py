"""Stage 07, everything together: the grid of ranks, the text, and training over the grid.

The grid's groups are checked against torch's ``init_device_mesh`` without spawning: torch's
fake process group lets one process play any rank of any world size, so every rank of every
shape is checked in a few fresh interpreters (one per shape).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import grid as grid_mod
from helpers import REPO

SHAPES = [(2, 1, 1, 2), (1, 2, 1, 2), (2, 2, 1, 1), (1, 1, 2, 2), (1, 2, 2, 1), (2, 2, 1, 2),
          (2, 1, 2, 2)]  # (dp, pp, cp, tp), up to 8 ranks

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
            if got != want or ours.ranks(axis) != want or ours.rank(axis) != want.index(rank):
                problems.append(f"rank {rank} axis {axis}: ours {got}, the mesh's {want}")
        dist.destroy_process_group()
    return problems


for shape in SHAPES:
    problems = differences(*shape, mesh_order=("pp", "dp", "cp", "tp"))
    print(f"{shape}: " + ("; ".join(problems) if problems else "groups equal"))
# negative control: a mesh with data and context swapped must differ from our grid
problems = differences(2, 1, 2, 2, mesh_order=("pp", "cp", "dp", "tp"))
print("control: " + ("differs" if problems else "NO DIFFERENCE"))
'''


def test_grid_groups_equal_init_device_mesh():
    """Every rank of every shape, in one interpreter (torch's fake process group)."""
    code = (f"SHAPES = {SHAPES!r}\n"
            f"GRID_FOLDER = {str(REPO / '07_parallelism' / '07_together')!r}\n")
    result = subprocess.run([sys.executable, "-c", code + textwrap.dedent(MESH_CHECK)],
                            capture_output=True, text=True, timeout=120)
    lines = result.stdout.strip().splitlines()
    want = [f"{shape}: groups equal" for shape in SHAPES] + ["control: differs"]
    assert result.returncode == 0 and lines == want, result.stdout[-3000:] + result.stderr[-3000:]


def test_grid_coordinates_without_processes():
    sizes = {"pp": 2, "dp": 2, "cp": 1, "tp": 2}
    for rank in range(8):
        assert grid_mod.grid_rank(grid_mod.grid_coordinate(rank, sizes), sizes) == rank
    assert grid_mod.grid_coordinate(5, sizes) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}
    assert grid_mod.groups_along(("tp",), sizes) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid_mod.groups_along(("pp",), sizes) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid_mod.groups_along(("dp", "cp"), sizes) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    drawn = grid_mod.draw_grid(dp=2, pp=2, cp=1, tp=2).splitlines()
    assert drawn[1] == "pp 0  dp 1 | cp 0: 2 3" and drawn[3] == "pp 1  dp 1 | cp 0: 6 7"
