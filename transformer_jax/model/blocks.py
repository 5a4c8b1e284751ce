"""The Transformer's layers and stacks (Vaswani et al., 2017): residual sub-layers, encoder
and decoder layers, and the stacks of them that every model in models.py shares."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.model import attention
from transformer_jax.model import kernels
from transformer_jax.model import kv_cache
from transformer_jax.model import layers
from transformer_jax.model import remat
from transformer_jax.model.schema import TransformerConfig

Array = jax.Array


def _remat(layer: type[nn.Module], c: TransformerConfig, static: tuple[str, ...]):
  """`layer`, rematerialised when `c.remat` (remat.remat)."""
  return remat.remat(layer, c.remat_policy, static) if c.remat else layer


def residual_stream(x: Array) -> Array:
  """[b, len, emb] between layers: rows split over data x fsdp, the embedding dimension whole
  (the jit layout's activation sharding; a no-op without logical axis rules, as under pmap)."""
  return nn.with_logical_constraint(x, ("batch", "length", None))


class SublayerConnection(nn.Module):
  """Residual connection with a norm after (post-LN) or before (pre-LN) the sublayer, and
  with `post_sublayer_norm` one more on the sublayer's output ('post_norm', Gemma 2 / 3)."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, sublayer, *, deterministic: bool) -> Array:
    c = self.config
    norm = layer_norm(c, "norm")
    y = sublayer(norm(x) if c.pre_ln else x)
    if c.post_sublayer_norm:
      y = layer_norm(c, "post_norm")(y)
    y = layers.Dropout(c.dropout_rate)(y, deterministic=deterministic)
    return x + y if c.pre_ln else norm(x + y)


def layer_norm(c: TransformerConfig, name: str) -> nn.Module:
  """The config's norm: LayerNorm, or RMSNorm (`norm='rmsnorm'`; scaled by 1 + scale with
  `norm_plus_one`)."""
  if c.norm == "rmsnorm":
    return layers.RMSNorm(c.layer_norm_epsilon, c.dtype, c.norm_plus_one, name=name)
  if c.norm != "layernorm":
    raise ValueError(f"Unknown norm {c.norm!r}: use 'layernorm' or 'rmsnorm'.")
  embed = lambda init: nn.with_logical_partitioning(init, ("embed",))
  return nn.LayerNorm(epsilon=c.layer_norm_epsilon, dtype=c.dtype, name=name,
                      scale_init=embed(nn.initializers.ones_init()),
                      bias_init=embed(nn.initializers.zeros_init()))


def _attention(c: TransformerConfig, name: str, score: str = "dot_product", *,
               self_attention: bool = True, local: bool = False):
  """An attention layer of the config; rotary embeddings ('rope') in self-attention only,
  `local` (a sliding-window layer's) with local_position_base where the config sets one."""
  rotary = self_attention and c.position_embedding == "rope"
  base, scaling = c.position_base, rope_scaling(c)
  if local and c.local_position_base:
    base, scaling = c.local_position_base, ("none",)
  scale = c.query_pre_attn_scalar ** -0.5 if c.query_pre_attn_scalar else None
  return attention.MultiHeadAttention(c.num_heads, c.qkv_dim, c.attention_dropout_rate, c.dtype,
                                      score, c.attention_implementation,
                                      use_bias=c.use_bias, qkv_bias=c.qkv_bias,
                                      out_bias=c.out_bias,
                                      scale_scores=c.scale_attention_scores,
                                      num_kv_heads=c.num_kv_heads,
                                      rope_base=base if rotary else None, rope_scaling=scaling,
                                      scale=scale, softcap=c.attention_softcap,
                                      qk_norm=c.qk_norm, norm_epsilon=c.layer_norm_epsilon,
                                      norm_plus_one=c.norm_plus_one, lora=c.lora,
                                      cache_dtype=c.kv_cache_dtype, name=name)


def rope_scaling(c: TransformerConfig) -> tuple:
  """The config's RoPE frequency scaling as layers.rope_frequencies takes it (each kind reads
  the values it needs)."""
  return (c.rope_scaling, c.rope_scaling_factor, c.rope_low_freq_factor,
          c.rope_high_freq_factor, c.rope_original_max_len)


def windowed_layers(c: TransformerConfig, num_layers: int) -> tuple[bool, ...]:
  """Which of a decoder stack's `num_layers` layers have the sliding window: letter
  i % len of `sliding_window_pattern` is 'L' (none without a `sliding_window`)."""
  pattern = c.sliding_window_pattern
  return tuple(bool(c.sliding_window) and pattern[i % len(pattern)] == "L"
               for i in range(num_layers))


def window_mask(query_positions: Array, key_positions: Array, window: int) -> Array:
  """[b|1, 1, q, k]: True where the key is less than `window` positions before the query
  (later keys pass: causality is the other masks' business). Positions, not slots, so that
  packed segments and the padding slots of a decoding cache count no distance."""
  return (key_positions[:, None, None, :]
          > query_positions[:, None, :, None] - window)  # [b|1, 1, q, k]


def _ffn(c: TransformerConfig):
  rate = c.dropout_rate if c.activation_dropout_rate is None else c.activation_dropout_rate
  return layers.FeedForward(c.mlp_dim, rate, c.ffn_activation, c.dtype, use_bias=c.use_bias,
                            lora=c.lora, name="ffn")


def _relative_bias(c: TransformerConfig, name: str, bidirectional: bool):
  return layers.RelativePositionBias(c.num_heads, c.relative_attention_num_buckets,
                                     c.relative_attention_max_distance, bidirectional,
                                     name=name)


def _relative_biases(c: TransformerConfig, num_layers: int, bidirectional: bool,
                     query_positions: Array, key_positions: Array) -> list[Array]:
  """Each layer's relative position bias [b, h, q, k] (inside a stack's compact call): one
  table for the stack, which T5 keeps in its first layer, or one per layer (UMT5)."""
  if not c.relative_bias_per_layer:
    bias = _relative_bias(c, "relative_bias", bidirectional)(query_positions, key_positions)
    return [bias] * num_layers
  return [_relative_bias(c, f"relative_bias_{i}", bidirectional)(query_positions,
                                                                 key_positions)
          for i in range(num_layers)]


def _stack_positions(length: int, positions: Array | None) -> Array:
  """[b|1, len] positions of a stack's tokens: the packed ones, else 0..len-1."""
  return jnp.arange(length)[None, :] if positions is None else positions


class EncoderLayer(nn.Module):
  """Self-attention, then the feed-forward network, each with its residual connection."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, mask: Array | None, deterministic: bool,
               bias: Array | None = None, positions: Array | None = None) -> Array:
    """`positions` [b|1, len]: the tokens' positions for rotary embeddings ('rope')."""
    residual = lambda name: SublayerConnection(self.config, name=name)
    self_attention = _attention(self.config, "self_attention")
    x = residual("self_attention_block")(
        x, lambda h: self_attention(h, h, mask, deterministic=deterministic, bias=bias,
                                    positions=positions),
        deterministic=deterministic)
    ffn = _ffn(self.config)
    return residual("ffn_block")(x, lambda h: ffn(h, deterministic=deterministic),
                                 deterministic=deterministic)


class DecoderLayer(nn.Module):
  """Causal self-attention, cross-attention (unless decoder-only), feed-forward network.

  `local`: a sliding-window layer (its mask comes windowed from the stack; its rotary
  embeddings take local_position_base where the config sets one)."""
  config: TransformerConfig
  local: bool = False

  @nn.compact
  def __call__(self, y: Array, encoded: Array | None, self_mask: Array | None,
               cross_mask: Array | None, deterministic: bool, decode: bool,
               bias: Array | None = None, positions: Array | None = None,
               prefix_fill: bool = False, beams: int = 1) -> Array:
    """`positions` [b|1, len]: the tokens' positions for rotary embeddings ('rope'); while
    decoding, those of the tokens fed in this call. `prefix_fill`, `beams`: see
    MultiHeadAttention."""
    c = self.config
    residual = lambda name: SublayerConnection(c, name=name)
    self_attention = _attention(c, "self_attention", local=self.local)
    y = residual("self_attention_block")(
        y, lambda h: self_attention(h, h, self_mask, deterministic=deterministic, decode=decode,
                                    bias=bias, positions=positions, prefix_fill=prefix_fill,
                                    beams=beams),
        deterministic=deterministic)
    if encoded is not None:
      cross_attention = _attention(c, "cross_attention", c.cross_attention_score,
                                   self_attention=False)
      y = residual("cross_attention_block")(
          y, lambda h: cross_attention(h, encoded, cross_mask, deterministic=deterministic,
                                       decode=decode),
          deterministic=deterministic)
    ffn = _ffn(c)
    return residual("ffn_block")(y, lambda h: ffn(h, deterministic=deterministic),
                                 deterministic=deterministic)


class EncoderStack(nn.Module):
  """num_layers encoder layers on embedded inputs [b, len, emb]; `positions` [b, len] (packed
  rows) matter only for a relative position bias or rotary embeddings."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, mask: Array | None, *, deterministic: bool,
               positions: Array | None = None) -> Array:
    c = self.config
    layer = _remat(EncoderLayer, c, static=("deterministic",))
    biases = [None] * c.num_layers
    positions = _stack_positions(x.shape[1], positions)
    if c.position_embedding == "relative":
      biases = _relative_biases(c, c.num_layers, True, positions, positions)
    rotary_positions = positions if c.position_embedding == "rope" else None
    for i in range(c.num_layers):
      x = layer(c, name=f"layer_{i}")(residual_stream(x), mask, deterministic, biases[i],
                                      rotary_positions)
    if c.pre_ln if c.final_norm is None else c.final_norm:
      x = layer_norm(c, "final_norm")(x)
    return x


class DecoderStack(nn.Module):
  """Decoder layers on embedded decoder inputs; `encoded` None = decoder-only.

  `positions` [b, len] (packed rows) matter only for a relative position bias, rotary
  embeddings or a sliding window; while decoding, each row's write position in the cache
  counts them instead (`kv_cache`), unless they are given (packed prompts filling a cache). `prefix_fill`: the tokens fed while decoding are a prefix
  LM's prompt, read both ways. `beams`: rows per source that are one beam search's
  hypotheses (see MultiHeadAttention).
  """
  config: TransformerConfig

  @nn.compact
  def __call__(self, y: Array, encoded: Array | None, self_mask: Array | None,
               cross_mask: Array | None, *, deterministic: bool, decode: bool,
               positions: Array | None = None, prefix_fill: bool = False,
               beams: int = 1) -> Array:
    c = self.config
    # Decoding takes no gradient: nothing to recompute (the variables are named the same).
    layer = DecoderLayer if decode else _remat(
        DecoderLayer, c, static=("deterministic", "decode", "prefix_fill", "beams"))
    num_layers = c.num_decoder_layers or c.num_layers
    local = windowed_layers(c, num_layers)
    # Key positions are needed beside the queries' by a relative bias and a window; while
    # decoding the cache keeps them (rotary embeddings alone need the new tokens' only).
    keyed = c.position_embedding == "relative" or any(local)
    query_positions = key_positions = None
    if keyed or c.position_embedding == "rope":
      query_positions, key_positions = self._positions(y, positions, decode, keyed)
    biases = [None] * num_layers
    if c.position_embedding == "relative":
      biases = _relative_biases(c, num_layers, False, query_positions, key_positions)
    rotary_positions = query_positions if c.position_embedding == "rope" else None
    local_mask = None
    if any(local):
      window = window_mask(query_positions, key_positions, c.sliding_window)
      local_mask = (self_mask.replace(dense=attention.combine_masks(self_mask.dense, window),
                                      window=c.sliding_window)
                    if isinstance(self_mask, kernels.StructuredMask)
                    else attention.combine_masks(self_mask, window))
    for i in range(num_layers):
      y = layer(c, local=local[i], name=f"layer_{i}")(
          residual_stream(y), encoded, local_mask if local[i] else self_mask, cross_mask,
          deterministic, decode, biases[i], rotary_positions, prefix_fill, beams)
    if c.pre_ln if c.final_norm is None else c.final_norm:
      y = layer_norm(c, "final_norm")(y)
    return y

  def _positions(self, y: Array, positions: Array | None, decode: bool,
                 keyed: bool) -> tuple[Array, Array | None]:
    """The self-attention's query positions [b|1, len] and, where `keyed`, its key positions
    (the queries' in training). Decoding, the queries are the new tokens' and the cache holds
    each slot's position beside the keys (written where each row writes its keys)."""
    length = y.shape[1]
    if not decode:
      positions = _stack_positions(length, positions)
      return positions, positions if keyed else None
    index, new = kv_cache.decode_positions(self, y.shape[0], length)
    if positions is not None:  # packed prompts filling a cache (prompt_packing.py)
      new = jnp.broadcast_to(positions, new.shape).astype(jnp.int32)
    if not keyed:
      return new, None
    initialized = self.has_variable("cache", "cached_positions")
    cached = self.variable("cache", "cached_positions", jnp.zeros, (y.shape[0], length),
                           jnp.int32)
    if not initialized:  # the init pass only creates the cache
      return new, new
    cached.value = kv_cache.write(cached.value, new, index)
    return new, cached.value

