"""The lab's launcher: the course's (common/launch.py), re-exported, plus what unwatched runs need.

``launch(worker, config, *args, timeout_s=None)`` supervises the ranks: the first to fail is named
with its traceback, a killed or stopped (SIGSTOP) rank is named, Ctrl-C or SIGTERM ends every rank
with one line, a segfault prints a Python stack, ``| head -1`` ends quietly. Bad environment
variables and runs that cannot fit in memory are refused in one line (exit 2) before any worker.
Ranks are forked from Python's fork server; the rendezvous store is held here unless MASTER_PORT.
"""

import argparse
import datetime
import faulthandler
import gc
import itertools
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
from multiprocessing import reduction

import torch
import torch.distributed as dist
import torch.multiprocessing

from bench import results
from common import usage_error
from common.launch import (Dist, LaunchConfig, Parser, choice_list, free_port, int_list,  # noqa: F401
                           list_of, non_negative_int, positive_float, positive_int, rank_threads,
                           ranks_on_this_node, ranks_per_gpu, under_torchrun)
from common.launch import make_parser as course_parser
from common.launch import resolve as course_resolve


class Stopped(SystemExit):
    """Ctrl-C or SIGTERM stopped the workers (exit 128 + signal); catch it to report, re-raise."""


def make_parser(doc: str | None, world_size: int = 2) -> Parser:
    """The course's parser; a lab script also ends quietly when its reader does."""
    quiet_when_the_reader_leaves()
    return course_parser(doc, world_size)


# --------------------------------------------------------------------------- environment
MAX_TIMEOUT_S = 7 * 24 * 3600  # a week; torch's deadlines overflow somewhere past 1e9 s


def timeout_s() -> float:
    """``DIST_TIMEOUT_S`` (default 300), the wait for a peer: 0.001 (1 ms) to a week."""
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
    if text and not (text.isdecimal() and 1 <= int(text) <= 65535):
        usage_error(f"MASTER_PORT={text!r}: give a TCP port from 1 to 65535, or leave it unset "
                    "(a free port is picked)")
    return int(text) if text else None


def torchrun_ranks() -> None:
    """torchrun's variables, when any is set: whole numbers in range, and where to meet."""
    given = [name for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE") if name in os.environ]
    missing = [name for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if name not in os.environ]
    if given and missing:
        usage_error(f"{given[0]} is set but {missing[0]} is not: set RANK, WORLD_SIZE and "
                    "LOCAL_RANK together (torchrun does), or none of them")
    for name in given:
        if not os.environ[name].isdecimal() or len(os.environ[name]) > 9:
            usage_error(f"{name}={os.environ[name]!r}: give a whole number >= 0 (torchrun sets it)")
    if not given:
        return
    value = {name: int(os.environ[name]) for name in given}
    if not value["RANK"] < value["WORLD_SIZE"]:
        usage_error(f"RANK={value['RANK']} with WORLD_SIZE={value['WORLD_SIZE']}: a rank counts "
                    "from 0 to WORLD_SIZE - 1")
    if not os.environ.get("MASTER_ADDR") or master_port() is None:
        usage_error("torchrun's RANK, WORLD_SIZE and LOCAL_RANK are set but MASTER_ADDR or "
                    "MASTER_PORT is not: set both to where rank 0 listens")


def check_environment() -> None:
    """Every environment variable a run reads, checked up front (one line, exit 2)."""
    timeout_s()
    torchrun_ranks()
    addr, port = master_addr(), master_port()
    if port is not None and not under_torchrun():  # a MASTER_PORT given by hand: rank 0 binds it
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr, port))
            except OSError as e:
                usage_error(f"MASTER_PORT={port}: another process holds it ({e.strerror}); unset "
                            "MASTER_PORT (a free port is picked) or give a free one")
    results.check_folder()  # RESULTS_DIR set but empty, a folder where a results file goes


def wait_for_rank_0(rank: int) -> None:
    """Under torchrun, a rank other than 0 waits for rank 0, saying so once, till DIST_TIMEOUT_S."""
    if rank == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return
    addr, port = master_addr(), master_port()
    limit = time.monotonic() + timeout_s()
    for attempt in itertools.count():
        try:
            socket.create_connection((addr, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > limit:
                raise SystemExit(f"error: rank {rank}: rank 0 never listened at {addr}:{port} "
                                 f"within DIST_TIMEOUT_S = {timeout_s():g} s") from None
            if attempt == 0:
                print(f"[rank {rank}] waiting for rank 0 at {addr}:{port} (up to "
                      f"DIST_TIMEOUT_S = {timeout_s():g} s)", file=sys.stderr, flush=True)
            time.sleep(0.5)


def resolve(args: argparse.Namespace) -> LaunchConfig:
    """Check the common flags and fill in the machine's defaults (the course's ``resolve``)."""
    check_environment()  # DIST_TIMEOUT_S, MASTER_ADDR/PORT, RESULTS_DIR: before any worker
    if not under_torchrun():
        check_ranks_fit(args.world_size)
    config = course_resolve(args)
    if config.backend == "nccl" and not dist.is_nccl_available():
        usage_error("--backend nccl: this torch has no NCCL; use --backend gloo")
    return config


# --------------------------------------------------------------------------- what fits
GIB = 2 ** 30


def host_available_bytes() -> int:
    """Host memory a new allocation can still get: Linux's MemAvailable, else free pages."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def rank_baseline_bytes() -> int:
    """One rank before any model: this process's resident memory plus 64 MiB for its group."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") + (64 << 20)
    except (OSError, ValueError, IndexError):
        return 512 << 20


def check_ranks_fit(ranks_here: int, per_rank_bytes: int = 0, what: str = "") -> None:
    """One-line usage error when ``ranks_here`` ranks (+ ``per_rank_bytes``) overfill the host."""
    baseline = rank_baseline_bytes()
    need = ranks_here * (baseline + per_rank_bytes)
    have = int(0.9 * host_available_bytes())
    if need > have:
        usage_error(f"{ranks_here} ranks need about {need / GIB:.1f} GiB of host memory "
                    f"({baseline / 2**20:.0f} MiB each to start{', plus ' + what if what else ''})"
                    f" but {have / GIB:.1f} GiB is available; use a smaller --world-size"
                    + (" or size" if what else ""))


def check_fits(config: LaunchConfig, per_rank_bytes: int, what: str) -> None:
    """One-line usage error when a rank's ``per_rank_bytes`` cannot fit (a shared GPU adds up)."""
    if config.device != "cuda":
        check_ranks_fit(ranks_on_this_node(config.world_size), per_rank_bytes, what)
        return
    need = ranks_per_gpu(config.world_size) * per_rank_bytes
    total = torch.cuda.get_device_properties(0).total_memory
    if need > 0.9 * total:
        usage_error(f"{what} needs about {need / GIB:.1f} GiB per GPU but a GPU has "
                    f"{total / GIB:.1f} GiB; use smaller sizes")


# --------------------------------------------------------------------------- one rank
def rendezvous_timeout() -> datetime.timedelta:  # ``launch`` has a parameter named timeout_s
    return datetime.timedelta(seconds=timeout_s())


RAISED_AT = "launch: this rank raised at "  # a note on a started rank's error, read by launch


def _run_worker(worker, rank, world_size, local_rank, backend, device, args):
    """One rank, under torchrun or here: pick the device, join the group, run ``worker``, leave."""
    dev = torch.device("cuda", local_rank % torch.cuda.device_count()) \
        if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    wait_s = timeout_s()
    # Joining waits silently for every peer: a rank not in after 10 s says, once, what it awaits.
    waited_s = min(10, wait_s / 2)
    message = (f"[rank {rank}] still waiting, after {waited_s:g} s, for the other {world_size - 1} "
               f"rank(s) to join the process group at {os.environ.get('MASTER_ADDR')}:"
               f"{os.environ.get('MASTER_PORT')} (rank 0 listens there); torch's limit for this "
               f"wait is DIST_TIMEOUT_S = {wait_s:g} s")
    note = threading.Timer(waited_s, print, (message,), {"file": sys.stderr, "flush": True})
    note.daemon = True
    note.start()
    try:
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=wait_s),
                                **({"device_id": dev} if backend == "nccl" else {}))
        note.cancel()
        return worker(Dist(rank, world_size, local_rank, backend, dev), *args)
    except Exception as error:
        # When it failed, before the group is torn down: the launcher names the first by it.
        if not under_torchrun() and sys.version_info >= (3, 11):  # torchrun names it its way
            error.add_note(f"{RAISED_AT}{time.time()!r}")
        raise
    finally:
        note.cancel()
        if dist.is_initialized():
            # fully_shard leaves cycles holding the group's work: torn down at exit, they abort.
            gc.collect()
            dist.destroy_process_group()


# --------------------------------------------------------------------------- the ranks
READER_GONE = 141  # a rank's exit status when the reader of the output left (128 + SIGPIPE)


def _start_method() -> str:
    """The fork server (never this process, whose threads may hold a lock at the fork); a rank
    keeps its hash seed and torch's import-time variables."""
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "bench.supervisor",
                                            "bench.fork_server"])
    return "forkserver"


class _Streams:
    """This launcher's stdout and stderr for a forked rank (the server kept an earlier one's)."""

    def __init__(self, fds=()):
        self.fds = fds

    def __reduce__(self):
        return (_Streams, ([reduction.DupFd(1), reduction.DupFd(2)],))

    def take(self) -> None:
        for wrapped, target in zip(self.fds, (1, 2)):
            fd = wrapped.detach()
            os.dup2(fd, target)
            os.close(fd)


def _rank(rank, worker, config, args, environ, streams):
    """A started rank (torch's wrapper around it records its traceback if it raises)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends a rank, even in a collective
    torch.multiprocessing._prctl_pr_set_pdeathsig(signal.SIGKILL)  # and its parent's end (not SIGINT)
    if not multiprocessing.parent_process().is_alive():
        os._exit(1)  # the launcher died while this rank started, before that request was made
    streams.take()
    # Close our copy of the server's "alive" pipe: the server, our parent, ends with the launcher.
    os.close(multiprocessing.forkserver._forkserver._forkserver_alive_fd)
    faulthandler.enable(file=2)  # a segfault prints every thread's Python stack on stderr (fd 2)
    os.environ.clear()
    os.environ.update(environ, RANK=str(rank), LOCAL_RANK=str(rank))  # the launcher's, now
    torch.seed()  # forked ranks would all share the server's generator state
    torch.set_num_threads(rank_threads(config.world_size))
    try:
        _run_worker(worker, rank, config.world_size, rank, config.backend, config.device, args)
    except BrokenPipeError:
        if not output_reader_gone():
            raise
        discard_output()  # `| head -1` has its line: not a failure of this rank
        sys.exit(READER_GONE)


def launch(worker, config: LaunchConfig, *args, timeout_s: float | None = None) -> None:
    """Run ``worker(ctx, *args)`` on every rank, supervised; ``timeout_s`` bounds the run."""
    if under_torchrun():
        if not faulthandler.is_enabled():
            faulthandler.enable()
        check_environment()
        wait_for_rank_0(int(os.environ["RANK"]))
        _run_worker(worker, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                    int(os.environ["LOCAL_RANK"]), config.backend, config.device, args)
        return
    addr = master_addr()
    environ = {**os.environ, "MASTER_ADDR": addr, "WORLD_SIZE": str(config.world_size),
               "LOCAL_WORLD_SIZE": str(config.world_size)}  # as torchrun sets them
    if master_port() is None:
        # The ranks' store, held here on a port the OS keeps for it; they join as clients.
        store = dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False, timeout=rendezvous_timeout())
        environ["MASTER_PORT"] = str(store.port)
        environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    stop = {"signum": None}  # SIGINT / SIGTERM set it; the supervisor acts on it
    on_main_thread = threading.current_thread() is threading.main_thread()
    old = {s: signal.signal(s, lambda signum, _: stop.update(signum=signum))
           for s in (signal.SIGINT, signal.SIGTERM)} if on_main_thread else {}
    ranks = None
    try:
        ranks = torch.multiprocessing.start_processes(
            _rank, (worker, config, args, environ, _Streams()), nprocs=config.world_size,
            join=False, start_method=_start_method())
        _supervise(ranks, timeout_s, stop)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if ranks is not None:
            _end(ranks.processes)
            for path in ranks.error_files:
                if os.path.exists(path):
                    os.remove(path)


# --------------------------------------------------------------------------- supervision
# Not torch's join: it names the first exit seen, cannot tell a stall, and trusts SIGTERM.

def _end(processes) -> None:
    for p in processes:
        if p.is_alive():
            p.kill()  # SIGKILL: also ends a rank that is stopped (SIGSTOP) or stuck in C++
    for p in processes:
        p.join(timeout=5)


def _stopped(pid: int) -> bool:
    """Whether Linux says the process is stopped (SIGSTOP): state T in /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def _supervise(ranks, timeout_s, stop: dict) -> None:
    processes = ranks.processes
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        codes = [p.exitcode for p in processes]  # read once: every decision below uses them
        if all(code == 0 for code in codes):
            return
        stalled = [rank for rank, p in enumerate(processes) if codes[rank] is None and _stopped(p.pid)]
        if stop["signum"] is not None:
            _end(processes)
            print(f"stopped by {signal.Signals(stop['signum']).name}: all {len(processes)} ranks "
                  "ended; results written before this point are kept", file=sys.stderr, flush=True)
            raise Stopped(128 + stop["signum"])
        if any(code not in (None, 0) for code in codes):
            _end(processes)
            _report_failure(codes, ranks.error_files, stalled)
        if deadline is not None and time.monotonic() > deadline:
            _end(processes)
            print(f"error: run exceeded its {timeout_s:.0f}s limit; all ranks killed"
                  + (f" (rank(s) {stalled} were stopped by a signal)" if stalled else ""),
                  file=sys.stderr, flush=True)
            raise SystemExit(1)
        multiprocessing.connection.wait([p.sentinel for p in processes if p.exitcode is None], timeout=0.5)


WHY_KILLED = {"SIGKILL": "sent from outside, by the out-of-memory killer or kill -9: no stack can be printed",
              **dict.fromkeys(("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT"),
                              "a crash in native code: its Python stack, from faulthandler, is above")}


def _report_failure(codes: list, error_files: list, stalled: list[int]) -> None:
    """Name the root cause, then exit: ranks killed by a signal, stalled ranks, ranks that exited
    without a traceback, and the traceback of the rank that raised first."""
    failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
    if READER_GONE in codes:  # `| head -1`: our own output went too, so stop as quietly
        discard_output()
        raise SystemExit(1)
    raised = []  # (when, rank, traceback) of each rank whose error torch's wrapper recorded
    for rank in failed:
        path = error_files[rank]
        if os.path.exists(path):
            with open(path, "rb") as f:
                text = pickle.load(f).rstrip("\n")  # our own rank's file, in our temporary folder
            body, _, when = text.rpartition("\n" + RAISED_AT)  # Python 3.10, no notes: the file's time
            raised.append((float(when), rank, body) if body else (os.stat(path).st_mtime, rank, text))
    raised.sort()  # the first one first
    silent = [rank for rank in failed if not os.path.exists(error_files[rank])]
    if not raised and all(codes[rank] == 2 for rank in failed):
        raise SystemExit(2)  # bad input only the ranks could see, said by them in one line
    lines = []
    for rank in [rank for rank in silent if codes[rank] < 0]:
        name = next((s.name for s in signal.Signals if s == -codes[rank]), f"signal {-codes[rank]}")
        why = WHY_KILLED.get(name, "sent from outside")
        lines.append(f"error: rank {rank} was killed by {name} ({why})")
    if stalled:
        lines.append(f"error: rank(s) {stalled} stalled (stopped by a signal, SIGSTOP?); the "
                     "others gave up waiting for them")
    own = [rank for rank in silent if codes[rank] > 0]
    if own:
        lines.append(f"error: rank(s) {own} exited with status "
                     f"{', '.join(str(codes[rank]) for rank in own)} without a traceback (their "
                     "own checks failed, or they could not start: see their output)")
    if raised:
        lines.append(f"error: rank {raised[0][1]} failed first"
                     f"{' while waiting for a stalled rank' if stalled else ''}:\n"
                     f"{raised[0][2]}")
    if len(raised) > 1:
        lines.append(f"(then rank(s) {sorted(rank for _, rank, _ in raised[1:])} failed too, "
                     "usually because a peer went away)")
    print("\n".join(lines), file=sys.stderr, flush=True)
    raise SystemExit(1)


# --------------------------------------------------------------------------- output
# `| head -1`: a print meeting the closed pipe ends the run without a word, as Unix tools do.

def output_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has exited (poll() reports POLLERR)."""
    poller = select.poll()
    poller.register(1, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def discard_output() -> None:
    """Point stdout at /dev/null, so what is still buffered can be flushed without an error."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


def _quiet_when_the_reader_is_gone(kind, error, tb):
    if issubclass(kind, BrokenPipeError) and output_reader_gone():
        discard_output()
        return
    _previous_excepthook(kind, error, tb)


def quiet_when_the_reader_leaves() -> None:
    """From now on, a print meeting a pipe whose reader left ends this process: status 1, silent."""
    global _previous_excepthook
    if sys.excepthook is not _quiet_when_the_reader_is_gone:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _quiet_when_the_reader_is_gone
