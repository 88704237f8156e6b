"""Held-out perplexity (GPT) or masked-LM loss and accuracy (BERT).

    python tools/evaluate.py --load CKPT --data-path PREFIX [--seq-length 1024 --stride 512]
    python tools/evaluate.py --hf-dir HF_DIR --input test.jsonl [--json result.json]

From a checkpoint of any format and layout or a Hugging Face directory; one plain process
(no torchrun). See docs/evaluation.md.
"""
import os
import sys
import warnings

warnings.filterwarnings("ignore", message=".*(Apex|apex|Transformer Engine).*")
# megatron-core's and torch.distributed.checkpoint's deprecation notices on every load
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_2bw.evaluation.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
