"""Structured output: constraints (JSON schema, regex, choice, EBNF) compiled by
xgrammar off the engine thread and enforced each step through a token bitmask.
"""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "StructuredOutputManager": "manager", "StructuredOutputsParams": "params",
})
