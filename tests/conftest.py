"""Shared fixtures: tiny models built from configs (no hub downloads) and skip rules for GPU / TE tests."""

from __future__ import annotations

import collections
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
    # and their OpenMP threads sleep instead of spinning while they wait: 2-rank processes beside the other worker's
    # spun away the cores the ranks they waited for needed (ZeRO-3's launch test: 70 s beside the FSDP2 ranks' test,
    # 21 s with PASSIVE; those ranks' 44 s became 32 s)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps process-wide state; a test using this starts and ends with a clean one."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


#: The files that take longest on the 2-core CI machine (``--durations=0``, summed per file; most multi-process),
#: heaviest first. scripts/test.sh runs the suite with ``--dist loadfile --no-loadscope-reorder``, so the two workers
#: take files in this order: started first, these no longer end the run with one worker idle (xdist's own order, most
#: tests first, put them last). A stale list costs balance, never a test.
LONGEST_FIRST = (
    "integrations/test_fsdp2.py",
    "fp8/test_experts_architectures.py",
    "integrations/test_launch_cpu.py",
    "integrations/test_launch_signals.py",
    "integrations/test_fsdp2_ranks.py",
    "fp8/test_compile.py",
    "test_bench.py",
    "commands/test_estimate.py",
    "core/test_checkpoints.py",
    "storage/test_storage.py",
    "storage/test_storage_resume.py",
    "commands/test_finetune.py",
    "fp8/test_experts_fp8.py",
    "integrations/test_parity.py",
    "integrations/test_integration.py",
    "commands/test_estimate_storage.py",
    "training/test_faults.py",
    "integrations/test_deepspeed_fp8.py",
    "integrations/test_clients.py",
)


def _file_order(items: list[pytest.Item]) -> None:
    """Order ``items`` file by file: :data:`LONGEST_FIRST`, then the other files, most tests first (xdist's order);
    the tests of a file keep their order (its module fixtures run once)."""
    here = os.path.dirname(__file__)
    files = {id(item): os.path.relpath(str(item.path), here) for item in items}
    count = collections.Counter(files.values())
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    order = sorted(count, key=lambda f: (rank.get(f, len(rank)), -count[f], f))
    position = {f: i for i, f in enumerate(order)}
    items.sort(key=lambda item: position[files[id(item)]])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _file_order(items)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_te = pytest.mark.skip(reason="needs Transformer Engine (pip install 'hf_mixedprec[transformer-engine]')")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "te" in item.keywords and not HAS_TE:
            item.add_marker(skip_te)
