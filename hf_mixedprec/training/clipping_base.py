"""The machinery every gradient clipper shares: the :class:`Clipper` base (device-side state, ``state_dict``), the
:class:`ClipResult` it returns, the global gradient norm and in-place scaling, argument checks.

Split from clipping.py (issue 28: files over 600 lines), which holds the four rules and the factory and re-exports
the public names here. The same rule holds: nothing reads a tensor value on the host.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from hf_mixedprec.core._device import Constants
from hf_mixedprec.core._private import foreach_mul_, foreach_norm

__all__ = [
    "STATE_VERSION",
    "ClipResult",
    "Clipper",
    "Params",
    "count_true",
    "global_grad_norm",
    "with_grads",
]

STATE_VERSION = 1
"""Version of the dict written by :meth:`Clipper.state_dict`; :meth:`Clipper.load_state_dict` checks it."""

_COEF_EPS = 1e-6
"""Added to the norm in the scale factor ``threshold / (norm + 1e-6)``, as ``torch.nn.utils.clip_grad_norm_``."""

Params = Tensor | Iterable[Tensor] | Iterable[tuple[str, Tensor]]
"""``model.parameters()``, ``model.named_parameters()``, a list of either, or one tensor."""


@dataclass(frozen=True)
class ClipResult:
    """What one :meth:`Clipper.clip_` call did; 0-d tensors on the gradients' device (reading them syncs).

    ``total_norm``: global L2 norm of the gradients before clipping (float32).
    ``threshold``: the global norm the gradients were clipped to; +inf when the rule sets no bound this step
    (ZClip below its z threshold, during its warm-up without ``max_norm``); NaN for AGC (per-unit thresholds).
    ``clipped``: bool, whether any gradient was scaled down.
    ``clipped_fraction``: AGC only, the fraction of units (weight rows, 1-D params) that were scaled.
    """

    total_norm: Tensor
    threshold: Tensor
    clipped: Tensor
    clipped_fraction: Tensor | None = None

    def as_floats(self) -> dict[str, float]:
        """The values as Python numbers for logging. This syncs with the device: call it only when a log is due."""
        out = {
            "total_norm": float(self.total_norm),
            "threshold": float(self.threshold),
            "clipped": float(self.clipped),
        }
        if self.clipped_fraction is not None:
            out["clipped_fraction"] = float(self.clipped_fraction)
        return out


def _split_params(parameters: Params) -> tuple[list[str] | None, list[Tensor]]:
    """Names (or None when unnamed) and tensors, from parameters or (name, parameter) pairs."""
    if isinstance(parameters, Tensor):
        return None, [parameters]
    items = list(parameters)
    if all(isinstance(x, Tensor) for x in items):  # the common case, checked in one pass
        return None, items
    pairs = [isinstance(x, tuple) for x in items]
    if items and all(pairs):
        names: list[str] = []
        params: list[Tensor] = []
        for item in items:
            if len(item) != 2 or not isinstance(item[0], str) or not isinstance(item[1], Tensor):
                raise TypeError(f"expected (name, parameter) pairs as from model.named_parameters(), got {item!r}")
            names.append(item[0])
            params.append(item[1])
        return names, params
    if any(pairs):
        raise TypeError("parameters mix (name, parameter) pairs and bare tensors; pass one kind")
    for item in items:
        if not isinstance(item, Tensor):
            raise TypeError(f"expected tensors or parameters, got {type(item).__name__}")
    return None, items


def _by_device(tensors: Sequence[Tensor]) -> dict[torch.device, list[Tensor]]:
    groups: dict[torch.device, list[Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return groups


def _norms_f32(tensors: list[Tensor]) -> list[Tensor]:
    try:
        return foreach_norm(tensors, 2, dtype=torch.float32)
    except (TypeError, RuntimeError):  # older torch without the dtype argument, or an unsupported layout
        return [torch.linalg.vector_norm(t, 2, dtype=torch.float32) for t in tensors]


def with_grads(parameters: Iterable[Any]) -> tuple[list[Any], list[Tensor]]:
    """The parameters that have a gradient, and their gradients, in one pass over ``parameters``."""
    params: list[Any] = []
    grads: list[Tensor] = []
    for p in parameters:
        g = getattr(p, "grad", None)
        if g is not None:
            params.append(p)
            grads.append(g)
    return params, grads


def global_grad_norm(grads: Sequence[Tensor]) -> Tensor:
    """L2 norm of all ``grads`` taken together, in float32, on the first gradient's device (no host sync).

    Per-tensor norms then the norm of the norms, as ``torch.nn.utils.clip_grad_norm_`` does (bit-identical to
    it for float32 gradients); FP16/BF16 gradients are reduced in float32 so the norm itself cannot overflow.
    Sharded gradients (``DTensor``, as FSDP2's ``fully_shard`` leaves them) give the global norm of the whole
    gradients from each rank's shards with one all-reduce (:func:`_sharded_grad_norm`), as a plain tensor that is
    the same on every rank, so every clipper decides the same everywhere.
    """
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    if any(type(g).__name__ == "DTensor" for g in grads):
        return _sharded_grad_norm(grads)
    groups = _by_device(grads)
    if len(groups) == 1:
        return torch.linalg.vector_norm(torch.stack(_norms_f32(grads)), 2)
    first = grads[0].device
    norms: list[Tensor] = []
    for group in groups.values():
        norms.extend(_norms_f32(group))
    return torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2)


def _sharded_grad_norm(grads: Sequence[Tensor]) -> Tensor:
    """The global L2 norm of gradients of which some are ``DTensor`` shards: each rank's squared norm of its local
    shards, summed over the ranks that hold the other shards with one all-reduce per mesh (one in all for FSDP2),
    plus the squared norms of replicated and plain gradients, which every rank holds whole. Nothing is gathered.
    A gradient still ``Partial`` (not yet reduced over the ranks) is refused: its squared norm is not the sum of
    the ranks' squared norms."""
    from torch.distributed.tensor import DTensor

    device = grads[0].to_local().device if isinstance(grads[0], DTensor) else grads[0].device
    sharded: dict[tuple[Any, ...], list[Tensor]] = {}  # the process groups (_shard_groups) -> local shards
    whole: list[Tensor] = []
    for g in grads:
        if not isinstance(g, DTensor):
            whole.append(g)
            continue
        if any(p.is_partial() for p in g.placements):
            raise ValueError(
                "gradient clipping: a DTensor gradient is still Partial (not reduced over the ranks); clip after "
                "the gradients are reduced (FSDP2 reduce-scatters them in backward)"
            )
        groups = _shard_groups(g)
        if not groups:
            whole.append(g.to_local())
            continue
        sharded.setdefault(groups, []).append(g.to_local())
    squared = torch.zeros((), dtype=torch.float32, device=device)
    for groups, local in sharded.items():
        squared = squared + _summed_over(groups, torch.stack([n.to(device) for n in _norms_f32(local)]).square().sum())
    if whole:
        squared = squared + torch.stack([n.to(device) for n in _norms_f32(whole)]).square().sum()
    return squared.sqrt()


def count_true(flags: Sequence[Tensor], device: torch.device) -> Tensor:
    """How many elements of ``flags`` (boolean tensors) are true over the whole model, as an int64 0-d tensor on
    ``device``: plain and replicated flags count as they are, the local shards of ``DTensor`` flags are counted on
    each rank and summed over the ranks with one all-reduce per mesh (AGC's clipped rows under FSDP2)."""
    total = torch.zeros((), dtype=torch.int64, device=device)
    sharded: dict[tuple[Any, ...], list[Tensor]] = {}  # as in _sharded_grad_norm
    for f in flags:
        if type(f).__name__ != "DTensor":
            total = total + f.sum().to(device)
            continue
        local = f.to_local().sum().to(device)
        groups = _shard_groups(f)
        if groups:
            sharded.setdefault(groups, []).append(local)
        else:
            total = total + local
    for groups, counts in sharded.items():
        total = total + _summed_over(groups, torch.stack(counts).sum())
    return total


def _shard_groups(t: Any) -> tuple[Any, ...]:
    """The process groups a ``DTensor``'s shards are spread over, one per sharded mesh dimension (() when it is
    replicated). FSDP2 makes a mesh per ``fully_shard`` call, all over the same ranks: keyed by their groups, the
    shards of every call are summed with one all-reduce."""
    return tuple(t.device_mesh.get_group(i) for i, p in enumerate(t.placements) if p.is_shard())


def _summed_over(groups: tuple[Any, ...], part: Tensor) -> Tensor:
    """``part`` (this rank's sum over its shards) summed over the ranks of ``groups``, in place."""
    import torch.distributed as dist

    for group in groups:
        dist.all_reduce(part, group=group)
    return part


def _mul_(grads: list[Tensor], coef: Tensor) -> None:
    """Multiply all grads in place by a 0-d coefficient (exactly 1.0 leaves them bit for bit unchanged)."""
    for device, group in _by_device(grads).items():
        foreach_mul_(group, coef.to(device))


def _scale_to(grads: list[Tensor], norm: Tensor, threshold: Tensor, valid: Tensor | None, k: Constants) -> Tensor:
    """Scale grads by ``threshold / (norm + 1e-6)`` where ``norm > threshold`` (and the step is valid; pass
    ``valid=None`` when the threshold is already +inf on invalid steps)."""
    clipped = norm > threshold
    if valid is not None:
        clipped = valid & clipped
    dev = norm.device
    coef = torch.where(clipped, threshold / (norm + k(_COEF_EPS, dev)), k(1.0, dev))
    _mul_(grads, coef)
    return clipped


def _check_float(name: str, value: Any, *, low: float, high: float = math.inf, low_open: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    ok_low = v > low if low_open else v >= low
    if not (ok_low and v <= high) or math.isnan(v):
        bound = f"{'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if high != math.inf else "")
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return v


def _check_int(name: str, value: Any, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


class Clipper:
    """Base class: gathers the gradients, computes the global norm and keeps device-side state.

    Subclasses implement :meth:`_clip` (the rule) and list their state tensors in ``_state_names``; a Python
    counter of calls (``steps``) is the only host-side state, since it is known without reading the device.
    """

    _state_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self.steps: int = 0
        """Number of :meth:`clip_` calls so far (host side; counts non-finite steps too)."""
        self._device = torch.device("cpu")
        self._k = Constants()

    # -- the rule ---------------------------------------------------------------------------------------------

    def _clip(
        self, names: list[str] | None, params: list[Tensor], grads: list[Tensor], norm: Tensor, valid: Tensor
    ) -> ClipResult:
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        """The constructor arguments (plain Python values)."""
        return {}

    # -- public API -------------------------------------------------------------------------------------------

    def clip_(self, parameters: Params, *, total_norm: Tensor | float | None = None) -> ClipResult:
        """Clip the gradients of ``parameters`` in place and update the statistics; no host-device sync.

        ``parameters``: ``model.parameters()``, ``model.named_parameters()`` (needed for AGC name excludes), a
        list of either, or one tensor; parameters without a gradient are skipped. ``total_norm``: the global
        gradient norm when already computed (after unscaling, reduced over ranks); otherwise it is computed
        here in float32. A call with no gradients and no ``total_norm`` changes nothing.
        """
        names, params = _split_params(parameters)
        return self.clip_grads_(
            params, [p.grad for p in params if p.grad is not None], total_norm=total_norm, names=names
        )

    def clip_grads_(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        *,
        total_norm: Tensor | float | None = None,
        names: list[str] | None = None,
    ) -> ClipResult:
        """:meth:`clip_` for a caller that already holds the parameters and their gradients (``grads``: the
        gradients that are not None, in order), so the parameters are not walked again."""
        if grads:
            device = grads[0].device
        elif isinstance(total_norm, Tensor):
            device = total_norm.device
        else:
            device = self._device
        if device != self._device:
            self.to(device)
        self.steps += 1
        if total_norm is None:
            norm = global_grad_norm(grads).to(device)
            has_any = bool(grads)  # host fact: whether there was anything to measure
        elif isinstance(total_norm, Tensor):
            norm = total_norm.detach()
            if norm.dtype != torch.float32 or norm.device != device or norm.dim():
                norm = norm.to(device=device, dtype=torch.float32).reshape(())
            has_any = True
        else:
            norm = torch.full((), float(total_norm), dtype=torch.float32, device=device)
            has_any = True
        valid = self._k.finite(norm) if has_any else torch.zeros((), dtype=torch.bool, device=device)
        return self._clip(names, params, grads, norm, valid)

    def host_request(self) -> Tensor | None:
        """The 0-d device value :meth:`host_sync` would read (None: nothing), for a caller that reads it with its
        own values in one copy and hands the result to :meth:`host_sync`."""
        return None

    def host_sync(self, value: float | None = None) -> None:
        """Called where a host read is due anyway (a logging step): a clipper may read its state here to learn
        facts that make its next steps cheaper; ``value`` is :meth:`host_request` already read. The default
        learns nothing."""

    def to(self, device: torch.device | str) -> Clipper:
        """Move the state tensors to ``device`` (done automatically on the first :meth:`clip_`)."""
        device = torch.device(device)
        for name in self._state_names:
            t = getattr(self, name)
            if t.device != device:
                setattr(self, name, t.to(device))
        self._device = device
        return self

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly where this clipper is: version, type, config, steps, tensors."""
        return {
            "version": STATE_VERSION,
            "type": type(self).__name__,
            "config": self.config(),
            "steps": self.steps,
            "state": {name: getattr(self, name).detach().clone() for name in self._state_names},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (tensors are copied onto this clipper's device).

        Raises ValueError when the version, the clipper type or the configuration differs, since continuing
        ZClip's or AutoClip's statistics under other settings would not be the same run.
        """
        version = state_dict.get("version")
        if version != STATE_VERSION:
            raise ValueError(f"clipper state version {version!r} is not supported (expected {STATE_VERSION})")
        kind = state_dict.get("type")
        if kind != type(self).__name__:
            raise ValueError(f"clipper state is for {kind!r}, not {type(self).__name__!r}")
        saved, mine = state_dict.get("config", {}), self.config()
        differ = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
        if differ:
            detail = ", ".join(f"{k}: saved {saved.get(k)!r}, now {mine.get(k)!r}" for k in differ)
            raise ValueError(f"clipper state was saved with another configuration ({detail})")
        tensors = state_dict.get("state", {})
        missing = sorted(set(self._state_names) - set(tensors))
        if missing:
            raise ValueError(f"clipper state lacks {', '.join(missing)}")
        for name in self._state_names:
            current = getattr(self, name)
            value = tensors[name].detach().to(device=self._device, dtype=current.dtype, copy=True)
            self._check_loaded(name, value)
            setattr(self, name, value)
        self.steps = int(state_dict.get("steps", 0))

    def _check_loaded(self, name: str, value: Tensor) -> None:
        expected = getattr(self, name).shape
        if value.shape != expected:
            raise ValueError(f"clipper state {name} has shape {tuple(value.shape)}, expected {tuple(expected)}")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"
