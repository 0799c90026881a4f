from .configuration_dscale import DScaleConfig, build_target_layer_ids
from .modeling_dscale import DraftContextCache, DraftVocab, DScaleDrafter, DScalePreTrainedModel, tap_layers

__all__ = ["DScaleConfig", "DScaleDrafter", "DScalePreTrainedModel", "DraftContextCache", "DraftVocab", "build_target_layer_ids", "tap_layers"]
