"""A grid of ranks: which ranks form which group when data, pipeline, context and tensor
parallelism are combined.

The world is laid out as a 4-D array of ranks of shape (pp, dp, cp, tp), tensor parallel
innermost:

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

so the tp ranks of one group are neighbours (one node, the fastest links: tensor parallelism
communicates inside every layer), then context parallel (every attention layer), then data
parallel (once per step), and pipeline parallel outermost (one activation per micro-batch,
point to point: it tolerates the slowest links). The layout of ``init_device_mesh(device,
(pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))``; the tests check the groups.

A group along an axis holds the ranks that differ only in that coordinate. "dp_cp" holds the
ranks that differ in the data or the context coordinate: they hold different tokens of the
same model piece, so their gradients are summed there.

For hybrid sharding (HSDP) the data axis has two parts, dp = dp_replicate x dp_shard,

    dp_index = replicate_index * dp_shard + shard_index

so a "dp_shard" group's ranks are neighbours (FSDP gathers the weights there in every
forward and backward) and a "dp_replicate" group holds one rank per shard group (one
all-reduce per step crosses nodes): ``init_device_mesh(device, (pp, dp_replicate, dp_shard,
cp, tp))``. With dp_shard = 1, "dp_replicate" is "dp" and every "dp_shard" group one rank.

    grid = ProcessGrid(dp=2, pp=1, cp=1, tp=2)     # after dist.init_process_group, 4 ranks
    grid.rank("tp"), grid.size("tp"), grid.group("tp")
    grid = ProcessGrid(dp=4, dp_shard=2)           # HSDP: 2 replicas of 2 shards

Torch alone: copy this file anywhere.
"""

from __future__ import annotations

import torch.distributed as dist

AXES = ("pp", "dp", "cp", "tp")  # outermost first
# The same grid with the data axis cut in two (hybrid sharding), outermost first.
FINE_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def grid_coordinate(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    """rank -> {axis: index}: the digits of ``rank`` in the mixed radix (pp, dp, cp, tp)."""
    coordinate = {}
    for axis in reversed(AXES):  # tp is the fastest-changing digit
        coordinate[axis] = rank % sizes[axis]
        rank = rank // sizes[axis]
    return coordinate


def grid_rank(coordinate: dict[str, int], sizes: dict[str, int]) -> int:
    """{axis: index} -> rank: ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index."""
    rank = 0
    for axis in AXES:
        rank = rank * sizes[axis] + coordinate[axis]
    return rank


def fine_coordinate(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    """rank -> {axis: index} over FINE_AXES and AXES: the data index cut into its replica and
    its shard (``sizes["dp_shard"]``, 1 when absent)."""
    coordinate = grid_coordinate(rank, sizes)
    dp_shard = sizes.get("dp_shard", 1)
    coordinate["dp_replicate"] = coordinate["dp"] // dp_shard
    coordinate["dp_shard"] = coordinate["dp"] % dp_shard
    return coordinate


def groups_along(axes: tuple[str, ...], sizes: dict[str, int]) -> list[list[int]]:
    """Every group of ranks that differ only in the coordinates ``axes`` (names of AXES or
    FINE_AXES; "dp" means both of its sub-axes), each sorted, in the order of their smallest
    rank. One group per value of the other coordinates."""
    varying = set(axes)
    if "dp" in varying:
        varying.update(("dp_replicate", "dp_shard"))
    world_size = 1
    for axis in AXES:
        world_size *= sizes[axis]
    groups = {}
    for rank in range(world_size):
        coordinate = fine_coordinate(rank, sizes)
        # The key: the coordinates that stay fixed inside a group.
        key = tuple(coordinate[axis] for axis in FINE_AXES if axis not in varying)
        if key not in groups:
            groups[key] = []
        groups[key].append(rank)
    return sorted(groups.values())


class ProcessGrid:
    """This rank's place on the (pp, dp, cp, tp) grid and a process group along each axis.

    ``group(axis)``, ``rank(axis)``, ``size(axis)`` for axis in "pp", "dp", "cp", "tp",
    "dp_cp" (data and context together), and the data axis's two parts "dp_replicate" and
    "dp_shard" (``dp_shard`` ranks of each data group share the shards of one copy). Call on
    every rank, after ``init_process_group``: creating a group is a collective, every rank
    creates every group in the same order.
    """

    def __init__(self, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1, dp_shard: int = 1):
        self.sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp, "dp_shard": dp_shard}
        if dp % dp_shard != 0:
            raise ValueError(f"ProcessGrid: dp_shard={dp_shard} does not divide dp={dp}; "
                             "dp = dp_replicate x dp_shard")
        self.sizes["dp_replicate"] = dp // dp_shard
        world_size = dist.get_world_size()
        product = pp * dp * cp * tp
        if product != world_size:
            raise ValueError(f"ProcessGrid: dp x pp x cp x tp = {dp} x {pp} x {cp} x {tp} = "
                             f"{product}, but the world has {world_size} ranks; the product "
                             "must equal the world size")
        self.global_rank = dist.get_rank()
        self.coordinate = grid_coordinate(self.global_rank, self.sizes)
        fine = fine_coordinate(self.global_rank, self.sizes)
        self.coordinate["dp_replicate"] = fine["dp_replicate"]
        self.coordinate["dp_shard"] = fine["dp_shard"]
        self.members = {}  # axis -> the global ranks of this rank's group along it
        self.groups = {}   # axis -> that process group
        made = {}          # axis -> this rank's group; "alone": its group of one rank
        axis_sets = {"pp": ("pp",), "dp": ("dp",), "cp": ("cp",), "tp": ("tp",),
                     "dp_cp": ("dp", "cp"), "dp_replicate": ("dp_replicate",),
                     "dp_shard": ("dp_shard",)}
        for name, axes in axis_sets.items():
            every = groups_along(axes, self.sizes)
            key = name
            if len(every[0]) == 1:         # a size-1 axis: one set of one-rank groups for all
                key = "alone"
            if key not in made:
                for ranks in every:
                    group = dist.new_group(ranks)  # a collective: every rank makes every group
                    if self.global_rank in ranks:
                        made[key] = group
            self.groups[name] = made[key]
            self.members[name] = next(ranks for ranks in every if self.global_rank in ranks)

    def destroy(self) -> None:
        """Free this rank's groups (a communicator each under NCCL) when the grid is done."""
        for group in set(self.groups.values()):
            dist.destroy_process_group(group)

    def group(self, axis: str):
        return self.groups[axis]

    def rank(self, axis: str) -> int:
        """This rank's index inside its group along ``axis``."""
        return self.members[axis].index(self.global_rank)

    def size(self, axis: str) -> int:
        return len(self.members[axis])


def draw_grid(dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1, dp_shard: int = 1) -> str:
    """The grid as text, a line per (pp, dp) pair: "pp 1  dp 0 | cp 0: 4 5" (its cp x tp ranks;
    under HSDP "pp 0  dp 1 (replica 0, shard 1) | cp 0: 1")."""
    sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
    lines = []
    for pp_index in range(pp):
        for dp_index in range(dp):
            parts = []
            for cp_index in range(cp):
                tp_ranks = []
                for tp_index in range(tp):
                    coordinate = {"pp": pp_index, "dp": dp_index, "cp": cp_index, "tp": tp_index}
                    tp_ranks.append(str(grid_rank(coordinate, sizes)))
                parts.append(f"cp {cp_index}: " + " ".join(tp_ranks))
            data = f"dp {dp_index}"
            if dp_shard > 1:
                data += f" (replica {dp_index // dp_shard}, shard {dp_index % dp_shard})"
            lines.append(f"pp {pp_index}  {data} | " + "   ".join(parts))
    return "\n".join(lines)
