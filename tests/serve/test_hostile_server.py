"""``sdm-mlx serve`` and ``sdm-mlx mcp`` against hostile and careless clients, through real clients.

One server subprocess (tiny model and head of ``tests/verified/test_generate.py``, copied so that
``--persist-feedback`` can write) is attacked with raw sockets (``http.client`` / ``socket``), the
official ``openai`` client and concurrent CLI writers: every bad request is a 4xx naming the problem
(never a 500, a hang or a dropped connection), no answer names a file, a prompt over the limit is
refused before any model work, an abandoned request frees the model thread, feedback needs the key,
JSON and a loopback Host, and ``add-support`` rows are never wiped by a later feedback.  The MCP
server answers every line, however malformed.  A bounded load test (20 clients) checks that the
server stays up with flat memory.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from server_process import ServerProcess, sdm_mlx  # noqa: E402
from verified_lab import OOD_PROMPT  # noqa: E402  (tests/helpers/; the setup fixture: conftest.py)

from sdm_mlx.estimator import SDMEstimator  # noqa: E402

KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT_LIMIT = 300
GOOD = {"messages": [{"role": "user", "content": "A warm and funny film."}], "max_tokens": 16,
        "sdm": {"on_reject": "return"}}


@pytest.fixture(scope="module")
def served(setup, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("hostile_server")
    head = str(root / "network")
    shutil.copytree(setup.head_dir, head)
    srv = ServerProcess(sdm_mlx("serve", "--head", head, "--port", 0, "--quiet", "--persist-feedback",
                                "--api-key", KEY, "--max-prompt-tokens", PROMPT_LIMIT, "--max-tokens-limit", 400,
                                "--body-timeout", 2))
    srv.head, srv.verifier = head, os.path.join(head, "verifier")
    yield srv
    srv.kill()


def request(port, method, path, body=None, *, raw=None, headers=None, timeout=60):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    try:
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        conn.close()


def assert_refused(served, status, text, code=None, param=None):
    assert 400 <= status < 500, (status, text[:300])
    err = json.loads(text)["error"]
    assert "Traceback" not in text and served.head not in text and "/tmp" not in text, text[:300]
    if code is not None:
        assert status == code, (status, text[:300])
    if param is not None:
        assert err["param"] == param, err
    return err


HOSTILE = [  # (name, method, path, raw body, extra headers, expected status, expected param)
    ("deep nesting", "POST", "/v1/chat/completions", b"[" * 100000, {}, 400, None),
    ("deep nesting in a field", "POST", "/v1/chat/completions",
     b'{"messages": ' + b"[" * 500 + b"]" * 500 + b"}", {}, 400, "messages"),
    ("lone surrogate", "POST", "/v1/chat/completions",
     b'{"messages":[{"role":"user","content":"\\ud800"}]}', {}, 400, "messages[0].content"),
    ("lone surrogate, streamed", "POST", "/v1/chat/completions",
     b'{"stream": true, "messages":[{"role":"user","content":"a\\udfffb"}]}', {}, 400, "messages[0].content"),
    ("lone surrogate in verify", "POST", "/v1/verify", b'{"prompt":"x","completion":"\\ud834"}', {}, 400,
     "completion"),
    ("lone surrogate in a key", "POST", "/v1/completions", b'{"prompt":"x","\\ud800":1}', {}, 400, None),
    ("bad UTF-8", "POST", "/v1/completions", b'{"prompt":"\xff\xfe"}', {}, 400, None),
    ("NaN literal", "POST", "/v1/completions", b'{"prompt":"x","temperature":NaN}', {}, 400, None),
    ("huge integer", "POST", "/v1/completions", b'{"prompt":"x","max_tokens":' + b"9" * 5000 + b"}", {}, 400, None),
    ("max_tokens over the cap", "POST", "/v1/completions", b'{"prompt":"x","max_tokens":1000000000}', {}, 400,
     "max_tokens"),
    ("too many attempts", "POST", "/v1/completions", b'{"prompt":"x","sdm":{"max_attempts":100000}}', {}, 400,
     "sdm.max_attempts"),
    ("long stop string", "POST", "/v1/completions",
     json.dumps({"prompt": "x", "stop": ["s" * 5000]}).encode(), {}, 400, "stop"),
    ("text/plain", "POST", "/v1/chat/completions", json.dumps(GOOD).encode(), {"Content-Type": "text/plain"}, 415,
     None),
    ("form post", "POST", "/v1/feedback", b"verdict_id=x&label=false",
     {"Content-Type": "application/x-www-form-urlencoded", **AUTH}, 415, None),
    ("foreign Host", "POST", "/v1/chat/completions", json.dumps(GOOD).encode(), {"Host": "attacker.example"}, 403,
     None),
    ("rebinding Host with port", "GET", "/v1/models", None, {"Host": "evil.example:8080"}, 403, None),
    ("cross-origin", "POST", "/v1/chat/completions", json.dumps(GOOD).encode(), {"Origin": "https://evil.example"},
     403, None),
    ("preflight", "OPTIONS", "/v1/feedback", None, {"Origin": "https://evil.example",
                                                   "Access-Control-Request-Method": "POST"}, 403, None),
    ("feedback without key", "POST", "/v1/feedback", b'{"verdict_id":"vd-0","label":false}', {}, 401, None),
    ("feedback with a wrong key", "POST", "/v1/feedback", b'{"verdict_id":"vd-0","label":false}',
     {"Authorization": "Bearer nope"}, 401, None),
    ("wrong key elsewhere", "GET", "/v1/models", None, {"Authorization": "Bearer nope"}, 401, None),
    ("long verdict id", "GET", "/v1/verdicts/" + "x" * 5000, None, {}, 404, None),
    ("huge body", "POST", "/v1/completions", b'{"prompt":"' + b"x" * (2 << 20) + b'"}', {}, 413, None),
]


@pytest.mark.parametrize("case", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_requests_get_4xx(served, case):
    name, method, path, raw, headers, status, param = case
    st, text = request(served.port, method, path, raw=raw, headers=headers)
    assert_refused(served, st, text, code=status, param=param)


def test_long_prompt_is_refused_before_any_model_work(served):
    huge = {"messages": [{"role": "user", "content": "word " * 52000}], "max_tokens": 8}
    for body in (huge, dict(huge, stream=True), {"messages": [{"role": "user", "content": "hi"}] * 20000}):
        t0 = time.monotonic()
        st, text = request(served.port, "POST", "/v1/chat/completions", body=body)
        err = assert_refused(served, st, text, code=400)
        assert err["message"].startswith("prompt too long (") and f"limit {PROMPT_LIMIT})" in err["message"], err
        assert time.monotonic() - t0 < 20
    st, text = request(served.port, "POST", "/v1/verify", body={"prompt": "x", "completion": "y " * 2000})
    assert "prompt too long" in assert_refused(served, st, text, code=400)["message"]
    assert request(served.port, "GET", "/health")[0] == 200


def test_slow_body_times_out(served):
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\"")
        t0 = time.monotonic()
        reply = b""
        while b"request_timeout" not in reply:  # headers and body may arrive in separate segments
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
        reply = reply.decode("latin-1")
    assert reply.startswith("HTTP/1.1 408") and "request_timeout" in reply, reply[:200]
    assert time.monotonic() - t0 < 15


def test_abandoned_request_frees_the_model_thread(setup):  # noqa: F811
    # plain decoding with a delimiter the random model never writes: generation runs to max_tokens
    srv = ServerProcess(sdm_mlx("serve", "-m", setup.model_path, "--verifier", setup.verifier_dir, "--port", 0,
                                "--quiet", "--delimiter", "\u2603\u2603", "--max-tokens-limit", 1000))
    try:
        runaway = {"prompt": "A", "max_tokens": 1000, "sdm": {"on_reject": "return"}}
        t0 = time.monotonic()
        st, text = request(srv.port, "POST", "/v1/completions", body=runaway)
        full = time.monotonic() - t0
        assert st == 200 and json.loads(text)["usage"]["completion_tokens"] == 1000, text[:300]
        for _ in range(3):
            with pytest.raises((TimeoutError, socket.timeout)):
                request(srv.port, "POST", "/v1/completions", body=runaway, timeout=max(0.2, full / 10))
        t0 = time.monotonic()
        st, text = request(srv.port, "POST", "/v1/completions", body=dict(runaway, max_tokens=4))
        assert st == 200, text
        # three abandoned runaways would take 3 x full if they kept the model thread
        assert time.monotonic() - t0 < full, (time.monotonic() - t0, full)
        assert srv.stop() == 0
    finally:
        srv.kill()


def test_openai_client_sees_clear_errors(served):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    ok = client.chat.completions.create(model=model, messages=GOOD["messages"], max_tokens=8,
                                        extra_body={"sdm": {"on_reject": "return"}})
    assert ok.choices[0].model_extra["verification"]["verdict_id"]
    with pytest.raises(openai.BadRequestError, match="prompt too long"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "word " * 3000}])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=model, prompt="x", max_tokens=10**6, stream=True)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0).models.list()


def _added_rows(verifier) -> int:
    est = SDMEstimator.load(verifier)
    log = est.feedback_state_.log
    added = len(est.support_ids_) - est.feedback_state_.n_training
    assert added == sum(e["op"] == "add" for e in log) - sum(e["op"] == "remove" for e in log)  # rows = log
    return added


def _rows(path, prefix: str, n: int, dim: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    path.write_text("".join(json.dumps({"id": f"{prefix}{i}", "label": i % 2, "embedding": rng.normal(size=dim).tolist()})
                            + "\n" for i in range(n)))
    return str(path)


def _verdict_id(port, completion: str) -> str:
    st, text = request(port, "POST", "/v1/verify", body={"prompt": OOD_PROMPT, "completion": completion})
    assert st == 200, text
    return json.loads(text)["verification"]["verdict_id"]


_READER = """
import sys, time
from sdm_mlx.estimator import SDMEstimator
bad = ok = 0
end = time.time() + float(sys.argv[2])
while time.time() < end:
    try:
        SDMEstimator.load(sys.argv[1]); ok += 1
    except Exception as e:
        bad += 1; print(type(e).__name__, e, file=sys.stderr)
print(ok, bad)
"""


def test_cli_rows_survive_server_feedback(served, tmp_path):
    port, verifier = served.port, served.verifier
    dim = SDMEstimator.load(verifier).input_dim_
    vid = _verdict_id(port, '{"a": 1}')
    before = _added_rows(verifier)
    r = subprocess.run(sdm_mlx("add-support", "--model", verifier, "--input", _rows(tmp_path / "r.jsonl", "cli", 20,
                                                                                  dim, 0)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    st, text = request(port, "POST", "/v1/feedback", body={"verdict_id": vid, "label": False}, headers=AUTH)
    assert st == 200, text
    out = json.loads(text)
    assert out["persisted"] and out["added_rows"] == before + 21 == _added_rows(verifier)
    # the server now serves the merged version: its own row is the nearest exemplar of the same answer
    assert json.loads(request(port, "POST", "/v1/verify", body={"prompt": OOD_PROMPT, "completion": '{"a": 1}'})[1]
                      )["verification"]["exemplars"][0]["id"] == out["support_id"]


def test_concurrent_cli_and_server_writers_with_a_reader(served, tmp_path):
    port, verifier = served.port, served.verifier
    dim = SDMEstimator.load(verifier).input_dim_
    vids = [_verdict_id(port, '{"n": %d}' % k) for k in range(6)]
    before = _added_rows(verifier)
    (tmp_path / "reader.py").write_text(_READER)
    reader = subprocess.Popen([sys.executable, str(tmp_path / "reader.py"), verifier, "15"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    cli = [subprocess.Popen(sdm_mlx("add-support", "--model", verifier, "--input",
                                    _rows(tmp_path / f"c{k}.jsonl", f"conc{k}-", 10, dim, k + 1)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(2)]
    statuses: list = []
    posters = [threading.Thread(target=lambda v=v: statuses.append(request(
        port, "POST", "/v1/feedback", body={"verdict_id": v, "label": True}, headers=AUTH)[0])) for v in vids]
    for t in posters:
        t.start()
    for t in posters:
        t.join(timeout=300)
    for p in cli:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    out, err = reader.communicate(timeout=120)
    ok, bad = map(int, out.split())
    assert statuses == [200] * 6 and bad == 0 and ok > 0, (statuses, err[-1000:])
    assert _added_rows(verifier) == before + 2 * 10 + 6


def test_unwritable_verifier_is_a_5xx_without_a_path(served):
    st, text = request(served.port, "POST", "/v1/verify", body={"prompt": "hello", "completion": '{"b": 2}'})
    vid = json.loads(text)["verification"]["verdict_id"]
    before = _added_rows(served.verifier)
    os.chmod(served.verifier, 0o555)
    try:
        st, text = request(served.port, "POST", "/v1/feedback", body={"verdict_id": vid, "label": True},
                           headers=AUTH)
    finally:
        os.chmod(served.verifier, 0o755)
    assert st == 500 and json.loads(text)["error"]["code"] == "feedback_not_saved", text
    assert served.head not in text and "/tmp" not in text and "Permission" not in text
    assert _added_rows(served.verifier) == before
    st, text = request(served.port, "POST", "/v1/feedback", body={"verdict_id": vid, "label": True}, headers=AUTH)
    assert st == 200, text  # nothing was recorded by the failed attempt: the label can be given again


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def _load_client(served, k: int, seconds: float, results: list) -> None:
    """One of the load test's clients: normal chats (even k), hostile requests or over-long prompts (odd k)."""
    hostile = [c for c in HOSTILE if c[0] != "huge body"]
    big = {"messages": [{"role": "user", "content": "word " * 20000}], "max_tokens": 8}
    end, i = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        i += 1
        try:
            if k % 2 == 0:
                results.append(("normal", request(served.port, "POST", "/v1/chat/completions", body=GOOD)[0]))
            elif k % 4 == 1:
                name, method, path, raw, headers, _, _ = hostile[(k + i) % len(hostile)]
                results.append((name, request(served.port, method, path, raw=raw, headers=headers)[0]))
            else:
                results.append(("big", request(served.port, "POST", "/v1/chat/completions", body=big)[0]))
        except Exception as e:  # noqa: BLE001
            results.append(("error", type(e).__name__))


@pytest.mark.slow
def test_load_20_mixed_clients_server_stays_up_memory_flat(served):
    """Three 8-second rounds of 20 clients; memory may grow in the first (verdict store filling, buffers) and
    must be flat after."""
    pid = served.proc.pid
    request(served.port, "POST", "/v1/chat/completions", body=GOOD)
    rss, results = [_rss_kb(pid)], []
    for _ in range(3):
        threads = [threading.Thread(target=_load_client, args=(served, k, 8.0, results)) for k in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        rss.append(_rss_kb(pid))
    print(f"load test: {len(results)} requests from 20 clients in 3 x 8 s "
          f"({sum(r[0] == 'normal' for r in results)} normal), server RSS (MB) {[round(r / 1024) for r in rss]}")
    assert request(served.port, "GET", "/health")[0] == 200
    normal = [st for name, st in results if name == "normal"]
    assert normal and all(st == 200 for st in normal), results[:20]
    assert not [r for r in results if r[0] == "error" or (r[0] != "normal" and not 400 <= r[1] < 500)], results[:20]
    assert rss[3] - rss[1] < 64 * 1024, rss  # flat once warm


# ------------------------------------------------------------------------------------------- MCP
def test_mcp_answers_every_line(setup):  # noqa: F811
    proc = subprocess.Popen(sdm_mlx("mcp", "--head", setup.head_dir), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)

    def send(line: bytes) -> None:
        proc.stdin.write(line + b"\n")
        proc.stdin.flush()

    def reply(timeout=60) -> dict:
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        assert ready, "no reply"
        return json.loads(proc.stdout.readline())

    try:
        send(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}).encode())
        assert reply(90)["id"] == 1
        send(b'{"jsonrpc":"2.0","method":"notifications/initialized"}')
        call = b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"%s","arguments":%s}}'
        lines = [call % (2, b"verify", b'{"question":"a\\ud800b","answer":"x"}'),
                 call % (3, b"add_feedback", b'{"verdict_id":"\\udfff","label":true}'),
                 call % (4, b"verify", b"[" * 5000 + b"]" * 5000),
                 call % (5, b"explain", b'{"verdict_id":"vd-none"}'),
                 b'{"jsonrpc":"2.0","id":6,"method":"tools/call","params":',
                 call % (7, b"verify", b'{"question":"ok","answer":"{\\"sentiment\\": \\"positive\\"}"}'),
                 call % (8, b"verify", b'{"question":"' + b"word " * 50000 + b'","answer":"x"}')]
        answers = {}
        for n, line in enumerate(lines, start=2):
            send(line)
            answers[n] = out = reply()
            if n == 6:  # cut-off JSON: a parse error, or a tool error when the id could be recovered
                assert out["id"] in (None, 6) and (out.get("error") or out["result"]["isError"]), out
            elif n == 7:
                assert not out["result"].get("isError") and "verdict_id" in out["result"]["content"][0]["text"]
            else:
                assert out["id"] == n and out["result"]["isError"], out
        assert "lone surrogate" in answers[2]["result"]["content"][0]["text"]
        assert "nested too deeply" in answers[4]["result"]["content"][0]["text"]
        assert "prompt too long" in answers[8]["result"]["content"][0]["text"]  # before any forward pass
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    assert proc.returncode == 0


def test_persisting_without_a_key_is_refused_before_loading(setup, tmp_path):  # noqa: F811
    env = {k: v for k, v in os.environ.items() if k != "SDM_MLX_API_KEY"}
    r = subprocess.run(sdm_mlx("serve", "--head", setup.head_dir, "--port", 0, "--persist-feedback"),
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "--api-key" in r.stderr and "listening" not in r.stderr, r.stderr
    r = subprocess.run(sdm_mlx("serve", "--head", setup.head_dir, "--port", 0, "--persist-feedback"),
                       capture_output=True, text=True, timeout=120, env={**env, "SDM_MLX_API_KEY": " "})
    assert r.returncode == 2 and "empty" in r.stderr, r.stderr


# ------------------------------------------------------------------------- issue 41, section 4: hostile leftovers
# A client hanging up halfway through its request body is one log line (was "internal error" and two tracebacks,
# about 100 lines per connection); a prompt whose length alone proves it over the limit is refused before it is
# tokenised (the message says "by its length alone"; tests/serve/test_prompt_counter.py shows the tokenizer is never
# called); /v1/verify names the field at fault; a Host header is exactly an allowed host with an optional port;
# --api-key / SDM_MLX_API_KEY with characters an HTTP header cannot carry: exit 2 at start.
HANG_UP = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100000\r\n\r\n" + b"{" * 1000)


def _settled(served) -> int:
    """The number of log lines on stderr once a request was answered (the server is --quiet: no access log; without
    --quiet uvicorn writes it to stdout)."""
    assert request(served.port, "GET", "/health")[0] == 200
    time.sleep(0.5)
    return len(served.lines)


def test_a_client_hanging_up_mid_body_is_one_log_line(served):
    before = _settled(served)
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", served.port), timeout=10) as s:
            s.sendall(HANG_UP)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and sum("closed the connection" in x for x in served.lines[before:]) < 3:
        time.sleep(0.1)
    time.sleep(1.0)  # anything else it would log arrives by now
    new = served.lines[before:]
    assert len(new) == 3 and all("closed the connection before its request body" in x for x in new), "".join(new)
    assert not any("Traceback" in x or "internal error" in x.lower() for x in new), "".join(new)
    assert request(served.port, "GET", "/health")[0] == 200


def test_an_oversized_prompt_is_refused_by_its_length_before_tokenising(served):
    """Through the openai client: ~750 KB prompts (chat and text completion) get 400 context_length_exceeded
    naming the field, decided by length alone; a prompt only the exact count can refuse still gets it."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    calls = {"messages": lambda: client.chat.completions.create(
                 model=model, messages=[{"role": "user", "content": "word " * 150_000}], max_tokens=4),
             "prompt": lambda: client.completions.create(model=model, prompt="word " * 150_000, max_tokens=4)}
    for field, call in calls.items():
        with pytest.raises(openai.BadRequestError) as e:
            call()
        err = e.value.body
        assert err["code"] == "context_length_exceeded" and err["param"] == field, err
        assert "by its length alone" in err["message"] and err["message"].endswith(f"limit {PROMPT_LIMIT})"), err
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="y " * 400, max_tokens=4)  # 801 tokens, 401 word starts
    assert e.value.body["message"].startswith("prompt too long (") and "length alone" not in e.value.body["message"]


def test_verify_names_the_field_that_is_too_long(served):
    cases = [({"prompt": "word " * 10_000, "completion": "fine"}, "prompt"),
             ({"prompt": "y " * 400, "completion": "fine"}, "prompt"),  # counted exactly
             ({"messages": [{"role": "user", "content": "word " * 10_000}], "completion": "fine"}, "messages"),
             ({"prompt": "x", "completion": "y " * 2000}, "completion"),
             ({"prompt": "x", "completion": "word " * 10_000}, "completion")]
    for body, field in cases:
        status, text = request(served.port, "POST", "/v1/verify", body=body)
        err = json.loads(text)["error"]
        assert status == 400 and err["param"] == field and err["code"] == "context_length_exceeded", (body, err)
        assert err["message"].startswith("prompt too long") and f"limit {PROMPT_LIMIT})" in err["message"], err


@pytest.mark.parametrize("host", ["[::1]attacker.example", "[::1].evil.example:80", "localhost:80@evil.example",
                                  "127.0.0.1.evil.example", "::1", "localhost:80:80", "localhost:"])
def test_a_host_that_is_not_exactly_an_allowed_host_and_port_is_refused(served, host):
    status, text = request(served.port, "POST", "/v1/chat/completions", body=GOOD, headers={"Host": host})
    assert status == 403 and json.loads(text)["error"]["code"] == "host_not_allowed", (status, text[:200])


def test_allowed_hosts_with_a_port_are_served(served):
    for host in (f"127.0.0.1:{served.port}", f"localhost:{served.port}", "localhost", f"[::1]:{served.port}"):
        assert request(served.port, "GET", "/v1/models", headers={"Host": host})[0] == 200, host


@pytest.mark.parametrize("key,where", [("cl\u00e9", "--api-key"), ("caf\u00e9-\u2603", "SDM_MLX_API_KEY"),
                                       ("two words", "--api-key")])
def test_an_api_key_no_client_can_send_is_refused_at_start(setup, key, where):  # noqa: F811
    """Before: the server started, and every client got 401 (httpx cannot even send a non-ASCII header)."""
    env = {k: v for k, v in os.environ.items() if k != "SDM_MLX_API_KEY"}
    args, extra_env = (["--api-key", key], {}) if where == "--api-key" else ([], {"SDM_MLX_API_KEY": key})
    r = subprocess.run(sdm_mlx("serve", "--head", setup.head_dir, "--port", 0, *args), capture_output=True,
                       text=True, timeout=120, env={**env, **extra_env})
    assert r.returncode == 2 and "listening" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert f"error: {where}:" in r.stderr and "visible ASCII" in r.stderr and key not in r.stderr, r.stderr


@pytest.mark.slow  # an MCP server of its own (~20 s at load 14); the counting is tested in test_prompt_counter.py
def test_mcp_refuses_an_8_mb_question_by_its_length(setup):  # noqa: F811
    """Through the MCP SDK client: an 8.5 MB question (before: 50.7 s and 873 MB to tokenise it) is a tool error
    decided by its length alone; the session goes on."""
    pytest.importorskip("mcp")
    from mcp import Client, StdioServerParameters

    env = {k: os.environ[k] for k in ("PYTHONPATH", "HF_HUB_OFFLINE") if k in os.environ}
    params = StdioServerParameters(command=sys.executable, args=["-m", "sdm_mlx", "mcp", "--head", setup.head_dir],
                                   env=env)

    async def session():
        async with asyncio.timeout(120):
            async with Client(params, read_timeout_seconds=120) as client:
                huge = await client.call_tool("verify", {"question": "word " * 1_700_000, "answer": "fine"})
                ok = await client.call_tool("verify", {"question": setup.verified_doc, "answer": setup.verified_answer})
                return huge, ok

    huge, ok = asyncio.run(session())
    assert huge.is_error and "by its length alone" in huge.content[0].text, huge.content
    assert not ok.is_error
