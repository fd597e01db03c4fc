"""A request as the scheduler tracks it: tokens so far, progress, and status."""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from kiln.lora.request import LoRARequest
    from kiln.sampling.params import SamplingParams
    from kiln.structured_output.manager import StructuredOutputRequest


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # failed alone (e.g. its grammar did not compile)

    @property
    def is_finished(self) -> bool:
        return self.value >= RequestStatus.FINISHED_STOPPED.value

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop",
                   RequestStatus.FINISHED_LENGTH: "length",
                   RequestStatus.FINISHED_ABORTED: "abort",
                   RequestStatus.FINISHED_ERROR: "error"}


class Request:
    """Invariant: `num_computed_tokens <= num_tokens`; a request needs a new token sampled
    exactly when the step that brings `num_computed_tokens` up to `num_tokens` runs."""

    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "eos_token_ids",
                 "arrival_time", "output_token_ids", "all_token_ids", "num_computed_tokens",
                 "status", "stop_reason", "num_preemptions", "priority", "cache_salt",
                 "block_hashes", "_block_hasher", "lora_request", "structured",
                 "spec_token_ids", "kv_transfer_params")

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, eos_token_ids: tuple[int, ...] = (),
                 arrival_time: float | None = None, *, priority: int = 0,
                 cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                 block_hasher: Callable[[Request], None] | None = None,
                 kv_transfer_params: dict | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.priority = priority  # lower runs first under the priority policy
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # its adapter's KV is its own (prefix-cache key)
        self.block_hashes: list[bytes] = []  # one per full block of known tokens
        self.structured: StructuredOutputRequest | None = None  # its grammar, if any
        # Draft tokens proposed after its last step, verified in the next one; never part
        # of all_token_ids (so never hashed into the prefix cache) until accepted.
        self.spec_token_ids: list[int] = []
        # KV connector options of this request (vLLM's name): {"do_remote_prefill":
        # true} makes a decode instance wait for the prompt's KV from a prefill instance.
        self.kv_transfer_params = kv_transfer_params
        self._block_hasher = block_hasher
        if block_hasher is not None:
            block_hasher(self)

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request else 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self._block_hasher is not None:
            self._block_hasher(self)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.name})")
