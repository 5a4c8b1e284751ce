"""The FastAPI application: OpenAI's routes over a Predictor and its batching engine.

  GET  /health                  200 once the model is loaded and compiled
  GET  /v1/models               the model served, and its named adapters (adapters.py)
  POST /v1/completions          prompt(s) -> text (text families)
  POST /v1/chat/completions     messages -> reply (text families)
  POST /v1/classifications      texts -> label and probabilities (classifiers)

Every error answers with OpenAI's error object: 400 for a request the model cannot answer as
asked (validated before anything is queued), 401 without the API key, 429 when the queue is
full. Prompts are encoded and outputs decoded on the event loop (tokenizers are not shared
between threads); only decoding runs on the engine's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import functools
import json
import math
import secrets
from typing import Any, AsyncIterator

from absl import logging
import fastapi
from fastapi import exceptions as fastapi_exceptions
from fastapi import responses
import numpy as np
from starlette import exceptions as starlette_exceptions

from transformer_jax.serving import batch_decoder
from transformer_jax.serving import engine as engine_lib
from transformer_jax.serving import protocol
from transformer_jax.serving import texts
from transformer_jax.serving import token_scores


class Service:
  """What the routes need: the model's texts, its limits and the engine."""

  def __init__(self, predictor, engine: engine_lib.Engine, name: str):
    self.predictor = predictor
    self.engine = engine
    self.name = name
    self.created = protocol.now()
    self.decoder = engine.decoder
    self.classifier = self.decoder.classifier
    self.prompts = texts.Prompts(predictor)
    self.tokenizer = predictor.tokenizer
    self.max_n = predictor.config.serve.max_n
    self.log_requests = predictor.config.serve.get("log_requests", False)
    self.scorer = None if self.classifier else token_scores.TokenScorer(self.decoder)
    self.adapters = self.decoder.adapters  # named adapters, or None

  def model_cards(self) -> list[dict[str, Any]]:
    """/v1/models: the base, then each named adapter (with its folder and the base, as vLLM
    lists LoRA modules)."""
    max_len = self.predictor.config.model.max_len
    cards = [protocol.model_card(self.name, max_len, self.created)]
    for name, folder in zip(self.adapters.names, self.adapters.folders) if self.adapters else ():
      cards.append(protocol.model_card(name, max_len, self.created, root=folder,
                                       parent=self.name))
    return cards

  def adapter(self, model: str | None) -> int:
    """The named adapter (batch_decoder.Row.adapter) of the model a request names: 0 for the
    base or none named; RequestError for a model not served."""
    if model in (None, self.name):
      return 0
    index = self.adapters.index(model) if self.adapters else None
    if index is None:
      names = ", ".join(repr(card["id"]) for card in self.model_cards())
      raise texts.RequestError(f"The model {model!r} does not exist: this server serves "
                               f"{names} (GET /v1/models).", "model")
    return index

  def check_family(self, classification: bool) -> None:
    if classification != self.classifier:
      route = "/v1/classifications" if self.classifier else "/v1/completions"
      raise texts.RequestError(f"{self.name} is a {self.predictor.family.name} model: use "
                               f"POST {route}.")

  def rows(self, request: protocol.Sampling, prompts: list, max_tokens: int | None
           ) -> tuple[list[batch_decoder.Row], int]:
    """Every (prompt, choice) row of a request, with its settings; and its max_tokens."""
    adapter = self.adapter(request.model)
    unsupported = request.unsupported()
    if unsupported:
      raise texts.RequestError(f"{unsupported} is not supported by this server.", unsupported)
    if request.n > self.max_n:
      raise texts.RequestError(f"n={request.n} is more than this server's limit of "
                               f"{self.max_n} choices (config.serve.max_n).", "n")
    limit = self.decoder.max_new_tokens
    d = self.predictor.config.decoding
    if max_tokens is None:
      max_tokens = min(d.max_decode_len or limit, limit)
    if max_tokens < (0 if getattr(request, "echo", False) else 1) or max_tokens > limit:
      raise texts.RequestError(f"max_tokens={max_tokens} must be in [1, {limit}]: this model "
                               f"generates at most {limit} tokens.", "max_tokens")
    # Settings left out take the model's decoding config where it samples, else greedy.
    sampled = d.method == "sample"
    temperature = request.temperature if request.temperature is not None else (
        d.temperature if sampled else 0.0)
    top_p = request.top_p if request.top_p is not None else (d.top_p if sampled else 1.0)
    top_k = request.top_k if request.top_k is not None else (d.top_k if sampled else 0)
    seed = request.seed if request.seed is not None else secrets.randbits(31)
    extras = self.prompts.row_extras(request, max_tokens, batch_decoder.LOGIT_BIAS_ENTRIES)
    rows = []
    for i, prompt in enumerate(prompts):
      for choice in range(request.n):
        rows.append(batch_decoder.Row(prompt, max_tokens, temperature, max(top_k, 0), top_p,
                                      seed, i, choice, adapter, **extras))
    return rows, max_tokens

  def submit(self, rows: list[batch_decoder.Row]) -> list[concurrent.futures.Future]:
    """Queues `rows`: a future per row (batch_decoder.Output)."""
    try:
      futures = self.engine.submit(rows)
    finally:
      _arrived(self.engine)
    if self.log_requests:
      logging.info("Received request: %d rows queued.", len(rows))
    return futures

  async def run(self, rows: list[batch_decoder.Row]) -> list[batch_decoder.Output]:
    futures = self.submit(rows)
    return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

  async def generate(self, request: protocol.Sampling, prompts: list, max_tokens: int | None
                     ) -> tuple[list[texts.Completion], int]:
    """The completions of every (prompt, choice) in order, and the prompts' token count."""
    rows, max_tokens = self.rows(request, prompts, max_tokens)
    outputs = await self.run(rows) if max_tokens else [
        batch_decoder.Output(np.zeros((0,), np.int32), np.zeros((0,), np.float32))
        for _ in rows]  # echo alone
    return ([texts.completion(self.tokenizer, o.ids, o.logprobs, max_tokens, request.stops)
             for o in outputs], sum(len(p) for p in prompts))

  async def complete(self, request: protocol.CompletionRequest):
    """A completions request's answer (a stream, or the whole response)."""
    given = _prompt_list(request.prompt)
    prompts = [self.prompts.completion(p) for p in given]
    top = request.logprobs or 0
    self.check_scores(request, request.echo, top)
    if request.stream:
      return _streamed(self, request, prompts, request.max_tokens, chat=False)
    choices, prompt_tokens = await self.generate(request, prompts, request.max_tokens)
    echo_scores = request.echo and request.logprobs is not None
    scores = (await self.scores(prompts, choices, request)
              if echo_scores or top else None)
    if request.echo:
      texts_given = [g if isinstance(g, str) else self.tokenizer.decode(p)
                     for g, p in zip(given, prompts)]
      choices = [_echoed(self, c, prompts[i], texts_given[i],
                         scores[i] if scores else None, request.logprobs)
                 for i, c in enumerate(choices)]
    return _answer(self, request, choices, prompt_tokens, chat=False, scores=scores)

  async def chat(self, request: protocol.ChatRequest):
    """A chat completions request's answer (a stream, or the whole response)."""
    prompt = self.prompts.chat(request.chat())
    max_tokens = (request.max_completion_tokens if request.max_completion_tokens is not None
                  else request.max_tokens)
    top = (request.top_logprobs or 0) if request.logprobs else 0
    self.check_scores(request, False, top)
    if request.stream:
      return _streamed(self, request, [prompt], max_tokens, chat=True)
    choices, prompt_tokens = await self.generate(request, [prompt], max_tokens)
    scores = await self.scores([prompt], choices, request) if top else None
    return _answer(self, request, choices, prompt_tokens, chat=True, scores=scores)

  def check_scores(self, request: protocol.Sampling, echo: bool, top: int) -> None:
    """A request for prompt log-probabilities or alternatives this server can answer."""
    if echo and not self.predictor.family.continues_prompt:
      raise texts.RequestError(f"echo needs a decoder-only model: {self.name}'s prompt is its "
                               "encoder's input, which it does not predict.", "echo")
    if echo and request.n > 1:
      raise texts.RequestError("echo takes n=1 (each choice would repeat the prompt's "
                               "log-probabilities).", "n")
    if (echo or top) and request.stream:
      raise texts.RequestError("Prompt log-probabilities and alternatives (echo, logprobs > 0, "
                               "top_logprobs) are not streamed: send stream=false.", "stream")

  async def scores(self, prompts: list, choices: list[texts.Completion],
                   request: protocol.Sampling) -> list[token_scores.Scores]:
    """Each choice's token scores over its prompt and completion (token_scores.py), with the
    request's adapter, computed off the event loop."""
    pairs = [(prompts[i // request.n], c.token_ids) for i, c in enumerate(choices)]
    return await asyncio.get_running_loop().run_in_executor(
        None, self.scorer.score, [p for p, _ in pairs], [o for _, o in pairs],
        [self.adapter(request.model)] * len(pairs))

  def stream(self, request: protocol.Sampling, prompts: list, max_tokens: int | None
             ) -> tuple[asyncio.Queue, list[texts.TextStream], int]:
    """Queues a streamed request's rows: each row's tokens come onto the returned queue as
    ('tokens', row, ids so far, log-probs) after every segment its batch decodes, and
    ('done', row, future) at its end; with a TextStream per row and the prompts' tokens."""
    rows, max_tokens = self.rows(request, prompts, max_tokens)
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue = asyncio.Queue()
    post = lambda *item: loop.call_soon_threadsafe(updates.put_nowait, item)
    for i, row in enumerate(rows):
      row.on_tokens = functools.partial(post, "tokens", i)
    for i, future in enumerate(self.submit(rows)):
      future.add_done_callback(functools.partial(post, "done", i))
    streams = [texts.TextStream(self.tokenizer, max_tokens, request.stops) for _ in rows]
    return updates, streams, sum(len(p) for p in prompts)


def create_app(service: Service, api_key: str | None = None) -> fastapi.FastAPI:
  app = fastapi.FastAPI(title="transformer_jax", docs_url=None, redoc_url=None)
  _add_error_handlers(app)

  # A plain ASGI middleware: Starlette's @app.middleware("http") runs every request in a
  # task group of its own, about a third of the event loop's time under load.
  app.add_middleware(_Admission, service=service, api_key=api_key)

  @app.get("/health")
  async def health():
    return {"status": "ok"}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": service.model_cards()}

  @app.post("/v1/completions")
  async def completions(request: protocol.CompletionRequest):
    service.check_family(classification=False)
    return await service.complete(request)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: protocol.ChatRequest):
    service.check_family(classification=False)
    return await service.chat(request)

  @app.post("/v1/classifications")
  async def classifications(request: protocol.ClassificationRequest):
    service.adapter(request.model)  # a classifier serves no named adapters: the base only
    service.check_family(classification=True)
    inputs = [request.input] if isinstance(request.input, str) else request.input
    if not inputs:
      raise texts.RequestError("input: give at least one text.", "input")
    prompts = [service.prompts.completion(text, "input") for text in inputs]
    outputs = await service.run([batch_decoder.Row(p) for p in prompts])
    family, tokenizer = service.predictor.family, service.tokenizer
    data = []
    for i, output in enumerate(outputs):
      names = [family.output_text([c], tokenizer) for c in range(len(output.logprobs))]
      probabilities = {n: math.exp(float(s)) for n, s in zip(names, output.logprobs)}
      data.append({"index": i, "label": names[int(output.logprobs.argmax())],
                   "probabilities": probabilities})
    prompt_tokens = sum(len(p) for p in prompts)
    return {"id": protocol.new_id("clsf"), "object": "list", "created": protocol.now(),
            "model": service.name, "data": data,
            "usage": protocol.usage(prompt_tokens, 0)}

  return app


# The current request's "still arriving" flag, shared by the middleware and the route (the
# event loop runs both, so the engine's count needs no lock).
_ARRIVING: contextvars.ContextVar = contextvars.ContextVar("arriving")


class _Admission:
  """ASGI middleware: the API key on /v1/ routes (401 without it), and each POST request
  counted as arriving until its rows are queued (or it fails first): the engine waits a
  little for requests already received before it starts a batch."""

  def __init__(self, app, service: Service, api_key: str | None):
    self.app, self.engine = app, service.engine
    self.authorization = f"Bearer {api_key}".encode() if api_key else None

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    if self.authorization and scope["path"].startswith("/v1/") and (
        dict(scope["headers"]).get(b"authorization") != self.authorization):
      response = _error(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY'.",
                        code="invalid_api_key")
      return await response(scope, receive, send)
    if scope["method"] != "POST":
      return await self.app(scope, receive, send)
    _ARRIVING.set([True])
    self.engine.arriving += 1
    try:
      return await self.app(scope, receive, send)
    finally:
      _arrived(self.engine)  # where the route did not


def _arrived(engine: engine_lib.Engine) -> None:
  """The current request's rows are queued (or it failed): no longer arriving."""
  arriving = _ARRIVING.get(None)
  if arriving and arriving[0]:
    arriving[0] = False
    engine.arriving -= 1


def _prompt_list(prompt) -> list:
  """A completion request's prompts: a text, texts, token ids, or lists of token ids."""
  if isinstance(prompt, str):
    return [prompt]
  if not prompt:
    raise texts.RequestError("prompt: give a text or a list of texts.", "prompt")
  if all(isinstance(p, int) for p in prompt):
    return [prompt]
  return list(prompt)


def _head(service: Service, request: protocol.Sampling, chat: bool) -> dict:
  return {"id": protocol.new_id("chatcmpl" if chat else "cmpl"), "created": protocol.now(),
          "model": request.model or service.name}  # the base's or an adapter's name


def _answer(service: Service, request: protocol.Sampling, choices: list,
            prompt_tokens: int, chat: bool, scores: list | None = None):
  usage = protocol.usage(prompt_tokens, sum(len(_generated(c)) for c in choices))
  kind = "chat.completion" if chat else "text_completion"
  listed = []
  for index, choice in enumerate(choices):
    if isinstance(choice, _Echoed):  # its logprobs object is made already
      listed.append({"index": index, "text": choice.text, "logprobs": choice.logprobs,
                     "finish_reason": choice.completion.finish_reason})
      continue
    logprobs = _logprobs(service, request, choice, chat, scores[index] if scores else None)
    if chat:
      listed.append({"index": index, "message": {"role": "assistant", "content": choice.text},
                     "logprobs": logprobs, "finish_reason": choice.finish_reason})
    else:
      listed.append({"index": index, "text": choice.text, "logprobs": logprobs,
                     "finish_reason": choice.finish_reason})
  return {**_head(service, request, chat), "object": kind, "choices": listed, "usage": usage}


def _logprobs(service: Service, request, choice: texts.Completion, chat: bool,
              scores: token_scores.Scores | None) -> dict | None:
  if not request.logprobs and not (request.logprobs == 0 and not chat):
    return None
  tokens = texts.token_strings(service.tokenizer, choice.token_ids)
  k = (request.top_logprobs or 0) if chat else request.logprobs
  # The generated tokens' alternatives: the last len(tokens) positions of their text's scores.
  top = (_alternatives(service, scores, k)[len(scores.logprobs) - len(tokens):]
         if scores is not None and k else None)
  if chat:
    return protocol.chat_logprobs(tokens, choice.logprobs,
                                  [list(t.items()) for t in top] if top else None)
  return protocol.completion_logprobs(tokens, choice.logprobs, choice.pieces, top)


@dataclasses.dataclass
class _Echoed:
  """A completion shown after its prompt (`echo`), with its logprobs object."""
  completion: texts.Completion
  text: str
  logprobs: dict | None


def _generated(choice) -> list[int]:
  return (choice.completion if isinstance(choice, _Echoed) else choice).token_ids


def _echoed(service: Service, choice: texts.Completion, prompt: np.ndarray, prompt_text: str,
            scores: token_scores.Scores | None, k: int | None) -> _Echoed:
  """`choice` after its prompt: the prompt's text and tokens first; their log-probabilities
  from `scores` (the first token's None where nothing predicts it), the completion's as it
  was decoded."""
  if k is None:
    return _Echoed(choice, prompt_text + choice.text, None)
  tokenizer = service.tokenizer
  ids = [int(i) for i in prompt]
  prefixes = [tokenizer.decode(ids[:i]) for i in range(1, len(ids) + 1)]
  prompt_pieces = texts.stream_pieces(prefixes, prompt_text)
  given = [None if np.isnan(x) else float(x) for x in scores.logprobs[:len(ids)]]
  top = _alternatives(service, scores, k) if k else None
  logprobs = protocol.completion_logprobs(
      texts.token_strings(tokenizer, ids + choice.token_ids), given + choice.logprobs,
      prompt_pieces + choice.pieces, top)
  return _Echoed(choice, prompt_text + choice.text, logprobs)


def _alternatives(service: Service, scores: token_scores.Scores, k: int
                  ) -> list[dict[str, float] | None]:
  """Per position, its k most likely tokens' strings and log-probabilities (None where
  nothing predicts the position)."""
  listed = []
  for ids, logprobs, own in zip(scores.top_ids, scores.top_logprobs, scores.logprobs):
    if np.isnan(own):
      listed.append(None)
      continue
    names = texts.token_strings(service.tokenizer, [int(i) for i in ids[:k]])
    listed.append({name: float(p) for name, p in zip(names, logprobs[:k])})
  return listed


def _streamed(service: Service, request: protocol.Sampling, prompts: list,
              max_tokens: int | None, chat: bool) -> responses.StreamingResponse:
  """A streamed request's response: its rows are queued (or the request refused) now, and
  their text is sent while they decode."""
  updates, streams, prompt_tokens = service.stream(request, prompts, max_tokens)
  return responses.StreamingResponse(
      _stream(updates, streams, request, prompt_tokens, _head(service, request, chat), chat),
      media_type="text/event-stream")


async def _stream(updates: asyncio.Queue, streams: list[texts.TextStream], request,
                  prompt_tokens: int, head: dict, chat: bool) -> AsyncIterator[str]:
  """Server-sent events in OpenAI's chunk format: every choice's final text as its batch
  decodes it (choices interleaved, each chunk naming its index), then its finish reason;
  the last finish chunk carries the usage; then [DONE]."""
  kind = "chat.completion.chunk" if chat else "text_completion"
  event = lambda body: f"data: {json.dumps({**head, 'object': kind, **body})}\n\n"

  def choice_chunk(index: int, piece: str | None, finish: str | None, first: bool = False):
    if chat:
      delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else (
          {} if piece is None else {"content": piece})
      return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {"index": index, "text": piece or "", "logprobs": None, "finish_reason": finish}

  if chat:
    for index in range(len(streams)):
      yield event({"choices": [choice_chunk(index, None, None, first=True)]})
  pending = set(range(len(streams)))
  while pending:
    what, index, *detail = await updates.get()
    stream = streams[index]
    if index not in pending:
      continue  # ended by a stop string before its row finished decoding
    if what == "tokens":
      piece = stream.update(*detail)
    elif detail[0].exception() is not None:
      # The response has begun (200): the failure is the stream's last event.
      error = protocol.error(f"The server failed on this request: {detail[0].exception()}",
                             "server_error", None, None)
      yield f"data: {json.dumps(error)}\n\n"
      return
    else:
      output = detail[0].result()
      piece = stream.finish(output.ids, output.logprobs)
    if piece:
      yield event({"choices": [choice_chunk(index, piece, None)]})
    if stream.done:
      pending.discard(index)
      usage = {} if pending else {"usage": _usage(prompt_tokens, streams)}
      yield event({"choices": [choice_chunk(index, None, stream.done.finish_reason)], **usage})
  if (request.stream_options or {}).get("include_usage"):
    yield event({"choices": [], "usage": _usage(prompt_tokens, streams)})
  yield "data: [DONE]\n\n"


def _usage(prompt_tokens: int, streams: list[texts.TextStream]) -> dict:
  return protocol.usage(prompt_tokens, sum(len(s.done.token_ids) for s in streams))


def _error(status: int, message: str, kind: str = "invalid_request_error",
           param: str | None = None, code: str | None = None) -> responses.JSONResponse:
  return responses.JSONResponse(protocol.error(message, kind, param, code), status_code=status)


def _add_error_handlers(app: fastapi.FastAPI) -> None:

  @app.exception_handler(fastapi_exceptions.RequestValidationError)
  async def invalid(request, error):  # pylint: disable=unused-argument
    problems = []
    for e in error.errors()[:3]:
      if e.get("type") == "json_invalid":
        return _error(400, f"The body is not valid JSON: {e.get('msg')} "
                           f"(at character {e.get('loc', ('', '?'))[-1]}).")
      where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
      problems.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    first = error.errors()[0].get("loc", ()) if error.errors() else ()
    param = first[1] if len(first) > 1 and isinstance(first[1], str) else None
    return _error(400, "Invalid request: " + "; ".join(problems) + ".", param=param)

  @app.exception_handler(texts.RequestError)
  async def bad_request(request, error):  # pylint: disable=unused-argument
    return _error(400, str(error), param=error.param)

  @app.exception_handler(engine_lib.QueueFullError)
  async def busy(request, error):  # pylint: disable=unused-argument
    return _error(429, str(error), kind="server_busy", code="queue_full")

  @app.exception_handler(starlette_exceptions.HTTPException)
  async def http_error(request, error):  # pylint: disable=unused-argument
    return _error(error.status_code, str(error.detail))

  @app.exception_handler(Exception)
  async def failed(request, error):  # pylint: disable=unused-argument
    return _error(500, f"The server failed on this request: {error}", kind="server_error")
