"""Stage 07, lesson 10: where do the ranks disagree? One line from torch's Flight Recorder.

With ``TORCH_FR_BUFFER_SIZE`` (Gloo) or ``TORCH_NCCL_TRACE_BUFFER_SIZE`` (NCCL) set before the
process group starts, torch records every collective a rank calls: its group, its sequence
number in that group (#1, #2, ...), the op, the input shapes and dtypes, the time it was
called and the Python stack that called it. ``torch._C._distributed_c10d._dump_fr_trace()``
returns a rank's record as pickled bytes. Give this file a folder of them, one per rank, named
``<prefix><rank>``:

    python 07_parallelism/10_hangs/diagnose.py FOLDER [--prefix rank_]

It walks each group's collectives in order and stops at the first one the ranks do not agree
on: a rank that never called it (it stopped earlier, or took another path), another op,
another shape, another dtype, or an all-to-all whose ranks send fewer rows in all than they
expect. It prints that in one line and exits 1; else one line saying they agree (and which
rank, if any, the others keep waiting for: a straggler, slow but not hung) and exits 0.
Send/recv are not compared (Gloo does not record them). The standard library alone: copy it.
A dump is a pickle, and unpickling runs code: read only your own job's dumps.
"""

import argparse
import ast
import pickle
import statistics
import sys
from pathlib import Path

STRAGGLER_SHARE = 0.5  # the others wait for one rank more than half of each step: a straggler
STRAGGLER_MIN_MS = 5.0  # below this, a lag is the OS scheduling a busy machine


def load(folder, prefix: str = "rank_") -> dict:
    """{rank: dump} from the files ``<prefix><rank>`` in ``folder``; ValueError, in one line,
    for one that is not a dump (truncated by the timeout that ended its rank, say)."""
    dumps = {}
    for path in Path(folder).glob(f"{prefix}*"):
        rank = path.name[len(prefix):]
        if rank.isdecimal():
            try:
                dumps[int(rank)] = pickle.loads(path.read_bytes())
            except Exception as error:  # unpickling raises whatever the bytes make it raise
                raise ValueError(f"{path} is not a Flight Recorder dump ({type(error).__name__}: {error})") from None
            if not isinstance(dumps[int(rank)], dict) or "entries" not in dumps[int(rank)]:
                raise ValueError(f"{path} is not a Flight Recorder dump (no entries)")
    return dict(sorted(dumps.items()))


def where(entry: dict) -> str:
    """The learner's line that called the collective: the innermost frame outside torch."""
    for frame in entry.get("frames", []):
        path = frame["filename"].replace("\\", "/")
        if "/torch/" not in path:
            return f"{Path(path).name}:{frame['line']} in {frame['name']}"
    return "no Python stack recorded"


def named(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def by_value(values: dict) -> list:
    """{rank: value} -> [(value, [ranks])], the most common value first."""
    groups = {}
    for rank, value in values.items():
        groups.setdefault(repr(value), (value, []))[1].append(rank)
    return sorted(groups.values(), key=lambda item: -len(item[1]))


def collectives(dumps: dict) -> dict:
    """{group: {rank: {sequence number: entry}}}: a group's ranks are those the dumps' table of
    groups lists (``pg_config``), every rank for the default group ("0"), else those with an entry."""
    groups = {}
    members = {"0": list(dumps)}
    for rank, dump in dumps.items():
        for name, config in (dump.get("pg_config") or {}).items():  # ranks: "[0, 1]", at times twice a string
            ranks = ast.literal_eval(str(config.get("ranks", "[]")))
            members[name] = ast.literal_eval(ranks) if isinstance(ranks, str) else ranks
        for entry in dump["entries"]:
            if not entry["is_p2p"]:
                name = entry["process_group"]
                groups.setdefault(name, {}).setdefault(rank, {})[entry["collective_seq_id"]] = entry
    for name, ranks in groups.items():
        for rank in set(members.get(name[0], [])) & set(dumps):
            ranks.setdefault(rank, {})
    return groups


def first_difference(ranks: dict, group: str):
    """One line for the first collective the ranks of one group disagree on, or None."""
    seqs = [seq for entries in ranks.values() for seq in entries]
    # the buffer is a ring: compare from the oldest entry every rank still holds
    start = max((min(entries) for entries in ranks.values() if entries), default=1)
    for seq in range(start, max(seqs, default=0) + 1):
        have = {rank: entries[seq] for rank, entries in ranks.items() if seq in entries}
        at = f"ranks disagree at collective #{seq} of group {group}: "
        missing = [rank for rank in ranks if rank not in have]
        if missing:
            calls = by_value({rank: where(entry) for rank, entry in have.items()})
            op = by_value({rank: entry["profiling_name"] for rank, entry in have.items()})
            stopped = by_value({rank: max(ranks[rank], default=0) for rank in missing})
            return (f"{at}{named(have)} called {op[0][0]} at {calls[0][0]}; " +
                    ", ".join(f"{named(rs)} never did (stopped after #{last})"
                              for last, rs in stopped) + split_paths(ranks, seq))
        checks = [("op", "profiling_name"), ("dtype", "input_dtypes"), ("shape", "input_sizes")]
        all_to_all = "all_to_all" in have[min(have)]["profiling_name"]
        if all_to_all:
            checks = checks[:2]  # uneven splits are allowed; rows lost are not (below)
        for what, key in checks:
            values = by_value({rank: entry[key] for rank, entry in have.items()})
            if len(values) > 1:
                return at + f"{what} differs: " + ", ".join(
                    f"{value} on {named(rs)} at {where(have[rs[0]])}" for value, rs in values)
        if all_to_all and all_to_all_difference(have):
            return at + all_to_all_difference(have)
    return None


def split_paths(ranks: dict, seq: int) -> str:
    """Where the missing call went: the first collective before ``seq`` called from another
    line on some rank (a branch one rank took), if any."""
    for earlier in range(1, seq):
        calls = by_value({rank: where(entries[earlier]) for rank, entries in ranks.items()
                          if earlier in entries})
        if len(calls) > 1:
            return (f"; the paths split at #{earlier}: " +
                    ", ".join(f"{named(rs)} at {line}" for line, rs in calls))
    return ""


def all_to_all_difference(have: dict) -> str:
    """An all-to-all moves every row sent to some rank: the rows all ranks send must add up
    to the rows they expect, whatever the splits."""
    rows = {rank: (sum(size[0] for size in entry["input_sizes"] if size),
                   sum(size[0] for size in entry["output_sizes"] if size))
            for rank, entry in have.items()}  # all_to_all_single: one tensor; all_to_all: a list
    sent, expected = map(sum, zip(*rows.values()))
    if sent == expected:
        return ""
    odd = [f"rank {rank} sends {send}, expects {expect}"
           for rank, (send, expect) in rows.items() if send != expect]
    return (f"{have[min(have)]['profiling_name']} split sizes disagree: the ranks "
            f"send {sent} rows in all but expect {expected} ({'; '.join(odd)})")


def straggler(ranks: dict) -> str:
    """Which rank the others wait for at every collective, if one does (the times torch noted
    when each rank called it)."""
    common = sorted(set.intersection(*(set(entries) for entries in ranks.values())))
    if len(ranks) < 2 or len(common) < 3:
        return ""
    arrived = [{rank: ranks[rank][seq]["time_created_ns"] / 1e6 for rank in ranks}
               for seq in common]
    first = [min(at.values()) for at in arrived]
    lag = {rank: statistics.median(at[rank] - f for at, f in zip(arrived, first))
           for rank in ranks}
    step = statistics.median(b - a for a, b in zip(first, first[1:]))
    slow = max(lag, key=lag.get)
    if step <= 0 or lag[slow] < max(STRAGGLER_MIN_MS, STRAGGLER_SHARE * step):
        return ""
    return (f"; but rank {slow} calls each collective {lag[slow]:.0f} ms after the first rank "
            f"(median; {lag[slow] / step:.0%} of a step): a straggler, slow, not a hang")


def diagnose(dumps: dict) -> tuple[bool, str]:
    """(whether the ranks agree, one line saying so or naming the first difference)."""
    groups = collectives(dumps)
    for name, ranks in sorted(groups.items(), key=lambda item: (len(item[0][0]), item[0])):  # "2" before "10"
        line = first_difference(ranks, f"{name[0]} ({name[1]})")
        if line:
            return False, line
    count = sum(len(max(ranks.values(), key=len)) for ranks in groups.values())
    if not count:
        return True, f"{named(dumps)} agree: the recorder holds no collective (send/recv aside)"
    slow = "".join(straggler(ranks) for ranks in groups.values())
    return True, (f"{named(dumps)} agree on all {count} collectives the recorder holds, in "
                  f"{len(groups)} group(s) (op, shape, dtype, order){slow}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", help="one Flight Recorder dump per rank")
    parser.add_argument("--prefix", default="rank_", help="dump file names: <prefix><rank>")
    args = parser.parse_args()
    try:
        dumps = load(args.folder, args.prefix)
        if not dumps:
            parser.error(f"no files named {args.prefix}<rank> in {args.folder}")
        agree, line = diagnose(dumps)
    except (ValueError, SyntaxError) as error:  # not a dump, or its table of groups unreadable
        parser.error(f"{args.folder}: {error}")
    print(line)
    sys.exit(0 if agree else 1)


if __name__ == "__main__":
    main()
