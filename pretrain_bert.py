"""Pretrain BERT with megatron-2bw: Megatron-LM's flags plus --pipeline-schedule {gpipe,flush,2bw}.

    torchrun --nproc-per-node 2 pretrain_bert.py --pipeline-model-parallel-size 2 \
        --pipeline-schedule 2bw --num-layers 4 --hidden-size 128 ... --mock-data
"""
import sys

from megatron_2bw.training.entry import main

if __name__ == "__main__":
    sys.exit(main("bert"))
