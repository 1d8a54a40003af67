# Distributed training from scratch: every command a learner or a CI needs.
#
#   make run     every stage in order on Gloo/CPU, small sizes (a few minutes on a laptop)
#   make test    the test suite (pytest, Gloo/CPU)
#   make check   every stage's and lesson's check on this box's device (DEVICE=cpu by default;
#                `make check DEVICE=cuda` on a GPU box: the first command to run there)
#   make bench   the measurements worth making on a GPU box (small sizes on CPU)
#   make train   07's capstone: the course LM on real text, one process and a 2 x 2 grid
#   make plan    07's planning lesson: every grid of MODEL on CLUSTER ranked, predicted (no GPU)
#   make 01 ... make 07   one stage
#   make diff S=04   what the algorithm changed from the stage before (03 -> 04 -> 05 -> 06)
#
# Python: PYTHON=... on the command line wins (e.g. `make bench PYTHON=python3` on a box whose
# Python already has torch). Otherwise: the project's .venv if it exists, else a python3 that
# already imports torch, tabulate and numpy, else a new .venv made by `make install`.
# `make bench` takes a python3 that imports torch as it is (tabulate and matplotlib are
# optional there), so it runs offline on a GPU box without creating a venv.

VENV          := .venv
DEVICE        ?= cpu
TORCH_VERSION ?= 2.13.0
# torch's CPU build by default (the course runs on the CPU; the default index on Linux brings
# the CUDA build and several GB of nvidia-* packages). Another build: TORCH_INDEX=<its index>
# (e.g. PyTorch's cu126 index); the default index: TORCH_INDEX= (empty). Where the index cannot
# be reached, install falls back to the default index and says so.
TORCH_INDEX   ?= https://download.pytorch.org/whl/cpu
# The other dependencies follow pyproject.toml.
DEPS          := "tabulate>=0.9" "numpy>=1.24" "pytest>=7" "matplotlib>=3.7"

ifeq ($(origin PYTHON), undefined)
  PYTHON := $(shell if [ -x $(VENV)/bin/python ]; then echo $(VENV)/bin/python; \
              elif python3 -c "import torch, tabulate, numpy" >/dev/null 2>&1; then echo python3; \
              else echo $(VENV)/bin/python; fi)
  BENCH_PYTHON := $(shell if [ -x $(VENV)/bin/python ]; then echo $(VENV)/bin/python; \
              elif python3 -c "import torch" >/dev/null 2>&1; then echo python3; \
              else echo $(VENV)/bin/python; fi)
else
  BENCH_PYTHON := $(PYTHON)
endif

SHELL := /bin/bash
.PHONY: install run test check bench clean diff train plan 01 02 03 04 05 06 07

install:
	@if $(PYTHON) -c "import torch, tabulate, numpy" >/dev/null 2>&1; then \
	    true; \
	else \
	    python3 -m venv $(VENV) && \
	    if [ -n "$(TORCH_INDEX)" ] && python3 -c "import urllib.request; urllib.request.urlopen('$(TORCH_INDEX)/torch/', timeout=10)" >/dev/null 2>&1; then \
	        echo "install: creating $(VENV): torch==$(TORCH_VERSION) from $(TORCH_INDEX)"; \
	        $(VENV)/bin/pip install --quiet --disable-pip-version-check --index-url $(TORCH_INDEX) torch==$(TORCH_VERSION); \
	    else \
	        echo "install: creating $(VENV): torch==$(TORCH_VERSION) from the default index$(if $(TORCH_INDEX), ($(TORCH_INDEX) cannot be reached),)"; \
	        $(VENV)/bin/pip install --quiet --disable-pip-version-check torch==$(TORCH_VERSION); \
	    fi && \
	    $(VENV)/bin/pip install --quiet --disable-pip-version-check $(DEPS) && \
	    $(VENV)/bin/python -c "import torch; print('install: got torch', torch.__version__, '(CUDA ' + torch.version.cuda + ' build)' if torch.version.cuda else '(CPU build)')"; \
	fi
	@$(PYTHON) -c "import pytest" >/dev/null 2>&1 || $(PYTHON) -m pip install --quiet "pytest>=7"

run: install
	@for stage in 01 02 03 04 05 06 07; do $(MAKE) --no-print-directory $$stage PYTHON=$(PYTHON) || exit 1; done

test: install
	$(PYTHON) -m pytest tests -q

# Each script checks itself against one process on $(DEVICE); a backend/device pair a lesson
# cannot carry is refused in one line and shown as "refused"; a summary table at the end.
check:
	@$(BENCH_PYTHON) -c "import torch" >/dev/null 2>&1 || $(MAKE) --no-print-directory install
	$(BENCH_PYTHON) bench/check.py --device $(DEVICE)

01: install
	$(PYTHON) 01_collectives/collectives.py --world-size 4 --backend gloo --device cpu

02: install
	$(PYTHON) 02_allreduce_bench/allreduce_bench.py --backend gloo --device cpu --sizes 64KB,1MB,10MB --world-sizes 2,4

03: install
	$(PYTHON) 03_naive_ddp/naive_ddp.py --backend gloo --device cpu

04: install
	$(PYTHON) 04_flat_ddp/flat_ddp.py --backend gloo --device cpu

05: install
	$(PYTHON) 05_overlap_ddp/overlap_ddp.py --backend gloo --device cpu

06: install
	$(PYTHON) 06_bucketed_ddp/bucketed_ddp.py --backend gloo --device cpu

07: install
	$(PYTHON) 07_parallelism/01_zero/run_zero.py --backend gloo --device cpu
	$(PYTHON) 07_parallelism/02_fsdp/run_fsdp.py --backend gloo --device cpu
	$(PYTHON) 07_parallelism/03_tensor_parallel/run_tensor_parallel.py --backend gloo --device cpu
	$(PYTHON) 07_parallelism/04_pipeline_parallel/run_pipeline.py --backend gloo --device cpu
	$(PYTHON) 07_parallelism/05_context_parallel/run_context_parallel.py --backend gloo --device cpu
	$(PYTHON) 07_parallelism/06_expert_parallel/run_expert_parallel.py --backend gloo --device cpu --world-size 4
	$(PYTHON) 07_parallelism/07_together/train.py --backend gloo --device cpu --world-size 4 --dp 2 --tp 2 --steps 40 --log-every 20 --check
	$(PYTHON) 07_parallelism/08_checkpoints/run_checkpoint.py --backend gloo --device cpu --world-size 4
	$(PYTHON) 07_parallelism/09_planning/run_planning.py --model course --cluster 8xH100-nvlink --top 5
	$(PYTHON) 07_parallelism/10_hangs/run_hangs.py --backend gloo --device cpu
	$(PYTHON) 07_parallelism/11_muon/run_muon.py --backend gloo --device cpu --world-size 4

# The capstone on real text: one process, then the same run on a 2 x 2 grid (data x tensor
# parallel); the second draws both loss curves in results/train_loss.png and samples text.
# Lesson 9: which grid for this model on that cluster, predicted from the lessons' formulas and
# a spec sheet (arithmetic: runs anywhere). MODEL: a course preset or llama3-8b; CLUSTER: a
# preset of 07_parallelism/09_planning/planner.py.
MODEL   ?= small
CLUSTER ?= 8xH100-nvlink
plan: install
	$(PYTHON) 07_parallelism/09_planning/run_planning.py --model $(MODEL) --cluster $(CLUSTER)

train: install
	$(PYTHON) 07_parallelism/07_together/train.py --backend gloo --device cpu --world-size 1 --dp 1 --steps 1000 --log-every 200
	$(PYTHON) 07_parallelism/07_together/train.py --backend gloo --device cpu --world-size 4 --dp 2 --tp 2 --steps 1000 --log-every 100

# The algorithm part of a stage file: from its imports to the harness marker.
ALGORITHM = sed -n '/^from __future__/,/^\# -* harness/p'
diff:
	@case "$(S)" in 04|05|06) ;; *) echo "make diff S=04|05|06: the algorithm diff from the stage before" >&2; exit 2;; esac
	@prev=$$(ls 0$$(( $(S) - 1 ))_*/*_ddp.py); this=$$(ls $(S)_*/*_ddp.py); \
	diff -u --label "$$prev" --label "$$this" <($(ALGORITHM) $$prev) <($(ALGORITHM) $$this); true

# keeps the committed bench report and the files behind it (results/README.md, bench_*.png,
# *.csv, *.json); removes traces, stage pictures and a killed report's folder (results/.report-*)
clean:
	rm -rf .pytest_cache traces results/traces results/.report-*
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	find results -type f ! -name .gitkeep ! -name README.md ! -name 'bench_*.png' ! -name '*.csv' ! -name '*.json' -delete

bench:
	@$(BENCH_PYTHON) -c "import torch" >/dev/null 2>&1 || $(MAKE) --no-print-directory install
	$(BENCH_PYTHON) bench/make_bench.py
