import math

import numpy as np
import pytest

from transformer_jax import layers


def _reference(length, dim, base):
  table = np.zeros((length, dim))
  for pos in range(length):
    for j in range(dim):
      angle = pos / base ** (2 * (j // 2) / dim)
      table[pos, j] = math.sin(angle) if j % 2 == 0 else math.cos(angle)
  return table


@pytest.mark.parametrize("dim", [1, 7, 8, 16])
@pytest.mark.parametrize("base", [10000.0, 100.0])
def test_sinusoidal_positions_match_reference(dim, base):
  table = layers.sinusoidal_positions(50, dim, base)
  assert table.shape == (50, dim)
  np.testing.assert_allclose(table, _reference(50, dim, base), atol=1e-6)


def test_sinusoidal_positions_known_values():
  table = layers.sinusoidal_positions(2, 4)
  # pos 0: sin 0, cos 0, ...; pos 1: sin(1), cos(1), sin(1/100), cos(1/100).
  np.testing.assert_allclose(table[0], [0, 1, 0, 1], atol=1e-7)
  np.testing.assert_allclose(table[1], [math.sin(1), math.cos(1), math.sin(0.01),
                                        math.cos(0.01)], atol=1e-7)
