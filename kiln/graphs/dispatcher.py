"""The graph dispatcher: capture sizes, the padding table, the valid keys per mode, and
the per-step choice `dispatch(num_tokens, uniform_decode) -> (mode, descriptor)`.

The dispatcher decides, the wrappers obey: a batch whose padded descriptor is a key runs
as that graph (FULL before PIECEWISE); anything else runs eagerly, unpadded.
"""
from __future__ import annotations

import bisect
from typing import Sequence

from kiln.attention.forward_context import BatchDescriptor
from kiln.config.compilation import CUDAGraphMode

class GraphDispatcher:
    """Owns the `BatchDescriptor` keys for one resolved mode.

    Mixed keys are added for every capture size under the mode's mixed routine. PIECEWISE
    keys are relaxed (only the token count matters: attention runs outside the graphs);
    FULL keys are exact (`num_reqs` is part of the captured attention launch). With a pair
    mode, uniform-decode keys (`uniform=True`, q tokens per request for each q in
    `uniform_query_lens`: 1, and 1 + k under speculative decoding) are added under the
    decode routine for request counts that are capture sizes up to `max_num_seqs`.
    """

    def __init__(self, mode: CUDAGraphMode, capture_sizes: Sequence[int], max_num_seqs: int,
                 compile_sizes: Sequence[int] = (),
                 uniform_query_lens: Sequence[int] = (1,)) -> None:
        self.mode = mode
        self.max_num_seqs = max_num_seqs
        self.uniform_query_lens = sorted(set(uniform_query_lens))
        self.capture_sizes = sorted(set(capture_sizes)) if mode else []
        self.max_capture_size = self.capture_sizes[-1] if self.capture_sizes else 0
        # padded[n] = the smallest capture size >= n, for n in 0..max_capture_size.
        self.padded = [self.capture_sizes[bisect.bisect_left(self.capture_sizes, n)]
                       for n in range(self.max_capture_size + 1)] if self.capture_sizes else []
        for size in compile_sizes:
            if size <= self.max_capture_size and self.padded[size] != size:
                raise ValueError(
                    f"compilation.compile_sizes entry {size} is never run: padding turns "
                    f"{size} tokens into {self.padded[size]} (capture sizes "
                    f"{self.capture_sizes}); add {size} to cudagraph_capture_sizes or drop "
                    "it from compile_sizes")
        self.keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {
            CUDAGraphMode.PIECEWISE: set(), CUDAGraphMode.FULL: set()}
        if mode:
            self._init_keys()

    def _init_keys(self) -> None:
        mixed = self.mode.mixed_mode()
        for size in self.capture_sizes:
            if mixed is CUDAGraphMode.PIECEWISE:
                self.keys[mixed].add(BatchDescriptor(size))
            elif mixed is CUDAGraphMode.FULL:
                self.keys[mixed].add(self._full_mixed_key(size))
        if self.mode.separate_routine() and self.mode.decode_mode() is CUDAGraphMode.FULL:
            for size in self.capture_sizes:
                if size <= self.max_num_seqs:
                    for q in self.uniform_query_lens:
                        self.keys[CUDAGraphMode.FULL].add(BatchDescriptor(q * size, size, True))

    def _full_mixed_key(self, padded: int) -> BatchDescriptor:
        return BatchDescriptor(padded, min(padded, self.max_num_seqs), False)

    def dispatch(self, num_tokens: int, uniform_decode: bool = False, query_len: int = 1
                 ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """FULL (exact key) > PIECEWISE (relaxed key) > NONE (unpadded, eager).

        `uniform_decode`: every request has `query_len` tokens (1, or 1 + k drafts); the
        request count is padded then, so padding requests take `query_len` tokens too."""
        if not self.mode:
            return CUDAGraphMode.NONE, BatchDescriptor(num_tokens)
        if uniform_decode and self.mode.separate_routine() and num_tokens % query_len == 0 \
                and 0 < num_tokens // query_len <= self.max_capture_size:
            reqs = self.padded[num_tokens // query_len]
            exact = BatchDescriptor(reqs * query_len, reqs, True)
            if exact in self.keys[CUDAGraphMode.FULL]:
                return CUDAGraphMode.FULL, exact
        if not 0 < num_tokens <= self.max_capture_size:
            return CUDAGraphMode.NONE, BatchDescriptor(num_tokens)
        padded = self.padded[num_tokens]
        exact = self._full_mixed_key(padded)
        if exact in self.keys[CUDAGraphMode.FULL]:
            return CUDAGraphMode.FULL, exact
        relaxed = BatchDescriptor(padded)
        if relaxed in self.keys[CUDAGraphMode.PIECEWISE]:
            return CUDAGraphMode.PIECEWISE, relaxed
        return CUDAGraphMode.NONE, BatchDescriptor(num_tokens)

    def capture_descriptors(self) -> list[tuple[CUDAGraphMode, list[BatchDescriptor]]]:
        """What start-up captures, largest first within each mode: smaller graphs then
        reuse the shared pool's memory."""
        order = []
        for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            descs = sorted(self.keys[mode], key=lambda d: (d.num_tokens, d.uniform),
                           reverse=True)
            if descs:
                order.append((mode, descs))
        return order

    @property
    def num_keys(self) -> int:
        return sum(len(k) for k in self.keys.values())
