"""lmlab.env.quick_exit: a command's process ends with its garbage collected and the rest frozen, after every atexit
handler registered later, once however often it is asked for; train.py, eval.py and generate.py ask for it."""

from __future__ import annotations

import pytest

from tests.runs import ROOT, cli

# registered before lmlab's handler, so run after it: what the interpreter's teardown will find
LAST = "import atexit, gc\natexit.register(lambda: print('frozen at the end:', gc.get_freeze_count() > 0))\n"


def ends(code: str, *args: str) -> list[str]:
    return cli("-c", LAST + code, *args, cwd=ROOT, timeout=120).stdout.splitlines()  # a new interpreter


def test_garbage_is_finalized_later_handlers_run_then_the_rest_is_frozen_once() -> None:
    code = """
from lmlab import env
env.quick_exit()
env.quick_exit()
print('registered', len(env._QUICK_EXIT))
atexit.register(lambda: print('a later handler'))
class Cycle:
    def __del__(self):
        print('garbage finalized')
c = Cycle(); c.me = c; del c
"""
    assert ends(code) == ["registered 1", "a later handler", "garbage finalized", "frozen at the end: True"]
    assert ends("class Cycle:\n    pass\n") == ["frozen at the end: False"]  # what it changes: nothing frozen


@pytest.mark.parametrize("script", ["train.py", "eval.py", "generate.py"])
def test_each_command_ends_quickly_even_when_it_refuses(script: str) -> None:
    code = f"import runpy\nrunpy.run_path({script!r}, run_name='__main__')"
    out = ends(code, "no_such_key=1")
    assert out[-1] == "frozen at the end: True", out
