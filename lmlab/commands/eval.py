"""`lmlab eval` / `python eval.py` run=<run dir> | compare=<multirun dir> — evaluate a run, or compare a sweep."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import hydra
from omegaconf import DictConfig, OmegaConf

from lmlab.cli import PROG, as_lists, quote_paths
from lmlab.commands.refusals import refuse_unknown, usage_errors
from lmlab.env import plain_warnings, quick_exit

# `rope_scaling=none,linear` (and `harness=a,b`) is one list here, not a sweep; run paths from sweeps hold '=' and ','.
LISTS = {"rope_scaling": "methods", "methods": "methods", "lengths": "lengths", "harness": "harness",
         "depths": "depths"}


def run(prog: str, argv: Sequence[str]) -> None:
    """The command line `prog argv...`."""
    quick_exit()  # lmlab.env: the process ends without the teardown's walks over torch's objects
    plain_warnings(prog.removeprefix("python "))  # lmlab's own warnings: one line each
    PROG["eval"] = prog
    sys.argv = [sys.argv[0], *quote_paths(as_lists(argv, LISTS), ("run", "compare", "out", "hf"))]
    refuse_unknown("eval", "eval", sys.argv[1:])  # one line for a misspelt group, option or key
    main()


@hydra.main(config_path="../conf", config_name="eval", version_base="1.3")
@usage_errors("eval")
def main(cfg: DictConfig) -> None:
    from pathlib import Path

    from lmlab import env
    from lmlab.registry import PositiveInt, check_value

    check_value("threads", cfg.threads, PositiveInt | None)  # the other arguments: evaluate() checks them first
    env.offline()
    env.set_threads(cfg.threads)
    if cfg.compare:
        from lmlab.analysis.compare import compare, output_dir, sweep_dirs

        dirs = sweep_dirs(list(cfg.compare) if OmegaConf.is_list(cfg.compare) else cfg.compare)
        _, md = compare(dirs, baseline=cfg.get("baseline"), target=cfg.get("target"), out=cfg.get("out"))
        files = ("compare.md", "compare_variants.md", "compare_significance.md", "compare_noise.md", "compare_seeds.md",
                 "compare_speed.md", "plots/")
        written = [f"{output_dir(dirs, cfg.get('out')) / f}" for f in files]
        print(md + "\n-> " + ", ".join(p for p in written if Path(p).exists()))
        return
    if cfg.hf:  # a transformers directory, read as a run (its own eval output goes to out or <hf>/eval)
        import tempfile

        from lmlab import compose
        from lmlab.interop.hf import as_run

        data = compose([f"data={cfg.hf_data}", *([f"data.paths=[{','.join(cfg.hf_data_paths)}]"]
                                                  if cfg.hf_data_paths else [])]).data
        cfg.out = cfg.out or str(Path(cfg.hf) / "eval")
        cfg.run = str(as_run(cfg.hf, tempfile.mkdtemp(prefix="lmlab-hf-run-"), OmegaConf.to_container(data)))
    if not cfg.run:
        raise ValueError("one of run=<run dir>, hf=<transformers dir> or compare=<multirun dir> is needed")
    if cfg.weights != "live" and (cfg.export or cfg.harness):
        raise ValueError(f"weights={cfg.weights}: the evaluation reads it; export= and harness= read the live "
                         f"weights (weights=live)")
    if cfg.get("merge") is not None:  # last:k[:linear] (lmlab.record.merge), checked before anything is read
        from lmlab.record.merge import parse_merge

        parse_merge(cfg.merge)
        if cfg.export or cfg.harness:
            raise ValueError(f"merge={cfg.merge}: the evaluation reads it; export= and harness= read the live weights")
    if cfg.export:
        if cfg.export != "hf" or not cfg.out:
            raise ValueError(f"export={cfg.export!r}: the accepted form is export=hf out=<dir>")
        from lmlab.interop.hf import export

        print(f"-> {export(cfg.run, cfg.out)}/ (AutoModelForCausalLM / AutoTokenizer .from_pretrained)")
        return
    if cfg.retrieval:
        from lmlab.analysis.retrieval import run_retrieval

        listed = lambda v: None if v is None else list(v) if OmegaConf.is_list(v) else [v]  # noqa: E731
        if cfg.weights != "live" or cfg.get("merge") is not None:
            raise ValueError(f"retrieval={cfg.retrieval} reads the run's live weights (weights=live, no merge=)")
        _, md = run_retrieval(cfg.run, cfg.retrieval, listed(cfg.lengths), listed(cfg.depths), cfg.retrieval_samples,
                              cfg.retrieval_keys, cfg.batch_size, cfg.allow_extrapolation,
                              Path(cfg.out) if cfg.out else None)
        print(md + f"\n-> {Path(cfg.out or Path(cfg.run) / 'eval_retrieval')}/")
        return
    if cfg.harness:
        from lmlab.analysis.harness import harness_cli

        harness_cli(cfg)
        return
    import signal

    from lmlab.analysis.cells import Interrupted
    from lmlab.analysis.evaluate import evaluate

    listify = lambda v: None if v is None else (list(v) if OmegaConf.is_list(v) else [v])  # noqa: E731
    merge = cfg.get("merge")  # last:k[:linear] -> eval_merge_last_k[_linear], beside eval/ (lmlab.record.merge)
    named = f"eval_merge_{str(merge).replace(':', '_')}" if merge is not None else \
        "eval" if cfg.weights == "live" else f"eval_{cfg.weights}"
    out = Path(cfg.out or Path(cfg.run) / named)
    got: list[int] = []

    def terminate(signum: int, frame: object) -> None:  # SIGTERM (a cluster's, kill): as Ctrl-C, cells kept
        got.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    try:
        result = evaluate(cfg.run, lengths=listify(cfg.lengths), scalings=listify(cfg.methods),
                          allow_extrapolation=cfg.allow_extrapolation, batch_size=cfg.batch_size, out_dir=out,
                          max_windows=cfg.max_windows, dynamic_step=cfg.dynamic_step, weights=cfg.weights,
                          merge=merge)
    except Interrupted as stop:
        print(f"{PROG['eval'].removeprefix('python ')}: {stop.line}", file=sys.stderr)
        raise SystemExit(128 + (got[0] if got else signal.SIGINT)) from None
    print((f"note: {result['note']}\n\n" if result["note"] else "") + (out / "eval.md").read_text() + f"\n-> {out}/")


if __name__ == "__main__":  # how Lightning's DDP launcher starts the other ranks of `lmlab eval` (lmlab/commands)
    run("lmlab eval", sys.argv[1:])
