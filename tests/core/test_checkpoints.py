"""Checkpoints that survive a kill: the manifest written last, verified before a resume; damaged checkpoints are
passed over loudly (``--resume latest``, ``resume_from_checkpoint=True``) or refused in one line (a named one),
before any step trains; rotation never removes the last complete checkpoint before a newer one is complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_mixedprec.cli.app import main
from hf_mixedprec.core.checkpoints import MANIFEST, CheckpointDamaged, newest_verified, verify, write_manifest
from tests.ranks import leave_group, run_two_ranks

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "tests" / "kill_at_write.py"
FINETUNE = [
    "--max-steps", "4", "--save-steps", "2", "--save-total-limit", "1", "--seq-len", "16", "--batch-size", "2",
    "--eval-split", "0", "--no-save",
]  # fmt: skip


def _complete(folder: Path, mark: bool = True) -> Path:
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"w" * 1000)
    (folder / "optimizer.pt").write_bytes(b"o" * 500)
    attrs = {"hf_mixedprec_manifest": 1} if mark else {}
    (folder / "trainer_state.json").write_text(json.dumps({"stateful_callbacks": {"C": {"attributes": attrs}}}))
    write_manifest(folder)
    return folder


# -- what a folder is -------------------------------------------------------------------------------------------------
def test_verify_names_the_file_and_what_is_wrong(tmp_path):
    ok = _complete(tmp_path / "checkpoint-2")
    assert verify(ok) is None
    cases = {
        "truncated": (lambda f: (f / "optimizer.pt").write_bytes(b"o" * 100), "optimizer.pt: 100 bytes where 500"),
        "garbage": (lambda f: (f / "optimizer.pt").write_bytes(b"x" * 500), "optimizer.pt: its content changed"),
        "missing": (lambda f: (f / "model.safetensors").unlink(), "model.safetensors: missing"),
        "no manifest": (lambda f: (f / MANIFEST).unlink(), f"{MANIFEST} is missing (the save did not finish)"),
        "bad manifest": (lambda f: (f / MANIFEST).write_text("{"), f"{MANIFEST} is unreadable"),
        "no state": (
            lambda f: [(f / MANIFEST).unlink(), (f / "trainer_state.json").unlink()],
            "trainer_state.json is missing or unreadable (the save did not finish)",
        ),
    }
    for i, (name, (damage, said)) in enumerate(cases.items()):
        folder = _complete(tmp_path / f"case-{i}")
        damage(folder)
        assert said in (verify(folder) or ""), name
    # a checkpoint saved without manifests (no promise in its trainer state) is taken as Trainer takes it
    old = _complete(tmp_path / "old", mark=False)
    (old / MANIFEST).unlink()
    assert verify(old) is None


def test_the_newest_complete_checkpoint_is_chosen_and_the_damaged_newer_ones_named(tmp_path):
    _complete(tmp_path / "checkpoint-2")
    _complete(tmp_path / "checkpoint-4")
    (tmp_path / "checkpoint-4" / "optimizer.pt").write_bytes(b"")
    (tmp_path / "checkpoint-6").mkdir()  # killed right after the folder was made
    choice = newest_verified(tmp_path)
    assert choice.path == tmp_path / "checkpoint-2"
    assert choice.note() == (
        "checkpoint-6 is damaged: trainer_state.json is missing or unreadable (the save did not finish); "
        "checkpoint-4 is damaged: optimizer.pt: 0 bytes where 500 were written; resuming from checkpoint-2"
    )


# -- the Trainer callback -------------------------------------------------------------------------------------------
def _trainer(out: Path, steps: int = 8, limit: int | None = 2):
    from transformers import Trainer

    from hf_mixedprec.core.demo import tiny_llama
    from hf_mixedprec.integrations.recipe import load_recipe
    from tests.integrations.test_integration import Bytes

    recipe = load_recipe("cpu-bf16")
    args = recipe.training_args(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=2,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=limit,
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    return Trainer(model=tiny_llama(), args=args, train_dataset=Bytes(), callbacks=recipe.callbacks())


def test_the_trainer_passes_over_a_damaged_newest_checkpoint_and_ends_as_the_straight_run(tmp_path):
    import shutil

    from accelerate.state import AcceleratorState

    from hf_mixedprec.integrations.trainer import runtime_of

    straight = _trainer(tmp_path / "straight", limit=None)
    straight.train()
    want = straight.model.state_dict()
    saved = sorted(p.name for p in (tmp_path / "straight").glob("checkpoint-*"))
    assert saved == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8"]
    assert all(verify(tmp_path / "straight" / p) is None for p in saved)
    run = tmp_path / "run"  # a run cut after step 6, whose disk lost the last write of its checkpoint-6
    for step in (4, 6):
        shutil.copytree(tmp_path / "straight" / f"checkpoint-{step}", run / f"checkpoint-{step}")
    (run / "checkpoint-6" / "optimizer.pt").write_bytes(b"garbage")

    AcceleratorState._reset_state(reset_partial_state=True)
    named = _trainer(run)
    with pytest.raises(CheckpointDamaged, match=r"checkpoint-6' is damaged: optimizer\.pt: 7 bytes where"):
        named.train(resume_from_checkpoint=str(run / "checkpoint-6"))
    assert named.state.global_step == 0  # refused before anything loaded or trained

    AcceleratorState._reset_state(reset_partial_state=True)
    resumed = _trainer(run)
    resumed.train(resume_from_checkpoint=True)
    notes = runtime_of(resumed).notes
    assert any(
        n.startswith("CHECKPOINT: checkpoint-6 is damaged: optimizer.pt") and "resuming from checkpoint-4" in n
        for n in notes
    )
    got = resumed.model.state_dict()
    assert [k for k in want if not torch.equal(want[k], got[k])] == []


def test_finetune_refuses_a_damaged_checkpoint_it_is_told_to_resume_in_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["finetune", "--output-dir", str(out), *FINETUNE]) == 0
    (out / "checkpoint-4" / "model.safetensors").write_bytes(b"")
    capsys.readouterr()
    code = main(["finetune", "--output-dir", str(out), *FINETUNE, "--resume", str(out / "checkpoint-4")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err)
    assert "checkpoint-4' is damaged: model.safetensors: 0 bytes where" in err[-1]
    assert not any("finetune: step" in line for line in err)  # no step trained before the refusal


# -- SIGKILL at every write of a save ---------------------------------------------------------------------------------
TRAINER_SCRIPT = str(REPO / "scripts" / "finetune_trainer.py")
# auto: the recipe this CPU computes fast (cpu-bf16 with native BF16, else cpu-fp32); the test is about checkpoints
TRAINER_ARGS = ["--recipe", "auto", "--max-steps", "4", "--save-steps", "2", "--batch-size", "2", "--seq-len", "16"]
BEFORE_MANIFEST = "manifest"  # killed as the manifest is to be written: every other file of the checkpoint is


def _zygote(tmp: Path, chains: list[list[dict]]) -> list[list[int]]:
    """The chains under tests/kill_at_write.py (one interpreter, a fork per step); each step's exit status."""
    jobs, results = tmp / "jobs.json", tmp / "results.json"
    jobs.write_text(json.dumps(chains))
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(HARNESS), str(jobs), str(results)], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(results.read_text())


def _finetune(out: Path, *extra: str) -> list[str]:
    return ["finetune", "--output-dir", str(out), *FINETUNE, *extra]


def _script(out: Path, *extra: str) -> list[str]:
    return [TRAINER_SCRIPT, "--output-dir", str(out), *TRAINER_ARGS, *extra]


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory):
    """Both entry points, run straight (counting the entries checkpoint-4 ever holds), then killed at each of those
    writes and at the manifest moment, each resumed with ``--resume latest`` / ``resume_from_checkpoint=True``."""
    tmp = tmp_path_factory.mktemp("kills")
    kinds = {"finetune": (_finetune, ("--resume", "latest")), "trainer": (_script, ("--resume",))}
    straight = [
        [{"cmd": cmd(tmp / f"{kind}-straight"), "kill_in": str(tmp / f"{kind}-straight" / "checkpoint-4"), "at": 0,
          "count": str(tmp / f"{kind}.count"), "log": str(tmp / f"{kind}-straight.log")}]
        for kind, (cmd, _) in kinds.items()
    ]  # fmt: skip
    assert _zygote(tmp, straight) == [[0], [0]]
    chains, runs = [], []
    for kind, (cmd, resume) in kinds.items():
        count = int((tmp / f"{kind}.count").read_text())
        assert count >= 8, f"{kind}: checkpoint-4 held {count} entries"  # weights, optimizer, ... and the manifest
        for at in [*range(1, count + 1), BEFORE_MANIFEST]:
            out = tmp / f"{kind}-kill-{at}"
            chains.append([
                {"cmd": cmd(out), "kill_in": str(out / "checkpoint-4"), "at": at, "log": f"{out}.log"},
                {"cmd": cmd(out, *resume), "log": f"{out}.resume.log"},
            ])  # fmt: skip
            runs.append((kind, at, out))
    return tmp, runs, _zygote(tmp, chains)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["finetune", "trainer"])
def test_a_run_killed_at_each_write_of_a_checkpoint_resumes_latest_from_a_verified_one(killed_runs, kind):
    """SIGKILL as each file of checkpoint-4 appears, and as its manifest is to be written; the resumed run (``finetune
    --resume latest``, or a plain Trainer script's ``resume_from_checkpoint=True``) passes over the killed save
    loudly, starts from checkpoint-2 (kept through ``save_total_limit`` 1 rotation) and ends as the straight run."""
    tmp, runs, results = killed_runs
    straight = tmp / f"{kind}-straight"
    want = load_file(straight / "checkpoint-4" / "model.safetensors")
    mine = [(at, out, res) for (k, at, out), res in zip(runs, results, strict=True) if k == kind]
    assert len(mine) >= 9
    for at, out, (killed, resumed) in mine:
        log = Path(f"{out}.resume.log").read_text()
        assert killed == -9, f"kill {at}: {Path(f'{out}.log').read_text()[-2000:]}"
        assert resumed == 0, f"kill {at}: {log[-2000:]}"
        assert "checkpoint-4 is damaged" in log and "resuming from checkpoint-2" in log, (at, log[-2000:])
        assert verify(out / "checkpoint-4") is None, f"kill {at}: the resumed run's checkpoint does not verify"
        got = load_file(out / "checkpoint-4" / "model.safetensors")
        assert [n for n in want if not torch.equal(want[n], got[n])] == [], f"kill {at}: the resumed run diverged"


def test_a_checkpoint_verified_once_is_not_hashed_again_until_a_file_changes(tmp_path, monkeypatch):
    import os

    import hf_mixedprec.core.checkpoints as ck

    folder = _complete(tmp_path / "checkpoint-2")
    hashed: list[str] = []
    inner = ck._sha256
    monkeypatch.setattr(ck, "_sha256", lambda p: hashed.append(p.name) or inner(p))
    assert verify(folder) is None and verify(folder) is None
    assert sorted(hashed) == ["model.safetensors", "optimizer.pt", "trainer_state.json"]  # once each
    (folder / "optimizer.pt").write_bytes(b"x" * 500)  # same size, other content, a later modification time
    os.utime(folder / "optimizer.pt", ns=(1, 10**18))
    assert "optimizer.pt: its content changed" in (verify(folder) or "")


# -- several ranks: rank 0 decides, every rank resumes from the same checkpoint -------------------------------------
def _rank_resume_target(rank: int, init: str, out: str, wanted: object, result: str) -> None:
    torch.set_num_threads(1)  # two ranks share the 2 cores
    import torch.distributed as dist

    import hf_mixedprec.core.checkpoints as ck
    from hf_mixedprec.integrations.checkpointing import resume_target

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    hashed: list[str] = []
    inner = ck._sha256
    ck._sha256 = lambda p: hashed.append(p.name) or inner(p)
    notes: list[str] = []
    try:
        got: object = resume_target(out, wanted, notes.append)
    except CheckpointDamaged as exc:
        got = f"refused: {exc}"
    Path(result).write_text(json.dumps({"target": got, "notes": notes, "hashed": len(hashed)}))
    leave_group()


@pytest.mark.slow
def test_with_two_ranks_rank_0_alone_hashes_and_both_resume_from_the_same_checkpoint(tmp_path):
    _complete(tmp_path / "checkpoint-2")
    _complete(tmp_path / "checkpoint-4")
    (tmp_path / "checkpoint-4" / "optimizer.pt").write_bytes(b"")
    for case, wanted in (("latest", True), ("named", str(tmp_path / "checkpoint-4"))):
        results = [tmp_path / f"{case}-{r}.json" for r in (0, 1)]
        init = f"file://{tmp_path / f'{case}.init'}"
        args = [(r, init, str(tmp_path), wanted, str(results[r])) for r in (0, 1)]
        run_two_ranks(_rank_resume_target, args, timeout=120)
        got = [json.loads(r.read_text()) for r in results]
        assert got[0]["target"] == got[1]["target"] and got[0]["notes"] == got[1]["notes"], case
        assert got[0]["hashed"] > 0 and got[1]["hashed"] == 0, case  # one pass over the files, on rank 0
        if case == "latest":
            assert got[0]["target"] == str(tmp_path / "checkpoint-2")
            assert "checkpoint-4 is damaged: optimizer.pt: 0 bytes where 500 were written" in got[0]["notes"][0]
        else:
            assert (
                got[1]["target"].startswith("refused: resume_from_checkpoint:")
                and "e.g. checkpoint-2" in got[1]["target"]
            )
