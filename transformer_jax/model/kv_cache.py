"""The decoding KV cache: its layout (keys and values kept keys-last), a write position per
row, and its beam-search slots (the decoded slots of a beam search kept apart from its
prompt's, and beams reordered by pointing each row at the rows that hold its slots instead of
moving keys and values).

A cache is the Flax 'cache' collection of a model applied with decode=True: per attention
layer 'cached_key' / 'cached_value' [rows, n, d, length], and per row a write position,
'cache_index' (attention layers) and 'position_index' (position embeddings, decoder stacks)
[rows], where that row's next keys and values go and the position its next token has. Rows
are independent: each writes at its own position and attends to its own filled slots, so rows
of different prompt lengths decode side by side without padding between prompt and output,
and one row can be refilled with a new prompt while the others decode (`insert_rows`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from transformer_jax.model import quantization

Array = jax.Array


def keys_last(x: Array) -> Array:
  """[b, k, n, d] -> [b, n, d, k]: how decoding keeps keys and values (the self-attention
  cache and the source's cross-attention ones), the layout XLA:CPU's score and value matmuls
  read them in. Kept [b, k, n, d] or heads-major [b, n, k, d], each decoding step copied
  every layer's into it: at batch 1 a third of a GPT-2-size step, at batch 32 two thirds
  of a t5-small-size one (issue #42, benchmarks/RESULTS.md)."""
  return jnp.transpose(x, (0, 2, 3, 1))


def from_keys_last(x: Array) -> Array:
  return jnp.transpose(x, (0, 3, 1, 2))


INDEX_NAMES = ("cache_index", "position_index")  # a row's write position, [rows] int32
SCALE_NAMES = ("key_scale", "value_scale")  # an int8 cache's scales, [rows, n, 1, length]
CACHE_DTYPES = ("", "float32", "bfloat16", "int8")  # '': the keys' own


def stored_dtype(cache_dtype: str, dtype) -> Any:
  """What a cache of `cache_dtype` keeps keys and values of `dtype` in."""
  return jnp.dtype(cache_dtype or dtype)


def quantize(x: Array) -> tuple[Array, Array]:
  """Keys or values kept-last [rows, n, d, q] -> (int8 of the same shape, float32 scales
  [rows, n, 1, q]): symmetric absmax per token and head, as JetStream and vLLM quantize a KV
  cache."""
  return quantization.absmax_int8(x, axis=2)


def dequantize(q: Array, scale: Array, dtype) -> Array:
  return quantization.from_int8(q, scale, dtype)


def write(cached: Array, new: Array, index: Array) -> Array:
  """`new` [rows, ..., q] written into `cached` [rows, ..., length] along the last axis,
  each row from its own `index` [rows] on (a scatter, in place under jit). `index` of more
  dimensions [sources, beams] matches as many leading ones."""
  def write_row(row, new_row, start):
    return jax.lax.dynamic_update_slice(row, new_row.astype(row.dtype),
                                        (0,) * (row.ndim - 1) + (start,))
  for _ in range(index.ndim):
    write_row = jax.vmap(write_row)
  return write_row(cached, new, index)


def decode_positions(module, rows: int, length: int) -> tuple[Array, Array]:
  """While decoding: (each row's first cache slot this call writes [rows], the positions
  [rows, len] of the tokens it feeds), from the row's write position in `module`'s cache
  ('position_index', `kv_cache`), which the call advances. The init pass that creates the
  cache gives 0..len-1 and leaves the positions at 0."""
  initialized = module.has_variable("cache", "position_index")
  index = module.variable("cache", "position_index", jnp.zeros, (rows,), jnp.int32)
  start = index.value
  if initialized:
    index.value = start + length
  return start, start[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]


def visible(index: Array, num_new: int, length: int, prefix_fill: bool = False) -> Array:
  """[rows, 1, q, length]: the slots the `num_new` tokens written from each row's `index` see:
  new token i those up to its own slot (causal); with `prefix_fill` every new token sees all
  of them (a prefix LM's prompt)."""
  last = index[:, None] + (jnp.full((num_new,), num_new - 1) if prefix_fill
                           else jnp.arange(num_new))[None, :]  # [rows, q]
  return (jnp.arange(length)[None, None, :] <= last[:, :, None])[:, None]


def with_lengths(cache: Any, lengths: Array) -> Any:
  """`cache` with every row's write position set to its `lengths` [rows]: after a prefill of
  right-padded prompts, each row goes on from its own prompt's end (the padding slots after
  it are written over by its next tokens, and unseen until then)."""
  lengths = jnp.asarray(lengths, jnp.int32)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: lengths if leaf_name(path) in INDEX_NAMES else x, cache)


def insert_rows(cache: Any, rows_cache: Any, row_ids: Array) -> Any:
  """`cache` with its rows `row_ids` [k] replaced by the k rows of `rows_cache` (a cache of the
  same layout and length, e.g. new prompts' prefill): refilling slots of a live batch. Ids
  past the last row are dropped (padding of a bucketed k)."""
  return jax.tree.map(lambda x, new: x.at[row_ids].set(new.astype(x.dtype), mode="drop"),
                      cache, rows_cache)


def length_and_rows(cache: Any) -> tuple[int, int]:
  """(slots, rows) of a cache's self-attention keys."""
  for path, x in jax.tree_util.tree_leaves_with_path(cache):
    if leaf_name(path) == "cached_key":
      return x.shape[-1], x.shape[0]
  raise ValueError("The cache holds no self-attention keys ('cached_key').")


def length(cache: Any) -> int:
  """The slots of each row of a cache: its prompt and output together."""
  return length_and_rows(cache)[0]


def leaf_name(path) -> str | None:
  """The key naming a tree leaf (a `tree_map_with_path` path), or None."""
  return getattr(path[-1], "key", None)


def beam_slots(x: Array, slot_rows: Array) -> Array:
  """A cache's keys or values [r, L, n, d] as each row's beam reads them (slot s of row j from
  row j + slot_rows[j, s]): a copy, for the attention that `beam_attention` does not cover
  (learned scores, captured weights)."""
  rows, length = slot_rows.shape
  return x[jnp.arange(rows)[:, None] + slot_rows, jnp.arange(length)[None, :]]


def with_beam_slots(cache: Any, max_len: int, beams: int) -> Any:
  """A filled cache for a beam search of `beams` rows a source: where a self-attention cache
  holds a prompt before its `max_len` decoding slots, 'decoded_key' / 'decoded_value' beside it
  take the decoded keys and values apart (`beam_attention`'s `decoded`). They are kept
  [sources, beams, n, d, max_len], the shape `beam_attention` reads (`expand_beams` leaves them
  so): read through a reshape, XLA:CPU wrote each of them twice a step, on copies of the
  whole buffer."""
  def add(tree):
    if not isinstance(tree, dict):
      return tree
    tree = {name: add(x) for name, x in tree.items()}
    if "cached_key" in tree and tree["cached_key"].shape[-1] > max_len:
      sources, heads, head_dim, _ = tree["cached_key"].shape  # not yet expanded to beams
      shape = (sources, beams, heads, head_dim, max_len)
      # An int8 cache's decoded slots are kept apart unquantized (a beam search's few).
      dtype = lambda x: jnp.float32 if x.dtype == jnp.int8 else x.dtype
      tree.update(decoded_key=jnp.zeros(shape, dtype(tree["cached_key"])),
                  decoded_value=jnp.zeros(shape, dtype(tree["cached_value"])),
                  prompt_length=tree["cache_index"])  # decoded slot t is slot prompt_length + t
    return tree
  return add(cache)


_PER_BEAM = ("decoded_key", "decoded_value")  # `with_beam_slots`' leaves


def expand_beams(cache: Any, beams: int) -> Any:
  """Beam search's expansion of a cache filled for `beams` > 1 (decoding.expand_cache): each
  row repeated `beams` times, except `with_beam_slots`' leaves, made per beam already."""
  def expand(path, x):
    if leaf_name(path) in _PER_BEAM:
      return x
    return jnp.repeat(x, beams, axis=0)
  return jax.tree_util.tree_map_with_path(expand, cache)


def reorder_beams(cache: Any, rows: Array) -> Any:
  """Beam search's reorder of a cache filled with `beams` > 1: row r goes on with the
  hypothesis of row rows[r]. Keys and values stay where they are: each row's slot offsets
  (`beam_attention`) are pointed at the rows that hold its new hypothesis's slots instead.
  Every other per-row entry of the cache is gathered."""
  def reorder(path, x):
    name = leaf_name(path)
    if name in ("cached_key", "cached_value") + SCALE_NAMES + _PER_BEAM:
      return x
    if name == "slot_rows":
      return x[rows] + (rows - jnp.arange(x.shape[0]))[:, None]
    return jnp.take(x, rows, axis=0, mode="clip")
  return jax.tree_util.tree_map_with_path(reorder, cache)
