"""`plait estimate`: the table, the JSON, and every bad input's message."""

from __future__ import annotations

import json

import pytest

from plait.errors import PlaitError
from plait.estimate.cli import estimate_main as estimate_with
from plait.families import shape_of


def estimate_main(argv: list[str]) -> int:
    return estimate_with(argv, shape_of)
from plait.estimate.report import human_bytes, table

pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


LLAMA_7B = ["--model", "llama-7b", "--dp", "8", "--zero", "1", "--seq-len", "4096",
            "--precision", "bf16", "--hardware", "h100-sxm"]


def test_table(capsys) -> None:
    assert estimate_main(LLAMA_7B) == 0
    out = capsys.readouterr().out
    for needle in ("memory per GPU", "optim", "9.41 GiB", "reduce_scatter", "MFU", "assumptions"):
        assert needle in out


def test_json(capsys) -> None:
    estimate_main([*LLAMA_7B, "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["memory"]["optim"] == 12 * 6_738_415_616 / 8
    assert set(result["comm"]["dp"]) == {"reduce_scatter", "all_gather", "all_reduce"}
    assert result["comm"]["dp"]["all_reduce"] < 100  # only the gradient norm's fp64 sum


def test_params_only(capsys) -> None:
    estimate_main(["--params", "7e9", "--dp", "8", "--zero", "3", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["memory"]["activations"] is None
    assert result["memory"]["params"] == pytest.approx(2 * 7e9 / 8)
    # plait train clips: the gradient norm's fp64 sum over the 8 shard ranks, as for a shaped model
    # (RWKV, priced by its size, measured 8 B a step on 2 ranks that the estimate left out)
    assert result["comm"]["dp"]["all_reduce"] == 2 * 7 / 8 * 8


def test_hardware_file(tmp_path, capsys) -> None:
    path = tmp_path / "hw.toml"
    path.write_text('[hardware]\nbase = "a100-40gb"\nname = "lab-a100"\n')
    estimate_main(["--model", "tiny", "--hardware-file", str(path), "--json"])
    assert json.loads(capsys.readouterr().out)["layout"]["hardware"] == "lab-a100"


@pytest.mark.parametrize("table, message", [
    ("memory_gb_s = nan", "memory_gb_s must be a positive number, got nan"),
    ("gemm = 5", "gemm must be a list of rows, got 5"),
    ('links = "x"', "links must be a list of rows, got 'x'"),
    ('base = "cpu"\ncrowding = 0.5', "crowding must be 1 or more, got 0.5"),
    ('base = "cpu"\n[hardware.lone_by_micro_batch]\n"8" = 0.5', "needs speedups of 1 or more, got 8 = 0.5"),
    ('base = "cpu"\n[hardware.split_by_micro_batch]\n"8" = 0.9', "needs ratios of 1 or more, got 8 = 0.9"),
    ('base = "cpu"\n[hardware.split_by_micro_batch]\n"x" = 1.1', "bad .*split_by_micro_batch"),
])
def test_a_bad_hardware_file_is_one_error(table: str, message: str, tmp_path) -> None:
    """Values a TOML file can hold that are no hardware: refused, not a NaN step or a TypeError."""
    path = tmp_path / "hw.toml"
    path.write_text(f"[hardware]\n{table}\n")
    with pytest.raises(PlaitError, match=message):
        estimate_main(["--model", "tiny", "--dp", "2", "--hardware-file", str(path)])
    path.write_bytes(b"\xff[hardware]\n")
    with pytest.raises(PlaitError, match="cannot read hardware file"):
        estimate_main(["--model", "tiny", "--hardware-file", str(path)])


@pytest.mark.parametrize("argv, message, hint", [
    (["--model", "gpt5"], "unknown --model 'gpt5'", "llama-7b"),
    (["--model", "tiny", "--hardware", "abacus"], "unknown hardware 'abacus'", "h100-sxm"),
    (["--model", "tiny", "--dp", "2", "--tp", "2", "--gpus", "8"],
     "layout dp=2 × tp=2 × pp=1 = 4 does not match --gpus 8", "product is 8"),
    (["--model", "tiny", "--tp", "3"], "n_heads = 4 is not divisible by tp=3", "tp among 1, 2, 4"),
    (["--model", "tiny", "--precision", "fp4"], "unknown --precision 'fp4'", "fp32, bf16, fp16, fp8"),
    (["--model", "tiny", "--params", "1e6"], "not both", "--model"),
    ([], "no model given", "--model"),
    (["--model", "tiny", "--seq-len", "0"], "--seq-len must be at least 1, got 0", "leave --seq-len out"),
    (["--model", "tiny", "--dp", "4", "--gpus-per-node", "-3"], "--gpus-per-node must be at least 1, got -3", "8"),
    (["--params", "nan", "--dp", "2"], "--params must be a positive number, got nan", "--params 7e9"),
])
def test_bad_input(argv: list[str], message: str, hint: str) -> None:
    with pytest.raises(PlaitError) as err:
        estimate_main(argv)
    assert message in err.value.message
    assert hint in err.value.hint


def test_humanised_units_and_alignment() -> None:
    assert human_bytes(1536) == "1.50 KiB"
    assert human_bytes(3 * 2**30) == "3.00 GiB"
    assert human_bytes(None) == "unknown"
    lines = table([["a", "1"], ["long name", "1000"]])
    assert lines == ["a             1", "long name  1000"]


def test_zero3_gather_options_change_traffic_and_gathered_memory(capsys) -> None:
    """--reshard-after-forward false: 2 gathers of the weights become 1, and every unit is held;
    --prefetch 2: one more unit held than the default."""
    base = ["--model", "small", "--dp", "4", "--zero", "3", "--seq-len", "128", "--json"]
    runs = {}
    for name, extra in (("default", []), ("prefetch2", ["--prefetch", "2"]), ("keep", ["--reshard-after-forward", "false"])):
        estimate_main([*base, *extra])
        runs[name] = json.loads(capsys.readouterr().out)
    gathers = {k: r["comm"]["dp"]["all_gather"] for k, r in runs.items()}
    assert gathers["keep"] == gathers["default"] / 2 and gathers["prefetch2"] == gathers["default"]
    params = {k: r["memory"]["params"] for k, r in runs.items()}
    assert params["default"] < params["prefetch2"] < params["keep"]


def test_compile_prices_the_compiled_blocks_element_wise_work_and_only_on_plaits_stack(capsys) -> None:
    """--compile moves the compute (the blocks' element-wise kernels), not traffic, and of memory
    only SwiGLU's product, which the compiled block keeps for the down projection's backward
    where the eager one makes it again (models/gpt/lean.gated_down): 32 blocks of 4,096 tokens
    of 11,008 bf16 values; a stack that runs its own kernels refuses it in one line."""
    estimate_main([*LLAMA_7B, "--json"])
    eager = json.loads(capsys.readouterr().out)
    estimate_main([*LLAMA_7B, "--json", "--compile"])
    compiled = json.loads(capsys.readouterr().out)
    assert compiled["time"]["compute_s"] < 0.9 * eager["time"]["compute_s"]
    assert compiled["memory"]["activations"] - eager["memory"]["activations"] == 32 * 4096 * 11008 * 2
    assert {k: v for k, v in compiled["memory"].items() if k not in ("activations", "fragmentation", "total", "peak")} \
        == {k: v for k, v in eager["memory"].items() if k not in ("activations", "fragmentation", "total", "peak")}
    assert compiled["comm"] == eager["comm"]
    with pytest.raises(PlaitError, match=r"--stack nemo has no --compile"):
        estimate_main([*LLAMA_7B, "--compile", "--stack", "nemo"])
