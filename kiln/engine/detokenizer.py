"""Incremental detokenization that never emits half a UTF-8 character.

The fast path is the `tokenizers` library's `DecodeStream`: it keeps its own window and
returns a chunk only once the bytes so far form whole characters. Tokenizers without a
Rust backend use the slow path: decode a short window of recent tokens twice (with and
without the new ones) and emit the difference. Either way the cost per token is constant,
not a re-decode of the whole text (which would make a request O(n^2)).
"""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

_PRIME_TOKENS = 6  # prompt tokens that seed the window: merges and leading spaces decode
# the way they will in the full text.


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._prime = list(prompt_token_ids[-_PRIME_TOKENS:])
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = self._new_stream(self._prime) if self._backend is not None else None
        # Slow path state.
        self._ids: list[int] = list(self._prime)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def update(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly printable text (maybe empty)."""
        if self.tokenizer is None or not new_token_ids:
            return ""
        if self._stream is not None:
            return "".join(self._step(t) for t in new_token_ids)
        return self._slow_update(new_token_ids)

    # ---- fast path: tokenizers.decoders.DecodeStream ---------------------------------------
    def _new_stream(self, prime: list[int]) -> Any:
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        if prime:
            stream.step(self._backend, prime)  # output discarded: it is prompt text
        return stream

    def _step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._backend, token_id) or ""
        except Exception as exc:  # e.g. "Invalid prefix" on non-monotonic byte output
            logger.debug("DecodeStream failed (%s); restarting the stream", exc)
            self._stream = self._new_stream(self._prime)
            try:
                return self._stream.step(self._backend, token_id) or ""
            except Exception:
                return ""

    # ---- slow path: windowed re-decode --------------------------------------------------
    def _slow_update(self, new_token_ids: list[int]) -> str:
        self._ids.extend(new_token_ids)
        prefix = self._decode(self._ids[self._prefix_offset: self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character: wait for more tokens
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def token_namer(tokenizer: Any) -> Any:
    """`ids -> [text of each id]` for logprob entries (special tokens shown), or None."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
    return lambda ids: [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
