"""The GPU check (scripts/bench_gpu.sh) prepared on the CPU: its dry run writes every stage's JSON with the keys
docs/bench.md names; the GPU breakdown counts each kernel once; the train.py figures and the summary read back what
the runs logged."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from lmlab.bench.suite import FILES, missing_keys
from tests.runs import ROOT


@pytest.mark.slow
def test_the_dry_run_writes_every_stage_json(tmp_path: Path) -> None:
    """bash scripts/bench_gpu.sh OUT --dry-run: every stage of the GPU plan at tiny sizes on the CPU (about 2 minutes
    on one core), each JSON file written with the keys docs/bench.md names, the summary without a problem."""
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    res = subprocess.run(["bash", str(ROOT / "scripts" / "bench_gpu.sh"), str(out), "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    for stage, (file, _) in FILES.items():
        data = json.loads((out / file).read_text())
        assert missing_keys(stage, data) == [], (stage, missing_keys(stage, data))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["problems"] == {} and summary["missing"] == []
    assert json.loads((out / "env.json").read_text())["dry_run"] is True
    for name in ("gpt2-124m-eager", "gpt2-124m-compiled"):
        bench = json.loads((out / f"{name}.json").read_text())
        assert bench["precision"] == "bf16" and bench["compile"] == name.endswith("compiled")
        b = bench["breakdown"]["lmlab"]
        assert b["seconds"].keys() == {"matmul", "attention", "optimizer", "other"} and b["seconds"]["matmul"] > 0
        assert bench["mfu_vs_spec_peak"]["lmlab"] > 0 and bench["ratios"]["train_vs_gpt2"]["median"] > 0
    for name in ("eager", "compiled", "fsdp2", "fp8"):
        run = json.loads((out / f"train-{name}.json").read_text())
        assert run["rc"] == 0 and run["summary"]["status"] == "completed" and run["summary"]["steps"] == 4
        assert run["tokens_per_s"] > 0 and run["mfu"] > 0 and run["max_memory_gib"] > 0
        assert "model=gpt2_124m" in run["overrides"] and "data=bpe50k" in run["overrides"]
    assert "trainer=fsdp2" in json.loads((out / "train-fsdp2.json").read_text())["overrides"]
    rows = json.loads((out / "attention.json").read_text())["rows"]
    assert [r["kind"] for r in rows] == ["full", "window", "docs", "mla"]
    assert rows[0]["vs_full_per_flop"] == 1.0 and rows[1]["pairs"] < rows[0]["pairs"] == 64 * 65 // 2
    moe = json.loads((out / "moe.json").read_text())["rows"]
    assert [r["name"].split(" ")[0] for r in moe] == ["dense", "moe", "moe"]
    mixers = json.loads((out / "mixers.json").read_text())["rows"]
    assert [(r["kind"], r["requested"], r["backend"]) for r in mixers] == [
        ("attention", "sdpa", "sdpa"), ("gdn", "auto", "torch"), ("gdn", "torch", "torch")]  # auto: torch on a CPU
    assert mixers[0]["vs_attention"] == 1.0 and mixers[1]["vs_attention"] > 0
    fp8 = json.loads((out / "train-fp8.json").read_text())
    assert fp8["rc"] == 0 and fp8["summary"]["status"] == "completed" and len(fp8["summary"]["fp8"]) > 0
    assert summary["stages"]["fp8"]["speedup_vs_bf16"] > 0 and summary["stages"]["fp8"]["val_loss_bf16"] > 0
    assert {t["target"].split(" ")[0] for t in summary["targets"]} == {"MFU", "compiled", "window", "docs", "moe",
                                                                       "train.py"}
    log = (out / "log.txt").read_text()
    assert "=== summary" in log and "=== failed" not in log
