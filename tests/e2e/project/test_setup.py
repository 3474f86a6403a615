"""The README's set-up, exactly as written, on a clean clone in a fresh venv: `make train` installs what running needs
and trains; `make test` installs what testing needs and its units pass without SLURM's `srun` on PATH and without
torch's AVX-512 kernels (ATEN_CPU_CAPABILITY=avx2: the AVX2 EPYCs `make test` once failed on), all but those that
compute nothing with torch's kernels (`kernel_free`); this session's units are the other side of both."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runs import ROOT

pytestmark = pytest.mark.slow


def _sh(command: str, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _without_srun(folder: Path, tmp_path: Path) -> Path:
    """A folder of links to everything in `folder` but srun (srun shares /usr/bin with bash and the compilers)."""
    shadow = tmp_path / "no-srun" / folder.as_posix().strip("/").replace("/", "_")
    shadow.mkdir(parents=True)
    for entry in folder.iterdir():
        if entry.name != "srun":
            (shadow / entry.name).symlink_to(entry)
    return shadow


# Units that compute nothing with torch's kernels and read nothing of srun (Hydra composition, the registry, README
# and layout text, run records, the GPU bench's JSON; token shards, which numpy and tokenizers write) run once, in
# this session: AVX2 would change none of their results. Every other unit runs again under AVX2, a new folder too.
KERNEL_FREE = ("record/test_*.py", "bench/test_*.py", "commands/test_*.py", "project/test_*.py", "data/test_shards.py")
BUT = ("commands/test_validation.py", "project/test_golden.py")  # Lightning's srun hint; the pinned golden losses


def kernel_free() -> list[str]:
    """The unit files the clean clone's `make test` under AVX2 leaves out, from the checkout's root."""
    units = ROOT / "tests" / "unit"
    assert all((units / kept).is_file() for kept in BUT), BUT  # renamed: name it here again, or it runs only once
    return [f"tests/unit/{f.relative_to(units).as_posix()}" for pattern in KERNEL_FREE
            for f in sorted(units.glob(pattern)) if f.relative_to(units).as_posix() not in BUT]


def test_the_readme_set_up_passes_on_a_clean_clone_in_a_fresh_venv(tmp_path: Path) -> None:
    clone = tmp_path / "lmlab"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    # the user's shell: no venv active, no PYTHONPATH into this checkout, a Python >= 3.10 on PATH
    # (nor this session's compile cache, which tests/conftest.py keyed on this session's kernels)
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "TORCHINDUCTOR_CACHE_DIR")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    activate = f"{sys.executable} -m venv .venv && . .venv/bin/activate"
    run = clone / "outputs" / "first"
    res = _sh(f'{activate} && make train ARGS="trainer.max_steps=5 logger=csv hydra.run.dir={run}"', clone, env, 1200)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert '"status": "completed"' in (run / "summary.json").read_text()
    venv = clone / ".venv"
    packages = _sh(". .venv/bin/activate && python -m pip list --format=freeze", clone, env, 120).stdout.splitlines()
    names = {line.split("==")[0].lower() for line in packages}
    assert {"lmlab", "torch", "lightning", "hydra-core"} <= names and "pytest" not in names  # running needs only
    assert "torch==2.13.0" in packages or "torch==2.13.0+cpu" in packages  # the pinned build, not a newer one
    installed = _sh(". .venv/bin/activate && cd / && python -c 'import lmlab; print(lmlab.__file__)'", clone, env, 60)
    assert installed.stdout.strip() == str(clone / "lmlab" / "__init__.py")  # this clone's, from anywhere
    assert (venv / "bin" / "lmlab").exists()
    # `make test` on the machine the README's set-up is most likely to fail on: no `srun` on PATH (each PATH folder
    # that holds srun, less srun) and AVX2 kernels, what a CPU without AVX-512 computes (torch takes the lower of this
    # and the CPU's). The other side of both is this session itself: the same units, here, with this machine's
    # kernels and, under .ci/run, SLURM's srun on PATH (a login node: Lightning warns that srun is not used).
    path = env["PATH"]
    if shutil.which("srun", path=path):
        path = ":".join(str(_without_srun(Path(p), tmp_path)) if (Path(p) / "srun").exists() else p
                        for p in path.split(":"))
        assert shutil.which("srun", path=path) is None and shutil.which("bash", path=path)
    ignore = " ".join(f"--ignore={p}" for p in kernel_free())
    # WORKERS=0: in one process. The outer suite's workers already fill the cores, so two more workers gained no time
    # and each collected every unit again (194 s of CPU here, 169 s in one process: the same 3,285 tests pass)
    res = _sh(f'. .venv/bin/activate && make test WORKERS=0 ARGS="{ignore}"', clone,
              {**env, "PATH": path, "ATEN_CPU_CAPABILITY": "avx2"}, 1500)
    failures = [line for line in res.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert res.returncode == 0, (failures, (res.stdout + res.stderr)[-3000:])
    assert " passed" in res.stdout and " failed" not in res.stdout
