"""Starting workers: stage 01's ten lines, made safe for every later stage.

``launch(worker, config, *args)`` runs ``worker(ctx, *args)`` on every rank, inside a process
group: in processes started here (forked from a server that imported torch once) meeting on
loopback, or in this very process under torchrun. Nothing hangs and nothing is silent: a rank
that raises, dies or stalls ends the run and is named; Ctrl-C or SIGTERM to the parent stops
every worker (one line, no tracebacks); a worker whose parent died exits; collectives time out (``DIST_TIMEOUT_S``, default 300 s), and
a rank still waiting for its peers after a few seconds says what for; bad flags, bad
environment variables and runs that cannot fit in memory are one line and exit status 2 before
any worker starts; ``python script.py | head -1`` ends quietly, as any Unix tool does.
"""

import argparse
import datetime
import errno
import gc
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing import reduction
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    """Who this worker is. ``device`` is where its tensors live (cuda:LOCAL_RANK or cpu)."""
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def print(self, *parts, all_ranks: bool = True) -> None:
        """print() prefixed with the rank, one write per line so ranks never interleave."""
        if all_ranks or self.is_main:
            sys.stdout.write(" ".join([f"[rank {self.rank}]", *map(str, parts)]) + "\n")
            sys.stdout.flush()


@dataclass(frozen=True)
class LaunchConfig:
    world_size: int
    backend: str
    device: str  # "cpu" or "cuda"


class Stopped(SystemExit):
    """Ctrl-C or SIGTERM stopped the workers (exit 128 + signal); a benchmark may catch it to
    report what finished, then re-raise it."""


# --------------------------------------------------------------------------- flags
class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit status 2."""

    def error(self, message: str):  # noqa: D401 - argparse's API
        usage_error(message, prog=self.prog)


def usage_error(message: str, prog: str | None = None) -> None:
    print(f"{prog or os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _number(kind, lowest, what: str):
    """A flag type for a ``kind`` >= ``lowest`` that also refuses NaN and infinities, so no flag
    can switch a check off by accident (argparse turns the ArgumentTypeError into one line)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = float("nan")
        if not math.isfinite(value) or value < lowest:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


def list_of(item, allowed=None):
    """A flag type: a non-empty comma-separated list of ``item`` values (of names in ``allowed``
    when given), duplicates dropped."""
    def parse(text: str) -> list:
        values = [s.strip() for s in text.split(",") if s.strip()]
        wrong = [v for v in values if v not in allowed] if allowed else []
        if allowed and (wrong or not values):  # '' too: a list that would check nothing
            raise argparse.ArgumentTypeError(f"{(wrong or [text])[0]!r} is not allowed: give a "
                                             f"comma-separated subset of {', '.join(allowed)}")
        if not values:
            raise argparse.ArgumentTypeError("empty list: give comma-separated values, e.g. 1,2,4")
        return list(dict.fromkeys(map(item, values)))
    parse.__name__ = "list"  # argparse names the type in its own messages
    return parse


def choice_list(allowed):
    """A flag type: a non-empty comma-separated subset of ``allowed``."""
    return list_of(str, allowed)


positive_int = _number(int, 1, "a whole number >= 1")
non_negative_int = _number(int, 0, "a whole number >= 0")
positive_float = _number(float, math.nextafter(0.0, 1.0), "a finite number > 0")  # 0 excluded
int_list = list_of(positive_int)  # '1,2,4' -> [1, 2, 4]


def make_parser(doc: str | None, world_size: int = 2) -> Parser:
    """A parser with the flags every stage shares: --world-size, --backend, --device."""
    parser = Parser(description=(doc or "").strip().split("\n")[0],
                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--world-size", type=positive_int, default=world_size,
                        help="worker processes to spawn here (under torchrun: WORLD_SIZE)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                        help="process-group backend; default: nccl with a GPU per rank, else gloo")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="where tensors live; default: cuda when there is a GPU, else cpu")
    return parser


# --------------------------------------------------------------------------- environment
# The variables a run reads, each checked for the range it really works in before any worker
# starts, so a bad one is one line and exit 2, never a worker's traceback half way.
MAX_TIMEOUT_S = 7 * 24 * 3600  # a week; torch's deadlines overflow somewhere past 1e9 s


def timeout_s() -> float:
    """How long the rendezvous and each collective wait for a peer: ``DIST_TIMEOUT_S``, default
    300 s, from 0.001 (torch counts whole milliseconds: less is an instant timeout) to a week."""
    text = os.environ.get("DIST_TIMEOUT_S", "300")
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.001 <= value <= MAX_TIMEOUT_S:  # NaN fails this too
        usage_error(f"DIST_TIMEOUT_S={text!r}: give the seconds a rank waits for its peers, "
                    f"from 0.001 to {MAX_TIMEOUT_S} (a week)")
    return value


def master_addr() -> str:
    """Where the ranks meet: ``MASTER_ADDR`` (unset or empty: 127.0.0.1), which must resolve."""
    addr = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    try:
        socket.getaddrinfo(addr, None)
    except (OSError, UnicodeError) as e:
        usage_error(f"MASTER_ADDR={addr!r} does not resolve ({e}); give a host name or an IP "
                    "address of the machine where rank 0 runs")
    return addr


def master_port() -> int | None:
    """``MASTER_PORT``: a TCP port from 1 to 65535; None when unset or empty (pick a free one)."""
    text = os.environ.get("MASTER_PORT", "").strip()
    if not text:
        return None
    if not (text.isdecimal() and 1 <= int(text) <= 65535):
        usage_error(f"MASTER_PORT={text!r}: give a TCP port from 1 to 65535, or leave it unset "
                    "(a free port is picked)")
    return int(text)


def check_environment() -> None:
    """Every environment variable a run reads, checked up front (one line, exit 2)."""
    timeout_s()
    master_addr()
    master_port()
    from common import results  # a late import: results imports this module
    results.check_folder()  # RESULTS_DIR set but empty, a folder where a results file goes


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def ranks_on_this_node(world_size: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if under_torchrun() else world_size


def resolve(args: argparse.Namespace) -> LaunchConfig:
    """Check the common flags and fill in the machine's defaults. CPU only: gloo/cpu. Fewer
    GPUs than ranks here (one GPU, say): the ranks share them over Gloo, since NCCL refuses two
    ranks on one GPU ("Duplicate GPU detected"). A GPU per rank: nccl/cuda."""
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.world_size
    ranks_here = ranks_on_this_node(world_size)
    check_environment()  # DIST_TIMEOUT_S, MASTER_ADDR/PORT, RESULTS_DIR: before any worker
    if not under_torchrun():
        check_ranks_fit(ranks_here)
    n_gpus = torch.cuda.device_count()
    device = args.device or ("cuda" if n_gpus > 0 else "cpu")
    backend = args.backend or ("nccl" if device == "cuda" and n_gpus >= ranks_here else "gloo")
    if device == "cuda" and n_gpus == 0:
        usage_error("--device cuda needs a GPU and none is visible; use --device cpu")
    if backend == "nccl" and (n_gpus < ranks_here or not dist.is_nccl_available()):
        usage_error(f"--backend nccl needs NCCL and one GPU per rank: {ranks_here} ranks here, "
                    f"{n_gpus} GPU(s); use --backend gloo (ranks may share a GPU over Gloo)")
    if backend == "nccl" and device != "cuda":
        usage_error("--backend nccl needs --device cuda (NCCL moves GPU memory only)")
    return LaunchConfig(world_size=world_size, backend=backend, device=device)


# --------------------------------------------------------------------------- what fits
# Host memory is checked before workers start: a run that cannot fit is refused with one line
# (exit 2) instead of an out-of-memory kill half way.

GIB = 2 ** 30


def host_available_bytes() -> int:
    """Host memory a new allocation can still get: Linux's MemAvailable, else free pages."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def rank_baseline_bytes() -> int:
    """What one rank costs before any model: this process's resident memory (a worker imports
    the same torch), plus 64 MiB for its process group and buffers."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") + (64 << 20)
    except (OSError, ValueError, IndexError):
        return 512 << 20


def check_ranks_fit(ranks_here: int, per_rank_bytes: int = 0, what: str = "") -> None:
    """One-line usage error when ``ranks_here`` workers (each its baseline plus
    ``per_rank_bytes``, described by ``what``) would not fit in host memory."""
    baseline = rank_baseline_bytes()
    need, have = ranks_here * (baseline + per_rank_bytes), int(0.9 * host_available_bytes())
    if need > have:
        usage_error(f"{ranks_here} ranks need about {need / GIB:.1f} GiB of host memory "
                    f"({baseline / 2**20:.0f} MiB each to start{', plus ' + what if what else ''})"
                    f" but {have / GIB:.1f} GiB is available; use a smaller --world-size"
                    + (" or size" if what else ""))


# --------------------------------------------------------------------------- workers
def rendezvous_timeout() -> datetime.timedelta:
    """``DIST_TIMEOUT_S`` as a timedelta (``launch`` has a parameter named ``timeout_s``)."""
    return datetime.timedelta(seconds=timeout_s())


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it), so parallel runs never collide."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WAIT_NOTE_S = 10  # a rank still joining after this long says what it waits for


def _say_what_we_wait_for(rank: int, world_size: int, waited_s: float, wait_s: float) -> None:
    print(f"[rank {rank}] still waiting, after {waited_s:g} s, for the other {world_size - 1} "
          f"rank(s) to join the process group at {os.environ.get('MASTER_ADDR')}:"
          f"{os.environ.get('MASTER_PORT')} (rank 0 listens there); torch's limit for this "
          f"wait is DIST_TIMEOUT_S = {wait_s:g} s", file=sys.stderr, flush=True)


def _run_worker(worker, rank, world_size, local_rank, backend, device, args, on_error=None):
    dev = torch.device("cuda", local_rank % torch.cuda.device_count()) \
        if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    wait_s = timeout_s()
    # Joining waits silently for every peer (an unreachable MASTER_ADDR: DIST_TIMEOUT_S long),
    # so a rank not in after a few seconds says, once, what it waits for and for how long.
    waited_s = min(WAIT_NOTE_S, wait_s / 2)
    note = threading.Timer(waited_s, _say_what_we_wait_for, (rank, world_size, waited_s, wait_s))
    note.daemon = True
    try:  # joining can fail too (a port taken, a peer gone): recorded like any failure
        note.start()
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size,  # env://
                                timeout=datetime.timedelta(seconds=wait_s),
                                **({"device_id": dev} if backend == "nccl" else {}))
        note.cancel()
        return worker(Dist(rank, world_size, local_rank, backend, dev), *args)
    except BaseException:
        note.cancel()
        if on_error is not None:
            on_error()
        raise
    finally:
        if dist.is_initialized():
            # Collect what still holds the group's work first (torch's fully_shard leaves
            # cycles): torn down later, during interpreter exit, it can abort the process.
            gc.collect()
            dist.destroy_process_group()


def _rank_processes():
    """Where the ranks come from: a fork server that imported torch once. ``import torch``
    costs seconds of CPU on a small box, and spawned ranks paid it each; a child forked from
    the server starts with torch loaded (the next launch reuses the server). The server never
    runs a tensor op (a fork after one can deadlock in OpenMP) and never touches CUDA, so the
    ranks may. It was started by the first launch of this process, with that moment's
    environment and standard streams. Each rank takes the current ones when it starts its job
    (``_Streams``, ``environ``) and a seed of its own for torch's generator (``_rank_entry``),
    as a spawned rank has. What stays the server's: the variables torch reads when imported
    (``TORCH_DISTRIBUTED_DEBUG``, say: set them before the first launch, as a script does),
    Python's hash seed, and the streams a rank has while it imports the script's ``__main__``."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")  # Windows: no fork at all
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed"])
    return context


class _Streams:
    """This launcher's stdout and stderr, sent to a rank as file descriptors when it starts
    (pickled with the rank's arguments; ``DupFd`` is multiprocessing's way to pass an fd)."""

    def __reduce__(self):
        return (_take_streams, (reduction.DupFd(1), reduction.DupFd(2)))


def _take_streams(stdout, stderr) -> None:
    for wrapped, target in ((stdout, 1), (stderr, 2)):
        fd = wrapped.detach()
        os.dup2(fd, target)
        os.close(fd)


def _rank_entry(rank, worker, world_size, backend, device, addr, port, args, error_dir,
                server_dir, environ, streams, parent_holds_store):
    # ``streams`` did its work already: unpickling it moved the launcher's stdout and stderr
    # onto this rank's (``_Streams``).
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    os.environ.clear()
    os.environ.update(environ)  # the launcher's, now (the fork server's is from its start)
    torch.seed()  # forked ranks would all share the server's generator state

    def exit_when_orphaned():  # the launcher died, even by SIGKILL: its end of a pipe closed
        multiprocessing.parent_process().join()
        # What the launcher would have removed on its way out: its failure records, and the
        # folder of the fork server's socket.
        shutil.rmtree(error_dir, ignore_errors=True)
        shutil.rmtree(server_dir, ignore_errors=True)
        os._exit(1)
    threading.Thread(target=exit_when_orphaned, daemon=True).start()
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank),  # as torchrun
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    if parent_holds_store:  # every rank joins the parent's store as a client (see launch)
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    # Share the cores, as torchrun does: oversubscribed ranks would time each other's contention.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))

    def record_failure():
        # A failure makes the peers fail moments later ("connection closed by peer"): record
        # when each failed, so the parent can name the first. Renamed into place.
        error = sys.exc_info()[1]
        text = (f"exited with status {error.code} (its own checks failed: see its output)\n"
                if isinstance(error, SystemExit) else traceback.format_exc())
        if isinstance(error, BrokenPipeError) and output_reader_gone():
            text = READER_GONE  # `| head -1` has its line: not a failure of this rank
            discard_output()  # else exiting would flush into the closed pipe and complain
        path = os.path.join(error_dir, f"rank{rank}.err")
        with open(path + ".tmp", "w") as f:
            f.write(f"{time.time()!r}\n{text}")
        os.replace(path + ".tmp", path)

    code = 0
    try:
        _run_worker(worker, rank, world_size, rank, backend, device, args, record_failure)
    except SystemExit as stop:
        code = 1
        if stop.code == 2:
            code = 2  # bad input the ranks found, said in one line
    except BaseException:
        code = 1  # quietly: the parent prints the first failure, once
    _leave(code)


def _leave(code: int) -> None:
    """End a started rank without the interpreter's teardown: with torch loaded it costs a
    second or more of CPU per rank (and torch's destructors have aborted a rank there). What
    the rank wrote is closed by now; only the standard streams still need flushing."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a reader that went away (| head -1), or a stream already closed
    os._exit(code)


def launch(worker, config: LaunchConfig, *args, timeout_s: float | None = None) -> None:
    """Run ``worker(ctx, *args)`` on every rank: in this process under torchrun, else in
    ``config.world_size`` processes started and supervised here; ``timeout_s`` bounds the
    run."""
    if under_torchrun():
        _run_worker(worker, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                    int(os.environ["LOCAL_RANK"]), config.backend, config.device, args)
        return
    addr = master_addr()
    port = master_port()
    store = None
    if port is None:
        # This process holds the ranks' rendezvous store, on a port the OS picks and keeps for
        # it: a port merely seen free could be taken by another process before rank 0 binds it.
        # The ranks join the store as clients, as they do under torchrun's agent.
        store = dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False,
                              timeout=rendezvous_timeout())
        port = store.port
    error_dir = tempfile.mkdtemp(prefix="launch-errors-")
    # daemon: the workers die with this process; so a worker cannot start processes of its
    # own (a DataLoader with num_workers > 0 would fail)
    context = _rank_processes()
    server_dir = multiprocessing.util.get_temp_dir()  # where the fork server's socket lives
    streams = None  # a spawned rank inherits this process's streams as they are now
    if context.get_start_method() == "forkserver":
        streams = _Streams()
    processes = []
    for rank in range(config.world_size):
        rank_args = (rank, worker, config.world_size, config.backend, config.device, addr, port,
                     args, error_dir, server_dir, dict(os.environ), streams,
                     store is not None)
        processes.append(context.Process(target=_rank_entry, args=rank_args, daemon=True))
    stop = {"signum": None}  # SIGINT / SIGTERM set it; the supervisor acts on it
    on_main_thread = threading.current_thread() is threading.main_thread()
    old = {s: signal.signal(s, lambda signum, _: stop.update(signum=signum))
           for s in (signal.SIGINT, signal.SIGTERM)} if on_main_thread else {}
    try:
        for p in processes:
            p.start()
        _supervise(processes, timeout_s, error_dir, stop)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        _kill(processes)
        shutil.rmtree(error_dir, ignore_errors=True)


def _kill(processes) -> None:
    # Only those started: when a start() raises (a script without the `if __name__ ==
    # "__main__":` guard, say), joining one never started would hide that error.
    started = [p for p in processes if p.pid is not None]
    for p in started:
        if p.is_alive():
            p.kill()  # SIGKILL: also ends a rank that is stopped (SIGSTOP) or stuck in C++
        elif p.exitcode == 255:
            # 255 is also what a dead fork server (the OOM killer's pick?) reports for ranks
            # that may still run: end them by pid, or they would outlive this launch.
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in started:
        p.join(timeout=5)


def _stopped(pid: int) -> bool:
    """Whether Linux says the process is stopped (SIGSTOP): state T in /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def _supervise(processes, timeout_s, error_dir: str, stop: dict) -> None:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        codes = [p.exitcode for p in processes]  # read once: every decision below uses them
        if all(c == 0 for c in codes):
            return
        stalled = [r for r, p in enumerate(processes) if codes[r] is None and _stopped(p.pid)]
        if stop["signum"] is not None:
            _kill(processes)
            print(f"stopped by {signal.Signals(stop['signum']).name}: all {len(processes)} ranks "
                  "ended; results written before this point are kept", file=sys.stderr, flush=True)
            raise Stopped(128 + stop["signum"])
        if any(c not in (None, 0) for c in codes):
            _kill(processes)
            if _reader_left(error_dir):  # our own output went too: stop as quietly
                raise BrokenPipeError(errno.EPIPE, "the reader of this output has exited")
            if _refused_bad_input(error_dir):
                raise SystemExit(2)  # e.g. a damaged checkpoint: a rank said why, in one line
            _report_failure(codes, error_dir, stalled)
            raise SystemExit(1)
        if deadline is not None and time.monotonic() > deadline:
            _kill(processes)
            print(f"error: run exceeded its {timeout_s:.0f}s limit; all ranks killed"
                  + (f" (rank(s) {stalled} were stopped by a signal)" if stalled else ""),
                  file=sys.stderr, flush=True)
            raise SystemExit(1)
        multiprocessing.connection.wait([p.sentinel for p in processes if p.exitcode is None],
                                        timeout=0.5)


def _reader_left(error_dir: str) -> bool:
    """Whether a rank stopped because the reader of the output went away (``| head -1``)."""
    return any(Path(error_dir, name).read_text().partition("\n")[2] == READER_GONE
               for name in os.listdir(error_dir) if name.endswith(".err"))


def _refused_bad_input(error_dir: str) -> bool:
    """Whether every rank that failed exited with status 2: bad input only the ranks could see
    (a damaged checkpoint, say), refused like a bad flag, its one line printed by a rank."""
    texts = [Path(error_dir, name).read_text() for name in os.listdir(error_dir)
             if name.endswith(".err")]
    refusals = [text for text in texts if text.partition("\n")[2].startswith("exited with status 2 ")]
    return len(texts) > 0 and len(refusals) == len(texts)


def _report_failure(codes: list, error_dir: str, stalled: list[int]) -> None:
    """Print the root cause: ranks killed by a signal or gone without a word, a stalled rank
    the others gave up waiting for, ranks whose own checks failed, and the first traceback."""
    failures = sorted((float(text.partition("\n")[0]), int(name[4:-4]), text.partition("\n")[2])
                      for name in os.listdir(error_dir) if name.endswith(".err")
                      for text in [Path(error_dir, name).read_text()])  # the first one first
    own = sorted(r for _, r, text in failures if text.startswith("exited with status"))
    raised = [(r, text) for _, r, text in failures if r not in own]
    lines = [f"error: rank {rank} was killed by {signal.Signals(-code).name}" if code < 0 else
             f"error: rank {rank} exited with status {code}" for rank, code in enumerate(codes)
             if code not in (None, 0) and rank not in {r for _, r, _ in failures}]
    if stalled:
        lines.append(f"error: rank(s) {stalled} stalled (stopped by a signal, SIGSTOP?); the "
                     "others gave up waiting for them")
    if own:
        lines.append(f"error: rank(s) {own} failed their own checks (see their output)")
    if raised:
        lines.append(f"error: rank {raised[0][0]} failed first"
                     f"{' while waiting for a stalled rank' if stalled else ''}:\n"
                     f"{raised[0][1].rstrip()}")
    if len(raised) > 1:
        lines.append(f"(then rank(s) {sorted(r for r, _ in raised[1:])} failed too, usually "
                     "because a peer went away)")
    print("\n".join(lines), file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- output
# `python script.py | head -1`: once head has its line it exits, and the next print raises
# BrokenPipeError, in the parent or in a rank. As any Unix tool does, the run then ends without
# a word: a rank records READER_GONE (not a failure), the parent stops the others and raises
# BrokenPipeError itself, and this hook, for the parent, prints no traceback (exit status 1).
READER_GONE = "the reader of the output has exited\n"


def output_reader_gone() -> bool:
    """Whether stdout (file descriptor 1) is a pipe whose reader has exited: Linux's poll()
    reports POLLERR for it."""
    poller = select.poll()
    poller.register(1, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def discard_output() -> None:
    """Point stdout at /dev/null, so what is still buffered can be flushed without an error."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


_previous_excepthook = sys.excepthook


def _quiet_when_the_reader_is_gone(kind, error, tb):
    if issubclass(kind, BrokenPipeError) and output_reader_gone():
        discard_output()
        return
    _previous_excepthook(kind, error, tb)


sys.excepthook = _quiet_when_the_reader_is_gone
