"""A warm interpreter for the tests' commands: `python train.py ...` run as a fork of a Python that has already
imported lmlab, Lightning and torch, instead of a new interpreter importing them again (a 1-step train.py: 1.1-1.5 s
warm, 7.4 s new; the imports are paid once per pytest worker instead of once per command, and CI runs ~130 such
commands on 2 cores).

The command is still a process of its own: its pid, its working directory, its environment and umask, its argv and
`__main__`, its stdout and stderr, its exit code (an uncaught exception prints its traceback and exits 1, SystemExit
exits with its code, as `python script` does), its atexit handlers and its children (DDP's rank 1 is a new
interpreter, started by Lightning). Only the imports are shared, so a command runs warm only where they are the ones
it would make: an lmlab script of this checkout or `-m lmlab <command>` (each runs under Hydra), under the
environment the server imported with (`tests.runs.cli` starts the server again under a command's environment where it
differs, and runs anything else, or anything with `fresh=True` or LMLAB_TEST_WARM=0, in a new interpreter).
tests/e2e/project/test_warm.py runs commands both ways and compares what they write.

Run as a script, this file is the server: one JSON request a line on stdin, the child's pid and then its exit code a
line each on the reply pipe."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("train.py", "eval.py", "generate.py")  # and `python -m lmlab <command>`: the commands that run under Hydra
HYDRA_COMMANDS = ("train", "eval", "compare", "generate")
# Variables a command's environment may differ in from the server's and still run warm: none is read at import.
# pytest sets the first per test; a run in the worker's own process sets the rest, and its subprocesses inherit them:
# Lightning's seed (read when a run seeds), the hub's offline switches (every lmlab command sets them before anything
# could reach the hub; the server too, before its imports), the tokenizers' threads (read when they first run), and
# sklearn's for Intel's OpenMP (this torch runs GNU's)
RUNTIME_ONLY = ("PYTEST_CURRENT_TEST", "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                "TOKENIZERS_PARALLELISM", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK")


def _become(request: dict, channels: tuple) -> None:
    """In the forked child: the command's process state, then its code, then its end (`_end`). Never returns."""
    import runpy

    for channel in channels:  # the server's request and reply pipes: closed as files, so nothing closes them again
        channel.close()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, fd)
        os.close(out)
    os.close(null)
    os.umask(request["umask"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = request["cwd"]  # as `python -m`
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script`
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code = -2
    except BaseException:  # noqa: BLE001  (as the interpreter: the traceback on stderr, exit code 1)
        sys.excepthook(*sys.exc_info())
        code = 1
    _end(code)


def _exit_code(code: object) -> int:
    """SystemExit's code as the interpreter turns it into an exit status (anything but None or an int: printed, 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _end(code: int) -> None:
    """The end of a new interpreter, less its module teardown: the threads joined, the atexit handlers (logging's,
    multiprocessing's, W&B's, the finalizers) run, the output flushed, then the exit. The teardown would free every
    object the server imported, and each write to a page the fork shares copies it: seconds of CPU a command, for
    nothing a command can see. An uncaught KeyboardInterrupt ends by SIGINT, as the interpreter's does."""
    import atexit
    import signal
    import threading

    threading._shutdown()  # noqa: SLF001  (what the interpreter calls at its end: non-daemon threads joined)
    atexit._run_exitfuncs()  # noqa: SLF001
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code == -2:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def serve() -> None:
    """Import what the commands import, then fork one child per request and report its pid and exit code."""
    sys.path[0] = ROOT
    from lmlab import env

    env.offline()  # as eval.py does before its imports, and as every run sets it before it could reach the hub
    import logging

    import lmlab.commands.eval  # noqa: F401
    import lmlab.commands.generate  # noqa: F401
    import lmlab.commands.train  # noqa: F401

    # A command imports Lightning under Hydra, whose logging (hydra/job_logging) has given the root logger its
    # handlers by then; Lightning then logs through them, where with none it adds its own handler on stderr. So here
    stand_in = logging.NullHandler()
    logging.getLogger().addHandler(stand_in)
    import lmlab.run.training  # noqa: F401  (Lightning, torch and what they import)

    logging.getLogger().removeHandler(stand_in)
    import gc

    gc.collect()  # what the imports left frozen (`gc.freeze`): a collection in a command (the collector's own, or the
    gc.freeze()  # one before its exit, lmlab.env.quick_exit) does not walk it, writing to pages the fork shares

    reply = os.fdopen(os.dup(1), "w", buffering=1)  # the replies; fd 1 and 2 become each child's own
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    requests = os.fdopen(0, "r")
    print("ready", file=reply)
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _become(request, (requests, reply))
        print(pid, file=reply)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), file=reply)


def runs_warm(argv: list[str], cwd: str) -> bool:
    """Whether `python argv...` in `cwd` is a command the server imported for: a script of this checkout, or `python -m
    lmlab <command>`, that runs under Hydra."""
    if argv[0] == "-m":
        return argv[1:3] in (["lmlab", command] for command in HYDRA_COMMANDS)
    script = os.path.realpath(os.path.join(cwd, argv[0]))
    return os.path.dirname(script) == os.path.realpath(ROOT) and os.path.basename(script) in SCRIPTS


class Warm:
    """The client of one server, started under `env` (tests.runs.warm keeps one per pytest worker)."""

    def __init__(self, env: dict[str, str]) -> None:
        import subprocess

        self.env = dict(env)
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], cwd=ROOT, env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self._buffer = b""
        if self._line(600) != "ready":
            self.proc.kill()
            raise RuntimeError(f"the warm interpreter did not start (exit code {self.proc.wait()})")

    def _line(self, timeout: float) -> str | None:
        """The server's next reply line, or None after `timeout` seconds without one (a select() on the pipe, and
        the pipe read unbuffered: a line already read into a buffer would wait out the timeout)."""
        import select
        import time

        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], min(left, 1.0))[0]:
                if left <= 0:
                    return None
                continue
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the warm interpreter ended (exit code {self.proc.wait()})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def imported_under(self, env: dict[str, str]) -> bool:
        """Whether a command under `env` imports what the server imported: its environment, but for RUNTIME_ONLY."""
        def read(env: dict[str, str]) -> dict[str, str]:
            return {k: v for k, v in env.items() if k not in RUNTIME_ONLY}

        return read(env) == read(self.env)

    def close(self) -> None:
        """The server ends at the end of its requests (a child still running is its own)."""
        import subprocess

        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def run(self, argv: list[str], cwd: str, env: dict[str, str], timeout: float):
        """`subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout)`, warm; None where it cannot be (`runs_warm`, `imported_under`) or the server has gone."""
        import signal
        import subprocess
        import tempfile

        if self.proc.poll() is not None or not runs_warm(argv, cwd) or not self.imported_under(env):
            return None
        with tempfile.TemporaryDirectory(prefix="lmlab-warm-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            umask = os.umask(0o022)
            os.umask(umask)
            request = {"argv": list(argv), "cwd": str(cwd), "env": dict(env), "umask": umask, "stdout": out,
                       "stderr": err}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            pid = int(self._line(60))
            code = self._line(timeout)
            if code is None:
                os.kill(pid, signal.SIGKILL)  # as subprocess.run's timeout: the child, not its children
            stdout, stderr = (_text(path) for path in (out, err))
            if code is None:
                self._line(60)  # the killed child's status
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess([sys.executable, *argv], int(code), stdout, stderr)


def _text(path: str) -> str:
    """A captured stream as subprocess's text mode reads it: UTF-8, universal newlines."""
    with open(path, encoding="utf-8", newline=None) as f:
        return f.read()


if __name__ == "__main__":
    serve()
