"""Shared fixtures: tiny models built from configs (no hub downloads) and skip rules for GPU / TE tests."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("HF_MIXEDPREC_RECIPE", None)

HAS_TE = importlib.util.find_spec("transformer_engine") is not None

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # several workers share the cores: one torch thread each, not oversubscribed
    # and so do the processes a test starts (a finetune subprocess with 2 threads beside the other worker trained
    # 25x slower here): torch reads OMP_NUM_THREADS at start-up; a test that sets it itself keeps its own
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps process-wide state; a test using this starts and ends with a clean one."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_te = pytest.mark.skip(reason="needs Transformer Engine (pip install 'hf_mixedprec[transformer-engine]')")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "te" in item.keywords and not HAS_TE:
            item.add_marker(skip_te)
