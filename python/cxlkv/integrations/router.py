"""A cache-unaware HTTP router in front of N vLLM OpenAI servers: what `cxlkv bench serve` puts
between vLLM's benchmark client and the servers, and what a deployment without KV-aware routing
looks like.

    python -m cxlkv.integrations.router --backend http://127.0.0.1:8100 \
        --backend http://127.0.0.1:8200 --port 8000 [--mode round-robin|turn]

Routing:

* ``round-robin`` (default): request i goes to backend i mod N, whatever its prompt;
* ``turn`` (sticky by conversation turn): a request that names its conversation and turn — the
  header ``X-Cxlkv-Route: U:T`` or the body field ``"cxlkv_route": {"user": U, "turn": T}`` (the
  field is removed before forwarding; vLLM's benchmark client can set body fields per request,
  not headers) — goes to backend (U + T) mod N, so consecutive turns of a conversation always
  land on different servers, as a cache-unaware router sends them by chance. Requests that name
  no turn fall back to round robin.

Answers pass through as they come: a streamed answer chunk by chunk. Failures are the client's to
see, never a truncated success:

* a backend that cannot be reached or answers 5xx: ``502`` (or its 5xx) with a JSON error naming
  the backend (``{"error": {"message": ..., "type": "upstream_error", "side": "backend 1 (URL)"}}``);
* a stream that breaks after it started: an SSE ``data: {"error": ...}`` event, then the
  connection is cut without the end of the chunked body, so an HTTP client raises (a payload
  error), never sees a clean end, and no ``[DONE]`` arrives.

``GET /router/requests`` returns one record per finished request (backend, route, status, prompt
and cached tokens read from the answer's ``usage``, the router's own TTFT): how `bench serve`
learns where each request went and how much of its prompt the server did not compute.
``GET /health`` is 200 only when every backend answers its ``/health``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import time
from dataclasses import asdict, dataclass

from aiohttp import ClientError, ClientTimeout, web

from .pd_proxy import COMPLETION_PATHS, UpstreamClient, UpstreamError, error_event

log = logging.getLogger("cxlkv.router")
MODES = ("round-robin", "turn")
ROUTE_HEADER = "X-Cxlkv-Route"
ROUTE_FIELD = "cxlkv_route"


class RouteKeyError(ValueError):
    """A request names its conversation turn in a form the router cannot read."""


@dataclass
class RequestRecord:
    request_id: str
    backend: int
    route: str  # "U:T" in turn mode, "" otherwise
    status: int
    start_s: float  # time.time() when the router got the request
    end_s: float
    ttft_s: float | None  # first answer byte from the backend, as the router saw it
    prompt_tokens: int | None
    cached_tokens: int | None
    error: str = ""


def route_key(headers, body: dict) -> tuple[int, int] | None:
    """(user, turn) named by the request, or None. Removes the body field."""
    field = body.pop(ROUTE_FIELD, None)
    raw = headers.get(ROUTE_HEADER)
    try:
        if field is not None:
            return int(field["user"]), int(field["turn"])
        if raw is not None:
            user, turn = raw.split(":")
            return int(user), int(turn)
    except (KeyError, TypeError, ValueError) as e:
        raise RouteKeyError(
            f"bad route key {field if field is not None else raw!r}: want the header "
            f'{ROUTE_HEADER}: U:T or the field "{ROUTE_FIELD}": {{"user": U, "turn": T}}'
        ) from e
    return None


def usage_of(data: bytes) -> dict:
    """The last ``usage`` object in an answer (plain JSON or SSE events), or {}."""
    try:  # a non-streamed answer
        return json.loads(data).get("usage") or {}
    except ValueError:
        pass
    usage: dict = {}
    for line in data.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        try:
            usage = json.loads(line[6:]).get("usage") or usage
        except ValueError:
            continue
    return usage


class Router(UpstreamClient):
    def __init__(self, backends: list[str], mode: str = "round-robin", timeout_s: float = 3600):
        if not backends:
            raise ValueError("the router needs at least one backend")
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
        self.backends = [b.rstrip("/") for b in backends]
        self.mode = mode
        super().__init__(timeout_s)
        self._next = itertools.count()
        self.records: list[RequestRecord] = []
        self.errors = [0] * len(self.backends)

    def side(self, i: int) -> str:
        return f"backend {i} ({self.backends[i]})"

    def choose(self, key: tuple[int, int] | None) -> int:
        if self.mode == "turn" and key is not None:
            return (key[0] + key[1]) % len(self.backends)
        return next(self._next) % len(self.backends)

    def _failed(self, i: int, status: int, message: str) -> UpstreamError:
        self.errors[i] += 1
        log.warning("%s failed: %s", self.side(i), message)
        return UpstreamError(self.side(i), status, message)

    async def completion(self, request: web.Request) -> web.StreamResponse:
        t0 = time.time()
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
            key = route_key(request.headers, body)
        except (ValueError, RouteKeyError) as e:
            msg = str(e) if isinstance(e, RouteKeyError) else f"request body is not a JSON object ({e})"
            return web.json_response({"error": {"message": msg, "type": "invalid_request_error"}}, status=400)
        i = self.choose(key)
        rec = RequestRecord(
            request_id=request.headers.get("x-request-id", ""),
            backend=i,
            route=f"{key[0]}:{key[1]}" if key else "",
            status=0,
            start_s=t0,
            end_s=0.0,
            ttft_s=None,
            prompt_tokens=None,
            cached_tokens=None,
        )
        try:
            return await self._forward(request, body, i, rec)
        except UpstreamError as e:
            rec.status, rec.error = e.status, e.message
            return e.response()
        finally:
            rec.end_s = time.time()
            self.records.append(rec)

    async def _forward(
        self, request: web.Request, body: dict, i: int, rec: RequestRecord
    ) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("x-request-id", "authorization")}
        try:
            r = await self.session.post(self.backends[i] + request.path, json=body, headers=headers)
        except (ClientError, asyncio.TimeoutError, OSError) as e:
            raise self._failed(i, 502, f"unreachable: {type(e).__name__}: {e}") from e
        async with r:
            if r.status >= 500:
                raise self._failed(i, r.status, f"answered {r.status}: {(await r.text())[:200]}")
            if not body.get("stream") or r.status != 200:
                try:
                    data = await r.read()
                except (ClientError, asyncio.TimeoutError, OSError) as e:
                    raise self._failed(i, 502, f"answer cut: {type(e).__name__}: {e}") from e
                rec.status, rec.ttft_s = r.status, time.time() - rec.start_s
                self._note_usage(rec, data)
                return web.Response(
                    status=r.status, body=data, content_type=r.content_type or "application/json"
                )
            out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            rec.status = 200
            tail = b""  # the last events: usage and [DONE] may straddle chunks
            try:
                async for chunk in r.content.iter_any():
                    if rec.ttft_s is None:
                        rec.ttft_s = time.time() - rec.start_s
                    tail = (tail + chunk)[-8192:]
                    await out.write(chunk)
                if b"data: [DONE]" not in tail:
                    raise ClientError("the stream ended without [DONE]")
            except (ClientError, asyncio.TimeoutError, OSError) as e:
                err = self._failed(i, 502, f"stream broken: {type(e).__name__}: {e}")
                rec.status, rec.error = 502, err.message
                await out.write(error_event(err.side, err.message))
                # No end of the chunked body: the client sees a cut connection, not a short
                # answer. close() (not abort()) sends the error event still buffered first.
                if request.transport is not None:
                    request.transport.close()
                return out
            self._note_usage(rec, tail)
            await out.write_eof()
            return out

    @staticmethod
    def _note_usage(rec: RequestRecord, data: bytes) -> None:
        usage = usage_of(data)
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")

    async def passthrough(self, request: web.Request) -> web.Response:
        return await self.relay_get(self.backends[0] + request.path, lambda st, msg: self._failed(0, st, msg))

    async def health(self, request: web.Request) -> web.Response:
        async def one(i: int) -> dict:
            try:
                async with self.session.get(
                    self.backends[i] + "/health", timeout=ClientTimeout(total=5)
                ) as r:
                    return {"url": self.backends[i], "ok": r.status == 200, "status": r.status}
            except (ClientError, asyncio.TimeoutError, OSError) as e:
                return {"url": self.backends[i], "ok": False, "error": f"{type(e).__name__}: {e}"}

        states = await asyncio.gather(*(one(i) for i in range(len(self.backends))))
        healthy = all(s["ok"] for s in states)
        return web.json_response(
            {"ok": healthy, "mode": self.mode, "backends": states, "errors": self.errors},
            status=200 if healthy else 503,
        )

    async def requests(self, request: web.Request) -> web.Response:
        return web.json_response([asdict(r) for r in self.records])


def make_app(backends: list[str], mode: str = "round-robin") -> web.Application:
    router = Router(backends, mode)
    app = web.Application(client_max_size=64 << 20)  # long prompts: 1 MiB (the default) is short
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    for p in COMPLETION_PATHS:
        app.router.add_post(p, router.completion)
    app.router.add_get("/v1/models", router.passthrough)
    app.router.add_get("/health", router.health)
    app.router.add_get("/router/requests", router.requests)
    return app


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", action="append", required=True, help="base URL of a server (repeat)")
    ap.add_argument("--mode", choices=MODES, default="round-robin")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    web.run_app(
        make_app(args.backend, args.mode),
        host=args.host,
        port=args.port,
        print=lambda *_: print("READY", flush=True),
        access_log=None,
    )


if __name__ == "__main__":
    main()
