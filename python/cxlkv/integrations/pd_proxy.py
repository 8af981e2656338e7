"""Prefill/decode router for two vLLM OpenAI servers sharing one cxlkv pool.

    python -m cxlkv.integrations.pd_proxy --prefill http://127.0.0.1:8100 \
        --decode http://127.0.0.1:8200 --port 8000

Each completion or chat request is first sent to the prefill server (kv_producer) with
``max_tokens=1``: it computes the prompt's KV and its connector publishes every full block to the
pool. The original request then goes to the decode server (kv_consumer), whose connector finds
those blocks in the pool and loads them instead of recomputing the prompt; its answer (streamed
or not) is returned to the client. No KV travels over HTTP: only the two requests do.

Failures are the client's to see, never a truncated success:

* the decode server is checked first (``/health``, cached for ``health_ttl_s``): while it is down
  no prefill is sent, and the client gets ``503`` naming the decode side;
* a side that cannot be reached or answers 5xx gives ``502``/its status with a JSON error naming
  the side (``{"error": {"message": ..., "type": "upstream_error", "side": "decode"}}``);
* a stream that breaks after it started (the decode server died mid-answer) ends with an SSE
  ``data: {"error": ...}`` event and no ``[DONE]``, so clients see an error, not a short answer;
* ``GET /health`` answers 200 only when both sides are healthy (503 otherwise, with each side's
  state), so a load balancer stops sending requests to a proxy whose servers are gone.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import time
from collections.abc import Callable

from aiohttp import ClientError, ClientSession, ClientTimeout, web

log = logging.getLogger("cxlkv.pd_proxy")
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


def prefill_body(body: dict) -> dict:
    """The request the prefill server gets: same prompt, one token, no streaming."""
    p = copy.deepcopy(body)
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["stream"] = False
    p.pop("stream_options", None)
    return p


class UpstreamError(Exception):
    """A side (prefill or decode) failed; status is what the client gets."""

    def __init__(self, side: str, status: int, message: str):
        super().__init__(f"{side} server: {message}")
        self.side, self.status, self.message = side, status, message

    def response(self) -> web.Response:
        return web.json_response(
            {
                "error": {
                    "message": str(self),
                    "type": "upstream_error",
                    "side": self.side,
                    "code": self.status,
                }
            },
            status=self.status,
        )


def error_event(side: str, message: str) -> bytes:
    payload = {"error": {"message": f"{side} server: {message}", "type": "upstream_error", "side": side}}
    return f"data: {json.dumps(payload)}\n\n".encode()


class UpstreamClient:
    """The upstream side of an aiohttp front: one client session, opened at the app's start-up
    and closed at its clean-up (the proxy and the router both own one)."""

    def __init__(self, timeout_s: float):
        self.timeout = ClientTimeout(total=timeout_s)
        self.session: ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        self.session = ClientSession(timeout=self.timeout)

    async def stop(self, app: web.Application) -> None:
        if self.session:
            await self.session.close()

    async def relay_get(self, url: str, failed: Callable[[int, str], UpstreamError]) -> web.Response:
        """GET `url` and answer what it answered; a transport failure is `failed`'s 502."""
        try:
            async with self.session.get(url) as r:
                return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)
        except (ClientError, asyncio.TimeoutError, OSError) as e:
            return failed(502, f"{type(e).__name__}: {e}").response()


class Proxy(UpstreamClient):
    def __init__(self, prefill: str, decode: str, timeout_s: float = 600, health_ttl_s: float = 2.0):
        self.prefill = prefill.rstrip("/")
        self.decode = decode.rstrip("/")
        super().__init__(timeout_s)
        self.health_timeout = ClientTimeout(total=5)
        self.health_ttl_s = health_ttl_s
        self.requests = 0
        self.errors = {"prefill": 0, "decode": 0}
        self._health: dict[str, tuple[float, bool, str]] = {}

    def _url(self, side: str) -> str:
        return self.prefill if side == "prefill" else self.decode

    async def side_health(self, side: str, fresh: bool = False) -> tuple[bool, str]:
        """(healthy, why not) of one side, cached for health_ttl_s."""
        now = time.monotonic()
        cached = self._health.get(side)
        if cached and not fresh and now - cached[0] < self.health_ttl_s:
            return cached[1], cached[2]
        try:
            async with self.session.get(self._url(side) + "/health", timeout=self.health_timeout) as r:
                ok, why = r.status == 200, f"/health answered {r.status}"
        except (ClientError, asyncio.TimeoutError, OSError) as e:
            ok, why = False, f"unreachable ({type(e).__name__}: {e})"
        self._health[side] = (now, ok, "" if ok else why)
        return ok, "" if ok else why

    def _failed(self, side: str, status: int, message: str) -> UpstreamError:
        self.errors[side] += 1
        self._health.pop(side, None)  # re-check on the next request
        log.warning("%s server %s failed: %s", side, self._url(side), message)
        return UpstreamError(side, status, message)

    async def _prefill(self, path: str, body: dict) -> None:
        try:
            async with self.session.post(self.prefill + path, json=prefill_body(body)) as r:
                text = await r.text()
                if r.status != 200:
                    if r.status < 500:  # the client's request is wrong: pass the answer through
                        raise UpstreamError("prefill", r.status, text[:500])
                    raise self._failed("prefill", r.status, f"answered {r.status}: {text[:200]}")
        except (ClientError, asyncio.TimeoutError, OSError) as e:
            raise self._failed("prefill", 502, f"{type(e).__name__}: {e}") from e

    async def completion(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response(
                {"error": {"message": "request body is not JSON", "type": "invalid_request_error"}},
                status=400,
            )
        self.requests += 1
        try:
            ok, why = await self.side_health("decode")
            if not ok:  # no prefill work while nobody can decode it
                raise self._failed("decode", 503, why)
            await self._prefill(request.path, body)
            return await self._decode(request, body)
        except UpstreamError as e:
            return e.response()

    async def _decode(self, request: web.Request, body: dict) -> web.StreamResponse:
        try:
            r = await self.session.post(self.decode + request.path, json=body)
        except (ClientError, asyncio.TimeoutError, OSError) as e:
            raise self._failed("decode", 502, f"{type(e).__name__}: {e}") from e
        async with r:
            if r.status >= 500:
                raise self._failed("decode", r.status, f"answered {r.status}: {(await r.text())[:200]}")
            if not body.get("stream") or r.status != 200:
                try:
                    data = await r.read()
                except (ClientError, asyncio.TimeoutError, OSError) as e:
                    raise self._failed("decode", 502, f"answer cut: {type(e).__name__}: {e}") from e
                return web.Response(
                    status=r.status, body=data, content_type=r.content_type or "application/json"
                )
            out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            tail = b""  # the stream's last bytes: [DONE] may straddle two chunks
            try:
                async for chunk in r.content.iter_any():
                    tail = (tail + chunk)[-64:]
                    await out.write(chunk)
                if b"data: [DONE]" not in tail:
                    raise ClientError("the stream ended without [DONE]")
            except (ClientError, asyncio.TimeoutError, OSError) as e:
                self._failed("decode", 502, f"stream broken: {type(e).__name__}: {e}")
                await out.write(error_event("decode", f"stream broken ({type(e).__name__}: {e})"))
            await out.write_eof()
            return out

    async def passthrough(self, request: web.Request) -> web.Response:
        return await self.relay_get(
            self.decode + request.path, lambda st, msg: self._failed("decode", st, msg)
        )

    async def health(self, request: web.Request) -> web.Response:
        sides = {}
        for side in ("prefill", "decode"):
            ok, why = await self.side_health(side, fresh=True)
            sides[side] = {"url": self._url(side), "ok": ok, **({"error": why} if why else {})}
        healthy = all(s["ok"] for s in sides.values())
        return web.json_response(
            {"ok": healthy, **sides, "requests": self.requests, "errors": self.errors},
            status=200 if healthy else 503,
        )


def make_app(prefill: str, decode: str, health_ttl_s: float = 2.0) -> web.Application:
    proxy = Proxy(prefill, decode, health_ttl_s=health_ttl_s)
    app = web.Application()
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    for p in COMPLETION_PATHS:
        app.router.add_post(p, proxy.completion)
    app.router.add_get("/v1/models", proxy.passthrough)
    app.router.add_get("/health", proxy.health)
    return app


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="base URL of the kv_producer server")
    ap.add_argument("--decode", required=True, help="base URL of the kv_consumer server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument(
        "--health-ttl",
        type=float,
        default=2.0,
        help="seconds a side's health check is trusted before it is checked again",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    web.run_app(
        make_app(args.prefill, args.decode, args.health_ttl), host=args.host, port=args.port, print=None
    )


if __name__ == "__main__":
    main()
