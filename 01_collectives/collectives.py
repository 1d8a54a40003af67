"""Stage 01: the collective operations, and a ring all-reduce built from sends and receives.

What it teaches
  Every collective that distributed training is made of, run on real processes: each rank
  prints its tensor before and after, and the result is checked against the exact value the
  collective promises. Then two compositions: a softmax over values held one per rank
  (all-reduce MAX, then SUM), and ``ring_all_reduce``, the bandwidth-optimal all-reduce,
  written from point-to-point sends and receives and checked against ``dist.all_reduce``.

How to run
  python 01_collectives/collectives.py --world-size 4
  torchrun --standalone --nproc-per-node=4 01_collectives/collectives.py

Copy ``ring_all_reduce`` into your own project with this file alone: the algorithm needs only
torch. The demo harness below it uses the repo's ``common`` package.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (one flat tensor in, one
# out) to *_single; same arguments. Use the new names where they exist.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

# --------------------------------------------------------------------------- ring all-reduce


def _peer(group, group_rank: int) -> int:
    """send/recv take global ranks; translate a rank within ``group``."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _grouped_p2p(group) -> bool:
    """Whether the ring must post each step's send and receive as one batch (NCCL does)."""
    return dist.get_backend(group) == "nccl"


# A step's chunk is sent in segments of this many elements (4 MiB of float32). Sent whole, a
# chunk must arrive completely before the addition starts, and the link idles while it runs;
# in segments, adding segment k overlaps receiving segment k+1: a pipeline, as NCCL's and
# Gloo's own rings are. Stage 02 on a 2-core CPU VM (2 ranks, 100 MB, float32): whole chunks
# 188 ms, segments of 1M floats 82 ms, Gloo's own all_reduce 85-89 ms.
SEGMENT_NUMEL = 1 << 20


def _exchange_segmented(right: int, left: int, group, segment_numel: int, like: torch.Tensor):
    """Gloo: send ``send_chunk`` to the right and receive from the left into (or add into)
    ``recv_chunk``, segment by segment. All sends are posted at once (every isend progresses
    on its own); receives that must be added land in two small buffers taken in turn, so
    segment k+1 is on its way while segment k is added. Extra memory: two segments."""
    spare = [torch.empty(min(segment_numel, like.numel()), dtype=like.dtype) for _ in range(2)]

    def exchange(send_chunk: torch.Tensor, recv_chunk: torch.Tensor, add: bool) -> None:
        # Empty chunks (a tensor smaller than the ring) are skipped; every rank computes the
        # same sizes, so sender and receiver skip together.
        sends = [dist.isend(seg, right, group) for seg in _segments(send_chunk, segment_numel)]
        targets = _segments(recv_chunk, segment_numel)
        if not add:  # all-gather: receive straight into place
            for request in [dist.irecv(seg, left, group) for seg in targets]:
                request.wait()
        else:
            def post(k: int):
                into = spare[k % 2][: targets[k].numel()]
                return dist.irecv(into, left, group), into
            pending = post(0) if targets else None
            for k in range(len(targets)):
                request, into = pending
                request.wait()
                if k + 1 < len(targets):
                    pending = post(k + 1)  # the next segment travels while we add this one
                targets[k].add_(into)
        for request in sends:
            request.wait()

    return exchange


def _exchange_grouped(right: int, left: int, group, incoming: torch.Tensor):
    """NCCL: each step's send and receive, whole chunks, posted together as one group.

    NCCL runs the sends and receives between two ranks in order on one stream, and a send
    blocks until the peer posts the matching receive. Posted one by one, each rank's receive
    waits behind its own send, which waits for the neighbour's receive, queued behind the
    neighbour's send (with 2 ranks, left == right): deadlock. batch_isend_irecv posts both
    as one NCCL group, progressed together. (NCCL pipelines inside the kernel itself.)"""

    def exchange(send_chunk: torch.Tensor, recv_chunk: torch.Tensor, add: bool) -> None:
        into = incoming[: recv_chunk.numel()] if add else recv_chunk
        ops = []
        if send_chunk.numel():
            ops.append(dist.P2POp(dist.isend, send_chunk, right, group))
        if into.numel():
            ops.append(dist.P2POp(dist.irecv, into, left, group))
        for request in dist.batch_isend_irecv(ops) if ops else []:
            request.wait()
        if add:
            recv_chunk.add_(into)

    return exchange


def _segments(chunk: torch.Tensor, segment_numel: int) -> tuple[torch.Tensor, ...]:
    return chunk.split(segment_numel) if chunk.numel() else ()


def ring_all_reduce(tensor: torch.Tensor, group=None,
                    segment_numel: int = SEGMENT_NUMEL) -> torch.Tensor:
    """Sum ``tensor`` over all ranks of ``group``, in place, like ``dist.all_reduce``.

    The n ranks stand in a ring; each sends only to its right neighbour and receives only
    from its left. The tensor is cut into n chunks (sizes differ by at most one element, so
    any size works, even one smaller than n).

    1. Reduce-scatter, n-1 steps. At step s, rank r sends chunk (r - s) mod n to the right
       and adds the chunk (r - s - 1) mod n that arrives from the left into its own. Each
       chunk travels once round the ring collecting every rank's addend, so after n-1 steps
       rank r holds the complete sum of chunk (r + 1) mod n.
    2. All-gather, n-1 steps. At step s, rank r sends chunk (r + 1 - s) mod n (complete) to
       the right and stores the complete chunk (r - s) mod n arriving from the left.

    Cost: 2(n-1) steps, each moving N/n elements per rank, so every rank sends
    2(n-1)/n * N elements in total. That is within a factor (n-1)/n of the lower bound for
    any all-reduce, independent of n, which is why NCCL and Gloo use rings for large tensors.
    The price is latency: 2(n-1) sequential message delays, which dominate for small tensors.

    Each step's chunk travels in segments of ``segment_numel`` elements, so that adding
    segment k overlaps with receiving segment k+1 (see ``_exchange_segmented``).

    Every rank ends with bitwise the same result: each complete chunk is summed on one rank
    and then copied, never re-summed in a different order.
    """
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return tensor
    if tensor.is_cuda and dist.get_backend(group) == "gloo":
        # Gloo's send/recv cannot read GPU memory ("writev: Bad address"); stage through host
        # memory, as Gloo's own all-reduce does internally for CUDA tensors.
        host = tensor.cpu()
        ring_all_reduce(host, group)
        return tensor.copy_(host)
    rank = dist.get_rank(group)
    right, left = _peer(group, (rank + 1) % world_size), _peer(group, (rank - 1) % world_size)

    # Work on a flat contiguous view (a copy only if the caller's tensor is not contiguous).
    work = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    chunks = torch.tensor_split(work, world_size)  # views into `work`
    if _grouped_p2p(group):
        exchange = _exchange_grouped(right, left, group, torch.empty_like(chunks[0]))
    else:
        exchange = _exchange_segmented(right, left, group, segment_numel, work)

    for step in range(world_size - 1):  # reduce-scatter: add what arrives into our chunk
        send_idx, recv_idx = (rank - step) % world_size, (rank - step - 1) % world_size
        exchange(chunks[send_idx], chunks[recv_idx], add=True)

    for step in range(world_size - 1):  # all-gather: store what arrives
        send_idx, recv_idx = (rank + 1 - step) % world_size, (rank - step) % world_size
        exchange(chunks[send_idx], chunks[recv_idx], add=False)

    if work.data_ptr() != tensor.data_ptr():
        tensor.copy_(work.view_as(tensor))
    return tensor


# --------------------------------------------------------------------------- distributed softmax


def distributed_softmax(x: torch.Tensor, group=None) -> torch.Tensor:
    """softmax over values spread across ranks (this rank holds ``x``, any shape).

    softmax(x)_i = exp(x_i - m) / sum_j exp(x_j - m), with m = max_j x_j for stability.
    Two all-reduces: MAX for m (every rank needs the global max), then SUM of the local
    exp-sums for the denominator. The result is this rank's share of the probabilities.
    """
    global_max = x.max().clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    numerator = torch.exp(x - global_max)
    denominator = numerator.sum()
    dist.all_reduce(denominator, op=dist.ReduceOp.SUM, group=group)
    return numerator / denominator


# --------------------------------------------------------------------------- demo harness
# Each demo prints every rank's tensor before and after, then asserts the exact result.


def _in_rank_order(ctx, line: str) -> None:
    """Print one line per rank, rank 0 first (a collective: every rank must call it).

    Each rank prints in turn between barriers; its write has reached the shared stdout
    before the next rank is let through, so the lines come out in rank order.
    """
    for turn in range(ctx.world_size):
        if turn == ctx.rank:
            ctx.print(line)
        dist.barrier()


def _show(ctx, name: str, before, after) -> None:
    fmt = lambda t: [x.tolist() for x in t] if isinstance(t, (list, tuple)) else t.tolist()
    _in_rank_order(ctx, f"{name:<24} before {fmt(before)!s:<28} after {fmt(after)}")


def _section(ctx, title: str, memory: str) -> None:
    dist.barrier()  # keep each collective's lines together in the output
    if ctx.is_main:
        print(f"\n== {title}  [memory: {memory}]", flush=True)
    dist.barrier()


def broadcast_demo(ctx, dev):
    _section(ctx, "broadcast(src=0): everyone gets rank 0's tensor", "in place, no extra")
    t = torch.tensor([ctx.rank * 10.0, ctx.rank * 10.0 + 1], device=dev)
    before = t.clone()
    dist.broadcast(t, src=0)
    _show(ctx, "broadcast", before, t)
    assert t.tolist() == [0.0, 1.0]


def reduce_demo(ctx, dev):
    _section(ctx, "reduce(dst=0, SUM): only rank 0 is promised the sum",
             "in place; other ranks' tensors may hold partial sums afterwards")
    t = torch.full((2,), float(ctx.rank + 1), device=dev)
    before = t.clone()
    dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)
    _show(ctx, "reduce", before, t)
    if ctx.rank == 0:
        n = ctx.world_size
        assert t.tolist() == [n * (n + 1) / 2] * 2


def all_reduce_demo(ctx, dev):
    _section(ctx, "all_reduce: every rank gets the reduction (SUM, MAX, MIN, PRODUCT)",
             "in place, no extra")
    n = ctx.world_size
    expected = {dist.ReduceOp.SUM: n * (n + 1) / 2, dist.ReduceOp.MAX: float(n),
                dist.ReduceOp.MIN: 1.0, dist.ReduceOp.PRODUCT: float(torch.arange(1, n + 1).prod())}
    for op, value in expected.items():
        t = torch.tensor([ctx.rank + 1.0], device=dev)
        before = t.clone()
        dist.all_reduce(t, op=op)
        _show(ctx, f"all_reduce({str(op).split('.')[-1]})", before, t)
        assert t.item() == value, (op, t.item(), value)


def all_gather_demo(ctx, dev):
    _section(ctx, "all_gather: every rank gets every rank's tensor",
             "output is world_size x the input on every rank")
    n = ctx.world_size
    t = torch.tensor([float(ctx.rank)] * 2, device=dev)
    out = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(out, t)
    _show(ctx, "all_gather (list)", t, out)
    assert [o.tolist() for o in out] == [[float(r)] * 2 for r in range(n)]
    flat = torch.empty(n * 2, device=dev)
    all_gather_single(flat, t)  # into one contiguous output, no list of tensors
    _show(ctx, "all_gather_single", t, flat)
    assert flat.tolist() == [float(r) for r in range(n) for _ in range(2)]


def gather_scatter_demo(ctx, dev):
    _section(ctx, "gather(dst=0) / scatter(src=0): many-to-one and one-to-many",
             "gather: world_size x input on dst only; scatter: world_size x output on src only")
    n = ctx.world_size
    t = torch.tensor([ctx.rank * 2.0], device=dev)
    gathered = [torch.empty_like(t) for _ in range(n)] if ctx.rank == 0 else None
    dist.gather(t, gather_list=gathered, dst=0)
    _show(ctx, "gather", t, gathered if gathered is not None else torch.tensor([]))
    if ctx.rank == 0:
        assert [g.item() for g in gathered] == [r * 2.0 for r in range(n)]
    out = torch.empty(1, device=dev)
    pieces = [torch.tensor([100.0 * r], device=dev) for r in range(n)] if ctx.rank == 0 else None
    dist.scatter(out, scatter_list=pieces, src=0)
    _show(ctx, "scatter", torch.tensor(pieces and [p.item() for p in pieces] or []), out)
    assert out.item() == 100.0 * ctx.rank


def reduce_scatter_demo(ctx, dev):
    _section(ctx, "reduce_scatter: rank r gets the sum over ranks of everyone's chunk r",
             "input world_size x output; half of an all-reduce")
    n = ctx.world_size
    # Rank q contributes chunk j = 10*q + j; rank r receives sum_q (10q + r) = 10*n(n-1)/2 + n*r.
    t = torch.tensor([10.0 * ctx.rank + j for j in range(n)], device=dev)
    out = torch.empty(1, device=dev)
    reduce_scatter_single(out, t)
    _show(ctx, "reduce_scatter_single", t, out)
    assert out.item() == 10.0 * n * (n - 1) / 2 + n * ctx.rank
    out_list = torch.empty(1, device=dev)
    dist.reduce_scatter(out_list, list(t.chunk(n)))
    assert out_list.item() == out.item()


def all_to_all_demo(ctx, dev):
    _section(ctx, "all_to_all: rank q's chunk j goes to rank j (a transpose across ranks)",
             "input and output both world_size chunks")
    n = ctx.world_size
    t = torch.tensor([10.0 * ctx.rank + j for j in range(n)], device=dev)
    out = torch.empty(n, device=dev)
    dist.all_to_all_single(out, t)
    _show(ctx, "all_to_all_single", t, out)
    assert out.tolist() == [10.0 * q + ctx.rank for q in range(n)]
    outs = [torch.empty(1, device=dev) for _ in range(n)]
    dist.all_to_all(outs, list(t.chunk(n)))
    assert [o.item() for o in outs] == out.tolist()


def barrier_demo(ctx, dev):
    import socket
    import time
    _section(ctx, "barrier: nobody leaves until everybody has arrived", "none")
    time.sleep(0.05 * ctx.rank)  # ranks arrive at different times
    arrived = time.time()
    dist.barrier()
    left = time.time()
    _in_rank_order(ctx, f"{'barrier':<24} arrived +{arrived % 10:.3f}s  left +{left % 10:.3f}s")
    # Check: every rank left after the last one arrived (wall clocks agree on one host).
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, (socket.gethostname(), arrived, left))
    if len({host for host, _, _ in everyone}) == 1:
        last_arrival = max(a for _, a, _ in everyone)
        assert all(l >= last_arrival - 1e-3 for _, _, l in everyone), everyone


def point_to_point_demo(ctx, dev):
    _section(ctx, "send/recv, isend/irecv, batch_isend_irecv: pass to the right neighbour",
             "one buffer per message")
    n, r = ctx.world_size, ctx.rank
    if n == 1:
        ctx.print("point-to-point needs 2 or more ranks; skipped")
        return
    right, left = (r + 1) % n, (r - 1) % n
    # Blocking send/recv round a ring: if everyone sent first, everyone could wait for a
    # receiver. Even ranks send then receive, odd ranks receive then send.
    mine, got = torch.tensor([float(r)], device=dev), torch.empty(1, device=dev)
    if r % 2 == 0:
        dist.send(mine, right)
        dist.recv(got, left)
    else:
        dist.recv(got, left)
        dist.send(mine, right)
    _show(ctx, "send/recv", mine, got)
    assert got.item() == float(left)
    # Non-blocking: post both, then wait; no ordering puzzle.
    got = torch.empty(1, device=dev)
    requests = [dist.isend(mine, right), dist.irecv(got, left)]
    for q in requests:
        q.wait()
    _show(ctx, "isend/irecv", mine, got)
    assert got.item() == float(left)
    # Batched: both directions at once (what pipeline parallelism does every step).
    from_left, from_right = torch.empty(1, device=dev), torch.empty(1, device=dev)
    ops = [dist.P2POp(dist.isend, mine, right), dist.P2POp(dist.isend, mine, left),
           dist.P2POp(dist.irecv, from_left, left), dist.P2POp(dist.irecv, from_right, right)]
    for q in dist.batch_isend_irecv(ops):
        q.wait()
    _show(ctx, "batch_isend_irecv", mine, torch.cat([from_left, from_right]))
    assert (from_left.item(), from_right.item()) == (float(left), float(right))


def subgroup_demo(ctx, dev):
    _section(ctx, "new_group: a collective among the even ranks only", "as the collective")
    evens = list(range(0, ctx.world_size, 2))
    group = dist.new_group(ranks=evens)  # every rank must call new_group, members or not
    t = torch.tensor([ctx.rank + 1.0], device=dev)
    before = t.clone()
    if ctx.rank in evens:
        dist.all_reduce(t, group=group)
        assert t.item() == sum(r + 1.0 for r in evens)
    _show(ctx, "all_reduce(even group)", before, t)
    if ctx.rank not in evens:
        assert t.item() == before.item()  # non-members are untouched
    dist.destroy_process_group(group)


def all_gather_object_demo(ctx, dev):
    _section(ctx, "all_gather_object: any picklable object (pickled into byte tensors)",
             "world_size x the pickled size; needs numpy")
    obj = {"rank": ctx.rank, "square": ctx.rank ** 2}
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    _in_rank_order(ctx, f"{'all_gather_object':<24} before {obj} after {out}")
    assert out == [{"rank": r, "square": r * r} for r in range(ctx.world_size)]


def softmax_demo(ctx, dev):
    _section(ctx, "distributed softmax: one value per rank, all_reduce MAX then SUM", "none")
    g = torch.Generator().manual_seed(1234)
    logits = torch.randn(ctx.world_size, generator=g, dtype=torch.float64) * 30  # large: max matters
    x = logits[ctx.rank : ctx.rank + 1].to(dev)
    p = distributed_softmax(x)
    expected = torch.softmax(logits, dim=0)[ctx.rank]
    _in_rank_order(ctx, f"{'softmax':<24} x={x.item():+.3f}  p={p.item():.6f}  reference={expected.item():.6f}")
    assert torch.allclose(p.cpu(), expected.reshape(1), rtol=1e-12, atol=1e-15), (p, expected)


def ring_all_reduce_demo(ctx, dev):
    _section(ctx, "ring_all_reduce (point-to-point) against dist.all_reduce",
             "in place plus two 4 MB receive segments")
    g = torch.Generator().manual_seed(100 + ctx.rank)  # different data on every rank
    for numel, dtype in [(1, torch.float32), (7, torch.float32), (1001, torch.float64),
                         (12345, torch.int64)]:
        if dtype.is_floating_point:
            x = torch.randn(numel, generator=g, dtype=dtype)
        else:
            x = torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)
        x = x.to(dev)
        ours, theirs = x.clone(), x.clone()
        ring_all_reduce(ours)
        dist.all_reduce(theirs)
        diff = (ours - theirs).abs().max().item()
        _in_rank_order(ctx, f"{'ring_all_reduce':<24} {numel:>6} x {str(dtype):<14} max |ring - all_reduce| = {diff:.2e}")
        if dtype.is_floating_point:  # the sums are added in a different order: close, not equal
            assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5), diff
        else:
            assert torch.equal(ours, theirs)
        # Bitwise identical on every rank.
        copies = [torch.empty_like(ours) for _ in range(ctx.world_size)]
        dist.all_gather(copies, ours)
        assert all(torch.equal(c, ours) for c in copies)


DEMOS = [broadcast_demo, reduce_demo, all_reduce_demo, all_gather_demo, gather_scatter_demo,
         reduce_scatter_demo, all_to_all_demo, barrier_demo, point_to_point_demo,
         subgroup_demo, all_gather_object_demo, softmax_demo, ring_all_reduce_demo]


def collectives_main(ctx) -> None:
    # NCCL moves only GPU tensors; Gloo supports every collective here on CPU tensors but only
    # a few on CUDA tensors, so under Gloo the demo keeps its tensors on the CPU.
    dev = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
    if ctx.is_main:
        print(f"world_size={ctx.world_size} backend={ctx.backend} tensors on {dev}", flush=True)
    for demo in DEMOS:
        demo(ctx, dev)
    dist.barrier()
    if ctx.is_main:
        print(f"\nall {len(DEMOS)} collective checks passed on {ctx.world_size} rank(s)", flush=True)


def main(argv=None) -> None:
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from common import launch

    parser = launch.make_parser(__doc__, world_size=4)
    args = parser.parse_args(argv)
    launch.launch(collectives_main, launch.resolve(args))


if __name__ == "__main__":
    main()
