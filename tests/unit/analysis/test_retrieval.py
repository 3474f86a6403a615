"""Retrieval across lengths (lmlab.analysis.retrieval): the prompts hold the planted fact(s) at the asked depth, the
question at the end and the answer after, exactly `length` context tokens; exact match by teacher forcing is what
greedy decoding writes (a model's own greedy continuation scores 1); an untrained model scores about 0 at every
length; the refusals by key; the markdown's table."""

from __future__ import annotations

import string

import numpy as np
import pytest
import torch

from lmlab.analysis.generate import generate
from lmlab.analysis.retrieval import END, FACT, IS, Prompt, check_args, exact_match, prompts, retrieval, write
from lmlab.config import GPTConfig
from lmlab.model.gpt import GPT, validate

CHARS = string.ascii_lowercase + " .,;'\n" + string.ascii_uppercase


def encode(text: str) -> list[int]:
    return [CHARS.index(c) for c in text]


TEXT = np.random.default_rng(0).integers(0, len(CHARS), 5000)


def _find(tokens: list[int], piece: list[int]) -> list[int]:
    return [i for i in range(len(tokens) - len(piece) + 1) if tokens[i:i + len(piece)] == piece]


@pytest.mark.parametrize("length, depth", [(64, 0.0), (64, 0.5), (200, 0.9), (200, 1.0)])
def test_a_passkey_prompt_holds_its_fact_at_the_depth_and_the_question_at_the_end(length: int, depth: float) -> None:
    for p in prompts(encode, TEXT, length, depth, "passkey", 5, seed=3):
        assert len(p.tokens) == length + 1 and p.answer == 5
        value = p.tokens[-5:]
        question_at = length + 1 - 5 - len(encode(FACT)) - 4 - len(encode(IS))
        key = p.tokens[question_at + len(encode(FACT)): question_at + len(encode(FACT)) + 4]
        fact = encode(FACT) + key + encode(IS) + value + encode(END)
        at = _find(p.tokens[:question_at], fact)
        filler = question_at - len(fact)
        assert at == [round(depth * filler)]  # once, at the depth of the text before the question
        assert p.tokens[question_at:question_at + len(encode(FACT))] == encode(FACT)


def test_multikey_plants_distinct_keys_and_asks_one() -> None:
    for p in prompts(encode, TEXT, 256, 0.25, "multikey", 4, seed=1, keys=4):
        facts = _find(p.tokens, encode(FACT))
        assert len(facts) == 5  # four facts and the question
        keys = [tuple(p.tokens[i + len(encode(FACT)): i + len(encode(FACT)) + 4]) for i in facts]
        assert len(set(keys[:4])) == 4 and keys[4] in keys[:4]  # distinct keys; the one asked is among them
        asked = keys[:4].index(keys[4])
        value_at = facts[asked] + len(encode(FACT)) + 4 + len(encode(IS))
        assert p.tokens[value_at:value_at + 5] == p.tokens[-5:]  # its value is the answer


def _model() -> GPT:
    cfg = GPTConfig(vocab_size=len(CHARS), n_layer=2, d_model=32, n_head=2, max_seq_len=256,
                    position={"name": "rope"}, attention={"name": "mha"})
    torch.manual_seed(0)
    return GPT(validate(cfg)).eval()


def test_exact_match_is_greedy_decoding_and_an_untrained_model_scores_about_zero() -> None:
    model = _model()
    batch = prompts(encode, TEXT, 96, 0.5, "passkey", 6, seed=2)
    assert exact_match(model, batch) == [False] * 6  # 5 letters in a row by an untrained model
    own = []  # the model's own greedy continuation of each question, as the answer: all hits
    for p in batch:
        context = torch.tensor([p.tokens[:-p.answer]])
        written = generate(model, context, p.answer, temperature=0.0)[0, -p.answer:].tolist()
        own.append(Prompt(p.tokens[:-p.answer] + written, p.answer))
    assert exact_match(model, own, batch_size=4) == [True] * 6
    wrong_last = [Prompt(p.tokens[:-1] + [(p.tokens[-1] + 1) % len(CHARS)], p.answer) for p in own]
    assert exact_match(model, wrong_last) == [False] * 6  # every answer token counts
    rows = retrieval(model, encode, TEXT, [64, 128], depths=[0.2, 0.8], samples=8)
    assert [(r["length"], r["depth"]) for r in rows] == [(64, 0.2), (64, 0.8), (128, 0.2), (128, 0.8)]
    assert all(r["accuracy"] <= 0.125 and r["n"] == 8 for r in rows)


def test_bad_arguments_are_refused_by_key_and_a_short_length_names_its_floor(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"retrieval='needle' is not a task; choose passkey or multikey"):
        check_args("needle", [0.5], 8, 4)
    with pytest.raises(ValueError, match=r"depths=\[0.5, 1.5\]: \[1.5\]"):
        check_args("passkey", [0.5, 1.5], 8, 4)
    with pytest.raises(ValueError, match=r"retrieval_keys=1 must be an integer >= 2"):
        check_args("multikey", [0.5], 8, 1)
    with pytest.raises(ValueError, match=r"retrieval at length 20: the facts, the question and the answer take 62 tokens; "
                                         r"use lengths >= 61"):
        prompts(encode, TEXT, 20, 0.5, "passkey", 1)
    md = write([{"family": "passkey", "length": 64, "depth": d, "keys": 1, "accuracy": a, "n": 4}
                for d, a in ((0.1, 0.5), (0.9, 1.0))], "run", tmp_path)
    assert "| 64 | 0.50 | 1.00 | 0.75 |" in md and (tmp_path / "retrieval.json").is_file()
