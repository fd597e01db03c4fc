"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's runtime LoRA updating.

They answer only on a server started with `--allow-runtime-lora-updating` (or
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`); elsewhere they are 404, because they let a
client make the server read any directory it can see. Replies are short plain text (200),
as vLLM's; failures are OpenAI-shaped errors.
"""
from __future__ import annotations

import logging

from starlette.responses import PlainTextResponse, Response

from kiln.engine.async_engine import AsyncLLMEngine, EngineDeadError
from kiln.entrypoints.openai.errors import APIError, bad_request
from kiln.entrypoints.openai.models import ServedModels
from kiln.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

logger = logging.getLogger(__name__)
RUNTIME_FLAG = "--allow-runtime-lora-updating"


def require_runtime_updates(allowed: bool, path: str) -> None:
    if not allowed:
        raise APIError(404, f"{path} is off: start kiln serve with {RUNTIME_FLAG} (or "
                       "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) to load and unload LoRA "
                       "adapters at run time")


async def load_lora_adapter(engine: AsyncLLMEngine, models: ServedModels,
                            req: LoadLoRAAdapterRequest) -> Response:
    try:
        lora = models.reserve(req.lora_name, req.lora_path)
    except ValueError as exc:
        raise bad_request(str(exc), "lora_name") from None
    committed = False
    try:
        await engine.add_lora(lora)  # checked on the engine thread, between steps
        models.commit(lora)
        committed = True
    except ValueError as exc:  # a bad adapter: the server carries on without it
        raise bad_request(str(exc), "lora_path") from None
    except EngineDeadError as exc:
        raise APIError(503, f"the engine is not available: {exc}") from None
    finally:
        if not committed:
            models.release(lora)
    logger.info("LoRA adapter '%s' loaded from %s (id %d)", lora.lora_name, lora.lora_path,
                lora.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' added "
                             "successfully.")


async def unload_lora_adapter(engine: AsyncLLMEngine, models: ServedModels,
                              req: UnloadLoRAAdapterRequest) -> Response:
    lora = models.adapters.get(req.lora_name)
    if lora is not None and req.lora_int_id not in (None, lora.lora_int_id):
        raise bad_request(f"the LoRA adapter '{req.lora_name}' has id {lora.lora_int_id}, "
                          f"not {req.lora_int_id}", "lora_int_id")
    try:
        lora = models.remove(req.lora_name)  # from here on, requests naming it get 404
    except ValueError as exc:
        raise bad_request(str(exc), "lora_name") from None
    try:
        await engine.remove_lora(lora.lora_int_id)
    except EngineDeadError as exc:
        raise APIError(503, f"the engine is not available: {exc}") from None
    logger.info("LoRA adapter '%s' unloaded", lora.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' removed "
                             "successfully.")
