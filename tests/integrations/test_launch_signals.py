"""A 2-rank ``hf-mixedprec launch`` a scheduler can stop: SIGTERM to the launch process's group, and to every
process of the job at once, ends in a complete, verified checkpoint of the step the signal came at, exit code 130, no process
left, and a printed resume command that resumes it (issue: launch died in 0.1 s and forwarded nothing; with every
process signalled the launcher's own second SIGTERM cut the save short)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_mixedprec.core._launcher import children
from hf_mixedprec.core.checkpoints import verify
from hf_mixedprec.integrations.recipe import RECIPE_ENV

REPO = Path(__file__).resolve().parents[2]
FINETUNE = str(REPO / "hf_mixedprec" / "cli" / "finetune.py")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop(RECIPE_ENV, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    return env


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _run_until(argv: list[str], after: str, signal_to: str) -> tuple[int, str, list[int]]:
    """Run ``argv`` (in a process group of its own, as a shell's job); once stderr shows ``after``, SIGTERM its
    process group (``group``: ``kill -TERM -PGID``) or every process of the job (``all``: Slurm); its exit code,
    stderr and the job's PIDs."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)  # fmt: skip
    lines: list[str] = []
    job: list[int] = []
    for line in proc.stderr:
        lines.append(line)
        if after in line:
            agents = children(proc.pid)
            ranks = [r for a in agents for r in children(a)]
            job = [proc.pid, *agents, *ranks]
            assert len(agents) == 1 and len(ranks) == 2, job
            if signal_to == "group":
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                for pid in job:
                    os.kill(pid, signal.SIGTERM)
            break
    err = "".join(lines) + proc.stderr.read()
    proc.wait(timeout=240)
    return proc.returncode, err, job


def test_sigterm_to_launchs_group_or_to_every_process_saves_the_step_and_the_printed_command_resumes_it(tmp_path):
    """The launch process's group holds launch alone (the launcher runs in a session of its own), so ``kill -TERM
    -PGID`` is the signal to launch; then the printed command, stopped as Slurm stops a job."""
    from hf_mixedprec.core.demo import tiny_llama

    base = tmp_path / "base"
    tiny_llama(vocab_size=512).save_pretrained(base)
    out = tmp_path / "run"
    args = ["--model", str(base), "--output-dir", str(out), "--max-steps", "2000", "--logging-steps", "1",
            "--save-steps", "10000", "--seq-len", "16", "--batch-size", "2", "--eval-split", "0"]  # fmt: skip
    launch = [sys.executable, "-m", "hf_mixedprec.cli", "launch", "--recipe", "cpu-fp32", "--num-processes", "2",
              "--grace-s", "90", FINETUNE]  # fmt: skip
    t0 = time.monotonic()
    code, err, job = _run_until([*launch, *args], "step 3/2000", "group")
    assert code == 130, err[-4000:]
    assert "SIGTERM received: the training processes save a checkpoint and stop" in err
    assert "SIGTERM received: forwarded to the 2 training processes" in err
    at = int(err.split("interrupted by SIGTERM at step ")[1].split()[0])
    assert 3 <= at < 2000 and verify(out / f"checkpoint-{at}") is None, err[-4000:]
    assert [p for p in job if _alive(p)] == []
    assert "launch exits with 130" in err and time.monotonic() - t0 < 200
    resume = next(line for line in err.splitlines() if "resume with:" in line).split("resume with: ", 1)[1]
    tokens = shlex.split(resume)
    assert tokens[:2] == ["hf-mixedprec", "launch"] and "--resume" in tokens, resume

    # the printed command, run as printed; stopped the way a scheduler stops a job: every process at once
    code, err2, job = _run_until([sys.executable, "-m", "hf_mixedprec.cli", *tokens[1:]], f"step {at + 3}/2000", "all")
    assert code == 130, err2[-4000:]
    assert f"checkpoint-{at}" in err2 and "resum" in err2
    later = int(err2.split("interrupted by SIGTERM at step ")[1].split()[0])
    assert at + 3 <= later < 2000 and verify(out / f"checkpoint-{later}") is None, err2[-4000:]
    assert "SIGKILL" not in err2 and "KeyboardInterrupt" not in err2, err2[-4000:]
    assert [p for p in job if _alive(p)] == []
