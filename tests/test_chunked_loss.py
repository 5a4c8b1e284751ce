"""config.logits_chunk_length: the output layer and loss over a few positions at a time give
the loss, metrics and gradients of the whole batch at once, in less memory; with
config.fused_loss each chunk's gradients are taken in the forward pass, the same again."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import make_tiny_config
from transformer_jax import config_validation
from transformer_jax import families
from transformer_jax import metrics
from transformer_jax.model import lora as lora_lib
from transformer_jax.model import quantization


def _family(family_name: str, chunk_length: int, vocab_size: int = 256, fused: bool = False,
            **model_fields):
  config = make_tiny_config("unused")  # no data is read
  config.fused_loss = fused
  if family_name == "decoder_only":
    families.set_family(config, "decoder_only")
    config.model.max_len = 64  # source and target in one sequence
  config.model.update(vocab_size=vocab_size, **model_fields)
  config.logits_chunk_length = chunk_length
  return families.get(config)


def _batch(family, rows: int, weighted_part: bool = False) -> dict:
  """Random tokens at the family's lengths, a few padded positions; `weighted_part` (the
  decoder-only family): loss weights on the target part alone, which takes the output layer's
  gathered path."""
  rng = np.random.default_rng(0)
  batch = {}
  for name, length in family.feature_lengths().items():
    if name == "weights":
      continue
    tokens = rng.integers(3, family.model_config.vocab_size, (rows, length), dtype=np.int32)
    tokens[:, length - 1:] = 0  # padding: weight 0, inside the last chunk of 5
    batch[name] = tokens
  if weighted_part:
    weights = (batch["targets"] > 0).astype(np.float32)
    weights[:, :family.config.max_source_length] = 0.0
    batch["weights"] = weights
  return batch


def _loss_and_grads(family, params, batch, adapters=None):
  """The loss, metrics and gradients of `params`; with `adapters` (a LoRA run's), of those
  alone, the rest of `params` the frozen base closed over."""
  if adapters is None:
    return jax.jit(lambda p, b: _traced_loss_and_grads(family, p, b))(params, batch)
  _, frozen = lora_lib.split(params)
  return jax.jit(lambda a, b: _traced_loss_and_grads(
      family, a, b, lambda a: lora_lib.combine(a, frozen)))(adapters, batch)


def _traced_loss_and_grads(family, params, batch, combine=lambda params: params):
  # As train.train_step's: the loss divided by the batch's token count, a traced value.
  denominator = jnp.sum(family.labels_and_weights(batch)[1])

  def loss(params):
    params = combine(params)
    def score(logits, labels, weights):
      smoothed, unsmoothed = metrics.smoothed_cross_entropy(
          logits, labels, 0.1, also_unsmoothed=True,
          padding_masked=family.model_config.mask_padding_logit)
      return (jnp.sum(smoothed * weights) / denominator,
              metrics.token_metrics(logits, labels, weights, unsmoothed))
    return family.score_outputs(params, batch, score, deterministic=True)
  return jax.value_and_grad(loss, has_aux=True)(params)


@pytest.mark.parametrize("fused", [False, True], ids=["chunked", "fused"])
@pytest.mark.parametrize("family_name,weighted_part,model_fields", [
    ("encoder_decoder", False, dict(tie_output=False, mask_padding_logit=True)),
    ("decoder_only", False, {}), ("decoder_only", True, {})])
def test_chunks_give_the_whole_batch_loss_metrics_and_gradients(family_name, weighted_part,
                                                                model_fields, fused):
  """Tied (the decoder-only family's default) and untied output layers, label smoothing 0.1,
  padding weighing 0."""
  whole = _family(family_name, 0, **model_fields)
  params = whole.init_params(jax.random.PRNGKey(0))
  batch = _batch(whole, rows=4, weighted_part=weighted_part)
  (loss, sums), grads = _loss_and_grads(whole, params, batch)
  # Chunks of 5 positions: the lengths (28 targets, 52 decoder-only) end in a padded one.
  (chunked_loss, chunked_sums), chunked_grads = _loss_and_grads(
      _family(family_name, 5, fused=fused, **model_fields), params, batch)
  np.testing.assert_allclose(chunked_loss, loss, rtol=1e-5)
  assert chunked_sums["denominator"] == sums["denominator"]
  assert abs(chunked_sums["accuracy"] - sums["accuracy"]) <= 1  # an argmax tie may flip
  np.testing.assert_allclose(chunked_sums["loss"], sums["loss"], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               chunked_grads, grads)


def test_chunks_hold_a_fraction_of_the_logits_memory():
  # 8 rows x 28 target positions x 8,192 float32 logits: 7.3 MB at once, 1 MB in chunks of 4.
  temp_bytes = {}
  for chunk_length, fused in ((0, False), (4, False), (4, True)):
    family = _family("encoder_decoder", chunk_length, vocab_size=8192, fused=fused)
    params = family.init_params(jax.random.PRNGKey(0))
    batch = _batch(family, rows=8)
    compiled = jax.jit(lambda p, b, family=family: _traced_loss_and_grads(family, p, b)).lower(
        params, batch).compile()
    temp_bytes[chunk_length, fused] = compiled.memory_analysis().temp_size_in_bytes
  assert temp_bytes[4, False] < temp_bytes[0, False] / 3, temp_bytes
  assert temp_bytes[4, True] < temp_bytes[0, False] / 3, temp_bytes


def test_a_classifier_is_told_to_leave_the_chunks_off():
  config = make_tiny_config("unused")
  config.logits_chunk_length = 64
  assert config_validation.problems(config) == []
  config.task = "classification"
  assert any("a classifier has one output per row" in p
             for p in config_validation.problems(config))


def test_the_fused_loss_needs_chunks():
  config = make_tiny_config("unused")
  config.fused_loss = True
  assert any("config.fused_loss needs config.logits_chunk_length" in p
             for p in config_validation.problems(config))
  config.logits_chunk_length = 16
  assert config_validation.problems(config) == []


@pytest.mark.parametrize("fused", [False, True], ids=["chunked", "fused"])
def test_chunks_over_a_frozen_int8_table_give_the_adapters_gradients(fused):
  """A QLoRA run's output layer: the tied table int8 (quantization.embeddings) and frozen,
  closed over as train_step's LoRA loss holds it. The fused loss takes no gradient of it (an
  int8 table has none; a float one would cost a [vocab, emb] float32 sum), and the adapters'
  gradients equal the whole batch's."""
  lora = dict(rank=4, targets="all", base_dtype="int8")
  families_by_chunk = {}
  for chunk_length in (0, 5):
    config = _family("decoder_only", chunk_length, fused=fused and chunk_length > 0).config
    config.lora.update(lora)
    config.quantization.embeddings = True
    families_by_chunk[chunk_length] = families.get(config)
  whole = families_by_chunk[0]
  adapters, base = lora_lib.split(whole.init_params(jax.random.PRNGKey(0)))
  adapters = jax.tree.map(lambda x: x + 0.1, adapters)  # b != 0: every adapter has gradient
  frozen = whole.frozen_base(base)
  assert any(isinstance(leaf, quantization.Int8Table)
             for leaf in jax.tree.leaves(frozen, is_leaf=quantization.is_quantized))
  batch = _batch(whole, rows=4)
  results = [_loss_and_grads(family, lora_lib.combine(adapters, frozen), batch, adapters)
             for family in families_by_chunk.values()]
  (loss, _), grads = results[0]
  (chunked_loss, _), chunked_grads = results[1]
  np.testing.assert_allclose(chunked_loss, loss, rtol=1e-5)
  assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(grads))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               chunked_grads, grads)
