"""tokenmill: a readable, measurable, fast LLM inference engine."""
from tokenmill.lora import LoRARequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput

__version__ = "0.1.0"


def __getattr__(name):
    if name == "LLM":
        from tokenmill.llm import LLM  # imports torch: `import tokenmill` and the light tools must not

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
