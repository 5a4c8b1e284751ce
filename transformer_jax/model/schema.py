"""The model's hyper-parameters: `TransformerConfig`, its named sizes and its conversions
from and to `config.model`. Read by everything that sizes, validates or imports a model
(default_config, config_validation, flops, pretrained/) without loading the Flax modules."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyper-parameters; names follow flax `examples/wmt` where they overlap.

  The one source of model defaults: `config.model` in default_config.py holds these fields
  with these values (the paper's base model; experiment configs set their own sizes).
  """
  # ---- Sizes ----------------------------------------------------------------------------
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
  # The attention's width: num_heads heads of qkv_dim / num_heads dimensions each, projected
  # back to emb_dim, so the head size need not be emb_dim / num_heads (Gemma: 256 x 8 > 2048).
  qkv_dim: int = 512
  mlp_dim: int = 2048
  max_len: int = 256

  # ---- Layer structure: norms, feed-forward, attention ------------------------------------
  pre_ln: bool = False  # False: post-LN as in the paper; True: pre-LN
  final_norm: bool | None = None  # a norm after each stack; None = pre_ln
  layer_norm_epsilon: float = 1e-6
  norm: str = "layernorm"  # or 'rmsnorm' (no bias, no centring: T5)
  # RMSNorm scales by (1 + scale), its scale starting at 0 (Gemma): the same function, another
  # parameterisation (weight decay pulls it towards the identity, not towards zero).
  norm_plus_one: bool = False
  # Pre-LN blocks also normalise each sub-layer's output before the residual add, with norms of
  # their own (Gemma 2 / 3: x + norm(attention(norm(x))), likewise the feed-forward network).
  post_sublayer_norm: bool = False
  # 'relu', 'gelu', 'gelu_tanh', 'silu', gated: 'geglu', 'geglu_tanh', 'reglu', 'swiglu'
  ffn_activation: str = "relu"
  use_bias: bool = True  # biases in the attention and feed-forward projections (T5: none)
  # Biases of the attention's query/key/value and output projections apart (None: use_bias):
  # Qwen2 has them on q/k/v only, Llama's `attention_bias` on all four.
  qkv_bias: bool | None = None
  out_bias: bool | None = None
  scale_attention_scores: bool = True  # scores / sqrt(head_dim) (T5 folds it into weights)
  # Scores x query_pre_attn_scalar^-0.5 instead of head_dim^-0.5 (Gemma 2 / 3); 0: head_dim.
  query_pre_attn_scalar: float = 0.0
  # Queries and keys RMS-normalised per head over the head dimension, before RoPE (Qwen3,
  # Gemma 3; the norm's epsilon and norm_plus_one are the model's); keys are cached normalised.
  qk_norm: bool = False
  # Attention scores soft-capped before the mask, cap * tanh(scores / cap) (Gemma 2); 0: off.
  # Not in jax.nn's fused kernels: with a cap, attention runs the reference einsums.
  attention_softcap: float = 0.0
  # Sliding-window attention (Mistral; Gemma 2 / 3 on alternate layers): causal self-attention
  # of a decoder stack's windowed layers sees the last `sliding_window` positions, its own
  # included, in training and in the KV cache alike (0: every layer sees every position).
  # `sliding_window_pattern` says which layers: letter i % len of 'L' (local: windowed) or 'G'
  # (global), e.g. 'L' every layer, 'LG' Gemma 2, 'LLLLLG' Gemma 3, or one letter per layer.
  sliding_window: int = 0
  sliding_window_pattern: str = "L"
  cross_attention_score: str = "dot_product"  # or 'multiplicative', 'additive'

  # ---- Positions --------------------------------------------------------------------------
  # 'sinusoidal' (interleaved), 'sinusoidal_halves' ([sin | cos]: Marian), 'learned',
  # 'relative' (T5: a learned bias per relative-position bucket, added to attention scores),
  # or 'rope' (rotary embeddings, Su et al., 2021: self-attention queries and keys rotated by
  # their positions, nothing added to the embeddings; the half-split GPT-NeoX / LLaMA layout
  # over the whole head dimension, which must be even; see layers.rotary_embedding)
  position_embedding: str = "sinusoidal"
  position_base: float = 10000.0  # the sinusoids' base n, or RoPE's base (theta)
  # RoPE frequency scaling for contexts past the trained one (layers.rope_frequencies): 'none',
  # 'linear' (positions / factor) or 'llama3' (low frequencies / factor, high kept, a smooth
  # ramp between, by rope_low_freq_factor / rope_high_freq_factor over rope_original_max_len).
  rope_scaling: str = "none"
  rope_scaling_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_len: int = 8192
  # RoPE base of the sliding-window layers, unscaled (Gemma 3's rope_local_base_freq; the
  # global layers keep position_base and rope_scaling); 0: as every other layer.
  local_position_base: float = 0.0
  relative_attention_num_buckets: int = 32  # 'relative': buckets per direction pair
  relative_attention_max_distance: int = 128  # 'relative': distances beyond share a bucket
  relative_bias_per_layer: bool = False  # 'relative': a bias per layer (UMT5), not per stack

  # ---- Embeddings and the output layer ----------------------------------------------------
  scale_embeddings: bool = True  # token embeddings x sqrt(emb_dim) (the paper; not T5/BART)
  # That factor rounded to `dtype` first, as Gemma computes it (bfloat16: 55.5 for 3072, not
  # 55.43); the same in float32.
  embedding_scale_in_dtype: bool = False
  embedding_norm: bool = False  # a norm after token + position embeddings (BART)
  share_embeddings: bool = True  # one embedding for source and target tokens
  tie_output: bool = True  # output layer = transposed target embedding
  output_rescale: bool = False  # decoder states x emb_dim^-0.5 before the output (T5 v1.0)
  logits_bias: bool = False  # a bias on the tied output's logits (BART / Marian)
  # The output never predicts id 0 (padding): for checkpoints without a pad token of their
  # own (GPT-2), whose pad row is added on import and must not compete in the softmax.
  mask_padding_logit: bool = False
  # Output logits soft-capped, cap * tanh(logits / cap) (Gemma 2's final_logit_softcapping);
  # 0: off.
  logits_softcap: float = 0.0
  bos_id: int = 2  # first decoder input (the tokenizer reserves it; imports: decoder start)
  # Encoder-decoder training: each target's first decoder input is its own last token instead
  # of bos_id (mBART-cc25, whose `X </s> [code]` targets start from their language code, as
  # mBART's shift_tokens_right wraps it round): rows of several target languages in one batch.
  start_from_last_target: bool = False

  # ---- Regularisation ---------------------------------------------------------------------
  dropout_rate: float = 0.1  # residual: embeddings and every sub-layer output
  attention_dropout_rate: float = 0.0  # on the attention weights
  activation_dropout_rate: float | None = None  # inside the FFN; None = dropout_rate

  # ---- Computation: precision, kernels, memory --------------------------------------------
  dtype: Any = jnp.float32  # activation dtype; parameters stay float32
  # The output matmul reads its operands in `dtype` and accumulates in float32; the logits are
  # float32 either way. True: float32 operands too (on a GPU that is a TF32 product, slower than
  # bfloat16's: benchmarks/RESULTS.md, GPU section); a float32 model is the same either way.
  logits_dot_in_float32: bool = False
  # 'auto': cuDNN flash attention where it applies (a GPU), else 'reference'; or 'xla', 'cudnn'
  attention_implementation: str = "auto"
  # The decoding KV cache's keys and values: '' = the activations' dtype, 'float32',
  # 'bfloat16', or 'int8' (per token and head, scaled by its largest magnitude: kv_cache.py);
  # the decoding config's kv_cache_dtype sets it for decoding.
  kv_cache_dtype: str = ""
  # The token embedding held in int8, one float32 scale per row (model/quantization.py); set
  # for inference by config.quantization.embeddings.
  int8_embeddings: bool = False
  remat: bool = False  # recompute each layer's activations in the backward pass
  remat_policy: str = "full"  # with remat: what is kept (see remat.REMAT_POLICIES)

  # ---- Family-specific --------------------------------------------------------------------
  num_classes: int = 2  # classifier outputs
  # classifier: 'mean' (non-padding), 'first', 'attention', or a dense + tanh over the first
  # token: 'cls_pooler' (BERT's pooler) or 'cls_head' (RoBERTa's head: dropout before it too)
  pooling: str = "mean"
  num_token_types: int = 0  # classifier: learned token-type rows (BERT); inputs are type 0
  # Decoder-only: a prefix LM (Raffel et al., 2020, Fig. 3): the source part `SOURCE <eos>`
  # (loss weight 0) is read both ways, the target causally; prompts are filled the same way.
  prefix_lm: bool = False

  # ---- Adapters -------------------------------------------------------------------------
  # Low-rank adapters on the chosen projections (lora.py; set from `config.lora`, not from
  # `config.model`); None: none.
  lora: "LoraSpec | None" = None

  def replace(self, **changes) -> "TransformerConfig":
    return dataclasses.replace(self, **changes)


# The projections LoRA can adapt, in this project's terms (lora.py maps them to modules).
LORA_TARGETS = ("query", "key", "value", "attention_out", "ffn_in", "ffn_out")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """Low-rank adapters (Hu et al., 2021): each targeted projection W gets x -> x W +
  scale * dropout(x) A B, A [in, rank], B [rank, out] (B starts at 0)."""
  rank: int
  alpha: float
  dropout: float = 0.0
  rslora: bool = False  # scale alpha / sqrt(rank) (Kalajdzievski, 2023) instead of alpha / rank
  targets: tuple[str, ...] = ("query", "value")
  # Each row of a batch brings its own adapters, `a` and `b` with a leading [rows] axis
  # (a server's adapters gathered by row, lora.for_rows), applied unmerged.
  per_row: bool = False

  @property
  def scale(self) -> float:
    return self.alpha / (self.rank ** 0.5 if self.rslora else self.rank)


# Named sizes. base and big are the paper's (Table 3); vocab_size is set per dataset.
SIZES = {
    "tiny": dict(emb_dim=64, num_heads=2, num_layers=2, qkv_dim=64, mlp_dim=256),
    "small": dict(emb_dim=256, num_heads=4, num_layers=3, qkv_dim=256, mlp_dim=1024),
    "base": dict(emb_dim=512, num_heads=8, num_layers=6, qkv_dim=512, mlp_dim=2048,
                 dropout_rate=0.1),
    "big": dict(emb_dim=1024, num_heads=16, num_layers=6, qkv_dim=1024, mlp_dim=4096,
                dropout_rate=0.3),
}


def named_config(size: str, **overrides) -> TransformerConfig:
  """TransformerConfig of a named size ('tiny', 'small', 'base', 'big') plus overrides."""
  if size not in SIZES:
    raise ValueError(f"Unknown model size {size!r}; known: {sorted(SIZES)}.")
  return TransformerConfig(**{**SIZES[size], **overrides})


def model_config(model_dict, **overrides) -> TransformerConfig:
  """TransformerConfig from `config.model` (dtype given by name, e.g. 'bfloat16'); `overrides`
  may add what config.model does not hold (`lora`)."""
  fields = dict(model_dict)
  fields.update(overrides)
  if isinstance(fields.get("dtype"), str):
    fields["dtype"] = jnp.dtype(fields["dtype"])
  known = {f.name for f in dataclasses.fields(TransformerConfig)}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise ValueError(f"Unknown config.model keys {unknown}; known: {sorted(known)}.")
  return TransformerConfig(**fields)


def as_dict(config: TransformerConfig) -> dict:
  """`config` as `config.model` holds it: every field, the dtype by name."""
  fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if f.name != "lora"}  # config.lora holds the adapters' settings
  fields["dtype"] = jnp.dtype(fields["dtype"]).name
  return fields


def config_defaults() -> dict:
  """Every TransformerConfig field and its default, the dtype by name: `config.model`."""
  return as_dict(TransformerConfig())
