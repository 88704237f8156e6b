"""Import a Hugging Face model directory as a checkpoint that pretraining continues from.

    python tools/checkpoint/import_hf.py --input HF_DIR --save CKPT [--ckpt-format torch]

GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM and MegatronBert (the classes
`export.py` writes) become megatron-core GPT / BERT weights (Mixtral: a mixture of experts
in every layer, --num-experts / --moe-router-topk / --moe-ffn-hidden-size from its config;
the experts as SequentialMLP's, or GroupedMLP's with --moe-grouped-gemm or when the
exported run had it), saved weights only at iteration 0 (no optimizer state): continue
with the printed flags plus `--load CKPT --finetune`. The vocabulary is padded to
Megatron's multiple (`--make-vocab-size-divisible-by`, default the exported
run's or 128) with copies of the last row, as Megatron-LM's converter pads it.
"""
from __future__ import annotations

import argparse
import logging
import shlex
from dataclasses import dataclass
from typing import Optional, Sequence

from ..vocab import pad_vocab_size
from .architecture import (BERT, CLASS_NAMES, META, MIXTRAL, ImportedArchitecture,
                           imported_architecture)
from .megatron_io import build_run, save_weights
from .tokenizer import tokenizer_flags
from .weights import from_hf, pad_vocab_rows

logger = logging.getLogger(__name__)
DEFAULT_SEQ_LENGTH = 4096  # the ceiling when the HF config names only its position limit


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tools/checkpoint/import_hf.py", allow_abbrev=False,
        description="Import a Hugging Face GPT-2, Llama, Mixtral or MegatronBert model "
        "directory as a megatron-2bw checkpoint (weights only, iteration 0) to continue "
        "pretraining from with --finetune. Runs as one process.")
    p.add_argument("--input", required=True, help="the HF model directory")
    p.add_argument("--save", required=True, help="the checkpoint directory to write")
    p.add_argument("--ckpt-format", choices=("torch_dist", "torch"), default="torch_dist",
                   help="torch_dist (default; resumes at any layout) or torch (resumes at "
                        "TP = PP = 1 only; convert it for another layout)")
    p.add_argument("--seq-length", type=int, default=None,
                   help="--seq-length of the continued run (default: the exported run's, "
                        f"else the model's position limit up to {DEFAULT_SEQ_LENGTH})")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                   help="Megatron's vocabulary padding multiple (default: the exported "
                        "run's, else 128); for tensor parallelism T pass N x T as the "
                        "continued run pads to a multiple of N x T")
    p.add_argument("--moe-grouped-gemm", action="store_true",
                   help="Mixtral: write the experts as GroupedMLP's weight1 / weight2, for a "
                        "run with --moe-grouped-gemm (default: the exported run's layout, "
                        "else SequentialMLP's per-expert weights)")
    p.add_argument("--overwrite-checkpoints", action="store_true")
    return p


@dataclass(frozen=True)
class ImportResult:
    """What was written, and the flags a pretrain run continues from it with."""

    model: str
    flags: list[str]
    tokenizer_found: bool
    padded_vocab_size: int


def _hf_state(input_dir: str, config, arch: ImportedArchitecture) -> dict:
    """The HF model's tensors, loaded by transformers' own class (any of its formats)."""
    import transformers

    name = (getattr(config, "architectures", None) or [CLASS_NAMES.get(arch.family)])[0]
    model = getattr(transformers, name).from_pretrained(input_dir, local_files_only=True)
    return {k: v.detach() for k, v in model.state_dict().items()}


def import_hf(input_dir: str, save: str, ckpt_format: str = "torch_dist",
              seq_length: Optional[int] = None, divisible_by: Optional[int] = None,
              overwrite: bool = False, grouped_gemm: bool = False) -> ImportResult:
    """Write the HF model in `input_dir` as a checkpoint in `save`; the flags to continue
    (`grouped_gemm`: a Mixtral's experts in GroupedMLP's layout)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(input_dir, local_files_only=True)
    arch = imported_architecture(config)
    meta = getattr(config, META, None) or {}
    seq = seq_length or meta.get("seq_length") or min(arch.max_positions, DEFAULT_SEQ_LENGTH)
    multiple = divisible_by or meta.get("make_vocab_size_divisible_by") or 128
    tokenizer = tokenizer_flags(input_dir, arch.family)
    flags = arch.flags + ["--seq-length", str(seq), "--make-vocab-size-divisible-by",
                          str(multiple)]
    if grouped_gemm and arch.family == MIXTRAL and "--moe-grouped-gemm" not in flags:
        flags.append("--moe-grouped-gemm")
    vocab = tokenizer or ["--vocab-size", str(arch.vocab_size)]
    run = build_run(arch.model, flags + vocab + ["--mock-data", "--save", save,
                                                 "--ckpt-format", ckpt_format]
                    + (["--overwrite-checkpoints"] if overwrite else []), arch.vocab_size)
    padded = run.model.vocab_size  # Megatron's padding of the HF rows
    rows = _tokenizer_rows(tokenizer, multiple) if tokenizer else None
    if rows is not None and rows != padded:
        logger.warning(f"the tokenizer in {input_dir} pads to {rows} vocabulary rows, the "
                       f"model has {padded}: a run with these tokenizer flags cannot load "
                       "the checkpoint (the tokenizer must be the model's, up to Megatron's "
                       "padding)")
    state = pad_vocab_rows(_hf_state(input_dir, config, arch), arch.family, padded)
    save_weights(run, from_hf(state, run.model))
    _report(arch, flags, tokenizer, save, padded)
    return ImportResult(arch.model, flags + (tokenizer or []), tokenizer is not None, padded)


def _tokenizer_rows(flags: list[str], multiple: int) -> Optional[int]:
    """The vocabulary rows a run with these tokenizer flags pads to (None: unknown)."""
    from ..data.tokenizers import TokenizerError, build_tokenizer

    given = dict(zip(flags[::2], flags[1::2]))
    try:
        tok = build_tokenizer(given["--tokenizer-type"], vocab_file=given.get("--vocab-file"),
                              merge_file=given.get("--merge-file"),
                              tokenizer_model=given.get("--tokenizer-model"))
    except (TokenizerError, OSError, ValueError):
        return None
    return pad_vocab_size(tok.vocab_size, multiple, 1)


def _report(arch: ImportedArchitecture, flags: list[str], tokenizer: Optional[list[str]],
            save: str, padded: int) -> None:
    script = "pretrain_bert.py" if arch.family == BERT else "pretrain_gpt.py"
    logger.info(f"imported {arch.family} ({arch.vocab_size} vocabulary rows, padded to "
                f"{padded}) into {save} (iteration 0, weights only)")
    if tokenizer is None:
        logger.warning(f"no tokenizer files in the HF directory: pass your tokenizer flags; "
                       f"its vocabulary must pad to {padded} rows")
    logger.info(f"continue with: {script} {shlex.join(flags + (tokenizer or []))} "
                f"--load {shlex.quote(save)} --finetune <data, batch, optimizer and "
                "parallel flags>")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The tool: one process, user errors as one line (the engine's `guarded`)."""
    from ..training.distributed import setup_logging
    from ..training.errors import guarded

    args = build_parser().parse_args(argv)
    setup_logging(0, 1)

    def body() -> int:
        import_hf(args.input, args.save, args.ckpt_format, args.seq_length,
                  args.make_vocab_size_divisible_by, args.overwrite_checkpoints,
                  args.moe_grouped_gemm)
        return 0
    return guarded(body)
