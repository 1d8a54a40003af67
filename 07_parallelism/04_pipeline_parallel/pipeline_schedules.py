"""Pipeline schedules as data: GPipe, 1F1B, interleaved 1F1B and zero-bubble ZB-H1.

A schedule is a pure function of (rank, stages, micro_batches) (interleaved: also chunks)
that returns the rank's ordered list of ``Step``s. This file has no torch in it: the lists
are checked here for order of events (every F before its B before its W, every send matched
by a receive in the same order, no deadlock), run in unit time by a small simulator (the
ideal idle share and the text timeline), set beside each schedule's idle formula, and
planned into groups of sends and receives that cannot deadlock (``p2p_plan``).
``pipeline_parallel.py`` executes the same lists with real tensors.

Words: p stages (ranks), m micro-batches, v model chunks per rank (interleaved only). The
model is cut into p*v pieces, "virtual stages"; piece s lives on rank s % p as its chunk
s // p, so a micro-batch visits every rank v times (Narayanan et al., 2021).
Ops: F forward; B backward (for ZB-H1 only the gradient w.r.t. the stage's input, which the
previous stage waits for; elsewhere the whole backward); W the weight gradients that ZB-H1
moves later (Qi et al., 2024), which nobody waits for.

Use it (this file needs Python alone):

    import pipeline_schedules as schedules
    lists = schedules.all_ranks("zbh1", stages=4, micro_batches=8)   # [rank] -> its Steps
    schedules.check_order(lists)                   # raises ValueError on a broken schedule
    print(schedules.describe("zbh1", 4, 8))        # the timeline, idle share and formula
"""

from __future__ import annotations

from dataclasses import dataclass

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"


@dataclass(frozen=True)
class Step:
    """One unit of work on one rank: ``op`` on ``micro_batch`` in model chunk ``chunk``.

    ``recv_from`` / ``send_to``: the rank it receives its input from / sends its output to
    (None: the first virtual stage reads the data, the last computes the loss; W neither).
    """

    op: str
    micro_batch: int
    chunk: int = 0
    recv_from: int | None = None
    send_to: int | None = None


def make_step(op: str, rank: int, stages: int, micro_batch: int, chunk: int = 0,
              chunks: int = 1) -> Step:
    """Forward goes virtual stage s -> s+1, backward s -> s-1; stage s is on rank s % p."""
    virtual_stage = chunk * stages + rank
    last_virtual_stage = stages * chunks - 1
    previous_rank = None                          # the first virtual stage reads the data
    if virtual_stage > 0:
        previous_rank = (virtual_stage - 1) % stages
    next_rank = None                              # the last computes the loss
    if virtual_stage < last_virtual_stage:
        next_rank = (virtual_stage + 1) % stages
    if op == FORWARD:
        return Step(op, micro_batch, chunk, recv_from=previous_rank, send_to=next_rank)
    if op == BACKWARD:
        return Step(op, micro_batch, chunk, recv_from=next_rank, send_to=previous_rank)
    return Step(op, micro_batch, chunk)           # W: local work, no message


def gpipe_schedule(rank: int, stages: int, micro_batches: int) -> list[Step]:
    """GPipe (Huang et al., 2019): all m forwards, then all m backwards."""
    forwards = [make_step(FORWARD, rank, stages, i) for i in range(micro_batches)]
    backwards = [make_step(BACKWARD, rank, stages, i) for i in range(micro_batches)]
    return forwards + backwards


def one_f_one_b_schedule(rank: int, stages: int, micro_batches: int) -> list[Step]:
    """1F1B (Narayanan et al., 2019): p-1-r warm-up forwards, then one F / one B, then drain.

    p-1-r forwards are just enough that B0's gradient arrives when the rank is ready for it;
    from then on each backward frees a micro-batch before the next forward stores one, so
    rank r holds at most p-r micro-batches, whatever m is.
    """
    warmup = min(stages - 1 - rank, micro_batches)
    f = [make_step(FORWARD, rank, stages, i) for i in range(micro_batches)]
    b = [make_step(BACKWARD, rank, stages, i) for i in range(micro_batches)]
    steps = f[:warmup]
    for j in range(micro_batches - warmup):              # steady state: F(warmup + j), B(j)
        steps += [f[warmup + j], b[j]]
    return steps + b[micro_batches - warmup:]


def interleaved_schedule(rank: int, stages: int, chunks: int, micro_batches: int) -> list[Step]:
    """Interleaved 1F1B (Megatron-LM's virtual pipeline): 1F1B over the rank's v chunks.

    Forwards go in groups of p micro-batches: group g runs chunk 0 on micro-batches
    gp..gp+p-1, then chunk 1 on the same ones, ..., chunk v-1; backwards likewise, from the
    last chunk down. Hence m must be a multiple of p. Warm-up: 2(p-1-r) + (v-1)p forwards.
    """
    p, v, m = stages, chunks, micro_batches        # the papers' letters, as in the formulas
    if m % p:
        raise ValueError(f"interleaved 1F1B needs micro-batches a multiple of the stages: "
                         f"m={m}, p={p}")
    total = m * v                                  # forwards (and backwards) on this rank
    warmup = min(2 * (p - 1 - rank) + (v - 1) * p, total)
    steps = [interleaved_nth(FORWARD, k, rank, p, v) for k in range(warmup)]
    for k in range(total - warmup):
        steps.append(interleaved_nth(FORWARD, warmup + k, rank, p, v))
        steps.append(interleaved_nth(BACKWARD, k, rank, p, v))
    for k in range(total - warmup, total):
        steps.append(interleaved_nth(BACKWARD, k, rank, p, v))
    return steps


def interleaved_nth(op: str, k: int, rank: int, stages: int, chunks: int) -> Step:
    """The rank's k-th forward (or backward) under interleaved 1F1B: k walks groups of p
    micro-batches, each group through chunk 0, 1, ..., v-1 (backwards: v-1 down to 0)."""
    group = k // (stages * chunks)                 # which group of p micro-batches
    micro_batch = group * stages + k % stages
    chunk = (k // stages) % chunks
    if op == BACKWARD:
        chunk = chunks - 1 - chunk
    return make_step(op, rank, stages, micro_batch, chunk, chunks)


def zb_h1_schedule(rank: int, stages: int, micro_batches: int) -> list[Step]:
    """ZB-H1 (Qi et al., 2024): 1F1B with the backward split into B (input gradient) and W.

    Rank r runs p-r forwards, then repeats B(j), W(j-r), F(j+p-r): its W's trail its B's by
    r micro-batches, and the r+1 W's left over at the end fill the time in which 1F1B's
    rank r would wait for gradients. Activations are held from F to W: p per rank at most.
    """
    p, m = stages, micro_batches                   # the papers' letters, as in the formulas
    warmup = min(p - rank, m)
    steps = [make_step(FORWARD, rank, p, i) for i in range(warmup)]
    for j in range(m):
        steps.append(make_step(BACKWARD, rank, p, j))
        if j >= rank:
            steps.append(make_step(WEIGHT, rank, p, j - rank))
        if j + warmup < m:
            steps.append(make_step(FORWARD, rank, p, j + warmup))
    return steps + [make_step(WEIGHT, rank, p, i) for i in range(max(0, m - rank), m)]


SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule,
             "interleaved": interleaved_schedule, "zbh1": zb_h1_schedule}


def schedule_steps(name: str, rank: int, stages: int, micro_batches: int,
                   chunks: int = 1) -> list[Step]:
    """Rank ``rank``'s steps under schedule ``name`` (``chunks`` is used by interleaved only)."""
    if name == "interleaved":
        return interleaved_schedule(rank, stages, chunks, micro_batches)
    return SCHEDULES[name](rank, stages, micro_batches)


def all_ranks(name: str, stages: int, micro_batches: int, chunks: int = 1) -> list[list[Step]]:
    return [schedule_steps(name, r, stages, micro_batches, chunks) for r in range(stages)]


def check_setting(name: str, stages: int, micro_batches: int, chunks: int = 1,
                  layers: int | None = None, batch: int | None = None) -> None:
    """Raise ValueError, in one line, if this setting cannot run: layers that do not split
    into p*v chunks, a batch that does not split into m, the schedule's own constraint (m a
    multiple of p for interleaved), a broken order of events, a deadlock."""
    if layers is not None and layers % (stages * chunks):
        raise ValueError(f"{layers} layers do not split into {stages * chunks} equal chunks "
                         f"({stages} stages x {chunks} chunks per stage)")
    if batch is not None and batch % micro_batches:
        raise ValueError(f"a batch of {batch} rows does not split into {micro_batches} "
                         "equal micro-batches")
    lists = all_ranks(name, stages, micro_batches, chunks)
    check_order(lists)
    try:
        check_grouped_p2p(lists)                     # simulates too: deadlocks either way
    except RuntimeError as e:
        raise ValueError(str(e)) from None


def peak_held(steps: list[Step]) -> int:
    """Most (chunk, micro-batch) pairs held at once: from the forward until the last step
    that needs its tensors (W where the schedule has W's, else B)."""
    frees = BACKWARD
    if any(step.op == WEIGHT for step in steps):
        frees = WEIGHT
    held = 0
    peak = 0
    for step in steps:
        if step.op == FORWARD:
            held += 1
        if step.op == frees:
            held -= 1
        peak = max(peak, held)
    return peak


def bubble_formula(name: str, stages: int, micro_batches: int, chunks: int = 1) -> float:
    """Idle share of every rank when each step takes one time unit.

    GPipe, 1F1B: (p-1)/(m+p-1). Interleaved: (p-1)/(vm+p-1). ZB-H1, T_F = T_B = T_W:
    (p-1)/(3m+p-1) when m >= p (derived in README.md beside this file); with m < p the pipe never
    fills and the pass lasts one F and one B ripple, 2(m+p-1), plus the last W.
    """
    p, m, v = stages, micro_batches, chunks        # the papers' letters, as in the formulas
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zbh1":
        return 1 - 3 * m / max(3 * m + p - 1, 2 * (m + p - 1) + 1)
    return (p - 1) / (m + p - 1)


# --------------------------------------------------------------------------- checks, simulator


def message(step: Step, rank: int, stages: int, sending: bool = False) -> tuple:
    """What travels: (op, micro-batch, virtual stage that receives it)."""
    virtual_stage = step.chunk * stages + rank
    if sending and step.op == FORWARD:
        virtual_stage += 1                        # forward: to the next virtual stage
    if sending and step.op == BACKWARD:
        virtual_stage -= 1                        # backward: to the previous one
    return step.op, step.micro_batch, virtual_stage


CHUNK_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _label(step: Step | None, chunks: int) -> str:
    """F3 (one chunk per rank), F3a / F3b (chunk 0 / 1), F3c26 (past z: the chunk's number)."""
    if step is None:
        return "."
    label = f"{step.op}{step.micro_batch}"
    if chunks == 1:
        return label
    if chunks <= len(CHUNK_LETTERS):
        return label + CHUNK_LETTERS[step.chunk]
    return label + f"c{step.chunk}"


def check_order(lists: list[list[Step]]) -> None:
    """Raise ValueError unless every rank runs each F, B (and W) exactly once, F before B
    before W, with the right peers, and every channel src -> dst delivers the messages in
    the order dst receives them (point-to-point messages between two ranks stay in order)."""
    stages = len(lists)
    chunks = 1 + max(step.chunk for steps in lists for step in steps)
    micro_batches = 1 + max(step.micro_batch for steps in lists for step in steps)
    ops = (FORWARD, BACKWARD)
    if any(step.op == WEIGHT for steps in lists for step in steps):
        ops = (FORWARD, BACKWARD, WEIGHT)
    sent = {}                 # (src, dst) -> the messages in the order src sends them
    received = {}             # (src, dst) -> the messages in the order dst receives them
    for rank, steps in enumerate(lists):
        position = {}         # (op, chunk, micro-batch) -> where the rank runs it
        for index, step in enumerate(steps):
            position[(step.op, step.chunk, step.micro_batch)] = index
        expected = set()
        for op in ops:
            for chunk in range(chunks):
                for micro_batch in range(micro_batches):
                    expected.add((op, chunk, micro_batch))
        if len(position) != len(steps) or set(position) != expected:
            raise ValueError(f"rank {rank} does not run each of {'/'.join(ops)} once per chunk "
                             f"and micro-batch")
        for index, step in enumerate(steps):
            if step != make_step(step.op, rank, stages, step.micro_batch, step.chunk, chunks):
                raise ValueError(f"rank {rank} step {_label(step, chunks)} has the wrong peers: "
                                 f"{step}")
            if step.op != FORWARD:
                before = ops[ops.index(step.op) - 1]      # B needs its F, W its B
                if position[(before, step.chunk, step.micro_batch)] > index:
                    raise ValueError(f"rank {rank} runs {_label(step, chunks)} before "
                                     f"{before}{step.micro_batch} of the same chunk")
            if step.send_to is not None:
                channel = (rank, step.send_to)
                sent.setdefault(channel, []).append(message(step, rank, stages, True))
            if step.recv_from is not None:
                channel = (step.recv_from, rank)
                received.setdefault(channel, []).append(message(step, rank, stages, False))
    for channel in sorted(set(sent) | set(received)):
        source, destination = channel
        sent_here = sent.get(channel, [])
        received_here = received.get(channel, [])
        for n in range(max(len(sent_here), len(received_here))):
            sent_as = "nothing"
            if n < len(sent_here):
                sent_as = sent_here[n]
            received_as = "nothing"
            if n < len(received_here):
                received_as = received_here[n]
            if sent_as != received_as:
                raise ValueError(f"channel rank {source} -> rank {destination}: message {n} "
                                 f"sent is {sent_as}, received as {received_as}")


def simulate(lists: list[list[Step]], cost: dict | None = None) -> list[list[tuple]]:
    """Start every step as early as its rank and its incoming message allow (sends do not
    wait for the receiver: Gloo's isend). ``cost``: time per op, 1 each by default.
    Returns [rank] -> [(start, end, step)]; raises RuntimeError on a deadlock."""
    cost = cost or {FORWARD: 1, BACKWARD: 1, WEIGHT: 1}
    stages = len(lists)
    arrives = {}                                  # message -> when its receiver has it
    timed = [[] for _ in range(stages)]           # [rank] -> [(start, end, step)]
    next_step = [0] * stages                      # per rank: the index of its next step
    free_at = [0] * stages                        # per rank: when its last step ended
    while any(next_step[rank] < len(lists[rank]) for rank in range(stages)):
        moved = False
        for rank in range(stages):
            while next_step[rank] < len(lists[rank]):
                step = lists[rank][next_step[rank]]
                start = free_at[rank]
                if step.recv_from is not None:
                    incoming = message(step, rank, stages, False)
                    if incoming not in arrives:
                        break                            # its message is not sent yet
                    start = max(start, arrives[incoming])
                free_at[rank] = start + cost[step.op]
                timed[rank].append((start, free_at[rank], step))
                if step.send_to is not None:
                    arrives[message(step, rank, stages, True)] = free_at[rank]
                next_step[rank] += 1
                moved = True
        if not moved:
            waiting = []
            for rank in range(stages):
                if next_step[rank] < len(lists[rank]):
                    waiting.append(f"rank {rank} waits in {lists[rank][next_step[rank]]}")
            raise RuntimeError("schedule deadlocks: " + ", ".join(waiting))
    return timed


def p2p_plan(lists: list[list[Step]]) -> list[list[list[list[tuple]]]]:
    """[rank][k]: the message groups to post before step k (k = len: after the last step),
    each group a list of ("send" | "recv", peer, message), posted as one batch.

    Rounds of the unit-time simulation: a message made at the end of time unit t is sent and
    received in round t, by both ranks, so each rank's round-t group matches its peers'
    round-t groups. A receive is thus posted early and waited for when its step comes; and
    where a send completes only once its receive is posted (NCCL), ranks posting rounds in
    order cannot wait on each other in a cycle. Messages to oneself (p = 1) stay local."""
    stages = len(lists)
    timed = simulate(lists)
    rounds = [{} for _ in range(stages)]          # [rank][t]: what it sends and receives at t
    for rank, row in enumerate(timed):
        for _, end, step in row:
            if step.send_to is None or step.send_to == rank:
                continue                          # no message, or one to itself
            sent = message(step, rank, stages, True)
            rounds[rank].setdefault(end, []).append(("send", step.send_to, sent))
            rounds[step.send_to].setdefault(end, []).append(("recv", rank, sent))
    plan = []
    for rank, row in enumerate(timed):
        # Before step k: the rounds after step k-1 starts, up to the time step k starts
        # (after the last step: the rest).
        starts = [start for start, _, _ in row] + [float("inf")]
        times = sorted(rounds[rank])
        next_round = 0
        before_step = []
        for k in range(len(row) + 1):
            groups = []
            while next_round < len(times) and times[next_round] <= starts[k]:
                groups.append(rounds[rank][times[next_round]])
                next_round += 1
            before_step.append(groups)
        plan.append(before_step)
    return plan


def check_grouped_p2p(lists: list[list[Step]], plan: list | None = None) -> None:
    """Raise RuntimeError unless ``plan`` (default: ``p2p_plan``) posts every receive before
    its step and every send after its step, and cannot deadlock where a send completes only
    once the peer has posted the matching receive (NCCL): rank by rank, the groups complete
    in order, each once every peer has posted the group holding its other halves."""
    stages = len(lists)
    plan = plan or p2p_plan(lists)
    posted = []               # [rank] -> [(k, group)]: its groups in order, each before step k
    for rank in range(stages):
        in_order = []
        for k, groups in enumerate(plan[rank]):
            for group in groups:
                in_order.append((k, group))
        posted.append(in_order)
    where = {}                # ("send" | "recv", message) -> its group's place in that order
    for rank in range(stages):
        for n, (_, group) in enumerate(posted[rank]):
            for kind, _, sent in group:
                where[(kind, sent)] = n
    for rank, steps in enumerate(lists):
        for k, step in enumerate(steps):
            halves = (("recv", step.recv_from, False), ("send", step.send_to, True))
            for kind, peer, after_step in halves:
                if peer is None or peer == rank:
                    continue
                n = where.get((kind, message(step, rank, stages, after_step)))
                in_time = n is not None and (posted[rank][n][0] > k) == after_step
                if not in_time:
                    when = "after" if after_step else "before"
                    raise RuntimeError(f"rank {rank}: the {kind} of {_label(step, step.chunk + 1)} "
                                       f"is not planned {when} its step")
    completed = [0] * stages  # per rank: its groups completed; it has posted the next one
    while any(completed[rank] < len(posted[rank]) for rank in range(stages)):
        ready = []
        for rank in range(stages):
            if completed[rank] == len(posted[rank]):
                continue
            group = posted[rank][completed[rank]][1]
            other_halves_posted = True
            for kind, peer, sent in group:
                other_half = "recv" if kind == "send" else "send"
                if completed[peer] < where[(other_half, sent)]:
                    other_halves_posted = False
            if other_halves_posted:
                ready.append(rank)
        if not ready:
            waiting = []
            for rank in range(stages):
                if completed[rank] < len(posted[rank]):
                    waiting.append(f"rank {rank} waits in group {completed[rank]}")
            raise RuntimeError("grouped send/receive deadlocks: " + ", ".join(waiting))
        for rank in ready:
            completed[rank] += 1


def idle_shares(timed: list[list[tuple]]) -> list[float]:
    """Per rank: 1 - busy / pass length; the pass ends when the last rank ends."""
    end = max(e for row in timed for _, e, _ in row)
    return [1 - sum(e - s for s, e, _ in row) / end for row in timed]


def format_timeline(timed: list[list[tuple]]) -> str:
    """One row per rank, one column per time unit (unit costs): F3 / B3 / W3 = forward /
    input-gradient backward / weight gradient of micro-batch 3 ('.' idle; with chunks,
    F3a / F3b = chunk 0 / chunk 1)."""
    chunks = 1 + max(step.chunk for row in timed for _, _, step in row)
    end = max(end for row in timed for _, end, _ in row)
    grid = [[None] * end for _ in timed]          # [rank][time unit] -> the step, or None
    for rank, row in enumerate(timed):
        for start, _, step in row:
            grid[rank][start] = step
    width = max(len(_label(step, chunks)) for row in grid for step in row)
    lines = []
    for rank, row in enumerate(grid):
        cells = [f"{_label(step, chunks):<{width}}" for step in row]
        lines.append(f"rank {rank} | " + " ".join(cells).rstrip())
    return "\n".join(lines)


def simulated_idle(name: str, stages: int, micro_batches: int, chunks: int = 1) -> list[float]:
    return idle_shares(simulate(all_ranks(name, stages, micro_batches, chunks)))


def describe(name: str, stages: int, micro_batches: int, chunks: int = 1) -> str:
    """A heading and the unit-time timeline of schedule ``name``."""
    head = f"{name}, p={stages}, m={micro_batches}" + (f", v={chunks}" if chunks > 1 else "")
    timed = simulate(all_ranks(name, stages, micro_batches, chunks))
    return (f"{head}: idle {idle_shares(timed)[0]:.3f} of the pass (formula "
            f"{bubble_formula(name, stages, micro_batches, chunks):.3f}):\n"
            + format_timeline(timed))
