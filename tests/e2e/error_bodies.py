"""The e2e suite's check that no error body names an internal address, path or exception.

`watch_error_bodies` wraps the transports of httpx, httpx2 (the openai client's) and requests,
so that every error response an e2e test receives (status >= 400, and the error events of a
200 event stream) goes through `internal_details`. Strings the request itself sent (a model path
given to /update_weights_from_disk) are the client's own, so they are removed before the check.
The patterns here are written apart from the gateway's scrubbing (gateway/errors.py) on purpose.
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass, field

import requests

ROOT_PREFIXES = ("/tmp/", "/home/", "/root/", "/work/", "/usr/", "/var/", "/opt/", "/proc/", "/etc/")
_FORBIDDEN = re.compile(
    r"\b\d{1,3}(?:\.\d{1,3}){3}\b"                      # an IPv4 address
    r"|\[[0-9A-Fa-f:]*::[0-9A-Fa-f:]*\]|\[[0-9A-Fa-f:]+\]:\d"   # a bracketed IPv6 address
    r"|\b(?:localhost|ipv4|ipv6|dns|unix)\b:"            # gRPC target and peer names
    r"|\b[A-Za-z][\w.-]*:\d{2,5}\b"                      # host:port
    r"|" + "|".join(re.escape(p) for p in ROOT_PREFIXES) +
    r"|(?<![\w.~/-])/(?!v1/)[\w.-]+/[\w.-]+/[\w.-]+"   # any absolute path three segments deep
    r"|site-packages|\.py\b|Traceback|<class '|\b[A-Z]\w*(?:Error|Exception)\(")


def internal_details(body: str, sent: str = "") -> list[str]:
    """What in `body` names an internal address, path or exception, once every string value of
    the JSON request `sent` is removed from it."""
    for value in sorted(_string_values(sent), key=len, reverse=True):
        body = body.replace(value, "")
    return [m.group(0) for m in _FORBIDDEN.finditer(body)]


def _string_values(sent: str) -> set[str]:
    try:
        document = json.loads(sent) if sent else None
    except (ValueError, RecursionError):   # not JSON, or nested past what Python parses
        return {sent} if len(sent) >= 4 else set()
    found: set[str] = set()

    def walk(value) -> None:
        if isinstance(value, str) and len(value) >= 4:
            found.add(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)
    walk(document)
    return found


def error_events(stream_text: str) -> list[str]:
    """The `data:` payloads of an event stream that are error objects."""
    return [line[len("data:"):].strip() for line in stream_text.splitlines()
            if line.startswith("data:") and line[len("data:"):].strip().startswith('{"error"')]


@dataclass
class Findings:
    """Error bodies that named internal details: (method url status, what matched, the body)."""

    items: list[tuple[str, list[str], str]] = field(default_factory=list)

    def check(self, where: str, status: int, content_type: str, body: bytes, sent: bytes | str | None) -> None:
        text = body.decode(errors="replace")
        sent_text = sent.decode(errors="replace") if isinstance(sent, bytes) else (sent or "")
        bodies = [text] if status >= 400 else error_events(text) if "text/event-stream" in content_type else []
        for error in bodies:
            matched = internal_details(error, sent_text)
            if matched:
                self.items.append((f"{where} {status}", matched, error[:500]))


def _inspected_stream_class(module):
    """A `module.SyncByteStream` (httpx, or the httpx2 the openai client uses) that passes the response's
    bytes through and hands them to `on_close` once the response is closed."""

    class InspectedStream(module.SyncByteStream):
        def __init__(self, inner, on_close) -> None:
            self._inner = inner
            self._on_close = on_close
            self._chunks: list[bytes] = []

        def __iter__(self):
            for chunk in self._inner:
                self._chunks.append(chunk)
                yield chunk

        def close(self) -> None:
            self._inner.close()
            self._on_close(b"".join(self._chunks))
    return InspectedStream


def _watch_httpx(monkeypatch, module, findings: Findings) -> None:
    original = module.HTTPTransport.handle_request
    inspected_stream = _inspected_stream_class(module)

    def handle_request(self, request):
        response = original(self, request)
        content_type = response.headers.get("content-type", "")
        if response.status_code >= 400 or "text/event-stream" in content_type:
            try:
                sent = request.content
            except module.RequestNotRead:   # a streamed upload: nothing to exempt
                sent = b""
            response.stream = inspected_stream(response.stream, lambda body: findings.check(
                f"{request.method} {request.url}", response.status_code, content_type, body, sent))
        return response
    monkeypatch.setattr(module.HTTPTransport, "handle_request", handle_request)


def watch_error_bodies(monkeypatch, findings: Findings) -> None:
    """Route every httpx, httpx2 and requests response of the test through `findings.check`."""
    for name in ("httpx", "httpx2"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        _watch_httpx(monkeypatch, module, findings)
    requests_send = requests.adapters.HTTPAdapter.send

    def send(self, request, **kwargs):
        response = requests_send(self, request, **kwargs)
        if response.status_code >= 400:
            findings.check(f"{request.method} {request.url}", response.status_code,
                           response.headers.get("content-type", ""), response.content, request.body)
        return response
    monkeypatch.setattr(requests.adapters.HTTPAdapter, "send", send)
