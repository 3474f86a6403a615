"""`lmlab generate` / `python generate.py` run=<run dir> prompt="..." — sample text from a trained model, streamed."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import hydra
from omegaconf import DictConfig

from lmlab.cli import PROG, quote_paths
from lmlab.commands.refusals import refuse_unknown, usage_errors
from lmlab.env import plain_warnings, quick_exit


def run(prog: str, argv: Sequence[str]) -> None:
    """The command line `prog argv...` (sweep job dirs hold '=' and ',')."""
    quick_exit()  # lmlab.env: the process ends without the teardown's walks over torch's objects
    plain_warnings(prog.removeprefix("python "))  # lmlab's own warnings: one line each
    PROG["generate"] = prog
    sys.argv = [sys.argv[0], *quote_paths(argv, ("run",))]
    refuse_unknown("generate", "generate", sys.argv[1:])  # one line for a misspelt group, option or key
    main()


@hydra.main(config_path="../conf", config_name="generate", version_base="1.3")
@usage_errors("generate")
def main(cfg: DictConfig) -> None:
    from lmlab.analysis.generate import run_generate

    run_generate(cfg)


if __name__ == "__main__":  # how Lightning's DDP launcher starts the other ranks of `lmlab generate` (lmlab/commands)
    run("lmlab generate", sys.argv[1:])
