"""Building blocks: positional encodings, position embeddings and the feed-forward network."""

from __future__ import annotations

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


class PositionEmbedding(nn.Module):
  """Adds sinusoidal or learned position embeddings to token embeddings.

  Positions are explicit for packed examples (`positions`), 0..len-1 otherwise. In decode mode
  a cache counter gives the absolute position of the tokens fed in this call.
  """
  max_len: int
  kind: str = "sinusoidal"  # or "learned"
  base: float = 10000.0

  @nn.compact
  def __call__(self, x: Array, positions: Array | None = None, *, decode: bool = False) -> Array:
    length, dim = x.shape[1], x.shape[2]
    if self.kind == "sinusoidal":
      table = jnp.asarray(sinusoidal_positions(self.max_len, dim, self.base))
    elif self.kind == "learned":
      table = self.param("pos_embedding", nn.initializers.normal(stddev=0.02), (self.max_len, dim))
    else:
      raise ValueError(f"Unknown position embedding kind {self.kind!r}: use 'sinusoidal' or "
                       "'learned'.")
    if decode:
      initialized = self.has_variable("cache", "position_index")
      index = self.variable("cache", "position_index", lambda: jnp.array(0, jnp.int32))
      if initialized:
        positions = (index.value + jnp.arange(length))[None, :]
        index.value = index.value + length
    if positions is None:
      positions = jnp.arange(length)[None, :]
    return x + jnp.take(table, positions, axis=0).astype(x.dtype)  # [b, len, dim]


class FeedForward(nn.Module):
  """Position-wise feed-forward network: max(0, x W1 + b1) W2 + b2."""
  mlp_dim: int
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  kernel_init: Any = nn.initializers.xavier_uniform()

  @nn.compact
  def __call__(self, x: Array, *, deterministic: bool = True) -> Array:
    hidden = nn.Dense(self.mlp_dim, dtype=self.dtype, kernel_init=self.kernel_init,
                      name="wi")(x)  # [b, len, mlp]
    hidden = nn.relu(hidden)
    hidden = nn.Dropout(self.dropout_rate)(hidden, deterministic=deterministic)
    return nn.Dense(x.shape[-1], dtype=self.dtype, kernel_init=self.kernel_init,
                    name="wo")(hidden)  # [b, len, emb]
