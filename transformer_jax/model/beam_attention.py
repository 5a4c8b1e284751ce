"""Attention of beam-search hypotheses that share their cache slots (`kv_cache.reorder_beams`
points rows at the slots their beams wrote, instead of moving keys and values)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformer_jax.model.dot_product import check_groups, masked_scores, softmax_weights
from transformer_jax.model.layers import float32_sum_einsum
from transformer_jax.model.kv_cache import keys_last

Array = jax.Array


def beam_attention(query: Array, key: Array, value: Array, mask: Array | None,
                   slot_rows: Array, beams: int, *, bias: Array | None = None,
                   scale: float | None = None, softcap: float | None = None,
                   decoded: tuple[Array, Array] | None = None) -> Array:
  """`dot_product_attention` of beams that share their cache slots: each source's `beams`
  consecutive rows are the hypotheses of one beam search, and row j reads slot s from row
  j + slot_rows[j, s] of its source, the row whose beam wrote it (`reorder_beams`). Each query
  meets every key of its source's rows, the slots of other beams masked out, so the cache is
  read once per step as in plain decoding and never copied when beams are reordered (`beams`
  times the arithmetic; a prompt is read once with `decoded`: RESULTS.md, issue #42).

  Args:
    query: [r, q, h, d], r = sources x beams.
    key: the cache's keys [r, L, n, d] (n dividing h, as in `dot_product_attention`).
    value: like `key`.
    mask: boolean, broadcastable to [r, h, q, L].
    slot_rows: int [r, L]: where each row's slots are, as offsets from the row.
    beams: rows per source.
    bias, scale, softcap: as in `dot_product_attention`.
    decoded: where the cache holds a prompt (the first prompt_length[r] slots of row r, alike
      in every beam of a source) and then its decoded slots: (keys, values, prompt_length [r]),
      the decoded slots kept apart as `with_beam_slots` keeps them, [b, beams, n, d, D]
      (decoded slot t is the cache's slot prompt_length + t). Each row then reads the prompt
      in its own row, and only the decoded slots from every holder: L + beams x D slots a
      query instead of beams x L.

  Returns:
    [r, q, h, d] outputs in `value.dtype`.
  """
  rows, num_queries, heads, head_dim = query.shape
  length, kv_heads = key.shape[1], key.shape[2]
  group = check_groups(heads, kv_heads)
  sources = rows // beams
  scale = jnp.float32(head_dim ** -0.5 if scale is None else scale)
  own = None
  if decoded is not None:  # the prompt, read in each row's own slots
    keys, values, prompt_length = decoded
    length = keys.shape[-1]
    in_prompt = jnp.arange(key.shape[1])[None, :] < prompt_length[:, None]  # [r, L]
    own_mask = in_prompt[:, None, None] if mask is None else mask & in_prompt[:, None, None]
    own, prompt_values = _prompt_part(query, key, value, own_mask, bias, softcap, scale, beams)
    slot_rows, mask, bias = _decoded_slots(prompt_length, length, slot_rows, mask, bias)
  else:
    # Source b, holder beam i, key/value head n, querying beam j, group g, query q, slot l.
    # The keys and values are split from the cache's own layout (`keys_last`), and both beams
    # are batch dimensions of the products, so that they read the cache without a copy.
    keys, values = (keys_last(x).reshape(sources, beams, kv_heads, head_dim, length)
                    for x in (key, value))
  queries = jnp.transpose(query.reshape(sources, beams, num_queries, kv_heads, group, head_dim),
                          (0, 3, 1, 4, 2, 5))[:, None]  # [b, 1, n, j, g, q, d]
  queries = jnp.broadcast_to(queries, (sources, beams) + queries.shape[2:])
  scores = float32_sum_einsum("binjgqd,bindl->binjgql", queries, keys) * scale
  holder = jnp.arange(beams)[None, :, None] + slot_rows.reshape(sources, beams, length)
  held = holder[:, None] == jnp.arange(beams)[None, :, None, None]  # [b, i, j, L]
  visible = held[:, :, None, :, None, None, :]
  if mask is not None:
    visible = visible & _by_source(mask, sources, beams, kv_heads, num_queries, length)
  if bias is not None:
    bias = _by_source(bias, sources, beams, kv_heads, num_queries, length)
  if own is None:
    weights = softmax_weights(scores, visible, bias, softcap,
                               axis=(1, 6)).astype(value.dtype)  # over holders and slots
  else:  # one softmax over the prompt's slots and the holders' decoded ones
    scores = masked_scores(scores, visible, bias, softcap)
    top = jnp.maximum(jnp.max(own, axis=-1), jnp.max(scores, axis=(1, 6)))  # [b, n, j, g, q]
    own = jnp.exp(own - top[..., None])
    scores = jnp.exp(scores - top[:, None, ..., None])
    total = jnp.sum(own, axis=-1) + jnp.sum(scores, axis=(1, 6))
    weights = (scores / total[:, None, ..., None]).astype(value.dtype)
    own = (own / total[..., None]).astype(value.dtype)
  # Each holder's part in float32, so that 16-bit values round once, after the sum.
  out = float32_sum_einsum("binjgql,bindl->binjgqd", weights, values
                           ).sum(axis=1)  # [b, n, j, g, q, d]
  if own is not None:  # the prompt's part, from each row's own slots
    out = out + float32_sum_einsum("bnjgql,bjndl->bnjgqd", own, prompt_values)
  return jnp.transpose(out.astype(value.dtype), (0, 2, 4, 1, 3, 5)).reshape(
      rows, num_queries, heads, head_dim)


def _prompt_part(query: Array, key: Array, value: Array, mask: Array, bias: Array | None,
                 softcap: float | None, scale: Array, beams: int) -> tuple[Array, Array]:
  """The prompt's masked scores [b, n, j, g, q, L], each row reading the prompt in its own
  slots (`mask`: those of its prompt), and its values [b, j, n, d, L] (`beam_attention`'s
  `decoded` case)."""
  rows, num_queries, heads, head_dim = query.shape
  length, kv_heads = key.shape[1], key.shape[2]
  sources, group = rows // beams, heads // kv_heads
  grouped = query.reshape(rows, num_queries, kv_heads, group, head_dim)
  own = float32_sum_einsum("rqngd,rknd->rngqk", grouped, key)
  own = jnp.swapaxes(own.reshape(sources, beams, *own.shape[1:]), 1, 2)
  by_source = lambda x: _by_source(x, sources, beams, kv_heads, num_queries, length)[:, 0]
  own = masked_scores(own * scale, by_source(mask),
                      None if bias is None else by_source(bias), softcap)
  return own, keys_last(value).reshape(sources, beams, kv_heads, head_dim, length)


def _decoded_slots(prompt_length: Array, length: int, slot_rows: Array, mask: Array | None,
                   bias: Array | None) -> tuple[Array, Array | None, Array | None]:
  """The slot offsets [r, D], mask and bias [r, h|1, q, D] of the `length` decoded slots kept
  apart: decoded slot t of row r is its cache slot prompt_length[r] + t."""
  rows = slot_rows.shape[0]
  slots = prompt_length[:, None] + jnp.arange(length)[None, :]  # [r, D]

  def gather(x):  # [r|1, h|1, q, L] -> [r, h|1, q, D]
    x = jnp.broadcast_to(x, (rows,) + x.shape[1:])
    return jnp.take_along_axis(x, slots[:, None, None, :], axis=-1, mode="clip")

  return (jnp.take_along_axis(slot_rows, slots, axis=1, mode="clip"),
          None if mask is None else gather(mask), None if bias is None else gather(bias))


def _by_source(x: Array, sources: int, beams: int, kv_heads: int, num_queries: int,
               length: int) -> Array:
  """A mask or bias broadcastable to [r, h, q, L] as `beam_attention`'s scores take it:
  [b, 1, n, j, g, q, L] (n and g of size 1 where it has no heads)."""
  heads = x.shape[-3] if x.ndim >= 3 else 1
  group = heads // kv_heads if heads > 1 else 1
  x = jnp.broadcast_to(x, (sources * beams, heads, num_queries, length))
  x = x.reshape(sources, beams, heads // group, group, num_queries, length)
  return jnp.transpose(x, (0, 2, 1, 3, 4, 5))[:, None]
