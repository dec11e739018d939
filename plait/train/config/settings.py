"""The training configuration: one typed dataclass, filled from defaults, a TOML file, then flags.

The defaults are the demo: the `small` GPT on the standard-library corpus, two processes.
The layout flags (dp, tp, pp, zero, offload, sp, schedule, virtual stages) become one
plait.layout.Layout (`TrainConfig.layout`), made and checked once; what the model itself
allows is its family's check (plait.families). All validation that needs no process group
happens here, so a bad value fails before anything is spawned, with one line saying what to
change.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from collections.abc import Callable
from typing import Any, Protocol

from plait import rules
from plait.errors import PlaitError
from plait.layout import Layout
from plait.train.config.applies import check_applies
from plait.train.config.check import check_values, parse_bytes
from plait.train.checkpoint.elastic import fit_world
from plait.train.checkpoint.restart import has_checkpoint, resolve, resolve_auto
from plait.runtime.inject import parse_bitflip
from plait.runtime.launch import check_local_nproc

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


@dataclass(frozen=True)
class TrainConfig:
    """Everything `plait train` needs; each field is also a `--flag` (underscores → dashes)."""

    model: str = field(default="small", metadata={"help": "the model, named as its family takes it (the list follows)"})
    imports: str = field(default="", metadata={"help": "Python modules to import on every rank first, comma-separated: each may register a model family (docs/models.md)"})
    data: str = field(default="embedded", metadata={"help": "corpus: 'embedded' (the text plait ships, the same on every machine), 'stdlib' (this Python's own source), a text file or directory (up to 8 MiB), or a directory from `plait data prepare`, or a blend of corpora: WEIGHT:CORPUS,... (e.g. 0.7:data/web,0.3:data/code: every batch in those shares); for a ResNet: 'digits' or a folder of class folders"})
    packing: str = field(default="auto", metadata={
        "help": "how documents become sequences: concat (windows over the stream, documents end to end) or "
                "best-fit (whole documents per sequence, padded; longer ones cut into sequence-long pieces); "
                "auto: best-fit for completion and chat data, concat for text (docs/data.md)"})
    doc_mask: str = field(default="auto", metadata={
        "help": "true: attention stays inside each document and positions restart at each; auto: true for "
                "completion and chat data, false for text"})
    steps: int = field(default=120, metadata={"help": "optimizer steps"})
    micro_batch: int = field(default=8, metadata={"help": "sequences per rank per forward/backward"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    seq_len: int = field(default=128, metadata={"help": "tokens per sequence"})
    lr: float = field(default=2e-3, metadata={"help": "peak learning rate"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "cosine decays to lr × this"})
    warmup_steps: int = field(default=10, metadata={"help": "steps of linear learning-rate warm-up"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay (not applied to norms)"})
    grad_clip: float = field(default=1.0, metadata={"help": "max global gradient norm (0 turns clipping off)"})
    seed: int = field(default=0, metadata={"help": "seeds the weights, the data order and the sample"})
    eval_every: int = field(default=60, metadata={"help": "steps between held-out evaluations (0: only at the end)"})
    eval_samples: int = field(default=32, metadata={"help": "held-out sequences per evaluation"})
    bucket_mb: float = field(default=rules.BUCKET_MB, metadata={"help": "gradient bucket size for data parallelism"})
    dp: int | None = field(default=None, metadata={"help": "data-parallel degree (default: what tp and pp leave)"})
    tp: int = field(default=1, metadata={"help": "tensor-parallel degree (Megatron-style)"})
    sp: bool = field(default=False, metadata={"help": "sequence parallelism in the norm regions (needs --tp > 1)"})
    pp: int = field(default=1, metadata={"help": "pipeline-parallel degree"})
    cp: int = field(default=1, metadata={
        "help": "context-parallel degree: each rank holds 2 of each sequence's 2·cp chunks; attention runs over "
                "the cp ranks (docs/context.md)"})
    cp_kind: str = field(default="ring", metadata={
        "help": "context parallelism's attention: ring (K/V passed round the cp ranks) or ulysses "
                "(all-to-all to head shards; needs heads divisible by cp)"})
    ep: int = field(default=1, metadata={
        "help": "expert-parallel degree, carved out of dp: each group of ep data-parallel ranks splits a mixture "
                "of experts' experts, tokens travelling by all-to-all (docs/moe.md)"})
    schedule: str = field(default="1f1b", metadata={"help": "pipeline schedule: gpipe, 1f1b, interleaved or zb-h1"})
    virtual_stages: int = field(default=1, metadata={"help": "model chunks per pipeline rank (interleaved)"})
    stage_layers: str = field(default="", metadata={
        "help": "blocks in each of the pp × virtual-stages stages, in stage order, e.g. 3,4,4,3; the first "
                "and the last may be 0 (the embedding alone, the head alone); empty: plait's cut (balanced by "
                "parameters; equal chunks when interleaved) (docs/pipeline.md)"})
    precision: str = field(default="fp32", metadata={
        "help": "fp32, bf16, fp16 or fp8: 16-bit weights and gradients, fp32 master weights and Adam state; "
                "fp16 with dynamic loss scaling; fp8 is bf16 whose block linears multiply in float8 "
                "(torchao; docs/precision.md)"})
    fp8_scaling: str = field(default="tensorwise", metadata={
        "help": "fp8: each float8 cast scaled by its tensor's largest value (tensorwise) or its row's (rowwise); "
                "tensorwise-fast: tensorwise with fast accumulation in the backward's products too"})
    reduce_dtype: str = field(default="", metadata={
        "help": "dtype gradients are reduced in over dp: fp32, bf16 or fp16 (default: the gradients' own)"})
    loss_scale: float = field(default=65536.0, metadata={
        "help": "fp16: the initial loss scale (halved on overflow, doubled after 1000 clean steps)"})
    skip_nonfinite: bool = field(default=False, metadata={
        "help": "skip a step whose loss or gradient is not finite (on every rank), instead of stopping"})
    recompute: str = field(default="none", metadata={
        "help": "activation recomputation: none, selective (rerun the attention core in backward), "
                "or full (keep each block's input, run the block again in backward)"})
    zero: int = field(default=0, metadata={"help": "ZeRO stage: 0 DDP, 1 optimizer states, 2 + gradients, 3 + parameters"})
    offload: bool = field(default=False, metadata={"help": "optimizer states and step in CPU memory (needs --zero)"})
    dp_shard: int = field(default=0, metadata={
        "help": "hybrid sharding: ZeRO inside groups of N data-parallel ranks (dp × cp), replicas across the groups (needs --zero; 0: all ranks)"})
    prefetch: int = field(default=1, metadata={
        "help": "ZeRO-3: units whose weights are gathered ahead of the one computing (0: gather on demand)"})
    reshard_after_forward: bool = field(default=True, metadata={
        "help": "ZeRO-3: free a unit's gathered weights after its forward and gather them again for backward; "
                "false keeps them until backward (one gather less per unit, the whole model held at once)"})
    memory_limit: float = field(default=0.0, metadata={
        "help": "GiB per rank: refuse, before any process starts, a run whose estimated memory per rank "
                "(plait estimate) is larger, naming a --cp that fits (0: no limit)"})
    nproc: int | None = field(default=None, metadata={"help": "local processes to spawn (default: the layout's product)"})
    backend: str = field(default="auto", metadata={"help": "auto (nccl with CUDA, else gloo), nccl, gloo or mpi"})
    timeout_s: float = field(default=300.0, metadata={"help": "a collective waiting longer than this fails, naming itself"})
    out: str = field(default="runs/latest", metadata={"help": "where metrics.jsonl, summary.json and the model go"})
    save_every: int = field(default=0, metadata={"help": "write a checkpoint every N steps and at the end (0: never)"})
    keep_checkpoints: int = field(default=3, metadata={"help": "how many checkpoints to keep (0: all)"})
    max_shard_size: str = field(default="50GB", metadata={
        "help": "the trained weights in --out are cut into safetensors files of at most this size, with "
                "model.safetensors.index.json, as transformers writes them (its default, 50GB; units KB, MB, GB, "
                "KiB, MiB, GiB)"})
    optimizer_kernel: str = field(default="fused", metadata={
        "help": "AdamW's kernel: fused (one kernel over every tensor, where torch has one for the device; else "
                "foreach on GPUs, loop on CPUs), foreach, loop (torch's per-tensor loop), or compiled (16-bit "
                "weights: masters, moments and weights in one torch.compile'd pass a tensor, no fp32 gradient copy)"})
    compile: bool = field(default=False, metadata={
        "help": "torch.compile each block's forward (regional compilation; graphs cached on disk for restarts; "
                "on a CPU it needs a C++ compiler)"})
    async_save: bool = field(default=False, metadata={
        "help": "write checkpoints in the background: the step boundary only copies this rank's pieces to host memory"})
    resume: str = field(default="", metadata={"help": "a checkpoint directory, or a run's --out, to continue from; auto: this run's latest checkpoint if any"})
    max_restarts: int = field(default=0, metadata={"help": "plait's spawner restarts the world from the latest checkpoint when a rank dies or hangs, at most N times"})
    min_nproc: int | None = field(default=None, metadata={
        "help": "with --max-restarts: a rank that fails in two worlds in a row is taken as lost, and the world "
                "restarts smaller, down to this many processes (dp and --grad-accum follow; default: never smaller)"})
    check_replicas: int = field(default=0, metadata={
        "help": "every N steps, and before each checkpoint, the ranks holding copies of a block of weights or "
                "optimizer state compare a hash of it: a mismatch (silent data corruption) names the ranks and "
                "stops the run, which --max-restarts resumes from the last checked checkpoint (0: never)"})
    inject: str = field(default="", metadata={
        "help": "rehearse a fault: bitflip:rank=R,step=S flips one bit of a weight on rank R as step S begins "
                "(caught by --check-replicas)"})
    measure: str = field(default="full", metadata={
        "help": "per-step measurement: full (all-rank loss, memory, traffic, pipeline timeline), light "
                "(this rank's loss and time, no collective), off (time only); first and last steps always full"})
    tensorboard: bool = field(default=False, metadata={"help": "also write TensorBoard scalars to OUT/tensorboard (rank 0)"})
    no_report: bool = field(default=False, metadata={"help": "skip the plots (plait report) at the end of the run"})
    log_level: str = field(default="warning", metadata={"help": "debug, info, warning or error; other ranks prefix [rank N]"})
    sample_tokens: int = field(default=160, metadata={"help": "length of the text sample printed at the end"})
    prompt: str = field(default="def ", metadata={"help": "text the closing sample continues"})
    hardware_file: str = field(default="", metadata={
        "help": "hardware TOML (plait calibrate) for the closing prediction; default: this machine's cached calibration"})
    sync_bn: bool = field(default=False, metadata={
        "help": "BatchNorm statistics over the whole dp group (ResNets; else rank 0's running stats are broadcast)"})
    augment: str = field(default="auto", metadata={
        "help": "image augmentation: auto (digits: crop; folders: crop,flip), none, crop or crop,flip"})

    @functools.cached_property
    def layout(self) -> Layout:
        """The run's layout record, made and checked once (after resolve_layout has set dp)."""
        return Layout(dp=self.dp or 1, **self.layout_choices())

    def layout_choices(self) -> dict[str, Any]:
        """The layout's fields besides dp, as the flags give them."""
        return dict(tp=self.tp, pp=self.pp, cp=self.cp, cp_kind=self.cp_kind, ep=self.ep, zero=self.zero,
                    dp_shard=self.dp_shard, offload=self.offload,
                    sp=self.sp, schedule=self.schedule, virtual_stages=self.virtual_stages, prefetch=self.prefetch,
                    reshard_after_forward=self.reshard_after_forward,
                    stage_layers=rules.parse_stage_layers(self.stage_layers))

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step, over all ranks (after resolve_layout has set dp)."""
        return self.micro_batch * self.grad_accum * (self.dp or 1)

    @property
    def compiles_update(self) -> bool:
        """Whether the update is the compiled pass (--optimizer-kernel compiled): what the
        optimizer is built with, and one reason the run compiles (its toolchain checked, its
        cost in the closing report), even without --compile."""
        return self.optimizer_kernel == "compiled"

    def work(self) -> dict[str, Any]:
        """The step's work as plait estimate's Workload names it (plait.estimate.layout), the
        layout aside: what a run's prediction and --memory-limit's price of a layout both read."""
        return dict(precision=self.precision, micro_batch=self.micro_batch, grad_accum=self.grad_accum,
                    seq_len=self.seq_len, recompute=self.recompute, reduce_dtype=self.reduce_dtype,
                    bucket_mb=self.bucket_mb, compiled=self.compile)

    def parallel_config(self) -> Any:
        """What `parallelize` takes besides the layout (which the mesh carries); on the ranks only
        (it imports torch)."""
        from plait.parallel.compose import ParallelConfig
        from plait.parallel.precision import reduce_dtype_of

        return ParallelConfig(bucket_mb=self.bucket_mb, recompute=self.recompute, sync_bn=self.sync_bn,
                              reduce_dtype=reduce_dtype_of(self.precision, self.reduce_dtype), compile=self.compile,
                              fp8=self.fp8_scaling if self.precision == "fp8" else "",
                              split_logits=True)  # the loss reads vocabulary slices (parallel/tensor/loss.py)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def field_names() -> list[str]:
    return [f.name for f in fields(TrainConfig)]


def load_toml(path: str) -> dict[str, Any]:
    """Read a TOML file of TrainConfig fields (dashes or underscores, top level or [train])."""
    try:
        with open(path, "rb") as handle:
            raw = tomllib.load(handle)
    except FileNotFoundError:
        raise PlaitError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise PlaitError(f"config file {path} is a directory", hint="give a .toml file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise PlaitError(f"config file {path} is not valid TOML: {exc}") from None
    if "train" in raw:  # the [train] table, or the top level: never both (one would be dropped)
        if not isinstance(raw["train"], dict) or len(raw) > 1:
            raise PlaitError(f"config file {path} has keys outside its [train] table, or a `train` that is not "
                             "a table", hint="put every key under [train], or none")
        raw = raw["train"]
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name in values:
            raise PlaitError(f"config file {path} gives {name} twice (as {name} and {name.replace('_', '-')})",
                             hint="keep one of the two spellings")
        values[name] = value
    unknown = sorted(set(values) - set(field_names()))
    if unknown:
        raise PlaitError(f"config file {path} has unknown keys: {', '.join(unknown)}",
                         hint="see `plait train --help` for the names")
    return values


class FamilyChecks(Protocol):
    """What validation asks of the model's family (plait.families.record.Family)."""

    def resolve(self, config: Any) -> Any: ...
    def check(self, config: Any) -> None: ...


def build_config(file_values: dict[str, Any], flag_values: dict[str, Any],
                 family_of: Callable[[TrainConfig], FamilyChecks] | None = None) -> TrainConfig:
    """Defaults, then the file, then the flags that were given (not None); then what the
    model's family (`family_of(config)`: plait.families.family_of) resolves, e.g. a preset's
    vocabulary following the data; then the layout."""
    given = {k: v for k, v in flag_values.items() if v is not None}
    merged = {**check_values(file_values, TrainConfig, "the config file"), **check_values(given, TrainConfig, "flag")}
    config = replace(TrainConfig(), **merged)
    if family_of is not None:
        config = family_of(config).resolve(config)
    return fit_world(resolve_layout(resolve_auto(config)))


def resolve_layout(config: TrainConfig) -> TrainConfig:
    """Fill dp and nproc from each other (plait.layout.Layout.fill) and check they agree."""
    nproc = config.nproc
    launched_world = _launched_world_size()
    if launched_world is not None:
        nproc = launched_world if nproc is None else nproc
        if nproc != launched_world:
            raise PlaitError(f"--nproc {nproc} given inside a job of {launched_world} processes",
                             hint="drop --nproc: the launcher decides the process count")
    dp = config.dp
    if dp is None and nproc is None:
        dp = 2 if config.tp * config.pp * config.cp == 1 else 1  # the demo: two data-parallel processes
    choices = config.layout_choices()
    if nproc is None:
        layout = Layout(dp=dp, **choices)
    else:
        layout = Layout.fill(nproc, dp, what="--nproc", **choices)
    return replace(config, dp=layout.dp, nproc=layout.world)


def _launched_world_size() -> int | None:
    """The world size set by an outside launcher, when there is one."""
    for name in ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if name in os.environ:
            return int(os.environ[name])
    return None


def validate(config: TrainConfig, family: FamilyChecks, *, local_limit: int | None = None) -> None:
    """Every check that needs no process group; raises PlaitError naming the fix. The
    layout's rules ran when it was made (plait.rules); the model's are its family's."""
    check_values(config.to_dict(), TrainConfig, "flag")  # every range once more: a config made in code too
    if config.nproc is not None and _launched_world_size() is None:
        check_local_nproc(config.nproc, local_limit)
    check_strategies(config)
    family.check(config)
    if config.memory_limit:
        from plait.train.config.memory_limit import check_memory_limit

        check_memory_limit(config, getattr(family, "memory", None))
    check_outputs(config)
    if config.min_nproc is not None and config.nproc is not None and config.min_nproc > config.nproc:
        raise PlaitError(f"--min-nproc {config.min_nproc} is more than --nproc {config.nproc}",
                         hint="--min-nproc is the smallest world the spawner may restart on")
    if config.save_every < 0 or config.keep_checkpoints < 0:
        raise PlaitError("--save-every and --keep-checkpoints cannot be negative")
    parse_bytes(config.max_shard_size)
    if config.resume:
        resolve(config.resume)  # fails now, with the reason, if there is nothing to resume
    check_applies(config, family)  # after the specific refusals (they name the fix better), before --out is made
    check_writable(config.out)
    check_fresh_out(config)
    check_prompt(config.prompt, config.sample_tokens)
    if config.inject:
        parse_bitflip(config.inject)


def check_prompt(prompt: str, sample_tokens: int) -> None:
    """The closing sample continues --prompt: checked now, not after the training, when a
    crash there would lose the run's outputs."""
    if not sample_tokens:
        return
    if not prompt:
        raise PlaitError("--prompt is empty: the closing sample continues it", hint="give some text, or --sample-tokens 0")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise PlaitError("--prompt is not valid UTF-8 text", hint="give UTF-8 text, or --sample-tokens 0") from None


def check_fresh_out(config: TrainConfig) -> None:
    """A run that does not resume writes its checkpoints beside no other run's: it would
    replace those of the same steps, and --keep-checkpoints would prune by step across both
    runs, deleting the new run's own."""
    if config.resume or not has_checkpoint(config.out):  # --resume auto's test, and the restarts'
        return
    latest = (Path(config.out) / "checkpoints" / "latest").resolve().name
    raise PlaitError(f"--out {config.out} holds another run's checkpoints (latest: {latest}); a new run there "
                     "would replace and prune them", hint="continue that run with --resume auto, or give another --out")


def check_strategies(config: TrainConfig) -> None:
    """What the layout runs with besides its own rules: recomputation, precision, the loss
    scale, the micro-batches a pipeline schedule takes (plait.rules, shared with the
    estimator)."""
    layout = config.layout
    rules.check_recompute(layout, config.recompute)
    rules.check_precision(config.precision, config.reduce_dtype)
    if config.precision == "fp8":
        check_fp8_launch(config)
    rules.check_sync_bn_accumulation(config.sync_bn, layout.dp, config.grad_accum)
    rules.check_optimizer_kernel(config.optimizer_kernel, config.precision, config.offload)
    if config.compile:
        rules.check_compile(layout.schedule, layout.pp)
    if config.compile or config.compiles_update:
        check_compile_toolchain(config)


def check_fp8_launch(config: TrainConfig) -> None:
    """fp8's layout, torchao and the device's float8 units, before spawning: the GPU's compute
    capability is read from nvidia-smi (torch is not imported here); each rank checks its own
    device again (plait.parallel.fp8)."""
    from plait.runtime.env import have_torchao, torch_release

    rules.check_fp8(config.layout, config.fp8_scaling)
    gpu = ranks_on_gpu(config)
    rules.check_fp8_device("cuda" if gpu else "cpu", _gpu_capability() if gpu else None, have_torchao(),
                           config.fp8_scaling, torch_release())


def _gpu_capability() -> tuple[int, int] | None:
    """The first GPU's compute capability as nvidia-smi reports it; None if it cannot say."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout.split()
        major, minor = out[0].split(".")
        return int(major), int(minor)
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return None


def check_compile_toolchain(config: TrainConfig) -> None:
    """--compile on a CPU run needs Inductor's C++ compiler: said before spawning (`ranks_on_gpu`
    guesses the device); the ranks check again on the device they run on."""
    from plait.runtime.env import cxx_compiler

    rules.check_compile_toolchain("cuda" if ranks_on_gpu(config) else "cpu", *cxx_compiler())


def ranks_on_gpu(config: TrainConfig) -> bool:
    """Whether the ranks will run on a GPU, guessed without importing torch: the nccl backend,
    or auto with a GPU this process may use (CUDA_VISIBLE_DEVICES honoured, so a GPU machine
    told to hide its GPUs is checked as the CPU machine it then is)."""
    from plait.runtime.launch import local_gpus

    return config.backend == "nccl" or (config.backend == "auto" and local_gpus() > 0)


def check_outputs(config: TrainConfig) -> None:
    """--measure, --log-level and --tensorboard: fail before spawning, not at the end."""
    from plait.train.observe.logs import LEVELS
    from plait.train.loop.measure import MODES

    if config.measure not in MODES:
        raise PlaitError(f"unknown --measure {config.measure!r}", hint=f"choose one of: {', '.join(MODES)}")
    if config.log_level not in LEVELS:
        raise PlaitError(f"unknown --log-level {config.log_level!r}", hint=f"choose one of: {', '.join(LEVELS)}")
    if config.tensorboard:
        from plait.train.observe.tboard import check_available

        check_available()


def check_writable(out: str) -> None:
    """Fail now, not after an hour of training, if the output directory cannot be written."""
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".plait-write-test-{os.getpid()}"  # one per process: ranks check at once
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise PlaitError(f"--out {out} is not writable: {exc.strerror or exc}",
                         hint="choose a directory you can write to") from None
