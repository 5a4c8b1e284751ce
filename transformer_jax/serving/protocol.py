"""OpenAI's request bodies (validated by pydantic) and response objects, as the `openai`
client and evaluation harnesses send and read them.

Fields of OpenAI's API that this server does not implement are refused when a request sets
them to anything but their neutral value, rather than silently ignored; unknown fields pass
(clients send extras such as `user`).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

import pydantic
from pydantic import Field

# Fields accepted only at these values (what they would change is not implemented).
UNSUPPORTED = {"best_of": (None, 1), "suffix": (None, ""), "tools": (None, []),
               "response_format": (None,)}
TOP_LOGPROBS = 5  # the most alternatives per position (token_scores.TOP)
Penalty = Annotated[float, Field(ge=-2, le=2)]
Bias = Annotated[float, Field(ge=-100, le=100)]


class Sampling(pydantic.BaseModel):
  """What completions and chat completions share."""
  model_config = pydantic.ConfigDict(extra="allow")

  model: str | None = None  # the served model's id; may be left out
  temperature: float | None = Field(None, ge=0, le=2)  # 0 = greedy
  top_p: float | None = Field(None, gt=0, le=1)
  top_k: int | None = Field(None, ge=-1)  # an extension (vLLM's): 0 or -1 = off
  n: int = Field(1, ge=1)
  stop: str | list[str] | None = None
  seed: int | None = None
  stream: bool = False
  stream_options: dict | None = None
  presence_penalty: Penalty | None = None
  frequency_penalty: Penalty | None = None
  logit_bias: dict[str, Bias] | None = None  # the model's token ids (as text) -> bias
  # vLLM's extensions: no EOS before min_tokens tokens; ignore_eos: none before max_tokens;
  # transformers' repetition penalty (None: the model's decoding config's).
  min_tokens: int = Field(0, ge=0)
  ignore_eos: bool = False
  repetition_penalty: float | None = Field(None, gt=0)

  def unsupported(self) -> str | None:
    """The first field set to a value this server cannot honour."""
    for name, neutral in UNSUPPORTED.items():
      value = (self.model_extra or {}).get(name, getattr(self, name, None))
      if value not in neutral:
        return name
    return None

  @property
  def stops(self) -> list[str]:
    return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(Sampling):
  prompt: Union[str, list[str], list[int], list[list[int]]]
  max_tokens: int | None = None
  # The chosen tokens' log-probabilities when set; k > 0: with the k most likely at each.
  logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)
  echo: bool = False  # the prompt before the completion, and its tokens' log-probabilities


class ContentPart(pydantic.BaseModel):
  type: Literal["text"]
  text: str


class Message(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="allow")
  role: Literal["system", "developer", "user", "assistant"]
  content: str | list[ContentPart]

  def text(self) -> str:
    if isinstance(self.content, str):
      return self.content
    return "".join(part.text for part in self.content)


class ChatRequest(Sampling):
  messages: list[Message] = Field(min_length=1)
  max_tokens: int | None = None
  max_completion_tokens: int | None = None
  logprobs: bool = False
  top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)  # with logprobs
  def chat(self) -> list[dict]:
    # 'developer' is the newer name of 'system'; chat templates know the older one.
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages]


class ClassificationRequest(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="allow")
  model: str | None = None
  input: str | list[str]


def error(message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> dict:
  """OpenAI's error object."""
  return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
  return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
  return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(tokens: list[str], logprobs: list[float | None], pieces: list[str],
                        top: list[dict[str, float] | None] | None = None) -> dict:
  """The legacy completions' logprobs object: each token, its log-probability (None where
  nothing predicts it: an echoed prompt's first token), the most likely alternatives at each
  position where asked for (`top`), and where each token's text starts."""
  offsets, at = [], 0
  for piece in pieces:
    offsets.append(at)
    at += len(piece)
  return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top,
          "text_offset": offsets}


def chat_logprobs(tokens: list[str], logprobs: list[float],
                  top: list[list[tuple[str, float]]] | None = None) -> dict:
  """Chat's logprobs object: each chosen token with its log-probability and, where asked
  for, the most likely alternatives at its position."""
  entry = lambda t, p: {"token": t, "logprob": p, "bytes": list(t.encode())}
  return {"content": [{**entry(t, p), "top_logprobs": [entry(*a) for a in (top or [])[i]]
                       if top else []} for i, (t, p) in enumerate(zip(tokens, logprobs))]}


def model_card(name: str, max_model_len: int, created: int, **more: str) -> dict[str, Any]:
  """/v1/models' entry of a model (`more`: an adapter's root folder and parent model)."""
  return {"id": name, "object": "model", "created": created, "owned_by": "transformer_jax",
          "max_model_len": max_model_len, **more}
