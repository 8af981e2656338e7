"""Prefill/decode router for two vLLM OpenAI servers sharing one cxlkv pool.

    python -m cxlkv.integrations.pd_proxy --prefill http://127.0.0.1:8100 \
        --decode http://127.0.0.1:8200 --port 8000

Each completion or chat request is first sent to the prefill server (kv_producer) with
``max_tokens=1``: it computes the prompt's KV and its connector publishes every full block to the
pool. The original request then goes to the decode server (kv_consumer), whose connector finds
those blocks in the pool and loads them instead of recomputing the prompt; its answer (streamed
or not) is returned to the client. No KV travels over HTTP: only the two requests do.
"""
from __future__ import annotations

import argparse
import copy
import logging

from aiohttp import ClientSession, ClientTimeout, web

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


class Proxy:
    def __init__(self, prefill: str, decode: str, timeout_s: float = 600):
        self.prefill = prefill.rstrip("/")
        self.decode = decode.rstrip("/")
        self.timeout = ClientTimeout(total=timeout_s)
        self.session: ClientSession | None = None
        self.requests = 0

    async def start(self, app: web.Application) -> None:
        self.session = ClientSession(timeout=self.timeout)

    async def stop(self, app: web.Application) -> None:
        if self.session:
            await self.session.close()

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        path = request.path
        self.requests += 1
        async with self.session.post(self.prefill + path, json=prefill_body(body)) as r:
            if r.status != 200:
                text = await r.text()
                log.warning("prefill server answered %d: %s", r.status, text[:200])
                return web.Response(status=r.status, text=text, content_type="application/json")
            await r.read()
        async with self.session.post(self.decode + path, json=body) as r:
            if not body.get("stream"):
                return web.Response(status=r.status, body=await r.read(),
                                    content_type=r.content_type or "application/json")
            out = web.StreamResponse(status=r.status, headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def passthrough(self, request: web.Request) -> web.Response:
        async with self.session.get(self.decode + request.path) as r:
            return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"prefill": self.prefill, "decode": self.decode,
                                  "requests": self.requests})


def make_app(prefill: str, decode: str) -> web.Application:
    proxy = Proxy(prefill, decode)
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
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    web.run_app(make_app(args.prefill, args.decode), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
