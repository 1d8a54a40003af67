"""make bench's deadline for a step (``BENCH_STEP_DEADLINE``, Unix time): the tensor-parallel,
expert-parallel, ledger (bench_zero.py, bench_fsdp.py) and checkpoint benches ran every
configuration regardless, so make bench killed them at their cap and their last rows were
lost. Now each runs its first configuration, skips every later one that cannot end in time
with one line saying so, keeps the rows it measured and returns (exit 0)."""

import argparse
import os
import time

import bench_checkpoint
import bench_expert_parallel
import bench_tensor_parallel
import ledger
from bench import results
from bench import supervisor as launch

TP = {"d_model": 12, "d_ff": 24, "batch": 2, "seq": 6, "heads": 3,
      "variants": ["megatron", "allgather"], "with_torch": True}
EP = {"d_model": 12, "d_ff": 16, "num_experts": 6, "top_k": 2, "tokens": [12, 24], "warmup": 0,
      "iters": 1, "capacity_factors": [1.0, None], "budget_s": None}
LEDGER = argparse.Namespace(model="tiny", batch_size=3, context_length=8, steps=1, warmup=0,
                            rounds=1, checkpointing=["off"])
CHECKPOINT = argparse.Namespace(model="tiny", warmup=0, iters=1, dir=None, device_used="cpu")


def past_the_deadline(ctx):
    """Each bench with a deadline 1 ms away: its first configuration runs, no other."""
    for run in (lambda: bench_tensor_parallel.bench_main(ctx, TP),
                lambda: bench_expert_parallel.bench_main(ctx, EP),
                lambda: ledger.run_ledger(ctx, ledger.strategies()[:2], LEDGER),
                lambda: bench_checkpoint.bench_main(ctx, CHECKPOINT)):
        os.environ["BENCH_STEP_DEADLINE"] = f"{time.time() + 1e-3:.6f}"
        run()


def test_every_bench_stops_at_make_benchs_deadline_keeping_its_rows(capfd):
    launch.launch(past_the_deadline, launch.LaunchConfig(3, "gloo", "cpu"), timeout_s=300)
    out = capfd.readouterr().out
    for what in ("MLP, allgather, and after", "24 tokens per rank and more, and the loads",
                 "round 1, ddp, checkpointing off, and after",
                 "torch_dcp 2 -> 3 ranks, and after"):
        assert f"{what}: skipped: past make bench's deadline" in out and "the rows above are written" in out, \
            (what, out[-3000:])
    rows = {name: results.read_csv(name) for name in ("tensor_parallel.csv", "expert_parallel.csv",
                                                      "sharding.csv", "checkpoint.csv")}
    assert {r["variant"] for r in rows["tensor_parallel.csv"]} == {"megatron"}
    assert results.read_csv("sequence_parallel.csv") == []
    assert [(r["measure"], r["tokens_per_rank"]) for r in rows["expert_parallel.csv"]] == \
        [("step", "12")]
    assert [r["impl"] for r in rows["sharding.csv"]] == ["none"]
    assert [(r["impl"], r["op"]) for r in rows["checkpoint.csv"]] == [("ours", "save"),
                                                                      ("ours", "load")]
