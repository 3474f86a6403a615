"""python train.py [group=option ...] [key=value ...] — train one GPT variant (see README); as `lmlab train`."""

import sys

from lmlab.commands.train import run

if __name__ == "__main__":
    run("python train.py", sys.argv[1:])
