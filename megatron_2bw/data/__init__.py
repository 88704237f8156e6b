"""Data: Megatron-LM tokenizers, loose-JSON preprocessing to .bin/.idx, megatron-core
GPT/BERT datasets with Megatron's sampler order, and the embedded default corpus.

Submodules are imported on demand (``from megatron_2bw.data.datasets import ...``) so that
preprocessing workers do not pay for torch and megatron-core.
"""
