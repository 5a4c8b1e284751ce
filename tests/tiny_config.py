"""The tests' tiny demo config as a config file, for runs of the command line:

  --config tests/tiny_config.py:CACHE_DIR
"""

from tests.conftest import make_tiny_config


def get_config(cache_dir):
  return make_tiny_config(cache_dir)
