# request first: the scheduler imports it while this package is still initialising.
from kiln.engine.request import Request, RequestStatus  # isort: skip
from kiln.engine.outputs import CompletionOutput, RequestOutput
from kiln.engine.llm_engine import LLMEngine

__all__ = ["CompletionOutput", "LLMEngine", "Request", "RequestOutput", "RequestStatus"]
