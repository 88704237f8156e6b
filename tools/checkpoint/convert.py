"""Convert a checkpoint between --ckpt-format torch and torch_dist, and to another layout.

    torchrun --nproc-per-node 4 tools/checkpoint/convert.py --load OLD --save NEW \
        --ckpt-format torch_dist --pipeline-model-parallel-size 4

Run with tensor x pipeline processes of the target layout (one data-parallel rank is
enough: replicas are identical). OLD may be megatron-2bw's or Megatron-LM's own, in
either format, with or without optimizer state. See docs/checkpoints.md.
"""
import os
import sys
import warnings

warnings.filterwarnings("ignore", message=".*(Apex|apex|Transformer Engine).*")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_2bw.training.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
