"""python eval.py run=<run dir> | compare=<multirun dir> — evaluate a run, or compare the runs of a sweep (the same as
`lmlab eval`; `lmlab compare <dir>`)."""

import sys

from lmlab.commands.eval import run

if __name__ == "__main__":
    run("python eval.py", sys.argv[1:])
