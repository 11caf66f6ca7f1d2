"""Architecture name (config.json "architectures") -> model class."""
from __future__ import annotations

from tokenmill.models import bert, deepseek, gemma3, gpt_oss, llama, moe, qwen2_5_vl

_REGISTRY = {
    "BertModel": bert.BertModel,
    "DeepseekV2ForCausalLM": deepseek.DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": deepseek.DeepseekForCausalLM,
    "Gemma3ForCausalLM": gemma3.Gemma3ForCausalLM,
    "GptOssForCausalLM": gpt_oss.GptOssForCausalLM,
    "LlamaForCausalLM": llama.LlamaForCausalLM,
    "MistralForCausalLM": llama.LlamaForCausalLM,
    "Qwen2ForCausalLM": llama.LlamaForCausalLM,
    "Qwen3ForCausalLM": llama.LlamaForCausalLM,
    "MixtralForCausalLM": moe.MixtralForCausalLM,
    "Qwen3MoeForCausalLM": moe.Qwen3MoeForCausalLM,
    "Qwen2_5_VLForConditionalGeneration": qwen2_5_vl.Qwen2_5_VLForConditionalGeneration,
}


def get_model_class(config):
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in _REGISTRY:
            return _REGISTRY[arch]
    raise ValueError(f"unsupported architecture {', '.join(archs) or '(none in config.json)'}; "
                     f"supported: {', '.join(sorted(_REGISTRY))}")


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)
