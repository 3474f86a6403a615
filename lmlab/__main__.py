"""python -m lmlab <command> ...: the same as the installed `lmlab` command (lmlab/commands)."""

from lmlab.commands import main

main()
