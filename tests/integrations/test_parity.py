"""Entry-point parity: one scenario run at every entry point, each promise of tests/parity_matrix.py asserted on it.

The scenario: a phased recipe (BF16 warm-up, then FP8 delayed scaling from step 3) with BF16 optimizer states,
FP8 statistics every step and a fallback reaction to FP8 saturation; an inf gradient at step 3; from step 5 an
input outlier into the FP8 layers that read layer 1's attention input. Eight steps, logged every second step, a
checkpoint at step 4 from which a second run resumes. Faults are hooks on the model (counted by training forwards),
so the same faults reach a Trainer, an own Accelerate loop, and the models `finetune` and `compare` build.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate.state import AcceleratorState

from hf_mixedprec.integrations.recipe import resolve_recipe
from tests.parity_matrix import CELLS, ENTRIES, NA, PROMISES, REFUSED, YES

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

STEPS, LOG_EVERY, SAVE_AT = 8, 2, 4
INF_AT, OUTLIER_FROM = 3, 5
#: the module whose output (the attention input of layer 1) gets the outlier, and the FP8 layers that read it
NORM = "model.layers.1.input_layernorm"
FED = {f"model.layers.1.self_attn.{p}_proj" for p in "qkv"}
RECIPE = {
    "name": "parity",
    "extends": "h100-fp8-delayed",
    "storage": {"optimizer_states": "bf16"},
    "health": {
        "fp8_sample_every": 1,
        "detectors": {"fp8_saturation": {"threshold": 0.02, "reaction": "fallback"}},
    },
    "phases": [{"name": "warmup", "start": 0, "precision": "bf16"}, {"name": "fp8", "start": 2, "precision": "fp8"}],
}


def _recipe(**changes: Any):
    return resolve_recipe({**RECIPE, **changes}).rehearsed()


class Faults:
    """Hooks on ``model``: step ``INF_AT``'s gradient of one weight is inf, and from step ``OUTLIER_FROM`` on the
    output of ``NORM`` holds an outlier. Steps count training forwards (one per step here); ``done``: steps already
    trained (a resumed run). Forwards in eval mode (measurements, evaluation) are neither counted nor touched."""

    def __init__(self, model: torch.nn.Module, done: int = 0):
        self.model, self.step, self.training = model, done, False
        #: the weights before step INF_AT and before the step after it (taken as those steps' forwards begin)
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        model.register_forward_pre_hook(self._count)
        model.model.layers[0].mlp.down_proj.weight.register_hook(self._inf)
        dict(model.named_modules())[NORM].register_forward_hook(self._outlier)

    def _count(self, module: torch.nn.Module, args: Any) -> None:
        self.training = module.training
        if module.training:
            self.step += 1
            if self.step in (INF_AT, INF_AT + 1):
                self.snapshots[self.step] = {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def _inf(self, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, math.inf) if self.training and self.step == INF_AT else grad

    def _outlier(self, module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        if not (self.training and self.step >= OUTLIER_FROM):
            return None
        out = out.clone()
        out[..., :8] = 3e4
        return out


@dataclass
class Observed:
    """What one entry point's straight run (and its resumed twin) showed, in one shape for every entry point."""

    rows: list[dict[str, Any]]  # the logged rows, each with its step
    skipped: int
    events: list[dict[str, Any]]
    notes: list[str]
    switches: list[tuple[int, str, str]]  # (steps done, phase name, precision)
    moved: list[str]
    optimizer_state_dtypes: set[str]
    report: dict[str, Any] | None
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    weights_before_skip: dict[str, torch.Tensor] = field(default_factory=dict)
    weights_after_skip: dict[str, torch.Tensor] = field(default_factory=dict)
    resumed: Observed | None = None
    checkpoint: Path | None = None  # the straight run's step-SAVE_AT checkpoint


def _state_dtypes(optimizer: Any) -> set[str]:
    inner = getattr(optimizer, "optimizer", optimizer)
    return {str(v.dtype).removeprefix("torch.") for st in inner.state.values() for k, v in st.items() if k != "step"}


def _unchanged_by_skip(faults: Faults) -> list[str]:
    """Parameters the skipped step changed (none, when it was skipped exactly)."""
    before, after = faults.snapshots[INF_AT], faults.snapshots[INF_AT + 1]
    return [n for n in before if not torch.equal(before[n], after[n])]


# -- the entry points ---------------------------------------------------------------------------------------------
def _trainer_run(
    out: Path, *, late: bool, resume_from: Path | None = None, recipe: Any = None
) -> tuple[Observed, Faults]:
    from transformers import Trainer

    from hf_mixedprec.core.demo import tiny_llama
    from hf_mixedprec.integrations.trainer import runtime_of
    from hf_mixedprec.training.run_report import write_run_report
    from tests.integrations.test_integration import Bytes

    if recipe is None:  # late + a storage optimizer: refused (its own cell)
        recipe = _recipe(storage={}) if late else _recipe()
    args = recipe.training_args(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=2e-3,
        report_to=[],
        disable_tqdm=True,
        seed=0,
        logging_steps=LOG_EVERY,
        save_strategy="steps",
        save_steps=SAVE_AT,
    )
    model = tiny_llama()
    faults = Faults(model, done=SAVE_AT if resume_from else 0)
    callbacks = recipe.callbacks()
    trainer = Trainer(model=model, args=args, train_dataset=Bytes(), callbacks=[] if late else callbacks)
    for cb in callbacks if late else ():
        trainer.add_callback(cb)
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    rt = runtime_of(trainer)
    write_run_report(out / "report", log_history=trainer.state.log_history, runtime=rt)
    obs = Observed(
        rows=[r for r in trainer.state.log_history if "step" in r],
        skipped=rt.amp.skipped_count(),
        events=list(rt.events),
        notes=list(rt.notes),
        switches=[(c["step"], c["name"], c["precision"]) for c in rt.phases.changes],
        moved=sorted(rt.moved_layers),
        optimizer_state_dtypes=_state_dtypes(trainer.optimizer),
        report=json.loads((out / "report" / "health.json").read_text()),
        weights={k: v.clone() for k, v in trainer.model.state_dict().items()},
    )
    return obs, faults


def _plugin_run(out: Path, *, resume_from: Path | None = None) -> tuple[Observed, Faults]:
    from hf_mixedprec.core.demo import tiny_llama
    from hf_mixedprec.training.run_report import write_run_report
    from tests.integrations.test_integration import Bytes

    acc = _recipe().accelerator(cpu=True, max_steps=STEPS)
    model = tiny_llama()
    faults = Faults(model, done=SAVE_AT if resume_from else 0)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / STEPS)
    model, opt, sched = acc.prepare(model, opt, sched)
    if resume_from is not None:
        acc.load_state(str(resume_from))
    data = Bytes()
    for step in range(SAVE_AT if resume_from else 0, STEPS):
        batch = {k: torch.stack([data[4 * step + i][k] for i in range(4)]) for k in ("input_ids", "labels")}
        loss = model(**batch).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if (step + 1) % LOG_EVERY == 0:
            acc.mp_metrics(loss=loss.item())
        if step + 1 == SAVE_AT and resume_from is None:
            acc.save_state(str(out / f"checkpoint-{SAVE_AT}"))
    write_run_report(out / "report", log_history=acc.mp_log, runtime=acc.mp)
    rt = acc.mp
    obs = Observed(
        rows=list(acc.mp_log),
        skipped=rt.amp.skipped_count(),
        events=list(rt.events),
        notes=list(rt.notes),
        switches=[(c["step"], c["name"], c["precision"]) for c in rt.phases.changes],
        moved=sorted(rt.moved_layers),
        optimizer_state_dtypes=_state_dtypes(opt),
        report=json.loads((out / "report" / "health.json").read_text()),
        weights={k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()},
    )
    return obs, faults


def _recipe_file(folder: Path, **changes: Any) -> Path:
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "parity.yaml"
    path.write_text(yaml.safe_dump({**RECIPE, **changes}))
    return path


def _with_faults(monkeypatch: pytest.MonkeyPatch, done: int, only_from: str | None = None) -> list[Faults]:
    """Faults on every model ``finetune``/``compare`` builds to train (``only_from``: the builder's caller)."""
    import sys

    import hf_mixedprec.commands.finetune as ft
    import hf_mixedprec.commands.workload as workload

    made: list[Faults] = []
    inner = workload.build_model

    def build_model(*args: Any, **kwargs: Any) -> Any:
        model, desc = inner(*args, **kwargs)
        if only_from is None or sys._getframe(1).f_code.co_name == only_from:
            made.append(Faults(model, done=done))
        return model, desc

    monkeypatch.setattr(ft, "build_model", build_model)  # finetune holds the name; compare looks it up each run
    monkeypatch.setattr(workload, "build_model", build_model)
    return made


FINETUNE_ARGS = [
    "--rehearse", "--max-steps", str(STEPS), "--seq-len", "32", "--batch-size", "4", "--logging-steps",
    str(LOG_EVERY), "--save-steps", str(SAVE_AT), "--save-total-limit", "3", "--eval-split", "0",
]  # fmt: skip


def _finetune_observed(out: Path) -> Observed:
    from safetensors.torch import load_file

    health = json.loads((out / "health.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    steps = sorted({int(s) for series in health["series"].values() for s in series})
    rows = [
        {"step": s, **{k: v[str(s)] for k, v in health["series"].items() if str(s) in v}} for s in steps
    ]  # health.json's series are the Trainer's log rows, by step
    moved = sorted({e["layer"] for e in health["events"] if e.get("reaction") == "fallback" and e.get("layer")})
    opt = torch.load(out / f"checkpoint-{STEPS}" / "optimizer.pt", map_location="cpu", weights_only=False)
    dtypes = {str(v.dtype).removeprefix("torch.") for st in opt["state"].values() for k, v in st.items() if k != "step"}
    return Observed(
        rows=rows,
        skipped=int(summary["skipped_steps"]),
        events=health["events"],
        notes=health["notes"],
        switches=[(c["step"], c["name"], c["precision"]) for c in health.get("phases", [])],
        moved=moved,
        optimizer_state_dtypes=dtypes,
        report=health,
        weights=load_file(str(out / "model.safetensors")),
    )


def _finetune_run(out: Path, resume: bool) -> tuple[Observed, Faults]:
    from hf_mixedprec.cli.app import main

    recipe = _recipe_file(out.parent / "recipe")
    straight = out.parent / "finetune-straight"
    if resume:
        shutil.copytree(straight / f"checkpoint-{SAVE_AT}", out / f"checkpoint-{SAVE_AT}")
    with pytest.MonkeyPatch.context() as mp:
        made = _with_faults(mp, SAVE_AT if resume else 0)
        more = ["--resume", str(out / f"checkpoint-{SAVE_AT}")] if resume else []
        code = main(["finetune", "--recipe", str(recipe), "--output-dir", str(out), *FINETUNE_ARGS, *more])
    assert code == 0 and len(made) == 1
    return _finetune_observed(out), made[0]


def _compare_run(out: Path) -> tuple[Observed, Faults, dict[str, Any]]:
    from hf_mixedprec.cli.app import main
    from hf_mixedprec.commands.compare import EXIT_FAILED

    recipe = _recipe_file(out.parent / "recipe")
    args = ["--max-steps", str(STEPS), "--seq-len", "32", "--batch-size", "4", "--eval-split", "0"]
    with pytest.MonkeyPatch.context() as mp:
        made = _with_faults(mp, 0, only_from="_trainer")  # the trained models, not the FP32 reference
        code = main(["compare", "--recipes", str(recipe), "--output-dir", str(out), *args])
    assert code == EXIT_FAILED  # the recipe fails the comparison (its skipped step): judged, not crashed
    doc = json.loads((out / "compare.json").read_text())
    run = doc["runs"][0]
    obs = Observed(
        rows=[],
        skipped=run["skipped"],
        events=run["events"],
        notes=run["notes"],
        switches=[],
        moved=sorted({e["layer"] for e in run["events"] if e.get("reaction") == "fallback" and e.get("layer")}),
        optimizer_state_dtypes=set(),
        report=doc,
    )
    return obs, made[-1], run


# -- one run per entry point, shared by its cells ------------------------------------------------------------------
_RUNS: dict[str, Any] = {}


def _run(entry: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The entry point's straight run, its resumed twin (in ``Observed.resumed``) and its faults; run once."""
    if entry in _RUNS:
        return _RUNS[entry]
    base = tmp_path_factory.mktemp(entry)
    try:
        AcceleratorState._reset_state(reset_partial_state=True)
        if entry in ("trainer", "late"):
            obs, faults = _trainer_run(base / "straight", late=entry == "late")
            AcceleratorState._reset_state(reset_partial_state=True)
            obs.resumed, _ = _trainer_run(
                base / "resumed", late=entry == "late", resume_from=base / "straight" / f"checkpoint-{SAVE_AT}"
            )
            extra = None
        elif entry == "plugin":
            obs, faults = _plugin_run(base / "straight")
            AcceleratorState._reset_state(reset_partial_state=True)
            obs.resumed, _ = _plugin_run(base / "resumed", resume_from=base / "straight" / f"checkpoint-{SAVE_AT}")
            extra = None
        elif entry == "finetune":
            obs, faults = _finetune_run(base / "finetune-straight", resume=False)
            AcceleratorState._reset_state(reset_partial_state=True)
            obs.resumed, _ = _finetune_run(base / "finetune-resumed", resume=True)
            extra = None
        else:
            obs, faults, extra = _compare_run(base / "compare")
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    if entry != "compare":
        obs.checkpoint = base / ("finetune-straight" if entry == "finetune" else "straight") / f"checkpoint-{SAVE_AT}"
    _RUNS[entry] = (obs, faults, extra)
    return _RUNS[entry]


# -- the promises, as each entry point shows them ---------------------------------------------------------------------
FALLBACK_LAYERS = [f"model.layers.1.self_attn.{p}_proj" for p in "koqv"]  # the outlier's attention projections
THRESHOLD = RECIPE["health"]["detectors"]["fp8_saturation"]["threshold"]


def _skips(entry: str, obs: Observed, faults: Faults, extra: Any) -> None:
    assert obs.skipped == 1
    assert _unchanged_by_skip(faults) == []  # the skipped step changed no weight
    if obs.rows:
        rows = [r for r in obs.rows if "mp/skipped_steps" in r]
        assert [r["mp/skipped_steps"] for r in rows] == [float(s >= INF_AT) for s in _logged(entry)]


def _resume(entry: str, obs: Observed, faults: Faults, extra: Any) -> None:
    again = obs.resumed
    assert again is not None and list(again.weights) == list(obs.weights)
    assert [k for k in obs.weights if not torch.equal(obs.weights[k], again.weights[k])] == []
    assert again.moved == obs.moved and set(obs.moved) >= set(FALLBACK_LAYERS)
    key = lambda e: (e["step"], e["detector"], e.get("layer"))  # noqa: E731
    assert sorted(map(key, again.events)) == sorted(map(key, obs.events))


def _report(entry: str, obs: Observed, faults: Faults, extra: Any) -> None:
    doc = obs.report
    assert doc is not None
    if entry == "compare":
        assert doc["runs"][0]["train_loss"] and len(doc["runs"][0]["train_loss"]) == STEPS
        events = doc["runs"][0]["events"]
    else:
        assert doc["recipe"] == "parity" and doc["precision"] == "bf16->fp8"
        assert sorted(map(int, doc["series"]["loss"])) == _logged(entry)
        events = doc["events"]
    assert _fallen(events) == set(obs.moved) >= set(FALLBACK_LAYERS)
    assert any(n.startswith("FALLBACK") for n in (obs.notes if entry == "compare" else doc["notes"]))


def _phases(entry: str, obs: Observed, faults: Faults, extra: Any) -> None:
    if entry == "compare":
        assert extra["precision"] == "bf16->fp8"
        assert any("phase 'fp8' (fp8) begins after step 2" in n for n in obs.notes)
        return
    assert obs.switches == [(2, "fp8", "fp8")]
    assert [r["mp/phase"] for r in obs.rows if "mp/phase" in r] == [float(s > 2) for s in _logged(entry)]


def _fallen(events: list[dict[str, Any]]) -> set[str]:
    return {e["layer"] for e in events if e["detector"] == "fp8_saturation" and e.get("reaction") == "fallback"}


def _fallbacks(entry: str, obs: Observed, faults: Faults, extra: Any) -> None:
    # exactly the layers whose saturation fired move, the outlier's among them (compare checks every step, so it
    # also sees the jump the outlier's gradients cause in layer 0 a step later)
    assert set(obs.moved) == _fallen(obs.events) >= set(FALLBACK_LAYERS)
    assert all(e["step"] >= OUTLIER_FROM for e in obs.events if e.get("reaction") == "fallback")
    if entry == "compare":
        return
    still_fp8 = [n for n in obs.moved if type(faults.model.get_submodule(n)).__name__ != "Linear"]
    assert still_fp8 == []  # the model trained on with those layers in high precision


def _storage(entry: str, obs: Observed, faults: Faults, extra: Any) -> None:
    if entry == "compare":
        assert extra["storage"]["optimizer_states"] == "bf16" and extra["storage"]["optimizer_class"] == "StorageAdamW"
        return
    assert obs.optimizer_state_dtypes == {"bfloat16"}


def _fp8_health(entry: str, obs: Observed, faults: Faults, extra: Any) -> None:
    if entry == "compare":  # the worst value of each layer over the run
        over = {n for n, v in extra["fp8_layers"].items() if v["saturation"] > THRESHOLD}
    else:
        over = {
            k.split("/")[2]
            for r in obs.rows
            for k, v in r.items()
            if k.startswith("mp/fp8/") and k.endswith("/saturation") and v > THRESHOLD
        }
    # reported above the threshold: some of the outlier's layers, and no layer the fallback did not move
    assert over & set(FALLBACK_LAYERS) and over <= set(obs.moved)


def _logged(entry: str) -> list[int]:
    """The steps an entry point logs: every LOG_EVERY-th, and finetune's first step too (its progress line)."""
    return ([1] if entry == "finetune" else []) + list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))


def _log_row(entry: str, obs: Observed, faults: Faults, extra: Any) -> None:
    rows = [r for r in obs.rows if any(k.startswith("mp/") for k in r)]
    assert [r["step"] for r in rows] == _logged(entry)
    assert all("loss" in r and math.isfinite(r["loss"]) for r in rows)  # beside the step's own loss


def _recipe_change(entry: str, obs: Observed, faults: Faults, extra: Any) -> None:
    from hf_mixedprec.training.recipe_change import RecipeChangeRefused

    assert obs.checkpoint is not None and obs.checkpoint.is_dir()
    other = {"storage": {}} if entry == "late" else {}  # the late run's own storage (its straight run's)
    out = obs.checkpoint.parent.parent / f"{entry}-other-recipe"
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        if entry == "finetune":
            from hf_mixedprec.cli.app import main

            recipe = _recipe_file(out.parent / "other", phases=None)
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                code = main(["finetune", "--recipe", str(recipe), "--output-dir", str(out), *FINETUNE_ARGS,
                             "--resume", str(obs.checkpoint)])  # fmt: skip
            lines = [x for x in err.getvalue().splitlines() if x.startswith("hf-mixedprec: error: ")]
            assert code == 2 and len(lines) == 1 and "Traceback" not in err.getvalue(), err.getvalue()[-3000:]
            line = lines[0]
        elif entry == "plugin":
            acc = _recipe(phases=None).accelerator(cpu=True, max_steps=STEPS)
            from hf_mixedprec.core.demo import tiny_llama

            model = tiny_llama()
            opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
            model, opt = acc.prepare(model, opt)
            with pytest.raises(RecipeChangeRefused) as err:
                acc.load_state(str(obs.checkpoint))
            line = str(err.value)
        else:
            with pytest.raises(RecipeChangeRefused) as err:
                _trainer_run(
                    out, late=entry == "late", resume_from=obs.checkpoint, recipe=_recipe(phases=None, **other)
                )
            line = str(err.value)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert "\n" not in line and "was written under recipe 'parity' (bf16->fp8)" in line, line
    assert "changes precision bf16->fp8 -> fp8" in line and "--allow-recipe-change" in line, line
    assert not out.exists() or not any(out.glob("checkpoint-*"))  # no step trained, nothing saved


CHECKS = {
    "skips": _skips,
    "resume": _resume,
    "report": _report,
    "phases": _phases,
    "fallbacks": _fallbacks,
    "storage": _storage,
    "fp8_health": _fp8_health,
    "log_row": _log_row,
    "recipe_change": _recipe_change,
}

SUPPORTED = [cell for cell, (status, _) in CELLS.items() if status == YES and cell[1] != "refusal"]


@pytest.mark.slow
@pytest.mark.parametrize("entry,promise", SUPPORTED, ids=[f"{e}-{p}" for e, p in SUPPORTED])
def test_a_supported_cell_holds(entry, promise, tmp_path_factory):
    obs, faults, extra = _run(entry, tmp_path_factory)
    CHECKS[promise](entry, obs, faults, extra)


# -- the refusals -------------------------------------------------------------------------------------------------
DEEPSPEED = {"name": "ds-parity", "extends": "cpu-bf16", "distributed": {"strategy": "deepspeed", "zero_stage": 1}}


def _trainer_refusal(recipe: Any, tmp_path: Path, *, late: bool) -> str:
    from transformers import Trainer

    from hf_mixedprec.core.demo import tiny_llama
    from tests.integrations.test_integration import Bytes

    args = recipe.training_args(output_dir=str(tmp_path / "out"), max_steps=2, report_to=[], disable_tqdm=True)
    with pytest.raises(Exception) as err:
        trainer = Trainer(
            model=tiny_llama(), args=args, train_dataset=Bytes(), callbacks=[] if late else recipe.callbacks()
        )
        for cb in recipe.callbacks() if late else ():
            trainer.add_callback(cb)
        trainer.train()
    return str(err.value)


def _cli_refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from hf_mixedprec.cli.app import main

    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err
    return err.splitlines()[-1]  # argparse prints its usage, then the one line


REFUSALS = [cell for cell, (status, _) in CELLS.items() if status == REFUSED or cell[1] == "refusal"]


@pytest.mark.parametrize("entry,promise", REFUSALS, ids=[f"{e}-{p}" for e, p in REFUSALS])
def test_a_refused_cell_is_one_line_naming_what_and_why(entry, promise, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    ds = resolve_recipe(DEEPSPEED)
    ds_file = tmp_path / "ds-parity.yaml"
    ds_file.write_text(json.dumps(DEEPSPEED))  # JSON is YAML
    out = str(tmp_path / "out")
    if promise == "refusal":
        want = "has distributed.strategy deepspeed"
        if entry in ("trainer", "late"):
            line = _trainer_refusal(ds, tmp_path, late=entry == "late")
        elif entry == "plugin":
            with pytest.raises(ValueError) as err:
                ds.accelerator(cpu=True)
            line = str(err.value)
        elif entry == "finetune":
            line = _cli_refusal(["finetune", "--recipe", str(ds_file), "--output-dir", out], capsys)
        else:
            line = _cli_refusal(["compare", "--recipes", str(ds_file), "--output-dir", out], capsys)
    elif (entry, promise) == ("late", "storage"):
        want = "storage"
        line = _trainer_refusal(_recipe(), tmp_path, late=True)
    else:
        assert (entry, promise) == ("compare", "resume")
        want = "unrecognized arguments: --resume"
        line = _cli_refusal(["compare", "--recipes", "cpu-bf16", "--resume", "latest", "--output-dir", out], capsys)
    assert want in line and "\n" not in line.strip(), line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing written


def test_every_cell_is_declared_and_every_refused_or_na_cell_says_why():

    assert set(CELLS) == {(e, p) for e in ENTRIES for p in PROMISES}
    for cell, (status, why) in CELLS.items():
        assert status in (YES, REFUSED, NA), cell
        assert status == YES or len(why) > 20, cell


def test_the_docs_table_is_the_matrix():
    """docs/parity.md is what scripts/gen_parity_table.py makes of the matrix (a declared cell is a cell run here)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gen_parity_table", Path(__file__).parents[2] / "scripts/gen_parity_table.py"
    )
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (Path(__file__).parents[2] / "docs" / "parity.md").read_text() == gen.render()
