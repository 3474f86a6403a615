"""lm-eval's scoring of an lmlab GPT in memory: what `eval.py harness=` (lmlab.analysis.harness) and the evaluation
during training (`downstream:`, lmlab.run.downstream) share, here below both so that a training run can use it.

`ScoringLM` is lm-eval's model interface over the GPT and its tokenizer (a `tokenizers.Tokenizer`) for the requests
that score text: loglikelihood and rolling loglikelihood, with the same conventions as lm-eval's HFLM (a
continuation's tokens are those of context + continuation after the context's; inputs longer than the model's
context keep their last tokens; lmlab's tokenizers have no begin-of-text token, so a text scored on its own is
conditioned on a newline, the corpus's document separator). Generation (`generate_until`) is analysis/harness.py's
`LmlabLM`, which adds it to this class. `load_tasks` and `score` run a task list the way lm-eval's simple_evaluate
does (its task preparation, then lm-eval's own `evaluate`), without reseeding the process's random generators.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lmlab.model.gpt import GPT

SCORED = ("loglikelihood", "multiple_choice", "loglikelihood_rolling")  # the output types ScoringLM answers
FEWSHOT_SEED = 1234  # lm-eval's simple_evaluate default (fewshot_random_seed): the same few-shot examples as it


def _lm_base() -> type:
    from lm_eval.api.model import LM

    return LM


def prefix_token(tokenizer: Any) -> int:
    """The token a text on its own is conditioned on: end/begin-of-text if the tokenizer has one, else a newline."""
    for name in ("<|endoftext|>", "</s>", "<s>", "<eos>", "<bos>"):
        if (i := tokenizer.token_to_id(name)) is not None:
            return i
    ids = tokenizer.encode("\n").ids
    if len(ids) != 1:
        raise ValueError("the tokenizer has no begin-of-text token and no single newline token to start a text with")
    return ids[0]


class ScoringLM(_lm_base()):
    """lm-eval's model interface over an lmlab GPT and its tokenizer: loglikelihood and rolling loglikelihood."""

    def __init__(self, model: GPT, tokenizer: Any, batch_size: int = 8) -> None:
        super().__init__()
        self.model, self.tok, self.batch_size = model.eval(), tokenizer, batch_size
        self.max_length = model.cfg.max_seq_len
        self.prefix = prefix_token(tokenizer)

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    @torch.no_grad()
    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """log p(continuation | context) and whether greedy decoding would produce it."""
        ids = (context + continuation)[-(self.max_length + 1):]
        device = next(self.model.parameters()).device
        x = torch.tensor([ids[:-1]], device=device)
        logp = F.log_softmax(self.model(x)[0].float(), dim=-1)  # (T, V)
        n = len(continuation)
        rows, targets = logp[-n:], torch.tensor(ids[-n:], device=device)
        return float(rows.gather(1, targets[:, None]).sum()), bool((rows.argmax(-1) == targets).all())

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for req in requests:
            context, continuation = req.args
            whole, ctx = self._encode(context + continuation), self._encode(context)
            if not ctx:
                raise ValueError("lmlab's tokenizers have no begin-of-text token: a continuation needs a context")
            out.append(self._score(whole[: len(ctx)], whole[len(ctx):]))
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Sum of log p over every token of the text, conditioned on the prefix token, in disjoint windows of the
        model's context, each seeing up to a full context before it."""
        out = []
        for req in requests:
            ids = [self.prefix, *self._encode(req.args[0])]
            total = 0.0
            for start in range(1, len(ids), self.max_length):
                end = min(start + self.max_length, len(ids))
                total += self._score(ids[max(0, end - self.max_length - 1): start], ids[start:end])[0]
            out.append(total)
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError("generation is lmlab.analysis.harness.LmlabLM's (eval.py harness=)")


def load_tasks(files: Sequence[str | Path]) -> dict[str, Any]:
    """lm-eval's task dict (TaskManager.load) of task YAML `files` (lm-eval's own tasks are not indexed), prepared as
    simple_evaluate prepares them: num_fewshot 0 unless the task sets it, the few-shot sampler seeded with
    FEWSHOT_SEED."""
    from lm_eval.tasks import TaskManager

    loaded = TaskManager(include_defaults=False).load([str(f) for f in files])
    for task in loaded["tasks"].values():
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
    return loaded


def score(lm: Any, loaded: dict[str, Any], limit: int | None = None) -> dict[str, dict[str, Any]]:
    """lm-eval's `evaluate` of `lm` on the task dict `loaded` (its first `limit` documents per task; None: all):
    lm-eval's results per task and group ({"acc,none": ..., ...}), no standard errors (bootstrap_iters=0), no
    samples. The random generators of python, numpy and torch are left as they were."""
    import numpy as np
    from lm_eval.evaluator import evaluate

    states = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            results = evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=0, log_samples=False)
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
    return results["results"]
