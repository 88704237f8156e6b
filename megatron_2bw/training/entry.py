"""What `pretrain_gpt.py` and `pretrain_bert.py` run: flags -> configs -> pretrain."""
from __future__ import annotations

import logging
import sys
from typing import Optional, Sequence

from .arguments import config_from_args, parse_args
from .data_sources import data_sources
from .distributed import init_distributed, setup_logging

logger = logging.getLogger("megatron_2bw.train")


def main(model: str, argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(model, argv)
    env = init_distributed()
    setup_logging(env.rank, env.world_size)
    try:
        sources = data_sources(args, model)
        run = config_from_args(args, model, env.world_size, sources.vocab_size)
    except (ValueError, OSError) as err:
        if env.rank == 0:
            print(f"pretrain_{model}.py: error: {err}", file=sys.stderr)
        return 2
    from .loop import pretrain
    pretrain(run, env, sources)
    return 0
