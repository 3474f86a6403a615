"""hydra/launcher=slurm: hydra-submitit-launcher's SlurmLauncher, submitting the same job array, that then waits for
every job itself and says how each one ended.

What it changes, and why:
- **waiting** (watch.py): submitit's wait relies on `sacct`; without accounting a job that ended without a result
  (a plain `scancel`, a kill) was waited on forever, with accounting one such job ended the submitting command while
  the rest of the array ran on unwatched. Here every job is waited on, a lost one is reported, the sweep goes on.
- **the report** (report.py): one line per job (status, steps, val loss, or why there is none), from its run's
  summary.json; the command exits 1 when a job failed, after every job of the batch has ended.
- **a request the partition cannot meet**: sbatch's refusal (with `EnforcePartLimits`, which a cluster should set:
  without it such a job pends forever) becomes one line naming the `hydra.launcher.*` keys to change, exit code 2.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

try:  # hydra imports every module of hydra_plugins at start-up: without the slurm extra, there is nothing here
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
except ImportError:  # pragma: no cover
    SlurmLauncher = None

# sbatch's refusals of a request the partition cannot meet, and the launcher keys that made the request
REFUSALS = {  # the most specific first: one refusal can print several of these lines
    "Memory specification can not be satisfied": ("mem_gb",),
    "Invalid generic resource": ("gpus_per_node",),
    "More processors requested than permitted": ("cpus_per_task", "tasks_per_node"),
    "Requested node configuration is not available": ("cpus_per_task", "mem_gb", "tasks_per_node"),
    "Memory required by task is not available": ("mem_gb",),
    "Node count specification invalid": ("nodes",),
    "Requested time limit is invalid": ("timeout_min",),
    "invalid partition": ("partition",),
}


class LmlabSlurmLauncher(SlurmLauncher or object):
    """`launch` as hydra-submitit-launcher's (the same executor, parameters and job array), then `wait` and
    `report` instead of submitit's `results()`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """In the job: catch SIGUSR1/SIGTERM before anything is imported (lmlab.run.early_signals), then the job."""
        from lmlab.run.early_signals import catch_early

        catch_early()
        return super().__call__(*args, **kwargs)

    def executor(self):
        """The executor hydra-submitit-launcher's launch builds, with the same parameter mapping."""
        import submitit
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
        from omegaconf import OmegaConf

        init = {"folder": self.params["submitit_folder"], "slurm_max_num_timeout": self.params["max_num_timeout"]}
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in self.params.items()
                                      if k not in ("submitit_folder", "max_num_timeout")})
        return executor

    def job_dir(self, overrides: Sequence[str], idx: int) -> Path:
        """Where job `idx` writes its run: the sweep dir and subdir its own config resolves to (Hydra copies the
        sweep's resolver cache into each job's config, so `${now:...}` is the same time here and in the job)."""
        from omegaconf import open_dict

        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(cfg.hydra.job):
            cfg.hydra.job.num = idx
            cfg.hydra.job.id = f"job_id_for_{idx}"
        return Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
        import logging

        from hydra.core.singleton import Singleton
        from hydra.core.utils import JobReturn, JobStatus, filter_overrides
        from submitit.core.utils import FailedJobError

        from hydra_plugins.lmlab_slurm import report, watch

        log = logging.getLogger("hydra_plugins.hydra_submitit_launcher.submitit_launcher")
        executor = self.executor()
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            sweep_dir.chmod(int(str(self.config.hydra.sweep.mode), 8))
        params = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        shown = swept(job_overrides)
        dirs = [self.job_dir(o, idx) for idx, o in enumerate(job_overrides, start=initial_job_idx)]
        try:
            jobs = executor.map_array(self, *zip(*params))
        except FailedJobError as err:
            refuse(str(err), self.params)
        print(f"slurm: submitted {len(jobs)} job(s): {', '.join(j.job_id for j in jobs)}; waiting for them "
              f"(logs: {sweep_dir}/.submitit/)", flush=True)
        try:
            watched = watch.wait(jobs)
        except KeyboardInterrupt:  # the jobs are SLURM's now: say so, and how to stop them
            ids = " ".join(j.job_id for j in jobs)
            print(f"\nslurm: stopped waiting; the jobs run on (squeue -j {ids.split('_')[0]}; scancel {ids})",
                  file=sys.stderr)
            raise SystemExit(130) from None
        results, failed = [], 0
        for w, overrides, run_dir, text in zip(watched, job_overrides, dirs, shown):
            out, bad = report.line(w.job.job_id, text, run_dir, w.outcome, w.lost, w.job.paths.stderr)
            print(out, flush=True)
            failed += bad
            if w.outcome is not None and w.outcome[0] == "success":
                results.append(w.outcome[1])
            else:  # no JobReturn came back: one in its place, so a sweeper reading the batch gets every job
                results.append(JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED,
                                         _return_value=float("inf")))
        print(f"slurm: {len(jobs) - failed} of {len(jobs)} job(s) finished" + (f", {failed} failed" if failed else ""),
              flush=True)
        if failed:
            raise SystemExit(1)
        return results


def swept(job_overrides: Sequence[Sequence[str]]) -> list[str]:
    """Each job's overrides that are not every job's: what tells the jobs of a sweep apart in the report (nothing
    for a sweep of one job)."""
    common = set.intersection(*(set(o) for o in job_overrides))
    return [" ".join(o for o in overrides if o not in common) for overrides in job_overrides]


def refuse(message: str, params: dict[str, Any]) -> NoReturn:
    """sbatch refused the job: one line naming the keys of the request and what the partition has (exit code 2)."""
    error = next((line.strip() for line in message.splitlines() if "error" in line), message.strip().splitlines()[-1])
    keys = next((k for text, k in REFUSALS.items() if text.lower() in message.lower()), None)
    keys_asked = keys or ("nodes", "tasks_per_node", "cpus_per_task", "mem_gb", "gpus_per_node")
    asked = ", ".join(f"hydra.launcher.{k}={params.get(k)}" for k in keys_asked)
    print(f"train.py: hydra/launcher=slurm: sbatch refused the request ({error}): {asked}; the partition "
          f"{params.get('partition') or '(default)'} has {partition_nodes(params.get('partition'))}. Change "
          f"{'that key' if keys and len(keys) == 1 else 'those keys'} to fit (README, Scaling out)", file=sys.stderr)
    raise SystemExit(2)


def partition_nodes(partition: str | None) -> str:
    """What one node of the partition offers (sinfo), to size the request against; '?' when sinfo does not say."""
    cmd = ["sinfo", "-h", "-o", "%D nodes of %c CPUs, %m MB, gres %G"] + (["-p", partition] if partition else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    return "; ".join(out.splitlines()) or "?"
