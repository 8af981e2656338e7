"""A stand-in OpenAI completion server for the P/D proxy's fault tests (no model): answers
/health, /stats (requests seen) and /v1/completions, streamed as `chunks` SSE events `delay_s`
apart then `[DONE]`. Run as its own process so tests can kill -9 it mid-answer.

    python fake_openai.py PORT [CHUNKS] [DELAY_S]
"""

import asyncio
import json
import sys

from aiohttp import web

PORT = int(sys.argv[1])
CHUNKS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
DELAY = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
seen = []


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    seen.append(body)
    if not body.get("stream"):
        return web.json_response(
            {"choices": [{"text": "x" * body.get("max_tokens", 1)}], "usage": {"prompt_tokens": 3}}
        )
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    for i in range(CHUNKS):
        await out.write(f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n".encode())
        print("SENT", i, flush=True)
        await asyncio.sleep(DELAY)
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out


async def health(request):
    return web.Response(text="ok")


async def stats(request):
    return web.json_response({"requests": len(seen)})


app = web.Application()
app.router.add_post("/v1/completions", completions)
app.router.add_get("/health", health)
app.router.add_get("/stats", stats)
web.run_app(app, host="127.0.0.1", port=PORT, print=lambda *_: print("READY", flush=True))
