"""examples/vllm/proxy.py against fake prefill and decode instances (httpx's mock transport):
what a client gets when the prefill fails, hangs or restarted while the request was sent to
both at once. The engine tests run the proxy against real vLLM servers."""

import asyncio
import json
import os
import sys

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("tpu_sync")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples", "vllm"))
import proxy  # noqa: E402

P, D = "http://prefill", "http://decode"
TEMPLATE = {"tpu_sync_version": 1, "remote_engine_id": "e1", "remote_addresses": {"0": "10.0.0.1:7001"},
            "remote_num_blocks": 64, "remote_geometry": {"block_size": 32}, "tp_size": 1}


class Upstream:
    """The fake instances: ``prefill`` is one of "ok", "down", "hang", "error", "restarted"."""

    def __init__(self, prefill="ok"):
        self.prefill = prefill
        self.decode_bodies = []
        self.prefill_calls = 0
        self.hang = asyncio.Event()

    async def __call__(self, request):
        body = json.loads(request.content)
        if request.url.host == "prefill":
            self.prefill_calls += 1
            params = body["kv_transfer_params"]
            if self.prefill_calls > 1 and self.prefill == "down":
                raise httpx.ConnectError("connection refused", request=request)
            if self.prefill_calls > 1 and self.prefill == "hang":
                await self.hang.wait()
            if self.prefill_calls > 1 and self.prefill in ("error", "late-error"):
                if self.prefill == "late-error":
                    await asyncio.sleep(0.1)  # after the decode's stream began
                return httpx.Response(400, json={"error": "bad prompt"})
            out = dict(TEMPLATE, remote_request_id=5, remote_block_ids=[1], remote_num_tokens=3)
            if self.prefill_calls > 1 and self.prefill == "restarted":
                out["remote_addresses"] = {"0": "10.0.0.1:7002"}
            if "tpu_sync_pair" in params:
                out["tpu_sync_pair"] = params["tpu_sync_pair"]
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": out})
        self.decode_bodies.append(body)
        if body.get("stream"):
            async def events():
                yield b'data: {"choices": [{"text": "a"}]}\n\n'
                await asyncio.sleep(0.2)
                yield b"data: [DONE]\n\n"
            return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})
        if self.prefill == "restarted" and len(self.decode_bodies) == 2:
            await asyncio.sleep(0.3)  # still pulling from the old address when the prefill answers
        return httpx.Response(200, json={"choices": [{"text": "decoded"}],
                                         "params": body.get("kv_transfer_params")})


async def ask(prefill_mode, stream=False, n=2):
    """Sends ``n`` requests through a --both-at-once proxy (the first learns the template);
    returns (status, body) of the last and the upstream."""
    up = Upstream(prefill_mode)
    app = proxy.make_app([P], [D], timeout=5.0, both_at_once=True, transport=httpx.MockTransport(up))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as c:
        for i in range(n):
            r = await asyncio.wait_for(c.post("/v1/completions", json={"prompt": [1, 2, 3], "stream": stream and i}),
                                       10)
        return r.status_code, r.content, up


def run(coro):
    return asyncio.run(coro)


def test_both_at_once_sends_the_nonce_to_both_and_answers_with_the_decode():
    status, content, up = run(ask("ok"))
    assert status == 200 and json.loads(content)["choices"][0]["text"] == "decoded"
    first, second = up.decode_bodies
    assert first["kv_transfer_params"]["remote_block_ids"] == [1]  # learned sequentially
    p = second["kv_transfer_params"]
    assert p["do_remote_prefill"] and "remote_block_ids" not in p and len(p["tpu_sync_pair"]) == 32
    assert p["remote_addresses"] == TEMPLATE["remote_addresses"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_dead_prefill_is_the_answer(stream):
    status, content, up = run(ask("down", stream=stream))
    assert status == 502 and b"unreachable" in content, content


def test_a_prefill_that_fails_at_once_is_the_answer_of_a_stream():
    status, content, up = run(ask("error", stream=True))
    assert status == 400 and b"bad prompt" in content


def test_a_prefill_that_fails_later_ends_the_stream_with_an_error_event():
    status, content, up = run(ask("late-error", stream=True))
    assert status == 200 and b"[DONE]" not in content, content  # cut: the decode request is aborted
    events = [json.loads(e[len(b"data: "):]) for e in content.strip().split(b"\n\n")]
    assert events[0] == {"choices": [{"text": "a"}]}
    assert events[-1] == {"error": {"code": 400, "message": {"error": "bad prompt"}}}


def test_a_hung_prefill_does_not_hold_the_answer():
    status, content, up = run(ask("hang"))
    assert status == 200 and json.loads(content)["choices"][0]["text"] == "decoded"


def test_a_restarted_prefill_gets_the_decode_request_resent_with_its_params():
    status, content, up = run(ask("restarted"))
    assert status == 200
    assert len(up.decode_bodies) == 3
    resent = up.decode_bodies[2]["kv_transfer_params"]
    assert resent["remote_addresses"] == {"0": "10.0.0.1:7002"} and resent["remote_block_ids"] == [1]
