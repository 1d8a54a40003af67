"""Pipeline schedules as data: GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1, and the
V-shaped ZB-V and DualPipeV.

A schedule is a pure function of (rank, stages, micro_batches) (interleaved: also chunks)
that returns the rank's ordered list of ``Step``s. This file has no torch in it: the lists
are checked here for order of events (every F before its B before its W, every send matched
by a receive in the same order, no deadlock), run in unit time by a small simulator (the
ideal idle share and the text timeline), set beside each schedule's idle formula, and
planned into groups of sends and receives that cannot deadlock (``p2p_plan``).
``pipeline_parallel.py`` executes the same lists with real tensors.

Words: p stages (ranks), m micro-batches, v model chunks per rank. The model is cut into
p*v pieces, "virtual stages", and a layout says which rank holds which (``stage_of``):
  * loop (GPipe, 1F1B, ZB-H1 with v = 1; interleaved): piece s on rank s % p as its chunk
    s // p, so a micro-batch loops over the ranks v times (Narayanan et al., 2021);
  * V (ZB-V, DualPipeV; v = 2): rank r holds piece r as chunk 0 and piece 2p-1-r as
    chunk 1, so a micro-batch goes down the ranks and back up, and the last piece (the
    loss) sits on rank 0 beside the first (Qi et al., 2024).
Ops: F forward; B backward (where a schedule has W's, only the gradient w.r.t. the stage's
input, which the previous stage waits for; elsewhere the whole backward); W the weight
gradients, which nobody waits for (Qi et al., 2024). A whole backward in a schedule with
W's is written B then W of the same micro-batch, back to back.

Use it (this file needs Python alone):

    import pipeline_schedules as schedules
    lists = schedules.all_ranks("zbv", stages=4, micro_batches=8)   # [rank] -> its Steps
    schedules.check_order(lists)                   # raises ValueError on a broken schedule
    print(schedules.describe("zbv", 4, 8))         # the timeline, idle share and formula
"""

from __future__ import annotations

from dataclasses import dataclass

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"
LOOP, V = "loop", "v"                      # the two layouts of virtual stages over ranks


@dataclass(frozen=True)
class Step:
    """One unit of work on one rank: ``op`` on ``micro_batch`` in model chunk ``chunk``, which
    is virtual stage ``virtual_stage`` of the model.

    ``recv_from`` / ``send_to``: the rank it receives its input from / sends its output to
    (None: the first virtual stage reads the data, the last computes the loss; W neither).
    A rank may be its own peer: under the V layout rank p-1 holds pieces p-1 and p.
    """

    op: str
    micro_batch: int
    chunk: int = 0
    recv_from: int | None = None
    send_to: int | None = None
    virtual_stage: int = 0


def stage_of(rank: int, chunk: int, stages: int, layout: str = LOOP) -> int:
    """The virtual stage (piece of the model) that ``rank`` holds as its chunk ``chunk``."""
    if layout == V:
        if chunk == 0:
            return rank                        # down the ranks ...
        return 2 * stages - 1 - rank           # ... and back up: piece 2p-1 on rank 0
    return chunk * stages + rank               # loop: piece s on rank s % p


def rank_of(virtual_stage: int, stages: int, layout: str = LOOP) -> int:
    """The rank that holds ``virtual_stage`` (the inverse of ``stage_of``)."""
    if layout == V and virtual_stage >= stages:
        return 2 * stages - 1 - virtual_stage
    return virtual_stage % stages


def make_step(op: str, rank: int, stages: int, micro_batch: int, chunk: int = 0,
              chunks: int = 1, layout: str = LOOP) -> Step:
    """Forward goes virtual stage s -> s+1, backward s -> s-1, each to the rank holding it."""
    virtual_stage = stage_of(rank, chunk, stages, layout)
    last_virtual_stage = stages * chunks - 1
    previous_rank = None                          # the first virtual stage reads the data
    if virtual_stage > 0:
        previous_rank = rank_of(virtual_stage - 1, stages, layout)
    next_rank = None                              # the last computes the loss
    if virtual_stage < last_virtual_stage:
        next_rank = rank_of(virtual_stage + 1, stages, layout)
    if op == FORWARD:
        return Step(op, micro_batch, chunk, previous_rank, next_rank, virtual_stage)
    if op == BACKWARD:
        return Step(op, micro_batch, chunk, next_rank, previous_rank, virtual_stage)
    return Step(op, micro_batch, chunk, None, None, virtual_stage)   # W: local, no message


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


class VSteps:
    """Rank ``rank``'s steps on the V layout, built in order: ``forward(c)`` / ``backward(c)``
    / ``weight(c)`` add the chunk's next micro-batch's F / B / W. Both V schedules use it."""

    def __init__(self, rank: int, stages: int):
        self.rank = rank
        self.stages = stages
        self.steps = []
        self.count = {}           # (op, chunk) -> how many this rank has added so far

    def add(self, op: str, chunk: int) -> None:
        micro_batch = self.count.get((op, chunk), 0)
        self.count[(op, chunk)] = micro_batch + 1
        self.steps.append(make_step(op, self.rank, self.stages, micro_batch, chunk, 2, V))

    def forward(self, chunk: int) -> None:
        self.add(FORWARD, chunk)

    def backward(self, chunk: int) -> None:
        self.add(BACKWARD, chunk)

    def weight(self, chunk: int) -> None:
        self.add(WEIGHT, chunk)

    def done(self, op: str, chunk: int) -> int:
        return self.count.get((op, chunk), 0)


def zbv_schedule(rank: int, stages: int, micro_batches: int) -> list[Step]:
    """ZB-V (Qi et al., 2024, section 6): ZB-H1's split backward on the V layout.

    Micro-batch i goes down the ranks on chunk 0 and back up on chunk 1; its backward then
    goes down on chunk 1 and up on chunk 0. Rank r, in five phases:
      1. 2(p-r)-1 chunk-0 forwards: rank 0 keeps feeding the pipe until micro-batch 0,
         having gone down and up, reaches its chunk 1 (2p-1 units later);
      2. r pairs (F chunk 1, F chunk 0): the first chunk-1 inputs arrive, chunk 0 goes on;
      3. p-r triples (F, B, W) on chunk 1: the first gradients start back down;
      4. steady: F chunk 0 (while any are left), B W chunk 0, F B W chunk 1;
      5. drain: r pairs (B chunk 0, B chunk 1), their W's put off; p-r of (B chunk 0, the
         oldest chunk-0 W put off); then the W's still put off, chunk 1's first. Those W's
         fill the time in which the rank would wait for the last gradients.
    The phases need m >= 2p-1 (phase 1 on rank 0); a smaller m runs the schedule of 2p-1
    micro-batches with the missing ones left out (a micro-batch's steps wait only for each
    other and for the rank's earlier steps, so every order and message stays matched).
    """
    p = stages                                      # the papers' letter, as in the formulas
    built_for = max(micro_batches, 2 * p - 1)      # micro-batches the phases are built for
    work = VSteps(rank, p)                          # this rank's steps, built in order
    for _ in range(2 * (p - rank) - 1):              # 1.
        work.forward(0)
    for _ in range(rank):                            # 2.
        work.forward(1)
        work.forward(0)
    for _ in range(p - rank):                        # 3.
        work.forward(1)
        work.backward(1)
        work.weight(1)
    while work.done(FORWARD, 1) < built_for:         # 4.
        if work.done(FORWARD, 0) < built_for:
            work.forward(0)
        work.backward(0)
        work.weight(0)
        work.forward(1)
        work.backward(1)
        work.weight(1)
    for _ in range(rank):                            # 5.
        work.backward(0)
        work.backward(1)
    for _ in range(p - rank):
        work.backward(0)
        work.weight(0)
    while work.done(WEIGHT, 1) < built_for:
        work.weight(1)
    while work.done(WEIGHT, 0) < built_for:
        work.weight(0)
    steps = []
    for step in work.steps:
        if step.micro_batch < micro_batches:        # leave out the micro-batches past m
            steps.append(step)
    return steps


def dualpipev_schedule(rank: int, stages: int, micro_batches: int) -> list[Step]:
    """DualPipeV (DeepSeek's DualPipe cut in half, the "cut-in-half" schedule of Sea AI Lab):
    on the V layout, the steady state runs a forward of one chunk beside the whole backward
    of the other, in pairs: (F chunk 0, B W chunk 1), (F chunk 1, B W chunk 0). DeepSeek
    overlaps each pair's compute with the other's messages (and, in their MoE model, its
    all-to-all); this executor runs a pair in order on one stream, so the unit-time
    simulation credits no overlap: a pair is F + B + W, 3 units.

    Rank r, in eight phases (m >= 2p):
      1. 2(p-r-1) chunk-0 forwards, 2. r+1 pairs (F chunk 0, F chunk 1): fill the V;
      3. p-r-1 of (B W chunk 1, F chunk 1): the first gradients start back down;
      4. m-2p+r+1 of the two pairs above, the steady state;
      5. p-r-1 of (B W chunk 1, then the pair (F chunk 1, B W chunk 0));
      6. r+1 of (B chunk 1, B chunk 0), whole backwards for the first half, from then on
         with W put off ("zero bubble": the W's fill the waits of the drain);
      7. p-r-1 of (the oldest W put off, B chunk 0); 8. the W's still put off.
    """
    p = stages                                      # the papers' letter, as in the formulas
    m = micro_batches
    if m < 2 * p:
        raise ValueError(f"DualPipeV needs at least as many micro-batches as virtual stages, "
                         f"m >= 2p: m={m}, p={p}")
    work = VSteps(rank, p)                          # this rank's steps, built in order
    put_off = []                                    # chunks whose oldest W is put off

    def backward(chunk: int, whole: bool = True) -> None:
        work.backward(chunk)
        if whole:
            work.weight(chunk)                         # the whole backward: B then W
        else:
            put_off.append(chunk)

    def oldest_put_off_weight() -> None:
        if put_off:
            work.weight(put_off.pop(0))

    for _ in range(2 * (p - rank - 1)):              # 1.
        work.forward(0)
    for _ in range(rank + 1):                        # 2.
        work.forward(0)
        work.forward(1)
    for _ in range(p - rank - 1):                    # 3.
        backward(1)
        work.forward(1)
    for _ in range(m - 2 * p + rank + 1):            # 4.
        work.forward(0)                                # pair: F chunk 0 beside B W chunk 1
        backward(1)
        work.forward(1)                                # pair: F chunk 1 beside B W chunk 0
        backward(0)
    for _ in range(p - rank - 1):                    # 5.
        backward(1)
        work.forward(1)
        backward(0)
    whole = True
    for i in range(rank + 1):                        # 6.
        if i == (rank + 1) // 2 and rank % 2 == 1:
            whole = False
        backward(1, whole)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            whole = False
        backward(0, whole)
    for _ in range(p - rank - 1):                    # 7.
        oldest_put_off_weight()
        backward(0, whole)
    while put_off:                                   # 8.
        oldest_put_off_weight()
    return work.steps


SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule,
             "interleaved": interleaved_schedule, "zbh1": zb_h1_schedule,
             "zbv": zbv_schedule, "dualpipev": dualpipev_schedule}
V_SCHEDULES = ("zbv", "dualpipev")                 # the schedules on the V layout


def layout_of(name: str) -> str:
    """The layout of schedule ``name``'s virtual stages: V for ZB-V and DualPipeV, else loop."""
    if name in V_SCHEDULES:
        return V
    return LOOP


def chunks_per_rank(name: str, chunks: int = 1) -> int:
    """v under schedule ``name``: ``chunks`` for interleaved, 2 on the V layout, else 1."""
    if name == "interleaved":
        return chunks
    if name in V_SCHEDULES:
        return 2
    return 1


def loss_rank(name: str, stages: int, chunks: int = 1) -> int:
    """The rank holding schedule ``name``'s last virtual stage, where the loss is computed:
    p-1 on the loop layout, 0 on the V."""
    last_virtual_stage = stages * chunks_per_rank(name, chunks) - 1
    return rank_of(last_virtual_stage, stages, layout_of(name))


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
    multiple of p for interleaved, m >= 2p for DualPipeV), a broken order of events, a
    deadlock. ``chunks``: v for interleaved (the V schedules always hold 2)."""
    chunks = chunks_per_rank(name, chunks)
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
    """Idle share of every rank when each step takes one time unit (derived in README.md
    beside this file, checked against ``simulate`` in the tests).

    GPipe, 1F1B: (p-1)/(m+p-1). Interleaved: (p-1)/(vm+p-1). ZB-H1, T_F = T_B = T_W:
    (p-1)/(3m+p-1) when m >= p; with m < p the pipe never fills and the pass lasts one F
    and one B ripple, 2(m+p-1), plus the last W. The V schedules do 6m chunk steps per rank
    (F, B, W on two chunks) and idle p-1 of them: ZB-V when m >= (3p-1)/2 (with fewer the
    pass lasts 4m+4p-2 units), DualPipeV (m >= 2p) with its pairs run in order, no overlap
    credited.
    """
    p, m, v = stages, micro_batches, chunks        # the papers' letters, as in the formulas
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zbh1":
        return 1 - 3 * m / max(3 * m + p - 1, 2 * (m + p - 1) + 1)
    if name == "zbv":
        return 1 - 6 * m / max(6 * m + p - 1, 4 * m + 4 * p - 2)
    if name == "dualpipev":
        return (p - 1) / (6 * m + p - 1)
    return (p - 1) / (m + p - 1)


# --------------------------------------------------------------------------- checks, simulator


def message(step: Step, sending: bool = False) -> tuple:
    """What travels: (op, micro-batch, virtual stage that receives it)."""
    virtual_stage = step.virtual_stage
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


def placement(lists: list[list[Step]]) -> dict[int, int]:
    """{virtual stage: the rank holding it}, as the steps say. Raise ValueError unless each
    of the virtual stages 0, 1, ... is one chunk of one rank, and each chunk one stage."""
    holder = {}               # virtual stage -> (rank, chunk)
    piece = {}                # (rank, chunk) -> virtual stage
    for rank, steps in enumerate(lists):
        for step in steps:
            here = (rank, step.chunk)
            holder.setdefault(step.virtual_stage, here)
            piece.setdefault(here, step.virtual_stage)
            if holder[step.virtual_stage] != here:
                first_rank, first_chunk = holder[step.virtual_stage]
                raise ValueError(f"virtual stage {step.virtual_stage} runs on rank {first_rank} "
                                 f"chunk {first_chunk} and on rank {rank} chunk {step.chunk}")
            if piece[here] != step.virtual_stage:
                raise ValueError(f"rank {rank} chunk {step.chunk} runs virtual stages "
                                 f"{piece[here]} and {step.virtual_stage}")
    if sorted(holder) != list(range(len(holder))):
        raise ValueError(f"the virtual stages run are {sorted(holder)}, not 0 to "
                         f"{len(holder) - 1}")
    ranks = {}
    for virtual_stage, (rank, _) in holder.items():
        ranks[virtual_stage] = rank
    return ranks


def peers(step: Step, holders: dict[int, int]) -> tuple:
    """(recv_from, send_to) that ``step`` must have, given where each virtual stage lives."""
    previous_rank = holders.get(step.virtual_stage - 1)     # None before the first stage
    next_rank = holders.get(step.virtual_stage + 1)         # None after the last
    if step.op == FORWARD:
        return previous_rank, next_rank
    if step.op == BACKWARD:
        return next_rank, previous_rank
    return None, None


def check_order(lists: list[list[Step]]) -> None:
    """Raise ValueError unless every rank runs each F, B (and W) exactly once, F before B
    before W, with the right peers for where each virtual stage lives, and every channel
    (src -> dst, F or B, into one virtual stage) delivers its messages in the order dst runs
    them. Messages on two channels between the same two ranks may cross (under the V layout
    rank 0 sends rank 1 forwards of chunk 0 and gradients of chunk 1): ``p2p_plan`` posts
    both ends of every message in the same order, so none is taken for another."""
    chunks = 1 + max(step.chunk for steps in lists for step in steps)
    micro_batches = 1 + max(step.micro_batch for steps in lists for step in steps)
    holders = placement(lists)            # the layout, as the steps state it
    ops = (FORWARD, BACKWARD)
    if any(step.op == WEIGHT for steps in lists for step in steps):
        ops = (FORWARD, BACKWARD, WEIGHT)
    sent = {}                 # channel -> the messages in the order src sends them
    received = {}             # channel -> the messages in the order dst receives them
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
            if (step.recv_from, step.send_to) != peers(step, holders):
                raise ValueError(f"rank {rank} step {_label(step, chunks)} has the wrong peers: "
                                 f"{step}")
            if step.op != FORWARD:
                before = ops[ops.index(step.op) - 1]      # B needs its F, W its B
                if position[(before, step.chunk, step.micro_batch)] > index:
                    raise ValueError(f"rank {rank} runs {_label(step, chunks)} before "
                                     f"{before}{step.micro_batch} of the same chunk")
            if step.send_to is not None:
                outgoing = message(step, True)
                channel = (rank, step.send_to, outgoing[0], outgoing[2])
                sent.setdefault(channel, []).append(outgoing)
            if step.recv_from is not None:
                incoming = message(step, False)
                channel = (step.recv_from, rank, incoming[0], incoming[2])
                received.setdefault(channel, []).append(incoming)
    for channel in sorted(set(sent) | set(received)):
        source, destination, op, virtual_stage = channel
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
                raise ValueError(f"channel rank {source} -> rank {destination} ({op} into "
                                 f"virtual stage {virtual_stage}): message {n} sent is "
                                 f"{sent_as}, received as {received_as}")


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
                    incoming = message(step, False)
                    if incoming not in arrives:
                        break                            # its message is not sent yet
                    start = max(start, arrives[incoming])
                free_at[rank] = start + cost[step.op]
                timed[rank].append((start, free_at[rank], step))
                if step.send_to is not None:
                    arrives[message(step, True)] = free_at[rank]
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
    order cannot wait on each other in a cycle. Messages to oneself (p = 1; on the V, rank
    p-1's turn from piece p-1 to piece p) stay local."""
    stages = len(lists)
    timed = simulate(lists)
    rounds = [{} for _ in range(stages)]          # [rank][t]: what it sends and receives at t
    for rank, row in enumerate(timed):
        for _, end, step in row:
            if step.send_to is None or step.send_to == rank:
                continue                          # no message, or one to itself
            sent = message(step, True)
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
                n = where.get((kind, message(step, after_step)))
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
    chunks = chunks_per_rank(name, chunks)
    head = f"{name}, p={stages}, m={micro_batches}" + (f", v={chunks}" if chunks > 1 else "")
    timed = simulate(all_ranks(name, stages, micro_batches, chunks))
    return (f"{head}: idle {idle_shares(timed)[0]:.3f} of the pass (formula "
            f"{bubble_formula(name, stages, micro_batches, chunks):.3f}):\n"
            + format_timeline(timed))
