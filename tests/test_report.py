"""bench/backends.py (each collective tried in its own job: a crash or a hang is a row) and the
report's sections for results/backends.csv, results/muon.csv and compute.csv's labelled MFU."""

import csv
import os
import time

from bench import backends, report


def planted(op, rank, world_size, device):
    """The real ops, and two that go wrong: a crash (SIGABRT) and an error."""
    if op == "abort":
        os.abort()
    if op == "raise":
        raise ValueError("boom\nsecond line")
    if op == "hang":
        time.sleep(600)
    return backends.try_op(op, rank, world_size, device)


def test_every_op_is_carried_by_gloo_on_cpu_and_a_crash_or_an_error_is_a_row():
    rows = backends.try_all([("gloo", "cpu")], ops=(*backends.OPS, "abort", "raise"), run=planted, timeout_s=120)
    outcome = {row["op"]: row["outcome"] for row in rows}
    assert outcome.pop("abort") == "crashed: SIGABRT"
    assert outcome.pop("raise") == "error: ValueError: boom"
    assert outcome == {op: "ok" for op in backends.OPS}


def test_an_outcome_names_a_crash_before_the_first_error_and_an_error_before_a_timeout(tmp_path):
    (tmp_path / "error.1").write_text("RuntimeError: Connection closed by peer")
    assert backends.outcome([-11, 1], str(tmp_path)) == "crashed: SIGSEGV"
    assert backends.outcome([None, 1], str(tmp_path)) == "error: RuntimeError: Connection closed by peer"
    (tmp_path / "error.1").unlink()
    assert backends.outcome([1, 0], str(tmp_path)) == "error: exit 1"
    assert backends.outcome([0, None], str(tmp_path)) == "timeout"
    assert backends.outcome([0, 0], str(tmp_path)) == "ok"


def test_a_job_unfinished_at_make_bench_deadline_is_left_out_and_said(monkeypatch, capfd):
    monkeypatch.setenv("BENCH_STEP_DEADLINE", str(time.time() + 8))
    start = time.monotonic()
    rows = backends.try_all([("gloo", "cpu")], ops=("all_reduce", "hang"), run=planted, timeout_s=120)
    assert time.monotonic() - start < 20
    assert rows == [{"backend": "gloo", "device": "cpu", "op": "all_reduce", "outcome": "ok"}]
    assert capfd.readouterr().out == ("hang on gloo/cpu: skipped: past make bench's deadline for this "
                                      "step; the other rows are written\n")


def _write_csv(path, rows):
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_the_report_shows_backends_beside_the_course_rule_muon_and_the_peak_each_mfu_is_of(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    _write_csv(out / "backends.csv", [
        {"backend": "gloo", "device": "cpu", "op": "send/recv", "outcome": "ok", "run_id": "r1"},
        {"backend": "gloo", "device": "cuda", "op": "send/recv", "outcome": "crashed: SIGSEGV", "run_id": "r1"},
        {"backend": "gloo", "device": "cuda", "op": "reduce", "outcome": "error: RuntimeError: no", "run_id": "r1"}])
    same = {"world_size": 2, "model": "tiny", "bytes_counted": 100, "bytes_formula": 100, "ns_gflop_max": 1.5,
            "machine": "box", "run_id": "r1"}
    _write_csv(out / "muon.csv", [{**same, "impl": "adamw+zero1", "step_ms": 10.0, "ns_imbalance": ""},
                                  {**same, "impl": "muon_a", "step_ms": 8.0, "ns_imbalance": 1.0},
                                  {**same, "impl": "muon_b", "step_ms": 12.0, "ns_imbalance": 2.0}])
    _write_csv(out / "compute.csv", [
        {"device": "cuda", "dtype": "bfloat16", "model": "tiny", "params": 1383680, "batch_size": 4,
         "context_length": 64, "fwd_ms": 10.0, "bwd_ms": 20.0, "optimizer_ms": 5.0, "tokens_per_s": 7314.0,
         "achieved_tflops": 100.0, "peak_tflops": 500.0, "mfu": 0.2, "mfu_of": "the bfloat16 matmul peak measured here",
         "mfu_of_datasheet": 0.101, "datasheet": "NVIDIA H100: 989 TFLOP/s bf16 dense", "optimizer_gbps": 1.1,
         "copy_gbps": 10.0, "max_memory_allocated_bytes": 2**30, "memory_total_bytes": 2**34, "run_id": "r1"}])
    path, empty = report.write_report(out)
    text = path.read_text()
    assert "| gloo/cuda | send/recv | crashed: SIGSEGV | not carried | yes |" in text
    assert "| gloo/cuda | reduce | error: RuntimeError: no | carried | **no** |" in text
    assert "The course's rule matches 2 of 3 tries; not: reduce on gloo/cuda." in text
    assert "| muon_a | 2 | tiny | 8 | 100B (100B) | 1.5 | 1.00 |" in text
    assert "On 2 ranks the fastest Muon step (muon_a) takes 0.80x AdamW + ZeRO-1's." in text
    assert "| tiny bfloat16 | 1.4M |" in text and "| 1GB of 16GB |" in text
    assert "| 20.0% of the bfloat16 matmul peak measured here; 10.1% of NVIDIA H100: 989 TFLOP/s bf16 dense |" in text
    assert report.OPTIONAL[0][0] not in empty and report.SECTIONS[1][0] in empty  # optional: never "missing"
    for name in ("muon.csv", "backends.csv"):
        (out / name).unlink()
    text = report.write_report(out)[0].read_text()  # a later run without them keeps them, marked
    assert "| muon_a | 2 | tiny | 8 |" in text and "| gloo/cuda | reduce |" in text
    os.remove(out / "compute.csv")
    (out / "README.md").unlink()
    _write_csv(out / "allreduce.csv", [{"backend": "gloo", "device": "cpu", "world_size": 2, "bytes": 1024,
                                        "impl": "backend", "time_ms_median": 1.0, "busbw_gbps": 1.0, "run_id": "r1"}])
    text = report.write_report(out)[0].read_text()  # nothing before, no rows: no section at all
    assert f"## {report.OPTIONAL[0][0]}" not in text and f"## {report.OPTIONAL[1][0]}" not in text
