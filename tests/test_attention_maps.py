"""Attention heatmaps: the weights and tokens of each attention kind, drawing, TensorBoard."""

import os
import re

import jax
import ml_collections
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from transformer_jax import attention_maps
from transformer_jax import config_validation
from transformer_jax import families
from transformer_jax import summary_writer
from transformer_jax import tokenizer as tokenizer_lib
from transformer_jax.model import models

CONFIG = models.TransformerConfig(vocab_size=40, emb_dim=16, num_heads=2, num_layers=2,
                                  qkv_dim=16, mlp_dim=32, max_len=16)
PROMPT = np.array([5, 9, 12, 1])  # SOURCE <eos>
OUTPUT = np.array([7, 8, 1, 0, 0])  # generated ids, EOS included, then padding


def _maps(architecture, **overrides):
  family = families.from_model_config(architecture, CONFIG.replace(**overrides))
  params = family.init_params(jax.random.PRNGKey(0))
  return attention_maps.collect(family, params, PROMPT, OUTPUT)


def test_encoder_decoder_maps_carry_each_kinds_tokens():
  maps = _maps("encoder_decoder")
  assert [(m.kind, m.layer) for m in maps] == [
      ("encoder_self", 0), ("encoder_self", 1), ("decoder_self", 0), ("decoder_self", 1),
      ("cross", 0), ("cross", 1)]
  by_kind = {m.kind: m for m in maps}
  output = [7, 8, 1]  # padding after EOS dropped
  assert (by_kind["encoder_self"].query_ids, by_kind["encoder_self"].key_ids) == (
      [5, 9, 12, 1], [5, 9, 12, 1])
  # Decoder queries are labelled with the token each predicts; keys with what it reads.
  assert (by_kind["decoder_self"].query_ids, by_kind["decoder_self"].key_ids) == (
      output, [CONFIG.bos_id, 7, 8])
  assert (by_kind["cross"].query_ids, by_kind["cross"].key_ids) == (output, [5, 9, 12, 1])
  for m in maps:
    assert m.weights.shape == (2, len(m.query_ids), len(m.key_ids))
    np.testing.assert_allclose(m.weights.sum(-1), 1.0, rtol=1e-5)
  causal = by_kind["decoder_self"].weights
  assert np.all(causal[:, np.triu_indices(3, 1)[0], np.triu_indices(3, 1)[1]] == 0)


def test_decoder_only_and_classifier_maps():
  (first, second) = _maps("decoder_only")
  sequence = [5, 9, 12, 1, 7, 8, 1]  # SOURCE <eos> TARGET <eos>, as in training
  assert (first.kind, first.query_ids, first.key_ids) == (
      "decoder_self", sequence, [CONFIG.bos_id] + sequence[:-1])
  assert second.weights.shape == (2, 7, 7)
  maps = _maps("encoder_classifier", num_classes=3)
  assert [(m.kind, m.query_ids) for m in maps] == [("encoder_self", [5, 9, 12, 1])] * 2


def test_chosen_layers_and_heads_count_from_the_end():
  maps = _maps("encoder_decoder", num_decoder_layers=1)
  choice = ml_collections.ConfigDict(dict(layers=(-1, 1), heads=(0, -1)))
  pairs = attention_maps.chosen(maps, choice)
  # Layer 1 of the 2-layer encoder; the 1-layer decoder's last layer (-1), and no layer 1.
  assert [(m.kind, m.layer, head) for m, head in pairs] == [
      ("encoder_self", 1, 0), ("encoder_self", 1, 1), ("decoder_self", 0, 0),
      ("decoder_self", 0, 1), ("cross", 0, 0), ("cross", 0, 1)]
  assert attention_maps.tag(*pairs[-1]) == "attention/cross/layer_0/head_1"


def _png_size(png):
  assert png[:8] == b"\x89PNG\r\n\x1a\n"
  return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


@pytest.fixture(scope="module")
def tokenizer():
  return tokenizer_lib.train_tokenizer(["ein Haus am See", "a house by the lake"] * 50, 40)


def test_id_to_piece_names_reserved_and_learned_pieces(tokenizer):
  assert [tokenizer.id_to_piece(i) for i in (0, 1, 2)] == ["<pad>", "</s>", "<s>"]
  ids = tokenizer.encode("Haus")
  assert "".join(tokenizer.id_to_piece(i) for i in ids) == "▁Haus"


def test_images_reach_tensorboard_as_pngs(tmp_path, tokenizer):
  maps = _maps("encoder_decoder")
  choice = ml_collections.ConfigDict(dict(layers=(0,), heads=(1,)))
  images = attention_maps.tensorboard_images(maps, choice, tokenizer)
  assert sorted(images) == ["attention/cross/layer_0/head_1",
                            "attention/decoder_self/layer_0/head_1",
                            "attention/encoder_self/layer_0/head_1"]
  writer = summary_writer.EventFileWriter(str(tmp_path))
  writer.write_pngs(7, images)
  writer.close()
  accumulator = event_accumulator.EventAccumulator(
      str(tmp_path), size_guidance={event_accumulator.IMAGES: 0})
  accumulator.Reload()
  assert sorted(accumulator.Tags()["images"]) == sorted(images)
  (event,) = accumulator.Images("attention/cross/layer_0/head_1")
  assert event.step == 7
  assert (event.width, event.height) == _png_size(event.encoded_image_string)
  assert event.encoded_image_string == images["attention/cross/layer_0/head_1"]


def test_one_png_holds_every_chosen_map(tokenizer):
  maps = _maps("encoder_decoder")
  one = attention_maps.draw(attention_maps.chosen(maps, ml_collections.ConfigDict(
      dict(layers=(0,), heads=(0,)))), tokenizer)
  grid = attention_maps.draw(attention_maps.chosen(maps, ml_collections.ConfigDict(
      dict(layers=(0, 1), heads=(0, 1)))), tokenizer)
  (w1, h1), (w2, h2) = _png_size(one), _png_size(grid)
  assert w2 == pytest.approx(2 / 1 * w1, rel=0.05)  # two heads side by side
  assert h2 == pytest.approx(6 / 3 * h1, rel=0.05)  # 3 kinds x 2 layers, over 3 x 1
  with pytest.raises(ValueError, match="No attention map chosen"):
    attention_maps.draw([], tokenizer)


@pytest.mark.parametrize("images, message", [
    (dict(layers=(1,)), "layers (1,) / heads (0,) are out of range for 1 layers and 2 heads"),
    (dict(heads=(2,)), "layers (-1,) / heads (2,) are out of range"),
    (dict(layers=("last",)), "must be tuples of ints"),
])
def test_config_refuses_attention_images_out_of_range(tiny_config, images, message):
  tiny_config.attention_images.update(dict(layers=(-1,), heads=(0,)))
  tiny_config.attention_images.update(images)
  with pytest.raises(config_validation.ConfigError, match=re.escape(message)):
    config_validation.validate(tiny_config)
