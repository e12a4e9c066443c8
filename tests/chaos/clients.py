"""HTTP clients the chaos scenarios run in threads: each records what it saw and when."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Reply:
    """One HTTP exchange as the client saw it: status, headers, the non-empty lines of the body (the
    `data:` lines of a stream), when each arrived and when the body ended (time.monotonic())."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    ended_at: float = 0.0

    @property
    def events(self) -> list[dict]:
        """The JSON events of a stream, [DONE] left out."""
        return [json.loads(line[5:]) for line in self.lines if line.startswith("data:") and line != "data: [DONE]"]

    @property
    def is_done(self) -> bool:
        return self.ended_at > 0


def completion(url: str, prompt: str, max_tokens: int, stream: bool, reply: Reply, **fields) -> Reply:
    """A greedy /v1/completions request with ignore_eos (and `fields`), recorded into `reply` as it arrives."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        **fields,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        reply.status, reply.headers = response.status_code, dict(response.headers)
        for line in response.iter_lines():
            if line:
                reply.lines.append(line)
                reply.times.append(time.monotonic())
    reply.ended_at = time.monotonic()
    return reply
