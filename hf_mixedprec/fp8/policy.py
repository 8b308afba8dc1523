"""Which layers go to FP8 and which stay in high precision, decided before any module is touched.

The GEMM layers considered are ``nn.Linear`` and transformers' ``Conv1D`` (``transformers/pytorch_utils.py``,
GPT-2's projections: weight [in, out], ``y = x @ weight + bias``); both follow the same rules, in the order they
are checked (the first that matches gives the reason): LoRA adapters (PEFT keeps them in high precision; only the
frozen base layer is converted), the output projection (``keep_lm_head``), name patterns (``keep_in_bf16``,
fnmatch globs on the dotted module name), the first/last N transformer blocks (``keep_first_last_blocks``), a
kind the backend cannot convert (``Conv1D`` under torchao or Transformer Engine), and dimensions not divisible by
``align`` (FP8 GEMMs in TE and torchao want multiples of 16; MXFP8 needs whole 32-element blocks). Embeddings are
lookups, not GEMMs, and are listed as kept. Every layer gets a decision: planning never stops at the first layer
it cannot convert, and never skips one silently. A layer that is already an FP8 module is listed as FP8 with
``already_fp8`` set: the backends leave it alone.
"""

from __future__ import annotations

import fnmatch
import re
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from torch import nn

from hf_mixedprec.schema import FP8Config

__all__ = [
    "ALREADY_FP8",
    "BACKEND_GEMM_KINDS",
    "GEMM_KINDS",
    "LORA_ADAPTER",
    "LayerDecision",
    "conv1d_class",
    "find_block_list",
    "plan_conversion",
]

#: The reason given for a layer that was an FP8 module before conversion (its decision has ``already_fp8``).
ALREADY_FP8 = "already FP8"

#: The reason given for a PEFT LoRA adapter (kept in high precision by design).
LORA_ADAPTER = "LoRA adapter (trainable, kept in high precision)"

#: The GEMM layer kinds the policy finds: ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2, ``pytorch_utils.py``).
GEMM_KINDS: tuple[str, ...] = ("Linear", "Conv1D")

#: The GEMM kinds each backend can convert. torchao's ``convert_to_float8_training`` swaps only ``nn.Linear``
#: (``torchao/float8/float8_linear_utils.py``), and ``te.Linear`` takes a [out, in] weight of its own, which would
#: change a ``Conv1D``'s parameters and checkpoint: both leave ``Conv1D`` in high precision, saying so.
BACKEND_GEMM_KINDS: dict[str, tuple[str, ...]] = {
    "emulated": GEMM_KINDS,
    "torchao": ("Linear",),
    "transformer_engine": ("Linear",),
}


@dataclass(frozen=True)
class LayerDecision:
    """The decision for one layer."""

    name: str
    kind: str  # "Linear", "Conv1D" or "Embedding"
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


def find_block_list(model: nn.Module) -> tuple[str, int] | None:
    """The dotted name and length of the transformer block list: the longest ModuleList of same-class modules."""
    best: tuple[str, int] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            classes = {type(m) for m in mod}
            if len(classes) == 1 and (best is None or len(mod) > best[1]):
                best = (name, len(mod))
    return best


def _output_projection_names(model: nn.Module) -> set[str]:
    names = set()
    get_out = getattr(model, "get_output_embeddings", None)
    out = get_out() if callable(get_out) else None
    for name, mod in model.named_modules():
        if (out is not None and mod is out) or name.split(".")[-1] in ("lm_head", "output", "embed_out"):
            names.add(name)
    return names


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
    heads: set[str]
    blocks: tuple[str, int] | None
    block_re: re.Pattern[str] | None
    backend: str
    kinds: tuple[str, ...]


def _keep_reason(name: str, kind: str, in_f: int, out_f: int, ctx: _Context) -> str | None:
    """Why this GEMM layer stays in high precision (the first rule that matches), or None to convert it."""
    cfg = ctx.cfg
    if _is_lora(name):
        return LORA_ADAPTER
    if name in ctx.heads and cfg.keep_lm_head:
        return "output projection (keep_lm_head)"
    pattern = next((p for p in cfg.keep_in_bf16 if fnmatch.fnmatchcase(name, p)), None)
    if pattern is not None:
        return f"matches keep_in_bf16 pattern {pattern!r}"
    m = ctx.block_re.match(name) if ctx.block_re is not None and cfg.keep_first_last_blocks else None
    if m and ctx.blocks is not None:
        idx, n, k = int(m.group(1)), ctx.blocks[1], cfg.keep_first_last_blocks
        if idx < k or idx >= n - k:
            return f"block {idx} of {n} is within the first/last {k} (keep_first_last_blocks)"
    if kind not in ctx.kinds:
        return f"{kind}: backend {ctx.backend} converts only nn.Linear"
    if in_f % cfg.align or out_f % cfg.align:
        return f"in/out features {in_f}x{out_f} not divisible by align={cfg.align}"
    if cfg.scaling == "mxfp8" and cfg.block_size and (in_f % cfg.block_size or out_f % cfg.block_size):
        return f"in/out features {in_f}x{out_f} not divisible by the MX block size {cfg.block_size}"
    return None


def plan_conversion(
    model: nn.Module, cfg: FP8Config, *, converted_types: Iterable[type] = (), backend: str | None = None
) -> list[LayerDecision]:
    """Decide, for every GEMM layer (``nn.Linear``, transformers' ``Conv1D``) and Embedding, whether it runs in
    FP8 and why. ``backend`` (None: any) keeps the layer kinds it cannot convert, naming it in the reason."""
    converted_types = tuple(converted_types)
    blocks = find_block_list(model)
    ctx = _Context(
        cfg=cfg,
        heads=_output_projection_names(model),
        blocks=blocks,
        block_re=re.compile(rf"^{re.escape(blocks[0])}\.(\d+)(\.|$)") if blocks else None,
        backend=backend or "any",
        kinds=BACKEND_GEMM_KINDS.get(backend, GEMM_KINDS) if backend is not None else GEMM_KINDS,
    )
    conv1d = conv1d_class()
    decisions: list[LayerDecision] = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Embedding):
            why = "embedding lookup (no GEMM)" if cfg.keep_embeddings else "embedding lookup has no FP8 GEMM"
            decisions.append(LayerDecision(name, "Embedding", mod.num_embeddings, mod.embedding_dim, False, why))
            continue
        if converted_types and isinstance(mod, converted_types):
            in_f, out_f = getattr(mod, "in_features", 0), getattr(mod, "out_features", 0)
            kind = getattr(mod, "kind", "Linear")
            decisions.append(LayerDecision(name, kind, in_f, out_f, True, ALREADY_FP8, already_fp8=True))
            continue
        gemm = _gemm_kind(mod, conv1d)
        if gemm is None:
            continue
        kind, in_f, out_f = gemm
        reason = _keep_reason(name, kind, in_f, out_f, ctx)
        decisions.append(LayerDecision(name, kind, in_f, out_f, reason is None, reason or "converted"))
    return decisions
