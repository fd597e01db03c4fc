"""The server's plugin routes: endpoint plugins (opt-in by name) and the IO processor's
`POST /process`."""
from __future__ import annotations

import dataclasses
import logging
from importlib.metadata import EntryPoint
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kiln.entrypoints.io_processor import IOProcessor, as_prompts
from kiln.entrypoints.openai import serving as sv
from kiln.entrypoints.openai.errors import bad_request
from kiln.plugins import ENDPOINT_PLUGINS_GROUP, call_plugins, discover
from kiln.engine.outputs import CompletionOutput, RequestOutput
from kiln.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


def check_endpoint_plugins(names: tuple[str, ...]) -> dict[str, EntryPoint]:
    """The named entries, found but not loaded; a missing name is a ValueError (run before
    the model loads, so a typo fails fast)."""
    if not names:
        return {}
    found = {ep.name: ep for ep in discover(ENDPOINT_PLUGINS_GROUP)}
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"--endpoint-plugins {','.join(missing)}: not installed (or not "
                         f"allowed by KILN_PLUGINS); installed: "
                         f"{', '.join(sorted(found)) or 'none'}")
    return {n: found[n] for n in names}


def endpoint_routers(names: tuple[str, ...]) -> dict[str, APIRouter]:
    """The routers of the named `kiln.endpoint_plugins` entries. Default-deny: only the
    names given are loaded (routes are network exposure). A name not installed (or
    filtered out by KILN_PLUGINS) is a ValueError at start-up; one that fails to load or
    returns something else is logged and skipped."""
    found = check_endpoint_plugins(names)
    loaded: dict[str, Any] = {}
    for name in names:
        try:
            loaded[name] = found[name].load()
        except Exception:
            logger.exception("Failed to load plugin '%s'", name)
    routers: dict[str, APIRouter] = {}
    for name, router in call_plugins(loaded).items():
        if isinstance(router, APIRouter):
            routers[name] = router
        else:
            logger.error("Failed to load plugin '%s': it returned %r, not a "
                         "fastapi.APIRouter", name, router)
    return routers


def mount_endpoint_plugins(app: FastAPI, names: tuple[str, ...]) -> None:
    for name, router in endpoint_routers(names).items():
        app.include_router(router)
        logger.info("endpoint plugin %r: %s", name,
                    ", ".join(getattr(r, "path", "?") for r in router.routes))


def add_process_route(app: FastAPI, ctx: sv.ServingContext,
                      processor: IOProcessor | None) -> None:
    """`POST /process` with body {"data": ...}: the IO processor's request format."""

    @app.post("/process")
    async def process(request: Request) -> Response:
        if processor is None:
            raise bad_request("this server has no IO processor: start it with "
                              "--io-processor-plugin NAME", "io_processor_plugin")
        try:
            body = await request.json()
        except ValueError:
            raise bad_request("the body must be JSON: {\"data\": ...}", "data") from None
        if not isinstance(body, dict) or "data" not in body:
            raise bad_request("the body must be a JSON object with a \"data\" field", "data")
        rid = sv.new_id("proc")
        try:
            parsed = processor.parse_request(body["data"])
            prompts = as_prompts(processor.pre_process(parsed, rid))
            params = processor.sampling_params(parsed) or \
                SamplingParams(**ctx.default_sampling)
        except ValueError as exc:
            raise bad_request(str(exc), "data") from None
        streams = await sv.start_requests(ctx, rid, prompts, [params] * len(prompts), "data")
        last: list[Any] = [None] * len(prompts)
        choices: list[dict[int, sv.Choice]] = [{} for _ in prompts]
        async for i, delta in sv.merge(streams):  # the async engine streams deltas
            keep = last[i] is not None and not delta.prompt_logprobs  # they come once
            last[i] = dataclasses.replace(delta, prompt_logprobs=last[i].prompt_logprobs) \
                if keep else delta
            for c in delta.outputs:
                choices[i].setdefault(c.index, sv.Choice()).add(c)
        outputs = [_final(out, samples) for out, samples in zip(last, choices)]
        return JSONResponse(processor.output_to_response(processor.post_process(outputs, rid)))


def _final(last: RequestOutput, samples: dict[int, sv.Choice]) -> RequestOutput:
    """What LLM.generate returns for the request: its last delta with each sample's
    accumulated text and tokens."""
    return dataclasses.replace(last, outputs=[
        CompletionOutput(k, "".join(c.text), c.token_ids, None, c.logprobs or None,
                         c.finish_reason, c.stop_reason) for k, c in sorted(samples.items())])
