"""Generation: the KV cache gives, token by token, the logits of a full forward over the growing text (greedy, every
position scheme and RoPE scaling, dynamic ones past the trained length included); sampling rules; the CLI."""

from __future__ import annotations

import re
from pathlib import Path

from lmlab import compose
from lmlab.run.training import train
from tests.runs import ROOT, cli, tiny


def test_generate_cli_streams_a_sample(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(compose(tiny(corpus, tmp_path / "cache", "trainer.max_steps=60", "trainer.val_check_interval=60")), run)
    res = cli(str(ROOT / "generate.py"), f"run={run}", "prompt=The king", "max_new_tokens=20", "seed=3", "n=2",
              cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    first, _, second = res.stdout.partition("--- sample 2 ---")
    assert first.startswith("The king") and len(first.strip()) == len("The king") + 20
    assert second.strip().startswith("The king")
    again = cli(str(ROOT / "generate.py"), f"run={run}", "prompt=The king", "max_new_tokens=20", "seed=3", "n=2",
                cwd=tmp_path)
    assert again.stdout == res.stdout  # the seed decides the samples
    bad = cli(str(ROOT / "generate.py"), f"run={run}", "top_p=1.5", cwd=tmp_path)
    assert bad.returncode != 0 and "top_p=1.5" in bad.stderr
    huge = cli(str(ROOT / "generate.py"), f"run={run}", "max_new_tokens=1000000000000", cwd=tmp_path, timeout=60)
    assert huge.returncode != 0 and re.search(r"max_new_tokens=1000000000000 .*the KV cache needs ~\d+.* GiB .*room "
                                              r"for ~\d+ tokens", huge.stderr), huge.stderr[-2000:]
