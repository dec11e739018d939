"""Model shapes, kept free of torch so that `estimate/` can use them as pure arithmetic.

A preset is a name for a `GPTConfig`. `tiny` and `small` are trained by the tests and the
demo; the larger ones exist so that `plait estimate` and `plait plan` can talk about the
models people actually train, without ever allocating them.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, fields, replace

from plait.errors import PlaitError
from plait.rules import check_divides, check_sequence_split


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a decoder-only transformer.

    `arch="llama"` is our block (RMSNorm, RoPE, SwiGLU, no biases); `arch="gpt2"` describes
    a GPT-2 block (LayerNorm, learned positions, GELU MLP, biases) for estimates only.
    """

    vocab_size: int = 256
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 192
    max_seq_len: int = 128
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    arch: str = "llama"
    mlp_matrices: int = 0  # the dense MLP's weight matrices: 0 is the arch's (llama SwiGLU 3, gpt2 2); 2 for relu²/GELU
    # q/k norms in the attention (a transformers family's, read off the model): "" none; "head"
    # over each head (Qwen3: whole on every tp rank, their gradients summed over tp); "full" over
    # every head at once (OLMo2: its plan gathers q, k and v whole and o_proj takes its slice)
    qk_norm: str = ""
    qk_norm_share: float = 1.0  # a block's mean of them, in the first one's (a hybrid's: Qwen3-Next's 1 in 4)
    # The d_model-wide weights a block's own norms hold, whole on every tp rank: 2 for two RMSNorms
    # (plait's GPT, Llama); a transformers family's read off its model (Gemma 2's four norms, OLMo's
    # parameter-free LayerNorms none, Cohere's one norm a block)
    norm_params: int = 2
    # Elements of a block's biases kept whole on every tp rank, beyond its norms' (a transformers
    # family's: its row layers' biases, added after their sum, the biases of an MLP its plan leaves
    # whole, OPT's, and a router's, GPT-OSS's); under SP their gradients are summed over tp as the
    # norms' are
    whole_biases: int = 0
    # Elements of a block's parameters kept whole that act on its split MLP's hidden units
    # (Apertus's learned activation): each tp rank's gradient is partial, summed over tp every
    # micro-batch (plait's probe finds and sums them), under SP with the norms'
    split_mlp_scalars: int = 0
    # Which of a block's two regions tp splits, its attention and its (dense) MLP: both for plait's
    # GPT; a transformers model's as its plan says (HunYuan's and the hybrids' split the embedding
    # and head alone, YouTu's the MLP alone, an inferred plan OPT's attention or MPT's MLP)
    tp_attention: bool = True
    tp_mlp: bool = True
    # Where the blocks differ (a hybrid's linear-attention blocks beside full-attention ones), a
    # mean over them: the share whose attention the plan splits as a region a row layer closes
    # (above 1 where a block runs several: LongCat's two), the rest read whole under SP; and the
    # all-reduces per micro-batch of an attention whose layers it splits with no row layer closing
    # them (Qwen3-Next's linear attention gathers its projections whole: its two entries in
    # backward), under SP too
    tp_attention_share: float = 1.0
    tp_attention_entries: float = 0.0
    # Under SP, a split MLP read whole: its forward adds the residual it is given (MPT's), so
    # what leaves it is not a row layer's output; it gathers the sequence, its layers split
    # as without SP inside (their two all-reduces), nothing reduce-scattered
    sp_mlp_read_whole: bool = False
    # Under SP, a block's token-mixing layers beyond its attention that the plan leaves whole
    # (Falcon-H1's mamba beside its attention), a mean over the blocks: each read whole (2 all-gathers)
    sp_whole_mixers: float = 0.0
    # Each block's parameters whose gradients SP does not sum: those in the children it reads
    # whole (mixing tokens, no plan entry naming them: DBRX's norm-attention-norm, Nemotron-H's
    # mamba and attention), alike on every rank, and those no gradient reaches, as the plan
    # runs under SP (Gemma 4's blocks, holding experts kept whole, are whole then). Where it
    # splits nothing in some blocks, SP sums the rest of each block's counted parameters, less
    # what it splits (estimate/traffic.counted_sp_sum)
    sp_read_whole: tuple[int, ...] = ()
    sp_read_whole_count: tuple[int, ...] = ()  # and how many such children each block has
    # What those children take and hand on along the sequence beyond one tensor each, as
    # d_model-wide tensors, per block: (inputs on the slice gathered beside the first, outputs
    # over the whole sequence cut to the slice beside the first: DBRX's norm-attention-norm
    # hands on its residual, one more gather a block in backward)
    sp_read_whole_passes: tuple[tuple[float, float], ...] = ()
    # Features a token of the float inputs each block is handed along the sequence beside its
    # hidden states (Gemma 4's per-layer inputs, hidden_size_per_layer_input): under SP each
    # block takes its slice of them, their gradient gathered back, every micro-batch
    sp_sliced_inputs: int = 0
    tp_shared_experts: bool = False  # the plan splits the shared experts beside routed ones kept whole (dots1's)
    # Widths a block's plan gathers whole under tp, per token: (its column layers' outputs gathered
    # forward, its split-input row layers' inputs gathered back in backward): Phi-3's fused q|k|v
    # and gate|up ("colwise_gather_output", then "rowwise_split_input"); (0, 0) for Megatron's block.
    # A block's mean where the blocks differ (Qwen3-Next's linear-attention blocks gather, its
    # full-attention ones do not)
    tp_gathered: tuple[float, float] = (0, 0)
    tp_gathered_calls: tuple[float, float] = (0, 0)  # how many layers each of those widths sums (one gather each)
    # Outputs per token of a layer kept whole that enter a split region on their own (MLA's rotary
    # key, qk_rope_head_dim of kv_a_proj's outputs): their gradient summed over tp in backward
    tp_entered_tail: int = 0
    # Features per token a block's split attention enters with beyond the hidden size, a mean
    # over the blocks: its column layers reading latents enter on their own (MLA's q_b_proj and
    # kv_b_proj), each with its width (models/hf/load._entry_extra); negative where they read
    # latents alone, narrower than the hidden. Their gradients' all-reduce in backward, without SP
    tp_entry_extra: float = 0.0
    # Whether a split attention's column layers read the block's input (q, k and v do; MLA's read
    # latents made inside it, but HY-V4's and dots3's gates beside them read the input): under SP
    # MLA's down-projections then keep the gathered input for backward only where none does
    attention_reads_input: bool = True
    # Parameters a block's plan keeps whole with their gradients summed over tp every micro-batch
    # (a declared "replicated_with_grad_allreduce": dots3's norm of MLA's rotary key), beyond the
    # per-head q/k norms `qk_norm` prices; a block's mean
    tp_summed_params: float = 0.0
    # A block's mean of its norms' parameters beyond norm_params' d_model-wide weights (AXK1's
    # norm after its MoE blocks' MLP, AXK2's gated norms' gate MLPs): run on a sequence slice
    # under SP, their gradients summed over tp with the other norms'
    sp_norm_extra: float = 0.0
    # The dense MLPs an MoE block runs beside its experts and that the plan splits (Gemma 4's one,
    # LongCat's two): its MoE blocks run their collectives too
    moe_dense_mlps: int = 0
    # MLA's down-projections and their norms (q_a_proj, kv_a_proj, their layernorms), kept whole
    # inside the split attention: under SP they run on its gathered input, which they keep for
    # backward (not gathered again), and their gradients are summed over tp every micro-batch
    mla_down_params: int = 0
    # Under tp the embedding and the head are split by vocabulary (plait's GPT, Megatron, a
    # transformers plan); False: both whole on every tp rank (plait's GPT-2 adapter: tied)
    vocab_split: bool = True
    # Where a transformers plan splits the embedding and the head differently: the embedding by
    # vocabulary or not (DBRX's and Inkling-2's stay whole: no all-reduce of its output), and
    # the head by its input features ("rowwise_split_input": Inkling's), whose logits over the
    # whole vocabulary are partial on each tp rank, summed (an all-reduce of b·s·V a
    # micro-batch), its input's gradient gathered back (vocab_split false: no vocab-parallel loss)
    embedding_split: bool = True
    head_sums_logits: bool = False
    # Parameters of an embedding split by vocabulary beyond its table, run inside its own forward
    # (Inkling's `embed_norm`): split in place, each token's row is made by its owner alone, so each
    # rank holds part of their gradients, summed over tp every micro-batch (first stage)
    embedding_summed_params: int = 0
    # What a block keeps for backward: True, plait's GPT (its norms and SwiGLU keep only their
    # inputs, grouped K/V heads stay grouped: plait.models.gpt.lean); False, autograd's
    # intermediates (a transformers model: fp32 norm copies, silu's output, K/V repeated)
    lean_blocks: bool = True
    # A transformers model's SwiGLU MLPs make their gated product again for the down
    # projection's backward, as plait's block does (plait/models/hf/gated.py): its dense blocks
    # keep gate and up alone (estimate/activations.remakes_product)
    remade_products: bool = False
    # Its MoE blocks' shared experts' SwiGLU MLPs do too (Qwen2-MoE's, DeepSeek's); its grouped
    # routed experts keep their product (estimate/ops.remade_units)
    remade_shared: bool = False
    # Under SP, where the sequence is cut: False at the embedding's output, so the final norm and
    # the head's entry run on slices too (plait's GPT, Megatron); True at the first block's input
    # and gathered at the last block's output, so the embedding, the final norm and the head see
    # the whole sequence (a transformers model, whose own code around its blocks needs it whole)
    whole_sequence_ends: bool = False
    # Mixture of experts (plait.models.gpt.moe): 0 experts is a dense model.
    experts: int = 0  # routed experts in each MoE block
    top_k: int = 2  # experts each token is sent to
    shared_experts: int = 0  # experts every token passes through as well (one SwiGLU of shared·hidden units)
    shared_expert_gate: bool = False  # a gate of d_model weights on the shared experts' output (Qwen2-MoE's)
    shared_hidden: int = 0  # the shared experts' SwiGLU width, where not shared_experts x expert_width (Qwen2-MoE's)
    # A transformers MoE whose tp plan splits every expert's hidden units, with no ep plan to keep
    # them whole (Llama 4): under tp its routed and shared experts split as a dense MLP does, and
    # the routed experts' entry and exit carry this many rows a token (Llama 4 runs every expert on
    # every token, the router's scores zeroing the rest: `experts` rows). 0: tp keeps the MoE MLP
    # whole on every rank (plait's MoE, and a transformers MoE with an ep plan).
    tp_expert_rows: int = 0
    # The same plan where the experts are routed top-k (LongCat's): split as a dense MLP's, their
    # module entered and left with one row a token, its output summed over the choices
    tp_routed_split: bool = False
    # Floats per token a split experts module enters with beside the tokens, in an MoE block:
    # (the routed experts', the shared experts'): the routing weights the experts scale their
    # outputs by (LongCat's top-k), the shared experts' gates (Inkling's gammas). Each rank's
    # units give part of their gradients, summed over tp in backward (without SP: under SP the
    # block runs whole in its region, which they are made inside)
    tp_expert_entries: tuple[float, float] = (0.0, 0.0)
    # The MoE blocks count each expert's tokens, summed over the data ranks every step
    # (estimate/traffic.routing_traffic): plait's always, a transformers MoE's where plait can
    # (plait.models.hf.experts.counts_routing: a router beside each block of its ep plan)
    counts_routing: bool = True
    # plait's MoE blocks hold a balancing bias an expert, fp32, trained by no optimizer
    # (estimate/memory.stage_memory); a transformers MoE's router has none of plait's
    balancing_bias: bool = True
    # Hidden-wide streams the residual holds between blocks (DeepSeek-V4's and HY-V4's
    # hyper-connections, hc_mult: 4); under SP the sequence's cut and gather around the blocks
    # carry them all
    residual_streams: int = 1
    moe_every: int = 1  # every moe_every-th block is an MoE block (the others keep the dense MLP)
    # Which blocks are MoE blocks where moe_every cannot say (a transformers family's, read off
    # its model: DeepSeek's dense first blocks); empty: moe_every's
    moe_blocks: tuple[int, ...] = ()
    expert_hidden: int = 0  # each expert's SwiGLU width (0: ffn_hidden)
    router: str = "softmax"  # softmax top-k with the auxiliary loss, or sigmoid with a bias (no auxiliary loss)
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss (softmax router)
    bias_rate: float = 0.001  # sigmoid router: how far each step moves an expert's bias towards balance
    capacity_factor: float = 0.0  # 0: dropless; else each expert takes at most factor·tokens·top_k/experts
    # A transformers model's parameters as it holds them, counted on the meta device where the
    # fields above describe a block only in part (a hybrid's linear attention, DBRX's experts,
    # Gemma 4's dense MLP beside its experts, a column layer's bias): per block, (parameters its
    # tp plan splits, parameters every tp rank keeps whole, routed experts an ep plan can deal
    # out, of the split ones those its plan under SP splits: DeepSeek's MoE blocks run whole
    # there, plans.whole_beside_experts), and the parameters outside the blocks beyond the
    # embedding, head and final norm (Gemma 4's per-layer embeddings), held whole on the first
    # stage (< 0: fewer). Empty / 0: the formulas'
    block_tally: tuple[tuple[int, int, int, int], ...] = ()
    # Of each counted block's parameters, those no optimizer trains (requires_grad False: AFMoE's,
    # ERNIE-4.5-MoE's and Laguna's router balancing biases): held whole on every rank of the
    # block, with no gradient, no optimizer state, no sync and no ZeRO shard. Empty: none
    frozen_block_params: tuple[int, ...] = ()
    # How many times one forward runs each block, where a looped model runs some more than once
    # (Inkling-2-Loop's loop layers, Dory's recurrent blocks): their compute, what autograd
    # keeps and their tp, cp and ep traffic repeat per run; their parameters, gradients and
    # ZeRO units are the block's, once. Empty: once each
    block_runs: tuple[int, ...] = ()
    extra_params: int = 0
    frozen_extra_params: int = 0  # of those, the ones no optimizer trains (HRM's `z_L_init`): whole, weights alone
    extra_last_params: int = 0  # the same after the blocks, on the last stage (a LayerNorm's bias; < 0: none)
    # Of those, the ones a layer the plan splits by its input features holds (Qwen4-Exp's
    # hyper-connection mixer's `input_mix_weight_down`, "rowwise_split_input"): each tp rank holds
    # 1/tp of them; and that layer's widths per token, (outputs, inputs): its partial outputs
    # summed over tp forward, its input's gradient gathered back whole in backward, every micro-batch
    extra_last_split: int = 0
    tp_last_rows: tuple[int, int] = (0, 0)
    # Vectors over the vocabulary the head holds beside its weight (Phi's bias, Dory's learned
    # scale a logit), split as the head is
    head_vectors: int = 0
    # Whether ZeRO-3 gathers the embedding as a unit of its own, around its forward and its
    # backward (plait.parallel.zero.shard.edge_units: a module of its own parameters alone);
    # else it sits in the root, whole throughout (Inkling's, which holds its norm as a child)
    embedding_unit: bool = True
    # The parameters of each other ZeRO-3 unit outside the blocks, on the first stage, run
    # before the blocks (edge_units' matrices beside the embedding and head: Gemma 3n's and
    # Gemma 4's per-layer embedding and its projection), where the root would hold them whole
    edge_units: tuple[int, ...] = ()
    # The same after the blocks, on the last stage, before the head, each (whole on every tp rank,
    # split by tp): Qwen4-Exp's hyper-connection mixer, its down-projection split by its input
    edge_units_last: tuple[tuple[int, int], ...] = ()
    # Bytes a block's eager attention keeps per (query, key) pair of a sequence, all its heads, a
    # mean over the blocks, (in fp32, in 16-bit): a transformers model whose attention runs
    # eagerly (a soft-cap, sinks, ALiBi) keeps its s × s matrices for backward, where SDPA keeps
    # none (estimate/activations.eager_attention_bytes). Measured when the shape is read (on the
    # meta device, or a small model on zeroed CPU memory: models/hf/load.py _kept_terms).
    attention_matrix_bytes: tuple[float, float] = (0.0, 0.0)
    # What a block keeps for backward per token beyond the formulas' view of it, measured as the
    # matrices above are for a transformers model (a hybrid's mamba or linear attention keeps its torch
    # path's chunk states; q/k norms, gates): ((whole on every tp rank, inside the regions the
    # plan splits, inside the token-mixing modules it leaves whole: whole under SP too) in fp32,
    # the same in 16-bit), bytes a token, a mean over the blocks; -1 where
    # that dtype's forward does not run on meta. Empty: the formulas' (plait's own GPT, counted
    # exactly by them). estimate/activations.llama_layer_bytes reads it
    block_saved_bytes: tuple[tuple[float, float, float], ...] = ()
    # What a transformers model keeps after its blocks, bytes a token (fp32, 16-bit), measured in
    # the same forwards: its final norm's input, statistics and output (which the head keeps),
    # a LayerNorm's or an RMSNorm's as it is; -1 where that dtype's forward did not run. Empty:
    # the formula's RMSNorm. estimate/activations.stage_extra_bytes reads it
    final_saved_bytes: tuple[float, float] = ()
    # What a transformers model keeps outside its blocks before the last one, bytes a token
    # (fp32, 16-bit), the token ids aside: a norm of the embedding's output (nanochat's,
    # ModernBERT's), one between two stacks (HRM's) or a loop's passes (Dory's). -1 where that
    # dtype's forward did not run. estimate/activations.stage_extra_bytes reads it, on the first stage
    outside_saved_bytes: tuple[float, float] = ()
    # The logits a transformers model's head keeps for its backward, bytes a token of the whole
    # vocabulary (fp32, 16-bit): a soft cap's tanh keeps its output; Dory's learned scale on each
    # logit keeps the logits, in fp32 whatever the compute dtype. -1 where that dtype's forward did
    # not run; empty: logit_softcap's. estimate/activations.head_kept_bytes reads it
    head_saved_bytes: tuple[float, float] = ()
    # What the blocks of a transformers model keep of the rotary tables its rotary module makes
    # each forward, bytes a position (fp32, 16-bit), measured in the same forwards: one sequence's
    # (cos and sin), shared by every sequence of the micro-batch; -1 where that dtype's forward
    # did not run. estimate/activations.forward_kept_bytes reads it
    position_table_bytes: tuple[float, float] = ()
    # Of block_saved_bytes, the copy of SDPA's output a transformers block makes for its output
    # projection, bytes a token (fp32, 16-bit): GPT-NeoX's and Phi's heads, handed out of a fused
    # projection, come back head-major and reshaping them copies; Llama's come back sequence-major
    # and o_proj reads a view. Context parallelism's attention hands its output back
    # sequence-major: no copy. estimate/activations.o_proj_copy_values reads it
    attention_out_copy_bytes: tuple[float, float] = ()
    # Of block_saved_bytes, the K/V heads a transformers attention repeats up to q's for SDPA, bytes
    # a token (fp32, 16-bit): it hands SDPA grouped heads (enable_gqa) only without a mask, so a
    # sliding window's layers keep them repeated. Context parallelism's attention is handed them
    # grouped and keeps them so. estimate/activations.kv_repeat_values reads it
    kv_repeat_bytes: tuple[float, float] = ()
    # Of block_saved_bytes, what SDPA's inputs alone keep beyond their own values, bytes a token
    # (fp32, 16-bit), signed: GPT-NeoX's, Phi-3's, CodeGen's and DBRX's V is a slice of one fused
    # q|k|v projection's output that nothing else keeps, and SDPA keeping V keeps all of it (2h
    # a token more for GPT-NeoX); Persimmon's V is a slice of an output its q and k norms keep
    # anyway, and costs nothing of its own (h less). Ulysses hands its attention tensors of its
    # own, traded by all-to-alls: estimate/activations.measured_correction takes this off there
    qkv_view_bytes: tuple[float, float] = ()
    # What a transformers block's row layers that take their slice of a whole input (OLMo2's
    # o_proj of its attention run whole) save of a storage something before them keeps, bytes a
    # token (fp32, 16-bit): at one process a view of it (SDPA's output), under tp a slice of its
    # own, the whole's 1/tp. estimate/activations.sliced_view_bytes reads it
    sliced_view_bytes: tuple[float, float] = ()
    # The share of the attention's calls whose output an op after it keeps, as a view or a copy
    # (o_proj's input: Llama's a view, GPT-NeoX's a copy); JetMoE's mixture of output heads keeps
    # its own gathered pieces instead (0). Where context parallelism hands the output back as a
    # tensor of its own (Ulysses' traded back; the ring's cast to 16-bit), that op keeps it
    attention_out_kept: float = 1.0
    # What a transformers model keeps a forward that no token makes, bytes (fp32, 16-bit): a
    # block's run, the first stage's (outside the blocks) and the last's (the final norm and the
    # head): vectors derived from the weights each forward, as Gemma's and Nemotron's norms make
    # 1 + weight, Dory's its scales; whole on every rank. -1 where that dtype's forward did not
    # run. estimate/activations.constant_kept_bytes reads it
    constant_bytes: tuple[tuple[float, float], ...] = ()
    # What a micro-batch of b >= 2 sequences keeps in a transformers block's run beyond b
    # sequences' reading at one, f + b·(c + a·s) + (b - 1)·g·s², one tuple a dtype (fp32,
    # 16-bit): a (bytes a token: the rest, the split regions', the mixers'), then c (a
    # sequence's), f (a micro-batch's), g (of an s × s tensor kept once a micro-batch: Inkling's
    # position bias). A mamba's final state is kept once a sequence, which a reading of one
    # sequence counts once a forward; a reshape may view at one sequence alone (Jamba's mamba,
    # GPT-NeoX-Japanese's attention). estimate/activations.measured_correction reads a, with
    # the measured bytes a token (tp and SP act on it as on them); further_sequence_bytes the rest
    further_sequence_bytes: tuple[tuple[float, ...], ...] = ()
    # What a transformers block keeps on a CPU beyond its reading's, where the CPU runs a call of
    # SDPA in its math form (a mask that needs its gradient: Doge's dynamic mask; a V narrower
    # than K: the latent attentions'), which a GPU's fused kernel takes: the math form keeps
    # scaled q and k, every head's K and V, and the s × s softmax in fp32, where the kernel keeps
    # q, k, V, its output and a log-sum-exp (Doge's 144 B a token a block over on the CPU). Bytes
    # a block's run, fp32's then 16-bit's (signed), each 18 terms of the three parts (the rest,
    # the split regions', the mixers'): a token's; a token's a position of the sequence; then what
    # a batch of b >= 2 keeps beyond b sequences, f + b·(c + a·s) + (b - 1)·g·s², as a, c, f, g.
    # estimate/activations.cpu_attention_bytes and cpu_attention_batch_bytes
    cpu_sdpa_bytes: tuple[tuple[float, ...], ...] = ()
    # Where a transformers model's token-mixing modules left whole pad the sequence to a chunk (a
    # linear attention's torch path: Qwen3-Next's 64 tokens), its tokens (0: they keep by the
    # token), and a sequence's bytes a block's run beyond a token's within a chunk (block_saved_bytes'
    # mixers then): (the first chunk's, the second's, each further one's) in fp32, the same in
    # 16-bit; -1 where that dtype's forward did not run. estimate/activations.mixer_chunk_bytes reads it
    mixer_chunk: int = 0
    mixer_chunk_bytes: tuple[tuple[float, float], ...] = ()
    # What each block of a transformers model keeps over its runs, where its blocks differ (a
    # hybrid's linear-attention and attention blocks, DeepSeek's dense first blocks and MoE ones),
    # measured with block_saved_bytes, in the first dtype whose forward ran: (c, a, q, first,
    # second, further, a', c', f', g') of c + b·(a·s + q·s² + the chunks' bytes, mixer_chunk's)
    # for a micro-batch of b sequences of s tokens, plus f' + b·(c' + a'·s) + (b - 1)·g'·s² where b >= 2 (what a
    # batch keeps beyond as many sequences alone). Only their ratios are read: a pipeline stage keeps its own
    # blocks' share of the mean block's bytes (estimate/activations.kept_runs). Empty: alike
    block_keeps: tuple[tuple[float, ...], ...] = ()
    # The sliding window (positions) a transformers model's sliding layers attend within, 0 for
    # none: under Ulysses a window shorter than the sequence is one additive mask a rank keeps
    # (plait.parallel.context.ulysses.window_mask; estimate/activations.window_mask_bytes)
    sliding_window: int = 0
    # The share of a transformers model's blocks that hand SDPA their sliding window's mask, each
    # kept as SDPA's own additive copy (estimate/activations.sdpa_mask_copy_bytes); 0 where its
    # attention is not SDPA (an eager one adds a mask it does not keep)
    sliding_mask_layers: float = 0.0
    # The share of blocks whose token mixing is softmax attention over the sequence, whose
    # FLOPs grow with it (4·h·s a token forward): a hybrid's linear-attention, mamba and
    # convolution blocks are not (Qwen3-Next's three in four, Jamba's seven in eight, Mamba's all)
    attention_share: float = 1.0
    # Values a head of the attention's q, k and v holds as a transformers model hands them to its
    # attention function, where they are not head_dim (multi-head latent attention's: q and k
    # qk_nope + qk_rope wide, v v_head_dim; a config whose head_dim is not d_model / n_heads).
    # Empty: head_dim each. Where layers differ (Gemma 4's global layers' wider heads), the mean
    # over one forward's calls: what cp moves and the attention computes are linear in each.
    # Context parallelism sends them and its estimate reads them
    head_widths: tuple[float, float, float] = ()
    # Softmax attentions a softmax-attention block's run calls (attention_share says which blocks
    # those are), a mean over them, as the model calls its attention function (DiffLlama's two a
    # layer, LongCat's two a block): context parallelism moves K and V for each, and each computes
    attention_calls: float = 1.0
    # The model's own forward caps its logits, c·tanh(logits/c) (transformers' final_logit_softcapping:
    # Gemma 2 and 3, nanochat): tanh keeps its output for backward, the logits of this rank's
    # vocabulary shard in the compute dtype, on the last stage
    logit_softcap: bool = False

    def __post_init__(self) -> None:
        """Shapes that cannot build a model are refused here, naming the field. moe_blocks,
        tp_gathered and the other pairs are kept tuples, as read back from JSON (lists) too: the
        config is hashed."""
        object.__setattr__(self, "moe_blocks", tuple(self.moe_blocks))
        object.__setattr__(self, "tp_gathered", tuple(self.tp_gathered))
        object.__setattr__(self, "head_widths", tuple(self.head_widths))
        object.__setattr__(self, "final_saved_bytes", tuple(self.final_saved_bytes))
        object.__setattr__(self, "outside_saved_bytes", tuple(self.outside_saved_bytes))
        object.__setattr__(self, "head_saved_bytes", tuple(self.head_saved_bytes))
        object.__setattr__(self, "position_table_bytes", tuple(self.position_table_bytes))
        object.__setattr__(self, "attention_out_copy_bytes", tuple(self.attention_out_copy_bytes))
        object.__setattr__(self, "kv_repeat_bytes", tuple(self.kv_repeat_bytes))
        object.__setattr__(self, "qkv_view_bytes", tuple(self.qkv_view_bytes))
        object.__setattr__(self, "sliced_view_bytes", tuple(self.sliced_view_bytes))
        object.__setattr__(self, "constant_bytes", tuple(tuple(pair) for pair in self.constant_bytes))
        object.__setattr__(self, "further_sequence_bytes", tuple(tuple(terms) for terms in self.further_sequence_bytes))
        object.__setattr__(self, "cpu_sdpa_bytes", tuple(tuple(terms) for terms in self.cpu_sdpa_bytes))
        object.__setattr__(self, "mixer_chunk_bytes", tuple(tuple(pair) for pair in self.mixer_chunk_bytes))
        object.__setattr__(self, "block_keeps", tuple(tuple(block) for block in self.block_keeps))
        object.__setattr__(self, "tp_gathered_calls", tuple(self.tp_gathered_calls))
        object.__setattr__(self, "tp_expert_entries", tuple(self.tp_expert_entries))
        object.__setattr__(self, "tp_last_rows", tuple(self.tp_last_rows))
        object.__setattr__(self, "sp_read_whole", tuple(self.sp_read_whole))
        object.__setattr__(self, "sp_read_whole_count", tuple(self.sp_read_whole_count))
        object.__setattr__(self, "sp_read_whole_passes", tuple(tuple(pair) for pair in self.sp_read_whole_passes))
        object.__setattr__(self, "block_tally", tuple(tuple(block) for block in self.block_tally))
        object.__setattr__(self, "frozen_block_params", tuple(self.frozen_block_params))
        object.__setattr__(self, "block_runs", tuple(self.block_runs))
        object.__setattr__(self, "edge_units", tuple(self.edge_units))
        object.__setattr__(self, "edge_units_last", tuple(tuple(pair) for pair in self.edge_units_last))
        object.__setattr__(self, "attention_matrix_bytes", tuple(self.attention_matrix_bytes))
        object.__setattr__(self, "block_saved_bytes", tuple(tuple(pair) for pair in self.block_saved_bytes))
        for name in ("vocab_size", "n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
            if getattr(self, name) < 1:
                raise PlaitError(f"model field {name} must be at least 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise PlaitError(f"d_model = {self.d_model} is not divisible by n_heads = {self.n_heads}",
                             hint="each head takes d_model / n_heads features")
        if self.n_heads % self.n_kv_heads:
            raise PlaitError(f"n_heads = {self.n_heads} is not divisible by n_kv_heads = {self.n_kv_heads}",
                             hint="each key/value head serves n_heads / n_kv_heads query heads")
        if self.block_runs and (len(self.block_runs) != self.n_layers or min(self.block_runs) < 1):
            raise PlaitError(f"block_runs {list(self.block_runs)} does not give each of the {self.n_layers} blocks "
                             f"one run or more", hint="leave it empty where each block runs once")
        check_experts(self)
        if self.mlp_matrices not in (0, 2, 3):
            raise PlaitError(f"mlp_matrices must be 2 (up, down) or 3 (gate, up, down), got {self.mlp_matrices}")

    @property
    def dense_mlp_matrices(self) -> int:
        """The dense MLP's weight matrices: mlp_matrices, or the arch's (GPT-2 2, llama's SwiGLU 3)."""
        return self.mlp_matrices or (2 if self.arch == "gpt2" else 3)

    @property
    def attention_params(self) -> int:
        """The attention's weights (llama's q, k, v, o without biases): 2·h² + 2·h·kv."""
        return 2 * self.d_model * self.d_model + 2 * self.d_model * self.kv_dim

    @property
    def mlp_params(self) -> int:
        """The dense MLP's weights: 2 or 3 matrices of d_model × ffn_hidden."""
        return self.dense_mlp_matrices * self.d_model * self.ffn_hidden

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def moe_layer(self, index: int) -> bool:
        """Whether block `index` (from 0) is an MoE block: one of moe_blocks where they are
        given, else every moe_every-th, counting from 1."""
        if self.moe_blocks:
            return self.is_moe and index in self.moe_blocks
        return self.is_moe and (index + 1) % self.moe_every == 0

    @functools.cached_property
    def moe_layers(self) -> int:
        """How many blocks are MoE blocks (kept once computed: the planner asks it per layout)."""
        return sum(self.moe_layer(i) for i in range(self.n_layers))

    @property
    def expert_width(self) -> int:
        """Hidden units of one expert's SwiGLU."""
        return self.expert_hidden or self.ffn_hidden

    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.d_model * self.expert_width

    @property
    def shared_width(self) -> int:
        """Hidden units of the shared experts' one SwiGLU: shared_hidden, or shared_experts
        experts' widths."""
        return self.shared_hidden or self.shared_experts * self.expert_width

    def routed_split_by_tp(self, ep: int) -> bool:
        """Whether tp splits the routed experts: where the model's plan does (tp_expert_rows,
        tp_routed_split) and no ep keeps them whole."""
        return bool(self.tp_expert_rows or self.tp_routed_split) and ep == 1

    def shared_split_by_tp(self, ep: int) -> bool:
        """Whether tp splits the shared experts: with the routed ones, or beside them
        (tp_shared_experts)."""
        return self.routed_split_by_tp(ep) or self.tp_shared_experts

    def moe_mlp_params(self) -> int:
        """An MoE block's feed-forward: the router, every routed expert, the shared experts."""
        return (self.d_model * self.experts + self.experts * self.expert_params()
                + 3 * self.d_model * self.shared_width + self.d_model * self.shared_expert_gate)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def block_attention_calls(self) -> float:
        """Softmax attention calls a block makes, a mean over every block (a hybrid's linear and
        mamba blocks make none): attention_share × attention_calls."""
        return self.attention_share * self.attention_calls

    @property
    def head_widths_handed(self) -> tuple[float, float, float]:
        """Values a head of q, k and v holds as the attention is handed it: head_widths where read
        off the model, head_dim each otherwise."""
        return self.head_widths or (self.head_dim,) * 3  # type: ignore[return-value]

    def attention_tp(self, tp: int) -> int:
        """The tp ranks the attention's heads are split over: tp, or 1 where the model's plan leaves
        the attention whole (`tp_attention`: every rank runs every head). The one reading for the
        attention's FLOPs, time, eager scores and cp's K/V."""
        return tp if self.tp_attention else 1

    @property
    def attention_widths(self) -> tuple[int, int, int, int]:
        """Values a token holds of q, k, v and the attention's output (n_heads heads of v's
        width) at tp 1: (d_model, kv_dim, kv_dim, d_model) but where head_widths says otherwise."""
        if not self.head_widths:
            return self.d_model, self.kv_dim, self.kv_dim, self.d_model
        q, k, v = self.head_widths
        return self.n_heads * q, self.n_kv_heads * k, self.n_kv_heads * v, self.n_heads * v

    @property
    def stream_width(self) -> int:
        """Values a token's residual holds between blocks: d_model in each of its
        residual_streams. A pipeline stage sends them all to the next."""
        return self.d_model * self.residual_streams

    def layer_params(self) -> int:
        """Parameters of one transformer block."""
        h, f, kv = self.d_model, self.ffn_hidden, self.kv_dim
        if self.arch == "gpt2":
            attn = h * (h + 2 * kv) + (h + 2 * kv) + h * h + h
            mlp = self.mlp_params + f + h
            norms = 2 * 2 * h
            return attn + mlp + norms
        attn = self.attention_params
        mlp = self.mlp_params
        norms = self.norm_params * h + self.whole_biases + self.split_mlp_scalars
        return attn + mlp + norms

    def runs_of(self, index: int) -> int:
        """How many times one forward runs block `index` (block_runs)."""
        return self.block_runs[index] if self.block_runs else 1

    def block_params(self, index: int) -> int:
        """Parameters of block `index`: as counted (block_tally), else a dense block, or one whose
        MLP is the MoE's (the router's bias is a buffer-like parameter, not counted: it is never
        trained)."""
        if self.block_tally:
            return sum(self.block_tally[index][:3])
        if not self.moe_layer(index):
            return self.layer_params()
        return self.layer_params() - self.mlp_params + self.moe_mlp_params()

    def active_block_params(self, index: int) -> int:
        """Parameters one token passes through in block `index`: a dense block's all; an MoE
        block's attention, norms, router, top_k routed experts and the shared ones (of a counted
        block, top_k/experts of its routed experts)."""
        if self.block_tally:
            split, whole, routed, _ = self.block_tally[index]
            return split + whole + (routed * self.top_k // self.experts if self.experts else routed)
        if not self.moe_layer(index):
            return self.layer_params()
        return (self.layer_params() - self.mlp_params + self.d_model * self.experts
                + self.top_k * self.expert_params() + 3 * self.d_model * self.shared_width
                + self.d_model * self.shared_expert_gate)

    def active_params(self) -> int:
        """Parameters one token passes through: every dense weight, and of each MoE block the
        router, top_k routed experts and the shared ones (what FLOPs per token follow)."""
        if self.block_tally:
            return sum(self.active_block_params(i) for i in range(self.n_layers)) + self.embedding_params()
        idle = (self.experts - self.top_k) * self.expert_params() * self.moe_layers
        return self.num_params() - idle

    @property
    def final_norm_weights(self) -> int:
        """The final norm's weights (and GPT-2's LayerNorm biases), on the last stage."""
        return 2 * self.d_model if self.arch == "gpt2" else self.d_model

    def embedding_params(self) -> int:
        """Token embedding, output head (unless tied), final norm, learned positions, and what a
        counted model holds beyond them (extra_params, extra_last_params)."""
        h = self.d_model
        total = self.vocab_size * h + self.vocab_size * self.head_vectors + self.final_norm_weights
        if not self.tie_embeddings:
            total += self.vocab_size * h
        if self.arch == "gpt2":
            total += self.max_seq_len * h
        return total + self.extra_params + self.extra_last_params

    def check_split(self, tp: int, sp: bool = False, seq_len: int | None = None) -> None:
        """The decoder splits whole heads, whole KV heads, the vocabulary and the MLP evenly
        over tp; under SP the sequence too. The vocabulary is not padded: pad it in the model
        instead (`--model NAME,vocab_size=N`). The heads only where the attention is split
        (`tp_attention`: GPT-BigCode's one K/V head stays whole on every rank). The family's own
        limits: the layout's rules are plait.rules'."""
        heads = (("n_heads", self.n_heads, "each rank holds whole attention heads"),
                 ("n_kv_heads", self.n_kv_heads, "each rank holds whole key/value heads")) if self.tp_attention else ()
        for what, size, why in (*heads,
                                ("vocab_size", self.vocab_size, "each rank holds V/tp rows of the vocabulary"),
                                ("ffn_hidden", self.ffn_hidden, "each rank holds ffn_hidden/tp MLP units")):
            pad = f", or pad the vocabulary to {size + (-size % tp)}" if what == "vocab_size" else ""
            check_divides(what, size, tp, why, pad)
        if seq_len is not None:
            check_sequence_split(seq_len, tp, sp)
        if self.is_moe and tp > 1 and sp and not self.whole_sequence_ends:
            raise PlaitError(f"--sp with a mixture of experts is not built yet for plait's GPT (tp {tp} keeps each "
                             "MoE block whole on every tp rank, which needs the whole sequence)",
                             hint="drop --sp: tp splits attention and the dense blocks, the experts stay whole")

    def num_params(self) -> int:
        """Exact parameter count of the model this config builds (tied weights counted once)."""
        return sum(self.block_params(i) for i in range(self.n_layers)) + self.embedding_params()


ROUTERS = ("softmax", "sigmoid")


def check_experts(config: GPTConfig) -> None:
    """An MoE shape that cannot route is refused here, naming the field."""
    if config.experts == 0:
        return
    if config.experts < 0 or config.top_k < 1 or config.moe_every < 1 or config.shared_experts < 0:
        raise PlaitError("experts, top_k and moe_every must be positive (shared_experts at least 0)",
                         hint="e.g. --model tiny-moe,experts=8,top_k=2")
    if config.top_k > config.experts:
        raise PlaitError(f"top_k = {config.top_k} is more than experts = {config.experts}",
                         hint=f"each token goes to top_k distinct experts: choose top_k <= {config.experts}")
    if config.router not in ROUTERS:
        raise PlaitError(f"router {config.router!r} is not one of {', '.join(ROUTERS)}",
                         hint="softmax: top-k with the load-balancing loss; sigmoid: auxiliary-loss-free bias")
    if config.capacity_factor < 0 or config.aux_loss_coef < 0 or config.bias_rate < 0:
        raise PlaitError("capacity_factor, aux_loss_coef and bias_rate must be at least 0")


PRESETS: dict[str, GPTConfig] = {
    # Trained by the tests: well under a million parameters, fast on one CPU core.
    "tiny": GPTConfig(),
    # Trained by the demo: about 9.5 M parameters, byte-level vocabulary.
    "small": GPTConfig(
        vocab_size=256, n_layers=6, d_model=384, n_heads=6, n_kv_heads=2,
        ffn_hidden=1024, max_seq_len=512,
    ),
    # Shape-only presets for estimates and planning.
    "gpt2-124m": GPTConfig(
        vocab_size=50257, n_layers=12, d_model=768, n_heads=12, n_kv_heads=12,
        ffn_hidden=3072, max_seq_len=1024, arch="gpt2",
    ),
    "llama-1b": GPTConfig(
        vocab_size=128256, n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8,
        ffn_hidden=8192, max_seq_len=8192, rope_theta=500000.0,
    ),
    "llama-7b": GPTConfig(
        vocab_size=32000, n_layers=32, d_model=4096, n_heads=32, n_kv_heads=32,
        ffn_hidden=11008, max_seq_len=4096, tie_embeddings=False,
    ),
    "llama-70b": GPTConfig(
        vocab_size=32000, n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8,
        ffn_hidden=28672, max_seq_len=4096, tie_embeddings=False,
    ),
}

PRESETS.update({
    # Mixtures of experts: tiny-moe is trained by the tests, small-moe by the MoE demo.
    "tiny-moe": GPTConfig(experts=4, top_k=2, shared_experts=1, expert_hidden=64),
    "small-moe": GPTConfig(
        vocab_size=256, n_layers=6, d_model=384, n_heads=6, n_kv_heads=2,
        ffn_hidden=1024, max_seq_len=512, experts=8, top_k=2, expert_hidden=512, moe_every=2,
    ),
    # Shape-only: Mixtral 8x7B's shape, for estimates and planning.
    "mixtral-8x7b": GPTConfig(
        vocab_size=32000, n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8,
        ffn_hidden=14336, max_seq_len=4096, tie_embeddings=False, rope_theta=1e6, experts=8, top_k=2,
    ),
})

# Presets small enough to allocate and train on a CPU.
TRAINABLE = ("tiny", "small", "tiny-moe", "small-moe")

def get_preset(name: str, **overrides: object) -> GPTConfig:
    """Look up a preset by name, with an error that lists the names that exist.

    `name` may carry overrides of the preset's fields: "tiny,n_kv_heads=4,n_layers=4"
    (what `--model` accepts), for a variant without a new preset.
    """
    base, _, spec = name.partition(",")
    if base not in PRESETS:
        raise PlaitError(
            f"unknown model preset {base!r}",
            hint=f"choose one of: {', '.join(PRESETS)}",
        )
    overrides = {**parse_overrides(spec, name), **overrides} if spec else overrides
    config = PRESETS[base]
    try:
        return replace(config, **overrides) if overrides else config
    except (ValueError, ZeroDivisionError) as exc:
        raise PlaitError(f"model {name!r}: {exc}") from None


def preset_name(name: str) -> str:
    """The preset a model spec starts from ("tiny" for "tiny,n_layers=4")."""
    return name.partition(",")[0]


def parse_overrides(spec: str, name: str) -> dict[str, object]:
    """"n_layers=4,tie_embeddings=false" -> typed values for GPTConfig's fields."""
    kinds = {f.name: f.type for f in fields(GPTConfig)}
    out: dict[str, object] = {}
    for item in filter(None, spec.split(",")):
        key, eq, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in kinds:
            raise PlaitError(f"model {name!r}: {item!r} is not FIELD=VALUE for a GPTConfig field",
                             hint=f"fields: {', '.join(kinds)}")
        out[key] = _typed(kinds[key], text.strip(), name, key)
    return out


def _typed(kind: object, text: str, name: str, key: str) -> object:
    kind = getattr(kind, "__name__", kind)
    try:
        if kind == "bool":
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        return {"int": int, "float": float}.get(str(kind), str)(text)
    except ValueError:
        raise PlaitError(f"model {name!r}: {key}={text!r} is not a valid {kind}") from None
