"""How the package talks to process groups (collectives.py) and how a run shows which
collectives it issued (recorder.py). Nothing else calls torch.distributed's collectives."""
from .collectives import (EXERCISE_ENV, MAX, SUM, CollectiveDeviceError, all_gather,
                          batch_isend_irecv,
                          all_gather_into_tensor, all_gather_object, all_reduce,
                          reduce_scatter_tensor, barrier, broadcast_object, device,
                          empty, exercising, gather_concat, group_ranks, irecv, is_initialized, isend,
                          new_group, rank, recv, runs, send, set_device, size, tensor,
                          world_runs, zeros)
from .recorder import RECORD_ENV, CollectiveRecorder, group_name, record_path, recorder_from_env

__all__ = ["EXERCISE_ENV", "MAX", "SUM", "CollectiveDeviceError", "all_gather",
           "batch_isend_irecv",
           "all_gather_into_tensor", "reduce_scatter_tensor",
           "all_gather_object", "all_reduce", "barrier", "broadcast_object", "device", "empty", "gather_concat",
           "exercising", "group_ranks", "irecv", "is_initialized", "isend", "new_group", "rank",
           "recv", "runs", "send", "set_device", "size", "tensor", "world_runs", "zeros",
           "RECORD_ENV", "CollectiveRecorder", "group_name", "record_path", "recorder_from_env"]
