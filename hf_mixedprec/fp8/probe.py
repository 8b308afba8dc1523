"""Per-layer FP8 health for backends whose layers keep no statistics of their own (torchao's ``Float8Linear``,
Transformer Engine's modules).

A :class:`LayerProbe` hangs off one such layer. On sampled steps only (the runtime sets :attr:`record_stats`), a
forward hook quantizes the layer's input and weight, and a hook on the output's gradient the incoming gradient,
with the backend's own rule (a :data:`QuantizeRule` the backend supplies), and keeps the same records the emulated
layers keep (:func:`~hf_mixedprec.scaling.stats.raw_operand_stats` rows, so the runtime stacks, combines over ranks
and finishes them with theirs): amax, saturation, underflow, SQNR. It is a
second quantization of the very tensors the layer quantizes, on the device, with no host read; on other steps the
hooks return at once. Each probe also knows how to put its layer back in high precision (the health fallback).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hf_mixedprec.fp8.stats import SampledStats, held_row, hold, never_measured
from hf_mixedprec.scaling.fp8 import FP8Format
from hf_mixedprec.scaling.stats import ROLES, raw_operand_stats

__all__ = ["LayerProbe", "QuantizeRule", "attach_probe", "probe_of"]

#: ``rule(t, role, src_dtype) -> (data, dequantized)`` for a 2-D float32 operand ``t`` ([tokens, features] for
#: input and gradient, [out, in] for the weight), its role ("input", "weight", "grad") and the type it had before
#: the upcast: ``data`` the scaled values the backend would store in FP8 (after saturation), ``dequantized`` what
#: the GEMM computes with. None: the backend does not quantize that operand this time (nothing to measure); a role
#: the backend never quantizes is left out of the probe's ``formats``.
QuantizeRule = Callable[[torch.Tensor, str, torch.dtype], "tuple[torch.Tensor, torch.Tensor] | None"]

#: the non-persistent buffer a probe adds to its layer: the output gradient's latest row
GRAD_STATS_BUFFER = "fp8_probe_grad_stats"

_PROBES: weakref.WeakKeyDictionary[nn.Module, LayerProbe] = weakref.WeakKeyDictionary()


class LayerProbe(SampledStats):
    """Samples one backend FP8 layer's quantization statistics (see module docs)."""

    def __init__(
        self,
        module: nn.Module,
        rule: QuantizeRule,
        formats: dict[str, FP8Format],
        to_high_precision: Callable[[nn.Module], nn.Module],
    ) -> None:
        self.rule = rule
        self.formats = formats
        self._to_high_precision = to_high_precision
        self.start_records()  # raw_operand_stats rows, as the emulated layers keep them
        # the gradient's row is written in place by the gradient hook (a Python write there would break a compiled
        # graph), held as the emulated layers hold theirs
        module.register_buffer(GRAD_STATS_BUFFER, held_row(module.weight.device), persistent=False)
        self._module = weakref.ref(module)
        self._handle = module.register_forward_hook(self._forward_hook)

    @property
    def module(self) -> nn.Module | None:
        """The backend layer this probe samples (None once it is gone)."""
        return self._module()

    def _forward_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if not (self.record_stats and module.training and args and isinstance(args[0], torch.Tensor)):
            return None
        self._measure("input", args[0])
        if type(module.weight) in (torch.Tensor, nn.Parameter):  # a subclass arrived quantized (FP8 all-gather)
            self._measure("weight", module.weight)
        if isinstance(output, torch.Tensor) and output.requires_grad and "grad" in self.formats:
            held = getattr(module, GRAD_STATS_BUFFER)
            self.records[2] = held
            if torch.compiler.is_compiling():
                # a hook on the output tensor would break a compiled graph at every layer: a copy whose backward
                # measures the gradient (a copy, not a view: a view a custom function returns cannot be modified
                # in place, as an inplace activation after the layer would)
                return _MeasureGrad.apply(output, held, self)
            output.register_hook(functools.partial(self.measure_grad, held))
        return None

    def measure_grad(self, held: torch.Tensor, grad: torch.Tensor) -> None:
        """The output gradient's row, written into ``held`` (the layer's buffer); NaN when the backend did not
        quantize it this time (no scale yet), as never measured."""
        row = self._measure("grad", grad)
        hold(held, never_measured(grad.device) if row is None else row)

    def _measure(self, role: str, t: torch.Tensor) -> torch.Tensor | None:
        """The raw row of ``t`` quantized as the backend would (None: it keeps ``t`` in high precision); the input
        and the weight kept in :attr:`records` (the gradient's row goes to the module's buffer)."""
        t2 = t.detach().reshape(-1, t.shape[-1]).to(torch.float32)
        out = self.rule(t2, role, t.dtype)
        if out is None:
            return None
        data, deq = out
        row = raw_operand_stats(t2, data, deq, self.formats[role])
        if role != "grad":
            self.records[ROLES.index(role)] = row
        return row

    def high_precision(self) -> nn.Module:
        """The layer's high-precision equivalent holding the same Parameter objects (the health fallback)."""
        module = self._module()
        if module is None:  # pragma: no cover - the registry holds probes of live modules only
            raise RuntimeError("the probed layer no longer exists")
        return self._to_high_precision(module)

    def remove(self) -> None:
        self._handle.remove()
        module = self._module()
        if module is not None:
            _PROBES.pop(module, None)


class _MeasureGrad(torch.autograd.Function):
    """A copy of the layer's output, whose backward hands the incoming gradient to a probe (under torch.compile,
    where the copy is fused away)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, held: torch.Tensor, probe: LayerProbe) -> torch.Tensor:
        ctx.held, ctx.probe = held, probe
        return output.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.probe.measure_grad(ctx.held, grad)
        return grad, None, None


def attach_probe(
    module: nn.Module,
    rule: QuantizeRule,
    formats: dict[str, FP8Format],
    to_high_precision: Callable[[nn.Module], nn.Module],
) -> LayerProbe:
    """Attach a :class:`LayerProbe` to ``module`` (replacing an earlier one) and register it."""
    old = _PROBES.get(module)
    if old is not None:
        old.remove()
    probe = LayerProbe(module, rule, formats, to_high_precision)
    _PROBES[module] = probe
    return probe


def probe_of(module: nn.Module) -> LayerProbe | None:
    """The probe attached to ``module``, if any."""
    return _PROBES.get(module)
