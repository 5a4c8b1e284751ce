"""The model options the Qwen3 and Gemma imports brought, as any model uses them: sliding-window
attention on a pattern of layers (training and the KV cache), attention and final-logit soft
caps, per-head query/key norms, the (1 + w) RMSNorm, post-sublayer norms, the scores' own
scale, a RoPE base for the windowed layers and the embedding factor in the model's dtype.
Cached decoding with all of them equals the full forward pass in test_modern_variants.py
(its 'gemma' variant); the imports against transformers in test_pretrained_encoders.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import config_validation
from transformer_jax import parallel
from transformer_jax.model import attention
from transformer_jax.model import blocks
from transformer_jax.model import layers
from transformer_jax.model import models

SMALL = models.TransformerConfig(vocab_size=40, emb_dim=16, num_heads=4, num_layers=2,
                                 qkv_dim=16, mlp_dim=32, max_len=24, dropout_rate=0.0,
                                 position_embedding="rope", pre_ln=True, norm="rmsnorm")
TOKENS = jnp.array([[11, 4, 13, 1, 21, 3, 7, 9, 5, 8, 1, 0]])


def _init(model, length=8):
  return parallel.unbox(model.init(jax.random.PRNGKey(0), jnp.ones((1, length), jnp.int32),
                                   deterministic=True)["params"])


def _count(tree):
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


# ---- Sliding windows --------------------------------------------------------------------------

def test_window_mask_is_literal_and_counts_positions_not_slots():
  positions = jnp.array([[0, 1, 2, 3, 4]])
  expected = np.array([[1, 1, 1, 1, 1],  # later keys pass: the causal mask removes them
                       [1, 1, 1, 1, 1],
                       [0, 1, 1, 1, 1],
                       [0, 0, 1, 1, 1],
                       [0, 0, 0, 1, 1]], bool)
  np.testing.assert_array_equal(blocks.window_mask(positions, positions, 2)[0, 0], expected)
  # A cache whose slots 2 and 3 are a prompt's padding: the query at position 3 (slot 4) sees
  # the keys at positions 2 and 3 (window 2), slot 1 (position 1) no longer.
  keys = jnp.array([[0, 1, 0, 0, 3]])
  np.testing.assert_array_equal(blocks.window_mask(jnp.array([[3]]), keys, 2)[0, 0, 0],
                                [False, False, False, False, True])


def test_windowed_layers_follow_the_pattern():
  config = SMALL.replace(num_layers=5, sliding_window=4, sliding_window_pattern="LLG")
  assert blocks.windowed_layers(config, 5) == (True, True, False, True, True)
  assert blocks.windowed_layers(config.replace(sliding_window=0), 5) == (False,) * 5
  assert blocks.windowed_layers(config.replace(sliding_window_pattern="L"), 2) == (True, True)


@pytest.mark.parametrize("decode", [False, True])
def test_a_windowed_layer_reads_only_the_last_window_positions(decode):
  # One windowed layer, window 3: the logits at position 7 depend on inputs 5, 6, 7 alone
  # (inputs are the tokens shifted right: token t - 1 is input t), in the full forward pass
  # and decoding token by token through the cache alike.
  model = models.DecoderOnly(SMALL.replace(num_layers=1, sliding_window=3))
  params = _init(model, 12)

  def logits(tokens):
    if not decode:
      return model.apply({"params": params}, tokens, deterministic=True)[0, 7]
    cache = jax.tree.map(jnp.zeros_like, model.init(
        jax.random.PRNGKey(0), jnp.ones((1, 12), jnp.int32), deterministic=True,
        decode=True)["cache"])
    inputs = models.shift_right(tokens, model.config.bos_id)
    for t in range(8):
      out, variables = model.apply({"params": params, "cache": cache}, inputs[:, t:t + 1],
                                   deterministic=True, decode=True, mutable=["cache"])
      cache = variables["cache"]
    return out[0, 0]

  base = logits(TOKENS)
  far = TOKENS.at[0, 3].set(30)  # input 4: outside the window
  near = TOKENS.at[0, 4].set(30)  # input 5: inside it
  np.testing.assert_allclose(logits(far), base, atol=1e-6)
  assert np.abs(logits(near) - base).max() > 1e-3


def test_local_layers_rotate_with_their_own_base():
  config = SMALL.replace(sliding_window=4, sliding_window_pattern="LG", local_position_base=50.0)
  local = blocks.DecoderLayer(config, local=True)
  global_ = blocks.DecoderLayer(config)
  # Same parameters, another base: the windowed layer's outputs differ, the global one's not.
  x = jax.random.normal(jax.random.PRNGKey(1), (1, 6, 16))
  positions = jnp.arange(6)[None]
  params = local.init(jax.random.PRNGKey(0), x, None, None, None, True, False,
                      positions=positions)
  run = lambda layer, c: layer.clone(config=c).apply(params, x, None, None, None, True, False,
                                                     positions=positions)
  plain = config.replace(local_position_base=0.0)
  assert np.abs(run(local, config) - run(local, plain)).max() > 1e-3
  np.testing.assert_array_equal(run(global_, config), run(global_, plain))


# ---- Soft caps, scale, norms ------------------------------------------------------------------

def test_attention_softcap_caps_the_scaled_scores_before_the_mask():
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  query, key, value = (5 * jax.random.normal(k, (1, 4, 2, 8)) for k in keys)
  mask = attention.causal_mask(4)
  out, weights = attention.dot_product_attention(query, key, value, mask, return_weights=True,
                                                 scale=0.5, softcap=2.0)
  scores = 2.0 * jnp.tanh(jnp.einsum("bqhd,bkhd->bhqk", query, key) * 0.5 / 2.0)
  expected = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
  np.testing.assert_allclose(weights, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out, jnp.einsum("bhqk,bkhd->bqhd", expected, value), rtol=1e-5,
                             atol=1e-5)
  # Scores within (-2, 2): no weight in a row exceeds e^4 times another visible one there.
  visible = np.broadcast_to(np.asarray(mask), weights.shape)
  smallest = np.where(visible, weights, np.inf).min(-1)
  assert np.all(np.asarray(weights).max(-1) <= smallest * np.exp(4.0))


def test_logits_softcap_bounds_the_logits():
  model = models.DecoderOnly(SMALL.replace(logits_softcap=0.5))
  params = _init(model)
  uncapped = models.DecoderOnly(SMALL).apply({"params": params}, TOKENS, deterministic=True)
  capped = model.apply({"params": params}, TOKENS, deterministic=True)
  np.testing.assert_allclose(capped, 0.5 * jnp.tanh(uncapped / 0.5), rtol=1e-5, atol=1e-6)


def test_query_pre_attn_scalar_replaces_the_head_dimension_in_the_scale():
  # Head dimension 4: a scalar of 4 is the default scale, 16 halves the scores.
  config = SMALL.replace(num_layers=1)
  params = _init(models.DecoderOnly(config))
  run = lambda c: models.DecoderOnly(c).apply({"params": params}, TOKENS, deterministic=True)
  np.testing.assert_allclose(run(config.replace(query_pre_attn_scalar=4.0)), run(config),
                             rtol=1e-6, atol=1e-6)
  assert np.abs(run(config.replace(query_pre_attn_scalar=16.0)) - run(config)).max() > 1e-3


def test_plus_one_rmsnorm_scales_by_one_plus_its_weight():
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 8))
  norm = layers.RMSNorm(1e-6, plus_one=True)
  params = norm.init(jax.random.PRNGKey(0), x)
  assert not np.any(parallel.unbox(params)["params"]["scale"])  # starts as the identity scale
  weight = jnp.linspace(-0.5, 0.5, 8)
  plain = layers.RMSNorm(1e-6).apply({"params": {"scale": 1.0 + weight}}, x)
  np.testing.assert_allclose(norm.apply({"params": {"scale": weight}}, x), plain, rtol=1e-6)


def test_new_parameters_are_counted_exactly_and_named_for_sharding():
  # Per layer: post_sublayer_norm 2 norms of emb_dim (16); qk_norm 2 scales of head_dim (4).
  base = _count(jax.eval_shape(lambda: _init(models.DecoderOnly(SMALL))))
  config = SMALL.replace(post_sublayer_norm=True, qk_norm=True, norm_plus_one=True)
  boxed = jax.eval_shape(lambda: models.DecoderOnly(config).init(
      jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32), deterministic=True))["params"]
  assert _count(parallel.unbox(boxed)) == base + 2 * (2 * 16 + 2 * 4)
  layer = boxed["decoder"]["layer_0"]
  assert layer["self_attention"]["query_norm"]["scale"].names == ("kv",)
  assert layer["self_attention"]["key_norm"]["scale"].names == ("kv",)
  assert layer["ffn_block"]["post_norm"]["scale"].names == ("embed",)


# ---- Everything at once, remat, config ---------------------------------------------------------

GEMMA_STYLE = dict(num_kv_heads=2, norm_plus_one=True, post_sublayer_norm=True, qk_norm=True,
                   attention_softcap=2.0, logits_softcap=3.0, query_pre_attn_scalar=5.0,
                   sliding_window=3, sliding_window_pattern="LG", local_position_base=100.0,
                   embedding_scale_in_dtype=True)


def test_remat_keeps_the_layers_window_and_gives_the_same_gradients():
  config = SMALL.replace(**GEMMA_STYLE)
  params = _init(models.DecoderOnly(config), 12)
  loss = lambda c: lambda p: jnp.sum(models.DecoderOnly(c).apply(
      {"params": p}, TOKENS, deterministic=True) ** 2)
  value, grads = jax.jit(jax.value_and_grad(loss(config)))(params)
  remat_value, remat_grads = jax.jit(jax.value_and_grad(loss(config.replace(remat=True))))(
      params)
  np.testing.assert_allclose(remat_value, value, rtol=1e-6)
  # The recomputation may sum in another order: a few float32 ulps of the largest gradient.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(b).max()))), remat_grads, grads)


def test_embedding_scale_in_bfloat16_is_rounded_first():
  config = SMALL.replace(emb_dim=3072, num_heads=1, qkv_dim=8, dtype=jnp.bfloat16,
                         scale_embeddings=True, embedding_scale_in_dtype=True)
  table = jnp.full((40, 3072), 9.0)
  embed = lambda c: models.TokenEmbedding(c).apply(
      {"params": {"embedding": {"embedding": table}}}, jnp.array([[3]]))[0, 0, 0]
  # sqrt(3072) = 55.43 is 55.5 in bfloat16, as Gemma multiplies: 9 x 55.5 = 499.5, rounded to
  # 500 (bfloat16 steps by 2 there); 9 x 55.43 = 498.8 to 498.
  assert float(embed(config)) == 500.0
  assert float(embed(config.replace(embedding_scale_in_dtype=False))) == 498.0


@pytest.mark.parametrize("overrides,message", [
    (dict(sliding_window_pattern="LX"), "sliding_window_pattern='LX' must be letters 'L'"),
    (dict(norm_plus_one=True), "norm_plus_one=True scales an RMSNorm"),
    (dict(post_sublayer_norm=True), "post_sublayer_norm=True adds a norm to pre-LN blocks"),
    (dict(local_position_base=10.0), "local_position_base is the RoPE base of sliding-window"),
    (dict(sliding_window=-1), "sliding_window=-1 must be >= 0"),
    (dict(attention_softcap=-1.0), "attention_softcap=-1.0 must be >= 0"),
])
def test_config_validation_names_bad_options(tiny_config, overrides, message):
  tiny_config.model.update(overrides)
  problems = config_validation.problems(tiny_config)
  assert any(message in p for p in problems), problems


def test_config_validation_accepts_a_gemma_style_model(tiny_config):
  tiny_config.architecture = "decoder_only"
  tiny_config.model.update(position_embedding="rope", pre_ln=True, norm="rmsnorm", max_len=64,
                           **GEMMA_STYLE)
  assert config_validation.problems(tiny_config) == []
  tiny_config.task = "classification"
  assert any("sliding_window is for decoders" in p
             for p in config_validation.problems(tiny_config))
