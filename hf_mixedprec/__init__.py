"""hf_mixedprec: mixed-precision LLM fine-tuning recipes for Hugging Face Transformers and Accelerate.

One validated YAML recipe per GPU generation (FP16 with loss scaling on V100, BF16 on A100, FP8 delayed,
current and blockwise on H100, MXFP8 on B200), applied with one line to a Trainer or an Accelerate loop.
"""

from hf_mixedprec.core import _moved
from hf_mixedprec.core._stdio import quiet_known_noise
from hf_mixedprec.core.errors import HardwareRefusal, MixedPrecisionError, RecipeError
from hf_mixedprec.integrations.recipe import Recipe, load_recipe
from hf_mixedprec.recipes.hardware import HardwareInfo, detect

__version__ = "0.1.0"

# Library use is quiet: the third-party messages that say nothing about the user's run (torchao's CUDA kernels that
# cannot load on CPU, torch's Enum deprecation notes, DeepSpeed's "Setting accelerator to CPU"; transformers
# imports torchao and DeepSpeed itself) are dropped, only those; everything else those loggers say still shows.
quiet_known_noise()
# module names of earlier releases (hf_mixedprec.schema, hf_mixedprec.runtime, ...) answer as the moved modules
_moved.install()

__all__ = [
    "HardwareInfo",
    "HardwareRefusal",
    "MixedPrecisionError",
    "Recipe",
    "RecipeError",
    "__version__",
    "detect",
    "load_recipe",
]
