"""Hugging Face interop: from_hf and to_hf give the transformers model's logits (fp32, tight tolerance) for Llama-like
(Mistral/Ministral windows, Gemma 2's softcaps and sandwich norms, DeepSeek-V3's MLA) and GPT-2-like configs — GQA
or not, tied or untied, every rope_scaling transformers represents, positions past the
original context — round-trip, and an exported run reloads with AutoModelForCausalLM / AutoTokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmlab import compose  # noqa: E402
from lmlab.run.training import train  # noqa: E402
from tests.runs import ROOT, cli, tiny  # noqa: E402
from tests.unit.interop.test_interop_hf import _llama_dir, _logits, transformers


def test_an_exported_run_reloads_with_auto_classes(corpus: Path, tmp_path: Path) -> None:
    """The default architecture (GPT-2-like: learned positions, LayerNorm, GELU MLP, no linear biases) trained a
    few steps, exported by eval.py, reloaded by transformers' Auto classes: same tokens, same logits."""
    run = tmp_path / "run"
    train(compose(tiny(corpus, tmp_path / "cache", "trainer.max_steps=3", "trainer.val_check_interval=3")), run)
    out = tmp_path / "hf"
    res = cli(str(ROOT / "eval.py"), f"run={run}", "export=hf", f"out={out}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    from tokenizers import Tokenizer

    text = "The king shall speak.\nThou lord"  # corpus characters (others are <unk>), within the 32 positions
    ids = Tokenizer.from_file(str(run / "tokenizer.json")).encode(text).ids
    assert tok(text)["input_ids"] == ids and tok.decode(ids) == text
    from lmlab.analysis.evaluate import load_model

    idx = torch.tensor([ids])
    torch.testing.assert_close(_logits(hf, idx), _logits(load_model(run), idx), rtol=1e-5, atol=1e-5)
    # no end-of-document token in this run: none is invented (id 0, the newline, as pad would mask every newline)
    assert tok.eos_token is None and tok.pad_token is None and hf.config.pad_token_id is None
    assert "without an end-of-document token (data.eod)" in res.stdout + res.stderr


def test_an_export_names_the_runs_end_of_document_token_eos_bos_and_pad(corpus: Path, tmp_path: Path) -> None:
    """A run trained with data.eod: its token (a plain entry of the char vocabulary) is the export's eos, and as in
    GPT-2 its bos and pad, in the tokenizer, config.json and generation_config.json; batched generation with padding
    gives each prompt what it gives alone."""
    from lmlab.interop.hf import export

    run = tmp_path / "run"
    train(compose(tiny(corpus, tmp_path / "cache", "trainer.max_steps=3", "trainer.val_check_interval=3",
                       "data.eod='<|endoftext|>'")), run)
    out = export(run, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    eod = tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_token == tok.bos_token == tok.pad_token == "<|endoftext|>"
    assert hf.config.eos_token_id == hf.config.pad_token_id == hf.generation_config.pad_token_id == eod
    assert tok("the king\n")["input_ids"][-1] != eod  # the newline is not the pad
    tok.padding_side = "left"
    prompts = ["the king shall\nspeak", "thou"]
    batch = tok(prompts, padding=True, return_tensors="pt")
    together = hf.generate(**batch, max_new_tokens=4, do_sample=False)[:, batch["input_ids"].shape[1]:]
    for i, prompt in enumerate(prompts):
        alone = tok(prompt, return_tensors="pt")
        one = hf.generate(**alone, max_new_tokens=4, do_sample=False)[0, alone["input_ids"].shape[1]:]
        assert together[i].tolist() == one.tolist(), prompt


def test_a_transformers_directory_is_studied_with_lmlabs_tools(corpus: Path, tmp_path: Path) -> None:
    """eval.py hf=<dir> scores an exported model as eval.py run= scores its run; train.py init_from=<dir> takes its
    architecture and weights (with lr ~ 0, the val loss is the source's)."""
    cache = tmp_path / "cache"
    run = tmp_path / "run"
    args = tiny(corpus, cache, "trainer.max_steps=20", "trainer.val_check_interval=20", "norm=rms", "ffn=swiglu",
                "position=rope", "attention=gqa", "model.n_kv_head=1")  # a Llama-like run
    source = train(compose(args), run)
    out = tmp_path / "hf"
    assert cli(str(ROOT / "eval.py"), f"run={run}", "export=hf", f"out={out}", cwd=tmp_path).returncode == 0
    res = cli(str(ROOT / "eval.py"), f"run={run}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    res = cli(str(ROOT / "eval.py"), f"hf={out}", "hf_data=text_files", f"hf_data_paths=[{corpus}]", "max_windows=32",
              cwd=tmp_path)  # the run evaluated its first data.val_windows=32 windows
    assert res.returncode == 0, res.stderr[-3000:]
    import json

    ours = json.loads((run / "eval" / "eval.json").read_text())["rows"][0]["loss"]
    theirs = json.loads((out / "eval" / "eval.json").read_text())["rows"][0]["loss"]
    assert theirs == pytest.approx(ours, abs=1e-5)
    plain = [a for a in tiny(corpus, cache) if not a.startswith("trainer.max_steps")]  # the default architecture
    summary = train(compose([*plain, f"init_from={out}", "optim.lr=1e-12", "trainer.max_steps=1",
                             "trainer.val_check_interval=1"]), tmp_path / "from_hf")
    assert summary["model"]["norm"]["name"] == "rms" and summary["model"]["ffn"]["name"] == "swiglu"
    assert summary["model"]["n_kv_head"] == 1
    assert summary["final_val_loss"] == pytest.approx(source["final_val_loss"], abs=1e-4)


def test_hf_import_refuses_missing_or_unexpected_tensors_by_name(corpus: Path, tmp_path: Path) -> None:
    """transformers fills a tensor missing from the file with its random init (an import scored 4.411 where the
    model's own loss is 4.405); lmlab refuses it, in eval.py hf= and train.py init_from=, naming the tensors."""
    from safetensors.torch import load_file, save_file

    from lmlab.interop.hf import load_hf_dir
    from lmlab.run.training import train

    good = _llama_dir(tmp_path / "good")
    load_hf_dir(good)  # the control: the complete directory loads
    for name, edit, found in (
            ("missing", lambda sd: sd.pop("model.layers.0.mlp.up_proj.weight"),
             r"missing: \['model\.layers\.0\.mlp\.up_proj\.weight'\]"),
            ("unexpected", lambda sd: sd.update({"model.layers.0.extra.weight": torch.zeros(3)}),
             r"unexpected: \['model\.layers\.0\.extra\.weight'\]")):
        bad = _llama_dir(tmp_path / name)
        sd = load_file(bad / "model.safetensors")
        edit(sd)
        save_file(sd, bad / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match=rf"{bad}: the weights do not match its config.json \({found}"):
            load_hf_dir(bad)
        with pytest.raises(ValueError, match=found):
            train(compose(tiny(corpus, tmp_path / "cache", f"init_from={bad}")), tmp_path / f"run_{name}")
        assert not (tmp_path / f"run_{name}" / "checkpoints").exists()
