"""Multi-head attention with a KV cache (`MultiHeadAttention`), and the way a call reaches its
kernel (`fused_attention`, through kernels.py's table). The masks and the reference
`dot_product_attention` live in dot_product.py and are re-exported here, as users import them
(`transformer_jax.attention.dot_product_attention`, `causal_mask`, `padding_mask`).
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.model import beam_attention
from transformer_jax.model import dot_product
from transformer_jax.model import kernels
from transformer_jax.model import kv_cache
from transformer_jax.model import layers
from transformer_jax.model import lora as lora_lib
from transformer_jax.model.dot_product import (  # noqa: F401  # re-exported: the public API
    causal_mask, check_groups, combine_masks, dot_product_attention, padding_mask, segment_mask)
from transformer_jax.model.schema import LoraSpec

Array = jax.Array


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


def resolve_implementation(implementation: str, query: Array | None = None,
                           key: Array | None = None, mask=None, *, bias: Array | None = None,
                           softcap: float = 0.0) -> str:
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
  [b, n, d, max_len] (`kv_cache.keys_last`; n = the key/value heads): a call with m new tokens
  writes them at `cache_index` and attends causally over everything written so far, so a
  prefix is filled in one call and then extended one token per call. The cache is created by
  an `init` in decode mode on inputs of the full decode length. Cross-attention keys/values are
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
  hypotheses, which reorders them with `kv_cache.reorder_beams`: self-attention then reads
  each row's slots where its hypothesis wrote them (`beam_attention`), so that no keys or
  values move. A cache that `kv_cache.with_beam_slots` gave 'decoded_key' / 'decoded_value' (a
  decoder-only model's, after its prompt) also keeps the decoded slots there: the prompt is
  then read in each row's own slots, once, and only the decoded slots from every beam of the
  source.

  `use_bias` False drops the projections' biases (`qkv_bias` / `out_bias`, where set, decide
  for the query/key/value and the output projections apart) and `scale_scores` False the 1/sqrt(d)
  factor (T5, which folds it into its query weights); `scale`, where set, is the scores' factor
  instead (Gemma's query_pre_attn_scalar^-0.5). A `bias` [b|1, h, q, k] passed to the call is
  added to the scores (T5's relative position bias). `softcap` > 0 soft-caps the scores
  (`dot_product_attention`); kernels without a soft cap leave such calls to the reference.

  `cache_dtype` keeps the KV cache's keys and values in another dtype: 'int8' per token and
  head with a float32 scale beside them (`kv_cache.quantize`), read back dequantized.

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
  cache_dtype: str = ""  # the KV cache's: '' = the keys', or 'float32', 'bfloat16', 'int8'

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array, mask: Array | None = None, *,
               deterministic: bool = True, decode: bool = False, bias: Array | None = None,
               positions: Array | None = None, prefix_fill: bool = False, beams: int = 1):
    if self.qkv_dim % self.num_heads:
      raise ValueError(f"qkv_dim={self.qkv_dim} must be divisible by num_heads={self.num_heads}.")
    head_dim = self.qkv_dim // self.num_heads
    kv_heads = self.num_kv_heads or self.num_heads
    group = check_groups(self.num_heads, kv_heads)
    # Fewer key/value heads get a logical name of their own: the jit layout splits them over
    # the tensor axis when they divide it and keeps them whole otherwise (multi-query).
    kv_axis = "heads" if group == 1 else "kv_heads"
    # Logical axis names of the parameters, mapped to mesh axes by the jit layout's rules.
    qkv_bias, out_bias = (self.use_bias if b is None else b for b in (self.qkv_bias, self.out_bias))

    def projection(parts, heads, heads_axis, name):
      dense = nn.DenseGeneral(
          (parts, heads, head_dim), dtype=self.dtype, use_bias=qkv_bias,
          dot_general=layers.one_part_dot if parts == 1 else None,
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
    return self._output(self._attend(query, key, value, mask, parts, bias, slot_rows, decoded,
                                     beams, deterministic), inputs_q, out_bias, deterministic)

  def _attend(self, query: Array, key: Array, value: Array, mask: Array | None,
              parts: kernels.StructuredMask | None, bias: Array | None,
              slot_rows: Array | None, decoded, beams: int, deterministic: bool) -> Array:
    """The heads' outputs [b, q, h, d]: beam attention over shared slots, a kernel of the
    table, or the reference (which the weights need: dropout, or capturing them)."""
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
        return beam_attention.beam_attention(query, key, value, mask, slot_rows, beams,
                                             bias=bias, scale=scale, softcap=self.softcap,
                                             decoded=decoded)
      key, value = kv_cache.beam_slots(key, slot_rows), kv_cache.beam_slots(value, slot_rows)
    if self.score == "dot_product" and not (capture or dropout_rng is not None):
      out = fused_attention(query, key, value, parts or mask, self.implementation, bias, scale,
                            self.softcap)
    else:
      out, weights = self._reference(query, key, value, mask, bias, scale, dropout_rng)
      if capture:
        self.sow("intermediates", "attention_weights", weights)
    if copies > 1:
      out = out.reshape(rows, num_queries, *out.shape[2:])
    return out

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
    return dot_product.attend(scores, value, mask, self.dropout_rate, dropout_rng, bias,
                              self.softcap)

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
      return layers.float32_sum_einsum("bqhd,bkhd->bhqk", query, keys)
    if self.score == "additive":
      w_key = self.param("score_key_kernel", init, (self.num_heads, head_dim, head_dim))
      w_query = self.param("score_query_kernel", init, (self.num_heads, head_dim, head_dim))
      v = self.param("score_vector", nn.initializers.normal(stddev=head_dim ** -0.5),
                     (self.num_heads, head_dim))
      keys = jnp.einsum("bkhd,hde->bkhe", key, w_key.astype(self.dtype))  # W1 h
      queries = jnp.einsum("bqhd,hde->bqhe", query, w_query.astype(self.dtype))  # W2 s
      hidden = jnp.tanh(queries[:, :, None] + keys[:, None, :])  # [b, q, k, h, e]
      return layers.float32_sum_einsum("bqkhe,he->bhqk", hidden, v.astype(self.dtype))
    raise ValueError(f"Unknown attention score {self.score!r}: use 'dot_product', "
                     "'multiplicative' or 'additive'.")

  def _encoded_key_value(self, project: Callable[[], tuple[Array, Array]]):
    """Cross-attention keys/values while decoding: projected from the encoder output once per
    source, kept in the 'encoded_kv' collection and read by every later step (whose new token
    then needs only its query projection)."""
    if self.has_variable("encoded_kv", "key"):
      return (kv_cache.from_keys_last(self.get_variable("encoded_kv", "key")),
              kv_cache.from_keys_last(self.get_variable("encoded_kv", "value")))
    key, value = project()
    if self.is_mutable_collection("encoded_kv"):
      self.put_variable("encoded_kv", "key", kv_cache.keys_last(key))
      self.put_variable("encoded_kv", "value", kv_cache.keys_last(value))
    return key, value

  def _update_cache(self, key: Array, value: Array, mask: Array | None, prefix_fill: bool,
                    beams: int):
    """Writes the new keys/values into the cache, each row at its own write position
    (`kv_cache`); returns all cached ones, their mask (each row's slots up to its new tokens,
    causal over them, or with `prefix_fill` all of them), where each row's slots are
    ('slot_rows', `beam_attention`: a row writes its new slots itself; without beams no row
    reads another's, and the offsets stay 0), and the decoded keys and values kept apart from a
    prompt's with each row's prompt length (`kv_cache.with_beam_slots`; else None)."""
    initialized = self.has_variable("cache", "cached_key")
    shape = kv_cache.keys_last(key).shape
    rows, num_new = shape[0], key.shape[1]
    stored = kv_cache.stored_dtype(self.cache_dtype, key.dtype)
    cached = {name: self.variable("cache", name, jnp.zeros, shape, stored)
              for name in ("cached_key", "cached_value")}
    scales = ({name: self.variable("cache", name, jnp.zeros, shape[:2] + (1, shape[3]),
                                   jnp.float32) for name in kv_cache.SCALE_NAMES}
              if stored == jnp.int8 else None)
    cache_index = self.variable("cache", "cache_index", jnp.zeros, (rows,), jnp.int32)
    slot_rows = self.variable("cache", "slot_rows", jnp.zeros, (rows, shape[3]), jnp.int32)
    if not initialized:  # the init pass only creates the cache
      return key, value, mask, None, None
    max_len = cached["cached_key"].value.shape[3]
    index = cache_index.value  # [rows]
    every = []  # all cached keys, then values, as the attention reads them
    for (name, new), scale_name in zip((("cached_key", key), ("cached_value", value)),
                                       kv_cache.SCALE_NAMES):
      new = kv_cache.keys_last(new)
      if scales is not None:
        new, scale = kv_cache.quantize(new)
        scales[scale_name].value = kv_cache.write(scales[scale_name].value, scale, index)
      cached[name].value = kv_cache.write(cached[name].value, new, index)
      every.append(kv_cache.dequantize(cached[name].value, scales[scale_name].value, key.dtype)
                   if scales is not None else cached[name].value.astype(key.dtype))
    cache_index.value = index + num_new
    if beams > 1:
      slot_rows.value = kv_cache.write(slot_rows.value, jnp.zeros((rows, num_new), jnp.int32),
                                       index)
    decoded = None
    if self.has_variable("cache", "decoded_key"):  # `kv_cache.with_beam_slots`
      prompt_length = self.get_variable("cache", "prompt_length")

      def kept_apart(name, new):  # decoded slot t of a row is its slot prompt_length + t
        kept = self.get_variable("cache", name)
        new = kv_cache.keys_last(new).reshape(kept.shape[:-1] + (num_new,))
        kept = kv_cache.write(kept, new, (index - prompt_length).reshape(kept.shape[:2]))
        self.put_variable("cache", name, kept)
        return kept

      decoded = (kept_apart("decoded_key", key), kept_apart("decoded_value", value),
                 prompt_length)
    visible = kv_cache.visible(index, num_new, max_len, prefix_fill)  # [rows, 1, q, max_len]
    return (kv_cache.from_keys_last(every[0]), kv_cache.from_keys_last(every[1]),
            combine_masks(visible, mask), slot_rows.value, decoded)
