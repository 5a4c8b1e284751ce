"""Beams that share their cache slots (issue #42): beam search reorders its hypotheses by
moving each row's slot offsets (kv_cache.reorder_beams), not every layer's keys and values,
and attention reads each row's slots where its hypothesis wrote them. The outputs are those of
beams that each carry a whole cache of their own."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import hf_fixtures
from transformer_jax import families
from transformer_jax.inference import generate
from transformer_jax.model import attention
from transformer_jax.model import beam_attention
from transformer_jax.model import kv_cache

transformers = pytest.importorskip("transformers")


def _holders(rng, sources: int, beams: int, length: int) -> np.ndarray:
  """Random slot offsets [sources * beams, length]: each slot held by a row of its source."""
  holder = rng.integers(0, beams, (sources, beams, length))
  return (holder - np.arange(beams)[None, :, None]).reshape(sources * beams, length)


@pytest.mark.parametrize("heads, kv_heads, with_bias, softcap, prompt_len", [
    (4, 4, False, None, 0), (4, 2, True, None, 0), (6, 1, False, 5.0, 0),
    (4, 2, True, None, 3), (6, 1, False, 5.0, 3)])
def test_beam_attention_is_attention_over_each_rows_own_slots(heads, kv_heads, with_bias,
                                                              softcap, prompt_len):
  """Against the reference attention over the keys/values copied to each row (beam_slots):
  plain and grouped heads, a per-head bias, a soft cap, a padding and causal mask; with a
  prompt (its slots alike in every beam of a source, of a length per source), the decoded
  slots passed apart."""
  rng = np.random.default_rng(0)
  sources, beams, length, dim = 3, 4, 7, 8
  rows = sources * beams
  prompt_lengths = np.maximum(np.array([prompt_len, prompt_len - 2, prompt_len - 1]), 0)
  query = jnp.asarray(rng.normal(size=(rows, 1, heads, dim)), jnp.float32)
  key, value = (rng.normal(size=(rows, length, kv_heads, dim)) for _ in range(2))
  for x in (key, value):  # each source's prompt, alike in its beams' rows
    x[:, :prompt_len] = np.repeat(x[::beams, :prompt_len], beams, axis=0)
  key, value = (jnp.asarray(x, jnp.float32) for x in (key, value))
  slot_rows = jnp.asarray(_holders(rng, sources, beams, length))
  mask = np.arange(length)[None, None, None, :] < np.repeat(
      rng.integers(2, length + 1, sources), beams)[:, None, None, None]
  bias = (jnp.asarray(rng.normal(size=(1, heads, 1, length)), jnp.float32) if with_bias
          else None)
  decoded = None
  if prompt_len:
    # Row r's decoded slot t is its slot prompt_length[r] + t; as `with_beam_slots` keeps
    # them: [sources, beams, n, d, slots]. Slots past the last decoded one are never read.
    slots = length - prompt_len
    prompt_length = np.repeat(prompt_lengths, beams)
    taken = prompt_length[:, None] + np.arange(slots)[None, :]  # [rows, slots]
    decoded = tuple(jnp.transpose(jnp.take_along_axis(x, jnp.asarray(taken)[..., None, None],
                                                      axis=1), (0, 2, 3, 1)).reshape(
        sources, beams, kv_heads, dim, slots) for x in (key, value))
    decoded += (jnp.asarray(prompt_length, jnp.int32),)
    mask = mask & (np.arange(length) < (prompt_length + slots)[:, None, None, None])
  mask = jnp.asarray(mask)
  got = beam_attention.beam_attention(query, key, value, mask, slot_rows, beams, bias=bias,
                                 softcap=softcap, decoded=decoded)
  want = attention.dot_product_attention(
      query, kv_cache.beam_slots(key, slot_rows), kv_cache.beam_slots(value, slot_rows),
      mask, bias=bias, softcap=softcap)
  np.testing.assert_allclose(got, want, atol=1e-6)
  # Not vacuous: the rows' own slots give other outputs.
  assert np.abs(np.asarray(attention.dot_product_attention(query, key, value, mask, bias=bias,
                                                           softcap=softcap)) - want).max() > 0.1


def test_reorder_beams_moves_slot_offsets_and_leaves_keys_and_values():
  rng = np.random.default_rng(1)
  rows, length = 6, 5  # two sources of three beams
  cache = {"layer": {"cached_key": jnp.asarray(rng.normal(size=(rows, 2, 3, length))),
                     "cached_value": jnp.asarray(rng.normal(size=(rows, 2, 3, length))),
                     "cache_index": jnp.array([3, 3, 3, 4, 4, 4]),
                     "slot_rows": jnp.asarray(_holders(rng, 2, 3, length))},
           "cached_positions": jnp.asarray(rng.integers(0, 9, (rows, length)))}
  parents = jnp.array([2, 2, 0, 4, 3, 3])  # row r goes on with row parents[r]'s hypothesis
  new = kv_cache.reorder_beams(cache, parents)
  for name in ("cached_key", "cached_value"):
    assert new["layer"][name] is cache["layer"][name]
  np.testing.assert_array_equal(new["cached_positions"], cache["cached_positions"][parents])
  np.testing.assert_array_equal(new["layer"]["cache_index"],
                                cache["layer"]["cache_index"][parents])
  # Row r now reads slot s where its parent read it.
  held = np.arange(rows)[:, None] + np.asarray(new["layer"]["slot_rows"])
  parent_held = (np.asarray(parents)[:, None] + np.asarray(cache["layer"]["slot_rows"])[parents])
  np.testing.assert_array_equal(held, parent_held)


def _whole_cache_beams(monkeypatch, family):
  """Beam search as before shared slots: the callback without `beams`, every leaf of the cache
  gathered per step."""
  start_decoding, search = family.runner.start_decoding, generate.search
  monkeypatch.setattr(family.runner, "start_decoding",
                      lambda params, inputs, rows, max_len, packing=None, beams=1:
                      start_decoding(params, inputs, rows, max_len, packing))
  monkeypatch.setattr(generate, "search",
                      lambda *args, reorder_cache=None, expand_beams=None, **kwargs:
                      search(*args, **kwargs))


def _compare_with_whole_cache_beams(monkeypatch, family, params, prompts, decoding_config,
                                    layout=None):
  """The 4-best outputs and scores of `prompts` with shared slots, then with whole caches."""
  results = []
  for shared in (True, False):
    if not shared:
      _whole_cache_beams(monkeypatch, family)
    generator = generate.Generator(family, layout)  # compiles anew
    results.append(generator.output_ids(params, prompts, 4, decoding_config, with_scores=True))
  for got, want in zip(*results):  # per prompt, (ids, score) of each of its 4 best
    assert [ids.tolist() for ids, _ in got] == [ids.tolist() for ids, _ in want]
    np.testing.assert_allclose([s for _, s in got], [s for _, s in want], rtol=1e-5, atol=1e-5)
  # Not vacuous: the hypotheses differ, and so the beams were reordered.
  assert len({tuple(ids.tolist()) for ids, _ in results[0][0]}) > 1


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  return hf_fixtures.folder_maker(tmp_path_factory)


# Learned positions (GPT-2), grouped heads with rotary positions and a window shorter than the
# prompts (Mistral); the encoder-decoder family is the from-scratch case below, and
# beam_attention's bias and soft cap are tested above.
@pytest.mark.parametrize("kind", ["gpt2", "mistral"])
def test_imported_models_search_beams_as_with_whole_caches(kind, folders, monkeypatch):
  from transformer_jax.predict import Predictor  # pylint: disable=g-import-not-at-top
  predictor = Predictor.from_pretrained(folders(kind))
  texts = hf_fixtures.model_sentences("en")[:5]
  prompts = [predictor.family.prompt(ids) for ids in predictor.tokenizer.encode_batch(texts)]
  decoding = predictor.decoding_config(method="beam", beam_size=4, max_decode_len=8,
                                       min_length=7)
  _compare_with_whole_cache_beams(monkeypatch, predictor.family, predictor.device_params,
                                  prompts, decoding, predictor.layout)


# Learned cross-attention scores beside the shared slots; a prefix LM with relative positions.
@pytest.mark.parametrize("architecture, options", [
    ("encoder_decoder", dict(cross_attention_score="additive")),
    ("decoder_only", dict(prefix_lm=True, position_embedding="relative"))])
def test_from_scratch_models_search_beams_as_with_whole_caches(architecture, options,
                                                               tiny_config, monkeypatch):
  tiny_config.architecture = architecture
  tiny_config.model.update(options)
  family = families.get(tiny_config)
  params = family.init_params(jax.random.PRNGKey(0))
  prompts = [np.random.default_rng(row).integers(3, 60, 3 + row).astype(np.int32)
             for row in range(3)]
  decoding = tiny_config.decoding
  decoding.update(method="beam", beam_size=4, max_decode_len=8, min_length=7)
  layout = generate.Generator(family).layout
  _compare_with_whole_cache_beams(monkeypatch, family, layout.place_params(
      params, jax.eval_shape(lambda: family.init_params(jax.random.PRNGKey(0), boxed=True))),
      prompts, decoding, layout)


def test_the_compiled_beam_search_writes_its_caches_in_place(tiny_config):
  """Issue #42's check of the optimized HLO: the search loop copies no key or value buffer.
  (Read through a reshape, the decoded slots of `with_beam_slots` were written twice a step,
  each time on a copy of the whole buffer.)"""
  tiny_config.architecture = "decoder_only"
  family = families.get(tiny_config)
  params = family.init_params(jax.random.PRNGKey(0))
  decoding = tiny_config.decoding
  decoding.update(method="beam", beam_size=4, max_decode_len=8)
  prompts = jnp.asarray(np.random.default_rng(0).integers(3, 60, (2, 5)), jnp.int32)
  hlo = jax.jit(lambda p, x: family.decode(p, x, jax.random.PRNGKey(0),
                                           decoding_config=decoding)).lower(
                                               params, prompts).compile().as_text()
  def body(name):  # a loop body's own instructions, not its fusions'
    loop = hlo[hlo.index(f"\n%{name} "):]
    return loop[:loop.index("\n}")]

  # The search loop: the longest loop body (XLA:CPU makes each row's cache write, a scatter,
  # a small loop of its own).
  loop = max((body(name) for name in re.findall(r" while\(.*body=%([\w.-]+)", hlo)), key=len)
  # The decoded slots, [sources, beams, heads, head dim, slots], are written there...
  assert re.search(r"= \(?[^=]*f32\[2,4,\d+,\d+,8\]\{[\d,]+\}[^=]* (fusion|call)\(", loop)
  # ... and no buffer of four or more dimensions (a cache) is copied.
  copied = re.findall(r"= f32\[([\d,]+)\]\{[\d,]+\} copy\(", loop)
  assert not [shape for shape in copied if shape.count(",") >= 3], copied
