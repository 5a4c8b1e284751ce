"""The three model families and every config variant: shapes, no leakage, caches, training."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import families
from transformer_jax import parallel
from transformer_jax import tokenizer as tokenizer_lib
from transformer_jax import train
from transformer_jax.data import demo
from transformer_jax.data import features
from transformer_jax.data import pipeline
from transformer_jax.model import models
from tests.conftest import decode_in_pieces
from tests.conftest import make_tiny_config

SMALL = models.TransformerConfig(vocab_size=40, emb_dim=16, num_heads=2, num_layers=2,
                                 qkv_dim=16, mlp_dim=32, max_len=16, dropout_rate=0.1,
                                 attention_dropout_rate=0.1)


def _count(params):
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


# ---- Named sizes ----------------------------------------------------------------------------

@pytest.mark.parametrize("size,expected", [("tiny", 2_601_472), ("small", 15_001_600),
                                           ("base", 63_082_496), ("big", 214_245_376)])
def test_named_sizes_have_pinned_parameter_counts(size, expected):
  config = models.named_config(size, vocab_size=37000)  # the paper's shared BPE vocabulary
  model = models.EncoderDecoder(config)
  shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32),
                                             jnp.ones((1, 4), jnp.int32), deterministic=True))
  d, ff, n = config.emb_dim, config.mlp_dim, config.num_layers
  attention, ffn, norm = 4 * (d * d + d), 2 * d * ff + ff + d, 2 * d
  by_hand = 37000 * d + n * (attention + ffn + 2 * norm) + n * (2 * attention + ffn + 3 * norm)
  assert _count(shapes["params"]) == expected == by_hand


# ---- DecoderOnly -----------------------------------------------------------------------------

def _decoder_only(config=SMALL, length=8):
  model = models.DecoderOnly(config)
  params = model.init(jax.random.PRNGKey(0), jnp.ones((1, length), jnp.int32),
                      deterministic=True)["params"]
  return model, params


def test_decoder_only_cache_with_prefix_fill_equals_full_forward():
  model, params = _decoder_only()
  tokens = jnp.array([[11, 4, 13, 1, 21, 3, 7, 1], [6, 17, 30, 9, 1, 8, 1, 5]])
  full = model.apply({"params": params}, tokens, deterministic=True)
  # A prompt of 4, then 1, 1 and 2 tokens.
  pieces = decode_in_pieces(model, params, tokens, [(0, 4), (4, 5), (5, 6), (6, 8)])
  np.testing.assert_allclose(pieces, full, rtol=1e-5, atol=1e-5)


def test_decoder_only_has_no_future_leakage_and_ignores_padding():
  model, params = _decoder_only(length=10)
  tokens = jnp.array([[11, 4, 13, 21, 1, 0]])
  a = model.apply({"params": params}, tokens, deterministic=True)
  b = model.apply({"params": params}, tokens.at[0, 3].set(30), deterministic=True)
  np.testing.assert_allclose(a[:, :4], b[:, :4], rtol=1e-6, atol=1e-6)
  assert not np.allclose(a[:, 4], b[:, 4])
  padded = model.apply({"params": params}, jnp.pad(tokens, ((0, 0), (0, 4))), deterministic=True)
  np.testing.assert_allclose(padded[:, :5], a[:, :5], rtol=1e-5, atol=1e-5)


def test_decoder_only_packed_segments_do_not_interact():
  model, params = _decoder_only()
  first, second = jnp.array([[11, 4, 1]]), jnp.array([[6, 17, 30, 1]])
  packed = jnp.concatenate([first, second, jnp.zeros((1, 1), jnp.int32)], axis=1)
  segments = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]])
  positions = jnp.array([[0, 1, 2, 0, 1, 2, 3, 0]])
  out = model.apply({"params": params}, packed, positions, segments, deterministic=True)
  np.testing.assert_allclose(out[:, :3], model.apply({"params": params}, first,
                                                     deterministic=True), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out[:, 3:7], model.apply({"params": params}, second,
                                                      deterministic=True), rtol=1e-5, atol=1e-5)


# ---- EncoderClassifier -----------------------------------------------------------------------

@pytest.mark.parametrize("pooling", ["mean", "first", "attention"])
def test_classifier_shape_and_padding_invariance(pooling):
  config = SMALL.replace(num_classes=3, pooling=pooling)
  model = models.EncoderClassifier(config)
  inputs = jnp.array([[5, 9, 12, 1, 0, 0], [7, 8, 1, 0, 0, 0]])
  params = model.init(jax.random.PRNGKey(0), inputs, deterministic=True)["params"]
  logits = model.apply({"params": params}, inputs, deterministic=True)
  assert logits.shape == (2, 3) and logits.dtype == jnp.float32
  more_padding = model.apply({"params": params}, jnp.pad(inputs, ((0, 0), (0, 5))),
                             deterministic=True)
  np.testing.assert_allclose(more_padding, logits, rtol=1e-5, atol=1e-5)


# ---- Variants --------------------------------------------------------------------------------

VARIANTS = {
    "post_ln": {},
    "pre_ln": dict(pre_ln=True),
    "learned_positions": dict(position_embedding="learned"),
    "position_base_100": dict(position_base=100.0),
    "separate_embeddings": dict(share_embeddings=False),
    "untied_output": dict(tie_output=False),
    "separate_untied": dict(share_embeddings=False, tie_output=False),
    "gelu": dict(ffn_activation="gelu"),
    "geglu": dict(ffn_activation="geglu"),
    "reglu": dict(ffn_activation="reglu"),
    "multiplicative_cross_attention": dict(cross_attention_score="multiplicative"),
    "additive_cross_attention": dict(cross_attention_score="additive"),
    "activation_dropout": dict(activation_dropout_rate=0.2, attention_dropout_rate=0.1),
    "xla_attention": dict(attention_implementation="xla"),
}  # bfloat16 and remat train in test_bfloat16_and_remat_match_float32


@pytest.fixture(scope="module")
def demo_batches(data_cache):
  config = make_tiny_config(data_cache)
  pairs = demo.generate_splits(256, 0, 0, seed=1)["train"]
  tok = tokenizer_lib.train_tokenizer((t for p in pairs for t in p), 256, model_type="bpe")
  data, _ = features.encode_examples(families.get(config),
                                     [{"source": s, "target": t} for s, t in pairs], tok)
  batches = pipeline.TrainBatches(data, 16, seed=0)
  return config, [next(batches) for _ in range(4)]


def _train(config, batches, **model_overrides):
  """Losses of 4 pmapped training steps of the tiny demo model with these overrides."""
  config = config.copy_and_resolve_references()
  config.model.update(model_overrides)
  config.label_smoothing = 0.0
  family = families.get(config)
  state = parallel.replicate(parallel.DataParallel().create_state(
      functools.partial(train.create_state, config, family, jax.random.PRNGKey(0))))
  step = train.compile_train_step(config, family)
  rng = jax.random.PRNGKey(1)
  losses = []
  for batch in batches:
    state, sums = step(state, parallel.shard(batch), rng)
    losses.append(float(sums["loss"][0] / sums["denominator"][0]))
  return np.array(losses), state


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_trains_on_the_demo_task(name, demo_batches):
  config, batches = demo_batches
  losses, state = _train(config, batches, **VARIANTS[name])
  assert np.all(np.isfinite(losses)), losses
  assert losses[-1] < losses[0]  # 4 Adam steps at a warmup learning rate already help
  params = parallel.unreplicate(state.params)
  assert ("logits_dense" in params) == (VARIANTS[name].get("tie_output") is False)
  assert ("source_embedding" in params) == (VARIANTS[name].get("share_embeddings") is False)


def test_bfloat16_and_remat_match_float32(demo_batches):
  config, batches = demo_batches
  no_dropout = dict(dropout_rate=0.0, attention_dropout_rate=0.0)
  reference, _ = _train(config, batches, **no_dropout)
  remat, _ = _train(config, batches, remat=True, **no_dropout)
  for policy in ("dots", "dots_no_batch"):
    kept, _ = _train(config, batches, remat=True, remat_policy=policy, **no_dropout)
    np.testing.assert_allclose(kept, reference, rtol=1e-5)
  bf16, _ = _train(config, batches, dtype="bfloat16", **no_dropout)
  np.testing.assert_allclose(remat, reference, rtol=1e-5)  # same math, recomputed
  np.testing.assert_allclose(bf16, reference, rtol=2e-2)  # bfloat16 activations: ~3 digits


def test_fast_attention_path_matches_reference():
  inputs = jnp.array([[5, 9, 12, 1, 0, 0], [7, 8, 1, 0, 0, 0]])
  targets = jnp.array([[11, 4, 13, 21, 1, 0, 0], [6, 17, 30, 9, 8, 3, 1]])
  reference = models.EncoderDecoder(SMALL)
  params = reference.init(jax.random.PRNGKey(0), inputs, targets, deterministic=True)["params"]
  expected = reference.apply({"params": params}, inputs, targets, deterministic=True)
  for implementation in ("xla", "auto"):
    fast = models.EncoderDecoder(SMALL.replace(attention_implementation=implementation))
    np.testing.assert_allclose(fast.apply({"params": params}, inputs, targets,
                                          deterministic=True), expected, rtol=1e-5, atol=1e-5)


def test_attention_weights_for_every_layer_and_head():
  model = models.EncoderDecoder(SMALL)
  inputs = jnp.array([[5, 9, 12, 1, 0]])
  targets = jnp.array([[11, 4, 1, 0]])
  params = model.init(jax.random.PRNGKey(0), inputs, targets, deterministic=True)["params"]
  weights = models.attention_weights(model, params, inputs, targets)
  assert sorted(weights) == sorted(
      [f"encoder/layer_{i}/self_attention" for i in range(2)] +
      [f"decoder/layer_{i}/{kind}" for i in range(2) for kind in ("self_attention",
                                                                  "cross_attention")])
  cross = weights["decoder/layer_0/cross_attention"]
  assert cross.shape == (1, 2, 4, 5)
  np.testing.assert_allclose(cross.sum(-1), 1.0, rtol=1e-6)
  np.testing.assert_array_equal(cross[0, :, :3, 4], 0.0)  # padding key
  causal = weights["decoder/layer_1/self_attention"][0, :, :3, :3]
  np.testing.assert_array_equal(np.triu(np.asarray(causal), k=1), 0.0)
