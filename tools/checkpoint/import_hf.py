"""Import a Hugging Face GPT-2, Llama or MegatronBert directory as a checkpoint to --finetune from.

    python tools/checkpoint/import_hf.py --input HF_DIR --save CKPT [--ckpt-format torch_dist|torch]

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

from megatron_2bw.hf.import_ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
