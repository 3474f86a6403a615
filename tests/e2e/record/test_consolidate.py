"""`python -m lmlab.record.consolidate`: never deletes a directory it did not write; in place replaces the shards; a
`.metadata` that writes into a class is refused with a non-zero exit."""

from __future__ import annotations

import pytest

from lmlab.record.consolidate import consolidate
from lmlab.record.rundir import load_checkpoint
from tests.hostile import STATE_WRITES, state_write
from tests.runs import ROOT, cli, sharded_checkpoint

# e2e: starts lmlab.record.consolidate; DCP warns "assuming the intent is ... single process"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_an_existing_directory_as_out_is_refused_and_kept(tmp_path) -> None:
    ckpt = sharded_checkpoint(tmp_path / "last.ckpt")
    out = tmp_path / "results"
    out.mkdir()
    (out / "notes.txt").write_text("a week of work")
    res = cli("-m", "lmlab.record.consolidate", str(ckpt), str(out), cwd=tmp_path)
    assert res.returncode != 0 and f"out={out} is an existing directory" in res.stderr, res.stderr[-2000:]
    assert (out / "notes.txt").read_text() == "a week of work" and sorted(p.name for p in out.iterdir()) == [
        "notes.txt"]
    other = sharded_checkpoint(tmp_path / "other.ckpt")  # another run's shards are not this one's either
    with pytest.raises(ValueError, match="is an existing directory"):
        consolidate(ckpt, other)
    assert (other / ".metadata").is_file()


def test_consolidated_into_a_file_and_in_place(tmp_path) -> None:
    ckpt = sharded_checkpoint(tmp_path / "last.ckpt")
    res = cli("-m", "lmlab.record.consolidate", str(ckpt), str(tmp_path / "one.ckpt"), cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    one = load_checkpoint(tmp_path / "one.ckpt", "test")
    assert one["global_step"] == 3 and ckpt.is_dir()
    assert consolidate(ckpt, ckpt) == ckpt and ckpt.is_file()  # the run's own shards: replaced by the one file
    assert load_checkpoint(ckpt, "test")["state_dict"]["model.wte.weight"].equal(one["state_dict"]["model.wte.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "one.ckpt"]  # no .old or .tmp left


@pytest.mark.parametrize("write", sorted(STATE_WRITES))
def test_metadata_that_writes_into_a_class_fails_the_command(tmp_path, write: str) -> None:
    """BUILD on pathlib.PosixPath (or an enum member) in front of the genuine metadata: consolidate wrote the file
    and exited 0 with the class changed in its process; now it names the file and writes nothing."""
    ckpt = sharded_checkpoint(tmp_path / "last.ckpt")
    (ckpt / ".metadata").write_bytes(state_write(write, (ckpt / ".metadata").read_bytes()))
    res = cli("-m", "lmlab.record.consolidate", str(ckpt), str(tmp_path / "one.ckpt"), cwd=ROOT)
    assert res.returncode != 0 and f"refused {ckpt}" in res.stderr and "BUILD on" in res.stderr, res.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_an_existing_file_as_out_is_kept_unless_overwrite(tmp_path) -> None:
    ckpt = sharded_checkpoint(tmp_path / "last.ckpt")
    mine = tmp_path / "mine.ckpt"
    mine.write_bytes(b"a week of work")
    res = cli("-m", "lmlab.record.consolidate", str(ckpt), str(mine), cwd=ROOT)
    assert res.returncode != 0 and f"out={mine} exists" in res.stderr and "--overwrite" in res.stderr, res.stderr
    assert mine.read_bytes() == b"a week of work"
    res = cli("-m", "lmlab.record.consolidate", str(ckpt), str(mine), "--overwrite", cwd=ROOT)
    assert res.returncode == 0 and load_checkpoint(mine, "test")["global_step"] == 3, res.stderr[-2000:]
    assert consolidate(ckpt) == consolidate(ckpt)  # the default name is lmlab's own: consolidating again replaces it


@pytest.mark.parametrize("module", ["lmlab.record.consolidate", "lmlab.consolidate"])
def test_a_run_directory_is_consolidated_under_its_lock_by_either_spelling(tmp_path, module: str) -> None:
    """`python -m lmlab.consolidate` (the old spelling, kept by the forwarding table) takes the run's lock as the new
    one does: the lock records the command, whose argv[0] the alias once left None (a TypeError, issue 59)."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    sharded_checkpoint(run / "checkpoints" / "last.ckpt")
    res = cli("-m", module, str(run), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    out = run / "checkpoints" / "last.consolidated.ckpt"
    assert res.stdout.strip() == f"-> {out}" and "state_dict" in load_checkpoint(out, "test")
