"""A command's own warnings (lmlab.env.plain_warnings): one line each, `train.py: warning: <what>`, once, without
Python's file:line and source line; other packages' warnings as Python prints them."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import lmlab
from lmlab.env import plain_warnings


def test_lmlabs_warnings_are_one_line_once_and_others_unchanged(capsys, monkeypatch) -> None:
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # restored after the test
    plain_warnings("train.py")
    ours = str(Path(lmlab.__file__).parent / "run" / "checks.py")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        for _ in range(2):
            warnings.warn_explicit("the whole run is warmup", UserWarning, ours, 164)
        with pytest.warns(UserWarning, match="an outside warning"):  # handed on to Python's display (pytest's here)
            warnings.warn_explicit("an outside warning", UserWarning, "/elsewhere/pkg.py", 7)
    err = capsys.readouterr().err
    assert err.count("train.py: warning: the whole run is warmup\n") == 1 and "checks.py:164" not in err
    assert "an outside warning" not in err  # handed to Python's own showwarning (here: pytest's record of it)
