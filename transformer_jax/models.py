"""Transformer models (Vaswani et al., 2017) as pure Flax Linen modules.

Three families share one encoder stack and one decoder stack:
  EncoderDecoder     translation, summarization: (inputs, targets) -> [b, tgt_len, vocab]
  DecoderOnly        causal or prefix language model (also over `SOURCE <eos> TARGET`):
                     tokens -> [b, len, vocab]
  EncoderClassifier  encoder + pooling + dense head: inputs -> [b, num_classes]

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
# The logit of a masked padding class (`mask_padding_logit`): far below any real logit, yet
# finite, so that a softmax or a loss at weight-0 positions stays finite.
PADDING_LOGIT = -1e9


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyper-parameters; names follow flax `examples/wmt` where they overlap.

  The one source of model defaults: `config.model` in default_config.py holds these fields
  with these values (the paper's base model; experiment configs set their own sizes).
  """
  vocab_size: int = 32000
  emb_dim: int = 512
  num_heads: int = 8
  # Key/value heads (grouped-query attention, Ainslie et al., 2023): each is shared by
  # num_heads / num_kv_heads query heads, in every attention layer and the KV cache; 1 =
  # multi-query attention, 0 (or None) = num_heads: plain multi-head attention, with exactly
  # its parameters (self-attention's fused 'qkv'). Fewer: separate 'query' and 'kv' kernels.
  num_kv_heads: int | None = 0
  num_layers: int = 6  # encoder layers, and decoder layers unless num_decoder_layers is set
  num_decoder_layers: int | None = None
  qkv_dim: int = 512
  mlp_dim: int = 2048
  max_len: int = 256
  dropout_rate: float = 0.1  # residual: embeddings and every sub-layer output
  attention_dropout_rate: float = 0.0  # on the attention weights
  activation_dropout_rate: float | None = None  # inside the FFN; None = dropout_rate
  dtype: Any = jnp.float32  # activation dtype; parameters stay float32
  pre_ln: bool = False  # False: post-LN as in the paper; True: pre-LN
  final_norm: bool | None = None  # a norm after each stack; None = pre_ln
  layer_norm_epsilon: float = 1e-6
  norm: str = "layernorm"  # or 'rmsnorm' (no bias, no centring: T5)
  # 'relu', 'gelu', 'gelu_tanh', 'silu', gated: 'geglu', 'geglu_tanh', 'reglu', 'swiglu'
  ffn_activation: str = "relu"
  use_bias: bool = True  # biases in the attention and feed-forward projections (T5: none)
  scale_attention_scores: bool = True  # scores / sqrt(head_dim) (T5 folds it into weights)
  # 'sinusoidal' (interleaved), 'sinusoidal_halves' ([sin | cos]: Marian), 'learned',
  # 'relative' (T5: a learned bias per relative-position bucket, added to attention scores),
  # or 'rope' (rotary embeddings, Su et al., 2021: self-attention queries and keys rotated by
  # their positions, nothing added to the embeddings; the half-split GPT-NeoX / LLaMA layout
  # over the whole head dimension, which must be even; see layers.rotary_embedding)
  position_embedding: str = "sinusoidal"
  position_base: float = 10000.0  # the sinusoids' base n, or RoPE's base (theta)
  relative_attention_num_buckets: int = 32  # 'relative': buckets per direction pair
  relative_attention_max_distance: int = 128  # 'relative': distances beyond share a bucket
  relative_bias_per_layer: bool = False  # 'relative': a bias per layer (UMT5), not per stack
  scale_embeddings: bool = True  # token embeddings x sqrt(emb_dim) (the paper; not T5/BART)
  embedding_norm: bool = False  # a norm after token + position embeddings (BART)
  share_embeddings: bool = True  # one embedding for source and target tokens
  tie_output: bool = True  # output layer = transposed target embedding
  output_rescale: bool = False  # decoder states x emb_dim^-0.5 before the output (T5 v1.0)
  logits_bias: bool = False  # a bias on the tied output's logits (BART / Marian)
  # The output never predicts id 0 (padding): for checkpoints without a pad token of their
  # own (GPT-2), whose pad row is added on import and must not compete in the softmax.
  mask_padding_logit: bool = False
  # The output matmul reads its operands in `dtype` and accumulates in float32; the logits are
  # float32 either way. True: float32 operands too (on a GPU that is a TF32 product, slower than
  # bfloat16's: benchmarks/RESULTS.md, GPU section); a float32 model is the same either way.
  logits_dot_in_float32: bool = False
  cross_attention_score: str = "dot_product"  # or 'multiplicative', 'additive'
  attention_implementation: str = "reference"  # or 'xla', 'cudnn', 'auto' (jax.nn)
  remat: bool = False  # recompute each layer's activations in the backward pass
  remat_policy: str = "full"  # with remat: what is kept (see REMAT_POLICIES)
  bos_id: int = 2  # first decoder input (the tokenizer reserves it; imports: decoder start)
  num_classes: int = 2  # classifier outputs
  # classifier: 'mean' (non-padding), 'first', 'attention', or a dense + tanh over the first
  # token: 'cls_pooler' (BERT's pooler) or 'cls_head' (RoBERTa's head: dropout before it too)
  pooling: str = "mean"
  num_token_types: int = 0  # classifier: learned token-type rows (BERT); inputs are type 0
  # Decoder-only: a prefix LM (Raffel et al., 2020, Fig. 3): the source part `SOURCE <eos>`
  # (loss weight 0) is read both ways, the target causally; prompts are filled the same way.
  prefix_lm: bool = False

  def replace(self, **changes) -> "TransformerConfig":
    return dataclasses.replace(self, **changes)


# Named sizes. base and big are the paper's (Table 3); vocab_size is set per dataset.
SIZES = {
    "tiny": dict(emb_dim=64, num_heads=2, num_layers=2, qkv_dim=64, mlp_dim=256),
    "small": dict(emb_dim=256, num_heads=4, num_layers=3, qkv_dim=256, mlp_dim=1024),
    "base": dict(emb_dim=512, num_heads=8, num_layers=6, qkv_dim=512, mlp_dim=2048,
                 dropout_rate=0.1),
    "big": dict(emb_dim=1024, num_heads=16, num_layers=6, qkv_dim=1024, mlp_dim=4096,
                dropout_rate=0.3),
}


# What a rematerialised layer keeps from its forward pass; the rest is recomputed.
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,  # least memory: only layer inputs
    "dots": jax.checkpoint_policies.dots_saveable,  # matmul outputs kept: no matmul recomputed
    # matmul outputs without batch dimensions (the projections, not attention scores), so
    # the [b, h, q, k] scores of long sequences are recomputed rather than stored.
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _remat(layer: type[nn.Module], c: "TransformerConfig", static_argnums: tuple[int, ...]):
  if not c.remat:
    return layer
  if c.remat_policy not in REMAT_POLICIES:
    raise ValueError(f"Unknown remat_policy {c.remat_policy!r}; use one of "
                     f"{sorted(REMAT_POLICIES)}.")
  # Flags such as `deterministic` must stay Python bools: static arguments.
  return nn.remat(layer, static_argnums=static_argnums, policy=REMAT_POLICIES[c.remat_policy])


def named_config(size: str, **overrides) -> TransformerConfig:
  """TransformerConfig of a named size ('tiny', 'small', 'base', 'big') plus overrides."""
  if size not in SIZES:
    raise ValueError(f"Unknown model size {size!r}; known: {sorted(SIZES)}.")
  return TransformerConfig(**{**SIZES[size], **overrides})


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


def config_defaults() -> dict:
  """Every TransformerConfig field and its default, the dtype by name: `config.model`."""
  fields = dataclasses.asdict(TransformerConfig())
  fields["dtype"] = jnp.dtype(fields["dtype"]).name
  return fields


def shift_right(targets: Array, bos_id: int, segmentation: Array | None = None) -> Array:
  """Decoder inputs: `bos` then the targets, one step later; packed segments each get a bos."""
  shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
  starts = jnp.zeros_like(targets, dtype=jnp.bool_).at[:, 0].set(True)
  if segmentation is not None:
    previous = jnp.pad(segmentation, ((0, 0), (1, 0)))[:, :-1]
    starts = starts | (segmentation != previous)
  shifted = jnp.where(starts, bos_id, shifted)
  return jnp.where(targets != 0, shifted, 0)  # padding stays padding


def self_attention_mask(tokens: Array, segmentation: Array | None, causal: bool,
                        prefix: Array | None = None) -> Array:
  """[b, 1, len, len]: non-padding, same segment, and (if causal) not in the future, except
  that positions of the `prefix` [b, len] (a prefix LM's source part) see each other."""
  visible = attention.causal_mask(tokens.shape[1]) if causal else None
  if causal and prefix is not None:
    visible = visible | (prefix[:, None, :, None] & prefix[:, None, None, :])
  return attention.combine_masks(
      attention.padding_mask(tokens, tokens),
      None if segmentation is None else attention.segment_mask(segmentation, segmentation),
      visible)


# ---- Layers and stacks ---------------------------------------------------------------------

def residual_stream(x: Array) -> Array:
  """[b, len, emb] between layers: rows split over data x fsdp, the embedding dimension whole
  (the jit layout's activation sharding; a no-op without logical axis rules, as under pmap)."""
  return nn.with_logical_constraint(x, ("batch", "length", None))


class SublayerConnection(nn.Module):
  """Residual connection with a norm after (post-LN) or before (pre-LN) the sublayer."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, sublayer, *, deterministic: bool) -> Array:
    c = self.config
    norm = _layer_norm(c, "norm")
    y = sublayer(norm(x) if c.pre_ln else x)
    y = layers.Dropout(c.dropout_rate)(y, deterministic=deterministic)
    return x + y if c.pre_ln else norm(x + y)


def _layer_norm(c: TransformerConfig, name: str) -> nn.Module:
  """The config's norm: LayerNorm, or RMSNorm (`norm='rmsnorm'`)."""
  if c.norm == "rmsnorm":
    return layers.RMSNorm(c.layer_norm_epsilon, c.dtype, name=name)
  if c.norm != "layernorm":
    raise ValueError(f"Unknown norm {c.norm!r}: use 'layernorm' or 'rmsnorm'.")
  embed = lambda init: nn.with_logical_partitioning(init, ("embed",))
  return nn.LayerNorm(epsilon=c.layer_norm_epsilon, dtype=c.dtype, name=name,
                      scale_init=embed(nn.initializers.ones_init()),
                      bias_init=embed(nn.initializers.zeros_init()))


def _logits_dense(c: TransformerConfig) -> nn.Dense:
  """The output layer when it is not tied to the embedding."""
  # Operands in the output's dtype, products summed and returned in float32.
  return nn.Dense(c.vocab_size, dtype=_output_dtype(c), use_bias=c.use_bias,
                  dot_general=layers.float32_sum_dot,
                  kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                           ("embed", "vocab")),
                  bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(),
                                                         ("vocab",)))


def _attention(c: TransformerConfig, name: str, score: str = "dot_product", *,
               self_attention: bool = True):
  """An attention layer of the config; rotary embeddings ('rope') in self-attention only."""
  rotary = self_attention and c.position_embedding == "rope"
  return attention.MultiHeadAttention(c.num_heads, c.qkv_dim, c.attention_dropout_rate, c.dtype,
                                      score, c.attention_implementation,
                                      use_bias=c.use_bias,
                                      scale_scores=c.scale_attention_scores,
                                      num_kv_heads=c.num_kv_heads,
                                      rope_base=c.position_base if rotary else None, name=name)


def _ffn(c: TransformerConfig):
  rate = c.dropout_rate if c.activation_dropout_rate is None else c.activation_dropout_rate
  return layers.FeedForward(c.mlp_dim, rate, c.ffn_activation, c.dtype, use_bias=c.use_bias,
                            name="ffn")


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
  """Causal self-attention, cross-attention (unless decoder-only), feed-forward network."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, y: Array, encoded: Array | None, self_mask: Array | None,
               cross_mask: Array | None, deterministic: bool, decode: bool,
               bias: Array | None = None, positions: Array | None = None,
               prefix_fill: bool = False) -> Array:
    """`positions` [b|1, len]: the tokens' positions for rotary embeddings ('rope'); while
    decoding, those of the tokens fed in this call. `prefix_fill`: see MultiHeadAttention."""
    c = self.config
    residual = lambda name: SublayerConnection(c, name=name)
    self_attention = _attention(c, "self_attention")
    y = residual("self_attention_block")(
        y, lambda h: self_attention(h, h, self_mask, deterministic=deterministic, decode=decode,
                                    bias=bias, positions=positions, prefix_fill=prefix_fill),
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
    layer = _remat(EncoderLayer, c, static_argnums=(3,))  # `deterministic`, counting self
    biases = [None] * c.num_layers
    positions = _stack_positions(x.shape[1], positions)
    if c.position_embedding == "relative":
      biases = _relative_biases(c, c.num_layers, True, positions, positions)
    rotary_positions = positions if c.position_embedding == "rope" else None
    for i in range(c.num_layers):
      x = layer(c, name=f"layer_{i}")(residual_stream(x), mask, deterministic, biases[i],
                                      rotary_positions)
    if c.pre_ln if c.final_norm is None else c.final_norm:
      x = _layer_norm(c, "final_norm")(x)
    return x


class DecoderStack(nn.Module):
  """Decoder layers on embedded decoder inputs; `encoded` None = decoder-only.

  `positions` [b, len] (packed rows) matter only for a relative position bias or rotary
  embeddings; while decoding, the cache counts positions instead, less each row's
  `decode_offset` [b] (see layers.PositionEmbedding). `prefix_fill`: the tokens fed while
  decoding are a prefix LM's prompt, read both ways.
  """
  config: TransformerConfig

  @nn.compact
  def __call__(self, y: Array, encoded: Array | None, self_mask: Array | None,
               cross_mask: Array | None, *, deterministic: bool, decode: bool,
               positions: Array | None = None, decode_offset: Array | None = None,
               prefix_fill: bool = False) -> Array:
    c = self.config
    # deterministic, decode, prefix_fill
    layer = _remat(DecoderLayer, c, static_argnums=(5, 6, 9))
    num_layers = c.num_decoder_layers or c.num_layers
    biases = [None] * num_layers
    if c.position_embedding == "relative":
      query_positions, key_positions = self._relative_positions(y, positions, decode)
      biases = _relative_biases(c, num_layers, False, query_positions, key_positions)
    rotary_positions = None
    if c.position_embedding == "rope":
      # Keys are cached already rotated: decoding needs the new tokens' positions only.
      rotary_positions = (self._decode_positions(y.shape[0], y.shape[1], decode_offset)[1]
                          if decode else _stack_positions(y.shape[1], positions))
    for i in range(num_layers):
      y = layer(c, name=f"layer_{i}")(residual_stream(y), encoded, self_mask, cross_mask,
                                      deterministic, decode, biases[i], rotary_positions,
                                      prefix_fill)
    if c.pre_ln if c.final_norm is None else c.final_norm:
      y = _layer_norm(c, "final_norm")(y)
    return y

  def _relative_positions(self, y: Array, positions: Array | None, decode: bool):
    """Query and key positions of the self-attention's relative bias. Decoding, the cache
    holds each slot's position beside the keys (written as tokens are fed; rows are beams)."""
    length = y.shape[1]
    if not decode:
      positions = _stack_positions(length, positions)
      return positions, positions
    initialized = self.has_variable("cache", "cached_positions")
    cached = self.variable("cache", "cached_positions", jnp.zeros, (y.shape[0], length),
                           jnp.int32)
    index, new = self._decode_positions(y.shape[0], length)
    if not initialized:  # the init pass only creates the cache
      return new, new
    cached.value = jax.lax.dynamic_update_slice(cached.value, new, (0, index))
    return new, cached.value

  def _decode_positions(self, batch_size: int, length: int,
                        decode_offset: Array | None = None) -> tuple[Array, Array]:
    """While decoding: (the first cache slot this call writes, the absolute positions
    [b, len] of the tokens it feeds), from a counter in the cache that every row (beam)
    shares, less each row's `decode_offset`. The init pass that creates the cache gives
    0..len-1 and leaves the counter at 0."""
    initialized = self.has_variable("cache", "position_index")
    index = self.variable("cache", "position_index", lambda: jnp.array(0, jnp.int32))
    start = index.value
    if initialized:
      index.value = start + length
    new = jnp.broadcast_to(start + jnp.arange(length, dtype=jnp.int32),
                           (batch_size, length))  # [b, len]
    if decode_offset is not None:
      new = new - decode_offset[:, None].astype(jnp.int32)
    return start, new


class TokenEmbedding(nn.Module):
  """Token embedding (scaled by sqrt(emb_dim) unless `scale_embeddings` is off); `attend`
  gives the tied output logits."""
  config: TransformerConfig

  def setup(self):
    c = self.config
    # Scaled by sqrt(emb_dim) on lookup, so initialised with stddev 1/sqrt(emb_dim).
    self.embedding = nn.Embed(c.vocab_size, c.emb_dim, embedding_init=nn.with_logical_partitioning(
        nn.initializers.normal(stddev=c.emb_dim ** -0.5), ("vocab", "embed")))

  def __call__(self, tokens: Array) -> Array:
    c = self.config
    # Under the jit layout the table is gathered whole before the lookup (as FSDP gathers every
    # weight before use): a lookup into a vocab x embed-sharded table has no efficient sharding.
    table = nn.with_logical_constraint(self.embedding.embedding, (None, None))
    embedded = residual_stream(jnp.take(table, tokens, axis=0))  # [b, len, emb]
    if c.scale_embeddings:
      embedded = embedded * jnp.sqrt(jnp.float32(c.emb_dim))
    return embedded.astype(c.dtype)

  def attend(self, y: Array) -> Array:
    """Float32 logits of `y`, multiplied in y's dtype (see `layers.tied_logits`)."""
    return layers.tied_logits(y, self.embedding.embedding)


def _output_dtype(c: TransformerConfig):
  """The dtype the output matmul reads its operands in (it accumulates in float32)."""
  return jnp.float32 if c.logits_dot_in_float32 else c.dtype


def _output_logits(module: nn.Module, embedding: TokenEmbedding, y: Array) -> Array:
  """Decoder states -> float32 logits: the tied embedding (plus the config's `logits_bias`,
  a parameter 'logits_bias' of `module`), or `module.logits_dense` when untied."""
  c = module.config
  y = y.astype(jnp.float32)
  if c.output_rescale:
    y = y * jnp.float32(c.emb_dim ** -0.5)
  y = y.astype(_output_dtype(c))
  if not c.tie_output:
    logits = module.logits_dense(y)
  else:
    logits = embedding.attend(y)  # [b, len, vocab]
    if c.logits_bias:
      logits = logits + module.logits_bias
  if c.mask_padding_logit:
    logits = logits.at[..., 0].set(PADDING_LOGIT)
  return logits


def _output_params(module: nn.Module) -> None:
  """The output layer's parameters, in `module.setup`: see `_output_logits`."""
  c = module.config
  if not c.tie_output:
    module.logits_dense = _logits_dense(c)
  elif c.logits_bias:
    module.logits_bias = module.param("logits_bias", nn.with_logical_partitioning(
        nn.initializers.zeros_init(), ("vocab",)), (c.vocab_size,))


def _embedding_norm(c: TransformerConfig, name: str):
  """The norm after token + position embeddings (BART), or the identity."""
  return _layer_norm(c, name) if c.embedding_norm else (lambda x: x)


def _positions(c: TransformerConfig, name: str) -> layers.PositionEmbedding:
  return layers.PositionEmbedding(c.max_len, c.position_embedding, c.position_base, name=name)


# ---- Families ------------------------------------------------------------------------------

class EncoderDecoder(nn.Module):
  """The paper's Transformer: encoder, decoder, embeddings tied to the output layer."""
  config: TransformerConfig

  def setup(self):
    c = self.config
    self.target_embedding = TokenEmbedding(c, name="shared_embedding" if c.share_embeddings
                                           else "target_embedding")
    self.source_embedding = (self.target_embedding if c.share_embeddings
                             else TokenEmbedding(c, name="source_embedding"))
    self.encoder_positions = _positions(c, "encoder_positions")
    self.decoder_positions = _positions(c, "decoder_positions")
    self.encoder_embedding_norm = _embedding_norm(c, "encoder_embedding_norm")
    self.decoder_embedding_norm = _embedding_norm(c, "decoder_embedding_norm")
    self.encoder = EncoderStack(c, name="encoder")
    self.decoder = DecoderStack(c, name="decoder")
    _output_params(self)
    self.dropout = layers.Dropout(c.dropout_rate)

  def encode(self, inputs: Array, inputs_position: Array | None = None,
             inputs_segmentation: Array | None = None, *, deterministic: bool = False) -> Array:
    """[b, src_len] tokens -> [b, src_len, emb] encoder outputs."""
    mask = self_attention_mask(inputs, inputs_segmentation, causal=False)
    x = self.encoder_positions(self.source_embedding(inputs), inputs_position)
    x = self.dropout(self.encoder_embedding_norm(x), deterministic=deterministic)
    return self.encoder(x, mask, deterministic=deterministic, positions=inputs_position)

  def decode(self, encoded: Array, inputs: Array, targets: Array,
             targets_position: Array | None = None, inputs_segmentation: Array | None = None,
             targets_segmentation: Array | None = None, *, deterministic: bool = False,
             decode: bool = False) -> Array:
    """Decoder logits [b, tgt_len, vocab] (float32).

    Training (`decode=False`): `targets` are the gold outputs, shifted right here. Decoding
    (`decode=True`): `targets` are the decoder's input tokens for this call (bos first; one
    or several), and the self-attention KV cache supplies causality. Cross-attention keys and
    values come from the 'encoded_kv' collection when it is given (a call with it mutable
    fills it); `targets` may then hold several rows (beams) per source row.
    """
    c = self.config
    if decode:
      decoder_inputs = targets
      self_mask = None
      cross_mask = (inputs != 0)[:, None, None, :]  # [b, 1, 1, src_len]
    else:
      decoder_inputs = shift_right(targets, c.bos_id, targets_segmentation)
      self_mask = self_attention_mask(targets, targets_segmentation, causal=True)
      cross_mask = attention.combine_masks(
          attention.padding_mask(targets, inputs),
          None if targets_segmentation is None else
          attention.segment_mask(targets_segmentation, inputs_segmentation))
    y = self.decoder_positions(self.target_embedding(decoder_inputs), targets_position,
                               decode=decode)
    y = self.dropout(self.decoder_embedding_norm(y), deterministic=deterministic)
    y = self.decoder(y, encoded, self_mask, cross_mask, deterministic=deterministic,
                     decode=decode, positions=targets_position)
    return _output_logits(self, self.target_embedding, y)

  def __call__(self, inputs: Array, targets: Array, inputs_position: Array | None = None,
               targets_position: Array | None = None, inputs_segmentation: Array | None = None,
               targets_segmentation: Array | None = None, *, deterministic: bool = False,
               decode: bool = False) -> Array:
    """Teacher-forced logits [b, tgt_len, vocab] for `inputs` [b, src_len] -> `targets`."""
    encoded = self.encode(inputs, inputs_position, inputs_segmentation,
                          deterministic=deterministic)
    return self.decode(encoded, inputs, targets, targets_position, inputs_segmentation,
                       targets_segmentation, deterministic=deterministic, decode=decode)


class DecoderOnly(nn.Module):
  """Causal language model. Training: logits[t] predicts tokens[t] (shifted right here).

  Conditioned on a source (decoder-only summarization) the tokens are
  `SOURCE <eos> TARGET <eos>` and the loss weights are 0 on the source part. Decoding
  (`decode=True`): `tokens` are fed as they are, several at once to fill a prompt, then one
  per call, with the KV cache.
  """
  config: TransformerConfig

  def setup(self):
    c = self.config
    self.embedding = TokenEmbedding(c, name="embedding")
    self.positions = _positions(c, "positions")
    self.embedding_norm = _embedding_norm(c, "embedding_norm")
    self.decoder = DecoderStack(c, name="decoder")
    _output_params(self)
    self.dropout = layers.Dropout(c.dropout_rate)

  def __call__(self, tokens: Array, positions: Array | None = None,
               segmentation: Array | None = None, prefix: Array | None = None, *,
               deterministic: bool = False, decode: bool = False,
               cache_mask: Array | None = None, decode_offset: Array | None = None,
               prefix_fill: bool = False) -> Array:
    """Logits [b, len, vocab]; the arguments as `states`."""
    return self.logits(self.states(tokens, positions, segmentation, prefix,
                                   deterministic=deterministic, decode=decode,
                                   cache_mask=cache_mask, decode_offset=decode_offset,
                                   prefix_fill=prefix_fill))

  def states(self, tokens: Array, positions: Array | None = None,
             segmentation: Array | None = None, prefix: Array | None = None, *,
             deterministic: bool = False, decode: bool = False,
             cache_mask: Array | None = None, decode_offset: Array | None = None,
             prefix_fill: bool = False) -> Array:
    """The last layer's states [b, len, emb], before the output layer.

    Training: a prefix LM (`config.prefix_lm`) reads the positions marked by `prefix`
    [b, len] (its source part) both ways. Decoding a batch of right-padded prompts:
    `cache_mask` [b, 1, 1, cache_len] hides the prompts' padding slots, `decode_offset` [b]
    keeps each row's positions as in training (see layers.PositionEmbedding), and
    `prefix_fill` has a prefix LM's prompt read both ways.
    """
    c = self.config
    if decode:
      inputs, mask = tokens, cache_mask
    else:
      inputs = shift_right(tokens, c.bos_id, segmentation)
      mask = self_attention_mask(tokens, segmentation, causal=True,
                                 prefix=prefix if c.prefix_lm else None)
    y = self.positions(self.embedding(inputs), positions, decode=decode,
                       decode_offset=decode_offset)
    y = self.dropout(self.embedding_norm(y), deterministic=deterministic)
    return self.decoder(y, None, mask, None, deterministic=deterministic, decode=decode,
                        positions=positions, decode_offset=decode_offset,
                        prefix_fill=prefix_fill and c.prefix_lm)

  def logits(self, states: Array) -> Array:
    """Float32 logits [..., vocab] of `states` [..., emb]."""
    return _output_logits(self, self.embedding, states)


class EncoderClassifier(nn.Module):
  """Encoder, pooling over non-padding tokens, dense head: [b, len] -> [b, num_classes]."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs: Array, inputs_position: Array | None = None,
               inputs_segmentation: Array | None = None, *,
               deterministic: bool = False) -> Array:
    c = self.config
    mask = self_attention_mask(inputs, inputs_segmentation, causal=False)
    x = TokenEmbedding(c, name="embedding")(inputs)
    if c.num_token_types:
      # Every input is one segment, type 0; the other rows are kept for export.
      types = self.param("token_types", nn.with_logical_partitioning(
          nn.initializers.normal(stddev=0.02), (None, "embed")), (c.num_token_types, c.emb_dim))
      x = x + types[0].astype(x.dtype)
    x = _positions(c, "positions")(x, inputs_position)
    x = _embedding_norm(c, "embedding_norm")(x)
    x = layers.Dropout(c.dropout_rate)(x, deterministic=deterministic)
    x = EncoderStack(c, name="encoder")(x, mask, deterministic=deterministic,
                                        positions=inputs_position)  # [b, len, emb]
    pooled = _pool(c, x, inputs, deterministic)
    pooled = layers.Dropout(c.dropout_rate)(pooled, deterministic=deterministic)
    return nn.Dense(c.num_classes, dtype=jnp.float32, name="head")(
        pooled.astype(jnp.float32))  # [b, num_classes]


def _pool(c: TransformerConfig, x: Array, inputs: Array, deterministic: bool) -> Array:
  """[b, len, emb] encoder outputs -> [b, emb], by `c.pooling` (inside the classifier's
  compact call, which owns the parameters made here)."""
  valid = (inputs != 0)[..., None]  # [b, len, 1]
  if c.pooling == "mean":
    return jnp.sum(jnp.where(valid, x, 0), axis=1) / jnp.maximum(jnp.sum(valid, axis=1), 1)
  if c.pooling == "first":
    return x[:, 0]
  if c.pooling in ("cls_pooler", "cls_head"):
    first = x[:, 0]
    if c.pooling == "cls_head":
      first = layers.Dropout(c.dropout_rate)(first, deterministic=deterministic)
    return jnp.tanh(nn.Dense(c.emb_dim, dtype=c.dtype, name="pooler")(first))
  if c.pooling == "attention":
    # A learned query scores every token; padding gets no weight.
    scores = nn.Dense(1, dtype=c.dtype, name="pooling_query")(x)  # [b, len, 1]
    scores = jnp.where(valid, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    return jnp.sum(jax.nn.softmax(scores, axis=1).astype(x.dtype) * x, axis=1)
  raise ValueError(f"Unknown pooling {c.pooling!r}: use 'mean', 'first', 'attention', "
                   "'cls_pooler' or 'cls_head'.")


def attention_weights(model: nn.Module, params, *args, **kwargs) -> dict[str, Array]:
  """Every attention layer's weights [b, heads, q_len, k_len] for one forward pass.

  Keys are module paths such as 'encoder/layer_0/attention_block/self_attention'.
  """
  _, state = model.apply({"params": params}, *args, deterministic=True,
                         mutable=["intermediates"], **kwargs)
  flat = jax.tree_util.tree_flatten_with_path(state["intermediates"])[0]
  weights = {}
  for path, value in flat:
    names = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]
    weights["/".join(n for n in names if n != "attention_weights")] = value
  return weights
