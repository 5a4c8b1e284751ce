"""Attention masks, scaled dot-product attention and multi-head attention with a KV cache.

Shape letters: b = batch, q = query length, k = key/value length, h = (query) heads, d = head
dim; with grouped-query attention n = key/value heads and g = h / n query heads per key/value
head (query head i reads key/value head i // g, as Hugging Face's `repeat_kv` and
`jax.nn.dot_product_attention` group them). Masks are booleans, True = may attend,
broadcastable to [b, h, q, k].
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax import kernels
from transformer_jax import layers
from transformer_jax import lora as lora_lib
from transformer_jax.model_schema import LoraSpec

Array = jax.Array
# Added to masked scores. Finite, so a fully masked row gives uniform weights, not NaN.
_MASKED_SCORE = jnp.finfo(jnp.float32).min


class _Partitioned(nn.LogicallyPartitioned):
  """`nn.LogicallyPartitioned` for DenseGeneral's multi-axis kernels and biases.

  DenseGeneral initialises them flattened to 2-D (1-D) and reshapes afterwards; flax would
  apply the full-rank logical names to the flat array as a sharding constraint (an error under
  a mesh), so the constraint waits until the value has the names' rank.
  """

  def unbox(self, apply_constraint: bool = True) -> Any:
    return super().unbox(apply_constraint and jnp.ndim(self.value) == len(self.names))


def _partitioned(init: Callable, names: tuple[str | None, ...]) -> Callable:
  """`init` whose result is boxed with logical axis names (see _Partitioned)."""
  return lambda *args, **kwargs: _Partitioned(init(*args, **kwargs), names)


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


def _masked_scores(scores: Array, mask: Array | None, bias: Array | None,
                   softcap: float | None) -> Array:
  """float32 scores soft-capped to (-softcap, softcap) where given, plus `bias`, masked."""
  if softcap:
    scores = jnp.tanh(scores / jnp.float32(softcap)) * jnp.float32(softcap)
  if bias is not None:
    scores = scores + bias
  if mask is not None:
    scores = jnp.where(mask, scores, _MASKED_SCORE)
  return scores.astype(jnp.float32)


def _softmax_weights(scores: Array, mask: Array | None, bias: Array | None,
                     softcap: float | None, axis: int | tuple[int, ...] = -1) -> Array:
  """Masked softmax (float32) over the key `axis` of `_masked_scores`."""
  return jax.nn.softmax(_masked_scores(scores, mask, bias, softcap), axis=axis)


def _attend(scores: Array, value: Array, mask: Array | None, dropout_rate: float,
            dropout_rng: Array | None, bias: Array | None = None,
            softcap: float | None = None) -> tuple[Array, Array]:
  """`_softmax_weights` over keys, then the weighted sum of values."""
  weights = _softmax_weights(scores, mask, bias, softcap)  # [b, h, q, k], rows sum to 1
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


def _check_groups(heads: int, kv_heads: int) -> int:
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
  group = _check_groups(heads, kv_heads)
  if group == 1:
    scores = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32)
  else:
    grouped = query.reshape(batch, num_queries, kv_heads, group, head_dim)  # [b, q, n, g, d]
    scores = jnp.einsum("bqngd,bknd->bngqk", grouped, key,
                        preferred_element_type=jnp.float32)  # [b, n, g, q, k]
    scores = scores.reshape(batch, heads, num_queries, key.shape[1])  # [b, h, q, k]
  scale = query.shape[-1] ** -0.5 if scale is None else scale
  scores = scores * jnp.float32(scale)  # [b, h, q, k]
  out, weights = _attend(scores, value, mask, dropout_rate, dropout_rng, bias, softcap)
  return (out, weights) if return_weights else out


def beam_attention(query: Array, key: Array, value: Array, mask: Array | None,
                   slot_rows: Array, beams: int, *, bias: Array | None = None,
                   scale: float | None = None, softcap: float | None = None,
                   decoded: tuple[Array, Array] | None = None) -> Array:
  """`dot_product_attention` of beams that share their cache slots: each source's `beams`
  consecutive rows are the hypotheses of one beam search, and row j reads slot s from row
  j + slot_rows[j, s] of its source, the row whose beam wrote it (`reorder_beams`). Each query
  meets every key of its source's rows, the slots of other beams masked out, so the cache is
  read once per step as in plain decoding and never copied when beams are reordered. (The
  score and value products do `beams` times the arithmetic; a prompt, which every beam of a
  source holds alike, is read once with `decoded`: benchmarks/RESULTS.md, issue #42.)

  Args:
    query: [r, q, h, d], r = sources x beams.
    key: the cache's keys [r, L, n, d] (n dividing h, as in `dot_product_attention`).
    value: like `key`.
    mask: boolean, broadcastable to [r, h, q, L].
    slot_rows: int [r, L]: where each row's slots are, as offsets from the row.
    beams: rows per source.
    bias, scale, softcap: as in `dot_product_attention`.
    decoded: where the cache holds a prompt (its first P slots, alike in every beam of a
      source) and then L - P decoded slots: those decoded slots apart, keys and values as
      `with_beam_slots` keeps them, [b, beams, n, d, L - P]. Each row then reads the prompt in
      its own row, and only the decoded slots from every holder: L + beams x (L - P) slots a
      query instead of beams x L.

  Returns:
    [r, q, h, d] outputs in `value.dtype`.
  """
  rows, num_queries, heads, head_dim = query.shape
  length, kv_heads = key.shape[1], key.shape[2]
  group = _check_groups(heads, kv_heads)
  sources = rows // beams
  scale = jnp.float32(head_dim ** -0.5 if scale is None else scale)
  prompt_len = 0 if decoded is None else length - decoded[0].shape[-1]
  own = None
  if decoded is not None:  # the prompt, read in each row's own slots: [b, n, j, g, q, L]
    grouped = query.reshape(rows, num_queries, kv_heads, group, head_dim)
    own = jnp.einsum("rqngd,rknd->rngqk", grouped, key, preferred_element_type=jnp.float32)
    own = jnp.swapaxes(own.reshape(sources, beams, *own.shape[1:]), 1, 2)
    in_prompt = jnp.arange(length) < prompt_len
    own_mask = in_prompt if mask is None else mask & in_prompt
    by_source = lambda x: _by_source(x, sources, beams, kv_heads, num_queries, length)[:, 0]
    own = _masked_scores(own * scale, by_source(own_mask),
                         None if bias is None else by_source(bias), softcap)
    prompt_values = _keys_last(value).reshape(sources, beams, kv_heads, head_dim, length)
    keys, values = decoded
    length = length - prompt_len
    slot_rows = slot_rows[:, prompt_len:]
    mask = None if mask is None else mask[..., prompt_len:]
    bias = None if bias is None else bias[..., prompt_len:]
  else:
    # Source b, holder beam i, key/value head n, querying beam j, group g, query q, slot l.
    # The keys and values are split from the cache's own layout (`_keys_last`), and both beams
    # are batch dimensions of the products, so that they read the cache without a copy.
    keys, values = (_keys_last(x).reshape(sources, beams, kv_heads, head_dim, length)
                    for x in (key, value))
  queries = jnp.transpose(query.reshape(sources, beams, num_queries, kv_heads, group, head_dim),
                          (0, 3, 1, 4, 2, 5))[:, None]  # [b, 1, n, j, g, q, d]
  queries = jnp.broadcast_to(queries, (sources, beams) + queries.shape[2:])
  scores = jnp.einsum("binjgqd,bindl->binjgql", queries, keys,
                      preferred_element_type=jnp.float32) * scale
  holder = jnp.arange(beams)[None, :, None] + slot_rows.reshape(sources, beams, length)
  held = holder[:, None] == jnp.arange(beams)[None, :, None, None]  # [b, i, j, L]
  visible = held[:, :, None, :, None, None, :]
  if mask is not None:
    visible = visible & _by_source(mask, sources, beams, kv_heads, num_queries, length)
  if bias is not None:
    bias = _by_source(bias, sources, beams, kv_heads, num_queries, length)
  if own is None:
    weights = _softmax_weights(scores, visible, bias, softcap,
                               axis=(1, 6)).astype(value.dtype)  # over holders and slots
  else:  # one softmax over the prompt's slots and the holders' decoded ones
    scores = _masked_scores(scores, visible, bias, softcap)
    top = jnp.maximum(jnp.max(own, axis=-1), jnp.max(scores, axis=(1, 6)))  # [b, n, j, g, q]
    own = jnp.exp(own - top[..., None])
    scores = jnp.exp(scores - top[:, None, ..., None])
    total = jnp.sum(own, axis=-1) + jnp.sum(scores, axis=(1, 6))
    weights = (scores / total[:, None, ..., None]).astype(value.dtype)
    own = (own / total[..., None]).astype(value.dtype)
  # Each holder's part in float32, so that 16-bit values round once, after the sum.
  out = jnp.einsum("binjgql,bindl->binjgqd", weights, values, preferred_element_type=jnp.float32
                   ).sum(axis=1)  # [b, n, j, g, q, d]
  if own is not None:  # the prompt's part, from each row's own slots
    out = out + jnp.einsum("bnjgql,bjndl->bnjgqd", own, prompt_values,
                           preferred_element_type=jnp.float32)
  return jnp.transpose(out.astype(value.dtype), (0, 2, 4, 1, 3, 5)).reshape(
      rows, num_queries, heads, head_dim)


def _by_source(x: Array, sources: int, beams: int, kv_heads: int, num_queries: int,
               length: int) -> Array:
  """A mask or bias broadcastable to [r, h, q, L] as `beam_attention`'s scores take it:
  [b, 1, n, j, g, q, L] (n and g of size 1 where it has no heads)."""
  heads = x.shape[-3] if x.ndim >= 3 else 1
  group = heads // kv_heads if heads > 1 else 1
  x = jnp.broadcast_to(x, (sources * beams, heads, num_queries, length))
  x = x.reshape(sources, beams, heads // group, group, num_queries, length)
  return jnp.transpose(x, (0, 2, 1, 3, 4, 5))[:, None]


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


def resolve_implementation(implementation: str, query: Array | None = None, key: Array | None = None,
                           mask=None, *, bias: Array | None = None, softcap: float = 0.0) -> str:
  """The kernel (a `kernels.KERNELS` name) that runs `implementation` ('auto' or a kernel)
  on the default backend for this call (`kernels.choose`); without a `query`, 'auto''s first
  choice for the backend."""
  if query is None:
    return kernels.AUTO_ORDER.get(jax.default_backend(), ("reference",))[0] \
        if implementation == "auto" else implementation
  key = query if key is None else key
  return kernels.choose(implementation, kernels.Call.of(query, key, mask, bias=bias,
                                                        softcap=softcap))


def fused_attention(query: Array, key: Array, value: Array, mask, implementation: str,
                    bias: Array | None = None, scale: float | None = None,
                    softcap: float = 0.0) -> Array:
  """Dot-product attention through the kernel table: [b, q, h, d] like
  `dot_product_attention`, without weights or dropout. Key/value [b, k, n, d] may have fewer
  heads than the query (n must divide h). `mask` is a boolean array or a
  `kernels.StructuredMask`; where `implementation` resolves to the reference (or falls back
  to it), `dot_product_attention` runs."""
  name = resolve_implementation(implementation, query, key, mask, bias=bias, softcap=softcap)
  out = None if name == "reference" else kernels.run(name, query, key, value, mask, bias=bias,
                                                     scale=scale, softcap=softcap)
  if out is None:
    out = dot_product_attention(query, key, value, kernels.split_mask(mask)[0], bias=bias,
                                scale=scale, softcap=softcap)
  return out


def _keys_last(x: Array) -> Array:
  """[b, k, n, d] -> [b, n, d, k]: how decoding keeps keys and values (the self-attention
  cache and the source's cross-attention ones), the layout XLA:CPU's score and value matmuls
  read them in. Kept [b, k, n, d] or heads-major [b, n, k, d], each decoding step copied
  every layer's into it: at batch 1 a third of a GPT-2-size step, at batch 32 two thirds
  of a t5-small-size one (issue #42, benchmarks/RESULTS.md)."""
  return jnp.transpose(x, (0, 2, 3, 1))


def _from_keys_last(x: Array) -> Array:
  return jnp.transpose(x, (0, 3, 1, 2))


class MultiHeadAttention(nn.Module):
  """Multi-head attention: project Q/K/V, score per head, attend, concatenate, project out.

  `score` picks how a query s meets a key h, per head: 'dot_product' (s^T h / sqrt(d), the
  Transformer's), 'multiplicative' (s^T W h, Luong) or 'additive' (v^T tanh(W1 h + W2 s),
  Bahdanau). `implementation` 'reference' computes dot-product attention with einsums here;
  the other names are kernels of `kernels.KERNELS` (jax.nn's XLA and cuDNN paths, tokamax,
  splash), and 'auto' (the default) the platform's fastest that takes the call
  (`kernels.choose`). The mask may be a `kernels.StructuredMask` (a mask array with the
  parts it was built from), which blockwise kernels need. The weights force the reference:
  attention dropout in training, or weights captured in the 'intermediates' collection (see
  `models.attention_weights`).

  In decode mode self-attention keys and values are kept in a 'cache' collection of shape
  [b, n, d, max_len] (`_keys_last`; n = the key/value heads): a call with m new tokens writes
  them at `cache_index` and attends causally over everything written so far, so a prefix is
  filled in one call and then extended one token per call. The cache is created by an `init`
  in decode mode on inputs of the full decode length. Cross-attention keys/values are
  projected once per source and kept in an 'encoded_kv' collection (`_encoded_key_value`);
  queries of several rows per source (beams) attend to them without copies.

  `num_kv_heads` (None or 0: num_heads) fewer than `num_heads` is grouped-query attention
  (Ainslie et al., 2023; 1: multi-query, Shazeer, 2019): the key/value projection 'kv' has
  that many heads, each read by num_heads / num_kv_heads query heads, and so has the cache.
  Self-attention then projects its queries ('query') apart from its keys and values; with as
  many key/value heads as query heads it keeps the one fused 'qkv' projection (the same
  parameters as plain multi-head attention).

  `rope_base` (self-attention only) rotates queries and keys by their positions (rotary
  embeddings, `layers.rotary_embedding`), before the keys are cached; the call's
  `positions` [b|1, q] give them (required while decoding: the new tokens' positions).

  `prefix_fill` (decode mode) makes the call's new tokens see each other both ways: a
  prefix LM's prompt, filled in one call as its training reads the source part.

  `beams` > 1 (decode mode): each source's `beams` consecutive rows are one beam search's
  hypotheses, which reorders them with `reorder_beams`: self-attention then reads each row's
  slots where its hypothesis wrote them (`beam_attention`), so that no keys or values move.
  A cache that `with_beam_slots` gave 'decoded_key' / 'decoded_value' (a decoder-only model's,
  after its prompt) also keeps the decoded slots there: the prompt is then read in each row's
  own slots, once, and only the decoded slots from every beam of the source.

  `use_bias` False drops the projections' biases (`qkv_bias` / `out_bias`, where set, decide
  for the query/key/value and the output projections apart) and `scale_scores` False the 1/sqrt(d)
  factor (T5, which folds it into its query weights); `scale`, where set, is the scores' factor
  instead (Gemma's query_pre_attn_scalar^-0.5). A `bias` [b|1, h, q, k] passed to the call is
  added to the scores (T5's relative position bias). `softcap` > 0 soft-caps the scores
  (`dot_product_attention`); kernels without a soft cap leave such calls to the reference.

  `qk_norm` RMS-normalises queries and keys per head over the head dimension ('query_norm',
  'key_norm'; epsilon `norm_epsilon`, (1 + scale) with `norm_plus_one`) before rotating them,
  so keys are cached normalised (Qwen3, Gemma 3).
  """
  num_heads: int
  qkv_dim: int
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  score: str = "dot_product"
  implementation: str = "reference"
  kernel_init: Callable = nn.initializers.xavier_uniform()
  use_bias: bool = True
  scale_scores: bool = True
  num_kv_heads: int | None = None
  rope_base: float | None = None
  rope_scaling: tuple = ("none",)  # layers.rope_frequencies
  qkv_bias: bool | None = None  # None: use_bias
  out_bias: bool | None = None  # None: use_bias
  scale: float | None = None  # None: 1/sqrt(d), or 1 without scale_scores
  softcap: float = 0.0
  qk_norm: bool = False
  norm_epsilon: float = 1e-6
  norm_plus_one: bool = False
  lora: LoraSpec | None = None  # low-rank adapters on the targeted projections (lora.py)

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array, mask: Array | None = None, *,
               deterministic: bool = True, decode: bool = False, bias: Array | None = None,
               positions: Array | None = None, prefix_fill: bool = False, beams: int = 1):
    if self.qkv_dim % self.num_heads:
      raise ValueError(f"qkv_dim={self.qkv_dim} must be divisible by num_heads={self.num_heads}.")
    head_dim = self.qkv_dim // self.num_heads
    kv_heads = self.num_kv_heads or self.num_heads
    group = _check_groups(self.num_heads, kv_heads)
    # Fewer key/value heads get a logical name of their own: the jit layout splits them over
    # the tensor axis when they divide it and keeps them whole otherwise (multi-query).
    kv_axis = "heads" if group == 1 else "kv_heads"
    # Logical axis names of the parameters, mapped to mesh axes by the jit layout's rules.
    qkv_bias, out_bias = (self.use_bias if b is None else b for b in (self.qkv_bias, self.out_bias))

    def projection(parts, heads, heads_axis, name):
      dense = nn.DenseGeneral(
          (parts, heads, head_dim), dtype=self.dtype, use_bias=qkv_bias,
          kernel_init=_partitioned(self.kernel_init, ("embed", None, heads_axis, "kv")),
          bias_init=_partitioned(nn.initializers.zeros_init(), (None, heads_axis, "kv")),
          name=name)
      return lambda x: lora_lib.adapted(self, self.lora, name, x, dense(x),
                                        deterministic=deterministic, in_names=("embed",),
                                        out_names=(heads_axis, "kv"))

    self_attention = inputs_q is inputs_kv
    query_norm, key_norm = self._qk_norms()
    # Fused projections: one matmul for Q, K and V in self-attention (for K and V in
    # cross-attention) instead of three (two); measured in the README's performance section.
    if self_attention and group == 1:
      qkv = projection(3, self.num_heads, "heads", "qkv")(inputs_q)  # [b, q, 3, h, d]
      query, key, value = qkv[:, :, 0], key_norm(qkv[:, :, 1]), qkv[:, :, 2]  # [b, q, h, d]
    else:
      query = projection(1, self.num_heads, "heads", "query")(inputs_q)[:, :, 0]  # [b, q, h, d]
      kv_projection = projection(2, kv_heads, kv_axis, "kv")

      def project():
        kv = kv_projection(inputs_kv)  # [b, k, 2, n, d]
        return key_norm(kv[:, :, 0]), kv[:, :, 1]  # each [b, k, n, d]

      key, value = (self._encoded_key_value(project) if decode and not self_attention
                    else project())
    query = query_norm(query)

    if self.rope_base is not None:
      if not self_attention:
        raise ValueError("Rotary position embeddings are for self-attention only.")
      query, key = self._rotate(query, key, positions, decode)

    # Under the jit layout: heads split over the tensor axis, rows over data x fsdp (a no-op
    # without logical axis rules, as under pmap).
    query = nn.with_logical_constraint(query, ("batch", "length", "heads", "kv"))
    key, value = (nn.with_logical_constraint(x, ("batch", "length", kv_axis, "kv"))
                  for x in (key, value))
    mask, parts = kernels.split_mask(mask)  # parts: for kernels that build masks blockwise
    slot_rows = decoded = None
    if decode and self_attention:
      parts = None  # the cache's slots have no parts
      key, value, mask, slot_rows, decoded = self._update_cache(key, value, mask, prefix_fill,
                                                                beams)
    # Decoding several copies (beams, samples) of each source: their queries meet the one
    # copy of the source's keys/values as extra query positions, [b * c, q] -> [b, c * q].
    rows, num_queries = query.shape[:2]
    copies = rows // key.shape[0]
    if copies > 1:
      query = query.reshape(key.shape[0], copies * num_queries, *query.shape[2:])

    dropout_rng = (self.make_rng("dropout") if not deterministic and self.dropout_rate > 0.0
                   else None)
    capture = self.is_mutable_collection("intermediates")
    scale = 1.0 if self.scale is None and not self.scale_scores else self.scale
    if beams > 1 and slot_rows is not None:
      if self.score == "dot_product" and not capture:
        return self._output(beam_attention(query, key, value, mask, slot_rows, beams, bias=bias,
                                           scale=scale, softcap=self.softcap, decoded=decoded),
                            inputs_q, out_bias, deterministic)
      key, value = beam_slots(key, slot_rows), beam_slots(value, slot_rows)
    implementation = "reference"
    if self.score == "dot_product" and not (capture or dropout_rng is not None):
      implementation = resolve_implementation(self.implementation, query, key, parts or mask,
                                              bias=bias, softcap=self.softcap)
    out = None
    if implementation != "reference":  # None: the kernel failed to build; the reference runs
      out = kernels.run(implementation, query, key, value, parts or mask, bias=bias,
                        scale=scale, softcap=self.softcap)
    if out is None:
      out, weights = self._reference(query, key, value, mask, bias, scale, dropout_rng)
      if capture:
        self.sow("intermediates", "attention_weights", weights)
    if copies > 1:
      out = out.reshape(rows, num_queries, *out.shape[2:])
    return self._output(out, inputs_q, out_bias, deterministic)

  def _output(self, out: Array, inputs_q: Array, out_bias: bool, deterministic: bool) -> Array:
    """The heads' outputs [b, q, h, d] projected back to the model dimension [b, q, emb]."""
    projected = nn.DenseGeneral(
        inputs_q.shape[-1], axis=(-2, -1), dtype=self.dtype, use_bias=out_bias,
        kernel_init=_partitioned(self.kernel_init, ("heads", "kv", "embed")),
        bias_init=_partitioned(nn.initializers.zeros_init(), ("embed",)),
        name="out")(out)  # [b, q, emb]
    return lora_lib.adapted(self, self.lora, "out", out, projected, deterministic=deterministic,
                            in_names=("heads", "kv"), out_names=("embed",))

  def _reference(self, query: Array, key: Array, value: Array, mask: Array | None,
                 bias: Array | None, scale: float | None,
                 dropout_rng: Array | None) -> tuple[Array, Array]:
    """Attention computed here with einsums: outputs [b, q, h, d] and weights [b, h, q, k]."""
    if self.score == "dot_product":
      return dot_product_attention(query, key, value, mask, return_weights=True,
                                   dropout_rate=self.dropout_rate, dropout_rng=dropout_rng,
                                   bias=bias, scale=scale, softcap=self.softcap)
    # The learned scores have a weight per query head: grouped keys/values are repeated.
    group = query.shape[2] // key.shape[2]
    key, value = (jnp.repeat(x, group, axis=2) for x in (key, value))  # [b, k, h, d]
    scores = self._scores(query, key, query.shape[-1])  # [b, h, q, k]
    return _attend(scores, value, mask, self.dropout_rate, dropout_rng, bias, self.softcap)

  def _qk_norms(self) -> tuple[Callable[[Array], Array], Callable[[Array], Array]]:
    """The per-head query and key norms over the head dimension (`qk_norm`), else
    identities."""
    if not self.qk_norm:
      return (lambda x: x), (lambda x: x)
    norm = lambda name: layers.RMSNorm(self.norm_epsilon, self.dtype, self.norm_plus_one,
                                       axis_name="kv", name=name)
    return norm("query_norm"), norm("key_norm")

  def _rotate(self, query: Array, key: Array, positions: Array | None,
              decode: bool) -> tuple[Array, Array]:
    """Queries and keys rotated by their positions (rotary embeddings; `positions` None: 0,
    1, ... over the queries)."""
    if positions is None:
      if decode:
        raise ValueError("Decoding with rotary embeddings needs the new tokens' positions.")
      positions = jnp.arange(query.shape[1])[None, :]
    return (layers.rotary_embedding(query, positions, self.rope_base, self.rope_scaling),
            layers.rotary_embedding(key, positions, self.rope_base, self.rope_scaling))

  def _scores(self, query: Array, key: Array, head_dim: int) -> Array:
    """[b, h, q, k] float32 scores of every query against every key (Luong / Bahdanau)."""
    init = nn.initializers.normal(stddev=head_dim ** -1.0)
    if self.score == "multiplicative":
      w = self.param("score_kernel", init, (self.num_heads, head_dim, head_dim))
      keys = jnp.einsum("bkhe,hde->bkhd", key, w.astype(self.dtype))  # W h: [b, k, h, d]
      return jnp.einsum("bqhd,bkhd->bhqk", query, keys, preferred_element_type=jnp.float32)
    if self.score == "additive":
      w_key = self.param("score_key_kernel", init, (self.num_heads, head_dim, head_dim))
      w_query = self.param("score_query_kernel", init, (self.num_heads, head_dim, head_dim))
      v = self.param("score_vector", nn.initializers.normal(stddev=head_dim ** -0.5),
                     (self.num_heads, head_dim))
      keys = jnp.einsum("bkhd,hde->bkhe", key, w_key.astype(self.dtype))  # W1 h
      queries = jnp.einsum("bqhd,hde->bqhe", query, w_query.astype(self.dtype))  # W2 s
      hidden = jnp.tanh(queries[:, :, None] + keys[:, None, :])  # [b, q, k, h, e]
      return jnp.einsum("bqkhe,he->bhqk", hidden, v.astype(self.dtype),
                        preferred_element_type=jnp.float32)
    raise ValueError(f"Unknown attention score {self.score!r}: use 'dot_product', "
                     "'multiplicative' or 'additive'.")

  def _encoded_key_value(self, project: Callable[[], tuple[Array, Array]]):
    """Cross-attention keys/values while decoding: projected from the encoder output once per
    source, kept in the 'encoded_kv' collection and read by every later step (whose new token
    then needs only its query projection)."""
    if self.has_variable("encoded_kv", "key"):
      return (_from_keys_last(self.get_variable("encoded_kv", "key")),
              _from_keys_last(self.get_variable("encoded_kv", "value")))
    key, value = project()
    if self.is_mutable_collection("encoded_kv"):
      self.put_variable("encoded_kv", "key", _keys_last(key))
      self.put_variable("encoded_kv", "value", _keys_last(value))
    return key, value

  def _update_cache(self, key: Array, value: Array, mask: Array | None, prefix_fill: bool,
                    beams: int):
    """Writes the new keys/values into the cache; returns all cached ones, their mask (causal
    over the new tokens, or with `prefix_fill` every slot written so far) and where each row's
    slots are ('slot_rows', `beam_attention`: a row writes its new slots itself; without beams
    no row reads another's, and the offsets stay 0), and the decoded keys and values kept
    apart from a prompt's (`with_beam_slots`; else None)."""
    initialized = self.has_variable("cache", "cached_key")
    shape = _keys_last(key).shape
    cached_key = self.variable("cache", "cached_key", jnp.zeros, shape, key.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, shape, value.dtype)
    cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    slot_rows = self.variable("cache", "slot_rows", jnp.zeros, (shape[0], shape[3]), jnp.int32)
    if not initialized:  # the init pass only creates the cache
      return key, value, mask, None, None
    num_new, max_len = key.shape[1], cached_key.value.shape[3]
    index = cache_index.value
    cached_key.value = jax.lax.dynamic_update_slice(cached_key.value, _keys_last(key),
                                                    (0, 0, 0, index))
    cached_value.value = jax.lax.dynamic_update_slice(cached_value.value, _keys_last(value),
                                                      (0, 0, 0, index))
    cache_index.value = index + num_new
    if beams > 1:
      slot_rows.value = jax.lax.dynamic_update_slice(
          slot_rows.value, jnp.zeros((shape[0], num_new), jnp.int32), (0, index))
    def kept_apart(name, new):  # `with_beam_slots`: the decoded slots, after the prompt's
      kept = self.get_variable("cache", name)
      kept = jax.lax.dynamic_update_slice(
          kept, _keys_last(new).reshape(kept.shape[:-1] + (num_new,)),
          (0, 0, 0, 0, index - (max_len - kept.shape[-1])))
      self.put_variable("cache", name, kept)
      return kept

    decoded = (tuple(kept_apart(name, x) for name, x in (("decoded_key", key),
                                                          ("decoded_value", value)))
               if self.has_variable("cache", "decoded_key") else None)
    # New token i (at absolute position index + i) sees cached positions <= index + i.
    query_positions = index + jnp.arange(num_new)[:, None]  # [q, 1]
    if prefix_fill:
      query_positions = jnp.full_like(query_positions, index + num_new - 1)
    visible = jnp.arange(max_len)[None, :] <= query_positions  # [q, max_len]
    return (_from_keys_last(cached_key.value), _from_keys_last(cached_value.value),
            combine_masks(visible[None, None], mask), slot_rows.value, decoded)
