"""Typed configuration, built once from the flags (arguments.py) and passed down narrow.

Nothing below the training layer reads flags: the model gets a ModelConfig, the
optimizer an OptimizerConfig, the loop the ParallelConfig / TrainConfig / DataConfig.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional

from ..models.config import ModelConfig
from ..optim.updater import OptimizerConfig
from ..schedules import DEFAULT_SCHEDULE
from .batch_sizes import BatchSizes
from .housekeeping import HousekeepingConfig
from .skip_guard import SkipGuardConfig


@dataclass(frozen=True)
class ParallelConfig:
    """The TP x CP x PP x DP grid. The data-parallel size is derived, as in Megatron-LM.

    Mixture-of-experts layers split the same ranks their own way (megatron-core's expert
    grid, `initialize_model_parallel`): within a pipeline stage, the TP x CP x DP ranks
    are expert-tensor-parallel x expert-parallel x expert-data-parallel (ETP x EP x EDP).
    """

    world_size: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    # --context-parallel-size: ranks that each hold 1/CP of every sequence
    context_parallel: int = 1
    schedule: str = DEFAULT_SCHEDULE  # canonical name (schedules.registry)
    grad_reduce_in_bf16: bool = False  # --grad-reduce-in-bf16 (with --bf16): bf16 main grads
    # --use-distributed-optimizer: masters and optimizer state sharded over data parallelism
    distributed_optimizer: bool = False
    # model chunks per pipeline rank (Megatron-LM's virtual_pipeline_model_parallel_size,
    # from --num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank);
    # above 1 a schedule with an interleaved form (flush: Megatron-LM's interleaved 1F1B)
    # interleaves them
    virtual_stages: int = 1
    # --expert-model-parallel-size: ranks each MoE layer's experts are spread over (EP)
    expert_parallel: int = 1
    # --expert-tensor-parallel-size: tensor-parallel ranks of each expert (ETP); None
    # (the default) becomes tensor_parallel, Megatron-LM's default
    expert_tensor_parallel: Optional[int] = None

    def __post_init__(self) -> None:
        if self.expert_tensor_parallel is None:
            object.__setattr__(self, "expert_tensor_parallel", self.tensor_parallel)
        grid = self.tensor_parallel * self.pipeline_parallel * self.context_parallel
        if self.world_size % grid:
            raise ValueError(
                f"world size {self.world_size} is not divisible by --tensor-model-parallel-size "
                f"({self.tensor_parallel}) x --pipeline-model-parallel-size "
                f"({self.pipeline_parallel}) x --context-parallel-size "
                f"({self.context_parallel}) = {grid}")
        if self.expert_parallel < 1 or self.expert_tensor_parallel < 1:
            raise ValueError(f"expert-parallel size {self.expert_parallel} and expert-tensor-"
                             f"parallel size {self.expert_tensor_parallel} must be positive")
        expert_grid = self.expert_tensor_parallel * self.expert_parallel * self.pipeline_parallel
        if self.world_size % expert_grid:
            raise ValueError(
                f"world size {self.world_size} is not divisible by "
                f"--expert-tensor-parallel-size ({self.expert_tensor_parallel}) x "
                f"--expert-model-parallel-size ({self.expert_parallel}) x "
                f"--pipeline-model-parallel-size ({self.pipeline_parallel}) = {expert_grid}")
        if self.virtual_stages > 1 and self.pipeline_parallel < 2:
            raise ValueError(f"{self.virtual_stages} virtual pipeline stages per rank need "
                             "--pipeline-model-parallel-size above 1")

    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.tensor_parallel * self.pipeline_parallel
                                   * self.context_parallel)

    @property
    def expert_data_parallel(self) -> int:
        """Ranks holding the same experts (EDP = world / (ETP x EP x PP)): an expert's
        gradient is reduced over these, the dense weights' over data x context parallel."""
        return self.world_size // (self.expert_tensor_parallel * self.expert_parallel
                                   * self.pipeline_parallel)


@dataclass(frozen=True)
class DataConfig:
    """Where the samples come from."""

    data_path: tuple[str, ...] = ()      # --data-path (Megatron blend syntax)
    split: str = "969,30,1"              # --split
    mock_data: bool = False              # --mock-data
    tokenizer_type: Optional[str] = None  # --tokenizer-type
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_size: Optional[int] = None     # --vocab-size (NullTokenizer / mock data)
    make_vocab_size_divisible_by: int = 128
    seq_length: int = 1024
    seed: int = 1234
    mask_prob: float = 0.15              # BERT masking
    short_seq_prob: float = 0.1
    data_cache_path: Optional[str] = None  # --data-cache-path
    mmap_bin_files: bool = True            # --no-mmap-bin-files
    eod_mask_loss: bool = False            # --eod-mask-loss (GPT)
    reset_position_ids: bool = False       # --reset-position-ids (GPT)
    reset_attention_mask: bool = False     # --reset-attention-mask (GPT)


@dataclass(frozen=True)
class TrainConfig:
    """The loop: batch sizes, length, logging, evaluation and checkpoints."""

    micro_batch_size: int
    global_batch_size: int
    train_iters: int
    log_interval: int = 100
    eval_interval: int = 1000
    eval_iters: int = 100
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    ckpt_format: str = "torch_dist"      # --ckpt-format (what --save writes)
    finetune: bool = False               # --finetune: weights only, from iteration 0
    no_load_optim: bool = False          # --no-load-optim
    no_load_rng: bool = False            # --no-load-rng
    no_save_optim: bool = False          # --no-save-optim
    no_save_rng: bool = False            # --no-save-rng
    metrics_file: Optional[str] = None
    tensorboard_dir: Optional[str] = None
    seed: int = 1234
    exit_interval: Optional[int] = None   # --exit-interval: save and exit at a multiple of it
    overwrite_checkpoints: bool = False   # --overwrite-checkpoints
    ckpt_step: Optional[int] = None       # --ckpt-step: this iteration of --load, not the newest
    exit_on_missing_checkpoint: bool = False  # --exit-on-missing-checkpoint
    override_opt_param_scheduler: bool = False        # --override-opt_param-scheduler
    use_checkpoint_opt_param_scheduler: bool = False  # --use-checkpoint-opt_param-scheduler
    exit_signal_handler: bool = False     # --exit-signal-handler: save and exit 0 on SIGTERM
    exit_duration_in_mins: Optional[int] = None  # --exit-duration-in-mins
    distributed_timeout_minutes: float = 10.0    # --distributed-timeout-minutes
    train_samples: Optional[int] = None   # --train-samples (train_iters then derived from it)
    rampup_batch_size: Optional[tuple[int, int, int]] = None  # --rampup-batch-size
    skip_train: bool = False              # --skip-train: validate and test the loaded model
    converting: bool = False              # tools/checkpoint/convert.py: trains nothing
    dist_ckpt_strictness: Optional[str] = None  # --dist-ckpt-strictness (torch_dist loads)
    housekeeping: HousekeepingConfig = HousekeepingConfig()  # --manual-gc, --profile
    skip_guard: SkipGuardConfig = SkipGuardConfig()  # --check-for-nan-in-loss-and-grad,
    #                                                  --max-consecutive-skipped-iterations
    # Megatron-LM's logging flags (arguments.py `_logging_flags`; used by metrics.py)
    log_throughput: bool = False                     # --log-throughput
    log_timers_to_tensorboard: bool = False          # --log-timers-to-tensorboard
    log_loss_scale_to_tensorboard: bool = True       # --no-log-loss-scale-to-tensorboard
    log_validation_ppl_to_tensorboard: bool = False  # --log-validation-ppl-to-tensorboard
    log_world_size_to_tensorboard: bool = False      # --log-world-size-to-tensorboard
    log_params_norm: bool = False                    # --log-params-norm
    log_num_zeros_in_grad: bool = False              # --log-num-zeros-in-grad
    log_memory_to_tensorboard: bool = False          # --log-memory-to-tensorboard
    timing_log_level: int = 0                        # --timing-log-level (timers.py)
    timing_log_option: str = "minmax"                # --timing-log-option
    tensorboard_log_interval: int = 1                # --tensorboard-log-interval
    moe_per_layer_logging: bool = False              # --moe-per-layer-logging
    tensorboard_queue_size: int = 1000               # --tensorboard-queue-size
    wandb_project: Optional[str] = None              # --wandb-project
    wandb_exp_name: Optional[str] = None             # --wandb-exp-name
    wandb_save_dir: Optional[str] = None             # --wandb-save-dir
    wandb_entity: Optional[str] = None               # --wandb-entity


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs, grouped."""

    model: ModelConfig
    parallel: ParallelConfig
    optimizer: OptimizerConfig
    data: DataConfig
    train: TrainConfig
    precision: str = "fp32"               # fp32 | bf16 | fp16
    flags: dict = field(default_factory=dict)  # the parsed flags, saved in checkpoints
    # (iteration, consumed samples) of the checkpoint resumed: the data continues there
    resumed_data: tuple[int, int] = (0, 0)

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step at the full --global-batch-size."""
        return self.train.global_batch_size // self.samples_per_microbatch

    @property
    def samples_per_microbatch(self) -> int:
        """Samples one microbatch carries over all data-parallel replicas."""
        return self.train.micro_batch_size * self.parallel.data_parallel

    @cached_property
    def batch_sizes(self) -> BatchSizes:
        """The global batch size of every iteration (constant, or ramped up)."""
        return BatchSizes(self.train.global_batch_size, self.train.rampup_batch_size,
                          self.resumed_data)
