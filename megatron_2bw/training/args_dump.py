"""What Megatron-LM prints before training: the arguments block and the parameter counts.

`_print_args` (megatron/training/arguments.py at core_v0.16.1) lists every argument,
sorted without regard to case, each padded with dots to one column, between two titled
dashed lines; `get_model` (training.py) prints ` > number of parameters on (tensor,
pipeline) model parallel rank (t, p): N` on every model-parallel rank of data-parallel
and context-parallel rank 0. Here the logging rank prints both: the arguments as
parsed (the derived values Megatron-LM also lists, world and data-parallel size,
included), and one line per model-parallel rank, gathered once at start.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

logger = logging.getLogger("megatron_2bw.train")


def arguments_block(args: Mapping[str, Any], title: str = "arguments") -> list[str]:
    """Megatron-LM's block: `  name ...... value` lines between dashed title lines."""
    rows = [f"  {name} {'.' * (48 - len(name))} {value}" for name, value in args.items()]
    return ([f"------------------------ {title} ------------------------"]
            + sorted(rows, key=str.lower)
            + [f"-------------------- end of {title} ---------------------"])


def log_arguments(flags: Mapping[str, Any], world_size: int, data_parallel: int) -> None:
    """Print the arguments block (on the logging rank: INFO elsewhere is off)."""
    shown = {**flags, "world_size": world_size, "data_parallel_size": data_parallel}
    for line in arguments_block(shown):
        logger.info(line)


def parameter_count_lines(counts: list[tuple[int, int, int, bool]]) -> list[str]:
    """Megatron-LM's per-rank lines from (tensor rank, pipeline rank, parameters, prints)
    of every rank, in rank order (`prints`: data- and context-parallel rank 0)."""
    return [" > number of parameters on (tensor, pipeline) model parallel rank "
            f"({tp}, {pp}): {count}" for tp, pp, count, prints in counts if prints]
