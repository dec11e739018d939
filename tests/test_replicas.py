"""Replicas checked as the run goes (plait/parallel/replicas.py, --check-replicas): a bit
flipped on one rank is named, the run stopped and resumed from the last checked checkpoint
to the bytes of a run without the flip; the layouts whose ranks share blocks (dp, tp's
norms, pp's tied embedding, --dp-shard's replica groups) agree when nothing is wrong."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from plait.errors import PlaitError
from plait.runtime.inject import parse_bitflip
from tests.worldlib import run_plait

RUN = ["--model", "tiny", "--seq-len", "32", "--micro-batch", "4", "--sample-tokens", "0", "--eval-every", "0",
       "--no-report", "--steps", "6", "--save-every", "2", "--check-replicas", "1"]


def test_a_flipped_bit_is_named_stopped_and_resumed_to_the_same_weights(tmp_path: Path) -> None:
    clean = run_plait("train", *RUN, "--nproc", "2", "--out", str(tmp_path / "clean"))
    assert clean.returncode == 0, clean.stderr[-2000:]
    flipped = run_plait("train", *RUN, "--nproc", "2", "--max-restarts", "1", "--resume", "auto",
                        "--inject", "bitflip:rank=1,step=3", "--out", str(tmp_path / "flipped"))
    assert flipped.returncode == 0, flipped.stderr[-2000:]
    said = flipped.stdout + flipped.stderr
    assert "injected fault: rank 1 flips one bit of model/embed.weight as step 3 begins" in said
    assert re.search(r"silent data corruption at step 3: model/embed.weight differs on rank\(s\) 1 from its copies "
                     r"on rank\(s\) 0; the run stops", said), said[-3000:]
    # every rank stops with code 3; the spawner names the first whose exit it sees
    assert re.search(r"rank \d exited with code 3", said) and "restarting the world (1 of 1)" in said, said[-3000:]
    assert (tmp_path / "flipped" / "model.safetensors").read_bytes() == (tmp_path / "clean" / "model.safetensors"
                                                                         ).read_bytes()


@pytest.mark.parametrize("layout", [["--nproc", "2", "--tp", "2"], ["--nproc", "2", "--pp", "2", "--grad-accum", "2"],
                                    ["--nproc", "4", "--zero", "3", "--dp-shard", "2"]])
def test_every_layouts_shared_blocks_agree_when_nothing_is_wrong(tmp_path: Path, layout: list[str]) -> None:
    proc = run_plait("train", *RUN, *layout, "--log-level", "info", "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    agreed = [int(n) for n in re.findall(r"the (\d+) blocks held by several ranks agree", proc.stderr)]
    assert len(agreed) >= 6 and min(agreed) > 0, proc.stderr[-2000:]


@pytest.mark.parametrize("spec", ["bitflip", "bitflip:rank=1", "bitflip:rank=-1,step=2", "flip:rank=0,step=1",
                                  "bitflip:rank=0,step=0", "bitflip:rank=x,step=1"])
def test_a_bad_injection_is_one_line(spec: str) -> None:
    with pytest.raises(PlaitError, match="is not bitflip:rank=R,step=S"):
        parse_bitflip(spec)
