"""Building blocks: positional encodings, position embeddings, relative position bias, norms
and the feed-forward network."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model import kv_cache
from transformer_jax.model import lora as lora_lib
from transformer_jax.model import quantization
from transformer_jax.model.schema import LoraSpec

Array = jax.Array


def sinusoidal_positions(length: int, dim: int, base: float = 10000.0) -> np.ndarray:
  """The paper's sinusoidal encoding, interleaved: even dims sine, odd dims cosine.

  PE(pos, 2i) = sin(pos / base^(2i/dim)), PE(pos, 2i+1) = cos(pos / base^(2i/dim)).
  Works for odd `dim` too (the last column is then a sine).

  Returns:
    float32 array [length, dim].
  """
  positions = np.arange(length, dtype=np.float64)[:, None]  # [length, 1]
  pair_index = np.arange((dim + 1) // 2, dtype=np.float64)[None, :]  # [1, ceil(dim/2)]
  angles = positions / np.power(base, 2.0 * pair_index / dim)  # [length, ceil(dim/2)]
  table = np.zeros((length, dim), dtype=np.float64)
  table[:, 0::2] = np.sin(angles)
  table[:, 1::2] = np.cos(angles[:, : dim // 2])
  return table.astype(np.float32)


def sinusoidal_positions_halves(length: int, dim: int, base: float = 10000.0) -> np.ndarray:
  """The same frequencies as `sinusoidal_positions`, laid out [sin ... | cos ...]: the first
  half of the dimensions are sines, the second half cosines (fairseq, Marian / OPUS-MT)."""
  table = sinusoidal_positions(length, dim, base)
  return np.concatenate([table[:, 0::2], table[:, 1::2]], axis=1)


def sinusoidal_positions_t2t(length: int, dim: int, base: float = 10000.0,
                             offset: int = 2) -> np.ndarray:
  """tensor2tensor's sinusoidal table as fairseq and M2M100 / NLLB-200 use it: [sin | cos]
  halves whose frequencies are base^(-i / (dim/2 - 1)) (not the paper's base^(-2i / dim)), a
  zero last column for odd `dim`, row p holding position p + `offset` (fairseq numbers
  positions from padding_idx + 1 = 2). Computed in float32, as PyTorch computes it.

  Returns:
    float32 array [length, dim].
  """
  half = dim // 2
  step = np.float32(math.log(base) / max(half - 1, 1))
  frequencies = np.exp(np.arange(half, dtype=np.float32) * -step)  # [half]
  angles = (np.arange(offset, length + offset, dtype=np.float32)[:, None]
            * frequencies[None, :])  # [length, half]
  table = np.concatenate([np.sin(angles), np.cos(angles)], axis=1)
  if dim % 2:
    table = np.concatenate([table, np.zeros((length, 1), np.float32)], axis=1)
  return table.astype(np.float32)


def non_pad_positions(tokens: jax.Array) -> jax.Array:
  """[b, len] positions counted over non-pad tokens only (fairseq's `make_positions`): the
  k-th non-pad token of a row is at position k - 1 whatever padding comes before it; pads
  at 0 (their embedding is never attended to)."""
  not_pad = (tokens != 0).astype(jnp.int32)
  return jnp.maximum(jnp.cumsum(not_pad, axis=1) - 1, 0) * not_pad


def rope_frequencies(dim: int, base: float = 10000.0, scaling: tuple = ("none",)) -> np.ndarray:
  """RoPE's inverse frequencies [dim / 2] in float32: base^(-2i/dim), as Hugging Face computes
  them (in float32), then scaled. `scaling`: ('none',), ('linear', factor): every frequency
  / factor (positions stretched), or ('llama3', factor, low_freq_factor, high_freq_factor,
  original_max_len): wavelengths longer than original_max_len / low_freq_factor divided by
  factor, shorter than original_max_len / high_freq_factor kept, a linear blend between."""
  inverse = (1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32)
                                         / np.float32(dim)))).astype(np.float32)
  kind = scaling[0]
  if kind == "none":
    return inverse
  factor = np.float32(scaling[1])
  if kind == "linear":
    return (inverse / factor).astype(np.float32)
  if kind != "llama3":
    raise ValueError(f"Unknown rope scaling {kind!r}: use 'none', 'linear' or 'llama3'.")
  low, high, original = (np.float32(v) for v in scaling[2:])
  wavelength = np.float32(2 * np.pi) / inverse
  scaled = np.where(wavelength > original / low, inverse / factor, inverse)
  smooth = (original / wavelength - low) / (high - low)
  blended = (1 - smooth) * scaled / factor + smooth * scaled
  middle = ~(wavelength < original / high) & ~(wavelength > original / low)
  return np.where(middle, blended, scaled).astype(np.float32)


def rotary_embedding(x: Array, positions: Array, base: float = 10000.0,
                     scaling: tuple = ("none",)) -> Array:
  """Rotary position embedding (RoPE; Su et al., 2021) of queries or keys.

  Each head's dimension pair (i, i + d/2) is rotated by the angle position * base^(-2i/d),
  so that a rotated query and key meet (q . k) through their positions' difference only. The
  pairs are the half-split layout of GPT-NeoX and Hugging Face's LLaMA (`rotate_half`), not
  the paper's adjacent pairs (2i, 2i+1): checkpoints in that layout then import without
  permuting their query/key weights. The rotation covers the full head dimension (no partial
  rotary fraction).

  Args:
    x: [b, len, h, d] queries or keys, d even.
    positions: [b|1, len] integer positions (packed rows restart them per segment).
    base: the frequencies' base (theta; 10000 in the paper and LLaMA).
    scaling: see `rope_frequencies`.

  Returns:
    [b, len, h, d] in `x.dtype`; angles and rotation are computed in float32.
  """
  dim = x.shape[-1]
  if dim % 2:
    raise ValueError(f"Rotary embeddings need an even head dimension, not {dim}.")
  half = dim // 2
  inverse_frequencies = jnp.asarray(rope_frequencies(dim, base, scaling))  # [d/2]
  angles = positions.astype(jnp.float32)[..., None] * inverse_frequencies  # [b|1, len, d/2]
  cos = jnp.cos(angles)[:, :, None, :]  # [b|1, len, 1, d/2]: the same for every head
  sin = jnp.sin(angles)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  first, second = x32[..., :half], x32[..., half:]  # [b, len, h, d/2] each
  rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
  return rotated.astype(x.dtype)  # [b, len, h, d]


def relative_position_buckets(relative_position: Array, *, bidirectional: bool,
                              num_buckets: int, max_distance: int) -> Array:
  """T5's bucket of each key position minus query position (Raffel et al., 2020).

  Half of the buckets (all of them when causal: future keys are masked) hold the exact small
  distances, the other half logarithmically wider ones up to `max_distance`, beyond which
  everything shares the last bucket; bidirectional buckets use one half per direction.
  The log is taken in float32 and truncated, as the reference implementation does, so that
  imported checkpoints see exactly their buckets.
  """
  buckets = jnp.zeros_like(relative_position)
  if bidirectional:
    num_buckets //= 2
    buckets = buckets + (relative_position > 0).astype(relative_position.dtype) * num_buckets
    distance = jnp.abs(relative_position)
  else:
    distance = -jnp.minimum(relative_position, 0)
  max_exact = num_buckets // 2
  scaled = (jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / max_exact)
            / jnp.float32(math.log(max_distance / max_exact)) * (num_buckets - max_exact))
  large = jnp.minimum(max_exact + scaled.astype(distance.dtype), num_buckets - 1)
  return buckets + jnp.where(distance < max_exact, distance, large)


class RelativePositionBias(nn.Module):
  """A learned bias per head and relative-position bucket, added to attention scores (T5).

  Returns float32 [b, heads, q, k] for query positions [b|1, q] and key positions [b|1, k].
  """
  num_heads: int
  num_buckets: int = 32
  max_distance: int = 128
  bidirectional: bool = True

  @nn.compact
  def __call__(self, query_positions: Array, key_positions: Array) -> Array:
    table = self.param("embedding", nn.with_logical_partitioning(
        nn.initializers.normal(stddev=1.0), (None, "heads")),
                       (self.num_buckets, self.num_heads))  # [buckets, h]
    relative = key_positions[:, None, :] - query_positions[:, :, None]  # [b, q, k]
    buckets = relative_position_buckets(relative, bidirectional=self.bidirectional,
                                        num_buckets=self.num_buckets,
                                        max_distance=self.max_distance)
    bias = jnp.take(table, buckets, axis=0)  # [b, q, k, h]
    return jnp.transpose(bias, (0, 3, 1, 2)).astype(jnp.float32)  # [b, h, q, k]


class RMSNorm(nn.Module):
  """Root-mean-square norm without a bias or centring (T5's LayerNorm): x / rms(x) * scale,
  the mean of squares taken in float32 whatever the activation dtype.

  `plus_one`: x / rms(x) * (1 + scale), the scale starting at 0 (Gemma), multiplied in float32
  before the cast as Gemma does. `axis_name`: the logical name of the normalised dimension
  ('kv' for a per-head norm over the head dimension).
  """
  epsilon: float = 1e-6
  dtype: Any = jnp.float32
  plus_one: bool = False
  axis_name: str = "embed"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    init = nn.initializers.zeros_init() if self.plus_one else nn.initializers.ones_init()
    scale = self.param("scale", nn.with_logical_partitioning(init, (self.axis_name,)),
                       (x.shape[-1],))
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
    return (normed * (1.0 + scale if self.plus_one else scale)).astype(self.dtype)


def dropout_keep_mask(rng: Array, rate: float, shape: tuple[int, ...]) -> tuple[Array, float]:
  """Boolean keep-mask with P(keep) = 1 - rate, exactly.

  Each random 32-bit word gives four 8-bit draws: 4x fewer random bits than
  `jax.random.bernoulli`, which makes dropout cheaper on CPU (benchmarks/RESULTS.md). A draw
  is kept when it reaches a threshold of rate * 256 rounded down or up, the rounding drawn
  once per call with the probabilities that make P(keep) exactly 1 - rate (so a rate of 0.1
  is not rounded to 26/256). Returns the mask and the keep probability, for rescaling.
  """
  scaled = rate * 256
  low = math.floor(scaled)
  threshold_rng, bits_rng = jax.random.split(rng)
  threshold = low + (jax.random.uniform(threshold_rng) < scaled - low).astype(jnp.int32)
  size = math.prod(shape)
  words = jax.random.bits(bits_rng, ((size + 3) // 4,), jnp.uint32)
  draws = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)[:size].reshape(shape)
  return draws.astype(jnp.int32) >= threshold, 1.0 - rate


def float32_sum_dot(lhs: Array, rhs: Array, dimension_numbers, precision=None,
                    preferred_element_type=None, **kwargs) -> Array:
  """`jax.lax.dot_general` of operands in their own dtype, products summed and returned in
  float32 (a bfloat16 model's output layer on the bfloat16 matrix units, float32 logits).
  XLA:CPU has no bfloat16 x bfloat16 = float32 product, so there the same rounded operands are
  multiplied in float32 (products of bfloat16 values are exact in float32: the same sums)."""
  del preferred_element_type, kwargs  # always float32
  if jax.default_backend() == "cpu":
    # A quantized kernel (model/quantization.py) is no array: it dequantizes itself.
    lhs = lhs.astype(jnp.float32)
    rhs = rhs.astype(jnp.float32) if isinstance(rhs, jax.Array) else rhs
  return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision,
                             preferred_element_type=jnp.float32)


def one_part_dot(lhs: Array, rhs: Array, dimension_numbers, precision=None,
                 **kwargs) -> Array:
  """`jax.lax.dot_general` of a one-part projection's kernel [embed, 1, heads, head_dim] (the
  'query' of grouped-query and of cross-attention) read without its size-1 axis, then put
  back: with it, XLA:CPU copied every layer's kernel on each call of a pmapped decode loop
  (that axis and pmap's per-device one took different layouts: about 10 ms a call at 135M
  parameters). A kernel qwix quantizes reaches it as it is (qwix knows its params by
  identity)."""
  contracts_embed = dimension_numbers == (((lhs.ndim - 1,), (0,)), ((), ()))
  if (not isinstance(rhs, jax.Array) or not contracts_embed or rhs.shape[1] != 1 or
      quantization.quantizes_weight_here()):
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, **kwargs)
  out = jax.lax.dot_general(lhs, jnp.squeeze(rhs, 1), dimension_numbers, precision, **kwargs)
  return jnp.expand_dims(out, lhs.ndim - 1)


def float32_sum_einsum(spec: str, a: Array, b: Array) -> Array:
  """`jnp.einsum` of two operands in their own dtype, products summed in float32 (attention's
  scores and weighted values in a bfloat16 model). As in `float32_sum_dot`, XLA:CPU multiplies
  16-bit operands in float32 (the same sums): its runtime has no bfloat16 x bfloat16 = float32
  product for the shapes it hands to its library (a 135M model's attention failed there)."""
  if jax.default_backend() == "cpu":
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _contract_last(a: Array, b: Array, b_axis: int) -> Array:
  """a [..., k] against b's axis `b_axis` (of 2) -> [..., b's other axis], float32 sums."""
  return float32_sum_dot(a, b, (((a.ndim - 1,), (b_axis,)), ((), ())))


@jax.custom_vjp
def tied_logits(y: Array, table: Array) -> Array:
  """Float32 output logits from the embedding table, y @ table.T: [..., d], [vocab, d] ->
  [..., vocab]. The products read y's dtype (the table is cast to it) and are summed in
  float32 (`float32_sum_dot`): a bfloat16 model's output layer runs on the bfloat16 matrix
  units, and its logits keep float32 precision for the softmax.

  The custom VJP computes the table's gradient as (y^T g)^T, a [d, vocab] product transposed,
  rather than g^T y: for the latter XLA:CPU first copies the [tokens, vocab] gradient g into
  transposed layout, the largest array of the step. The backward products read g in y's dtype.
  """
  return _contract_last(y, table.astype(y.dtype), 1)


def _tied_logits_fwd(y: Array, table: Array):
  return tied_logits(y, table), (y, table)


def _tied_logits_bwd(residuals, g: Array):
  y, table = residuals
  g = g.astype(y.dtype)
  d_y = _contract_last(g, table.astype(y.dtype), 0)  # [..., d]
  leading = tuple(range(y.ndim - 1))
  d_table = float32_sum_dot(y, g, ((leading, leading), ((), ()))).T  # [vocab, d]
  return d_y.astype(y.dtype), d_table.astype(table.dtype)


tied_logits.defvjp(_tied_logits_fwd, _tied_logits_bwd)


class Dropout(nn.Module):
  """Inverted dropout like `nn.Dropout`, with the cheaper mask of `dropout_keep_mask`
  (kept because it pays: see benchmarks/RESULTS.md)."""
  rate: float

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    if deterministic or self.rate == 0.0:
      return x
    keep, keep_prob = dropout_keep_mask(self.make_rng("dropout"), self.rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(keep_prob, x.dtype), jnp.zeros_like(x))


POSITION_EMBEDDINGS = ("sinusoidal", "sinusoidal_halves", "sinusoidal_t2t", "learned",
                       "relative", "rope")
# Kinds whose positions count non-pad tokens only (models.py derives them from the tokens).
NON_PAD_POSITIONS = ("sinusoidal_t2t",)


class PositionEmbedding(nn.Module):
  """Adds sinusoidal or learned position embeddings to token embeddings ('relative' and
  'rope': none; the attention layers add a relative position bias or rotate their queries
  and keys instead).

  Positions are explicit for packed examples (`positions`), 0..len-1 otherwise. In decode mode
  each row's write position in the cache (`kv_cache`) gives the positions of the tokens fed in
  this call (unless they are given: packed prompts filling a cache).
  """
  max_len: int
  kind: str = "sinusoidal"  # or "sinusoidal_halves", "sinusoidal_t2t", "learned", ...
  base: float = 10000.0

  @nn.compact
  def __call__(self, x: Array, positions: Array | None = None, *,
               decode: bool = False) -> Array:
    length, dim = x.shape[1], x.shape[2]
    if self.kind in ("relative", "rope"):
      return x
    if self.kind == "sinusoidal":
      table = jnp.asarray(sinusoidal_positions(self.max_len, dim, self.base))
    elif self.kind == "sinusoidal_halves":
      table = jnp.asarray(sinusoidal_positions_halves(self.max_len, dim, self.base))
    elif self.kind == "sinusoidal_t2t":
      table = jnp.asarray(sinusoidal_positions_t2t(self.max_len, dim, self.base))
    elif self.kind == "learned":
      table = self.param("pos_embedding", nn.with_logical_partitioning(
          nn.initializers.normal(stddev=0.02), (None, "embed")), (self.max_len, dim))
    else:
      raise ValueError(f"Unknown position embedding kind {self.kind!r}: use one of "
                       f"{POSITION_EMBEDDINGS}.")
    if length > self.max_len and not (decode and self.has_variable("cache", "position_index")):
      # A gather past the table's end would give NaN, not an error.
      raise ValueError(f"A sequence of {length} tokens is longer than the model's position "
                       f"range config.model.max_len={self.max_len}; raise max_len or shorten "
                       "max_source_length / max_target_length / max_decode_len.")
    if decode:
      initialized = self.has_variable("cache", "position_index")
      _, counted = kv_cache.decode_positions(self, x.shape[0], length)
      if initialized and positions is None:  # given: a packed prompt fill (prompt_packing.py)
        positions = counted
    if positions is None:
      positions = jnp.arange(length)[None, :]
    return x + jnp.take(table, positions, axis=0).astype(x.dtype)  # [b, len, dim]


_GELU = lambda x: nn.gelu(x, approximate=False)  # exact, as torch's "gelu"
_GELU_TANH = lambda x: nn.gelu(x, approximate=True)  # HF's "gelu_new" (T5 v1.1, GPT-2)
# activation name -> (function, gated)
ACTIVATIONS = {"relu": (nn.relu, False), "gelu": (_GELU, False),
               "gelu_tanh": (_GELU_TANH, False), "silu": (nn.silu, False),
               "reglu": (nn.relu, True), "geglu": (_GELU, True),
               "geglu_tanh": (_GELU_TANH, True), "swiglu": (nn.silu, True)}


class FeedForward(nn.Module):
  """Position-wise feed-forward network: act(x W1 + b1) W2 + b2.

  `activation` is 'relu' (the paper), 'gelu' (exact), 'gelu_tanh' (its tanh approximation),
  'silu', or a gated linear unit (Shazeer, 2020): 'geglu' = gelu(x W_gate) * (x W1), likewise
  'geglu_tanh', 'reglu' (relu) and 'swiglu' (silu). `use_bias` False: no biases (T5).
  """
  mlp_dim: int
  dropout_rate: float = 0.0  # on the hidden activations
  activation: str = "relu"
  dtype: Any = jnp.float32
  kernel_init: Any = nn.initializers.xavier_uniform()
  use_bias: bool = True
  lora: LoraSpec | None = None  # low-rank adapters on the targeted projections (lora.py)

  @nn.compact
  def __call__(self, x: Array, *, deterministic: bool = True) -> Array:
    # Logical axis names of the parameters, mapped to mesh axes by the jit layout's rules.

    def dense(features, axes, name):
      projection = nn.Dense(
          features, dtype=self.dtype, name=name, use_bias=self.use_bias,
          kernel_init=nn.with_logical_partitioning(self.kernel_init, axes),
          bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), axes[1:]))
      return lambda x: lora_lib.adapted(self, self.lora, name, x, projection(x),
                                        deterministic=deterministic, in_names=axes[:1],
                                        out_names=axes[1:])

    if self.activation not in ACTIVATIONS:
      raise ValueError(f"Unknown feed-forward activation {self.activation!r}: use one of "
                       f"{sorted(ACTIVATIONS)}.")
    act, gated = ACTIVATIONS[self.activation]
    hidden = dense(self.mlp_dim, ("embed", "mlp"), "wi")(x)  # [b, len, mlp]
    if gated:
      hidden = act(dense(self.mlp_dim, ("embed", "mlp"), "wi_gate")(x)) * hidden
    else:
      hidden = act(hidden)
    hidden = nn.with_logical_constraint(hidden, ("batch", "length", "mlp"))  # jit layout only
    hidden = Dropout(self.dropout_rate)(hidden, deterministic=deterministic)
    return dense(x.shape[-1], ("mlp", "embed"), "wo")(hidden)  # [b, len, emb]
