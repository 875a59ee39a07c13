"""``sdm-mlx serve`` end to end: the real server as a subprocess, the official ``openai`` client, raw sockets.

The model, positive head and verifier are the tiny ones of ``tests/verified/test_generate.py``
(its module fixture ``setup``): with the head, joint decoding answers review prompts
in JSON and the verifier admits ``setup.verified_doc``'s answer, while the
far-away ``OOD_PROMPT`` is rejected.  One server is shared by the module
(``--port 0``; its stderr names the port) and stopped with SIGTERM at the end,
asserting a clean exit.
"""

from __future__ import annotations

import http.client
import json
import pathlib
import signal
import socket
import threading

import pytest

pytest.importorskip("mlx_lm")
openai = pytest.importorskip("openai")

from server_process import ServerProcess, sdm_mlx  # noqa: E402
from verified_lab import OOD_PROMPT, SYSTEM, TEMPLATE  # noqa: E402  (tests/helpers/; the setup fixture: conftest.py)

from sdm_mlx.llm import embed as E  # noqa: E402

MAX_BODY = 20_000
TIMEOUT = 60


@pytest.fixture(scope="module")
def server(setup):  # noqa: F811
    srv = ServerProcess(sdm_mlx("serve", "--head", setup.head_dir, "--port", 0, "--quiet",
                                "--max-body-bytes", MAX_BODY, "--served-model-name", "tiny"))
    try:
        yield srv
        assert _get(srv, "/health").status_code == 200
        assert srv.stop(signal.SIGTERM) == 0, "".join(srv.lines)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", srv.port), timeout=2).close()
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


class _Response:
    def __init__(self, status: int, headers, body: bytes):
        self.status_code, self.headers, self.text = status, headers, body.decode()

    def json(self):
        return json.loads(self.text)


def _request(srv, method, path, body=None) -> _Response:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=TIMEOUT)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        r = conn.getresponse()
        return _Response(r.status, r.headers, r.read())
    finally:
        conn.close()


def _get(srv, path):
    return _request(srv, "GET", path)


def _post(srv, path, body):
    return _request(srv, "POST", path, body)


def _verification(choice) -> dict:
    return choice.model_extra["verification"]


def _user(doc):
    return [{"role": "user", "content": doc}]


# --------------------------------------------------------------------------- OpenAI client


def test_health_is_what_the_docs_say(server, client):
    # docs/serving.md's routes table: {"status": "ok", "model": ID}, ID the served model's id as /v1/models has it
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text(encoding="utf-8")
    row = next(line for line in doc.splitlines() if line.startswith("| `GET /health` |"))
    assert '`{"status": "ok", "model": ID}`' in row and "as `/v1/models`" in row, row
    r = _get(server, "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "model": client.models.list().data[0].id}


def test_models_and_verified_chat(server, client, setup):  # noqa: F811
    assert [m.id for m in client.models.list().data] == ["tiny"]
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=_user(setup.verified_doc))
    resp = raw.parse()
    choice = resp.choices[0]
    assert choice.message.content == setup.verified_answer and choice.finish_reason == "stop"
    v = _verification(choice)
    assert v["verified"] and v["admitted"] and v["status"] == "verified" and v["rejection_reason"] is None
    assert 0 < v["p_lower"] <= 1 and v["prediction"] == 1 and v["n_attempts"] == 1
    assert v["exemplars"] and {"id", "label"} <= set(v["exemplars"][0])
    assert raw.headers["X-SDM-Verified"] == "true" and raw.headers["X-SDM-Admitted"] == "true"
    assert float(raw.headers["X-SDM-P-Lower"]) == pytest.approx(v["p_lower"], rel=1e-5)
    assert raw.headers["X-SDM-Verdict-Id"] == v["verdict_id"]
    assert resp.usage.completion_tokens == v["attempts"][0]["tokens"] > 0 and resp.usage.prompt_tokens > 0
    # the full per-row quantities of that verdict
    ex = _get(server, f"/v1/verdicts/{v['verdict_id']}").json()
    assert ex["p_lower"] == v["p_lower"] and ex["answer"] == setup.verified_answer and ex["source"] == "chat"
    assert {"q", "d0", "d", "p_centroid", "p_upper", "q_tilde_lower"} <= set(ex["verifier"])
    assert {"logits", "sdm", "n_hat", "hard_bin", "offset"} <= set(ex["row"])
    assert setup.verified_doc in ex["prompt"] and SYSTEM in ex["prompt"]  # the server applied the head's template
    assert _get(server, "/v1/verdicts/vd-nope").status_code == 404


def test_chat_stream_carries_verdict_in_last_chunk(client, setup):  # noqa: F811
    chunks = list(client.chat.completions.create(model="tiny", messages=_user(setup.verified_doc), stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == setup.verified_answer
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and _verification(finals[0].choices[0])["verified"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_policies_abstain_return_reask(client):
    # default policy (abstain): a well-formed completion saying it is not verified, never an HTTP error
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=_user(OOD_PROMPT), max_tokens=12)
    choice = raw.parse().choices[0]
    v = _verification(choice)
    assert raw.http_response.status_code == 200 and raw.headers["X-SDM-Verified"] == "false"
    assert v["status"] == "abstained" and not v["verified"] and v["rejection_reason"]
    assert choice.message.content.startswith("NOT VERIFIED") and v["rejection_reason"] in choice.message.content
    # per-request override: return the answer flagged unverified (streamed live)
    chunks = list(client.chat.completions.create(model="tiny", messages=_user(OOD_PROMPT), max_tokens=12,
                                                 stream=True, extra_body={"sdm": {"on_reject": "return"}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    vr = _verification(chunks[-1].choices[0])
    assert vr["status"] == "unverified" and text == vr["attempts"][0]["text"] and len(chunks) > 3
    # re-ask: up to two attempts, each reported
    r = client.chat.completions.create(model="tiny", messages=_user(OOD_PROMPT), max_tokens=12,
                                       extra_body={"sdm": {"on_reject": "reask", "max_attempts": 2}})
    v2 = _verification(r.choices[0])
    assert v2["on_reject"] == "reask" and 1 <= v2["n_attempts"] <= 2 and len(v2["attempts"]) == v2["n_attempts"]
    assert [a["attempt"] for a in v2["attempts"]] == list(range(1, v2["n_attempts"] + 1))


def test_text_completions_raw_prompt(client, setup):  # noqa: F811
    model, tok = E.load_model(setup.model_path)
    prompt = E.chat_text(tok, setup.verified_doc, system=SYSTEM, prompt_template=TEMPLATE)
    r = client.completions.create(model="tiny", prompt=prompt)
    assert r.object == "text_completion" and r.choices[0].text == setup.verified_answer
    assert _verification(r.choices[0])["verified"]
    chunks = list(client.completions.create(model="tiny", prompt=prompt, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == setup.verified_answer
    assert _verification(chunks[-1].choices[0])["verified"]
    # stop strings: text cut before the stop, finish_reason "stop"
    r = client.completions.create(model="tiny", prompt=prompt, stop=['"'], extra_body={"sdm": {"on_reject": "return"}})
    assert r.choices[0].text == setup.verified_answer[: setup.verified_answer.index('"')]
    assert r.choices[0].finish_reason == "stop"


def test_verify_endpoint(server, client, setup):  # noqa: F811
    ref = _verification(client.chat.completions.create(model="tiny", messages=_user(setup.verified_doc)).choices[0])
    r = _post(server, "/v1/verify", {"messages": _user(setup.verified_doc), "completion": setup.verified_answer})
    assert r.status_code == 200, r.text
    v = r.json()["verification"]
    assert v["verified"] and v["p_lower"] == pytest.approx(ref["p_lower"], abs=1e-6)
    assert r.headers["X-SDM-Verified"] == "true" and r.json()["usage"]["completion_tokens"] > 0
    bad = _post(server, "/v1/verify", {"prompt": OOD_PROMPT, "completion": '{"sentiment": "positive"}'}).json()
    assert not bad["verification"]["verified"] and bad["verification"]["rejection_reason"]
    assert _get(server, f"/v1/verdicts/{bad['verification']['verdict_id']}").json()["source"] == "verify"


def test_concurrent_requests_are_queued_not_interleaved(client, setup):  # noqa: F811
    docs = [setup.verified_doc, OOD_PROMPT, "The film is sharp and lovely.", "A dull, boring movie."]
    solo = [client.chat.completions.create(model="tiny", messages=_user(d), max_tokens=12,
                                           extra_body={"sdm": {"on_reject": "return"}}).choices[0].message.content
            for d in docs]
    got, errors = [None] * 4, []

    def one(i):  # even: streamed, odd: not
        try:
            kw = dict(model="tiny", messages=_user(docs[i]), max_tokens=12, extra_body={"sdm": {"on_reject": "return"}})
            if i % 2 == 0:
                got[i] = "".join(c.choices[0].delta.content or ""
                                 for c in client.chat.completions.create(stream=True, **kw) if c.choices)
            else:
                got[i] = client.chat.completions.create(**kw).choices[0].message.content
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors and got == solo


# --------------------------------------------------------------------------- hostile input (raw HTTP)


def _raw(port, data: bytes, read: bool = True) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as s:
        s.sendall(data)
        if not read:
            return b""
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _http(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def _error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_bad_requests_get_openai_errors(server, client):
    status, err = _error(_raw(server.port, _http("/v1/chat/completions", b'{"messages": [')))
    assert status == 400 and err["code"] == "invalid_json" and err["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=_user("hi"))
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    cases = [({"model": "tiny"}, "messages"), ({"messages": []}, "messages"),
             ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
             ({"messages": _user("x"), "max_tokens": 0}, "max_tokens"),
             ({"messages": _user("x"), "temperature": "hot"}, "temperature"),
             ({"messages": _user("x"), "stop": [""]}, "stop"),
             ({"messages": _user("x"), "n": 2}, "n"),
             ({"messages": _user("x"), "frobnicate": 1}, "frobnicate"),
             ({"messages": _user("x"), "sdm": {"on_reject": "shrug"}}, "sdm.on_reject")]
    for body, param in cases:
        r = _post(server, "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    for stream in (False, True):  # sampling fields out of range are refused before any stream starts
        for field, value in (("top_p", 0), ("top_k", -1), ("min_p", 1.5), ("seed", -3), ("top_logprobs", 21),
                             ("repetition_penalty", -1), ("xtc_threshold", 0.9), ("presence_penalty", "x"),
                             ("logit_bias", {"1": 500})):
            r = _post(server, "/v1/chat/completions", {"messages": _user("x"), field: value, "stream": stream})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)


def test_oversized_body(server):
    big = json.dumps({"messages": _user("x" * (2 * MAX_BODY))}).encode()
    status, err = _error(_raw(server.port, _http("/v1/chat/completions", big)))
    assert status == 413 and err["code"] == "request_too_large"
    # a lying Content-Length / chunked upload is cut off while reading
    chunked = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n"
               b"Content-Type: application/json\r\n"
               b"Connection: close\r\n\r\n" + f"{len(big):x}\r\n".encode() + big + b"\r\n0\r\n\r\n")
    status, err = _error(_raw(server.port, chunked))
    assert status == 413
    assert _get(server, "/health").status_code == 200


def test_client_disconnect_mid_stream(server, client, setup):  # noqa: F811
    body = json.dumps({"messages": _user(OOD_PROMPT), "stream": True, "max_tokens": 200,
                       "sdm": {"on_reject": "return"}}).encode()
    for _ in range(2):
        with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as s:
            s.sendall(_http("/v1/chat/completions", body))
            got = b""
            while b"data:" not in got:
                got += s.recv(4096)
            assert got.startswith(b"HTTP/1.1 200")
        # the socket is closed mid-stream; the server keeps serving
    r = client.chat.completions.create(model="tiny", messages=_user(setup.verified_doc))
    assert _verification(r.choices[0])["verified"]


# --------------------------------------------------------------------------- process lifecycle


def test_sigterm_during_stream_exits_cleanly(setup):  # noqa: F811
    srv = ServerProcess(sdm_mlx("serve", "--head", setup.head_dir, "--port", 0, "--quiet"))
    try:
        body = json.dumps({"messages": _user(OOD_PROMPT), "stream": True, "max_tokens": 2000,
                           "sdm": {"on_reject": "return"}}).encode()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT) as s:
            s.sendall(_http("/v1/chat/completions", body))
            got = b""
            while b"data:" not in got:
                got += s.recv(4096)
            assert srv.stop(signal.SIGTERM, timeout=30) == 0, "".join(srv.lines)
            while chunk := s.recv(65536):
                got += chunk
        # the open stream ended at once with an error event, not a cut connection
        assert b'"code": "shutting_down"' in got and b"data: [DONE]" in got
        assert "stopped" in "".join(srv.lines)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", srv.port), timeout=2).close()
    finally:
        srv.kill()


def test_cli_errors(setup, server):  # noqa: F811
    import subprocess

    busy = subprocess.run(sdm_mlx("serve", "--head", setup.head_dir, "--port", server.port), capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert busy.returncode == 2 and f"cannot listen on 127.0.0.1:{server.port}" in busy.stderr
    assert "Traceback" not in busy.stderr
    missing = subprocess.run(sdm_mlx("serve", "--model", setup.model_path, "--verifier", "/nonexistent"),
                             capture_output=True, text=True, timeout=TIMEOUT)
    assert missing.returncode == 2 and "--verifier /nonexistent" in missing.stderr


# --------------------------------------------------------------------------- decoding options used by the server


def test_decoder_stop_strings_and_temperature(tiny_phi3_path):
    import mlx.core as mx

    from sdm_mlx.network.heads import SDMHeads
    from sdm_mlx.decoding import SamplingParams
    from greedy_decoder import GreedyDecoder

    model, tok = E.load_model(tiny_phi3_path)
    dec = GreedyDecoder(model, tok, stop_at_delimiter=False)
    ids = E.encode(tok, E.chat_text(tok, "Hello", system=SYSTEM, prompt_template=TEMPLATE))
    full = dec(ids, 30)
    assert len(full.text) > 8
    stop = full.text[4:7]
    streamed = []
    got = dec(ids, 30, streamed.append, stop=[stop, "never-there"])
    assert got.stop_reason == "stop" and got.text == full.text[: full.text.index(stop)] == "".join(streamed)
    assert got.token_ids == full.token_ids[: len(got.token_ids)] and got.text.startswith(tok.decode(got.token_ids))
    mx.random.seed(3)
    a = dec(ids, 20, temperature=1.5)
    mx.random.seed(3)
    b = dec(ids, 20, temperature=1.5)
    assert a.token_ids == b.token_ids != full.token_ids[: len(a.token_ids)]  # sampled, reproducibly
    joint = GreedyDecoder(model, tok, heads=SDMHeads(model), stop_at_delimiter=False)  # sampled from the SDM output
    seeded = [joint(ids, 12, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=5)).token_ids for _ in range(2)]
    assert seeded[0] == seeded[1]
    with pytest.raises(ValueError, match="stop"):
        dec(ids, 5, stop=[""])
