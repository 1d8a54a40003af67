"""Not a lesson: lesson 4's schedules checked and simulated as data (no processes, no torch).

``check_order``: every rank runs each F, B (and W) once per chunk and micro-batch, F before its B before its
W, with the right peers, and every channel (src -> dst, F or B, into one virtual stage) receives its
messages in the order they are sent. ``check_grouped_p2p``: ``p2p_plan``'s groups cannot deadlock under
NCCL's completion rule. ``peak_held``, ``idle_shares``, ``bubble_formula``, ``describe``: what the README
derives, from the unit-time simulation. ``check_setting``: all of it for one setting, in one line.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common import import_stage  # noqa: E402  (after the path)

schedules = import_stage("07_parallelism/04_pipeline_parallel/pipeline_schedules")
FORWARD, BACKWARD, WEIGHT = schedules.FORWARD, schedules.BACKWARD, schedules.WEIGHT
message = schedules.message
NCCL_EAGER_BYTES = 4 * 2**20            # NCCL_BUFFSIZE's default: smaller sends complete at once


def label(step, chunks: int) -> str:
    """F3 (one chunk per rank), F3a / F3b (chunk 0 / 1), F3c26 (past z: the chunk's number)."""
    if step is None:
        return "."
    if chunks == 1:
        return f"{step.op}{step.micro_batch}"
    if chunks <= 26:
        return f"{step.op}{step.micro_batch}{'abcdefghijklmnopqrstuvwxyz'[step.chunk]}"
    return f"{step.op}{step.micro_batch}c{step.chunk}"


def check_order(lists: list) -> None:
    """Raise ValueError, in one line, at the first broken rule (see the module docstring)."""
    chunks = 1 + max(step.chunk for steps in lists for step in steps)
    micro_batches = 1 + max(step.micro_batch for steps in lists for step in steps)
    holder = {}               # virtual stage -> (rank, chunk): each stage one chunk of one rank
    for rank, steps in enumerate(lists):
        for step in steps:
            here = holder.setdefault(step.virtual_stage, (rank, step.chunk))
            if here != (rank, step.chunk):
                raise ValueError(f"virtual stage {step.virtual_stage} runs on rank {here[0]} "
                                 f"chunk {here[1]} and on rank {rank} chunk {step.chunk}")
    if sorted(holder) != list(range(len(holder))):
        raise ValueError(f"the virtual stages run are {sorted(holder)}, not 0 to {len(holder) - 1}")
    split = any(step.op == WEIGHT for steps in lists for step in steps)
    ops = (FORWARD, BACKWARD, WEIGHT) if split else (FORWARD, BACKWARD)
    sent = {}                 # channel -> messages in the order src sends them
    received = {}             # channel -> messages in the order dst receives them
    for rank, steps in enumerate(lists):
        position = {(s.op, s.chunk, s.micro_batch): index for index, s in enumerate(steps)}
        expected = {(op, c, i) for op in ops for c in range(chunks) for i in range(micro_batches)}
        if len(position) != len(steps) or set(position) != expected:
            raise ValueError(f"rank {rank} does not run each of {'/'.join(ops)} once per chunk "
                             f"and micro-batch")
        for index, step in enumerate(steps):
            previous_rank = holder.get(step.virtual_stage - 1, (None,))[0]
            next_rank = holder.get(step.virtual_stage + 1, (None,))[0]
            peers = {FORWARD: (previous_rank, next_rank), BACKWARD: (next_rank, previous_rank),
                     WEIGHT: (None, None)}[step.op]
            if (step.recv_from, step.send_to) != peers:
                raise ValueError(f"rank {rank} step {label(step, chunks)} has the wrong peers: {step}")
            if step.op != FORWARD:
                before = ops[ops.index(step.op) - 1]      # B needs its F, W its B
                if position[(before, step.chunk, step.micro_batch)] > index:
                    raise ValueError(f"rank {rank} runs {label(step, chunks)} before "
                                     f"{before}{step.micro_batch} of the same chunk")
            if step.send_to is not None:
                outgoing = message(step, True)
                sent.setdefault((rank, step.send_to, outgoing[0], outgoing[2]), []).append(outgoing)
            if step.recv_from is not None:
                got = message(step)
                received.setdefault((step.recv_from, rank, got[0], got[2]), []).append(got)
    for channel in sorted(set(sent) | set(received)):
        if sent.get(channel) != received.get(channel):
            source, destination, op, virtual_stage = channel
            raise ValueError(f"channel rank {source} -> rank {destination} ({op} into virtual stage "
                             f"{virtual_stage}): sent {sent.get(channel)}, received {received.get(channel)}")


def check_grouped_p2p(lists: list, plan: list | None = None, message_bytes: int = 2**30,
                      eager_bytes: int = NCCL_EAGER_BYTES) -> None:
    """Raise RuntimeError unless ``plan`` (default: ``p2p_plan``) posts every receive before its
    step, every send after it, and its groups cannot deadlock under NCCL's rule: a group completes
    once each send above ``eager_bytes`` has its receive posted, and each receive its send."""
    plan = plan or schedules.p2p_plan(lists)
    # [rank] -> [(k, group)]: its groups in order, each before step k
    posted = [[(k, group) for k, before in enumerate(groups) for group in before] for groups in plan]
    where = {}                # ("send" | "recv", message) -> its group's place on its rank
    for rank_posted in posted:
        for n, (_, group) in enumerate(rank_posted):
            for kind, _, sent in group:
                where[(kind, sent)] = n
    for rank, steps in enumerate(lists):
        for k, step in enumerate(steps):
            for kind, peer, after_step in (("recv", step.recv_from, False), ("send", step.send_to, True)):
                if peer is None or peer == rank:
                    continue
                n = where.get((kind, message(step, after_step)))
                if n is None or (posted[rank][n][0] > k) != after_step:
                    when = "after" if after_step else "before"
                    raise RuntimeError(f"rank {rank}: the {kind} of {label(step, step.chunk + 1)} "
                                       f"is not planned {when} its step")
    completed = [0] * len(lists)   # per rank: groups completed; the next one is posted
    while any(completed[r] < len(posted[r]) for r in range(len(lists))):
        ready = []
        for rank, rank_posted in enumerate(posted):
            if completed[rank] == len(rank_posted):
                continue
            waits_for = []    # the other halves this group needs posted
            for kind, peer, sent in rank_posted[completed[rank]][1]:
                if kind == "recv" or message_bytes > eager_bytes:
                    other_half = "send" if kind == "recv" else "recv"
                    waits_for.append((peer, where[(other_half, sent)]))
            if all(completed[peer] >= n for peer, n in waits_for):
                ready.append(rank)
        if not ready:
            stuck = [f"rank {r} waits in group {completed[r]}" for r in range(len(lists))
                     if completed[r] < len(posted[r])]
            raise RuntimeError("grouped send/receive deadlocks: " + ", ".join(stuck))
        for rank in ready:
            completed[rank] += 1


def peak_held(steps: list) -> int:
    """Most (chunk, micro-batch) pairs held at once: from F until W (no W's: until B)."""
    frees = WEIGHT if any(step.op == WEIGHT for step in steps) else BACKWARD
    held = 0
    peak = 0
    for step in steps:
        held += (step.op == FORWARD) - (step.op == frees)
        peak = max(peak, held)
    return peak


def idle_shares(timed: list) -> list[float]:
    """Per rank: 1 - busy / pass length; the pass ends when the last rank ends."""
    end = max(e for row in timed for _, e, _ in row)
    return [1 - sum(e - s for s, e, _ in row) / end for row in timed]


def simulated_idle(name: str, stages: int, micro_batches: int, chunks: int = 1) -> list[float]:
    return idle_shares(schedules.simulate(schedules.all_ranks(name, stages, micro_batches, chunks)))


def bubble_formula(name: str, stages: int, micro_batches: int, chunks: int = 1) -> float:
    """Every rank's idle share in unit time (derived in the lesson's README).

    GPipe, 1F1B: (p-1)/(m+p-1). Interleaved: (p-1)/(vm+p-1). ZB-H1: (p-1)/(3m+p-1) when
    m >= p (else the pass is 2(m+p-1)+1). ZB-V: (p-1)/(6m+p-1) when m >= (3p-1)/2 (else the
    pass is 4m+4p-2). DualPipeV (m >= 2p), its pairs run in order: (p-1)/(6m+p-1)."""
    p, m, v = stages, micro_batches, chunks
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zbh1":
        return 1 - 3 * m / max(3 * m + p - 1, 2 * (m + p - 1) + 1)
    if name == "zbv":
        return 1 - 6 * m / max(6 * m + p - 1, 4 * m + 4 * p - 2)
    if name == "dualpipev":
        return (p - 1) / (6 * m + p - 1)
    return (p - 1) / (m + p - 1)


def format_timeline(timed: list) -> str:
    """One row per rank, one column per time unit: F3 / B3 / W3 ('.' idle)."""
    chunks = 1 + max(step.chunk for row in timed for _, _, step in row)
    end = max(e for row in timed for _, e, _ in row)
    grid = [[None] * end for _ in timed]          # [rank][time unit] -> the step, or None
    for rank, row in enumerate(timed):
        for start, _, step in row:
            grid[rank][start] = step
    width = max(len(label(step, chunks)) for row in grid for step in row)
    rows = (" ".join(f"{label(step, chunks):<{width}}" for step in row).rstrip() for row in grid)
    return "\n".join(f"rank {rank} | {cells}" for rank, cells in enumerate(rows))


def describe(name: str, stages: int, micro_batches: int, chunks: int = 1) -> str:
    """A heading and the unit-time timeline of schedule ``name``."""
    chunks = schedules.chunks_per_rank(name, chunks)
    head = f"{name}, p={stages}, m={micro_batches}" + (f", v={chunks}" if chunks > 1 else "")
    timed = schedules.simulate(schedules.all_ranks(name, stages, micro_batches, chunks))
    return (f"{head}: idle {idle_shares(timed)[0]:.3f} of the pass (formula "
            f"{bubble_formula(name, stages, micro_batches, chunks):.3f}):\n"
            + format_timeline(timed))


def check_setting(name: str, stages: int, micro_batches: int, chunks: int = 1,
                  layers: int | None = None, batch: int | None = None) -> None:
    """Raise ValueError, in one line, if this setting cannot run: layers or batch that do not
    split, the schedule's rule on m, a broken order, a deadlock (``chunks``: interleaved's v)."""
    chunks = schedules.chunks_per_rank(name, chunks)
    if layers is not None and layers % (stages * chunks):
        raise ValueError(f"{layers} layers do not split into {stages * chunks} equal chunks "
                         f"({stages} stages x {chunks} chunks per stage)")
    if batch is not None and batch % micro_batches:
        raise ValueError(f"a batch of {batch} rows does not split into {micro_batches} equal micro-batches")
    lists = schedules.all_ranks(name, stages, micro_batches, chunks)
    check_order(lists)
    try:
        check_grouped_p2p(lists)                     # simulates too: deadlocks either way
    except RuntimeError as e:
        raise ValueError(str(e)) from None
