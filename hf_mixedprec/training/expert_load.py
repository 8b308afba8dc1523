"""Load balance of MoE experts: tokens per expert, counted on the device every step, read at logging steps.

An MoE layer that stops sending tokens to some experts (dead experts), or sends most of them to a few (routing
collapse), trains on: its loss does not say so, and under FP8 a starved expert's scales go stale. This module watches
the routing of every experts module of transformers' experts interface, whatever precision its experts run in:

- **counting**: a forward pre-hook on each experts module adds its routed tokens per expert (a histogram of
  ``top_k_index``, one device op) into its row of one ``[modules, experts]`` buffer; recomputed forwards (gradient
  checkpointing, inside backward) and forwards outside training are not counted;
- **per optimizer step** (:meth:`ExpertLoad.after_step`, a fixed number of tensor operations for all modules
  together, no host read): each expert's run of steps without a token, its peak since the last logging step,
  the tokens since the last logging step, and an exponential moving average of the load (half-life: the
  ``routing_collapse`` detector's ``window`` steps);
- **a logging step** (:meth:`ExpertLoad.request` / :meth:`ExpertLoad.read`): six numbers per module join the runtime's
  one device-to-host copy and become the ``mp/moe/...`` metrics and the values the ``dead_expert`` and
  ``routing_collapse`` detectors judge.

Several ranks: each counts its own tokens; a logging step combines them (tokens summed, an expert idle only where it
was idle on every rank) with one all-gather, at the check every rank makes. The state (runs, peaks, averages,
tokens since the last log) is saved with the runtime's, so a resumed run judges as the uninterrupted one would.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from hf_mixedprec.core import metrics as M
from hf_mixedprec.core._device import several_ranks
from hf_mixedprec.core._private import in_backward
from hf_mixedprec.fp8.experts import is_experts_module, tokens_per_expert
from hf_mixedprec.recipes.schema import HealthConfig

__all__ = ["COLUMNS", "MIN_TOKENS_PER_EXPERT", "ExpertLoad", "ExpertWatch"]

#: What a logging step reads per experts module, in order.
COLUMNS = ("tokens", "load_max", "load_entropy", "idle_steps", "dead_experts", "idle_expert", "busiest_expert")
#: The moving-average load is judged for collapse only once it holds this many routed tokens per expert.
MIN_TOKENS_PER_EXPERT = 8
_HOOKED = "_hf_mixedprec_load_hook"


class ExpertLoad:
    """The routed-token counts of a model's experts modules and what a logging step reads of them (module docs).

    ``half_life``: steps after which a step's tokens weigh half in the moving-average load; ``dead_after``: the
    run of token-less steps at which an expert counts as dead in ``mp/moe/dead_experts``."""

    def __init__(self, model: nn.Module, *, half_life: int, dead_after: float, device: torch.device) -> None:
        found = [(n, m) for n, m in model.named_modules() if is_experts_module(m)]
        self.names = [n for n, _ in found]
        self.n_experts = [int(m.num_experts) for _, m in found]
        self.device = device
        self.decay = 0.5 ** (1.0 / max(half_life, 1))
        self.dead_after = dead_after
        rows, width = len(found), max(self.n_experts, default=0)
        zeros = torch.zeros(rows, width, device=device)
        self.valid = torch.zeros(rows, width, dtype=torch.bool, device=device)
        for i, e in enumerate(self.n_experts):
            self.valid[i, :e] = True
        self.experts = self.valid.sum(1, dtype=torch.float32)  # experts per module, on the device (no host copy)
        self.counts = zeros.clone()  # this step's tokens
        self.idle = zeros.clone()  # steps in a row without a token
        self.peak = zeros.clone()  # the longest such run since the last logging step
        self.since = zeros.clone()  # tokens since the last logging step
        self.ema = zeros.clone()  # moving-average tokens per step, times 1 / (1 - decay)
        self._handles = [m.register_forward_pre_hook(self._hook(i), with_kwargs=True) for i, (_, m) in enumerate(found)]
        for _, m in found:
            setattr(m, _HOOKED, True)

    def __bool__(self) -> bool:
        return bool(self.names)

    def _hook(self, row: int) -> Any:
        n = self.n_experts[row]

        def count(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not mod.training or in_backward():
                return
            idx = args[1] if len(args) > 1 else kwargs.get("top_k_index")
            if idx is None:
                return
            self.counts[row, :n].add_(tokens_per_expert(idx.detach(), n).to(self.counts.device))

        return count

    def remove(self) -> None:
        """Take the hooks off the model."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def after_step(self) -> None:
        """After an optimizer step (taken or skipped: the tokens were routed either way): update the runs, peaks and
        averages from this step's counts. Device operations only, the same number for any count of modules."""
        got = self.counts > 0
        self.idle = torch.where(got | ~self.valid, torch.zeros_like(self.idle), self.idle + 1)
        torch.maximum(self.peak, self.idle, out=self.peak)
        self.since.add_(self.counts)
        self.ema.mul_(self.decay).add_(self.counts)
        self.counts.zero_()

    def request(self) -> Tensor | None:
        """The ``[modules, len(COLUMNS)]`` table a logging step reads (combined over the ranks: a collective, every
        rank must ask), flattened; None without experts modules. Device operations only."""
        if not self:
            return None
        since, peak, ema = self.since, self.peak, self.ema
        if several_ranks():
            since, peak, ema = _over_ranks(since, peak, ema)
        e = self.experts
        tokens = since.sum(1)
        load_max = since.amax(1) * e / tokens.clamp_min(1)
        total = ema.sum(1, keepdim=True)
        p = ema / total.clamp_min(1e-30)
        entropy = -(p * p.clamp_min(1e-30).log()).sum(1) / e.log().clamp_min(1e-30)
        enough = total.squeeze(1) >= MIN_TOKENS_PER_EXPERT * e
        entropy = torch.where(enough, entropy, torch.full_like(entropy, math.nan))
        idle_steps, idle_expert = peak.masked_fill(~self.valid, -1).max(1)
        busiest = since.masked_fill(~self.valid, -1).argmax(1)
        dead = ((peak >= self.dead_after) & self.valid).sum(1).float()
        columns = [tokens, load_max, entropy, idle_steps, dead, idle_expert.float(), busiest.float()]
        table = torch.stack(columns, 1)
        self.peak.copy_(self.idle)  # the next interval's peaks start from the runs going on now
        self.since.zero_()
        return table.reshape(-1)

    def read(self, values: list[float]) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        """The host values of :meth:`request`: the ``mp/moe/`` metrics, and per module the values the experts
        detectors judge (``idle_steps``, ``load_entropy``, and which expert each concerns)."""
        width = len(COLUMNS)
        per = {
            n: dict(zip(COLUMNS, values[i * width : (i + 1) * width], strict=True)) for i, n in enumerate(self.names)
        }
        out: dict[str, float] = {}
        for name, v in per.items():
            for stat in M.MOE_MODULE_STATS:
                out[M.moe_module_key(name, stat)] = v[stat]
        out[M.MOE_LOAD_MAX] = max((v["load_max"] for v in per.values()), default=0.0)
        out[M.MOE_DEAD_EXPERTS] = sum(v["dead_experts"] for v in per.values())
        return out, per

    # -- state -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-friendly state: the modules it watches and, per module, its experts' running numbers."""
        rows = [(n, e, i) for i, (n, e) in enumerate(zip(self.names, self.n_experts, strict=True))]
        return {
            "version": 1,
            "modules": {
                n: {k: getattr(self, k)[i, :e].tolist() for k in ("idle", "peak", "since", "ema")} for n, e, i in rows
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != 1:
            raise ValueError(f"expert load state version {state.get('version')!r} (expected 1)")
        saved = state["modules"]
        if set(saved) != set(self.names):
            raise ValueError(
                f"the checkpoint watched experts modules {sorted(saved)[:3]}... ({len(saved)}), this model has "
                f"{len(self.names)}: the checkpoint belongs to another model"
            )
        for i, (n, e) in enumerate(zip(self.names, self.n_experts, strict=True)):
            for k in ("idle", "peak", "since", "ema"):
                vals = saved[n][k]
                if len(vals) != e:
                    raise ValueError(f"expert load state of {n}: {len(vals)} experts saved, the model has {e}")
                getattr(self, k)[i, :e] = torch.tensor(vals, dtype=torch.float32, device=self.device)


class ExpertWatch:
    """The runtime's side of it: an :class:`ExpertLoad` for the model it trains (made when a step first sees the
    model; None for a model without experts modules), and a checkpoint's state loaded before that."""

    def __init__(self, health: HealthConfig, device: torch.device) -> None:
        d = health.detectors
        self.half_life = d.routing_collapse.window or 100
        self.dead_after = d.dead_expert.threshold if d.dead_expert.threshold is not None else math.inf
        self.device = device
        self.load: ExpertLoad | None = None
        self._model: int | None = None  # id() of the model watched
        self._pending: dict[str, Any] | None = None

    def see(self, model: nn.Module) -> None:
        """Watch ``model`` (a no-op once it is watched)."""
        if self._model == id(model):
            return
        if self.load is not None:
            self.load.remove()
        load = ExpertLoad(model, half_life=self.half_life, dead_after=self.dead_after, device=self.device)
        self.load, self._model = (load if load else None), id(model)
        if self.load is not None and self._pending is not None:
            self.load.load_state_dict(self._pending)
        self._pending = None

    def after_step(self) -> None:
        if self.load is not None:
            self.load.after_step()

    def state_dict(self) -> dict[str, Any] | None:
        return self.load.state_dict() if self.load is not None else self._pending

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is not None and self.load is not None:
            self.load.load_state_dict(state)
        else:
            self._pending = state


def _over_ranks(since: Tensor, peak: Tensor, ema: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Every rank's numbers as one process on the global batch would have counted them: tokens and averages summed,
    an expert's idle run the shortest over the ranks (it got a token where any rank routed one). One all-gather."""
    import torch.distributed as dist

    n = dist.get_world_size()
    mine = torch.stack([since, peak, ema])
    every = mine.new_empty((n, *mine.shape))
    dist.all_gather_into_tensor(every.view(n * mine.shape[0], *mine.shape[1:]), mine.contiguous())
    return every[:, 0].sum(0), every[:, 1].amin(0), every[:, 2].sum(0)
