"""Rematerialised layers (config.model.remat, model/remat.py): the same gradients as without
remat, dropout included, and a backward pass that holds one layer's activations at a time."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import parallel
from transformer_jax.model import models
from transformer_jax.model import remat

SMALL = models.TransformerConfig(vocab_size=40, emb_dim=16, num_heads=2, num_layers=2,
                                 qkv_dim=16, mlp_dim=32, max_len=16, dropout_rate=0.2,
                                 attention_dropout_rate=0.1)
INPUTS = jnp.array([[5, 9, 12, 1, 0, 0], [7, 8, 1, 0, 0, 0]])
TARGETS = jnp.array([[11, 4, 13, 21, 1, 0, 0], [6, 17, 30, 9, 8, 3, 1]])


def _assert_close(a, b):
  # The recomputation may sum in another order: a few float32 ulps of the largest gradient.
  np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(b).max())))


@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_with_dropout_gives_the_gradients_of_the_layers_without_it(policy):
  """Both stacks rematerialised, dropout on: the recomputation draws the same masks."""
  params = parallel.unbox(models.EncoderDecoder(SMALL).init(
      jax.random.PRNGKey(0), INPUTS, TARGETS, deterministic=True)["params"])

  def loss(config):
    return lambda p: jnp.sum(models.EncoderDecoder(config).apply(
        {"params": p}, INPUTS, TARGETS, deterministic=False,
        rngs={"dropout": jax.random.PRNGKey(3)}) ** 2)

  value, grads = jax.jit(jax.value_and_grad(loss(SMALL)))(params)
  remat_value, remat_grads = jax.jit(jax.value_and_grad(loss(
      SMALL.replace(remat=True, remat_policy=policy))))(params)
  np.testing.assert_allclose(remat_value, value, rtol=1e-6)
  jax.tree.map(_assert_close, remat_grads, grads)


def _step_temporaries(layers: int, remat: bool) -> int:
  """Bytes of temporaries XLA's compiled gradient of a decoder-only model needs: 4 x 256
  tokens through an MLP 2048 wide, where one layer's activations are several 8 MiB
  [1024, 2048] float32 buffers."""
  config = models.TransformerConfig(vocab_size=64, emb_dim=32, num_heads=2, qkv_dim=32,
                                    mlp_dim=2048, max_len=256, num_layers=layers,
                                    dropout_rate=0.0, position_embedding="rope", pre_ln=True,
                                    remat=remat)
  tokens = jnp.ones((4, 256), jnp.int32)
  model = models.DecoderOnly(config)
  params = parallel.unbox(model.init(jax.random.PRNGKey(0), tokens[:, :8],
                                     deterministic=True)["params"])
  loss = lambda p: jnp.mean(model.apply({"params": p}, tokens, deterministic=True) ** 2)
  compiled = jax.jit(jax.grad(loss)).lower(params).compile()
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's scheduling, measured")
def test_the_backward_pass_recomputes_one_layer_at_a_time():
  """Six layers need no more temporaries than two, give or take one layer's activations:
  XLA recomputes a layer only once its output's gradient exists, and computes its weights'
  gradients before the layer below's (both deferrable, and then every layer's activations
  live at once: with jax.checkpoint alone, six layers took as much as without remat, 136
  against 51 MiB). Without remat they grow by more than a buffer a layer."""
  buffer = 4 * 256 * 2048 * 4
  with_remat = functools.partial(_step_temporaries, remat=True)
  assert with_remat(6) - with_remat(2) < 2 * buffer
  assert _step_temporaries(6, remat=False) - _step_temporaries(2, remat=False) > 4 * buffer


class _Tanh(nn.Module):
  @nn.compact
  def __call__(self, x, scale):
    return jnp.tanh(nn.Dense(8)(x) * scale)


def test_one_traced_call_differentiated_two_ways_gets_each_ones_gradients():
  """A jitted call reused under one gradient, its input differentiated in one use and not in
  the other: the gradients of the layer without remat (each forward pass carries what it
  differentiated in its residuals, for its own backward pass)."""
  x, other = jnp.ones((2, 4)), jnp.full((2, 4), 0.5)
  params = _Tanh().init(jax.random.PRNGKey(0), x, 2.0)["params"]

  def gradients(layer):
    call = jax.jit(lambda p, x: jnp.sum(layer().apply({"params": p}, x, 2.0) ** 2))
    return jax.grad(lambda p, x: call(p, x) + call(p, other), argnums=(0, 1))(params, x)

  expected, grads = gradients(_Tanh), gradients(remat.remat(_Tanh, "full", static=()))
  jax.tree.map(_assert_close, grads, expected)
  assert float(jnp.abs(grads[1]).max()) > 0
