"""Inference: turn source texts into translations with a trained model.

`Translator.from_workdir(workdir)` loads the config, tokenizer and latest (or a given) checkpoint
saved by training and translates lists of strings; training reuses `decode_fn` for its BLEU.
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


def _greedy_translate(params, inputs, *, model: models.EncoderDecoder, max_decode_len: int):
  """[b, src_len] tokens -> [b, max_decode_len] greedy output tokens, with the KV cache."""
  encoded = model.apply({"params": params}, inputs, deterministic=True, method=model.encode)

  def tokens_to_logits(ids, cache):
    logits, variables = model.apply(
        {"params": params, "cache": cache}, encoded, inputs, ids, deterministic=True,
        decode=True, mutable=["cache"], method=model.decode)
    return logits[:, -1], variables["cache"]

  cache = init_cache(model, inputs.shape[0], inputs.shape[1], max_decode_len)
  return decoding.greedy_search(cache, tokens_to_logits, batch_size=inputs.shape[0],
                                bos_id=model.config.bos_id, eos_id=tokenizer_lib.EOS_ID,
                                max_decode_len=max_decode_len)


def decode_fn(model: models.EncoderDecoder, max_decode_len: int):
  """pmapped (replicated params, sharded inputs) -> sharded output tokens."""
  return jax.pmap(functools.partial(_greedy_translate, model=model,
                                    max_decode_len=max_decode_len), axis_name=parallel.AXIS)


def translate_ids(p_decode, replicated_params, sources: np.ndarray,
                  batch_size: int) -> np.ndarray:
  """Greedy output tokens [n, max_decode_len] for source tokens [n, src_len], in order."""
  outputs = []
  for start in range(0, len(sources), batch_size):
    rows = sources[start:start + batch_size]
    padded = np.pad(rows, ((0, batch_size - len(rows)), (0, 0)))  # fixed shape: one compile
    tokens = parallel.unshard(p_decode(replicated_params, parallel.shard(padded)))
    outputs.append(tokens[:len(rows)])
  return np.concatenate(outputs) if outputs else np.zeros((0, 0), np.int32)


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
    self._decode = decode_fn(self.model, config.max_target_length)

  @classmethod
  def from_workdir(cls, workdir: str, step: int | None = None) -> "Translator":
    """Loads the workdir's config, tokenizer and checkpoint (latest unless `step`)."""
    config = load_config(workdir)
    tokenizer = tokenizer_lib.Tokenizer.load(os.path.join(workdir, TOKENIZER_FILE))
    model = models.EncoderDecoder(models.model_config(config.model))
    abstract = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), jnp.ones((1, 1), jnp.int32),
                           jnp.ones((1, 1), jnp.int32), deterministic=True)["params"])
    params, _, step = checkpoints.restore(checkpoints.manager(workdir, read_only=True),
                                          abstract, step=step)
    return cls(config, tokenizer, params, step)

  def translate(self, texts: Sequence[str]) -> list[str]:
    """One translation per input text; an empty (or blank) text gives an empty output."""
    outputs = [""] * len(texts)
    nonempty = [i for i, t in enumerate(texts) if t.strip()]
    if not nonempty:
      return outputs
    sources, truncated = pipeline.encode_texts([texts[i] for i in nonempty], self.tokenizer,
                                               self.config.max_source_length)
    if truncated:
      logging.warning("%d input(s) longer than max_source_length=%d tokens were truncated.",
                      truncated, self.config.max_source_length)
    tokens = translate_ids(self._decode, self.replicated_params, sources, self.batch_size)
    for i, row in zip(nonempty, tokens):
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
