"""Requests' texts to token ids and generated ids back to texts, the model's way.

A completion's prompt goes through the model's prompt format (data/prompt_format.py) as a
line of `--mode predict` does: an encoder-decoder's source, a decoder-only model's raw text
(or chat, or task) prompt. A chat request renders the checkpoint's chat template where it has
one; otherwise its last user message is the source. Outputs end at EOS, at the request's
max_tokens, or before the first of its stop strings.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

from absl import logging
import numpy as np

from transformer_jax import tokenizer as tokenizer_lib
from transformer_jax.data import prompt_format


class RequestError(ValueError):
  """A request the model cannot answer as asked (HTTP 400), with the parameter at fault."""

  def __init__(self, message: str, param: str | None = None):
    super().__init__(message)
    self.param = param


class Prompts:
  """Turns requests' texts into the prompts the model's family decodes from."""

  def __init__(self, predictor):
    self.predictor = predictor
    self.config = predictor.config
    self.tokenizer = predictor.tokenizer
    self.family = predictor.family
    self.encoder = prompt_format.TextEncoder(self.config, self.tokenizer)
    self.chat_template = bool(getattr(self.tokenizer, "has_chat_template", False)) and (
        self.family.continues_prompt)

  def completion(self, text: str | Sequence[int], param: str = "prompt") -> np.ndarray:
    """A prompt's ids from its text (or its token ids, taken as they are)."""
    if isinstance(text, str):
      ids = self.encoder.encode([text])[0][0]
    else:
      ids = self.model_ids(text, param)
    return self._fitted(ids, param)

  def model_ids(self, ids: Sequence[int], param: str) -> list[int]:
    """A request's token ids (the checkpoint's own) as the model's; RequestError where one is
    not in its vocabulary."""
    ids = [int(i) for i in ids]
    to_internal = getattr(self.tokenizer, "to_internal", None)  # a checkpoint's own ids
    try:
      ids = list(to_internal(ids)) if to_internal and min(ids, default=0) >= 0 else ids
    except (IndexError, KeyError, ValueError):
      ids = [-1]
    vocab = self.config.model.vocab_size
    if any(not 0 < i < vocab for i in ids):
      raise RequestError(f"{param}: token ids must be ids of the model's vocabulary "
                         f"({vocab} ids).", param)
    return ids

  def row_extras(self, request, max_tokens: int, most_biases: int) -> dict:
    """batch_decoder.Row's settings beyond sampling for a request (protocol.Sampling):
    OpenAI's penalties and logit_bias (by the model's ids), vLLM's min_tokens / ignore_eos /
    repetition_penalty."""
    if request.min_tokens > max_tokens:
      raise RequestError(f"min_tokens={request.min_tokens} is more than max_tokens="
                         f"{max_tokens}.", "min_tokens")
    return dict(
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        logit_bias=self.logit_bias(request.logit_bias, most_biases) if request.logit_bias
        else None,
        min_tokens=max_tokens if request.ignore_eos else request.min_tokens,
        repetition_penalty=request.repetition_penalty)

  def logit_bias(self, bias: dict[str, float], most: int) -> dict[int, float]:
    """A request's logit_bias ({token id as text: bias}) by the model's ids."""
    if len(bias) > most:
      raise RequestError(f"logit_bias has {len(bias)} entries; this server takes at most "
                         f"{most}.", "logit_bias")
    try:
      keys = [int(key) for key in bias]
    except ValueError:
      raise RequestError("logit_bias: its keys must be token ids, such as \"50256\".",
                         "logit_bias") from None
    return dict(zip(self.model_ids(keys, "logit_bias"), bias.values()))

  def chat(self, messages: list[dict]) -> np.ndarray:
    """A chat's prompt: the rendered chat template with its generation prompt, or (a model
    without one) the last user message in the model's own prompt format."""
    if self.chat_template:
      rendered = self.tokenizer.render_chat(messages, add_generation_prompt=True)
      ids = self.tokenizer.encode_batch([rendered], add_special_tokens=False)[0]
      return self._fitted(ids, "messages")
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not users:
      raise RequestError("messages: this model reads the last user message, and there is none.",
                         "messages")
    return self.completion(users[-1], "messages")

  def _fitted(self, ids: list[int], param: str) -> np.ndarray:
    """The family's prompt of `ids`; RequestError where it would be cut short."""
    prompt = self.family.prompt(ids)
    limit = self.config.max_source_length
    if len(prompt) < len(ids) or not np.array_equal(prompt[:len(ids)], ids):
      # with_eos cuts to limit - 1 ids and its EOS; raw and chat prompts to limit.
      takes = limit - 1 if self.config.get("prompt_format", "task") == "task" else limit
      raise RequestError(f"{param}: the prompt has {len(ids)} tokens and this model takes at "
                         f"most {takes} (config.max_source_length={limit}); shorten it.",
                         param)
    return prompt


@dataclasses.dataclass
class Completion:
  """One generated output, as the response shows it."""
  text: str
  token_ids: list[int]  # the tokens generated, EOS included, through the stop string if any
  logprobs: list[float]  # of each of token_ids
  finish_reason: str  # 'stop' (EOS or a stop string) or 'length' (max_tokens)
  tokenizer: Any = dataclasses.field(default=None, repr=False, compare=False)

  @functools.cached_property
  def pieces(self) -> list[str]:
    """The text each token adds (empty where a character is still incomplete), for the
    log-probabilities' text offsets: a decode per prefix, so only where asked for."""
    ids = self.token_ids
    return stream_pieces([self.tokenizer.decode(ids[:i]) for i in range(1, len(ids) + 1)],
                         self.text)


def completion(tokenizer, ids: np.ndarray, logprobs: np.ndarray, max_tokens: int,
               stop: Sequence[str] = ()) -> Completion:
  """The output of generated `ids` (zeros after EOS) with their log-probabilities."""
  ids = [int(i) for i in ids[:max_tokens]]
  ended = tokenizer_lib.EOS_ID in ids
  if ended:
    ids = ids[:ids.index(tokenizer_lib.EOS_ID) + 1]
  text = tokenizer.decode(ids) if ids else ""
  finish = "stop" if ended else "length"
  stops = [(text.find(s), s) for s in stop if s and s in text]
  if stops:
    at, _ = min(stops)
    text = text[:at]
    finish = "stop"
    # The tokens through the one whose text reaches the stop string.
    count = next(i for i in range(1, len(ids) + 1)
                 if any(s in tokenizer.decode(ids[:i]) for s in stop if s))
    ids = ids[:count]
  return Completion(text, ids, [float(x) for x in logprobs[:len(ids)]], finish, tokenizer)


def stream_pieces(prefixes: list[str], text: str) -> list[str]:
  """The text each token adds, so that the pieces add up to `text` exactly: a prefix's new
  characters where it extends the text so far within `text` (a byte-level token that ends
  mid-character adds nothing until the character is whole); the last piece takes the rest."""
  pieces, shown = [], ""
  for prefix in prefixes[:-1]:
    grown = text.startswith(prefix) and len(prefix) > len(shown) and not prefix.endswith(
        "\ufffd")
    pieces.append(prefix[len(shown):] if grown else "")
    shown = prefix if grown else shown
  if prefixes:
    pieces.append(text[len(shown):])
  return pieces


def token_strings(tokenizer, ids: Sequence[int]) -> list[str]:
  """Each token as a string (its vocabulary piece), for log-probability listings."""
  return [tokenizer.id_to_piece(i) for i in ids]


class TextStream:
  """A streamed output's text while its tokens arrive: only text that is final is handed out,
  so that the pieces add up exactly to `completion`'s text of the whole output.

  Held back: a trailing incomplete character (a byte-level or byte-fallback token that ends
  mid-UTF-8 decodes to U+FFFD until the rest arrives) and the longest end of the text that
  could begin a stop string (if the string completes, the text ends before it). The output is
  done at EOS, at max_tokens, or once a stop string is in its text and no stop string still
  being written could start earlier.
  """

  def __init__(self, tokenizer, max_tokens: int, stop: Sequence[str] = ()):
    self.tokenizer = tokenizer
    self.max_tokens = max_tokens
    self.stop = [s for s in stop if s]
    self.shown = ""  # the text handed out so far
    self.done: Completion | None = None  # the whole output, once it is known

  def update(self, ids: Sequence[int], logprobs: Sequence[float]) -> str:
    """The new piece of final text, given all the output's tokens so far."""
    if self.done:
      return ""
    ids = [int(i) for i in ids]
    if tokenizer_lib.EOS_ID in ids or len(ids) >= self.max_tokens:
      return self._finish(ids, logprobs)
    text = self.tokenizer.decode(ids)
    whole = text.rstrip("\ufffd")  # without a character still incomplete
    unsure = len(whole) - _stop_prefix_length(whole, self.stop)  # a stop may start here
    found = [text.find(s) for s in self.stop if s in text]
    if found and min(found) <= unsure:
      return self._finish(ids, logprobs)
    return self._extend(whole[:unsure])

  def finish(self, ids: np.ndarray, logprobs: np.ndarray) -> str:
    """The rest of the text, from the output's final ids (batch_decoder.Output)."""
    return "" if self.done else self._finish(ids, logprobs)

  def _finish(self, ids, logprobs) -> str:
    self.done = completion(self.tokenizer, np.asarray(ids), np.asarray(logprobs),
                           self.max_tokens, self.stop)
    if not self.done.text.startswith(self.shown):
      # Text once final changed with later tokens (a tokenizer that rewrites decoded text):
      # what was sent stays sent.
      logging.warning("A streamed text changed after it was sent: %r is not a prefix of %r.",
                      self.shown, self.done.text)
    return self._extend(self.done.text)

  def _extend(self, text: str) -> str:
    if len(text) <= len(self.shown) or not text.startswith(self.shown):
      return ""
    piece, self.shown = text[len(self.shown):], text
    return piece


def _stop_prefix_length(text: str, stop: Sequence[str]) -> int:
  """The length of the longest end of `text` that begins some stop string (0: none)."""
  longest = 0
  for s in stop:
    for n in range(min(len(s) - 1, len(text)), longest, -1):
      if text.endswith(s[:n]):
        longest = n
        break
  return longest
