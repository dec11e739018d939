"""The training configuration: one typed dataclass, filled from defaults, a TOML file, then flags.

The defaults are the demo: the `small` GPT on the standard-library corpus, two processes.
All validation that needs no process group happens here, so a bad value fails before
anything is spawned, with one line saying what to change.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from plait import rules
from plait.errors import PlaitError
from plait.models.config import TRAINABLE, get_preset, preset_name
from plait.models.hf_config import is_hf, model_shape
from plait.models.resnet_config import get_resnet, is_resnet
from plait.train.tokens import model_for_data
from plait.train.config_check import check_values
from plait.train.restart import resolve_auto

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


@dataclass(frozen=True)
class TrainConfig:
    """Everything `plait train` needs; each field is also a `--flag` (underscores → dashes)."""

    model: str = field(default="small", metadata={"help": "model preset: tiny or small, with optional field overrides: tiny,n_layers=4; or resnet18, resnet34, resnet50 (resnet18,width=16); or hf:DIR, a local Hugging Face model directory (config.json; weights and tokenizer.json optional)"})
    data: str = field(default="stdlib", metadata={"help": "corpus: 'stdlib' (Python's own source), a text file or directory (up to 8 MiB), or a directory from `plait data prepare`; for a ResNet: 'digits' or a folder of class folders"})
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
    bucket_mb: float = field(default=25.0, metadata={"help": "gradient bucket size for data parallelism"})
    dp: int | None = field(default=None, metadata={"help": "data-parallel degree (default: what tp and pp leave)"})
    tp: int = field(default=1, metadata={"help": "tensor-parallel degree (Megatron-style)"})
    sp: bool = field(default=False, metadata={"help": "sequence parallelism in the norm regions (needs --tp > 1)"})
    pp: int = field(default=1, metadata={"help": "pipeline-parallel degree"})
    schedule: str = field(default="1f1b", metadata={"help": "pipeline schedule: gpipe, 1f1b, interleaved or zb-h1"})
    virtual_stages: int = field(default=1, metadata={"help": "model chunks per pipeline rank (interleaved)"})
    precision: str = field(default="fp32", metadata={
        "help": "fp32, bf16 or fp16: 16-bit weights and gradients, fp32 master weights and Adam state; "
                "fp16 with dynamic loss scaling"})
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
    nproc: int | None = field(default=None, metadata={"help": "local processes to spawn (default: the layout's product)"})
    backend: str = field(default="auto", metadata={"help": "auto (nccl with CUDA, else gloo), nccl, gloo or mpi"})
    timeout_s: float = field(default=300.0, metadata={"help": "a collective waiting longer than this fails, naming itself"})
    out: str = field(default="runs/latest", metadata={"help": "where metrics.jsonl, summary.json and the model go"})
    save_every: int = field(default=0, metadata={"help": "write a checkpoint every N steps and at the end (0: never)"})
    keep_checkpoints: int = field(default=3, metadata={"help": "how many checkpoints to keep (0: all)"})
    resume: str = field(default="", metadata={"help": "a checkpoint directory, or a run's --out, to continue from; auto: this run's latest checkpoint if any"})
    max_restarts: int = field(default=0, metadata={"help": "plait's spawner restarts the world from the latest checkpoint when a rank dies or hangs, at most N times"})
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

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step, over all ranks (after resolve_layout has set dp)."""
        return self.micro_batch * self.grad_accum * (self.dp or 1)

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
    except tomllib.TOMLDecodeError as exc:
        raise PlaitError(f"config file {path} is not valid TOML: {exc}") from None
    raw = raw.get("train", raw)
    values = {key.replace("-", "_"): value for key, value in raw.items()}
    unknown = sorted(set(values) - set(field_names()))
    if unknown:
        raise PlaitError(f"config file {path} has unknown keys: {', '.join(unknown)}",
                         hint="see `plait train --help` for the names")
    return values


def build_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> TrainConfig:
    """Defaults, then the file, then the flags that were given (not None)."""
    given = {k: v for k, v in flag_values.items() if v is not None}
    merged = {**check_values(file_values, TrainConfig, "the config file"), **check_values(given, TrainConfig, "flag")}
    config = replace(TrainConfig(), **merged)
    if not is_resnet(config.model) and not is_hf(config.model):  # a preset's vocabulary follows the data
        config = replace(config, model=model_for_data(config.model, config.data))
    return resolve_layout(resolve_auto(config))


def resolve_layout(config: TrainConfig) -> TrainConfig:
    """Fill dp and nproc from each other and check they agree."""
    dp, nproc = config.dp, config.nproc
    launched_world = _launched_world_size()
    if launched_world is not None:
        nproc = launched_world if nproc is None else nproc
        if nproc != launched_world:
            raise PlaitError(f"--nproc {nproc} given inside a job of {launched_world} processes",
                             hint="drop --nproc: the launcher decides the process count")
    model_parallel = config.tp * config.pp
    if dp is None and nproc is None:
        dp = 2 if model_parallel == 1 else 1  # the demo: two data-parallel processes
    if dp is None:
        if nproc % model_parallel:
            raise PlaitError(f"--nproc {nproc} is not divisible by tp={config.tp} × pp={config.pp}",
                             hint="choose tp and pp whose product divides the number of processes")
        dp = nproc // model_parallel
    world = dp * model_parallel
    nproc = nproc or world
    if world != nproc:
        raise PlaitError(f"layout dp={dp} × tp={config.tp} × pp={config.pp} = {world} does not match --nproc {nproc}",
                         hint=f"use --nproc {world}, or change the degrees")
    return replace(config, dp=dp, nproc=nproc)


def _launched_world_size() -> int | None:
    """The world size set by an outside launcher, when there is one."""
    for name in ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if name in os.environ:
            return int(os.environ[name])
    return None


def max_local_processes() -> int:
    """How many processes one machine may run: one per GPU, or a few per CPU core."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    except ImportError:
        pass
    return max(8, 4 * (os.cpu_count() or 1))


def validate(config: TrainConfig, *, local_limit: int | None = None) -> None:
    """Every check that needs no process group; raises PlaitError naming the fix."""
    if is_resnet(config.model):
        check_image_model(config)
    elif is_hf(config.model):
        from plait.train.hf_check import check_hf_run

        check_hf_run(config)  # the directory, its tokenizer and the data agree; --seq-len fits
    else:
        get_preset(config.model)  # raises naming the presets, or the override that is wrong
        if preset_name(config.model) not in TRAINABLE:
            raise PlaitError(f"model preset {config.model!r} is shape-only (for estimates)",
                             hint=f"train one of: {', '.join(TRAINABLE)}; use `plait estimate --model {config.model}`")
        if config.sync_bn:
            raise PlaitError(f"--sync-bn shares BatchNorm statistics, and model {config.model!r} has no BatchNorm",
                             hint="drop --sync-bn, or train a ResNet (--model resnet18 --data digits)")
    for name in ("steps", "micro_batch", "grad_accum", "seq_len", "eval_samples"):
        if getattr(config, name) < 1:
            raise PlaitError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(config, name)}")
    if config.lr <= 0:
        raise PlaitError(f"--lr must be positive, got {config.lr}")
    max_seq = model_shape(config.model).max_seq_len if not is_resnet(config.model) else config.seq_len
    if config.seq_len > max_seq:
        raise PlaitError(f"--seq-len {config.seq_len} is longer than model {config.model!r} allows ({max_seq})",
                         hint=f"use --seq-len {max_seq} or less")
    limit = local_limit if local_limit is not None else max_local_processes()
    if config.nproc is not None and _launched_world_size() is None and config.nproc > limit:
        raise PlaitError(f"--nproc {config.nproc} is more than this machine allows ({limit})",
                         hint="use fewer processes, or launch across nodes with torchrun or srun")
    check_strategies(config)
    if not is_resnet(config.model):
        check_data(config.data)  # images: check_image_model above
    check_outputs(config)
    if config.save_every < 0 or config.keep_checkpoints < 0:
        raise PlaitError("--save-every and --keep-checkpoints cannot be negative")
    if config.resume:
        from plait.train.checkpoint_read import resolve

        resolve(config.resume)  # fails now, with the reason, if there is nothing to resume
    check_writable(config.out)


def check_strategies(config: TrainConfig) -> None:
    """Each strategy's own checks, and the combinations that are not built yet: the rules
    `plait estimate` and `plait plan` apply too (plait.rules), then the pipeline's own."""
    from plait.parallel.compose import ParallelConfig

    for name in ("tp", "pp", "virtual_stages"):
        if getattr(config, name) < 1:
            raise PlaitError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(config, name)}")
    ParallelConfig(bucket_mb=config.bucket_mb, zero=config.zero, offload=config.offload)
    model = model_shape(config.model) if config.tp > 1 or config.pp > 1 else None  # a ResNet has no GPT shape
    rules.check_strategy_choices(schedule=config.schedule, precision=config.precision, recompute=config.recompute,
                                 zero=config.zero, reduce_dtype=config.reduce_dtype)
    if not config.loss_scale >= 1:
        raise PlaitError(f"--loss-scale must be at least 1, got {config.loss_scale}", hint="the default is 65536")
    rules.check_combination(tp=config.tp, pp=config.pp, zero=config.zero, offload=config.offload, sp=config.sp,
                            recompute=config.recompute, schedule=config.schedule)
    if model is not None:
        rules.check_tensor_parallel(model, config.tp, config.sp, config.seq_len)
    rules.check_pipeline_shape(model.n_layers if model else None, pp=config.pp, virtual_stages=config.virtual_stages,
                               schedule=config.schedule, microbatches=config.grad_accum)
    if config.pp > 1:
        from plait.parallel.pipeline.runner import check_pipeline

        check_pipeline(model.n_layers, config.pp, config.schedule, config.grad_accum,
                       virtual_stages=config.virtual_stages)


def check_outputs(config: TrainConfig) -> None:
    """--measure, --log-level and --tensorboard: fail before spawning, not at the end."""
    from plait.train.logs import LEVELS
    from plait.train.measure import MODES

    if config.measure not in MODES:
        raise PlaitError(f"unknown --measure {config.measure!r}", hint=f"choose one of: {', '.join(MODES)}")
    if config.log_level not in LEVELS:
        raise PlaitError(f"unknown --log-level {config.log_level!r}", hint=f"choose one of: {', '.join(LEVELS)}")
    if config.tensorboard:
        from plait.train.tboard import check_available

        check_available()


def check_data(source: str) -> None:
    """--data exists and can be used whole: a prepared corpus passes its cheap checks, raw
    text is small enough to hold (the full checksum waits for the ranks: plait/train/tokens.py)."""
    from plait.train.data import STDLIB, raw_files
    from plait.train.tokens import check_tokens, is_prepared

    if is_prepared(source):
        check_tokens(source, full=False)
    elif source != STDLIB:
        raw_files(source)


def check_image_model(config: TrainConfig) -> None:
    """A ResNet trains data-parallel (DDP or ZeRO): no tensor or pipeline split, no text sample."""
    get_resnet(config.model)  # raises naming the presets, or the override that is wrong
    if config.tp > 1 or config.pp > 1:
        raise PlaitError(f"--model {config.model} is trained data-parallel only (DDP or --zero), not with "
                         "--tp or --pp", hint="drop --tp and --pp; use --nproc for more data-parallel ranks")


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
