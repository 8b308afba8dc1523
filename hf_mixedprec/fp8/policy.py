"""Which layers go to FP8 and which stay in high precision, decided before any module is touched.

The GEMM layers considered are ``nn.Linear`` and transformers' ``Conv1D`` (``transformers/pytorch_utils.py``,
GPT-2's projections: weight [in, out], ``y = x @ weight + bias``); both follow the same rules, in the order they
are checked (the first that matches gives the reason): LoRA adapters (PEFT keeps them in high precision; only the
frozen base layer is converted), a parameter the model declares must stay in FP32
(``_keep_in_fp32_modules_strict``), the recipe's ``modules:`` rule governing the layer (``fp8: off`` or a
``compute`` other than fp8; :mod:`hf_mixedprec.recipes.module_rules` says which rule that is), a kind the backend cannot
convert (``Conv1D`` under torchao or Transformer Engine), a subclass with its own ``forward`` (an FP8 layer in its
place would lose it), and dimensions not divisible by ``align`` (FP8 GEMMs in TE
and torchao want multiples of 16; MXFP8 needs whole 32-element blocks). Embeddings are lookups, not GEMMs, and are
listed as kept. Every layer gets a decision: planning never stops at the first layer it cannot convert, and never
skips one silently. A layer that is already an FP8 module is listed as FP8 with ``already_fp8`` set: the backends
leave it alone.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from hf_mixedprec.core._device import has_fp8_tensor_cores
from hf_mixedprec.fp8.experts import experts_shape, is_experts_module
from hf_mixedprec.recipes.module_rules import RuleAssignment, assign_rules, find_block_list
from hf_mixedprec.recipes.modules_config import DEFAULT_RULES, ModuleRule
from hf_mixedprec.recipes.schema import FP8Config, MXFP8Config

__all__ = [
    "ALREADY_FP8",
    "BACKEND_GEMM_KINDS",
    "EXPERTS_KIND",
    "GEMM_KINDS",
    "LORA_ADAPTER",
    "LayerDecision",
    "conv1d_class",
    "find_block_list",
    "gemm_work",
    "plan_conversion",
]

#: The reason given for a layer that was an FP8 module before conversion (its decision has ``already_fp8``).
ALREADY_FP8 = "already FP8"

#: The reason given for a PEFT LoRA adapter (kept in high precision by design).
LORA_ADAPTER = "LoRA adapter (trainable, kept in high precision)"

#: The GEMM layer kinds the policy finds: ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2, ``pytorch_utils.py``).
GEMM_KINDS: tuple[str, ...] = ("Linear", "Conv1D")

#: The kind of an MoE experts module run through transformers' experts interface (3-D expert weights, grouped GEMMs:
#: :mod:`hf_mixedprec.fp8.experts`). ``in_features`` / ``out_features`` of its decision are hidden / intermediate.
EXPERTS_KIND = "Experts"

#: The backends that run experts in FP8 (the emulated grouped GEMMs of :mod:`hf_mixedprec.fp8.experts`; under torchao
#: with its recipe's numerics, where torchao emulates its own FP8 GEMMs too).
EXPERTS_BACKENDS: tuple[str, ...] = ("emulated", "torchao")

#: The GEMM kinds each backend can convert. torchao's ``convert_to_float8_training`` swaps only ``nn.Linear``
#: (``torchao/float8/float8_linear_utils.py``), and ``te.Linear`` takes a [out, in] weight of its own, which would
#: change a ``Conv1D``'s parameters and checkpoint: both leave ``Conv1D`` in high precision, saying so.
BACKEND_GEMM_KINDS: dict[str, tuple[str, ...]] = {
    "emulated": GEMM_KINDS,
    "native": GEMM_KINDS,
    "torchao": ("Linear",),
    "transformer_engine": ("Linear",),
}


@dataclass(frozen=True)
class LayerDecision:
    """The decision for one layer."""

    name: str
    kind: str  # "Linear", "Conv1D", "Experts" or "Embedding"
    in_features: int
    out_features: int
    fp8: bool
    reason: str
    already_fp8: bool = False
    """The layer was an FP8 module before conversion: it counts as FP8 and nothing replaces it."""

    @property
    def to_swap(self) -> bool:
        """Whether conversion replaces this layer with an FP8 one (FP8 and not FP8 already)."""
        return self.fp8 and not self.already_fp8

    def to_dict(self) -> dict[str, object]:
        """The report's fields (``already_fp8`` shows as the reason text :data:`ALREADY_FP8`)."""
        d = asdict(self)
        del d["already_fp8"]
        return d


def _is_lora(name: str) -> bool:
    return any(part.startswith("lora_") for part in name.split("."))


def conv1d_class() -> type | None:
    """transformers' ``Conv1D`` if ``transformers.pytorch_utils`` is loaded, else None.

    A model holding a ``Conv1D`` has loaded that module, so planning never imports transformers itself.
    """
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)


def _gemm_kind(mod: nn.Module, conv1d: type | None) -> tuple[str, int, int] | None:
    """``(kind, in_features, out_features)`` of a GEMM layer the policy knows, else None."""
    if isinstance(mod, nn.Linear):
        return "Linear", mod.in_features, mod.out_features
    if conv1d is not None and isinstance(mod, conv1d):
        in_f, out_f = mod.weight.shape  # Conv1D stores [nx, nf] = [in, out] (transformers/pytorch_utils.py)
        return "Conv1D", int(in_f), int(out_f)
    return None


@dataclass(frozen=True)
class _Context:
    """What every layer's decision needs to know about the model, the recipe and the backend."""

    cfg: FP8Config
    rules: RuleAssignment
    backend: str
    kinds: tuple[str, ...]


def own_forward(mod: nn.Module, conv1d: type | None = None) -> str | None:
    """The class of a Linear / Conv1D subclass that defines its own ``forward`` (Phi-3.5-MoE's and Llama-4's routers),
    else None. An FP8 layer put in its place would run a plain GEMM and lose that forward, so such a layer is never
    swapped."""
    for base in (nn.Linear, conv1d):
        if base is not None and isinstance(mod, base) and type(mod).forward is not base.forward:
            return type(mod).__name__
    return None


def _declared_or_ruled(name: str, ctx: _Context) -> str | None:
    """Why a GEMM layer or experts module stays out of FP8 by the model's FP32 declaration of one of its own parameters
    or by the ``modules:`` rule governing it, else None."""
    if any(p.startswith(name + ".") and "." not in p[len(name) + 1 :] for p in ctx.rules.fp32_params):
        return "the model keeps it in FP32 (_keep_in_fp32_modules)"
    rule = ctx.rules.rule_of(name)
    if rule is not None and rule.keeps_out_of_fp8():
        return f"rule {rule.label(ctx.rules.owner[name])} ({rule.describe()})"
    return None


def _keep_reason(name: str, mod: nn.Module, kind: str, in_f: int, out_f: int, ctx: _Context) -> str | None:
    """Why this GEMM layer stays in high precision (the first rule that matches), or None to convert it."""
    cfg = ctx.cfg
    if _is_lora(name):
        return LORA_ADAPTER
    if (why := _declared_or_ruled(name, ctx)) is not None:
        return why
    if (cls := own_forward(mod, conv1d_class())) is not None:
        return f"its class {cls} defines its own forward, which an FP8 {kind} would lose"
    if kind not in ctx.kinds:
        return f"{kind}: backend {ctx.backend} converts only nn.Linear"
    if in_f % cfg.align or out_f % cfg.align:
        return f"in/out features {in_f}x{out_f} not divisible by align={cfg.align}"
    if isinstance(cfg, MXFP8Config) and cfg.block_size and (in_f % cfg.block_size or out_f % cfg.block_size):
        return f"in/out features {in_f}x{out_f} not divisible by the MX block size {cfg.block_size}"
    return None


def _experts_keep_reason(name: str, hidden: int, inter: int, device: torch.device, ctx: _Context) -> str | None:
    """Why this experts module stays in high precision, or None to run its grouped GEMMs in FP8."""
    from hf_mixedprec.fp8.experts import EXPERTS_SCALINGS

    cfg = ctx.cfg
    if (why := _declared_or_ruled(name, ctx)) is not None:
        return why
    if cfg.scaling not in EXPERTS_SCALINGS:
        return (
            f"experts: {cfg.scaling} scaling has no grouped-GEMM quantization for experts yet (fp8.scaling "
            f"{', '.join(EXPERTS_SCALINGS)} run the experts in FP8)"
        )
    if ctx.backend != "any" and ctx.backend not in EXPERTS_BACKENDS:
        return (
            f"experts: backend {ctx.backend} has no FP8 grouped GEMM here (fp8.backend emulated runs them: exact FP8 "
            "numerics, no speed-up)"
        )
    if ctx.backend == "torchao" and has_fp8_tensor_cores(device):
        return (
            f"experts: backend torchao's FP8 grouped GEMMs are not wired on {device} yet, and its emulation would be "
            "slower than BF16 here (fp8.backend emulated rehearses them: exact FP8 numerics, no speed-up)"
        )
    if hidden % cfg.align or inter % cfg.align:
        return f"hidden/intermediate {hidden}x{inter} not divisible by align={cfg.align}"
    if isinstance(cfg, MXFP8Config) and cfg.block_size and (hidden % cfg.block_size or inter % cfg.block_size):
        return f"hidden/intermediate {hidden}x{inter} not divisible by the MX block size {cfg.block_size}"
    return None


def gemm_work(model: nn.Module, decisions: Iterable[LayerDecision]) -> dict[str, int]:
    """Multiply-adds per token of each GEMM layer decided (Linear, Conv1D: in x out; an experts module: its top-k
    experts' two projections), by name: what "the share of the GEMM work in FP8" weighs layers by."""
    from hf_mixedprec.fp8.experts import experts_macs_per_token

    out: dict[str, int] = {}
    for d in decisions:
        if d.kind == EXPERTS_KIND:
            out[d.name] = experts_macs_per_token(model.get_submodule(d.name))
        elif d.kind in GEMM_KINDS:
            out[d.name] = d.in_features * d.out_features
    return out


def plan_conversion(
    model: nn.Module,
    cfg: FP8Config,
    *,
    converted_types: Iterable[type] = (),
    backend: str | None = None,
    rules: RuleAssignment | tuple[ModuleRule, ...] | None = None,
) -> list[LayerDecision]:
    """Decide, for every GEMM layer (``nn.Linear``, transformers' ``Conv1D``) and Embedding, whether it runs in
    FP8 and why. ``backend`` (None: any) keeps the layer kinds it cannot convert, naming it in the reason.
    ``rules``: the recipe's ``modules:`` rules, or their assignment to this model (None: the default rules)."""
    converted_types = tuple(converted_types)
    if not isinstance(rules, RuleAssignment):
        rules = assign_rules(model, DEFAULT_RULES if rules is None else tuple(rules), "fp8")
    ctx = _Context(
        cfg=cfg,
        rules=rules,
        backend=backend or "any",
        kinds=BACKEND_GEMM_KINDS.get(backend, GEMM_KINDS) if backend is not None else GEMM_KINDS,
    )
    conv1d = conv1d_class()
    decisions: list[LayerDecision] = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Embedding):
            why = "embedding lookup (no GEMM)"
            decisions.append(LayerDecision(name, "Embedding", mod.num_embeddings, mod.embedding_dim, False, why))
            continue
        if converted_types and isinstance(mod, converted_types):
            in_f, out_f = getattr(mod, "in_features", 0), getattr(mod, "out_features", 0)
            kind = getattr(mod, "kind", "Linear")
            decisions.append(LayerDecision(name, kind, in_f, out_f, True, ALREADY_FP8, already_fp8=True))
            continue
        if is_experts_module(mod):
            _, hidden, inter = experts_shape(mod)
            if getattr(mod, "_hf_mixedprec_fp8", None) is not None:
                decisions.append(LayerDecision(name, EXPERTS_KIND, hidden, inter, True, ALREADY_FP8, already_fp8=True))
                continue
            reason = _experts_keep_reason(name, hidden, inter, mod.down_proj.device, ctx)
            decisions.append(LayerDecision(name, EXPERTS_KIND, hidden, inter, reason is None, reason or "converted"))
            continue
        gemm = _gemm_kind(mod, conv1d)
        if gemm is None:
            continue
        kind, in_f, out_f = gemm
        reason = _keep_reason(name, mod, kind, in_f, out_f, ctx)
        decisions.append(LayerDecision(name, kind, in_f, out_f, reason is None, reason or "converted"))
    return decisions
