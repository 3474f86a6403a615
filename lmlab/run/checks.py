"""The checks a run's config passes before anything is built, loaded or trained: architecture (on the meta device),
optimizer, schedule, the run's own keys, the devices, the attention's memory. Torch and lmlab's model code only, no
Lightning: the command runs them first, so a bad value is refused in about the time Hydra takes to compose (plus
torch's import), not after the whole training stack is imported."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from omegaconf import DictConfig, OmegaConf

from lmlab.cli import override_key
from lmlab.config import GPTConfig, arch_config
from lmlab.data.keys import DATA_KEYS
from lmlab.data.sources import check_sources
from lmlab.model.capabilities import ChecksRun
from lmlab.model.gpt import GPT, meta_model
from lmlab.model.head import HEADS
from lmlab.model.memory import check_attention_fits, check_batch_fits
from lmlab.model.norm import NORMS
from lmlab.optim import OPTIMIZERS, check_pieces, optimizer_spec, validate_optim
from lmlab.optim.capabilities import capabilities
from lmlab.optim.overrides import check as check_groups
from lmlab.record.targets import check_targets
from lmlab.registry import PositiveFloat, PositiveInt, Range, check_values, option_params
from lmlab.run import budget, features, seeds


def _slurm_launched() -> bool:
    """Lightning's SLURMEnvironment.detect(), imported only inside a SLURM allocation (srun sets SLURM_NTASKS)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect()


def top_level_keys() -> frozenset[str]:
    """The keys a training config may hold at its top: train.yaml's own and its groups' (`hydra` too, which Hydra
    itself reads). An experiment or recipe sets these; a key added beside them (`+lr=1e-3`) is read by nothing."""
    import yaml

    from lmlab.registry import CONF_DIR

    own = yaml.safe_load((CONF_DIR / "train.yaml").read_text())
    groups = {next(iter(d)).split()[-1].split("/")[0].split("@")[0] for d in own["defaults"] if isinstance(d, dict)}
    return frozenset(own.keys() - {"defaults"} | groups | {"hydra"})


def check_unknown_top_level(cfg: DictConfig) -> None:
    """Refuse, naming it and the closest known keys, a top-level key that nothing reads (added with `+key=...` on the
    command line, in an experiment of one's own, or in a saved overrides file)."""
    import difflib

    known = top_level_keys()
    for key in (str(k) for k in cfg.keys()):
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise ValueError(f"{key}: lmlab's config has no top-level key {key!r}, so nothing would read it{hint} "
                             f"(the keys: {', '.join(sorted(known - {'hydra'}))})")


# Lightning's precision values (lightning.fabric.connector's _PRECISION_INPUT, which tests/unit/run/test_checks_keys.py
# compares with these): checked here, before Lightning is imported, to refuse a bad one in one line by its key
PRECISIONS = ("transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true", "bf16-mixed",
              "32-true", "64-true", "64", "32", "16", "bf16", 64, 32, 16)


def check_precision(precision: Any) -> None:
    if precision is not None and (isinstance(precision, bool) or precision not in PRECISIONS):
        raise ValueError(f"trainer.precision={precision!r} is not a precision Lightning knows; choose one of "
                         f"{', '.join(str(p) for p in PRECISIONS[:8])} (or 64, 32, 16, bf16)")


def check_config(cfg: DictConfig, overrides: Sequence[str] | None = None) -> GPT:
    """Everything that can be checked without data: architecture (on the meta device), optimizer, schedule (types
    and ranges from each option's signature), the run's own keys, each run-time feature's (lmlab.run.features), the
    devices, and the attention's memory. `overrides`, the command's, tell a warmup the user chose from a smoke run of a
    config's own (None: unknown). Returns the model it built on the meta device, which the start reads again
    (lmlab.run.training.train's `checked`) rather than build it once more."""
    check_unknown_top_level(cfg)
    eod = 0 if cfg.data.get("eod") is not None else None  # its id is the tokenizer's: any id checks the model here
    arch = arch_config(cfg, vocab_size=cfg.model.vocab_size or STAND_IN_VOCAB, eod_id=eod)
    if "labels" in arch.head and arch.head["labels"] is None:  # head=classify: the data's labels, read with the data
        arch.head["labels"] = ["0", "1"]  # (as vocab_size is the tokenizer's): any two check the model here
    model = meta_model(arch)  # the architecture's checks, and its shapes for the optimizer's below (no memory)
    gcfg, strategy, optim = model.cfg, strategy_name(cfg), OmegaConf.to_container(cfg.optim)
    validate_optim(optim, OmegaConf.to_container(cfg.schedule), strategy, gcfg.param)
    check_pieces(optim, model)
    opt_name = option_params("optim", OPTIMIZERS, optimizer_spec(optim))[0]
    caps = capabilities(OPTIMIZERS[opt_name])
    check_groups(optim, caps.roles, model)
    if isinstance(norm := NORMS[gcfg.norm["name"]], ChecksRun):  # a norm that constrains the loop (ngpt)
        norm.check_run(optim, strategy, bool(caps.averages))
    if isinstance(cfg.get("compile"), str) and strategy == "FSDP2Strategy":
        raise ValueError(f"compile={cfg.compile} with trainer=fsdp2: FSDP2 compiles each block inside its hooks, where "
                         f"a recorded CUDA graph would replay stale all-gathers; use compile=true with trainer=fsdp2")
    absent = object()
    values = {key: OmegaConf.select(cfg, key, default=absent) for key in RUN_KEYS}
    check_values("", {k: v for k, v in values.items() if v is not absent}, RUN_KEYS)
    seeds.check(cfg)  # seeds.init / .data / .dropout: each a seed like `seed`, or null (lmlab.run.seeds)
    if "sources" in cfg.data.keys():  # data=mixture: its sources by key (lmlab.data.sources)
        check_sources(OmegaConf.to_container(cfg.data, resolve=True))
    check_launch(cfg.trainer.get("devices", 1), cfg.trainer.get("num_nodes", 1))
    check_precision(cfg.trainer.get("precision"))
    features.check(cfg, model)  # each run-time feature's keys: QK-clip, FP8, downstream tasks... (lmlab.run.features)
    if gcfg.untie_at_step is not None and gcfg.untie_at_step >= int(cfg.trainer.max_steps):
        warnings.warn(f"model.untie_at_step={gcfg.untie_at_step} >= trainer.max_steps={cfg.trainer.max_steps}: the "
                      f"head stays tied for the whole run (lower model.untie_at_step, or raise trainer.max_steps)",
                      stacklevel=2)
    budget.chosen(cfg)  # budget.*: one at most, > 0
    check_targets(cfg.get("targets"))  # targets: a list of val losses > 0
    _check_devices(cfg, gcfg, strategy)
    _check_memory(cfg, gcfg, strategy)

    warmup, max_steps = cfg.schedule.get("warmup_steps", 0), cfg.trainer.max_steps
    chosen = overrides is None or any(override_key(o) == "schedule.warmup_steps" for o in overrides)
    if warmup >= max_steps and chosen:  # a warning, not a refusal; not for a smoke run (steps cut, warmup the config's)
        warnings.warn(f"schedule.warmup_steps={warmup} >= trainer.max_steps={max_steps}: the whole run is warmup, "
                      f"so the learning rate never settles at optim.lr (lower schedule.warmup_steps or raise "
                      f"trainer.max_steps unless this is a smoke run)", stacklevel=2)
    return model


STAND_IN_VOCAB = 256  # the vocabulary check_config builds the model with when model.vocab_size leaves it to the data

RUN_KEYS = {  # the keys of train.yaml and the shared ones of conf/data (DATA_KEYS), typed like an option's keys
    "seed": Annotated[int, Range(ge=0, le=2**32 - 1)],  # numpy's bounds (lmlab seeds numpy with it)
    "trainer.log_every_n_steps": PositiveInt,  # 0 would log no training row at all
    "threads": PositiveInt | None, "compile": bool | Literal["reduce-overhead", "max-autotune"],
    "malloc": Literal["system", "keep"],
    "trainer.max_steps": PositiveInt, "perf.peak_flops": PositiveFloat | None, "trainer.num_nodes": PositiveInt,
    "trainer.val_check_interval": PositiveInt,  # steps: the training loader never ends, so no fraction of an epoch
    **{f"data.{k}": t for k, t in DATA_KEYS.items()},
}


def _check_devices(cfg: DictConfig, gcfg: GPTConfig, strategy: str) -> None:
    """A GPU the trainer asks for is there; DDP's every-parameter-used rule against model.untie_at_step."""
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    if (accelerator in ("gpu", "cuda") or strategy == "fsdp") and not torch.cuda.is_available():
        key = f"trainer.strategy={strategy}" if strategy == "fsdp" else f"trainer.accelerator={accelerator}"
        fix = {"fsdp": "trainer=fsdp2 trainer.accelerator=cpu trainer.devices=2 (FSDP2 runs on CPU with gloo; "
                       "trainer=fsdp is FSDP1, CUDA only)",
               "ddp": "trainer=ddp trainer.accelerator=cpu trainer.devices=2",
               "FSDP2Strategy": "trainer=fsdp2 trainer.accelerator=cpu trainer.devices=2"}.get(
            strategy, "trainer=cpu (trainer.accelerator=cpu)")
        raise ValueError(f"{key} needs a CUDA GPU (none found); on CPU use {fix}")
    if gcfg.untie_at_step is not None and strategy.startswith("ddp") and "find_unused_parameters_true" not in strategy:
        raise ValueError(f"model.untie_at_step={gcfg.untie_at_step} leaves the head's own matrix without a gradient "
                         f"until that step, which trainer.strategy={strategy} refuses (DDP expects every parameter "
                         f"used): use trainer.strategy=ddp_find_unused_parameters_true, or trainer=fsdp2")


def _check_memory(cfg: DictConfig, gcfg: GPTConfig, strategy: str) -> None:
    """The attention's scores and a batch's activations fit the device, at the largest batch a schedule reaches."""
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    staged = budget.stages_of(cfg)  # data.batch_schedule / seq_schedule (lmlab.data.stages), checked by key
    largest = max([b for _, b in (staged or {}).get("batch") or []] + [int(cfg.data.get("batch_size", 1))])
    if staged and staged["batch"] and HEADS[gcfg.head["name"]].draws:  # every head declares it
        raise ValueError(f"data.batch_schedule with head={gcfg.head['name']}: its masks are keyed by a sequence's "
                         f"place in a fixed-size batch; use one data.batch_size, or head=next")
    check_attention_fits(f"model.max_seq_len={gcfg.max_seq_len}", gcfg.position["name"], gcfg.attn_heads,
                         gcfg.max_seq_len, largest, "cuda" if on_gpu else "cpu")
    check_batch_fits(largest, gcfg.max_seq_len, gcfg.d_model, gcfg.n_layer, "cuda" if on_gpu else "cpu")


# --- downstream (lmlab.run.features.downstream): lm-eval tasks scored at validations, checked without importing lm-eval

EXAMPLE_TASKS = Path(__file__).resolve().parents[2] / "examples" / "lm_eval"  # the checkout's task files


def _task_name(path: Path) -> str | None:
    """The `task:` name of an lm-eval task YAML file (None: a group's file, or not a task file); lm-eval's own tags
    (`!function ...`) are read as nothing."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    try:
        doc = yaml.load(path.read_text(), Loader=Loader)  # a SafeLoader
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return doc.get("task") if isinstance(doc, dict) and isinstance(doc.get("task"), str) else None


def example_tasks(directory: Path = EXAMPLE_TASKS) -> dict[str, Path]:
    """The tasks of examples/lm_eval/ by name (their YAML's `task:`): what downstream.tasks may name."""
    found = {}
    for path in sorted(directory.glob("*.y*ml")) if directory.is_dir() else []:
        if (name := _task_name(path)) is not None:
            found.setdefault(name, path)
    return found


def downstream_task(spec: Any) -> Path:
    """One entry of downstream.tasks as its task YAML file: a task of examples/lm_eval/ by name, or the path of a
    task YAML file (.yaml or .yml, relative to the working directory); anything else is refused, naming both."""
    known = example_tasks()
    accepted = (f"a task of {EXAMPLE_TASKS} ({', '.join(known) or 'none here'}) or the path of an lm-eval task YAML "
                f"file")
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"downstream.tasks: {spec!r} is not a task name; each entry is {accepted}")
    if spec in known:
        return known[spec]
    path = Path(spec).expanduser()
    if path.suffix in (".yaml", ".yml") or "/" in spec:
        if not path.is_file():
            raise ValueError(f"downstream.tasks: the task file {spec} is not found (from {Path.cwd()}); each entry is "
                             f"{accepted}")
        if _task_name(path) is None:
            raise ValueError(f"downstream.tasks: {spec} names no task (no `task: <name>` in it); each entry is "
                             f"{accepted}")
        return path
    raise ValueError(f"downstream.tasks: unknown task {spec!r}; each entry is {accepted} (lm-eval's own tasks fetch "
                     f"their data from the Hub: run them after training, eval.py run=<run> harness={spec})")


def check_downstream(block: dict[str, Any] | None) -> None:
    """The `downstream:` keys, refused by name before training: every_n_vals an integer >= 1, limit null or an
    integer >= 1, tasks a list of tasks that exist (downstream_task), each once, and lm-eval installed to run them."""
    import importlib.util

    from lmlab.registry import PositiveInt, check_values

    if not block:
        return
    check_values("downstream.", block, {"every_n_vals": PositiveInt, "limit": PositiveInt | None})
    tasks = block.get("tasks") or []
    tasks = [tasks] if isinstance(tasks, str) else tasks
    if not isinstance(tasks, list):
        raise ValueError(f"downstream.tasks={tasks!r} must be a list of task names or task YAML files")
    named = [_task_name(downstream_task(spec)) for spec in tasks]
    if twice := sorted({n for n in named if named.count(n) > 1}):
        raise ValueError(f"downstream.tasks={tasks} names the task {', '.join(twice)} twice: list each task once")
    if tasks and importlib.util.find_spec("lm_eval") is None:
        raise ValueError("downstream.tasks needs lm-eval, the `eval` extra: pip install '.[eval]' (or "
                         "downstream.tasks=[] to train without)")


def strategy_name(cfg: DictConfig) -> str:
    """`trainer.strategy` as a name: Lightning's string, or the class a `_target_` builds (FSDP2Strategy)."""
    strategy = cfg.trainer.get("strategy", "auto")
    return strategy.get("_target_", "").rpartition(".")[2] if isinstance(strategy, DictConfig) else str(strategy)


def check_launch(devices: Any, num_nodes: int) -> None:
    """Under a launcher that starts one process per device itself (srun in a SLURM job, torchrun), Lightning takes
    the ranks from the environment, and `trainer.devices` x `trainer.num_nodes` must be the launcher's layout:
    `trainer.devices` a number of processes per node (not auto), `trainer.num_nodes` the number of nodes."""
    import torch

    env = os.environ
    if torch.distributed.is_available() and torch.distributed.is_torchelastic_launched():
        launcher, per_node, nodes = "torchrun", env.get("LOCAL_WORLD_SIZE"), None
        if per_node and env.get("WORLD_SIZE"):
            nodes = str(int(env["WORLD_SIZE"]) // max(1, int(per_node)))
        per_node_flag, nodes_flag = "--nproc_per_node", "--nnodes"
    elif "SLURM_NTASKS" in env and _slurm_launched():
        launcher, per_node, nodes = "SLURM (srun)", env.get("SLURM_NTASKS_PER_NODE"), env.get("SLURM_NNODES")
        per_node_flag, nodes_flag = "--ntasks-per-node", "--nodes"
    else:
        return
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        hint = f"trainer.devices={per_node}" if per_node and per_node.isdigit() else "trainer.devices=<GPUs per node>"
        raise ValueError(f"trainer.devices={devices!r} must be a number of devices per node under {launcher}, which "
                         f"starts one process per device and gives each its rank; use {hint}")
    for key, value, flag, have in (("trainer.devices", devices, per_node_flag, per_node),
                                   ("trainer.num_nodes", num_nodes, nodes_flag, nodes)):
        if have is not None and have.isdigit() and int(have) != value:
            raise ValueError(f"{key}={value} but {launcher} started {flag}={have}; use {key}={have}")
