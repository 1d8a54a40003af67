"""Pipeline schedules as data: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V and DualPipeV.

What it teaches. A schedule is a pure function of (rank, p stages, m micro-batches) returning
the rank's ordered ``Step``s; ``pipeline_parallel.py`` executes any such list. The model is
cut into p*v pieces ("virtual stages") laid over the ranks (``stage_of``): on the loop layout
piece s is on rank s % p (interleaved: v > 1); on the V (ZB-V, DualPipeV) rank r holds pieces
r and 2p-1-r, so a micro-batch goes down the ranks and back up and the loss sits on rank 0.
Ops: F forward; B backward (only dL/d(input) where the schedule has W's); W the weight
gradients, which nobody waits for. ``simulate`` runs the lists in unit time; ``p2p_plan``
groups their messages so that they cannot deadlock. Plain Python, no torch:

    lists = pipeline_schedules.all_ranks("zbv", stages=4, micro_batches=8)   # [rank] -> Steps
"""

from __future__ import annotations

from dataclasses import dataclass

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"
LOOP, V = "loop", "v"                      # the two layouts of virtual stages over ranks


@dataclass(frozen=True)
class Step:
    """``op`` on ``micro_batch`` in this rank's model chunk ``chunk`` (virtual stage
    ``virtual_stage``); ``recv_from`` / ``send_to``: the rank its input comes from / its output
    goes to (None: the data, the loss, or W). Rank p-1 on the V is its own peer once."""

    op: str
    micro_batch: int
    chunk: int = 0
    recv_from: int | None = None
    send_to: int | None = None
    virtual_stage: int = 0


def stage_of(rank: int, chunk: int, stages: int, layout: str = LOOP) -> int:
    """The virtual stage (piece of the model) that ``rank`` holds as its chunk ``chunk``."""
    if layout == V and chunk == 1:
        return 2 * stages - 1 - rank           # back up the V: piece 2p-1 on rank 0
    return chunk * stages + rank               # loop: piece s on rank s % p (V chunk 0: r)


def rank_of(virtual_stage: int, stages: int, layout: str = LOOP) -> int:
    """The rank that holds ``virtual_stage`` (the inverse of ``stage_of``)."""
    if layout == V and virtual_stage >= stages:
        return 2 * stages - 1 - virtual_stage
    return virtual_stage % stages


def make_step(op: str, rank: int, stages: int, micro_batch: int, chunk: int = 0,
              chunks: int = 1, layout: str = LOOP) -> Step:
    """Forward goes virtual stage s -> s+1, backward s -> s-1, each to the rank holding it."""
    virtual_stage = stage_of(rank, chunk, stages, layout)
    previous_rank = None                          # the first virtual stage reads the data
    if virtual_stage > 0:
        previous_rank = rank_of(virtual_stage - 1, stages, layout)
    next_rank = None                              # the last computes the loss
    if virtual_stage < stages * chunks - 1:
        next_rank = rank_of(virtual_stage + 1, stages, layout)
    if op == FORWARD:
        return Step(op, micro_batch, chunk, previous_rank, next_rank, virtual_stage)
    if op == BACKWARD:
        return Step(op, micro_batch, chunk, next_rank, previous_rank, virtual_stage)
    return Step(op, micro_batch, chunk, None, None, virtual_stage)   # W: local, no message


def gpipe_schedule(rank: int, stages: int, micro_batches: int) -> list[Step]:
    """GPipe (Huang et al., 2019): all m forwards, then all m backwards. Holds m."""
    forwards = [make_step(FORWARD, rank, stages, i) for i in range(micro_batches)]
    backwards = [make_step(BACKWARD, rank, stages, i) for i in range(micro_batches)]
    return forwards + backwards


def one_f_one_b_schedule(rank: int, stages: int, micro_batches: int) -> list[Step]:
    """1F1B (Narayanan et al., 2019): ``one_f_one_b.py``'s three loops as a list. p-1-r
    warm-up forwards, then one F / one B, then the drain: holds at most p-r."""
    warmup = min(stages - 1 - rank, micro_batches)
    f = [make_step(FORWARD, rank, stages, i) for i in range(micro_batches)]
    b = [make_step(BACKWARD, rank, stages, i) for i in range(micro_batches)]
    steps = f[:warmup]
    for j in range(micro_batches - warmup):              # steady state: F(warmup + j), B(j)
        steps += [f[warmup + j], b[j]]
    return steps + b[micro_batches - warmup:]


def interleaved_schedule(rank: int, stages: int, chunks: int, micro_batches: int) -> list[Step]:
    """Interleaved 1F1B (Megatron-LM's virtual pipeline): 1F1B over the rank's v chunks.

    The k-th forward: groups of p micro-batches, each group through chunk 0, 1, ..., v-1
    (backwards from chunk v-1 down), so m must be a multiple of p. Warm-up: 2(p-1-r) + (v-1)p.
    """
    p, v, m = stages, chunks, micro_batches        # the papers' letters, as in the formulas
    if m % p:
        raise ValueError(f"interleaved 1F1B needs micro-batches a multiple of the stages: "
                         f"m={m}, p={p}")

    def nth(op: str, k: int) -> Step:
        micro_batch = (k // (p * v)) * p + k % p
        chunk = (k // p) % v
        if op == BACKWARD:
            chunk = v - 1 - chunk
        return make_step(op, rank, p, micro_batch, chunk, v)

    total = m * v                                  # forwards (and backwards) on this rank
    warmup = min(2 * (p - 1 - rank) + (v - 1) * p, total)
    steps = [nth(FORWARD, k) for k in range(warmup)]
    for k in range(total - warmup):
        steps += [nth(FORWARD, warmup + k), nth(BACKWARD, k)]
    return steps + [nth(BACKWARD, k) for k in range(total - warmup, total)]


def zb_h1_schedule(rank: int, stages: int, micro_batches: int) -> list[Step]:
    """ZB-H1 (Qi et al., 2024): 1F1B with the backward split into B (input gradient) and W.

    Rank r runs p-r forwards, then repeats B(j), W(j-r), F(j+p-r): its W's trail its B's by
    r micro-batches, and the r+1 W's left at the end fill the time in which 1F1B's rank r
    waits for gradients. Holds at most p (from F to W).
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


class VSteps:
    """A rank's steps on the V, in order: ``add("F0 B1 W1")`` appends a forward on chunk 0, a
    B and a W on chunk 1, each of that chunk's next micro-batch."""

    def __init__(self, rank: int, stages: int):
        self.rank = rank
        self.stages = stages
        self.steps = []
        self.count = {}           # (op, chunk) -> how many added so far

    def add(self, ops: str) -> None:
        for token in ops.split():                    # "B1": op B on chunk 1
            op, chunk = token[0], int(token[1])
            micro_batch = self.done(op, chunk)
            self.count[(op, chunk)] = micro_batch + 1
            self.steps.append(make_step(op, self.rank, self.stages, micro_batch, chunk, 2, V))

    def done(self, op: str, chunk: int) -> int:
        return self.count.get((op, chunk), 0)


def zbv_schedule(rank: int, stages: int, micro_batches: int) -> list[Step]:
    """ZB-V (Qi et al., 2024, section 6): ZB-H1's split backward on the V layout. Rank r:
      1. 2(p-r)-1 chunk-0 forwards: rank 0 feeds the pipe until micro-batch 0, down and back
         up, reaches its chunk 1;
      2. r pairs (F chunk 1, F chunk 0);  3. p-r triples F B W on chunk 1;
      4. steady: F chunk 0 (while any are left), B W chunk 0, F B W chunk 1;
      5. drain: r pairs (B chunk 0, B chunk 1) with their W's put off; p-r of (B W chunk 0);
         then the W's put off, chunk 1's first: they fill the waits for the last gradients.
    The phases need m >= 2p-1; a smaller m runs the schedule of 2p-1 with the micro-batches
    past m left out (each micro-batch's steps wait only on each other and the rank's order).
    """
    p = stages
    built_for = max(micro_batches, 2 * p - 1)
    work = VSteps(rank, p)
    for _ in range(2 * (p - rank) - 1):              # 1.
        work.add("F0")
    for _ in range(rank):                            # 2.
        work.add("F1 F0")
    for _ in range(p - rank):                        # 3.
        work.add("F1 B1 W1")
    while work.done(FORWARD, 1) < built_for:         # 4.
        if work.done(FORWARD, 0) < built_for:
            work.add("F0")
        work.add("B0 W0 F1 B1 W1")
    for _ in range(rank):                            # 5.
        work.add("B0 B1")
    for _ in range(p - rank):
        work.add("B0 W0")
    for chunk in (1, 0):
        while work.done(WEIGHT, chunk) < built_for:
            work.add(f"W{chunk}")
    return [step for step in work.steps if step.micro_batch < micro_batches]


def dualpipev_schedule(rank: int, stages: int, micro_batches: int) -> list[Step]:
    """DualPipeV (DeepSeek's DualPipe cut in half, Sea AI Lab): on the V layout the steady
    state pairs a forward of one chunk with the whole backward of the other, (F chunk 0,
    B W chunk 1) then (F chunk 1, B W chunk 0). DeepSeek overlaps a pair's compute with the
    other's messages; here a pair runs in order. Rank r, in eight phases (m >= 2p):
      1. 2(p-r-1) chunk-0 forwards;  2. r+1 pairs (F chunk 0, F chunk 1): the V fills;
      3. p-r-1 of (B W chunk 1, F chunk 1);  4. m-2p+r+1 of the two pairs: the steady state;
      5. p-r-1 of (B W chunk 1, F chunk 1, B W chunk 0);
      6. r+1 of (B chunk 1, B chunk 0), the first r+1 whole, then with W put off;
      7. p-r-1 of (the oldest W put off, B chunk 0);  8. the W's still put off.
    """
    p = stages
    m = micro_batches
    if m < 2 * p:
        raise ValueError(f"DualPipeV needs at least as many micro-batches as virtual stages, "
                         f"m >= 2p: m={m}, p={p}")
    work = VSteps(rank, p)
    for _ in range(2 * (p - rank - 1)):              # 1.
        work.add("F0")
    for _ in range(rank + 1):                        # 2.
        work.add("F0 F1")
    for _ in range(p - rank - 1):                    # 3.
        work.add("B1 W1 F1")
    for _ in range(m - 2 * p + rank + 1):            # 4.
        work.add("F0 B1 W1 F1 B0 W0")
    for _ in range(p - rank - 1):                    # 5.
        work.add("B1 W1 F1 B0 W0")
    put_off = []                                     # chunks whose oldest W is put off
    for i in range(2 * (rank + 1)):                  # 6. the first r+1 whole, then W put off
        chunk = 1 - i % 2                            #    B chunk 1, B chunk 0, ...
        work.add(f"B{chunk}")
        if i < rank + 1:
            work.add(f"W{chunk}")
        else:
            put_off.append(chunk)
    for _ in range(p - rank - 1):                    # 7.
        if put_off:
            work.add(f"W{put_off.pop(0)}")
        work.add("B0")
        put_off.append(0)
    for chunk in put_off:                            # 8.
        work.add(f"W{chunk}")
    return work.steps


SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule,
             "interleaved": interleaved_schedule, "zbh1": zb_h1_schedule,
             "zbv": zbv_schedule, "dualpipev": dualpipev_schedule}
V_SCHEDULES = ("zbv", "dualpipev")                 # the schedules on the V layout


def layout_of(name: str) -> str:
    return V if name in V_SCHEDULES else LOOP


def chunks_per_rank(name: str, chunks: int = 1) -> int:
    """v under schedule ``name``: ``chunks`` for interleaved, 2 on the V layout, else 1."""
    return {"interleaved": chunks, "zbv": 2, "dualpipev": 2}.get(name, 1)


def loss_rank(name: str, stages: int, chunks: int = 1) -> int:
    """The rank holding the last virtual stage, where the loss is computed: p-1 on the loop
    layout, 0 on the V. The V's v is its own 2, whatever ``chunks`` (interleaved's v) says."""
    last_virtual_stage = stages * chunks_per_rank(name, chunks) - 1
    return rank_of(last_virtual_stage, stages, layout_of(name))


def all_ranks(name: str, stages: int, micro_batches: int, chunks: int = 1) -> list[list[Step]]:
    """Every rank's steps under schedule ``name`` (``chunks``: v, for interleaved only)."""
    if name == "interleaved":
        return [interleaved_schedule(r, stages, chunks, micro_batches) for r in range(stages)]
    return [SCHEDULES[name](r, stages, micro_batches) for r in range(stages)]


# --------------------------------------------------------------------------- messages


def message(step: Step, sending: bool = False) -> tuple:
    """What travels: (op, micro-batch, virtual stage that receives it)."""
    virtual_stage = step.virtual_stage
    if sending and step.op == FORWARD:
        virtual_stage += 1                        # forward: to the next virtual stage
    if sending and step.op == BACKWARD:
        virtual_stage -= 1                        # backward: to the previous one
    return step.op, step.micro_batch, virtual_stage


def simulate(lists: list[list[Step]], cost: dict | None = None) -> list[list[tuple]]:
    """Each step as early as its rank and its input allow (sends do not wait); ``cost``: time
    per op, 1 each by default. [rank] -> [(start, end, step)]; RuntimeError on a deadlock."""
    cost = cost or {FORWARD: 1, BACKWARD: 1, WEIGHT: 1}
    stages = len(lists)
    arrives = {}                                  # message -> when its receiver has it
    timed = [[] for _ in range(stages)]
    free_at = [0] * stages                        # per rank: when its last step ended
    moved = True
    while moved:
        moved = False
        for rank in range(stages):
            while len(timed[rank]) < len(lists[rank]):
                step = lists[rank][len(timed[rank])]
                start = free_at[rank]
                if step.recv_from is not None:
                    if message(step) not in arrives:
                        break                            # its message is not sent yet
                    start = max(start, arrives[message(step)])
                free_at[rank] = start + cost[step.op]
                timed[rank].append((start, free_at[rank], step))
                if step.send_to is not None:
                    arrives[message(step, True)] = free_at[rank]
                moved = True
    stuck = [f"rank {r} waits in {lists[r][len(timed[r])]}" for r in range(stages)
             if len(timed[r]) < len(lists[r])]
    if stuck:
        raise RuntimeError("schedule deadlocks: " + ", ".join(stuck))
    return timed


def p2p_plan(lists: list[list[Step]]) -> list[list[list[list[tuple]]]]:
    """[rank][k]: the groups of ("send" | "recv", peer, message) to post before step k (k =
    len: after the last), each one ``batch_isend_irecv``. A message made at time t of the
    simulation is sent and received in round t by both ranks, so groups match across ranks
    and, posted in order, cannot wait on each other in a cycle even where a send completes only
    once its receive is posted (NCCL). Messages to oneself (the V's turn) stay local."""
    timed = simulate(lists)
    rounds = [{} for _ in lists]                 # [rank][t]: what it sends and receives at t
    for rank, row in enumerate(timed):
        for _, end, step in row:
            if step.send_to is None or step.send_to == rank:
                continue
            sent = message(step, True)
            rounds[rank].setdefault(end, []).append(("send", step.send_to, sent))
            rounds[step.send_to].setdefault(end, []).append(("recv", rank, sent))
    plan = []
    for rank, row in enumerate(timed):
        starts = [start for start, _, _ in row] + [float("inf")]
        times = sorted(rounds[rank])
        before_step = []                          # before step k: the rounds up to its start
        for k in range(len(row) + 1):
            before_step.append([rounds[rank][t] for t in times if t <= starts[k]])
            times = [t for t in times if t > starts[k]]
        plan.append(before_step)
    return plan
