"""Lesson 9's DDP crossover: the planner's prediction against a hand computation (from the LM's
parameters and FLOPs, and from make bench's files; the old inputs' 2.9x as a negative control),
the lab's finder against planted curves (a curve with no crossing is reported as none), and one
run of crossover.py at the tiniest sizes."""

import csv
import time

import pytest

import crossover
import planner
import run_planning

# One block, d_model 8, d_ff 32, 2 heads, vocab 16, 4 tokens: on paper
#   matrices 3*8*8 + 8*8 + 32*8 + 8*32 = 768; forward a token 2*768 + 2*16*8 + 4*4*8/2 = 1856;
#   backward 2 x 1856 = 3712 FLOP; parameters 16*8 + 4*8 + 840 (block) + 16 + 16*8 = 1144.
PAPER = planner.LM(layers=1, d_model=8, d_ff=32, heads=2, vocab=16, seq=4, batch=1)


def test_the_prediction_equals_a_hand_computation():
    assert planner.parameter_count(PAPER) == 1144
    assert planner.training_flops_per_token(PAPER) * 2 / 3 == 3712
    link = planner.Link(latency=1e-3, busbw=1e9)
    # 4 ranks: 1 ms + 2 x 3/4 x 4 x 1144 B / 1 GB/s of all-reduce, at 1 GFLOP/s over 3712 FLOP a token
    hand = (1e-3 + 2 * 0.75 * 4576 / 1e9) * 1e9 / 3712
    assert planner.dp_crossover_tokens(PAPER, 1e9, link, 4) == pytest.approx(hand, rel=1e-12)
    # without latency, the Scaling Book's form: 2(W-1)/W x b C / busbw over backward's FLOP per parameter
    bare = planner.Link(latency=0.0, busbw=1e9)
    assert planner.dp_crossover_tokens(PAPER, 1e9, bare, 4) == pytest.approx(
        2 * 0.75 * 4 * 1e9 / 1e9 / (3712 / 1144), rel=1e-12)
    # one rank sends nothing: never communication-bound
    assert planner.dp_crossover_tokens(PAPER, 1e9, link, 1) == 0
    # backward's floor (0.5 ms at no tokens) leaves less all-reduce to hide: (4.4 - 0.5) ms at
    # 3712 FLOP a token and 1 GFLOP/s; a floor longer than the all-reduce hides it at any size
    assert planner.dp_crossover_tokens(PAPER, 1e9, link, 4, floor=0.5e-3) == pytest.approx(
        (1e-3 + 2 * 0.75 * 4576 / 1e9 - 0.5e-3) * 1e9 / 3712, rel=1e-12)
    assert planner.dp_crossover_tokens(PAPER, 1e9, link, 4, floor=5e-3) == 0


def plant_results(folder, row_ms=2.26, rows_ms=3.54, all_reduce_ms=4.0, ranks=2) -> None:
    """make bench's DDP control (ddp_step.csv), a row from another world size beside it: what
    box_crossover reads."""
    folder.mkdir(parents=True, exist_ok=True)
    columns = ["backend", "device", "world_size", "model", "impl", "context_length", "bwd_one_row_ms",
               "bwd_two_rows_ms", "all_reduce_after_backward_ms", "run_id"]
    with open(folder / "ddp_step.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        for world_size, scale in ((ranks, 1), (ranks + 2, 10)):
            writer.writerow({"backend": "gloo", "device": "cpu", "world_size": world_size, "model": "tiny",
                             "impl": "none", "context_length": 64, "bwd_one_row_ms": row_ms * scale,
                             "bwd_two_rows_ms": rows_ms * scale, "all_reduce_after_backward_ms": all_reduce_ms,
                             "run_id": "r"})


def test_this_boxs_prediction_from_make_benchs_files(tmp_path, monkeypatch):
    monkeypatch.setenv("RESULTS_DIR", str(tmp_path))
    assert run_planning.box_crossover(2) is None               # before make bench: none
    plant_results(tmp_path)
    box = run_planning.box_crossover(2)
    # backward at a row of 64 tokens 2.26 ms, at two rows 3.54 ms: 0.02 ms a token above a floor
    # of 0.98 ms; it reaches the 4 ms all-reduce after backward at (4 - 0.98) / 0.02 = 151 tokens
    assert box["tokens"] == pytest.approx(151, rel=1e-9)
    assert box["floor_s"] == pytest.approx(0.98e-3, rel=1e-12) and box["all_reduce_s"] == 4e-3
    lm = run_planning.course_lm("tiny", 64, compute_bytes=4)
    assert box["rate"] == pytest.approx(planner.training_flops_per_token(lm) * 2 / 3 / 0.02e-3, rel=1e-12)
    # the 4-rank control's own row: a floor of 9.8 ms outlasts its 4 ms all-reduce: never bound by it
    assert run_planning.box_crossover(4)["tokens"] == 0 and run_planning.box_crossover(3) is None
    plant_results(tmp_path, rows_ms="")                          # a control from before these columns
    assert run_planning.box_crossover(2) is None


def test_without_backwards_floor_the_planted_crossing_is_missed(tmp_path, monkeypatch):
    """Negative control on the planted control row: backward as 4NT/C through one row alone (no
    floor: the C/W rule's own form) puts the crossing at 4 / 2.26 x 64 = 113 tokens a rank, not
    within x1.25 of the 151 that the line through one row and two gives."""
    monkeypatch.setenv("RESULTS_DIR", str(tmp_path))
    plant_results(tmp_path)
    box = run_planning.box_crossover(2)
    lm = run_planning.course_lm("tiny", 64, compute_bytes=4)
    one_row_rate = planner.training_flops_per_token(lm) * 2 / 3 * 64 / 2.26e-3
    no_floor = planner.dp_crossover_tokens(lm, one_row_rate, planner.Link(4e-3, float("inf")), 2)
    assert no_floor == pytest.approx(4 / 2.26 * 64, rel=1e-9)
    ratio = box["tokens"] / no_floor
    assert not 1 / crossover.TARGET <= ratio <= crossover.TARGET


def test_the_finder_on_planted_curves():
    tokens = [10, 20, 40, 80, 160]
    # backward proportional to the tokens, all-reduce 3 ms: equal at 57 tokens exactly in log space
    found = crossover.crossing(tokens, [3 * t / 57 for t in tokens], 3.0)
    assert found == pytest.approx(57, rel=1e-9)
    # a floor and a slope: the crossing lies between its bracketing points, near the true 50
    affine = [0.5 + t / 20 for t in tokens]
    assert 40 < crossover.crossing(tokens, affine, 3.0) < 80
    # negative controls: compute-bound everywhere, communication-bound everywhere, crossing down
    assert crossover.crossing(tokens, [5.0] * 5, 3.0) is None
    assert crossover.crossing(tokens, [1.0] * 5, 3.0) is None
    assert crossover.crossing(tokens, [5, 4, 2, 1, 1], 3.0) is None
    # where no point crosses, the sweep goes on past the end the crossing must lie beyond
    curve = [{"tokens_per_rank": t, "backward_ms": b, "all_reduce_ms": 3.0} for t, b in zip(tokens, affine)]
    assert crossover.beyond(curve[:2]) == [40] and crossover.beyond(curve[3:]) == [40]
    assert crossover.beyond(curve) == [] and crossover.beyond([{**curve[4], "tokens_per_rank": 1}]) == []
    points = crossover.sweep(49, 7)
    assert points == sorted(points) and points[0] == 12 and points[-1] == 196 and len(points) == 7


def test_one_small_run_writes_measured_beside_predicted(tmp_path, capfd):
    folder = tmp_path / "results"
    plant_results(folder)
    crossover.main(["--tokens", "2,64", "--seq", "16", "--warmup", "0", "--steps", "2"])
    out = capfd.readouterr().out
    assert "crossover measured:" in out and "crossover predicted:" in out
    rows = list(csv.DictReader(open(folder / "crossover.csv")))
    assert [row["point"] for row in rows] == ["0", "1", "crossover"]
    assert [int(row["tokens_per_rank"]) for row in rows[:2]] == [2, 64]
    assert [(row["rows"], row["seq"]) for row in rows[:2]] == [("1", "2"), ("4", "16")]
    assert all(float(row["backward_ms"]) > 0 and float(row["all_reduce_ms"]) > 0 for row in rows[:2])
    assert float(rows[2]["predicted_tokens"]) == pytest.approx(run_planning.box_crossover(2)["tokens"])


def test_make_benchs_deadline_stops_the_sweep_and_says_so(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("BENCH_STEP_DEADLINE", f"{time.time() + 0.01:.3f}")   # passed by the second point
    crossover.main(["--tokens", "2,64", "--seq", "16", "--warmup", "0", "--steps", "1"])
    assert "crossover: 64 tokens a rank and more: skipped: past make bench's deadline" in \
        capfd.readouterr().out
    rows = list(csv.DictReader(open(tmp_path / "results" / "crossover.csv")))
    assert [row["point"] for row in rows] == ["0", "crossover"] and rows[1]["tokens_per_rank"] == ""
