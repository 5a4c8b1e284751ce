"""Modern model options in every family and in cached decoding: rotary position embeddings
('rope'), grouped-query and multi-query attention (`num_kv_heads`), SwiGLU, and the
decoder-only prefix LM with its loss on the weighted positions only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import decode_in_pieces
from transformer_jax import commands
from transformer_jax import config_validation
from transformer_jax import default_config
from transformer_jax import families
from transformer_jax import flops
from transformer_jax import metrics
from transformer_jax import parallel
from transformer_jax import train
from transformer_jax.inference import decoding
from transformer_jax.model import attention
from transformer_jax.model import layers
from transformer_jax.model import models

# Four heads of dimension 4, so that 2 (grouped) and 1 (multi-query) key/value heads differ.
SMALL = models.TransformerConfig(vocab_size=40, emb_dim=16, num_heads=4, num_layers=2,
                                 qkv_dim=16, mlp_dim=32, max_len=24, dropout_rate=0.1,
                                 attention_dropout_rate=0.1)
VARIANTS = {
    "rope": dict(position_embedding="rope"),
    "gqa": dict(num_kv_heads=2),
    "mqa": dict(num_kv_heads=1),
    "rope_gqa_swiglu": dict(position_embedding="rope", num_kv_heads=2, ffn_activation="swiglu"),
    "rope_mqa_swiglu": dict(position_embedding="rope", num_kv_heads=1, ffn_activation="swiglu"),
    "prefix_lm": dict(prefix_lm=True),
    "prefix_rope_gqa": dict(prefix_lm=True, position_embedding="rope", num_kv_heads=2),
    # Gemma 2 / 3's options (tests/test_llm_options.py): a 3-token window on alternate layers,
    # shorter than the rows, with a RoPE base of its own; soft caps, q/k and (1 + w) norms.
    "gemma": dict(position_embedding="rope", pre_ln=True, norm="rmsnorm", norm_plus_one=True,
                  post_sublayer_norm=True, qk_norm=True, num_kv_heads=2, attention_softcap=2.0,
                  logits_softcap=3.0, query_pre_attn_scalar=5.0, sliding_window=3,
                  sliding_window_pattern="LG", local_position_base=100.0),
}
# Every option alone and all together, for the tests run per variant (the suite's time is
# budgeted: "gqa" and "rope_mqa_swiglu" are covered by the grouped-attention tests below).
EACH_OPTION = ("rope", "mqa", "rope_gqa_swiglu", "gemma")
DECODER_ONLY_OPTIONS = EACH_OPTION + ("prefix_lm", "prefix_rope_gqa")
TOL = dict(rtol=1e-5, atol=1e-5)


def _count(params):
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def _init(model, *shapes):
  return parallel.unbox(model.init(jax.random.PRNGKey(0),
                                   *[jnp.ones(s, jnp.int32) for s in shapes],
                                   deterministic=True)["params"])


def _random_qkv(seed=0, length=6, heads=4, kv_heads=4, dim=8):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (jax.random.normal(keys[0], (2, length, heads, dim)),
          jax.random.normal(keys[1], (2, length, kv_heads, dim)),
          jax.random.normal(keys[2], (2, length, kv_heads, dim)))


# ---- Rotary position embeddings ------------------------------------------------------------

def test_rotary_embedding_rotates_half_split_pairs_literally():
  # d = 4: pairs (0, 2) and (1, 3) turn by position * base^0 and position * base^(-1/2).
  x = jnp.array([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4)
  out = layers.rotary_embedding(x, jnp.array([[3]]), base=100.0)
  a, b = 3.0, 3.0 / 10.0
  expected = [1 * np.cos(a) - 3 * np.sin(a), 2 * np.cos(b) - 4 * np.sin(b),
              3 * np.cos(a) + 1 * np.sin(a), 4 * np.cos(b) + 2 * np.sin(b)]
  np.testing.assert_allclose(out.reshape(-1), expected, rtol=1e-6)
  np.testing.assert_array_equal(layers.rotary_embedding(x, jnp.array([[0]])), x)  # angle 0
  with pytest.raises(ValueError, match="even head dimension"):
    layers.rotary_embedding(jnp.ones((1, 1, 1, 3)), jnp.array([[1]]))


def _rotary_weights(positions, query, key, value):
  positions = jnp.asarray(positions)[None, :]
  rotate = lambda x: layers.rotary_embedding(x, positions)
  return attention.dot_product_attention(rotate(query), rotate(key), value,
                                         attention.causal_mask(query.shape[1]),
                                         return_weights=True)[1]


def test_rotary_attention_weights_depend_only_on_relative_positions():
  query, key, value = _random_qkv()
  weights = _rotary_weights(np.arange(6), query, key, value)
  np.testing.assert_allclose(_rotary_weights(np.arange(6) + 17, query, key, value), weights,
                             rtol=1e-5, atol=1e-6)
  # Not a uniform shift: the last token moves away from the others.
  moved = _rotary_weights([0, 1, 2, 3, 4, 9], query, key, value)
  np.testing.assert_allclose(moved[:, :, :5], weights[:, :, :5], rtol=1e-5, atol=1e-6)
  assert not np.allclose(moved[:, :, 5], weights[:, :, 5], atol=1e-3)


def test_rope_model_sees_relative_positions_only():
  # The whole decoder-only model: the same tokens at positions shifted by a constant give the
  # same attention weights and logits (nothing absolute is added to the embeddings).
  model = models.DecoderOnly(SMALL.replace(**VARIANTS["rope_gqa_swiglu"]))
  params = _init(model, (1, 6))
  tokens = jnp.array([[11, 4, 13, 21, 7, 1]])
  run = lambda positions: models.attention_weights(model, params, tokens,
                                                   jnp.asarray([positions]))
  weights = run(np.arange(6))
  shifted = run(np.arange(6) + 9)
  assert sorted(weights) == [f"decoder/layer_{i}/self_attention" for i in range(2)]
  for name in weights:
    assert weights[name].shape == (1, 4, 6, 6)  # one map per query head
    np.testing.assert_allclose(shifted[name], weights[name], rtol=1e-5, atol=1e-6)
  moved = run([0, 1, 2, 3, 4, 12])
  assert not np.allclose(moved["decoder/layer_0/self_attention"][:, :, 5],
                         weights["decoder/layer_0/self_attention"][:, :, 5], atol=1e-3)
  logits = lambda positions: model.apply({"params": params}, tokens, jnp.asarray([positions]),
                                         deterministic=True)
  np.testing.assert_allclose(logits(np.arange(6) + 9), logits(np.arange(6)), **TOL)


def test_rope_rotates_self_attention_only():
  # Shifting only the target positions (or only the source positions) changes nothing:
  # cross-attention, where queries and keys come from two sequences, is not rotated.
  model = models.EncoderDecoder(SMALL.replace(position_embedding="rope"))
  params = _init(model, (1, 4), (1, 3))
  assert "encoder_positions" not in params and "decoder_positions" not in params
  inputs, targets = jnp.array([[5, 9, 12, 1]]), jnp.array([[11, 4, 1]])
  run = lambda source_shift, target_shift: model.apply(
      {"params": params}, inputs, targets, jnp.arange(4)[None] + source_shift,
      jnp.arange(3)[None] + target_shift, deterministic=True)
  expected = run(0, 0)
  np.testing.assert_allclose(run(0, 5), expected, **TOL)
  np.testing.assert_allclose(run(7, 0), expected, **TOL)
  with pytest.raises(ValueError, match="self-attention only"):
    attention.MultiHeadAttention(4, 16, rope_base=10000.0).init(
        jax.random.PRNGKey(0), jnp.ones((1, 3, 16)), jnp.ones((1, 4, 16)))


@pytest.mark.parametrize("name", EACH_OPTION)
def test_packed_segments_do_not_interact(name):
  # RoPE positions restart with every packed segment, as the *_position arrays say.
  config = SMALL.replace(**VARIANTS[name])
  first = (jnp.array([[5, 9, 1]]), jnp.array([[11, 4, 1]]))
  second = (jnp.array([[7, 8, 6, 1]]), jnp.array([[6, 17, 30, 1]]))
  pad = jnp.zeros((1, 1), jnp.int32)
  segments = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]])
  positions = jnp.array([[0, 1, 2, 0, 1, 2, 3, 0]])
  model = models.EncoderDecoder(config)
  params = _init(model, (1, 8), (1, 8))
  packed = model.apply({"params": params}, jnp.concatenate([first[0], second[0], pad], 1),
                       jnp.concatenate([first[1], second[1], pad], 1), positions, positions,
                       segments, segments, deterministic=True)
  np.testing.assert_allclose(packed[:, :3], model.apply({"params": params}, *first,
                                                        deterministic=True), **TOL)
  np.testing.assert_allclose(packed[:, 3:7], model.apply({"params": params}, *second,
                                                         deterministic=True), **TOL)
  model = models.DecoderOnly(config)
  params = _init(model, (1, 8))
  packed = model.apply({"params": params}, jnp.concatenate([first[1], second[1], pad], 1),
                       positions, segments, deterministic=True)
  np.testing.assert_allclose(packed[:, :3], model.apply({"params": params}, first[1],
                                                        deterministic=True), **TOL)
  np.testing.assert_allclose(packed[:, 3:7], model.apply({"params": params}, second[1],
                                                         deterministic=True), **TOL)


@pytest.mark.parametrize("name", EACH_OPTION)
def test_classifier_is_padding_invariant(name):
  model = models.EncoderClassifier(SMALL.replace(num_classes=3, **VARIANTS[name]))
  inputs = jnp.array([[5, 9, 12, 1, 0, 0], [7, 8, 1, 0, 0, 0]])
  params = _init(model, (1, 6))
  logits = model.apply({"params": params}, inputs, deterministic=True)
  assert logits.shape == (2, 3)
  np.testing.assert_allclose(model.apply({"params": params}, jnp.pad(inputs, ((0, 0), (0, 5))),
                                         deterministic=True), logits, **TOL)


# ---- Cached decoding equals the full forward pass ------------------------------------------

@pytest.mark.parametrize("name", EACH_OPTION)
def test_encoder_decoder_cached_decoding_equals_full_forward(name):
  # Padded sources and targets, two rows (beams) per source reading one copy of its
  # cross-attention keys/values; the self-attention cache and RoPE positions are per row.
  family = families.from_model_config("encoder_decoder", SMALL.replace(**VARIANTS[name]))
  model = family.model
  params = family.init_params(jax.random.PRNGKey(0))
  inputs = jnp.array([[5, 9, 12, 1, 0, 0], [7, 8, 1, 0, 0, 0]])
  targets = jnp.array([[11, 4, 13, 21, 1, 0, 0], [6, 17, 30, 9, 8, 3, 1],
                       [6, 17, 8, 1, 0, 0, 0], [20, 21, 22, 23, 24, 25, 1]])  # 2 per source
  full = model.apply({"params": params}, jnp.repeat(inputs, 2, axis=0), targets,
                     deterministic=True)
  encoded = model.apply({"params": params}, inputs, deterministic=True, method=model.encode)
  step = jax.jit(family.runner.cached_tokens_to_logits(params, encoded, inputs))
  cache = decoding.expand_cache(family.runner.init_cache(2, 6, 7), 2)
  decoder_inputs = models.shift_right(targets, family.model_config.bos_id)
  valid = np.asarray(targets) > 0
  for t in range(targets.shape[1]):
    logits, cache = step(decoder_inputs[:, t:t + 1], cache)
    np.testing.assert_allclose(np.asarray(logits)[valid[:, t]],
                               np.asarray(full[:, t])[valid[:, t]], **TOL)


@pytest.mark.parametrize("name", EACH_OPTION)
def test_decoder_only_prefix_fill_then_steps_equals_full_forward(name):
  model = models.DecoderOnly(SMALL.replace(**VARIANTS[name]))
  params = _init(model, (1, 8))
  tokens = jnp.array([[11, 4, 13, 1, 21, 3, 7, 1], [6, 17, 30, 9, 1, 8, 1, 0]])
  full = model.apply({"params": params}, tokens, deterministic=True)
  # A prompt of 4, then 1, 1 and 2 tokens.
  pieces = decode_in_pieces(model, params, tokens, [(0, 4), (4, 5), (5, 6), (6, 8)])
  valid = np.asarray(tokens) > 0
  np.testing.assert_allclose(np.asarray(pieces)[valid], np.asarray(full)[valid], **TOL)


@pytest.mark.parametrize("name", DECODER_ONLY_OPTIONS)
def test_decoder_only_padded_prompts_and_copies_decode_like_the_full_forward(name):
  # The family's own decoding start: right-padded prompts `SOURCE <eos>` of different lengths
  # fill the cache together, then each row continues from its own length (its write position);
  # two rows (beams, samples) per prompt continue differently.
  family = families.from_model_config("decoder_only", SMALL.replace(**VARIANTS[name]))
  params = family.init_params(jax.random.PRNGKey(0))
  prompts = [[5, 9, 12, 1], [7, 1]]
  continuations = [[[11, 4, 13], [6, 17, 30]], [[20, 21, 22], [3, 5, 7]]]
  inputs = jnp.array([p + [0] * (4 - len(p)) for p in prompts])
  cache, step, start_id = family.runner.start_decoding(params, inputs, rows=4, max_len=4)
  cache = decoding.expand_cache(cache, 2)
  step = jax.jit(step)
  feeds = np.array([[start_id] + c for rows in continuations for c in rows])  # [4, 4]
  stepwise = []
  for t in range(feeds.shape[1]):
    logits, cache = step(jnp.asarray(feeds[:, t:t + 1]), cache)
    stepwise.append(logits)
  stepwise = jnp.stack(stepwise, axis=1)  # [4, 4, vocab]
  for row in range(4):
    prompt = prompts[row // 2]
    sequence = jnp.array([prompt + continuations[row // 2][row % 2] + [1]])
    prefix = jnp.arange(sequence.shape[1])[None] < len(prompt)  # read both ways by a prefix LM
    full = family.model.apply({"params": params}, sequence, None, None, prefix,
                              deterministic=True)
    # Feeding EOS (the prompt's last token) predicts the first output token, as in training.
    np.testing.assert_allclose(stepwise[row], full[0, len(prompt):], **TOL)


@pytest.mark.parametrize("architecture", ["encoder_decoder", "decoder_only"])
def test_beam_search_runs_with_rope_and_multi_query_attention(architecture):
  family = families.from_model_config(architecture,
                                      SMALL.replace(**VARIANTS["rope_mqa_swiglu"]))
  params = family.init_params(jax.random.PRNGKey(0))
  decoding_config = default_config.get_config().decoding
  decoding_config.update(method="beam", beam_size=3, max_decode_len=5)
  inputs = jnp.array([[5, 9, 12, 1, 0, 0], [7, 8, 1, 0, 0, 0]])
  ids, scores = family.decode(params, inputs, jax.random.PRNGKey(0),
                              decoding_config=decoding_config, nbest=2)
  assert ids.shape == (2, 2, 5) and scores.shape == (2, 2)
  assert np.all(np.isfinite(scores)) and np.all(np.diff(scores, axis=1) <= 0)


# ---- Prefix LM and the loss on weighted positions --------------------------------------------

def test_prefix_lm_mask_is_bidirectional_exactly_over_the_prefix():
  # Two packed examples, prefixes of 3 and 2 tokens, then padding: a query sees a key iff
  # both are in one segment and (the key is not later, or both are in its prefix).
  model = models.DecoderOnly(SMALL.replace(prefix_lm=True))
  params = _init(model, (1, 9))
  tokens = jnp.array([[5, 9, 1, 11, 1, 7, 1, 6, 0]])
  segments = np.array([1, 1, 1, 1, 1, 2, 2, 2, 0])
  prefix = np.array([1, 1, 1, 0, 0, 1, 1, 0, 0], bool)
  positions = jnp.array([[0, 1, 2, 3, 4, 0, 1, 2, 0]])
  weights = models.attention_weights(model, params, tokens, positions, jnp.asarray([segments]),
                                     jnp.asarray([prefix]))
  q, k = np.arange(9)[:, None], np.arange(9)[None, :]
  expected = ((segments[:, None] == segments[None, :]) & (segments[None, :] > 0)
              & ((k <= q) | (prefix[:, None] & prefix[None, :])))
  for name, layer_weights in weights.items():
    seen = np.asarray(layer_weights[0] > 0)  # [heads, q, k]
    np.testing.assert_array_equal(seen[:, :8], np.broadcast_to(expected[:8], (4, 8, 9)), name)
  # Without prefix_lm the same call is causal.
  causal = models.DecoderOnly(SMALL)
  weights = models.attention_weights(causal, params, tokens, positions, jnp.asarray([segments]),
                                     jnp.asarray([prefix]))
  seen = np.asarray(weights["decoder/layer_0/self_attention"][0, 0] > 0)
  np.testing.assert_array_equal(seen[:8], (expected & (k <= q))[:8])


@pytest.mark.parametrize("name", ["prefix_lm", "prefix_rope_gqa"])
def test_prefix_lm_packed_rows_equal_each_example_alone(name):
  model = models.DecoderOnly(SMALL.replace(**VARIANTS[name]))
  params = _init(model, (1, 10))
  first, second = [5, 9, 1, 11, 4, 1], [7, 1, 6, 1]  # SOURCE <eos> TARGET <eos>
  first_prefix, second_prefix = [1, 1, 1, 0, 0, 0], [1, 1, 0, 0]
  packed = model.apply({"params": params}, jnp.array([first + second]),
                       jnp.array([list(range(6)) + list(range(4))]),
                       jnp.array([[1] * 6 + [2] * 4]),
                       jnp.array([first_prefix + second_prefix], bool), deterministic=True)
  alone = lambda tokens, prefix: model.apply({"params": params}, jnp.array([tokens]), None, None,
                                             jnp.array([prefix], bool), deterministic=True)
  np.testing.assert_allclose(packed[:, :6], alone(first, first_prefix), **TOL)
  np.testing.assert_allclose(packed[:, 6:], alone(second, second_prefix), **TOL)


def _loss_and_grads(family, score_outputs, params, batch):
  def score(logits, labels, weights):
    loss = metrics.smoothed_cross_entropy(logits, labels, 0.1)
    return jnp.sum(loss * weights), metrics.token_metrics(logits, labels, weights)

  loss_fn = lambda p: score_outputs(family, p, batch, score, deterministic=True)
  return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)


@pytest.mark.parametrize("packed", [False, True])
def test_loss_on_weighted_positions_only_equals_the_full_computation(tiny_config, packed):
  # The decoder-only family scores logits gathered at the weighted positions; the base
  # class scores all of them. Unpacked rows fit the budget of rows x max_target_length;
  # packed rows of many short examples weigh more and take the full computation instead.
  tiny_config.architecture = "decoder_only"
  tiny_config.update(max_source_length=6, max_target_length=4)
  tiny_config.model.update(prefix_lm=True, vocab_size=40, max_len=12, emb_dim=16, qkv_dim=16,
                           mlp_dim=32, num_heads=2, num_layers=1)
  family = families.get(tiny_config)
  params = family.init_params(jax.random.PRNGKey(0))
  examples = [([5, 9], [11, 4, 13]), ([7], [6]), ([20, 21, 22, 23], [3]), ([8], [9, 10])]
  rows = [family.example_features(source, target) for source, target in examples]
  lengths = [len(r["targets"]) for r in rows]
  if packed:  # two rows (a budget of 2 x 4 weighted tokens): examples 0 + 1, 2 + 3
    rows = [{k: np.concatenate([a[k], b[k]]) for k in a} for a, b in (rows[:2], rows[2:])]
  width = 12
  batch = {k: jnp.array([np.pad(r[k], (0, width - len(r[k]))) for r in rows]) for k in rows[0]}
  if packed:
    segment = lambda a, b: [1] * a + [2] * b + [0] * (width - a - b)
    position = lambda a, b: list(range(a)) + list(range(b)) + [0] * (width - a - b)
    batch["targets_segmentation"] = jnp.array([segment(*lengths[:2]), segment(*lengths[2:])])
    batch["targets_position"] = jnp.array([position(*lengths[:2]), position(*lengths[2:])])
  weighted = int(jnp.sum(batch["weights"] > 0))
  assert (weighted > len(rows) * 4) == packed  # over the budget exactly when packed
  (loss, sums), grads = _loss_and_grads(family, type(family).score_outputs, params, batch)
  (full_loss, full_sums), full_grads = _loss_and_grads(family, families.Family.score_outputs,
                                                       params, batch)
  np.testing.assert_allclose(loss, full_loss, rtol=1e-6)
  assert float(sums["denominator"]) == weighted == float(full_sums["denominator"])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), sums,
               full_sums)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads,
               full_grads)


# ---- Grouped-query attention ----------------------------------------------------------------

@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_attention_equals_attention_over_repeated_key_value_heads(kv_heads):
  query, key, value = _random_qkv(seed=3, kv_heads=kv_heads)
  group = 4 // kv_heads
  repeat = lambda x: jnp.repeat(x, group, axis=2)  # query head i reads key/value head i // g
  mask = attention.combine_masks(attention.causal_mask(6),
                                 jnp.array([[True] * 6, [True] * 4 + [False] * 2])[:, None,
                                                                                     None])
  bias = jax.random.normal(jax.random.PRNGKey(4), (1, 4, 6, 6))
  out, weights = attention.dot_product_attention(query, key, value, mask, bias=bias,
                                                 return_weights=True)
  expected, expected_weights = attention.dot_product_attention(
      query, repeat(key), repeat(value), mask, bias=bias, return_weights=True)
  assert out.shape == (2, 6, 4, 8) and weights.shape == (2, 4, 6, 6)
  np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(weights, expected_weights, rtol=1e-6, atol=1e-6)
  fused = attention.fused_attention(query, key, value, mask, "xla", bias)
  np.testing.assert_allclose(fused, expected, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="do not divide"):
    attention.dot_product_attention(query, key[:, :, :1].repeat(3, axis=2), value[:, :, :3])


def _as_multi_head(params, group):
  """The GQA model's 'kv' parameters with every key/value head repeated for the query heads
  that read it (query head i reads key/value head i // group)."""
  if not isinstance(params, dict):
    return params
  params = {name: _as_multi_head(value, group) for name, value in params.items()}
  if "kv" not in params:
    return params
  # kernel [emb, 2, n, d], bias [2, n, d]: the heads are axis -2.
  params["kv"] = {k: jnp.repeat(v, group, axis=-2) for k, v in params["kv"].items()}
  return params


def _fuse_self_attention(params):
  """Self-attention's separate 'query' and 'kv' parameters as the fused 'qkv'."""
  if not isinstance(params, dict):
    return params
  params = {name: _fuse_self_attention(value) for name, value in params.items()}
  attention_params = params.get("self_attention")
  if attention_params is not None and "query" in attention_params:
    query, kv = attention_params.pop("query"), attention_params.pop("kv")
    attention_params["qkv"] = {k: jnp.concatenate([query[k], kv[k]], axis=-3) for k in query}
  return params


@pytest.mark.parametrize("name", ["gqa", "mqa", "rope_gqa_swiglu"])
def test_grouped_model_equals_multi_head_model_with_repeated_key_value_heads(name):
  config = SMALL.replace(**VARIANTS[name])
  group = config.num_heads // config.num_kv_heads
  grouped = models.EncoderDecoder(config)
  params = _init(grouped, (1, 6), (1, 7))
  multi_head = models.EncoderDecoder(config.replace(num_kv_heads=0))
  converted = _fuse_self_attention(_as_multi_head(params, group))
  assert jax.tree.map(jnp.shape, converted) == jax.tree.map(jnp.shape, _init(multi_head, (1, 6),
                                                                             (1, 7)))
  inputs = jnp.array([[5, 9, 12, 1, 0, 0], [7, 8, 1, 0, 0, 0]])
  targets = jnp.array([[11, 4, 13, 21, 1, 0, 0], [6, 17, 30, 9, 8, 3, 1]])
  np.testing.assert_allclose(
      grouped.apply({"params": params}, inputs, targets, deterministic=True),
      multi_head.apply({"params": converted}, inputs, targets, deterministic=True),
      rtol=1e-6, atol=5e-6)  # logits of order 1: float32 rounding of differently fused matmuls


def test_as_many_key_value_heads_as_heads_is_plain_multi_head_attention():
  # The same parameter names and shapes as before num_kv_heads existed (checkpoints, imports).
  shapes = lambda config: jax.tree.map(jnp.shape, jax.eval_shape(
      lambda: _init(models.EncoderDecoder(config), (1, 4), (1, 4))))
  assert shapes(SMALL.replace(num_kv_heads=4)) == shapes(SMALL.replace(num_kv_heads=None)) \
      == shapes(SMALL)
  layer = shapes(SMALL)["decoder"]["layer_0"]
  assert sorted(layer["self_attention"]) == ["out", "qkv"]
  assert sorted(layer["cross_attention"]) == ["kv", "out", "query"]


def test_fast_attention_path_matches_reference_with_groups_and_rope():
  config = SMALL.replace(**VARIANTS["rope_gqa_swiglu"])
  inputs = jnp.array([[5, 9, 12, 1, 0, 0], [7, 8, 1, 0, 0, 0]])
  targets = jnp.array([[11, 4, 13, 21, 1, 0, 0], [6, 17, 30, 9, 8, 3, 1]])
  reference = models.EncoderDecoder(config)
  params = _init(reference, (1, 6), (1, 7))
  expected = reference.apply({"params": params}, inputs, targets, deterministic=True)
  fast = models.EncoderDecoder(config.replace(attention_implementation="xla"))
  np.testing.assert_allclose(fast.apply({"params": params}, inputs, targets,
                                        deterministic=True), expected, **TOL)


@pytest.mark.parametrize("score", ["multiplicative", "additive"])
def test_grouped_cross_attention_with_learned_scores(score):
  config = SMALL.replace(num_kv_heads=2, cross_attention_score=score)
  model = models.EncoderDecoder(config)
  params = _init(model, (1, 6), (1, 4))
  inputs = jnp.array([[5, 9, 12, 1, 0, 0]])
  logits = model.apply({"params": params}, inputs, jnp.array([[11, 4, 1, 0]]),
                       deterministic=True)
  assert logits.shape == (1, 4, 40) and np.all(np.isfinite(logits))


def test_grouped_parameter_counts_are_exact():
  d, ff, v = 16, 32, 40
  kv = 2 * 4  # 2 key/value heads of dimension 4
  # Encoder-decoder, 1 layer each, 2 of 4 key/value heads:
  #   attention = query (d*d + d) + key/value (d*2kv + 2kv) + out (d*d + d)
  #             = 272 + 272 + 272 = 816 (plain multi-head: 4 * 272 = 1088)
  #   ffn = d*ff + ff + ff*d + d = 1072; a norm = 2d = 32
  #   encoder layer = 816 + 1072 + 2 * 32 = 1952; decoder layer = 2 * 816 + 1072 + 3 * 32
  #   = 2800; embedding = v*d = 640; total = 640 + 1952 + 2800 = 5392.
  attention_params = (d * d + d) + (d * 2 * kv + 2 * kv) + (d * d + d)
  ffn = d * ff + ff + ff * d + d
  config = SMALL.replace(num_layers=1, num_kv_heads=2)
  model = models.EncoderDecoder(config)
  shapes = jax.eval_shape(lambda: _init(model, (1, 4), (1, 4)))
  by_hand = v * d + (attention_params + ffn + 2 * 2 * d) + (2 * attention_params + ffn + 3 * 2 * d)
  assert _count(shapes) == by_hand == 5392
  # Decoder-only, 2 layers, rope (no position parameters), 1 key/value head, SwiGLU:
  #   attention = 272 + (16*8 + 8 = 136) + 272 = 680; ffn = wi 544 + wi_gate 544 + wo 528
  #   = 1616; layer = 680 + 1616 + 2 * 32 = 2360; total = 640 + 2 * 2360 = 5360.
  config = SMALL.replace(**VARIANTS["rope_mqa_swiglu"])
  shapes = jax.eval_shape(lambda: _init(models.DecoderOnly(config), (1, 4)))
  assert _count(shapes) == 5360


def test_cache_holds_only_the_key_value_heads():
  family = families.from_model_config("encoder_decoder", SMALL.replace(num_kv_heads=2))
  cache = family.runner.init_cache(3, 6, 9)
  layer = cache["decoder"]["layer_0"]["self_attention"]
  # [b, n, d, len]: the layout the score and value matmuls read (kv_cache.keys_last)
  assert layer["cached_key"].shape == layer["cached_value"].shape == (3, 2, 4, 9)
  params = family.init_params(jax.random.PRNGKey(0))
  inputs = jnp.array([[5, 9, 12, 1, 0, 0]])
  encoded = family.model.apply({"params": params}, inputs, deterministic=True,
                               method=family.model.encode)
  encoded_kv = family.runner.encoded_key_value(params, encoded, inputs)
  assert encoded_kv["decoder"]["layer_0"]["cross_attention"]["key"].shape == (1, 2, 4, 6)
  family = families.from_model_config("decoder_only", SMALL.replace(
      **VARIANTS["rope_mqa_swiglu"]))
  layer = family.runner.init_cache(3, 9)["decoder"]["layer_1"]["self_attention"]
  assert layer["cached_key"].shape == (3, 1, 4, 9)


def test_key_value_heads_split_over_the_tensor_axis_when_they_divide_it(tiny_config):
  tiny_config.model.update(num_heads=4, num_kv_heads=2)
  layout = parallel.MeshParallel(data=1, fsdp=1, tensor=1)  # specs only; one device here
  layout.mesh = jax.sharding.AbstractMesh((1, 2, 2), parallel.MESH_AXES)
  spec = lambda: jax.tree.map(lambda s: s.spec, layout.shardings(jax.eval_shape(
      lambda: families.get(tiny_config).init_params(jax.random.PRNGKey(0), boxed=True))))
  P = jax.sharding.PartitionSpec
  layer = spec()["decoder"]["layer_0"]
  assert layer["self_attention"]["kv"]["kernel"] == P("fsdp", None, "tensor", None)
  assert layer["self_attention"]["query"]["kernel"] == P("fsdp", None, "tensor", None)
  tiny_config.model.num_kv_heads = 1  # one head does not split: it stays whole
  assert spec()["decoder"]["layer_0"]["self_attention"]["kv"]["kernel"] == P(
      "fsdp", None, None, None)


# ---- Config, FLOPs and a training run --------------------------------------------------------

@pytest.mark.parametrize("overrides,message", [
    (dict(num_kv_heads=3), "num_kv_heads=3 must divide config.model.num_heads=2"),
    (dict(num_kv_heads=-1), "num_kv_heads=-1 must be >= 0"),
    (dict(position_embedding="rope", num_heads=8, qkv_dim=24),
     "'rope' needs an even head dimension"),
    (dict(position_embedding="rotary"), "is not one of sinusoidal, sinusoidal_halves, "
                                        "sinusoidal_t2t, learned, relative, rope"),
    (dict(prefix_lm=True), "prefix_lm=True is for config.architecture='decoder_only'"),
])
def test_config_validation_names_bad_options(tiny_config, overrides, message):
  tiny_config.model.update(overrides)
  assert any(message in p for p in config_validation.problems(tiny_config)), \
      config_validation.problems(tiny_config)


def test_config_validation_accepts_the_options(tiny_config):
  tiny_config.architecture = "decoder_only"
  tiny_config.model.update(position_embedding="rope", num_kv_heads=1, ffn_activation="swiglu",
                           max_len=64)
  assert config_validation.problems(tiny_config) == []
  assert default_config.get_config().model.num_kv_heads == 0  # from models.config_defaults


def test_flops_count_the_smaller_key_value_projections():
  config = models.TransformerConfig(vocab_size=10, emb_dim=4, num_heads=2, num_layers=1,
                                    qkv_dim=4, mlp_dim=8)
  saved = (flops.forward_flops(config, 1, 3, 2)
           - flops.forward_flops(config.replace(num_kv_heads=1), 1, 3, 2))
  # Key and value projections 4 -> 2 wide instead of 4: 2 matmuls of 4x2 fewer per token in
  # every self-attention (3 source + 2 target tokens) and in cross-attention (3 sources).
  assert saved == (3 + 2 + 3) * 2 * 2 * 4 * 2
  extra = (flops.forward_flops(config.replace(ffn_activation="swiglu"), 1, 3, 2)
           - flops.forward_flops(config, 1, 3, 2))
  assert extra == (3 + 2) * 2 * 4 * 8  # the gate's matmul
  # Decoder-only over 5 tokens, the output layer at 2 of them: per token, projections
  # 4 * 2 * 4 * 4 = 128 (with 1 of 2 key/value heads: 2 * 2 * 4 * 4 + 2 * 2 * 4 * 2 = 96),
  # scores and values 2 * 2 * 5 * 4 = 80, ffn 2 * 2 * 4 * 8 = 128; logits 2 * 4 * 10 = 80.
  assert flops.decoder_only_forward_flops(config, 3, 5, 2) == 3 * (5 * (128 + 80 + 128)
                                                                   + 2 * 80)
  assert flops.decoder_only_forward_flops(config.replace(num_kv_heads=1), 1, 5, 2) == (
      5 * (96 + 80 + 128) + 2 * 80)


def test_prefix_lm_with_rope_mqa_swiglu_trains_packed_and_evaluates(tmp_path, tiny_config):
  tiny_config.architecture = "decoder_only"
  tiny_config.pack_examples = True
  tiny_config.model.update(position_embedding="rope", num_kv_heads=1, ffn_activation="swiglu",
                           prefix_lm=True, max_len=64)
  tiny_config.decoding.update(beam_size=2, max_decode_len=12)
  tiny_config.num_generate_examples = 4
  workdir = str(tmp_path)
  result = train.train_and_evaluate(tiny_config, workdir)
  assert np.isfinite(result["loss"])
  evaluated = commands.run_evaluate(workdir, split="validation")
  assert evaluated["step"] == 20
  np.testing.assert_allclose(evaluated["loss"], result["loss"], rtol=1e-5)
  assert "bleu" in evaluated
