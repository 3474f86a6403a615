"""Launchers that record their sweep: `sweep.json` (lmlab.record.sweep) is written before the first job starts, and
`lmlab sweep resume` runs only the jobs that did not finish.

`Recorded` goes in front of a Hydra launcher (`class L(Recorded, HydraLauncher)`): its `launch` works out each job's
run directory, seed and steps from the job's own config, records the sweep (command, base config and hash) and the
batch in the manifest, then hands the jobs to `launch_recorded`, which the launcher below implements. Under `lmlab
sweep resume` (lmlab.record.sweep.RESUME set in this process) it first refuses a base config that drifted from the
manifest's, naming the keys (those the resume command sets are the drift meant), and leaves out the jobs that
finished or are still queued or running: their results come back from their summaries, so a sweeper (Optuna) reads
every job of the batch.

`hydra/launcher=serial` (lmlab's default, conf/hydra/launcher/serial.yaml) is `LmlabBasicLauncher`: Hydra's basic
launcher, one job after the other in this process; `hydra/launcher=local` is submitit's local one, recorded too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_launcher import BasicLauncher

try:  # the slurm extra (hydra-submitit-launcher)
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher
except ImportError:  # pragma: no cover
    LocalLauncher = None


class Recorded:
    """The mixin: `launch` records the batch in the sweep's manifest and runs the jobs `launch_recorded` is given."""

    recorded_as = "basic"  # the launcher's name in the manifest

    def job_config(self, overrides: Sequence[str], idx: int) -> Any:
        """Job `idx`'s own config, as the job will compose it (Hydra copies the sweep's resolver cache into each job's
        config, so `${now:...}` is the same time here and in the job)."""
        from omegaconf import open_dict

        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(cfg.hydra.job):
            cfg.hydra.job.num = idx
            cfg.hydra.job.id = f"job_id_for_{idx}"
        return cfg

    def job_dir(self, overrides: Sequence[str], idx: int) -> Path:
        """Where job `idx` writes its run: the sweep dir and subdir its own config resolves to."""
        cfg = self.job_config(overrides, idx)
        return Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
        from omegaconf import OmegaConf

        from lmlab.cli import typed_command
        from lmlab.record import sweep

        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        base = OmegaConf.to_container(self.config, resolve=False)
        base.pop("hydra", None)
        jobs, dirs = [], []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            cfg = self.job_config(overrides, idx)
            run_dir = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
            dirs.append(run_dir)
            jobs.append({"dir": os.path.relpath(run_dir, sweep_dir), "overrides": list(overrides),
                         "seed": cfg.get("seed"), "max_steps": OmegaConf.select(cfg, "trainer.max_steps")})
        resume = sweep.RESUME
        if resume is not None:
            refuse_drift(sweep_dir, base, resume.get("allowed", ()))
        command = typed_command()
        params = OmegaConf.select(self.config, "hydra.sweeper.params") or {}
        sweep.record_launch(sweep_dir, command=command, cwd=os.getcwd(), base=base, launcher=self.recorded_as,
                            jobs=jobs, swept=sweep.swept_keys(command[1:], list(params)))
        skip = set(resume.get("skip", ())) if resume is not None else set()
        chosen = [i for i, job in enumerate(jobs) if job["dir"] not in skip]
        ran = self.launch_recorded([(initial_job_idx + i, list(job_overrides[i]), dirs[i]) for i in chosen])
        results = dict(zip(chosen, ran))
        return [results[i] if i in results else finished(job_overrides[i], dirs[i]) for i in range(len(jobs))]

    def launch_recorded(self, jobs: Sequence[tuple[int, list[str], Path]]) -> Sequence[Any]:
        """Run (or submit) these jobs, (index, overrides, run dir) each; one result per job, in order."""
        raise NotImplementedError


def finished(overrides: Sequence[str], run_dir: Path) -> Any:
    """The result of a job the resume left alone: its objective from its summary (+inf without one)."""
    from hydra.core.utils import JobReturn, JobStatus

    from lmlab.record.rundir import RunDir
    from lmlab.record.summary import objective

    try:
        summary = RunDir(run_dir).read_summary()
    except ValueError:
        summary = None
    return JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED, _return_value=objective(summary))


def refuse_drift(sweep_dir: Path, base: dict[str, Any], allowed: Sequence[str]) -> None:
    """Exit 2, naming the keys, when the base config composed now differs from the one the sweep recorded, except in
    the keys the resume command sets (`lmlab sweep resume DIR trainer.max_steps=400`: that drift is meant)."""
    from lmlab.record import sweep

    manifest = sweep.read(sweep_dir)
    if manifest is None or "base_config" not in manifest:
        return
    changed = {k: v for k, v in sweep.drift(manifest["base_config"], base).items()
               if not any(k == a or k.startswith(f"{a}.") for a in allowed)}
    if changed:
        keys = "; ".join(f"{k}: {was!r} -> {now!r}" for k, (was, now) in list(changed.items())[:12])
        more = f" (and {len(changed) - 12} more)" if len(changed) > 12 else ""
        print(f"lmlab sweep resume: {sweep_dir}: the base config drifted from the one the sweep started with "
              f"({sweep.MANIFEST}): {keys}{more}. Resuming would mix two experiments; if the change is meant, say so "
              f"by setting the key(s) on the command line (lmlab sweep resume {sweep_dir} "
              f"{next(iter(changed))}=...)", file=sys.stderr)
        raise SystemExit(2)


class LmlabBasicLauncher(Recorded, BasicLauncher):
    """Hydra's basic launcher, recorded: one job after the other in this process, the manifest updated after each."""

    def launch_recorded(self, jobs: Sequence[tuple[int, list[str], Path]]) -> Sequence[Any]:
        from lmlab.record import sweep

        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        results = []
        for idx, overrides, run_dir in jobs:
            (result,) = BasicLauncher.launch(self, [overrides], initial_job_idx=idx)
            results.append(result)
            state = sweep.job_states(sweep_dir)
            mine = {os.path.relpath(run_dir, sweep_dir)}
            sweep.record_jobs(sweep_dir, {r["dir"]: {"state": r["state"]} for r in state if r["dir"] in mine})
        return results


class LmlabLocalLauncher(Recorded, LocalLauncher or object):
    """submitit's local launcher (`hydra/launcher=local`: each job a subprocess), recorded."""

    recorded_as = "local"

    def launch_recorded(self, jobs: Sequence[tuple[int, list[str], Path]]) -> Sequence[Any]:
        if not jobs:
            return []
        return LocalLauncher.launch(self, [o for _, o, _ in jobs], initial_job_idx=jobs[0][0])
