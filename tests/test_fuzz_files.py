"""Every file plait reads, fuzzed: damaged, truncated, mistyped or foreign contents end in one
PlaitError naming the file, or read as what they are; never a raw exception.

Each reader gets a valid file first (written by plait or by the library that owns the format),
then hypothesis damages it: cut at any byte, bytes flipped, a JSON or TOML value swapped for
one of another type, or plain noise. `FUZZ_EXAMPLES` sets the examples per reader (as in
tests/test_fuzz.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plait.errors import PlaitError

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "40"))
ODD = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=8),
                st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


def _swap_one(value: Any, draw: Any) -> Any:
    """`value` (parsed JSON) with one entry, at any depth, replaced by an odd value."""
    if isinstance(value, dict) and value:
        key = draw(st.sampled_from(sorted(value)))
        copy = dict(value)
        copy[key] = _swap_one(value[key], draw) if draw(st.booleans()) else draw(ODD)
        return copy
    if isinstance(value, list) and value:
        i = draw(st.integers(0, len(value) - 1))
        copy = list(value)
        copy[i] = _swap_one(value[i], draw) if draw(st.booleans()) else draw(ODD)
        return copy
    return draw(ODD)


def _damaged(original: bytes, draw: Any, is_json: bool) -> bytes:
    how = draw(st.sampled_from(["cut", "flip", "swap", "noise", "empty"] if is_json else ["cut", "flip", "noise", "empty"]))
    if how == "cut":
        return original[:draw(st.integers(0, max(0, len(original) - 1)))]
    if how == "flip":
        data = bytearray(original)
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
        return bytes(data)
    if how == "swap":
        return json.dumps(_swap_one(json.loads(original), draw), default=str).encode()
    if how == "noise":
        return draw(st.binary(max_size=200))
    return b""


def fuzz_file(path: Path, read: Callable[[], Any], is_json: bool = False) -> None:
    """Damage `path` every way hypothesis finds; `read` must succeed or raise PlaitError."""
    original = path.read_bytes()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def fuzz(data):
        path.write_bytes(_damaged(original, data.draw, is_json))
        try:
            read()
        except PlaitError as exc:
            assert exc.message and "\n" not in exc.message, exc.message

    try:
        fuzz()
    finally:
        path.write_bytes(original)


def test_a_config_toml(tmp_path):
    from plait.families import family_of
    from plait.train.config.settings import build_config, load_toml, validate

    path = tmp_path / "run.toml"
    path.write_text('model = "tiny"\nsteps = 3\nlr = 1e-3\nzero = 1\nsp = false\n')

    def read() -> None:
        config = build_config({**load_toml(str(path)), "out": str(tmp_path / "o")}, {}, family_of)
        validate(config, family_of(config), local_limit=8)

    fuzz_file(path, read)


def test_a_hardware_file(tmp_path):
    from plait.estimate.hardware import load_hardware

    path = tmp_path / "hw.toml"
    path.write_text('[hardware]\nbase = "h100-sxm"\ninter_node_gb_s = 25.0\nmemory_gib = 80\n'
                    'gemm = [["fp32 64x64x64", 1.5]]\n')
    fuzz_file(path, lambda: load_hardware(path))


def test_a_prepared_corpus_index_and_its_documents(tmp_path):
    from plait.train.data.corpus import map_tokens
    from plait.train.data.prepare import prepare

    source = tmp_path / "a.jsonl"
    source.write_text("".join(json.dumps({"text": f"document {i} " * 3}) + "\n" for i in range(20)))
    prepare("bytes", str(source), str(tmp_path / "p"))
    fuzz_file(tmp_path / "p" / "index.json", lambda: map_tokens(str(tmp_path / "p")), is_json=True)
    fuzz_file(tmp_path / "p" / "documents.bin", lambda: map_tokens(str(tmp_path / "p")))


def test_a_run_directory_for_the_report(tmp_path):
    from plait.report.page import read_run

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "tokens_per_s": 5.0}\n'
                                       '{"step": 2, "loss": 1.5, "tokens_per_s": 5.5}\n')
    (run / "summary.json").write_text(json.dumps({"task": {"unit": "tokens", "metrics": {}}, "steps": 2}))
    fuzz_file(run / "metrics.jsonl", lambda: read_run(run))
    fuzz_file(run / "summary.json", lambda: read_run(run), is_json=True)


def test_a_checkpoint_index(tmp_path):
    from plait.models.gpt.config import get_preset
    from plait.models.gpt.model import build_gpt
    from plait.runtime.env import ProcessEnv
    from plait.runtime.mesh import init_mesh
    from plait.train.checkpoint import write as checkpoint
    from plait.train.checkpoint.read import Reader, describe

    model = build_gpt(get_preset("tiny"), 0)
    optimizer = torch.optim.AdamW(model.parameters())
    mesh = init_mesh(env=ProcessEnv("single", 0, 1, 0, "127.0.0.1", 29500))
    path = checkpoint.save(tmp_path / "ck", 1, model, optimizer, mesh, {"note": "x"})

    def read() -> None:
        Reader(path)
        describe(str(path))

    fuzz_file(Path(path) / "index.json", read, is_json=True)


def test_safetensors_weights_and_their_index(tmp_path):
    from plait.train.checkpoint.shards import read_weights, write_streamed

    weights = {f"layer{i}.weight": torch.randn(3, 4) for i in range(4)}
    write_streamed(tmp_path, weights, 100)

    def read() -> None:
        for tensor in read_weights(tmp_path).values():
            tensor.sum()

    fuzz_file(tmp_path / "model.safetensors.index.json", read, is_json=True)
    fuzz_file(sorted(tmp_path.glob("model-*.safetensors"))[0], read)


def test_a_hugging_face_config_and_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from plait.models.hf.config import read_hf_dir
    from plait.train.data.prepare import load_tokenizer
    from tests.test_records import bpe_with_eos

    transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    bpe_with_eos(tmp_path)

    def read_config() -> None:
        read_hf_dir(f"hf:{tmp_path}").shape_or_none()

    fuzz_file(tmp_path / "config.json", read_config, is_json=True)
    fuzz_file(tmp_path / "tokenizer.json", lambda: load_tokenizer(str(tmp_path)), is_json=True)


def test_data_records(tmp_path):
    from plait.train.data.records import Documents

    source = tmp_path / "a.jsonl"
    source.write_text("".join(json.dumps({"text": f"document {i}", "id": i}) + "\n" for i in range(5)))
    fuzz_file(source, lambda: list(Documents(source)))
