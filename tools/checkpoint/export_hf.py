"""Export a checkpoint (any format and layout) to a Hugging Face transformers model directory.

    python tools/checkpoint/export_hf.py --load CKPT --output HF_DIR [--weight-version newest|shadow]

One plain process (no torchrun); needs the hf extra (pip install -e .[hf]). See
docs/evaluation.md.
"""
import os
import sys
import warnings

warnings.filterwarnings("ignore", message=".*(Apex|apex|Transformer Engine).*")
# megatron-core's and torch.distributed.checkpoint's deprecation notices on every load
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_2bw.hf.export import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
