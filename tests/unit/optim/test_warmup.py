"""A short run is never all warmup (lmlab.optim.warmup): the schedule's default warmup is capped at a fifth of the run
unless
the command (or an experiment) chose it, the run says so, a resume keeps its own, and every short-run example in the
README reaches optim.lr at least once."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from lmlab import compose
from lmlab.optim import SCHEDULES
from lmlab.optim.warmup import fit_warmup
from lmlab.registry import option_params
from tests.pages import PAGES
from tests.runs import metric, tiny


def _peak(cfg) -> float:
    """The largest lr multiplier of the run's schedule over its steps (1.0: optim.lr reached)."""
    name, params = option_params("schedule", SCHEDULES, dict(cfg.schedule))
    steps = int(cfg.trainer.max_steps)
    return max(SCHEDULES[name](s, steps, **params) for s in range(steps))


def readme_short_runs() -> list[list[str]]:
    """The overrides of every command of the README and docs/ (train.py, `lmlab train`, torchrun, `compose([...])`: a line of a code
    block, continuations joined, or an inline span) that sets trainer.max_steps to 100 or less and leaves the warmup to
    the default: one value of a swept key; placeholders, flags and Hydra's own keys left out."""
    text = "\n".join(PAGES.values())  # the README and the pages under docs/
    blocks = re.findall(r"^```\w*\n(.*?)^```", text, flags=re.M | re.S)
    lines = [line for b in blocks for line in b.replace("\\\n", " ").splitlines()]
    spans = [" ".join(span.split()) for span in re.findall(r"`([^`\n]*(?:\n[^`\n]*)?)`",
                                                            re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))]
    found = []
    for cmd in [line.split("  #", 1)[0] for line in lines] + spans:
        if not re.search(r"train\.py|lmlab train|compose\(\[", cmd) or "schedule.warmup_steps" in cmd:
            continue
        m = re.search(r"trainer\.max_steps=(\d+)", cmd)
        if not m or int(m.group(1)) > 100:
            continue
        if "compose([" in cmd:
            args = re.findall(r'"([^"]+=[^"]*)"', cmd.split("compose([", 1)[1].split("])", 1)[0])
        else:
            args = [a for a in shlex.split(cmd) if re.fullmatch(r"[\w.+~/][\w.+~/-]*=\S*", a)]
        found.append([a.split(",")[0] if "," in a and "[" not in a else a for a in args
                      if not a.lstrip("+~").startswith(("hydra", "init_from")) and "<" not in a])
    return found


def test_the_readmes_short_run_examples_reach_optim_lr() -> None:
    """The 50- and 60-step examples (a train.py command, a SLURM sweep, the library call) and the rest up to 100 steps
    end their warmup inside the run: the lr multiplier reaches 1 at least once. Without the cap none did."""
    runs = readme_short_runs()
    steps = sorted({int(a.split("=")[1]) for r in runs for a in r if a.startswith("trainer.max_steps=")})
    assert {1, 20, 50, 60} <= set(steps), runs  # the test reads the README's examples, not nothing
    capped = 0
    for args in runs:
        cfg = compose(args)
        default = cfg.schedule.warmup_steps == 100
        assert _peak(cfg) < 1.0 or not default, args  # the default's 100 warmup steps: all warmup, as the issue found
        fit_warmup(cfg, args)
        assert _peak(cfg) == pytest.approx(1.0), (args, cfg.schedule)
        assert cfg.schedule.warmup_steps <= int(0.2 * cfg.trainer.max_steps)
        capped += default
    assert capped >= 6, runs


@pytest.mark.parametrize("args, warmup", [
    (["trainer.max_steps=600"], 100),  # long enough: the default stays
    (["trainer.max_steps=60", "schedule.warmup_steps=100"], 100),  # the command chose it: kept (and warned)
    (["trainer.max_steps=60", "experiment=ladder"], 15),  # an experiment's own
    (["trainer.max_steps=60", "schedule=wsd"], 12),  # every schedule's default
])
def test_a_chosen_or_fitting_warmup_is_kept(args: list[str], warmup: int) -> None:
    cfg = compose(args)
    fit_warmup(cfg, args)
    assert cfg.schedule.warmup_steps == warmup


def test_a_short_run_reaches_optim_lr_says_so_and_a_resume_keeps_its_warmup(corpus: Path, tmp_path: Path,
                                                                            capsys) -> None:
    """30 steps with the default warmup: capped at 6, said in one line, the logged lr reaches optim.lr at step 5 and
    the effective config records it; continued to 200 the run keeps warmup 6 (a cap of 200 would give 40: the lr
    would fall back into a warmup at step 30)."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    args = [a for a in tiny(corpus, cache) if not a.startswith("schedule.warmup_steps")]
    from lmlab.run.training import train

    summary = train(compose(args), run, overrides=args)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("schedule.warmup_steps")]
    assert said == ["schedule.warmup_steps=6: the default 100 capped at 20% of trainer.max_steps=30, so the lr "
                    "reaches optim.lr at step 6; set schedule.warmup_steps to choose"]
    lr, peak = metric(run, "lr"), summary["config"]["optim"]["lr"]
    assert max(lr.values()) == pytest.approx(peak) and lr[5] == pytest.approx(peak) and lr[4] < peak
    assert summary["config"]["schedule"]["warmup_steps"] == 6
    from lmlab.cli import merge_overrides

    more = merge_overrides(args, ["trainer.max_steps=200"])  # as train.py continues it
    summary = train(compose(more), run, overrides=more)
    assert summary["config"]["schedule"]["warmup_steps"] == 6 and summary["steps"] == 200
    lr = metric(run, "lr")
    assert all(lr[s] <= lr[s - 1] + 1e-12 for s in range(32, 200))  # decaying on: no second warmup
