"""data=token_bin: .bin shards in the nanoGPT/llm.c layout round-trip, the header is checked (bad magic, wrong
version, truncated refused by path), validation is the first val_tokens tokens, and a run trains on them."""

from __future__ import annotations

from pathlib import Path

from tests.unit.data.test_token_bin import _shards


def test_a_run_trains_on_bin_shards(tmp_path: Path) -> None:
    from lmlab import compose
    from lmlab.run.training import train

    d = _shards(tmp_path / "shards", tokens=20000, vocab=64, counting=True)
    args = ["data=token_bin", f"data.train={d}/fineweb_train_*.bin", f"data.val={d}/fineweb_val_*.bin",
            "data.val_tokens=1650", "data.vocab_size=64", "data.batch_size=8", "model.n_layer=1", "model.d_model=32",
            "model.n_head=2", "model.max_seq_len=32", "trainer.max_steps=60", "trainer.val_check_interval=30",
            "optim.lr=1e-2", "schedule.warmup_steps=5", "logger=none", "threads=1", "trainer.enable_progress_bar=false",
            "monitor.attn_every_n_steps=0"]
    summary = train(compose(args), tmp_path / "run")
    assert summary["status"] == "completed" and summary["steps"] == 60
    # the shards count 0..63 over and over: the next token is always the previous + 1, which 60 steps learn
    assert summary["final_val_loss"] < 0.5 * summary["unigram_val_loss"]
    assert (tmp_path / "run" / "tokenizer.json").is_file()
