"""Scale-health monitoring: exact detector rules, fault injection with reactions, FP8 fallback, no host sync."""

from __future__ import annotations

import collections
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import TrainerCallback

import hf_mixedprec
from hf_mixedprec.core._device import HOST_COPY_ATTR
from hf_mixedprec.fp8 import EmulatedFP8Linear
from hf_mixedprec.integrations.recipe import HealthConfig, resolve_recipe
from hf_mixedprec.integrations.trainer import runtime_of
from hf_mixedprec.training import health as health_mod
from hf_mixedprec.training.health import HealthMonitor
from hf_mixedprec.training.runtime import GuardScaler, MixedPrecisionRuntime
from tests.integrations.test_integration import _logs, _trainer

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def _health(**detectors) -> HealthConfig:
    return HealthConfig.model_validate({"detectors": detectors})


# -- detector rules, exact ---------------------------------------------------------------------------


def test_grad_spike_zscore_rule():
    mon = HealthMonitor(_health(grad_spike={"threshold": 3.0, "window": 10}))
    norms = [1.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0, 2.0]  # mean 1.5, population std 0.5
    for g in norms:
        mon.pre_step(loss=None, grad_norm=torch.tensor(g))
        mon.post_step(skipped=torch.tensor(0.0), scale=None)
    assert mon.check() == []
    mon.pre_step(loss=None, grad_norm=torch.tensor(2.99))  # z = 2.98: below 3
    mon.post_step(skipped=torch.tensor(0.0), scale=None)
    assert mon.check() == []
    mon.pre_step(loss=None, grad_norm=torch.tensor(100.0))
    mon.post_step(skipped=torch.tensor(0.0), scale=None)
    (ev,) = mon.check()
    assert ev.detector == "grad_spike" and ev.step == 10
    # window now holds the 9 previous finite values (the spike itself is not recorded)
    vals = [*norms, 2.99]
    mean = sum(vals) / 9
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / 9)
    assert ev.value == pytest.approx((100.0 - mean) / std, rel=1e-5)


def test_nonfinite_loss_skip_flag_and_latch_reset():
    mon = HealthMonitor(_health(nonfinite_loss={"reaction": "skip_step"}, skip_rate={"enabled": False}))
    assert not mon.pre_step(loss=torch.tensor(2.0), grad_norm=torch.tensor(1.0)).item()
    mon.post_step(skipped=torch.tensor(0.0), scale=None)
    assert mon.pre_step(loss=torch.tensor(float("nan")), grad_norm=torch.tensor(1.0)).item()
    mon.post_step(skipped=torch.tensor(1.0), scale=None)
    events = mon.check()
    assert [(e.detector, e.step, e.reaction) for e in events] == [("nonfinite_loss", 2, "skip_step")]
    assert mon.check() == []  # latches cleared


def test_skip_rate_consecutive_and_death_spiral():
    mon = HealthMonitor(
        _health(
            skip_rate={"threshold": 0.25, "window": 8},
            consecutive_skips={"threshold": 3},
            death_spiral={"threshold": 3, "window": 6, "reaction": "stop"},
            scale_floor={"threshold": 8.0},
        )
    )
    scale = 64.0
    fired = {}
    # steps 1-2 clean, then persistent overflow: the scale halves every step
    for step in range(1, 9):
        overflow = step >= 3
        mon.pre_step(loss=torch.tensor(1.0), grad_norm=torch.tensor(float("inf") if overflow else 1.0))
        if overflow:
            scale /= 2
        mon.post_step(skipped=torch.tensor(float(overflow)), scale=torch.tensor(scale))
        for e in mon.check():
            fired.setdefault(e.detector, step)
    # skip rate over a window of 8 counts filled steps: 1/3 > 0.25 at step 3
    assert fired["skip_rate"] == 3
    assert fired["consecutive_skips"] == 5  # 3 skips in a row: steps 3, 4, 5
    # backoffs are counted from the second scale seen: steps 3, 4, 5 -> 3 backoffs, no growth
    assert fired["death_spiral"] == 5
    assert fired["scale_floor"] == 5  # 64 -> 32 (step 3), 16 (4), 8 (5): at the floor
    assert scale == 1.0


def test_tiny_update_rule():
    mon = HealthMonitor(_health(tiny_update={"threshold": 1e-3}, skip_rate={"enabled": False}))
    mon.observe_update(torch.tensor(2e-3), torch.tensor(0.0))
    mon.post_step(skipped=torch.tensor(0.0), scale=None)
    mon.observe_update(torch.tensor(0.0), torch.tensor(1.0))  # a skipped step changes nothing on purpose
    mon.post_step(skipped=torch.tensor(1.0), scale=None)
    assert mon.check() == []
    mon.observe_update(torch.tensor(5e-4), torch.tensor(0.0))
    mon.post_step(skipped=torch.tensor(0.0), scale=None)
    (ev,) = [e for e in mon.check() if e.detector == "tiny_update"]
    assert ev.step == 3 and ev.value == pytest.approx(5e-4, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("lr,fires", [(1e-7, True), (2e-3, False)])
def test_tiny_update_on_bf16_weights(tmp_path, lr, fires):
    # plain BF16 weights must be asked for (storage.master none): by default they get an FP32 master
    recipe = _recipe("{health: {fp8_sample_every: 2}, storage: {master: none}}", base="cpu-bf16")
    from hf_mixedprec.core.demo import tiny_llama

    tr = _run(recipe, tmp_path, steps=4, model=tiny_llama().to(torch.bfloat16), learning_rate=lr)
    events = [e for e in runtime_of(tr).events if e["detector"] == "tiny_update"]
    assert [e["step"] for e in events] == ([2, 4] if fires else [])
    if fires:
        assert all(e["value"] < 1e-3 for e in events)


def test_monitor_state_round_trip():
    cfg = _health(grad_spike={"threshold": 3.0, "window": 5})
    a, b = HealthMonitor(cfg), HealthMonitor(cfg)
    for g in (1.0, 1.5, 1.2, 1.1):
        a.pre_step(loss=torch.tensor(g), grad_norm=torch.tensor(g))
        a.post_step(skipped=torch.tensor(0.0), scale=torch.tensor(1024.0))
    b.load_state_dict(a.state_dict())
    assert json.dumps(b.state_dict()) == json.dumps(a.state_dict())
    for mon in (a, b):
        mon.pre_step(loss=torch.tensor(9.0), grad_norm=torch.tensor(9.0))
        mon.post_step(skipped=torch.tensor(0.0), scale=torch.tensor(512.0))
    assert [e.to_dict() for e in a.check()] == [e.to_dict() for e in b.check()]


def test_replay_at_check_equals_checking_every_step():
    """Records stacked across flushes and replayed at one late check give the events and state of a monitor
    that was checked after every step (first step and value of each detector, windows, counters)."""
    cfg = _health(
        grad_spike={"threshold": 4.0, "window": 32},
        loss_spike={"threshold": 4.0, "window": 16},
        skip_rate={"threshold": 0.03, "window": 50},
        death_spiral={"threshold": 3, "window": 20},
    )
    late, eager = HealthMonitor(cfg), HealthMonitor(cfg)
    gen = torch.Generator().manual_seed(0)
    n_steps = 2 * health_mod.FLUSH_EVERY + 37
    eager_events = []
    for step in range(1, n_steps + 1):
        g = 1.0 + 0.1 * float(torch.randn((), generator=gen))
        if step in (300, 301, 560):
            g = 50.0
        loss = float("nan") if step == 400 else 2.0 + 0.05 * float(torch.randn((), generator=gen))
        skipped = float(step in (400, 450, 451))
        scale = 2.0 ** (16 - sum(s <= step for s in (450, 451, 452)))
        for mon in (late, eager):
            mon.pre_step(loss=torch.tensor(loss), grad_norm=torch.tensor(g))
            mon.post_step(skipped=torch.tensor(skipped), scale=torch.tensor(scale))
        eager_events += eager.check()
    late_events = late.check()
    first = {}
    for e in eager_events:
        first.setdefault(e.detector, e)
    assert {e.detector: (e.step, repr(e.value)) for e in late_events} == {
        d: (e.step, repr(e.value)) for d, e in first.items()
    }
    assert {e.detector for e in late_events} >= {"grad_spike", "nonfinite_loss", "skip_rate", "death_spiral"}
    assert first["grad_spike"].step == 300 and first["nonfinite_loss"].step == 400
    assert json.dumps(late.state_dict()) == json.dumps(eager.state_dict())


def test_window_running_sums_decide_like_two_passes():
    w = health_mod._Window(16)
    gen = torch.Generator().manual_seed(1)
    for i in range(500):
        x = 3.0 + float(torch.randn((), generator=gen))
        for thr in (0.5, 1.0, 2.0):
            assert w.above(x, thr) == (w.zscore(x) > thr), (i, thr)
        w.put(i, float("nan") if i % 11 == 0 else x)
        finite = [v for v in w.vals if math.isfinite(v)]
        assert w.n == len(finite) and w.s1 == pytest.approx(math.fsum(finite), rel=1e-12)


# -- fault injection through Trainer ----------------------------------------------------------------


class Overflow(TrainerCallback):
    """inf gradients (one weight) during the backward of the given optimizer steps (1-based); records weights."""

    def __init__(self, steps):
        self.steps, self.armed, self.unchanged = set(steps), False, {}

    def on_train_begin(self, args, state, control, model=None, **kw):
        w = model.model.layers[0].mlp.down_proj.weight
        w.register_hook(lambda g: torch.full_like(g, float("inf")) if self.armed else g)

    def on_step_begin(self, args, state, control, model=None, **kw):
        self.step = state.global_step + 1
        self.armed = self.step in self.steps
        self.before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def on_optimizer_step(self, args, state, control, model=None, **kw):
        self.unchanged[self.step] = all(torch.equal(self.before[n], p) for n, p in model.named_parameters())


def _run(recipe, tmp_path, *, steps, callbacks=(), model=None, resume=None, **targs):
    tr = _trainer(recipe, tmp_path, steps=steps, extra_callbacks=callbacks, model=model, **targs)
    tr.train(resume_from_checkpoint=resume)
    return tr


def _recipe(extra: str, base: str = "v100-fp16"):
    import yaml

    data = {"name": "drill", "extends": base, **yaml.safe_load(extra)}
    return resolve_recipe(data).rehearsed()


@pytest.mark.slow
def test_overflow_steps_are_skipped_exactly_and_counted(tmp_path):
    inject = Overflow({4, 9})
    tr = _run(hf_mixedprec.load_recipe("v100-fp16", rehearse=True), tmp_path, steps=12, callbacks=[inject])
    skipped = _logs(tr, "mp/skipped_steps")
    assert [i + 1 for i in range(12) if skipped[i] > (skipped[i - 1] if i else 0)] == [4, 9]
    assert [s for s, same in inject.unchanged.items() if same] == [4, 9]  # bit for bit, only there
    rt = runtime_of(tr)
    grad_events = [e for e in rt.events if e["detector"] == "nonfinite_grad"]
    assert [e["step"] for e in grad_events] == [4, 9]
    assert _logs(tr, "mp/loss_scale")[-1] == 16384.0  # halved twice


class NanLoss(Overflow):
    """The model's loss is NaN during the given optimizer steps (before the recipe's hook reads it)."""

    def on_train_begin(self, args, state, control, model=None, **kw):
        def hook(module, inputs, output):
            if self.armed and module.training:
                output.loss = output.loss * float("nan")
            return output

        model.register_forward_hook(hook, prepend=True)


@pytest.mark.slow
def test_bf16_guard_skips_nan_loss_steps_exactly(tmp_path):
    inject = NanLoss({3, 7})
    tr = _run(hf_mixedprec.load_recipe("cpu-bf16"), tmp_path, steps=10, callbacks=[inject])
    assert [s for s, same in inject.unchanged.items() if same] == [3, 7]  # bit for bit, only there
    rt = runtime_of(tr)
    assert isinstance(rt.scaler, GuardScaler) and rt.scaler.get_scale() == 1.0  # never backed off
    assert [e["step"] for e in rt.events if e["detector"] == "nonfinite_loss"] == [3, 7]
    assert _logs(tr, "mp/skipped_steps")[-1] == 2.0
    opt = tr.optimizer.optimizer if hasattr(tr.optimizer, "optimizer") else tr.optimizer
    assert {int(s["step"]) for s in opt.state.values()} == {8}  # fused AdamW undid the step count twice


@pytest.mark.parametrize("fused", [True, False])
def test_guard_scaler_skips_only_flagged_steps(fused):
    """Fused AdamW gets the flag directly; a non-AMP-aware optimizer goes through torch's own GradScaler.step."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1, fused=fused)
    rt = MixedPrecisionRuntime(hf_mixedprec.load_recipe("cpu-bf16"))
    scaler = rt.make_guard_scaler()
    changed = []
    for flag in (0.0, 1.0, 0.0):
        loss = lin(torch.randn(2, 4)).square().sum()
        assert scaler.scale(loss) is loss  # a product with 1, not computed
        scaler.scale(loss).backward()
        before = lin.weight.detach().clone()
        rt.amp.mark_skip(opt, torch.tensor(flag))
        scaler.step(opt)
        scaler.update()
        changed.append(not torch.equal(before, lin.weight))
        opt.zero_grad()
    assert changed == [True, False, True]
    assert scaler.get_scale() == 1.0
    scaler.load_state_dict(
        {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 0}
    )
    assert scaler.get_scale() == 1.0  # an FP16 run's scaler.pt cannot make the guard scale


class LrUsed(TrainerCallback):
    """The learning rate each optimizer step used (read after the step, before the scheduler moves on)."""

    def __init__(self):
        self.lr = {}

    def on_optimizer_step(self, args, state, control, optimizer=None, **kw):
        self.lr[state.global_step + 1] = optimizer.param_groups[0]["lr"]


@pytest.mark.slow
def test_skipped_steps_are_taken_out_of_the_lr_schedule_before_the_next_step(tmp_path):
    lr = LrUsed()
    tr = _run(
        hf_mixedprec.load_recipe("v100-fp16", rehearse=True),
        tmp_path,
        steps=12,
        callbacks=[Overflow({2, 7}), lr],
        logging_steps=5,
        lr_scheduler_type="linear",
    )
    rt = runtime_of(tr)
    # Trainer's default fused AdamW skips overflow steps itself, so Accelerate reports them as taken
    assert rt._optimizer_skips_itself
    # a skip is taken back out of the schedule before the next step runs, also between log steps (5, 10)
    rewound = {k: sum(s < k for s in (2, 7)) for k in range(1, 13)}
    expected = {k: 2e-3 * (12 - ((k - 1) - rewound[k])) / 12 for k in range(1, 13)}
    assert lr.lr == pytest.approx(expected, rel=1e-12)
    assert tr.lr_scheduler.last_epoch == 10  # 12 steps, 2 skipped


@pytest.mark.slow
def test_death_spiral_stops_with_a_checkpoint_that_resumes(tmp_path):
    recipe = _recipe("health: {detectors: {death_spiral: {threshold: 4, window: 10, reaction: stop}}}")
    tr = _run(recipe, tmp_path, steps=20, callbacks=[Overflow(range(3, 21))], save_strategy="steps", save_steps=1000)
    rt = runtime_of(tr)
    spiral = [e for e in rt.events if e["detector"] == "death_spiral"]
    assert spiral and spiral[0]["step"] == 6  # 4 backoffs (steps 3-6) without growth, within the window of 10
    assert tr.state.global_step == 6  # stopped right there
    ckpt = tmp_path / "out" / "checkpoint-6"
    # the loss scaler's state rides in the runtime's state in trainer_state.json (not Trainer's scaler.pt)
    stored = json.loads((ckpt / "trainer_state.json").read_text())["stateful_callbacks"]["MixedPrecisionCallback"]
    stored = stored[0] if isinstance(stored, list) else stored
    assert stored["attributes"]["restored"]["scaler"]["scale"] == 65536.0 / 2**4  # 4 backoffs, steps 3-6
    assert any(n.startswith("STOPPED:") and "train in BF16" in n for n in rt.notes)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    resumed = _run(recipe, tmp_path, steps=10, resume=str(ckpt))  # the drill is over: no more overflow
    assert resumed.state.global_step == 10
    assert all(math.isfinite(v) for v in _logs(resumed, "loss"))


@pytest.mark.slow
def test_fp16_fallback_continues_in_bf16(tmp_path):
    recipe = _recipe("health: {detectors: {death_spiral: {threshold: 4, window: 10, reaction: fallback}}}")
    tr = _run(recipe, tmp_path, steps=20, callbacks=[Overflow(range(3, 21))], save_strategy="steps", save_steps=1000)
    rt = runtime_of(tr)
    assert rt.fallback_recipe == "cpu-bf16" and tr.state.global_step == 6
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    bf16 = hf_mixedprec.load_recipe(rt.fallback_recipe)
    resumed = _run(bf16, tmp_path, steps=14, resume=str(tmp_path / "out" / "checkpoint-6"))
    loss = [r["loss"] for r in resumed.state.log_history if "loss" in r and r["step"] > 6]
    assert resumed.state.global_step == 14 and len(loss) == 8
    assert all(math.isfinite(v) for v in loss)
    assert resumed.accelerator.mixed_precision == "bf16"
    assert "mp/loss_scale" not in resumed.state.log_history[-2]  # no FP16 loss scaling any more


class Outlier(TrainerCallback):
    """From step ``at`` on, one input element of one FP8 layer becomes huge (an activation outlier)."""

    def __init__(self, layer: str, at: int):
        self.layer, self.at, self.on = layer, at, False

    def on_train_begin(self, args, state, control, model=None, **kw):
        def pre(mod, args):
            if not self.on:
                return None
            x = args[0].clone()
            x[..., :8] = 3e4  # 8 of the layer's 128 input features
            return (x,)

        dict(model.named_modules())[self.layer].register_forward_pre_hook(pre)

    def on_step_begin(self, args, state, control, **kw):
        self.on = state.global_step + 1 >= self.at


@pytest.mark.slow
def test_fp8_outlier_saturates_one_layer_and_fallback_moves_only_it(tmp_path):
    recipe = _recipe(
        "health: {fp8_sample_every: 1, detectors: {fp8_saturation: {threshold: 0.02, reaction: fallback}}}",
        base="h100-fp8-delayed",
    )
    layer = "model.layers.1.mlp.down_proj"
    tr = _run(recipe, tmp_path, steps=8, callbacks=[Outlier(layer, at=5)])
    sat = [r.get(f"mp/fp8/{layer}/saturation") for r in tr.state.log_history if f"mp/fp8/{layer}/saturation" in r]
    # early delayed-scaling steps clip a few values (up to ~0.5%) while the amax history grows, under the
    # threshold; the outlier step (scaled with last step's amax) saturates 8/128 of the inputs
    assert max(sat[:4]) < 0.02 < sat[4]
    rt = runtime_of(tr)
    fired = {e["layer"] for e in rt.events if e["detector"] == "fp8_saturation"}
    assert fired == {layer}
    kinds = {n: type(m) for n, m in tr.model.named_modules() if n.startswith("model.layers") and n.endswith("_proj")}
    assert len(kinds) == 14  # 2 blocks x (q, k, v, o, gate, up, down)
    assert kinds[layer] is nn.Linear
    assert all(t is EmulatedFP8Linear for n, t in kinds.items() if n != layer)
    assert all(math.isfinite(v) for v in _logs(tr, "loss")), (_logs(tr, "loss"), _logs(tr, "grad_norm"))


# -- no host sync on non-logging steps ----------------------------------------------------------------


class _SyncCounter:
    """Counts host reads (.item(), .tolist(), .cpu(), bool/float/int of a tensor) made from hf_mixedprec code
    (reads of AsyncRead host copies excepted: their values are final in host memory and wait for nothing)."""

    NAMES = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__", "numpy")

    def __init__(self, monkeypatch):
        self.step, self.hits, self.host_copy_reads = 0, [], []
        pkg = str(Path(hf_mixedprec.__file__).parent)
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)

            def wrapper(t, *a, _orig=orig, _name=name, **k):
                frame = sys._getframe(1)
                if frame.f_code.co_filename.startswith(pkg):
                    where = (self.step, _name, f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}")
                    # host copies made by AsyncRead hold final values in host memory: reading them waits for nothing
                    (self.host_copy_reads if getattr(t, HOST_COPY_ATTR, False) else self.hits).append(where)
                return _orig(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, wrapper)


class _StepTracker(TrainerCallback):
    def __init__(self, counter):
        self.counter = counter

    def on_step_begin(self, args, state, control, **kw):
        self.counter.step = state.global_step + 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cpu-bf16", "h100-fp8-delayed", "v100-fp16", "h100-fp8-current+torchao"])
def test_no_host_sync_on_non_logging_steps(tmp_path, monkeypatch, name):
    # a ZClip warm-up of 3 steps ends inside the run: its end is learnt from an AsyncRead host copy
    base, _, backend = name.partition("+")  # +torchao: torchao's Float8Linear with the health probes
    fp8 = f", fp8: {{backend: {backend}}}" if backend else ""
    recipe = _recipe(f"{{clipping: {{method: zclip, warmup_steps: 3}}{fp8}}}", base=base)
    counter = _SyncCounter(monkeypatch)
    _run(recipe, tmp_path, steps=12, callbacks=[_StepTracker(counter)], logging_steps=5)
    off_log = [h for h in counter.hits if h[0] % 5 != 0 and h[0] != 0]
    assert off_log == [], off_log
    assert any(h[0] == 5 for h in counter.hits)  # logging steps do read (metrics)
    # reads of host copies, all through AsyncRead: before each optimizer step, the previous step's skip flag
    # (for the LR schedule) unless the previous step logged and read it there already (steps 6, 11); at the
    # logging steps 5, 10, 12 their own flag as well; at step 4 the read step 3 started (ZClip's warm-up end)
    reads = collections.Counter(s for s, _, f in counter.host_copy_reads if f.startswith("_device.py"))
    assert len(counter.host_copy_reads) == sum(reads.values())
    assert reads == {s: 1 + (s in (4, 5, 10, 12)) for s in range(2, 13) if s not in (6, 11)}


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["a100-bf16", "v100-fp16", "h100-fp8-delayed"])
def test_no_sync_on_cuda_with_sync_debug_mode_error(name):
    """On a GPU, torch itself raises on any host sync inside our per-step code on non-logging steps."""
    import contextlib

    from hf_mixedprec.core.demo import builtin_text, byte_batches, tiny_llama
    from hf_mixedprec.training.runtime import MixedPrecisionRuntime

    recipe = hf_mixedprec.load_recipe(name, rehearse=name != "a100-bf16")
    rt = MixedPrecisionRuntime(recipe, device="cuda")
    model = tiny_llama().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    rt.convert_model(model, opt)
    scaler = rt.make_grad_scaler() or rt.make_guard_scaler()
    batches = byte_batches(builtin_text(), seq_len=64, batch_size=4, n_batches=12, seed=0)

    @contextlib.contextmanager
    def no_sync(on: bool):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if on else "default")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    for step, batch in enumerate(batches, start=1):
        quiet = step % 5 != 0  # steps 5 and 10 log
        x = batch.cuda()
        with no_sync(quiet):
            rt.begin_step(model)
        with rt.autocast():
            loss = model(input_ids=x, labels=x).loss
        rt.record_loss(loss)
        scaler.scale(loss).backward()
        with no_sync(quiet):  # unscales (FP16) or marks the guard's optimizer state itself
            rt.before_optimizer_step(model.parameters(), opt)
        scaler.step(opt)
        scaler.update()
        with no_sync(quiet):
            rt.after_optimizer_step(model, opt)
        opt.zero_grad(set_to_none=True)
        if not quiet:
            rt.check(model, opt)
            assert math.isfinite(rt.metrics()["mp/grad_norm"])


def test_a_detector_set_in_a_recipe_keeps_its_other_defaults():
    r = resolve_recipe(
        {"name": "d", "extends": "v100-fp16", "health": {"detectors": {"death_spiral": {"reaction": "fallback"}}}}
    )
    ds = r.health.detectors.death_spiral
    assert (ds.threshold, ds.window, ds.reaction) == (8, 50, "fallback")
    assert r.health.detectors.skip_rate.threshold == 0.2  # untouched detectors keep theirs too


@pytest.mark.slow
def test_loss_scale_never_goes_below_min_scale(tmp_path):
    recipe = _recipe(
        "{loss_scale: {init_scale: 4.0, min_scale: 1.0}, health: {detectors: {death_spiral: {enabled: false}}}}"
    )
    tr = _run(recipe, tmp_path, steps=6, callbacks=[Overflow(range(1, 7))])
    assert _logs(tr, "mp/loss_scale") == [2.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert _logs(tr, "mp/skipped_steps") == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
