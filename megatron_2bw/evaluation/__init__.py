"""Held-out evaluation: GPT perplexity and BERT masked-LM loss / accuracy (tools/evaluate.py).

- `windows.py`: pure: which tokens each window reads and which it scores (the sliding
  window with `--stride`, every token but the first scored exactly once); BERT's chunks.
- `inputs.py`: the token stream from a .bin/.idx prefix or loose JSON, and the tokenizer
  (the model's own flags, overridable with Megatron's tokenizer flags).
- `sources.py`: the two backends behind one `Scorer.logits(batch)`: a checkpoint of any
  layout (megatron-core) or a Hugging Face directory (transformers).
- `perplexity.py`, `mlm.py`: the metrics, computed the same way from either backend's
  logits (fp32 cross entropy, fp64 sums; BERT's seeded 80/10/10 masking).
- `progress.py`: a progress log line with an ETA every few seconds.
- `cli.py`: the flags, their checks (all before the weights load) and the one-line result.

See docs/evaluation.md. Only the `--hf-dir` path imports `transformers`.
"""
