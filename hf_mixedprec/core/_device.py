"""Device-side helpers for the per-step hot path: cached 0-d constants, finiteness in two operations,
reading a device value on the host without waiting for the device (no host-device sync), and running a model's
forward inside a context (an autocast)."""

from __future__ import annotations

import contextlib
import functools
import os
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class Constants:
    """0-d float32 constants on one device, made once: an operation with a tensor operand skips the
    scalar-to-tensor wrap a Python number costs (about half of a 0-d operation's time on a CPU). Never
    written to and never handed out."""

    def __init__(self) -> None:
        self._device: torch.device | None = None
        self._values: dict[float, Tensor] = {}

    def __call__(self, value: float, device: torch.device) -> Tensor:
        if torch.compiler.is_compiling():
            # the compiled graph holds its own constant; a write to the cache there is a side effect that breaks the
            # graph (or, inside an autograd.Function, makes torch.compile refuse its saved tensors)
            return torch.full((), value, dtype=torch.float32, device=device)
        if device != self._device:
            self._device, self._values = device, {}
        t = self._values.get(value)
        if t is None:
            t = torch.full((), value, dtype=torch.float32, device=device)
            if type(t) is torch.Tensor:  # a fake tensor (estimate's FakeTensorMode) must not outlive its mode
                self._values[value] = t
        return t

    def finite(self, x: Tensor) -> Tensor:
        """``torch.isfinite(x)`` in two operations instead of four: x - x is 0 for finite x, NaN for inf and NaN."""
        return torch.eq(x - x, self(0.0, x.device))

    def nonfinite(self, x: Tensor) -> Tensor:
        """``~torch.isfinite(x)`` in two operations."""
        return torch.ne(x - x, self(0.0, x.device))


#: Set on the host tensors that :class:`AsyncRead` reads: their values are final, reading them waits for nothing.
HOST_COPY_ATTR = "_hf_mixedprec_host_copy"


class AsyncRead:
    """One device scalar, read on the host once it has arrived, never by waiting for it.

    :meth:`push` starts the read. On CUDA: an asynchronous copy into pinned host memory and an event after
    it. On CPU the tensor already lives in host memory and is final (an eager CPU operation has finished when
    it returns), so it is kept as it is. :meth:`poll` returns the value once the copy has landed
    (``Event.query()`` does not block) and None before. Other devices (mps, xpu): :meth:`push` does nothing
    and :meth:`poll` returns None, so callers keep whatever they do without the value.
    """

    def __init__(self) -> None:
        self._host: Tensor | None = None
        self._event: Any = None
        self.pending = False

    def push(self, value: Tensor) -> None:
        """Start reading ``value`` (a 0-d tensor); ignored while an earlier read is still pending."""
        if self.pending:
            return
        if value.device.type == "cpu":
            host = value
        elif value.device.type == "cuda":
            host = self._host
            if host is None or host.dtype != value.dtype:
                host = torch.empty((), dtype=value.dtype, pin_memory=True)
            host.copy_(value, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            return
        setattr(host, HOST_COPY_ATTR, True)
        self._host = host
        self.pending = True

    def poll(self) -> Any:
        """The pushed value as a Python number once it is on the host; None while it is not (or nothing pushed)."""
        if not self.pending or self._host is None:
            return None
        if self._event is not None:
            if not self._event.query():
                return None
            self._event = None
        self.pending = False
        return self._host.item()

    def wait(self) -> Any:
        """The pushed value as a Python number, waiting for its copy to land if it has not yet (the event of that
        one copy, not the whole device); None when nothing is pending or the device is not CPU/CUDA."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self.poll()


def several_ranks() -> bool:
    """A process group of more than one rank exists (what every cross-rank reduction checks first)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_main_rank() -> bool:
    """Rank 0 of a distributed run (or a single process), before or after the process group exists."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def wrap_forward(model: torch.nn.Module, context: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
    """Make ``model.forward`` run inside ``context()`` (a new one per call).

    The wrapper is a method bound to ``model``, so ``copy.deepcopy(model)`` (TRL's reference model, an EMA copy)
    binds the copy's forward to the copy: Python's ``copy`` rebinds a bound method to the copied instance, where a
    closure over the original's bound method would keep running the original's weights. A forward that is not a
    method of ``model`` (another wrapper's function) is wrapped as it is."""
    inner = model.forward
    func = getattr(inner, "__func__", None)
    if func is None or getattr(inner, "__self__", None) is not model:

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with context():
                return inner(*args, **kwargs)

        model.forward = forward  # type: ignore[method-assign]
        return

    @functools.wraps(func)
    def method(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        with context():
            return func(self, *args, **kwargs)

    model.forward = types.MethodType(method, model)  # type: ignore[method-assign]


def has_fp8_tensor_cores(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA GPU with FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper,
    Blackwell)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
