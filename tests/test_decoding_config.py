"""The `decoding` config keys: each bad value is one clear ConfigError before any work."""

import pytest

from configs import demo
from transformer_jax import config_validation


def test_the_defaults_are_valid():
  config = demo.get_config()
  assert config_validation.problems(config) == []
  config.decoding.update(num_decodes=8, min_length=3, max_decode_len=20, banned_ids=(0, 511),
                         repetition_penalty=1.3, temperature=0.0, top_p=1.0)
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
])
def test_bad_decoding_settings_are_one_line_errors(settings, message):
  config = demo.get_config()
  config.decoding.update(settings)
  with pytest.raises(config_validation.ConfigError) as raised:
    config_validation.validate(config)
  assert message in str(raised.value) and "\n" not in str(raised.value)
  assert len(config_validation.problems(config)) == 1
