"""make bench end to end at tiny sizes, for tests/test_bench.py: the real driver
(bench/make_bench.py) and the real scripts, with a plan of tiny steps in place of its own.
Started by tests/conftest.py at the start of the session (RESULTS_DIR, TMPDIR and
BENCH_BUDGET_S set there); not meant to be run by hand."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import make_bench

WHERE = ["--backend", "gloo", "--device", "cpu"]
LM = ["--model", "tiny", "--batch-size", "4", "--context-length", "16"]


def tiny_plan(setup, quick, model, trace_dir):
    return [make_bench.Step(key, key, argv, share_s=140, min_s=10) for key, argv in [
        ("allreduce", ["bench/allreduce_sweep.py", *WHERE, "--sizes", "4100B,256KB",
                       "--world-sizes", "2", "--iters", "3", "--warmup", "1"]),
        ("ddp", ["bench/ddp_step.py", *WHERE, *LM, "--bucket-sizes",
                 "0.01,1", "--steps", "4", "--warmup", "1", "--case-budget-s", "1e-6"]),
        ("profile", ["bench/profile_ddp.py", *WHERE, *LM,
                     "--trace-dir", trace_dir]),
        ("tp", ["07_parallelism/measure/bench_tensor_parallel.py", "--bench", *WHERE, "--d-model", "32",
                "--d-ff", "64"]),
        ("pp", ["07_parallelism/measure/bench_pipeline.py", "--world-size", "2",
                *WHERE, "--layers", "4", "--d-model", "16", "--hidden", "32", "--batch", "8",
                "--micro-batches", "2", "--emulate-ms", "5", "--iters", "1"]),
        ("ledger", ["07_parallelism/measure/bench_fsdp.py", "--bench", *WHERE, *LM, "--steps", "1",
                    "--warmup", "0", "--rounds", "1", "--checkpointing", "off"]),
        ("cp", ["07_parallelism/measure/bench_context_parallel.py", "--bench",
                "--world-size", "2", *WHERE, "--seqs", "32", "--batch", "1", "--heads", "1",
                "--head-dim", "4", "--warmup", "0", "--iters", "1", "--emulate-ms", "20"]),
        ("compute", ["bench/compute.py", "--device", "cpu", "--models", "tiny", "--batch-size",
                     "2", "--context-length", "16", "--steps", "1", "--warmup", "1",
                     "--matmul-n", "256"]),
        ("prediction", ["07_parallelism/measure/check_prediction.py", "--backend", "gloo",
                        "--device", "cpu"])]]


make_bench.plan = tiny_plan
make_bench.main()
