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

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hf_mixedprec.fp8.stats import SampledStats
from hf_mixedprec.scaling.fp8 import FP8Format
from hf_mixedprec.scaling.stats import ROLES, raw_operand_stats

__all__ = ["LayerProbe", "QuantizeRule", "attach_probe", "probe_of"]

#: ``rule(t, role, src_dtype) -> (data, dequantized)`` for a 2-D float32 operand ``t`` ([tokens, features] for
#: input and gradient, [out, in] for the weight), its role ("input", "weight", "grad") and the type it had before
#: the upcast: ``data`` the scaled values the backend would store in FP8 (after saturation), ``dequantized`` what
#: the GEMM computes with. None: the backend keeps that operand in high precision (nothing to measure).
QuantizeRule = Callable[[torch.Tensor, str, torch.dtype], "tuple[torch.Tensor, torch.Tensor] | None"]

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
        self._module = weakref.ref(module)
        self._handle = module.register_forward_hook(self._forward_hook)

    @property
    def module(self) -> nn.Module | None:
        """The backend layer this probe samples (None once it is gone)."""
        return self._module()

    def _forward_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not (self.record_stats and module.training and args and isinstance(args[0], torch.Tensor)):
            return
        self._measure("input", args[0])
        if type(module.weight) in (torch.Tensor, nn.Parameter):  # a subclass arrived quantized (FP8 all-gather)
            self._measure("weight", module.weight)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._grad_hook)

    def _grad_hook(self, grad: torch.Tensor) -> None:
        self._measure("grad", grad)

    def _measure(self, role: str, t: torch.Tensor) -> None:
        t2 = t.detach().reshape(-1, t.shape[-1]).to(torch.float32)
        out = self.rule(t2, role, t.dtype)
        if out is None:
            return
        data, deq = out
        self.records[ROLES.index(role)] = raw_operand_stats(t2, data, deq, self.formats[role])

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
