"""The decoding KV cache's layout and its beam-search slots: keys and values kept keys-last,
the decoded slots of a beam search kept apart from its prompt's, and beams reordered by
pointing each row at the rows that hold its slots instead of moving keys and values."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

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
      tree.update(decoded_key=jnp.zeros(shape, tree["cached_key"].dtype),
                  decoded_value=jnp.zeros(shape, tree["cached_value"].dtype))
    return tree
  return add(cache)


_PER_BEAM = ("decoded_key", "decoded_value")  # `with_beam_slots`' leaves


def expand_beams(cache: Any, beams: int) -> Any:
  """Beam search's expansion of a cache filled for `beams` > 1 (decoding.expand_cache): each
  row repeated `beams` times, except `with_beam_slots`' leaves, made per beam already."""
  def expand(path, x):
    if x.ndim == 0 or getattr(path[-1], "key", None) in _PER_BEAM:
      return x
    return jnp.repeat(x, beams, axis=0)
  return jax.tree_util.tree_map_with_path(expand, cache)


def reorder_beams(cache: Any, rows: Array) -> Any:
  """Beam search's reorder of a cache filled with `beams` > 1: row r goes on with the
  hypothesis of row rows[r]. Keys and values stay where they are: each row's slot offsets
  (`beam_attention`) are pointed at the rows that hold its new hypothesis's slots instead.
  Every other per-row entry of the cache is gathered; scalars are shared."""
  def reorder(path, x):
    name = getattr(path[-1], "key", None)
    if x.ndim == 0 or name in ("cached_key", "cached_value") + _PER_BEAM:
      return x
    if name == "slot_rows":
      return x[rows] + (rows - jnp.arange(x.shape[0]))[:, None]
    return jnp.take(x, rows, axis=0, mode="clip")
  return jax.tree_util.tree_map_with_path(reorder, cache)
