"""DeepSpeed on a CPU-only host, for the test suite: a single-process rendezvous and an FP16-capable CPU accelerator."""

from __future__ import annotations

import socket
from typing import Any


def deepspeed_cpu_env(master_port: int | None = None) -> dict[str, str]:
    """Environment for a single-process DeepSpeed run on CPU (``os.environ.update`` it before building the Trainer).

    ``DS_ACCELERATOR=cpu`` makes DeepSpeed pick its CPU accelerator even where a GPU exists (its communication
    backend is then gloo, oneCCL being absent). The rendezvous variables are required: without ``RANK`` /
    ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` in the environment, ``deepspeed.init_distributed()``
    (called by TrainingArguments when ``deepspeed=`` is set) falls back to MPI discovery and fails with
    ``ModuleNotFoundError: No module named 'mpi4py'``. ``master_port=None`` picks a free local port.
    """
    if master_port is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            master_port = s.getsockname()[1]
    return {
        "DS_ACCELERATOR": "cpu",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }


def install_deepspeed_cpu_accelerator(*, fp16: bool = True, shm_comm: bool = False) -> Any:
    """Install (``deepspeed.accelerator.set_accelerator``) a DeepSpeed CPU accelerator fit for FP16 tests; return it.

    Call it before TrainingArguments / ``deepspeed.initialize`` (``deepspeed.init_distributed`` already asks the
    accelerator for its op builders). It is process-wide, so prefer a subprocess in test suites.

    Why it exists (DeepSpeed 0.19.8): ``DeepSpeedEngine._do_sanity_check`` raises
    ``ValueError("Type fp16 is not supported on your device.")`` when ``get_accelerator().is_fp16_supported()``
    is false, and ``CPU_Accelerator`` answers with ``torch.ops.mkldnn._is_mkldnn_fp16_supported()``, which is
    true only on CPUs with native FP16 arithmetic (AVX512-FP16 / AMX-FP16, e.g. Xeon Sapphire Rapids). CPUs
    with only AVX512-BF16 (AMD Zen 4, for one) are refused although PyTorch runs every FP16 op the model needs
    on them (more slowly, converting through FP32). ``fp16=True`` reports FP16 as supported (and so adds
    ``torch.float16`` to ``supported_dtypes()``); nothing else about the accelerator changes. This is for
    exercising the FP16 loss-scaling path on CPU, not for speed.

    ``shm_comm=False`` hides DeepSpeed's shared-memory all-reduce op (``ShareMemCommBuilder``): the
    ``TorchBackend`` constructor JIT-compiles it (about 50 s with a C++ toolchain, a failure without one) even
    for a single process, where it has nothing to reduce; without it DeepSpeed uses torch.distributed (gloo).
    """
    from deepspeed.accelerator import set_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    class _TestCPUAccelerator(CPU_Accelerator):
        def is_fp16_supported(self) -> bool:
            return True if fp16 else super().is_fp16_supported()

        def get_op_builder(self, class_name: str) -> Any:
            if class_name == "ShareMemCommBuilder" and not shm_comm:
                return None
            return super().get_op_builder(class_name)

    accel = _TestCPUAccelerator()
    set_accelerator(accel)
    return accel


def join_as_deepspeed_rank(rank: int, world: int, port: int) -> None:
    """Make this spawned process rank ``rank`` of ``world`` DeepSpeed CPU processes (gloo on loopback): one torch
    thread (the ranks share the cores), the rendezvous variables ``deepspeed.init_distributed`` reads, and the CPU
    accelerator of :func:`install_deepspeed_cpu_accelerator` without FP16."""
    import os

    import torch

    torch.set_num_threads(1)
    os.environ.update(
        {"DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
         "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
    )  # fmt: skip
    install_deepspeed_cpu_accelerator(fp16=False)
