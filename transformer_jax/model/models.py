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

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.model import attention
from transformer_jax.model import blocks
from transformer_jax.model import kernels
from transformer_jax.model import layers
from transformer_jax.model import quantization
# The schema lives in schema.py and the layers in blocks.py; these names stay
# importable from here, as the public interface has them.
from transformer_jax.model.schema import (  # noqa: F401 pylint: disable=unused-import
    SIZES, TransformerConfig, config_defaults, model_config, named_config)

Array = jax.Array
# The logit of a masked padding class (`mask_padding_logit`): far below any real logit, yet
# finite, so that a softmax or a loss at weight-0 positions stays finite.
PADDING_LOGIT = -1e9


def shift_right(targets: Array, bos_id: int, segmentation: Array | None = None, *,
                start_from_last: bool = False) -> Array:
  """Decoder inputs: `bos` then the targets, one step later; packed segments each get a bos.
  `start_from_last`: each target (segment) starts from its own last token instead of `bos`,
  as mBART's shift_tokens_right wraps it round (mBART-cc25's `X </s> [code]` targets start
  from their language code, so rows of different target languages start apart)."""
  shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
  starts = jnp.zeros_like(targets, dtype=jnp.bool_).at[:, 0].set(True)
  if segmentation is not None:
    previous = jnp.pad(segmentation, ((0, 0), (1, 0)))[:, :-1]
    starts = starts | (segmentation != previous)
  first = _segment_last_tokens(targets, segmentation) if start_from_last else bos_id
  shifted = jnp.where(starts, first, shifted)
  return jnp.where(targets != 0, shifted, 0)  # padding stays padding


def _segment_last_tokens(targets: Array, segmentation: Array | None) -> Array:
  """[b, len]: at each position, the last non-pad token of its segment (of its row unpacked)."""
  segments = (targets != 0).astype(jnp.int32) if segmentation is None else segmentation
  following = jnp.pad(segments[:, 1:], ((0, 0), (0, 1)))
  ends = (targets != 0) & (following != segments)
  length = targets.shape[1]
  # The nearest end at or after each position: a running minimum from the right.
  index = jax.lax.cummin(jnp.where(ends, jnp.arange(length), length - 1), axis=1, reverse=True)
  return jnp.take_along_axis(targets, index, axis=1)


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


def structured_self_mask(tokens: Array, segmentation: Array | None, causal: bool,
                         prefix: Array | None = None):
  """`self_attention_mask` with the parts it is built from (`kernels.StructuredMask`), which
  blockwise attention kernels read instead of the array; a prefix LM's (per-row prefixes)
  has no such parts: the array alone."""
  dense = self_attention_mask(tokens, segmentation, causal, prefix)
  if prefix is not None:
    return dense
  segments = segment_ids(tokens, segmentation)
  return kernels.StructuredMask(dense, segments, segments, causal=causal)


def segment_ids(tokens: Array, segmentation: Array | None) -> Array:
  """[b, len] segment ids with 0 at padding (1 everywhere else in an unpacked batch)."""
  if segmentation is None:
    return (tokens != 0).astype(jnp.int32)
  return jnp.where(tokens != 0, segmentation, 0).astype(jnp.int32)


class TokenEmbedding(nn.Module):
  """Token embedding (scaled by sqrt(emb_dim) unless `scale_embeddings` is off); `attend`
  gives the tied output logits."""
  config: TransformerConfig

  def setup(self):
    c = self.config
    # Scaled by sqrt(emb_dim) on lookup, so initialised with stddev 1/sqrt(emb_dim).
    init, names = nn.initializers.normal(stddev=c.emb_dim ** -0.5), ("vocab", "embed")
    init = (quantization.int8_table_init(init, names) if c.int8_embeddings
            else nn.with_logical_partitioning(init, names))
    self.embedding = nn.Embed(c.vocab_size, c.emb_dim, embedding_init=init)

  def __call__(self, tokens: Array) -> Array:
    c = self.config
    # Under the jit layout the table is gathered whole before the lookup (as FSDP gathers every
    # weight before use): a lookup into a vocab x embed-sharded table has no efficient sharding.
    table = jax.tree.map(lambda x: nn.with_logical_constraint(x, (None, None)),
                         self.embedding.embedding)
    rows = (table.lookup(tokens) if isinstance(table, quantization.Int8Table)
            else jnp.take(table, tokens, axis=0))
    embedded = blocks.residual_stream(rows)  # [b, len, emb]
    if c.scale_embeddings:
      scale = jnp.sqrt(jnp.float32(c.emb_dim))
      if c.embedding_scale_in_dtype:
        scale = scale.astype(c.dtype).astype(jnp.float32)
      embedded = embedded * scale
    return embedded.astype(c.dtype)

  def attend(self, y: Array) -> Array:
    """Float32 logits of `y`, multiplied in y's dtype (see `layers.tied_logits`); an int8
    table (config.quantization.embeddings: served, or a QLoRA run's frozen base) multiplied
    by its int8 rows, each logit then scaled."""
    table = self.embedding.embedding
    if isinstance(table, quantization.Int8Table):
      return table.logits(y, layers.float32_sum_dot)
    return layers.tied_logits(y, table)


def _output_dtype(c: TransformerConfig):
  """The dtype the output matmul reads its operands in (it accumulates in float32)."""
  return jnp.float32 if c.logits_dot_in_float32 else c.dtype


def _logits_dense(c: TransformerConfig) -> nn.Dense:
  """The output layer when it is not tied to the embedding."""
  # Operands in the output's dtype, products summed and returned in float32.
  return nn.Dense(c.vocab_size, dtype=_output_dtype(c), use_bias=c.use_bias,
                  dot_general=layers.float32_sum_dot,
                  kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                           ("embed", "vocab")),
                  bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(),
                                                         ("vocab",)))


def _output_logits(module: nn.Module, embedding: TokenEmbedding, y: Array) -> Array:
  """Decoder states -> float32 logits: the tied embedding (plus the config's `logits_bias`,
  a parameter 'logits_bias' of `module`), or `module.logits_dense` when untied; soft-capped
  by `logits_softcap`."""
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
  if c.logits_softcap:
    logits = jnp.tanh(logits / jnp.float32(c.logits_softcap)) * jnp.float32(c.logits_softcap)
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
  return blocks.layer_norm(c, name) if c.embedding_norm else (lambda x: x)


def counts_non_pad(c: TransformerConfig) -> bool:
  """Whether positions count non-pad tokens only (M2M100 / NLLB), not slots."""
  return c.position_embedding in layers.NON_PAD_POSITIONS


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
    self.encoder = blocks.EncoderStack(c, name="encoder")
    self.decoder = blocks.DecoderStack(c, name="decoder")
    _output_params(self)
    self.dropout = layers.Dropout(c.dropout_rate)

  def encode(self, inputs: Array, inputs_position: Array | None = None,
             inputs_segmentation: Array | None = None, *, deterministic: bool = False) -> Array:
    """[b, src_len] tokens -> [b, src_len, emb] encoder outputs."""
    mask = structured_self_mask(inputs, inputs_segmentation, causal=False)
    if inputs_position is None and counts_non_pad(self.config):
      inputs_position = layers.non_pad_positions(inputs)
    x = self.encoder_positions(self.source_embedding(inputs), inputs_position)
    x = self.dropout(self.encoder_embedding_norm(x), deterministic=deterministic)
    return self.encoder(x, mask, deterministic=deterministic, positions=inputs_position)

  def decode(self, encoded: Array, inputs: Array, targets: Array,
             targets_position: Array | None = None, inputs_segmentation: Array | None = None,
             targets_segmentation: Array | None = None, *, deterministic: bool = False,
             decode: bool = False, beams: int = 1, states_only: bool = False) -> Array:
    """Decoder logits [b, tgt_len, vocab] (float32); `states_only`: the decoder's states
    [b, tgt_len, emb] before the output layer (`logits` of them: the logits).

    Training (`decode=False`): `targets` are the gold outputs, shifted right here. Decoding
    (`decode=True`): `targets` are the decoder's input tokens for this call (bos first; one
    or several), and the self-attention KV cache supplies causality. Cross-attention keys and
    values come from the 'encoded_kv' collection when it is given (a call with it mutable
    fills it); `targets` may then hold several rows (beams) per source row, and `beams` > 1
    says that they are one beam search's hypotheses (see attention.MultiHeadAttention).
    """
    c = self.config
    if decode:
      decoder_inputs = targets
      self_mask = None
      cross_mask = (inputs != 0)[:, None, None, :]  # [b, 1, 1, src_len]
    else:
      decoder_inputs = shift_right(targets, c.bos_id, targets_segmentation,
                                   start_from_last=c.start_from_last_target)
      if targets_position is None and counts_non_pad(c):
        targets_position = layers.non_pad_positions(decoder_inputs)
      self_mask = structured_self_mask(targets, targets_segmentation, causal=True)
      cross_mask = kernels.StructuredMask(
          attention.combine_masks(
              attention.padding_mask(targets, inputs),
              None if targets_segmentation is None else
              attention.segment_mask(targets_segmentation, inputs_segmentation)),
          segment_ids(targets, targets_segmentation), segment_ids(inputs, inputs_segmentation))
    y = self.decoder_positions(self.target_embedding(decoder_inputs), targets_position,
                               decode=decode)
    y = self.dropout(self.decoder_embedding_norm(y), deterministic=deterministic)
    y = self.decoder(y, encoded, self_mask, cross_mask, deterministic=deterministic,
                     decode=decode, positions=targets_position, beams=beams)
    return y if states_only else self.logits(y)

  def __call__(self, inputs: Array, targets: Array, inputs_position: Array | None = None,
               targets_position: Array | None = None, inputs_segmentation: Array | None = None,
               targets_segmentation: Array | None = None, *, deterministic: bool = False,
               decode: bool = False, states_only: bool = False) -> Array:
    """Teacher-forced logits [b, tgt_len, vocab] for `inputs` [b, src_len] -> `targets`
    (`states_only`: as `decode`)."""
    encoded = self.encode(inputs, inputs_position, inputs_segmentation,
                          deterministic=deterministic)
    return self.decode(encoded, inputs, targets, targets_position, inputs_segmentation,
                       targets_segmentation, deterministic=deterministic, decode=decode,
                       states_only=states_only)

  def logits(self, states: Array) -> Array:
    """Float32 logits [..., vocab] of decoder `states` [..., emb]."""
    return _output_logits(self, self.target_embedding, states)


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
    self.decoder = blocks.DecoderStack(c, name="decoder")
    _output_params(self)
    self.dropout = layers.Dropout(c.dropout_rate)

  def __call__(self, tokens: Array, positions: Array | None = None,
               segmentation: Array | None = None, prefix: Array | None = None, *,
               deterministic: bool = False, decode: bool = False,
               cache_mask: Array | None = None, prefix_fill: bool = False,
               shift: bool = True, beams: int = 1) -> Array:
    """Logits [b, len, vocab]; the arguments as `states`."""
    return self.logits(self.states(tokens, positions, segmentation, prefix,
                                   deterministic=deterministic, decode=decode,
                                   cache_mask=cache_mask, prefix_fill=prefix_fill,
                                   shift=shift, beams=beams))

  def states(self, tokens: Array, positions: Array | None = None,
             segmentation: Array | None = None, prefix: Array | None = None, *,
             deterministic: bool = False, decode: bool = False,
             cache_mask: Array | None = None, prefix_fill: bool = False,
             shift: bool = True, beams: int = 1) -> Array:
    """The last layer's states [b, len, emb], before the output layer.

    Training reads `tokens` shifted right (`<bos>` first: logits[t] predict tokens[t]), or,
    with `shift=False`, as they are (logits[t] predict tokens[t + 1]: a text that begins as
    a pretrained model's tokenizer begins it, with its own BOS or none).

    Training: a prefix LM (`config.prefix_lm`) reads the positions marked by `prefix`
    [b, len] (its source part) both ways. Decoding, each row writes its keys and values and
    counts its positions from its own write position in the cache (`kv_cache`); filling a
    batch of right-padded prompts, `cache_mask` [b, 1, 1, cache_len] hides the padding slots
    from a prefix LM's prompt (`prefix_fill`, read both ways), and `beams` > 1 says that each
    prompt's consecutive rows are one beam search's hypotheses (attention.MultiHeadAttention).
    """
    c = self.config
    if decode:
      inputs, mask = tokens, cache_mask
    else:
      inputs = shift_right(tokens, c.bos_id, segmentation) if shift else tokens
      mask = structured_self_mask(tokens, segmentation, causal=True,
                                  prefix=prefix if c.prefix_lm else None)
    y = self.positions(self.embedding(inputs), positions, decode=decode)
    y = self.dropout(self.embedding_norm(y), deterministic=deterministic)
    return self.decoder(y, None, mask, None, deterministic=deterministic, decode=decode,
                        positions=positions, prefix_fill=prefix_fill and c.prefix_lm,
                        beams=beams)

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
    mask = structured_self_mask(inputs, inputs_segmentation, causal=False)
    x = TokenEmbedding(c, name="embedding")(inputs)
    if c.num_token_types:
      # Every input is one segment, type 0; the other rows are kept for export.
      types = self.param("token_types", nn.with_logical_partitioning(
          nn.initializers.normal(stddev=0.02), (None, "embed")), (c.num_token_types, c.emb_dim))
      x = x + types[0].astype(x.dtype)
    x = _positions(c, "positions")(x, inputs_position)
    x = _embedding_norm(c, "embedding_norm")(x)
    x = layers.Dropout(c.dropout_rate)(x, deterministic=deterministic)
    x = blocks.EncoderStack(c, name="encoder")(x, mask, deterministic=deterministic,
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
