"""The `decoding` config keys: each bad value is one clear ConfigError before any work, and
`generate.search` applies every setting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import demo
from transformer_jax import commands
from transformer_jax import config_validation
from transformer_jax import tokenizer as tokenizer_lib
from transformer_jax.inference import generate


def test_the_defaults_are_valid():
  config = demo.get_config()
  assert config_validation.problems(config) == []
  config.decoding.update(num_decodes=8, min_length=3, max_decode_len=20, banned_ids=(0, 511),
                         repetition_penalty=1.3, temperature=0.0, top_p=1.0,
                         no_repeat_ngram_size=3, forced_bos_id=511, forced_eos=True,
                         length_penalty="hf")
  assert config_validation.problems(config) == []


@pytest.mark.parametrize("settings, message", [
    (dict(top_p=0.0), "config.decoding.top_p=0.0 must be > 0 and <= 1"),
    (dict(top_p=1.5), "config.decoding.top_p=1.5 must be > 0 and <= 1"),
    (dict(temperature=-0.5), "config.decoding.temperature=-0.5 must be >= 0"),
    (dict(num_decodes=0), "config.decoding.num_decodes=0 must be >= 1"),
    (dict(min_length=-1), "config.decoding.min_length=-1 must be >= 0"),
    (dict(repetition_penalty=0.0), "config.decoding.repetition_penalty=0.0 must be > 0"),
    (dict(banned_ids=(3, -1)), "config.decoding.banned_ids=(3, -1) must be a tuple of token "
                               "ids >= 0"),
    (dict(banned_ids=(3, 512, 600)), "config.decoding.banned_ids [512, 600] are not below "
                                     "config.model.vocab_size=512"),
    (dict(min_length=8, max_decode_len=8), "config.decoding.min_length=8 leaves no room for "
                                           "EOS in config.decoding.max_decode_len=8 tokens"),
    (dict(no_repeat_ngram_size=-1), "config.decoding.no_repeat_ngram_size=-1 must be >= 0"),
    (dict(length_penalty="t5"), "config.decoding.length_penalty='t5' is not one of gnmt, hf"),
    (dict(forced_bos_id=-2), "config.decoding.forced_bos_id=-2 must be >= -1"),
    (dict(forced_bos_id=512), "config.decoding.forced_bos_id=512 is not below "
                              "config.model.vocab_size=512"),
])
def test_bad_decoding_settings_are_one_line_errors(settings, message):
  config = demo.get_config()
  config.decoding.update(settings)
  with pytest.raises(config_validation.ConfigError) as raised:
    config_validation.validate(config)
  assert message in str(raised.value) and "\n" not in str(raised.value)
  assert len(config_validation.problems(config)) == 1


@pytest.mark.parametrize("method", ["greedy", "beam", "sample"])
def test_search_applies_the_hugging_face_settings(method):
  decoding_config = demo.get_config().decoding
  decoding_config.update(method=method, beam_size=2, num_decodes=2, no_repeat_ngram_size=1,
                         forced_bos_id=5, forced_eos=True)
  # A model that never says EOS and would repeat 2.
  logits = jnp.array([-9.0, -30.0, 0.0, -0.5, -1.0, -1.5, -2.0, -2.5])
  tokens_to_logits = lambda ids, cache: (jnp.tile(logits, (ids.shape[0], 1)), cache)
  nbest = 1 if method == "greedy" else 2
  tokens, _ = generate.search({}, tokens_to_logits, jax.random.PRNGKey(0), start_id=2,
                              batch_size=2, decoding_config=decoding_config, max_len=5,
                              nbest=nbest)
  assert tokens.shape == (2, nbest, 5)
  for row in np.asarray(tokens).reshape(-1, 5):
    assert row[0] == 5 and row[-1] == tokenizer_lib.EOS_ID and len(set(row)) == 5
  if method != "sample":
    np.testing.assert_array_equal(tokens[:, 0], [[5, 2, 3, 4, 1]] * 2)


def test_search_ranks_beams_by_the_configured_length_penalty():
  decoding_config = demo.get_config().decoding
  decoding_config.update(method="beam", alpha=0.6, forced_eos=True)
  logits = jnp.array([-9.0, -30.0, 0.0, -0.5])
  tokens_to_logits = lambda ids, cache: (jnp.tile(logits, (ids.shape[0], 1)), cache)
  scores = {}
  for kind in ("gnmt", "hf"):
    decoding_config.length_penalty = kind
    _, scores[kind] = generate.search({}, tokens_to_logits, jax.random.PRNGKey(0), start_id=2,
                                      batch_size=1, decoding_config=decoding_config, max_len=4)
  # Every output has 4 tokens: divided by ((5 + 4) / 6) ** 0.6, or by 4 ** 0.6.
  np.testing.assert_allclose(scores["hf"] / scores["gnmt"], (1.5 / 4) ** 0.6, rtol=1e-5)
  assert commands.decoding_tag(decoding_config) == "beam4_alpha0.6_hf"
  decoding_config.length_penalty = "gnmt"
  assert commands.decoding_tag(decoding_config) == "beam4_alpha0.6"
