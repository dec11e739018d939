"""A checkpoint write that fails half-way (disk full, permission lost) is one clear error,
and the previous checkpoint stays `latest` and loadable. (A process killed mid-save:
tests/test_checkpoint.py.)"""

from __future__ import annotations

import errno

import pytest
import safetensors.torch
import torch

from plait.errors import PlaitError
from plait.train.checkpoint import write as checkpoint
from plait.train.checkpoint.read import Reader, load
from tests.test_checkpoint import single_mesh, trained


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


def _fail_with(code):
    def fail(*args, **kwargs):
        raise OSError(code, "injected: " + errno.errorcode[code], "somefile")
    return fail


@pytest.mark.parametrize("where, code", [("rank file", errno.ENOSPC), ("index", errno.EACCES)])
def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch, where, code):
    mesh = single_mesh()
    model, opt = trained()
    checkpoint.save(tmp_path, 1, model, opt, mesh, {"note": "good"})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # what step 2 would have saved
    if where == "rank file":
        monkeypatch.setattr(safetensors.torch, "save_file", _fail_with(code))
    else:
        monkeypatch.setattr(checkpoint, "_write_index", _fail_with(code))
    with pytest.raises(PlaitError) as err:
        checkpoint.save(tmp_path, 2, model, opt, mesh, {"note": "bad"})
    message = err.value.message
    assert message.startswith(f"checkpoint {tmp_path / 'step-00000002'} could not be written on rank(s) 0: ")
    assert f"injected: {errno.errorcode[code]} (somefile)" in message
    assert message.endswith("the previous checkpoint step-00000001 is intact")
    assert "--resume auto" in err.value.hint
    assert (tmp_path / "latest").resolve().name == "step-00000001"
    assert not (tmp_path / "step-00000002").exists() and not (tmp_path / ".tmp-step-00000002").exists()
    assert Reader(tmp_path).index["trainer"] == {"note": "good"}
    monkeypatch.undo()
    fresh, fresh_opt = trained()
    load(tmp_path, fresh, fresh_opt, mesh)
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_failed_first_write_says_there_is_nothing_earlier(tmp_path, monkeypatch):
    mesh = single_mesh()
    model, opt = trained()
    monkeypatch.setattr(safetensors.torch, "save_file", _fail_with(errno.ENOSPC))
    with pytest.raises(PlaitError, match=r"ENOSPC \(somefile\); no earlier checkpoint exists"):
        checkpoint.save(tmp_path, 1, model, opt, mesh, {})
