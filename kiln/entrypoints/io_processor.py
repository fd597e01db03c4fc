"""IO processors: a plugin's own request format in, its own answer out (vLLM's 13.7).

A `kiln.io_processor_plugins` entry returns the qualified name ("pkg.mod:Class") of an
`IOProcessor` subclass, or None when it cannot run here. One is selected by name:
`io_processor_plugin` (LLM(...), `--io-processor-plugin`) wins, else the model's
config.json field `io_processor_plugin`; with neither, none is loaded. Then
`LLM.process(data)` and the server's `POST /process` run parse_request -> pre_process ->
generate -> post_process (-> output_to_response on the server).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from kiln.engine.outputs import RequestOutput
from kiln.plugins import (IO_PROCESSOR_PLUGINS_GROUP, call_plugins, discover,
                          load_plugins_by_group, resolve_qualname)
from kiln.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | dict[str, Any]


class IOProcessor:
    """Subclass it in a plugin. Raise ValueError for bad input: `LLM.process` raises it,
    the server answers 400 with its message."""

    def __init__(self, config: Any) -> None:
        self.config = config  # the engine's EngineConfig

    def parse_request(self, data: Any) -> Any:
        """Check and convert the raw input (the server's `data` field, as JSON)."""
        return data

    def pre_process(self, data: Any, request_id: str | None = None) -> Prompt | list[Prompt]:
        """The engine prompts for `data`: text, {"prompt_token_ids": [...]}, or a list."""
        raise NotImplementedError

    def sampling_params(self, data: Any) -> SamplingParams | None:
        """The prompts' sampling parameters; None: the engine's defaults."""
        return None

    def post_process(self, outputs: list[RequestOutput], request_id: str | None = None) -> Any:
        """The answer, from one finished output per prompt (in prompt order)."""
        raise NotImplementedError

    def output_to_response(self, output: Any) -> Any:
        """What the server sends back as JSON (default: `output` itself)."""
        return output


def processor_name(requested: str | None, model_dir: Path) -> str | None:
    """The processor to load: the explicit name, else the model config's field."""
    if requested:
        return requested
    try:
        return json.loads((model_dir / "config.json").read_text()).get("io_processor_plugin")
    except (OSError, ValueError):
        return None


def check_io_processor_name(name: str | None) -> None:
    """An explicitly named processor must be installed: checked before the model loads,
    so a typo fails in a second rather than after the whole start-up."""
    if not name:
        return
    installed = sorted(ep.name for ep in discover(IO_PROCESSOR_PLUGINS_GROUP))
    if name not in installed:
        raise ValueError(f"io_processor_plugin={name!r} is not installed (or not allowed by "
                         f"KILN_PLUGINS); installed: {', '.join(installed) or 'none'}")


def get_io_processor(config: Any, model_dir: Path) -> IOProcessor | None:
    name = processor_name(getattr(config, "io_processor_plugin", None), model_dir)
    if not name:
        return None
    answers = {n: q for n, q in
               call_plugins(load_plugins_by_group(IO_PROCESSOR_PLUGINS_GROUP)).items()
               if q is not None}
    if not answers:
        raise ValueError(f"io_processor_plugin={name!r} was requested but no IOProcessor "
                         "plugin is installed, or none loaded (entry point group "
                         f"{IO_PROCESSOR_PLUGINS_GROUP}; a failure to load is logged)")
    if name not in answers:
        raise ValueError(f"io_processor_plugin={name!r} is not installed (or failed to load: "
                         f"see the log); installed: {', '.join(sorted(answers))}")
    answer = answers[name]  # a qualified name, as in vLLM, or the class itself
    cls = resolve_qualname(answer) if isinstance(answer, str) else answer
    if not (isinstance(cls, type) and issubclass(cls, IOProcessor)):
        raise ValueError(f"io_processor_plugin {name!r} returned {answer!r}, which is "
                         "not a kiln.IOProcessor subclass")
    try:
        processor = cls(config)
    except Exception as exc:  # the plugin's own failure, reported as a start-up error
        raise ValueError(f"io_processor_plugin {name!r}: {cls.__name__}(config) failed: "
                         f"{type(exc).__name__}: {exc}") from exc
    logger.info("IO processor %r (%s)", name, answer)
    return processor


def as_prompts(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    return [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
