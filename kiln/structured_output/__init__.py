"""Structured output: constraints (JSON schema, regex, choice, EBNF) compiled by
xgrammar off the engine thread and enforced each step through a token bitmask."""
from kiln.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
