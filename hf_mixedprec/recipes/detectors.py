"""The health detectors, declared once as a table: what each measures, when it fires, its defaults and its words.

One :class:`Detector` row per detector, in :data:`DETECTORS`. The recipe schema builds ``health.detectors`` (its
keys, defaults and descriptions) from the table, and :class:`hf_mixedprec.training.health.HealthMonitor` evaluates a row by
its measure ``kind`` with code shared by every detector of that kind, so a new detector of an existing kind is one
more row here. Plain data (no torch), so the schema and the monitor, a layer above it, both read it.

The kinds, each comparing one number with the threshold (``compare``) except ``nonfinite``:

- ``nonfinite``: the signal itself is NaN/Inf (no threshold);
- ``zscore``: (value - mean) / std of the signal against its finite values of the last ``window`` steps, once
  there are a few of them; a value that fires is not added to the window;
- ``rate``: the mean of a 0/1 signal over the last ``window`` steps (the steps seen so far before that);
- ``run``: how many steps in a row a 0/1 signal was set;
- ``floor``: the signal's value;
- ``backoffs``: how often the signal went down within ``window`` steps, firing only if it never went up there;
- ``ratio``: a signal measured on sampled steps, on steps that were taken (a skipped step changes nothing);
- ``fp8_layer``: one statistic of each FP8 layer's operands, the worst of the samples since the last check;
- ``experts``: one number per MoE experts module, counted on the device every step and judged at each check
  (:mod:`hf_mixedprec.training.expert_load`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "DETECTORS",
    "EXPERT_DETECTORS",
    "EXPERT_REACTIONS",
    "LAYER_DETECTORS",
    "STATE_SLOTS",
    "STEP_DETECTORS",
    "Detector",
    "Reaction",
]

Kind = Literal["nonfinite", "zscore", "rate", "run", "floor", "backoffs", "ratio", "fp8_layer", "experts"]
#: ``loss`` (raw, before Trainer's NaN filter), ``grad_norm`` (unscaled, before clipping), ``skipped`` (1 if the
#: optimizer step was skipped), ``loss_scale``, ``update_ratio`` (RMS(update)/RMS(weight) on sampled steps) ...
StepSignal = Literal["loss", "grad_norm", "skipped", "loss_scale", "update_ratio"]
#: ... and the :data:`~hf_mixedprec.scaling.stats.METRICS` of an FP8 layer's operands.
LayerSignal = Literal["amax", "saturation", "underflow", "sqnr_db", "mx_clamp"]
#: ... and what an MoE experts module's routing shows: the longest run of steps one of its experts got no token
#: (``idle_steps``), the entropy of its experts' moving-average load over log(experts) (``load_entropy``).
ExpertSignal = Literal["idle_steps", "load_entropy"]
Signal = StepSignal | LayerSignal | ExpertSignal
Compare = Literal["above", "below", "at_or_above", "at_or_below"]
#: What a recipe can make a detector's event do (hf_mixedprec.training.reactions carries it out).
Reaction = Literal["log", "warn", "skip_step", "stop", "fallback", "lower_lr"]

#: The running state a kind keeps across steps, slot by slot; a row's ``state`` names each slot's checkpoint key.
#: ``window``: the last ``window`` values; ``count``: a number starting at 0; ``last``: the previous value seen.
STATE_SLOTS: dict[str, tuple[str, ...]] = {
    "zscore": ("window",),
    "rate": ("window",),
    "run": ("count",),
    "backoffs": ("window", "window", "last"),  # decreases, increases, the previous value
}


@dataclass(frozen=True)
class Detector:
    """One detector: its recipe key, what it measures, when it fires, its defaults, and its words.

    ``message`` is a :meth:`str.format` template. Per-step detectors get ``value``, ``threshold`` (0 when unset),
    ``window`` (the recipe's), ``value_pct`` and ``threshold_pct`` (times 100); per-layer ones get ``layer``,
    ``role``, ``metric``, ``value``, ``threshold`` and ``op`` (the comparison's sign); experts ones get ``layer``,
    ``value``, ``threshold``, ``expert`` (the idle one), ``busiest`` and ``dead`` (experts past the threshold)."""

    name: str
    kind: Kind
    signal: Signal
    compare: Compare | None  # None only for kind nonfinite
    threshold: float | None
    window: int | None  # also the size kept when a recipe sets window to null
    reaction: Reaction
    doc: str  # the recipe key's description
    message: str
    state: tuple[str, ...] = ()  # checkpoint keys of the running state, one per STATE_SLOTS slot of the kind

    def __post_init__(self) -> None:
        if len(self.state) != len(STATE_SLOTS.get(self.kind, ())):
            raise ValueError(f"detector {self.name}: kind {self.kind} keeps {STATE_SLOTS.get(self.kind, ())}")
        if (self.compare is None) != (self.kind == "nonfinite"):
            raise ValueError(f"detector {self.name}: every kind but nonfinite compares with its threshold")
        if "window" in STATE_SLOTS.get(self.kind, ()) and self.window is None:
            raise ValueError(f"detector {self.name}: kind {self.kind} needs a default window")


_LAYER_MESSAGE = "{layer} {role} {metric} {value:.4g} {op} {threshold:g}"

DETECTORS: tuple[Detector, ...] = (
    # name, kind, signal, compare, default threshold, window and reaction; doc; message; state
    Detector(
        "nonfinite_loss", "nonfinite", "loss", None, None, None, "skip_step",
        "NaN/Inf in the raw loss (before Trainer's NaN filter).",
        "loss is {value} (NaN/Inf)",
    ),
    Detector(
        "nonfinite_grad", "nonfinite", "grad_norm", None, None, None, "log",
        "NaN/Inf in the gradients (FP16: an overflow step the scaler skips).",
        "gradient norm is {value} (NaN/Inf)",
    ),
    Detector(
        "skip_rate", "rate", "skipped", "above", 0.2, 100, "warn",
        "threshold: fraction of skipped optimizer steps over the last `window` steps.",
        "{value_pct:.1f}% of the last {window} steps were skipped (threshold {threshold_pct:g}%)",
        state=("skip_hist",),
    ),
    Detector(
        "consecutive_skips", "run", "skipped", "at_or_above", 10.0, None, "warn",
        "threshold: this many skipped steps in a row.",
        "{value:g} optimizer steps in a row were skipped (threshold {threshold:g})",
        state=("consecutive",),
    ),
    Detector(
        "scale_floor", "floor", "loss_scale", "at_or_below", 1.0, None, "warn",
        "threshold: loss scale at or below this value.",
        "loss scale {value:g} is at or below the floor {threshold:g}",
    ),
    Detector(
        "death_spiral", "backoffs", "loss_scale", "at_or_above", 8.0, 50, "stop",
        "threshold: this many loss-scale backoffs without a growth within `window` steps.",
        "{value:g} loss-scale backoffs without any growth in {window} steps (threshold {threshold:g})",
        state=("backoff_hist", "growth_hist", "prev_scale"),
    ),
    Detector(
        "loss_spike", "zscore", "loss", "above", 6.0, 128, "warn",
        "threshold: z-score of the loss over the last `window` steps.",
        "loss is {value:.1f} standard deviations above its last {window} steps (threshold {threshold:g})",
        state=("loss_hist",),
    ),
    Detector(
        "grad_spike", "zscore", "grad_norm", "above", 6.0, 128, "warn",
        "threshold: z-score of the grad norm over the last `window` steps.",
        "grad norm is {value:.1f} standard deviations above its last {window} steps (threshold {threshold:g})",
        state=("grad_hist",),
    ),
    Detector(
        "tiny_update", "ratio", "update_ratio", "below", 1e-3, None, "log",
        "threshold: RMS(update)/RMS(weight) of parameters stored in BF16/FP16, measured on sampled steps; "
        "below about 2e-3 BF16 rounds updates away.",
        "updates are {value:.3g} of the weights' RMS in BF16/FP16 parameters (threshold {threshold:g}): below "
        "about 2e-3 a BF16 weight rounds the update away; keep FP32 master weights or raise the learning rate",
    ),
    Detector(
        "fp8_saturation", "fp8_layer", "saturation", "above", 0.001, None, "warn",
        "threshold: fraction of a layer's values clipped at the FP8 max.",
        _LAYER_MESSAGE,
    ),
    Detector(
        "fp8_underflow", "fp8_layer", "underflow", "above", 0.1, None, "log",
        "threshold: fraction of a layer's non-zero values that quantize to zero.",
        _LAYER_MESSAGE,
    ),
    Detector(
        "fp8_sqnr", "fp8_layer", "sqnr_db", "below", 20.0, None, "log",
        "threshold: minimum quantization SQNR in dB for a layer.",
        _LAYER_MESSAGE,
    ),
    Detector(
        "mx_clamp", "fp8_layer", "mx_clamp", "above", 0.01, None, "warn",
        "threshold: fraction of MXFP8 blocks whose E8M0 scale is at the clamp.",
        _LAYER_MESSAGE,
    ),
    Detector(
        "dead_expert", "experts", "idle_steps", "at_or_above", 100.0, None, "warn",
        "MoE models: threshold: optimizer steps in a row an expert received no token.",
        "{layer}: expert {expert} received no token for {value:g} optimizer steps in a row (threshold "
        "{threshold:g}); {dead:g} of its experts did",
    ),
    Detector(
        "routing_collapse", "experts", "load_entropy", "below", 0.5, 100, "warn",
        "MoE models: threshold: entropy of an experts module's load over log(experts) (1 = even); the load is a "
        "moving average whose half-life is `window` steps.",
        "{layer}: routing is collapsing: the entropy of its experts' load is {value:.3f} of an even load's "
        "(threshold {threshold:g}); the busiest expert is {busiest}",
    ),
)  # fmt: skip

if len({d.name for d in DETECTORS}) != len(DETECTORS):
    raise ValueError("two detectors share a name")

#: The per-layer detectors' thresholds of an ``fp8.scaling: nvfp4`` recipe where it sets none: FP4 is coarser than FP8,
#: and FP8's defaults flag every layer. Each is above what healthy NVFP4 layers of the embedded Llama measured with
#: ``simulate --recipe b200-nvfp4`` (sr_seed 0-2): SQNR 16.1-19 dB, underflow up to 27% (1x16 blocks flush values
#: under about 1/24 of their block's largest), saturation up to 0.3% (subnormal E4M3 block scales), up to 1.6% of
#: the 16-element blocks with a flushed or saturated scale.
NVFP4_LAYER_THRESHOLDS: dict[str, float] = {
    "fp8_saturation": 0.01,
    "fp8_underflow": 0.4,
    "fp8_sqnr": 15.0,
    "mx_clamp": 0.05,
}

#: The detectors evaluated step by step (events come out in this order), and the per-layer FP8 ones with the
#: :class:`~hf_mixedprec.scaling.stats.RoleStats` metric each watches.
STEP_DETECTORS: tuple[str, ...] = tuple(d.name for d in DETECTORS if d.kind not in ("fp8_layer", "experts"))
LAYER_DETECTORS: dict[str, str] = {d.name: d.signal for d in DETECTORS if d.kind == "fp8_layer"}
#: The MoE experts detectors, with the signal each watches, and the reactions they may take: their events concern a
#: module's routing, which neither skipping a step nor a precision fallback changes.
EXPERT_DETECTORS: dict[str, str] = {d.name: d.signal for d in DETECTORS if d.kind == "experts"}
EXPERT_REACTIONS: tuple[Reaction, ...] = ("log", "warn", "stop", "lower_lr")
