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

from hydra_plugins.lmlab_slurm.recorded import Recorded

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


class LmlabSlurmLauncher(Recorded, SlurmLauncher or object):
    """`launch` as hydra-submitit-launcher's (the same executor, parameters and job array), recorded in the sweep's
    manifest (recorded.py: the SLURM job ids too), then `wait` and `report` instead of submitit's `results()` -- or,
    with `hydra.launcher.wait=false`, return at once: the jobs are SLURM's, `lmlab sweep status DIR` follows them."""

    recorded_as = "slurm"

    def __init__(self, **params: Any) -> None:
        self.wait = bool(params.pop("wait", True))
        super().__init__(**params)

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

        check_lines(self.params)
        init = {"folder": self.params["submitit_folder"], "slurm_max_num_timeout": self.params["max_num_timeout"]}
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in self.params.items()
                                      if k not in ("submitit_folder", "max_num_timeout")})
        return executor

    def launch_recorded(self, jobs: Sequence[tuple[int, list[str], Path]]) -> Sequence[Any]:
        import logging
        import os

        from hydra.core.singleton import Singleton
        from hydra.core.utils import JobReturn, JobStatus, filter_overrides
        from submitit.core.utils import FailedJobError

        from hydra_plugins.lmlab_slurm import report, watch
        from lmlab.record import sweep

        log = logging.getLogger("hydra_plugins.hydra_submitit_launcher.submitit_launcher")
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        if not jobs:
            return []
        if not self.wait and searching(self.config):
            print("train.py: hydra.launcher.wait=false submits every job at once; a search "
                  f"(hydra.sweeper={self.config.hydra.sweeper._target_}) chooses its next trials from the results of "
                  "the last, so it waits: leave hydra.launcher.wait=true with hparams_search", file=sys.stderr)
            raise SystemExit(2)
        executor = self.executor()
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
        if "mode" in self.config.hydra.sweep:
            sweep_dir.chmod(int(str(self.config.hydra.sweep.mode), 8))
        params = []
        for idx, overrides, _ in jobs:
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        job_overrides = [o for _, o, _ in jobs]
        shown = swept(job_overrides)
        dirs = [d for _, _, d in jobs]
        # `pending` before sbatch, not after: a job refused at once (optim.lr=abc) can say `failed` before sbatch
        # returns here, and a word written after it would bury the job's own (the job then read as lost)
        previous = {j["dir"]: j.get("submissions", 0) for j in (sweep.read(sweep_dir) or {"jobs": []})["jobs"]}
        rel = [os.path.relpath(d, sweep_dir) for d in dirs]
        sweep.record_jobs(sweep_dir, {r: {"state": "pending", "error": None, "submissions": previous.get(r, 0) + 1}
                                      for r in rel})
        try:
            submitted = executor.map_array(self, *zip(*params))
        except FailedJobError as err:
            refuse(str(err), self.params)
        sweep.record_jobs(sweep_dir, {r: {"scheduler_id": j.job_id, "log": str(j.paths.stderr)}
                                      for r, j in zip(rel, submitted)})
        ids = ", ".join(j.job_id for j in submitted)
        if not self.wait:  # fire and forget: the jobs are SLURM's, the manifest says where they are
            print(f"slurm: submitted {len(submitted)} job(s): {ids}; not waiting (hydra.launcher.wait=false). "
                  f"Follow them with: lmlab sweep status {sweep_dir}", flush=True)
            return [JobReturn(overrides=list(o), status=JobStatus.COMPLETED, _return_value=float("inf"))
                    for o in job_overrides]
        print(f"slurm: submitted {len(submitted)} job(s): {ids}; waiting for them "
              f"(logs: {sweep_dir}/.submitit/; from another shell: lmlab sweep status {sweep_dir})", flush=True)
        try:
            watched = watch.wait(submitted)
        except KeyboardInterrupt:  # the jobs are SLURM's now: say so, and how to stop them
            ids = " ".join(j.job_id for j in submitted)
            print(f"\nslurm: stopped waiting; the jobs run on (lmlab sweep status {sweep_dir}; "
                  f"squeue -j {ids.split('_')[0]}; scancel {ids})", file=sys.stderr)
            raise SystemExit(130) from None
        results, failed, report_lines = [], 0, []
        for w, overrides, run_dir, text in zip(watched, job_overrides, dirs, shown):
            out, bad = report.line(w.job.job_id, text, run_dir, w.outcome, w.lost, w.job.paths.stderr)
            print(out, flush=True)
            if bad:
                report_lines.append(out)
            failed += bad
            if w.outcome is not None and w.outcome[0] == "success":
                results.append(w.outcome[1])
            else:  # no JobReturn came back: one in its place, so a sweeper reading the batch gets every job
                results.append(JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED,
                                         _return_value=float("inf")))
        states = {r["dir"]: {"state": r["state"]} for r in sweep.job_states(sweep_dir) if r["dir"] in set(rel)}
        sweep.record_jobs(sweep_dir, states)
        print(f"slurm: {len(submitted) - failed} of {len(submitted)} job(s) finished"
              + (f", {failed} failed" if failed else ""), flush=True)
        if failed and not searching(self.config):
            raise SystemExit(1)
        if failed:  # the search goes on past them; train.py exits 1 at its end, listing them
            from lmlab.commands.train import FAILED_JOBS

            FAILED_JOBS.extend(line for line in report_lines if " failed" in line or "SLURM state" in line)
        return results


def check_lines(params: Any, key: str = "hydra.launcher") -> None:
    """Every string of the launcher's settings is one line: each becomes (part of) a line of the sbatch script, so a
    newline in a comment, name or partition would be a shell line of its own. Refused naming the key."""
    from lmlab.record.saved import control_char

    if isinstance(params, str):
        if bad := control_char(params):
            raise ValueError(f"{key}={params!r}: a control character ({bad}) in a line of the sbatch script")
    elif isinstance(params, dict):
        for k, v in params.items():
            check_lines(v, f"{key}.{k}")
    elif isinstance(params, list | tuple):
        for i, v in enumerate(params):
            check_lines(v, f"{key}[{i}]")


def searching(config: Any) -> bool:
    """Whether a sweeper other than the basic one drives the sweep (Optuna): it reads a failed job's +inf and goes on
    to its next trials, so a failed job does not end the command there (train.py says so at the end)."""
    target = str(config.hydra.sweeper.get("_target_", ""))
    return bool(target) and not target.endswith("BasicSweeper")


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
