"""Per sequence family, what decoding needs of the model: a zeroed KV cache
(`init_cache`), the prompts read into it (`prefill`, with the context its steps need), and the
step callback `tokens_to_logits(ids, cache)` the searches call (`step_logits`). The searches
(decoding.py, beam_search.py) know nothing of the model but that callback.

A family makes its runner from its Flax model (families.py); `Runner.start_decoding` is what
a decode calls: cache, callback and first token for a batch of prompts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformer_jax import tokenizer as tokenizer_lib
from transformer_jax.inference import prompt_packing
from transformer_jax.model import attention
from transformer_jax.model import kv_cache
from transformer_jax.model import models

Array = jax.Array


class Runner:
  """A sequence model's decoding: `model` (a models.EncoderDecoder or models.DecoderOnly) and
  its `model_config`."""

  def __init__(self, model, model_config):
    self.model = model
    self.model_config = model_config

  def start_decoding(self, params, inputs: Array, rows: int, max_len: int, packing=None,
                     beams: int = 1):
    """(cache, tokens_to_logits over `rows` flat rows, first token) for `inputs` [b, len].
    `beams` > 1: the rows are the hypotheses of a beam search that reorders the cache with
    kv_cache.reorder_beams (the keys and values stay where they were written)."""
    cache, context, start_id = self.prefill(params, inputs, rows, max_len, packing)
    if beams > 1:
      cache = kv_cache.with_beam_slots(cache, max_len, beams)
    return cache, self.step_logits(params, context, beams), start_id

  def prefill(self, params, inputs: Array, rows: int, max_len: int, packing=None):
    """(cache, context, first token): `start_decoding` with its callback's inputs (encoder
    output, masks: arrays) returned as `context`, so that a decode split into several compiled
    calls (a server streaming tokens) can carry them from one call to the next. `packing`:
    the prompts are read packed (prompt_packing.place), with the same results per row."""
    raise NotImplementedError

  def step_logits(self, params, context, beams: int = 1):
    """The decoding callback tokens_to_logits(ids [n, 1], cache) of a `prefill` context;
    `beams`: `start_decoding`'s."""
    raise NotImplementedError

  def widest_refill(self, source_length: int, cache_length: int) -> int:
    """The widest prompts [k, P] `refill` takes into a pool whose sources hold source_length
    tokens and whose cache cache_length slots per row (prompts packed side by side may be
    wider than any one prompt)."""
    del cache_length
    return source_length

  def refill(self, params, cache, context, row_ids: Array, inputs: Array, packing=None):
    """(cache, context, first tokens [k]): the prompts `inputs` [k, P] read into the rows
    `row_ids` [k] of a live `cache` and `context` (a `prefill`'s, one row per prompt, while
    its other rows decode on), each as `prefill` reads a prompt alone: a finished row's slot
    refilled with a waiting request. Ids past the last row are dropped (padding). The other
    rows' keys, values and write positions stay as they were, so their outputs do not
    change."""
    raise NotImplementedError


class EncoderDecoderRunner(Runner):
  """The encoder reads the prompts once; the decoder's self-attention keeps a KV cache and
  its cross-attention the encoder output's keys and values, once per source."""

  def init_cache(self, batch_size: int, source_len: int, cache_len: int):
    """Zeroed decoder KV cache for `batch_size` rows and `cache_len` positions, shaped
    without running the model."""
    init = lambda: self.model.init(
        jax.random.PRNGKey(0), jnp.ones((batch_size, source_len), jnp.int32),
        jnp.ones((batch_size, cache_len), jnp.int32), deterministic=True, decode=True)
    return jax.tree.map(jnp.zeros_like, jax.eval_shape(init)["cache"])

  def encoded_key_value(self, params, encoded: Array, source: Array):
    """Every decoder layer's cross-attention keys/values for `encoded` [b, src_len, emb]: the
    'encoded_kv' collection, computed once per source (by one discarded decoder step)."""
    model = self.model
    cache = self.init_cache(source.shape[0], source.shape[1], 1)
    first = jnp.full((source.shape[0], 1), self.model_config.bos_id, jnp.int32)
    _, variables = model.apply({"params": params, "cache": cache}, encoded, source, first,
                               deterministic=True, decode=True, mutable=["cache", "encoded_kv"],
                               method=model.decode)
    # The barrier keeps them computed here, in the layout attention.py stores them in: XLA
    # would otherwise sink the transposes into the decoding loop, a copy of every layer's
    # keys and values per step.
    return jax.lax.optimization_barrier(variables["encoded_kv"])

  def cached_tokens_to_logits(self, params, encoded: Array, source: Array):
    """The decoding callback: next-token logits [n, vocab] from the decoder's KV cache, for
    n = a multiple of the b source rows (beams or samples of each source, row-major)."""
    return self.step_logits(params, self._context(params, encoded, source))

  def refill(self, params, cache, context, row_ids, inputs, packing=None):
    source_len = context["source"].shape[1]
    if inputs.shape[1] > source_len:
      raise ValueError(f"Prompts of {inputs.shape[1]} tokens cannot refill rows of a batch "
                       f"whose sources hold {source_len}.")
    if kv_cache.length_and_rows(cache)[1] != context["source"].shape[0]:
      raise ValueError("Rows of a batch decoding several outputs per source cannot be "
                       "refilled one at a time.")
    inputs = jnp.pad(inputs, ((0, 0), (0, source_len - inputs.shape[1])))
    fresh, new, start = self.prefill(params, inputs, inputs.shape[0], kv_cache.length(cache),
                                     packing)
    context = jax.tree.map(lambda live, x: live.at[row_ids].set(x, mode="drop"), context, new)
    starts = jnp.broadcast_to(jnp.asarray(start, jnp.int32), row_ids.shape)
    return kv_cache.insert_rows(cache, fresh, row_ids), context, starts

  def _context(self, params, encoded: Array, source: Array) -> dict:
    return {"encoded": encoded, "source": source,
            "encoded_kv": self.encoded_key_value(params, encoded, source)}

  def step_logits(self, params, context, beams=1):
    model = self.model

    def tokens_to_logits(ids, cache):
      logits, variables = model.apply(
          {"params": params, "cache": cache, "encoded_kv": context["encoded_kv"]},
          context["encoded"], context["source"], ids, deterministic=True, decode=True,
          beams=beams, mutable=["cache"], method=model.decode)
      return logits[:, -1], variables["cache"]

    return tokens_to_logits

  def prefill(self, params, inputs, rows, max_len, packing=None):
    # Beams and samples share their source's encoder output and cross-attention keys/values:
    # nothing per source is copied per row.
    model = self.model
    if packing is None:
      encoded = model.apply({"params": params}, inputs, deterministic=True,
                            method=model.encode)
    else:
      places, packed_rows = packing
      tokens, segments, positions = prompt_packing.pack(inputs, places, packed_rows)
      packed = model.apply({"params": params}, tokens, positions, segments, deterministic=True,
                           method=model.encode)  # [packed rows, len, emb]
      encoded = jnp.moveaxis(prompt_packing.unpack(jnp.moveaxis(packed, 1, -1), places,
                                                   inputs != 0), -1, 1)
    cache = self.init_cache(inputs.shape[0], inputs.shape[1], max_len)
    return cache, self._context(params, encoded, inputs), self.model_config.bos_id


class DecoderOnlyRunner(Runner):
  """One decoder: the prompts fill its KV cache, decoding continues from there. `unshifted`:
  prompts read as a pretrained tokenizer makes them (raw or chat), not `<bos> SOURCE`."""

  def __init__(self, model, model_config, unshifted: bool):
    super().__init__(model, model_config)
    self.unshifted = unshifted

  def init_cache(self, batch_size: int, cache_len: int):
    init = lambda: self.model.init(jax.random.PRNGKey(0),
                                   jnp.ones((batch_size, cache_len), jnp.int32),
                                   deterministic=True, decode=True)
    return jax.tree.map(jnp.zeros_like, jax.eval_shape(init)["cache"])

  def prefill(self, params, inputs, rows, max_len, packing=None):
    """Fills the KV cache with the right-padded prompts `SOURCE <eos>` [b, P].

    The cache holds `<bos> SOURCE` (the training input up to the EOS), so decoding starts by
    feeding EOS, whose logits predict the first target token, exactly as in training. Raw and
    chat prompts are read as they are: the cache holds all but each prompt's last token,
    which decoding starts from. Each row then goes on writing and counting positions from its
    own prompt's end (`kv_cache.with_lengths`): no padding lies between a prompt and its
    output. With `packing` the prompts fill a cache of packed rows, whose slots are then moved
    to each prompt's own row. The context is empty: the cache holds all a step needs.
    """
    model = self.model
    batch_size, prompt_len = inputs.shape
    if self.unshifted:
      last = jnp.sum(inputs != 0, axis=1, keepdims=True) - 1  # [b, 1]
      start = jnp.take_along_axis(inputs, jnp.maximum(last, 0), axis=1)[:, 0]
      filled = jnp.where(jnp.arange(prompt_len) < last, inputs, 0)
    else:
      start = tokenizer_lib.EOS_ID
      filled = models.shift_right(inputs, self.model_config.bos_id)  # <bos> SOURCE, 0...
    lengths = jnp.sum(filled != 0, axis=1)  # [b]: where each row's decoding goes on
    if packing is None:
      cache_mask = (jnp.arange(prompt_len + max_len)[None, :] < lengths[:, None])[:, None, None]
      _, variables = model.apply({"params": params, "cache": self.init_cache(
          batch_size, prompt_len + max_len)}, filled, deterministic=True, decode=True,
          cache_mask=cache_mask, prefix_fill=True, mutable=["cache"])
      cache = variables["cache"]
    else:
      cache = self._packed_fill(params, filled, packing, max_len)
    return kv_cache.with_lengths(cache, lengths), {}, start

  def widest_refill(self, source_length: int, cache_length: int) -> int:
    del source_length
    return cache_length - 1  # a slot left to decode into

  def refill(self, params, cache, context, row_ids, inputs, packing=None):
    room = kv_cache.length(cache) - inputs.shape[1]
    if room < 1:
      raise ValueError(f"Prompts of {inputs.shape[1]} tokens leave no room to decode in a "
                       f"cache of {kv_cache.length(cache)} slots.")
    fresh, _, start = self.prefill(params, inputs, inputs.shape[0], room, packing)
    starts = jnp.broadcast_to(jnp.asarray(start, jnp.int32), row_ids.shape)
    return kv_cache.insert_rows(cache, fresh, row_ids), context, starts

  def _packed_fill(self, params, filled, packing, max_len):
    """The cache of `prefill` for prompts `filled` [b, P], filled packed: each packed row's
    prompts see only themselves, at their own positions; then each prompt's cached slots go to
    its row, and the slots after them stay empty for decoding."""
    places, packed_rows = packing
    tokens, segments, positions = prompt_packing.pack(filled, places, packed_rows)
    _, variables = self.model.apply(
        {"params": params, "cache": self.init_cache(packed_rows, filled.shape[1])}, tokens,
        positions, deterministic=True, decode=True,
        cache_mask=attention.segment_mask(segments, segments), prefix_fill=True,
        mutable=["cache"])

    def to_rows(path, packed):
      if kv_cache.leaf_name(path) in kv_cache.INDEX_NAMES:  # set by `prefill`
        return jnp.zeros(filled.shape[:1], packed.dtype)
      rows = prompt_packing.unpack(packed, places, filled != 0)  # [b, ..., P]
      return jnp.pad(rows, [(0, 0)] * (rows.ndim - 1) + [(0, max_len)])

    return jax.tree_util.tree_map_with_path(to_rows, variables["cache"])

  def step_logits(self, params, context, beams=1):
    model = self.model

    def tokens_to_logits(ids, cache):
      logits, new = model.apply({"params": params, "cache": cache}, ids, deterministic=True,
                                decode=True, beams=beams, mutable=["cache"])
      return logits[:, -1], new["cache"]

    return tokens_to_logits
