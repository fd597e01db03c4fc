"""The xgrammar backend: constraints -> grammars -> compiled grammars -> matchers.

Parsing (`grammar_for`) needs no tokenizer and takes milliseconds: it runs when a new
constraint is added, so a bad schema, regex or grammar is a `ValueError` naming the field
before anything is scheduled. Compiling the parsed grammar against the vocabulary
(`compiler.compile_grammar`) is the slow part and runs in the manager's thread pool.
"""
from __future__ import annotations

import json
import re
from typing import Any

import xgrammar as xgr

from kiln.structured_output.params import StructuredOutputsParams

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: "; users need the rest.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def backend_message(exc: BaseException) -> str:
    return _LOCATION.sub("", str(exc).strip()).strip()


def grammar_for(params: StructuredOutputsParams) -> xgr.Grammar:
    """The constraint as an xgrammar `Grammar`; ValueError naming the field if malformed."""
    kind = params.kind
    ws = not params.disable_any_whitespace
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(json.dumps(params.json), any_whitespace=ws)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=ws)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_regex("|".join(re.escape(c) for c in params.choice))
        return xgr.Grammar.from_ebnf(params.grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"structured_outputs.{kind} cannot be used: "
                         f"{backend_message(exc)}") from None


class XgrammarBackend:
    """Holds the vocabulary-specific compiler. Thread-safe: xgrammar's compiler may be
    called from several threads at once."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 max_threads: int) -> None:
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)

    @staticmethod
    def matcher(compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled)

    def allocate_bitmask(self, rows: int) -> Any:
        return xgr.allocate_token_bitmask(rows, self.vocab_size)
