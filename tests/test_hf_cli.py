"""`plait train --model hf:DIR`, `--resume` under another layout, and `ckpt export --hf`.

The test writes DIR itself: a tiny LlamaConfig saved with its (seeded) safetensors weights,
and a byte-level BPE tokenizer trained with `tokenizers` on the test's own text. Then:

- one run, dp 2, 4 steps, checkpoints at 2 and 4: its first loss equals the loss of
  transformers' own model loaded from DIR on the same first batch, computed here in one
  process (the text tokenized here, whole);
- `--resume` from step 2 under another layout (one process with accumulation; ZeRO-3 × 2
  under `make test-all`): it runs steps 3 and 4, with the losses and final weights of the
  run that was not interrupted;
- `ckpt export --hf`: `from_pretrained` on the export gives exactly the logits of plait's
  final weights (OUT/model.safetensors), and the tokenizer comes along.

Bad input is checked in this process, before anything would spawn: each is one error line
and a hint.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from plait.cli import main
from tests.parity import PARAM_ATOL, PARAM_RTOL, assert_losses_close
from tests.worldlib import Runs, run_plait, split_slow

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SEQ, MICRO, STEPS = 16, 2, 4
TRAIN = ["--seq-len", str(SEQ), "--micro-batch", str(MICRO), "--steps", str(STEPS), "--eval-every", "0",
         "--eval-samples", "4", "--sample-tokens", "4", "--no-report", "--lr", "0.01", "--warmup-steps", "1"]
RESUMED = {"one process": ["--nproc", "1", "--grad-accum", "2"], "zero3 x2": ["--nproc", "2", "--zero", "3"],
           "tp2": ["--nproc", "2", "--tp", "2", "--grad-accum", "2"],
           "pp2 1f1b": ["--nproc", "2", "--pp", "2", "--schedule", "1f1b", "--grad-accum", "2"]}


def corpus_text() -> str:
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly pack boxes of jugs".split()
    lines = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(5 + i % 6)) + f" {i}." for i in range(300)]
    return "\n".join(lines) + "\n"


def write_model_dir(root: Path, vocab_size: int = 320) -> Path:
    """DIR: config.json and model.safetensors (save_pretrained), and tokenizer.json."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([corpus_text()], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(3)
    directory = root / "model"
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_cli")
    corpus = root / "corpus.txt"
    corpus.write_text(corpus_text())
    paths = {"dir": write_model_dir(root), "corpus": corpus, "first": root / "first", "root": root}
    with_report = [flag for flag in TRAIN if flag != "--no-report"]
    proc = run_plait("train", "--model", f"hf:{paths['dir']}", "--data", str(corpus), *with_report, "--nproc", "2",
                     "--save-every", "2", "--keep-checkpoints", "0", "--out", str(paths["first"]),
                     env_extra={"PLAIT_REPORT": "on"})  # the whole closing path, report included
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"report      {paths['first']}/report.md" in proc.stdout
    assert (paths["first"] / "report" / "throughput.png").is_file()
    return paths


@pytest.fixture(scope="module")
def resumed(setup: dict[str, Path]) -> Runs:
    """Runs continued from the first run's step 2, under another layout (no --save-every)."""
    def run(layout: str) -> Path:
        out = setup["root"] / f"resumed-{layout.replace(' ', '-')}"
        proc = run_plait("train", "--model", f"hf:{setup['dir']}", "--data", str(setup["corpus"]), *TRAIN,
                         *RESUMED[layout], "--resume", str(setup["first"] / "checkpoints" / "step-00000002"),
                         "--out", str(out))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return out
    return Runs(run)


def metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_first_loss_matches_transformers_on_the_same_batch(setup: dict[str, Path]) -> None:
    """The weights come from DIR, the text is tokenized by DIR's tokenizer, the loss is
    next-token cross-entropy over the whole first global batch (dp 2 × micro-batch 2)."""
    import torch
    import torch.nn.functional as F
    from tokenizers import Tokenizer

    from plait.train.data.corpus import StepSampler, train_val_split

    ids = Tokenizer.from_file(str(setup["dir"] / "tokenizer.json")).encode(corpus_text(), add_special_tokens=False).ids
    train, _ = train_val_split(torch.tensor(ids), SEQ)
    first = StepSampler(train.num_samples, 2 * MICRO, 0, 1, 2 * MICRO, seed=0).micro_batches(0)[0]
    inputs, targets = train.batch(first)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(setup["dir"]))
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    assert_losses_close([metrics(setup["first"])[0]["loss"]], [expected])


@pytest.mark.parametrize("layout", split_slow(RESUMED, fast={"one process"}))
def test_resume_under_another_layout_continues_the_run(setup: dict[str, Path], resumed: Runs, layout: str) -> None:
    import torch
    from safetensors.torch import load_file

    out = resumed[layout]
    lines, whole = metrics(out), metrics(setup["first"])
    assert [r["step"] for r in lines] == [3, 4]
    assert_losses_close([r["loss"] for r in lines], [r["loss"] for r in whole[2:]])
    final, expected = load_file(str(out / "model.safetensors")), load_file(str(setup["first"] / "model.safetensors"))
    assert final.keys() == expected.keys() and "model.embed_tokens.weight" in final
    for name, tensor in expected.items():
        torch.testing.assert_close(final[name], tensor, rtol=PARAM_RTOL, atol=PARAM_ATOL)


def test_export_hf_loads_in_transformers_with_the_trained_weights(setup: dict[str, Path]) -> None:
    import torch
    from safetensors.torch import load_file

    out = setup["root"] / "exported"
    assert main(["ckpt", "export", str(setup["first"]), "--hf", str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == (setup["dir"] / "tokenizer.json").read_bytes()
    assert (out / "generation_config.json").read_bytes() == (setup["dir"] / "generation_config.json").read_bytes()
    trained = load_file(str(setup["first"] / "model.safetensors"))  # what plait wrote at the end
    reference = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(str(setup["dir"])))
    reference.load_state_dict(trained, strict=False)  # the head is tied to the embedding
    reference.tie_weights()
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert torch.equal(exported.lm_head.weight, trained["model.embed_tokens.weight"])
    ids = torch.randint(0, 300, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, reference.eval()(input_ids=ids).logits)
    assert not any(p.name.startswith(".exported") for p in setup["root"].iterdir())  # no temporary left


def test_a_run_without_checkpoints_exports_from_its_own_outputs(resumed: Runs, tmp_path: Path) -> None:
    """No --save-every: `plait ckpt export RUN --hf OUT` reads RUN/model.safetensors and the
    model's files the run attached beside it."""
    import torch
    from safetensors.torch import load_file

    run = resumed["one process"]
    assert not (run / "checkpoints").exists() and (run / "attached" / "hf" / "config.json").is_file()
    out = tmp_path / "exported"
    assert main(["ckpt", "export", str(run), "--hf", str(out)]) == 0
    trained = load_file(str(run / "model.safetensors"))
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert all(torch.equal(exported.state_dict()[name], tensor) for name, tensor in trained.items())
    assert (out / "tokenizer.json").is_file()


def test_weights_above_the_shard_size_are_written_and_exported_as_transformers_shards(setup: dict[str, Path],
                                                                                      tmp_path: Path) -> None:
    """--max-shard-size: the run's weights, gathered a few tensors at a time under tp 2, land in
    shards with model.safetensors.index.json; the export cuts them again, and
    from_pretrained loads the run's bytes."""
    import torch

    from plait.train.checkpoint.shards import read_weights

    run = tmp_path / "sharded"
    proc = run_plait("train", "--model", f"hf:{setup['dir']}", "--data", str(setup["corpus"]), *TRAIN, "--nproc", "2",
                     "--tp", "2", "--max-shard-size", "20KB", "--out", str(run))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    index = json.loads((run / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (run / "model.safetensors").exists()
    assert f"model.safetensors.index.json ({len(shards)} shards)" in proc.stdout
    trained = read_weights(run)
    out = tmp_path / "exported"
    assert main(["ckpt", "export", str(run), "--hf", str(out), "--max-shard-size", "30KB"]) == 0
    assert (out / "model.safetensors.index.json").is_file()
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    assert set(trained) <= set(exported) and all(torch.equal(exported[name], trained[name]) for name in trained)


# -- bad input: one line and a hint, before any process starts ---------------------------------------
def bad_dirs(root: Path, model: Path) -> dict[str, tuple[str, str]]:
    """{case: (--model, words the error must hold)}."""
    import shutil

    def copy(name: str, keep: tuple[str, ...], config: dict[str, Any] | None = None) -> Path:
        directory = root / name
        directory.mkdir()
        for file in keep:
            shutil.copyfile(model / file, directory / file)
        if config is not None:
            (directory / "config.json").write_text(json.dumps(config))
        return directory

    base = json.loads((model / "config.json").read_text())
    return {
        "missing dir": (f"hf:{root / 'absent'}", "is not a directory"),
        "no config.json": (f"hf:{copy('noconfig', ('model.safetensors', 'tokenizer.json'))}", "config.json is missing"),
        "tokenizer larger than vocab": (f"hf:{copy('small', ('tokenizer.json',), {**base, 'vocab_size': 200})}",
                                        "tokenizer.json has 300 tokens, more than the vocab_size 200"),
        "bytes need 256 ids": (f"hf:{copy('bytes', (), {**base, 'vocab_size': 200})}", "read as bytes"),
        "shards without index": (f"hf:{copy('shards', ('config.json',))}", "without model.safetensors.index.json"),
        "not a causal LM": (f"hf:{copy('t5', (), {**base, 'model_type': 't5'})}", "model_type 't5'"),
    }


def test_bad_model_dirs_fail_with_one_line_and_a_hint(setup: dict[str, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    from plait.train.data.prepare import prepare

    cases = bad_dirs(tmp_path, setup["dir"])
    shutil.copyfile(setup["dir"] / "model.safetensors", tmp_path / "shards" / "model-00001-of-00002.safetensors")
    prepare("bytes", str(setup["corpus"]), str(tmp_path / "as-bytes"))
    cases["corpus prepared as bytes"] = (f"hf:{setup['dir']}", "was not tokenized with")
    for case, (model, words) in cases.items():
        data = tmp_path / "as-bytes" if case == "corpus prepared as bytes" else setup["corpus"]
        code = main(["train", "--model", model, "--data", str(data), "--seq-len", str(SEQ),
                     "--out", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert code == 2, (case, err)
        lines = err.strip().splitlines()
        assert len(lines) == 2 and lines[0].startswith("plait: error: ") and lines[1].startswith("  hint: "), (case, err)
        assert words in lines[0], (case, err)


def test_a_model_whose_own_forward_fails_is_named_so(setup: dict[str, Path], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """3 K/V heads for 4 query heads: transformers builds the Llama, and its attention cannot
    broadcast them. The run stops with one line saying that the model's own forward fails at
    one process (and torch's line), not torch's RuntimeError alone; a failure the model does
    not raise on its own is left as it came."""
    from plait.models.hf.config import read_hf_dir
    from plait.models.hf.load import fails_on_its_own

    config = json.loads((setup["dir"] / "config.json").read_text())
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 3}))
    code = main(["train", "--model", f"hf:{tmp_path / 'bad'}", "--data", str(setup["corpus"]), "--nproc", "1",
                 "--seq-len", str(SEQ), "--micro-batch", "2", "--steps", "1", "--no-report", "--out", str(tmp_path / "o")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2, lines
    assert lines[-2] == (f"plait: error: --model hf:{tmp_path / 'bad'}: the model's own forward fails at one process, "
                         "before plait splits anything: RuntimeError: The size of tensor a (4) must match the size "
                         "of tensor b (3) at non-singleton dimension 1"), lines
    assert lines[-1].startswith("  hint: its config.json's sizes disagree"), lines
    other = RuntimeError("The size of tensor a (2) must match the size of tensor b (3) at non-singleton dimension 1")
    assert fails_on_its_own(read_hf_dir(f"hf:{tmp_path / 'bad'}"), other, 2, SEQ) is None
    assert fails_on_its_own(read_hf_dir(f"hf:{setup['dir']}"), other, 2, SEQ) is None  # the model runs


def test_dropout_or_router_noise_trains_on_one_process_only(setup: dict[str, Path], tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """GPT-2's defaults (three dropouts of 0.1) on 2 processes would draw the same masks on both
    dp ranks: refused in one line naming the fields, not the classifier heads' dropout, which
    a causal LM never runs; on one process it trains. Mixtral's router noise likewise."""
    from plait.families.hf.check import check_random_draws
    from plait.models.hf.config import read_hf_dir

    transformers.GPT2Config(vocab_size=256, n_embd=16, n_layer=1, n_head=2, n_positions=32).save_pretrained(
        tmp_path / "gpt2")
    code = main(["train", "--model", f"hf:{tmp_path / 'gpt2'}", "--data", str(setup["corpus"]), "--nproc", "2",
                 "--seq-len", str(SEQ), "--out", str(tmp_path / "o")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 2, lines
    assert lines[0].startswith(f"plait: error: --model hf:{tmp_path / 'gpt2'}: attn_pdrop = 0.1, embd_pdrop = 0.1, "
                               "resid_pdrop = 0.1; random draws in the training forward"), lines
    assert "summary_first_dropout" not in lines[0] and "or train on one process (--nproc 1)" in lines[1]
    check_random_draws(read_hf_dir(f"hf:{tmp_path / 'gpt2'}"), 1, "gpt2")  # one process: the reference itself
    config = json.loads((setup["dir"] / "config.json").read_text())
    (tmp_path / "noisy").mkdir()
    (tmp_path / "noisy" / "config.json").write_text(json.dumps({**config, "router_jitter_noise": 0.01}))
    with pytest.raises(Exception, match="router_jitter_noise = 0.01; random draws"):
        check_random_draws(read_hf_dir(f"hf:{tmp_path / 'noisy'}"), 4, "noisy")
    (tmp_path / "nested").mkdir()  # a nested table's dropout, and layer drop, are draws too
    (tmp_path / "nested" / "config.json").write_text(json.dumps(
        {**config, "text_config": {"attention_dropout": 0.1}, "attn_config": {"attn_pdrop": 0.0}, "layerdrop": 0.2}))
    with pytest.raises(Exception, match="text_config.attention_dropout = 0.1, layerdrop = 0.2; random draws"):
        check_random_draws(read_hf_dir(f"hf:{tmp_path / 'nested'}"), 2, "nested")


def test_export_hf_of_a_plait_gpt_checkpoint_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from plait.train.checkpoint.write import FORMAT

    step = tmp_path / "step-00000001"
    step.mkdir()
    (step / "index.json").write_text(json.dumps({"format": FORMAT, "step": 1, "world_size": 1, "files": {},
                                                 "tensors": {}, "trainer": {"config": {"model": "tiny"}}}))
    assert main(["ckpt", "export", str(step), "--hf", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "is of --model tiny, not of a Hugging Face model" in err and "--to FILE.safetensors" in err
    assert not (tmp_path / "out").exists()


def test_estimate_reads_the_shape_from_config_json(setup: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from plait.families import shape_of

    shape = shape_of(f"hf:{setup['dir']}")
    assert (shape.n_layers, shape.d_model, shape.n_heads, shape.n_kv_heads, shape.vocab_size) == (2, 32, 4, 2, 320)
    summary = json.loads((setup["first"] / "summary.json").read_text())
    assert summary["num_params"] == shape.num_params() == 2 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 64) + 320 * 32 + 32
    assert main(["estimate", "--model", f"hf:{setup['dir']}", "--dp", "2", "--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)
    assert predicted["memory"]["params"] == summary["num_params"] * 4  # fp32, replicated


def test_the_shape_counts_the_mlp_the_model_builds(tmp_path: Path) -> None:
    """A relu² MLP (Nemotron: up and down, no gate) has two matrices, which config.json does not
    say: read as Llama-shaped it would count three. The shape counts what transformers builds
    on the meta device, and so do the estimate's parameters and FLOPs."""
    import torch
    import transformers

    from plait.estimate.time import flops_per_token
    from plait.families import shape_of

    config = transformers.NemotronConfig(vocab_size=256, hidden_size=64, intermediate_size=512, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         tie_word_embeddings=False)
    config.save_pretrained(tmp_path / "nemotron")
    with torch.device("meta"):
        built = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    shape = shape_of(f"hf:{tmp_path / 'nemotron'}")
    assert shape.mlp_matrices == 2 and shape.mlp_params == 2 * 64 * 512
    assert shape.num_params() == built  # counted (GPTConfig.block_tally), its LayerNorms' biases too
    formula = replace(shape, block_tally=(), extra_params=0)  # the formulas alone, as read
    llama_reading = replace(formula, mlp_matrices=3)
    assert abs(formula.num_params() / built - 1) < 0.01  # its LayerNorms' biases are all they miss
    assert llama_reading.num_params() - formula.num_params() == 2 * 64 * 512  # one d·f matrix per block, 2 blocks
    assert flops_per_token(llama_reading, 64)[0] - flops_per_token(formula, 64)[0] == 6 * 2 * 64 * 512


def test_without_weights_every_rank_starts_from_the_seed(tmp_path: Path) -> None:
    """No safetensors in DIR: every rank builds the same model from --seed (and another seed
    gives another model), whatever its layout; with them, DIR's weights."""
    import torch

    from plait.models.hf.config import read_hf_dir
    from plait.models.hf.load import build_hf_model

    transformers.GPT2Config(vocab_size=256, n_embd=16, n_layer=1, n_head=2, n_positions=32).save_pretrained(tmp_path)
    hf = read_hf_dir(f"hf:{tmp_path}")
    assert hf.weights == () and hf.tokenizer is None and hf.shape().arch == "gpt2"
    first, again, other = (dict(build_hf_model(hf, seed).named_parameters()) for seed in (0, 0, 1))
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["transformer.wte.weight"], other["transformer.wte.weight"])
    assert build_hf_model(hf, 0).training  # from_pretrained gives eval mode; plait trains


def test_raw_text_is_tokenized_as_data_prepare_would(setup: dict[str, Path], tmp_path: Path) -> None:
    """Raw --data through DIR's tokenizer, on each rank, gives the tokens `plait data prepare
    --tokenizer DIR` writes; such a prepared corpus passes the checks, and is used as it is."""
    import torch

    from plait.families import family_of
    from plait.train.config.settings import build_config, validate
    from plait.train.data.corpus import map_tokens
    from plait.families.hf.task import HFTask
    from plait.train.data.prepare import prepare

    prepared = tmp_path / "prepared"
    prepare(str(setup["dir"]), str(setup["corpus"]), str(prepared))
    raw, mapped = ({"model": f"hf:{setup['dir']}", "data": str(data), "seq_len": str(SEQ), "out": str(tmp_path / "o")}
                   for data in (setup["corpus"], prepared))
    config = build_config({}, mapped, family_of)
    validate(config, family_of(config))
    train, val, _ = HFTask(build_config({}, raw)).load()
    whole = torch.cat([train.tokens, val.tokens])
    assert torch.equal(whole, map_tokens(str(prepared)).long())
    assert HFTask(build_config({}, mapped)).attachments()["hf/tokenizer.json"] == setup["dir"] / "tokenizer.json"
