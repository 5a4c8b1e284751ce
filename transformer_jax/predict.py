"""Inference: turn source texts into translations with a trained model.

`Translator.from_workdir(workdir)` loads the config, tokenizer and latest (or a given, or the
average of the last N) checkpoint saved by training and translates lists of strings, batched by
length, with the generation settings of `config.decoding` (greedy, sampling or beam search).
Evaluation reuses `decode_fn` for its BLEU.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from transformer_jax import checkpoints
from transformer_jax import decoding
from transformer_jax import models
from transformer_jax import parallel
from transformer_jax import tokenizer as tokenizer_lib
from transformer_jax.data import pipeline

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.model"


def save_config(workdir: str, config: ml_collections.ConfigDict) -> None:
  path = os.path.join(workdir, CONFIG_FILE)
  with open(f"{path}.tmp", "w") as f:
    f.write(config.to_json(indent=2))
  os.replace(f"{path}.tmp", path)


def load_config(workdir: str) -> ml_collections.ConfigDict:
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    raise checkpoints.CheckpointError(
        f"{path} not found: {workdir} is not a training workdir. Train first with "
        "python -m transformer_jax.main --config configs/demo.py --workdir DIR.")
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


def init_cache(model: models.EncoderDecoder, batch_size: int, source_len: int,
               max_decode_len: int):
  """Zeroed decoder KV cache for `batch_size` rows, shaped without running the model."""
  shapes = jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), jnp.ones((batch_size, source_len), jnp.int32),
                         jnp.ones((batch_size, max_decode_len), jnp.int32),
                         deterministic=True, decode=True)["cache"])
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def max_decode_len(decoding_config: ml_collections.ConfigDict,
                   model_config: models.TransformerConfig, source_len: int) -> int:
  """Longest output: `decoding.max_decode_len`, or (when 0) source length + 50; never more
  than the model's position range."""
  length = decoding_config.max_decode_len or source_len + 50
  if decoding_config.max_decode_len > model_config.max_len:
    raise ValueError(f"config.decoding.max_decode_len={length} exceeds config.model.max_len="
                     f"{model_config.max_len}; lower it.")
  return min(length, model_config.max_len)


def cached_tokens_to_logits(model: models.EncoderDecoder, params, encoded, source):
  """The decoding callback: next-token logits [n, vocab] from the decoder's KV cache."""

  def tokens_to_logits(ids, cache):
    logits, variables = model.apply(
        {"params": params, "cache": cache}, encoded, source, ids, deterministic=True,
        decode=True, mutable=["cache"], method=model.decode)
    return logits[:, -1], variables["cache"]

  return tokens_to_logits


def _generate(params, inputs, rng, *, model: models.EncoderDecoder,
              decoding_config: ml_collections.ConfigDict, max_len: int):
  """[b, src_len] source tokens -> [b, max_len] output tokens, with the KV cache."""
  d = decoding_config
  beam = d.method == "beam"
  encoded = model.apply({"params": params}, inputs, deterministic=True, method=model.encode)
  if beam:  # the callback sees [batch * beam] rows
    encoded = decoding.flat_batch_beam_expand(encoded, d.beam_size)
    source = decoding.flat_batch_beam_expand(inputs, d.beam_size)
  else:
    source = inputs

  tokens_to_logits = cached_tokens_to_logits(model, params, encoded, source)
  batch_size = inputs.shape[0]
  cache = init_cache(model, batch_size, inputs.shape[1], max_len)
  common = dict(eos_id=tokenizer_lib.EOS_ID, max_decode_len=max_len)
  bos = model.config.bos_id
  if beam:
    sequences, _ = decoding.beam_search(inputs, cache, tokens_to_logits, beam_size=d.beam_size,
                                        alpha=d.alpha, bos_id=bos, **common)
    return sequences[:, 0]
  if d.method == "greedy":
    return decoding.greedy_search(cache, tokens_to_logits, batch_size=batch_size, bos_id=bos,
                                  **common)
  if d.method == "sample":
    return decoding.sample(cache, tokens_to_logits, rng, batch_size=batch_size, bos_id=bos,
                           temperature=d.temperature, top_k=d.top_k, top_p=d.top_p, **common)
  raise ValueError(f"Unknown config.decoding.method={d.method!r}; use 'greedy', 'beam' or "
                   "'sample'.")


def decode_fn(model: models.EncoderDecoder, decoding_config: ml_collections.ConfigDict):
  """pmapped (replicated params, sharded inputs, replicated rng) -> sharded output tokens.

  One compilation per source length; the output length follows `max_decode_len`.
  """
  compiled: dict[int, object] = {}  # by source length

  def run(replicated_params, sharded_inputs, rng):
    source_len = sharded_inputs.shape[-1]
    if source_len not in compiled:
      max_len = max_decode_len(decoding_config, model.config, source_len)
      compiled[source_len] = jax.pmap(
          functools.partial(_generate, model=model, decoding_config=decoding_config,
                            max_len=max_len), axis_name=parallel.AXIS, in_axes=(0, 0, None))
    return compiled[source_len](replicated_params, sharded_inputs, rng)

  return run


def translate_ids(p_decode, replicated_params, sources: np.ndarray, batch_size: int,
                  seed: int = 0) -> list[np.ndarray]:
  """Output tokens for source tokens [n, src_len], in order (one array per row)."""
  outputs = []
  for index, start in enumerate(range(0, len(sources), batch_size)):
    rows = sources[start:start + batch_size]
    padded = np.pad(rows, ((0, batch_size - len(rows)), (0, 0)))  # fixed shape: one compile
    rng = jax.random.fold_in(jax.random.PRNGKey(seed), index)
    tokens = parallel.unshard(p_decode(replicated_params, parallel.shard(padded), rng))
    outputs.extend(tokens[:len(rows)])
  return outputs


def restore_params(workdir: str, model: models.EncoderDecoder, step: int | None = None,
                   average_last: int = 1):
  """Parameters at `step` (default latest), or the mean of the last `average_last` checkpoints
  up to it (the paper averages the last 5 or 20). Returns (params, step)."""
  abstract = jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), jnp.ones((1, 1), jnp.int32),
                         jnp.ones((1, 1), jnp.int32), deterministic=True)["params"])
  manager = checkpoints.manager(workdir, read_only=True)
  params, _, step = checkpoints.restore(manager, abstract, step=step)
  if average_last <= 1:
    return params, step
  steps = sorted(s for s in manager.all_steps() if s <= step)[-average_last:]
  if len(steps) < average_last:
    logging.warning("Averaging %d checkpoints %s: only these are kept (config.keep_checkpoints).",
                    len(steps), steps)
  total = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  for other in steps[:-1]:
    other_params, _, _ = checkpoints.restore(manager, abstract, step=other)
    total = jax.tree.map(lambda t, x: t + np.asarray(x, np.float64), total, other_params)
  logging.info("Averaged the parameters of checkpoints %s.", steps)
  return jax.tree.map(lambda t, x: (t / len(steps)).astype(x.dtype), total, params), step


def _bucket_length(num_tokens: int, max_len: int) -> int:
  """Padded source length: the next power of two >= 8, at most max_len (few compilations)."""
  length = 8
  while length < num_tokens:
    length *= 2
  return min(length, max_len)


class Translator:
  """A trained model, its tokenizer and compiled decoding, ready to translate strings."""

  def __init__(self, config: ml_collections.ConfigDict, tokenizer: tokenizer_lib.Tokenizer,
               params, step: int | None = None):
    self.config = config
    self.tokenizer = tokenizer
    self.step = step
    self.model = models.EncoderDecoder(models.model_config(config.model))
    self.batch_size = config.per_device_batch_size * jax.local_device_count()
    self.params = params
    self.replicated_params = parallel.replicate(params)
    self._decode = decode_fn(self.model, config.decoding)

  @classmethod
  def from_workdir(cls, workdir: str, step: int | None = None,
                   average_last: int = 1) -> "Translator":
    """Loads the workdir's config, tokenizer and checkpoint (latest unless `step`)."""
    config = load_config(workdir)
    tokenizer = tokenizer_lib.Tokenizer.load(os.path.join(workdir, TOKENIZER_FILE))
    model = models.EncoderDecoder(models.model_config(config.model))
    params, step = restore_params(workdir, model, step, average_last)
    return cls(config, tokenizer, params, step)

  def translate(self, texts: Sequence[str]) -> list[str]:
    """One translation per text, in order; empty texts give empty outputs.

    Texts are grouped by token length so short ones are not padded to the longest; texts
    longer than `config.max_source_length` tokens are truncated, with one warning per call.
    """
    max_len = self.config.max_source_length
    token_ids = {i: self.tokenizer.encode(t) for i, t in enumerate(texts) if t.strip()}
    too_long = sum(len(ids) + 1 > max_len for ids in token_ids.values())
    if too_long:
      logging.warning("%d input(s) longer than max_source_length=%d tokens were truncated.",
                      too_long, max_len)
    buckets: dict[int, list[int]] = {}
    for i, ids in token_ids.items():
      buckets.setdefault(_bucket_length(len(ids) + 1, max_len), []).append(i)
    outputs = [""] * len(texts)
    for length, indices in sorted(buckets.items()):
      sources, _ = pipeline.pad_with_eos([token_ids[i] for i in indices], length)
      tokens = translate_ids(self._decode, self.replicated_params, sources, self.batch_size,
                             self.config.decoding.seed)
      for i, row in zip(indices, tokens):
        outputs[i] = self.tokenizer.decode(row)
    return outputs

  def translate_lines(self, lines: Iterable[str], chunk_size: int = 1024) -> Iterator[str]:
    """Streams translations of `lines`, `chunk_size` at a time, never holding the whole input."""
    chunk = []
    for line in lines:
      chunk.append(line.rstrip("\n"))
      if len(chunk) == chunk_size:
        yield from self.translate(chunk)
        chunk = []
    if chunk:
      yield from self.translate(chunk)
