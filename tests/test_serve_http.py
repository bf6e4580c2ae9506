"""The OpenAI-compatible server over real HTTP (uvicorn on a loopback port), driven by the
official `openai` client: streaming and plain completions equal the engine's own tokens, bad
requests get OpenAI-style errors, a client that goes away frees its pages, /metrics matches
the engine's counters, keys and quotas."""

import json
import os
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

import gemini_jax as gj
from gemini_jax.config import ServeConfig
from gemini_jax.data import corpus
from gemini_jax.serve.http import chat_prompt, create_app

SEED = 11
MODEL_ID = "gemini-jax-tiny"


class LiveServer:
    """uvicorn serving `app` on 127.0.0.1 (a free port) from a thread."""

    def __init__(self, app):
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.05)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def state(self):
        return self.app.state.server

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


def _engine(model, **over):
    cfg = dict(max_seq_len=512, prefill_chunk=64, max_batch=4, decode_steps_per_call=1,
               cache=dict(block_size=16, num_pages=64))
    cfg.update(over)
    return gj.Engine(model, gj.config.from_dict(gj.EngineConfig, cfg))


@pytest.fixture(scope="module")
def model():
    return gj.load_tiny()


@pytest.fixture(scope="module")
def server(model):
    eng = _engine(model)
    live = LiveServer(create_app(eng, gj.ByteTokenizer(), ServeConfig(model_id=MODEL_ID)))
    yield live
    live.close()
    eng.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="anything", max_retries=0, timeout=120)


def _prompts(n, seed=SEED):
    rng = np.random.default_rng(seed)
    _, text = corpus.load_split("heldout")
    out = []
    for _ in range(n):
        off = int(rng.integers(0, len(text) - 200))
        out.append(bytes(text[off:off + int(rng.integers(40, 120))]).decode("utf-8", errors="ignore"))
    return out


def _engine_text(server, prompt_tokens, max_tokens):
    """The engine-level greedy continuation (the same engine, through `generate`)."""
    with server.state.worker.lock:  # the scheduler's thread is idle: nothing else uses the engine
        toks = server.state.engine.generate(prompt_tokens, gj.SamplingParams(max_new_tokens=max_tokens)).tokens
    return gj.ByteTokenizer().decode(toks), toks


def test_completions_stream_and_plain_equal_the_engine(server, client):
    tok = gj.ByteTokenizer()
    for prompt in _prompts(2):
        want, toks = _engine_text(server, tok.encode(prompt), 24)
        plain = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0)
        assert plain.choices[0].text == want, f"seed {SEED}"
        assert plain.usage.prompt_tokens == len(tok.encode(prompt))
        assert plain.usage.completion_tokens == len(toks)
        assert plain.choices[0].finish_reason == ("stop" if toks and toks[-1] == tok.EOS else "length")
        stream = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        pieces, usage = [], None
        for ch in stream:
            if ch.choices:
                pieces.append(ch.choices[0].text)
            if ch.usage is not None:
                usage = ch.usage
        assert len(pieces) > 2, "the stream arrived in one piece"
        assert "".join(pieces) == want, f"seed {SEED}"
        assert usage.completion_tokens == len(toks)


def test_chat_completions_stream_and_plain(server, client):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": _prompts(1, SEED + 1)[0]}]
    want, _ = _engine_text(server, gj.ByteTokenizer().encode(chat_prompt(messages)), 20)
    plain = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=20, temperature=0)
    assert plain.choices[0].message.role == "assistant"
    assert plain.choices[0].message.content == want
    stream = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=20, temperature=0,
                                            stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == want


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL_ID]


def test_bad_requests_get_openai_errors(server, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL_ID, prompt="x" * 500, max_tokens=100)
    assert err.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL_ID, prompt=[1, 2, 99999], max_tokens=2)
    assert "99999" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL_ID, prompt="x", max_tokens=2, temperature=-1)
    assert "temperature" in err.value.body["message"]
    r = httpx.post(server.url + "/v1/completions", content=b'{"model": "gemini-jax-tiny", "prompt": ',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    body = r.json()["error"]
    assert body["type"] == "invalid_request_error" and "JSON" in body["message"]
    assert server.state.scheduler.idle  # nothing refused reached the scheduler


def _wait_idle(state, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        with state.worker.lock:
            if state.scheduler.idle:
                return
        time.sleep(0.05)
    raise AssertionError("the scheduler did not go idle")


def test_a_client_that_disconnects_frees_its_pages(server):
    state = server.state
    pool = state.engine.pages.pool
    _wait_idle(state)
    before = pool.num_free
    body = {"model": MODEL_ID, "prompt": _prompts(1, SEED + 2)[0], "max_tokens": 400, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            # Mid-stream: the request holds pages now.
            assert pool.num_free < before
    _wait_idle(state)
    assert pool.num_free == before, "a disconnected stream kept its pages"
    assert not state.engine.pages.seqs
    metrics = _scrape(server)
    assert metrics[("gemini_jax_requests_total", (("reason", "cancelled"),))] >= 1


def _scrape(server) -> dict:
    text = httpx.get(server.url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_match_the_engine(server, client):
    state = server.state
    _wait_idle(state)
    before = _scrape(server)
    prompts = _prompts(3, SEED + 3)
    for p in prompts:
        client.completions.create(model=MODEL_ID, prompt=p, max_tokens=8, temperature=0)
    _wait_idle(state)
    after = _scrape(server)
    stats = dict(state.engine.stats)
    for name in ("prefill_tokens_computed", "prefill_tokens_reused", "decode_steps", "kv_bytes_read",
                 "compute_units"):
        assert after[(f"gemini_jax_engine_{name}_total", ())] == stats[name], name
    computed = after[("gemini_jax_engine_prefill_tokens_computed_total", ())] - \
        before[("gemini_jax_engine_prefill_tokens_computed_total", ())]
    reused = after[("gemini_jax_engine_prefill_tokens_reused_total", ())] - \
        before[("gemini_jax_engine_prefill_tokens_reused_total", ())]
    assert computed + reused == sum(len(p.encode()) for p in prompts)
    ttft = after[("gemini_jax_time_to_first_token_seconds_count", ())] - \
        before.get(("gemini_jax_time_to_first_token_seconds_count", ()), 0)
    assert ttft == 3
    assert after[("gemini_jax_queue_depth", ())] == 0 and after[("gemini_jax_running_sequences", ())] == 0


@pytest.fixture(scope="module")
def keyed(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    layers = model.cfg.num_layers
    path.write_text(json.dumps({"tenants": {"A": {"pool": 60 * layers, "per_request": 40 * layers},
                                            "B": {"pool": None}},
                                "keys": {"sk-a": "A", "sk-b": "B"}}))
    eng = _engine(model, max_batch=2)
    live = LiveServer(create_app(eng, gj.ByteTokenizer(), ServeConfig(model_id=MODEL_ID, api_keys=str(path))))
    yield live
    live.close()
    eng.close()


def test_keys_and_quotas(keyed):
    url = keyed.url + "/v1"
    r = httpx.get(url + "/models")  # no Authorization header at all
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError) as err:
        openai.OpenAI(base_url=url, api_key="sk-wrong", max_retries=0).completions.create(
            model=MODEL_ID, prompt="x", max_tokens=2)
    assert err.value.body["code"] == "invalid_api_key"
    a = openai.OpenAI(base_url=url, api_key="sk-a", max_retries=0)
    with pytest.raises(openai.RateLimitError) as err:  # 10 + 35 tokens > the 40-token cap per request
        a.completions.create(model=MODEL_ID, prompt="x" * 10, max_tokens=35)
    assert "per-request cap" in err.value.body["message"]
    ok = a.completions.create(model=MODEL_ID, prompt="x" * 10, max_tokens=20, temperature=0)
    used = ok.usage.compute_units
    assert used == (10 + ok.usage.completion_tokens) * 4 - 4  # the last token's KV is never computed
    with pytest.raises(openai.RateLimitError) as err:  # 60 - 29 units' worth of tokens left < 10 + 25
        a.completions.create(model=MODEL_ID, prompt="x" * 10, max_tokens=25)
    assert "left" in err.value.body["message"] and err.value.body["code"] == "insufficient_quota"
    b = openai.OpenAI(base_url=url, api_key="sk-b", max_retries=0)
    assert b.completions.create(model=MODEL_ID, prompt="x" * 10, max_tokens=30, temperature=0).usage.completion_tokens


def _stream_until(server, body, k, interrupt):
    """Stream a completion; after `k` text chunks call `interrupt(id)`; return (id, text, finish)."""
    pieces, finish, sid = [], None, None
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ch = json.loads(line[6:])
                sid = ch["id"]
                pieces.append(ch["choices"][0]["text"])
                finish = ch["choices"][0]["finish_reason"] or finish
                if len(pieces) == k:
                    interrupt(sid)
    return sid, "".join(pieces), finish


@pytest.mark.parametrize("rewind", [False, True])
def test_interrupt_and_resume_over_http_equal_engine_resume(server, tmp_path, rewind):
    """Interrupt a stream at a random token, resume it with an instruction (and a rewind): the
    tokens equal `Engine.resume` from a snapshot at that token, and the audit chain replays."""
    from gemini_jax.session import verify

    seed = SEED + 10 + rewind
    rng = np.random.default_rng(seed)
    tok = gj.ByteTokenizer()
    state = server.state
    prompt = _prompts(1, seed)[0]
    k = int(rng.integers(3, 20))
    got = {}

    def interrupt(sid):
        r = httpx.post(f"{server.url}/v1/sessions/{sid}/interrupt", timeout=60)
        got["interrupt"] = r

    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 200, "temperature": 0, "stream": True}
    sid, text, finish = _stream_until(server, body, k, interrupt)
    r = got["interrupt"]
    assert r.status_code == 200, r.text
    assert finish == "interrupted"
    t, position = r.json()["generated_tokens"], r.json()["position"]
    assert t >= k and position == len(tok.encode(prompt)) + t

    instruction = "\n# now in French\n"
    rewind_to = int(rng.integers(1, position + 1)) if rewind else None
    resumed = httpx.post(f"{server.url}/v1/sessions/{sid}/resume", timeout=120, json={
        "instruction": instruction, "rewind_to": rewind_to, "max_tokens": 24, "temperature": 0}).json()
    assert resumed["object"] == "text_completion", resumed

    _wait_idle(state)
    with state.worker.lock:  # the engine-level reference, on the same engine while the server idles
        params = gj.SamplingParams(max_new_tokens=200, temperature=0.0)
        sess = state.engine.start(tok.encode(prompt), params)
        first = [next(sess) for _ in range(t)]
        path = str(tmp_path / "ref")
        sess.snapshot(path)
        sess.close()
        again = state.engine.resume(path, tok.encode(instruction), rewind_to=rewind_to,
                                    params=gj.SamplingParams(max_new_tokens=24, temperature=0.0))
        want = again.run()
        again.close()
        ok, msg = verify(state.sessions.audit_path, state.engine)
    assert tok.decode(first) == text, f"seed {seed}: the interrupted stream differs from the engine's tokens"
    assert resumed["choices"][0]["text"] == tok.decode(want), f"seed {seed}: resume differs from Engine.resume"
    assert ok and "replayed" in msg, msg


def test_session_errors(server):
    r = httpx.post(f"{server.url}/v1/sessions/cmpl-nope/interrupt")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    done = httpx.post(server.url + "/v1/completions", timeout=60,
                      json={"model": MODEL_ID, "prompt": "x = 1", "max_tokens": 2}).json()
    r = httpx.post(f"{server.url}/v1/sessions/{done['id']}/resume", json={"instruction": "y"})
    assert r.status_code == 404  # an ended request is not kept


def test_the_command_line_server_starts_with_hydra_overrides(tmp_path):
    """`python -m gemini_jax.serve` with Hydra overrides serves the shipped model under its id;
    a misspelt serve knob is refused by name before anything listens."""
    import os
    import socket
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "gemini_jax.serve", f"serve.port={port}", "serve.model_id=tiny-test",
           "engine.max_seq_len=256", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except httpx.HTTPError:
                assert time.time() < deadline, "the server did not answer within 120 s"
                time.sleep(0.5)
        assert [m["id"] for m in r.json()["data"]] == ["tiny-test"]
        c = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "tiny-test", "prompt": "import ", "max_tokens": 3, "temperature": 0}).json()
        assert c["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    # At the default log_level (INFO) the server logs its own lines; libraries (absl: Orbax) stay at WARNING.
    noise = [line for line in proc.stdout.read().splitlines() if "[absl][INFO]" in line]
    assert not noise, noise[:5]
    bad = subprocess.run([*cmd[:3], "serve.preempt=drop", f"hydra.run.dir={tmp_path / 'bad'}"], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "serve.preempt" in bad.stdout + bad.stderr


def test_an_interrupted_session_expires_after_its_ttl_and_the_404_says_where_its_snapshot_is(server, tmp_path):
    from gemini_jax.serve.request import Request
    from gemini_jax.serve.sessions import Sessions

    now = [100.0]
    s = Sessions(None, str(tmp_path / "state"), ttl_s=60, clock=lambda: now[0])
    reqs = {sid: Request(sid, [1, 2], gj.SamplingParams()) for sid in ("a", "b", "c")}
    for sid, r in reqs.items():
        s.add(sid, r)
    reqs["a"].finish_reason = reqs["b"].finish_reason = "interrupted"
    reqs["c"].finish_reason = "length"
    s.ended("a", reqs["a"])
    now[0] += 30
    s.ended("b", reqs["b"])
    s.ended("c", reqs["c"])  # not interrupted: forgotten at once
    assert s.get("c") is None and s.parked == 2
    now[0] += 31  # a parked 61 s (> 60), b 31 s
    assert s.get("a") is None and s.get("b") is reqs["b"] and s.parked == 1 and s.expired == {"a": None}
    s.add("b", reqs["b"])  # resumed under its id: no longer parked
    now[0] += 1000
    assert s.get("b") is reqs["b"] and s.parked == 0

    # Over HTTP: an interrupted, snapshotted stream expires; its 404 names the snapshot.
    state = server.state
    got = {}
    body = {"model": MODEL_ID, "prompt": _prompts(1, SEED + 40)[0], "max_tokens": 200, "temperature": 0,
            "stream": True}
    sid, _, finish = _stream_until(server, body, 3, lambda sid: got.setdefault(
        "r", httpx.post(f"{server.url}/v1/sessions/{sid}/interrupt", timeout=60)))
    assert finish == "interrupted" and got["r"].status_code == 200, got["r"].text
    path = httpx.post(f"{server.url}/v1/sessions/{sid}/snapshot", timeout=60).json()["path"]
    clock, ttl = state.sessions._clock, state.sessions.ttl_s
    try:
        state.sessions.ttl_s, state.sessions._clock = 5.0, lambda: clock() + 10.0
        r = httpx.post(f"{server.url}/v1/sessions/{sid}/resume", json={"instruction": "y"})
    finally:
        state.sessions.ttl_s, state.sessions._clock = ttl, clock
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_expired", r.text
    assert path in r.json()["error"]["message"] and os.path.isdir(path)


def test_text_stream_sends_what_one_decode_gives_and_decodes_each_token_a_bounded_number_of_times():
    from gemini_jax.serve.http import TextStream

    seed = 77
    rng = np.random.default_rng(seed)
    tok = gj.ByteTokenizer()
    text = "".join(rng.choice(list("ab= \n()éλ中🙂")) for _ in range(300))  # 1- to 4-byte characters
    tokens = tok.encode(text)
    decoded = []

    class Counting:
        def decode(self, ids):
            decoded.append(len(ids))
            return tok.decode(ids)

    stream = TextStream(Counting())
    pieces = [stream.push(t) for t in tokens] + [stream.push(None, final=True)]
    assert "".join(pieces) == stream.sent == tok.decode(tokens) == text, f"seed={seed}"
    assert all("\ufffd" not in p for p in pieces), f"seed={seed}: half a character was sent"
    assert sum(decoded) <= 10 * len(tokens), f"seed={seed}: {sum(decoded)} tokens decoded for {len(tokens)}"


def test_the_load_generator_streams_the_engine_tokens_on_its_own_client_or_a_shared_one(server):
    """`serve.load.run_streams`: every stream gets as many tokens as the engine's greedy run, timed,
    whether the call makes its client or is given one (which stays open for the next call)."""
    import asyncio

    from gemini_jax.serve.load import run_streams, summarize

    tok = gj.ByteTokenizer()
    prompts = [list(tok.encode(p)) for p in _prompts(3, seed=SEED + 7)]
    want = [_engine_text(server, p, 6)[1] for p in prompts]

    async def shared():
        async with httpx.AsyncClient() as c:
            first = await run_streams(server.url, prompts[:2], max_tokens=6, model=MODEL_ID, client=c)
            again = await run_streams(server.url, prompts[2:], max_tokens=6, model=MODEL_ID, client=c)
            assert not c.is_closed, "a caller's client is the caller's to close"
        return first + again

    own = asyncio.run(run_streams(server.url, prompts, max_tokens=6, model=MODEL_ID))
    for res in (own, asyncio.run(shared())):
        for r, w in zip(res, want):
            assert r.error is None and r.status == 200, (r.status, r.error, f"seed {SEED + 7}")
            assert len(r.token_times) == len(w) and r.completion_tokens == len(w), f"seed {SEED + 7}"
            assert r.ttft is not None and r.ttft > 0 and r.t_end >= r.token_times[-1]
        s = summarize(res)
        assert s["failed"] == 0 and s["output_tokens"] == sum(len(w) for w in want)


def test_a_pretrained_gguf_is_served_as_a_chat_model_with_its_template():
    """SmolLM2 served under its name: a chat's prompt is the file's own template (the ids
    `apply_chat_template` gives), the answer is the engine's greedy continuation of those ids, and
    its EOS (<|im_end|>) ends it."""
    model, tok = gj.load_pretrained("smollm2-135m-instruct")
    eng = _engine(model, max_seq_len=256, prefill_chunk=64, max_batch=2, cache=dict(block_size=16, num_pages=40))
    live = LiveServer(create_app(eng, tok, ServeConfig(model_id="smollm2-135m-instruct")))
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="anything", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is the capital of France? One word."}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)
        with live.state.worker.lock:
            want = eng.generate(ids, gj.SamplingParams(max_new_tokens=12, temperature=0.0)).tokens
        got = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=12,
                                             temperature=0)
        assert got.usage.prompt_tokens == len(ids)
        assert got.choices[0].message.content == tok.decode([t for t in want if t != tok.eos_id]), (want, got)
        assert got.choices[0].finish_reason == ("stop" if want[-1] == tok.eos_id else "length")
        assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]
    finally:
        live.close()
        eng.close()
