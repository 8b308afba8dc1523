"""Gradient clippers with device-side state: fixed norm, ZClip, AutoClip and AGC.

Every clipper clips gradients in place with :meth:`Clipper.clip_` and returns a :class:`ClipResult` of 0-d
tensors on the gradients' device. Nothing here reads a tensor value on the host (no ``.item()``, no
``if tensor``, no boolean-mask indexing): every decision is a ``torch.where`` and all statistics live in device
tensors, so a training step never waits for the GPU because of clipping. Read the result's tensors only when a
log is due (:meth:`ClipResult.as_floats` does that, and syncs).

Non-finite norms (inf/NaN, e.g. an FP16 overflow step that ``GradScaler`` will skip) are ignored by every
clipper: the gradients are left exactly as they are (multiplied by exactly 1.0, never by NaN or 0), the
statistics do not change and ``clipped`` is False.

Use it after the gradients are unscaled and before ``optimizer.step()`` (in ``Trainer``: after
``accelerator.clip_grad_norm_``, e.g. in ``on_pre_optimizer_step``). Pass ``total_norm`` when the global norm is
already known (Accelerate returns it after unscaling; under FSDP the local gradients are only shards, so the
reduced norm must be passed in).

Torch only: no transformers, no trainer. This module holds the four rules (:class:`NormClipper`, :class:`ZClip`,
:class:`AutoClip`, :class:`AGC`) and :func:`make_clipper`; the :class:`Clipper` base, :class:`ClipResult` and the
global norm are in clipping_base.py and re-exported here.
"""

from __future__ import annotations

import fnmatch
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from hf_mixedprec.core._device import AsyncRead
from hf_mixedprec.recipes.schema import CLIP_DEFAULTS
from hf_mixedprec.training.clipping_base import (
    _COEF_EPS,
    STATE_VERSION,
    Clipper,
    ClipResult,
    _check_float,
    _check_int,
    _mul_,
    _scale_to,
    count_true,
    global_grad_norm,
    with_grads,
)
from hf_mixedprec.training.clipping_base import Params as Params

__all__ = [
    "AGC",
    "CLIP_DEFAULTS",
    "CLIP_METHODS",
    "STATE_VERSION",
    "AutoClip",
    "ClipResult",
    "Clipper",
    "NormClipper",
    "ZClip",
    "global_grad_norm",
    "make_clipper",
    "with_grads",
]

_NORM, _ZCLIP, _AUTOCLIP, _AGC = (CLIP_DEFAULTS[m] for m in ("norm", "zclip", "autoclip", "agc"))


class NormClipper(Clipper):
    """Fixed-threshold global-norm clipping, the same as ``torch.nn.utils.clip_grad_norm_``.

    coef = min(max_norm / (norm + 1e-6), 1), bit-identical to torch for float32 gradients; on a non-finite norm
    the gradients are left untouched (torch would multiply them by 0 or NaN).
    """

    def __init__(self, max_norm: float = _NORM["max_norm"]) -> None:
        super().__init__()
        self.max_norm = _check_float("max_norm", max_norm, low=0.0)

    def config(self) -> dict[str, Any]:
        return {"max_norm": self.max_norm}

    def _clip(
        self, names: list[str] | None, params: list[Tensor], grads: list[Tensor], norm: Tensor, valid: Tensor
    ) -> ClipResult:
        coef = torch.clamp(self.max_norm / (norm + _COEF_EPS), max=1.0)
        coef = torch.where(valid, coef, 1.0)
        _mul_(grads, coef)
        threshold = torch.full((), self.max_norm, dtype=torch.float32, device=norm.device)
        return ClipResult(total_norm=norm, threshold=threshold, clipped=coef < 1.0)


class ZClip(Clipper):
    """ZClip (Kumar et al., 2025, "ZClip: Adaptive Spike Mitigation for LLM Pre-Training"): z-score spike clipping.

    Rules, as in the authors' reference implementation (bluorion-com/ZClip), with g the global norm:

    * Warm-up: the first ``warmup_steps`` finite norms are stored in a device buffer and nothing is clipped
      (except by ``max_norm``). On the step that stores the last of them, mu = mean(buffer) and
      var = population variance mean((buffer - mu)**2) (divide by N, as the reference code). That step is still
      not clipped; adaptive clipping starts with the next finite norm.
    * After: sigma = sqrt(var), z = (g - mu) / (sigma + eps).
      mode "zscore", clip_option "adaptive_scaling" (the paper's reciprocal rule): if z > z_thresh the
      threshold is mu + z_thresh * sigma / (z / z_thresh) = mu + z_thresh**2 * sigma / z.
      mode "zscore", clip_option "mean": if z > z_thresh the threshold is mu.
      mode "percentile": the threshold is mu + z_thresh * sigma, applied when g exceeds it.
      Otherwise no threshold (+inf).
    * EMA with the clipped norm g_c (the threshold when the rule clipped, else g), mean first and the variance
      with the *updated* mean (the reference code's order): mu <- alpha*mu + (1-alpha)*g_c;
      var <- alpha*var + (1-alpha)*(g_c - mu)**2.
    * ``max_norm`` (optional) caps the threshold at every step, warm-up included; it does not enter the EMA
      (as in the reference, the statistics follow the ZClip rule alone).
    * Scaling: when g > threshold the grads are multiplied by threshold / (g + 1e-6).
    * Non-finite g: grads untouched, buffer, count, mu and var unchanged (such steps do not count for warm-up).

    In float32, with as few operations as the rules allow (each is a kernel launch on a GPU): the warm-up
    statistics come from one ``var_mean``, the EMAs are ``lerp`` (x + (1-alpha)*(target - x)) and the
    reciprocal rule one ``addcdiv``; they equal the formulas above up to float32 rounding.

    State (device tensors): ``buffer`` (warmup_steps,), ``count`` (int64, finite norms seen), ``mean``, ``var``.
    """

    _state_names = ("buffer", "count", "mean", "var")

    def __init__(
        self,
        alpha: float = _ZCLIP["alpha"],
        z_thresh: float = _ZCLIP["z_thresh"],
        warmup_steps: int = _ZCLIP["warmup_steps"],
        mode: Literal["zscore", "percentile"] = "zscore",
        clip_option: Literal["adaptive_scaling", "mean"] = "adaptive_scaling",
        max_norm: float | None = _ZCLIP["max_norm"],
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.alpha = _check_float("alpha", alpha, low=0.0, high=1.0)
        if self.alpha == 1.0:
            raise ValueError("alpha must be < 1 (alpha = 1 would never update the statistics)")
        self.z_thresh = _check_float("z_thresh", z_thresh, low=0.0)
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, low=1)
        if mode not in ("zscore", "percentile"):
            raise ValueError(f"mode must be one of: zscore, percentile (got {mode!r})")
        if clip_option not in ("adaptive_scaling", "mean"):
            raise ValueError(f"clip_option must be one of: adaptive_scaling, mean (got {clip_option!r})")
        self.mode = mode
        self.clip_option = clip_option
        self.max_norm = None if max_norm is None else _check_float("max_norm", max_norm, low=0.0)
        self.eps = _check_float("eps", eps, low=0.0, low_open=False)
        self.buffer = torch.zeros(self.warmup_steps, dtype=torch.float32)
        self.count = torch.zeros((), dtype=torch.int64)
        self.mean = torch.zeros((), dtype=torch.float32)
        self.var = torch.zeros((), dtype=torch.float32)
        self._warm_done = False  # host knowledge: a host read saw count >= warmup_steps
        self._slots: Tensor | None = None  # arange(warmup_steps) on the norms' device
        self._warm_read = AsyncRead()  # count >= warmup_steps, read without waiting

    def config(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "z_thresh": self.z_thresh,
            "warmup_steps": self.warmup_steps,
            "mode": self.mode,
            "clip_option": self.clip_option,
            "max_norm": self.max_norm,
            "eps": self.eps,
        }

    def boundary(self) -> Tensor:
        """The norm above which the next step would be clipped: ``mu + z_thresh * sigma`` (inf in warm-up).

        ``max_norm`` caps it. This is what monitoring plots against the grad norm; the value a clipped step
        is scaled to (the reciprocal rule) is lower and is reported in :class:`ClipResult`.
        """
        edge = self.mean + self.z_thresh * self.var.clamp_min(0).sqrt()
        edge = torch.where(self.initialized, edge, torch.full_like(edge, float("inf")))
        if self.max_norm is not None:
            edge = edge.clamp(max=self.max_norm)
        return edge

    @property
    def initialized(self) -> Tensor:
        """Bool tensor: whether the warm-up is over (mean and var hold statistics)."""
        return self.count >= self.warmup_steps

    def host_request(self) -> Tensor | None:
        return None if self._warm_done else (self.count >= self.warmup_steps).float()

    def host_sync(self, value: float | None = None) -> None:
        """Learn (one host read, or ``value`` read by the caller) whether the warm-up is over; from then on steps
        skip the warm-up operations."""
        if not self._warm_done:
            self._warm_done = bool(self.count >= self.warmup_steps) if value is None else value > 0.5

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._warm_done = False
        self._warm_read = AsyncRead()
        self.host_sync()

    def _clip(
        self, names: list[str] | None, params: list[Tensor], grads: list[Tensor], norm: Tensor, valid: Tensor
    ) -> ClipResult:
        # The host knows two facts that drop whole branches without waiting for the device: before the
        # ``warmup_steps``-th call fewer norms than that can have been seen (warm-up for sure), and once it
        # has seen the warm-up end it is over for good. It sees that from an asynchronous read of
        # ``count >= warmup_steps`` started on the call that can end the warm-up (and on later ones until it
        # has), or from a read at a logging step (``host_sync``). The operations dropped would have changed
        # nothing, so every branch gives the same bits.
        calls_before = self.steps - 1
        if not self._warm_done and self._warm_read.poll():
            self._warm_done = True
        if self._warm_done:
            return self._clip_after(grads, norm, valid)
        if calls_before < self.warmup_steps:
            init_possible = calls_before == self.warmup_steps - 1
            result = self._clip_warmup(grads, norm, valid, init_possible=init_possible)
        else:
            result = self._clip_either(grads, norm, valid)
        if calls_before >= self.warmup_steps - 1:
            self._warm_read.push(self.count >= self.warmup_steps)
        return result

    def _store(self, g: Tensor, in_warmup: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Warm-up: store g at slot ``count``; returns (buffer, count, whether the buffer just became full)."""
        n = self.count
        if self._slots is None or self._slots.device != g.device:
            self._slots = torch.arange(self.warmup_steps, device=g.device)
        buffer = torch.where(in_warmup & (self._slots == n), g, self.buffer)
        count = torch.add(n, in_warmup)
        return buffer, count, in_warmup & (count == self.warmup_steps)

    def _rule(self, g: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The ZClip rule with the statistics before this step: (spike, rule threshold, new mean, new var)."""
        mu, var = self.mean, self.var
        zt, k, dev = self.z_thresh, self._k, g.device
        std = var.sqrt()
        if self.mode == "zscore":
            z = (g - mu) / (std + k(self.eps, dev))
            spike = valid & (z > k(zt, dev))
            # mu + (zt * std) / (z / zt), the reciprocal rule, in one operation
            rule = torch.addcdiv(mu, std, z, value=zt * zt) if self.clip_option == "adaptive_scaling" else mu
        else:
            rule = torch.add(mu, std, alpha=zt)
            spike = valid & (g > rule)
        g_c = torch.where(spike, rule, g)
        # alpha * x + (1 - alpha) * target, as x + (1 - alpha) * (target - x)
        mu1 = torch.lerp(mu, g_c, 1.0 - self.alpha)
        var1 = torch.lerp(var, (g_c - mu1).square(), 1.0 - self.alpha)
        return spike, rule, mu1, var1

    def _finish(self, grads: list[Tensor], g: Tensor, valid: Tensor, threshold: Tensor | None) -> ClipResult:
        """Cap by ``max_norm``, scale the gradients where the norm is above the threshold, report."""
        if threshold is None:  # no rule this step
            if self.max_norm is None:  # nothing can clip: the gradients stay as they are (a factor 1.0)
                inf = torch.full((), math.inf, dtype=torch.float32, device=g.device)
                return ClipResult(total_norm=g, threshold=inf, clipped=torch.zeros_like(valid))
            threshold = torch.full((), self.max_norm, dtype=torch.float32, device=g.device)
        elif self.max_norm is not None:
            threshold = torch.clamp(threshold, max=self.max_norm)
        else:  # the threshold is +inf wherever the norm is not finite: no need to mask
            return ClipResult(total_norm=g, threshold=threshold, clipped=_scale_to(grads, g, threshold, None, self._k))
        clipped = _scale_to(grads, g, threshold, valid, self._k)
        return ClipResult(total_norm=g, threshold=threshold, clipped=clipped)

    def _clip_warmup(self, grads: list[Tensor], g: Tensor, valid: Tensor, init_possible: bool) -> ClipResult:
        buffer, count, init_now = self._store(g, valid)  # in warm-up for sure: every valid norm is stored
        self.buffer, self.count = buffer, count
        if init_possible:  # this call may store the last warm-up norm: mean and population variance
            var0, mu0 = torch.var_mean(buffer, correction=0)
            self.mean = torch.where(init_now, mu0, self.mean)
            self.var = torch.where(init_now, var0, self.var)
        return self._finish(grads, g, valid, None)

    def _clip_after(self, grads: list[Tensor], g: Tensor, valid: Tensor) -> ClipResult:
        spike, rule, mu1, var1 = self._rule(g, valid)
        self.count = torch.add(self.count, valid)
        self.mean = torch.where(valid, mu1, self.mean)
        self.var = torch.where(valid, var1, self.var)
        return self._finish(grads, g, valid, torch.where(spike, rule, self._k(math.inf, g.device)))

    def _clip_either(self, grads: list[Tensor], g: Tensor, valid: Tensor) -> ClipResult:
        """Warm-up and rule both computed; which one applies is decided on the device."""
        after = valid & (self.count >= self.warmup_steps)
        buffer, count, init_now = self._store(g, valid ^ after)
        count = torch.add(count, after)
        var0, mu0 = torch.var_mean(buffer, correction=0)
        spike, rule, mu1, var1 = self._rule(g, after)
        self.buffer, self.count = buffer, count
        self.mean = torch.where(init_now, mu0, torch.where(after, mu1, self.mean))
        self.var = torch.where(init_now, var0, torch.where(after, var1, self.var))
        return self._finish(grads, g, valid, torch.where(spike, rule, self._k(math.inf, g.device)))


class AutoClip(Clipper):
    """AutoClip (Seetharaman et al., 2020, "AutoClip: Adaptive Gradient Clipping for Source Separation Networks").

    Threshold = the ``percentile``-th percentile of the history of finite global norms, the current one included;
    when g > threshold the grads are multiplied by threshold / (g + 1e-6). The percentile is numpy's default
    ("linear"): with the n sorted valid norms x, position h = (n - 1) * percentile / 100, i = floor(h),
    t = h - i, result = x[i] + (x[i+1] - x[i]) * t, or x[i+1] - (x[i+1] - x[i]) * (1 - t) when t >= 0.5
    (numpy's monotone lerp), computed in float64 (float32 on mps) and returned as float32.

    The history is a device ring buffer of ``history_size`` norms (oldest overwritten) with a device count;
    invalid slots are set to +inf before sorting, so the n valid norms come first and the position is computed
    on the device. ``history_size=None`` keeps every norm: the buffer grows (doubling) on the host side, which
    knows the number of calls, an upper bound on the number of finite norms. Non-finite norms are not recorded.
    """

    _state_names = ("history", "count")

    def __init__(
        self, percentile: float = _AUTOCLIP["percentile"], history_size: int | None = _AUTOCLIP["history_size"]
    ) -> None:
        super().__init__()
        self.percentile = _check_float("percentile", percentile, low=0.0, high=100.0, low_open=False)
        self.history_size = None if history_size is None else _check_int("history_size", history_size, low=1)
        capacity = self.history_size if self.history_size is not None else 64
        self.history = torch.zeros(capacity, dtype=torch.float32)
        self.count = torch.zeros((), dtype=torch.int64)

    def config(self) -> dict[str, Any]:
        return {"percentile": self.percentile, "history_size": self.history_size}

    def _check_loaded(self, name: str, value: Tensor) -> None:
        if name == "history" and self.history_size is None:
            if value.ndim != 1:
                raise ValueError(f"clipper state history must be 1-D, got shape {tuple(value.shape)}")
            return
        super()._check_loaded(name, value)

    def _grow(self, needed: int) -> None:
        capacity = self.history.numel()
        if needed <= capacity:
            return
        while capacity < needed:
            capacity *= 2
        extra = torch.zeros(capacity - self.history.numel(), dtype=self.history.dtype, device=self.history.device)
        self.history = torch.cat([self.history, extra])

    def _clip(
        self, names: list[str] | None, params: list[Tensor], grads: list[Tensor], norm: Tensor, valid: Tensor
    ) -> ClipResult:
        if self.history_size is None:
            self._grow(self.steps)  # count <= steps, so the next slot always exists
        g = norm
        capacity = self.history.numel()
        positions = torch.arange(capacity, device=g.device)
        write_at = self.count % capacity if self.history_size is not None else self.count
        history = torch.where(valid & (positions == write_at), g, self.history)
        count = self.count + valid.to(torch.int64)
        self.history, self.count = history, count

        n = torch.clamp(count, max=capacity)
        ordered = torch.where(positions < n, history, math.inf).sort().values
        wide = torch.float32 if g.device.type == "mps" else torch.float64
        h = (n - 1).clamp(min=0).to(wide) * (self.percentile / 100.0)
        lo = torch.floor(h).to(torch.int64)
        hi = torch.minimum(lo + 1, (n - 1).clamp(min=0))
        t = h - lo.to(wide)
        a = ordered.gather(0, lo.reshape(1)).reshape(()).to(wide)
        b = ordered.gather(0, hi.reshape(1)).reshape(()).to(wide)
        diff = b - a
        value = torch.where(t >= 0.5, b - diff * (1.0 - t), a + diff * t)
        threshold = torch.where(n > 0, value, math.inf).to(torch.float32)
        clipped = _scale_to(grads, g, threshold, valid, self._k)
        return ClipResult(total_norm=g, threshold=threshold, clipped=clipped)


class AGC(Clipper):
    """Adaptive Gradient Clipping (Brock et al., 2021, "High-Performance Large-Scale Image Recognition Without
    Normalization", NFNets): unit-wise, relative to the weight norm.

    For each parameter with ndim >= 2 and each output unit i (row i: reduce over all dims but 0):
    max_i = clip_factor * max(||W_i||, eps); if ||G_i|| > max_i then G_i <- G_i * max_i / ||G_i||. Parameters with
    ndim <= 1 (biases, norm gains) are one unit each, or skipped with ``include_1d=False``. Norms in float32.

    ``exclude`` skips parameters by name (the paper does not clip the final classifier layer): a callable
    ``name -> bool`` or glob patterns such as ``["lm_head.*"]``; it needs ``model.named_parameters()``.
    ``ClipResult.threshold`` is NaN (there is no single threshold); ``clipped_fraction`` is the fraction of units
    scaled and ``total_norm`` the global norm before clipping; when it is not finite nothing is scaled.
    Rows must be whole: use it with unsharded parameters (single device, DDP), not FSDP shards.
    """

    def __init__(
        self,
        clip_factor: float = _AGC["clip_factor"],
        eps: float = _AGC["eps"],
        exclude: Callable[[str], bool] | Sequence[str] | None = None,
        include_1d: bool = True,
    ) -> None:
        super().__init__()
        self.clip_factor = _check_float("clip_factor", clip_factor, low=0.0)
        self.eps = _check_float("eps", eps, low=0.0, low_open=False)
        if isinstance(exclude, str):
            exclude = [exclude]
        if exclude is not None and not callable(exclude):
            exclude = list(exclude)
            for pattern in exclude:
                if not isinstance(pattern, str):
                    raise ValueError(f"exclude patterns must be strings, got {pattern!r}")
        self.exclude = exclude
        self.include_1d = bool(include_1d)

    def config(self) -> dict[str, Any]:
        exclude: Any = self.exclude
        if callable(exclude):  # a stable description (a repr would hold a memory address)
            exclude = f"callable {getattr(exclude, '__module__', '?')}.{getattr(exclude, '__qualname__', '?')}"
        return {"clip_factor": self.clip_factor, "eps": self.eps, "exclude": exclude, "include_1d": self.include_1d}

    def _excluded(self, name: str) -> bool:
        if self.exclude is None:
            return False
        if callable(self.exclude):
            return bool(self.exclude(name))
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.exclude)

    def _clip(
        self, names: list[str] | None, params: list[Tensor], grads: list[Tensor], norm: Tensor, valid: Tensor
    ) -> ClipResult:
        if self.exclude is not None and names is None:
            raise ValueError("AGC exclude needs parameter names: pass model.named_parameters()")
        device = norm.device
        triggers: list[Tensor] = []
        units = 0
        for i, p in enumerate(params):
            grad = p.grad
            if grad is None or (names is not None and self._excluded(names[i])):
                continue
            if p.ndim <= 1:
                if not self.include_1d:
                    continue
                dims: tuple[int, ...] | None = None
                units += 1
            else:
                dims = tuple(range(1, p.ndim))
                units += p.shape[0]
            w_norm = torch.linalg.vector_norm(p.detach(), 2, dim=dims, keepdim=True, dtype=torch.float32)
            g_norm = torch.linalg.vector_norm(grad, 2, dim=dims, keepdim=True, dtype=torch.float32)
            max_norm = torch.clamp(w_norm, min=self.eps) * self.clip_factor
            trigger = (g_norm > max_norm) & valid.to(grad.device)
            grad.mul_(torch.where(trigger, max_norm / g_norm, 1.0))
            triggers.append(trigger)
        units_clipped = count_true(triggers, device)  # FSDP2 shards: each rank's rows, summed over the ranks
        fraction = units_clipped.to(torch.float32) / max(units, 1)
        return ClipResult(
            total_norm=norm,
            threshold=torch.full((), math.nan, dtype=torch.float32, device=device),
            clipped=units_clipped > 0,
            clipped_fraction=fraction,
        )


CLIP_METHODS: dict[str, type[Clipper] | None] = {
    "none": None,
    "norm": NormClipper,
    "zclip": ZClip,
    "autoclip": AutoClip,
    "agc": AGC,
}
"""Method name (the recipe's ``clipping.method``) -> clipper class; "none" means no clipper."""


def make_clipper(method: str, **params: Any) -> Clipper | None:
    """Build the clipper for a recipe's ``clipping.method`` and parameters (``None`` for "none").

    Parameter names are the recipe's (``max_norm``, ``alpha``, ``z_thresh``, ``warmup_steps``, ``percentile``,
    ``history_size``, ``clip_factor``, ``eps``, plus ``mode``/``clip_option`` for ZClip and ``exclude``/
    ``include_1d`` for AGC), so ``make_clipper(cfg.method, **cfg.params())`` works. Unknown methods or
    parameter names raise ValueError naming them and the allowed values.
    """
    if method not in CLIP_METHODS:
        raise ValueError(f"unknown clipping method {method!r} (allowed: {', '.join(CLIP_METHODS)})")
    cls = CLIP_METHODS[method]
    allowed = [] if cls is None else list(inspect.signature(cls.__init__).parameters)[1:]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        accepted = ", ".join(allowed) if allowed else "none"
        raise ValueError(
            f"unknown parameter(s) {', '.join(map(repr, unknown))} for clipping method {method!r} (allowed: {accepted})"
        )
    return None if cls is None else cls(**params)
