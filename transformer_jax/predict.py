"""Inference: turn source texts into outputs (translations, summaries, labels).

`Predictor.from_workdir(workdir)` loads the config, tokenizer and latest (or a given, or the
average of the last N) checkpoint saved by training and maps lists of strings to outputs,
batched by length, with the generation settings of `config.decoding` (greedy, sampling or beam
search). Evaluation reuses `decode_fn` and `generate_ids` for its BLEU / ROUGE / accuracy.
"""

from __future__ import annotations

import collections
import difflib
import functools
import json
from typing import Iterable, Iterator, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from transformer_jax import checkpoints
from transformer_jax import config_validation
from transformer_jax import decoding
from transformer_jax import models
from transformer_jax import parallel
from transformer_jax import tasks
from transformer_jax import tokenizer as tokenizer_lib
from transformer_jax import workdir as workdir_lib
from transformer_jax.data import pipeline

def init_cache(model: nn.Module, batch_size: int, source_len: int, cache_len: int):
  """Zeroed decoder KV cache for `batch_size` rows and `cache_len` positions, shaped without
  running the model (`source_len` is the encoder input length; unused by decoder-only)."""
  if isinstance(model, models.DecoderOnly):
    init = lambda: model.init(jax.random.PRNGKey(0), jnp.ones((batch_size, cache_len), jnp.int32),
                              deterministic=True, decode=True)
  else:
    init = lambda: model.init(jax.random.PRNGKey(0), jnp.ones((batch_size, source_len), jnp.int32),
                              jnp.ones((batch_size, cache_len), jnp.int32), deterministic=True,
                              decode=True)
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(init)["cache"])


def max_decode_len(decoding_config: ml_collections.ConfigDict,
                   model_config: models.TransformerConfig, source_len: int,
                   prompt_len: int = 0) -> int:
  """Longest output: `decoding.max_decode_len`, or (when 0) source length + 50; never past
  the model's position range (which a prefix LM's prompt of `prompt_len` shares)."""
  length = decoding_config.max_decode_len or source_len + 50
  room = model_config.max_len - prompt_len
  if decoding_config.max_decode_len > room:
    raise ValueError(f"config.decoding.max_decode_len={length} does not fit config.model."
                     f"max_len={model_config.max_len} (after a {prompt_len}-token prompt); "
                     "lower it or raise max_len.")
  return min(length, room)


def cached_tokens_to_logits(model: models.EncoderDecoder, params, encoded, source):
  """The decoding callback: next-token logits [n, vocab] from the decoder's KV cache."""

  def tokens_to_logits(ids, cache):
    logits, variables = model.apply(
        {"params": params, "cache": cache}, encoded, source, ids, deterministic=True,
        decode=True, mutable=["cache"], method=model.decode)
    return logits[:, -1], variables["cache"]

  return tokens_to_logits


def _prefix_lm_start(model: models.DecoderOnly, params, prompts, max_len: int, rows: int):
  """Fills the KV cache with right-padded prompts `SOURCE <eos>` [b, P]; returns the cache and
  a decoding callback for `rows` (= b, or b * beam) rows.

  The cache holds `<bos> SOURCE` (the training input up to the EOS), so decoding starts by
  feeding EOS, whose logits predict the first target token, exactly as in training. Padding
  slots are masked out and each row's positions continue from its own prompt length.
  """
  batch_size, prompt_len = prompts.shape
  filled = models.shift_right(prompts, model.config.bos_id)  # [b, P]: <bos> SOURCE, 0...
  cache_mask = jnp.concatenate([filled != 0, jnp.ones((batch_size, max_len), bool)], axis=1)
  cache_mask = cache_mask[:, None, None, :]  # [b, 1, 1, P + max_len]
  offset = prompt_len - jnp.sum(filled != 0, axis=1)  # [b]: padding slots before decoding
  cache = init_cache(model, batch_size, prompt_len, prompt_len + max_len)
  _, variables = model.apply({"params": params, "cache": cache}, filled, deterministic=True,
                             decode=True, cache_mask=cache_mask, mutable=["cache"])
  if rows != batch_size:  # beam search: the callback sees [batch * beam] rows
    cache_mask = decoding.flat_batch_beam_expand(cache_mask, rows // batch_size)
    offset = decoding.flat_batch_beam_expand(offset, rows // batch_size)

  def tokens_to_logits(ids, cache):
    logits, new = model.apply({"params": params, "cache": cache}, ids, deterministic=True,
                              decode=True, cache_mask=cache_mask, decode_offset=offset,
                              mutable=["cache"])
    return logits[:, -1], new["cache"]

  return variables["cache"], tokens_to_logits


def _generate(params, inputs, rng, *, model: nn.Module,
              decoding_config: ml_collections.ConfigDict, max_len: int, nbest: int = 1):
  """[b, src_len] source tokens -> ([b, nbest, max_len] output tokens, [b, nbest] scores),
  best first, with the KV cache. Scores are what the search ranks by: the length-penalised
  log-probability for beam search, the log-probability for greedy and sampled outputs."""
  d = decoding_config
  beam = d.method == "beam"
  batch_size = inputs.shape[0]
  copies = d.beam_size if beam else nbest  # rows per input the callback sees
  rows = batch_size * copies
  if isinstance(model, models.DecoderOnly):
    cache, tokens_to_logits = _prefix_lm_start(model, params, inputs, max_len, rows)
    start = tokenizer_lib.EOS_ID
  else:
    encoded = model.apply({"params": params}, inputs, deterministic=True, method=model.encode)
    source = inputs
    if copies > 1:
      encoded = decoding.flat_batch_beam_expand(encoded, copies)
      source = decoding.flat_batch_beam_expand(inputs, copies)
    tokens_to_logits = cached_tokens_to_logits(model, params, encoded, source)
    cache = init_cache(model, batch_size, inputs.shape[1], max_len)
    start = model.config.bos_id
  common = dict(eos_id=tokenizer_lib.EOS_ID, max_decode_len=max_len, bos_id=start)
  if beam:
    sequences, scores = decoding.beam_search(inputs, cache, tokens_to_logits,
                                             beam_size=d.beam_size, alpha=d.alpha, **common)
    return sequences[:, :nbest], scores[:, :nbest]
  if nbest > 1:  # independent samples of each input, ranked by log-probability
    cache = decoding.expand_cache(cache, nbest)
  if d.method == "greedy":
    tokens, scores = decoding.greedy_search(cache, tokens_to_logits, batch_size=rows,
                                            return_logprobs=True, **common)
  else:
    tokens, scores = decoding.sample(cache, tokens_to_logits, rng, batch_size=rows,
                                     temperature=d.temperature, top_k=d.top_k, top_p=d.top_p,
                                     return_logprobs=True, **common)
  tokens, scores = tokens.reshape(batch_size, nbest, -1), scores.reshape(batch_size, nbest)
  order = jnp.argsort(-scores, axis=1)
  return (jnp.take_along_axis(tokens, order[:, :, None], axis=1),
          jnp.take_along_axis(scores, order, axis=1))


def _classify(params, inputs, rng, *, model: models.EncoderClassifier, nbest: int = 1):
  """([b, nbest, 1] class ids, [b, nbest] log-probabilities), most likely first."""
  del rng
  logits = model.apply({"params": params}, inputs, deterministic=True)
  scores, ids = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32)), nbest)
  return ids[:, :, None], scores


def check_nbest(decoding_config: ml_collections.ConfigDict, nbest: int,
                num_classes: int | None = None) -> None:
  """Raises ValueError when the decoding method cannot give `nbest` outputs."""
  d = decoding_config
  if nbest < 1:
    raise ValueError(f"nbest={nbest}: ask for at least 1 output.")
  if num_classes is not None:
    if nbest > num_classes:
      raise ValueError(f"nbest={nbest}: the classifier has only {num_classes} classes.")
  elif d.method == "beam" and nbest > d.beam_size:
    raise ValueError(f"nbest={nbest} needs decoding.beam_size >= {nbest} (it is "
                     f"{d.beam_size}).")
  elif d.method == "greedy" and nbest > 1:
    raise ValueError(f"nbest={nbest}: greedy search gives one output; use decoding.method "
                     "'beam' (beam_size >= nbest) or 'sample'.")


def decode_fn(model: nn.Module, decoding_config: ml_collections.ConfigDict, layout=None,
              nbest: int = 1):
  """(placed params, placed inputs, rng) -> (output tokens [.., nbest, len] ([.., nbest, 1]
  class ids for a classifier), scores [.., nbest]), compiled by `layout` (default pmap) once
  per source length."""
  layout = layout or parallel.DataParallel()
  compiled: dict[int, object] = {}  # by source length

  def run(device_params, device_inputs, rng):
    source_len = device_inputs.shape[-1]
    if source_len not in compiled:
      if isinstance(model, models.EncoderClassifier):
        fn = functools.partial(_classify, model=model, nbest=nbest)
      else:
        prompt_len = source_len if isinstance(model, models.DecoderOnly) else 0
        max_len = max_decode_len(decoding_config, model.config, source_len, prompt_len)
        fn = functools.partial(_generate, model=model, decoding_config=decoding_config,
                               max_len=max_len, nbest=nbest)
      compiled[source_len] = layout.compile_decode(fn)
    return compiled[source_len](device_params, device_inputs, rng)

  return run


def translate_ids(p_decode, device_params, sources: np.ndarray, batch_size: int,
                  seed: int = 0, layout=None) -> list[tuple[np.ndarray, np.ndarray]]:
  """(output tokens [nbest, len], scores [nbest]) for source tokens [n, src_len], in order."""
  layout = layout or parallel.DataParallel()
  outputs = []
  for index, start in enumerate(range(0, len(sources), batch_size)):
    rows = sources[start:start + batch_size]
    padded = np.pad(rows, ((0, batch_size - len(rows)), (0, 0)))  # fixed shape: one compile
    rng = jax.random.fold_in(jax.random.PRNGKey(seed), index)
    tokens, scores = layout.host_rows(p_decode(device_params, layout.eval_batch(padded), rng))
    outputs.extend(zip(tokens[:len(rows)], scores[:len(rows)]))
  return outputs


def generate_ids(p_decode, device_params, prompts: Sequence[np.ndarray], max_len: int,
                 batch_size: int, seed: int = 0, layout=None
                 ) -> list[tuple[np.ndarray, np.ndarray]]:
  """(output tokens [nbest, len], scores [nbest]) for token sequences of any length (EOS
  included), in order: grouped into length buckets so short ones are not padded to the
  longest."""
  buckets: dict[int, list[int]] = {}
  for i, ids in enumerate(prompts):
    buckets.setdefault(_bucket_length(len(ids), max_len), []).append(i)
  outputs: list = [None] * len(prompts)
  for length, indices in sorted(buckets.items()):
    sources = np.zeros((len(indices), length), np.int32)
    for row, i in enumerate(indices):
      sources[row, :len(prompts[i])] = prompts[i]
    results = translate_ids(p_decode, device_params, sources, batch_size, seed, layout)
    for i, result in zip(indices, results):
      outputs[i] = result
  return outputs


def restore_params(workdir: str, model: nn.Module, step: int | None = None,
                   average_last: int = 1, layout=None):
  """Parameters at `step` (default latest), or the mean of the last `average_last` checkpoints
  up to it (the paper averages the last 5 or 20), in `layout`'s shardings (default: one
  device), whatever layout saved them. Returns (params, step)."""
  abstract = jax.eval_shape(lambda: tasks.init_params(model, jax.random.PRNGKey(0)))
  if layout is not None:
    abstract = layout.abstract_params(abstract)
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


class Predictor:
  """A trained model, its tokenizer and compiled generation, ready to turn texts into outputs:
  translations, summaries, or label names.

  Decoding settings may be overridden per call (`predict(texts, beam_size=8)`); the compiled
  functions are kept per setting (the most recent `MAX_DECODERS`), so a new setting never
  reuses a stale one.
  """
  MAX_DECODERS = 8

  def __init__(self, config: ml_collections.ConfigDict, tokenizer: tokenizer_lib.Tokenizer,
               params, step: int | None = None, layout=None):
    self.config = config
    self.tokenizer = tokenizer
    self.step = step
    self.model = tasks.make_model(config)
    # The training config's layout (pmap or jit over a mesh) on this machine's devices.
    self.layout = layout or parallel.make_layout(config)
    self.batch_size = config.per_device_batch_size * self.layout.eval_devices
    self.params = params  # None: set device_params before use (training's evaluator)
    self.device_params = None if params is None else self.layout.place_params(params)
    self._decoders: collections.OrderedDict = collections.OrderedDict()

  @classmethod
  def from_workdir(cls, workdir: str, step: int | None = None, average_last: int = 1,
                   config: ml_collections.ConfigDict | None = None) -> "Predictor":
    """Loads the workdir's config (or `config`, e.g. the saved one with other decoding
    settings), tokenizer and checkpoint (the newest good one unless `step`)."""
    config = config or workdir_lib.load_config(workdir)
    tokenizer = tokenizer_lib.Tokenizer.load(workdir_lib.tokenizer_path(workdir))
    layout = parallel.make_layout(config, fit_devices=True)
    params, step = restore_params(workdir, tasks.make_model(config), step, average_last, layout)
    return cls(config, tokenizer, params, step, layout)

  def decoding_config(self, **overrides) -> ml_collections.ConfigDict:
    """config.decoding with `overrides` applied and checked (unknown keys, bad values)."""
    decoding_config = ml_collections.ConfigDict(self.config.decoding.to_dict())
    for key, value in overrides.items():
      if key not in decoding_config:
        close = difflib.get_close_matches(key, list(decoding_config), n=1)
        raise ValueError(f"Unknown decoding setting {key!r}"
                         f"{f'; did you mean {close[0]!r}' if close else ''}. Settings: "
                         f"{', '.join(decoding_config)}.")
      decoding_config[key] = value
    checked = ml_collections.ConfigDict(self.config.to_dict())
    checked.decoding = decoding_config
    config_validation.validate(checked)
    return decoding_config

  def _decoder(self, decoding_config: ml_collections.ConfigDict, nbest: int):
    key = (json.dumps(decoding_config.to_dict(), sort_keys=True), nbest)
    if key not in self._decoders:
      self._decoders[key] = decode_fn(self.model, decoding_config, self.layout, nbest)
      if len(self._decoders) > self.MAX_DECODERS:
        self._decoders.popitem(last=False)
    self._decoders.move_to_end(key)
    return self._decoders[key]

  def output_ids(self, prompts: Sequence[np.ndarray], nbest: int = 1,
                 decoding_config: ml_collections.ConfigDict | None = None,
                 with_scores: bool = False) -> list:
    """Generated tokens (or [class id]) for encoded sources, EOS included, in order: the best
    array per prompt, or with `with_scores` a list of `nbest` (tokens, score) pairs, best
    first."""
    decoding_config = decoding_config or self.config.decoding
    results = generate_ids(self._decoder(decoding_config, nbest), self.device_params, prompts,
                           self.config.max_source_length, self.batch_size, decoding_config.seed,
                           self.layout)
    if with_scores:
      return [list(zip(tokens, scores.tolist())) for tokens, scores in results]
    return [tokens[0] for tokens, _ in results]

  def output_text(self, ids: np.ndarray) -> str:
    if isinstance(self.model, models.EncoderClassifier):
      names = self.config.label_names
      label = int(ids[0])
      return names[label] if label < len(names) else str(label)
    return self.tokenizer.decode(ids)

  def _prompts(self, texts: Sequence[str]) -> dict[int, np.ndarray]:
    """Encoded non-empty texts by position; over-long ones truncated (one warning)."""
    max_len = self.config.max_source_length
    token_ids = {i: self.tokenizer.encode(t) for i, t in enumerate(texts) if t.strip()}
    too_long = sum(len(ids) + 1 > max_len for ids in token_ids.values())
    if too_long:
      logging.warning("%d input(s) longer than max_source_length=%d tokens were truncated.",
                      too_long, max_len)
    return {i: pipeline.with_eos(ids, max_len) for i, ids in token_ids.items()}

  def predict(self, texts: Sequence[str], **decoding_overrides) -> list[str]:
    """One output per text, in order; empty texts give empty outputs. Keyword arguments
    override config.decoding for this call (method, beam_size, alpha, temperature, ...)."""
    decoding_config = self.decoding_config(**decoding_overrides)
    prompts = self._prompts(texts)
    outputs = [""] * len(texts)
    for i, ids in zip(prompts, self.output_ids(list(prompts.values()), 1, decoding_config)):
      outputs[i] = self.output_text(ids)
    return outputs

  def predict_nbest(self, texts: Sequence[str], n: int,
                    **decoding_overrides) -> list[list[tuple[str, float]]]:
    """The `n` best outputs per text as (text, score) pairs, best first; the score is the
    log-probability the search ranks by (length-penalised for beam search; for a classifier,
    the class's log-probability). Empty texts give empty lists."""
    decoding_config = self.decoding_config(**decoding_overrides)
    classifier = isinstance(self.model, models.EncoderClassifier)
    check_nbest(decoding_config, n, self.config.model.num_classes if classifier else None)
    prompts = self._prompts(texts)
    outputs: list[list[tuple[str, float]]] = [[] for _ in texts]
    for i, pairs in zip(prompts, self.output_ids(list(prompts.values()), n, decoding_config,
                                                 with_scores=True)):
      outputs[i] = [(self.output_text(ids), score) for ids, score in pairs]
    return outputs

  def predict_lines(self, lines: Iterable[str], chunk_size: int = 1024) -> Iterator[str]:
    """Streams outputs for `lines`, `chunk_size` at a time, never holding the whole input."""
    for chunk in chunk_lines(lines, chunk_size):
      yield from self.predict(chunk)

  # Translation names, kept for existing callers.
  translate = predict
  translate_lines = predict_lines


def chunk_lines(lines: Iterable[str], size: int) -> Iterator[list[str]]:
  chunk = []
  for line in lines:
    chunk.append(line.rstrip("\r\n"))
    if len(chunk) == size:
      yield chunk
      chunk = []
  if chunk:
    yield chunk


Translator = Predictor
