"""Checkpoints that cannot silently rot and resumes that cannot silently go wrong (issue 11,
items 1, 2 and 9's masters): the checksum manifest and its verification, failed and
refused saves, the resume checks (LR schedule, --train-iters, model shapes), one metrics
row per iteration, and the fp32 masters of a --bf16 resume.

The file layer and the resume checks are tested in this process; three launches through
the entry point cover what needs real ranks (fixture `trained`, the `slow` tests).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from torch import nn

from megatron_2bw.optim.updater import MegatronUpdater, ParamInfo
from megatron_2bw.checkpointing import files as cf
from megatron_2bw.training.arguments import config_from_args, parse_args
from megatron_2bw.checkpointing.save_load import (LoadedCheckpoint, continuation_line,
                                                 prepare_resume, read_checkpoint,
                                                 scheduler_source)
from megatron_2bw.training.metrics import drop_rows_after
from tests.dist_harness import free_port
from tests.entry_harness import ROOT, TINY, launch

REL = "mp_rank_00/model_optim_rng.pt"


def _save(root: str, iteration: int, value: float = 1.0) -> str:
    """One complete single-rank iteration as save_checkpoint leaves it; its file path."""
    path = os.path.join(cf.iteration_dir(root, iteration), REL)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    entry = cf.write_state(path, {"w": torch.full((256,), value), "iteration": iteration})
    cf.write_manifest(root, iteration, {REL: entry})
    cf.write_tracker(root, iteration)
    return path


# ---------------------------------------------------------------------------- manifest


def test_manifest_records_each_file_and_a_clean_load_passes(tmp_path) -> None:
    root = str(tmp_path)
    path = _save(root, 2)
    manifest = cf.read_manifest(root, 2)
    assert manifest[REL].size == os.path.getsize(path) and len(manifest[REL].sha256) == 64
    assert cf.verify(root, 2, REL)
    assert cf.load_state(root, 2, REL)["iteration"] == 2
    assert not [n for _, _, names in os.walk(root) for n in names if n.endswith(".tmp")]


def test_flipped_byte_names_file_and_previous_complete_iteration(tmp_path) -> None:
    root = str(tmp_path)
    _save(root, 1)
    path = _save(root, 2)
    with open(path, "r+b") as f:  # same size, one bit different deep in the tensor data
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(cf.CheckpointError) as err:
        cf.load_state(root, 2, REL)
    msg = str(err.value)
    assert "sha256" in msg and path in msg and "\n" not in msg
    assert "resume from iteration 1" in msg and f"write 1 into {root}" in msg


def test_truncated_file_names_file_and_sizes(tmp_path) -> None:
    root = str(tmp_path)
    _save(root, 1)
    path = _save(root, 2)
    size = os.path.getsize(path)
    os.truncate(path, size // 2)
    with pytest.raises(cf.CheckpointError, match="truncated") as err:
        cf.load_state(root, 2, REL)
    assert path in str(err.value) and str(size) in str(err.value)
    assert "resume from iteration 1" in str(err.value)


def test_unreadable_file_without_manifest_names_file(tmp_path) -> None:
    root = str(tmp_path)
    path = _save(root, 3)
    os.remove(os.path.join(cf.iteration_dir(root, 3), cf.MANIFEST))
    os.truncate(path, 100)
    with pytest.raises(cf.CheckpointError, match="unreadable") as err:
        cf.load_state(root, 3, REL, warn=lambda m: None)
    assert path in str(err.value) and "no earlier complete checkpoint" in str(err.value)


def test_corrupt_manifest_is_an_error_naming_it(tmp_path) -> None:
    root = str(tmp_path)
    _save(root, 2)
    manifest = os.path.join(cf.iteration_dir(root, 2), cf.MANIFEST)
    with open(manifest, "w") as f:
        f.write('{"files": {')
    with pytest.raises(cf.CheckpointError, match="manifest is unreadable") as err:
        cf.load_state(root, 2, REL)
    assert manifest in str(err.value)


def test_checkpoint_without_manifest_loads_with_one_warning(tmp_path, caplog) -> None:
    """A checkpoint written by Megatron-LM (or before manifests) has no manifest.json."""
    root = str(tmp_path)
    _save(root, 4)
    os.remove(os.path.join(cf.iteration_dir(root, 4), cf.MANIFEST))
    with caplog.at_level(logging.WARNING):
        loaded = read_checkpoint(root, rel=REL)
    assert loaded.iteration == 4 and loaded.state["iteration"] == 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "without checksum verification" in warnings[0]


# ---------------------------------------------------------------------------- failed saves


class _FullDisk:
    """A file whose writes fail with ENOSPC after `limit` bytes, as on a full disk."""

    def __init__(self, path: str, limit: int) -> None:
        self.f, self.left = open(path, "wb"), limit

    def write(self, data) -> int:
        if len(data) > self.left:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.left -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


def test_full_disk_names_the_path_and_keeps_the_previous_checkpoint(tmp_path,
                                                                      monkeypatch) -> None:
    root = str(tmp_path)
    _save(root, 1)
    monkeypatch.setattr(cf, "_open_tmp", lambda path: _FullDisk(path, 300))
    path = os.path.join(cf.iteration_dir(root, 2), REL)
    os.makedirs(os.path.dirname(path))
    with pytest.raises(cf.CheckpointError) as err:
        cf.write_state(path, {"w": torch.zeros(4096)})
    msg = str(err.value)
    assert "disk is full" in msg and path + ".tmp" in msg and "free there" in msg
    assert not os.path.exists(path) and not os.path.exists(path + ".tmp")
    assert cf.read_tracker(root) == 1 and cf.load_state(root, 1, REL)["iteration"] == 1


def test_file_size_limit_is_a_real_os_error_named_in_one_line(tmp_path) -> None:
    """The OS's own failure (ulimit -f, EFBIG), in a fresh child process: torch.save
    reports a failed write as an unrelated RuntimeError, the writer must recover the
    OSError. (A fresh interpreter, not os.fork: forking a process whose torch threads
    hold locks can deadlock the child.)"""
    path = str(tmp_path / "model_optim_rng.pt")
    code = ("import signal, torch\n"
            "from megatron_2bw.checkpointing import files as cf\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "try:\n"
            f"    cf.write_state({path!r}, {{'w': torch.zeros(1 << 16)}})\n"
            "    print('no error')\n"
            "except BaseException as e:\n"
            "    print(f'{type(e).__name__}: {e}')\n")

    def limit() -> None:  # 64 KiB files in the child only
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          preexec_fn=limit, timeout=120, cwd=ROOT)
    text = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr
    assert text.startswith("CheckpointError: ") and "file size limit" in text, text
    assert path + ".tmp" in text and not os.path.exists(path + ".tmp")


def test_leftovers_of_failed_saves_are_removed_and_complete_ones_kept(tmp_path) -> None:
    root = str(tmp_path)
    _save(root, 2)
    leftovers = [os.path.join(root, cf.TRACKER + ".tmp"),
                 os.path.join(cf.iteration_dir(root, 2), "mp_rank_00", "x.pt.tmp"),
                 os.path.join(cf.iteration_dir(root, 3), "mp_rank_01", "model_optim_rng.pt")]
    for path in leftovers:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "w").close()
    removed = cf.clear_for_save(root, 4, overwrite=False)
    assert set(removed) == set(leftovers[:2]) | {cf.iteration_dir(root, 3)}
    assert cf.is_complete(root, 2) and cf.list_iterations(root) == [2]


def test_an_existing_complete_iteration_is_replaced_only_with_overwrite(tmp_path) -> None:
    root = str(tmp_path)
    _save(root, 2)
    with pytest.raises(cf.CheckpointError, match="--overwrite-checkpoints"):
        cf.clear_for_save(root, 2, overwrite=False)
    assert cf.is_complete(root, 2)
    assert cf.clear_for_save(root, 2, overwrite=True) == [cf.iteration_dir(root, 2)]


def test_save_dir_refusals_before_the_first_iteration(tmp_path) -> None:
    root = str(tmp_path)
    cf.check_save_dir(root, 0, overwrite=False)  # empty: fine
    _save(root, 2)
    _save(root, 4)
    with pytest.raises(cf.CheckpointError, match="starts from iteration 0") as err:
        cf.check_save_dir(root, 0, overwrite=False)  # a fresh run would overwrite them
    assert "iter_0000002" in str(err.value) and "--overwrite-checkpoints" in str(err.value)
    with pytest.raises(cf.CheckpointError, match="newer than the resumed iteration 2"):
        cf.check_save_dir(root, 2, overwrite=False)  # iter_4 is complete
    cf.check_save_dir(root, 4, overwrite=False)
    cf.check_save_dir(root, 0, overwrite=True)
    os.remove(os.path.join(cf.iteration_dir(root, 4), cf.MANIFEST))
    cf.check_save_dir(root, 2, overwrite=False)  # an interrupted save's leftover


def test_missing_tracker_with_checkpoints_refuses_to_start_fresh(tmp_path) -> None:
    root = str(tmp_path)
    _save(root, 2)
    _save(root, 4)
    os.remove(os.path.join(root, cf.TRACKER))
    with pytest.raises(cf.CheckpointError) as err:
        read_checkpoint(root, rel=REL)
    msg = str(err.value)
    assert "no latest_checkpointed_iteration.txt" in msg and "write 4 (the newest" in msg
    assert "--overwrite-checkpoints" in msg
    assert read_checkpoint(root, rel=REL, overwrite=True) is None
    assert read_checkpoint(str(tmp_path / "empty"), rel=REL) is None
    cf.write_tracker(root, 4)  # the advice, followed
    assert read_checkpoint(root, rel=REL).iteration == 4


# ------------------------------------------------------------------ saves killed at any moment


def _save_steps(root: str, iteration: int) -> list:
    """save_checkpoint's steps on rank 0 of a one-rank job, in order (saving.py)."""
    path = os.path.join(cf.iteration_dir(root, iteration), REL)
    entries = {}

    def write_tmp() -> None:  # killed inside write_state: the .tmp, not yet renamed
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"w": torch.full((256,), float(iteration)), "iteration": iteration},
                   path + ".tmp")

    def rename() -> None:
        os.replace(path + ".tmp", path)
        with open(path, "rb") as f:
            data = f.read()
        import hashlib
        entries[REL] = cf.FileEntry(hashlib.sha256(data).hexdigest(), len(data))
    return [lambda: os.makedirs(root, exist_ok=True) or cf.settle_late_commit(root),
            lambda: cf.clear_for_save(root, iteration, False),
            lambda: cf.begin_save(root, iteration), write_tmp, rename,
            lambda: cf.write_manifest(root, iteration, entries),
            lambda: cf.write_tracker(root, iteration), lambda: cf.end_save(root, iteration)]


@pytest.mark.parametrize("previous", [None, 2], ids=["first-save", "later-save"])
def test_a_kill_after_any_step_of_a_save_resumes_without_hand_work(tmp_path, previous,
                                                                   caplog) -> None:
    """Cut the save of iteration 4 after each of its steps (what a SIGKILL leaves): the
    next start loads the previous checkpoint (or none, at the first save) until the
    manifest is written, then iteration 4; the start-up checks pass, the save after it
    clears what was left, and no complete iteration is ever removed."""
    for cut in range(len(_save_steps("", 4)) + 1):
        root = str(tmp_path / f"cut{cut}")
        if previous:
            _save(root, previous)
        for step in _save_steps(root, 4)[:cut]:
            step()
        committed = cut >= 6  # the manifest is written
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            loaded = read_checkpoint(root, rel=REL)
        start = loaded.iteration if loaded else 0
        assert start == (4 if committed else previous or 0), (cut, start)
        assert not loaded or loaded.state["iteration"] == start
        if 3 < cut < 6:  # an unfinished save's directory: ignored in one line
            assert caplog.text.count("a save that did not finish") == 1, (cut, caplog.text)
        cf.check_save_dir(root, start, overwrite=False)
        for step in _save_steps(root, 6):  # the resumed run's next save
            step()
        assert cf.list_iterations(root) == sorted({previous or 6, start or 6, 6}), cut
        assert cf.read_tracker(root) == 6 and not os.path.exists(
            os.path.join(root, cf.SAVING))


def test_a_leftover_without_the_marker_is_ignored_when_its_files_show_it(tmp_path) -> None:
    """Before the marker existed (or from a Megatron-LM run), an iteration directory cut
    short holds `.tmp` files or a torch file without its zip end record: ignored too. One
    with whole files and no manifest may be Megatron-LM's: refused, with advice that
    works."""
    root = str(tmp_path)
    path = _save(root, 2)
    os.remove(os.path.join(root, cf.TRACKER))
    os.remove(os.path.join(cf.iteration_dir(root, 2), cf.MANIFEST))
    os.truncate(path, os.path.getsize(path) - 30)
    assert cf.interrupted_saves(root) == [2] and read_checkpoint(root, rel=REL) is None
    cf.check_save_dir(root, 0, overwrite=False)
    _save(root, 3)
    os.remove(os.path.join(root, cf.TRACKER))
    os.remove(os.path.join(cf.iteration_dir(root, 3), cf.MANIFEST))
    with pytest.raises(cf.CheckpointError, match=r"write 3 \(the newest; it has no manifest"):
        read_checkpoint(root, rel=REL)
    cf.write_tracker(root, 3)
    assert read_checkpoint(root, rel=REL).iteration == 3


def test_advice_after_a_corrupt_newest_checkpoint_works(tmp_path) -> None:
    """'write 1 into the tracker and add --overwrite-checkpoints': followed, the run loads
    iteration 1 and passes the --save checks (without the flag it would be refused)."""
    root = str(tmp_path)
    _save(root, 1)
    path = _save(root, 2)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\0\1\2\3")
    with pytest.raises(cf.CheckpointError, match="write 1 into .* add --overwrite-checkpoints"):
        read_checkpoint(root, rel=REL)
    cf.write_tracker(root, 1)
    assert read_checkpoint(root, rel=REL).iteration == 1
    with pytest.raises(cf.CheckpointError, match="newer than the resumed iteration 1"):
        cf.check_save_dir(root, 1, overwrite=False)
    cf.check_save_dir(root, 1, overwrite=True)


# ---------------------------------------------------------------------------- messages


def test_a_missing_iteration_is_named_missing_with_the_complete_ones(tmp_path) -> None:
    root = str(tmp_path)
    _save(root, 2)
    _save(root, 4)
    with pytest.raises(cf.CheckpointError, match=r"--ckpt-step 3: iteration 3 is missing .*"
                       r"complete iterations of --load .*: 2, 4; give one of those"):
        read_checkpoint(root, rel=REL, step=3)
    cf.write_tracker(root, 6)
    with pytest.raises(cf.CheckpointError) as err:
        read_checkpoint(root, rel=REL)
    msg = str(err.value)
    assert "tracker names iteration 6, which is missing" in msg and "layout" not in msg
    assert "write 4 into" in msg
    cf.write_tracker(root, 4)  # the advice, followed
    assert read_checkpoint(root, rel=REL).iteration == 4
    with open(os.path.join(root, cf.TRACKER), "w") as f:
        f.write("abc")
    with pytest.raises(cf.CheckpointError, match="write 4 into it, the newest complete"):
        read_checkpoint(root, rel=REL)
    cf.write_tracker(root, 4)
    os.makedirs(os.path.join(cf.iteration_dir(root, 5), "mp_rank_00"))  # cut short at once
    with pytest.raises(cf.CheckpointError, match="iteration 5 is an interrupted save"):
        read_checkpoint(root, rel=REL, step=5)


def test_another_model_type_is_named_with_its_entry_point() -> None:
    from megatron_2bw.checkpointing.fit import Misfit, misfit_line

    bert = ["encoder.layers.0.mlp.linear_fc1.weight", "binary_head.weight"]
    gpt = ["decoder.layers.0.mlp.linear_fc1.weight", "decoder.final_layernorm.weight"]
    found = [Misfit(n, None, (4,)) for n in gpt] + [Misfit(n, (4,), None) for n in bert]
    line = misfit_line(found, "ck/iter_0000002")
    assert line.startswith("the checkpoint is a BERT checkpoint, this run trains GPT")
    assert "resume it with pretrain_bert.py" in line
    found = [Misfit(n, None, (4,)) for n in bert] + [Misfit(n, (4,), None) for n in gpt]
    assert "is a GPT checkpoint, this run trains BERT" in misfit_line(found, "ck")
    assert "pretrain_gpt.py" in misfit_line(found, "ck")
    same = [Misfit(gpt[0], (4,), (8,))]  # one model type: the tensor, as before
    assert misfit_line(same, "ck").startswith(f"the checkpoint does not fit this model: {gpt[0]}")


def test_every_mismatch_names_the_checkpoints_value_first() -> None:
    from megatron_2bw.checkpointing.restoring import check_optimizer_kind
    from megatron_2bw.checkpointing.save_load import (check_shapes, group_mismatches,
                                                     schedule_mismatches)

    with pytest.raises(cf.CheckpointError, match="saved with --hidden-size 32, this run has 64"):
        check_shapes({"hidden_size": 32}, {"hidden_size": 64}, "ck")
    assert schedule_mismatches({"max_lr": 0.01}, {"max_lr": 0.02, "lr_decay_style": "cosine"},
                               8, "") == [
        "--lr gives 0.01 in the checkpoint, 0.02 in this run"]
    assert group_mismatches([], [{"max_lr": 0.03, "min_lr": 0.0}]) == [
        "--decoupled-lr/--decoupled-min-lr give no decoupled rate in the checkpoint, max 0.03 "
        "and min 0 in this run"]
    run = _run("--optimizer", "muon")
    loaded = LoadedCheckpoint(2, {"args": {"optimizer": "adam"}, "optimizer": {}}, "ck/x.pt")
    with pytest.raises(cf.CheckpointError, match="saved with --optimizer adam, this run has "
                       "--optimizer muon"):
        check_optimizer_kind(loaded, _updater(run).checkpoint_state())


# ---------------------------------------------------------------------------- resume checks


def _run(*flags: str):
    argv = [*TINY, "--global-batch-size", "8", "--pipeline-model-parallel-size", "2",
            "--train-iters", "4", *flags]
    return config_from_args(parse_args("gpt", argv), "gpt", 2, 127)


def _updater(run) -> MegatronUpdater:
    return MegatronUpdater([nn.Parameter(torch.zeros(2))], [ParamInfo("w", False, True, False)],
                           run.optimizer)


def _checkpoint_of(run, iteration: int = 2) -> LoadedCheckpoint:
    """What a checkpoint of `run` at `iteration` holds for the resume checks."""
    sched = _updater(run).scheduler
    sched.step(increment=iteration * run.train.global_batch_size)
    return LoadedCheckpoint(iteration, {"args": run.flags, "optimizer":
                                        {"scheduler": sched.state_dict()}}, "ck/iter_2/x.pt")


@pytest.mark.parametrize("flags,names", [
    (["--lr", "1e-3"], "--lr gives 0.01 in the checkpoint, 0.001 in this run"),
    (["--min-lr", "1e-3", "--lr-decay-style", "linear"], "--lr-decay-style gives constant in the "
                                                          "checkpoint, linear in this run"),
    (["--lr-warmup-iters", "2"], "--lr-warmup-iters/--lr-warmup-fraction gives 0 iterations "
                                 "in the checkpoint, 2 iterations in this run"),
], ids=["lr", "decay-style", "warmup"])
def test_schedule_change_on_resume_is_one_clear_error(flags, names) -> None:
    saved = _checkpoint_of(_run())
    new = _run(*flags)
    with pytest.raises(cf.CheckpointError) as err:
        scheduler_source(saved, _updater(new), new)
    msg = str(err.value)
    assert names in msg and "\n" not in msg, msg
    assert "--override-opt_param-scheduler" in msg and "--use-checkpoint-opt_param-scheduler" \
        in msg


def test_longer_train_iters_changes_the_decay_length_and_names_train_iters() -> None:
    linear = ["--lr-decay-style", "linear"]
    saved = _checkpoint_of(_run(*linear))
    new = _run(*linear, "--train-iters", "8")
    with pytest.raises(cf.CheckpointError, match=r"--train-iters \(the decay length while "
                       r"--lr-decay-iters is unset\) gives 4 iterations in the checkpoint, "
                       r"8 iterations in this run"):
        scheduler_source(saved, _updater(new), new)
    # an explicit --lr-decay-iters keeps the schedule: no error
    fixed = ["--lr-decay-iters", "4"]
    kept = _run(*linear, *fixed, "--train-iters", "8")
    assert scheduler_source(_checkpoint_of(_run(*linear, *fixed)), _updater(kept), kept) == \
        "checkpoint"
    # constant decay both ways: the decay length changes nothing
    const = _run("--train-iters", "8")
    assert scheduler_source(_checkpoint_of(_run()), _updater(const), const) == "checkpoint"


def test_the_two_scheduler_flags_resolve_a_mismatch() -> None:
    saved = _checkpoint_of(_run())
    override = _run("--lr", "1e-3", "--override-opt_param-scheduler")
    keep = _run("--lr", "1e-3", "--use-checkpoint-opt_param-scheduler")
    assert scheduler_source(saved, _updater(override), override) == "flags"
    assert scheduler_source(saved, _updater(keep), keep) == "checkpoint"
    for source, lr in (("flags", 1e-3), ("checkpoint", 1e-2)):
        updater = _updater(override)
        state = {"adam": updater.adam.state_dict(), "muon": updater.muon.state_dict(),
                 "compensation": updater.compensation.state_dict(),
                 "scaler": updater.scaler.state_dict(),
                 "scheduler": saved.state["optimizer"]["scheduler"]}
        updater.load_state_dict(state, scheduler_from=source)
        assert updater.param_groups.lr == pytest.approx(lr)
        assert updater.scheduler.num_steps == 2 * 8


def test_train_iters_below_the_checkpoint_is_an_error_naming_both() -> None:
    with pytest.raises(cf.CheckpointError) as err:
        prepare_resume(_checkpoint_of(_run(), iteration=6), _run("--train-iters", "3"))
    assert "--train-iters 3 is below the checkpoint's iteration 6" in str(err.value)


def test_other_model_shape_is_an_error_naming_the_flag() -> None:
    with pytest.raises(cf.CheckpointError, match="saved with --hidden-size 32, this run has 64"):
        prepare_resume(_checkpoint_of(_run()), _run("--hidden-size", "64"))


def test_schedule_switch_says_which_version_it_continues_from() -> None:
    to_flush = continuation_line("2bw", "flush", 6, saved_versions=2, held=1)
    assert "newest weight version 6" in to_flush and "shadow version 5 is dropped" in to_flush
    to_2bw = continuation_line("flush", "2bw", 6, saved_versions=1, held=2)
    assert "shadow version 5" in to_2bw and "copy of version 6" in to_2bw
    assert continuation_line("2bw", "2bw", 6, 2, 2) is None


def test_restore_masters_from_the_weights_when_the_checkpoint_has_none() -> None:
    """fp32 checkpoint (no masters) resumed with --bf16: the masters must be the restored
    weights, not the initial ones they were built from."""
    run = _run("--bf16")
    weights = [nn.Parameter(torch.randn(8).bfloat16())]
    updater = MegatronUpdater(weights, [ParamInfo("w", False, True, False)], run.optimizer)
    restored = torch.randn(8)
    with torch.no_grad():
        weights[0].copy_(restored)
    updater.restore_masters(None, weights)
    assert torch.equal(updater.masters[0], weights[0].float())
    updater.restore_masters([restored], weights)  # the checkpoint's fp32 values win
    assert torch.equal(updater.masters[0], restored)


def test_restore_masters_of_fp32_weights_go_into_the_newest_buffer_only() -> None:
    """A --bf16 checkpoint (fp32 masters) resumed in fp32: the masters alias weight buffer
    0 at build time, but the newest version may be in buffer 1 (2BW, odd iteration); the
    shadow in buffer 0 must stay as restored."""
    shadow, newest = nn.Parameter(torch.zeros(8)), nn.Parameter(torch.ones(8))
    updater = MegatronUpdater([shadow], [ParamInfo("w", False, True, False)],
                              _run().optimizer)
    assert updater.alias
    saved = torch.randn(8)
    updater.restore_masters([saved], [newest])
    assert torch.equal(newest, saved) and not shadow.any()


def test_drop_rows_after_keeps_one_row_per_iteration(tmp_path) -> None:
    path = str(tmp_path / "m.jsonl")
    rows = [{"split": "train", "iteration": i} for i in (1, 2, 3)] + \
        [{"split": "valid", "iteration": 2}, {"split": "valid", "iteration": 3}]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
        f.write('{"split": "tra')  # torn by the crash
    assert drop_rows_after(path, 2) == 3
    with open(path) as f:
        assert [json.loads(line) for line in f] == [rows[0], rows[1], rows[3]]
    assert drop_rows_after(path, 2) == 0 and drop_rows_after(str(tmp_path / "none"), 0) == 0


# ------------------------------------------------------------------ through the entry point

# the legacy format's files are inspected here (torch_dist: tests/test_sharded_checkpoint.py)
PP2 = ["--global-batch-size", "8", "--pipeline-model-parallel-size", "2", "--ckpt-format",
       "torch"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2BW PP2 run stopped at iteration 2, checkpoints at 1 and 2, its metrics file."""
    work = tmp_path_factory.mktemp("trained")
    metrics = str(work / "m.jsonl")
    launch("gpt", 2, PP2 + ["--pipeline-schedule", "2bw", "--train-iters", "4", "--save",
                            str(work / "ckpt"), "--save-interval", "1", "--exit-interval", "2"],
           metrics)
    return work


def _entry(nproc: int, flags: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), os.path.join(ROOT, "pretrain_gpt.py"), *TINY,
           *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_save_writes_a_manifest_per_iteration(trained) -> None:
    ckpt = str(trained / "ckpt")
    assert cf.list_iterations(ckpt) == [1, 2] and cf.read_tracker(ckpt) == 2
    for it in (1, 2):
        assert sorted(cf.read_manifest(ckpt, it)) == [f"mp_rank_00_00{r}/model_optim_rng.pt"
                                                      for r in (0, 1)]
        assert all(cf.verify(ckpt, it, rel) for rel in cf.read_manifest(ckpt, it))


@pytest.mark.slow
def test_resume_bf16_under_flush_after_a_crash(trained, tmp_path) -> None:
    """Resume the 2BW fp32 checkpoint with --pipeline-schedule flush --bf16 and a new LR
    (--override-opt_param-scheduler, LR 0): the log says which weight version it continues
    from and which LR schedule it uses; the metrics file, where the crashed run had left a
    row of iteration 3 and a torn line, holds iterations 1..3 once; the bf16 run's fp32
    masters are exactly the checkpoint's fp32 weights (LR 0: the step keeps them)."""
    metrics = str(tmp_path / "m.jsonl")
    shutil.copy(trained / "m.jsonl", metrics)
    with open(metrics, "a") as f:
        f.write(json.dumps({"split": "train", "iteration": 3, "loss": 99.0}) + '\n{"spl')
    out = str(tmp_path / "ckpt")
    proc = _entry(2, PP2 + ["--pipeline-schedule", "flush", "--bf16", "--lr", "0",
                            "--override-opt_param-scheduler", "--train-iters", "3", "--load",
                            str(trained / "ckpt"), "--save", out, "--metrics-file", metrics])
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert log.count("resuming a 2bw checkpoint with --pipeline-schedule flush: continuing "
                     "from its newest weight version 2") == 1
    assert log.count("learning-rate schedule from the flags: --lr gives 0.01 in the checkpoint, "
                     "0 in this run") == 1
    with open(metrics) as f:
        rows = [json.loads(line) for line in f]
    train = [r for r in rows if r["split"] == "train"]
    assert [r["iteration"] for r in train] == [1, 2, 3] and train[2]["loss"] != 99.0
    for rank in ("00_000", "00_001"):
        rel = f"mp_rank_{rank}/model_optim_rng.pt"
        before = cf.load_state(str(trained / "ckpt"), 2, rel)
        after = cf.load_state(out, 3, rel)
        assert next(iter(after["model"].values())).dtype == torch.bfloat16
        weights = [t for t in before["model"].values() if t is not None]
        masters = after["optimizer"]["masters"]
        assert len(masters) == len(weights)
        assert all(torch.equal(m, w) for m, w in zip(masters, weights))


@pytest.mark.slow
def test_resume_refuses_a_corrupt_checkpoint_before_training(trained, tmp_path) -> None:
    """Flipped bytes in one rank's file: every rank stops at start-up with the file named
    and the way back to iteration 1; the metrics file is untouched."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(trained / "ckpt", ckpt)
    path = os.path.join(cf.iteration_dir(ckpt, 2), "mp_rank_00_001", "model_optim_rng.pt")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\0\1\2\3")
    proc = _entry(2, PP2 + ["--pipeline-schedule", "2bw", "--train-iters", "4", "--load", ckpt,
                            "--save", ckpt, "--metrics-file", str(tmp_path / "m.jsonl")])
    assert proc.returncode != 0
    line = f"error: checkpoint file corrupt: its sha256 differs from the manifest ({path})"
    assert proc.stderr.count(line) == 1, proc.stderr[-3000:]
    assert "to resume from iteration 1" in proc.stderr
    assert not os.path.exists(tmp_path / "m.jsonl") or not os.path.getsize(tmp_path / "m.jsonl")
