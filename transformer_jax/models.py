"""Transformer models (Vaswani et al., 2017) as pure Flax Linen modules.

Token id 0 is padding everywhere. Packed examples carry `*_segmentation` (segment ids, 0 =
padding) and `*_position` arrays; masks, positions and the right shift respect them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax import attention
from transformer_jax import layers

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyper-parameters; names follow flax `examples/wmt` where they overlap."""
  vocab_size: int = 32000
  emb_dim: int = 512
  num_heads: int = 8
  num_layers: int = 6  # encoder layers, and decoder layers unless num_decoder_layers is set
  num_decoder_layers: int | None = None
  qkv_dim: int = 512
  mlp_dim: int = 2048
  max_len: int = 256
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  dtype: Any = jnp.float32  # activation dtype; parameters stay float32
  pre_ln: bool = False  # False: post-LN as in the paper; True: pre-LN
  position_embedding: str = "sinusoidal"  # or "learned"
  position_base: float = 10000.0
  bos_id: int = 2  # first decoder input token; the tokenizer reserves it
  num_classes: int = 2  # for the classifier

  def replace(self, **changes) -> "TransformerConfig":
    return dataclasses.replace(self, **changes)


def model_config(model_dict, **overrides) -> TransformerConfig:
  """TransformerConfig from `config.model` (dtype given by name, e.g. 'bfloat16')."""
  fields = dict(model_dict)
  fields.update(overrides)
  if isinstance(fields.get("dtype"), str):
    fields["dtype"] = jnp.dtype(fields["dtype"])
  known = {f.name for f in dataclasses.fields(TransformerConfig)}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise ValueError(f"Unknown config.model keys {unknown}; known: {sorted(known)}.")
  return TransformerConfig(**fields)


def shift_right(targets: Array, bos_id: int, segmentation: Array | None = None) -> Array:
  """Decoder inputs: `bos` then the targets, one step later; packed segments each get a bos."""
  shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
  starts = jnp.zeros_like(targets, dtype=jnp.bool_).at[:, 0].set(True)
  if segmentation is not None:
    previous = jnp.pad(segmentation, ((0, 0), (1, 0)))[:, :-1]
    starts = starts | (segmentation != previous)
  shifted = jnp.where(starts, bos_id, shifted)
  return jnp.where(targets != 0, shifted, 0)  # padding stays padding


class SublayerConnection(nn.Module):
  """Residual connection with LayerNorm after (post-LN) or before (pre-LN) the sublayer."""
  pre_ln: bool
  dropout_rate: float
  dtype: Any

  @nn.compact
  def __call__(self, x: Array, sublayer, *, deterministic: bool) -> Array:
    norm = nn.LayerNorm(dtype=self.dtype, name="norm")
    y = sublayer(norm(x) if self.pre_ln else x)
    y = nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
    return x + y if self.pre_ln else norm(x + y)


class EncoderLayer(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, mask: Array | None, *, deterministic: bool) -> Array:
    c = self.config
    residual = lambda name: SublayerConnection(c.pre_ln, c.dropout_rate, c.dtype, name=name)
    self_attention = attention.MultiHeadAttention(
        c.num_heads, c.qkv_dim, c.attention_dropout_rate, c.dtype, name="self_attention")
    x = residual("attention_block")(
        x, lambda h: self_attention(h, h, mask, deterministic=deterministic),
        deterministic=deterministic)
    ffn = layers.FeedForward(c.mlp_dim, c.dropout_rate, c.dtype, name="ffn")
    return residual("ffn_block")(x, lambda h: ffn(h, deterministic=deterministic),
                                 deterministic=deterministic)


class DecoderLayer(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, encoded: Array, self_mask: Array | None,
               cross_mask: Array | None, *, deterministic: bool, decode: bool) -> Array:
    c = self.config
    residual = lambda name: SublayerConnection(c.pre_ln, c.dropout_rate, c.dtype, name=name)
    self_attention = attention.MultiHeadAttention(
        c.num_heads, c.qkv_dim, c.attention_dropout_rate, c.dtype, name="self_attention")
    x = residual("self_attention_block")(
        x, lambda h: self_attention(h, h, self_mask, deterministic=deterministic, decode=decode),
        deterministic=deterministic)
    cross_attention = attention.MultiHeadAttention(
        c.num_heads, c.qkv_dim, c.attention_dropout_rate, c.dtype, name="cross_attention")
    x = residual("cross_attention_block")(
        x, lambda h: cross_attention(h, encoded, cross_mask, deterministic=deterministic),
        deterministic=deterministic)
    ffn = layers.FeedForward(c.mlp_dim, c.dropout_rate, c.dtype, name="ffn")
    return residual("ffn_block")(x, lambda h: ffn(h, deterministic=deterministic),
                                 deterministic=deterministic)


class EncoderDecoder(nn.Module):
  """The paper's Transformer: encoder, decoder, shared embeddings tied to the output layer."""
  config: TransformerConfig

  def setup(self):
    c = self.config
    # Scaled by sqrt(emb_dim) on lookup, so initialised with stddev 1/sqrt(emb_dim).
    self.embed = nn.Embed(c.vocab_size, c.emb_dim,
                          embedding_init=nn.initializers.normal(stddev=c.emb_dim ** -0.5),
                          name="shared_embedding")
    position = lambda name: layers.PositionEmbedding(c.max_len, c.position_embedding,
                                                     c.position_base, name=name)
    self.encoder_positions = position("encoder_positions")
    self.decoder_positions = position("decoder_positions")
    self.encoder_layers = [EncoderLayer(c, name=f"encoder_layer_{i}") for i in range(c.num_layers)]
    num_decoder_layers = c.num_decoder_layers or c.num_layers
    self.decoder_layers = [DecoderLayer(c, name=f"decoder_layer_{i}")
                           for i in range(num_decoder_layers)]
    # Pre-LN stacks end with a LayerNorm; post-LN outputs are normalised already.
    if c.pre_ln:
      self.encoder_norm = nn.LayerNorm(dtype=c.dtype)
      self.decoder_norm = nn.LayerNorm(dtype=c.dtype)
    self.dropout = nn.Dropout(c.dropout_rate)

  def _embed(self, tokens: Array) -> Array:
    c = self.config
    return (self.embed(tokens) * jnp.sqrt(jnp.float32(c.emb_dim))).astype(c.dtype)

  def encode(self, inputs: Array, inputs_position: Array | None = None,
             inputs_segmentation: Array | None = None, *, deterministic: bool = False) -> Array:
    """[b, src_len] tokens -> [b, src_len, emb] encoder outputs."""
    mask = attention.combine_masks(
        attention.padding_mask(inputs, inputs),
        None if inputs_segmentation is None else
        attention.segment_mask(inputs_segmentation, inputs_segmentation))
    x = self.encoder_positions(self._embed(inputs), inputs_position)
    x = self.dropout(x, deterministic=deterministic)
    for layer in self.encoder_layers:
      x = layer(x, mask, deterministic=deterministic)
    return self.encoder_norm(x) if self.config.pre_ln else x

  def decode(self, encoded: Array, inputs: Array, targets: Array,
             targets_position: Array | None = None, inputs_segmentation: Array | None = None,
             targets_segmentation: Array | None = None, *, deterministic: bool = False,
             decode: bool = False) -> Array:
    """Decoder logits [b, tgt_len, vocab] (float32).

    Training (`decode=False`): `targets` are the gold outputs, shifted right here. Decoding
    (`decode=True`): `targets` are the decoder's input tokens for this step (bos first), and
    the self-attention KV cache supplies causality.
    """
    c = self.config
    if decode:
      decoder_inputs = targets
      self_mask = None
      cross_mask = (inputs != 0)[:, None, None, :]  # [b, 1, 1, src_len]
    else:
      decoder_inputs = shift_right(targets, c.bos_id, targets_segmentation)
      segments = None
      if targets_segmentation is not None:
        segments = attention.segment_mask(targets_segmentation, targets_segmentation)
      self_mask = attention.combine_masks(attention.causal_mask(targets.shape[1]),
                                          attention.padding_mask(targets, targets), segments)
      cross_segments = None
      if targets_segmentation is not None:
        cross_segments = attention.segment_mask(targets_segmentation, inputs_segmentation)
      cross_mask = attention.combine_masks(attention.padding_mask(targets, inputs),
                                           cross_segments)
    y = self.decoder_positions(self._embed(decoder_inputs), targets_position, decode=decode)
    y = self.dropout(y, deterministic=deterministic)
    for layer in self.decoder_layers:
      y = layer(y, encoded, self_mask, cross_mask, deterministic=deterministic, decode=decode)
    if c.pre_ln:
      y = self.decoder_norm(y)
    # Output layer tied to the embedding; logits in float32 for a stable softmax.
    return self.embed.attend(y.astype(jnp.float32))  # [b, tgt_len, vocab]

  def __call__(self, inputs: Array, targets: Array, inputs_position: Array | None = None,
               targets_position: Array | None = None, inputs_segmentation: Array | None = None,
               targets_segmentation: Array | None = None, *, deterministic: bool = False,
               decode: bool = False) -> Array:
    """Teacher-forced logits [b, tgt_len, vocab] for `inputs` [b, src_len] -> `targets`."""
    encoded = self.encode(inputs, inputs_position, inputs_segmentation,
                          deterministic=deterministic)
    return self.decode(encoded, inputs, targets, targets_position, inputs_segmentation,
                       targets_segmentation, deterministic=deterministic, decode=decode)
