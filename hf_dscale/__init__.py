"""hf_dscale: exact speculative decoding with block-diffusion drafters for `transformers`."""

from .models import DScaleConfig, DScaleDrafter, build_target_layer_ids

__version__ = "0.1.0"
__all__ = ["DScaleConfig", "DScaleDrafter", "build_target_layer_ids", "__version__"]
