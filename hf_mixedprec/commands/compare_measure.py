"""What ``hf-mixedprec compare`` measures in each run besides its loss: per-layer gradient fidelity against FP32
(cosine, SQNR), the held-out loss, digests of the initial weights and of each batch (the collator that records
them), the ``tiny_update`` samples, the run's storage and its FP8 layers' worst saturation and underflow.

Split from :mod:`hf_mixedprec.commands.compare` (which re-exports :func:`gradient_fidelity` and :func:`held_out_loss`) to keep
each module short; the run orchestration there calls these helpers.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from hf_mixedprec.commands.compare_report import LayerFidelity, RunResult, UpdateMeasure

__all__ = ["gradient_fidelity", "held_out_loss"]


# -- gradient fidelity -------------------------------------------------------------------------------------------


def _layer_of(param_name: str) -> str:
    return param_name.removesuffix(".weight")


@contextlib.contextmanager
def _measuring(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode (no FP8 history update, no dropout) with its FP8 statistics off, both restored after:
    a measurement that leaves the training run as it was."""
    from hf_mixedprec.fp8 import fp8_layers

    recording = [(m, m.record_stats) for _, m in fp8_layers(model, fresh=True)]
    training = model.training
    model.eval()
    try:
        for m, _ in recording:
            m.record_stats = False
        yield
    finally:
        model.train(training)
        for m, was in recording:
            m.record_stats = was


def gradient_fidelity(
    model: torch.nn.Module,
    reference: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    autocast: Any = None,
    loss_scale: float = 1.0,
) -> dict[str, LayerFidelity]:
    """Per layer with a 2-D weight: ``model``'s gradient (under ``autocast``, the loss multiplied by
    ``loss_scale`` and the gradient divided by it, as an FP16 step does) against ``reference``'s FP32 gradient of
    the same weights (copied into it here) on the same batch. Neither model's ``.grad`` is touched; ``model`` runs
    in eval mode (no FP8 history update, no dropout) and its FP8 statistics are left as they were."""
    names = [n for n, p in model.named_parameters() if p.requires_grad and p.dim() == 2]
    params = dict(model.named_parameters())
    with torch.no_grad():
        ref_params = dict(reference.named_parameters())
        missing = [n for n in names if n not in ref_params]
        if missing:
            raise ValueError(f"the reference model has no parameter {missing[0]!r}")
        for n, p in params.items():
            if n in ref_params:
                ref_params[n].copy_(p.detach().to(torch.float32))
    with _measuring(model):
        with autocast if autocast is not None else contextlib.nullcontext():
            loss = model(**batch).loss
        grads = torch.autograd.grad(loss * loss_scale, [params[n] for n in names], allow_unused=True)
    reference.eval()
    ref_loss = reference(**batch).loss
    ref_grads = torch.autograd.grad(ref_loss, [ref_params[n] for n in names], allow_unused=True)
    out: dict[str, LayerFidelity] = {}
    for n, g, r in zip(names, grads, ref_grads, strict=True):
        if g is None or r is None:
            continue
        out[_layer_of(n)] = _fidelity(g.detach().double() / loss_scale, r.detach().double())
    return out


def _fidelity(g: torch.Tensor, r: torch.Tensor) -> LayerFidelity:
    """Cosine similarity and SQNR (dB, signal = the FP32 gradient) of ``g`` against ``r`` (float64)."""
    dot, gn, rn = float((g * r).sum()), float(g.norm()), float(r.norm())
    cosine = dot / (gn * rn) if gn > 0 and rn > 0 else (1.0 if gn == rn == 0 else 0.0)
    noise = float((g - r).pow(2).sum())
    signal = float(r.pow(2).sum())
    if not math.isfinite(noise):
        return LayerFidelity(float("nan"), float("nan"))
    sqnr = math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal > 0 else -math.inf)
    return LayerFidelity(cosine, sqnr)


# -- digests and held-out loss -----------------------------------------------------------------------------------


def _digest(tensors: Any) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class _RecordingCollator:
    """``default_data_collator`` that keeps a digest of each training batch, in the order they were made."""

    def __init__(self) -> None:
        self.digests: list[str] = []

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        from transformers import default_data_collator

        batch = default_data_collator(features)
        self.digests.append(_digest([batch["input_ids"]]))
        return batch


def held_out_loss(model: torch.nn.Module, blocks: Any, batch_size: int, autocast: Any = None) -> float:
    """Mean loss over the held-out blocks, in eval mode, without gradients and without FP8 statistics."""
    device = next(model.parameters()).device
    total, n = 0.0, 0
    with torch.no_grad(), _measuring(model), autocast if autocast is not None else contextlib.nullcontext():
        for i in range(0, len(blocks), batch_size):
            ids = torch.stack([blocks[j]["input_ids"] for j in range(i, min(i + batch_size, len(blocks)))])
            ids = ids.to(device)
            total += float(model(input_ids=ids, labels=ids).loss) * len(ids)
            n += len(ids)
    return total / max(n, 1)


# -- storage ----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _recording_updates(rt: Any) -> Iterator[list[tuple[int, torch.Tensor, torch.Tensor]]]:
    """Collect what the run's health monitor is given at each ``tiny_update`` sample: (step, ratio, skipped flag),
    device tensors kept as they are (no host read during the run). The monitor's own ``observe_update`` still
    runs, so the detector and its events are untouched; the method is restored afterwards."""
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    monitor = getattr(rt, "monitor", None)
    if monitor is None:
        yield seen
        return
    original = monitor.observe_update

    def observe_update(ratio: torch.Tensor, skipped: torch.Tensor) -> None:
        seen.append((monitor.step + 1, ratio.detach().float().reshape(()), skipped.detach().float().reshape(())))
        original(ratio, skipped)

    monitor.observe_update = observe_update
    try:
        yield seen
    finally:
        del monitor.observe_update  # the class's method again


def _fill_storage(run: RunResult, rt: Any, updates: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
    """The run's storage, bytes per parameter (its precision plan) and ``tiny_update`` measure."""
    plan = getattr(rt, "plan", None)
    if plan is not None:
        run.storage = {**plan.storage, "optimizer_class": plan.optimizer}
        run.bytes_per_param = plan.bytes_per_param()
        run.storage_bytes = plan.bytes_by_component()
    cfg = rt.recipe.health.detectors.tiny_update if rt is not None else None
    if not updates or cfg is None or cfg.threshold is None:
        return
    host = torch.stack([torch.stack([r, s.to(r.device)]) for _, r, s in updates]).tolist()  # one host read
    taken = [(step, ratio) for (step, _, _), (ratio, skipped) in zip(updates, host, strict=True) if skipped < 0.5]
    run.tiny_update = UpdateMeasure(
        threshold=cfg.threshold,
        every=rt.recipe.health.fp8_sample_every,
        steps=[s for s, _ in taken],
        ratios=[r for _, r in taken],
        fired=sum(1 for e in run.events if e.get("detector") == "tiny_update"),
    )


def _fp8_layers(logs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per FP8 layer, the worst saturation and underflow logged over the run."""
    out: dict[str, dict[str, float]] = {}
    for row in logs:
        for key, v in row.items():
            if not key.startswith("mp/fp8/"):
                continue
            layer, _, metric = key[len("mp/fp8/") :].rpartition("/")
            if metric in ("saturation", "underflow"):
                d = out.setdefault(layer, {"saturation": 0.0, "underflow": 0.0})
                d[metric] = max(d[metric], float(v))
    return out
