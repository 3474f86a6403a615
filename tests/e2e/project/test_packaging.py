"""The installed package, not only the checkout: a wheel carries conf/, so `from lmlab import compose` works from it."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.runs import ROOT


def test_a_wheel_ships_the_configs_and_compose_works_from_it(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(ROOT)], check=True, capture_output=True, text=True, timeout=300)
    wheel = next(dist.glob("lmlab-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    conf = ROOT / "lmlab" / "conf"
    shipped = {f"lmlab/conf/{p.relative_to(conf)}" for p in conf.rglob("*.yaml")}
    assert "lmlab/conf/train.yaml" in shipped and shipped <= names
    assert "hydra_plugins/lmlab_slurm/__init__.py" in names  # hydra/launcher=slurm_dry_run's launcher
    # The wheel's files in a folder of their own, first on the path, with this interpreter's packages behind them:
    # the installed copy, away from the checkout. (A `venv --system-site-packages` made from a venv's interpreter sees
    # the base interpreter's packages, not the venv's: omegaconf was missing on the README's own set-up.)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    code = ("import lmlab; from lmlab import compose; cfg = compose(['norm=rms', 'experiment=postnorm_warmup']); "
            "print(lmlab.__file__); print(cfg.norm.name, cfg.placement.name)")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(target)})
    assert res.returncode == 0, res.stderr[-2000:]
    where, names_line = res.stdout.strip().splitlines()[-2:]
    assert str(target) in where  # the installed copy, not the checkout
    assert names_line == "rms post"
    # The installed command (a console script, and python -m lmlab): Hydra finds the configs in the installed package
    # (a config package it imports, not a path beside a script), and a refusal is the usage error.
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "lmlab = lmlab.commands:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    env = {**os.environ, "PYTHONPATH": str(target)}
    for command in ([str(target / "bin" / "lmlab")], [sys.executable, "-m", "lmlab"]):
        res = subprocess.run([*command, "train", "norm=rms", "--cfg", "job"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=120, env=env)
        assert res.returncode == 0 and "name: rms" in res.stdout, res.stderr[-2000:]
        res = subprocess.run([*command, "train", "optim.lr=abc"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=120, env=env)
        assert res.returncode == 2 and res.stderr.strip() == "lmlab train: optim.lr='abc' must be a float > 0", \
            res.stderr[-2000:]
