"""lm-eval (EleutherAI's evaluation harness, the `eval` extra) on a run: `python eval.py run=<run> harness=<tasks>`.

A run whose architecture transformers represents is exported (lmlab.interop.hf) and evaluated by lm-eval's own
`HFLM`, the path most published numbers take; any other architecture goes through `LmlabLM`, an lm-eval model
over lmlab's own GPT: loglikelihood and rolling loglikelihood (lmlab.run.scoring.ScoringLM, which the evaluation
during training, `downstream:`, shares) and generation, with the same conventions as HFLM
(a continuation's tokens are those of context + continuation after the context's; inputs longer than the model's
context keep their last tokens). lmlab's tokenizers have no begin-of-text token, so a text scored on its own (rolling
loglikelihood) is conditioned on a newline, the corpus's document separator, on both routes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from lmlab.analysis.generate import generate
from lmlab.record.rundir import RunDir, atomic_write, dumps, load_model
from lmlab.run.scoring import ScoringLM, _lm_base, prefix_token  # noqa: F401  (moved to run/: importable here, as before)


class LmlabLM(ScoringLM):
    """lm-eval's model interface over an lmlab GPT and its tokenizer (a `tokenizers.Tokenizer`): lmlab.run.scoring's
    loglikelihood and rolling loglikelihood (what training's downstream evaluation scores with), and generation."""

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            context, kwargs = req.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            ids = torch.tensor([self._encode(context)[-self.max_length:]])
            new = generate(self.model, ids, int(kwargs.get("max_gen_toks", 256)), temperature=temperature)
            text = self.tok.decode(new[0, ids.size(1):].tolist())
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out


def harness_model(run_dir: str | Path, batch_size: int = 8, route: str = "auto") -> tuple[Any, str]:
    """(lm-eval model, route): 'hf' (an export read by lm-eval's HFLM) when transformers represents the run's
    architecture, else 'lmlab' (LmlabLM). `route` forces one."""
    from lmlab.data.tokenizer import load_tokenizer
    from lmlab.interop.hf import NotRepresentable, export, family

    run = RunDir(run_dir)
    model = load_model(run.path)
    if not model.head.predicts_next:  # lm-eval scores continuations by their next-token log-likelihoods
        raise ValueError(f"run={run.path} trained head={model.cfg.head['name']}, which does not predict the next "
                         f"token: lm-eval's log-likelihoods do not apply")
    if route in ("auto", "hf"):
        try:
            family(model.cfg)
        except NotRepresentable:
            if route == "hf":
                raise
        else:
            from lm_eval.models.huggingface import HFLM

            out = Path(tempfile.mkdtemp(prefix="lmlab-hf-"))
            export(run.path, out)
            tok = load_tokenizer(run.tokenizer, model.cfg.vocab_size)
            lm = HFLM(pretrained=str(out), device="cpu", dtype="float32", batch_size=batch_size,
                      max_length=model.cfg.max_seq_len, add_bos_token=False, prefix_token_id=prefix_token(tok))
            return lm, "hf"
    return LmlabLM(model, load_tokenizer(run.tokenizer, model.cfg.vocab_size), batch_size), "lmlab"


def run_harness(run_dir: str | Path, tasks: list[str], *, include: str | None = None, limit: int | None = None,
                batch_size: int = 8, route: str = "auto", log_samples: bool = False) -> dict[str, Any]:
    """lm-eval's simple_evaluate over `tasks` (names, or tasks defined in YAML files under `include`)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    lm, used = harness_model(run_dir, batch_size, route)
    manager = TaskManager(include_path=include) if include else TaskManager()
    results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                      log_samples=log_samples, batch_size=batch_size)
    results["lmlab_route"] = used
    return results


def harness_cli(cfg: Any) -> dict[str, Any]:
    """eval.py run=<run> harness=<tasks>: run lm-eval, print its table, write <out or run/eval>/harness.json."""
    from lm_eval.utils import make_table


    tasks = list(cfg.harness) if not isinstance(cfg.harness, str) else cfg.harness.split(",")
    results = run_harness(cfg.run, tasks, include=cfg.get("harness_include"), limit=cfg.get("harness_limit"),
                          batch_size=cfg.batch_size)
    out = Path(cfg.out or Path(cfg.run) / "eval")
    record = {"run": str(cfg.run), "route": results["lmlab_route"], "tasks": tasks, "results": results["results"]}
    atomic_write(out / "harness.json", dumps(record))
    print(f"lm-eval through the {results['lmlab_route']} route\n{make_table(results)}\n-> {out / 'harness.json'}")
    return record
