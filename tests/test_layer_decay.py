"""Layer-wise learning-rate decay: per-parameter multipliers, scaled updates, both layouts."""

import dataclasses
import functools
import re

import jax
import numpy as np
import optax
import pytest

from transformer_jax import config_validation
from transformer_jax import families
from transformer_jax import layer_decay
from transformer_jax import optimizer
from transformer_jax import parallel
from transformer_jax import train
from transformer_jax.model import models

_TINY = models.TransformerConfig(vocab_size=16, emb_dim=8, num_heads=2, num_layers=2, qkv_dim=8,
                                 mlp_dim=16, max_len=32, num_classes=2, dropout_rate=0.0,
                                 attention_dropout_rate=0.0, pre_ln=True)


def _classifier(**overrides):
  # Every parameter the classifier can have: learned positions, token types, embedding norm,
  # the encoder's final norm, a pooler.
  model_config = dataclasses.replace(_TINY, position_embedding="learned", num_token_types=2,
                                     embedding_norm=True, pooling="cls_pooler")
  return families.from_model_config("encoder_classifier", model_config, **overrides)


def _encoder_decoder(**overrides):
  # 2 encoder + 3 decoder layers, each stack with one shared relative bias, untied output.
  model_config = dataclasses.replace(_TINY, position_embedding="relative", num_decoder_layers=3,
                                     tie_output=False, embedding_norm=True)
  return families.from_model_config("encoder_decoder", model_config, **overrides)


def _by_module(tree):
  """{'first/second' path names: the values of that module's leaves (one value expected)}."""
  found = {}
  for path, value in jax.tree_util.tree_flatten_with_path(tree)[0]:
    names = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]
    found.setdefault("/".join(names[:2]), set()).add(value)
  return found


def test_classifier_multipliers():
  params = jax.eval_shape(functools.partial(_classifier().init_params, boxed=True),
                          jax.random.PRNGKey(0))
  d = 0.5  # L = 2 layers: embeddings d^3, layer i d^(2 - i), the rest 1
  assert _by_module(layer_decay.multipliers(params, d)) == {
      "embedding/embedding": {d ** 3}, "positions/pos_embedding": {d ** 3},
      "token_types": {d ** 3}, "embedding_norm/scale": {d ** 3}, "embedding_norm/bias": {d ** 3},
      "encoder/layer_0": {d ** 2}, "encoder/layer_1": {d},
      "encoder/final_norm": {1.0}, "pooler/kernel": {1.0}, "pooler/bias": {1.0},
      "head/kernel": {1.0}, "head/bias": {1.0}}


def test_encoder_decoder_multipliers():
  params = jax.eval_shape(_encoder_decoder().init_params, jax.random.PRNGKey(0))
  d = 0.5  # L = 2 + 3 layers as one stack: embeddings d^6, encoder layer i d^(5 - i), ...
  assert _by_module(layer_decay.multipliers(params, d)) == {
      "shared_embedding/embedding": {d ** 6},
      "encoder_embedding_norm/scale": {d ** 6}, "encoder_embedding_norm/bias": {d ** 6},
      "decoder_embedding_norm/scale": {d ** 6}, "decoder_embedding_norm/bias": {d ** 6},
      "encoder/relative_bias": {d ** 5}, "encoder/layer_0": {d ** 5},
      "encoder/layer_1": {d ** 4},
      "decoder/relative_bias": {d ** 3}, "decoder/layer_0": {d ** 3},
      "decoder/layer_1": {d ** 2}, "decoder/layer_2": {d},
      "encoder/final_norm": {1.0}, "decoder/final_norm": {1.0},
      "logits_dense/kernel": {1.0}, "logits_dense/bias": {1.0}}


def test_depth_of_per_layer_biases_and_decoder_only_paths():
  sizes = {"encoder": 2, "decoder": 3}
  assert layer_decay.depth(("decoder", "relative_bias_1", "rel_embedding"), sizes) == 4
  assert layer_decay.depth(("encoder", "relative_bias_0", "rel_embedding"), sizes) == 1
  decoder_only = {"decoder": 2}
  assert layer_decay.depth(("embedding", "embedding"), decoder_only) == 0
  assert layer_decay.depth(("positions", "pos_embedding"), decoder_only) == 0
  assert layer_decay.depth(("decoder", "layer_1", "ffn", "wi", "kernel"), decoder_only) == 2
  assert layer_decay.depth(("logits_bias",), decoder_only) == 3


def _two_updates(config, params, grads):
  """The updates of two AdamW steps (clipped, with decoupled weight decay) on `grads` and the
  same `params` (the decay term depends on them): the second step has moments."""
  tx = optimizer.make_optimizer(config)

  @jax.jit
  def run():
    first, state = tx.update(grads, tx.init(params), params)
    second, _ = tx.update(jax.tree.map(lambda g: -0.5 * g, grads), state, params)
    return first, second

  return run()


def test_update_is_the_full_rate_update_times_the_multiplier():
  decay = 0.7
  family = _encoder_decoder(weight_decay=0.1, grad_clip_norm=1.0)
  params = jax.jit(family.init_params)(jax.random.PRNGKey(0))
  rng = np.random.default_rng(1)
  grads = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), params)
  full = _two_updates(family.config, params, grads)
  family.config.layer_decay = decay
  decayed = _two_updates(family.config, params, grads)
  factors = layer_decay.multipliers(params, decay)
  for full_update, decayed_update in zip(full, decayed):
    jax.tree.map(lambda f, d, m: np.testing.assert_allclose(d, f * m, rtol=1e-6, atol=1e-12),
                 full_update, decayed_update, factors)


def test_layer_decay_one_leaves_the_optimizer_state_unchanged():
  family = _classifier(weight_decay=0.1, grad_clip_norm=1.0, layer_decay=1.0)
  params = jax.eval_shape(family.init_params, jax.random.PRNGKey(0))
  structure = lambda tx: jax.tree.structure(jax.eval_shape(tx.init, params))
  schedule = optimizer.rsqrt_schedule(1e-3, 10)
  before = optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1))
  assert structure(optimizer.make_optimizer(family.config)) == structure(before)
  family.config.layer_decay = 0.8  # adds a stateless step: no arrays to checkpoint
  assert structure(optimizer.make_optimizer(family.config)).num_leaves == structure(before).num_leaves
  family.config.update(weight_decay=0.0, grad_clip_norm=0.0, layer_decay=1.0)
  assert structure(optimizer.make_optimizer(family.config)) == structure(optax.adam(schedule))


def _moved_by_one_step(mode, decay):
  """How far one compiled train step moves each parameter of a tiny classifier whose state
  was created (boxed) and placed by the `mode` layout."""
  batch = {"inputs": np.array([[3, 4, 5, 1], [6, 7, 1, 0]], np.int32),
           "labels": np.array([0, 1], np.int32)}
  family = _classifier(layer_decay=decay, learning_rate=1e-2, warmup_steps=1, weight_decay=0.1)
  family.config.parallel.mode = mode
  layout = parallel.make_layout(family.config)
  state = layout.create_state(functools.partial(train.create_state, family.config, family,
                                                jax.random.PRNGKey(0)))
  start = jax.tree.map(np.array, state.params)  # copied: the step donates the state
  step = train.compile_train_step(family.config, family, layout)
  new_state, _ = step(layout.place_state(state), layout.train_batch(batch),
                      jax.random.PRNGKey(1))
  end = layout.host_sums(new_state.params) if mode == "pmap" else new_state.params
  return jax.tree.map(lambda a, b: np.asarray(b) - a, start, end)


@pytest.fixture(scope="module")
def full_rate_step():
  return _moved_by_one_step("pmap", 1.0)


@pytest.mark.parametrize("mode", ["pmap", "jit"])
def test_train_step_scales_boxed_parameters_under_either_layout(mode, full_rate_step):
  """Each parameter moves by the full-rate step times its multiplier."""
  decayed = _moved_by_one_step(mode, 0.5)
  factors = layer_decay.multipliers(full_rate_step, 0.5)
  # Moves are ~1e-2; the tolerance is the rounding of parameters near 1 (before and after).
  jax.tree.map(lambda full, d, m: np.testing.assert_allclose(d, full * m, atol=3e-7),
               full_rate_step, decayed, factors)
  assert max(np.abs(x).max() for x in jax.tree.leaves(full_rate_step)) > 1e-3  # it moved


@pytest.mark.parametrize("value", [0, 1.5, -0.2])
def test_layer_decay_out_of_range_is_a_config_error(value):
  config = _classifier().config
  config.layer_decay = value
  assert config_validation.problems(config) == [
      f"config.layer_decay={float(value)} must be > 0 and <= 1"]
  with pytest.raises(config_validation.ConfigError, match=re.escape("config.layer_decay")):
    config_validation.validate(config)


def test_layer_decay_in_range_is_fine():
  config = _classifier().config
  config.layer_decay = 0.8
  assert config_validation.problems(config) == []
