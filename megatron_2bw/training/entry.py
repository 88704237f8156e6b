"""What `pretrain_gpt.py` and `pretrain_bert.py` run: flags -> configs -> pretrain."""
from __future__ import annotations

import functools
import logging
import sys
from typing import Optional, Sequence

from .arguments import config_from_args, parse_args
from .batches import mock_bert_sample, mock_gpt_sample, stream
from .distributed import init_distributed, setup_logging

logger = logging.getLogger("megatron_2bw.train")


def _batch_source(args, model: str):
    """(batch source, vocabulary size before padding) for the chosen data."""
    if args.mock_data or not args.data_path:
        if not args.mock_data:
            raise ValueError("give --data-path PREFIX (see tools/preprocess_data.py) or --mock-data")
        vocab = args.vocab_size or 50257
        make = mock_gpt_sample if model == "gpt" else mock_bert_sample
        sample_fn = make(args.seed, args.seq_length, vocab)
        return functools.partial(stream, sample_fn), vocab
    from ..data.training_data import batch_source  # real data: indexed datasets + tokenizer
    return batch_source(args, model)


def main(model: str, argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(model, argv)
    env = init_distributed()
    setup_logging(env.rank, env.world_size)
    try:
        batches, vocab = _batch_source(args, model)
        run = config_from_args(args, model, env.world_size, vocab)
    except (ValueError, FileNotFoundError) as err:
        if env.rank == 0:
            print(f"pretrain_{model}.py: error: {err}", file=sys.stderr)
        return 2
    from .loop import pretrain
    pretrain(run, env, batches)
    return 0
