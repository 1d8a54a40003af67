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
    s, last = chunk * stages + rank, stages * chunks - 1
    prev = (s - 1) % stages if s > 0 else None
    nxt = (s + 1) % stages if s < last else None
    if op == FORWARD:
        return Step(op, micro_batch, chunk, prev, nxt)
    if op == BACKWARD:
        return Step(op, micro_batch, chunk, nxt, prev)
    return Step(op, micro_batch, chunk)           # W: local work, no message


def gpipe_schedule(rank: int, stages: int, micro_batches: int) -> list[Step]:
    """GPipe (Huang et al., 2019): all m forwards, then all m backwards."""
    return ([make_step(FORWARD, rank, stages, i) for i in range(micro_batches)]
            + [make_step(BACKWARD, rank, stages, i) for i in range(micro_batches)])


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
    p, v, m = stages, chunks, micro_batches
    if m % p:
        raise ValueError(f"interleaved 1F1B needs micro-batches a multiple of the stages: "
                         f"m={m}, p={p}")

    def nth(op: str, k: int) -> Step:                    # the rank's k-th forward / backward
        chunk = (k // p) % v
        i = (k // (p * v)) * p + k % p
        return make_step(op, rank, p, i, chunk if op == FORWARD else v - 1 - chunk, v)

    total = m * v
    warmup = min(2 * (p - 1 - rank) + (v - 1) * p, total)
    steps = [nth(FORWARD, k) for k in range(warmup)]
    for k in range(total - warmup):
        steps += [nth(FORWARD, warmup + k), nth(BACKWARD, k)]
    return steps + [nth(BACKWARD, k) for k in range(total - warmup, total)]


def zb_h1_schedule(rank: int, stages: int, micro_batches: int) -> list[Step]:
    """ZB-H1 (Qi et al., 2024): 1F1B with the backward split into B (input gradient) and W.

    Rank r runs p-r forwards, then repeats B(j), W(j-r), F(j+p-r): its W's trail its B's by
    r micro-batches, and the r+1 W's left over at the end fill the time in which 1F1B's
    rank r would wait for gradients. Activations are held from F to W: p per rank at most.
    """
    p, m = stages, micro_batches
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
        raise ValueError(f"--layers {layers} is not divisible by {stages * chunks} "
                         f"({stages} stages x {chunks} chunks per stage)")
    if batch is not None and batch % micro_batches:
        raise ValueError(f"--batch {batch} is not divisible by {micro_batches} micro-batches")
    lists = all_ranks(name, stages, micro_batches, chunks)
    check_order(lists)
    try:
        check_grouped_p2p(lists)                     # simulates too: deadlocks either way
    except RuntimeError as e:
        raise ValueError(str(e)) from None


def peak_held(steps: list[Step]) -> int:
    """Most (chunk, micro-batch) pairs held at once: from the forward until the last step
    that needs its tensors (W where the schedule has W's, else B)."""
    last = WEIGHT if any(s.op == WEIGHT for s in steps) else BACKWARD
    held = peak = 0
    for s in steps:
        held += (s.op == FORWARD) - (s.op == last)
        peak = max(peak, held)
    return peak


def bubble_formula(name: str, stages: int, micro_batches: int, chunks: int = 1) -> float:
    """Idle share of every rank when each step takes one time unit.

    GPipe, 1F1B: (p-1)/(m+p-1). Interleaved: (p-1)/(vm+p-1). ZB-H1, T_F = T_B = T_W:
    (p-1)/(3m+p-1) when m >= p (derived in README.md beside this file); with m < p the pipe never
    fills and the pass lasts one F and one B ripple, 2(m+p-1), plus the last W.
    """
    p, m, v = stages, micro_batches, chunks
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zbh1":
        return 1 - 3 * m / max(3 * m + p - 1, 2 * (m + p - 1) + 1)
    return (p - 1) / (m + p - 1)


# --------------------------------------------------------------------------- checks, simulator


def message(step: Step, rank: int, stages: int, sending: bool = False) -> tuple:
    """What travels: (op, micro-batch, virtual stage that receives it)."""
    s = step.chunk * stages + rank
    if sending:
        s += 1 if step.op == FORWARD else -1
    return step.op, step.micro_batch, s


def _label(step: Step | None, chunks: int) -> str:
    if step is None:
        return "."
    return f"{step.op}{step.micro_batch}" + ("abcdefghij"[step.chunk] if chunks > 1 else "")


def check_order(lists: list[list[Step]]) -> None:
    """Raise ValueError unless every rank runs each F, B (and W) exactly once, F before B
    before W, with the right peers, and every channel src -> dst delivers the messages in
    the order dst receives them (point-to-point messages between two ranks stay in order)."""
    p = len(lists)
    v = 1 + max(s.chunk for steps in lists for s in steps)
    m = 1 + max(s.micro_batch for steps in lists for s in steps)
    ops = (FORWARD, BACKWARD, WEIGHT) if any(s.op == WEIGHT for st in lists for s in st) \
        else (FORWARD, BACKWARD)
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    for r, steps in enumerate(lists):
        at = {(s.op, s.chunk, s.micro_batch): k for k, s in enumerate(steps)}
        want = {(op, c, i) for op in ops for c in range(v) for i in range(m)}
        if len(at) != len(steps) or set(at) != want:
            raise ValueError(f"rank {r} does not run each of {'/'.join(ops)} once per chunk "
                             f"and micro-batch")
        for k, s in enumerate(steps):
            if s != make_step(s.op, r, p, s.micro_batch, s.chunk, v):
                raise ValueError(f"rank {r} step {_label(s, v)} has the wrong peers: {s}")
            before = ops[ops.index(s.op) - 1] if s.op != FORWARD else None
            if before and at[(before, s.chunk, s.micro_batch)] > k:
                raise ValueError(f"rank {r} runs {_label(s, v)} before "
                                 f"{before}{s.micro_batch} of the same chunk")
            if s.send_to is not None:
                sent.setdefault((r, s.send_to), []).append(message(s, r, p, True))
            if s.recv_from is not None:
                received.setdefault((s.recv_from, r), []).append(message(s, r, p, False))
    for (src, dst) in sorted(set(sent) | set(received)):
        a, b = sent.get((src, dst), []), received.get((src, dst), [])
        for n in range(max(len(a), len(b))):
            if n >= len(a) or n >= len(b) or a[n] != b[n]:
                raise ValueError(f"channel rank {src} -> rank {dst}: message {n} sent is "
                                 f"{a[n] if n < len(a) else 'nothing'}, received as "
                                 f"{b[n] if n < len(b) else 'nothing'}")


def simulate(lists: list[list[Step]], cost: dict | None = None) -> list[list[tuple]]:
    """Start every step as early as its rank and its incoming message allow (sends do not
    wait for the receiver: Gloo's isend). ``cost``: time per op, 1 each by default.
    Returns [rank] -> [(start, end, step)]; raises RuntimeError on a deadlock."""
    cost = cost or {FORWARD: 1, BACKWARD: 1, WEIGHT: 1}
    p = len(lists)
    arrives: dict[tuple, float] = {}
    out: list[list[tuple]] = [[] for _ in range(p)]
    pos, free = [0] * p, [0] * p
    while any(pos[r] < len(lists[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(lists[r]):
                step = lists[r][pos[r]]
                start = free[r]
                if step.recv_from is not None:
                    key = message(step, r, p, False)
                    if key not in arrives:
                        break                            # its message is not sent yet
                    start = max(start, arrives[key])
                free[r] = start + cost[step.op]
                out[r].append((start, free[r], step))
                if step.send_to is not None:
                    arrives[message(step, r, p, True)] = free[r]
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("schedule deadlocks: " + ", ".join(
                f"rank {r} waits in {lists[r][pos[r]]}" for r in range(p)
                if pos[r] < len(lists[r])))
    return out


def p2p_plan(lists: list[list[Step]]) -> list[list[list[list[tuple]]]]:
    """[rank][k]: the message groups to post before step k (k = len: after the last step),
    each group a list of ("send" | "recv", peer, message), posted as one batch.

    Rounds of the unit-time simulation: a message made at the end of time unit t is sent and
    received in round t, by both ranks, so each rank's round-t group matches its peers'
    round-t groups. A receive is thus posted early and waited for when its step comes; and
    where a send completes only once its receive is posted (NCCL), ranks posting rounds in
    order cannot wait on each other in a cycle. Messages to oneself (p = 1) stay local."""
    p, timed = len(lists), simulate(lists)
    rounds: list[dict[float, list]] = [{} for _ in range(p)]
    for r, row in enumerate(timed):
        for _, end, s in row:
            if s.send_to not in (None, r):
                rounds[r].setdefault(end, []).append(("send", s.send_to, message(s, r, p, True)))
                rounds[s.send_to].setdefault(end, []).append(("recv", r, message(s, r, p, True)))
    starts = [[-1.0] + [start for start, _, _ in row] + [float("inf")] for row in timed]
    return [[[rounds[r][t] for t in sorted(rounds[r]) if starts[r][k] < t <= starts[r][k + 1]]
             for k in range(len(timed[r]) + 1)] for r in range(p)]


def check_grouped_p2p(lists: list[list[Step]], plan: list | None = None) -> None:
    """Raise RuntimeError unless ``plan`` (default: ``p2p_plan``) posts every receive before
    its step and every send after its step, and cannot deadlock where a send completes only
    once the peer has posted the matching receive (NCCL): rank by rank, the groups complete
    in order, each once every peer has posted the group holding its other halves."""
    p, plan = len(lists), plan or p2p_plan(lists)
    seq = [[(k, g) for k, groups in enumerate(plan[r]) for g in groups] for r in range(p)]
    where = {(kind, msg): n for r in range(p) for n, (_, g) in enumerate(seq[r])
             for kind, _, msg in g}
    for r, steps in enumerate(lists):
        for k, s in enumerate(steps):
            for kind, peer, later in (("recv", s.recv_from, False), ("send", s.send_to, True)):
                n = where.get((kind, message(s, r, p, later)))
                if peer not in (None, r) and (n is None or (seq[r][n][0] > k) != later):
                    raise RuntimeError(f"rank {r}: the {kind} of {_label(s, s.chunk + 1)} is not "
                                       f"planned {'after' if later else 'before'} its step")
    done = [0] * p                                       # groups completed, rank by rank
    while any(done[r] < len(seq[r]) for r in range(p)):
        ready = [r for r in range(p) if done[r] < len(seq[r]) and all(
            done[peer] >= where[("recv" if kind == "send" else "send", msg)]
            for kind, peer, msg in seq[r][done[r]][1])]
        if not ready:
            raise RuntimeError("grouped send/receive deadlocks: " + ", ".join(
                f"rank {r} waits in group {done[r]}" for r in range(p) if done[r] < len(seq[r])))
        for r in ready:
            done[r] += 1


def idle_shares(timed: list[list[tuple]]) -> list[float]:
    """Per rank: 1 - busy / pass length; the pass ends when the last rank ends."""
    end = max(e for row in timed for _, e, _ in row)
    return [1 - sum(e - s for s, e, _ in row) / end for row in timed]


def format_timeline(timed: list[list[tuple]]) -> str:
    """One row per rank, one column per time unit (unit costs): F3 / B3 / W3 = forward /
    input-gradient backward / weight gradient of micro-batch 3 ('.' idle; with chunks,
    F3a / F3b = chunk 0 / chunk 1)."""
    v = 1 + max(s.chunk for row in timed for _, _, s in row)
    end = max(e for row in timed for _, e, _ in row)
    grid = [[None] * end for _ in timed]
    for r, row in enumerate(timed):
        for start, _, step in row:
            grid[r][start] = step
    width = max(len(_label(s, v)) for row in grid for s in row)
    return "\n".join(f"rank {r} | " + " ".join(f"{_label(s, v):<{width}}" for s in row).rstrip()
                     for r, row in enumerate(grid))


def simulated_idle(name: str, stages: int, micro_batches: int, chunks: int = 1) -> list[float]:
    return idle_shares(simulate(all_ranks(name, stages, micro_batches, chunks)))


def describe(name: str, stages: int, micro_batches: int, chunks: int = 1) -> str:
    """A heading and the unit-time timeline of schedule ``name``."""
    head = f"{name}, p={stages}, m={micro_batches}" + (f", v={chunks}" if chunks > 1 else "")
    timed = simulate(all_ranks(name, stages, micro_batches, chunks))
    return (f"{head}: idle {idle_shares(timed)[0]:.3f} of the pass (formula "
            f"{bubble_formula(name, stages, micro_batches, chunks):.3f}):\n"
            + format_timeline(timed))
