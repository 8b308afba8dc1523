"""hf_mixedprec: mixed-precision LLM fine-tuning recipes for Hugging Face Transformers and Accelerate.

One validated YAML recipe per GPU generation (FP16 with loss scaling on V100, BF16 on A100, FP8 delayed,
current and blockwise on H100, MXFP8 on B200), applied with one line to a Trainer or an Accelerate loop.
"""

from hf_mixedprec._stdio import quiet_known_noise
from hf_mixedprec.errors import HardwareRefusal, MixedPrecisionError, RecipeError
from hf_mixedprec.hardware import HardwareInfo, detect
from hf_mixedprec.recipe import Recipe, load_recipe

__version__ = "0.1.0"

# Library use is quiet: the third-party messages that say nothing about the user's run (torchao's CUDA kernels that
# cannot load on CPU, torch's Enum deprecation notes, DeepSpeed's "Setting accelerator to CPU"; transformers
# imports torchao and DeepSpeed itself) are dropped, only those; everything else those loggers say still shows.
quiet_known_noise()

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
