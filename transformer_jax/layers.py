"""Building blocks: positional encodings, position embeddings and the feed-forward network."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

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


@jax.custom_vjp
def tied_logits(y: Array, table: Array) -> Array:
  """Output logits from the embedding table, y @ table.T: [..., d], [vocab, d] -> [..., vocab].

  The custom VJP only changes how the table's gradient is computed: as (y^T g)^T, a
  [d, vocab] product transposed, rather than g^T y. For the latter XLA:CPU first copies the
  [tokens, vocab] gradient g into transposed layout, the largest array of the step.
  """
  return jnp.einsum("...d,vd->...v", y, table)


def _tied_logits_fwd(y: Array, table: Array):
  return tied_logits(y, table), (y, table)


def _tied_logits_bwd(residuals, g: Array):
  y, table = residuals
  d_y = jnp.einsum("...v,vd->...d", g, table)
  d_table = jnp.einsum("...d,...v->dv", y, g).T
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


class PositionEmbedding(nn.Module):
  """Adds sinusoidal or learned position embeddings to token embeddings.

  Positions are explicit for packed examples (`positions`), 0..len-1 otherwise. In decode mode
  a cache counter gives the absolute position of the tokens fed in this call.
  """
  max_len: int
  kind: str = "sinusoidal"  # or "learned"
  base: float = 10000.0

  @nn.compact
  def __call__(self, x: Array, positions: Array | None = None, *, decode: bool = False,
               decode_offset: Array | None = None) -> Array:
    """`decode_offset` [b]: in decode mode, row i's tokens sit offset[i] positions before
    their cache slots (a decoder-only model's right-padded prompts were filled in first)."""
    length, dim = x.shape[1], x.shape[2]
    if self.kind == "sinusoidal":
      table = jnp.asarray(sinusoidal_positions(self.max_len, dim, self.base))
    elif self.kind == "learned":
      table = self.param("pos_embedding", nn.with_logical_partitioning(
          nn.initializers.normal(stddev=0.02), (None, "embed")), (self.max_len, dim))
    else:
      raise ValueError(f"Unknown position embedding kind {self.kind!r}: use 'sinusoidal' or "
                       "'learned'.")
    if length > self.max_len and not (decode and self.has_variable("cache", "position_index")):
      # A gather past the table's end would give NaN, not an error.
      raise ValueError(f"A sequence of {length} tokens is longer than the model's position "
                       f"range config.model.max_len={self.max_len}; raise max_len or shorten "
                       "max_source_length / max_target_length / max_decode_len.")
    if decode:
      initialized = self.has_variable("cache", "position_index")
      index = self.variable("cache", "position_index", lambda: jnp.array(0, jnp.int32))
      if initialized:
        positions = (index.value + jnp.arange(length))[None, :]
        if decode_offset is not None:
          positions = positions - decode_offset[:, None]
        index.value = index.value + length
    if positions is None:
      positions = jnp.arange(length)[None, :]
    return x + jnp.take(table, positions, axis=0).astype(x.dtype)  # [b, len, dim]


_GELU = lambda x: nn.gelu(x, approximate=False)  # exact, as torch's "gelu"
# activation name -> (function, gated)
_ACTIVATIONS = {"relu": (nn.relu, False), "gelu": (_GELU, False),
                "reglu": (nn.relu, True), "geglu": (_GELU, True)}


class FeedForward(nn.Module):
  """Position-wise feed-forward network: act(x W1 + b1) W2 + b2.

  `activation` is 'relu' (the paper), 'gelu', or a gated linear unit (Shazeer, 2020):
  'geglu' = gelu(x W_gate) * (x W1), 'reglu' = relu(x W_gate) * (x W1).
  """
  mlp_dim: int
  dropout_rate: float = 0.0  # on the hidden activations
  activation: str = "relu"
  dtype: Any = jnp.float32
  kernel_init: Any = nn.initializers.xavier_uniform()

  @nn.compact
  def __call__(self, x: Array, *, deterministic: bool = True) -> Array:
    # Logical axis names of the parameters, mapped to mesh axes by the jit layout's rules.
    dense = lambda features, axes, name: nn.Dense(
        features, dtype=self.dtype, name=name,
        kernel_init=nn.with_logical_partitioning(self.kernel_init, axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), axes[1:]))
    if self.activation not in _ACTIVATIONS:
      raise ValueError(f"Unknown feed-forward activation {self.activation!r}: use 'relu', "
                       "'gelu', 'geglu' or 'reglu'.")
    act, gated = _ACTIVATIONS[self.activation]
    hidden = dense(self.mlp_dim, ("embed", "mlp"), "wi")(x)  # [b, len, mlp]
    if gated:
      hidden = act(dense(self.mlp_dim, ("embed", "mlp"), "wi_gate")(x)) * hidden
    else:
      hidden = act(hidden)
    hidden = nn.with_logical_constraint(hidden, ("batch", "length", "mlp"))  # jit layout only
    hidden = Dropout(self.dropout_rate)(hidden, deterministic=deterministic)
    return dense(x.shape[-1], ("mlp", "embed"), "wo")(hidden)  # [b, len, emb]
