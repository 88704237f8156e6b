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
import errno
import logging
import os
import re
import shutil
import uuid
from typing import Optional, Sequence

from .architecture import hf_config, hf_family, moe_meta
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
    returns the class name written. The files are written into a folder beside `output`
    and moved in when all are there: a failed export (a full disk) leaves `output` as it
    was, and says so in one line naming --output."""
    with loaded_checkpoint(load, model, weight_version, check=hf_family) as loaded:
        config = loaded.config
        state = to_hf(loaded.state_dict(), config)
        saved_args, iteration, version = loaded.saved_args, loaded.iteration, loaded.version
    staging = os.path.join(os.path.dirname(os.path.abspath(output)),
                           f".{os.path.basename(os.path.abspath(output))}.{uuid.uuid4().hex[:8]}")
    try:
        name = _write_model(staging, config, state, saved_args, iteration, version)
        os.makedirs(output, exist_ok=True)
        for entry in os.listdir(staging):
            os.replace(os.path.join(staging, entry), os.path.join(output, entry))
    except Exception as err:  # noqa: BLE001 - a write error of any library: one line
        raise _write_failed(output, err) or err
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info(f"exported {load} (iteration {iteration}, weight version "
                f"{version}) to {output} as {name}")
    return name


def _write_model(folder: str, config, state: dict, saved_args: dict, iteration: int,
                 version: int) -> str:
    from transformers import GenerationConfig

    os.makedirs(folder)
    special = export_tokenizer(saved_args, folder)
    hf = hf_config(config, special, {**_meta(saved_args), **moe_meta(config),
                                     "source_iteration": iteration, "weight_version": version})
    hf.save_pretrained(folder)
    if config.model == "gpt":
        GenerationConfig.from_model_config(hf).save_pretrained(folder)
    _write_weights(state, folder)
    return hf.architectures[0]


def _write_failed(output: str, err: Exception) -> Optional[Exception]:
    """The UserError for a write that failed for want of space or permission (safetensors
    reports it as its own error type, with the OS error's number in its text); None for
    anything else (a programming error keeps its traceback)."""
    from ..training.errors import UserError

    code = err.errno if isinstance(err, OSError) else None
    found = re.search(r"os error (\d+)", str(err))
    code = code or (int(found.group(1)) if found else None)
    if code is None:
        return None
    what = "the disk is full" if code in (errno.ENOSPC, errno.EDQUOT) else os.strerror(code)
    return UserError(f"cannot write the Hugging Face model: {what} ({output})", "--output",
                     "free space or choose another --output (nothing was written; what the "
                     "folder held before is unchanged)")


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
