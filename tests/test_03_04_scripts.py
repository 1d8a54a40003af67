"""Stages 03 and 04 as a user meets them: the scripts' plain runs, --bench, bad input, and
each DDP file copied alone into an empty folder. (The DDP classes' equivalence with
single-process training is tests/test_ddp_equivalence.py.)"""

from __future__ import annotations

import csv
import shutil
import textwrap

import pytest

import flat_ddp
import naive_ddp
from common import step_bench
from helpers import REPO, run_script

SCRIPTS = {"naive": REPO / "03_naive_ddp" / "naive_ddp.py",
           "flat": REPO / "04_flat_ddp" / "flat_ddp.py"}
QUICK_BENCH = ["--batch-size", "2", "--context-length", "16", "--steps", "2", "--warmup", "1"]


@pytest.mark.parametrize("impl", list(SCRIPTS))
def test_plain_run_verifies_against_single_process(impl):
    r = run_script(SCRIPTS[impl], "--world-size", "2", "--backend", "gloo", "--device", "cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("[ok]") == 5, r.stdout
    assert "FAIL" not in r.stdout
    for what in ["ToyModel", "TiedModel", "BranchModel", "BatchNormModel", "TransformerLM",
                 "bitwise equal across ranks: True", "all checks passed"]:
        assert what in r.stdout, what


def test_bench_rows_upserted_by_both_stages(tmp_path):
    for impl, extra in [("flat", []),  # 04 writes naive+flat+references; 03 then its own,
                        ("naive", ["--steps", "5", "--case-budget-s", "1e-6",  # capped,
                                   "--rounds", "2"])]:  # and written after each round
        env = {"RESULTS_DIR": str(tmp_path), "RESULTS_RUN_ID": f"run-{impl}"}
        r = run_script(SCRIPTS[impl], "--bench", "--world-size", "2", "--backend", "gloo",
                       "--device", "cpu", *QUICK_BENCH, *extra, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "ms/step" in r.stdout and "vs_torch_ddp" in r.stdout
    # the per-case budget: 2 timed steps (the minimum) instead of 5, and said so
    assert "note: 2 timed steps instead of 5" in r.stdout, r.stdout
    with (tmp_path / "ddp_step.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        columns, rows = reader.fieldnames, list(reader)
    assert columns[:12] == step_bench.CSV_COLUMNS
    keys = [tuple(r[k] for k in step_bench.CSV_KEY) for r in rows]
    assert len(keys) == len(set(keys)), keys  # upsert: no duplicates
    assert sorted(r["impl"] for r in rows) == ["flat", "naive", "none", "torch_ddp"]
    for r in rows:
        assert (r["backend"], r["device"], r["world_size"], r["model"]) == ("gloo", "cpu", "2", "tiny")
        assert float(r["step_ms"]) > 0 and 0 <= float(r["comm_share"]) <= 1
        assert float(r["comm_after_backward_ms"]) <= float(r["step_ms"])
    by_impl = {r["impl"]: r for r in rows}
    assert by_impl["flat"]["run_id"] == "run-flat"  # each row says which run wrote it
    assert {by_impl[i]["run_id"] for i in ("naive", "none", "torch_ddp")} == {"run-naive"}
    assert {r["steps"] for r in rows if r["impl"] == "flat"} == {"2"}
    assert {r["steps"] for r in rows if r["impl"] != "flat"} == {"4"}  # 2 rounds x 2, pooled
    assert float(by_impl["torch_ddp"]["ratio_vs_torch_ddp"]) == 1.0
    assert by_impl["torch_ddp"]["bucket_mb"] == "25" and by_impl["naive"]["bucket_mb"] == ""


@pytest.mark.parametrize("argv, says", [
    (["--bench", "--world-size", "2", "--batch-size", "3"], "not divisible by world size 2"),
    (["--bench", "--model", "huge"], "invalid choice: 'huge'"),
    (["--bench", "--steps", "0"], "--steps must be >= 1"),
    (["--bench", "--model", "2.7B", "--world-size", "64", "--batch-size", "64"], "GiB"),
    (["--world-size", "0"], "--world-size must be >= 1"),
])
@pytest.mark.parametrize("module", [naive_ddp, flat_ddp], ids=["naive", "flat"])
def test_bad_input_is_one_line_exit_2(module, argv, says, capsys):
    # main() validates before any worker starts, so calling it in-process is enough here.
    with pytest.raises(SystemExit) as exc:
        module.main([*argv, "--backend", "gloo", "--device", "cpu"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert len(err.strip().splitlines()) == 1 and says in err, err


COPY_CHECK = textwrap.dedent("""
    import sys, tempfile, os
    import torch, torch.distributed as dist, torch.nn as nn
    mod = __import__(sys.argv[1])
    assert os.path.dirname(os.path.abspath(mod.__file__)) == os.getcwd(), mod.__file__
    assert "common" not in sys.modules, "the algorithm imported common"
    store = tempfile.mktemp()
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    net[2].bias.requires_grad_(False)
    ddp = getattr(mod, sys.argv[2])(net)
    assert ddp.module is net
    x = torch.randn(6, 4)
    ddp(x).square().mean().backward()
    want = [p.grad.clone() for p in net.parameters() if p.requires_grad]
    ddp.finish_gradient_synchronization()   # one rank: the average is the gradient itself
    got = [p.grad for p in net.parameters() if p.requires_grad]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert net[2].bias.grad is None
    frozen = nn.Linear(2, 2).requires_grad_(False)
    try:
        getattr(mod, sys.argv[2])(frozen)
        raise SystemExit("no error for a model without trainable parameters")
    except ValueError as e:
        assert "require grad" in str(e)
    dist.destroy_process_group()
    print("copy-one-file ok", sys.argv[1])
""")


@pytest.mark.parametrize("impl, cls", [("naive", "NaiveDDP"), ("flat", "FlatDDP")])
def test_copy_one_file(impl, cls, tmp_path):
    shutil.copy(SCRIPTS[impl], tmp_path / SCRIPTS[impl].name)
    r = run_script("-s", "-c", COPY_CHECK, SCRIPTS[impl].stem, cls, cwd=tmp_path,
                   env={"PYTHONPATH": ""}, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"copy-one-file ok {SCRIPTS[impl].stem}" in r.stdout
