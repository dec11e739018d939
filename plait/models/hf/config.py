"""A local Hugging Face model directory (`--model hf:DIR`), read without torch or transformers.

    DIR/config.json                       required: the architecture (model_type, sizes): any
                                          causal LM transformers builds (plait.families.hf.check)
    DIR/model.safetensors                 optional: the weights to start from; or
    DIR/model.safetensors.index.json      with the shards it names (model-00001-of-00002...)
    DIR/generation_config.json            optional, like tokenizer_config.json and
                                          special_tokens_map.json: carried into the export
    DIR/tokenizer.json                    optional: else the corpus is bytes (vocabulary ≥ 256)

Everything here is JSON and file names, so `plait train` checks the directory, and `plait
estimate` sizes the model, before any process starts. `shape()` describes the model as a
GPTConfig (the shape every memory and time formula of `plait estimate` reads), from the
sizes decoder configs name under a few common spellings; a config that names none of them
has no shape (data parallelism and ZeRO need none; the estimate is then by parameter count).
Building the model itself is plait.models.hf.load's. Nothing is ever downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.errors import PlaitError
from plait.models.gpt.config import GPTConfig

PREFIX = "hf:"
CONFIG, WEIGHTS, WEIGHTS_INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
GENERATION, TOKENIZER = "generation_config.json", "tokenizer.json"
# Carried, when DIR has them, into checkpoints and the export: what from_pretrained and
# AutoTokenizer read beside the weights.
COMPANIONS = (GENERATION, "tokenizer_config.json", "special_tokens_map.json")
# The sizes a decoder's config.json names, each under the spellings transformers' configs use.
SIZES = {"layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
         "hidden": ("hidden_size", "n_embd", "d_model"),
         "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads", "attention_heads"),  # GPT-Neo's, MPT's, XGLM's
         "positions": ("max_position_embeddings", "n_positions", "max_seq_len", "model_max_length")}  # Kimi's

# A config's list of its blocks' kinds, one a block, where it names no count of them.
LAYER_KINDS = ("layers_block_type", "layer_types")


# Where transformers' configs keep the attention's dropout rate (Llama's, GPT-2's spelling).
ATTENTION_DROPOUT = ("attention_dropout", "attn_pdrop")


def attention_dropout(config: dict[str, Any]) -> tuple[str, float] | None:
    """(field, rate) of a config's attention dropout when it is on, else None."""
    for field in ATTENTION_DROPOUT:
        rate = config.get(field) or 0.0
        if rate > 0:
            return field, rate
    return None


# Fields of transformers' configs that only heads other than the causal LM's read (sequence
# classification, GPT-2's double heads): their dropout never runs in `plait train`.
UNUSED_DROPOUT = ("classifier_dropout", "summary_first_dropout")
# A random draw in the training forward besides dropout: Mixtral's and PhiMoE's router noise.
ROUTER_NOISE = ("router_jitter_noise",)


def random_draws(config: dict[str, Any], prefix: str = "") -> list[tuple[str, float]]:
    """(field, rate) of every random draw the config turns on in a training forward: each
    dropout (any field spelled with "dropout" or "pdrop": attention, hidden, residual,
    embedding, activation...), layer drop (a whole block skipped at random) and router noise,
    when above 0; at any depth, for the tables a config nests (a multimodal model's
    text_config, DBRX's attn_config), named by their path (text_config.attention_dropout)."""
    out = []
    for field, value in config.items():
        if isinstance(value, dict):
            out += random_draws(value, f"{prefix}{field}.")
            continue
        random = (("dropout" in field or "pdrop" in field or "layerdrop" in field or field in ROUTER_NOISE)
                  and field not in UNUSED_DROPOUT)
        if random and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            out.append((f"{prefix}{field}", float(value)))
    return out


def is_hf(spec: str) -> bool:
    """True for a `--model` that names a Hugging Face directory (hf:DIR)."""
    return spec.startswith(PREFIX)


def sliding_share(window: Any, kinds: Any, use_sliding_window: Any = True, runs: tuple[int, ...] = ()) -> float:
    """The share of the blocks whose attention slides, from a config's `sliding_window`,
    `layer_types` and `use_sliding_window`: as `layer_types` says, else every one where a window
    is set and `use_sliding_window` is not off (Mistral's every layer; transformers' own
    reading); 0 without a window. The one reading for config.json's and a built model's config.
    With `runs`, a forward's runs of each block (GPTConfig.block_runs), the share of the runs:
    Dory's looped kind runs its full-attention block twice beside two sliding ones, half of them."""
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return 0.0
    if isinstance(kinds, list) and kinds:
        if len(runs) == len(kinds):
            return sum(n for n, kind in zip(runs, kinds) if kind == "sliding_attention") / sum(runs)
        return kinds.count("sliding_attention") / len(kinds)
    return 1.0 if use_sliding_window else 0.0


@dataclass(frozen=True)
class HFModelDir:
    """What a Hugging Face model directory holds (see the module docstring)."""

    path: Path
    config: dict[str, Any]
    weights: tuple[Path, ...]  # empty: train from a seeded random initialisation
    tokenizer: Path | None

    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    def size(self, what: str) -> int | None:
        """A size by its meaning ("layers", "hidden", "heads", "positions"), or None."""
        for key in SIZES[what]:
            if isinstance(self.config.get(key), int):
                return int(self.config[key])
        if what == "layers":  # Nemotron-H's config derives its count from its list of blocks' kinds
            kinds = next((self.config[key] for key in LAYER_KINDS if isinstance(self.config.get(key), list)), None)
            if kinds and all(isinstance(kind, str) for kind in kinds):
                return len(kinds)
        return None

    def shape(self) -> GPTConfig:
        """The model's shape in plait's terms, for estimates, reports and layout checks: a
        GPT-2 block for gpt2, a Llama block (RMSNorm, RoPE, SwiGLU) for any other decoder.
        Under SP its sequence is cut at its blocks alone (`whole_sequence_ends`): the model's
        own code around them needs the whole (models/hf/hooks.py: split_sequence_around). Its
        blocks keep what autograd keeps (`lean_blocks` false: fp32 norm copies, silu's output)."""
        c, spec = self.config, f"{PREFIX}{self.path}"
        sizes = {what: self.size(what) for what in SIZES}
        missing = [SIZES[what][0] for what, size in sizes.items() if size is None]
        if missing:
            raise PlaitError(f"--model {spec}: {CONFIG} names no {', '.join(missing)} (model_type "
                             f"{self.model_type!r}), so plait knows only its parameter count",
                             hint="train it with data parallelism or ZeRO; tensor and pipeline parallelism "
                                  "and the shape-based estimates need these sizes")
        hidden, heads = sizes["hidden"], sizes["heads"]
        try:
            if self.model_type == "gpt2":
                return GPTConfig(vocab_size=self.vocab_size, n_layers=sizes["layers"], d_model=hidden, n_heads=heads,
                                 n_kv_heads=heads, ffn_hidden=int(c.get("n_inner") or 4 * hidden),
                                 max_seq_len=sizes["positions"], tie_embeddings=bool(c.get("tie_word_embeddings", True)),
                                 arch="gpt2", whole_sequence_ends=True, lean_blocks=False)
            parameters = c.get("rope_parameters") or {}
            if not isinstance(parameters, dict):
                raise PlaitError(f"--model {spec}: {CONFIG}'s rope_parameters is a {type(parameters).__name__}, "
                                 f"not a table", hint='write it as transformers does, e.g. {"rope_theta": 10000.0}')
            rope = c.get("rope_theta") or parameters.get("rope_theta", 10000.0)
            return GPTConfig(vocab_size=self.vocab_size, n_layers=sizes["layers"], d_model=hidden, n_heads=heads,
                             n_kv_heads=int(c.get("num_key_value_heads") or heads),
                             ffn_hidden=self.mlp_width(hidden),
                             max_seq_len=sizes["positions"],
                             tie_embeddings=bool(c.get("tie_word_embeddings", False)), rope_theta=float(rope),
                             norm_eps=float(c.get("rms_norm_eps") or c.get("layer_norm_eps") or 1e-6),
                             whole_sequence_ends=True, lean_blocks=False, counts_routing=False, balancing_bias=False,
                             logit_softcap=bool(c.get("final_logit_softcapping")),
                             sliding_window=self.sliding_window(), **self.experts(hidden))
        except (TypeError, ValueError) as exc:
            raise PlaitError(f"--model {spec}: {CONFIG} has a size that is not a number ({exc})") from None

    def sliding_window(self) -> int:
        """The window (positions) the model's sliding layers attend within, 0 where none slides
        (`sliding_share`)."""
        c = self.config
        window = c.get("sliding_window")
        return window if sliding_share(window, c.get("layer_types"), c.get("use_sliding_window", True)) else 0

    def mlp_width(self, hidden: int) -> int:
        """The dense MLP's hidden units: Llama 4's intermediate_size_mlp, else intermediate_size
        (one per layer in Gemma 3n's config: taken where they are all one), OPT's and XGLM's
        ffn_dim, else 4·hidden."""
        c = self.config
        width = c.get("intermediate_size_mlp") or c.get("intermediate_size") or c.get("ffn_dim") or 4 * hidden
        if isinstance(width, list) and len(set(width)) == 1:
            width = width[0]
        return int(width)

    def experts(self, hidden: int) -> dict[str, Any]:
        """A mixture of experts' fields of GPTConfig, from the names transformers' MoE configs
        use (Mixtral's num_local_experts, Qwen2-MoE's num_experts, moe_intermediate_size,
        shared_expert_intermediate_size, decoder_sparse_step, Llama 4's interleave_moe_layer_step);
        {} for a dense model. Llama 4's dense blocks are intermediate_size_mlp wide (ffn_hidden),
        its experts intermediate_size."""
        ffn = self.config.get("ffn_config")  # DBRX nests its experts' fields
        c = {**(ffn if isinstance(ffn, dict) else {}), **self.config}
        experts = int(c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts")
                      or c.get("moe_num_experts") or 0)  # the last: Aria's, ERNIE-4.5-MoE's, DBRX's
        if not experts:
            return {}
        width = int(c.get("moe_intermediate_size") or c.get("intermediate_size") or c.get("ffn_hidden_size")
                    or 4 * hidden)
        shared = int(c.get("shared_expert_intermediate_size") or 0)
        top_k = (c.get("num_experts_per_tok") or c.get("moe_topk") or c.get("moe_k")  # HunYuan's, ERNIE's
                 or c.get("moe_top_k") or 2)  # DBRX's
        return dict(experts=experts, top_k=int(top_k[0] if isinstance(top_k, list) else top_k), expert_hidden=width,
                    shared_experts=max(1, round(shared / width)) if shared else 0,
                    moe_every=int(c.get("decoder_sparse_step") or c.get("interleave_moe_layer_step") or 1))

    def shape_or_none(self) -> GPTConfig | None:
        """`shape()`, or None for a config that does not name a decoder's sizes."""
        try:
            return self.shape()
        except PlaitError:
            return None


def read_hf_dir(spec: str) -> HFModelDir:
    """The directory `spec` ("hf:DIR") names, checked: one PlaitError naming what is wrong."""
    path = Path(spec.removeprefix(PREFIX)).expanduser()
    if not path.is_dir():
        raise PlaitError(f"--model {spec}: {path} is not a directory",
                         hint="give hf:DIR, a local directory holding config.json (nothing is downloaded)")
    config = _read_config(path, spec)
    if not isinstance(config.get("model_type"), str):
        raise PlaitError(f"--model {spec}: {path / CONFIG} names no model_type",
                         hint="write the config with save_pretrained: it records which transformers class to build")
    if not isinstance(config.get("vocab_size"), int) or config["vocab_size"] < 1:
        raise PlaitError(f"--model {spec}: {path / CONFIG} has no positive integer vocab_size")
    tokenizer = path / TOKENIZER
    return HFModelDir(path=path, config=config, weights=_weight_files(path, spec),
                      tokenizer=tokenizer if tokenizer.is_file() else None)


def _read_config(path: Path, spec: str) -> dict[str, Any]:
    file = path / CONFIG
    if not file.is_file():
        raise PlaitError(f"--model {spec}: {file} is missing",
                         hint="a Hugging Face model directory needs its config.json (write it with "
                              "config.save_pretrained(DIR), or copy it from the model's repository)")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise PlaitError(f"--model {spec}: {file} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise PlaitError(f"--model {spec}: {file} is not a JSON object")
    return config


def _weight_files(path: Path, spec: str) -> tuple[Path, ...]:
    """model.safetensors, or the shards its index names (each must be there), or none."""
    if (path / WEIGHTS).is_file():
        return (path / WEIGHTS,)
    index = path / WEIGHTS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise PlaitError(f"--model {spec}: {index} is not a safetensors index ({exc})") from None
        missing = [name for name in shards if not (path / name).is_file()]
        if missing:
            raise PlaitError(f"--model {spec}: {index} names shards that are not there: {', '.join(missing)}",
                             hint="copy every shard beside the index, or remove the index to start from random weights")
        return tuple(path / name for name in shards)
    if any(path.glob("*.safetensors")):
        raise PlaitError(f"--model {spec}: {path} holds *.safetensors shards without {WEIGHTS_INDEX}",
                         hint="copy the index beside the shards (it says which tensor is in which file)")
    return ()
