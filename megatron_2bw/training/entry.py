"""What `pretrain_gpt.py` and `pretrain_bert.py` run: flags -> configs -> pretrain."""
from __future__ import annotations

import logging
import sys
from typing import Optional, Sequence

from .arguments import config_from_args, parse_args
from .data_sources import data_sources, tokenizer_from_args
from .distributed import init_distributed, setup_logging

logger = logging.getLogger("megatron_2bw.train")


def main(model: str, argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(model, argv)
    env = init_distributed()
    setup_logging(env.rank, env.world_size)
    try:
        tokenizer = tokenizer_from_args(args, model)
        run = config_from_args(args, model, env.world_size, tokenizer.vocab_size)
        sources = data_sources(run, tokenizer)
    except (ValueError, OSError) as err:
        if env.rank == 0:
            print(f"pretrain_{model}.py: error: {err}", file=sys.stderr)
        return 2
    from ..models import apply_cpu_shims
    from .loop import pretrain
    apply_cpu_shims(env.device.type)
    pretrain(run, env, sources)
    return 0
