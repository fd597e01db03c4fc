from kiln.entrypoints.llm import LLM

__all__ = ["LLM"]
