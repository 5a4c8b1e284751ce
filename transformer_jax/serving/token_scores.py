"""Log-probabilities of given tokens, for the server's `echo` and `logprobs: k` (legacy
completions) and `top_logprobs` (chat): every position's token and its `TOP` most likely
alternatives, from the model's float32 logits at temperature 1 over the prompt and its
completion read at once (teacher-forced), as vLLM reports prompt log-probabilities. An
evaluation harness's log-likelihood requests (`echo`, `max_tokens` 1, `logprobs` 1) read these.

A decoder-only model scores every token after the first of its text (raw and chat prompts:
the first has nothing before it) or every token (the task format, after its start token); an
encoder-decoder scores its output tokens only (its prompt is the encoder's input).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.inference import generate
from transformer_jax.model import lora as lora_lib
from transformer_jax.serving import batch_decoder

TOP = 5  # OpenAI's (and vLLM's default) limit on alternatives per position


@dataclasses.dataclass
class Scores:
  """One text's scores: per token, its log-probability (NaN where nothing predicts it), the
  TOP most likely ids and their log-probabilities, most likely first."""
  logprobs: np.ndarray  # [len]
  top_ids: np.ndarray  # [len, TOP]
  top_logprobs: np.ndarray  # [len, TOP]


class TokenScorer:
  """The predictor of `decoder` (a batch_decoder.BatchDecoder) scoring texts in batches of
  its bucketed shapes."""

  def __init__(self, decoder: batch_decoder.BatchDecoder):
    self.decoder = decoder
    self.family, self.layout = decoder.family, decoder.layout
    self.longest = decoder.predictor.config.model.max_len
    self._score = self.layout.compile_decode(self._scores)

  def _scores(self, params, sources, tokens, prompt_lengths, adapters):
    """[rows, len] log-probabilities of `tokens` (NaN where none), [rows, len, TOP] ids and
    log-probabilities of the alternatives; each row with its named adapter `adapters` [rows]
    (0: none)."""
    family = self.family
    params = lora_lib.for_rows(params, adapters)
    if family.continues_prompt:
      prefix = jnp.arange(tokens.shape[1])[None, :] < prompt_lengths[:, None]  # a prefix LM's
      logits = family.model.apply({"params": params}, tokens, None, None, prefix,
                                  deterministic=True, shift=not family.unshifted)
      if family.unshifted:  # logits[t] predict token t + 1: none predicts the first
        logits = jnp.pad(logits[:, :-1], ((0, 0), (1, 0), (0, 0)), constant_values=jnp.nan)
    else:
      logits = family.forward(params, {"inputs": sources, "targets": tokens},
                              deterministic=True)
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, :, None], axis=-1)[:, :, 0]
    top_logprobs, top_ids = jax.lax.top_k(jnp.nan_to_num(logprobs, nan=-jnp.inf), TOP)
    return chosen, top_ids, top_logprobs

  def score(self, prompts: Sequence[np.ndarray], outputs: Sequence[Sequence[int]],
            adapters: Sequence[int] | None = None) -> list[Scores]:
    """Each (prompt, output ids) pair's scores: a decoder-only model's over prompt + output,
    an encoder-decoder's over the output; with the named adapter of each pair in `adapters`
    (batch_decoder.Row.adapter; default: none)."""
    results = []
    batch = self.decoder.max_batch_size
    adapters = list(adapters or [0] * len(prompts))
    for start in range(0, len(prompts), batch):
      part = slice(start, start + batch)
      results += self._batch(prompts[part], outputs[part], adapters[part])
    return results

  def _batch(self, prompts, outputs, adapters) -> list[Scores]:
    continues = self.family.continues_prompt
    texts = [np.concatenate([p, np.asarray(o, np.int32)]) if continues
             else np.asarray(o, np.int32) for p, o in zip(prompts, outputs)]
    count = generate.batch_bucket(len(texts), self.decoder.max_batch_size,
                                  self.layout.eval_devices)
    width = generate.bucket_length(max(max(map(len, texts)), 1), self.longest)
    source_width = self.decoder.prompt_bucket(max(map(len, prompts)))
    tokens = np.zeros((count, width), np.int32)
    sources = np.zeros((count, source_width), np.int32)
    lengths = np.zeros((count,), np.int32)
    adapter_ids = np.zeros((count,), np.int32)
    adapter_ids[:len(adapters)] = adapters
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
      tokens[i, :len(text)] = text
      sources[i, :len(prompt)] = prompt
      lengths[i] = len(prompt)
    eval_batch = self.layout.eval_batch
    chosen, top_ids, top_logprobs = self.layout.host_rows(self._score(
        self.decoder.params, eval_batch(sources), eval_batch(tokens), eval_batch(lengths),
        eval_batch(adapter_ids)))
    return [Scores(chosen[i, :len(t)], top_ids[i, :len(t)], top_logprobs[i, :len(t)])
            for i, t in enumerate(texts)]
