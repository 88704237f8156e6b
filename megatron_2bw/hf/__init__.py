"""Hugging Face `transformers` export and import (an optional extra: `pip install -e .[hf]`).

- `architecture.py`: which `transformers` class a megatron-core model is (GPT-2, Llama,
  Mixtral, MegatronBert), its config, and the reverse: the pretrain flags of an HF config. One
  clear error naming the flag for what HF has no class for.
- `weights.py`: megatron-core state dict <-> HF state dict (the fused QKV split, SwiGLU's
  fused fc1, GPT-2's transposed Conv1D weights, Mixtral's experts). Torch only.
- `megatron_io.py`: a checkpoint of any format and layout read into one process, and a
  state dict written as a checkpoint that `--finetune` starts from.
- `tokenizer.py`: the run's tokenizer as HF tokenizer files, and back to flags.
- `export.py`, `import_.py`: the two tools (front ends in tools/checkpoint/).

Only this package and the tools import `transformers`; training never does.
"""
