"""Stage 07, lesson 10, runnable: nine planted failures (plants.py), each run under torch's
Flight Recorder and named in one line (diagnose.py) beside its control (the same code without
the plant), which must raise no alarm; exit 1 if a plant goes unnamed or a control alarms.

    python 07_parallelism/10_hangs/run_hangs.py                   # 4 ranks, gloo/cpu, all nine
    python 07_parallelism/10_hangs/run_hangs.py --scenarios wrong_order --timeout 5
    python 07_parallelism/10_hangs/diagnose.py /tmp/hangs/wrong_order   # the dumps it leaves

Each run gets a process group of its own whose timeout (``--timeout``) ends a stuck rank's
wait. Every rank writes its record to DUMPS/<scenario>[_clean]/rank_<rank>; rank 0 prints
diagnose.py's line or, where the recorder saw no difference but a rank stopped, where each
rank gave up or what torch refused (Gloo records no send/recv: a rank's own stack names it).
"""

import datetime
import os
import pickle
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  (a rank's first recorder dump imports it: once, before the fork)
import torch.distributed as dist

import diagnose
import plants

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: common/
from common import launch  # noqa: E402

# What each plant's line must say: the rank and op it names, the collective's number in its
# group (a send/recv has none on Gloo). Rank 1 carries every plant. {all}: every rank; {from_2}:
# ranks 2 and up; {rows}, {more}: 2N, 2N + 1 (which stages wait for the pipeline's message depends on N).
EXPECTED = {
    "skip_collective": ["#3", "called gloo:all_reduce", "rank 1 never did"],
    "wrong_order": ["#1", "op differs", "gloo:broadcast on rank 1"],
    "dtype_mismatch": ["#1", "dtype differs", "['Long'] on rank 1"],
    "divergent_branch": ["#3", "rank 1 called gloo:all_reduce", "split at #2", "rank 1 at"],
    "send_recv_deadlock": ["{all} gave up waiting in send"],
    "send_recv_rejected": ["rank 0 gave up waiting in request.wait()", "{from_2} finished",
                           "rank 1 was refused in batch_isend_irecv", "the same group"],
    "pipeline_fewer_micro_batches": ["gave up waiting in recv", "finished"],
    "all_to_all_splits": ["#1", "split sizes disagree", "rank 1 sends {rows}, expects {more}"],
    "straggler": ["agree", "rank 1 calls each collective", "not a hang"],
}
ALARMS = ("disagree", "gave up", "refused", "straggler")  # none may appear in a control's line


def waited_in(error: Exception) -> str:
    """'gave up waiting in recv at plants.py:111 in backward' (its timeout or a peer's: one that
    gives up closes its connections), or the call torch refused and why, from the stack."""
    frames = traceback.extract_tb(error.__traceback__)
    mine = [f for f in frames if f.filename == plants.__file__] or frames
    op = next((f.name for f in frames if f.filename.endswith("distributed_c10d.py")),
              mine[-1].line)  # a Work's wait() has no Python frame: its line says it
    at = f"at {Path(mine[-1].filename).name}:{mine[-1].lineno} in {mine[-1].name}"
    if isinstance(error, ValueError):
        return f"was refused in {op} {at} ({str(error).rstrip('.')})"
    return f"gave up waiting in {op} {at}"


def run_one(ctx, name: str, plant: bool, timeout_s: float, dumps: Path) -> str:
    """One scenario on every rank, in a group of its own; rank 0 returns its line."""
    label = name if plant else f"{name}_clean"
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s), group_desc=label)
    error = ""
    try:
        plants.SCENARIOS[name](ctx.rank, ctx.world_size, group, plant)
    except (RuntimeError, ValueError) as e:  # Gloo's timeout, a peer's, or torch's refusal
        error = waited_in(e)
    record = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    record["entries"] = [e for e in record["entries"] if e["process_group"][0] == group.group_name]
    # Gloo leaves the groups' table empty; torch's analyzer (fr_trace) needs it to read a dump
    record["pg_config"] = {group.group_name: {"name": group.group_name, "desc": label,
                                              "ranks": str(dist.get_process_group_ranks(group))}}
    folder = dumps / label
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank_{ctx.rank}").write_bytes(pickle.dumps(record))
    errors = [None] * ctx.world_size
    dist.all_gather_object(errors, error)  # the default group: DIST_TIMEOUT_S, long
    if not ctx.is_main:
        return ""
    for stale in folder.glob("rank_*"):  # an earlier run's, on more ranks
        if stale.name[len("rank_"):].isdecimal() and int(stale.name[len("rank_"):]) >= ctx.world_size:
            stale.unlink()
    agree, line = diagnose.diagnose(diagnose.load(folder))
    if agree and any(errors):  # nothing the recorder saw differs, and yet a rank waited
        waits = diagnose.by_value({rank: e for rank, e in enumerate(errors) if e})
        finished = [rank for rank, e in enumerate(errors) if not e]
        line = (f"{line}; yet " +           # its stack says where: Gloo records no send/recv
                "; ".join(f"{diagnose.named(ranks)} {e}" for e, ranks in waits) +
                (f"; {diagnose.named(finished)} finished" if finished else ""))
    return line


def demo(ctx, cfg: dict) -> None:
    problems = []
    n = ctx.world_size
    who = dict(all=diagnose.named(range(n)), from_2=diagnose.named(range(2, n)), rows=2 * n, more=2 * n + 1)
    for name in cfg["scenarios"]:
        for plant in (True, False):
            line = run_one(ctx, name, plant, cfg["timeout"], Path(cfg["dumps"]))
            if not ctx.is_main:
                continue
            print(f"{name:<29} {'planted' if plant else 'control'}: {line}", flush=True)
            if plant and not all(part.format(**who) in line for part in EXPECTED[name]):
                problems.append(f"{name}: the plant is not named (expected {[p.format(**who) for p in EXPECTED[name]]})")
            if not plant and any(alarm in line for alarm in ALARMS):
                problems.append(f"{name}: a false alarm on the control")
    if not ctx.is_main:
        return
    if problems:
        ctx.print("; ".join(problems))
        raise SystemExit(1)
    ctx.print(f"all {len(cfg['scenarios'])} plants named, no alarm on their controls "
              f"({ctx.world_size} ranks, {ctx.backend}, timeout {cfg['timeout']:g} s); dumps "
              f"in {cfg['dumps']}")


def main() -> None:
    parser = launch.make_parser(__doc__, world_size=4)
    parser.add_argument("--scenarios", type=launch.choice_list(list(plants.SCENARIOS)),
                        default=list(plants.SCENARIOS), help="comma-separated, from plants.py")
    parser.add_argument("--timeout", type=launch.number(float, 0.5, "seconds from 0.5 to 3600", 3600), default=2.0,
                        help="seconds a rank waits in a scenario's collective or receive (and to make its group)")
    parser.add_argument("--dumps", default=str(Path(tempfile.gettempdir()) / "hangs"),
                        help="where each rank writes its Flight Recorder record")
    args = parser.parse_args()
    config = launch.resolve(args)
    if config.backend != "gloo":
        parser.error("the plants send CPU tensors over Gloo: add --backend gloo --device cpu")
    if config.world_size < 4 or config.world_size % 2:
        parser.error("give an even --world-size of 4 or more (the pipeline's plant needs "
                     "micro-batches < stages - 1; the swaps pair ranks)")
    os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"  # before the process group starts (0 would turn it off)
    launch.launch(demo, config, vars(args))


if __name__ == "__main__":
    main()
