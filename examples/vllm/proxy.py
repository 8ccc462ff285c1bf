"""A minimal prefill/decode proxy for vLLM's OpenAI-compatible servers with TpuSyncConnector.

Each completion request is sent first to a prefill instance (``kv_role=kv_producer``) with
``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``; the prefill instance
returns the ``kv_transfer_params`` that locate the request's KV (its endpoint address, transfer
id, block ids, geometry). The proxy then sends the original request to a decode instance
(``kv_role=kv_consumer``) with those params: the decode instance pulls the KV instead of
recomputing the prompt, and its answer (streamed or not) is the proxy's answer. Instances are
picked round-robin.

    python examples/vllm/proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \
        --port 8000

Needs ``fastapi``, ``uvicorn`` and ``httpx`` (all installed with vLLM) and the ``tpu_sync`` package. Endpoints:
``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``.
A failed prefill is answered with its status and body (502 when unreachable); the decode
instance's errors pass through.

``--both-at-once``: once a prefill instance has answered one request (its params tell the
proxy its endpoint addresses and KV geometry), each later request goes to the prefill and the
decode instance at the same time, both carrying a fresh nonce (``tpu_sync_pair``). The decode
instance learns of the request while the prefill still computes: it derives the transfer id
from the nonce and its prompt, asks the prefill instance for the request's blocks once they are
registered (in the step that prefills it; with ``layerwise`` before its forward, each layer
published as it is computed) and pulls while the prefill runs. A prefill that fails aborts the
decode request (the proxy closes its connection) and is answered with the prefill's error.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import secrets
from typing import Any, Dict, List, Optional, Tuple

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tpu_sync.vllm.compat import PAIR_KEY, pair_params

log = logging.getLogger("tpu_sync.proxy")

#: How long a streamed both-at-once request waits for a prefill that fails at once before the
#: decode instance's stream is passed through (later failures end the stream with an error event).
STREAM_SETTLE_S = 0.05


def prefill_body(body: Dict[str, Any], decode_tp: int = 1, nonce: Optional[str] = None) -> Dict[str, Any]:
    """The request sent to the prefill instance: one token, not streamed, asking it to keep the
    KV for a decode instance of TP ``decode_tp`` (each of its ranks pulls); with ``nonce``, under
    the transfer id that a decode instance told the same nonce derives (both at once)."""
    p = dict(body)
    params: Dict[str, Any] = {"do_remote_decode": True, "decode_tp_size": int(decode_tp)}
    if nonce is not None:
        params[PAIR_KEY] = nonce
    p.update(max_tokens=1, stream=False, kv_transfer_params=params)
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p.pop("stream_options", None)
    p["n"] = 1
    return p


def decode_body(body: Dict[str, Any], params: Dict[str, Any]) -> Dict[str, Any]:
    """The request sent to the decode instance: the client's request plus the prefill's params."""
    d = dict(body)
    d["kv_transfer_params"] = params
    return d


def streamed(resp: httpx.Response, on_close: Optional[Any] = None, failure: Optional[Any] = None,
             stop: Optional[asyncio.Event] = None) -> StreamingResponse:
    """The decode instance's streamed answer, passed through; ``on_close()`` runs once it ends
    (or the client went away). Setting ``stop`` cuts the stream (closing it aborts the decode
    request) and sends ``failure()`` (``(status, body)``) as a last ``data: {"error": ...}``
    event."""

    async def chunks():
        cut = False
        it = resp.aiter_raw().__aiter__()
        stopped = asyncio.ensure_future(stop.wait()) if stop is not None else None
        try:
            while True:
                nxt = asyncio.ensure_future(it.__anext__())
                if stopped is not None:
                    await asyncio.wait({nxt, stopped}, return_when=asyncio.FIRST_COMPLETED)
                    if not nxt.done():
                        nxt.cancel()
                        cut = True
                        break
                try:
                    yield await nxt
                except StopAsyncIteration:
                    break
        finally:
            if stopped is not None:
                stopped.cancel()
            await resp.aclose()
            if on_close is not None:
                on_close()
        f = failure() if cut and failure is not None else None
        if f is not None:
            status, content = f
            try:
                detail: Any = json.loads(content)
            except ValueError:
                detail = content.decode(errors="replace")
            yield ("data: " + json.dumps({"error": {"code": status, "message": detail}}) + "\n\n").encode()

    return StreamingResponse(chunks(), status_code=resp.status_code,
                             media_type=resp.headers.get("content-type", "text/event-stream"))


def make_app(prefill: List[str], decode: List[str], timeout: float = 600.0, decode_tp: int = 1,
             both_at_once: bool = False, transport: Optional[httpx.AsyncBaseTransport] = None) -> FastAPI:
    """The proxy application over the given instance base URLs (``decode_tp``: the decode
    instances' TP size; ``both_at_once``: see the module's doc; ``transport``: httpx's, for
    tests)."""
    app = FastAPI()
    next_p = itertools.cycle(prefill)
    next_d = itertools.cycle(decode)
    client = httpx.AsyncClient(timeout=timeout, transport=transport)
    #: per prefill instance: the params of its last answer (the template of both-at-once params)
    templates: Dict[str, Dict[str, Any]] = {}
    app.state.pairs = 0  # requests sent both at once (for tests and logs)

    async def both(path: str, body: Dict[str, Any], base: str, template: Dict[str, Any]) -> Response:
        """Sends the request to the prefill and a decode instance at once. The answer is the
        decode instance's, or the prefill's failure if it fails first (the decode request is
        then aborted; a stream ends with an error event). The proxy does not wait for the
        prefill once the decode instance answered."""
        nonce = secrets.token_hex(16)
        p_url, d_url = base + path, next(next_d) + path
        app.state.pairs += 1
        prefill_task = asyncio.ensure_future(client.post(p_url, json=prefill_body(body, decode_tp, nonce)))
        d_body = decode_body(body, pair_params(template, nonce))

        def prefill_failure() -> Optional[Tuple[int, bytes]]:
            """``(status, body)`` of a failed prefill, None while it runs or when it succeeded."""
            if not prefill_task.done() or prefill_task.cancelled():
                return None
            e = prefill_task.exception()
            if e is not None:
                return 502, json.dumps({"error": f"prefill instance {p_url} unreachable: {e}"}).encode()
            pr = prefill_task.result()
            return None if pr.status_code == 200 else (pr.status_code, pr.content)

        def prefill_params() -> Dict[str, Any]:
            """A successful prefill's params (learned as the template of later requests)."""
            if not prefill_task.done() or prefill_failure() is not None or prefill_task.cancelled():
                return {}
            params = prefill_task.result().json().get("kv_transfer_params") or {}
            if params.get(PAIR_KEY) != nonce:
                log.warning("prefill instance %s ignored the both-at-once nonce; the decode instance waits for "
                            "its KV until pull_timeout_s, then recomputes or fails", base)
                return {}
            templates[base] = params
            return params

        prefill_task.add_done_callback(lambda _: prefill_params())

        def answer(f: Tuple[int, bytes]) -> Response:
            return Response(f[1], status_code=f[0], media_type="application/json")

        if body.get("stream"):
            resp = await client.send(client.build_request("POST", d_url, json=d_body), stream=True)
            # A prefill that fails at once (unreachable, a refused request) answers with its own
            # status; the decode's first token cannot come before the prefill's KV anyway.
            await asyncio.wait({prefill_task}, timeout=STREAM_SETTLE_S)
            if prefill_failure() is not None:
                await resp.aclose()  # aborts the decode request
                return answer(prefill_failure())  # type: ignore[arg-type]

            stop = asyncio.Event()
            # A failed prefill cuts the stream (closing it aborts the decode request).
            prefill_task.add_done_callback(lambda _: prefill_failure() is not None and stop.set())
            return streamed(resp, failure=prefill_failure, stop=stop)
        decode_task = asyncio.ensure_future(client.post(d_url, json=d_body))
        await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
        if prefill_failure() is not None:
            decode_task.cancel()  # closes the connection: the decode instance aborts the request
            return answer(prefill_failure())  # type: ignore[arg-type]
        if not decode_task.done():
            params = prefill_params()
            stale = params and any(params.get(k) != template.get(k) for k in ("remote_addresses", "remote_engine_id"))
            if stale:
                # The prefill instance restarted since the template was learned: the decode
                # instance was told old addresses. Abort it and send it the actual params.
                log.warning("prefill instance %s has new addresses; resending the decode request", base)
                decode_task.cancel()
                decode_task = asyncio.ensure_future(client.post(d_url, json=decode_body(body, params)))
        try:
            dr = await decode_task
        except httpx.HTTPError as e:
            return JSONResponse({"error": f"decode instance {d_url} unreachable: {e}"}, status_code=502)
        if dr.status_code != 200 and prefill_failure() is not None:
            return answer(prefill_failure())  # type: ignore[arg-type]
        return Response(dr.content, status_code=dr.status_code, media_type="application/json")

    async def forward(path: str, request: Request) -> Response:
        body = await request.json()
        base = next(next_p)
        if both_at_once and base in templates:
            return await both(path, body, base, templates[base])
        p_url = base + path
        try:
            pr = await client.post(p_url, json=prefill_body(body, decode_tp))
        except httpx.HTTPError as e:
            return JSONResponse({"error": f"prefill instance {p_url} unreachable: {e}"}, status_code=502)
        if pr.status_code != 200:
            return Response(pr.content, status_code=pr.status_code, media_type="application/json")
        params = pr.json().get("kv_transfer_params")
        if params:
            templates[base] = params
        if not params:
            # The prefill instance has no TpuSyncConnector producer: let decode prefill itself.
            log.warning("prefill instance returned no kv_transfer_params; decode recomputes the prompt")
            params = None
        d_url = next(next_d) + path
        d_body = decode_body(body, params) if params else dict(body)
        if body.get("stream"):
            req = client.build_request("POST", d_url, json=d_body)
            return streamed(await client.send(req, stream=True))
        try:
            dr = await client.post(d_url, json=d_body)
        except httpx.HTTPError as e:
            return JSONResponse({"error": f"decode instance {d_url} unreachable: {e}"}, status_code=502)
        return Response(dr.content, status_code=dr.status_code, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models() -> Response:
        r = await client.get(decode[0] + "/v1/models")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"prefill": prefill, "decode": decode, "both_at_once": both_at_once,
                             "pairs": app.state.pairs})

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", action="append", required=True, help="prefill instance base URL (repeatable)")
    ap.add_argument("--decode", action="append", required=True, help="decode instance base URL (repeatable)")
    ap.add_argument("--decode-tp", type=int, default=1, help="TP size of the decode instances")
    ap.add_argument("--both-at-once", action="store_true",
                    help="send each request to a prefill and a decode instance at once (after the first answer of "
                         "each prefill instance); the decode instance pulls while the prefill computes")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    strip = lambda urls: [u.rstrip("/") for u in urls]  # noqa: E731
    uvicorn.run(make_app(strip(a.prefill), strip(a.decode), decode_tp=a.decode_tp, both_at_once=a.both_at_once),
                host=a.host, port=a.port,
                log_level="warning")


if __name__ == "__main__":
    main()
