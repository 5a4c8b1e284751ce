"""Analytic model FLOPs and device peaks, for model FLOPs utilisation (MFU)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from transformer_jax.model import layers
from transformer_jax.model import schema as model_schema

# Dense peak TFLOP/s per chip from the vendors' data sheets: (bfloat16, float32).
# GPU float32 is the TF32 tensor-core rate, which XLA uses for float32 matmuls by default.
PEAK_TFLOPS = {
    "TPU v4": (275.0, 275.0),
    "TPU v5 lite": (197.0, 197.0),  # v5e
    "TPU v5p": (459.0, 459.0),
    "TPU v5": (459.0, 459.0),
    "TPU v6 lite": (918.0, 918.0),  # v6e
    "H100": (989.0, 494.5),
    "H200": (989.0, 494.5),
    "A100": (312.0, 156.0),
}


def _per_token(config: model_schema.TransformerConfig) -> tuple[int, int, int]:
  """(key/value width, FLOPs per token of the Q/K/V/output projections, of the feed-forward
  network): K and V with grouped-query attention's fewer heads, three FFN matrices when
  gated."""
  e, q, f = config.emb_dim, config.qkv_dim, config.mlp_dim
  kv = q * (config.num_kv_heads or config.num_heads) // config.num_heads  # K (V) width
  gated = layers.ACTIVATIONS.get(config.ffn_activation, (None, False))[1]
  return kv, 2 * 2 * e * q + 2 * 2 * e * kv, 2 * (3 if gated else 2) * e * f


def _self_attention_layer(config: model_schema.TransformerConfig, length: int) -> int:
  """FLOPs of a layer of self-attention and feed-forward network over `length` tokens."""
  _, projections, ffn = _per_token(config)
  return length * (projections + 2 * 2 * length * config.qkv_dim + ffn)  # + scores, values


def forward_flops(config: model_schema.TransformerConfig, batch_size: int, source_len: int,
                  target_len: int) -> int:
  """Matmul FLOPs (2 per multiply-add) of one EncoderDecoder forward pass.

  Counts the Q/K/V/output projections (K and V with grouped-query attention's fewer heads),
  attention scores and weighted sums (over the full, padded lengths: that is what runs; per
  query head, grouped or not), the feed-forward network (three matrices when gated) and the
  output logits. Embedding lookups are gathers, not matmuls; rotary embeddings, layer norms,
  softmax and other elementwise work are left out, as is customary.
  """
  e, q, v = config.emb_dim, config.qkv_dim, config.vocab_size
  s, t = source_len, target_len
  kv = _per_token(config)[0]
  decoder_layer = (_self_attention_layer(config, t)
                   + t * 2 * 2 * e * q + s * 2 * 2 * e * kv  # cross: query+out, key+value
                   + t * 2 * 2 * s * q)  # cross scores + values
  logits = t * 2 * e * v
  decoder_layers = config.num_decoder_layers or config.num_layers
  per_example = (config.num_layers * _self_attention_layer(config, s)
                 + decoder_layers * decoder_layer + logits)
  return batch_size * per_example


def decoder_only_forward_flops(config: model_schema.TransformerConfig, batch_size: int, length: int,
                               scored_len: int) -> int:
  """Matmul FLOPs of one DecoderOnly forward pass over rows of `length` tokens whose output
  layer runs at `scored_len` positions each (training: the target part); counted as
  `forward_flops` counts a decoder layer without cross-attention."""
  return batch_size * (config.num_layers * _self_attention_layer(config, length)
                       + scored_len * 2 * config.emb_dim * config.vocab_size)


def train_step_flops(config: model_schema.TransformerConfig, batch_size: int, source_len: int,
                     target_len: int) -> int:
  """Forward + backward: the backward pass costs twice the forward (two matmuls per one)."""
  return 3 * forward_flops(config, batch_size, source_len, target_len)


def measured_matmul_tflops(size: int = 2048, repeats: int = 5) -> float:
  """Float32 matmul throughput of the default device, as a peak for CPUs (no data sheet)."""
  a = jnp.ones((size, size), jnp.float32)
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()
  start = time.perf_counter()
  for _ in range(repeats):
    out = matmul(a)
  out.block_until_ready()
  return 2 * size ** 3 * repeats / (time.perf_counter() - start) / 1e12


def peak_tflops(dtype, device: jax.Device | None = None) -> tuple[float, str]:
  """(peak TFLOP/s of one device for `dtype`, where the number comes from)."""
  device = device or jax.devices()[0]
  for name, (bf16, fp32) in PEAK_TFLOPS.items():
    if name.lower() in device.device_kind.lower():
      return (bf16 if jnp.dtype(dtype) == jnp.bfloat16 else fp32), f"data sheet ({name})"
  return measured_matmul_tflops(), "measured float32 matmul"
