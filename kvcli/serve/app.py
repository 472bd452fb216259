"""`kvcli serve`'s HTTP side (FastAPI on uvicorn): OpenAI's routes and llama-server's extras over the
engine, server-sent events, OpenAI error objects, the API key, start and shutdown. The request bodies
are kvcli/serve/schemas.py, /metrics is kvcli/serve/metrics.py.

Every error a client can cause is one JSON body {"error": {"message", "type", "code"[, "param"]}}:
400 for bad input (FastAPI's 422 included), 401 for the key, 503 while loading or when the queue is
full; an unexpected failure is a 500 with a one-line message (the traceback goes to the server log).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import socket
import threading
import time
import uuid
import weakref
from importlib import resources
from pathlib import Path
from typing import Callable

import uvicorn
from fastapi import Body, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from kvcli.errors import KvcliError
from kvcli.serve import metrics, slot_files
from kvcli.serve.engine import Done, Engine, Failed, Piece, QueueFull, Request as Job, timings
from kvcli.serve.schemas import ApiError, ChatBody, CompletionBody, DetokenizeBody, Sampling, TokenizeBody

log = logging.getLogger("kvcli.serve")
PUBLIC = {"/", "/health", "/v1/health", "/models", "/v1/models"}  # open without the key, as llama-server's
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 409: "invalid_request_error", 500: "server_error",
               501: "not_supported_error", 503: "unavailable_error"}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "code": status}
    if param:
        body["param"] = param
    return JSONResponse({"error": body}, status_code=status)


# ---- the server object the routes share ----

class Server:
    """What the routes read: the engine (None while the model loads) and the facts /props gives."""

    def __init__(self, model_name: str, n_ctx: int, n_slots: int, spec, api_key: str | None,
                 slot_save_path: Path | None = None):
        self.model_name, self.n_ctx, self.n_slots, self.spec, self.api_key = model_name, n_ctx, n_slots, spec, api_key
        self.slot_save_path = slot_save_path  # --slot-save-path: where /slots/{id}?action=save|restore keep files
        self.engine: Engine | None = None
        self.created = int(time.time())

    def ready(self) -> Engine:
        if self.engine is None:
            raise ApiError(503, "Loading model")
        return self.engine


class Mailbox:
    """Events from the engine thread to the event loop's queues, one loop wakeup for all that a step posts: a step of
    four streams woke the loop four times (four self-pipe writes, four turns of the GIL between the threads)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.lock, self.items, self.posted = loop, threading.Lock(), [], False

    def post(self, queue: asyncio.Queue, event) -> None:  # on the engine thread
        with self.lock:
            self.items.append((queue, event))
            if self.posted:
                return
            self.posted = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass

    def _deliver(self) -> None:  # on the loop
        with self.lock:
            items, self.items, self.posted = self.items, [], False
        for queue, event in items:
            queue.put_nowait(event)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _token_text(tok, i: int) -> tuple[str, list[int]]:
    b = tok.token_to_bytes(i)
    return b.decode("utf-8", errors="replace"), list(b)


def _chat_logprobs(tok, items: list[dict]) -> dict:
    def entry(i, lp):
        text, b = _token_text(tok, i)
        return {"token": text, "logprob": lp, "bytes": b}
    return {"content": [entry(x["id"], x["logprob"]) | {"top_logprobs": [entry(i, lp) for i, lp in x["top"]]}
                        for x in items]}


def _completion_logprobs(tok, items: list[dict]) -> dict:
    return {"tokens": [_token_text(tok, x["id"])[0] for x in items], "token_logprobs": [x["logprob"] for x in items],
            "top_logprobs": [{_token_text(tok, i)[0]: lp for i, lp in x["top"]} for x in items]}


def create_app(server: Server) -> FastAPI:
    async def check_key(request: Request) -> None:  # async: on the loop, not a worker thread a request
        if server.api_key is None or request.url.path in PUBLIC:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), server.api_key.encode()):
            raise ApiError(401, "Invalid API Key")

    app = FastAPI(title="kvcli", dependencies=[Depends(check_key)], docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):  # FastAPI's 422 -> OpenAI's 400
        first = e.errors()[0]
        if first.get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        return error_response(400, f"{where or 'body'}: {first.get('msg', 'invalid')}", where or None)

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(KvcliError)
    async def _kvcli(request, e: KvcliError):
        return error_response(400, str(e))

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):
        log.exception("unexpected error in %s", request.url.path)
        return error_response(500, f"internal error: {type(e).__name__}: {e}")

    @app.get("/health")
    @app.get("/v1/health")
    def health():
        if server.engine is None:
            return JSONResponse({"status": "loading", "error": {"code": 503, "message": "Loading model",
                                                                "type": "unavailable_error"}}, status_code=503)
        return {"status": "ok"}

    @app.get("/")
    def page():
        page = resources.files("kvcli.serve").joinpath("chat.html")
        if not page.is_file():
            raise ApiError(404, "the chat page (kvcli/serve/chat.html) is not installed")
        return HTMLResponse(page.read_text(encoding="utf-8"))

    @app.get("/models")
    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "kvcli"}]}

    @app.get("/props")
    def props():
        e, s = server.ready(), server.spec
        kv = s.mode == "kv"
        return {"model": server.model_name, "total_slots": server.n_slots, "n_ctx": server.n_ctx,
                "n_ctx_slot": e.n_ctx_slot,
                "cache": {"mode": s.mode, "type_k": s.type_k if kv else None, "type_v": s.type_v if kv else None,
                          "type_h": None if kv else s.type_h, "window": s.window} | e.cache_stats(),
                "chat_template": bool(e.tok.chat_template),
                "prompt_cache_ram": e.ram.stats() if e.ram is not None else None}

    @app.get("/slots")
    def get_slots():
        e = server.ready()
        return [{"id": s.index, "n_ctx": e.n_ctx_slot, "is_processing": s.req is not None,
                 "tokens_cached": len(s.cached), "cache_bytes_in_use": s.cells_bytes()[0]} for s in e.slots]

    @app.post("/slots/{id_slot}")
    async def slot_action(id_slot: int, action: str = "", body: dict = Body(default_factory=dict)):
        e = server.ready()
        if action not in slot_files.ACTIONS:
            raise ApiError(400, f"action {action!r}: choose save, restore or erase", "action")
        if action != "erase" and server.slot_save_path is None:
            raise ApiError(501, "this server keeps no slot files: start it with --slot-save-path DIR")
        if action == "erase":
            work = lambda: slot_files.erase(e, id_slot)  # noqa: E731
        else:
            do = slot_files.save if action == "save" else slot_files.restore
            work = lambda: do(e, id_slot, server.slot_save_path, body.get("filename"))  # noqa: E731
        try:
            return await asyncio.wrap_future(e.call(work))
        except QueueFull as err:
            raise ApiError(503, str(err)) from None

    @app.get("/metrics")
    def get_metrics():
        return PlainTextResponse(metrics.render(server.ready()), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    def tokenize(body: TokenizeBody):
        tok = server.ready().tok
        ids = tok.encode(body.content, add_bos=body.add_special, parse_special=body.parse_special)
        if not body.with_pieces:
            return {"tokens": ids}
        def piece(i):  # as llama-server: the text, or its bytes where a token is part of a character
            b = tok.token_to_bytes(i)
            try:
                return b.decode("utf-8")
            except UnicodeDecodeError:
                return list(b)
        return {"tokens": [{"id": i, "piece": piece(i)} for i in ids]}

    @app.post("/detokenize")
    def detokenize(body: DetokenizeBody):
        return {"content": server.ready().tok.decode(body.tokens)}

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat(body: ChatBody):
        e = server.ready()
        if not e.tok.chat_template:
            raise ApiError(400, "this model has no chat template; use /v1/completions")
        with e.preparing() as ticket:
            await asyncio.sleep(0)  # the requests that came in with this one announce themselves too
            messages = [{"role": m.role, "content": m.content if isinstance(m.content, str) else
                         "".join(p.text for p in m.content or [])} for m in body.messages]
            # as `kvcli run -cnv`: the model's template, then its control tokens parsed
            ids = e.tok.encode(e.tok.apply_chat_template(messages, add_generation_prompt=True), parse_special=True)
            n_top = (body.top_logprobs or 0) if body.logprobs else None
            return await _complete(e, body, ids, n_top, chat=True, ticket=ticket)

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(body: CompletionBody):
        e = server.ready()
        with e.preparing() as ticket:
            await asyncio.sleep(0)  # as chat's
            if isinstance(body.prompt, str):
                ids = e.tok.encode(body.prompt, parse_special=True)  # as `kvcli run -p`
            else:
                ids = list(body.prompt)
                bad = [i for i in ids if not 0 <= i < e.llm.config.vocab_size]
                if bad:
                    raise ApiError(400, f"token id {bad[0]} is outside the vocabulary: ids run "
                                        f"0..{e.llm.config.vocab_size - 1}", "prompt")
            if not ids:
                raise ApiError(400, "the prompt is empty", "prompt")
            return await _complete(e, body, ids, body.logprobs, chat=False, ticket=ticket)

    mailboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a Mailbox per event loop serving

    async def _complete(e: Engine, body: Sampling, ids: list[int], n_top: int | None, chat: bool, ticket=None):
        loop = asyncio.get_running_loop()
        mailbox = mailboxes.get(loop) or mailboxes.setdefault(loop, Mailbox(loop))
        queue: asyncio.Queue = asyncio.Queue()
        job = Job(ids, lambda event: mailbox.post(queue, event), body.sampler(e.eog), body.limit(), body.stops(),
                  n_top)
        try:
            e.submit(job, ticket)
        except QueueFull as err:
            raise ApiError(503, str(err)) from None
        except KvcliError as err:
            raise ApiError(400, str(err), "messages" if chat else "prompt") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": server.model_name}

        def usage(d: Done) -> dict:
            return {"prompt_tokens": len(ids), "completion_tokens": d.predicted_n,
                    "total_tokens": len(ids) + d.predicted_n}

        def logprobs(items):
            if n_top is None or not items:
                return None
            return _chat_logprobs(e.tok, items) if chat else _completion_logprobs(e.tok, items)

        def choice(text: str | None, items, finish: str | None) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                return {"index": 0, "delta": delta, "logprobs": logprobs(items), "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": logprobs(items), "finish_reason": finish}

        if body.stream:
            async def events():
                try:
                    if chat:
                        yield _sse(head | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}]})
                    while True:
                        ev = await queue.get()
                        if isinstance(ev, Piece):
                            yield _sse(head | {"choices": [choice(ev.text, ev.logprobs, None)]})
                        elif isinstance(ev, Done):
                            yield _sse(head | {"choices": [choice(None, [], ev.finish_reason)], "usage": usage(ev),
                                               "timings": timings(ev)})
                            break
                        else:  # Failed: an error event, as llama-server's
                            yield _sse({"error": {"message": ev.message, "type": ERROR_TYPES.get(ev.code, "server_error"),
                                                  "code": ev.code}})
                            break
                    yield "data: [DONE]\n\n"
                finally:  # the stream ended or the client left: the engine frees the slot at its next step
                    job.cancelled = True

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        text, items = [], []
        try:
            while True:
                ev = await queue.get()
                if isinstance(ev, Piece):
                    text.append(ev.text)
                    items += ev.logprobs
                elif isinstance(ev, Failed):
                    raise ApiError(ev.code, ev.message)
                else:
                    break
        finally:
            job.cancelled = True
        out = "".join(text)
        if chat:
            first = {"index": 0, "message": {"role": "assistant", "content": out}, "logprobs": logprobs(items),
                     "finish_reason": ev.finish_reason}
        else:
            first = {"index": 0, "text": out, "logprobs": logprobs(items), "finish_reason": ev.finish_reason}
        obj = "chat.completion" if chat else "text_completion"
        return head | {"object": obj, "choices": [first], "usage": usage(ev), "timings": timings(ev)}

    return app


class _Uvicorn(uvicorn.Server):
    """uvicorn, with SIGINT/SIGTERM also stopping the engine (its streams end) and no re-raised signal
    after the graceful shutdown, so the process exits 0."""

    def __init__(self, config, on_exit: Callable[[], None]):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for connections
        self.should_exit = True
        self.on_exit()


def serve(load: Callable[[], Engine], server: Server, host: str, port: int, say: Callable[[str], None]) -> int:
    """Listen on host:port at once (/health answers 503 while loading), load the engine in its own
    thread, which then runs it; return the exit code when a signal or a failed load stops the server."""
    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise KvcliError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    config = uvicorn.Config(create_app(server), log_level="info", timeout_graceful_shutdown=10,
                            timeout_keep_alive=5)
    failed: list[str] = []

    def stop_engine() -> None:
        if server.engine is not None:
            server.engine.stop()

    uv = _Uvicorn(config, stop_engine)

    def work() -> None:
        try:
            engine = load()
        except KvcliError as e:
            failed.append(str(e))
            uv.should_exit = True
            return
        server.engine = engine
        if uv.should_exit:  # a signal came while loading
            return
        say(engine.describe())
        say("model loaded; all slots idle")
        engine.run()
        if engine.fatal is not None:  # a pipeline rank lost: the server cannot answer any more
            failed.append(engine.fatal)
            uv.should_exit = True

    say(f"listening on http://{host}:{port}" if ":" not in host else f"listening on http://[{host}]:{port}")
    thread = threading.Thread(target=work, name="kvcli-engine", daemon=True)
    thread.start()
    uv.run(sockets=[sock])
    stop_engine()
    thread.join(timeout=10)
    if failed:
        raise KvcliError(failed[0])
    return 0
