"""lmlab's launchers, in the hydra_plugins namespace where Hydra requires launchers to live, each recording its sweep
in the sweep's manifest (recorded.py: the default `hydra/launcher=serial`, and `local`): `hydra/launcher=slurm`
(launcher.py: hydra-submitit-launcher's, waiting for every job and reporting how each ended, or with `wait=false`
returning at once) and `hydra/launcher=slurm_dry_run` (below). SLURM goes through hydra-submitit-launcher
(`pip install '.[slurm]'`).

`hydra/launcher=slurm` (conf/hydra/launcher/slurm.yaml) maps `trainer.num_nodes` x `trainer.devices` to
`--nodes` x `--ntasks-per-node`, one GPU per task (`--gpus-per-node` = `trainer.devices`), so that srun starts one
process per GPU and Lightning's SLURMEnvironment reads each one's rank from SLURM_PROCID / SLURM_LOCALID /
SLURM_NODEID. The warning before the time limit is SIGUSR1 (`--signal=USR1@<signal_delay_s>`): lmlab saves at the
step boundary and requeues the job itself (lmlab/run/interrupt.py). submitit's own default is USR2, which would run
submitit's checkpoint-and-resubmit handler instead, without lmlab's checkpoint.

`hydra/launcher=slurm_dry_run` runs `hydra/launcher=slurm`'s `launch` unchanged (the same executor, the same
parameters, submitit's own `_make_sbatch_string`) up to the point where submitit would call `sbatch`, and prints
the script it would have submitted instead. Nothing is submitted and nothing is trained; the job pickles submitit
writes on the way are removed again. No cluster is needed (submitit's check that `srun` exists is skipped).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

from hydra_plugins.lmlab_slurm.launcher import LmlabSlurmLauncher  # noqa: F401  (hydra/launcher=slurm's _target_)


class _Submitted(Exception):
    """Raised where submitit would run sbatch: the dry run ends there."""


class DryRunSlurmLauncher(LmlabSlurmLauncher):
    """Everything `hydra/launcher=slurm` does until `sbatch`; then print the sbatch script instead of submitting it.
    `scripts` keeps what was printed (one script per submission: a sweep is one job array)."""

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.scripts: list[str] = []

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
        from submitit.core.utils import JobPaths
        from submitit.slurm.slurm import SlurmExecutor

        def sbatch(executor: SlurmExecutor, command: str) -> None:  # in place of SlurmExecutor._submit_command
            self.scripts.append(executor._make_submission_file_text(command, "dry-run"))
            raise _Submitted

        root = JobPaths.get_first_id_independent_folder(self.params["submitit_folder"])
        before = set(root.rglob("*")) if root.exists() else set()
        existed = root.exists()
        try:
            with mock.patch.object(SlurmExecutor, "_submit_command", sbatch), \
                    mock.patch.object(SlurmExecutor, "affinity", classmethod(lambda cls: 2)):
                self.launch_recorded([(i, list(o), self.job_dir(o, i))  # not recorded: a dry run writes nothing
                                      for i, o in enumerate(job_overrides, start=initial_job_idx)])
        except _Submitted:
            pass
        finally:  # the job pickles submitit wrote for the jobs that were not submitted
            _remove_new(root, before, existed)
        jobs = [f"  array task {i}: {' '.join(o) or '(no overrides)'}" for i, o in enumerate(job_overrides)]
        print(f"# hydra/launcher=slurm_dry_run: nothing submitted. `sbatch` would get this script "
              f"({len(job_overrides)} job(s)):\n" + "\n".join(jobs) + "\n")
        for script in self.scripts:
            print(script)
        sys.stdout.flush()
        return []


def _remove_new(root: Path, before: set[Path], existed: bool) -> None:
    import shutil

    if not root.exists():
        return
    if not existed:
        shutil.rmtree(root, ignore_errors=True)
        return
    for path in sorted(set(root.rglob("*")) - before, reverse=True):  # files before their directories
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
