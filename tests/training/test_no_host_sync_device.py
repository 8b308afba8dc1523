"""No host-device traffic from hf_mixedprec on a step that does not log, checked on the CPU with tensors that live
on a device other than the host (the meta device).

On a CPU a host-to-device copy is no copy at all, so a test on CPU tensors cannot see one; on a GPU each is a host
sync (an H200 found 168 per step from two such lines). Here every tensor of the step lives on ``meta`` and a
dispatch mode records, from hf_mixedprec's own frames, every operation that moves data between host and device or
reads a device value on the host: a copy across devices, an operation mixing host and device tensors,
``torch.tensor(host data, device=...)``, ``.item()``/``bool()``/``float()`` (``_local_scalar_dense``), ``nonzero`` and
other data-dependent reads. Logging steps read by design (one copy, see test_perf_host_reads.py) and are left out; FP8-sampled
steps are guarded like any other.

What meta cannot run as CUDA does, the test stands in for, and says so: autocast (none on meta: the step computes in
FP32), a fused optimizer (an SGD that skips on the device from the scaler's found-inf flag, as torch's fused AdamW
does) and :class:`~hf_mixedprec.core._device.AsyncRead` (a device-side copy that has not arrived, as on CUDA).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_mixedprec
from hf_mixedprec.core import _device
from hf_mixedprec.core.demo import tiny_llama
from hf_mixedprec.integrations.recipe import resolve_recipe
from hf_mixedprec.recipes.files import builtin_recipe_names
from hf_mixedprec.training.runtime import MixedPrecisionRuntime

PKG = str(Path(hf_mixedprec.__file__).parent)
DEVICE = torch.device("meta")
#: operations that read a device value on the host (a sync on a GPU)
HOST_READS = {
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.is_nonzero",
    "aten.equal",
    "aten.masked_select",
    "aten.unique",
    "aten._unique2",
    "aten.unique_consecutive",
}


def _ours() -> str | None:
    """``file:line`` of the innermost hf_mixedprec frame on the stack, None when there is none."""
    frames = [f for f in traceback.extract_stack() if f.filename.startswith(PKG)]
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else None


def _devices(values: Any) -> set[str]:
    out: set[str] = set()
    for v in values:
        if isinstance(v, torch.Tensor):
            out.add(v.device.type)
        elif isinstance(v, (list, tuple)):
            out |= _devices(v)
    return out


class HostTraffic(TorchDispatchMode):
    """Records (what, where) for every host read or host-device transfer made from hf_mixedprec while ``on``."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.hits: list[tuple[str, str]] = []

    def _hit(self, what: str) -> None:
        where = _ours()
        if where is not None:
            self.hits.append((what, where))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket._qualified_op_name.replace("::", ".")
        if self.on and name == "aten._local_scalar_dense":  # meta has no value: record, answer 0, go on
            self._hit(name)
            return False if args[0].dtype == torch.bool else 0
        if self.on and name in HOST_READS:
            self._hit(name)
        out = func(*args, **kwargs)
        if self.on:
            devices = _devices(list(args) + list(kwargs.values()) + [out])
            if len(devices) > 1:
                self._hit(f"{name} {sorted(devices)}")
        return out


class DeviceSGD(torch.optim.SGD):
    """SGD that skips a flagged step on the device, from the scaler's ``found_inf``, as torch's fused AdamW does
    (``_step_supports_amp_scaling``); meta has no fused kernels."""

    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        found = getattr(self, "found_inf", None)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    update = p.grad * group["lr"]
                    if found is not None:
                        update = torch.where(found > 0, torch.zeros_like(update), update)
                    p.sub_(update)


def _meta_model(blocks: int = 1) -> torch.nn.Module:
    # one decoder block beyond those a recipe keeps out by position (a share, as b200-nvfp4's, keeps none of one block,
    # never every block): every block runs
    # the same code, and on meta each operation costs Python time (MXFP8's block scales go through torch's reference
    # kernels)
    with torch.device(DEVICE):
        model = tiny_llama(num_hidden_layers=blocks)
    return model.train()


def _blocks_kept(recipe) -> int:
    """How many decoder blocks ``recipe``'s ``modules:`` rules keep out of FP8 by position."""
    return max([(r.first_blocks or 0) + (r.last_blocks or 0) for r in recipe.modules] + [0])


@pytest.fixture
def traffic(monkeypatch):
    mode = HostTraffic()
    real_tensor = torch.tensor

    def tensor(*args: Any, **kwargs: Any) -> torch.Tensor:  # its copy to the device is hidden from dispatch modes
        device = kwargs.get("device")
        if mode.on and device is not None and torch.device(device).type != "cpu":
            mode._hit("torch.tensor(host data, device=...)")
        return real_tensor(*args, **kwargs)

    def push(self: Any, value: torch.Tensor) -> None:  # CUDA's asynchronous copy: in flight, not arrived
        if not self.pending:
            self._host, self.pending = value.detach().clone(), True

    monkeypatch.setattr(_device.AsyncRead, "push", push)
    monkeypatch.setattr(_device.AsyncRead, "poll", lambda self: None)
    torch.tensor = tensor
    try:
        yield mode
    finally:
        torch.tensor = real_tensor
        # torch.compile's rules map torch functions by identity, and may have been built while the stand-in was
        # in place (torch's GradScaler reaches dynamo): forget them, so later compiles see the real torch.tensor
        torch._dynamo.trace_rules.get_torch_obj_rule_map.cache_clear()
        torch._dynamo.reset()


def _steps(
    recipe_name: str,
    traffic: HostTraffic,
    *,
    steps: int = 7,
    log_every: int = 5,
    backend: str | None = None,
    build: Callable[[], torch.nn.Module] | None = None,
) -> torch.nn.Module:
    """``steps`` training steps of ``build()`` (default: the tiny Llama on meta) under ``recipe_name``, guarded on
    every step that does not log; returns the model."""
    # FP8 statistics sampled every 3rd step, so sampled steps (3, 6) are among the guarded ones too
    spec = {"name": f"{recipe_name}-guarded", "extends": recipe_name, "health": {"fp8_sample_every": 3}}
    if backend is not None:
        spec["fp8"] = {"backend": backend}
    recipe = resolve_recipe(spec).rehearsed()
    rt = MixedPrecisionRuntime(recipe, device=DEVICE)
    rt.set_max_steps(steps)  # a phased recipe starts its phases at fractions of the run
    model = build() if build is not None else _meta_model(1 + _blocks_kept(recipe))
    opt = DeviceSGD(model.parameters(), lr=1e-3)
    report = rt.convert_model(model, opt)
    assert backend is None or report.backend == backend
    scaler = rt.make_grad_scaler() or rt.make_guard_scaler()
    done = 0
    with traffic:
        for step in range(1, steps + 1):
            traffic.on = step % log_every != 0
            x = torch.zeros(2, 16, dtype=torch.long, device=DEVICE)
            rt.begin_step(model)
            loss = model(input_ids=x, labels=x).loss
            rt.record_loss(loss)
            scaler.scale(loss).backward()
            rt.before_optimizer_step(model.parameters(), opt)
            scaler.step(opt)
            scaler.update()
            rt.after_optimizer_step(model, opt)
            opt.zero_grad(set_to_none=True)
            traffic.on = False
            done += 1
    assert done == steps and rt.steps == steps
    if recipe.precision == "fp8" and recipe.phases is None:  # the sampled steps ran and recorded statistics
        from hf_mixedprec.fp8 import fp8_layers

        layers = [m for _, m in fp8_layers(model)]
        assert layers and all(any(m.measured) for m in layers)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("name", builtin_recipe_names())
def test_no_host_traffic_on_a_step_that_does_not_log(name, traffic):
    _steps(name, traffic)
    assert traffic.hits == [], sorted(set(traffic.hits))


@pytest.mark.parametrize("name", ["h100-fp8-delayed", "h100-fp8-current"])
def test_no_host_traffic_from_the_native_backend(name, traffic):
    """The native layers (torch._scaled_mm on the FP8 data) keep the promise too: dequantization scales are made on
    the device from the quantizers' scales."""
    _steps(name, traffic, backend="native")
    assert traffic.hits == [], sorted(set(traffic.hits))


def test_the_guard_sees_each_kind_of_host_traffic(traffic):
    """The guard is able to fail: each kind of traffic, made from a frame of hf_mixedprec, is recorded."""
    from hf_mixedprec.scaling import fp8 as scaling

    x = torch.ones(3, device=DEVICE)
    with traffic:
        traffic.on = True
        for make in (
            lambda: torch.where(x > 0, torch.zeros(()), x),  # a host tensor as an operand
            lambda: torch.tensor([1.0], device=DEVICE),  # host data copied over
            lambda: x.sum().item(),  # a host read
            lambda: torch.zeros(1).to(DEVICE),  # a copy
        ):
            before = len(traffic.hits)
            scaling._call_for_test = make  # run it from a frame inside the package
            exec(compile("_call_for_test()", scaling.__file__, "exec"), vars(scaling))
            assert len(traffic.hits) == before + 1
        del scaling._call_for_test
