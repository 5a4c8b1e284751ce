"""Prompts packed side by side for the prefill, as packed training examples are.

A batch of prompts is padded to the length bucket of its longest, so the encoder (or a
decoder-only model's prompt fill) of 32 sentences of 6 to 41 tokens reads 32 x 64 positions
for about 560 real ones (benchmarks/RESULTS.md, issue #42). Packed, several short prompts
share a row, each in a segment of its own (attention stays within it, positions restart at
0), and the prefill reads a third of the rows.

The host plans where each prompt goes (`place`): first fit, longest first, into rows as wide
as the length bucket, within each part of the batch that one program decodes (a device's
rows under pmap, all rows under jit). Parts of at least MIN_ROWS rows are packed, into a
quarter, half or three quarters of their rows, so that a (length, rows) bucket compiles at
most three more programs, not one per call. In the compiled decode, `pack` moves the prompts
into their rows and `unpack` brings each prompt's results (encoder outputs, cached keys and
values) back to its own row.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

# Fewer rows are cheap to fill as they are; packing them would cost programs, not time.
MIN_ROWS = 8


def place(lengths: Sequence[int], parts: int, width: int) -> tuple[np.ndarray | None, int]:
  """(places [rows, 2]: each row's packed row within its part and its first slot there,
  packed rows per part) for prompts of `lengths` tokens; (None, 0) where packing would not
  save a row. `parts` divides the rows; no prompt is longer than `width`."""
  rows = len(lengths)
  per_part = rows // parts
  if per_part < MIN_ROWS:
    return None, 0
  places = np.zeros((rows, 2), np.int32)
  needed = 1
  for part in range(parts):
    used: list[int] = []  # tokens in each packed row so far
    chunk = range(part * per_part, (part + 1) * per_part)
    for row in sorted(chunk, key=lambda r: -lengths[r]):
      packed_row = next((i for i, n in enumerate(used) if n + lengths[row] <= width), len(used))
      if packed_row == len(used):
        used.append(0)
      places[row] = (packed_row, used[packed_row])
      used[packed_row] += lengths[row]
    needed = max(needed, len(used))
  step = per_part // 4
  packed_rows = -(-needed // step) * step
  return (None, 0) if packed_rows >= per_part else (places, packed_rows)


def side_by_side(lengths: Sequence[int], parts: int, width: int) -> np.ndarray | None:
  """`place`'s places for one packed row per part: each part's prompts one after the other
  (None where some part's do not fit in `width` tokens)."""
  per_part = len(lengths) // parts
  places = np.zeros((len(lengths), 2), np.int32)
  for part in range(parts):
    chunk = np.asarray(lengths[part * per_part:(part + 1) * per_part])
    if chunk.sum() > width:
      return None
    places[part * per_part:(part + 1) * per_part, 1] = np.cumsum(chunk) - chunk
  return places


def pack(tokens: Array, places: Array, packed_rows: int) -> tuple[Array, Array, Array]:
  """Right-padded prompts [b, len] -> (tokens, segment ids, positions), each
  [packed_rows, len]: row i's tokens at `places[i]`, in segment i + 1, at positions 0, 1, ...
  (padding: segment 0)."""
  batch, length = tokens.shape
  slot = jnp.arange(length)[None, :]
  real = tokens != 0
  rows = jnp.where(real, places[:, :1], packed_rows)  # padding goes past the end: dropped
  columns = places[:, 1:] + slot

  def scatter(values):
    return jnp.zeros((packed_rows, length), values.dtype).at[rows, columns].set(
        jnp.broadcast_to(values, (batch, length)), mode="drop")

  return (scatter(tokens), scatter(jnp.arange(1, batch + 1, dtype=jnp.int32)[:, None]),
          scatter(slot.astype(jnp.int32)))


def unpack(packed: Array, places: Array, real: Array) -> Array:
  """[packed_rows, ..., len] values per packed slot -> [b, ..., len]: each prompt's from its
  place, zero where `real` [b, len] is False."""
  length = real.shape[1]
  slots = jnp.minimum(places[:, 1:] + jnp.arange(length)[None, :], packed.shape[-1] - 1)
  values = packed[places[:, 0]]  # [b, ..., len]
  middle = (1,) * (values.ndim - 2)
  slots = jnp.broadcast_to(slots.reshape(slots.shape[0], *middle, length), values.shape)
  values = jnp.take_along_axis(values, slots, axis=-1)
  return jnp.where(real.reshape(real.shape[0], *middle, length), values, 0)
