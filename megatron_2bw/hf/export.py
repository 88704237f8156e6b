"""Export a checkpoint to a Hugging Face `transformers` model directory.

    python tools/checkpoint/export_hf.py --load CKPT --output HF_DIR [--weight-version shadow]

Writes config.json (the class in `architecture.py`), safetensors weights (sharded above
5 GB, as `save_pretrained`), generation_config.json for GPT models, and tokenizer files
where the run's tokenizer allows (`tokenizer.py`). The checkpoint may be of any format
and layout (see `megatron_io.py`); the vocabulary keeps Megatron's padded size, so the
logits of every id equal ours.
"""
from __future__ import annotations

import argparse
import logging
import os
from typing import Optional, Sequence

from .architecture import hf_config, hf_family
from .megatron_io import VERSIONS, loaded_checkpoint
from .tokenizer import export_tokenizer
from .weights import to_hf

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tools/checkpoint/export_hf.py", allow_abbrev=False,
        description="Export a megatron-2bw / Megatron-LM checkpoint (any format and layout) "
        "to a Hugging Face transformers model directory. Runs as one process.")
    p.add_argument("--load", required=True, help="checkpoint directory")
    p.add_argument("--output", required=True, help="the HF model directory to write")
    p.add_argument("--weight-version", choices=VERSIONS, default="newest",
                   help="newest (default: the weights as the optimizer trained them), or "
                        "2BW's shadow version (the weights the next iteration's forward "
                        "passes would use)")
    p.add_argument("--model", choices=("gpt", "bert"), default=None,
                   help="the checkpoint's model (default: detected from its tensors)")
    return p


def _meta(saved: dict) -> dict:
    """What an import needs to give back the flags this model came from."""
    return {"seq_length": saved.get("seq_length"),
            "make_vocab_size_divisible_by": saved.get("make_vocab_size_divisible_by", 128),
            "source_iteration": saved.get("iteration")}


def _write_weights(state: dict, output: str) -> None:
    from huggingface_hub import save_torch_state_dict

    save_torch_state_dict(state, output, max_shard_size="5GB")


def export_hf(load: str, output: str, weight_version: str = "newest",
              model: Optional[str] = None) -> str:
    """Write `load`'s weight version `weight_version` as an HF model into `output`;
    returns the class name written."""
    from transformers import GenerationConfig

    with loaded_checkpoint(load, model, weight_version, check=hf_family) as loaded:
        config = loaded.config
        state = to_hf(loaded.state_dict(), config)
        os.makedirs(output, exist_ok=True)
        special = export_tokenizer(loaded.saved_args, output)
        hf = hf_config(config, special, {**_meta(loaded.saved_args),
                                         "source_iteration": loaded.iteration,
                                         "weight_version": loaded.version})
    hf.save_pretrained(output)
    if config.model == "gpt":
        GenerationConfig.from_model_config(hf).save_pretrained(output)
    _write_weights(state, output)
    name = hf.architectures[0]
    logger.info(f"exported {load} (iteration {loaded.iteration}, weight version "
                f"{loaded.version}) to {output} as {name}")
    return name


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The tool: one process, user errors as one line (the engine's `guarded`)."""
    from ..training.distributed import setup_logging
    from ..training.errors import guarded

    args = build_parser().parse_args(argv)
    setup_logging(0, 1)

    def body() -> int:
        export_hf(args.load, args.output, args.weight_version, args.model)
        return 0
    return guarded(body)
