"""What the commands print instead of a traceback: lmlab's refusals as one line and exit code 2 (`usage_errors`), and
an unknown config group, option or key refused with the closest names before Hydra parses the command line."""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lmlab.cli import PROG

_STARTED = time.time() - 1.0  # before Hydra made any directory of this command's (ctime's resolution: a margin)


def usage_errors(command: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator for an entry point: lmlab's refusals (a bad value, a run it will not continue, a path that is not
    there, a busy run directory) as one line on stderr and exit code 2, a usage error, instead of a traceback under
    Hydra's hint. `HYDRA_FULL_ERROR=1` (or `LMLAB_DEBUG=1`) shows the traceback. A plain function wrapper, so
    the task function still pickles (submitit's launchers send it to their jobs)."""

    def decorate(main: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(main)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            from lmlab.record.rundir import DiskFull, RunDirBusy

            try:
                return main(*args, **kwargs)
            except DiskFull as err:  # not a usage error (exit 1), but one line too: what is full and what to do
                if "1" in (os.environ.get("HYDRA_FULL_ERROR"), os.environ.get("LMLAB_DEBUG")):
                    raise
                print(f"{PROG[command].removeprefix('python ')}: {err.strerror}", file=sys.stderr)
                raise SystemExit(1) from None
            except PermissionError as err:  # a read-only run directory or cache: the file and what to do, one line
                if "1" in (os.environ.get("HYDRA_FULL_ERROR"), os.environ.get("LMLAB_DEBUG")):
                    raise
                why = err.strerror or "permission denied"
                print(f"{PROG[command].removeprefix('python ')}: {err.filename or err}: {why} (a run or cache "
                      f"directory lmlab writes must be writable by this user; copy the run to continue it elsewhere)",
                      file=sys.stderr)
                raise SystemExit(2) from None
            except (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, RunDirBusy) as err:
                if command == "train":
                    drop_empty_run_dir()  # a refused start leaves nothing behind
                if "1" in (os.environ.get("HYDRA_FULL_ERROR"), os.environ.get("LMLAB_DEBUG")):
                    raise
                print(f"{PROG[command].removeprefix('python ')}: {err}", file=sys.stderr)
                raise SystemExit(2) from None

        return wrapped

    return decorate


def drop_empty_run_dir() -> None:
    """The run directory Hydra made for this command (outputs/<date>/<time>), removed when nothing was written into
    it, and its date directory too when that is left empty: a refusal leaves no empty run behind."""
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
    except (ImportError, ValueError):  # not under Hydra (a library call)
        return
    if hc.mode.name != "RUN":  # a sweep's job directories are the sweep's
        return
    out = Path(hc.runtime.output_dir)
    if out.resolve() == Path.cwd().resolve():  # a command that runs in the working directory itself
        return
    named = any(o.startswith("hydra.run.dir=") for o in hc.overrides.hydra)  # the user's: its parent is theirs too
    for d in (out,) if named else (out, out.parent):  # Hydra's outputs/<date>/<time>: the date's too
        try:
            if d.stat().st_ctime < _STARTED:  # there before this command: the user's, kept
                return
            d.rmdir()  # only when empty
        except OSError:
            return


GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"

# Hydra's flags that take the next argument as their value (the check leaves a command with a config of its own alone).
_FLAG_VALUES = ("--cfg", "-c", "--package", "-p", "--info", "-i", "--config-path", "-cp", "--config-name", "-cn",
                "--config-dir", "-cd", "--experimental-rerun")


def refuse_unknown(command: str, config_name: str, argv: Sequence[str]) -> None:
    """Before Hydra parses `argv`: an unknown config group, group option or key is refused in one line with the closest
    names and exit code 2 (Hydra's own error is several lines, exit 1, and for a misspelt key suggests `+key`, which
    would add it). Anything else Hydra rejects (its grammar, a plugin not installed) is left to Hydra to report."""
    if any(a in ("-h", "--help", "--hydra-help", "-cp", "--config-path", "-cn", "--config-name", "-cd",
                 "--config-dir") for a in argv):
        return
    overrides, skip = [], False
    for arg in argv:
        if skip or arg.startswith("-"):
            skip = not skip and arg in _FLAG_VALUES
            continue
        overrides.append(arg)
    problem = unknown_override(config_name, overrides)
    if problem and len(problem) > 1000:  # (a key of thousands of characters: its start says enough)
        problem = f"{problem[:500]} ... {problem[-300:]}"
    if problem:
        print(f"{PROG[command].removeprefix('python ')}: {problem}", file=sys.stderr)
        raise SystemExit(2)


def unknown_override(config_name: str, overrides: Sequence[str]) -> str | None:
    """Why `overrides` name a group option or key that `config_name` does not have, or one Hydra's grammar cannot
    parse (None: neither, or Hydra has another objection to report): `norm=rsm: norm has no option 'rsm'; did you
    mean rms? (...)`."""
    import difflib

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from omegaconf import OmegaConf

    from lmlab import compose
    from lmlab.registry import CONF_DIR, is_group

    parser, groups, keys = OverridesParser.create(), [], []
    for text in overrides:
        try:
            ov = parser.parse_override(text)
        except Exception as err:  # noqa: BLE001  (Hydra's words, on one line: it prints three and exits 1)
            why = " ".join(str(err).split())
            return f"{text}: Hydra's override grammar cannot parse it ({why}); see {GRAMMAR}"
        key = ov.key_or_group
        if key.startswith("hydra") or ov.package is not None:
            continue
        if is_group(key) and not ov.is_delete():
            if ov.value_type == ValueType.GLOB_CHOICE_SWEEP:
                continue
            options = sorted(p.stem for p in (CONF_DIR / key).glob("*.yaml"))
            values = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.value()]
            chosen = [v for value in values for v in (value if isinstance(value, list) else [value])]  # residual=[a,b]
            for value in chosen:
                if value is not None and str(value) not in options:
                    close = difflib.get_close_matches(str(value), options, n=3)
                    hint = f"; did you mean {' or '.join(close)}?" if close else ""
                    return f"{text}: {key} has no option {str(value)!r}{hint} (the options: {', '.join(options)})"
            groups.append(f"{ov.get_key_element()}={values[0]}" if ov.is_sweep_override() else text)
        elif not (ov.is_add() or ov.is_force_add()):
            keys.append((text, key))
    try:
        cfg = compose(groups, config_name=config_name)
    except Exception:  # noqa: BLE001  (a group Hydra cannot compose: its own message says why)
        return None
    for text, key in keys:
        node, path = cfg, []
        for part in key.split("."):
            names = [str(k) for k in node.keys()] if OmegaConf.is_dict(node) else []  # `in` is False for ??? values
            if part not in names:
                where = ".".join(path)
                close = [".".join([*path, c]) for c in difflib.get_close_matches(part, names, n=3)]
                hint = f"; did you mean {' or '.join(close)}?" if close else f" (the keys: {', '.join(names)})"
                what = f"{where} has no key {part!r}" if path else f"there is no config group or key {part!r}"
                return f"{text}: {what}{hint}"
            node, path = node._get_node(part), [*path, part]
    return None
