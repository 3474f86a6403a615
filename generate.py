"""python generate.py run=<run dir> prompt="..." — sample text from a trained model, streamed to the terminal."""

import sys

import hydra
from omegaconf import DictConfig

from lmlab.cli import quote_paths, usage_errors

sys.argv = [sys.argv[0], *quote_paths(sys.argv[1:], ("run",))]  # sweep job dirs hold '=' and ','


@hydra.main(config_path="lmlab/conf", config_name="generate", version_base="1.3")
@usage_errors("generate.py")
def main(cfg: DictConfig) -> None:
    from lmlab.generate import run_generate

    run_generate(cfg)


if __name__ == "__main__":
    main()
