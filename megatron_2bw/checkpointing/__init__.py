"""Checkpoints in Megatron-LM's two layouts, beside the training loop that writes them.

- `files.py`: the legacy `torch` format's files: atomic writes, the tracker, the checksum
  manifest, what a --save directory may hold;
- `contents.py`: what a checkpoint says: Megatron-LM's `args`, its names for the
  parameters, the RNG and engine state;
- `sharded.py`: `--ckpt-format torch_dist` through megatron-core's dist_checkpointing;
  `megatron_optim/`: Adam's state in Megatron-LM's own optimizer layouts there;
- `fit.py`: whether a checkpoint's tensors fit the model, shape by shape, and which flag
  makes a difference;
- `save_load.py`: saving and resuming a run, the names other layers import; behind it
  `saving.py`, `reading.py`, `resume.py` (what a resume refuses before any work),
  `restoring.py`, and `ranks.py` (every rank agrees on a failure).

It imports `comm` and `models`, and of `runtime` and `optim` only their checkpoint
contracts (`runtime/checkpoint.py`: the weight versions; `optim/checkpoint.py`: the
optimizer state): it calls nothing else on an executor or an updater. `training`, `hf`,
`evaluation` and `finetune` use it (tests/test_layers.py checks both).
`training/convert.py` converts through a Trainer, so it stays in training.
"""
