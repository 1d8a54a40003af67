"""Stage 01: the collective operations, and a ring all-reduce built from sends and receives.

What it teaches
  How processes join a group (written out here; later stages get it from common/launch.py),
  then every collective distributed training is made of, on real processes, each checked
  against the exact value it promises. Then a softmax over values held one per rank, and the
  ring all-reduce from sends and receives: the textbook version, then the same ring made fast.

How to run: python 01_collectives/collectives.py --world-size 4
            torchrun --standalone --nproc-per-node=4 01_collectives/collectives.py
Copy ``ring_all_reduce`` (or ``pipelined_ring_all_reduce``) anywhere: it needs only torch.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# --------------------------------------------------------------------------- setup
# Every worker joins one process group before any collective; from stage 02 on
# common/launch.py does this, plus reporting which rank failed first and stopping cleanly.


def init_process(rank: int, world_size: int, backend: str, fn, *args) -> None:
    """A worker: join the group (meeting at MASTER_ADDR:MASTER_PORT), run ``fn``, leave."""
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))  # one GPU per rank
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))  # never wait forever
    try:
        fn(rank, world_size, backend, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size: int, backend: str, *args) -> None:
    """Start ``world_size`` workers on this machine. If one raises, the others are stopped
    and its traceback is raised here. (torchrun starts the workers itself instead.)"""
    with socket.socket() as s:  # a free port, so runs side by side never collide
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    mp.spawn(init_process, args=(world_size, backend, fn, *args), nprocs=world_size)


# --------------------------------------------------------------------------- ring all-reduce


def _peer(group, group_rank: int) -> int:  # send/recv take global ranks
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int, group) -> None:
    """Send to the right neighbour while receiving from the left one. Both are posted before
    either is waited on: had every rank first waited for its send to be received, every rank
    would be waiting and none receiving. Empty chunks are skipped by all ranks alike."""
    ops = ([dist.P2POp(dist.isend, send, right, group)] if send.numel() else []) + \
          ([dist.P2POp(dist.irecv, recv, left, group)] if recv.numel() else [])
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()


def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks of ``group``, in place, like ``dist.all_reduce``.

    The n ranks stand in a ring; each sends only to its right neighbour and receives only
    from its left. The tensor is cut into n chunks (sizes differ by at most one element).

    1. Reduce-scatter, n-1 steps. At step s, rank r sends chunk (r - s) mod n to the right
       and adds the chunk (r - s - 1) mod n arriving from the left into its own. Each chunk
       travels once round the ring collecting every rank's addend: after n-1 steps rank r
       holds the complete sum of chunk (r + 1) mod n.
    2. All-gather, n-1 steps. At step s, rank r sends the complete chunk (r + 1 - s) mod n
       to the right and stores the complete chunk (r - s) mod n arriving from the left.

    Each rank sends 2(n-1) chunks of N/n elements, 2(n-1)/n N in all: the least any
    all-reduce can send (bandwidth-optimal). The price is latency: 2(n-1) message delays one
    after another, which dominate small tensors. Each chunk is summed once and then copied,
    so every rank ends with bitwise the same result.
    (CPU tensors on Gloo, or NCCL; ``pipelined_ring_all_reduce`` also takes GPU tensors on Gloo.)
    """
    n = dist.get_world_size(group)
    if n == 1:
        return tensor
    rank = dist.get_rank(group)
    right, left = _peer(group, (rank + 1) % n), _peer(group, (rank - 1) % n)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    chunks = torch.tensor_split(flat, n)             # views into flat
    incoming = torch.empty_like(chunks[0])            # chunk 0 is the largest
    for step in range(n - 1):                         # 1. reduce-scatter
        send, recv = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
        _exchange(send, incoming[: recv.numel()], right, left, group)
        recv += incoming[: recv.numel()]
    for step in range(n - 1):                         # 2. all-gather
        send, recv = chunks[(rank + 1 - step) % n], chunks[(rank - step) % n]
        _exchange(send, recv, right, left, group)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor


# --------------------------------------------------------------------------- making it fast
# The textbook ring waits for a whole chunk before adding it, and the link idles while it
# adds. NCCL's and Gloo's own rings pipeline instead: each chunk travels in segments, and
# adding segment k overlaps receiving segment k+1. Stage 02 times both rings beside
# dist.all_reduce (the 01 README shows the figures).

SEGMENT_NUMEL = 1 << 20  # elements per segment (4 MiB of float32)


def _segmented_exchange(send, recv, add: bool, right, left, group, segment_numel, spare):
    """Gloo: all sends posted at once (each progresses on its own); receives that must be
    added land in two small buffers taken in turn, so segment k+1 is on its way while
    segment k is added. Extra memory: two segments, not a whole chunk."""
    sends = [dist.isend(seg, right, group) for seg in send.split(segment_numel)] \
        if send.numel() else []
    targets = recv.split(segment_numel) if recv.numel() else ()
    if not add:  # all-gather: receive straight into place
        for request in [dist.irecv(seg, left, group) for seg in targets]:
            request.wait()
    else:
        def post(k):
            into = spare[k % 2][: targets[k].numel()]
            return dist.irecv(into, left, group), into
        pending = post(0) if targets else None
        for k in range(len(targets)):
            request, into = pending
            request.wait()
            if k + 1 < len(targets):
                pending = post(k + 1)  # the next segment travels while this one is added
            targets[k].add_(into)
    for request in sends:
        request.wait()


def pipelined_ring_all_reduce(tensor: torch.Tensor, group=None,
                              segment_numel: int = SEGMENT_NUMEL) -> torch.Tensor:
    """``ring_all_reduce``'s algorithm, step for step, with three changes for speed:

    * Gloo: each step's chunk moves in segments of ``segment_numel``, pipelined as above;
    * NCCL: whole chunks, one grouped send+receive per step (NCCL pipelines inside its
      kernel, and orders a rank's sends and receives on one stream: ungrouped, two ranks
      each sending first would wait for each other forever);
    * GPU tensors on Gloo go through host memory (Gloo's send/recv cannot read GPU memory),
      as Gloo's own all-reduce does for them.
    """
    n = dist.get_world_size(group)
    if n == 1:
        return tensor
    if tensor.is_cuda and dist.get_backend(group) == "gloo":
        host = tensor.cpu()
        pipelined_ring_all_reduce(host, group, segment_numel)
        return tensor.copy_(host)
    rank = dist.get_rank(group)
    right, left = _peer(group, (rank + 1) % n), _peer(group, (rank - 1) % n)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    chunks = torch.tensor_split(flat, n)
    nccl = dist.get_backend(group) == "nccl"
    incoming = torch.empty_like(chunks[0]) if nccl else None
    spare = None if nccl else [torch.empty(min(segment_numel, chunks[0].numel()),
                                           dtype=flat.dtype) for _ in range(2)]

    def exchange(send, recv, add):
        if nccl:  # the textbook exchange, whole chunks, grouped
            into = incoming[: recv.numel()] if add else recv
            _exchange(send, into, right, left, group)
            if add:
                recv += into
        else:
            _segmented_exchange(send, recv, add, right, left, group, segment_numel, spare)

    for step in range(n - 1):
        exchange(chunks[(rank - step) % n], chunks[(rank - step - 1) % n], add=True)
    for step in range(n - 1):
        exchange(chunks[(rank + 1 - step) % n], chunks[(rank - step) % n], add=False)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor


# --------------------------------------------------------------------------- distributed softmax


def distributed_softmax(x: torch.Tensor, group=None) -> torch.Tensor:
    """softmax over values spread across ranks (this rank holds ``x``, any shape).

    softmax(x)_i = exp(x_i - m) / sum_j exp(x_j - m), with m = max_j x_j for stability:
    an all-reduce MAX for m, then an all-reduce SUM of the local sums for the denominator.
    """
    global_max = x.max().clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    numerator = torch.exp(x - global_max)
    denominator = numerator.sum()
    dist.all_reduce(denominator, op=dist.ReduceOp.SUM, group=group)
    return numerator / denominator


# --------------------------------------------------------------------------- harness
# Each collective: every rank's tensor before -> after on one line (rank 0), the memory it
# needs, and a check of the exact result on every rank. The checks are agreed: if any rank
# got a wrong result, every rank raises, naming the ranks, what they got and by how much (a
# rank that raised alone would leave the others waiting in the next collective).


def _text(t) -> str:
    if isinstance(t, (list, tuple)):
        return "[" + ",".join(_text(x) for x in t) + "]"
    return "-" if t is None else ",".join(f"{v:g}" for v in t.flatten().tolist())


def _wrong(got: list[float], want: list[float]) -> str | None:
    """None when ``got`` is exactly ``want``; else both, and the largest difference."""
    if got == want:
        return None
    if len(got) != len(want):
        return f"got {got}, want {want}"
    off = max(abs(a - b) for a, b in zip(got, want))
    return f"got {got}, want {want} (off by up to {off:g})"


def _agree(world_size: int, what: str, problem: str | None) -> None:
    """Every rank's verdict on one check, gathered: all raise if any failed, or none does."""
    everyone = [None] * world_size
    dist.all_gather_object(everyone, problem)
    failed = [f"rank {q}: {p}" for q, p in enumerate(everyone) if p is not None]
    if failed:
        raise AssertionError(f"{what}: " + "; ".join(failed))


def _show(rank, world_size, name, before, after, memory, problem):
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (_text(before), _text(after)))
    if rank == 0:
        print(f"{name:<25} {memory:<46} {' '.join(b for b, _ in everyone)} -> "
              f"{' '.join(a for _, a in everyone)}", flush=True)
    _agree(world_size, name, problem)


def collectives_demo(rank: int, world_size: int, backend: str, device: str = "cpu",
                     sends_on_device: bool = True) -> None:
    n = world_size
    r = rank
    # NCCL moves GPU tensors only; Gloo moves CPU tensors, and GPU tensors for every collective
    # here, but its sends and receives read host memory only (``sends_on_device`` False:
    # common/launch.py's carries_point_to_point), so there they go through the host.
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else \
        torch.device("cpu")
    p2p = dev if sends_on_device else torch.device("cpu")

    def floats(*values, where=dev):  # a float32 tensor of these values, on ``where``
        return torch.tensor(values, dtype=torch.float32, device=where)

    if r == 0:
        hosted = "" if p2p == dev else " (sends and receives on the host: Gloo cannot send GPU memory)"
        print(f"{n} ranks, {backend}, tensors on {dev}{hosted}\n{'collective':<25} "
              f"{'memory':<46} every rank's tensor before -> after", flush=True)

    t = floats(10.0 * r)
    before = t.clone()
    dist.broadcast(t, src=0)
    _show(r, n, "broadcast(src=0)", before, t, "in place", _wrong(t.tolist(), [0.0]))

    t = floats(r + 1.0)
    before = t.clone()
    dist.reduce(t, dst=0)
    problem = _wrong(t.tolist(), [n * (n + 1) / 2]) if r == 0 else None  # only dst is promised
    _show(r, n, "reduce(dst=0, SUM)", before, t if r == 0 else None,
          "in place; others' tensors undefined", problem)

    for op, want in [(dist.ReduceOp.SUM, n * (n + 1) / 2), (dist.ReduceOp.MAX, n),
                     (dist.ReduceOp.PRODUCT, float(torch.arange(1, n + 1).prod()))]:
        t = floats(r + 1.0)
        before = t.clone()
        dist.all_reduce(t, op=op)
        _show(r, n, f"all_reduce({str(op).split('.')[-1]})", before, t, "in place",
              _wrong(t.tolist(), [want]))

    t = floats(r)
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t)
    _show(r, n, "all_gather", t, parts, "output: world_size x input, everywhere",
          _wrong([p.item() for p in parts], list(range(n))))
    t = floats(r)
    flat = torch.empty(n, device=t.device)
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(flat, t)  # 2.13's name
    _show(r, n, "all_gather (one tensor)", t, flat, "same, one contiguous output",
          _wrong(flat.tolist(), list(range(n))))

    t = floats(r * 2.0)
    parts = [torch.empty_like(t) for _ in range(n)] if r == 0 else None
    dist.gather(t, gather_list=parts, dst=0)
    problem = _wrong([p.item() for p in parts], [2.0 * q for q in range(n)]) if r == 0 else None
    _show(r, n, "gather(dst=0)", t, parts, "world_size x input on dst only", problem)

    pieces = [floats(100.0 * q) for q in range(n)] if r == 0 else None
    t = torch.empty(1, device=dev)
    dist.scatter(t, scatter_list=pieces, src=0)
    _show(r, n, "scatter(src=0)", pieces, t, "world_size x output on src only",
          _wrong(t.tolist(), [100.0 * r]))

    t = floats(*[10.0 * r + j for j in range(n)])
    out = torch.empty(1, device=t.device)
    getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, t)  # (older too)
    _show(r, n, "reduce_scatter", t, out, "input world_size x output; half an all-reduce",
          _wrong(out.tolist(), [10.0 * n * (n - 1) / 2 + n * r]))  # sum over q of 10q + r

    out = torch.empty(n, device=t.device)
    dist.all_to_all_single(out, t)
    _show(r, n, "all_to_all", t, out, "a transpose across ranks; in and out same size",
          _wrong(out.tolist(), [10.0 * q + r for q in range(n)]))  # rank q's chunk r comes to r

    dist.barrier()  # nobody leaves until everybody has arrived

    if n > 1:
        right = (r + 1) % n
        left = (r - 1) % n
        got = torch.empty(1, device=p2p)
        if r % 2 == 0:  # blocking calls round a ring: half send first, half receive first
            dist.send(floats(r, where=p2p), right)
            dist.recv(got, left)
        else:
            dist.recv(got, left)
            dist.send(floats(r, where=p2p), right)
        _show(r, n, "send/recv (to the right)", floats(r), got, "one buffer per message",
              _wrong(got.tolist(), [left]))
        got = torch.empty(1, device=p2p)
        for req in [dist.isend(floats(r, where=p2p), right), dist.irecv(got, left)]:  # post both,
            req.wait()                                                                # then wait
        _show(r, n, "isend/irecv", floats(r), got, "one buffer per message",
              _wrong(got.tolist(), [left]))

    evens = list(range(0, n, 2))
    group = dist.new_group(ranks=evens)  # every rank calls new_group, member or not
    t = floats(r + 1.0)
    before = t.clone()
    if r in evens:
        dist.all_reduce(t, group=group)
    want = sum(q + 1.0 for q in evens) if r in evens else r + 1.0
    _show(r, n, "all_reduce(even ranks)", before, t, "non-members untouched",
          _wrong(t.tolist(), [want]))
    dist.destroy_process_group(group)

    objects = [None] * n
    dist.all_gather_object(objects, {"rank": r})  # pickled into byte tensors (needs numpy)
    want = [{"rank": q} for q in range(n)]
    _agree(n, "all_gather_object", None if objects == want else f"got {objects}, want {want}")

    g = torch.Generator().manual_seed(1234)
    logits = torch.randn(n, generator=g, dtype=torch.float64) * 30  # large: the max matters
    p = distributed_softmax(logits[r:r + 1].to(dev))
    want = torch.softmax(logits, 0)[r:r + 1]
    problem = None
    if not torch.allclose(p.cpu(), want, rtol=1e-12, atol=1e-15):
        off = (p.cpu() - want).abs().item()
        problem = f"got {p.item():.17g}, want {want.item():.17g} (off by {off:.3g})"
    _show(r, n, "softmax over ranks", logits[r:r + 1], p, "two scalar all-reduces", problem)

    g = torch.Generator().manual_seed(100 + r)  # different data on every rank
    problems = []
    for ring in (ring_all_reduce, pipelined_ring_all_reduce):
        for numel, dtype in [(1, torch.float32), (7, torch.float64), (12345, torch.int64)]:
            where = p2p if ring is ring_all_reduce else dev  # the pipelined ring hosts itself
            x = torch.randint(-1000, 1000, (numel,), generator=g).to(dtype=dtype, device=where)
            ours = ring(x.clone())
            theirs = x.clone()
            dist.all_reduce(theirs)  # small integers: exact in any order, so bitwise equal to
            if not torch.equal(ours, theirs):  # the backend's sum, and the same on every rank
                differ = ours != theirs
                problems.append(f"{ring.__name__} on {numel} {dtype}: {int(differ.sum())} of "
                                f"{numel} elements differ from dist.all_reduce, max |diff| "
                                f"{(ours - theirs).abs().max().item():g}")
    _agree(n, "rings against dist.all_reduce", "; ".join(problems) if problems else None)
    if r == 0:
        print(f"ring_all_reduce and pipelined_ring_all_reduce equal dist.all_reduce exactly on "
              f"1, 7 and 12345 elements (float32, float64, int64) on every rank\n"
              f"all collective checks passed on {n} rank(s)", flush=True)


def main(argv=None) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
    try:
        from common import launch  # flags only: the setup is written out at the top
    except ImportError:  # copied alone: the algorithm above needs torch only
        raise SystemExit(f"{__file__}: this demo needs the repository (common/)")

    args = launch.make_parser(__doc__, world_size=4).parse_args(argv)
    config = launch.resolve(args)
    sends_on_device = launch.carries_point_to_point(config.backend, config.device)
    if launch.under_torchrun():  # torchrun started this process as one rank
        init_process(int(os.environ["RANK"]), config.world_size, config.backend,
                     collectives_demo, config.device, sends_on_device)
    else:
        spawn(collectives_demo, config.world_size, config.backend, config.device, sends_on_device)


if __name__ == "__main__":
    main()
