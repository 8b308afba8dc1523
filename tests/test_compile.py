"""No graph breaks from hf_mixedprec under torch.compile on a step that does not sample FP8 statistics: the model as
the runtime prepares it (storage plan, FP8 layers, autocast wrapper, the plugin's step hook) traces in one graph
wherever the plain model does."""

from __future__ import annotations

import pytest
import torch

import hf_mixedprec
from hf_mixedprec.demo import tiny_llama
from hf_mixedprec.fp8 import fp8_layers
from hf_mixedprec.runtime import MixedPrecisionRuntime

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def _breaks(model) -> tuple[int, list[str]]:
    torch._dynamo.reset()
    x = torch.randint(0, 256, (2, 32))
    out = torch._dynamo.explain(model)(input_ids=x, labels=x)
    return out.graph_break_count, [r.reason.splitlines()[0] for r in out.break_reasons]


@pytest.mark.parametrize("name", ["cpu-bf16", "h100-fp8-delayed", "h100-fp8-current"])
def test_the_runtime_prepared_model_compiles_without_graph_breaks(name):
    plain, _ = _breaks(tiny_llama())
    assert plain == 0
    rt = MixedPrecisionRuntime(hf_mixedprec.load_recipe(name, rehearse=True))
    model = tiny_llama()
    rt.prepare_storage(model)
    report = rt.convert_model(model, torch.optim.AdamW(model.parameters()))
    assert name == "cpu-bf16" or len(report.converted) == 14  # emulated FP8 layers are in the graph
    rt.wrap_forward_with_autocast(model)
    rt.begin_step(model)
    assert _breaks(model) == (0, [])


def test_the_accelerate_plugin_prepared_model_compiles_without_graph_breaks():
    from hf_mixedprec.integrations.accelerate_plugin import make_accelerator

    acc = make_accelerator(hf_mixedprec.load_recipe("h100-fp8-delayed", rehearse=True), cpu=True)
    model = tiny_llama()
    model, _ = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    assert len(fp8_layers(model)) == 14  # the emulated FP8 layers are in what is traced
    assert _breaks(model) == (0, [])
