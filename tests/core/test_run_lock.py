"""One writer per run folder (issue 47): a second process is refused in one line naming the holder, a killed holder
blocks nobody, one process's holds are shared, and the Trainer callback and compare take the lock too."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from hf_mixedprec.core.run_lock import LOCK_NAME, RunFolderBusy, hold_run_folder

#: another run holding a folder as hold_run_folder holds it (plain Python: no seconds of torch imports per process)
HOLD = (
    "import fcntl, json, os, pathlib, socket, sys, time\n"
    "d = pathlib.Path(sys.argv[1]); d.mkdir(parents=True, exist_ok=True)\n"
    "f = open(d / '.hf_mixedprec.lock', 'a+'); fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
    "f.write(json.dumps({'pid': os.getpid(), 'host': socket.gethostname(), 'started': 'then', 'command': 'A'}))\n"
    "f.flush(); print('held', flush=True); time.sleep(600)\n"
)
#: exits 1 when the folder's lock is held by someone else, 0 when it could take it
PROBE = (
    "import fcntl, sys\n"
    "f = open(sys.argv[1] + '/.hf_mixedprec.lock', 'a+')\n"
    "try:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept OSError:\n    sys.exit(1)\n"
)


@pytest.fixture
def holder(tmp_path):
    """Another process holding ``tmp_path / 'run'`` (killed with SIGKILL at the end, as a crashed run is)."""
    folder = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    yield folder, proc
    proc.kill()
    proc.wait()


def test_a_second_process_is_refused_naming_the_holder_and_a_killed_holder_blocks_nobody(holder):
    folder, proc = holder
    with pytest.raises(RunFolderBusy) as err:
        hold_run_folder(folder, key="--output-dir")
    text = str(err.value)
    assert text.startswith(f"--output-dir: {str(folder)!r} is being written by another run: PID {proc.pid} on ")
    assert f"on {socket.gethostname()}, since then (A)" in text and "choose another folder" in text and "\n" not in text
    os.kill(proc.pid, signal.SIGKILL)  # no clean-up runs: the kernel lets go of the lock with the process
    proc.wait()
    release = hold_run_folder(folder, key="--output-dir")
    assert (folder / LOCK_NAME).read_text().count(f'"pid": {os.getpid()}') == 1
    release()
    assert not (folder / LOCK_NAME).exists()  # a run that ends removes its lock file


def test_one_process_shares_its_hold_and_lets_go_after_the_last_release(tmp_path):
    folder = tmp_path / "run"
    first = hold_run_folder(folder, key="--output-dir")
    second = hold_run_folder(folder, key="TrainingArguments.output_dir")  # finetune, then its Trainer callback
    first()
    first()  # a release is done once
    held = subprocess.run([sys.executable, "-c", PROBE, str(folder)], capture_output=True, text=True)
    assert held.returncode == 1  # still held by `second`
    second()
    assert not folder.exists()  # made by the hold, nothing written: removed with the lock
    folder.mkdir()
    free = subprocess.run([sys.executable, "-c", PROBE, str(folder)], capture_output=True, text=True)
    assert free.returncode == 0, free.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_the_trainer_callback_and_compare_refuse_a_folder_another_run_writes(holder, tmp_path):
    import hf_mixedprec
    from hf_mixedprec.commands.compare import run_compare
    from hf_mixedprec.core.demo import tiny_llama
    from tests.integrations.test_integration import Bytes

    folder, proc = holder
    recipe = hf_mixedprec.load_recipe("cpu-fp32")
    args = recipe.training_args(output_dir=str(folder), max_steps=1, report_to=[], disable_tqdm=True)
    from transformers import Trainer

    with pytest.raises(RunFolderBusy, match=rf"^TrainingArguments.output_dir: .* PID {proc.pid} on "):
        Trainer(model=tiny_llama(0), args=args, train_dataset=Bytes(n=4, seq_len=16), callbacks=recipe.callbacks())
    assert sorted(p.name for p in folder.iterdir()) == [LOCK_NAME]  # nothing written
    start = time.perf_counter()
    with pytest.raises(RunFolderBusy, match=rf"^--output-dir: .* PID {proc.pid} on "):
        run_compare(["cpu-fp32"], output_dir=folder, max_steps=2)
    assert time.perf_counter() - start < 10  # refused before any data is prepared or anything trains
