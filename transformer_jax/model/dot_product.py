"""Attention masks and scaled dot-product attention (the reference einsums every kernel is
checked against).

Shape letters: b = batch, q = query length, k = key/value length, h = (query) heads, d = head
dim; with grouped-query attention n = key/value heads and g = h / n query heads per key/value
head (query head i reads key/value head i // g, as Hugging Face's `repeat_kv` and
`jax.nn.dot_product_attention` group them). Masks are booleans, True = may attend,
broadcastable to [b, h, q, k].
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.model import layers

Array = jax.Array
# Added to masked scores. Finite, so a fully masked row gives uniform weights, not NaN.
_MASKED_SCORE = jnp.finfo(jnp.float32).min


def causal_mask(length: int) -> Array:
  """[length, length] lower-triangular mask: position i may attend to positions <= i."""
  return nn.make_causal_mask(jnp.zeros((length,)), dtype=jnp.bool_)[0]


def padding_mask(query_tokens: Array, key_tokens: Array, pad_id: int = 0) -> Array:
  """[b, 1, q, k] mask: True where neither the query nor the key token is padding."""
  return nn.make_attention_mask(query_tokens != pad_id, key_tokens != pad_id, dtype=jnp.bool_)


def segment_mask(query_segments: Array, key_segments: Array) -> Array:
  """[b, 1, q, k] mask for packed sequences: True where query and key share a segment."""
  return nn.make_attention_mask(query_segments, key_segments, jnp.equal, dtype=jnp.bool_)


def combine_masks(*masks: Array | None) -> Array | None:
  """Logical AND of the masks that are not None (None if all are); lower-rank masks (such
  as a [q, k] causal mask) broadcast against the leading dimensions of the others."""
  present = [m for m in masks if m is not None]
  rank = max((m.ndim for m in present), default=0)
  present = [m.reshape((1,) * (rank - m.ndim) + m.shape) for m in present]
  return nn.combine_masks(*present, dtype=jnp.bool_)


def masked_scores(scores: Array, mask: Array | None, bias: Array | None,
                   softcap: float | None) -> Array:
  """float32 scores soft-capped to (-softcap, softcap) where given, plus `bias`, masked."""
  if softcap:
    scores = jnp.tanh(scores / jnp.float32(softcap)) * jnp.float32(softcap)
  if bias is not None:
    scores = scores + bias
  if mask is not None:
    scores = jnp.where(mask, scores, _MASKED_SCORE)
  return scores.astype(jnp.float32)


def softmax_weights(scores: Array, mask: Array | None, bias: Array | None,
                     softcap: float | None, axis: int | tuple[int, ...] = -1) -> Array:
  """Masked softmax (float32) over the key `axis` of `masked_scores`."""
  return jax.nn.softmax(masked_scores(scores, mask, bias, softcap), axis=axis)


def attend(scores: Array, value: Array, mask: Array | None, dropout_rate: float,
            dropout_rng: Array | None, bias: Array | None = None,
            softcap: float | None = None) -> tuple[Array, Array]:
  """`softmax_weights` over keys, then the weighted sum of values."""
  weights = softmax_weights(scores, mask, bias, softcap)  # [b, h, q, k], rows sum to 1
  attended = weights
  if dropout_rng is not None and dropout_rate > 0.0:
    keep, keep_prob = layers.dropout_keep_mask(dropout_rng, dropout_rate, weights.shape)
    attended = jnp.where(keep, weights / keep_prob, 0.0)
  attended = attended.astype(value.dtype)
  batch, heads, num_queries, num_keys = attended.shape
  kv_heads = value.shape[2]
  if kv_heads == heads:
    return jnp.einsum("bhqk,bkhd->bqhd", attended, value), weights  # [b, q, h, d]
  # Grouped: each key/value head is read by its g query heads where it lies, not repeated.
  grouped = attended.reshape(batch, kv_heads, heads // kv_heads, num_queries, num_keys)
  out = jnp.einsum("bngqk,bknd->bqngd", grouped, value)  # [b, q, n, g, d]
  return out.reshape(batch, num_queries, heads, value.shape[-1]), weights  # [b, q, h, d]


def check_groups(heads: int, kv_heads: int) -> int:
  """Query heads per key/value head; ValueError unless kv_heads divides heads."""
  if kv_heads < 1 or heads % kv_heads:
    raise ValueError(f"{kv_heads} key/value heads do not divide {heads} query heads: "
                     "grouped-query attention needs num_heads to be a multiple of "
                     "num_kv_heads.")
  return heads // kv_heads


def dot_product_attention(query: Array, key: Array, value: Array, mask: Array | None = None, *,
                          return_weights: bool = False, dropout_rate: float = 0.0,
                          dropout_rng: Array | None = None, bias: Array | None = None,
                          scale: float | None = None, softcap: float | None = None):
  """softmax(Q K^T / sqrt(d) + bias + mask) V, per head.

  Key and value may have fewer heads than the query (grouped-query attention; 1 head:
  multi-query): n heads, n dividing h, each read by h / n query heads, without copies.

  Args:
    query: [b, q, h, d].
    key: [b, k, h, d], or [b, k, n, d] (grouped).
    value: like `key`.
    mask: boolean, broadcastable to [b, h, q, k]; True = may attend.
    return_weights: also return the attention weights [b, h, q, k].
    dropout_rate: dropout on the attention weights (needs `dropout_rng`).
    dropout_rng: PRNG key for that dropout; None = no dropout.
    bias: float32, broadcastable to [b, h, q, k], added to the scores (e.g. T5's relative
      position bias); None = none.
    scale: the scores' factor; None = 1 / sqrt(d) (T5 folds it into its weights: 1.0).
    softcap: scaled scores become softcap * tanh(scores / softcap) before bias and mask
      (Gemma 2's attention soft-capping); None or 0 = none.

  Returns:
    [b, q, h, d] outputs in `value.dtype`, and the float32 weights if `return_weights`.
  """
  # Scores and softmax in float32, whatever the activation dtype.
  batch, num_queries, heads, head_dim = query.shape
  kv_heads = key.shape[2]
  group = check_groups(heads, kv_heads)
  if group == 1:
    scores = layers.float32_sum_einsum("bqhd,bkhd->bhqk", query, key)
  else:
    grouped = query.reshape(batch, num_queries, kv_heads, group, head_dim)  # [b, q, n, g, d]
    scores = layers.float32_sum_einsum("bqngd,bknd->bngqk", grouped, key)  # [b, n, g, q, k]
    scores = scores.reshape(batch, heads, num_queries, key.shape[1])  # [b, h, q, k]
  scale = query.shape[-1] ** -0.5 if scale is None else scale
  scores = scores * jnp.float32(scale)  # [b, h, q, k]
  out, weights = attend(scores, value, mask, dropout_rate, dropout_rng, bias, softcap)
  return (out, weights) if return_weights else out
