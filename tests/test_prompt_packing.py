"""Prompts packed for the prefill (transformer_jax/prompt_packing.py, issue #42): the plan
keeps every prompt whole and apart, and packed decoding gives the ids of unpacked decoding for
every position scheme and attention variant the imports bring."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest

from tests import hf_fixtures
from transformer_jax.inference import prompt_packing
from transformer_jax.predict import Predictor

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("parts", [1, 2])
def test_the_plan_keeps_prompts_whole_apart_and_rows_few(parts):
  rng = np.random.default_rng(0)
  lengths = list(rng.integers(1, 30, 48)) + [0] * 16  # 48 prompts in a 64-row bucket
  lengths = [lengths[i] for i in rng.permutation(64)]  # and the empty rows in both parts
  places, packed_rows = prompt_packing.place(lengths, parts, 32)
  per_part = 64 // parts
  assert packed_rows % (per_part // 4) == 0 and packed_rows < per_part
  for part in range(parts):
    used = np.zeros((packed_rows, 32), int)
    for row in range(part * per_part, (part + 1) * per_part):
      packed_row, first = places[row]
      assert first + lengths[row] <= 32
      used[packed_row, first:first + lengths[row]] += 1
    assert used.max() == 1  # no two prompts share a slot
    assert used.sum() == sum(lengths[part * per_part:(part + 1) * per_part])


def test_side_by_side_puts_each_parts_prompts_one_after_the_other():
  places = prompt_packing.side_by_side([3, 0, 5, 2, 4, 4], parts=2, width=10)
  np.testing.assert_array_equal(places, [[0, 0], [0, 3], [0, 3], [0, 0], [0, 2], [0, 6]])
  assert prompt_packing.side_by_side([3, 0, 5, 2, 4, 4], parts=2, width=9) is None  # 10 > 9


def test_few_rows_or_long_prompts_are_not_packed():
  assert prompt_packing.place([3] * 4, 1, 8) == (None, 0)  # under MIN_ROWS
  assert prompt_packing.place([7] * 16, 1, 8) == (None, 0)  # one prompt per row anyway


def _right_padded(lengths, width: int) -> np.ndarray:
  """[len(lengths), width] random token ids (3 to 199), each row `lengths[row]` long."""
  rng = np.random.default_rng(2)
  tokens = np.zeros((len(lengths), width), np.int32)
  for row, n in enumerate(lengths):
    tokens[row, :n] = rng.integers(3, 200, n)
  return tokens


def test_unpack_returns_each_prompt_from_its_place():
  lengths = np.random.default_rng(1).integers(1, 9, 16)
  tokens = _right_padded(lengths, 8)
  places, packed_rows = prompt_packing.place(list(lengths), 1, 8)
  packed, segments, positions = prompt_packing.pack(jnp.asarray(tokens), jnp.asarray(places),
                                                    packed_rows)
  assert packed.shape == (packed_rows, 8) and int((np.asarray(packed) != 0).sum()) == sum(lengths)
  # The positions restart at 0 in each segment, one segment per prompt.
  for row, n in enumerate(lengths):
    packed_row, first = places[row]
    assert (np.asarray(segments)[packed_row, first:first + n] == row + 1).all()
    assert (np.asarray(positions)[packed_row, first:first + n] == np.arange(n)).all()
  back = prompt_packing.unpack(packed, jnp.asarray(places), jnp.asarray(tokens != 0))
  np.testing.assert_array_equal(back, tokens)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  return hf_fixtures.folder_maker(tmp_path_factory)


# Relative bias (T5), sinusoidal positions over non-pad tokens (M2M100), learned positions
# (GPT-2), rotary positions with a sliding window shorter than the prompts (Mistral), a window
# on alternate layers, q/k norms, local RoPE bases and a final soft cap (Gemma 3).
@pytest.mark.parametrize("kind", ["t5", "m2m_100", "gpt2", "mistral", "gemma3_text"])
def test_packed_prompts_decode_as_unpacked(kind, folders, monkeypatch, caplog):
  predictor = Predictor.from_pretrained(folders(kind))
  sentences = hf_fixtures.model_sentences("en", 200)
  limit = predictor.config.max_source_length
  texts = [t for t in sorted(sentences, key=len) if len(predictor.tokenizer.encode(t)) < limit]
  texts = texts[::max(1, len(texts) // 16)][:16]  # 16 prompts, short to long
  prompts = [predictor.family.prompt(ids) for ids in predictor.tokenizer.encode_batch(texts)]
  decoding = predictor.decoding_config(method="greedy", max_decode_len=8)
  with caplog.at_level(logging.INFO):
    packed = predictor.output_ids(prompts, decoding_config=decoding)
  assert "prompts packed in" in caplog.text  # not vacuous: this call packed them
  monkeypatch.setattr(prompt_packing, "place", lambda *args: (None, 0))
  unpacked = predictor.output_ids(prompts, decoding_config=decoding)
  assert [p.tolist() for p in packed] == [u.tolist() for u in unpacked]
  assert len({tuple(p.tolist()) for p in packed}) > 1


@pytest.mark.parametrize("architecture, options", [
    ("decoder_only", dict(prefix_lm=True)),
    ("decoder_only", dict(position_embedding="rope", sliding_window=4)),
    ("decoder_only", dict(position_embedding="relative")),
    ("decoder_only", dict(position_embedding="learned")),
    ("encoder_decoder", dict(position_embedding="sinusoidal"))])
def test_a_packed_prefill_gives_the_logits_of_an_unpacked_one(architecture, options,
                                                              tiny_config):
  """From-scratch models (random weights) of each position scheme, a prefix LM, and a window
  shorter than the prompts: the first decoding steps' logits after a packed prefill are those
  after an unpacked one (moving every position by one changes them by 0.03 to 2)."""
  import jax  # pylint: disable=g-import-not-at-top
  from transformer_jax import families  # pylint: disable=g-import-not-at-top
  tiny_config.architecture = architecture
  tiny_config.model.update(options)
  family = families.get(tiny_config)
  params = family.init_params(jax.random.PRNGKey(0))
  lengths = np.random.default_rng(1).integers(2, 12, 16)
  inputs = _right_padded(lengths, 16)
  places, packed_rows = prompt_packing.place(list(lengths), 1, 16)
  assert packed_rows == 8
  logits = []
  for packing in (None, (jnp.asarray(places), packed_rows)):
    cache, context, start = jax.jit(
        lambda p, x, packing=packing: family.runner.prefill(p, x, 16, 6, packing))(params, inputs)
    step = jax.jit(family.runner.step_logits(params, context))
    ids, steps = jnp.full((16, 1), start, jnp.int32), []
    for _ in range(3):
      step_logits, cache = step(ids, cache)
      steps.append(np.asarray(step_logits))
      ids = jnp.argmax(step_logits, -1)[:, None].astype(jnp.int32)
    logits.append(np.stack(steps))
  np.testing.assert_allclose(logits[1], logits[0], atol=1e-5)
