"""The names of lmlab's temporaries: `.<name>.lmlab-<pid>.tmp` beside the file a writer replaces, and
`.<name>.lmlab-<pid>.old` for a sharded checkpoint moved aside. The marker and the writer's pid let cleaning up after a
killed writer (lmlab.record.rundir.RunDir.clean_temporaries) tell them from a user's own `.notes.tmp`. Ground floor: the
run
directory's writers (lmlab.record.rundir) and the sharded checkpoint's (lmlab.run.distributed) both name their files
here."""

from __future__ import annotations

import os
import re
from pathlib import Path

MARK = "lmlab"
OURS = re.compile(rf"^\.(?P<target>.+)\.{MARK}-\d+\.(?P<kind>tmp|old)$")


def temporary(path: str | Path, kind: str = "tmp") -> Path:
    """The temporary beside `path` that this process writes it through (`kind` "tmp"), or moves the old one aside
    to ("old"): `.<name>.lmlab-<pid>.<kind>`."""
    path = Path(path)
    return path.with_name(f".{path.name}.{MARK}-{os.getpid()}.{kind}")
