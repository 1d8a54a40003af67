"""Stage 02: the all-reduce benchmark's arithmetic, its fit, a tiny real sweep, its guards."""

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import allreduce_bench as bench
from common import launch
from helpers import REPO, run_script

SCRIPT = REPO / "02_allreduce_bench" / "allreduce_bench.py"
KB, MB, GB = 2**10, 2**20, 2**30


# --------------------------------------------------------------------------- pure arithmetic


def test_sizes_are_binary_and_must_be_whole_floats():
    assert bench.parse_size("1MB") == MB
    assert bench.parse_size("64KB") == 64 * KB
    assert bench.parse_size("1GB") == GB
    assert bench.parse_size("1.5mb") == 3 * MB // 2
    assert bench.parse_size("4100") == bench.parse_size("4100B") == 4100
    assert [bench.format_size(n) for n in (64 * KB, MB, 10 * MB, 3 * GB // 2, 12, 2**40)] == \
        ["64KB", "1MB", "10MB", "1.5GB", "12B", "1TB"]
    for bad in ["12XB", "MB", "", "-1MB", "0KB", "6B", "1.0000001KB"]:
        with pytest.raises(ValueError):
            bench.parse_size(bad)


def test_algbw_and_busbw_on_known_numbers():
    assert bench.algbw(10**9, 1.0) == pytest.approx(1.0)          # GB/s are 10^9 B/s
    assert bench.algbw(MB, 1e-3) == pytest.approx(1.048576)       # 1 MB (2^20 B) in 1 ms
    assert bench.busbw(1.0, 2) == pytest.approx(1.0)              # 2(n-1)/n = 1 for n = 2
    assert bench.busbw(1.0, 4) == pytest.approx(1.5)
    assert bench.busbw(2.0, 6) == pytest.approx(2.0 * 10 / 6)
    assert bench.busbw(bench.algbw(8 * 10**8, 0.5), 8) == pytest.approx(1.6 * 14 / 8)


def test_fit_recovers_latency_and_bandwidth():
    a, w = 250e-6, 1.7e9  # 250 us, 1.7 GB/s
    sizes = [MB, 10 * MB, 100 * MB, GB]
    fa, fw = bench.fit_latency_bandwidth(sizes, [bench.predict_seconds(a, w, n) for n in sizes])
    assert fa == pytest.approx(a, rel=0.01) and fw == pytest.approx(w, rel=0.01)
    # With +-0.3% noise on every point the bandwidth still comes back within 1%.
    noisy = [bench.predict_seconds(a, w, n) * (1 + 0.003 * (-1) ** i) for i, n in enumerate(sizes)]
    assert bench.fit_latency_bandwidth(sizes, noisy)[1] == pytest.approx(w, rel=0.01)
    with pytest.raises(ValueError):
        bench.fit_latency_bandwidth([MB, MB], [1e-3, 1e-3])


def test_fit_rows_is_keyed_per_backend_device_world_size():
    rows = []
    for ws, (a, w) in {2: (1e-4, 1e9), 4: (3e-4, 5e8)}.items():
        for n in (KB, MB, 8 * MB):
            for impl, slow in (("backend", 1.0), ("ring", 1.5)):
                rows.append({"backend": "gloo", "device": "cpu", "world_size": str(ws),
                             "bytes": str(n), "impl": impl,
                             "time_ms_median": str(slow * bench.predict_seconds(a, w, n) * 1e3)})
    fits = bench.fit_rows(rows)
    assert set(fits) == {"gloo/cpu/2", "gloo/cpu/4"}
    f = fits["gloo/cpu/4"]
    assert (f["backend"], f["device"], f["world_size"], f["impl"]) == ("gloo", "cpu", 4, "backend")
    assert f["a_s"] == pytest.approx(3e-4, rel=1e-3)
    assert f["w_bytes_per_s"] == pytest.approx(5e8, rel=1e-3)
    assert f["sizes_bytes"] == [KB, MB, 8 * MB]
    assert all(abs(p["rel_error"]) < 1e-6 for p in f["points"])
    assert f["ring"]["w_bytes_per_s"] == pytest.approx(5e8 / 1.5, rel=1e-3)
    json.dumps(fits)  # plain JSON


def test_memory_guard_and_missing_matplotlib(tmp_path, capsys, monkeypatch):
    assert bench.memory_shortfall(4 * KB, 2, "cpu", True) is None
    reason = bench.memory_shortfall(2**50, 2, "cpu", True)
    assert reason and "host memory" in reason
    # gloo/cuda: the ring's host staging counts against host memory; the GPU side is checked
    # against the free bytes given (a rank passes only its own GPU's), no CUDA needed here.
    monkeypatch.setattr(launch, "host_available_bytes", lambda: 100 * GB)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    n = 16 * GB  # 2 ranks x (2 N + 0.5 GB) = 65 GB fits in 90 GB; x (3.5 N + 0.5 GB) = 113 GB not
    assert bench.memory_shortfall(n, 2, "cuda", False, "gloo", gpu_free=[2**50]) is None
    assert "host memory" in bench.memory_shortfall(n, 2, "cuda", True, "gloo", gpu_free=[2**50])
    assert "per GPU" in bench.memory_shortfall(MB, 2, "cuda", True, "nccl", gpu_free=[GB])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rows = [{"backend": "gloo", "device": "cpu", "world_size": "2", "bytes": str(KB),
             "impl": "backend", "busbw_gbps": "0.1"}]
    assert bench.plot_busbw(rows, tmp_path / "p.png", "here") is None
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "matplotlib is not installed" in out
    assert not (tmp_path / "p.png").exists()


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("argv, needle", [
    (["--sizes", "1MB,12XB"], "12XB"),
    (["--sizes", "6B"], "6B"),
    (["--world-sizes", "1,2"], "world size 1"),
    (["--world-size", "1"], "world size 1"),
    (["--world-sizes", "two"], "two"),
    (["--backend", "mpi"], "mpi"),
    (["--backend", "nccl", "--device", "cuda"], "nccl"),
    (["--device", "cuda"], "cuda"),
    (["--iters", "2"], "--iters"),
])
def test_bad_input_exits_2_with_one_line(argv, needle, capsys):
    if torch.cuda.is_available() and "cuda" in argv:
        pytest.skip("this box can run CUDA")
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error" in err and needle in err, err


def test_bad_input_from_the_command_line():
    r = run_script(SCRIPT, "--backend", "gloo", "--sizes", "1MB,1ZB", timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "1ZB" in r.stderr, r.stderr
    assert r.stdout == ""  # nothing started


# --------------------------------------------------------------------------- real runs


def test_tiny_sweep_writes_table_csv_and_fit():
    # 4100 B = 1025 floats: not divisible by 2 or 3, so the ring's chunks are uneven.
    sizes = [4 * KB, 4100, 16 * KB]
    r = run_script(SCRIPT, "--backend", "gloo", "--device", "cpu", "--sizes", "4KB,4100B,16KB",
                   "--world-sizes", "2,3", "--iters", "3", "--warmup", "1", timeout=150)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 MB = 2^20 bytes" in r.stdout and "10^9 bytes/s" in r.stdout
    assert "[1/12] gloo/cpu ws=2 4KB backend" in r.stdout
    assert "[12/12] gloo/cpu ws=3 16KB ring" in r.stdout
    assert "| gloo/cpu" in r.stdout and "busbw GB/s" in r.stdout  # the table

    results = Path(os.environ["RESULTS_DIR"])
    with open(results / "allreduce.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[:10] == ["backend", "device", "world_size", "bytes", "impl",
                                  "time_ms_median", "time_ms_min", "time_ms_max",
                                  "algbw_gbps", "busbw_gbps"]
    got = {(r["world_size"], int(r["bytes"]), r["impl"]) for r in rows}
    assert got == {(str(ws), n, impl) for ws in (2, 3) for n in sizes
                   for impl in ("backend", "ring")}
    for row in rows:
        t, lo, hi = (float(row[c]) for c in ("time_ms_median", "time_ms_min", "time_ms_max"))
        assert 0 < lo <= t <= hi
        alg, bus = float(row["algbw_gbps"]), float(row["busbw_gbps"])
        assert alg > 0 and bus == pytest.approx(bench.busbw(alg, int(row["world_size"])), rel=1e-4)
        assert alg == pytest.approx(int(row["bytes"]) / (t * 1e-3) / 1e9, rel=1e-3)

    fit = json.loads((results / "allreduce_fit.json").read_text())
    assert set(fit) == {"gloo/cpu/2", "gloo/cpu/3"}
    for key, entry in fit.items():
        assert entry["impl"] == "backend" and entry["sizes_bytes"] == sorted(sizes)
        assert entry["w_bytes_per_s"] > 0 and len(entry["points"]) == 3
    try:  # matplotlib is optional (SPEC section 1): a plot with it, a one-line note without
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (results / "allreduce_busbw.png").exists()
        assert sum("matplotlib is not installed" in line for line in r.stdout.splitlines()) == 1
    else:
        assert (results / "allreduce_busbw.png").stat().st_size > 1000


def ring_and_guards_worker(ctx, sizes, plan):
    ring = bench.load_ring_all_reduce()
    assert ring is not None, "01_collectives/collectives.py has no ring_all_reduce"
    for nbytes in sizes:
        ours = torch.empty(nbytes // 4, dtype=torch.float32)
        bench._fill_check_pattern(ours, ctx.rank)
        assert bench._check_sum(ours, ctx.world_size) > 0  # the check can fail
        theirs = ours.clone()
        ring(ours)
        dist.all_reduce(theirs)
        assert torch.equal(ours, theirs), (nbytes, (ours - theirs).abs().max().item())
        assert bench._check_sum(ours, ctx.world_size) == 0
    bench.allreduce_sweep(ctx, plan)


def test_ring_and_backend_identical_sums_and_guards_skip_with_a_reason(capfd):
    # One launch (3 ranks) for both, to keep the suite fast.
    # 1. The benchmark's check buffers, sized around the pattern's tile (7 * 2^17 floats) and
    #    split unevenly over 3 ranks: the ring and the backend give bitwise the same sums.
    sizes = [4, 4100, 64 * KB, 4 * 7 * 2**17 + 4 * 5]
    # 2. The guards: the memory reason comes from the parent's plan; the time budget scales
    #    the 4 KB time up to 2^40 B and skips it without allocating anything.
    plan = {"sizes": [(4 * KB, 1, None), (2**36, 3, "needs 1 TB of host memory"),
                      (2**40, 5, None)],
            "impls": ["backend", "ring"], "total": 6, "warmup": 1, "max_iters": 3,
            "budget_s": 30.0, "run_id": "t", "machine": "test"}
    launch.launch(ring_and_guards_worker, launch.LaunchConfig(3, "gloo", "cpu"), sizes, plan,
                  timeout_s=120)
    out = capfd.readouterr().out
    assert "[1/6] gloo/cpu ws=3 4KB backend" in out and "[2/6] gloo/cpu ws=3 4KB ring" in out
    assert "[3/6] gloo/cpu ws=3 64GB backend skipped: needs 1 TB of host memory" in out
    assert "[6/6] gloo/cpu ws=3 1TB ring skipped: estimated" in out
    assert "over the 30 s budget" in out
    rows = {(r["bytes"], r["impl"]) for r in csv.DictReader(
        open(Path(os.environ["RESULTS_DIR"]) / "allreduce.csv", newline=""))}
    assert rows == {(str(4 * KB), "backend"), (str(4 * KB), "ring")}


def test_a_wrong_sum_fails_the_run_and_says_by_how_much(tmp_path, capfd):
    broken = tmp_path / "broken_ring.py"
    broken.write_text("def ring_all_reduce(tensor, group=None):\n"
                      "    return tensor.mul_(2)  # not a sum\n")
    plan = {"sizes": [(4 * KB, 1, None)], "impls": ["backend", "ring"], "total": 2,
            "warmup": 1, "max_iters": 3, "budget_s": 30.0, "run_id": "t", "machine": "test",
            "ring_file": str(broken)}
    with pytest.raises(SystemExit) as e:
        launch.launch(bench.allreduce_sweep, launch.LaunchConfig(2, "gloo", "cpu"), plan,
                      timeout_s=120)
    assert e.value.code == 1
    err = capfd.readouterr().err
    assert "wrong sum" in err and "4KB ring: max |sum - expected| = " in err, err
    assert "4KB backend" not in err  # the backend's sum was right


def _read_lines(stream, lines):
    for line in stream:
        lines.append(line)


def test_ctrl_c_keeps_finished_rows():
    results = Path(os.environ["RESULTS_DIR"])
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--backend", "gloo", "--device", "cpu",
         "--sizes", "4KB,64KB,1MB,4MB,16MB,64MB", "--world-sizes", "2", "--no-plot"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)  # its own process group: Ctrl-C reaches the ranks too
    lines: list[str] = []
    reader = threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 90
        while not any(l.startswith("[3/") for l in lines) and time.monotonic() < deadline:
            assert proc.poll() is None, "".join(lines)
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        assert proc.wait(timeout=60) == 130, "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=5)
    out = "".join(lines)
    assert "interrupted" in out
    with open(results / "allreduce.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert 2 <= len(rows) < 12, out  # the finished ones, not all of them
    assert all(float(r["busbw_gbps"]) > 0 for r in rows)


def test_file_works_copied_alone(tmp_path):
    shutil.copy(SCRIPT, tmp_path / "allreduce_bench.py")
    code = ("import allreduce_bench as b; "
            "a, w = b.fit_latency_bandwidth([2**20, 2**30], [b.predict_seconds(1e-4, 2e9, n) "
            "for n in (2**20, 2**30)]); "
            "assert abs(a - 1e-4) < 1e-9 and abs(w / 2e9 - 1) < 1e-9; "
            "assert b.busbw(b.algbw(b.parse_size('1GB'), 1.0), 4) == 2**30 / 1e9 * 1.5; "
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
