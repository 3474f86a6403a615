"""What W&B will show, read back with W&B's own reader of offline runs (`wandb leet inspect`): one W&B run per
job of a sweep, each with its own config, history and summary; a resumed run continues its W&B run; a diverged run
says so; eval joins its training run's group. Plus run and group naming, the online/offline choice and the live
throughput figures. Every test runs W&B offline (conftest sets WANDB_MODE=offline)."""

from __future__ import annotations

from pathlib import Path

from lmlab import CONF_DIR, compose

# --- units ----------------------------------------------------------------------------------------------------

def test_run_and_group_names() -> None:
    from lmlab.record.tracking import group_name, run_name

    assert run_name(["placement=post", "schedule.warmup_steps=0", "hydra.job.num=1"]) == \
        "placement=post,schedule.warmup_steps=0"
    assert run_name([]) == "default"
    # a sweep's swept keys first; a long name shortened on the key side only, the values whole (TensorBoard and W&B
    # cut a run list's names at the right: two hybrids both read `mixer.pattern=[mixer,mixer,mixer,attention],mixe...`)
    pattern = "mixer.pattern=[mixer,mixer,mixer,attention]"
    jobs = [[pattern, f"mixer={m}", "model.n_layer=8", "trainer.max_steps=2000"] for m in ("gdn", "mamba2")]
    names = [run_name(job, [job[1]]) for job in jobs]
    assert names == ["mixer=gdn,pattern=[mixer,mixer,mixer,attention],n_layer=8,max_steps=2000",
                     "mixer=mamba2,pattern=[mixer,mixer,mixer,attention],n_layer=8,max_steps=2000"]
    assert run_name(["norm=rms", "seed=1"], ["seed=1"]) == "seed=1,norm=rms"  # short: keys whole
    assert group_name("multirun/2026-11-30/23-40-12", "postnorm_warmup") == "postnorm_warmup-2026-11-30_23-40-12"
    assert group_name("multirun/2026-11-30/23-40-12", None) == "2026-11-30_23-40-12"
    assert group_name("outputs/2026-11-30/23-40-12", None) == "2026-11-30_23-40-12"  # a single run
    assert group_name("/scratch/me/my_sweep", None) == "my_sweep"
    assert group_name("/scratch/me/my_sweep", "norm_compare") == "norm_compare-my_sweep"


def test_online_with_credentials_offline_without(tmp_path: Path, monkeypatch) -> None:
    from lmlab.record.tracking import wandb_mode

    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_mode() == "offline"
    (tmp_path / "netrc").write_text("machine example.com\n  login me\n  password x\n")
    assert wandb_mode() == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_mode() == "offline"  # the user's explicit choice wins
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    assert wandb_mode() == "online"


def test_studies_log_like_any_run() -> None:
    for path in sorted((CONF_DIR / "experiment").glob("*.yaml")):
        cfg = compose([f"experiment={path.stem}"])
        assert "wandb" in (cfg.logger or {}), path.stem


def test_peak_flops_of_known_gpus() -> None:
    from lmlab.run.perf import peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA L40S") == 362e12 and peak_flops("NVIDIA L4") == 121e12
    assert peak_flops("cpu") is None and peak_flops("Some Future GPU") is None
