"""The example's IO processor: a list of words in, a greedy continuation of each out."""
from __future__ import annotations

from typing import Any

from kiln import IOProcessor, SamplingParams


class WordsProcessor(IOProcessor):
    def parse_request(self, data: Any) -> dict[str, Any]:
        words = data.get("words") if isinstance(data, dict) else None
        if not isinstance(words, list) or not words or \
                not all(isinstance(w, str) and w for w in words):
            raise ValueError("data.words must be a non-empty list of non-empty strings")
        max_tokens = data.get("max_tokens", 4)
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= 64:
            raise ValueError("data.max_tokens must be an integer in [1, 64]")
        return {"words": words, "max_tokens": max_tokens}

    def pre_process(self, data: dict[str, Any], request_id: str | None = None) -> list[str]:
        return list(data["words"])

    def sampling_params(self, data: dict[str, Any]) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=data["max_tokens"], ignore_eos=True)

    def post_process(self, outputs: list[Any], request_id: str | None = None) -> dict[str, Any]:
        return {"continuations": [o.outputs[0].text for o in outputs],
                "num_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}


def processor() -> str:
    """`kiln.io_processor_plugins` entry: the processor's qualified name."""
    return "kiln_example_plugin.io:WordsProcessor"
