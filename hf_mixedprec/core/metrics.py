"""The names of the metrics hf_mixedprec adds to Trainer's log rows (``mp/...``), in one place.

Use these constants to read the metrics back (``row[metrics.SKIPPED_STEPS]``) instead of spelling the keys.
:data:`METRICS` is the documented table (docs/health.md shows the same rows; a test keeps them equal).
"""

from __future__ import annotations

__all__ = [
    "CLIPPED",
    "CLIP_THRESHOLD",
    "FP8_PREFIX",
    "GRAD_NORM",
    "HEALTH_EVENTS",
    "LOSS_SCALE",
    "METRICS",
    "MOE_DEAD_EXPERTS",
    "MOE_LOAD_MAX",
    "MOE_PREFIX",
    "OVERFLOW",
    "PHASE",
    "PREFIX",
    "SKIPPED_STEPS",
    "fp8_layer_key",
    "moe_module_key",
]

PREFIX = "mp/"
LOSS_SCALE = "mp/loss_scale"
SKIPPED_STEPS = "mp/skipped_steps"
GRAD_NORM = "mp/grad_norm"
CLIP_THRESHOLD = "mp/clip_threshold"
CLIPPED = "mp/clipped"
HEALTH_EVENTS = "mp/health_events"
OVERFLOW = "mp/overflow"
PHASE = "mp/phase"
FP8_PREFIX = "mp/fp8/"
#: Per-layer FP8 statistics: ``mp/fp8/<layer>/<stat>``.
FP8_LAYER_STATS = ("saturation", "underflow", "sqnr_db", "input_amax")
FP8_RULE_PREFIX = "mp/fp8_rule/"
#: Per ``modules:`` rule group, over its FP8 layers: ``mp/fp8_rule/<rule>/<stat>`` (worst of the group's layers).
FP8_RULE_STATS = ("saturation", "underflow", "sqnr_db")
MOE_PREFIX = "mp/moe/"
#: Per experts module of an MoE model: ``mp/moe/<module>/<stat>`` (hf_mixedprec.training.expert_load).
MOE_MODULE_STATS = ("tokens", "load_max", "load_entropy", "idle_steps", "dead_experts")
MOE_LOAD_MAX = "mp/moe/load_max"
MOE_DEAD_EXPERTS = "mp/moe/dead_experts"

#: metric (or pattern) -> meaning.
METRICS: dict[str, str] = {
    LOSS_SCALE: "the GradScaler's scale (FP16; also DeepSpeed's scale under DeepSpeed)",
    SKIPPED_STEPS: "optimizer steps skipped so far (overflow or `skip_step`); present whenever a GradScaler exists "
    "(FP16, or the scale-1 guard)",
    GRAD_NORM: "the last step's total gradient norm, unscaled, before clipping; inf or NaN on an overflow step",
    CLIP_THRESHOLD: "where the recipe's clipper clips now (ZClip: absent during its 25-step warm-up)",
    CLIPPED: "1 if the last step was clipped, else 0",
    HEALTH_EVENTS: "events so far",
    OVERFLOW: "DeepSpeed only: its overflow flag",
    PHASE: "phased recipes only: the index of the phase in force (0 = the first phase)",
    "mp/fp8/<layer>/saturation, /underflow": "from the last FP8 sampled step: the largest fraction over the "
    "layer's input, weight and gradient (0.0625 = 6.25%)",
    "mp/fp8/<layer>/sqnr_db": "the smallest SQNR over input, weight and gradient, in dB",
    "mp/fp8/<layer>/input_amax": "the input's absolute maximum",
    "mp/fp8_rule/<rule>/saturation, /underflow, /sqnr_db": "the same, worst over the FP8 layers a `modules:` rule "
    "governs (`no_rule`: those no rule governs); read from the per-layer values, no extra device work",
    "mp/moe/<module>/tokens": "MoE models: tokens routed to the experts module since the last log (a token counts "
    "once per expert it is sent to)",
    "mp/moe/<module>/load_max": "the busiest expert's share of those tokens times the number of experts (1 = even)",
    "mp/moe/<module>/load_entropy": "entropy of the experts' moving-average load over log(experts) (1 = even); NaN "
    "until it holds 8 tokens per expert",
    "mp/moe/<module>/idle_steps": "the longest run of steps one of its experts received no token, since the last log",
    "mp/moe/<module>/dead_experts": "experts whose run without a token reached `dead_expert`'s threshold",
    MOE_LOAD_MAX: "the largest `load_max` over the experts modules",
    MOE_DEAD_EXPERTS: "the sum of `dead_experts` over the experts modules",
}


def fp8_rule_metrics(layer_metrics: dict[str, float], groups: dict[str, list[str]]) -> dict[str, float]:
    """``mp/fp8_rule/<rule>/<stat>`` from per-layer metrics already on the host: the largest saturation and underflow
    and the smallest SQNR over each group's layers that have them (groups without FP8 layers are left out)."""
    out: dict[str, float] = {}
    for label, layers in groups.items():
        for stat, worst in (("saturation", max), ("underflow", max), ("sqnr_db", min)):
            vals = [layer_metrics[k] for k in (f"{FP8_PREFIX}{n}/{stat}" for n in layers) if k in layer_metrics]
            if vals:
                out[f"{FP8_RULE_PREFIX}{label}/{stat}"] = worst(vals)
    return out


def moe_module_key(module: str, stat: str) -> str:
    """``mp/moe/<module>/<stat>`` for one of :data:`MOE_MODULE_STATS`."""
    if stat not in MOE_MODULE_STATS:
        raise ValueError(f"{stat!r} is not an experts-module statistic (allowed: {', '.join(MOE_MODULE_STATS)})")
    return f"{MOE_PREFIX}{module}/{stat}"


def fp8_layer_key(layer: str, stat: str) -> str:
    """``mp/fp8/<layer>/<stat>`` for one of :data:`FP8_LAYER_STATS`."""
    if stat not in FP8_LAYER_STATS:
        raise ValueError(f"{stat!r} is not an FP8 layer statistic (allowed: {', '.join(FP8_LAYER_STATS)})")
    return f"{FP8_PREFIX}{layer}/{stat}"
