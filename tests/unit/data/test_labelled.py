"""data=labelled (lmlab.data.labelled): a JSONL labelled set read, tokenized and padded with [MASK], its labels named
and counted, its refusals; and the project's own set, Shakespeare's speeches by their play's First Folio genre."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from lmlab.data.labelled import FOLIO, LabelledDataModule, genre_set, label_names, speeches


def _write(path: Path, rows: list[tuple[str, object]]) -> Path:
    path.write_text("".join(json.dumps({"text": t, "label": label}) + "\n" for t, label in rows))
    return path


def _module(tmp_path: Path, rows: list[tuple[str, object]], **data) -> LabelledDataModule:
    dm = LabelledDataModule({"name": "labelled", "path": str(_write(tmp_path / "train.jsonl", rows)),
                             "cache_dir": str(tmp_path / "cache"), "batch_size": 2, **data}, seq_len=8, seed=3)
    dm.setup("fit")
    return dm


ROWS = [("abc", "yes"), ("a much longer text", "no"), ("cab", "maybe"), ("ba", "no"), ("c", "yes"),
        ("bb aa", "no"), ("aaa", "maybe"), ("abcabc", "no"), ("cc", "yes"), ("b", "no")]


def test_texts_are_tokenized_cut_and_padded_with_mask(tmp_path: Path) -> None:
    dm = _module(tmp_path, ROWS, val_fraction=0.2)
    assert dm.labels == ["maybe", "no", "yes"]  # sorted names; head=classify takes them
    assert dm.pad_id == dm.vocab_size == dm.tokenizer.get_vocab_size()  # [MASK]: the first id past the tokenizer's
    x, y = dm.train_x, dm.train_y
    assert x.shape == (8, 8) and len(dm.val_x) == 2  # the last fifth for validation
    first = dm.tokenizer.encode("abc").ids
    assert x[0, :3].tolist() == first and (x[0, 3:] == dm.pad_id).all()
    assert x[1].tolist() == dm.tokenizer.encode("a much longer text").ids[:8]  # cut at model.max_seq_len
    assert y.tolist() == [2, 1, 0, 1, 2, 1, 0, 1]
    counts = np.array([2, 4, 2]) / 8  # the labels' entropy: the loss of answering their frequencies
    assert dm.unigram_entropy("train") == pytest.approx(float(-(counts * np.log(counts)).sum()))
    assert dm.unigram_entropy("val") == pytest.approx(math.log(2))  # "cc" yes, "b" no
    a, b = next(iter(dm.train_dataloader()))
    assert a.shape == (2, 8) and b.shape == (2,) and a.dtype == torch.int64
    again = _module(tmp_path, ROWS, val_fraction=0.2)  # the order is the seed's: the same batches
    assert all(torch.equal(p, q) for p, q in zip(next(iter(again.train_dataloader())), (a, b)))


def test_labels_named_by_number_sort_by_value() -> None:
    assert label_names(["10", "2", "1", "2"]) == ["1", "2", "10"]
    assert label_names(["b", "a", "10"]) == ["10", "a", "b"]


def test_a_bad_labelled_set_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs data.path"):
        LabelledDataModule({"name": "labelled"}, seq_len=8, seed=0)
    with pytest.raises(ValueError, match="does not take"):
        LabelledDataModule({"name": "labelled", "path": "x", "paths": "y"}, seq_len=8, seed=0)
    with pytest.raises(ValueError, match="one label"):
        _module(tmp_path, [("a", 1), ("b", 1), ("c", 1)])
    val = _write(tmp_path / "val.jsonl", [("a", "other")])
    with pytest.raises(ValueError, match=r"labels the training set lacks: \['other'\]"):
        _module(tmp_path, ROWS, val_path=str(val))
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*\"label\""):
        _module(tmp_path, ROWS, val_path=str(tmp_path / "bad.jsonl"))


PLAY = """THE TRAGEDY OF SOMETHING

DRAMATIS PERSONAE

Ham.
To be, or not to be: that is the question:
[Aside.]
Whether 'tis nobler in the mind to suffer

First Citizen.
Short.

[Exeunt.]

KING.
We do it wrong, being so majestical,
To offer it the show of violence;
"""


def test_a_speech_is_its_lines_without_speaker_or_stage_directions() -> None:
    assert speeches(PLAY) == ["To be, or not to be: that is the question:\nWhether 'tis nobler in the mind to suffer",
                              "We do it wrong, being so majestical,\nTo offer it the show of violence;"]


def test_the_genre_set_is_balanced_labelled_by_the_folio_and_split_by_speech(tmp_path: Path) -> None:
    sizes = {"tempest": 9, "hamlet": 6, "lear": 5, "henry_v": 12}  # comedy 9, tragedy 11, history 12
    for play, n in sizes.items():
        text = "\n\n".join(f"A.\nSpeech number {i} of the play {play}, long enough to keep." for i in range(n))
        (tmp_path / f"{play}_gut.txt").write_text(text)
    train, val = genre_set(sorted(tmp_path.glob("*.txt")), val_fraction=0.2)
    genre = {p: g for g, plays in FOLIO.items() for p in plays}
    for label in FOLIO:  # balanced to the rarest genre (comedy's 9): 7 train, 2 validation each
        assert sum(r["label"] == label for r in train) == 7 and sum(r["label"] == label for r in val) == 2
    assert all(genre[r["play"]] == r["label"] and r["play"] in r["text"] for r in train + val)
    assert not {r["text"] for r in train} & {r["text"] for r in val}
    assert genre_set(sorted(tmp_path.glob("*.txt")), val_fraction=0.2) == (train, val)  # seeded


def test_compare_tabulates_the_accuracy_of_each_variant(tmp_path: Path) -> None:
    runs = []
    for name, recipe, seed, accuracy in (("a", "roformer_v2", 1, 0.4), ("b", "roformer_v2", 2, 0.5),
                                         ("c", "gau_alpha", 1, 0.3)):
        (run := tmp_path / name).mkdir()
        (run / "classify.json").write_text(json.dumps({"step": 300, "accuracy": accuracy,
                                                       "majority_accuracy": 1 / 3}))
        runs.append((run, {"recipe": recipe, "seed": str(seed)}))
    (tmp_path / "d").mkdir()  # a run without a classifier: left out
    text = LabelledDataModule.compare_section(tmp_path, [r for r, _ in runs] + [tmp_path / "d"],
                                              {r: o for r, o in runs} | {tmp_path / "d": {}}, ["recipe"])
    rows = (tmp_path / "compare_classify.csv").read_text().splitlines()
    assert "Classification" in text and len(rows) == 3
    assert rows[1].startswith("roformer_v2,2,300,0.45") and rows[2].startswith("gau_alpha,1,300,0.3")
    assert LabelledDataModule.compare_section(tmp_path, [tmp_path / "d"], {tmp_path / "d": {}}, ["recipe"]) == ""
