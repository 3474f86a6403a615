"""Checkpoint merging (issue 62): `checkpoint.keep_last=k` keeps the last k validations' checkpoints as
checkpoints/step_<N>.ckpt, and `eval.py run=<dir> merge=last:k[:linear]` evaluates the average of their weights
(floating-point parameters averaged; buffers and integer tensors the newest checkpoint's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmlab import compose
from lmlab.analysis.evaluate import evaluate, position_losses, run_data
from lmlab.config import GPTConfig
from lmlab.model.gpt import GPT, validate
from lmlab.record.merge import coefficients, merge_states, parse_merge
from lmlab.record.rundir import RunDir, load_checkpoint, load_run
from lmlab.run.training import train
from tests.runs import tiny


def _states() -> list[dict[str, torch.Tensor]]:
    return [{"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([10.0]), "n": torch.tensor([1])},
            {"w": torch.tensor([3.0, 6.0]), "b": torch.tensor([20.0]), "n": torch.tensor([2])},
            {"w": torch.tensor([5.0, 1.0]), "b": torch.tensor([30.0]), "n": torch.tensor([3])}]


def test_uniform_average_is_the_hand_mean() -> None:
    merged = merge_states(_states(), coefficients(3, "uniform"), params={"w", "n"})
    torch.testing.assert_close(merged["w"], torch.tensor([3.0, 3.0]))  # (1+3+5)/3, (2+6+1)/3
    torch.testing.assert_close(merged["b"], torch.tensor([30.0]))  # a buffer: the newest checkpoint's
    assert merged["n"].tolist() == [3]  # an integer tensor: never averaged


def test_linear_weights_favour_the_newest() -> None:
    assert coefficients(3, "linear") == pytest.approx([1 / 6, 2 / 6, 3 / 6])
    merged = merge_states(_states(), coefficients(3, "linear"), params={"w"})
    torch.testing.assert_close(merged["w"], torch.tensor([(1 + 6 + 15) / 6, (2 + 12 + 3) / 6]))


@pytest.mark.parametrize("spec", ["last", "last:0", "last:x", "first:3", "last:3:cubic", "last:3:linear:1", 3])
def test_bad_specs_are_refused_naming_the_forms(spec: object) -> None:
    with pytest.raises(ValueError, match=r"merge=.*accepted forms: merge=last:<k> .*merge=last:<k>:linear"):
        parse_merge(spec)


def test_parse() -> None:
    assert parse_merge("last:3") == (3, "uniform") and parse_merge("last:2:linear") == (2, "linear")


@pytest.fixture(scope="module")
def kept(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("keep_last")
    cfg = compose(tiny(corpus, tmp / "cache", "checkpoint.keep_last=3", "trainer.max_steps=30",
                       "trainer.val_check_interval=5"))
    assert train(cfg, tmp / "run")["status"] == "completed"
    return tmp / "run"


def test_keep_last_keeps_the_last_k_validations(kept: Path) -> None:
    names = sorted(p.name for p in (kept / "checkpoints").iterdir())
    assert names == ["best.ckpt", "last.ckpt", "step_20.ckpt", "step_25.ckpt", "step_30.ckpt"]  # step_5..15 removed
    assert [s for s, _ in RunDir(kept).step_checkpoints()] == [20, 25, 30]
    last = load_checkpoint(kept / "checkpoints" / "last.ckpt", "test")
    newest = load_checkpoint(kept / "checkpoints" / "step_30.ckpt", "test")
    assert newest["global_step"] == last["global_step"] == 30
    for k, v in last["state_dict"].items():
        torch.testing.assert_close(newest["state_dict"][k], v)


def _hand_loss(run: Path, coeffs: list[float]) -> float:
    saved = load_run(run)
    states = [load_checkpoint(run / "checkpoints" / f"step_{s}.ckpt", "test")["state_dict"] for s in (20, 25, 30)]
    model = GPT(validate(GPTConfig(**saved.model)))
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    state = {}
    for key, last in states[-1].items():
        name = key.removeprefix("model.")
        if not key.startswith("model."):
            continue
        state[name] = sum(c * s[key].double() for c, s in zip(coeffs, states)).to(last.dtype) \
            if name in params and last.is_floating_point() else last
    model.load_state_dict(state)
    model.eval()
    trained = saved.model.get("train_len") or saved.model["max_seq_len"]
    windows = run_data(run, saved.config, seq_len=trained).val_windows(trained)[:16]
    with torch.no_grad():
        return float(position_losses(model, windows, 8).mean())


@pytest.mark.parametrize("spec,coeffs", [("last:3", [1 / 3] * 3), ("last:3:linear", [1 / 6, 2 / 6, 3 / 6])])
def test_merged_eval_is_the_hand_averaged_model(kept: Path, spec: str, coeffs: list[float]) -> None:
    result = evaluate(kept, max_windows=16, merge=spec)
    assert result["rows"][0]["loss"] == pytest.approx(_hand_loss(kept, coeffs), rel=1e-6)
    live = evaluate(kept, max_windows=16)["rows"][0]["loss"]
    assert result["rows"][0]["loss"] != pytest.approx(live, rel=1e-9)  # it evaluated other weights
    assert result["merge"]["steps"] == [20, 25, 30]


def test_too_few_checkpoints_are_refused(kept: Path) -> None:
    with pytest.raises(ValueError, match=r"merge=last:4: .* has 3 step checkpoints .*checkpoint\.keep_last=4"):
        evaluate(kept, max_windows=16, merge="last:4")


@pytest.mark.e2e  # starts eval.py
def test_cli_writes_beside_eval_and_refuses_in_one_line(kept: Path) -> None:
    from tests.runs import ROOT, cli

    res = cli(str(ROOT / "eval.py"), f"run={kept}", "merge=last:3:linear", "max_windows=16", cwd=kept)
    assert res.returncode == 0, res.stderr
    result = json.loads((kept / "eval_merge_last_3_linear" / "eval.json").read_text())
    assert result["rows"][0]["loss"] == pytest.approx(_hand_loss(kept, [1 / 6, 2 / 6, 3 / 6]), rel=1e-6)
    assert result["merge"]["steps"] == [20, 25, 30] and not (kept / "eval").exists()
    res = cli(str(ROOT / "eval.py"), f"run={kept}", "merge=last:5", cwd=kept)
    lines = [line for line in res.stderr.splitlines() if "merge=last:5" in line]
    assert res.returncode == 2 and len(lines) == 1 and "checkpoint.keep_last=5" in lines[0], res.stderr
    assert not (kept / "eval_merge_last_5").exists()


def test_resume_reads_last_and_keeps_counting(corpus: Path, tmp_path: Path) -> None:
    """A resume continues from last.ckpt; the step checkpoints go on from the directory as it is, and one past the
    resumed step (an abandoned attempt's) is removed at the first save."""
    run = tmp_path / "run"
    common = (*tiny(corpus, tmp_path / "cache"), "checkpoint.keep_last=2", "trainer.val_check_interval=5")
    assert train(compose([*common, "trainer.max_steps=15"]), run)["status"] == "completed"
    assert [s for s, _ in RunDir(run).step_checkpoints()] == [10, 15]
    (run / "checkpoints" / "step_99.ckpt").write_bytes(b"from an abandoned attempt")
    summary = train(compose([*common, "trainer.max_steps=25"]), run)
    assert summary["status"] == "completed" and summary["steps"] == 25
    assert [s for s, _ in RunDir(run).step_checkpoints()] == [20, 25]
    assert load_checkpoint(run / "checkpoints" / "last.ckpt", "test")["global_step"] == 25


def test_moe_expert_bias_is_the_newest_not_averaged(corpus: Path, tmp_path: Path) -> None:
    from lmlab.record.merge import merged_weights

    cfg = compose(tiny(corpus, tmp_path / "cache", "ffn=moe", "ffn.n_experts=4", "ffn.bias_update_rate=0.01",
                       "checkpoint.keep_last=2", "trainer.max_steps=10", "trainer.val_check_interval=5"))
    assert train(cfg, tmp_path / "run")["status"] == "completed"
    merged, info = merged_weights(load_run(tmp_path / "run"), "last:2")
    paths = [tmp_path / "run" / "checkpoints" / f"step_{s}.ckpt" for s in (5, 10)]
    old, new = ({k.removeprefix("model."): v for k, v in load_checkpoint(p, "test")["state_dict"].items()}
                for p in paths)
    biases = [k for k in merged if k.endswith("expert_bias")]
    assert biases and info["steps"] == [5, 10]
    for k in biases:
        assert not torch.equal(old[k], new[k]) and torch.equal(merged[k], new[k])
    torch.testing.assert_close(merged["wte.weight"], (old["wte.weight"] + new["wte.weight"]) / 2)
