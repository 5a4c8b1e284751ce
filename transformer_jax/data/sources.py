"""Where text pairs come from, selected by `config.dataset`."""

from __future__ import annotations

import os

import ml_collections

from transformer_jax.data import demo

SPLITS = ("train", "validation", "test")


def default_cache_dir() -> str:
  return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                      "transformer_jax")


def load_pairs(config: ml_collections.ConfigDict) -> dict[str, list[tuple[str, str]]]:
  """{'train' | 'validation' | 'test': [(source, target), ...]} for `config.dataset`."""
  if config.dataset == "demo":
    d = config.demo
    return demo.load_or_generate(d.cache_dir or default_cache_dir(), d.num_train,
                                 d.num_validation, d.num_test, d.seed)
  raise ValueError(f"Unknown config.dataset={config.dataset!r}; available: 'demo'.")
