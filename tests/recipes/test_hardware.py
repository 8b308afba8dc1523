"""Hardware decisions for every generation, driven through the pure functions (no GPU needed)."""

from __future__ import annotations

import pytest

from hf_mixedprec.integrations.recipe import builtin_recipe_names, load_recipe_file
from hf_mixedprec.recipes.hardware import (
    HardwareInfo,
    HardwareRefusal,
    auto_recipe_name,
    check_recipe,
    detect,
    generation_of,
    support_for,
)

GPUS = {
    "V100": ((7, 0), "12.4", "volta"),
    "T4": ((7, 5), "12.4", "turing"),
    "A100": ((8, 0), "12.4", "ampere"),
    "A10": ((8, 6), "12.4", "ampere"),
    "L4": ((8, 9), "12.4", "ada"),
    "H100": ((9, 0), "12.9", "hopper"),
    "B200": ((10, 0), "12.9", "blackwell"),
    "RTX5090": ((12, 0), "12.9", "blackwell"),
}


def info(gpu: str, **kw) -> HardwareInfo:
    cap, cuda, _ = GPUS[gpu]
    return HardwareInfo("cuda", cap, gpu, kw.pop("cuda", cuda), **kw)


CPU = HardwareInfo("cpu")


@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_generation_of(gpu):
    cap, _, gen = GPUS[gpu]
    assert generation_of("cuda", cap) == gen
    assert generation_of("cpu", None) == "cpu" and generation_of("mps", None) == "mps"


def test_support_matrix():
    assert support_for("cpu").precisions == ("fp32", "bf16")
    assert support_for("cuda", (7, 0), "12.4").precisions == ("fp32", "fp16")
    a100 = support_for("cuda", (8, 0), "12.4")
    assert a100.precisions == ("fp32", "fp16", "bf16") and a100.tf32 and a100.fp8_scalings == ()
    assert support_for("cuda", (8, 9), "12.4").fp8_scalings == ("delayed", "current")
    assert support_for("cuda", (8, 9), "12.0").fp8_scalings == ()  # Ada needs CUDA >= 12.1
    assert support_for("cuda", (9, 0), "12.9").fp8_scalings == ("delayed", "current", "blockwise")
    assert support_for("cuda", (9, 0), "12.4").fp8_scalings == ("delayed", "current")  # blockwise needs 12.9
    assert support_for("cuda", (10, 0), "12.9").fp8_scalings == ("delayed", "current", "blockwise", "mxfp8", "nvfp4")
    assert "mxfp8" not in support_for("cuda", (12, 0), "12.9").fp8_scalings


FP8 = ["ada-fp8-current", "h100-fp8-delayed", "h100-fp8-current", "h100-fp8-blockwise", "b200-mxfp8"]


@pytest.mark.parametrize("hw", ["cpu", "V100", "A100"])
@pytest.mark.parametrize("name", FP8)
def test_fp8_refused_without_fp8_hardware(hw, name):
    hwinfo = CPU if hw == "cpu" else info(hw)
    with pytest.raises(HardwareRefusal) as exc:
        check_recipe(load_recipe_file(name), hwinfo)
    msg = str(exc.value)
    assert f"recipe {name!r} needs FP8" in msg
    assert hwinfo.describe() in msg
    instead = {"cpu": "cpu-bf16", "V100": "v100-fp16", "A100": "a100-bf16"}[hw]
    assert f"use {instead!r} instead" in msg
    assert f"hf-mixedprec simulate --recipe {name}" in msg
    assert "rehearse it on this machine (--rehearse, load_recipe(..., rehearse=True) or HF_MIXEDPREC_REHEARSE=1)" in msg
    assert "\n" not in msg


def test_mxfp8_refused_on_hopper_and_blockwise_on_ada():
    with pytest.raises(HardwareRefusal, match=r"needs MXFP8 block scaling \(needs compute capability 10.x"):
        check_recipe(load_recipe_file("b200-mxfp8"), info("H100", te_version="2.8"))
    with pytest.raises(HardwareRefusal, match="use 'h100-fp8-delayed' instead"):
        check_recipe(load_recipe_file("b200-mxfp8"), info("H100", te_version="2.8"))
    with pytest.raises(HardwareRefusal, match=r"needs blockwise FP8 \(needs compute capability >= 9.0"):
        check_recipe(load_recipe_file("h100-fp8-blockwise"), info("L4", te_version="2.8"))
    with pytest.raises(HardwareRefusal, match="needs MXFP8"):
        check_recipe(load_recipe_file("b200-mxfp8"), info("RTX5090"))


def test_bf16_refused_on_volta_and_turing():
    for gpu in ("V100", "T4"):
        with pytest.raises(HardwareRefusal, match=r"needs BF16 \(needs compute capability >= 8.0"):
            check_recipe(load_recipe_file("a100-bf16"), info(gpu))
    with pytest.raises(HardwareRefusal, match="FP16 mixed precision with loss scaling"):
        check_recipe(load_recipe_file("v100-fp16"), CPU)


def test_supported_pairs_pass():
    ok = {
        "V100": ["v100-fp16", "t4-fp16"],
        "A100": ["a100-bf16", "v100-fp16"],
        "L4": ["ada-fp8-current", "h100-fp8-delayed", "a100-bf16"],
        "H100": ["h100-fp8-delayed", "h100-fp8-current", "h100-fp8-blockwise", "a100-bf16"],
        "B200": ["b200-mxfp8", "h100-fp8-delayed", "h100-fp8-blockwise"],
    }
    for gpu, names in ok.items():
        for name in names:
            check_recipe(load_recipe_file(name), info(gpu, te_version="2.8"))
    check_recipe(load_recipe_file("cpu-bf16"), CPU)


@pytest.mark.parametrize(
    "name, te, ao, runs",
    [
        ("h100-fp8-delayed", False, False, "native"),
        ("h100-fp8-current", False, True, "torchao"),
        ("h100-fp8-current", False, False, "native"),
        ("h100-fp8-anneal-bf16", False, False, "native"),  # every phase
        ("h100-fp8-blockwise", True, False, "transformer_engine"),
        ("h100-fp8-blockwise", False, True, None),  # only TE runs blockwise
        ("b200-mxfp8", False, True, None),  # only TE runs MXFP8
    ],
)
def test_an_fp8_recipe_without_a_backend_here_is_refused_before_any_work(name, te, ao, runs):
    """FP8 hardware without Transformer Engine: what fp8.backend auto would fail on inside Trainer's construction is
    refused by the hardware check, in one line that names the backends and what to use instead."""
    from hf_mixedprec.recipes.hardware import fp8_backend_for

    gpu = info("B200" if name == "b200-mxfp8" else "H100", te_version="2.8" if te else None,
               torchao_version="0.18" if ao else None)  # fmt: skip
    recipe = load_recipe_file(name)
    spec = recipe.phase_specs()[0] if recipe.phases is not None else recipe
    got, _ = fp8_backend_for("auto", spec.fp8.scaling, device_type="cuda", te=te, torchao=ao, native=(True, ""))
    assert got == runs
    if runs is not None:
        check_recipe(recipe, gpu)
        return
    with pytest.raises(HardwareRefusal) as exc:
        check_recipe(recipe, gpu)
    msg = str(exc.value)
    assert msg.startswith(f"recipe {name!r} has no FP8 backend on {gpu.describe()}: fp8.backend: 'auto' finds no")
    instead = "ada-fp8-current" if name == "b200-mxfp8" else "h100-fp8-current"  # what auto picks there
    assert "Transformer Engine: not installed" in msg and f"use {instead!r} instead" in msg
    assert "rehearse it on this machine" in msg and "\n" not in msg


def test_a_named_fp8_backend_that_is_not_installed_is_refused():
    base = load_recipe_file("h100-fp8-current")
    te = base.model_copy(update={"fp8": base.fp8.model_copy(update={"backend": "transformer_engine"})})
    with pytest.raises(HardwareRefusal, match=r"fp8.backend: 'transformer_engine' is not installed"):
        check_recipe(te, info("H100", torchao_version="0.18"))
    check_recipe(te, info("H100", te_version="2.8"))
    ao = base.model_copy(update={"fp8": base.fp8.model_copy(update={"backend": "torchao"})})
    with pytest.raises(HardwareRefusal, match=r"fp8.backend: 'torchao' is not installed"):
        check_recipe(ao, info("H100"))


@pytest.mark.parametrize(
    "gpu, te, ao, native, expected",
    [
        ("V100", False, False, True, "v100-fp16"),
        ("T4", False, False, True, "t4-fp16"),
        ("A100", True, True, True, "a100-bf16"),
        ("A100", False, False, True, "a100-bf16"),  # no FP8 tensor cores: torch's FP8 GEMM changes nothing
        ("L4", True, False, False, "ada-fp8-current"),
        ("L4", False, False, True, "ada-fp8-current"),  # native backend, TE's choice of scaling kept
        ("H100", True, False, False, "h100-fp8-delayed"),
        ("H100", False, True, True, "h100-fp8-current"),  # torchao: faster than native on an H100
        ("H100", False, False, True, "h100-fp8-delayed"),  # native backend: delayed, as TE would
        ("H100", False, False, False, "a100-bf16"),  # a torch without _scaled_mm
        ("B200", True, False, False, "b200-mxfp8"),
        ("B200", False, False, True, "h100-fp8-delayed"),  # MXFP8 needs TE; native runs delayed
        ("RTX5090", True, False, False, "ada-fp8-current"),
    ],
)
def test_auto_recipe(gpu, te, ao, native, expected):
    cap, cuda, _ = GPUS[gpu]
    name, notes = auto_recipe_name("cuda", cap, cuda, te_available=te, torchao_available=ao, native_available=native)
    assert name == expected
    assert name in builtin_recipe_names()
    # Every fallback is named in the notes; no fallback, no note.
    fell_back = gpu in ("H100", "B200", "L4", "RTX5090") and not te and not (native and not ao and gpu != "B200")
    assert bool(notes) == fell_back
    for n in notes:
        assert n.startswith("FALLBACK:")
    # whatever auto picks must pass the hardware check
    check_recipe(load_recipe_file(name), HardwareInfo("cuda", cap, gpu, cuda, te_version="2.8" if te else None))


def test_auto_on_cpu_and_detect_here():
    assert auto_recipe_name("cpu") == ("cpu-bf16", [])
    here = detect()
    assert here.device_type == "cpu" and here.generation == "cpu"
