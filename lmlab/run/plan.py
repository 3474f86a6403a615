"""A run's plan: everything that decides what it will do, worked out before its directory is touched.

`make_plan(cfg, run, mode)` turns the Hydra config into one `RunPlan`: the effective config (a copy: what `init_from=`
adopts is written there, never into the caller's config; it is what `.hydra/config.yaml` and `summary.json` record),
the resolved model record, the data module, the source an `init_from=` starts from, the checkpoint a resume
continues and what it saved. Every refusal happens here, so a refused start writes nothing. `lmlab.run.training` then
accepts the plan (writes the run directory), fits and records.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.seed import seed_everything
from omegaconf import DictConfig, OmegaConf

from lmlab.run import budget, seeds
from lmlab.cli import continue_command
from lmlab.config import COMPUTE_KEYS, GPTConfig, arch_config, what_it_is
from lmlab.data import build_datamodule
from lmlab.env import is_rank_zero
from lmlab.interop.hf import adopt, is_hf_dir, load_hf_dir
from lmlab.model.gpt import GPT, meta_model
from lmlab.model.head import HEADS, fit_head, fit_vocabulary
from lmlab.model.memory import check_model_fits
from lmlab.model.resolve import resolve
from lmlab.record.rundir import RunDir, load_checkpoint, load_run, model_config
from lmlab.record.summary import FINISHED
from lmlab.record.trusted import check_config_targets
from lmlab.registry import option_params
from lmlab.optim.warmup import fit_warmup


@dataclass
class RunPlan:
    cfg: DictConfig  # the effective config (the caller's, plus what init_from adopted)
    model: GPTConfig  # the model record, resolved and validated
    data: Any  # the data module, set up
    source: dict[str, Any] | None  # init_from: the source's model record, weights and path
    ckpt: Path | None  # the checkpoint a resume continues (None: a fresh start)
    saved: dict[str, Any] | None  # that checkpoint's metadata (its weights are Lightning's to load)
    resume_step: int
    previous: dict[str, Any] | None  # the summary a resume continues
    ended: bool  # a resume of a run that has ended: nothing to do, every file stays as it is
    budget: dict[str, Any] | None = None  # budget.*: what it is and the steps it gave (lmlab.run.budget; None:
                                          # max_steps)
    changed: dict[str, list[Any]] | None = None  # a resume's launch against the checkpoint's: key -> [was, now]
    stages: dict[str, Any] | None = None  # data.batch_schedule / seq_schedule as the loop reads them (data/stages.py)


def make_plan(cfg: DictConfig, run: RunDir, mode: str, strategy: str,
              announce: Callable[[int], None] | None = None, overrides: list[str] | None = None,
              checked: GPT | None = None) -> RunPlan:
    """The plan of a start in `run` with resume `mode` under the trainer's `strategy` (its class name); raises
    naming the key or path for anything that refuses the start. `announce(step)` is called once a resume's checkpoint
    is read, before the data is prepared (its line comes first), unless the run has ended. `overrides`: the command's,
    which tell a warmup it chose from the schedule's default (lmlab.optim.warmup; None: unknown, kept as it is).
    `checked`: the meta model lmlab.run.checks.check_config built for `cfg` (None: built here)."""
    cfg = copy.deepcopy(cfg)
    check_config_targets(cfg)  # every _target_ the trainer and loggers take one lmlab builds, before any import
    source = prepare_init_from(cfg)
    ckpt = resume_checkpoint(run, mode, bool(cfg.get("overwrite", False)))
    saved, resume_step, previous, ended, changed = None, 0, None, False, None
    if ckpt is not None:
        what = f"resume={mode} ({ckpt})"
        if ckpt.is_dir() and strategy != "FSDP2Strategy":
            raise ValueError(f"{what}: the checkpoint is sharded (written by trainer=fsdp2); continue it with "
                             f"trainer=fsdp2, or make it one file first: python -m lmlab.record.consolidate {run.path} {ckpt}")
        saved = load_checkpoint(ckpt, what, mmap=True, weights=False)  # Lightning loads the weights
        resume_step, previous = int(saved["global_step"]), run.read_summary()
        if announce is not None and not _ended(saved, previous, resume_step, _planned_steps(cfg, saved)):
            announce(resume_step)
    chosen = seeds.effective(cfg)  # seeds.init / .data / .dropout, each `seed` unless set (lmlab.run.seeds)
    seeds.record(cfg, chosen)  # into the effective config: .hydra/config.yaml and summary.json record them
    seed_everything(chosen.init, workers=True, verbose=False)  # after the source's model was read, as always
    data = build_datamodule(OmegaConf.to_container(cfg.data, resolve=True), seq_len=cfg.model.max_seq_len,
                            seed=chosen.data)
    data.prepare_data()
    data.setup("fit")
    eod_id = data.eod_id  # every data module declares `eod_id`, `tokenizer`, `labels` (None where it has none)
    model = arch_config(cfg, vocab_size=data.vocab_size + objective_for(cfg, data), eod_id=eod_id)
    # what the head reads from the vocabulary (head=prefix's prefix table), into the model record only
    model.head = fit_vocabulary(model.head, data.tokenizer, model.vocab_size, eod_id,
                                cfg.data.get("name"))
    meta = checked_model(model, checked)
    spend = budget.apply(cfg, model, meta)  # budget.flops|tokens|...: this variant's own trainer.max_steps
    if (said := fit_warmup(cfg, overrides, saved)) and is_rank_zero():  # after the budget: the run's own length
        print(said, flush=True)
    if saved is not None:
        check_same_data(what, data, saved, run.path)  # first: another tokenizer also shows as another vocab_size
        check_same_arch(what, model.to_dict(), model_config(saved), ("dropout", *COMPUTE_KEYS))
        changed = check_same_launch(what, (saved.get("lmlab") or {}).get("launch"), planned_launch(cfg, strategy),
                                    run.path)
        ended = _ended(saved, previous, resume_step, cfg.trainer.max_steps)
    return RunPlan(cfg=cfg, model=model, data=data, source=source, ckpt=ckpt, saved=saved, resume_step=resume_step,
                   previous=previous, ended=ended, budget=spend, changed=changed, stages=budget.stages_of(cfg))


def checked_model(model: GPTConfig, checked: GPT | None) -> GPT | None:
    """Resolve and check `model`, the record with the data's vocabulary (lmlab.model.gpt.validate), building it on the
    meta device only if the start has not: `checked`, check_config's meta model, is that architecture built with a
    stand-in vocabulary, document id and labels (no data then), so only the memory the data's vocabulary needs is
    checked again, and LitGPT builds the model itself before the run directory is written. Returns the meta model of
    `model` when there is one: `checked` when nothing the data decides differs, the one built here otherwise (another
    architecture: init_from=<transformers dir> adopted its own; None: library use that checked nothing)."""
    if checked is None or _but_data(checked.cfg) != _but_data(resolve(model)):
        return meta_model(model)
    check_model_fits(model)
    return checked if checked.cfg.to_dict() == model.to_dict() else None


def _but_data(model: GPTConfig) -> dict[str, Any]:
    """A model record less what the data decides (the vocabulary, the document separator's id, the head's labels)."""
    return {k: v for k, v in model.to_dict().items() if k not in ("vocab_size", "eod_id", "head")} | {
        "head": {k: v for k, v in model.head.items() if k != "labels"}}


def objective_for(cfg: DictConfig, data: Any) -> int:
    """Fit the head to the data in `cfg`, the effective config (lmlab.model.head.fit_head: a labelled set's label
    names become head.labels); the ids the head reads past the tokenizer's, which the model's vocabulary adds."""
    spec, reserved = fit_head(OmegaConf.to_container(cfg.head, resolve=True), data.labels,
                              cfg.data.get("name"))
    if "labels" in spec:
        cfg.head.labels = spec["labels"]
    return reserved


def continuing(run: RunDir, step: int, overrides: list[str] | None) -> str:
    """The first line of a continued run: its directory, the step it continues from and the overrides of its own it
    keeps (`overrides`: the merged ones it runs with, None from library use, which gave a config and no command),
    with those this command adds or changes. Read before the start rewrites .hydra/overrides.yaml."""
    line = f"continuing {run.path} from step {step}"
    if overrides is None:
        return line
    saved = run.saved_lines()  # (read as data by the command that continues it: only compared here)
    kept = [o for o in overrides if o in saved]
    new = [o for o in overrides if o not in saved]
    line += f", its overrides kept: {' '.join(kept)}" if kept else ", with no overrides of its own"
    return line + (f"; this command's: {' '.join(new)}" if new else "")


def _ended(saved: dict[str, Any], previous: dict[str, Any] | None, step: int, max_steps: int) -> bool:
    """Whether the run a checkpoint belongs to has ended (diverged, or done its steps, and recorded so)."""
    status = (saved.get("lmlab") or {}).get("divergence", {}).get("status") or (
        "completed" if step >= max_steps else None)
    return bool(status) and (previous or {}).get("status") in FINISHED


def _planned_steps(cfg: DictConfig, saved: dict[str, Any]) -> int:
    """The run's steps as far as they are known before the model is built: a budget's are the checkpoint's (the same
    budget buys the same steps), otherwise trainer.max_steps."""
    if budget.chosen(cfg) is not None:
        return int((saved.get("hyper_parameters") or {}).get("max_steps") or cfg.trainer.max_steps)
    return cfg.trainer.max_steps


# Keys of the model config that may differ between a run and one initialised from it (`init_from=`).
EXTENSIBLE = ("max_seq_len", "train_len", "rope_scaling", "dropout", "attention", "head", *COMPUTE_KEYS)
RESUME_MODES = ("auto", "true", "false")


def resume_mode(cfg: DictConfig) -> str:
    """`resume`: auto (continue when the run directory holds a checkpoint, else start), true (a checkpoint is
    required) or false (start; a directory that holds a run is refused unless overwrite=true)."""
    value = cfg.get("resume", "auto")
    mode = {True: "true", False: "false"}.get(value, value) if isinstance(value, bool) else str(value).lower()
    if mode not in RESUME_MODES:
        raise ValueError(f"resume={value!r} is not an option; choose one of {list(RESUME_MODES)}")
    if not isinstance(cfg.get("overwrite", False), bool):
        raise ValueError(f"overwrite={cfg.overwrite!r} must be true or false")
    return mode


def resume_checkpoint(run: RunDir, mode: str, overwrite: bool) -> Path | None:
    """The checkpoint this start continues from (None: a fresh start), or a refusal naming the path."""
    ckpt = run.checkpoint()
    if mode == "true" and ckpt is None:
        raise FileNotFoundError(f"resume=true: {run.last} does not exist, so there is nothing to continue; "
                                f"resume=auto starts a fresh run when there is no checkpoint")
    if mode == "false" and run.holds_run() and not overwrite:
        raise FileExistsError(f"resume=false: {run.path} already holds a run; continue it with resume=auto, or start "
                              f"over with overwrite=true (which deletes its checkpoints, metrics and summary)")
    return ckpt if mode != "false" else None


def prepare_init_from(cfg: DictConfig) -> dict[str, Any] | None:
    """For `init_from=<run dir>`: use the source run's tokenizer, and scale RoPE relative to the length the
    source was trained at. For `init_from=<transformers dir>` (save_pretrained, e.g. from eval.py export=hf), the
    config takes that model's architecture too. Returns the source's model config and weights (None without
    init_from). Writes into `cfg`: `make_plan` calls it on its own copy, the run's effective config."""
    if not cfg.get("init_from"):
        return None
    source = RunDir(cfg.init_from)
    if not source.path.is_dir():
        raise FileNotFoundError(f"init_from={source.path}: no such run directory")
    if is_hf_dir(source.path):  # a transformers checkpoint: its architecture is the one studied
        model, tokenizer = load_hf_dir(source.path)
        adopt(cfg, model.cfg)
        model_cfg, weights = model.cfg.to_dict(), model.state_dict()
        cfg.data.tokenizer = str(tokenizer)
    else:
        saved = load_run(source.path, "init_from")
        model_cfg, weights = saved.model, saved.weights
        if cfg.data.tokenizer in ("char", "bpe"):  # the vocabulary must be the source's, token for token
            cfg.data.tokenizer = str(source.tokenizer)
    if cfg.rope_scaling.name != "none" and cfg.rope_scaling.get("original_max_len") is None:
        cfg.rope_scaling.original_max_len = model_cfg.get("train_len") or model_cfg["max_seq_len"]
    return {"model": model_cfg, "weights": weights, "path": str(source.path)}


def check_same_arch(what: str, new: dict[str, Any], saved: dict[str, Any], may_differ: tuple[str, ...] = ()) -> None:
    """Refuse a checkpoint whose architecture differs from the config, naming every differing key. Both are compared
    resolved and without their derived sizes: a record saved before the derived sizes were declared (or with a
    RoPE scaling's `original_max_len` left null) is the same architecture as today's record of it."""
    new, saved = (what_it_is(resolve(GPTConfig(**d)).inputs()) for d in (new, saved))
    differ = sorted(k for k in new if k not in may_differ and new[k] != saved.get(k))
    if differ:
        detail = ", ".join(f"model/{k}: checkpoint has {saved.get(k)!r}, config has {new[k]!r}" for k in differ)
        raise ValueError(f"{what}: the checkpoint's architecture doesn't match the config ({detail})")


def check_same_data(what: str, data, saved: dict[str, Any], run: Path | None = None) -> None:
    """Refuse a checkpoint trained with another tokenizer than the config builds now (it would read other ids), or
    on other data: a text corpus's fingerprint, data=token_bin's shards (each compared only where the checkpoint
    recorded it: a checkpoint of an older lmlab has the tokenizer's at most)."""
    state = saved.get(type(data).__qualname__) or {}
    if state.get("tokenizer_sha256") not in (None, data.tokenizer_sha256):
        raise ValueError(f"{what}: the checkpoint was trained with another tokenizer than data.tokenizer="
                         f"{data.tokenizer_kind!r} builds now (different corpus, data.val_fraction or "
                         f"data.vocab_size?); resume with the run's own data config")
    was = {**{k: v for k, v in (state.get("shards") or {}).items()},
           **({f"data={data.corpus}": {"sha256": state["corpus_sha256"]}} if state.get("corpus_sha256") else {})}
    now = {**data.shards,  # every data module declares both (none: {}, None)
           **({f"data={data.corpus}": {"sha256": data.corpus_sha256}} if data.corpus_sha256 else {})}
    for key, old in was.items():
        if key in now and old.get("sha256") != now[key]["sha256"]:
            fix = f"put back the data it was trained on and continue with {continue_command(run)}" if run else \
                "put back the data it was trained on"
            raise ValueError(f"{what}: {key} is not the data the checkpoint was trained on (checkpoint: "
                             f"{_data(old)}; now: {_data(now[key])}), so the run would go on with other batches; "
                             f"{fix}, or start a new run from its weights with init_from={run or '<run dir>'}")


def _data(record: dict[str, Any]) -> str:
    counts = [f"{record[k]:,} {k}" for k in ("shards", "tokens") if k in record]
    return ", ".join([*counts, f"sha256 {record['sha256'][:12]}"])


# --- the launch: what decides the global batch a step takes, recorded in each checkpoint (LitGPT, `lmlab.launch`) ---

LAUNCH_KEYS = {"batch_size": "data.batch_size", "devices": "trainer.devices", "num_nodes": "trainer.num_nodes",
               "accumulate_grad_batches": "trainer.accumulate_grad_batches"}


def planned_launch(cfg: DictConfig, strategy: str) -> dict[str, Any]:
    """The launch the config asks for, in the terms a checkpoint records it (`LitGPT.launch`), before any trainer exists
    (None where it can't tell:
    that key is not compared). `devices: auto` (or -1) is every GPU of the node, one process on CPU, as Lightning
    counts them; under torchrun or srun `trainer.devices` is a number already (lmlab.run.checks.check_launch)."""
    import torch

    trainer, nodes = cfg.trainer, int(cfg.trainer.get("num_nodes", 1))
    devices, accelerator = trainer.get("devices", 1), str(trainer.get("accelerator", "auto"))
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if isinstance(devices, str) and "," in devices:
        devices = [d for d in devices.split(",") if d.strip()]
    if devices in ("auto", -1):
        gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
        devices = torch.cuda.device_count() if gpu else 1
    per_node = len(devices) if OmegaConf.is_list(devices) or isinstance(devices, list) else \
        devices if isinstance(devices, int) and not isinstance(devices, bool) else None
    world = per_node * nodes if per_node else None
    single = {"auto": "SingleDeviceStrategy" if world == 1 else "DDPStrategy", "single_device": "SingleDeviceStrategy",
              "fsdp": "FSDPStrategy"}
    return {"world_size": world, "num_nodes": nodes, "devices": per_node,
            "strategy": single.get(strategy, "DDPStrategy" if strategy.startswith("ddp") else strategy),
            "accumulate_grad_batches": int(trainer.get("accumulate_grad_batches", 1)),
            "batch_size": int(cfg.data.batch_size) if cfg.data.get("batch_size") is not None else None}


def global_batch(launch: dict[str, Any]) -> int | None:
    """Sequences per optimizer step: data.batch_size x ranks x trainer.accumulate_grad_batches (None: unknown)."""
    parts = [launch.get(k) for k in ("batch_size", "world_size", "accumulate_grad_batches")]
    return None if None in parts else parts[0] * parts[1] * parts[2]


def check_same_launch(what: str, saved: dict[str, Any] | None, planned: dict[str, Any],
                      run: Path) -> dict[str, list[Any]] | None:
    """A resume continues at the checkpoint's global batch and gradient accumulation, or is refused naming the keys
    that change them and the command that continues the run as it was (and, where one exists, the one at the same
    global batch on this launch: another world size or accumulation is legitimate when data.batch_size makes up for
    it, the data order being a function of (step, global batch) alone; Lightning's micro-batch counts are rescaled
    to the new accumulation as the checkpoint is loaded, lmlab.run.lit.rescale_batches). Returns what changed,
    key -> [was, now] (None: nothing, or a checkpoint of an lmlab that recorded no launch)."""
    if not saved:
        return None
    changed = {k: [saved.get(k), v] for k, v in planned.items() if v is not None and saved.get(k) != v}
    was, now = global_batch(saved), global_batch(planned)
    if was is None or now is None or was == now:
        if changed and is_rank_zero():
            print(f"{what}: continuing at the same global batch ({was}) with "
                  f"{', '.join(f'{k} {a} -> {b}' for k, (a, b) in changed.items())} (recorded in summary.json)")
        return changed or None
    keys = [k for k in LAUNCH_KEYS if k in changed]
    detail = ", ".join(f"{LAUNCH_KEYS.get(k, k)}: checkpoint {changed[k][0]}, now {changed[k][1]}"
                       for k in [*keys, *(["strategy"] if "strategy" in changed else [])])
    as_was = " ".join([continue_command(run), *(f"{LAUNCH_KEYS[k]}={changed[k][0]}" for k in keys)])
    per_rank = planned["world_size"] * planned["accumulate_grad_batches"]  # data.batch_size keeps the global batch
    kept = [f"{LAUNCH_KEYS[k]}={planned[k]}" for k in keys if k != "batch_size"]
    same = f"; or at the same global batch on {planned['world_size']} rank(s): " + " ".join(
        [continue_command(run), *kept, f"data.batch_size={was // per_rank}"]) if was % per_rank == 0 else ""
    raise ValueError(f"{what}: the run's global batch is {was} sequences per step (data.batch_size x ranks x "
                     f"trainer.accumulate_grad_batches = {saved['batch_size']} x {saved['world_size']} x "
                     f"{saved['accumulate_grad_batches']}), this launch's {now} ({planned['batch_size']} x "
                     f"{planned['world_size']} x {planned['accumulate_grad_batches']}: {detail}), which would change "
                     f"the run (a resume keeps the global batch); continue it as it was: "
                     f"{as_was}{same}")


def load_init_from(model, new: dict[str, Any], source: dict[str, Any]) -> None:
    """Copy the source run's weights into `model`, refusing when the architectures differ. The head may differ (an
    mlm run fine-tuned as head=classify, a next-token run given MTP's modules): the trunk's weights are copied, the
    new head's own (`head.*`) keep their init, the old head's are left behind."""
    what = f"init_from={source['path']}"
    old, now = (dict(cfg.get("head") or {"name": "next"}) for cfg in (source["model"], new))
    if old != now:
        reserved = [HEADS[option_params("head", HEADS, h)[0]].reserved for h in (old, now)]
        if reserved[0] != reserved[1]:
            raise ValueError(f"{what}: head={now['name']} reads {reserved[1]} id(s) past the tokenizer's ([MASK]) "
                             f"and the source's head={old['name']} {reserved[0]}: their vocabularies differ; start "
                             f"head={now['name']} from a run with the same (head=mlm for head=classify)")
    check_same_arch(what, new, source["model"], EXTENSIBLE)
    weights = source["weights"]
    if old != now:  # the trunk only: each head's own weights are its own
        weights = {k: v for k, v in weights.items() if not k.startswith("head.")}
        weights |= {k: v for k, v in model.state_dict().items() if k.startswith("head.")}
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:  # a learned position table of another length, typically
        raise ValueError(f"{what}: weights don't fit the config ({str(err).splitlines()[-1]}); "
                         f"position=learned cannot change model.max_seq_len") from None


