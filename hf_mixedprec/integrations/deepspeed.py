"""Recipe -> DeepSpeed config (JSON), for Trainer's ``deepspeed=`` and for ``hf-mixedprec launch``.

DeepSpeed's dynamic loss scaler names (``initial_scale_power``, ``loss_scale_window``, ``hysteresis``,
``min_loss_scale``) are derived from the recipe's torch-style ``loss_scale`` keys; ``loss_scale: 0`` selects
dynamic scaling. DeepSpeed clips inside ``engine.step()``; under ZeRO stages 1-3 the recipe's adaptive clipper
(ZClip, AutoClip) decides the threshold from the global gradient norm DeepSpeed computes there, and DeepSpeed's own
clipping applies it (:func:`route_adaptive_clipping`); AGC and stage 0 keep a fixed ``gradient_clipping``, said in a
fallback note, never silently.

ZeRO-3 shards the weights over the ranks, so ``trainer.save_model()`` can write a loadable
``model.safetensors`` only when DeepSpeed gathers them first: the config sets
``zero_optimization.stage3_gather_16bit_weights_on_model_save`` (without it Trainer writes a DeepSpeed
checkpoint and no weights file).

:func:`deepspeed_refusal` says, before any rank starts, when DeepSpeed itself would refuse the recipe's
precision on the device it will pick (see its docstring for the rule and where DeepSpeed raises).
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

from hf_mixedprec.core._private import mkldnn_fp16_supported
from hf_mixedprec.recipes.schema import RecipeSpec

__all__ = [
    "clip_through_deepspeed",
    "config_stage",
    "deepspeed_config",
    "deepspeed_device",
    "deepspeed_fp16_supported",
    "deepspeed_refusal",
    "deepspeed_storage_keys",
    "drop_clipper",
    "engine_config",
    "fp8_under_deepspeed",
    "ownership_notes",
    "read_deepspeed_scaler",
    "route_adaptive_clipping",
    "zero_optimizer",
]


def deepspeed_storage_keys(recipe: RecipeSpec) -> dict[str, bool]:
    """DeepSpeed's own ``bf16`` keys for the recipe's ``storage:`` (``deepspeed/runtime/constants.py``:
    ``bf16_master_weights_and_grads``, ``bf16_optimizer_states``; both need ZeRO 1..3). The recipe's validation
    refuses every storage choice without a DeepSpeed equivalent, so what reaches here maps one to one."""
    st = recipe.storage
    if st.master != "none":
        return {}
    return {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": st.optimizer_states == "bf16"}


def deepspeed_config(recipe: RecipeSpec, *, zero_stage: int | None = None) -> tuple[dict[str, Any], list[str]]:
    """Build a DeepSpeed config dict for ``recipe`` and the fallback notes that go with it.

    Batch size, accumulation and optimizer settings are ``"auto"`` so that Trainer / Accelerate fill them.
    """
    notes: list[str] = []
    stage = zero_stage if zero_stage is not None else (recipe.distributed.zero_stage or 0)
    cfg: dict[str, Any] = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": stage},
    }
    if stage == 3:
        # gather the shards into one 16-bit state dict on save_model(), so model.safetensors is written
        cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    if recipe.precision == "fp16":
        ls = recipe.loss_scale
        assert ls is not None
        cfg["fp16"] = {
            "enabled": True,
            "loss_scale": 0,  # 0 = dynamic
            "initial_scale_power": int(math.log2(ls.init_scale)),
            "loss_scale_window": ls.growth_interval,
            "hysteresis": ls.hysteresis,
            "min_loss_scale": ls.min_scale,
        }
        cfg["bf16"] = {"enabled": False}
    elif recipe.precision == "bf16":
        cfg["bf16"] = {"enabled": True, **deepspeed_storage_keys(recipe)}
        cfg["fp16"] = {"enabled": False}
    else:
        cfg["bf16"] = {"enabled": False}
        cfg["fp16"] = {"enabled": False}
        if recipe.precision == "fp8":
            notes.append(
                "precision fp8 under DeepSpeed: DeepSpeed runs in FP32 (FP32 weights, master and gradient reduction; "
                "its bf16 mode would cast the FP8 layers' scaling state to BF16), and hf_mixedprec's FP8 layers "
                "compute inside its BF16 autocast"
            )
    clip = recipe.clipping
    cfg["gradient_clipping"] = cap = deepspeed_clip_value(recipe)
    why = adaptive_refusal(clip.method, stage)
    if why is not None:
        notes.append(
            f"FALLBACK: clipping.method {clip.method!r} is adaptive, but {why}; using a fixed gradient_clipping of "
            f"{cap:g} under DeepSpeed (set clipping.method: norm to choose it)"
        )
    return cfg, notes


def engine_config(state: Any) -> dict[str, Any]:
    """The DeepSpeed config Accelerate's ``state`` holds for the engine it will build (empty without DeepSpeed)."""
    return getattr(getattr(state, "deepspeed_plugin", None), "deepspeed_config", None) or {}


def config_stage(config: dict[str, Any]) -> Any:
    """``zero_optimization.stage`` of a DeepSpeed config, 0 (no ZeRO) when absent, as DeepSpeed reads it."""
    return (config.get("zero_optimization") or {}).get("stage", 0)


def _clips_nothing(cap: Any) -> str:
    return (
        f"DeepSpeed's gradient_clipping is {cap!r} in this config, so DeepSpeed clips nothing (set it to any value > 0: "
        "the recipe's clipper then decides the threshold; deepspeed_config(recipe) writes 1.0)"
    )


def clipping_refusal(method: str, config: dict[str, Any], max_grad_norm: float) -> str | None:
    """Why the recipe's clipper cannot decide the clipping of a DeepSpeed engine built from ``config`` (its stage and
    ``gradient_clipping``, ``"auto"`` being Trainer's ``max_grad_norm``); None when it can, as far as the config
    says (the engine's optimizer is checked at the first step)."""
    stage = config_stage(config)
    why = adaptive_refusal(method, stage if isinstance(stage, int) else 1)
    if why is not None or method == "none":
        return why
    cap = config.get("gradient_clipping", 0.0)
    cap = max_grad_norm if cap == "auto" else cap
    if not (isinstance(cap, (int, float)) and cap > 0):
        return _clips_nothing(cap)
    return None


def adaptive_refusal(method: str, stage: int | None) -> str | None:
    """Why the recipe's adaptive clipper cannot decide DeepSpeed's clipping at ZeRO ``stage`` (None: it can, or
    the method is not adaptive)."""
    if method in ("norm", "none"):
        return None
    if method == "agc":
        return (
            "AGC clips each weight row by its own norm, and DeepSpeed clips the whole step by one factor on its "
            "flattened, partitioned gradients"
        )
    if not stage:
        return (
            "ZeRO stage 0 clips with torch's clip_grad_norm_ inside DeepSpeed's BF16/FP16 optimizers, which takes no "
            "threshold from outside (zero_stage 1, 2 or 3 can)"
        )
    return None


def deepspeed_clip_value(recipe: RecipeSpec) -> float:
    """The fixed ``gradient_clipping`` DeepSpeed gets for ``recipe`` (and Trainer's ``max_grad_norm`` must equal).

    ``norm``: its ``max_norm``; ``none``: 0 (off); adaptive methods: ZClip's ``max_norm`` cap if set, else 1.0.
    """
    clip = recipe.clipping
    if clip.method == "norm":
        return float(clip.max_norm)
    if clip.method == "none":
        return 0.0
    return float(clip.max_norm) if clip.method == "zclip" and clip.max_norm else 1.0


def ownership_notes(recipe: RecipeSpec) -> list[str]:
    """What DeepSpeed owns in a run of ``recipe`` (the Trainer callback's notes)."""
    st = recipe.storage
    master = "its FP32 master and FP32 states" if st.master == "fp32" else "bf16.bf16_master_weights_and_grads"
    return [
        "DeepSpeed owns loss scaling (its dynamic scaler, with hysteresis), clipping and the skipping of non-finite "
        "steps (FP16 and BF16); hf_mixedprec reads its loss scale, overflow and skipped steps",
        f"storage.master {st.master} / optimizer_states {st.optimizer_states}: DeepSpeed keeps the master and "
        f"optimizer states itself ({master}; hf_mixedprec's deepspeed_config writes the matching keys)",
    ]


# --- FP8 under DeepSpeed -------------------------------------------------------------------------------------------


def fp8_under_deepspeed(rt: Any, model: Any, state: Any, *, late: bool = False) -> None:
    """An FP8 recipe under DeepSpeed (``state``: Accelerate's, holding the DeepSpeed plugin and its config): refuse a
    config that cannot carry it, then convert the model's layers to FP8 before DeepSpeed takes the parameters and run
    its forward under the recipe's BF16 autocast.

    DeepSpeed runs FP32 for an FP8 recipe (``deepspeed_config``): its ``bf16`` mode casts the whole module with
    ``module.bfloat16()`` (deepspeed/runtime/engine.py, ``_configure_distributed_model``), FP8 layers' scaling
    buffers included, and autocasts nothing. ZeRO 1 and 2 partition the FP32 optimizer states and gradients; the
    FP8 layers keep their Parameters, so the optimizer steps them as any other. Delayed scaling's amaxes are reduced
    over the ranks (MAX) at each step as without DeepSpeed."""
    from hf_mixedprec.recipes.schema import DEEPSPEED_FP8_STAGES

    if late:
        raise ValueError(
            f"recipe {rt.recipe.name!r} (precision fp8) under DeepSpeed: the callback was added after the DeepSpeed "
            "engine took the model, so its layers can no longer be converted to FP8 (allowed: pass "
            "recipe.callbacks() to Trainer(callbacks=...))"
        )
    cfg = engine_config(state)
    stage = config_stage(cfg)
    if stage not in DEEPSPEED_FP8_STAGES:
        raise ValueError(
            f"recipe {rt.recipe.name!r} (precision fp8) under DeepSpeed ZeRO stage {stage}: FP8 runs under stages "
            f"{', '.join(map(str, DEEPSPEED_FP8_STAGES))} (zero_optimization.stage; build the config with "
            "deepspeed_config(recipe))"
        )
    for key in ("bf16", "fp16"):
        if (cfg.get(key) or {}).get("enabled") is True:
            raise ValueError(
                f"recipe {rt.recipe.name!r} (precision fp8) under DeepSpeed with {key}.enabled true: DeepSpeed would "
                "cast the FP8 layers' scaling state to 16 bits (allowed: bf16 and fp16 disabled, DeepSpeed in FP32, "
                "as deepspeed_config(recipe) writes)"
            )
    partitioned = next((n for n, p in model.named_parameters() if hasattr(p, "ds_id")), None)
    if partitioned is not None:
        raise ValueError(
            f"recipe {rt.recipe.name!r} (precision fp8) under DeepSpeed ZeRO-3: the model was built already "
            f"partitioned over the ranks ({partitioned} holds 1/N of its elements: from_pretrained after "
            "TrainingArguments with a ZeRO-3 config loads it so), and the FP8 conversion needs each layer's whole "
            "weight; load the model before building the TrainingArguments (hf-mixedprec finetune --model does for "
            "an FP8 recipe)"
        )
    rt.convert_model(model)
    rt.wrap_forward_with_autocast(model)
    rt.note(
        f"FP8 under DeepSpeed ZeRO-{stage}: FP8 layers converted before DeepSpeed takes the parameters, BF16 autocast "
        "installed by hf_mixedprec; DeepSpeed keeps FP32 weights, master, gradients and optimizer states"
    )


# --- Adaptive clipping through DeepSpeed's own ----------------------------------------------------------------------


def zero_optimizer(obj: Any) -> Any:
    """The ZeRO stage 1/2/3 optimizer behind ``obj`` (an engine, Accelerate's wrapper, the optimizer itself), or
    None (stage 0, no DeepSpeed)."""
    if "deepspeed" not in sys.modules:
        return None
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for _ in range(8):
        if isinstance(obj, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)):
            return obj
        inner = getattr(obj, "optimizer", None)
        if inner is None or inner is obj:
            return None
        obj = inner
    return None


def drop_clipper(rt: Any, method: str, why: str, max_norm: float) -> None:
    """Drop the runtime's clipper under DeepSpeed with a FALLBACK note saying ``why`` (DeepSpeed's fixed
    ``gradient_clipping``, ``max_norm``, clips instead)."""
    if rt.clipper is None:
        return
    rt.note(
        f"FALLBACK: clipping.method {method!r} is not applied under DeepSpeed: {why}; DeepSpeed clips with its fixed "
        f"gradient_clipping ({max_norm:g} here)"
    )
    rt.clipper = None


def clip_through_deepspeed(rt: Any, engine: Any, method: str, max_norm: float) -> None:
    """Once the DeepSpeed engine exists (a Trainer's first step): let the runtime's clipper decide DeepSpeed's
    clipping (:func:`route_adaptive_clipping`; each step's result is what the runtime reports), or drop it with a
    FALLBACK note naming why."""
    clipper = rt.clipper
    if clipper is None:
        return

    def decide(norm: Any) -> Any:
        rt._last = clipper.clip_grads_([], [], total_norm=norm)
        return rt._last.threshold

    why = route_adaptive_clipping(engine, decide)
    if why is not None:
        drop_clipper(rt, method, why, max_norm)
        return
    rt.note(
        f"clipping.method {method!r} under DeepSpeed: the threshold comes from the global gradient norm DeepSpeed "
        "computes over its partitions, and DeepSpeed's own clipping applies it"
    )


#: The attribute of a routed ZeRO optimizer holding the ``decide`` its clipping asks.
_DECIDE = "_hf_mixedprec_decide"


def route_adaptive_clipping(optimizer: Any, decide: Any) -> str | None:
    """Let ``decide(norm) -> threshold`` (0-d tensors: the unscaled global gradient norm of the step, and the
        clipper's threshold, inf for no clipping) set the clipping of the ZeRO optimizer behind ``optimizer``. Returns
        why it cannot (a fallback note's reason), or None when routed.

        ZeRO stages 1-3 (deepspeed/runtime/zero/stage_1_and_2.py and stage3.py, ``step``) compute the global norm of
        the partitioned gradients with one all-reduce, skip the step on an overflow, and hand that norm (times the loss
        scale) to ``unscale_and_clip_grads``, once per parameter group, which scales the gradients by
        ``1 / (loss_scale * max(1, (norm / loss_scale + 1e-6) / clip_grad))``. Its first call of a step asks
        ``decide`` once; every call of the step then gets the norm that makes DeepSpeed's own factor
        ``max(1, (norm + 1e-6) / threshold)``: the clipper's rule, with no gradient gathered, no extra collective and
        no host read. A step DeepSpeed skips for an overflow hands ``decide`` an infinite norm after the step, which the
    clipper records as a non-finite step (its statistics unchanged), as it does without DeepSpeed."""
    opt = zero_optimizer(optimizer)
    if opt is None:
        inner = getattr(getattr(optimizer, "optimizer", optimizer), "optimizer", None)
        return (
            f"DeepSpeed steps with {type(inner).__name__ if inner is not None else 'no'} optimizer, not a ZeRO stage 1-3 "
            "one (stage 0, and BF16 under ZeRO-1 with FP32 gradient accumulation, clip with torch's clip_grad_norm_ "
            "inside DeepSpeed)"
        )
    if getattr(opt, _DECIDE, None) is not None:  # routed before (a second train() on the same engine): re-point
        setattr(opt, _DECIDE, decide)
        return None
    if not float(opt.clip_grad) > 0:
        return _clips_nothing(opt.clip_grad)
    import torch

    original, original_step = opt.unscale_and_clip_grads, opt.step
    step_norm: dict[str, Any] = {}
    setattr(opt, _DECIDE, decide)

    def step(*args: Any, **kwargs: Any) -> Any:
        # a new step: its first unscale_and_clip_grads asks the clipper. The norm DeepSpeed hands over carries the
        # scale of the backward, which its scaler may grow before the clipping (stage_1_and_2.py: _update_scale)
        step_norm.clear()
        step_norm["backward_scale"] = opt.loss_scale
        out = original_step(*args, **kwargs)
        if "arg" not in step_norm:  # skipped for an overflow: the clipper sees a non-finite norm, as without DeepSpeed
            getattr(opt, _DECIDE)(torch.full((), math.inf, device=getattr(opt, "device", "cpu")))  # no copy
        return out

    def unscale_and_clip_grads(first: Any, total_norm: Any, *rest: Any, **kwargs: Any) -> Any:
        if "arg" not in step_norm:
            scale = opt.loss_scale  # what DeepSpeed divides by below
            scaled = total_norm if torch.is_tensor(total_norm) else torch.tensor(float(total_norm))
            norm = scaled.float() / step_norm.get("backward_scale", scale)
            threshold = getattr(opt, _DECIDE)(norm)
            cap = float(opt.clip_grad)  # a Python float in DeepSpeed's config (a checkpoint's value after a load)
            # DeepSpeed's factor is max(1, (n / scale + 1e-6) / cap): n = scale * (cap * (norm + 1e-6) / threshold
            # - 1e-6) makes it max(1, (norm + 1e-6) / threshold); clamped at 0 (no clipping: threshold inf), which
            # DeepSpeed's invalid-norm check (norm < 0) would turn into zeroed gradients
            step_norm["arg"] = (cap * (norm + 1e-6) / threshold.to(norm.device) - 1e-6).clamp_min(0) * scale
        return original(first, step_norm["arg"], *rest, **kwargs)

    opt.step = step
    opt.unscale_and_clip_grads = unscale_and_clip_grads
    return None


# --- What DeepSpeed will refuse on this machine -------------------------------------------------------------------


def deepspeed_device() -> str:
    """The accelerator DeepSpeed will pick in the training processes: ``DS_ACCELERATOR`` if set, else cuda or cpu.

    DeepSpeed also detects XPU, NPU, HPU and other devices; those are returned only through ``DS_ACCELERATOR``.
    """
    name = os.environ.get("DS_ACCELERATOR", "").strip()
    if name:
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def deepspeed_fp16_supported(device: str) -> bool | None:
    """What DeepSpeed 0.19.8's accelerator answers to ``is_fp16_supported()`` on this machine; None if unknown.

    The same rule DeepSpeed applies, without importing DeepSpeed: its CPU accelerator asks
    ``torch.ops.mkldnn._is_mkldnn_fp16_supported()`` (true only on CPUs with native FP16 arithmetic,
    AVX512-FP16 / AMX-FP16); its CUDA accelerator accepts compute capability 7.0 and newer, and 6.x only with
    ``DS_ALLOW_DEPRECATED_FP16=1``. Other devices: None (not judged here).
    """
    import torch

    if device == "cpu":
        try:
            return mkldnn_fp16_supported()
        except Exception:
            return False
    if device == "cuda":
        if not torch.cuda.is_available():
            return None
        major, _ = torch.cuda.get_device_capability()
        return major >= 7 or (major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1")
    return None


def deepspeed_refusal(recipe: RecipeSpec, device: str, *, fp16_supported: bool | None) -> str | None:
    """Why DeepSpeed cannot run ``recipe`` on ``device`` (one line naming the keys and what to use), or None.

    DeepSpeed 0.19.8 checks precision in ``DeepSpeedEngine._do_sanity_check``, inside ``deepspeed.initialize``
    on every rank: ``fp16.enabled`` on an accelerator whose ``is_fp16_supported()`` is false raises
    ``ValueError("Type fp16 is not supported on your device.")`` at any ZeRO stage (0-3). That is the only
    precision DeepSpeed refuses on the devices judged here: its CPU accelerator always supports bf16, and with
    ``fp16_supported`` true (or precision bf16/fp32) every stage 0-3 trained on 2 CPU ranks. Rehearsal does
    not help: DeepSpeed runs FP16 itself, not hf_mixedprec's emulation.
    """
    if recipe.distributed.strategy != "deepspeed" or recipe.precision != "fp16" or fp16_supported is not False:
        return None
    stage = recipe.distributed.zero_stage
    if device == "cpu":
        where = (
            "this CPU: DeepSpeed's CPU accelerator has FP16 only on CPUs with AVX512-FP16/AMX-FP16 "
            "(torch.ops.mkldnn._is_mkldnn_fp16_supported() is false here)"
        )
        instead = "precision bf16, e.g. a recipe that extends cpu-bf16 with the same distributed section"
    else:
        where = f"this {device} device: DeepSpeed's accelerator reports no FP16 (compute capability below 7.0)"
        instead = "precision fp32 with the same distributed section"
    return (
        f"recipe {recipe.name!r}: precision fp16 with distributed.strategy deepspeed (zero_stage {stage}) cannot run "
        f"on {where}; every rank would stop with DeepSpeed's 'Type fp16 is not supported on your device' "
        f"(allowed: {instead}; or distributed.strategy none/ddp with --rehearse to rehearse FP16 loss scaling)"
    )


# --- Reading DeepSpeed's loss scaler --------------------------------------------------------------------------------


def _as_float(value: Any) -> float:
    return float(value.item() if hasattr(value, "item") else value)


def _as_int(value: Any) -> int | None:
    if value is None:
        return None
    return int(value.item() if hasattr(value, "item") else value)


def _scaler_owner(obj: Any) -> tuple[Any, Any] | None:
    """Unwrap Accelerate's wrappers and the engine down to the object that owns DeepSpeed's loss scaler (a ZeRO
    or stage-0 FP16 optimizer, or a scaler itself); returns (the engine met on the way or None, that object)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.fp16.loss_scaler import LossScaleConfig, LossScalerBase

    engine = None
    for _ in range(8):
        if isinstance(obj, DeepSpeedEngine):
            engine = obj
            obj = obj.optimizer
        elif (
            isinstance(obj, LossScalerBase)
            or isinstance(getattr(obj, "loss_scaler", None), LossScalerBase)
            or isinstance(getattr(obj, "loss_scale_config", None), LossScaleConfig)
        ):
            return engine, obj
        else:
            inner = getattr(obj, "optimizer", None)
            if inner is None or inner is obj:
                return None
            obj = inner
    return None


def read_deepspeed_scaler(obj: Any) -> dict[str, Any] | None:
    """The state of DeepSpeed's FP16 loss scaler behind ``obj``, or None where there is no DeepSpeed scaler.

    ``obj`` may be the optimizer a Trainer callback receives (Accelerate's ``DeepSpeedOptimizerWrapper``, an
    ``AcceleratedOptimizer``), a ``DeepSpeedEngine`` (``trainer.model_wrapped``), a DeepSpeed optimizer (ZeRO
    stage 1/2/3 ``DeepSpeedZeroOptimizer*``, stage-0 ``FP16_Optimizer`` / ``FP16_UnfusedOptimizer``) or the
    scaler itself. Returns ``{"loss_scale", "overflow", "skipped_steps", "hysteresis", "dynamic"}``:

    - ``loss_scale``: the scale the next backward multiplies the loss by (``cur_scale``; an external scale set
      with ``set_loss_scale`` wins, as in DeepSpeed's own ``loss_scale`` property).
    - ``overflow``: whether the last optimizer step found inf/NaN gradients and was skipped (``optimizer.overflow``;
      it is only rewritten at accumulation boundaries).
    - ``skipped_steps``: the engine's count of skipped steps (``engine.skipped_steps``); None when only the
      optimizer is at hand (ZeRO optimizers keep no link to their engine; stage-0 FP16 optimizers do).
    - ``hysteresis``: ``cur_hysteresis`` of ZeRO's ``DynamicLossScaler``, the overflows still tolerated before the
      next back-off; None for a static scale and for the stage-0 FP16 optimizers, which ignore ``hysteresis``.
    - ``dynamic``: whether the scale is dynamic (config ``fp16.loss_scale: 0``).

    DeepSpeed's dynamic scaler (``deepspeed/runtime/fp16/loss_scaler.py``, config ``fp16.*``): the scale starts at
    ``2**initial_scale_power`` (default 16). On an overflow the step is skipped; if ``cur_hysteresis`` is 1 (or
    ``hysteresis`` is 1) the scale is divided by 2, never below ``min_loss_scale`` (default 1), otherwise only
    ``cur_hysteresis`` drops by one (and stays down after the halving). On the ``loss_scale_window``-plus-first
    consecutive clean step (default window 1000) the scale doubles and ``cur_hysteresis`` refills to
    ``hysteresis`` (default 2; ``consecutive_hysteresis: true`` refills it after every clean step instead). An
    overflow with the scale already at ``min_loss_scale`` raises "Current loss scale already at minimum - cannot
    decrease scale anymore. Exiting run." The stage-0 FP16 optimizers halve on every overflow.

    Meant for logging steps: it reads Python attributes and calls ``.item()`` only on a tensor value. BF16 / FP32
    runs (ZeRO keeps a fixed ``LossScaler(1.0)`` there) and DeepSpeed's ``torch_autocast`` mode (whose scale lives
    in a torch ``GradScaler``, ``optimizer.torch_autocast_gradscaler``) give None; handed a scaler object itself,
    it reports that object as it is.
    """
    if "deepspeed" not in sys.modules:  # nothing can be a DeepSpeed object
        return None
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaleConfig, LossScalerBase

    found = _scaler_owner(obj)
    if found is None:
        return None
    engine, obj = found
    if engine is None and isinstance(getattr(obj, "deepspeed", None), DeepSpeedEngine):
        engine = obj.deepspeed  # stage-0 FP16 optimizers keep their engine
    skipped = _as_int(getattr(engine, "skipped_steps", None)) if engine is not None else None
    overflow = bool(getattr(obj, "overflow", False))

    if isinstance(obj, LossScalerBase):  # the scaler itself: it records the iteration of its last overflow
        scaler, custom = obj, False
        overflow = (
            isinstance(obj, DynamicLossScaler) and obj.cur_iter > 0 and obj.last_overflow_iter == obj.cur_iter - 1
        )
    elif isinstance(getattr(obj, "loss_scale_config", None), LossScaleConfig):  # FP16_Optimizer / Unfused
        cfg = obj.loss_scale_config
        if not cfg.use_grad_scaling:
            return None
        custom = bool(getattr(obj, "custom_loss_scaler", False))
        scale = obj.external_loss_scale if custom else cfg.cur_scale
        return {
            "loss_scale": _as_float(scale),
            "overflow": overflow,
            "skipped_steps": skipped,
            "hysteresis": None,
            "dynamic": bool(cfg.dynamic_loss_scale) and not custom,
        }
    else:  # ZeRO optimizers
        scaler = obj.loss_scaler
        custom = bool(getattr(obj, "custom_loss_scaler", False))
        if getattr(obj, "dtype", torch.float16) != torch.float16 and not custom:
            return None  # bf16 / fp32: DeepSpeed keeps a LossScaler(1.0) that never scales
    dynamic = isinstance(scaler, DynamicLossScaler) and bool(scaler.dynamic) and not custom
    scale = obj.external_loss_scale if custom else scaler.cur_scale
    return {
        "loss_scale": _as_float(scale),
        "overflow": overflow,
        "skipped_steps": skipped,
        "hysteresis": _as_int(scaler.cur_hysteresis) if dynamic else None,
        "dynamic": dynamic,
    }


def deepspeed_step_state(engine: Any) -> dict[str, Any] | None:
    """What the last ``engine.step()`` did, for the health monitor: :func:`read_deepspeed_scaler`'s fields where
    DeepSpeed keeps an FP16 scaler, else (BF16, FP32) ``loss_scale`` None and the engine's ``skipped_steps``.

    DeepSpeed skips a step whose gradients hold inf/NaN under BF16 too (its ZeRO optimizers and the stage-0
    BF16 optimizer check for overflow whatever the dtype) and counts it in ``engine.skipped_steps``; that count,
    a Python int, is how a BF16 skip is seen without a scaler. ``grad_norm`` is the engine's last global gradient
    norm (``get_global_grad_norm()``, what Trainer logs), None where DeepSpeed does not compute it. None when
    ``engine`` is no DeepSpeed engine.
    """
    state = read_deepspeed_scaler(engine)
    if state is None:
        count = _as_int(getattr(engine, "skipped_steps", None))
        if count is None:
            return None
        overflow = bool(getattr(getattr(engine, "optimizer", None), "overflow", False))
        state = {"loss_scale": None, "overflow": overflow, "skipped_steps": count, "hysteresis": None, "dynamic": False}
    norm = engine.get_global_grad_norm() if callable(getattr(engine, "get_global_grad_norm", None)) else None
    state["grad_norm"] = _as_float(norm) if norm is not None else None
    return state
