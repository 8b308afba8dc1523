"""finetune's run control pieces on their own: the progress bar on a terminal, lines in a log, run folders."""

from __future__ import annotations

import contextlib
import io
from types import SimpleNamespace

import pytest

from hf_mixedprec.core.errors import UsageError
from hf_mixedprec.training.run_control import Progress, check_run_folder, clear_previous_run, latest_checkpoint


def _drive(progress: Progress, steps: int, log_at: int) -> str:
    buf = io.StringIO()
    state = SimpleNamespace(global_step=0, is_world_process_zero=True)
    with contextlib.redirect_stderr(buf):
        progress.on_train_begin(None, state, None)
        for step in range(1, steps + 1):
            state.global_step = step
            progress.on_step_end(None, state, None)
            if step % log_at == 0:
                progress.on_log(None, state, None, logs={"loss": 2.5, "learning_rate": 1e-3})
        progress.on_train_end(None, state, None)
    return buf.getvalue()


def test_a_terminal_gets_a_bar_redrawn_in_place_and_the_log_lines_replace_it():
    out = _drive(Progress(6, 128, bar=True), steps=6, log_at=3)
    assert out.count("\r[") == 6 and "[###############...............] 3/6" in out
    lines = out.split("\n")
    assert "\r\x1b[Kfinetune: step 3/6  loss 2.5000  lr 1.00e-03  elapsed " in lines[0]
    assert "\r\x1b[Kfinetune: step 6/6" in out and out.endswith("\n")
    assert " eta " in lines[0] and " tok/s" in lines[0]


def test_a_log_file_gets_lines_only():
    out = _drive(Progress(6, 128, bar=False), steps=6, log_at=3)
    assert "\r" not in out and out.count("\n") == 2
    assert out.startswith("finetune: step 3/6  loss 2.5000") and "elapsed 0:00  eta 0:00" in out


def test_run_folders(tmp_path):
    out = tmp_path / "run"
    check_run_folder(out, overwrite=False, resume=None)  # a new folder is fine
    (out / "checkpoint-4").mkdir(parents=True)
    (out / "checkpoint-4" / "trainer_state.json").write_text("{}")
    (out / "checkpoint-12").mkdir()
    (out / "checkpoint-12" / "trainer_state.json").write_text("{}")
    (out / "summary.json").write_text("{}")
    (out / "mine.txt").write_text("keep")
    with pytest.raises(UsageError, match="already holds a run"):
        check_run_folder(out, overwrite=False, resume=None)
    check_run_folder(out, overwrite=False, resume=str(out / "checkpoint-4"))  # continuing it is fine
    assert latest_checkpoint(out).name == "checkpoint-12"  # by step number, not by name order
    assert sorted(clear_previous_run(out)) == ["checkpoint-12", "checkpoint-4", "summary.json"]
    assert [p.name for p in out.iterdir()] == ["mine.txt"]


def test_a_signal_delivered_twice_is_one_request_and_a_save_in_progress_is_not_cut_short(monkeypatch, capfd):
    """A scheduler signals every process and the launcher forwards the same signal: within DUPLICATE_S it is the first
    one again; once the checkpoint is being saved a later one waits for it; otherwise a later one stops at once."""
    import signal

    from hf_mixedprec.training import run_control
    from hf_mixedprec.training.run_control import DUPLICATE_S, Interrupt

    clock = [100.0]
    monkeypatch.setattr(run_control.time, "monotonic", lambda: clock[0])
    for name in ("RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    it = Interrupt()
    it._handle(signal.SIGTERM, None)
    assert it.requested == "SIGTERM" and "SIGTERM received: saving a checkpoint" in capfd.readouterr().err
    clock[0] += DUPLICATE_S / 2
    it._handle(signal.SIGTERM, None)  # the same request: nothing happens
    assert capfd.readouterr().err == ""
    it.at_step = 7
    clock[0] += DUPLICATE_S
    it._handle(signal.SIGTERM, None)  # saving: it waits for the save
    assert "the checkpoint of step 7 is saved first" in capfd.readouterr().err
    with pytest.raises(KeyboardInterrupt):
        it._handle(signal.SIGINT, None)  # a third one: at once, even while saving (a hung save)
    fresh = Interrupt()
    fresh._handle(signal.SIGINT, None)
    clock[0] += DUPLICATE_S
    with pytest.raises(KeyboardInterrupt):
        fresh._handle(signal.SIGINT, None)  # a second request, later, before any save: at once
    capfd.readouterr()
    monkeypatch.setenv("RANK", "1")
    rank = Interrupt(world_size=2)
    rank._handle(signal.SIGTERM, None)
    assert rank.requested == "SIGTERM" and capfd.readouterr().err == ""  # rank 0 says it for the job
    for _ in range(3):  # under a launcher a repeat is never a second request: the launcher stops the job at once
        clock[0] += DUPLICATE_S
        rank._handle(signal.SIGTERM, None)
