"""Drafter models (what is loaded). Registered with the transformers Auto classes on import."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .dscale import DScaleConfig, DScaleDrafter, build_target_layer_ids

AutoConfig.register(DScaleConfig.model_type, DScaleConfig, exist_ok=True)
AutoModel.register(DScaleConfig, DScaleDrafter, exist_ok=True)
# `save_pretrained` then copies the modeling code and writes `auto_map`, so a saved folder loads with
# `AutoModel.from_pretrained(folder, trust_remote_code=True)` where hf_dscale is not installed.
DScaleConfig.register_for_auto_class()
DScaleDrafter.register_for_auto_class("AutoModel")

__all__ = ["DScaleConfig", "DScaleDrafter", "build_target_layer_ids"]

from .dllm import DiffusionLM, DiffusionLMConfig, DreamConfig, DreamModel, LLaDAConfig, LLaDAModelLM  # noqa: E402

AutoConfig.register(DiffusionLMConfig.model_type, DiffusionLMConfig, exist_ok=True)
AutoModel.register(DiffusionLMConfig, DiffusionLM, exist_ok=True)
DiffusionLMConfig.register_for_auto_class()
DiffusionLM.register_for_auto_class("AutoModel")
# The published LLaDA and Dream checkpoints (model types "llada", "Dream") load with these classes, no remote code.
for _config, _model in ((LLaDAConfig, LLaDAModelLM), (DreamConfig, DreamModel)):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _model, exist_ok=True)
    AutoModelForCausalLM.register(_config, _model, exist_ok=True)

__all__ += ["DiffusionLM", "DiffusionLMConfig", "DreamConfig", "DreamModel", "LLaDAConfig", "LLaDAModelLM"]
