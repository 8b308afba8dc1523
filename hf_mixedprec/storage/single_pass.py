"""One compiled pass over a large BF16 parameter for :class:`~hf_mixedprec.storage.optim.StorageAdamW` on a CPU.

``StorageAdamW``'s step gathers a run's BF16 weights, remainders or compensations and gradients into FP32 buffers,
runs torch's fused AdamW kernel on them and writes them back: several passes over the data around the kernel's one.
For a parameter of :data:`MIN_ELEMENTS` or more (2**16 or 2**18 elements by master) this module does the same
update in one loop that ``torch.compile`` generates, reading the stored weight, its remainder or compensation, the
gradient and the moments once and writing them once, with the same bits:

* the update is torch's CPU fused AdamW as its source states it (``aten/src/ATen/native/cpu/FusedAdamKernel.cpp``):
  the first moment's lerp a fused multiply-add, the weight decay a product, ``denom = sqrt(v) / sqrt(bias_correction2)
  + eps``, every scalar computed in double and used as float32; the second moment ``v * beta2 + (1 - beta2) * g * g``
  is the fused multiply-add torch's build contracts it into (``torch._inductor.inductor_prims.fma`` keeps each one
  rounding);
* ``bf16_remainder`` runs on pairs of elements: the BF16 weights and int16 remainders read as int32 words (two to a
  word), the FP32 moments as int64 words, so the loop holds no int16 value, which inductor's CPU code generation does
  not vectorise (one such operation makes the whole loop scalar, 5-6x slower); the split and join are those of
  :mod:`hf_mixedprec.storage.bits` in int32;
* ``bf16_kahan`` and ``none`` round with inductor's ``emulate_precision_casts`` (without it a BF16 value stays FP32
  inside the loop and the compensation comes out zero).

Whether the compiled loop gives the multi-pass step's bits depends on the compiler that built torch (where it
contracted a multiply-add), so it is checked once per process and setting (:func:`check`) against ``StorageAdamW``'s
own multi-pass step on a probe of wide-ranging values, infinities and NaNs included; where it differs, or where
``torch.compile`` fails (no C++ compiler), the optimizer says so loudly and keeps the multi-pass step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from hf_mixedprec.core._private import fused_adamw_, in_dispatch_mode, inductor_fma
from hf_mixedprec.storage.bits import _NAN_BITS
from hf_mixedprec.storage.masters import gather_master, store_master

__all__ = ["MIN_ELEMENTS", "MODES", "SinglePass", "check", "eligible", "hyper", "update"]

#: Per master, the parameters of at least this many elements take the single pass; smaller ones are gathered into
#: runs, where the passes stay in cache and a compiled call per parameter (about 25 us) costs more than it saves.
#: Measured with ``scripts/bench_storage_step.py`` (docs/benchmarks.md): at 2**16 elements the single pass took
#: 0.4-0.7x the multi-pass step's time for ``bf16_remainder`` and ``bf16_kahan``, but 0.9-1.3x for ``none`` (whose
#: multi-pass step is already short), which gains from 2**18 on.
MIN_ELEMENTS: dict[str, int] = {"bf16_remainder": 1 << 16, "bf16_kahan": 1 << 16, "none": 1 << 18}

#: The masters the single pass keeps (``bf16_stochastic`` draws from torch's generator in the multi-pass step's order).
MODES = ("bf16_remainder", "bf16_kahan", "none")

log = logging.getLogger("hf_mixedprec")

_LOW32 = 0xFFFFFFFF
_HIGH16 = -65536  # 0xFFFF0000 as an int32

#: builds the multi-pass optimizer a check compares with: ``(optimizer, its step without global hooks)``
Reference = Callable[..., tuple[Any, Callable[[], None]]]

_fma: Callable[..., torch.Tensor] | None = None
_compiled: dict[str, Callable[..., None]] = {}
#: per setting (:func:`_setting`): None where the single pass gave the multi-pass step's bits, else why not
_checked: dict[tuple[Any, ...], str | None] = {}


def hyper(lr: float, beta1: float, beta2: float, weight_decay: float, eps: float, step: float) -> torch.Tensor:
    """The update's scalars as torch's CPU kernel makes them (double, then float32): weight decay factor,
    ``1 - beta1``, ``beta2``, ``1 - beta2``, ``sqrt(bias_correction2)``, ``eps``, ``-lr / bias_correction1``."""
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    values = [1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, math.sqrt(bc2), eps, -lr / bc1]
    return torch.tensor(values, dtype=torch.float32)


def _adamw(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: torch.Tensor) -> tuple[Any, ...]:
    """One AdamW update of FP32 ``p`` (see the module docs): ``(weight, exp_avg, exp_avg_sq)``."""
    fma = _fma
    m1 = fma(h[1].expand_as(m), g - m, m)  # lerp(m, g, 1 - beta1), its weight below 0.5 (beta1 > 0.5)
    v1 = fma(h[3] * g, g, v * h[2])
    return p * h[0] + h[6] * m1 / (v1.sqrt() / h[4] + h[5]), m1, v1


def _pairs_f32(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two FP32 values per int64 word (little-endian: the lower-addressed element in the low half)."""
    return words.to(torch.int32).view(torch.float32), (words >> 32).to(torch.int32).view(torch.float32)


def _words_f32(even: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    return (even.view(torch.int32).to(torch.int64) & _LOW32) | (odd.view(torch.int32).to(torch.int64) << 32)


def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``hf_mixedprec.storage.bits.split_remainder`` in int32: the rounded weight's pattern (low half zero) and the
    signed remainder; a NaN is stored as the quiet NaN."""
    bits = torch.where(torch.isnan(x), _NAN_BITS, x.view(torch.int32))
    rem = (bits << 16) >> 16
    return bits - rem, rem


def _remainder_pairs(
    w: torch.Tensor,
    r: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    h: torch.Tensor,
    bf16_grad: bool,
) -> None:
    """``bf16_remainder``, in place, on words of two elements: ``w``, ``r`` int32 (BF16 weights, int16 remainders),
    ``g`` int32 (BF16) or int64 (FP32), ``m``, ``v`` int64 (FP32)."""
    x_even = ((w << 16) + ((r << 16) >> 16)).view(torch.float32)  # bits = (weight << 16) + signed remainder
    x_odd = ((w & _HIGH16) + (r >> 16)).view(torch.float32)
    if bf16_grad:
        g_even, g_odd = (g << 16).view(torch.float32), (g & _HIGH16).view(torch.float32)
    else:
        g_even, g_odd = _pairs_f32(g)
    m_even, m_odd = _pairs_f32(m)
    v_even, v_odd = _pairs_f32(v)
    x_even, m_even, v_even = _adamw(x_even, g_even, m_even, v_even, h)
    x_odd, m_odd, v_odd = _adamw(x_odd, g_odd, m_odd, v_odd, h)
    hi_even, rem_even = _split(x_even)
    hi_odd, rem_odd = _split(x_odd)
    w.copy_(((hi_even >> 16) & 0xFFFF) | hi_odd)
    r.copy_((rem_even & 0xFFFF) | (rem_odd << 16))
    m.copy_(_words_f32(m_even, m_odd))
    v.copy_(_words_f32(v_even, v_odd))


def _kahan(
    w: torch.Tensor, c: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: torch.Tensor
) -> None:
    """``bf16_kahan``, in place: the master is the BF16 weight plus its BF16 compensation, written back as the
    nearest BF16 weight and what rounding lost (``hf_mixedprec.storage.bits.kahan_store``)."""
    p, m1, v1 = _adamw(w.float() + c.float(), g.float(), m, v, h)
    weight = p.to(torch.bfloat16)
    w.copy_(weight)
    c.copy_((p - weight.float()).to(torch.bfloat16))
    m.copy_(m1)
    v.copy_(v1)


def _nearest(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: torch.Tensor) -> None:
    """``none``, in place: the BF16 weight updated in FP32 and rounded to nearest."""
    p, m1, v1 = _adamw(w.float(), g.float(), m, v, h)
    w.copy_(p.to(torch.bfloat16))
    m.copy_(m1)
    v.copy_(v1)


def _kernel(mode: str) -> Callable[..., None]:
    """``mode``'s compiled update, made once per process (one graph for every size: ``dynamic=True``)."""
    global _fma
    if mode not in _compiled:
        _fma = _fma or inductor_fma()
        fn = {"bf16_remainder": _remainder_pairs, "bf16_kahan": _kahan, "none": _nearest}[mode]
        _compiled[mode] = torch.compile(fn, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True})
    return _compiled[mode]


def eligible(p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], mode: str) -> bool:
    """Whether the single pass can update ``p`` (a local tensor on a CPU) where it is stored: BF16, at least
    :data:`MIN_ELEMENTS` of its master's elements, FP32 moments, a BF16 or FP32 gradient, every tensor contiguous
    (and, for the word views of ``bf16_remainder``, starting at an even offset)."""
    if p.device.type != "cpu" or p.dtype != torch.bfloat16 or mode not in MODES or p.numel() < MIN_ELEMENTS[mode]:
        return False
    extra = {"bf16_remainder": "remainder", "bf16_kahan": "compensation"}.get(mode)
    if extra is not None and extra not in state:
        return False
    tensors = [p, grad, state["exp_avg"], state["exp_avg_sq"], *([state[extra]] if extra else [])]
    if grad.dtype not in (torch.bfloat16, torch.float32) or grad.shape != p.shape or grad.device != p.device:
        return False
    if state["exp_avg"].dtype != torch.float32 or state["exp_avg_sq"].dtype != torch.float32:
        return False
    if not all(t.is_contiguous() and t.shape == p.shape for t in tensors):
        return False
    return mode != "bf16_remainder" or all(t.storage_offset() % 2 == 0 for t in tensors)


#: The body of a parameter is cut at a multiple of this many elements; the rest, its tail, is stepped by torch's
#: fused kernel itself. That kernel steps a tensor's last ``numel % width`` elements one at a time, and there its
#: compiler did not contract the second moment into a fused multiply-add (the vector body's bits differ from the
#: tail's for an FP32 gradient): so its tail is given to it. 16 is a multiple of its vector width on every CPU torch
#: builds for (AVX512: 16 floats, AVX2: 8, NEON: 4).
TAIL_ALIGN = 16


def update(
    p: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    mode: str,
    settings: dict[str, float],
    step: float,
    h: torch.Tensor | None = None,
) -> None:
    """One AdamW step of ``p`` (:func:`eligible`), its state updated in place: the compiled loop over the body, torch's
    fused kernel over the tail (:data:`TAIL_ALIGN`). ``settings``: ``lr``, ``beta1``, ``beta2``, ``weight_decay``,
    ``eps``; ``step``: the step count after this step; ``h``: :func:`hyper` of both (made here when None)."""
    w, m, v = p.detach().view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
    g = grad.view(-1)
    extra = state["remainder"].view(-1) if mode == "bf16_remainder" else None
    extra = state["compensation"].view(-1) if mode == "bf16_kahan" else extra
    n = w.numel()
    body = n - n % TAIL_ALIGN
    if body:
        if h is None:
            h = hyper(**settings, step=step)
        w_, g_, m_, v_ = w[:body], g[:body], m[:body], v[:body]
        # under torch.compile's default stance whatever the caller's (torch.compiler.set_stance): run eagerly,
        # inductor_prims.fma rounds twice and the bits change
        with torch.compiler.set_stance("default"):
            if mode == "bf16_remainder":
                assert extra is not None
                words = g_.view(torch.int32) if g.dtype == torch.bfloat16 else g_.view(torch.int64)
                r_, bf16_grad = extra[:body].view(torch.int32), g.dtype == torch.bfloat16
                _kernel(mode)(w_.view(torch.int32), r_, words, m_.view(torch.int64), v_.view(torch.int64), h, bf16_grad)
            elif mode == "bf16_kahan":
                assert extra is not None
                _kernel(mode)(w_, extra[:body], g_, m_, v_, h)
            else:
                _kernel(mode)(w_, g_, m_, v_, h)
    if body < n:
        _tail(mode, w[body:], None if extra is None else extra[body:], g[body:], m[body:], v[body:], settings, step)


def _tail(
    mode: str,
    w: torch.Tensor,
    extra: torch.Tensor | None,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    settings: dict[str, float],
    step: float,
) -> None:
    """The last elements of a parameter as the multi-pass step does them: the FP32 master made, torch's fused kernel,
    the master stored back (:mod:`hf_mixedprec.storage.masters`)."""
    state = {"remainder": extra, "compensation": extra}  # the one ``mode`` keeps, if any
    master = gather_master([w], [state], mode)
    fused_adamw_([master], [g.float()], [m], [v], [torch.tensor(step, dtype=torch.float32)], **settings)
    store_master([w], [state], mode, master, [w.numel()], None)


class SinglePass:
    """One optimizer's use of the single pass: which of its parameters take it, the check, the step, and what it
    said.

    ``master``, ``state_dtype``: the optimizer's storage; ``setting``: ``auto`` (on where it applies) or ``off``;
    ``grad_of(p, state)``: a parameter's gradient (a local shard's rides in its state); ``reference``: builds the
    multi-pass optimizer the check compares with and its step without the global optimizer hooks a user may have
    registered (``reference(params, lr=, betas=, eps=, weight_decay=, master=)`` -> ``(optimizer, step)``)."""

    def __init__(
        self,
        master: str,
        state_dtype: torch.dtype,
        setting: str,
        grad_of: Callable[[torch.Tensor, dict[str, Any]], torch.Tensor],
        reference: Reference,
    ) -> None:
        if setting not in ("auto", "off"):
            raise ValueError(f"single_pass {setting!r} (allowed: auto, off)")
        self.master, self.grad_of, self.reference = master, grad_of, reference
        self.enabled = setting == "auto" and master in MODES and state_dtype == torch.float32
        #: what a run report should say (a failed check, once per reason); logged as a warning when made
        self.notes: list[str] = []
        self._taken = 0

    def take_notes(self) -> list[str]:
        """The :attr:`notes` made since the last call."""
        new = self.notes[self._taken :]
        self._taken = len(self.notes)
        return new

    def wanted(self, group: dict[str, Any], optimizer: Any) -> bool:
        """Whether ``group``'s large BF16 parameters may take the single pass at this step: on, no ``grad_scale`` to
        divide by (the multi-pass step divides as torch's kernel does), the learning rate and ``found_inf`` on the
        host, beta1 above 0.5 (the lerp :func:`_adamw` writes), a positive learning rate (a step at lr 0 keeps each
        stored master as it is), neither inside ``torch.compile`` nor under a ``TorchDispatchMode`` (``estimate``'s
        fake tensors, an operation counter), where ``torch.compile`` cannot run, nor under inference mode or CPU
        autocast."""
        lr, found_inf = group["lr"], getattr(optimizer, "found_inf", None)
        if not self.enabled or any(torch.is_tensor(t) and t.device.type != "cpu" for t in (lr, found_inf)):
            return False
        return (
            getattr(optimizer, "grad_scale", None) is None
            and group["betas"][0] > 0.5
            and float(lr) > 0.0
            and not torch.compiler.is_compiling()
            and not in_dispatch_mode()
            and not torch.is_inference_mode_enabled()  # either would compile another loop, which no check compared
            and not torch.is_autocast_enabled("cpu")
        )

    def pick(
        self, group: dict[str, Any], optimizer: Any, by_kind: dict[Any, tuple[list[torch.Tensor], list[dict[str, Any]]]]
    ) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        """Take the parameters that take the single pass out of ``by_kind`` (the optimizer's parameters by device,
        dtype and shard, with their states): (parameters, states)."""
        taken: tuple[list[torch.Tensor], list[dict[str, Any]]] = ([], [])
        if not self.wanted(group, optimizer):
            return taken
        for (device, dtype, _), (params, states) in by_kind.items():
            if device.type != "cpu" or dtype != torch.bfloat16:
                continue
            keep = [not self._takes(group, p, st) for p, st in zip(params, states)]
            taken[0].extend(p for p, k in zip(params, keep) if not k)
            taken[1].extend(st for st, k in zip(states, keep) if not k)
            params[:] = [p for p, k in zip(params, keep) if k]
            states[:] = [st for st, k in zip(states, keep) if k]
        return taken

    def _takes(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]) -> bool:
        """:func:`eligible`, and :func:`check` passed for its gradient dtype and the group's settings; a failed check
        is said (a warning and a note) the first time."""
        grad = self.grad_of(p, state)
        if not eligible(p, grad, state, self.master):
            return False
        why = check(self.master, grad.dtype, group, self.reference)
        if why is not None and all(why not in n for n in self.notes):
            self.notes.append(
                f"StorageAdamW: the single-pass update of storage.master {self.master} is off on this machine: {why}; "
                f"BF16 parameters of {MIN_ELEMENTS[self.master]:,}+ elements take the multi-pass step (the same "
                "results, more passes over memory)"
            )
            log.warning("hf_mixedprec: %s", self.notes[-1])
        return why is None

    def step(
        self, group: dict[str, Any], params: list[torch.Tensor], states: list[dict[str, Any]], found_inf: Any
    ) -> None:
        """One step of ``params`` (each picked), one compiled loop each. Step counts and ``found_inf`` are read on the
        host (a CPU's own memory: no sync); a flagged step changes nothing, as torch's CPU kernel skips it."""
        if found_inf is not None and float(found_inf) > 0:
            return
        settings = _settings(group, float(group["lr"]))
        scalars: dict[float, torch.Tensor] = {}
        for p, st in zip(params, states):
            step = st["step"]
            step += 1
            count = float(step)
            if count not in scalars:
                scalars[count] = hyper(**settings, step=count)
            update(p, self.grad_of(p, st), st, self.master, settings, count, scalars[count])


def _settings(group: dict[str, Any], lr: float) -> dict[str, float]:
    """``group``'s AdamW settings as :func:`hyper` and torch's fused kernel take them, at learning rate ``lr``."""
    beta1, beta2 = group["betas"]
    return {"lr": lr, "beta1": beta1, "beta2": beta2, "weight_decay": group["weight_decay"], "eps": group["eps"]}


def _setting(mode: str, grad_dtype: torch.dtype, group: dict[str, Any]) -> tuple[Any, ...]:
    return (mode, grad_dtype, tuple(group["betas"]), group["eps"], group["weight_decay"])


def check(mode: str, grad_dtype: torch.dtype, group: dict[str, Any], reference: Reference) -> str | None:
    """None where the single pass gives the multi-pass bits (of the optimizer ``reference`` builds) for ``mode``,
    this gradient dtype and ``group``'s betas, eps and weight decay on this machine; else why not. Once per process
    and setting: three steps of a probe parameter (2**12 + 29 elements of magnitudes 1e-30 to 1e30, zeros of both
    signs, infinities and NaNs among weights and gradients) both ways, every stored bit compared (NaNs as NaNs,
    whatever their payload, except the remainder's, which must be equal)."""
    key = _setting(mode, grad_dtype, group)
    if key not in _checked:
        try:
            _checked[key] = _compare(mode, grad_dtype, group, reference)
        except Exception as exc:  # torch.compile without a C++ compiler, or an inductor that cannot lower the loop
            first = (str(exc).strip().splitlines() or [""])[0][:160]
            _checked[key] = f"its check raised {type(exc).__name__}: {first}"
    return _checked[key]


def _probe(n: int, gen: torch.Generator) -> torch.Tensor:
    values = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-30, 31, (n,), generator=gen).float()
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40, -1e-40, 3e38])
    values[torch.randperm(n, generator=gen)[: len(specials)]] = specials
    return values


def _compare(mode: str, grad_dtype: torch.dtype, group: dict[str, Any], reference: Reference) -> str | None:
    # a body whose words end in a part vector (inductor's masked last iteration) and a tail for torch's kernel
    n, steps = (1 << 12) + 16 + 13, 3
    gen = torch.Generator().manual_seed(0)
    settings = _settings(group, float(group["lr"]) or 1e-3)
    ref = torch.nn.Parameter(_probe(n, gen).to(torch.bfloat16))
    ref.grad_dtype = grad_dtype  # an FP32 gradient on a BF16 parameter, as the run's own
    mine = torch.nn.Parameter(ref.detach().clone())
    opt, step_without_hooks = reference(
        [ref], lr=settings["lr"], betas=tuple(group["betas"]), eps=group["eps"], weight_decay=group["weight_decay"],
        master=mode,
    )  # fmt: skip
    state: dict[str, Any] = {"exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}
    state |= {"remainder": torch.zeros(n, dtype=torch.int16), "compensation": torch.zeros(n, dtype=torch.bfloat16)}
    for step in range(1, steps + 1):
        grad = (_probe(n, gen) * 1e-3).to(grad_dtype)
        ref.grad = grad.clone()
        with torch.no_grad():
            step_without_hooks()
        update(mine, grad, state, mode, settings, float(step))
    theirs = opt.state[ref]
    pairs = [("weight", mine.detach(), ref.detach()), ("exp_avg", state["exp_avg"], theirs["exp_avg"])]
    pairs.append(("exp_avg_sq", state["exp_avg_sq"], theirs["exp_avg_sq"]))
    if mode == "bf16_kahan":
        pairs.append(("compensation", state["compensation"], theirs["compensation"]))
    if mode == "bf16_remainder":
        pairs.append(("remainder", state["remainder"], theirs["remainder"]))
    for name, a, b in pairs:
        int_type = {1: torch.int8, 2: torch.int16, 4: torch.int32}[a.element_size()]
        differ = a.view(int_type) != b.view(int_type)
        if not (mode == "bf16_remainder" and name in ("weight", "remainder")):  # a stored NaN is the quiet NaN
            differ &= ~(torch.isnan(a) & torch.isnan(b))
        if bool(differ.any()):
            return f"{int(differ.sum())} of {n} {name} values differ after {steps} steps"
    return None
