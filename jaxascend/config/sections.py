"""The other sections of a run config (data, optimizer, offload, checkpoint, export, train, eval) and
:class:`Config`, which holds one of each."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from jaxascend.config.model import ModelConfig
from jaxascend.config.values import ConfigError, DType, check_range, parse_bytes


@dataclass
class DataConfig:
    """Where text comes from, how it is tokenized and packed into batches."""

    # Files or directories of UTF-8 text (.txt; for the tiny default, .py), .jsonl, .parquet and
    # .arrow files, and Hugging Face datasets folders (save_to_disk). "@stdlib" stands for the
    # running Python's standard library folder.
    paths: list[str] = field(default_factory=list)
    # globs inside directories (a datasets folder met there is taken whole, whatever they say)
    include: list[str] = field(default_factory=lambda: ["*.txt", "*.jsonl", "*.parquet", "*.arrow"])
    text_field: str = "text"  # JSONL field / table column holding the text
    # "auto": the model folder's tokenizer when model.path is set, else "byte"; "byte"; "model"
    # (model.path's); or a local Hugging Face tokenizer folder.
    tokenizer: str = "auto"
    seq_len: int = 256  # tokens per row (each row holds seq_len + 1 tokens: inputs and shifted targets)
    # Rows per micro-batch; in a job, in all: they must split evenly over its processes (refused
    # otherwise) and over each process's devices (else those devices go unused, said in a note).
    batch_size: int = 8
    seed: int = 0  # shuffles the documents (and the examples) each epoch
    max_documents: Optional[int] = None  # cap on documents read (None: all)
    # "auto": what the first record of each file holds, said in a note (a messages_field: chat;
    # prompt_field / completion_field: prompt_completion; text_field: text; plain text files such
    # as .txt and "@stdlib": text); files of two formats are refused. "text": documents packed back
    # to back, every token trained on; "prompt_completion": records (JSONL lines, table rows) with
    # prompt_field / completion_field; "chat": records whose messages_field is a list of
    # {"role", "content"} (OpenAI / Hugging Face form), rendered with the tokenizer's chat template
    # or the chat_template file. For those two the loss covers the completion / assistant tokens
    # only, unless train_on_prompt.
    format: Literal["auto", "text", "prompt_completion", "chat"] = "auto"
    prompt_field: str = "prompt"  # prompt_completion: the JSONL field of the prompt
    completion_field: str = "completion"  # prompt_completion: the JSONL field of the completion
    messages_field: str = "messages"  # chat: the JSONL field of the list of messages
    chat_template: Optional[str] = None  # chat: a Jinja template file; None: the tokenizer's own
    train_on_prompt: bool = False  # prompt_completion / chat: the loss covers every token, prompts included
    # Examples (prompt_completion, chat) are packed several to a row, attention kept inside each
    # example (segment ids) and positions restarting per example; false: one example per row,
    # padded. An example longer than a row (seq_len + 1 tokens) is truncated or dropped.
    packing: bool = True
    overlong: Literal["truncate", "drop"] = "truncate"  # what becomes of an example longer than a row

    def __post_init__(self):
        check_range("data.seq_len", self.seq_len, lo=2)
        check_range("data.batch_size", self.batch_size, lo=1)
        check_range("data.max_documents", self.max_documents, lo=1)
        for name in ("text_field", "prompt_field", "completion_field", "messages_field"):
            if not getattr(self, name):
                raise ConfigError(f"data.{name}: must be a non-empty field name")
        if self.format not in ("auto", "text", "prompt_completion", "chat"):
            raise ConfigError(f"data.format: expected one of 'auto', 'text', 'prompt_completion', 'chat', got "
                              f"{self.format!r}")
        if self.prompt_field == self.completion_field:
            raise ConfigError(f"data.completion_field: {self.completion_field!r} is also data.prompt_field")
        if self.overlong not in ("truncate", "drop"):
            raise ConfigError(f"data.overlong: expected 'truncate' or 'drop', got {self.overlong!r}")
        if self.chat_template is not None and self.format not in ("chat", "auto"):  # auto: once resolved
            raise ConfigError(f"data.chat_template: only used with data.format: chat (format is {self.format!r})")


@dataclass
class EvalConfig:
    """Held-out evaluation on the compute params (no optimizer state is touched, no gradient
    sent), and samples from the trained model at the end of the run."""

    # Files or directories read like data.paths, with data's format, fields and tokenizer.
    paths: list[str] = field(default_factory=list)
    every_steps: int = 0  # 0: at the end of the run only (when paths are given)
    batches: Optional[int] = None  # batches per evaluation; None: the whole held-out set
    batch_size: Optional[int] = None  # None: data.batch_size; split over a job's processes and devices as it is
    # Prompts answered (greedy unless sample_temperature > 0) at the end of the run; with
    # data.format: chat each is sent as one user message through the chat template.
    sample_prompts: list[str] = field(default_factory=list)
    sample_max_tokens: int = 64  # new tokens per sample prompt at most
    sample_temperature: float = 0.0  # 0: greedy
    sample_top_p: float = 1.0  # nucleus sampling mass, in (0, 1]

    def __post_init__(self):
        check_range("eval.every_steps", self.every_steps, lo=0)
        check_range("eval.batches", self.batches, lo=1)
        check_range("eval.batch_size", self.batch_size, lo=1)
        check_range("eval.sample_max_tokens", self.sample_max_tokens, lo=1)
        check_range("eval.sample_temperature", self.sample_temperature, lo=0)
        check_range("eval.sample_top_p", self.sample_top_p, lo=0, hi=1, lo_open=True)


@dataclass
class OptimizerConfig:
    """AdamW with an optional warmup + decay schedule and global-norm clipping."""

    learning_rate: float = 3e-4  # peak learning rate (after the warmup)
    schedule: Literal["constant", "cosine", "linear"] = "cosine"  # the decay after the warmup
    warmup_steps: int = 0  # linear warmup from 0 to learning_rate over this many steps
    # The schedule's length in steps (warmup included). None: train.steps of the run's first
    # start, recorded in its checkpoints, so a resumed run with a larger train.steps keeps it.
    decay_steps: Optional[int] = None
    min_lr_ratio: float = 0.1  # final lr = learning_rate * min_lr_ratio for cosine/linear
    b1: float = 0.9  # Adam's first-moment decay
    b2: float = 0.95  # Adam's second-moment decay
    eps: float = 1e-8  # added to sqrt(v) in Adam's denominator
    weight_decay: float = 0.0  # decoupled (AdamW) weight decay, times the learning rate; see weight_decay_mask
    # Which parameters weight_decay applies to: "default" (all but biases and norm weights, the
    # parameters named *.bias and *.scale), "default_no_embed" (also not the embeddings,
    # *.embedding), "all", or a regular expression searched in each parameter's dotted path (e.g.
    # layers.mlp.up_proj.kernel): the parameters it matches decay, the others do not.
    weight_decay_mask: str = "default"
    grad_clip_norm: Optional[float] = 1.0  # None: no clipping
    # Loss scaling: "dynamic" scales fp16 compute only (bf16/fp32 need none), "always" scales any
    # dtype, "none" never. Overflowing steps are skipped and the scale multiplied by backoff.
    loss_scale: Literal["dynamic", "always", "none"] = "dynamic"
    loss_scale_init: float = 2.0**15  # the first loss scale
    loss_scale_growth: float = 2.0  # factor the scale grows by after loss_scale_growth_interval finite steps
    loss_scale_backoff: float = 0.5  # factor the scale shrinks by after an overflow
    loss_scale_growth_interval: int = 2000  # finite steps in a row before the scale grows
    loss_scale_min: float = 1.0  # the scale never goes below this
    loss_scale_max: float = 2.0**24  # nor above this
    # How m and v are stored on SSD (needs offload.enabled; the fp32 master weights stay fp32):
    # float32 (12 B/param of state), bfloat16 (8) or int8 (6 + 8/block: block-wise 8-bit codes
    # with a float32 scale per block of state_block elements, 256-2048).
    state_dtype: Literal["float32", "bfloat16", "int8"] = "float32"
    state_block: int = 2048  # int8 state: elements per scale block (a power of two, 256-2048)
    # How bfloat16/int8 moments are rounded: "stochastic" (v in both, and int8's m; seeded by
    # train.seed, the update count and the element; reproducible) or "nearest" even, under which
    # a moment stops following the gradients once a step changes it by less than half an ulp
    # (jaxascend.optim.state_codes). bfloat16 m is always rounded to nearest.
    state_rounding: Literal["stochastic", "nearest"] = "stochastic"
    # The master weights (needs offload.enabled): float32 (4 B/param, beside the compute copy), or
    # bfloat16: the bf16 compute weights are the master (needs model.dtype: bfloat16), 2 B/param
    # read and written by the update, no separate copy.
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    # How a bfloat16 master takes an update: "compensated" keeps the float32 master's low 16 bits
    # in a companion (2 B/param more), so master and companion are the float32 master exactly,
    # or "stochastic" rounds with reproducible random bits (seeded as state_rounding's), or
    # "nearest" (an ablation: an update under half a bfloat16 ulp is lost, so at a fine-tuning
    # learning rate the weights stop moving; docs/bench_master_quality.md).
    master_rounding: Literal["compensated", "stochastic", "nearest"] = "compensated"

    def __post_init__(self):
        if not (256 <= self.state_block <= 2048 and self.state_block & (self.state_block - 1) == 0):
            raise ConfigError(f"optimizer.state_block: {self.state_block} must be a power of two in [256, 2048]")
        check_range("optimizer.learning_rate", self.learning_rate, lo=0)
        check_range("optimizer.warmup_steps", self.warmup_steps, lo=0)
        check_range("optimizer.decay_steps", self.decay_steps, lo=1)
        check_range("optimizer.min_lr_ratio", self.min_lr_ratio, lo=0, hi=1)
        check_range("optimizer.b1", self.b1, lo=0, hi=1, hi_open=True)
        check_range("optimizer.b2", self.b2, lo=0, hi=1, hi_open=True)
        check_range("optimizer.eps", self.eps, lo=0, lo_open=True)
        check_range("optimizer.weight_decay", self.weight_decay, lo=0)
        check_decay_mask(self.weight_decay_mask)
        check_range("optimizer.grad_clip_norm", self.grad_clip_norm, lo=0, lo_open=True)
        check_range("optimizer.loss_scale_init", self.loss_scale_init, lo=0, lo_open=True)
        check_range("optimizer.loss_scale_growth", self.loss_scale_growth, lo=1)
        check_range("optimizer.loss_scale_backoff", self.loss_scale_backoff, lo=0, hi=1, lo_open=True, hi_open=True)
        check_range("optimizer.loss_scale_growth_interval", self.loss_scale_growth_interval, lo=1)
        check_range("optimizer.loss_scale_min", self.loss_scale_min, lo=0, lo_open=True)
        if self.loss_scale_max < self.loss_scale_min:
            raise ConfigError(f"optimizer.loss_scale_max: {self.loss_scale_max} is below "
                              f"optimizer.loss_scale_min={self.loss_scale_min}")


WEIGHT_DECAY_MASKS = ("default", "default_no_embed", "all")  # besides a regular expression


def check_decay_mask(rule: str) -> None:
    """Refuses an ``optimizer.weight_decay_mask`` that is neither a named rule nor a regular expression."""
    if rule in WEIGHT_DECAY_MASKS:
        return
    try:
        re.compile(rule)
    except re.error as err:
        raise ConfigError(f"optimizer.weight_decay_mask: {rule!r} is neither one of {', '.join(WEIGHT_DECAY_MASKS)} "
                          f"nor a regular expression ({err})") from None
    if not rule:
        raise ConfigError(f"optimizer.weight_decay_mask: empty; expected one of {', '.join(WEIGHT_DECAY_MASKS)} or a "
                          "regular expression of parameter paths")


PARAM_PLACEMENTS = ("auto", "resident", "ssd")
GRADIENT_PLACEMENTS = ("auto", "ssd", "host")
IO_ENGINES = ("auto", "io_uring", "threads")


@dataclass
class OffloadConfig:
    """Optimizer state and gradients on SSD, streamed through a preallocated host arena.

    Sizes accept integers or strings like ``"64MiB"``. The SSD engine needs
    ``block_bytes`` to be a multiple of 4096 and ``chunk_bytes``, ``shard_bytes`` and
    ``staging_bytes`` to be multiples of ``block_bytes`` (I/O addresses whole blocks).
    """

    # true (the default): the offloaded engine (the AdamW state and the gradients on SSD); false:
    # the in-memory engine, everything in RAM (one process, one device; no overlap, no
    # offload.params: ssd; configs/tiny-in-memory.yaml).
    enabled: bool = True
    # Shard files live here (locked while a run uses it); None: <train.out_dir>/offload. "{process}"
    # in it becomes the process number (a multi-process job: each process its own directory).
    dir: Optional[str] = None
    arena_bytes: Optional[Any] = None  # e.g. "2GiB"; None: exactly what the arena plan needs
    # e.g. "16GiB": the run's host memory (the plan's total, the arena included) must fit in it,
    # and offload.params: auto plans against it. None: what the machine can give (MemAvailable or
    # the memory cgroup's headroom; see `python -m jaxascend.plan`).
    host_memory_budget: Optional[Any] = None
    # Streaming granularity of the optimizer step: 8 MiB read and wrote faster than 64 MiB
    # (docs/bench_io.md: 3.24 vs 2.55 GB/s reads) and keeps the arena 8x smaller.
    chunk_bytes: Any = "8MiB"
    # "io_uring" (one ring thread, queue_depth requests in flight), "threads" (io_threads
    # pread/pwrite workers), or "auto": io_uring where the kernel allows it, else threads.
    io_engine: str = "auto"
    queue_depth: int = 8  # io_uring: requests in flight (the measured best; docs/bench_io.md)
    io_threads: int = 8  # the threads engine: pread/pwrite workers = requests in flight
    direct_io: bool = True  # O_DIRECT; falls back to buffered + fadvise where refused
    block_bytes: Any = "1MiB"  # checksum block = I/O request size
    shard_bytes: Any = "1GiB"  # largest shard file
    staging_bytes: Any = "8MiB"  # each arena staging slot (copies in/out, gradient writes)
    staging_slots: int = 2  # staging slots: copy one while another is written
    stream_depth: int = 3  # pipeline stages: 1 in use, depth-2 read ahead, 1 written behind
    lock_memory: bool = True  # mlock the arena (warns and continues unlocked if refused)
    pin_memory: bool = True  # cudaHostRegister the arena when a CUDA device is present
    # Advise the arena into transparent huge pages: a 1 MiB block then leaves as one disk request,
    # not two (4 KiB pages exceed the 254 segments a virtio request takes; docs/bench_io.md).
    huge_pages: bool = True
    preallocate: bool = True  # fallocate shard space up front, so a full disk fails early
    kernel_threads: int = 1  # threads of the fused AdamW kernel per chunk (the step is I/O bound)
    # Where the compute-dtype weights of the layer stack live: "resident" (device memory; on a
    # CPU machine, RAM: 2 B/param), "ssd" (shard store regions beside master/m/v, read layer by
    # layer during the step: a few layers in RAM; needs offload.enabled and model.remat other than
    # none, refused with post_backward_overflow_check), or "auto": resident if the run's plan fits
    # host_memory_budget (without one: what the machine can give, MemAvailable or the memory
    # cgroup's headroom), else ssd where the config allows it (else resident over the limit). The
    # choice is said in a note. See `python -m jaxascend.plan`.
    params: str = "auto"
    param_prefetch: int = 2  # layers the parameter source reads ahead (arena slots of one layer each)
    # Where each step's gradients wait for the update: "ssd" (written by the backward, read by the
    # update: 2 + 2 B/param of SSD traffic a step and 2 B/param on disk), "host" (the same
    # regions kept in RAM: 2 B/param of host memory, no SSD round trip), or "auto": host when
    # the run's plan still fits with it, 10% free (after offload.params chose), else as many
    # layers as fit so (host_gradient_layers), else ssd; said in a note.
    # ssd and host need offload.enabled, and are refused with fp32_grad_buffer (leave it auto).
    gradients: str = "auto"
    # With gradients host: only the layer stack's first N layers keep their gradients in RAM, the
    # other layers' and leaves' go to SSD (null: every one in RAM). Refused with ssd and auto.
    host_gradient_layers: Optional[int] = None
    # The optimizer of step t runs on a thread while step t+1's forward/backward runs, layer by
    # layer behind it (bit-identical results): in the offloaded engine, with train.grad_accum > 1
    # and in a job too. Off (said once, in a note) with fp32_grad_buffer,
    # post_backward_overflow_check, or resident weights (params resident, or auto's choice) under
    # model.remat: none.
    overlap: bool = True
    # Buffered I/O only (direct_io false, or the O_DIRECT fallback): drop each block from the
    # page cache after it is read or written. False is ZeRO-Infinity's page-cache I/O: the kernel
    # keeps (and writes back, when it likes) every page it has seen, up to 14 B/param.
    drop_page_cache: bool = True
    # Ablation switches: each brings back one host-memory habit of a ZeRO-Infinity-style
    # offload, so its cost can be measured (docs/architecture.md, "Ablation switches"). All
    # false is jaxascend; all true (with direct_io and drop_page_cache false) is the baseline.
    # None changes the arithmetic: the losses and the SSD state stay the same.
    pow2_buffers: bool = False  # every arena buffer rounded up to a power of two bytes
    single_pool: bool = False  # one pool of step buffers, each sized for the largest tensor
    fp32_grad_buffer: bool = False  # gradients land in a full fp32 host buffer (4 B/param); no overlap, one device
    # The full gradient tree, then a scan with temporaries; no overlap, one device, no params: ssd.
    post_backward_overflow_check: bool = False
    # Keep the offload files after a finished run. False: they are removed once the final
    # checkpoint is complete (a resume rebuilds them from it); they hold the whole optimizer state.
    keep_files: bool = False
    # Every step a resume point: each state record is written to a free slot of its ring and a
    # journal in offload.dir names the step the files hold, so a run killed anywhere resumes from
    # its last complete step without a checkpoint (docs/architecture.md, "Durable steps"). The
    # step's gradients are the redo log: with them in RAM (offload.gradients host) each update
    # first copies them to a log on SSD (2 B/param written a step, 2 B/param of disk).
    # Needs offload.enabled; refused with offload.fp32_grad_buffer. In a job each process keeps its
    # own journal, and the job resumes from the latest step every process's files reach.
    durable: bool = False
    # Spare records per slot ring (at least stream_depth: a commit waits for no I/O; each commits
    # about spares - 2 chunks): spares x the largest record of disk (chunk_bytes x 3 at fp32 state).
    durable_spares: int = 8

    def __post_init__(self):
        if self.arena_bytes is not None:
            self.arena_bytes = parse_bytes(self.arena_bytes, "offload.arena_bytes")
            check_range("offload.arena_bytes", self.arena_bytes, lo=4096)
        if self.host_memory_budget is not None:
            self.host_memory_budget = parse_bytes(self.host_memory_budget, "offload.host_memory_budget")
            check_range("offload.host_memory_budget", self.host_memory_budget, lo=4096)
        if self.io_engine not in IO_ENGINES:
            raise ConfigError(f"offload.io_engine: {self.io_engine!r} is not one of {', '.join(IO_ENGINES)}")
        check_range("offload.queue_depth", self.queue_depth, lo=1, hi=256)
        check_range("offload.io_threads", self.io_threads, lo=1, hi=64)
        check_range("offload.staging_slots", self.staging_slots, lo=1, hi=64)
        check_range("offload.stream_depth", self.stream_depth, lo=2, hi=64)
        check_range("offload.durable_spares", self.durable_spares, lo=1, hi=1024)
        check_range("offload.kernel_threads", self.kernel_threads, lo=1, hi=256)
        if self.params not in PARAM_PLACEMENTS:
            raise ConfigError(f"offload.params: {self.params!r} is not one of {', '.join(PARAM_PLACEMENTS)}")
        check_range("offload.param_prefetch", self.param_prefetch, lo=1, hi=64)
        if self.gradients not in GRADIENT_PLACEMENTS:
            raise ConfigError(f"offload.gradients: {self.gradients!r} is not one of {', '.join(GRADIENT_PLACEMENTS)}")
        if self.host_gradient_layers is not None:
            check_range("offload.host_gradient_layers", self.host_gradient_layers, lo=1, hi=1 << 20)
        self.block_bytes = parse_bytes(self.block_bytes, "offload.block_bytes")
        check_range("offload.block_bytes", self.block_bytes, lo=4096, hi=1 << 30)
        if self.block_bytes % 4096:
            raise ConfigError(f"offload.block_bytes: must be a multiple of 4096, got {self.block_bytes}")
        for name in ("chunk_bytes", "shard_bytes", "staging_bytes"):
            value = parse_bytes(getattr(self, name), f"offload.{name}")
            check_range(f"offload.{name}", value, lo=self.block_bytes)
            if value % self.block_bytes:
                raise ConfigError(f"offload.{name}: must be a multiple of offload.block_bytes="
                                  f"{self.block_bytes}, got {value}")
            setattr(self, name, value)


@dataclass
class CheckpointConfig:
    """Orbax checkpoints of the whole training state (see :mod:`jaxascend.checkpoint.manager`)."""

    dir: Optional[str] = None  # None: <train.out_dir>/checkpoints
    every_steps: int = 0  # 0: only at the end
    every_minutes: float = 0.0  # also once this many minutes of training passed since the last save; 0: off
    keep_last: int = 2  # complete checkpoints kept (older ones are deleted)
    # false: no checkpoint at the end of the run (unless every_steps falls there): its outputs
    # (params.safetensors, the export) hold the trained weights, and the disk of a state copy is saved.
    final: bool = True
    async_save: bool = True  # small items (params, meta) are written in the background
    compression: Literal["none", "zstd"] = "none"  # of the streamed optimizer-state arrays
    cleanup_partial: bool = True  # remove half-written saves (Orbax tmp dirs) when opening dir

    def __post_init__(self):
        check_range("checkpoint.every_steps", self.every_steps, lo=0)
        check_range("checkpoint.every_minutes", self.every_minutes, lo=0)
        check_range("checkpoint.keep_last", self.keep_last, lo=1)
        if self.compression not in ("none", "zstd"):
            raise ConfigError(f"checkpoint.compression: expected one of 'none', 'zstd', got {self.compression!r}")


@dataclass
class ExportConfig:
    """Hugging Face export of the trained weights (later: ``python -m jaxascend.export``)."""

    enabled: bool = False  # write a Hugging Face folder at the end of the run
    dir: Optional[str] = None  # None: <train.out_dir>/hf
    # dtype the exported weights are stored in; "source": that of the checkpoint the run started
    # from (model.path), or model.param_dtype for a run from scratch.
    dtype: Union[Literal["source"], DType] = "source"
    shard_bytes: Any = "5GB"  # largest safetensors shard (transformers' default)
    save_params: bool = True  # write <train.out_dir>/params.safetensors so a run can be exported later

    def __post_init__(self):
        self.shard_bytes = parse_bytes(self.shard_bytes, "export.shard_bytes")
        check_range("export.shard_bytes", self.shard_bytes, lo=1)


@dataclass
class DistributedConfig:
    """One process of a multi-process job on JAX's own runtime (``jax.distributed``).

    ``coordinator`` / ``num_processes`` / ``process_id`` name the job explicitly; left unset,
    ``jax.distributed.initialize()`` finds them itself: the ``JAX_COORDINATOR_ADDRESS`` /
    ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` variables (``python -m jaxascend.launch`` sets
    them), SLURM or Open MPI. The timeouts bound how long a process waits for the others at the
    start, how soon a dead peer is noticed, and how long the end waits for the rest."""

    coordinator: Optional[str] = None  # "host:port" of process 0's coordination service
    num_processes: Optional[int] = None  # processes in the job
    process_id: Optional[int] = None  # this process's index, 0 .. num_processes - 1
    initialization_timeout_seconds: int = 300  # how long a process waits for the others at the start
    heartbeat_timeout_seconds: int = 100  # how soon a dead peer is noticed
    shutdown_timeout_seconds: int = 300  # how long the end waits for the rest

    def __post_init__(self):
        check_range("train.distributed.num_processes", self.num_processes, lo=1)
        check_range("train.distributed.process_id", self.process_id, lo=0)
        for name in ("initialization_timeout_seconds", "heartbeat_timeout_seconds", "shutdown_timeout_seconds"):
            check_range(f"train.distributed.{name}", getattr(self, name), lo=1)
        given = [self.coordinator is not None, self.num_processes is not None, self.process_id is not None]
        if any(given) and not all(given):
            raise ConfigError("train.distributed: give coordinator, num_processes and process_id together, "
                              "or none of them (then the environment says: JAX_* variables, SLURM, Open MPI)")
        if self.coordinator is not None and (":" not in self.coordinator or
                                             not self.coordinator.rsplit(":", 1)[1].isdigit()):
            raise ConfigError(f"train.distributed.coordinator: expected host:port, got {self.coordinator!r}")
        if all(given) and self.process_id >= self.num_processes:
            raise ConfigError(f"train.distributed.process_id: {self.process_id} is not below "
                              f"num_processes={self.num_processes}")


# train.report_to -> (the module it writes with, how to install it)
REPORT_BACKENDS = {"tensorboard": ("tensorboardX", "pip install tensorboardX"),
                   "wandb": ("wandb", "pip install wandb (or pip install -e '.[wandb]')")}

# train.steps when neither it nor train.epochs is given.
DEFAULT_STEPS = 100

# The signals a run can be told to stop on (train.stop_signals); all of them by default.
STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1", "SIGHUP")

@dataclass
class TrainConfig:
    """The loop: how long, how often to log, where outputs go."""

    steps: Optional[int] = None  # optimizer steps of the whole run; null: 100, or train.epochs's count when given
    # Passes over the data, instead of train.steps: give one of the two (both in one place is an
    # error; a --set of one over a config file's other replaces it, said in a note). The
    # run's first phase counts the steps from the data: the batches until every document or example
    # of the epochs was in one (a fraction: the first part of an epoch's seeded order; each is
    # tokenized once to count), over train.grad_accum rounded up, so each batch is trained on once
    # and a last step the epochs leave short takes its other micro-batches from the data after
    # them. One note says the count (python -m jaxascend.plan too, once the data is there);
    # train.steps is then that count in config.yaml, the checkpoints and the schedule, and a resume
    # counts the same data to the same steps.
    epochs: Optional[float] = None
    seed: int = 0  # the init of a model from scratch, stochastic rounding of compressed state, sampling
    grad_accum: int = 1  # micro-batches per optimizer step, each layer running them in turn (overlap and jobs alike)
    log_every: int = 10  # a metrics.jsonl record (and a progress bar update of the figures) every N steps
    out_dir: str = "runs/default"  # metrics.jsonl and checkpoints go here
    progress: bool = True  # show a progress bar
    # "auto": newest complete checkpoint in checkpoint.dir (fresh start if none); "none": fresh
    # start; an integer: that step's checkpoint (an error if it is missing).
    resume: Union[Literal["auto", "none"], int] = "auto"
    # Stop after this step, saving a checkpoint there, as if interrupted (a time-boxed job): the
    # run writes its metrics and summary.json but not the final weights or export, and says how to
    # go on: the same command without train.stop_at_step (or with a later step) resumes from that
    # checkpoint. None: run to train.steps.
    stop_at_step: Optional[int] = None
    # A multi-process job (see DistributedConfig); None: one process, unless the environment
    # says otherwise (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES set, as jaxascend.launch does).
    # Data parallel: needs offload.enabled (each process holds its slice of the SSD state).
    distributed: Optional[DistributedConfig] = None
    # Signals that stop the run at the end of the step in flight, with a checkpoint of that step
    # (exit status 128 + the signal); a second SIGINT abandons the step in flight.
    stop_signals: list[str] = field(default_factory=lambda: list(STOP_SIGNALS))
    # Where the figures go besides metrics.jsonl (process 0 only): "tensorboard" (event files in
    # <out_dir>/tensorboard), "wandb" (a W&B run in <out_dir>/wandb, if wandb is installed; project
    # WANDB_PROJECT, online or offline as WANDB_MODE says). Every metrics.jsonl field, the held-out
    # loss and the end-of-run samples (as text).
    report_to: list[Literal["tensorboard", "wandb"]] = field(default_factory=list)

    def __post_init__(self):
        self.resume = validate_resume(self.resume)
        if len(set(self.report_to)) != len(self.report_to):
            raise ConfigError(f"train.report_to: each of {', '.join(REPORT_BACKENDS)} at most once, got {self.report_to!r}")
        unknown = [s for s in self.stop_signals if s not in STOP_SIGNALS]
        if unknown or len(set(self.stop_signals)) != len(self.stop_signals):
            raise ConfigError(f"train.stop_signals: expected some of {', '.join(STOP_SIGNALS)} (each once), got "
                              f"{self.stop_signals!r}")
        check_range("train.steps", self.steps, lo=1)
        check_range("train.epochs", self.epochs, lo=0, lo_open=True)
        if self.steps is not None and self.epochs is not None:
            raise ConfigError(f"train.epochs: give train.steps or train.epochs, not both (steps {self.steps}, "
                              f"epochs {self.epochs:g})")
        if self.epochs is None and self.steps is None:
            self.steps = DEFAULT_STEPS
        # With train.epochs the last step is known once the data is counted (checked there).
        check_range("train.stop_at_step", self.stop_at_step, lo=1, hi=self.steps)
        check_range("train.grad_accum", self.grad_accum, lo=1)
        check_range("train.log_every", self.log_every, lo=1)


def validate_resume(value: Any, name: str = "train.resume") -> Union[str, int]:
    """``"auto"``, ``"none"`` or a step number >= 0 (a string of digits is read as one)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not (value in ("auto", "none") or isinstance(value, int)):
        raise ConfigError(f"{name}: expected 'auto', 'none' or a step number, got {value!r}")
    if isinstance(value, int) and value < 0:
        raise ConfigError(f"{name}: a step number must be >= 0, got {value!r}")
    return value


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def schedule_length(self) -> int:
        """The learning-rate schedule's length: ``optimizer.decay_steps`` (a resumed run's
        recorded one, once the trainer resolved it), else ``train.steps``."""
        return self.optimizer.decay_steps or self.train.steps

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
