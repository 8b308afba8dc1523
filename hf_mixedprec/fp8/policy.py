"""Which layers go to FP8 and which stay in high precision, decided before any module is touched.

Rules, in the order they are checked (the first that matches gives the reason): LoRA adapters (PEFT keeps
them in high precision; only the frozen base Linear is converted), the output projection (``keep_lm_head``),
name patterns (``keep_in_bf16``, fnmatch globs on the dotted module name), the first/last N transformer
blocks (``keep_first_last_blocks``), and dimensions not divisible by ``align`` (FP8 GEMMs in TE and torchao
want multiples of 16; MXFP8 needs whole 32-element blocks). Embeddings are lookups, not GEMMs, and are
listed as kept. Every layer gets a decision: planning never stops at the first layer it cannot convert.
A layer that is already an FP8 module is listed as FP8 with ``already_fp8`` set: the backends leave it alone.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from torch import nn

from hf_mixedprec.schema import FP8Config

__all__ = ["ALREADY_FP8", "LayerDecision", "find_block_list", "plan_conversion"]

#: The reason given for a layer that was an FP8 module before conversion (its decision has ``already_fp8``).
ALREADY_FP8 = "already FP8"


@dataclass(frozen=True)
class LayerDecision:
    """The decision for one layer."""

    name: str
    kind: str  # "Linear" or "Embedding"
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


def plan_conversion(model: nn.Module, cfg: FP8Config, *, converted_types: Iterable[type] = ()) -> list[LayerDecision]:
    """Decide, for every Linear and Embedding in ``model``, whether it runs in FP8 and why."""
    converted_types = tuple(converted_types)
    heads = _output_projection_names(model)
    blocks = find_block_list(model)
    block_re = re.compile(rf"^{re.escape(blocks[0])}\.(\d+)(\.|$)") if blocks else None
    decisions: list[LayerDecision] = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Embedding):
            why = "embedding lookup (no GEMM)" if cfg.keep_embeddings else "embedding lookup has no FP8 GEMM"
            decisions.append(LayerDecision(name, "Embedding", mod.num_embeddings, mod.embedding_dim, False, why))
            continue
        if converted_types and isinstance(mod, converted_types):
            in_f, out_f = getattr(mod, "in_features", 0), getattr(mod, "out_features", 0)
            decisions.append(LayerDecision(name, "Linear", in_f, out_f, True, ALREADY_FP8, already_fp8=True))
            continue
        if not isinstance(mod, nn.Linear):
            continue
        in_f, out_f = mod.in_features, mod.out_features
        reason = None
        if _is_lora(name):
            reason = "LoRA adapter (trainable, kept in high precision)"
        elif name in heads and cfg.keep_lm_head:
            reason = "output projection (keep_lm_head)"
        else:
            pattern = next((p for p in cfg.keep_in_bf16 if fnmatch.fnmatchcase(name, p)), None)
            if pattern is not None:
                reason = f"matches keep_in_bf16 pattern {pattern!r}"
        if reason is None and block_re is not None and blocks is not None and cfg.keep_first_last_blocks:
            m = block_re.match(name)
            if m:
                idx, n = int(m.group(1)), blocks[1]
                k = cfg.keep_first_last_blocks
                if idx < k or idx >= n - k:
                    reason = f"block {idx} of {n} is within the first/last {k} (keep_first_last_blocks)"
        if reason is None and (in_f % cfg.align or out_f % cfg.align):
            reason = f"in/out features {in_f}x{out_f} not divisible by align={cfg.align}"
        if (
            reason is None
            and cfg.scaling == "mxfp8"
            and cfg.block_size
            and (in_f % cfg.block_size or out_f % cfg.block_size)
        ):
            reason = f"in/out features {in_f}x{out_f} not divisible by the MX block size {cfg.block_size}"
        decisions.append(LayerDecision(name, "Linear", in_f, out_f, reason is None, reason or "converted"))
    return decisions
