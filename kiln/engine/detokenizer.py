"""Incremental detokenization that never emits half a UTF-8 character.

Each step decodes a short window of recent tokens twice (with and without the new ones)
and emits the difference, so the cost per step is constant rather than O(n) re-decoding.
"""
from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Seed the window with the prompt's tail so the first word's leading space and
        # merges with the prompt decode as they will in the full text.
        self.token_ids: list[int] = list(prompt_token_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def update(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly printable text (maybe empty)."""
        if self.tokenizer is None:
            return ""
        self.token_ids.extend(new_token_ids)
        prefix = self._decode(self.token_ids[self.prefix_offset: self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character: wait for more tokens
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
