"""Memory per GPU for each recipe, by component, from the recipe's precision plan and one training step run on
fake tensors.

``estimate_memory`` builds the model from its ``config.json`` under PyTorch's ``FakeTensorMode`` (tensors with
shapes, dtypes and devices but no storage: an 8B-parameter model costs no memory), the way ``finetune`` builds it
(float32), and makes the recipe's precision plan for it (:func:`hf_mixedprec.precision.plan.build_plan`, what a run builds).
It then prepares the model as the run would (the plan's storage put into effect, FP8 layers converted as the
plan decided) and runs one real training step on it: the model's own forward and backward under the recipe's
autocast and, for delayed FP8 scaling, the amax-history update. Counted by kind:

- weights, master, gradients and AdamW's states: the plan's bytes per parameter (its ``storage:`` section:
  float32 weights for ``master: fp32``, BF16 for the other choices, an int16 remainder or a BF16 Kahan buffer as
  master, ``exp_avg`` / ``exp_avg_sq`` in fp32, bf16 or torchao's 8bit / 4bit / fp8 layouts, a float32 ``step``
  per tensor). Under DeepSpeed BF16/FP16 the weights and gradients take 2 bytes (DeepSpeed casts the module) and
  DeepSpeed keeps its own master copy: 4 bytes, or 2 with ``master: none`` (``bf16_master_weights_and_grads``);
  ``optimizer_states: bf16`` is its ``bf16_optimizer_states``;
- other optimizers (``sgd``, ``adafactor``; the plan assumes AdamW): ``optimizer.state`` after a step of the
  optimizer Trainer would build (``Trainer.get_optimizer_cls_and_kwargs``) on the fake model;
- activations: the peak of the tensors autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``),
  Parameters excluded, each storage counted once. With gradient checkpointing the recomputation inside
  backward is part of the peak (the step uses reentrant checkpointing, whose recomputed tensors the hook sees;
  non-reentrant checkpointing holds the same tensors);
- FP8 extras: the converted layers' buffers (amax histories, scales); for Transformer Engine, its FP8 weight
  copies (row- and column-wise) and delayed-scaling state, from :mod:`hf_mixedprec.fp8.memory`.

Sharding: DeepSpeed ZeRO stage 1 partitions the optimizer states (and the master weights), stage 2 also the
gradients, stage 3 also the weights, each over the world size (Rajbhandari et al., "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", SC 2020, Sec. 5.1). FSDP2 shards weights, master, gradients and
optimizer states like stage 3. Plain data parallel (DDP) keeps a gradient-sized set of buckets
(``torch.nn.parallel.DistributedDataParallel``'s ``gradient_as_bucket_view=False``, Trainer's default).

Not counted: the CUDA context, the caching allocator's fragmentation, temporaries that live only within one op,
communication buckets of DeepSpeed and FSDP, and the all-gathered block FSDP2/ZeRO-3 holds during a forward.
The fit verdict keeps 10% of a GPU free for them.

The fake step and the accounting of what it holds are in :mod:`hf_mixedprec.commands.estimate_step`; this module holds the
inputs, the sharding rules, the results and the table, and re-exports that module's public names.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from hf_mixedprec.commands.estimate_step import (
    OPTIMIZERS,
    EstimateUnsupported,
    SavedTensorMeter,
    _run_fake_step,
    _Settings,
    _Step,
)
from hf_mixedprec.core._text import root_cause, shorten
from hf_mixedprec.core.errors import UsageError
from hf_mixedprec.integrations.recipe import Recipe, fp32_recipe, load_recipe

__all__ = [
    "GPUS",
    "OPTIMIZERS",
    "Components",
    "EstimateUnsupported",
    "GpuFit",
    "MemoryEstimate",
    "RecipeEstimate",
    "SavedTensorMeter",
    "estimate_memory",
    "format_estimate",
    "load_model_config",
    "parse_gpu",
]

#: Nominal memory of common training GPUs in GiB, as their product names give it; the driver reports a little
#: less (an H200 shows about 139 GiB of its 141). ``--gpu NAME=SIZE`` or a bare size names any other card.
GPUS: dict[str, float] = {
    "t4-16gb": 16,
    "v100-16gb": 16,
    "v100-32gb": 32,
    "a10-24gb": 24,
    "l4-24gb": 24,
    "rtx4090-24gb": 24,
    "a100-40gb": 40,
    "l40s-48gb": 48,
    "a100-80gb": 80,
    "h100-80gb": 80,
    "h200-141gb": 141,
    "b200-192gb": 192,
}

#: Share of a GPU the verdict leaves for what the estimate does not count (see the module docs).
RESERVE = 0.10
GIB = 2**30


# -- results -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Components:
    """Bytes per GPU by kind (see the module docs for what each holds)."""

    weights: int
    master_weights: int
    gradients: int
    optimizer: int
    activations: int
    fp8_extras: int
    ddp_buckets: int = 0

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class GpuFit:
    """Whether a recipe's total fits one GPU, keeping :data:`RESERVE` of it free."""

    gpu: str
    capacity: int
    headroom: int
    verdict: str  # "fits", "tight" (under the reserve) or "does not fit"


@dataclass(frozen=True)
class RecipeEstimate:
    """One recipe's memory per GPU. ``components``: the model states by part (weights, master, gradients, then each
    optimizer state: ``exp_avg``, ``exp_avg_sq``, ``step`` for AdamW), per GPU; ``bytes_per_param``: weights, master,
    gradients and optimizer per GPU over the model's parameter count; ``storage``: the recipe's ``storage:``
    choices and the optimizer that keeps them."""

    recipe: str
    precision: str
    fp8_backend: str | None
    fp8_layers: int
    strategy: str
    memory: Components
    percent_of_fp32: float
    fits: tuple[GpuFit, ...]
    notes: tuple[str, ...] = ()
    components: dict[str, int] = field(default_factory=dict)
    bytes_per_param: float = 0.0
    storage: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MemoryEstimate:
    """``estimate_memory``'s answer: the settings, the FP32 reference and one entry per recipe."""

    model: str
    parameters: int
    settings: dict[str, Any]
    fp32: Components
    recipes: tuple[RecipeEstimate, ...]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fp32"] = self.fp32.to_dict()
        for r, rec in zip(d["recipes"], self.recipes, strict=True):
            r["memory"] = rec.memory.to_dict()
        return d


# -- inputs --------------------------------------------------------------------------------------------------


def load_model_config(
    model: str | os.PathLike[str] | None = None,
    *,
    config: str | os.PathLike[str] | None = None,
    seq_len: int = 512,
) -> Any:
    """The ``PretrainedConfig`` of a model folder (its ``config.json``; no weights needed) or of a config file;
    neither: the model ``finetune`` builds without ``--model`` (positions for ``seq_len``)."""
    from transformers import AutoConfig

    from hf_mixedprec.core.demo import default_model_config
    from hf_mixedprec.core.model_dir import check_model_dir, read_model_config

    if model is not None and config is not None:
        raise UsageError("--model and --config: give one of them (both name the model)")
    if model is None and config is None:
        return default_model_config(seq_len=seq_len)
    if model is not None:
        check_model_dir(str(model))
        _check_sizes(_raw_config(Path(model) / "config.json"), f"--model: {str(model)!r}")
        cfg = read_model_config(str(model))
    else:
        path = Path(config or "")
        if not path.is_file():
            raise UsageError(f"--config: {str(path)!r} is not a file (allowed: a model's config.json)")
        _check_sizes(_raw_config(path), f"--config: {str(path)!r}")
        try:
            data = json.loads(path.read_text())
            cfg = AutoConfig.for_model(**data) if "model_type" in data else None
        except Exception as exc:
            raise UsageError(f"--config: cannot read a model config from {str(path)!r} ({root_cause(exc)})") from None
        if cfg is None:
            raise UsageError(f"--config: {str(path)!r} has no 'model_type' (allowed: a transformers config.json)")
    cfg.name_or_path = str(model if model is not None else config)
    return cfg


#: Config keys that are sizes or counts (top level, or in a multimodal model's ``text_config``): each must be an
#: integer >= 1 when given (>= 0 for the expert counts).
SIZE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "n_embd",
    "n_layer",
    "n_head",
    "n_positions",
    "n_inner",
)
#: The most layers ``estimate`` builds (the largest published LLMs have under 130); building costs about 0.1 s per
#: layer and recipe on a 2-core CPU, so this bounds a hostile config's work at a few minutes.
MAX_LAYERS = 1024
_MAX_CONFIG_BYTES = 16 * 2**20


def _raw_config(path: Path) -> dict[str, Any]:
    """A config file's JSON, read with bounds (size, nesting); {} when it is not there (the loader says so)."""
    if not path.is_file():
        return {}
    if path.stat().st_size > _MAX_CONFIG_BYTES:
        raise UsageError(f"{path}: {path.stat().st_size:,} bytes is not a model config (allowed: at most 16 MiB)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:
        raise UsageError(f"{path}: not a JSON model config ({type(exc).__name__})") from None
    return data if isinstance(data, dict) else {}


def _check_sizes(data: dict[str, Any], where: str) -> None:
    """Every size in a model config is an integer >= 1, and the layer count one ``estimate`` can build in bounded
    time (:data:`MAX_LAYERS`); else one line naming the flag, the file, the key and the value."""
    for scope, part in (("", data), ("text_config.", data.get("text_config"))):
        if not isinstance(part, dict):
            continue
        for key in SIZE_KEYS:
            value = part.get(key)
            if value is None:
                continue
            low = 0 if "expert" in key else 1  # 0 experts: a dense model of a MoE family
            # some families give a size per layer (Gemma 3n's intermediate_size, Ernie 4.5's moe_intermediate_size)
            values = value if isinstance(value, list) and value and key != "num_hidden_layers" else [value]
            for v in values:
                if isinstance(v, bool) or not isinstance(v, int) or v < low:
                    raise UsageError(
                        f"{where}: {scope}{key} {shorten(repr(value), 60)} is not a size (allowed: an integer >= "
                        f"{low}, or a list of them per layer)"
                    )
            if key in ("num_hidden_layers", "n_layer") and value > MAX_LAYERS:
                raise UsageError(
                    f"{where}: {scope}{key} {value:,} is more layers than estimate and plan build (allowed: 1 to "
                    f"{MAX_LAYERS:,}; about 0.1 s per layer and recipe)"
                )


def parse_gpu(spec: str) -> tuple[str, int]:
    """``h100-80gb`` (a name in :data:`GPUS`), ``NAME=SIZE`` or ``SIZE`` (``24GiB``, ``24``) -> (name, bytes)."""
    name, _, size = spec.rpartition("=") if "=" in spec else ("", "", spec)
    key = spec.lower()
    if not name and key in GPUS:
        return key, int(GPUS[key] * GIB)
    text = size.strip().lower().removesuffix("gib").removesuffix("gb").strip()
    try:
        gib = float(text)
    except ValueError:
        gib = float("nan")
    if not math.isfinite(gib) or gib <= 0:
        raise UsageError(
            f"--gpu: {spec!r} is not a GPU this knows (allowed: {', '.join(GPUS)}, or a size such as 24GiB, "
            "or NAME=SIZE)"
        )
    return (name or f"{gib:g}GiB"), int(gib * GIB)


def _recipe(spec: str | Recipe) -> Recipe:
    if isinstance(spec, Recipe):
        return spec
    if spec == "fp32":
        return fp32_recipe()
    return load_recipe(spec, check_hardware=False)


def _check(settings: _Settings) -> None:
    for flag, value in (("--batch-size", settings.batch_size), ("--seq-len", settings.seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{flag}: {value!r} is not allowed (allowed: an integer >= 1)")
    if settings.num_gpus is not None and (not isinstance(settings.num_gpus, int) or settings.num_gpus < 1):
        raise UsageError(f"--num-gpus: {settings.num_gpus!r} is not allowed (allowed: an integer >= 1)")
    if settings.zero is not None and settings.zero not in (0, 1, 2, 3):
        raise UsageError(f"--zero: {settings.zero!r} is not allowed (allowed: 0, 1, 2, 3)")
    if settings.optimizer not in OPTIMIZERS:
        raise UsageError(f"--optimizer: {settings.optimizer!r} is not allowed (allowed: {', '.join(OPTIMIZERS)})")
    if settings.target not in ("gpu", "cpu"):
        raise UsageError(f"--target: {settings.target!r} is not allowed (allowed: gpu, cpu)")


def _check_positions(seq_len: int, config: Any) -> None:
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if isinstance(limit, int) and seq_len > limit:
        raise UsageError(
            f"--seq-len: {seq_len} is more than the model's max_position_embeddings {limit} (allowed: 1..{limit})"
        )


# -- sharding ------------------------------------------------------------------------------------------------


def _strategy(recipe: Recipe, s: _Settings) -> tuple[str, int, int]:
    """(strategy, ZeRO stage, world size) for ``recipe`` under the flags (flags win over the recipe)."""
    n = s.num_gpus if s.num_gpus is not None else recipe.distributed.num_processes
    if s.zero is not None:
        return ("deepspeed" if s.zero > 0 else ("ddp" if n > 1 else "none")), s.zero, n
    dist = recipe.distributed
    if dist.strategy == "deepspeed":
        return "deepspeed", dist.zero_stage or 0, n
    if dist.strategy == "fsdp2":
        return ("fsdp2" if n > 1 else "none"), 0, n
    return ("ddp" if n > 1 else "none"), 0, n


def _share(nbytes: int, n: int, sharded: bool) -> int:
    return -(-nbytes // n) if sharded else nbytes


def _model_states(step: _Step, recipe: Recipe, strategy: str) -> dict[str, int]:
    """Unsharded bytes of the model states by part: the plan's weights, master and gradients (DeepSpeed's own under
    DeepSpeed BF16/FP16), then the optimizer's states (the plan's AdamW states, else the measured ones)."""
    assert step.plan is not None
    plan = step.plan.bytes_by_component()
    parts = {k: plan.get(k, 0) for k in ("weights", "master", "gradients")}
    if strategy == "deepspeed":  # ZeRO keeps 2-byte module weights and gradients beside its own master partition
        low = 2 if recipe.precision in ("bf16", "fp16") else 4
        master = (2 if recipe.storage.master == "none" else 4) if low == 2 else 0  # bf16_master_weights_and_grads
        parts = {"weights": step.params * low, "master": step.params * master, "gradients": step.params * low}
    if step.states is not None:
        return {**parts, **step.states}
    return {**parts, "exp_avg": plan["exp_avg"], "exp_avg_sq": plan["exp_avg_sq"], "step": plan["optimizer_step"]}


def _components(
    step: _Step, recipe: Recipe, strategy: str, stage: int, n: int, half_activations: int | None
) -> tuple[Components, dict[str, int]]:
    """Per-GPU bytes of ``step`` under ``strategy``, and the model states by part (see the module docs for the
    ZeRO / FSDP2 / DDP rules)."""
    parts = _model_states(step, recipe, strategy)
    states = [k for k in parts if k not in ("weights", "master", "gradients")]
    optimizer = step.optimizer if step.states is not None else sum(parts[k] for k in states)
    ds, fsdp = strategy == "deepspeed", strategy == "fsdp2"
    zero1 = fsdp or (ds and stage >= 1)  # the master and the optimizer states
    sharded = {"weights": fsdp or (ds and stage >= 3), "gradients": fsdp or (ds and stage >= 2)}
    per_gpu = {k: _share(v, n, sharded.get(k, zero1)) for k, v in parts.items()}
    mem = Components(
        weights=per_gpu["weights"],
        master_weights=per_gpu["master"],
        gradients=per_gpu["gradients"],
        optimizer=_share(optimizer, n, zero1),
        activations=half_activations if half_activations is not None else step.activations,
        fp8_extras=step.fp8_extras,
        ddp_buckets=parts["gradients"] if strategy == "ddp" else 0,
    )
    return mem, per_gpu


def _fit(total: int, gpus: Sequence[tuple[str, int]]) -> tuple[GpuFit, ...]:
    fits = []
    for name, capacity in gpus:
        headroom = capacity - total
        verdict = "fits" if total <= capacity * (1 - RESERVE) else ("tight" if headroom >= 0 else "does not fit")
        fits.append(GpuFit(name, capacity, headroom, verdict))
    return tuple(fits)


@dataclass(frozen=True)
class _One:
    """One recipe (or phase) estimated: its memory, its model states by part, the step and the strategy label."""

    memory: Components
    parts: dict[str, int]
    step: _Step
    strategy: str


def _check_storage(recipe: Recipe, s: _Settings, strategy: str, stage: int) -> None:
    """Refuse what the run would refuse: a storage choice beside another optimizer than AdamW, or one DeepSpeed
    has no equivalent of under ``--zero``."""
    from pydantic_core import PydanticCustomError

    from hf_mixedprec.recipes.storage_config import storage_rules

    st = recipe.storage
    if not st.is_default and s.optimizer != "adamw":
        raise UsageError(
            f"--optimizer {s.optimizer}: recipe {recipe.name!r} keeps storage.master {st.master} with "
            f"optimizer_states {st.optimizer_states}, which needs AdamW (allowed: --optimizer adamw; or a recipe with "
            "storage master fp32 and optimizer_states fp32)"
        )
    if strategy == "deepspeed":
        try:
            storage_rules(st, recipe.precision, strategy, stage)
        except PydanticCustomError as exc:
            raise UsageError(f"--zero {stage}: recipe {recipe.name!r}: {exc.message()}") from None


def _estimate_one(config: Any, recipe: Recipe, s: _Settings) -> _One:
    strategy, stage, n = _strategy(recipe, s)
    _check_storage(recipe, s, strategy, stage)
    step = _run_fake_step(config, recipe, s)
    half = None
    if strategy == "deepspeed" and recipe.precision in ("bf16", "fp16"):
        dtype = torch.bfloat16 if recipe.precision == "bf16" else torch.float16
        half = _run_fake_step(config, recipe, replace(s, optimizer="sgd"), model_dtype=dtype).activations
    label = strategy if strategy != "deepspeed" else f"deepspeed ZeRO-{stage}"
    if n > 1:
        label += f" x{n}"
    mem, parts = _components(step, recipe, strategy, stage, n, half)
    return _One(mem, parts, step, label)


def estimate_memory(
    model: Any = None,
    recipes: Sequence[str | Recipe] = ("a100-bf16",),
    *,
    batch_size: int = 1,
    seq_len: int = 2048,
    gradient_checkpointing: bool = False,
    optimizer: str = "adamw",
    zero: int | None = None,
    num_gpus: int | None = None,
    gpus: Sequence[str] = ("h100-80gb",),
    target: str = "gpu",
) -> MemoryEstimate:
    """Memory per GPU of one training step of ``model`` under each recipe, by component.

    ``model``: a ``PretrainedConfig``, a model folder or a ``config.json`` path (None: ``finetune``'s default
    model); no weights are read or allocated. ``target``: ``gpu`` (FP8 on the recipe's GPU backend, Transformer
    Engine for ``auto``) or ``cpu`` (what runs on this machine: rehearsed FP8 layers). ``zero`` and
    ``num_gpus`` override the recipes' ``distributed`` section. Raises :class:`UsageError` for bad input.
    """
    s = _Settings(batch_size, seq_len, bool(gradient_checkpointing), optimizer, zero, num_gpus, target)
    _check(s)
    config, label = _config_of(model, seq_len)
    _check_positions(seq_len, config)
    gpu_list = [parse_gpu(g) for g in gpus]
    loaded = [_recipe(r) for r in recipes]
    fp32 = fp32_recipe()
    results, params = [], 0
    baselines: dict[tuple[str, int, int], Components] = {}
    measured: dict[Recipe, _One] = {}  # a phase that repeats another (a BF16 warm-up and anneal) is measured once
    for name, rec in _phases_of(loaded):
        if rec not in measured:
            measured[rec] = _estimate_one(config, rec, s)
        one = measured[rec]
        mem, step, params = one.memory, one.step, one.step.params
        key = _strategy(rec, s)
        if key not in baselines:  # an FP32 recipe with the default storage is its own reference
            same = rec.precision == "fp32" and rec.storage.is_default
            baselines[key] = mem if same else _estimate_one(config, _with_distributed(fp32, rec), s).memory
        states = mem.weights + mem.master_weights + mem.gradients + mem.optimizer
        results.append(
            RecipeEstimate(
                recipe=name,
                precision=rec.precision,
                fp8_backend=step.backend,
                fp8_layers=step.fp8_layers,
                strategy=one.strategy,
                memory=mem,
                percent_of_fp32=round(100.0 * mem.total / baselines[key].total, 1),
                fits=_fit(mem.total, gpu_list),
                notes=tuple(step.notes),
                components=dict(one.parts),
                bytes_per_param=round(states / params, 4) if params else 0.0,
                storage=_storage_of(rec, step),
            )
        )
    fp32_mem = next(iter(baselines.values()), None) or _estimate_one(config, fp32, s).memory
    settings = asdict(s)
    settings["gpus"] = [name for name, _ in gpu_list]
    return MemoryEstimate(label, params, settings, fp32_mem, tuple(results))


def recipe_memory(
    model: Any,
    recipe: Recipe,
    *,
    batch_size: int,
    seq_len: int,
    gradient_checkpointing: bool = False,
    num_gpus: int | None = None,
    target: str = "gpu",
) -> Components:
    """The components of :func:`estimate_memory` for one recipe (a phased one: its largest phase), without the FP32
    baseline run that ``estimate`` adds for its percentages: what ``finetune``'s summary reports, at half the cost
    (each fake step takes about half a second on a CPU)."""
    s = _Settings(batch_size, seq_len, bool(gradient_checkpointing), "adamw", None, num_gpus, target)
    _check(s)
    config, _ = _config_of(model, seq_len)
    _check_positions(seq_len, config)
    measured: dict[Recipe, Components] = {}
    for _, rec in _phases_of([recipe]):
        if rec not in measured:
            measured[rec] = _estimate_one(config, rec, s).memory
    return max(measured.values(), key=lambda m: m.total)


def _storage_of(rec: Recipe, step: _Step) -> dict[str, Any]:
    """The recipe's storage choices and the optimizer keeping them (``unchanged``: the one ``--optimizer`` names)."""
    impl = step.plan.optimizer if step.plan is not None else "unchanged"
    return {"master": rec.storage.master, "optimizer_states": rec.storage.optimizer_states, "optimizer": impl}


def _phases_of(recipes: list[Recipe]) -> list[tuple[str, Recipe]]:
    """Each recipe by name, a phased one as one entry per phase (``name [phase label]``): its memory changes at
    every boundary (FP8 weight copies and histories come and go)."""
    out: list[tuple[str, Recipe]] = []
    for rec in recipes:
        if rec.phases is None:
            out.append((rec.name, rec))
            continue
        for i, (phase, spec) in enumerate(zip(rec.phases, rec.phase_specs())):
            out.append((f"{rec.name} [{phase.label(i)}]", spec))
    return out


def _with_distributed(fp32: Recipe, rec: Recipe) -> Recipe:
    """The FP32 reference under ``rec``'s distributed section (DeepSpeed keeps FP32 weights at FP32)."""
    return fp32.model_copy(update={"distributed": rec.distributed})


def _config_of(model: Any, seq_len: int) -> tuple[Any, str]:
    if model is None:
        return load_model_config(seq_len=seq_len), "finetune's default model (small Llama built from a config)"
    if isinstance(model, (str, os.PathLike)):
        model = load_model_config(model) if Path(model).is_dir() else load_model_config(config=model)
    return model, getattr(model, "name_or_path", "") or type(model).__name__


# -- output --------------------------------------------------------------------------------------------------


def _in(n: int, unit: int) -> str:
    return f"{n / unit:,.2f}" if unit == GIB else f"{n / unit:,.1f}"


def format_estimate(est: MemoryEstimate) -> str:
    """The estimate as a Markdown table (GiB per GPU) with the settings above it."""
    s = est.settings
    head = (
        f"model: {est.model}, {est.parameters / 1e9:.3f}B parameters; batch {s['batch_size']} x seq "
        f"{s['seq_len']}, optimizer {s['optimizer']}, gradient checkpointing "
        f"{'on' if s['gradient_checkpointing'] else 'off'}, target {s['target']}"
    )
    gpus = s["gpus"]
    cols = ["recipe", "strategy", "weights", "master", "grads", "optimizer", "activations", "fp8", "total", "% fp32"]
    cols.append("B/param")
    unit = GIB if max((r.memory.total for r in est.recipes), default=0) >= GIB else 2**20
    lines = [head, "", f"{'GiB' if unit == GIB else 'MiB'} per GPU:", "", "| " + " | ".join(cols + gpus) + " |"]
    lines.append("|" + "---|" * 2 + "---:|" * (len(cols) - 2) + "---|" * len(gpus))
    for r in est.recipes:
        m = r.memory
        parts = [m.weights, m.master_weights, m.gradients + m.ddp_buckets, m.optimizer, m.activations, m.fp8_extras]
        fits = [f"{f.verdict} ({f.headroom / GIB:+.1f})" for f in r.fits]
        row = [
            r.recipe,
            r.strategy,
            *(_in(p, unit) for p in parts),
            _in(m.total, unit),
            f"{r.percent_of_fp32:.1f}",
            f"{r.bytes_per_param:.2f}",
            *fits,
        ]
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "B/param: weights, master, grads and optimizer per GPU over the model's parameters. Fit: the headroom in GiB "
        "after the total; 'tight' = fits but with under 10% free for the CUDA context, fragmentation and "
        "temporaries (not counted).",
    ]
    notes = sorted({n for r in est.recipes for n in r.notes})
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)
