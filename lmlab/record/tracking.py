"""Tracking: the one module that knows the loggers and W&B.

It builds a run's loggers (metrics.csv first, always), names runs and groups (one rule each), opens one W&B run per
job whatever the launcher (Hydra's in-process sweep included: the run is created, never picked up from an earlier
job, and finished when the job ends), keeps the W&B run id in the run directory so a resume continues the same W&B
run, sends what the run is (config) and how it ended (summary, tags), and logs eval's results as W&B runs of the
training run's group. W&B is online when the user has credentials, offline (files in the run directory) otherwise.
"""

from __future__ import annotations

import functools
import netrc
import os
import re
import shlex
import signal
import subprocess
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lmlab.env import is_rank_zero
from lmlab.record.rundir import LOGGER_DIRS, RunDir, strict_json
from lmlab.record.targets import wandb_keys

_DATE, _TIME = re.compile(r"\d{4}-\d{2}-\d{2}"), re.compile(r"\d{2}-\d{2}-\d{2}")
# Keys of the W&B logger's config that are wandb.init's, not Lightning's (the rest go to Lightning's WandbLogger).
INIT_KEYS = ("project", "entity", "notes", "tags")


# --- names ------------------------------------------------------------------------------------------------------

NAME_WIDTH = 64  # about what a dashboard's run list shows before it cuts the name


def run_name(overrides: list[str], swept: list[str] | tuple[str, ...] = ()) -> str:
    """A run is named by its overrides (Hydra's own `hydra.*` ones left out): `placement=post,seed=2`; in a sweep the
    `swept` overrides (the keys that differ across its jobs) lead, so a run list cut short still tells the jobs
    apart. A name longer than NAME_WIDTH is shortened from the key side, never in a value: each dotted key to its
    last part (`mixer.pattern=[...]` to `pattern=[...]`), the swept ones last of all."""
    own = [o for o in overrides if not o.lstrip("+").startswith("hydra")]
    lead = [o for o in own if o in swept or o[:64] in swept]  # (a sweep's tags: W&B cuts a tag at 64 characters)
    ordered = lead + [o for o in own if o not in lead]
    name = ",".join(ordered)
    if len(name) > NAME_WIDTH:
        short = [o if o in lead else _last_key(o) for o in ordered]
        name = ",".join(short)
        if len(name) > NAME_WIDTH:
            name = ",".join(_last_key(o) for o in short)
    return name or "default"


def _last_key(override: str) -> str:
    """`mixer.pattern=[gdn,attention]` -> `pattern=[gdn,attention]`: the key's last part, the value whole."""
    key, eq, value = override.partition("=")
    return f"{key.rpartition('.')[2]}{eq}{value}" if eq else override


def experiment_of(overrides: list[str]) -> str | None:
    """The study a run belongs to: the value of its `experiment=` override, if any."""
    names = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("experiment=")]
    return names[-1] if names and names[-1] not in ("null", "") else None


def group_name(directory: str | Path, experiment: str | None) -> str:
    """A sweep's group (or a single run's, which its eval runs join), named by its directory: Hydra's
    `multirun/<date>/<time>` (or `outputs/<date>/<time>`) gives `<date>_<time>`, any other directory its name;
    prefixed with the experiment: `postnorm_warmup-2026-11-30_23-40-12`."""
    path = Path(directory)
    stamp = f"{path.parent.name}_{path.name}" if _DATE.fullmatch(path.parent.name) and _TIME.fullmatch(path.name) \
        else path.name
    return f"{experiment}-{stamp}" if experiment else stamp


def hydra_group(hydra: Any) -> str:
    """The group of a job launched by train.py: its sweep's in a multirun, its own run directory's otherwise."""
    directory = hydra.sweep.dir if hydra.mode.name == "MULTIRUN" else hydra.runtime.output_dir
    return group_name(directory, experiment_of(list(hydra.overrides.task)))


# --- W&B settings -------------------------------------------------------------------------------------------------

def wandb_mode() -> str:
    """WANDB_MODE when the user set it; else online with credentials (WANDB_API_KEY, or a `wandb login` entry in
    the netrc file for the W&B host), offline without."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    path = os.environ.get("NETRC") or str(Path.home() / ".netrc")
    try:
        return "online" if netrc.netrc(path).authenticators(host) else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


@functools.cache
def code_version() -> dict[str, str | None]:
    """lmlab's version and, in a git checkout of lmlab, the commit (None otherwise)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        lmlab_version = version("lmlab")
    except PackageNotFoundError:
        lmlab_version = None
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        top, commit = out.stdout.split() if out.returncode == 0 else (None, None)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        top, commit = None, None
    same = top is not None and Path(top).resolve() == root  # not a repository that merely contains site-packages
    return {"lmlab_version": lmlab_version, "git_commit": commit if same else None}


def _is(spec: Any, cls: type) -> bool:
    from hydra.utils import get_class

    from lmlab.record.trusted import TRUSTED_MODULES

    target = spec.get("_target_") if spec is not None else None
    if not isinstance(target, str) or not target.startswith(TRUSTED_MODULES):  # nothing else is imported to ask
        return False
    try:
        return bool(target) and issubclass(get_class(target), cls)
    except (ImportError, ValueError, TypeError):  # not a class here (a run's logger that is gone): not this one
        return False


def wandb_spec(loggers: Any) -> dict[str, Any] | None:
    """The W&B logger's entry of a `logger` config (any `_target_` that is Lightning's WandbLogger or a subclass)."""
    specs = [dict(spec) for spec in (loggers or {}).values() if spec is not None and spec.get("_target_")]
    if not specs:  # logger=csv or none: nothing to ask Lightning (eval.py reads such a run without importing it)
        return None
    from lightning.pytorch.loggers import WandbLogger

    return next((spec for spec in specs if _is(spec, WandbLogger)), None)


def _init(**kwargs: Any):
    """A new W&B run, whatever run this process already has (an earlier job of an in-process sweep)."""
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    return wandb.init(mode=kwargs.pop("mode", None) or wandb_mode(), reinit="create_new", **kwargs)


def _where(run, directory: Path) -> None:
    """Where the run's W&B files are, and the two commands that show them."""
    if run.settings.mode == "disabled":
        return
    d = shlex.quote(str(directory))
    print(f"W&B run {run.id} ({getattr(run, 'url', None) or 'offline'}) -> {directory}\n"
          f"  wandb sync {d}    # upload it to W&B\n"
          f"  wandb leet {d}    # browse it in the terminal")


# --- a training run -------------------------------------------------------------------------------------------

def log_at(trainer: Any, metrics: dict[str, float], step: int) -> None:
    """The channel a callback logs through (the stability monitor, a task's metrics): hand the figures to the run's
    loggers with the step they were measured at (rank 0 writes).

    Not through `LightningModule.log`: Lightning re-emits a callback's last value at every later logging step until
    it is logged again, so a figure measured at step 0 would also appear at steps 9, 19, ... (and each Python float
    would be copied to the GPU, a blocking sync).
    """
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


class Tracking:
    """One job's loggers and W&B run: `start` before the Trainer exists, `finish` when the job ends."""

    def __init__(self, loggers: list, run: Any = None, directory: Path | None = None) -> None:
        self.loggers, self.run, self.directory = loggers, run, directory

    @classmethod
    def start(cls, cfg: Any, run_dir: RunDir, *, overrides: list[str], group: str | None, resume_step: int | None,
              n_params: int, n_active_params: int | None = None, tags: list[str] | None = None) -> Tracking:
        """The loggers of `cfg.logger` after lmlab's MetricsCSV. `resume_step`: the step a resumed run continues
        from (None: a fresh start, which gets a new W&B run; a resume continues the one the directory names).
        `tags`: the W&B run's tags beside logger.wandb.tags and the experiment (a sweep job's swept `key=value`s)."""
        from lightning.pytorch.loggers import Logger, TensorBoardLogger, WandbLogger
        from omegaconf import OmegaConf

        from lmlab.record.metrics_csv import MetricsCSV
        from lmlab.record.trusted import build

        # What the run is: the whole resolved config, its overrides, its size and the code that ran it.
        from lmlab.record.summary import recorded  # `${oc.env:...}` values as their text, never in clear

        config = {**recorded(cfg), "overrides": list(overrides), "n_params": n_params,
                  "n_active_params": n_params if n_active_params is None else n_active_params,
                  **code_version()}
        loggers, wandb_run = [MetricsCSV(run_dir.path, resume_step)], None
        for name, spec in (cfg.logger or {}).items():
            extra: dict[str, Any] = {}
            if _is(spec, WandbLogger):  # the run is lmlab's: created here, Lightning's logger writes to it
                wandb_run = cls._wandb_run(config, dict(spec), run_dir, overrides, group, resume_step, tags or [])
                extra = {"experiment": wandb_run, "save_dir": str(run_dir.path)}
                spec = OmegaConf.create({k: v for k, v in spec.items() if k not in (*INIT_KEYS, "offline")})
            elif _is(spec, TensorBoardLogger):
                extra = {k: v for k, v in {"save_dir": str(run_dir.path), "name": LOGGER_DIRS["tensorboard"],
                                           "version": ""}.items()
                         if spec.get(k) is None}
            logger = build(spec, f"logger.{name}", Logger, **extra)  # only a Lightning logger (lmlab.record.trusted)
            if not isinstance(logger, WandbLogger):
                logger.log_hyperparams(config)  # W&B has it from wandb.init
            loggers.append(logger)
        return cls(loggers, wandb_run, run_dir.wandb)

    @staticmethod
    def _wandb_run(config: dict[str, Any], spec: dict[str, Any], run_dir: RunDir, overrides: list[str],
                   group: str | None, resume_step: int | None, tags: list[str]):
        """The job's W&B run (rank 0 only; other ranks log nothing): the directory's run continued on resume."""
        if not is_rank_zero():
            return None
        stored = None
        if resume_step is not None:
            try:
                stored = run_dir.read_wandb_run()
            except ValueError as err:
                warnings.warn(f"{err}: this attempt starts a new W&B run", stacklevel=2)
        experiment = experiment_of(overrides)
        name, group = run_name(overrides, tags), group or group_name(run_dir.path, experiment)
        run_dir.wandb.mkdir(parents=True, exist_ok=True)
        run = _init(project=spec.get("project") or "lmlab", entity=spec.get("entity"), notes=spec.get("notes"),
                    dir=str(run_dir.path), name=name, group=group, job_type="train", config=config,
                    tags=[*(spec.get("tags") or []), *([experiment] if experiment else []), *tags],
                    id=stored["id"] if stored else None, resume="allow" if stored else None,
                    mode="offline" if spec.get("offline") else None)
        # Every figure is plotted against the training step it was measured at, resumed runs included.
        run.define_metric("trainer/global_step")
        run.define_metric("*", step_metric="trainer/global_step", step_sync=True)
        run_dir.write_wandb_run({"id": run.id, "name": name, "group": group, "project": run.project})
        return run

    def finish(self, summary: dict[str, Any]) -> None:
        """End the W&B run with what summary.json says: its figures as the run's summary, its status as a tag,
        and the exit code the job has (0 for a result, completed or not; 128+signal interrupted; 1 failed)."""
        self._finish_tensorboard(summary)
        if self.run is None:
            return
        from lmlab.record.summary import EXIT_CODES, FINISHED, STATUSES

        status, run, self.run = summary["status"], self.run, None
        try:
            run.summary.update(strict_json(_figures(summary)))
            run.tags = (*(t for t in run.tags if t not in STATUSES), status)
            if status in FINISHED:
                code = 0
            elif status == "interrupted":  # train.py's exit code (Ctrl-C pressed twice: SIGINT's)
                code = EXIT_CODES.get(summary.get("signal") or signal.SIGINT, 1)
            else:
                code = 1
            run.finish(exit_code=code)
        except Exception as exc:  # noqa: BLE001  (the run's own record, summary.json, is written already)
            warnings.warn(f"W&B: could not finish run {run.id}: {type(exc).__name__}: {exc}", stacklevel=2)
        _where(run, self.directory)


    def _finish_tensorboard(self, summary: dict[str, Any]) -> None:
        """TensorBoard gets summary.json's figures as `summary/<name>` scalars at the run's last step: the HParams
        tab lists them per run beside its config (a sweep's runs side by side, sortable), the status as 0/1 flags."""
        from lightning.pytorch.loggers import TensorBoardLogger

        from lmlab.record.summary import STATUSES

        figures = {f"summary/{k}": float(v) for k, v in _figures(summary).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None}
        figures.update({f"summary/status_{s}": float(summary.get("status") == s) for s in STATUSES})
        for logger in self.loggers:
            if isinstance(logger, TensorBoardLogger) and logger.experiment is not None:
                logger.log_metrics(figures, step=int(summary.get("steps") or 0))
                logger.finalize("success")


def _figures(summary: dict[str, Any]) -> dict[str, Any]:
    """summary.json's scalars, and its `to_target` under one name per figure and target
    (lmlab.record.targets.wandb_keys):
    what a run's W&B summary (and TensorBoard's summary/ scalars) show."""
    return {**{k: v for k, v in summary.items() if v is None or isinstance(v, (str, int, float, bool))},
            **wandb_keys(summary.get("to_target"))}


# --- eval -------------------------------------------------------------------------------------------------------

def log_eval(result: dict[str, Any], out: Path, run_dir: Path, run_cfg: dict[str, Any],
             columns: list[str]) -> None:
    """The eval table (and plot) as a W&B run (job_type eval) in the training run's project and group, named
    `eval:<training run's name>`, when the training run logged to W&B; its files go to `out`/wandb."""
    spec = wandb_spec(run_cfg.get("logger"))
    if spec is None:
        return
    import wandb

    run = RunDir(run_dir)
    train = run.read_wandb_run() or {}
    overrides = (run.read_summary() or {}).get("overrides") or []
    name = train.get("name") or run_name(overrides)
    (out / "wandb").mkdir(parents=True, exist_ok=True)
    w = _init(project=train.get("project") or spec.get("project") or "lmlab", entity=spec.get("entity"),
              dir=str(out), job_type="eval", name=f"eval:{name}",
              group=train.get("group") or group_name(run.path, experiment_of(overrides)),
              config={"run": str(run.path), "train_run_id": train.get("id"), "trained_len": result["trained_len"],
                      "run_status": result["run_status"], **code_version()},
              mode="offline" if spec.get("offline") else None)
    w.log({"eval/extension": wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in result["rows"]])})
    if (png := out / "plots" / "length_extension.png").exists():
        w.log({"eval/length_extension": wandb.Image(str(png))})
    w.finish()
    _where(w, out / "wandb")
