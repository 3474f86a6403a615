"""Every reader of a checkpoint lmlab has, fed hostile pickles (tests/hostile.py): a single-file checkpoint, a
sharded checkpoint's `meta.pt`, its DCP `.metadata` and its non-tensor (bytes) entries. Each payload, alone and in
front of the genuine data, is refused with the path named and creates no file; the genuine data loads. A `.metadata`
that writes into a class (or an object it did not build) is refused with the object unchanged."""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo

from lmlab.record.rundir import CheckpointError, load_checkpoint
from lmlab.record.sharded import META
from tests.hostile import PAYLOADS, STATE_WRITES, hidden_in_tuple, hostile, state_write
from tests.runs import lmlab_checkpoint, sharded_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: "assuming the intent is ... single process"


def _rewrite_pickle(zip_path: Path, transform) -> None:
    """Replace the pickle inside a torch.save zip file by transform(genuine pickle)."""
    with zipfile.ZipFile(zip_path) as z:
        entries = {n: z.read(n) for n in z.namelist()}
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name, data in entries.items():
            z.writestr(name, transform(data) if name.endswith("/data.pkl") else data)
    zip_path.write_bytes(out.getvalue())


def _refused(path: Path, marker: Path) -> None:
    with pytest.raises(CheckpointError, match=rf"refused {path}|{path} is not a loadable"):
        load_checkpoint(path, "run=x")
    assert not marker.exists(), "the payload ran"


GENUINE = pytest.mark.parametrize("genuine", [False, True], ids=["alone", "before_genuine"])


def test_the_genuine_checkpoints_load(tmp_path) -> None:
    """The controls: what the hostile cases start from loads, so a refusal below is the payload's."""
    torch.save(lmlab_checkpoint(), tmp_path / "one.ckpt")
    assert load_checkpoint(tmp_path / "one.ckpt", "run=x")["global_step"] == 3
    state = load_checkpoint(sharded_checkpoint(tmp_path / "sharded.ckpt"), "run=x")
    weight = lmlab_checkpoint()["state_dict"]["model.wte.weight"]
    torch.testing.assert_close(state["state_dict"]["model.wte.weight"], weight)
    (group,) = state["optimizer_states"][0]["param_groups"]
    assert state["global_step"] == 3 and group["lr"] == 0.1 and tuple(group["betas"]) == (0.9, 0.95)


@GENUINE
@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_hostile_dcp_metadata_is_refused(tmp_path, payload: str, genuine: bool) -> None:
    ckpt = sharded_checkpoint(tmp_path / "last.ckpt")
    marker = tmp_path / "pwned"
    real = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(hostile(payload, marker, real if genuine else None))
    _refused(ckpt, marker)


def test_dcp_metadata_with_a_payload_inside_the_record_is_refused(tmp_path) -> None:
    """itemgetter(1)((payload, genuine metadata)): the reported chain that lets a reader return normal numbers."""
    ckpt = sharded_checkpoint(tmp_path / "last.ckpt")
    marker = tmp_path / "pwned"
    genuine = pickle.loads((ckpt / ".metadata").read_bytes())  # the test's own file: plain pickle is fine here
    assert pickle.loads(hidden_in_tuple(marker, genuine)).state_dict_metadata.keys() == \
        genuine.state_dict_metadata.keys() and marker.exists()  # the payload is real: plain pickle runs it
    marker.unlink()
    (ckpt / ".metadata").write_bytes(hidden_in_tuple(marker, genuine))
    _refused(ckpt, marker)


def test_dcp_metadata_that_is_not_dcps_record_is_refused(tmp_path) -> None:
    """Only what DCP writes: one Metadata record (not a dict, not two pickles), shards inside the directory."""
    ckpt = sharded_checkpoint(tmp_path / "last.ckpt")
    real = (ckpt / ".metadata").read_bytes()
    metadata = pickle.loads(real)
    for bad, reason in ((pickle.dumps({"a": 1}), "not DCP's Metadata"), (real + real, "data after"),
                        (None, "outside the checkpoint directory")):
        if bad is None:
            index = next(iter(metadata.storage_data))
            metadata.storage_data[index] = _StorageInfo("../../etc/passwd", 0, 10)
            bad = pickle.dumps(metadata)
        (ckpt / ".metadata").write_bytes(bad)
        with pytest.raises(CheckpointError, match=rf"refused {ckpt}.*{reason}"):
            load_checkpoint(ckpt, "run=x")


@pytest.fixture
def put_back():
    """Whatever a state write changed, put back afterwards (a reader that lets one through changes it for the whole
    process: every later test would see `Path.exists` replaced)."""
    saved = {name: (target(), attr, getattr(target(), attr)) for name, (target, attr, _) in STATE_WRITES.items()}
    yield
    for obj, attr, value in saved.values():
        if getattr(obj, attr) is not value:
            setattr(obj, attr, value) if isinstance(obj, type) else vars(obj).__setitem__(attr, value)


@pytest.mark.parametrize("write", sorted(STATE_WRITES))
def test_dcp_metadata_that_writes_into_a_class_is_refused_and_the_class_is_unchanged(tmp_path, put_back,
                                                                                      write: str) -> None:
    """BUILD on `pathlib.PosixPath` itself (setattr(PosixPath, "exists", set): every path "absent" afterwards) or on
    an enum member calling the enum returned, in front of the genuine metadata: an allowed class is a constructor only,
    state goes into objects the load built."""
    target, attr, _ = STATE_WRITES[write]
    before = getattr(target(), attr)
    ckpt = sharded_checkpoint(tmp_path / "last.ckpt")
    (ckpt / ".metadata").write_bytes(state_write(write, (ckpt / ".metadata").read_bytes()))
    with pytest.raises(CheckpointError, match=rf"refused {ckpt}: .*\(BUILD on (the class pathlib\.PosixPath|a "
                                              rf"_MEM_FORMAT_ENCODING it did not build) is not allowed"):
        load_checkpoint(ckpt, "run=x")
    assert getattr(target(), attr) == before and ckpt.exists()


@GENUINE
@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_hostile_single_file_checkpoint_is_refused(tmp_path, payload: str, genuine: bool) -> None:
    path, marker = tmp_path / "last.ckpt", tmp_path / "pwned"
    torch.save(lmlab_checkpoint(), path)
    _rewrite_pickle(path, lambda real: hostile(payload, marker, real if genuine else None))
    _refused(path, marker)
    path.write_bytes(hostile(payload, marker))  # a bare pickle (torch's legacy format) too
    _refused(path, marker)


@GENUINE
@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_hostile_sharded_meta_is_refused(tmp_path, payload: str, genuine: bool) -> None:
    ckpt, marker = sharded_checkpoint(tmp_path / "last.ckpt"), tmp_path / "pwned"
    _rewrite_pickle(ckpt / META, lambda real: hostile(payload, marker, real if genuine else None))
    _refused(ckpt, marker)
    with pytest.raises(CheckpointError, match=rf"refused {ckpt}"):  # what a resume reads before Lightning does
        load_checkpoint(ckpt, "resume", weights=False)
    assert not marker.exists()


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_hostile_dcp_bytes_entry_is_refused(tmp_path, payload: str) -> None:
    """A non-tensor entry (an optimizer hyper-parameter) pointed at a payload appended to the shard file."""
    ckpt, marker = sharded_checkpoint(tmp_path / "last.ckpt"), tmp_path / "pwned"
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    index = next(i for i in metadata.storage_data if i.fqn.endswith("param_groups.0.lr"))
    shard = ckpt / metadata.storage_data[index].relative_path
    offset, data = shard.stat().st_size, hostile(payload, marker)
    with open(shard, "ab") as f:
        f.write(data)
    metadata.storage_data[index] = _StorageInfo(shard.name, offset, len(data))
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    _refused(ckpt, marker)
