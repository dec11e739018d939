"""Bytes that autograd keeps between forward and backward, per layer and per stage.

Two blocks are counted:

* GPT-2's, as Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models") count it: s·b·h·(34 + 5·a·s/h) bytes per layer in 16-bit, because
  the eager attention of the time kept the a·s·s softmax, its dropout mask and output.
* Ours (plait/models/gpt/model.py). It calls SDPA, whose CPU and flash kernels keep only a
  log-sum-exp per (head, query) and recompute the attention matrix in backward, so no a·s²
  term appears; its norms and SwiGLU keep only their inputs (plait/models/gpt/lean.py) and
  grouped K/V heads stay grouped (SDPA's enable_gqa). Listing what each op saves
  (deduplicated by storage; the test in tests/test_estimate_memory.py checks it with
  saved_tensors_hooks), per token per layer:

    RMSNorm, twice  its input and the fp32 reciprocal rms (one value); its
                    output, kept by the projections it feeds               2·(2eh + 4) bytes
    attention       q after RoPE, k and v (kv_dim wide each), SDPA's
                    output, which o_proj reads as a view (RoPE writes
                    q and k seq-major, as the projections did, and SDPA
                    writes its output in its query's order)              2h + 2kv elements
                    SDPA's log-sum-exp, always fp32                      4·a bytes
    SwiGLU          gate and up outputs (down's input, their gated
                    product, made again in its backward: gated_down;
                    kept, 3f, where a compiled block or a stack's
                    kernels run: `remakes_product`)                      2f elements

  = e·(6h + 2kv + 2f) + 8 + 4a bytes per token, e = 4 in fp32 and 2 in bf16/fp16 (the model
  itself in that dtype, as the (2+2+12)Ψ mixed-precision accounting assumes).

  A transformers model (GPTConfig.lean_blocks false) keeps autograd's intermediates: each
  norm its fp32 input and normalised values (4(h + 1) + 2eh: in fp32 its input is its own
  copy), K and V as the model made them (its SDPA takes grouped heads: enable_gqa), the
  (b, s, h) copy of SDPA's output that o_proj reads (a view where a rank holds one head),
  silu's output (4f): e·(7h + 2kv + 4f) + 8(h + 1) + 4a. Where plait builds it, its SwiGLU
  MLPs make their product again as plait's block does (GPTConfig.remade_products: 2f). Its rotary tables, (1, s, head_dim)
  a forward whatever the batch where the positions are not given per row, are measured at
  one sequence, so counted per token: 2·(b − 1)·s·head_dim·e over a forward of b sequences.

Outside the blocks the forward keeps the int64 token ids (embedding) and the final norm's
4(h + 1) + 2eh bytes (a sequence shard of them under SP, unless the final norm reads the whole
sequence: `GPTConfig.whole_sequence_ends`), and where the model's forward caps its logits
(`GPTConfig.logit_softcap`: Gemma 2's, nanochat's) tanh's output, b·s·V/t in the compute
dtype. RoPE's multiplications keep views of the model's
cos and sin tables, buffers resident on every rank, which memory.py counts as such; under
context parallelism a forward gathers the rows of its rank's positions, kept as activations
(`rope_rows_bytes`); packed documents add every token's rows and their attention mask
(`document_mask_bytes`). That is everything plait's ActivationMeter sees, since it wraps the
model's forward only and counts neither its weights nor its buffers; the loss's fp32 logits
and log-softmax are counted by memory.py as a buffer on the last stage.

Under context parallelism every per-token figure counts this rank's tokens only (s/cp per
sequence); Ulysses runs the same SDPA on whole sequences of h/cp heads, so it saves the same
bytes per token (K/V repeated to the query heads where cp does not divide their heads);
ring attention keeps K/V unexpanded and its output in fp32 (e(h + 2·kv) + 4h in place of
the SDPA's q, k, v and output).

Tensor parallelism divides what lives inside the column/row-parallel region (attention
and MLP); the norms stay replicated unless sequence parallelism shards them too, in which
case (as in the paper) the linear layers keep only their sequence shard and everything is
divided by t. Full recompute keeps only each block's input.
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.interleave import held_frontier, warmup
from plait.estimate.experts import dense_width, expert_units_on_rank, saved_bytes_per_token
from plait.estimate.layout import Workload, StageShare, chunk_ends, chunk_layers, embedding_rows, vocab_shard
from plait.models.gpt.config import GPTConfig

MASK_BYTES = 1  # a dropout mask is one byte per element
LSE_BYTES = 4  # SDPA's log-sum-exp is fp32 whatever the input dtype
ID_BYTES = 8  # int64 token ids, kept by the embedding for its backward
NORM_BYTES = 4  # RMSNorm computes in fp32 whatever the model's dtype
RING_OUT_BYTES = 4  # ring attention keeps its output in fp32 (fp64 for fp64) for the backward


def korthikanti_layer_bytes(config: GPTConfig, layout: Workload) -> float:
    """One GPT-2 block's saved bytes per micro-batch, in the paper's accounting.

    Per token: replicated 4h elements (two LayerNorm inputs, the QKV and MLP inputs) plus
    two h-sized dropout masks; sharded Q, K, V, the projection's input, the fc output and
    GELU output (2h + 2kv + 2f elements); the attention a·s softmax and dropout output
    (elements) and its mask (bytes). With f = 4h, kv = h and e = 2 this is 34h + 5as.
    """
    h, f, kv, a = config.d_model, config.ffn_hidden, config.kv_dim, config.n_heads
    s, e = layout.seq_len, layout.compute_bytes
    replicated = e * 4 * h + MASK_BYTES * 2 * h
    sharded = e * (2 * h + 2 * kv + 2 * f)
    attention = (e * 2 + MASK_BYTES) * a * s
    if layout.recompute == "selective":
        attention = 0  # the paper's selective recompute redoes exactly the attention core
    return _combine(replicated, sharded + attention, layout, e * h)


def llama_layer_bytes(config: GPTConfig, layout: Workload) -> float:
    """One block of our model: saved bytes per micro-batch (see the module docstring),
    averaged over the blocks; an MoE block's MLP by the widths of a token's experts, whole on
    every tp rank or split as the plan splits them, plus what its routing keeps
    (estimate/experts.py). A transformers block keeps what was measured of it
    (`measured_correction`)."""
    whole, split = llama_token_bytes(config, layout)
    more_whole, more_split, mixers = (sum(terms) for terms in zip(measured_correction(config, layout),
                                                                  cpu_attention_bytes(config, layout)))
    whole, split = whole + more_whole, split + more_split
    # a model with no tp plan (Persimmon's) measured its attention among the modules the plan
    # leaves whole: what the formulas take off it (under cp, the copy of SDPA's output) comes off those
    mixers += min(0.0, whole) + min(0.0, split)
    # a token-mixing module the plan leaves whole runs on the whole sequence on every rank, SP or not
    mixed = max(0.0, mixers) * layout.tokens_per_micro_batch if layout.recompute != "full" else 0.0
    return (_combine(max(0.0, whole), max(0.0, split), layout, layout.compute_bytes * config.d_model) + mixed
            + eager_attention_bytes(config, layout) + sdpa_mask_copy_bytes(config, layout)
            + ulysses_order_bytes(layout) + constant_kept_bytes(config, layout, 0) + sliced_view_bytes(config, layout)
            + further_sequence_bytes(config, layout) + cpu_attention_batch_bytes(config, layout))


def further_sequence_bytes(config: GPTConfig, layout: Workload) -> float:
    """What a micro-batch of b >= 2 sequences keeps in a transformers block's run beyond b
    sequences' reading at one and beyond its tokens' (GPTConfig.further_sequence_bytes; a
    token's is `measured_correction`'s), f + b·c + (b - 1)·g·s² on this rank's share of each
    sequence (g: an s × s tensor kept once a micro-batch), the rest's and the mixers' whole on
    every tp rank, the split regions' 1/tp: a mamba's final state kept once a sequence, a
    micro-batch's decay blocks (MiniMax's: 1.43 of the meter at two sequences). None at one
    sequence, or under full recomputation (each block keeps its input alone)."""
    terms = batch_terms(config, layout)
    if terms is None or layout.recompute == "full":
        return 0.0
    return batch_beyond_bytes(terms, layout)


def batch_beyond_bytes(terms: tuple[float, ...], layout: Workload) -> float:
    """f + b·c + (b - 1)·g·s² over the three parts, of `terms` as the reading gives what a batch
    keeps beyond as many sequences (a, c, f, g of the rest, the split regions' and the mixers',
    `_beyond` in models/hf/load.py), on this rank's share of each sequence: the rest's and the
    mixers' whole on every tp rank, the split regions' 1/tp."""
    b, s = layout.micro_batch, layout.seq_len // layout.cp
    shares = (1.0, 1.0 / layout.tp, 1.0)  # the rest, the split regions', the mixers'
    return sum(share * (f + b * c + (b - 1) * g * s * s)
               for share, c, f, g in zip(shares, terms[3:6], terms[6:9], terms[9:12]))


def batch_terms(config: GPTConfig, layout: Workload) -> tuple[float, ...] | None:
    """GPTConfig.further_sequence_bytes in this layout's dtype, where its micro-batch holds two
    sequences or more; else None."""
    if layout.micro_batch < 2 or not config.further_sequence_bytes:
        return None
    return config.further_sequence_bytes[0 if layout.compute_bytes == 4 else 1]


def sliced_view_bytes(config: GPTConfig, layout: Workload) -> float:
    """What a transformers block's row layers keep of their slice of a whole input under tp,
    per micro-batch (GPTConfig.sliced_view_bytes): at one process they view what SDPA keeps
    (OLMo2's o_proj of its whole attention's output), under tp each takes a slice of its own, the
    whole's 1/tp (its 16 values a token a block were missing under tp 2: 0.97 of the meter). None
    at tp 1 or under full recomputation."""
    measured = measured_in(config.sliced_view_bytes, layout)
    if layout.tp == 1 or layout.recompute == "full" or not measured:
        return 0.0
    return measured / layout.tp * layout.tokens_per_micro_batch


def constant_kept_bytes(config: GPTConfig, layout: Workload, where: int) -> float:
    """What a transformers model keeps a forward that no token makes (GPTConfig.constant_bytes):
    `where` 0 a block's run (vectors it derives from its weights: Gemma's norms' 1 + weight;
    recomputed, not kept, under full recomputation), 1 the first stage's, 2 the last's."""
    if len(config.constant_bytes) <= where or (where == 0 and layout.recompute == "full"):
        return 0.0
    return max(0.0, measured_in(config.constant_bytes[where], layout) or 0.0)


def ulysses_keeps_its_own(layout: Workload) -> bool:
    """Whether Ulysses' attention runs here and keeps what it makes for backward (its traded q,
    k, V and output, its orderings, its window mask): cp > 1 of that kind, nothing recomputed."""
    return layout.cp > 1 and layout.cp_kind == "ulysses" and layout.recompute == "none"


def ulysses_order_bytes(layout: Workload) -> float:
    """Ulysses' two reorderings of the whole sequence in each block (ranks' order to positions'
    and back, plait.parallel.context.ulysses): the int64 indices its index_selects keep, made
    afresh by each block's attention. Recomputed with the core under recomputation."""
    if not ulysses_keeps_its_own(layout):
        return 0.0
    return 2.0 * ID_BYTES * layout.seq_len


def measured_correction(config: GPTConfig, layout: Workload) -> tuple[float, float, float]:
    """What a transformers block keeps a token beyond the formulas, (whole on every tp rank,
    inside the split regions, inside the token-mixing modules the plan leaves whole): its
    measured bytes (GPTConfig.block_saved_bytes, one process, no recompute) less the formulas'
    at that layout (which have no third kind), added to theirs at any layout, so that tp, SP,
    cp and recompute act on it as they do on the formulas' own. Where this dtype's forward did
    not run on meta, the other dtype's difference (the formulas carry the dtypes' own). (0, 0,
    0) for a model the formulas count (plait's GPT). A micro-batch of two sequences or more adds
    what a token of it keeps beyond one sequence's (`batch_terms`)."""
    if not config.block_saved_bytes:
        return (0.0, 0.0, 0.0)
    order = [0, 1] if layout.compute_bytes == 4 else [1, 0]
    index = next((i for i in order if min(config.block_saved_bytes[i]) >= 0), None)
    if index is None:
        return (0.0, 0.0, 0.0)
    # the reading's own conditions: eager, where a transformers SwiGLU MLP plait builds makes its
    # product again (2f); compiled, Inductor keeps what it chooses, priced by the formulas at the layout
    base = Workload(precision="fp32" if index == 0 else "bf16")
    whole, split = llama_token_bytes(config, base)
    # the K/V repeated for SDPA under a mask are priced apart, as each layout's sequence makes
    # them or not (`kv_repeat_values`): taken off the measured bytes and the formulas' alike
    split -= base.compute_bytes * kv_repeat_values(config, base)
    repeated = max(0.0, config.kv_repeat_bytes[index]) if config.kv_repeat_bytes else 0.0
    # what SDPA's inputs alone keep beyond their own values (a fused projection's output through
    # its V; less a V viewing what the block keeps anyway): Ulysses hands its attention its own
    beyond = config.qkv_view_bytes[index] if ulysses_keeps_its_own(layout) and config.qkv_view_bytes else 0.0
    measured_whole, measured_split, mixers = config.block_saved_bytes[index]
    # what a token of a batch of two sequences or more keeps beyond one sequence's (a reshape
    # that copies from two sequences up: Jamba's; or keeps less: GPT-NeoX-Japanese's, 1.10)
    batch = batch_terms(config, layout) or (0.0, 0.0, 0.0)
    return (measured_whole - whole + batch[0], measured_split - split - repeated - beyond + batch[1],
            mixers + batch[2] + mixer_chunk_bytes(config, layout, index) / (layout.seq_len // layout.cp))


def cpu_attention_bytes(config: GPTConfig, layout: Workload) -> tuple[float, float, float]:
    """What a transformers block keeps a token on a CPU beyond on a GPU, (whole on every tp rank,
    inside the split regions, inside the mixers left whole), where the CPU runs a call of SDPA
    in its math form and a GPU its fused kernel (GPTConfig.cpu_sdpa_bytes, signed: Doge's mask
    that needs its gradient, 144 B a token a block less, its output and log-sum-exp not kept;
    a latent attention's V narrower than K, the s × s softmax kept: `cpu_sdpa_terms`). None on
    a GPU, under recomputation (the core is run again, or the block whole) or under ring
    attention (its own kernels in place of the model's SDPA)."""
    terms = cpu_sdpa_terms(config, layout)
    if not terms:
        return (0.0, 0.0, 0.0)
    # a token's from two sequences up, of the model's own tensors (Ulysses hands SDPA its own)
    beyond = terms[6:9] if layout.micro_batch >= 2 and layout.cp == 1 else (0.0, 0.0, 0.0)
    return tuple(a + q * layout.seq_len + more for a, q, more in zip(terms[:3], terms[3:6], beyond))


def cpu_attention_batch_bytes(config: GPTConfig, layout: Workload) -> float:
    """What a micro-batch of b >= 2 sequences keeps on a CPU beyond b sequences' own of
    `cpu_attention_bytes`, f + b·c + (b - 1)·g·s², the split regions' 1/tp (in fp32 the math
    form views one sequence's V in a fused projection's output, keeping it whole, and copies a
    batch's: DeepSeek-V3's 1.035 of the meter at two sequences without it)."""
    terms = cpu_sdpa_terms(config, layout)
    if not terms or layout.micro_batch < 2 or layout.cp > 1:  # Ulysses hands SDPA tensors of its own
        return 0.0
    return batch_beyond_bytes(terms[6:], layout)


def cpu_sdpa_terms(config: GPTConfig, layout: Workload) -> tuple[float, ...]:
    """GPTConfig.cpu_sdpa_bytes in this layout's dtype where they apply (a CPU's run of SDPA on
    the model's heads, nothing recomputed: the model's own attention, or Ulysses', which hands
    SDPA a cp-th of the heads over the whole sequence: a token's bytes a cp-th of the heads'
    at s, as many tokens again), else (). The ring runs its own kernels."""
    ring = layout.cp > 1 and layout.cp_kind == "ring"
    if layout.device != "cpu" or layout.recompute != "none" or ring or not config.cpu_sdpa_bytes:
        return ()
    return config.cpu_sdpa_bytes[0 if layout.compute_bytes == 4 else 1]


def mixer_chunk_bytes(config: GPTConfig, layout: Workload, index: int) -> float:
    """A sequence's bytes a block beyond a token's within a chunk, where the token-mixing modules
    pad the sequence to a chunk (GPTConfig.mixer_chunk, measured in dtype `index`): the first
    chunk's, the second's and each further chunk's begun, whatever the tokens in the last."""
    if not config.mixer_chunk or min(config.mixer_chunk_bytes[index]) < 0:
        return 0.0
    first, second, further = config.mixer_chunk_bytes[index]
    chunks = -(-(layout.seq_len // layout.cp) // config.mixer_chunk)
    return first + second * (chunks > 1) + further * max(0, chunks - 2)


def llama_token_bytes(config: GPTConfig, layout: Workload) -> tuple[float, float]:
    """The formulas' bytes a block keeps per token, (whole on every tp rank, split by tp), before
    tp, SP and full recompute divide them (`_combine`), eager attention's matrices apart."""
    h, a, lean = config.d_model, config.n_heads, config.lean_blocks
    f = dense_width(config)
    e = layout.compute_bytes
    # q's and the output's widths: h but for a transformers attention whose heads are handed
    # otherwise (GPTConfig.head_widths: a latent attention's q wider, its output narrower)
    q, _, _, out = config.attention_widths
    o_proj_copy = o_proj_copy_values(config, layout)
    # SwiGLU keeps gate and up in plait's lean block, which makes their product again for
    # down's backward (2f; compiled, or priced as a stack's kernels, the product too: 3f);
    # outside it their product and silu's output too (4f); a two-matrix MLP (GELU, relu²)
    # keeps up's output and the activation's, which feeds down (2f: relu² squares relu's
    # output in place of a copy). A transformers model's MLPs that plait gives the same
    # remaking (models/hf/gated.py) keep gate and up alone too; its grouped experts do not.
    swiglu = 2 if remakes_product(config, layout) else 3 if lean else 4
    mlp = 2 if config.mlp_matrices == 2 else swiglu
    experts = swiglu if lean else 4
    whole_experts, split_experts = (e * experts * units for units in expert_units_on_rank(config, layout))
    replicated = 2 * rmsnorm_bytes(h, e, lean) + saved_bytes_per_token(config, layout) + whole_experts
    # q, k, v, out: K/V as the model made them, grouped heads unrepeated (plait's block, and a
    # transformers block, whose SDPA takes them grouped: enable_gqa)
    attention = q + out + kv_kept(config, layout) + kv_repeat_values(config, layout)
    sharded = e * (attention + o_proj_copy + mlp * f) + LSE_BYTES * a + split_experts
    if layout.cp > 1 and layout.cp_kind == "ring":
        # Ring attention keeps K and V as the model made them (kv_dim wide: GQA saves here)
        # and its output in fp32 for the backward's merge: q, k, v, out = e(h + 2kv) + 4h. o_proj
        # keeps its input, that output in the model's dtype: in fp32 a view of it (the ring
        # writes it seq-major), in 16-bit its cast, e·h more (a transformers block's too).
        k, v = config.attention_widths[1:3]
        o_proj_input = e * out * config.attention_out_kept if e != RING_OUT_BYTES else 0
        sharded += e * (q + k + v) + RING_OUT_BYTES * out + o_proj_input - e * attention
        if layout.recompute == "selective":
            # the core recomputed keeps neither its fp32 output nor its log-sum-exp; o_proj
            # still keeps its input, the core's output in the model's dtype
            kept = e * out if lean else 0
            return replicated, sharded - RING_OUT_BYTES * out - LSE_BYTES * a + kept - o_proj_input
    if ulysses_keeps_its_own(layout):
        # o_proj keeps its input: SDPA's output traded back to sequence shards, a copy of it
        # (SDPA keeps its own, on the head shards), in a transformers block as in plait's, where
        # an op after the attention keeps its output (GPTConfig.attention_out_kept)
        sharded += e * out * config.attention_out_kept
    if layout.recompute == "selective":
        # Recomputing the attention core drops SDPA's output and log-sum-exp; q, k, v stay
        # as the recomputation's inputs, K/V as the model made them (repeated ones, outside the
        # lean block, are the core's own). SDPA already recomputes the a·s² matrix, so this
        # buys little for our block: prefer "full".
        sharded -= e * o_proj_copy + LSE_BYTES * a
    # a region the model's plan leaves whole (GPTConfig.tp_attention, tp_mlp) keeps it all on every rank
    whole = ((e * (attention + o_proj_copy) + LSE_BYTES * a) * (not config.tp_attention)
             + e * mlp * f * (not config.tp_mlp))
    return replicated + whole, sharded - whole


def remakes_product(config: GPTConfig, layout: Workload) -> bool:
    """Whether a block's down projection gets its input, SwiGLU's gated product, made again in
    backward rather than kept: plait's lean block run eagerly by plait's own element-wise ops
    (models/gpt/lean.gated_down), or a transformers model's MLPs given it (models/hf/gated.py:
    GPTConfig.remade_products). Not a two-matrix MLP, a compiled one
    (Inductor keeps the product: 1.21 of the meter where the estimate took it as made again),
    a stack's kernels (Megatron's keep it), or a block under full recomputation (torch's
    checkpoint keeps its input alone, and its rerun keeps the product until backward is done
    with it). The memory's rule and the time's (ops.py)."""
    return (config.lean_blocks or config.remade_products) and config.dense_mlp_matrices == 3 and products_remade_at(layout)


def products_remade_at(layout: Workload) -> bool:
    """Whether this layout runs a gated product made again as its forward is written: not
    compiled, not under full recomputation, not a stack's kernels (`remakes_product`)."""
    return not layout.compiled and layout.recompute != "full" and layout.software.elementwise != "megatron"


def measured_in(pair: tuple[float, ...], layout: Workload) -> float | None:
    """The value for this layout's dtype of a (fp32, 16-bit) pair the shape reader measured
    (GPTConfig.final_saved_bytes and its kind), None where the pair is empty or that dtype's
    forward did not run (-1)."""
    if not pair:
        return None
    value = pair[0 if layout.compute_bytes == 4 else 1]
    return value if value >= 0 else None


def o_proj_copy_values(config: GPTConfig, layout: Workload) -> float:
    """Values a token o_proj's input holds beyond SDPA's output, on one tp rank times tp: none in
    plait's block, whose rotary output, and so SDPA's, stays sequence-major (models/gpt/rope.py)
    and o_proj reads a view; none under context parallelism, whose attention hands its output back
    sequence-major; none with one head a rank; else a transformers block's copy as measured
    (GPTConfig.attention_out_copy_bytes: GPT-NeoX's, none of Llama's), or the whole output where
    it was not."""
    out = config.attention_widths[3]
    if config.lean_blocks or layout.cp > 1 or config.n_heads // layout.tp <= 1:
        return 0.0
    measured = measured_in(config.attention_out_copy_bytes, layout)
    return float(out) if measured is None else measured / layout.compute_bytes


def kv_repeat_values(config: GPTConfig, layout: Workload) -> float:
    """Values a token of K/V heads a transformers attention repeats up to q's for SDPA, beyond
    the grouped ones, a mean over the blocks: transformers hands SDPA grouped heads only without
    a mask, so each sliding layer repeats them where the sequence reaches its window
    (GPTConfig.sliding_mask_layers, their share: what was measured where the reading reached the
    window, whose layers' heads may be narrower than the mean width, Gemma 4's unified kind read
    1.008 of its keep by the mean; else by the mean widths); elsewhere what was measured
    (GPTConfig.kv_repeat_bytes). None under context parallelism, whose attention keeps them
    grouped, or under selective recomputation, which recomputes the core that repeats them. None
    where a tp rank holds one of the model's several K/V heads (`one_kv_head_a_rank`)."""
    if (config.lean_blocks or layout.cp > 1 or layout.recompute == "selective"
            or one_kv_head_a_rank(config, layout)):
        return 0.0
    measured = measured_in(config.kv_repeat_bytes, layout)
    if config.sliding_mask_layers:
        if not sliding_mask_made(config, layout):
            return 0.0  # no mask: SDPA takes the heads grouped
        if measured:  # read where the reading's sequence reached the window: the sliding layers' own
            return measured / layout.compute_bytes  # widths (Gemma 4's are half its global ones')
        _, k, v, _ = config.attention_widths
        repeated = (config.n_heads - config.n_kv_heads) / config.n_kv_heads  # copies of each K/V head
        return config.sliding_mask_layers * repeated * (k + v)
    return 0.0 if measured is None else measured / layout.compute_bytes


def one_kv_head_a_rank(config: GPTConfig, layout: Workload) -> bool:
    """Whether tp leaves each rank's attention one of the model's several K/V heads, which
    transformers' repeat_kv (an expand and a reshape) views where it copies several: Mistral's
    two heads over tp 2 had been priced as a copy, 1.04 of the meter. Not where the plan gathers
    the attention's columns whole (OLMo3's q and k normed over every head, GPTConfig.qk_norm
    "full"; Phi-3's fused projection, GPTConfig.tp_gathered): each rank runs every head and
    copies them."""
    return (config.n_kv_heads > 1 and max(1, config.n_kv_heads // layout.tp) == 1 and config.tp_attention
            and not config.tp_gathered[0] and config.qk_norm != "full")


def sdpa_mask_copy_bytes(config: GPTConfig, layout: Workload) -> float:
    """What a transformers block keeps per micro-batch of its sliding window's mask: where the
    sequence reaches the window, transformers hands SDPA a boolean (b, 1, s, s) mask, and SDPA
    keeps its own additive copy in the compute dtype for backward, at every sliding layer
    (GPTConfig.sliding_mask_layers, their share: Mistral's every layer, Gemma 3's five in six),
    whole on every tp rank. None where the window holds the sequence (no mask is made), under
    recomputation of the attention, or under context parallelism (its own attention, its own
    mask: `window_mask_bytes`)."""
    if (not config.sliding_mask_layers or layout.cp > 1 or layout.recompute != "none"
            or not sliding_mask_made(config, layout)):
        return 0.0
    return config.sliding_mask_layers * layout.micro_batch * layout.seq_len ** 2 * layout.compute_bytes


def sliding_mask_made(config: GPTConfig, layout: Workload) -> bool:
    """Whether transformers makes a sliding layer's mask at this layout's sequence: where the
    sequence reaches the window (shorter, and its SDPA runs causal, grouped, unmasked)."""
    return 0 < config.sliding_window <= layout.seq_len


def eager_attention_bytes(config: GPTConfig, layout: Workload) -> float:
    """What an eager attention keeps per block and micro-batch beyond SDPA's: its s × s
    matrices (the fp32 softmax, its cast, a soft-cap's tanh: GPTConfig.attention_matrix_bytes,
    measured), b·s² of them, over the tp ranks its heads split over. Recomputed under full and
    selective recomputation; context parallelism runs its own attention in place of the model's."""
    fp32, low = config.attention_matrix_bytes
    if layout.recompute != "none" or layout.cp > 1 or not (fp32 or low):
        return 0.0
    heads = config.attention_tp(layout.tp)
    return layout.micro_batch * layout.seq_len ** 2 * (fp32 if layout.compute_bytes == 4 else low) / heads


def kv_kept(config: GPTConfig, layout: Workload) -> int:
    """K's and V's elements per token SDPA keeps: 2·kv_dim (a latent attention's as handed:
    GPTConfig.attention_widths), or every head's where Ulysses repeats them because cp does not
    divide a tp rank's K/V heads."""
    _, k, v, _ = config.attention_widths
    if layout.cp > 1 and layout.cp_kind == "ulysses" and (config.n_kv_heads // layout.tp) % layout.cp:
        return (k + v) * config.n_heads // config.n_kv_heads
    return k + v


def rmsnorm_bytes(h: int, e: int, lean: bool = True) -> float:
    """One RMSNorm's saved bytes per token, its output (kept by the projections it feeds)
    included: plait's lean norm keeps its input and the fp32 reciprocal rms; autograd's keeps
    the fp32 input and rsqrt, and x·rsqrt in e bytes."""
    return 2 * e * h + NORM_BYTES if lean else NORM_BYTES * (h + 1) + 2 * e * h


def _combine(replicated: float, sharded: float, layout: Workload, block_input: float) -> float:
    """Per-token bytes -> per-micro-batch bytes, applying tp, sp and full recompute."""
    t, tokens = layout.tp, layout.tokens_per_micro_batch
    if layout.recompute == "full":
        per_token = block_input / t if layout.sp else block_input
    elif layout.sp:
        per_token = (replicated + sharded) / t
        if layout.compiled:
            # a compiled block keeps the attention's and the MLP's gathered inputs whole for its
            # backward (Inductor's choice), where eager keeps its shard and gathers it again
            per_token += 2 * block_input * (1 - 1 / t)
    else:
        per_token = replicated + sharded / t
    return per_token * tokens


def layer_bytes(config: GPTConfig, layout: Workload) -> float:
    """Saved bytes of one block for one micro-batch on one rank."""
    if config.arch == "gpt2" and not config.block_saved_bytes:
        return korthikanti_layer_bytes(config, layout)
    return llama_layer_bytes(config, layout)


def stage_extra_bytes(config: GPTConfig, layout: Workload, stage: StageShare) -> float:
    """Saved outside the blocks, per micro-batch: token ids on the first stage, and where tp
    splits the embedding by vocabulary the boolean mask of the tokens other ranks own, which
    zeroes their rows (plait.parallel.tensor.layers.sum_owned_rows), and what a transformers
    model keeps outside its blocks before the last (GPTConfig.outside_saved_bytes: a norm of the
    embedding's output, counted with it); the final norm on the last, and the logits its head
    keeps (head_kept_bytes). Split by t only under SP, and only where SP cuts the sequence
    there: not with `whole_sequence_ends`, whose ends read the whole sequence."""
    tokens, t = layout.tokens_per_micro_batch, layout.tp
    sequence_cut = t if layout.sp and not config.whole_sequence_ends else 1  # what SP cuts the ends' tokens by
    total = 0.0
    if stage.first:
        total += ID_BYTES * tokens
        if t > 1 and embedding_rows(config, t) < config.vocab_size:
            total += MASK_BYTES * tokens
        outside = max(0.0, measured_in(config.outside_saved_bytes, layout) or 0.0)
        total += tokens * (outside / sequence_cut) + constant_kept_bytes(config, layout, 1)
    if stage.last:
        total += tokens * (final_norm_bytes(config, layout) / sequence_cut)
        total += tokens * head_kept_bytes(config, layout) + constant_kept_bytes(config, layout, 2)
    return total


def head_kept_bytes(config: GPTConfig, layout: Workload) -> float:
    """The logits the model's head keeps for its backward, a token on this rank: of this rank's
    vocabulary shard, as measured (GPTConfig.head_saved_bytes: Dory's learned scale keeps them
    in fp32), else a soft cap's tanh output in the compute dtype; none for a plain head."""
    share = vocab_shard(config, layout.tp)
    measured = measured_in(config.head_saved_bytes, layout)
    if measured is not None:
        return measured * share / config.vocab_size
    return share * layout.compute_bytes if config.logit_softcap else 0.0


def final_norm_bytes(config: GPTConfig, layout: Workload) -> float:
    """What the final norm keeps a token, its output (which the head keeps) included: measured
    for a transformers model (GPTConfig.final_saved_bytes: a LayerNorm's 2·e·h + 8, where the
    RMSNorm formula gave 4 bytes more a value in fp32), else an RMSNorm's, or GPT-2's input and
    output."""
    measured = measured_in(config.final_saved_bytes, layout)
    if measured is not None:
        return measured
    h, e = config.d_model, layout.compute_bytes
    return e * (2 * h) if config.arch == "gpt2" else rmsnorm_bytes(h, e, config.lean_blocks)


def rope_table_bytes(config: GPTConfig, layout: Workload) -> float:
    """cos and sin, (max_seq_len, head_dim/2) each, once per rank. plait's GPT holds them as
    buffers, resident whatever runs: its blocks save views of them, which hold no bytes of
    their own, so `memory.stage_buffers` counts them, not the activations. A transformers
    model makes its rotary tables each forward, which its measured block bytes hold, and
    keeps only their frequencies, a buffer of head_dim/2 values."""
    if config.arch == "gpt2":
        return 0.0
    return float(config.max_seq_len * config.head_dim * layout.compute_bytes)


def rope_rows_bytes(config: GPTConfig, layout: Workload) -> float:
    """What one forward of a chunk of plait's GPT keeps of its rotary tables beyond the
    resident ones: nothing while its positions are 0..s-1 (rows sliced as views); under
    context parallelism the rows of this rank's positions, gathered afresh (s/cp × head_dim
    elements, cos and sin), which its blocks keep until the backward; for packed documents,
    whose positions restart at each, the rows of every token (b·s/cp × head_dim)."""
    if config.arch == "gpt2" or not config.lean_blocks or (layout.cp == 1 and not layout.doc_mask):
        return 0.0
    rows = layout.micro_batch if layout.doc_mask else 1
    return float(rows * (layout.seq_len // layout.cp) * config.head_dim * layout.compute_bytes)


def document_mask_bytes(config: GPTConfig, layout: Workload) -> float:
    """What one forward of a chunk of plait's GPT keeps to hold attention inside packed
    documents (plait.parallel.packed.document_attention), shared by its blocks. On a CPU
    (`doc_mask` "dense"), SDPA's additive (b, 1, s, s) mask in the compute dtype, made once a
    forward and kept for backward (whole sequences: Ulysses attends them whole). Under
    recomputation attention keeps no mask (each layer makes one and drops it), and its
    checkpoints keep the documents' int64 numbers instead, whole rows under cp. On a GPU
    ("blocks"), FlexAttention's block tables (eight int32 tables of b·n² or b·n entries,
    n = s/128: about 64 KiB a sequence at 8k tokens) are left out. Ring attention keeps no
    mask: its backward makes each block's again from the documents (plait.parallel.context.ring)."""
    if not layout.doc_mask or config.arch == "gpt2" or not config.lean_blocks:
        return 0.0
    if layout.recompute != "none":
        return float(ID_BYTES * layout.micro_batch * layout.seq_len)
    if layout.doc_mask == "dense" and not (layout.cp > 1 and layout.cp_kind == "ring"):
        return float(layout.micro_batch * layout.seq_len ** 2 * layout.compute_bytes)
    return 0.0


def window_mask_bytes(config: GPTConfig, layout: Workload) -> float:
    """Ulysses' sliding-window mask (plait.parallel.context.ulysses.window_mask): SDPA's additive
    (1, 1, s, s) mask in the compute dtype, (b, 1, s, s) inside packed documents, kept for
    backward. None under recomputation (each layer makes its own and drops it), under the ring
    (its backward makes each block's again) or where the window holds the whole sequence."""
    if not ulysses_keeps_its_own(layout) or not 0 < config.sliding_window < layout.seq_len:
        return 0.0
    return float((layout.micro_batch if layout.doc_mask else 1) * layout.seq_len ** 2 * layout.compute_bytes)


def shared_window_mask_bytes(config: GPTConfig, layout: Workload) -> float:
    """A rank's one window mask without packed documents: its forwards share it while any keeps
    it (every micro-batch's, every chunk's), so it is counted once a rank, not once a forward in
    flight. Inside packed documents each micro-batch has its own (`forward_kept_bytes`)."""
    return 0.0 if layout.doc_mask else window_mask_bytes(config, layout)


def position_table_kept_bytes(config: GPTConfig, layout: Workload) -> float:
    """The rotary tables a transformers model makes each forward, as its blocks keep them
    (GPTConfig.position_table_bytes, a position's, measured): one sequence's rows of this rank's
    positions, shared by the micro-batch's sequences, or every sequence's for packed documents,
    whose positions restart in each; none under full recomputation, whose blocks keep only
    their inputs. Counted once a forward: per token, a batch of b kept (b - 1)·s rows too many."""
    if not config.position_table_bytes or layout.recompute == "full":
        return 0.0
    fp32, low = config.position_table_bytes
    e = layout.compute_bytes
    per_position = measured_in(config.position_table_bytes, layout)
    if per_position is None:  # the other dtype's, in this one's bytes
        per_position = max(fp32 * e / 4, low * e / 2)
    rows = layout.micro_batch if layout.doc_mask else 1
    return float(max(0.0, per_position) * rows * (layout.seq_len // layout.cp))


def forward_kept_bytes(config: GPTConfig, layout: Workload) -> float:
    """What each forward of a chunk holding blocks keeps beside its blocks' own bytes: its rope
    rows (a transformers model's rotary tables) and its packed documents' mask (under Ulysses,
    with a sliding window's), made once and read by every block."""
    documents_window = window_mask_bytes(config, layout) if layout.doc_mask else 0.0
    return (rope_rows_bytes(config, layout) + position_table_kept_bytes(config, layout)
            + document_mask_bytes(config, layout) + documents_window)


def loss_bytes(config: GPTConfig, layout: Workload) -> float:
    """Peak of the loss on the last stage, per micro-batch: the logits in the compute
    dtype, their fp32 copy and the fp32 log-softmax cross_entropy keeps for backward,
    over this rank's vocab shard (the whole vocabulary where the head stays whole or sums whole
    logits, `vocab_split` false); the logits alone under a stack's fused loss (Stack.loss:
    llm-foundry's, whose 72 published runs the fp32 copies put over their GPUs)."""
    shard = -(-config.vocab_size // layout.tp) if config.vocab_split else config.vocab_size
    kept = layout.compute_bytes + (0 if layout.software.loss == "fused" else 4 + 4)
    return float(layout.tokens_per_micro_batch * shard * kept)


def in_flight(layout: Workload, stage: StageShare) -> float:
    """Micro-batches whose activations a stage holds at its peak.

    GPipe runs every forward before any backward: m. 1F1B lets stage r run p - r forwards
    before its first backward, so the first stage holds p (Narayanan et al. 2021). ZB-H1
    runs 1F1B's forwards, but a micro-batch's graph stays alive until its deferred weight
    gradient (W) has run, so every rank holds min(p, m) at its peak (plait's executor
    measures exactly that). The
    interleaved schedule holds its warm-up forwards and one more on rank r: 2(p - r - 1) +
    (v - 1)N + 1 chunk-forwards for rounds of N (plait.interleave), each 1/v of the rank's
    layers; with N = p, p divides m, that is p(1 + (p - 1)/(p·v)) on the first rank
    (Korthikanti's factor). Never more than the micro-batches there are.
    """
    p, r, m, v = layout.pp, stage.index, layout.grad_accum, layout.virtual_stages
    if p == 1:
        return 1.0  # accumulation runs micro-batches one after another
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "1f1b":
        return float(min(p - r, m))
    if layout.schedule == "zb-h1":
        return float(min(p, m))
    chunks = min(warmup(p, m, v, r) + 1, m * v)
    return chunks / v


def stage_block_bytes(config: GPTConfig, layout: Workload, stage: StageShare) -> float:
    """What `stage`'s blocks keep for one micro-batch: each run's, kept for its backward, as
    its own blocks keep (`kept_runs`)."""
    return kept_runs(config, layout, stage.blocks, stage.runs) * layer_bytes(config, layout)


def kept_runs(config: GPTConfig, layout: Workload, blocks: Sequence[int], runs: float) -> float:
    """`runs`, the block runs of a stage (or a chunk) holding `blocks`, each counted as what its
    block keeps against the mean run's (GPTConfig.block_keeps) at this layout's micro-batch and
    sequence: a hybrid's stages differ (Jamba's mamba block keeps 2.9 times its attention one at
    16 tokens), and DeepSeek's dense first block keeps 0.75 of an MoE one's, so the stage of MoE
    blocks was priced 0.85-0.89 of its keep from the mean. `runs` itself where the blocks keep
    alike, were not read, or under full recomputation (each keeps its input). The weights are
    the one process's: tp and SP divide every block's alike here."""
    if not config.block_keeps or not blocks or len(blocks) == config.n_layers or layout.recompute == "full":
        return runs  # alike, unread, every block (the mean's own sum), or each keeping its input
    each = [block_keep(terms, config, layout) for terms in config.block_keeps]
    total = sum(each)
    if total <= 0:
        return runs
    return sum(each[i] for i in blocks) * (sum(config.block_runs) or config.n_layers) / total


def block_keep(terms: tuple[float, ...], config: GPTConfig, layout: Workload) -> float:
    """One block's keep over its runs by its terms (GPTConfig.block_keeps), a micro-batch of this
    layout on one rank's share of the sequence (a batch of two or more with what it keeps beyond
    as many sequences alone), never below nothing."""
    c, a, q, first, second, further, batch_a, batch_c, batch_f, batch_g = terms
    b, s = layout.micro_batch, layout.seq_len // layout.cp
    chunks = -(-s // config.mixer_chunk) if config.mixer_chunk else 0
    per_sequence = a * s + q * s * s + first * (chunks > 0) + second * (chunks > 1) + further * max(0, chunks - 2)
    beyond = batch_f + b * (batch_c + batch_a * s) + (b - 1) * batch_g * s * s if b > 1 else 0.0
    return max(0.0, c + b * per_sequence + beyond)


def stage_activation_bytes(config: GPTConfig, layout: Workload, stage: StageShare) -> float:
    """Peak activation bytes on one rank of `stage`."""
    if layout.schedule == "interleaved":
        return interleaved_peak(config, layout, stage)
    per_micro_batch = stage_block_bytes(config, layout, stage)
    per_micro_batch += stage_extra_bytes(config, layout, stage)
    per_micro_batch += forward_kept_bytes(config, layout)  # one chunk a rank: interleaving is walked above
    return in_flight(layout, stage) * per_micro_batch + shared_window_mask_bytes(config, layout)


def interleaved_peak(config: GPTConfig, layout: Workload, stage: StageShare) -> float:
    """The peak over the rank's own interleaved order (plait.interleave, the order the
    runner's schedule follows): each chunk-forward adds that chunk's blocks (and the first or
    last stage's extras, on the chunk that holds that end), each backward frees them, so
    which chunks are in flight at once is the schedule's answer (read off the states that can
    set it: plait.interleave.held_frontier). Equal chunks too: `in_flight`'s count spreads
    the ends' extras over every chunk, where only the end chunk keeps them."""
    chunk_bytes = chunk_forward_bytes(config, layout, stage)
    frontier = held_frontier(layout.pp, layout.grad_accum, layout.virtual_stages, stage.index)
    held_most = max([0.0] + [sum(n * b for n, b in zip(held, chunk_bytes)) for held, _ in frontier])
    return held_most + shared_window_mask_bytes(config, layout)


def chunk_forward_bytes(config: GPTConfig, layout: Workload, stage: StageShare) -> list[float]:
    """What one forward of each of `stage`'s chunks saves until its backward: its blocks (each
    block's runs: a looped model's run some more than once), and the first or last stage's
    extras on the chunk that holds that end."""
    rows = forward_kept_bytes(config, layout)  # each chunk's forward makes its own, kept by its blocks
    per_run = layer_bytes(config, layout)
    extras = stage_extra_bytes(config, layout, stage)
    counts = chunk_layers(layout, stage)
    starts = [sum(counts[:chunk]) for chunk in range(len(counts))]
    out = []
    for chunk, (blocks, start) in enumerate(zip(counts, starts)):
        held = stage.blocks[start:start + blocks]
        runs = blocks * (stage.runs / stage.layers if stage.layers else 1.0)  # a looped model's spread evenly
        out.append(kept_runs(config, layout, held, runs) * per_run
                   + (extras if any(chunk_ends(layout, stage, chunk)) else 0.0) + (rows if blocks else 0.0))
    return out
