"""What the native FP8 backend allocates and keeps: no FP32 copy of an activation in a compiled step (read from
inductor's generated code on this CPU), and FP8, not BF16, saved for the backward pass."""

from __future__ import annotations

import re

import pytest
import torch

from hf_mixedprec.fp8.emulated import EmulationSpec
from hf_mixedprec.fp8.native import NativeFP8Linear

M, K, N = 320, 96, 80  # tokens, in_features, out_features: three distinct sizes, so a buffer's shape says what it is


def _fp32_buffers(code: str) -> set[tuple[int, ...]]:
    found = re.findall(r"empty_strided_cpu\(\(([\d, ]+)\), \([\d, ]*\), torch\.float32\)", code)
    return {tuple(int(d) for d in dims.split(",") if d.strip()) for dims in found}


def _kernels_reading(code: str, buffer: str) -> int:
    """How many generated kernels of ``code`` take ``buffer`` as an argument."""
    calls = re.findall(r"\n\s+(cpp_fused_\w+)\(([^)]*)\)", code)
    return sum(buffer in [a.strip() for a in args.split(",")] for _, args in calls)


def _compiled_step_code(scaling: str, device: str, m: int, k: int, n: int) -> tuple[str, str, torch.Tensor]:
    """Inductor's generated code (forward, backward) for one step of a compiled native FP8 Linear [k -> n] on a BF16
    input [m, k] under BF16 autocast on ``device``, and the layer's output. Only the layer is compiled and the
    backward is fed a BF16 output gradient from outside, so the backward graph's [m, n] input is that gradient
    itself (not a sum inductor would make of a loss's tangents first)."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    layer = NativeFP8Linear(torch.nn.Linear(k, n, bias=False), EmulationSpec(scaling=scaling)).to(device).train()
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device, requires_grad=True)
    gy = torch.randn(m, n, dtype=torch.bfloat16, device=device)

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device, dtype=torch.bfloat16):
            return layer(x)

    compiled = torch.compile(forward)

    def step() -> torch.Tensor:
        y = compiled(x)
        y.backward(gy)
        return y

    torch._dynamo.reset()
    y, (forward_code, backward_code) = run_and_get_code(step)
    assert x.grad is not None and layer.weight.grad is not None
    return forward_code, backward_code, y


def _buffer_of_shape(code: str, shape: tuple[int, int]) -> str:
    """The name of the graph input of ``shape`` (the step's input, or the output gradient in the backward)."""
    (name,) = re.findall(rf"assert_size_stride\((\w+), \({shape[0]}, {shape[1]}\)", code)
    return name


@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_a_compiled_native_layer_keeps_no_fp32_copy_of_its_activations(scaling):
    """A BF16 input through a compiled native FP8 Linear, forward and backward: inductor allocates no FP32 buffer of
    the input's [tokens, in] shape, nor of the output's or output gradient's [tokens, out] (the GEMM writes BF16
    itself; the GEMM's FP32 output was one before).

    How often the input is read is not checked here: a generated CPU kernel is a C++ function that may hold several
    loops, and inductor's CPU code generation never reorders a node's loops to fuse it with another
    (``torch/_inductor/scheduler.py``, ``shared_data_after_reordering_loop``: "Don't do loop reordering/reindexing for
    CPU for now"), so the FP8 copy the weight-gradient GEMM wants transposed is a pass of its own on a CPU, besides
    the amax and the cast. On a GPU it may share the cast's pass: the GPU test below counts that."""
    forward, backward, y = _compiled_step_code(scaling, "cpu", M, K, N)
    assert y.dtype == torch.bfloat16
    for code in (forward, backward):
        assert not _fp32_buffers(code) & {(M, K), (M, N), (K, M), (N, M)}, _fp32_buffers(code)
    assert 1 <= _kernels_reading(forward, _buffer_of_shape(forward, (M, K))) <= 2
    assert "extern_kernels._scaled_mm" in forward and "extern_kernels._scaled_mm" in backward


def _triton_kernels_reading(code: str, buffer: str) -> list[str]:
    """The generated Triton kernels of ``code`` launched with ``buffer`` among their arguments."""
    calls = re.findall(r"\b(triton_\w+)\.run\(([^)]*)\)", code)
    return [name for name, args in calls if buffer in [a.strip() for a in args.split(",")]]


@pytest.mark.gpu
@pytest.mark.parametrize(("scaling", "reads"), [("delayed", 1), ("current", 2)])
def test_on_a_gpu_each_fp8_operand_is_read_once_per_pass_its_scaling_needs(scaling, reads):
    """The fused-cast goal of issue 49 on a GPU (compute capability >= 8.9), where inductor reorders loops to fuse: in a
    compiled native step the BF16 input is read by one generated kernel under delayed scaling (its amax, and its FP8
    copies in the forward GEMM's layout and in the transposed one the weight-gradient GEMM takes, since the scale
    was made at the last step) and by two under current scaling (the amax first, then the casts); the same for the
    output gradient in the backward."""
    from hf_mixedprec.fp8.native import native_available

    ok, why = native_available(torch.device("cuda"))
    if not ok:
        pytest.skip(why)
    m, k, n = 2048, 1024, 1536
    forward, backward, _ = _compiled_step_code(scaling, "cuda", m, k, n)
    x_reads = _triton_kernels_reading(forward, _buffer_of_shape(forward, (m, k)))
    g_reads = _triton_kernels_reading(backward, _buffer_of_shape(backward, (m, n)))
    assert len(x_reads) == reads, x_reads
    assert len(g_reads) == reads, g_reads


def _saved_bytes(model: torch.nn.Module, batch: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for the backward pass of one forward, parameters not counted."""
    params = {p.data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=batch, labels=batch).loss.backward()
    return sum(seen.values())


def test_native_fp8_saves_less_for_backward_than_bf16():
    """The same tiny Llama and batch under BF16 autocast, then with its Linears in native FP8: the layers save their
    FP8 input and weight (1 byte an element) where BF16 saves the BF16 input and the weight's BF16 copy (2), so the
    model saves less in all, and each Linear about half."""
    from hf_mixedprec.core.demo import tiny_llama
    from hf_mixedprec.fp8 import convert
    from hf_mixedprec.integrations.recipe import resolve_recipe

    batch = torch.randint(0, 256, (4, 64))
    model = tiny_llama()
    bf16 = _saved_bytes(model, batch)
    recipe = resolve_recipe({"name": "native", "extends": "h100-fp8-delayed", "fp8": {"backend": "native"}})
    convert(model, recipe, backend="native")
    fp8 = _saved_bytes(model, batch)
    assert fp8 < bf16, (fp8, bf16)

    torch.manual_seed(0)
    linear = torch.nn.Linear(K, N, bias=False)
    x = torch.randn(M, K, requires_grad=True)

    def one(layer: torch.nn.Module) -> int:
        seen: list[int] = []
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.nbytes) or t, lambda t: t)
        with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x).float().sum().backward()
        return sum(seen)

    plain = one(linear)
    native = one(NativeFP8Linear(linear, EmulationSpec(scaling="delayed")))
    assert plain == 2 * (M * K + N * K)
    assert native == M * K + N * K + 2 * 4  # the FP8 input and weight, and their two FP32 dequantization scales


def test_an_eager_native_step_makes_one_fp32_temporary_of_the_input():
    """Eager mode, BF16 input: the only FP32 tensor of the input's shape is the quantizer's one temporary (upcast,
    scaled and clamped in place); before, the input was upcast for the whole forward and the quantizer made three."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    layer = NativeFP8Linear(torch.nn.Linear(K, N, bias=False), EmulationSpec(scaling="delayed")).train()
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)

    shapes: list[tuple[str, tuple[int, ...]]] = []

    class Fp32Outputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                fresh = not func.is_view and not any(t is a for a in args)  # an in-place op returns its input
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 2 and fresh:
                    shapes.append((str(func), tuple(t.shape)))
            return out

    with Fp32Outputs(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    forward = [name for name, shape in shapes if shape in ((M, K), (M, N))]
    assert y.dtype == torch.bfloat16
    assert forward == ["aten._to_copy.default"], shapes
