"""Pretrain BERT with megatron-2bw: Megatron-LM's flags plus --pipeline-schedule {gpipe,flush,2bw}.

    torchrun --nproc-per-node 2 pretrain_bert.py --pipeline-model-parallel-size 2 \
        --pipeline-schedule 2bw --num-layers 4 --hidden-size 128 ... --mock-data
"""
import sys
import warnings

# megatron-core announces its fallbacks when apex / Transformer Engine are absent (expected here)
warnings.filterwarnings("ignore", message=".*(Apex|apex|Transformer Engine).*")
# megatron-core's sequence-parallel layers call torch's collectives by their pre-2.13 names
warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed\."
                        r"(all_gather_single|reduce_scatter_single)`")

try:
    from megatron_2bw.training.entry import main
except KeyboardInterrupt:  # Ctrl-C while torch is imported: before any handler is up
    print("stopped: SIGINT (Ctrl-C) during start-up; nothing was trained", file=sys.stderr)
    sys.exit(130)

if __name__ == "__main__":
    sys.exit(main("bert"))
