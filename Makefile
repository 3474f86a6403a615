# Set-up is part of each target: the first run installs lmlab and its pinned dependencies.
PYTHON ?= python


.PHONY: install train test test-all bench

install:
	@$(PYTHON) -c "import lmlab, lightning, hydra, pytest, transformers, hydra_plugins.hydra_submitit_launcher, hydra_plugins.hydra_optuna_sweeper, lm_eval, accelerate" 2>/dev/null || \
		$(PYTHON) -m pip install -q -e '.[dev]'

train: install
	$(PYTHON) train.py $(ARGS)

# units: no training run, no process started (a few minutes)
test: install
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -q $(ARGS)

# everything: units, e2e (runs, processes, sweeps) and slow; what CI runs
test-all: install
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -q -m "" $(ARGS)

bench: install
	$(PYTHON) -m lmlab.bench $(ARGS)
