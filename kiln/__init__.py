"""kiln: a compiler-centric LLM inference engine."""
from kiln.engine import CompletionOutput, LLMEngine, RequestOutput  # isort: skip
from kiln.config import EngineConfig
from kiln.entrypoints.llm import LLM
from kiln.lora import LoRARequest
from kiln.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "LoRARequest",
           "RequestOutput", "SamplingParams", "__version__"]
