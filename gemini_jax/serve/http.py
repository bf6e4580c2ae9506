"""The OpenAI-compatible HTTP app (Starlette): `/v1/models`, `/v1/completions`,
`/v1/chat/completions` (with SSE streaming and usage), `/metrics`, and interruptible sessions:
`POST /v1/sessions/{id}/interrupt | snapshot | resume`, `DELETE /v1/sessions/{id}` (the id is the
completion's).

    app = create_app(engine, tokenizer, ServeConfig())     # then uvicorn.run(app, ...)

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a request
that cannot run (bad JSON or field, too long for the context), 401 for a missing or unknown key
(when `serve.api_keys` is set), 404 for an unknown model, 429 when a quota would be passed,
503 when the queue is full. Extensions beyond OpenAI's fields: `priority` (int, lower runs first)
and `ignore_eos` (bool, generate max_tokens tokens whatever comes) in a request body,
`compute_units` in `usage`, finish_reason "interrupted" for a stream stopped by an interrupt.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Optional

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gemini_jax.config import SamplingParams, ServeConfig
from gemini_jax.errors import AuthError, ContextLengthError, QuotaExceeded, SamplingError, SnapshotError, TokenError
from gemini_jax.serve.metrics import CONTENT_TYPE, Metrics
from gemini_jax.serve.quotas import Quotas, Tenant
from gemini_jax.serve.request import Request
from gemini_jax.serve.scheduler import Scheduler
from gemini_jax.serve.sessions import Sessions, Turn
from gemini_jax.serve.worker import Worker

DEFAULT_MAX_TOKENS = 16  # /v1/completions' default, as OpenAI's
INTERRUPT_WAIT_S = 60  # an interrupt waits this long for the request's next token boundary


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", *,
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def chat_prompt(messages) -> str:
    """The chat template: each message as `<|role|>` + content on its own lines, then the
    assistant's turn. (The shipped byte-level model was not trained on chat: it continues the text.)"""
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(parts) + "<|assistant|>\n"


def chat_tokens(tokenizer, messages) -> list:
    """A chat's prompt ids: the model's own template when its tokenizer carries one (a pretrained
    GGUF: `GGUFTokenizer.apply_chat_template`, generation prompt added), else `chat_prompt`."""
    if hasattr(tokenizer, "apply_chat_template"):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return tokenizer.encode(chat_prompt(messages))


class TextStream:
    """Text of the generated tokens as it becomes final: a trailing replacement character (a
    multi-byte character cut between tokens) is held back until the next token completes it.

    Each push decodes only the tokens since the last text sent, with the tokens of that text as
    context (a tokenizer may decode a token differently at the start of a string), so a stream of
    n tokens costs O(n) decoding, not O(n^2). `stop`: a token that ends the answer and is not text
    (the model's EOS when the request stops at it: a chat model's `<|im_end|>` is not content)."""

    def __init__(self, tokenizer, stop: Optional[int] = None):
        self.tokenizer, self.stop = tokenizer, stop
        self.tokens: list[int] = []
        self._context = 0  # tokens[_context:_sent] decode to the last text sent: context for the next
        self._sent = 0     # tokens before it are sent
        self._pieces: list[str] = []

    @property
    def sent(self) -> str:
        """The text sent so far."""
        return "".join(self._pieces)

    def push(self, token: Optional[int], final: bool = False) -> str:
        if token is not None and token != self.stop:
            self.tokens.append(token)
        before = self.tokenizer.decode(self.tokens[self._context:self._sent])
        text = self.tokenizer.decode(self.tokens[self._context:])
        if not final and (text.endswith("\ufffd") or len(text) <= len(before) or not text.startswith(before)):
            return ""  # an unfinished character, or nothing new: wait for the next token
        self._context, self._sent = self._sent, len(self.tokens)
        self._pieces.append(text[len(before):] if text.startswith(before) else text)
        return self._pieces[-1]


class Server:
    """What the app's routes share: the worker (scheduler thread), the tokenizer, quotas, metrics."""

    def __init__(self, engine, tokenizer, config: ServeConfig):
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.quotas = Quotas.open(config.api_keys)
        self.scheduler = Scheduler(engine, config)
        self.worker = Worker(self.scheduler)
        self.metrics = Metrics(self.worker)
        self.sessions = Sessions(engine, config.state_dir, ttl_s=config.session_ttl_s)
        self.layers = engine.model_cfg.num_layers

    def close(self) -> None:
        self.worker.close()
        self.sessions.close()

    # ---- checks -----------------------------------------------------------------------------------
    def tenant(self, http: HttpRequest) -> Optional[Tenant]:
        if self.quotas is None:
            return None  # no keys configured: any key (or none) is served, with no quotas
        auth = http.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        try:
            return self.quotas.tenant_of(key)
        except AuthError as e:
            raise ApiError(401, f"{e}", "authentication_error", code="invalid_api_key") from None

    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model != self.config.model_id:
            raise ApiError(404, f"The model {model!r} does not exist; this server serves {self.config.model_id!r}.",
                           param="model", code="model_not_found")

    def sampling(self, body: dict, default_max: int) -> SamplingParams:
        for name in ("n", "best_of"):
            if body.get(name, 1) not in (1, None):
                raise ApiError(400, f"{name}={body[name]!r}: only one choice per request is supported.", param=name)
        for name in ("stop", "logprobs", "tools", "functions", "suffix", "echo"):
            if body.get(name) not in (None, False, []):
                raise ApiError(400, f"{name!r} is not supported by this server.", param=name)
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens", default_max))
        if max_tokens is None:
            max_tokens = default_max
        try:
            seed = body.get("seed")
            return SamplingParams(max_new_tokens=_int(max_tokens, "max_tokens"),
                                  temperature=_number(body.get("temperature", 1.0), "temperature"),
                                  top_p=_number(body.get("top_p", 1.0), "top_p"),
                                  top_k=_int(body.get("top_k", 0), "top_k"),
                                  seed=0 if seed is None else _int(seed, "seed"),
                                  stop_at_eos=not body.get("ignore_eos", False))
        except SamplingError as e:
            raise ApiError(400, str(e)) from None

    # ---- a request through the scheduler ----------------------------------------------------------
    def start(self, req: Request, body: dict, tenant: Optional[Tenant], loop: asyncio.AbstractEventLoop,
              prefix: str, turn: Optional[Turn] = None) -> tuple[str, asyncio.Queue]:
        """Check `req`, reserve its units, and hand it to the worker; returns its API id and the
        queue its tokens arrive on (None at the end). A resumed `turn` is audited when it ends."""
        try:
            self.scheduler.check(req.tokens, req.params)
        except ContextLengthError as e:
            raise ApiError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
        except TokenError as e:
            raise ApiError(400, str(e), param="prompt") from None
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise ApiError(503, f"{len(self.scheduler.waiting)} requests are queued (serve.max_waiting="
                                f"{self.config.max_waiting}); retry later.", "server_error", code="overloaded")
        priority = body.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ApiError(400, f"priority={priority!r} must be an integer (lower runs first).", param="priority")
        units = (len(req.tokens) + req.params.max_new_tokens) * self.layers
        if tenant is not None:
            try:
                self.quotas.reserve(tenant, units)
            except QuotaExceeded as e:
                raise ApiError(429, str(e), "insufficient_quota", code="insufficient_quota") from None
        out: asyncio.Queue = asyncio.Queue()
        api_id = f"{prefix}-{uuid.uuid4().hex[:24]}"

        def sink(r: Request, token: Optional[int]) -> None:  # the scheduler's thread
            if token is None:
                if tenant is not None:
                    self.quotas.settle(tenant, units, r.compute_units)
                self.metrics.finished(r)
                if turn is not None:
                    self.sessions.record(turn, r)
                self.sessions.ended(api_id, r)
            loop.call_soon_threadsafe(out.put_nowait, token)

        req.rid, req.priority, req.tenant, req.sink = api_id, priority, tenant.name if tenant else "", sink
        self.sessions.add(api_id, req)
        self.worker.submit(req)
        return api_id, out

    def stop_token(self, req: Request) -> Optional[int]:
        """The token that ends `req` without being text: the model's EOS, when the request stops there."""
        return self.engine.model_cfg.eos_id if req.params.stop_at_eos else None

    async def respond(self, req: Request, out: asyncio.Queue, api_id: str, body: dict, *, chat: bool):
        """The completion (or chat completion) response: streamed as SSE, or whole at the end."""
        created = int(time.time())
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            return StreamingResponse(_stream(self, req, out, api_id, created, chat, bool(opts.get("include_usage"))),
                                     media_type="text/event-stream")
        text = TextStream(self.tokenizer, self.stop_token(req))
        try:
            while (tok := await out.get()) is not None:
                text.push(tok)
        finally:
            if not req.finished:
                self.worker.cancel(req)
        if req.finish_reason == "error":
            raise ApiError(500, f"generation failed: {req.error}", "server_error")
        content = text.sent + text.push(None, final=True)
        choice = ({"index": 0, "message": {"role": "assistant", "content": content}} if chat else
                  {"index": 0, "text": content, "logprobs": None})
        choice["finish_reason"] = req.finish_reason
        return JSONResponse({"id": api_id, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": self.config.model_id, "choices": [choice],
                             "usage": _usage(req)})

    def session(self, http: HttpRequest) -> tuple[str, Request]:
        sid = http.path_params["sid"]
        req = self.sessions.get(sid)
        if req is None and sid in self.sessions.expired:
            path = self.sessions.expired[sid]
            raise ApiError(404, f"session {sid!r} expired: it waited longer than serve.session_ttl_s="
                                f"{self.config.session_ttl_s:g} s after its interrupt"
                                + (f"; its snapshot is at {path} (Engine.resume reads it)." if path else
                                   " and no snapshot was taken."), param="id", code="session_expired")
        if req is None:
            raise ApiError(404, f"no session {sid!r}: it ended without an interrupt, was deleted, or never existed.",
                           param="id", code="session_not_found")
        return sid, req


def _int(v, name: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise ApiError(400, f"{name}={v!r} must be an integer.", param=name)
    return v


def _number(v, name: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ApiError(400, f"{name}={v!r} must be a number.", param=name)
    return float(v)


async def _body(http: HttpRequest) -> dict:
    try:
        body = json.loads(await http.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"The body is not valid JSON: {e}.") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The body must be a JSON object.")
    return body


def _usage(req: Request) -> dict:
    return {"prompt_tokens": req.prompt_len, "completion_tokens": req.new_tokens,
            "total_tokens": req.prompt_len + req.new_tokens, "compute_units": req.compute_units}


def create_app(engine, tokenizer, config: ServeConfig | None = None) -> Starlette:
    """The ASGI app over `engine` (its scheduler thread starts now and stops with the app)."""
    config = config or ServeConfig()
    server = Server(engine, tokenizer, config)

    def errors(handler):
        async def wrapped(http: HttpRequest):
            try:
                return await handler(http)
            except ApiError as e:
                return e.response()
        return wrapped

    async def models(http: HttpRequest):
        server.tenant(http)
        return JSONResponse({"object": "list", "data": [
            {"id": config.model_id, "object": "model", "created": 0, "owned_by": "gemini_jax"}]})

    async def completions(http: HttpRequest):
        return await _generate(http, chat=False)

    async def chat_completions(http: HttpRequest):
        return await _generate(http, chat=True)

    async def _generate(http: HttpRequest, *, chat: bool):
        tenant = server.tenant(http)
        body = await _body(http)
        server.check_model(body)
        if chat:
            messages = body.get("messages")
            if (not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages)):
                raise ApiError(400, "messages must be a non-empty list of {role, content} objects with string "
                                    "content.", param="messages")
            tokens = chat_tokens(tokenizer, messages)
        else:
            tokens = _prompt_tokens(body.get("prompt"), tokenizer)
        params = server.sampling(body, DEFAULT_MAX_TOKENS if not chat else
                                 max(1, min(256, engine.config.max_seq_len - len(tokens))))
        req = Request("", list(tokens), params)
        api_id, out = server.start(req, body, tenant, asyncio.get_running_loop(), "chatcmpl" if chat else "cmpl")
        return await server.respond(req, out, api_id, body, chat=chat)

    # ---- interrupt, snapshot, resume --------------------------------------------------------------
    async def interrupt(http: HttpRequest):
        server.tenant(http)
        sid, req = server.session(http)
        if req.finished and req.finish_reason != "interrupted":
            raise ApiError(409, f"session {sid} already ended ({req.finish_reason}).", code="session_ended")
        server.worker.interrupt(req)
        deadline = time.time() + INTERRUPT_WAIT_S
        while not req.finished:
            if time.time() > deadline:
                raise ApiError(504, f"session {sid} did not reach a token boundary within {INTERRUPT_WAIT_S} s.",
                               "server_error")
            await asyncio.sleep(0.005)
        if req.finish_reason != "interrupted":
            raise ApiError(409, f"session {sid} ended ({req.finish_reason}) before the interrupt took effect.",
                           code="session_ended")
        return JSONResponse({"id": sid, "object": "session", "status": "interrupted",
                             "position": len(req.image.tokens), "generated_tokens": req.new_tokens})

    async def snapshot(http: HttpRequest):
        server.tenant(http)
        sid, req = server.session(http)
        try:
            path, digest = await asyncio.to_thread(server.sessions.snapshot, sid, req)
        except SnapshotError as e:
            raise ApiError(409, str(e), code="session_not_interrupted") from None
        return JSONResponse({"id": sid, "object": "session.snapshot", "path": path, "snapshot_hash": digest})

    async def resume(http: HttpRequest):
        tenant = server.tenant(http)
        sid, old = server.session(http)
        body = await _body(http)
        if body.get("model", config.model_id) != config.model_id:
            server.check_model(body)
        if old.finish_reason != "interrupted":
            raise ApiError(409, f"session {sid} is not interrupted ({old.finish_reason or old.phase.value}); "
                                f"interrupt it first.", code="session_not_interrupted")
        text = body.get("instruction")
        if text is not None and not isinstance(text, str):
            raise ApiError(400, "instruction must be a string.", param="instruction")
        instruction = tokenizer.encode(text) if text else list(body.get("instruction_tokens") or [])
        rewind_to = body.get("rewind_to")
        if rewind_to is not None:
            _int(rewind_to, "rewind_to")
        params = server.sampling(body, DEFAULT_MAX_TOKENS)
        try:
            req, turn = await asyncio.to_thread(server.sessions.turn, sid, old, instruction, rewind_to, params, text)
        except ValueError as e:
            raise ApiError(400, str(e), param="rewind_to") from None
        api_id, out = server.start(req, body, tenant, asyncio.get_running_loop(), "cmpl", turn)
        return await server.respond(req, out, api_id, body, chat=False)

    async def delete(http: HttpRequest):
        server.tenant(http)
        sid, _ = server.session(http)
        server.sessions.delete(sid)
        return JSONResponse({"id": sid, "object": "session", "deleted": True})

    async def metrics(http: HttpRequest):
        # In a thread: a scrape waits for the scheduler's step to end, the event loop must not.
        return Response(await asyncio.to_thread(server.metrics.render), media_type=CONTENT_TYPE)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        server.close()

    app = Starlette(routes=[
        Route("/v1/models", errors(models), methods=["GET"]),
        Route("/v1/completions", errors(completions), methods=["POST"]),
        Route("/v1/chat/completions", errors(chat_completions), methods=["POST"]),
        Route("/v1/sessions/{sid}/interrupt", errors(interrupt), methods=["POST"]),
        Route("/v1/sessions/{sid}/snapshot", errors(snapshot), methods=["POST"]),
        Route("/v1/sessions/{sid}/resume", errors(resume), methods=["POST"]),
        Route("/v1/sessions/{sid}", errors(delete), methods=["DELETE"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], lifespan=lifespan)
    app.state.server = server
    return app


def _prompt_tokens(prompt, tokenizer) -> list:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt is empty.", param="prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise ApiError(400, "prompt must be a non-empty string or a list of token ids (one prompt per request).",
                   param="prompt")


async def _stream(server: Server, req: Request, out: asyncio.Queue, rid: str, created: int, chat: bool,
                  include_usage: bool):
    """SSE chunks as tokens arrive; a client that goes away cancels the request (its pages are freed)."""
    model = server.config.model_id
    kind = "chat.completion.chunk" if chat else "text_completion"
    text = TextStream(server.tokenizer, server.stop_token(req))

    def chunk(delta: Optional[str], finish: Optional[str], *, role: bool = False) -> str:
        if chat:
            d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": d, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        body = {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    try:
        if chat:
            yield chunk(None, None, role=True)
        while (tok := await out.get()) is not None:
            delta = text.push(tok)
            if delta:
                yield chunk(delta, None)
        if req.finish_reason == "error":
            err = {"error": {"message": f"generation failed: {req.error}", "type": "server_error", "param": None,
                             "code": None}}
            yield f"data: {json.dumps(err)}\n\n"
            return
        rest = text.push(None, final=True)
        yield chunk(rest or (None if chat else ""), req.finish_reason)
        if include_usage:
            body = {"id": rid, "object": kind, "created": created, "model": model, "choices": [], "usage": _usage(req)}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not req.finished:
            server.worker.cancel(req)
