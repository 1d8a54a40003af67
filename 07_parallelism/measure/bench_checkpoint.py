"""Stage 07, lesson 8, measured: the LM (--model) in FSDP's padded row blocks with its AdamW
state, saved at 2 ranks and loaded at W, saved at W and loaded at 2 (resharding), by this
lesson's checkpoint.py and by ``torch.distributed.checkpoint`` on the same state (DTensors
Shard(0) made from the same shards), alternately in the same run: time (the slowest rank's
median) and bytes per rank. Rows go to results/checkpoint.csv.

    python 07_parallelism/measure/bench_checkpoint.py --bench --model course --world-size 4
"""

import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from bench import results, step_bench, timing  # noqa: E402  (the repository root is on the path now)
from bench import supervisor as launch  # noqa: E402
from common import import_stage, models  # noqa: E402
from common.launch import carries_point_to_point  # noqa: E402

checkpoint = import_stage("07_parallelism/08_checkpoints/checkpoint")
layouts = import_stage("07_parallelism/08_checkpoints/layouts")

VOCAB = 256


def one_folder(ctx, given: str | None, prefix: str) -> Path:
    """The folder every rank works in: ``given``, or one rank 0 makes in the temp folder."""
    shared = [(given or tempfile.mkdtemp(prefix=prefix)) if ctx.is_main else None]
    dist.broadcast_object_list(shared, src=0)
    return Path(shared[0])


def bench_state(full_lm, rank: int, world_size: int, device) -> tuple[list, dict]:
    """The LM in FSDP's padded row blocks at ``world_size`` ranks, with AdamW moments (random
    values: what matters is their size) and steps: (layout for this lesson, the same shards as
    DTensors for torch.distributed.checkpoint). Rank ``rank`` of the group."""
    layout, tensors = [], {}
    generator = torch.Generator().manual_seed(7)
    for name, p in full_lm.named_parameters():
        full_shape = list(p.shape)
        moments = {"exp_avg": torch.randn(full_shape, generator=generator),
                   "exp_avg_sq": torch.rand(full_shape, generator=generator)}
        for key, full in [("model", p.detach())] + list(moments.items()):
            full_name = f"model.{name}" if key == "model" else f"optimizer.{name}.{key}"
            if len(full_shape) >= 2:
                rows_per_rank = math.ceil(full_shape[0] / world_size)
                local = torch.zeros([rows_per_rank] + full_shape[1:], device=device)
                boxes = layouts.padded_row_block(full_shape, rank, world_size)
                for local_box, full_box in boxes:
                    local[checkpoint.as_index(local_box)] = full[checkpoint.as_index(full_box)]
                write = True
            else:
                local = full.clone().to(device)
                boxes = [(layouts.whole(full_shape), layouts.whole(full_shape))]
                write = rank == 0
            layout.append(layouts.entry(full_name, local, full_shape, boxes, write))
            tensors[full_name] = (local, full_shape, boxes)
        step = torch.tensor(10.0)
        layout.append(layouts.entry(f"optimizer.{name}.step", step, [], [([], [])], rank == 0))
        tensors[f"optimizer.{name}.step"] = (step, [], None)
    return layout, tensors


def as_dtensors(tensors: dict, mesh) -> dict:
    """The same shards as DTensors: Shard(0) (torch's even split: ceil(rows / N) rows each,
    the last ones shorter, as FSDP's blocks without their padding), 1-D ones Replicate()."""
    state = {}
    for name, (local, full_shape, boxes) in tensors.items():
        if boxes is None:
            state[name] = local                 # a plain tensor: replicated, saved once
            continue
        if len(full_shape) >= 2:
            rows = boxes[0][0][0][1] if boxes else 0  # this rank's rows, none past the end
            stride = torch.empty(full_shape, device="meta").stride()
            state[name] = DTensor.from_local(local[:rows], mesh, [Shard(0)], run_check=False,
                                             shape=torch.Size(full_shape), stride=stride)
        else:
            state[name] = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
    return state


def io_counts() -> tuple[int, int]:
    """(bytes read, bytes written) by this process's read and write calls, from the kernel
    (/proc/self/io rchar, wchar: including the page cache), or (0, 0) where there is none."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
        return int(fields["rchar"]), int(fields["wchar"])
    except (OSError, KeyError, ValueError):
        return 0, 0


def bench_main(ctx, args) -> None:
    """Save at 2 ranks and load at W, save at W and load at 2; ours and torch's alternately."""
    root = one_folder(ctx, args.dir, "checkpoint-bench-")
    full_lm = models.TransformerLM(args.model, vocab_size=VOCAB, context_length=256)
    block_columns = layouts.lm_block_columns([name for name, _ in full_lm.named_parameters()],
                                             models.PRESETS[args.model])
    world_size = ctx.world_size
    groups = {2: dist.new_group([0, 1]), world_size: dist.group.WORLD}
    meshes, states = {}, {}
    for size, group in groups.items():
        if ctx.rank < size:
            meshes[size] = DeviceMesh.from_group(group, ctx.device.type)
            states[size] = bench_state(full_lm, dist.get_rank(group), size, ctx.device)
    torch_too = carries_point_to_point(ctx.backend, ctx.device.type)  # DTensor: coalesced ops
    deadline = step_bench.Deadline(ctx)
    rows = []
    for saved_at, loaded_at in ((2, world_size), (world_size, 2)):
        for impl in ("ours", "torch_dcp") if torch_too else ("ours",):
            if not deadline.allows(f"{impl} {saved_at} -> {loaded_at} ranks, and after"):
                break
            rows += bench_pair(ctx, args, root, impl, saved_at, loaded_at, groups, meshes,
                               states, block_columns)
    # the state, each element once: weights, 2 moments, a step
    full_bytes = sum(3 * p.numel() * 4 + 4 for p in full_lm.parameters())
    if ctx.is_main:
        finish_bench(args, rows, full_bytes)
    dist.barrier()
    if ctx.is_main and args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


def bench_pair(ctx, args, root, impl, saved_at, loaded_at, groups, meshes, states,
               block_columns) -> list[dict]:
    """Time ``args.iters`` saves at ``saved_at`` ranks (after ``args.warmup``), then as many loads of the last
    one at ``loaded_at`` ranks, by ``impl``; rows of the slowest rank's median and each rank's bytes."""
    rows = []
    folder = root / f"{impl}_{saved_at}"
    for op, size in (("save", saved_at), ("load", loaded_at)):
        group = groups[size]
        times, counted, kernel = [], [], []
        for iteration in range(args.warmup + args.iters):
            if ctx.rank < size:
                layout, tensors = states[size]
                dist.barrier(group=group)
                timing.synchronize(ctx.device)
                read_before, written_before = io_counts()
                start = time.perf_counter()
                count = run_op(impl, op, folder, iteration, layout, tensors, meshes[size],
                               group, block_columns)
                timing.synchronize(ctx.device)
                elapsed = time.perf_counter() - start
                read_after, written_after = io_counts()
                if iteration >= args.warmup:
                    times.append(elapsed)
                    counted.append(count)
                    kernel.append(written_after - written_before if op == "save"
                                  else read_after - read_before)
            dist.barrier()
            if ctx.is_main and op == "save" and impl == "torch_dcp" \
                    and iteration < args.warmup + args.iters - 1:
                shutil.rmtree(dcp_folder(folder, iteration), ignore_errors=True)
        rows.append(bench_row(ctx, impl, op, saved_at, loaded_at, times, counted, kernel, size))
    return rows


def dcp_folder(folder: Path, iteration: int) -> Path:
    return folder / f"dcp_{iteration:03d}"


def run_op(impl, op, folder, iteration, layout, tensors, mesh, group, block_columns) -> dict | None:
    """One save or load: the bytes this lesson counted, {"data", "manifest"} (torch's: None)."""
    if impl == "ours" and op == "save":
        stats = checkpoint.save(folder, layout, iteration + 1, "fsdp", {}, block_columns, group=group)
        return {"data": stats["bytes_written"], "manifest": stats["manifest_bytes"]}
    if impl == "ours":
        stats = checkpoint.load(checkpoint.latest_checkpoint(folder), layout, group=group)
        return {"data": stats["bytes_read"], "manifest": stats["manifest_bytes"],
                "needed": stats["bytes_needed"]}
    state = as_dtensors(tensors, mesh)
    if op == "save":
        dcp.save(state, checkpoint_id=str(dcp_folder(folder, iteration)), process_group=group)
        return None
    last = sorted(folder.glob("dcp_*"))[-1]
    dcp.load(state, checkpoint_id=str(last), process_group=group)
    return None


def bench_row(ctx, impl, op, saved_at, loaded_at, times, counted, kernel, size) -> dict:
    """One row: the slowest rank's median time and the spread, and the most bytes any rank
    moved (counted here: the data, and the manifest; and by the kernel: every read or write
    call of the process meanwhile, /proc/self/io), from every rank of the group that ran it."""
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, {"times": times, "counted": counted, "kernel": kernel})
    ran = everyone[:size]
    all_times = [t for theirs in ran for t in theirs["times"]]
    kernel_bytes = [theirs["kernel"][-1] for theirs in ran]
    counted = [theirs["counted"][-1] for theirs in ran if theirs["counted"][-1] is not None]
    for here in counted:
        if here.get("needed", here["data"]) != here["data"]:
            raise AssertionError(f"{impl} {op}: a rank read {here['data']} bytes for an overlap "
                                 f"of {here['needed']}")
    data_bytes = [here["data"] for here in counted]
    return {"impl": impl, "op": op, "saved_at": saved_at, "loaded_at": loaded_at, "ranks": size,
            "time_ms_median": 1000 * max(statistics.median(theirs["times"]) for theirs in ran),
            "time_ms_min": 1000 * min(all_times), "time_ms_max": 1000 * max(all_times),
            "data_bytes_max": max(data_bytes, default=""), "data_bytes_total":
            sum(data_bytes) if data_bytes else "", "manifest_bytes":
            max((here["manifest"] for here in counted), default=""),
            "kernel_bytes_max": max(kernel_bytes), "kernel_bytes_total": sum(kernel_bytes)}


def finish_bench(args, rows: list[dict], full_bytes: int) -> None:
    """Rank 0: the table, the targets measured beside their values, results/checkpoint.csv."""
    machine = results.machine_name()
    for row in rows:
        row.update({"model": args.model, "backend": dist.get_backend(), "device": str(args.device_used),
                    "machine": machine, "run_id": results.run_id()})
    by_key = {(row["impl"], row["op"], row["saved_at"], row["loaded_at"]): row for row in rows}
    for row in rows:  # NaN: torch's not run (a pair that cannot carry it, or past the deadline)
        theirs = by_key.get(("torch_dcp", row["op"], row["saved_at"], row["loaded_at"]))
        row["ratio_vs_torch"] = row["time_ms_median"] / theirs["time_ms_median"] if theirs else float("nan")
    shown = [{"impl": row["impl"], "op": row["op"],
              "saved at -> loaded at": f"{row['saved_at']} -> {row['loaded_at']}", "ranks": row["ranks"],
              "ms (median)": row["time_ms_median"], "x torch": row["ratio_vs_torch"],
              "data bytes/rank (max)": row["data_bytes_max"], "manifest bytes": row["manifest_bytes"],
              "kernel bytes/rank (max)": row["kernel_bytes_max"]} for row in rows]
    results.print_table(shown, title=f"checkpoint save and load, the {args.model} LM + AdamW ({machine})")
    path = results.upsert_csv("checkpoint.csv", rows, key=["model", "backend", "device", "impl",
                                                          "op", "saved_at", "loaded_at"])
    print(f"wrote {path}", flush=True)
    for row in rows:
        if row["impl"] == "ours" and row["op"] == "save":
            verdict = "met" if row["data_bytes_total"] == full_bytes else "NOT met"
            print(f"target: bytes written at {row['saved_at']} ranks, all ranks together, exactly the state "
                  f"once ({full_bytes}): measured {row['data_bytes_total']} ({verdict})", flush=True)
        if row["impl"] == "ours" and row["op"] == "load":
            print(f"target: bytes read per rank exactly the overlap with what it holds, at "
                  f"{row['loaded_at']} ranks: met on every rank (checked at each load)", flush=True)
    for row in rows:
        if row["impl"] == "ours" and not math.isnan(row["ratio_vs_torch"]):  # torch's ran too
            verdict = "met" if row["ratio_vs_torch"] <= 1.5 else "NOT met"
            print(f"target: {row['op']} {row['saved_at']} -> {row['loaded_at']} ranks at most "
                  f"1.5x torch.distributed.checkpoint: measured {row['ratio_vs_torch']:.2f}x "
                  f"({verdict}; {machine})", flush=True)


def main(argv=None) -> None:
    parser = launch.make_parser(__doc__, world_size=4)
    parser.add_argument("--bench", action="store_true", help="accepted (make bench passes it)")
    parser.add_argument("--model", choices=list(models.PRESETS), default="tiny", help="the LM preset")
    parser.add_argument("--warmup", type=launch.non_negative_int, default=1, help="untimed saves and loads")
    parser.add_argument("--iters", type=launch.positive_int, default=3, help="timed saves and loads")
    parser.add_argument("--dir", default=None,
                        help="where checkpoints go (kept); default: a temporary folder, removed")
    args = parser.parse_args(argv)
    config = launch.resolve(args)
    if config.world_size < 3:
        parser.error(f"--bench --world-size {config.world_size}: it saves at 2 ranks and loads "
                     "at the world size, and back: give 3 ranks or more")
    if args.dir is None and launch.under_torchrun() and (os.environ.get("LOCAL_WORLD_SIZE")
                                                         != os.environ["WORLD_SIZE"]):
        parser.error("the job spans nodes (WORLD_SIZE > LOCAL_WORLD_SIZE): rank 0's temporary "
                     "folder is not on the others; give --dir, a folder every node sees")
    if args.dir is not None:
        if Path(args.dir).exists() and not Path(args.dir).is_dir():
            parser.error(f"--dir {args.dir}: not a folder")
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        if any(Path(args.dir).iterdir()):
            parser.error(f"--dir {args.dir}: already used (not empty); give a new or empty folder")
    args.device_used = config.device
    results.check_writable()
    launch.launch(bench_main, config, args)


if __name__ == "__main__":
    main()
