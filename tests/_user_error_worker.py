"""One rank of a job in which rank `bad` finds a user error while the others are blocked.

Every other rank waits on a receive from the next rank of a ring, so the one waiting on
`bad` fails first and the others only through the chain (or through the store watch):
what `pretrain_gpt.py` does when one stage finds a checkpoint file that does not fit
while its neighbours wait for its activations. Run: `python _user_error_worker.py BAD`
with torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set.
"""
import sys
import time

import torch
import torch.distributed as dist

from megatron_2bw.training.errors import UserError, guarded, watch_peers


def body(bad: int) -> int:
    dist.init_process_group("gloo")
    watch_peers()
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    if rank == bad:
        time.sleep(0.5)  # let the others block first
        raise UserError(f"injected on rank {rank}", "--test-flag", "nothing to fix")
    dist.recv(torch.zeros(1), src=(rank + 1) % world)
    return 0


if __name__ == "__main__":
    sys.exit(guarded(lambda: body(int(sys.argv[1]))))
