"""Multi-head latent attention (DeepSeek-V2): the module against the paper's equations computed token by token and head
by head (with and without the compressed query), RoPE on the decoupled key part only, the cache holding the latents
alone, the sizes the record keeps, the weights and cache widths the size checks read, and the refusals by key."""

from __future__ import annotations


def test_the_attention_bench_runs_every_kind(tmp_path) -> None:
    import json
    import subprocess
    import sys

    out = tmp_path / "attention.json"
    res = subprocess.run([sys.executable, "-m", "lmlab.bench", "attention", "--lengths", "64", "--steps", "1",
                          "--window", "16", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["kind"] for r in rows] == ["full", "window", "docs", "mla"]
    assert all(r["tokens_per_s"] > 0 and r["device"] == "cpu" for r in rows)
