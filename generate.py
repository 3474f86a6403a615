"""python generate.py run=<run dir> prompt="..." — sample text from a trained model, streamed to the terminal (the
same as `lmlab generate`)."""

import sys

from lmlab.commands.generate import run

if __name__ == "__main__":
    run("python generate.py", sys.argv[1:])
