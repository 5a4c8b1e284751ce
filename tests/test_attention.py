import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model import attention


def test_causal_mask_literal():
  expected = np.array([[1, 0, 0, 0],
                       [1, 1, 0, 0],
                       [1, 1, 1, 0],
                       [1, 1, 1, 1]], dtype=bool)
  mask = attention.causal_mask(4)
  assert mask.dtype == jnp.bool_
  np.testing.assert_array_equal(mask, expected)


def test_padding_mask_literal():
  query = jnp.array([[5, 6, 0]])
  key = jnp.array([[7, 0]])
  expected = np.array([[[[1, 0],
                         [1, 0],
                         [0, 0]]]], dtype=bool)
  np.testing.assert_array_equal(attention.padding_mask(query, key), expected)


def test_segment_mask_literal():
  segments = jnp.array([[1, 1, 2, 0]])
  expected = np.array([[[[1, 1, 0, 0],
                         [1, 1, 0, 0],
                         [0, 0, 1, 0],
                         [0, 0, 0, 1]]]], dtype=bool)
  np.testing.assert_array_equal(attention.segment_mask(segments, segments), expected)


def _qkv(seed=0, batch=2, q_len=3, kv_len=5, heads=2, dim=4):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (jax.random.normal(keys[0], (batch, q_len, heads, dim)),
          jax.random.normal(keys[1], (batch, kv_len, heads, dim)),
          jax.random.normal(keys[2], (batch, kv_len, heads, dim)))


def test_weights_sum_to_one_and_ignore_masked_keys():
  query, key, value = _qkv()
  key_valid = jnp.array([[True, True, True, False, False], [True, True, True, True, True]])
  mask = key_valid[:, None, None, :]
  out, weights = attention.dot_product_attention(query, key, value, mask, return_weights=True)
  assert out.shape == (2, 3, 2, 4) and weights.shape == (2, 2, 3, 5)
  np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)
  np.testing.assert_array_equal(weights[0, :, :, 3:], 0.0)
  # Masked keys do not influence the output: change their values, same result.
  changed = value.at[0, 3:].set(100.0)
  np.testing.assert_allclose(attention.dot_product_attention(query, key, changed, mask), out,
                             rtol=1e-6, atol=1e-6)


def test_matches_numpy_reference():
  query, key, value = _qkv(seed=1)
  q, k, v = (np.asarray(x, np.float64) for x in (query, key, value))
  scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  expected = np.einsum("bhqk,bkhd->bqhd", weights, v)
  np.testing.assert_allclose(attention.dot_product_attention(query, key, value), expected,
                             rtol=1e-5, atol=1e-5)
