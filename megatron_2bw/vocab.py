"""Megatron-LM's vocabulary padding, in one torch-free place (models, data and planner use it)."""


def pad_vocab_size(orig: int, divisible_by: int = 128, tensor_parallel: int = 1) -> int:
    """Pad a vocabulary size the way Megatron-LM does (`_vocab_size_with_padding`).

    The padded size is the smallest multiple of `divisible_by * tensor_parallel` that is
    >= `orig`, so every tensor-parallel rank holds an equal, aligned slice of the
    embedding and output layer.
    """
    if orig <= 0 or divisible_by <= 0 or tensor_parallel <= 0:
        raise ValueError(f"pad_vocab_size needs positive sizes, got orig={orig}, "
                         f"divisible_by={divisible_by}, tensor_parallel={tensor_parallel}")
    multiple = divisible_by * tensor_parallel
    return -(-orig // multiple) * multiple
