# Set-up is part of each target: the first run installs lmlab (editable, from this checkout) and its pinned
# dependencies into the Python on PATH (a venv when one is active: see the README), then only checks.
PYTHON ?= python

# lmlab is importable from outside the checkout, and it is this checkout's (not another clone's editable install)
THIS_LMLAB = $(PYTHON) -c "import os, sys, importlib.util as u; os.chdir('/'); s = u.find_spec('lmlab'); \
	sys.exit(not (s and s.origin.startswith('$(CURDIR)/')))"
# and these packages are there (found, not imported: a second, not ten)
HAS = $(PYTHON) -c "import sys, importlib.util as u; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))"
RUN_DEPS = torch lightning hydra omegaconf wandb datasets tokenizers matplotlib tensorboardX
DEV_DEPS = $(RUN_DEPS) pytest xdist transformers hydra_plugins.hydra_submitit_launcher hydra_plugins.hydra_optuna_sweeper \
	lm_eval accelerate tensorboard playwright hypothesis torchao

.PHONY: install dev train test test-all bench

# $(call INSTALL,packages,pip target): nothing when this checkout and the packages are there; this checkout alone
# (--no-deps) in place of another clone's editable install; else the pip target with its dependencies. --no-compile:
# Python compiles the modules a run imports when it first imports them, not every file of every package at install
# (pip's default: some 40 s here, mostly of torch's and transformers' modules no run imports)
INSTALL = @($(THIS_LMLAB) && $(HAS) $(1)) 2>/dev/null || \
	($(HAS) $(1) 2>/dev/null && $(PYTHON) -m pip install -q --no-compile --no-deps -e .) || \
	$(PYTHON) -m pip install -q --no-compile -e '$(2)'

# what running needs: lmlab and its dependencies (the `lmlab` command, train.py, eval.py, generate.py)
install:
	$(call INSTALL,$(RUN_DEPS),.)

# what the tests need too: transformers, the SLURM and Optuna launchers, lm-eval, pytest
dev:
	$(call INSTALL,$(DEV_DEPS),.[dev])

train: install
	$(PYTHON) train.py $(ARGS)

# pytest-xdist workers, one test file each at a time (a file's shared fixtures, e.g. its trained runs, are made once),
# in the order tests/conftest.py puts them (longest first; not xdist's own, which puts the files with most tests first);
# one CPU thread each. `make test WORKERS=0` runs in this process, one test after the other.
WORKERS ?= auto
XDIST = $(if $(filter 0,$(WORKERS)),-p no:xdist,-n $(WORKERS) --dist loadfile --no-loadscope-reorder)

# Bytecode is written (where the machine sets PYTHONDONTWRITEBYTECODE, every process the tests start compiled lmlab's
# modules again: half a second of each train.py, and the suite starts hundreds)
TEST_ENV = OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=

# units: no training run, no process started (two and a half minutes here, on two workers)
test: dev
	$(TEST_ENV) $(PYTHON) -m pytest -q $(XDIST) $(ARGS)

# everything: units, e2e (runs, processes, sweeps) and slow; what CI runs (the 40 slowest tests listed at the end:
# where the suite's time goes). One worker more than cores unless WORKERS is given: the end-to-end tests wait on
# their processes, SLURM and sockets (a twentieth of the machine idle with a worker per core; 22 minutes became 20)
test-all: WORKERS := $(if $(filter file,$(origin WORKERS)),$(shell $(PYTHON) -c \
	"import os; print(len(os.sched_getaffinity(0)) + 1)"),$(WORKERS))
test-all: dev
	$(TEST_ENV) $(PYTHON) -m pytest -q $(XDIST) -m "" --durations=40 $(ARGS)

bench: dev
	$(PYTHON) -m lmlab.bench $(ARGS)
