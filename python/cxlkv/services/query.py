"""``cxlkv query``: the longest prefix of a token sequence whose KV is in the pool.

Answered straight from the pool's index: the keys are derived exactly as the connector derives
them (integrations/keys.py: the namespace's name, the LoRA adapter by content, the tenant's
cache_salt), and ``match_prefix`` counts the leading ones present. The namespace is chosen by
what determines the bytes: its pool name (``kv2-...``, the identity digest of docs/IDENTITY.md)
or its weights identity (the layout's ``model_id``), never by a served model alias; a pool with
one KV namespace needs neither.

``serve`` answers the same over HTTP, shaped like Mooncake conductor's ``POST /query``:
``{"model": ..., "lora_name": ..., "token_ids": [...]}`` in,
``{"data": {"<pool instance>": {"matched_tokens": N, "L2": N, ...}}}`` out (the pool is one tier,
host memory: Mooncake's L2). ``model`` takes the namespace name or weights identity; a LoRA
prefix is keyed by the adapter's content, so it is asked by ``lora_id`` (``lora:<digest>`` as the
connector computes it), not by a name.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import cxlkv
from cxlkv.errors import CommandError
from cxlkv.integrations.heads import HeadNamespace, HeadPlan
from cxlkv.integrations.keys import block_keys
from cxlkv.integrations.namespace_kinds import kv_namespaces

MAX_TOKENS = 1 << 20  # a request larger than this is refused, not hashed


def select_namespace(pool: cxlkv.Pool, model: str | None) -> dict:
    """The KV namespace named ``model`` (pool name or model_id); the only one when None."""
    spaces = kv_namespaces(pool)
    hits = [n for n in spaces if model in (n["name"], n["model_id"])] if model else spaces
    if len(hits) == 1:
        return hits[0]
    listing = "; ".join(f"{n['name']} ({n.get('source') or n['model_id']})" for n in spaces) or "none"
    if not hits:
        raise CommandError(f"no KV namespace {model!r} in pool {pool.path}; namespaces: {listing}")
    raise CommandError(
        f"pool {pool.path} has {len(hits)} KV namespaces{' matching ' + repr(model) if model else ''}: "
        f'name one (--namespace / "model"): {listing}'
    )


def _token_ids(values) -> list[int]:
    if not isinstance(values, list) or len(values) > MAX_TOKENS:
        raise CommandError(f"token_ids must be a list of at most {MAX_TOKENS} integers")
    if not all(isinstance(v, int) and not isinstance(v, bool) and -(2**31) <= v < 2**31 for v in values):
        raise CommandError("token_ids must be 32-bit integers")
    return values


def blocks_view(ns, info: dict):
    """A namespace of per-head entries (heads_per_entry, integrations/heads.py) answers for whole
    blocks: a block matches when every head of it is there."""
    if not info.get("heads_per_entry"):
        return ns
    return HeadNamespace(ns, HeadPlan(int(info["num_kv_heads"]) // int(info["heads_per_entry"])))


def query(
    pool: cxlkv.Pool,
    token_ids: list,
    *,
    model: str | None = None,
    lora_id: str | None = None,
    cache_salt: str | None = None,
) -> dict:
    """{"namespace", "block_size", "matched_blocks", "matched_tokens", "total_tokens"}."""
    token_ids = _token_ids(token_ids)
    info = select_namespace(pool, model)
    ns = blocks_view(pool.namespace(cxlkv.KVLayout.from_info(info), name=info["name"]), info)
    bs = int(info["tokens_per_block"])
    keys = block_keys(token_ids, bs, info["name"], lora=lora_id, cache_salt=cache_salt)
    matched = ns.match_prefix(keys) if keys else 0
    return {
        "namespace": info["name"],
        "block_size": bs,
        "matched_blocks": matched,
        "matched_tokens": matched * bs,
        "total_tokens": len(token_ids),
    }


def instance_name(pool: cxlkv.Pool) -> str:
    return f"cxlkv:{pool.uuid}"


def conductor_answer(pool: cxlkv.Pool, body: dict) -> dict:
    """Mooncake conductor's /query answer for one request body."""
    if not isinstance(body, dict):
        raise CommandError("the body must be a JSON object")
    if body.get("lora_name") and not body.get("lora_id"):
        raise CommandError(
            "LoRA prefixes are keyed by the adapter's content: pass lora_id ('lora:<digest>'), not lora_name"
        )
    r = query(
        pool,
        body.get("token_ids"),
        model=body.get("model") or None,
        lora_id=body.get("lora_id") or None,
        cache_salt=body.get("cache_salt") or None,
    )
    n = r["matched_tokens"]
    return {"data": {instance_name(pool): {"matched_tokens": n, "L2": n, **r}}}


class _Handler(BaseHTTPRequestHandler):
    pool: cxlkv.Pool
    lock: threading.Lock
    max_body = 16 << 20

    def _send(self, code: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        if self.path.rstrip("/") != "/query":
            self._send(404, {"error": f"no such endpoint {self.path}; POST /query"})
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 < length <= self.max_body:
            self._send(400, {"error": f"a JSON body of 1..{self.max_body} bytes is required"})
            return
        try:
            body = json.loads(self.rfile.read(length))
            with self.lock:  # one namespace handle cache per pool object
                answer = conductor_answer(self.pool, body)
        except (ValueError, CommandError) as e:
            self._send(400, {"error": str(e)})
            return
        self._send(200, answer)

    def log_message(self, format: str, *args) -> None:
        return  # a router queries per request: no line per query on stderr


def make_server(pool: cxlkv.Pool, host: str, port: int) -> ThreadingHTTPServer:
    handler = type("QueryHandler", (_Handler,), {"pool": pool, "lock": threading.Lock()})
    try:
        return ThreadingHTTPServer((host, port), handler)
    except OSError as e:
        raise CommandError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
