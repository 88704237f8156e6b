"""A checkpoint that does not fit the model is refused by its shapes (issue 31, item 2):
the tensor comparison (checkpointing/fit.py), the vocabulary against the checkpoint's args,
and the notes for another seed or data flag. Pure functions: no process group, no model
(the matrix's class 11 resumes real checkpoints)."""
from __future__ import annotations

import logging

import pytest

from megatron_2bw.checkpointing.files import CheckpointError
from megatron_2bw.checkpointing.fit import LAYERS, misfit_line, misfits
from megatron_2bw.checkpointing.save_load import check_vocabulary, note_data_order

MODEL = {"embedding.word_embeddings.weight": (128, 32),
         "decoder.layers.mlp.linear_fc1.weight": (4, 128, 32),
         "decoder.layers.mlp.linear_fc1.bias": (4, 128),
         "decoder.final_layernorm.weight": (32,)}


def test_equal_shapes_fit() -> None:
    assert misfits(dict(MODEL), dict(MODEL)) == []
    assert misfit_line([], "ck") is None


@pytest.mark.parametrize("key, shape, flag", [
    ("embedding.word_embeddings.weight", (256, 32), "--vocab-size"),
    ("decoder.layers.mlp.linear_fc1.weight", (4, 64, 32), "--ffn-hidden-size"),
    ("decoder.layers.mlp.linear_fc1.weight", (2, 128, 32), "--num-layers"),
])
def test_a_different_shape_names_its_flag(key, shape, flag) -> None:
    saved = {**MODEL, key: shape}
    line = misfit_line(misfits(saved, MODEL), "ck/iter_0000002")
    assert f"{key} is {list(shape)} in the checkpoint, {list(MODEL[key])} in this model" in line
    assert f"resume with the checkpoint's {flag}" in line
    assert "(ck/iter_0000002)" in line and "\n" not in line


def test_missing_and_unexpected_tensors() -> None:
    saved = {k: v for k, v in MODEL.items() if not k.endswith("fc1.bias")}
    assert "--disable-bias-linear" in misfit_line(misfits(saved, MODEL), "ck")
    extra = {**MODEL, "embedding.position_embeddings.weight": (16, 32)}
    found = misfits(extra, MODEL)
    assert [m.name for m in found] == ["embedding.position_embeddings.weight"]
    assert "--position-embedding-type" in misfit_line(found, "ck")
    # another stage's tensors, or a head --finetune drops: not this rank's business
    assert misfits(extra, MODEL, unexpected=False) == []
    assert misfits(saved, MODEL, missing_ok=["decoder.layers.mlp.linear_fc1.bias"]) == []


def test_torch_format_layer_count_is_one_line() -> None:
    """The torch format names each layer: fewer layers is one misfit of the count first."""
    def layers(n: int) -> dict:
        return {f"decoder.layers.{i}.mlp.linear_fc1.weight": (128, 32) for i in range(n)}
    found = misfits(layers(4), layers(2))
    assert found[0].name == LAYERS and len(found) == 3
    line = misfit_line(found, "ck")
    assert "the checkpoint has 4 transformer layers on this stage, this model 2" in line
    assert line.endswith("resume with the checkpoint's --num-layers")


def test_vocabulary_padding_may_differ_only_when_asked() -> None:
    saved = {**MODEL, "embedding.word_embeddings.weight": (192, 32)}
    assert misfits(saved, MODEL, vocab_rows_may_differ=True) == []
    hidden = {**MODEL, "embedding.word_embeddings.weight": (192, 64)}
    assert len(misfits(hidden, MODEL, vocab_rows_may_differ=True)) == 1


ARGS = {"vocab_size": 127, "padded_vocab_size": 128, "make_vocab_size_divisible_by": 64,
        "tensor_model_parallel_size": 1, "tokenizer_type": None, "vocab_file": None,
        "merge_file": None, "tokenizer_model": None, "seed": 1234, "data_path": [],
        "split": "969,30,1", "seq_length": 16, "mock_data": True}


@pytest.mark.parametrize("reshardable", [False, True])
def test_another_vocabulary_is_refused(reshardable) -> None:
    with pytest.raises(CheckpointError, match=r"--vocab-size 127 in the checkpoint, 200 in this run, "
                                              r"so its embedding and output layer have 128 "
                                              r"rows and this model's 256 \(ck\)"):
        check_vocabulary(ARGS, {**ARGS, "vocab_size": 200}, 256, "ck", reshardable)


def test_padding_alone_reshards_from_torch_dist_only(caplog) -> None:
    flags = {**ARGS, "make_vocab_size_divisible_by": 256}
    with pytest.raises(CheckpointError, match=r"--make-vocab-size-divisible-by 64 in the checkpoint, "
                                              r"256 in this run.*convert it to torch_dist"):
        check_vocabulary(ARGS, flags, 256, "ck", reshardable=False)
    with caplog.at_level(logging.WARNING):
        assert check_vocabulary(ARGS, flags, 256, "ck", reshardable=True) is True
    assert "padding rows 128 to 255 start from their initialization" in caplog.text


def test_same_rows_other_tokenizer_is_a_note(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        assert check_vocabulary(ARGS, {**ARGS, "vocab_size": 100}, 128, "ck", True) is False
    assert "--vocab-size 127 in the checkpoint, 100 in this run" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check_vocabulary(ARGS, dict(ARGS), 128, "ck", True)
    assert caplog.text == ""


def test_an_output_layer_on_one_side_names_the_untie_flag() -> None:
    saved = {**MODEL, "output_layer.weight": (128, 32)}
    for found in (misfits(saved, MODEL), misfits(MODEL, saved)):
        line = misfit_line(found, "ck")
        assert "output_layer.weight" in line and line.endswith(
            "resume with the checkpoint's --untie-embeddings-and-output-weights"), line


def test_data_order_note(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        note_data_order(ARGS, {**ARGS, "seed": 7, "data_path": ["a", "b"],
                               "mock_data": False}, 2)
    assert ("--seed 1234 in the checkpoint, 7 in this run; --data-path (unset) in the checkpoint, a b "
            "in this run"
            in caplog.text) and "after iteration 2" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        note_data_order(ARGS, dict(ARGS), 2)
    assert caplog.text == ""


def test_unset_data_flags_and_mock_data_are_no_data_order_change(caplog) -> None:
    """Megatron-LM leaves --data-path None, this parser []; mock data reads no path and
    splits 1,1,1 whatever --split says: no note for either."""
    megatron = {**ARGS, "data_path": None, "split": None, "mock_data": True}
    with caplog.at_level(logging.WARNING):
        note_data_order(megatron, {**megatron, "data_path": [], "split": "969,30,1"}, 2)
    assert caplog.text == ""
    with caplog.at_level(logging.WARNING):
        note_data_order(megatron, {**megatron, "split": "1,0,0", "mock_data": False}, 2)
    assert "--split (unset) in the checkpoint, 1,0,0 in this run" in caplog.text
