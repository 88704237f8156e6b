"""Finetune a pretrained BERT on MNLI-style sentence pairs or RACE-style multiple choice
under any schedule (megatron_2bw/finetune/run.py has the flags).

    torchrun --nproc-per-node 2 tools/finetune.py --task MNLI --train-data train.tsv \
        --valid-data dev_matched.tsv --pretrained-checkpoint bert-ckpt --epochs 3 \
        --seq-length 128 --micro-batch-size 8 --lr 2e-5 \
        --pipeline-model-parallel-size 2 --pipeline-schedule 2bw
"""
import os
import sys
import warnings

warnings.filterwarnings("ignore", message=".*(Apex|apex|Transformer Engine).*")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_2bw.finetune.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
