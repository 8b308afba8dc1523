"""Storage precision: how trainable weights keep full precision (FP32 master, BF16 + remainder, Kahan, stochastic
rounding), in what dtype optimizer states are kept, and the optimizer that does it.

- :mod:`~hf_mixedprec.storage.bits`: the bit-level math (remainder split/combine, stochastic rounding, Kahan);
- :mod:`~hf_mixedprec.storage.optim`: :class:`StorageAdamW`, AdamW over those stores;
- :mod:`~hf_mixedprec.storage.lowbit`: torchao's low-bit AdamW (8-bit, 4-bit, FP8 states), skipping flagged steps on
  the device;
- :mod:`~hf_mixedprec.storage.setup`: putting a precision plan's storage into effect on a model and optimizer;
- :mod:`~hf_mixedprec.storage.convert`: a checkpoint's weights and optimizer state converted for another master.

What a recipe may ask for is :class:`hf_mixedprec.recipes.storage_config.StorageConfig` (the ``storage:`` section).
"""

from hf_mixedprec.storage.bits import combine_remainder, kahan_store, split_remainder, stochastic_round_bf16
from hf_mixedprec.storage.optim import StorageAdamW
from hf_mixedprec.storage.setup import (
    StorageRefusal,
    apply_storage,
    replace_optimizer,
    storage_optimizer,
    trainer_optimizer,
)

__all__ = [
    "StorageAdamW",
    "StorageRefusal",
    "apply_storage",
    "combine_remainder",
    "kahan_store",
    "replace_optimizer",
    "split_remainder",
    "stochastic_round_bf16",
    "storage_optimizer",
    "trainer_optimizer",
]
