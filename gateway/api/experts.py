"""SGLang's expert distribution routes, thin: start, stop and dump the per-expert token counts of an MoE
model (the operations and the CSV they write: `gateway/service/experts.py`)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from gateway.api.app_state import gateway_state
from gateway.api.json_route import JSONRoute
from gateway.cluster.worker_records import ExpertRecordOp
from gateway.service.experts import dump_experts, record_experts
from gateway.service.state import GatewayState

router = APIRouter(route_class=JSONRoute)


@router.api_route("/start_expert_distribution_record", methods=["GET", "POST"])
async def start_expert_distribution_record(state: GatewayState = Depends(gateway_state)) -> PlainTextResponse:
    """Clear every worker's counts and start counting."""
    await record_experts(state, ExpertRecordOp.START)
    return PlainTextResponse("Start recording the expert distribution.\n")


@router.api_route("/stop_expert_distribution_record", methods=["GET", "POST"])
async def stop_expert_distribution_record(state: GatewayState = Depends(gateway_state)) -> PlainTextResponse:
    await record_experts(state, ExpertRecordOp.STOP)
    return PlainTextResponse("Stop recording the expert distribution.\n")


@router.api_route("/dump_expert_distribution_record", methods=["GET", "POST"])
async def dump_expert_distribution_record(state: GatewayState = Depends(gateway_state)) -> PlainTextResponse:
    """Sum every worker's counts into a new CSV file (the workers' counts are cleared)."""
    await dump_experts(state)
    return PlainTextResponse("Dump expert distribution record.\n")
