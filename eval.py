"""python eval.py run=<run dir> | compare=<multirun dir> — evaluate a run, or compare the runs of a sweep."""

import sys

import hydra
from omegaconf import DictConfig, OmegaConf



def _cli_arg(arg: str) -> str:
    """`rope_scaling=none,linear` would read as a Hydra sweep: for eval it is one list of methods. Run and sweep
    paths hold '=' and ',' (Hydra names sweep jobs by their overrides), so they are quoted for Hydra's parser."""
    key, _, value = arg.partition("=")
    if key in ("rope_scaling", "lengths") and "," in value and "[" not in value:
        return f"{key}=[{value}]"
    if key in ("run", "compare", "out") and value and value[0] not in "'\"":
        return f"{key}='{value}'"
    return arg


sys.argv = [sys.argv[0], *map(_cli_arg, sys.argv[1:])]


@hydra.main(config_path="conf", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from pathlib import Path

    if cfg.threads:
        import torch

        torch.set_num_threads(int(cfg.threads))
    if cfg.compare:
        from lmlab.compare import compare

        _, md = compare(cfg.compare)
        print(md + f"\n-> {Path(cfg.compare) / 'compare.md'}, {Path(cfg.compare) / 'plots'}/")
        return
    if not cfg.run:
        raise SystemExit("eval.py needs run=<run dir> or compare=<multirun dir>")
    from lmlab.evaluate import evaluate

    listify = lambda v: None if v is None else (list(v) if OmegaConf.is_list(v) else [v])  # noqa: E731
    out = Path(cfg.out or Path(cfg.run) / "eval")
    result = evaluate(cfg.run, lengths=listify(cfg.lengths), scalings=listify(cfg.rope_scaling),
                      allow_extrapolation=cfg.allow_extrapolation, batch_size=cfg.batch_size, out_dir=out,
                      max_windows=cfg.max_windows, dynamic_step=cfg.dynamic_step)
    print((out / "eval.md").read_text() + f"\n-> {out}/")


if __name__ == "__main__":
    main()
