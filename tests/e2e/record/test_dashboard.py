"""The sweep-wide dashboard offline: a sweep with logger=tensorboard, `tensorboard --logdir <sweep dir>` served on
localhost, looked at in a real headless browser (chromium driven by playwright): the sweep's runs are listed, the
train/loss chart is drawn, and its table shows each run's last loss as metrics.csv has it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.runs import ROOT, cli, metric, tiny

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tensorboard_of(tmp_path: Path):
    """`tensorboard_of(logdir) -> url`: TensorBoard serving `logdir` on a free localhost port, stopped after."""
    pytest.importorskip("tensorboard", reason="the dashboard extra: pip install '.[dashboard]'")
    procs = []

    def serve(logdir: Path) -> str:
        port = _free_port()
        proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host",
                                 "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL,
                                stderr=(tmp_path / "tensorboard.log").open("w"))
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        for _ in range(120):
            try:
                with urllib.request.urlopen(f"{url}/data/runs", timeout=2) as r:
                    if r.status == 200:
                        return url
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"tensorboard did not answer: {(tmp_path / 'tensorboard.log').read_text()[-2000:]}")

    yield serve
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium; .ci/run installs it)")
def test_a_sweep_is_one_dashboard_in_tensorboard(corpus: Path, tmp_path: Path, tensorboard_of) -> None:
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright (the dev extra) drives the browser")
    sweep = tmp_path / "sweep"
    args = tiny(corpus, tmp_path / "cache", "model.n_layer=1", "trainer.max_steps=12", "logger=tensorboard")
    res = cli(str(ROOT / "train.py"), "-m", *args, "placement=pre,post", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    jobs = {p.parent.name: p.parent for p in sweep.glob("*/summary.json")}
    assert len(jobs) == 2
    last = {name: metric(job, "train/loss")[11] for name, job in jobs.items()}
    url = tensorboard_of(sweep)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/#timeseries", wait_until="networkidle")
            for name in jobs:  # the sweep's runs, each job one run named by its directory
                page.get_by_text(f"{name}/tensorboard").first.wait_for(timeout=60_000)
            page.fill("input[placeholder*='Filter tags']", "train/loss$")
            card = page.locator("scalar-card-component").filter(has_text="loss").first
            card.wait_for(timeout=60_000)
            for name, loss in last.items():  # the chart's table: each run's value at the last step, as metrics.csv
                card.get_by_text(f"{loss:.4f}").first.wait_for(timeout=60_000)
                assert f"{name}/tensorboard" in card.inner_text()
            chart, colored = card.locator("line-chart").first, 0
            for _ in range(60):  # the lines are drawn after the table: until the chart has them (or 30 s)
                colored = _coloured_pixels(chart.screenshot(path=str(tmp_path / "train_loss.png")))
                if colored > 200:
                    break
                time.sleep(0.5)
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        finally:
            browser.close()
    assert colored > 200, f"no line drawn in the train/loss chart ({colored} coloured pixels)"


def _coloured_pixels(png: bytes) -> int:
    """Pixels of a saturated colour: the runs' lines (the grid, the axes and the text are grey)."""
    from io import BytesIO

    from PIL import Image

    return sum(1 for r, g, b in Image.open(BytesIO(png)).convert("RGB").getdata() if max(r, g, b) - min(r, g, b) > 60)
