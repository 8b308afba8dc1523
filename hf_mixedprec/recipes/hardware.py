"""Which hardware can run which recipe, decided by a pure function of (device, capability, versions).

Facts (Transformer Engine's own checks: ``check_fp8_support``, ``check_mxfp8_support`` and
``check_fp8_block_scaling_support`` in ``transformer_engine/pytorch/fp8.py``): FP8 delayed/current scaling needs compute
capability >= 8.9 (Ada also needs CUDA >= 12.1); blockwise FP8 needs >= 9.0 and CUDA >= 12.9; MXFP8 needs
10.x (not 12.x); NVFP4 (``check_nvfp4_support``) needs >= 10.0; V100 (7.0) and T4 (7.5) have no BF16 and no FP8; A100 (8.0) has BF16 and TF32 but no FP8.
TE's default recipe is MXFP8 on 10.x, current scaling on 12.x and delayed scaling otherwise; NVFP4 is never a
default (``auto`` does not pick it; ``detect`` lists the built-in recipes that also run here).

:func:`detect` is the only function here that looks at the machine; everything else is pure, so every
generation is tested without its hardware. Nothing here ever falls back silently: a recipe the hardware
cannot run is refused by :func:`check_recipe` with a message that names the hardware, what it lacks and
the recipe to use instead.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from hf_mixedprec.core._optional import available
from hf_mixedprec.core._private import cpu_native_16bit, has_scaled_mm, mkldnn_fp16_supported
from hf_mixedprec.core.errors import EnvValueError, HardwareRefusal
from hf_mixedprec.core.formats import COMPUTE_FORMATS
from hf_mixedprec.recipes.schema import RecipeSpec

__all__ = [
    "CPU_BF16_ENV",
    "SLOW_GEMM_RATIO",
    "CpuGemmSpeed",
    "HardwareInfo",
    "HardwareRefusal",
    "Support",
    "auto_recipe_name",
    "check_recipe",
    "cpu_gemm_speed",
    "cpu_speed_note",
    "decide_cpu_gemm",
    "detect",
    "fp8_backend_for",
    "generation_of",
    "measure_gemm_slowdown",
    "support_for",
]


# -- how fast this CPU runs 16-bit GEMMs ------------------------------------------------------------------------------
# Without native BF16 instructions (AVX512-BF16, AMX) oneDNN emulates BF16 GEMMs with FP32 ones plus conversions: on a
# 2-core AMD EPYC with AVX2 only a BF16 F.linear (1024x256 by 704x256) took 62 ms against 12 ms in FP32, and a whole
# BF16-autocast training step about 16x longer. FP16 without AVX512-FP16 or AMX-FP16 is the same story.

#: Forces the answer to "does this CPU compute BF16 natively": ``native`` or ``emulated``. Unset: torch's CPU
#: queries answer on x86; elsewhere a short measured GEMM decides.
CPU_BF16_ENV = "HF_MIXEDPREC_CPU_BF16"
_CPU_BF16_CHOICES = ("native", "emulated")
#: A measured 16-bit GEMM this many times slower than the same GEMM in FP32 counts as emulated. Native BF16 GEMMs
#: run at least as fast as FP32 ones (half the bytes moved; AMX and AVX512-BF16 do twice the multiply-adds).
SLOW_GEMM_RATIO = 1.5
_X86 = ("x86_64", "amd64", "i386", "i686", "x86")


@dataclass(frozen=True)
class CpuGemmSpeed:
    """Whether this CPU runs ``dtype`` (``bf16`` or ``fp16``) GEMMs natively, how that was found, and the evidence."""

    dtype: str
    native: bool
    how: str
    """``torch`` (torch's CPU queries), ``measured`` (a timed GEMM) or ``env`` (:data:`CPU_BF16_ENV`)."""
    evidence: str
    """What answered, in words: the instructions found or missing, or the variable."""
    slowdown: float | None = None
    """Measured time of a ``dtype`` GEMM over the same GEMM in FP32 (None where nothing was timed)."""

    def describe(self) -> str:
        """One line: ``bf16 GEMM 5.1x slower than fp32 on this CPU (AVX2: no AVX512-BF16, no AMX)``."""
        if self.slowdown is None:
            return f"{self.dtype} {'native' if self.native else 'emulated'} on this CPU ({self.evidence})"
        if self.slowdown >= 1.0:
            speed = f"{self.slowdown:.1f}x slower than"
        else:
            speed = f"{1.0 / self.slowdown:.1f}x faster than"
        return f"{self.dtype} GEMM {speed} fp32 on this CPU ({self.evidence})"


def _linear_seconds(a: torch.Tensor, b: torch.Tensor) -> float:
    start = time.perf_counter()
    torch.nn.functional.linear(a, b)
    return time.perf_counter() - start


@functools.cache
def measure_gemm_slowdown(dtype: str = "bf16", budget_s: float = 0.03) -> float:
    """The time of a 256x256 by 256x256 ``F.linear`` in ``dtype`` over the same in FP32, on one thread: the best of
    each, timed in alternation for about ``budget_s`` (at least 4 rounds), so that a busy machine slows both alike.
    Tens of milliseconds, once per process."""
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    a32, b32 = torch.randn(256, 256), torch.randn(256, 256)
    a16, b16 = a32.to(low), b32.to(low)
    best32 = best16 = float("inf")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core's speed: threads waiting on a busy core would blur the ratio
    try:
        with torch.inference_mode():
            torch.nn.functional.linear(a32, b32)  # oneDNN makes its kernels on the first call
            torch.nn.functional.linear(a16, b16)
            start, rounds = time.perf_counter(), 0
            while rounds < 4 or (time.perf_counter() - start < budget_s and rounds < 100):
                best32 = min(best32, *(_linear_seconds(a32, b32) for _ in range(3)))
                best16 = min(best16, _linear_seconds(a16, b16))
                rounds += 1
    finally:
        torch.set_num_threads(threads)
    return best16 / max(best32, 1e-9)


def _isa_answer(dtype: str) -> tuple[bool | None, str]:
    """torch's answer for ``dtype`` on this CPU, with the evidence; None where its queries cannot answer (not x86)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if platform.machine().lower() not in _X86:
        return None, f"{platform.machine() or 'this processor'}, cpu capability {capability}"
    isa = cpu_native_16bit()
    if dtype == "bf16":
        found = [name for key, name in (("avx512_bf16", "AVX512-BF16"), ("amx_tile", "AMX")) if isa[key]]
        return (
            (True, f"{capability} with {' and '.join(found)}")
            if found
            else (
                False,
                f"{capability}: no AVX512-BF16, no AMX",
            )
        )
    if isa["amx_fp16"] or mkldnn_fp16_supported():
        return True, f"{capability} with {'AMX-FP16' if isa['amx_fp16'] else 'AVX512-FP16'}"
    return False, f"{capability}: no AVX512-FP16, no AMX-FP16"


def decide_cpu_gemm(
    dtype: str,
    *,
    env: str | None,
    isa: tuple[bool | None, str],
    measure: Callable[[], float],
) -> CpuGemmSpeed:
    """Whether ``dtype`` GEMMs are native on this CPU: ``env`` (:data:`CPU_BF16_ENV`, bf16 only) when set, else torch's
    instruction-set answer ``isa`` where it has one, else the measured slowdown against :data:`SLOW_GEMM_RATIO`. Where
    the answer is "emulated" the slowdown is measured too, so that the user reads how much slower."""
    if env is not None:
        value = env.strip().lower()
        if value not in _CPU_BF16_CHOICES:
            raise EnvValueError(
                f"{CPU_BF16_ENV}={env[:40]!r} is not a CPU BF16 answer (allowed: {', '.join(_CPU_BF16_CHOICES)}; or "
                "unset, and torch's CPU queries or a measured GEMM decide)"
            )
        return CpuGemmSpeed(dtype, value == "native", "env", f"{CPU_BF16_ENV}={value}")
    answer, evidence = isa
    if answer is True:
        return CpuGemmSpeed(dtype, True, "torch", evidence)
    slowdown = measure()
    if answer is False:
        return CpuGemmSpeed(dtype, False, "torch", evidence, round(slowdown, 2))
    native = slowdown < SLOW_GEMM_RATIO
    return CpuGemmSpeed(dtype, native, "measured", f"{evidence}; measured", round(slowdown, 2))


@functools.cache
def _cpu_gemm_speed(dtype: str, env: str | None) -> CpuGemmSpeed:
    return decide_cpu_gemm(dtype, env=env, isa=_isa_answer(dtype), measure=lambda: measure_gemm_slowdown(dtype))


def cpu_gemm_speed(dtype: str = "bf16") -> CpuGemmSpeed:
    """How this CPU runs ``dtype`` (``bf16`` or ``fp16``) GEMMs (:func:`decide_cpu_gemm`), found once per process and
    value of :data:`CPU_BF16_ENV` (which answers for bf16 only)."""
    if dtype not in ("bf16", "fp16"):
        raise ValueError(f"dtype {dtype!r} (allowed: bf16, fp16)")
    return _cpu_gemm_speed(dtype, os.environ.get(CPU_BF16_ENV) if dtype == "bf16" else None)


def _compute_dtypes(recipe: RecipeSpec) -> list[str]:
    """The 16-bit formats ``recipe`` (every phase) computes its GEMMs in, as its autocast does
    (:data:`~hf_mixedprec.core.formats.COMPUTE_FORMATS`: bf16 for bf16 and for fp8, whose other layers run inside BF16
    autocast; fp16 for fp16)."""
    names = (COMPUTE_FORMATS[s.precision].name for s in recipe.phase_specs() if s.precision in COMPUTE_FORMATS)
    return list(dict.fromkeys(names))


def cpu_speed_note(recipe: RecipeSpec, *, speed: Callable[[str], CpuGemmSpeed] | None = None) -> str | None:
    """On a CPU: the one line saying that ``recipe`` computes in a 16-bit format this CPU emulates and how much slower
    its GEMMs are for it, or None where every format it computes in is native (``speed``: :func:`cpu_gemm_speed`)."""
    speed = speed or cpu_gemm_speed
    slow = [s for s in map(speed, _compute_dtypes(recipe)) if not s.native]
    if not slow:
        return None
    fast = "cpu-bf16" if speed("bf16").native else "cpu-fp32"
    return (
        f"SLOW ON THIS CPU: recipe {recipe.name!r} computes in {' and '.join(s.dtype.upper() for s in slow)} without "
        f"native instructions here: {'; '.join(s.describe() for s in slow)}. On such a CPU a 16-bit recipe shows its "
        f"numerics, not its speed; {fast} (what auto picks here) trains at this CPU's full speed"
    )


@dataclass(frozen=True)
class HardwareInfo:
    """What the decision needs to know about a machine."""

    device_type: str  # "cpu", "cuda" or "mps"
    capability: tuple[int, int] | None = None
    device_name: str = ""
    cuda_version: str | None = None
    torch_version: str = ""
    te_version: str | None = None
    torchao_version: str | None = None
    device_count: int = 0
    cpu_capability: str | None = None
    """torch's ``torch.backends.cpu.get_cpu_capability()`` (``AVX2``, ``AVX512``, ...)."""
    cpu_bf16: CpuGemmSpeed | None = None
    """On a CPU-only machine: whether it runs BF16 GEMMs natively (what ``auto`` decides by); None where not asked."""

    @property
    def generation(self) -> str:
        return generation_of(self.device_type, self.capability)

    def describe(self) -> str:
        if self.device_type == "cuda" and self.capability:
            cc = f"{self.capability[0]}.{self.capability[1]}"
            name = self.device_name or "CUDA GPU"
            return f"{name} ({self.generation}, compute capability {cc}, CUDA {self.cuda_version or 'unknown'})"
        if self.device_type == "mps":
            return "Apple GPU (mps)"
        return "cpu (no CUDA GPU)"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["capability"] = f"{self.capability[0]}.{self.capability[1]}" if self.capability else None
        d["generation"] = self.generation
        return d


@dataclass(frozen=True)
class Support:
    """What a machine can do natively."""

    precisions: tuple[str, ...]
    fp8_scalings: tuple[str, ...] = ()
    tf32: bool = False
    lacks: dict[str, str] = field(default_factory=dict)
    """For each unsupported precision or FP8 scaling, the reason (what the hardware lacks)."""


def _version_tuple(v: str | None) -> tuple[int, ...]:
    if not v:
        return ()
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def generation_of(device_type: str, capability: tuple[int, int] | None) -> str:
    """Map a device type and CUDA compute capability to a GPU generation name."""
    if device_type == "cpu":
        return "cpu"
    if device_type == "mps":
        return "mps"
    if device_type != "cuda" or capability is None:
        raise ValueError(f"unknown device type {device_type!r} (allowed: cpu, cuda, mps)")
    major, minor = capability
    if major < 7:
        return "pre-volta"
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ada" if minor >= 9 else "ampere"
    if major == 9:
        return "hopper"
    return "blackwell"  # 10.x datacenter, 12.x consumer


#: The first Transformer Engine release whose recipes include ``NVFP4BlockScaling`` used here.
NVFP4_TE = (2, 9)
#: What an NVFP4 recipe needs, in the words of every refusal (TE's ``check_nvfp4_support``).
NVFP4_NEEDS = "NVFP4 (FP4 tensor cores: needs compute capability >= 10.0, Blackwell such as B200)"


def support_for(
    device_type: str, capability: tuple[int, int] | None = None, cuda_version: str | None = None
) -> Support:
    """What precisions and FP8 scalings this (device, capability, CUDA version) supports natively."""
    gen = generation_of(device_type, capability)
    lacks: dict[str, str] = {}
    fp8_all = ("delayed", "current", "mxfp8", "blockwise", "nvfp4")
    if gen in ("cpu", "mps"):
        precisions: tuple[str, ...] = ("fp32", "bf16") if gen == "cpu" else ("fp32", "fp16", "bf16")
        if gen == "cpu":
            lacks["fp16"] = "FP16 mixed precision with loss scaling (Accelerate's fp16 does nothing on CPU)"
        lacks["fp8"] = "FP8 tensor cores (needs a CUDA GPU with compute capability >= 8.9)"
        return Support(precisions, (), False, lacks)
    assert capability is not None
    cc = capability
    cuda = _version_tuple(cuda_version)
    if gen == "pre-volta":
        lacks.update(fp16="FP16 tensor cores (needs compute capability >= 7.0)", bf16="BF16", fp8="FP8")
        return Support(("fp32",), (), False, lacks)
    precisions = ("fp32", "fp16")
    if cc >= (8, 0):
        precisions += ("bf16",)
    else:
        lacks["bf16"] = "BF16 (needs compute capability >= 8.0, Ampere)"
    tf32 = cc >= (8, 0)
    scalings: list[str] = []
    if cc < (8, 9):
        lacks["fp8"] = "FP8 tensor cores (needs compute capability >= 8.9, Ada/Hopper/Blackwell)"
    elif cc == (8, 9) and cuda and cuda < (12, 1):
        lacks["fp8"] = f"FP8 support in CUDA {cuda_version} (Ada needs CUDA >= 12.1)"
    else:
        scalings += ["delayed", "current"]
        if cc >= (9, 0) and (not cuda or cuda >= (12, 9)):
            scalings.append("blockwise")
        elif cc < (9, 0):
            lacks["blockwise"] = "blockwise FP8 (needs compute capability >= 9.0, Hopper)"
        else:
            lacks["blockwise"] = f"blockwise FP8 in CUDA {cuda_version} (needs CUDA >= 12.9)"
        if cc[0] == 10:
            scalings.append("mxfp8")
        else:
            lacks["mxfp8"] = "MXFP8 block scaling (needs compute capability 10.x, datacenter Blackwell such as B200)"
        if cc >= (10, 0):  # TE's check_nvfp4_support (transformer_engine/pytorch/quantization.py): 10.0 and above
            scalings.append("nvfp4")
        else:
            lacks["nvfp4"] = NVFP4_NEEDS
    if scalings:
        precisions += ("fp8",)
    for s in fp8_all:
        if s not in scalings and s not in lacks and "fp8" in lacks:
            lacks[s] = lacks["fp8"]
    return Support(precisions, tuple(scalings), tf32, lacks)


def auto_recipe_name(
    device_type: str,
    capability: tuple[int, int] | None = None,
    cuda_version: str | None = None,
    *,
    te_available: bool = False,
    torchao_available: bool = False,
    native_available: bool = False,
    cpu_bf16: CpuGemmSpeed | None = None,
) -> tuple[str, list[str]]:
    """The built-in recipe ``auto`` picks, and notes on why (every fallback is named in the notes).

    ``native_available``: torch has its FP8 GEMM (``torch._scaled_mm``), so hf_mixedprec's native FP8 layers run
    delayed and current scaling without Transformer Engine or torchao. ``cpu_bf16``: on a CPU, whether it computes
    BF16 natively (:func:`cpu_gemm_speed`); where it does not, ``cpu-fp32``. None: not asked, ``cpu-bf16``."""
    gen = generation_of(device_type, capability)
    sup = support_for(device_type, capability, cuda_version)
    notes: list[str] = []
    if gen == "cpu" and cpu_bf16 is not None and not cpu_bf16.native:
        notes.append(
            f"cpu-fp32, not cpu-bf16: this CPU has no native BF16: {cpu_bf16.describe()}. FP32 trains faster here; "
            "ask for --recipe cpu-bf16 to rehearse BF16 numerics anyway"
        )
        return "cpu-fp32", notes
    if gen in ("cpu", "mps"):
        return "cpu-bf16", notes
    if gen == "pre-volta":
        raise HardwareRefusal(
            f"compute capability {capability} is older than Volta: no recipe ships for it (fp32 only); "
            "write a recipe with precision: fp32"
        )
    if gen == "volta":
        return "v100-fp16", notes
    if gen == "turing":
        return "t4-fp16", notes
    if "fp8" not in sup.precisions:
        if gen == "ada":
            notes.append(f"FALLBACK: FP8 not used: this machine lacks {sup.lacks['fp8']}; using BF16 (a100-bf16)")
        return "a100-bf16", notes
    # FP8-capable. Follow TE's default choice of scaling, but only where a backend can run it.
    if gen == "blackwell" and capability is not None and capability[0] == 10:
        preferred = "b200-mxfp8"
    elif gen == "hopper":
        preferred = "h100-fp8-delayed"
    else:  # ada, and 12.x consumer Blackwell: current scaling
        preferred = "ada-fp8-current"
    if te_available:
        return preferred, notes
    if torchao_available:
        name = "ada-fp8-current" if gen in ("ada", "blackwell") else "h100-fp8-current"
        if name != preferred:
            why = (
                "runs without it only on fp8.backend native, which measured slower than torchao's current scaling"
                if preferred == "h100-fp8-delayed" and native_available
                else "cannot run"
            )
            notes.append(
                f"FALLBACK: Transformer Engine is not installed, so {preferred} {why}; using {name} with "
                "the torchao backend (pip install 'hf_mixedprec[transformer-engine]' for the TE recipes)"
            )
        return name, notes
    if native_available:
        name = preferred if preferred in ("h100-fp8-delayed", "ada-fp8-current") else "h100-fp8-delayed"
        if name != preferred:
            notes.append(
                f"FALLBACK: Transformer Engine is not installed, so {preferred} cannot run; using {name} on "
                "hf_mixedprec's native FP8 backend (torch._scaled_mm)"
            )
        return name, notes
    notes.append(
        "FALLBACK: neither Transformer Engine nor torchao is installed, so FP8 cannot run; using BF16 (a100-bf16). "
        "pip install 'hf_mixedprec[transformer-engine]' or 'hf_mixedprec[torchao]' to train in FP8"
    )
    return "a100-bf16", notes


#: The FP8 scalings hf_mixedprec's native backend runs (per-tensor scales on torch._scaled_mm's tensorwise GEMM).
NATIVE_FP8_SCALINGS = ("delayed", "current")


def fp8_backend_for(
    choice: str, scaling: str, *, device_type: str, te: bool, torchao: bool, native: tuple[bool, str]
) -> tuple[str | None, str]:
    """The FP8 backend that ``fp8.backend: choice`` (``auto`` or a backend's name) runs ``scaling`` with on a
    ``device_type`` machine with (or without) Transformer Engine and torchao installed, ``native``: whether torch's
    FP8 GEMM runs there and why not; and a note (the choice made, or, with None, why nothing runs).

    ``auto``: Transformer Engine on CUDA where installed; else torchao for current scaling (measured faster than the
    native layers on an H100); else the native layers for delayed and current scaling. A named backend is taken as
    named where it can run. One rule for the conversion (``fp8.resolve_backend``) and :func:`check_recipe` (before any
    work), so a recipe refused at the start is exactly one that would fail at conversion."""
    cuda = device_type == "cuda"
    runs, why = native
    if choice == "auto":
        if cuda and te:
            return "transformer_engine", "fp8.backend auto -> transformer_engine"
        if cuda and scaling == "current" and torchao:
            return "torchao", "fp8.backend auto -> torchao tensorwise (Transformer Engine is not installed)"
        if cuda and runs and scaling in NATIVE_FP8_SCALINGS:
            return "native", (
                f"fp8.backend auto -> native ({scaling} scaling with hf_mixedprec's quantizers on torch._scaled_mm; "
                "Transformer Engine is not installed)"
            )
        where = "this CUDA GPU" if cuda else f"device {device_type!r}"
        return None, (
            f"fp8.backend: 'auto' finds no backend that runs scaling {scaling!r} on {where} (Transformer Engine: "
            f"{'installed' if te else 'not installed'}; torchao: {'installed' if torchao else 'not installed'}, "
            f"current scaling only; native: {'delayed and current scaling only' if runs else why}); "
            "install 'hf_mixedprec[transformer-engine]' on a GPU with compute capability >= 8.9, or set "
            "fp8.backend: emulated to run the exact numerics anywhere (slowly)"
        )
    if choice == "transformer_engine" and not (cuda and te):
        lack = "is not installed" if not te else "runs on CUDA GPUs only"
        return None, f"fp8.backend: 'transformer_engine' {lack} (install 'hf_mixedprec[transformer-engine]')"
    if choice == "torchao" and not torchao:
        return None, "fp8.backend: 'torchao' is not installed (install 'hf_mixedprec[torchao]')"
    if choice == "native" and not runs:
        return None, f"fp8.backend: 'native' cannot run here: {why}"
    return choice, ""


def torch_has_fp8_gemm() -> bool:
    """Whether this torch has its FP8 GEMM (``torch._scaled_mm``), which the native FP8 backend runs on."""
    return has_scaled_mm()


def check_recipe(recipe: RecipeSpec, info: HardwareInfo) -> None:
    """Refuse, with one clear message, a recipe that this hardware cannot run natively (every phase of a phased
    recipe)."""
    if recipe.phases is not None:
        for spec in dict.fromkeys(recipe.phase_specs()):
            check_recipe(spec, info)
        return
    sup = support_for(info.device_type, info.capability, info.cuda_version)
    missing: str | None = None
    if recipe.precision not in sup.precisions:
        missing = sup.lacks.get(recipe.precision, recipe.precision)
        if recipe.precision == "fp8" and recipe.fp8 is not None and recipe.fp8.scaling == "nvfp4":
            missing = NVFP4_NEEDS  # not "FP8 tensor cores (>= 8.9)": an H100 has those and still cannot run it
    elif recipe.precision == "fp8" and recipe.fp8 is not None and recipe.fp8.scaling not in sup.fp8_scalings:
        missing = sup.lacks.get(recipe.fp8.scaling, f"FP8 {recipe.fp8.scaling} scaling")
    elif recipe.tf32 and not sup.tf32 and info.device_type == "cuda":
        missing = "TF32 (needs compute capability >= 8.0)"
    no_backend = _no_fp8_backend(recipe, info) if missing is None else None
    if missing is None and no_backend is None:
        return
    try:
        instead, _ = auto_recipe_name(
            info.device_type,
            info.capability,
            info.cuda_version,
            te_available=info.te_version is not None,
            torchao_available=info.torchao_version is not None,
            native_available=torch_has_fp8_gemm(),
            cpu_bf16=info.cpu_bf16,
        )
    except HardwareRefusal:
        instead = "a recipe with precision: fp32"
    rehearse = (
        "; or rehearse it on this machine (--rehearse, load_recipe(..., rehearse=True) or HF_MIXEDPREC_REHEARSE=1)"
    )
    if recipe.precision == "fp8":
        rehearse += f", and see its FP8 numerics per layer with `hf-mixedprec simulate --recipe {recipe.name}`"
    if no_backend is not None:
        raise HardwareRefusal(
            f"recipe {recipe.name!r} has no FP8 backend on {info.describe()}: {no_backend}; or use {instead!r} "
            f"instead{rehearse}"
        )
    raise HardwareRefusal(
        f"recipe {recipe.name!r} needs {missing}, which {info.describe()} lacks; use {instead!r} instead{rehearse}"
    )


def _no_fp8_backend(recipe: RecipeSpec, info: HardwareInfo) -> str | None:
    """Why no FP8 backend runs ``recipe`` on ``info``'s machine; None when one does. Called once the hardware is
    known to have FP8 (compute capability >= 8.9), so the native layers need only torch's FP8 GEMM."""
    if recipe.precision != "fp8" or recipe.fp8 is None:
        return None
    backend, why = fp8_backend_for(
        recipe.fp8.backend,
        recipe.fp8.scaling,
        device_type=info.device_type,
        te=info.te_version is not None,
        torchao=info.torchao_version is not None,
        native=(torch_has_fp8_gemm(), f"torch {torch.__version__} has no torch._scaled_mm"),
    )
    if backend == "transformer_engine" and recipe.fp8.scaling == "nvfp4":
        have = _version_tuple(info.te_version)
        if have and have < NVFP4_TE:
            return (
                f"Transformer Engine {info.te_version} has no NVFP4BlockScaling (it needs >= "
                f"{'.'.join(map(str, NVFP4_TE))}: pip install -U transformer-engine)"
            )
    return why if backend is None else None


def detect() -> HardwareInfo:
    """Look at this machine: device 0 of CUDA if present, else MPS, else CPU; plus library versions."""
    te = available("transformer_engine")
    ao = available("torchao")
    te_version = (_dist_version("transformer-engine") or _dist_version("transformer_engine")) if te else None
    ao_version = (_dist_version("torchao") or "unknown") if ao else None
    te_version = te_version or ("unknown" if te else None)
    common = {"torch_version": torch.__version__, "te_version": te_version, "torchao_version": ao_version}
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability(0)
        return HardwareInfo(
            "cuda",
            (int(cap[0]), int(cap[1])),
            torch.cuda.get_device_name(0),
            torch.version.cuda,
            device_count=torch.cuda.device_count(),
            **common,
        )
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return HardwareInfo("mps", None, "Apple GPU", None, device_count=1, **common)
    return HardwareInfo(
        "cpu",
        None,
        "cpu",
        None,
        device_count=0,
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        cpu_bf16=cpu_gemm_speed("bf16"),
        **common,
    )


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
