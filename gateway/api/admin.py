"""SGLang's admin routes on the gateway, thin: model and server info, health_generate, flush_cache,
update_weights_from_disk (the operations: `gateway/service/admin.py`), and loading and unloading LoRA
adapters under SGLang's and vLLM's paths (`gateway/service/lora_admin.py`)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict

from gateway.api.app_state import gateway_state
from gateway.api.json_route import JSONRoute
from gateway.errors import APIError
from gateway.service.admin import flush_caches, is_healthy, server_info, update_weights
from gateway.service.lora_admin import load_adapter, unload_adapter
from gateway.service.model_info import model_info
from gateway.service.state import GatewayState

router = APIRouter(route_class=JSONRoute)


@router.get("/get_model_info")
async def get_model_info(state: GatewayState = Depends(gateway_state)) -> dict:
    return model_info(state)


@router.get("/get_server_info")
async def get_server_info(state: GatewayState = Depends(gateway_state)) -> dict:
    return await server_info(state)


@router.get("/health_generate")
async def health_generate(state: GatewayState = Depends(gateway_state)):
    """200 only if one token makes it through prefill -> KV transfer -> decode."""
    try:
        healthy = await is_healthy(state)
    except APIError as exc:
        return JSONResponse(exc.body() if not state.config.is_embedding else {"status": "unavailable"}, status_code=503)
    return JSONResponse({"status": "ok" if healthy else "unavailable"}, status_code=200 if healthy else 503)


_FLUSH_NOTE = (
    "Please check backend logs for more details. (When there are running or waiting requests, "
    "the operation will not be performed.)"
)


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(state: GatewayState = Depends(gateway_state)):
    """Flush every worker's prefix cache; refused (400) while any worker has requests in flight."""
    result = await flush_caches(state)
    if result.success:
        return PlainTextResponse(f"Cache flushed.\n{_FLUSH_NOTE}\n")
    return PlainTextResponse(f"Cache not flushed: {result.message}.\n{_FLUSH_NOTE}\n", status_code=400)


class UpdateWeightsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str
    load_format: str | None = None


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: UpdateWeightsBody, state: GatewayState = Depends(gateway_state)):
    """Every worker reloads its weights from `model_path` in place. Requests in flight are aborted
    (they fail cleanly, never mixing weights); answers SGLang's {"success", "message"}."""
    result = await update_weights(state, body.model_path)
    return JSONResponse(
        {"success": result.success, "message": result.message}, status_code=200 if result.success else 400
    )


class LoadLoraBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    pinned: bool = False  # SGLang's; accepted, without effect: the workers evict only unused adapters


class UnloadLoraBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; accepted and unused


@router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraBody, state: GatewayState = Depends(gateway_state)):
    """SGLang's: every generation worker loads the adapter (or none does); answers
    {"success", "error_message", "loaded_adapters"} (name -> path)."""
    await load_adapter(state, body.lora_name, body.lora_path)
    return {"success": True, "error_message": None, "loaded_adapters": _loaded(state)}


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraBody, state: GatewayState = Depends(gateway_state)):
    await unload_adapter(state, body.lora_name)
    return {"success": True, "error_message": None, "loaded_adapters": _loaded(state)}


@router.post("/v1/load_lora_adapter")
async def v1_load_lora_adapter(body: LoadLoraBody, state: GatewayState = Depends(gateway_state)):
    """vLLM's: a plain-text success; a refusal is an OpenAI error body."""
    await load_adapter(state, body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def v1_unload_lora_adapter(body: UnloadLoraBody, state: GatewayState = Depends(gateway_state)):
    await unload_adapter(state, body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _loaded(state: GatewayState) -> dict[str, str]:
    return {name: state.pool.lora_paths.get(name, name) for name in state.pool.lora_adapters()}
