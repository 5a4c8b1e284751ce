import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.model import layers


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


def test_tied_logits_read_bfloat16_operands_and_return_float32():
  """A bfloat16 model's output layer: bfloat16 products (the table rounded to bfloat16),
  summed and returned in float32; the gradients come back in the operands' own dtypes."""
  import jax
  import jax.numpy as jnp
  y = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 8)).astype(jnp.bfloat16)
  table = jax.random.normal(jax.random.PRNGKey(1), (13, 8))
  logits = layers.tied_logits(y, table)
  assert logits.dtype == jnp.float32
  rounded = table.astype(jnp.bfloat16).astype(jnp.float32)
  # Products of bfloat16 values are exact in float32: only the summation order differs.
  np.testing.assert_allclose(logits, jnp.einsum("bld,vd->blv", y.astype(jnp.float32), rounded),
                             rtol=1e-6, atol=1e-6)
  d_y, d_table = jax.vjp(layers.tied_logits, y, table)[1](jnp.ones_like(logits))
  assert (d_y.dtype, d_table.dtype) == (jnp.bfloat16, jnp.float32)
  np.testing.assert_allclose(d_table, jnp.broadcast_to(y.astype(jnp.float32).sum((0, 1)),
                                                       (13, 8)), rtol=1e-6)


def test_tied_logits_and_its_gradients_match_autodiff():
  import jax
  import jax.numpy as jnp
  y = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 8))
  table = jax.random.normal(jax.random.PRNGKey(1), (13, 8))
  cotangent = jax.random.normal(jax.random.PRNGKey(2), (2, 3, 13))
  plain = lambda y, table: jnp.einsum("bld,vd->blv", y, table)
  np.testing.assert_allclose(layers.tied_logits(y, table), plain(y, table), rtol=1e-6)
  ours = jax.vjp(layers.tied_logits, y, table)[1](cotangent)
  theirs = jax.vjp(plain, y, table)[1](cotangent)
  for a, b in zip(ours, theirs):
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_one_part_projection_is_not_copied_on_each_call_of_a_pmapped_loop():
  """The 'query' kernel [embed, 1, heads, head_dim] read in a decode loop under pmap: with
  `one_part_dot` XLA reads it in place (its plain dot_general copied it on every call, one
  copy per layer), and the product is the plain one's."""
  def loop(dot):
    dense = nn.DenseGeneral((1, 4, 8), dot_general=dot)

    def run(params, x):
      step = lambda _, h: h + dense.apply(params, h)[:, 0].reshape(h.shape)
      return jax.lax.fori_loop(0, jnp.int32(3) + x[0, 0].astype(jnp.int32) * 0, step, x)
    return jax.pmap(run)

  x = jax.random.normal(jax.random.PRNGKey(0), (1, 2, 32))
  params = jax.tree.map(lambda p: p[None], nn.DenseGeneral((1, 4, 8)).init(
      jax.random.PRNGKey(1), x[0]))
  copied = lambda dot: re.findall(r"f32\[32,1,4,8\]\{[\d,]+\} copy", loop(dot).lower(
      params, x).compile().as_text())
  assert copied(layers.one_part_dot) == []
  np.testing.assert_allclose(loop(layers.one_part_dot)(params, x), loop(None)(params, x),
                             rtol=1e-6)
