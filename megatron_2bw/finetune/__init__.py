"""Finetuning BERT on the paper's downstream tasks (tools/finetune.py).

- `tasks.py`: the task files as examples: MNLI-style sentence pairs (GLUE TSV or JSON
  lines) and RACE-style multiple choice (RACE's JSON files), label names per task.
- `samples.py`: examples -> fixed-length encoder rows ([CLS] a [SEP] b [SEP]), and the
  views the training loop draws from: epochs of shuffled training samples, and a
  validation set padded to whole global batches (padding samples count nothing).
- `run.py`: flags -> a BERT run with a task head (`ModelConfig.task`), started from a
  pretrained checkpoint with `--finetune`, trained by the engine's `Trainer` under any
  schedule, its accuracy reported per validation set.

The model side (the head on the pooled [CLS] state, the loss and the accuracy metric) is
`megatron_2bw.models.heads`; the engine does not know it is finetuning.
"""
