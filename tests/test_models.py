import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import families
from transformer_jax.inference import decoding
from transformer_jax.model import models

CONFIG = models.TransformerConfig(vocab_size=40, emb_dim=16, num_heads=2, num_layers=2,
                                  qkv_dim=16, mlp_dim=32, max_len=16, dropout_rate=0.1,
                                  attention_dropout_rate=0.1)


def _family():
  return families.from_model_config("encoder_decoder", CONFIG)


def _init(config, src_len=6, tgt_len=7):
  model = models.EncoderDecoder(config)
  params = model.init(jax.random.PRNGKey(0), jnp.ones((1, src_len), jnp.int32),
                      jnp.ones((1, tgt_len), jnp.int32), deterministic=True)["params"]
  return model, params


def test_shift_right_literal():
  targets = jnp.array([[5, 6, 7, 1, 0, 0]])
  np.testing.assert_array_equal(models.shift_right(targets, bos_id=2), [[2, 5, 6, 7, 0, 0]])


def test_shift_right_restarts_each_packed_segment():
  targets = jnp.array([[5, 6, 1, 8, 1, 0]])
  segments = jnp.array([[1, 1, 1, 2, 2, 0]])
  np.testing.assert_array_equal(models.shift_right(targets, 2, segments), [[2, 5, 6, 2, 8, 0]])


def test_shift_right_can_start_each_target_from_its_last_token():
  # mBART-cc25's `X </s> [code]` targets start from their code (mBART's shift_tokens_right).
  targets = jnp.array([[5, 6, 1, 250, 0, 0], [7, 1, 251, 8, 1, 250]])
  np.testing.assert_array_equal(models.shift_right(targets, 2, start_from_last=True),
                                [[250, 5, 6, 1, 0, 0], [250, 7, 1, 251, 8, 1]])
  segments = jnp.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 2, 2, 2]])  # packed: per segment
  np.testing.assert_array_equal(models.shift_right(targets, 2, segments, start_from_last=True),
                                [[250, 5, 6, 1, 0, 0], [251, 7, 1, 250, 8, 1]])


@pytest.mark.parametrize("pre_ln", [False, True])
def test_cached_decoding_equals_full_forward(pre_ln):
  config = CONFIG.replace(pre_ln=pre_ln)
  model, params = _init(config)
  inputs = jnp.array([[5, 9, 12, 1, 0, 0], [7, 8, 1, 0, 0, 0]])
  targets = jnp.array([[11, 4, 13, 21, 1, 0, 0], [6, 17, 30, 9, 8, 3, 1]])
  full = model.apply({"params": params}, inputs, targets, deterministic=True)
  # Decode one token at a time, feeding the gold shifted targets.
  decoder_inputs = models.shift_right(targets, config.bos_id)
  encoded = model.apply({"params": params}, inputs, deterministic=True, method=model.encode)
  cache = _family().runner.init_cache(2, inputs.shape[1], targets.shape[1])
  step = jax.jit(lambda cache, ids: model.apply(
      {"params": params, "cache": cache}, encoded, inputs, ids, deterministic=True, decode=True,
      mutable=["cache"], method=model.decode))  # one compile, not op-by-op for every step
  stepwise = []
  for t in range(targets.shape[1]):
    logits, variables = step(cache, decoder_inputs[:, t:t + 1])
    cache = variables["cache"]
    stepwise.append(logits[:, 0])
  stepwise = jnp.stack(stepwise, axis=1)
  valid = np.asarray(targets) > 0
  np.testing.assert_allclose(np.asarray(stepwise)[valid], np.asarray(full)[valid],
                             rtol=1e-5, atol=1e-5)


def test_cached_prefix_fill_then_single_steps():
  model, params = _init(CONFIG)
  inputs = jnp.array([[5, 9, 12, 1, 0, 0]])
  targets = jnp.array([[11, 4, 13, 21, 1, 3, 7]])
  full = model.apply({"params": params}, inputs, targets, deterministic=True)
  decoder_inputs = models.shift_right(targets, CONFIG.bos_id)
  encoded = model.apply({"params": params}, inputs, deterministic=True, method=model.encode)
  cache = _family().runner.init_cache(1, inputs.shape[1], targets.shape[1])
  outputs = []
  for start, stop in [(0, 4), (4, 5), (5, 7)]:  # a 4-token prefix, then 1, then 2 tokens
    logits, variables = model.apply({"params": params, "cache": cache}, encoded, inputs,
                                    decoder_inputs[:, start:stop], deterministic=True,
                                    decode=True, mutable=["cache"], method=model.decode)
    cache = variables["cache"]
    outputs.append(logits)
  np.testing.assert_allclose(jnp.concatenate(outputs, axis=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("score", ["dot_product", "additive"])
def test_beams_share_their_sources_cross_attention_keys_and_values(score):
  # Three rows (beams) per source read the source's one copy of the cross-attention keys and
  # values; each row's logits equal the full forward pass of its own targets.
  config = CONFIG.replace(cross_attention_score=score)
  family = families.from_model_config("encoder_decoder", config)
  model, params = family.model, _init(config)[1]
  inputs = jnp.array([[5, 9, 12, 1, 0, 0], [7, 8, 1, 0, 0, 0]])
  targets = jnp.array([[11, 4, 13, 1], [6, 17, 30, 1], [3, 5, 7, 9],
                       [6, 17, 8, 1], [20, 21, 22, 1], [9, 9, 9, 9]])  # 3 rows per source
  full = model.apply({"params": params}, jnp.repeat(inputs, 3, axis=0), targets,
                     deterministic=True)
  encoded = model.apply({"params": params}, inputs, deterministic=True, method=model.encode)
  step = family.runner.cached_tokens_to_logits(params, encoded, inputs)
  cache = decoding.expand_cache(family.runner.init_cache(2, 6, 4), 3)
  decoder_inputs = models.shift_right(targets, config.bos_id)
  for t in range(targets.shape[1]):
    logits, cache = step(decoder_inputs[:, t:t + 1], cache)
    np.testing.assert_allclose(logits, full[:, t], rtol=1e-5, atol=1e-5)


def test_decode_steps_read_cross_attention_keys_and_values_from_the_collection():
  family = _family()
  model, params = family.model, _init(CONFIG)[1]
  inputs = jnp.array([[5, 9, 12, 1, 0, 0]])
  encoded = model.apply({"params": params}, inputs, deterministic=True, method=model.encode)
  encoded_kv = family.runner.encoded_key_value(params, encoded, inputs)
  assert set(encoded_kv["decoder"]["layer_0"]["cross_attention"]) == {"key", "value"}
  step = lambda enc: model.apply(
      {"params": params, "cache": family.runner.init_cache(1, 6, 2), "encoded_kv": encoded_kv}, enc,
      inputs, jnp.array([[CONFIG.bos_id]]), deterministic=True, decode=True,
      mutable=["cache"], method=model.decode)[0]
  # The step does not look at the encoder output again: only at its keys/values.
  np.testing.assert_array_equal(step(encoded), step(jnp.zeros_like(encoded)))
  full = model.apply({"params": params}, inputs, jnp.array([[4]]), deterministic=True)
  np.testing.assert_allclose(step(encoded)[:, 0], full[:, 0], rtol=1e-5, atol=1e-5)


def test_future_targets_do_not_change_earlier_logits():
  model, params = _init(CONFIG)
  inputs = jnp.array([[5, 9, 12, 1, 0, 0]])
  targets = jnp.array([[11, 4, 13, 21, 1, 0, 0]])
  changed = targets.at[0, 3].set(30)
  a = model.apply({"params": params}, inputs, targets, deterministic=True)
  b = model.apply({"params": params}, inputs, changed, deterministic=True)
  np.testing.assert_allclose(a[:, :4], b[:, :4], rtol=1e-6, atol=1e-6)  # shifted: 3 feeds 4
  assert not np.allclose(a[:, 4], b[:, 4])


def test_more_padding_does_not_change_outputs():
  model, params = _init(CONFIG, src_len=10, tgt_len=9)
  inputs = jnp.array([[5, 9, 12, 1, 0, 0]])
  targets = jnp.array([[11, 4, 13, 21, 1, 0, 0]])
  a = model.apply({"params": params}, inputs, targets, deterministic=True)
  b = model.apply({"params": params}, jnp.pad(inputs, ((0, 0), (0, 4))),
                  jnp.pad(targets, ((0, 0), (0, 2))), deterministic=True)
  np.testing.assert_allclose(a[:, :5], b[:, :5], rtol=1e-5, atol=1e-5)


def test_packed_segments_do_not_interact():
  model, params = _init(CONFIG, src_len=8, tgt_len=8)
  first = (jnp.array([[5, 9, 1]]), jnp.array([[11, 4, 1]]))
  second = (jnp.array([[7, 8, 6, 1]]), jnp.array([[6, 17, 30, 1]]))
  packed_inputs = jnp.concatenate([first[0], second[0], jnp.zeros((1, 1), jnp.int32)], 1)
  packed_targets = jnp.concatenate([first[1], second[1], jnp.zeros((1, 1), jnp.int32)], 1)
  inputs_segmentation = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]])
  targets_segmentation = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]])
  positions = jnp.array([[0, 1, 2, 0, 1, 2, 3, 0]])
  packed = model.apply({"params": params}, packed_inputs, packed_targets, positions, positions,
                       inputs_segmentation, targets_segmentation, deterministic=True)
  alone_first = model.apply({"params": params}, *first, deterministic=True)
  alone_second = model.apply({"params": params}, *second, deterministic=True)
  np.testing.assert_allclose(packed[:, :3], alone_first, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(packed[:, 3:7], alone_second, rtol=1e-5, atol=1e-5)


def test_dropout_is_active_only_when_not_deterministic():
  model, params = _init(CONFIG)
  inputs, targets = jnp.array([[5, 9, 1]]), jnp.array([[11, 4, 1]])
  run = lambda seed: model.apply({"params": params}, inputs, targets,
                                 rngs={"dropout": jax.random.PRNGKey(seed)})
  assert not np.allclose(run(0), run(1))
  np.testing.assert_array_equal(model.apply({"params": params}, inputs, targets,
                                            deterministic=True),
                                model.apply({"params": params}, inputs, targets,
                                            deterministic=True))


@pytest.mark.parametrize("tie_output", [True, False])
def test_bfloat16_output_layer_multiplies_in_bfloat16_unless_asked_for_float32(tie_output):
  """Float32 logits either way; `logits_dot_in_float32` only changes the operands' dtype."""
  config = CONFIG.replace(dtype=jnp.bfloat16, tie_output=tie_output)
  model, params = _init(config)
  src, tgt = jnp.array([[5, 6, 7, 1, 0, 0]]), jnp.array([[8, 9, 10, 11, 1, 0, 0]])
  fast = model.apply({"params": params}, src, tgt, deterministic=True)
  slow = models.EncoderDecoder(config.replace(logits_dot_in_float32=True)).apply(
      {"params": params}, src, tgt, deterministic=True)
  assert fast.dtype == slow.dtype == jnp.float32
  np.testing.assert_allclose(fast, slow, rtol=5e-2, atol=5e-2)  # bfloat16 operands: ~3 digits
  assert not np.array_equal(fast, slow)  # the switch does change the product
  hlo = jax.jit(lambda p: model.apply({"params": p}, src, tgt, deterministic=True)).lower(
      params).as_text()
  # The output weights are rounded to bfloat16 for the product (XLA:CPU then multiplies the
  # rounded values in float32: layers.float32_sum_dot).
  weights = "tensor<40x16xf32>) -> tensor<40x16xbf16>" if tie_output else (
      "tensor<16x40xf32>) -> tensor<16x40xbf16>")
  assert weights in hlo


def test_parameter_count_is_exact():
  config = CONFIG.replace(num_layers=1)
  model = models.EncoderDecoder(config)
  shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32),
                                             jnp.ones((1, 4), jnp.int32), deterministic=True))
  count = sum(np.prod(x.shape) for x in jax.tree.leaves(shapes["params"]))
  d, ff, v = 16, 32, 40
  attention = 4 * (d * d + d)  # q, k, v, out with biases
  ffn = d * ff + ff + ff * d + d
  norm = 2 * d
  encoder_layer = attention + ffn + 2 * norm
  decoder_layer = 2 * attention + ffn + 3 * norm
  assert count == v * d + encoder_layer + decoder_layer
