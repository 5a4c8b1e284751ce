"""Where examples come from, selected by `config.dataset`: 'demo', 'local' or 'tfds'.

An example is a dict: {'source': str, 'target': str} for translation and summarization,
{'source': str, 'label': int} for classification.
"""

from __future__ import annotations

import os
from typing import Sequence

import ml_collections

from transformer_jax.data import demo
from transformer_jax.data import readers

SPLITS = ("train", "validation", "test")


def check_splits(splits: Sequence[str]) -> None:
  unknown = set(splits) - set(SPLITS)
  if unknown:
    raise ValueError(f"Unknown split(s) {sorted(unknown)}; use {SPLITS}.")


def default_cache_dir() -> str:
  return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                      "transformer_jax")


def _demo(config: ml_collections.ConfigDict, splits: Sequence[str]) -> dict[str, list[dict]]:
  d = config.demo
  pairs = demo.load_or_generate(d.cache_dir or default_cache_dir(), d.num_train,
                                d.num_validation, d.num_test, d.seed)
  return {split: [{"source": s, "target": t} for s, t in pairs[split]] for split in splits}


def _local(config: ml_collections.ConfigDict, splits: Sequence[str]) -> dict[str, list[dict]]:
  if not config.data_dir:
    raise ValueError("config.dataset='local' needs the dataset folder: --config.data_dir=PATH.")
  if not os.path.isdir(config.data_dir):
    raise FileNotFoundError(f"config.data_dir={config.data_dir!r} is not a folder.")
  local, data_dir = config.local, config.data_dir
  if local.format == "label_files":
    every_split = readers.read_label_files(data_dir, local.label_files, local.encoding,
                                           config.data_seed)
    return {split: every_split[split] for split in splits}
  readers_by_format = {
      "parallel": lambda f: readers.read_parallel(data_dir, f, local.source_lang,
                                                  local.target_lang),
      "jsonl": lambda f: readers.read_jsonl(data_dir, f, local.source_field, local.target_field),
      "tsv": lambda f: readers.read_tsv(data_dir, f, local.text_column, local.label_column),
      "label_lines": lambda f: readers.read_label_lines(data_dir, f, local.text_file,
                                                        local.label_file),
  }
  if local.format not in readers_by_format:
    raise ValueError(f"Unknown config.local.format={local.format!r}; use one of "
                     f"{sorted(readers_by_format) + ['label_files']}.")
  return {split: readers_by_format[local.format](config.splits[split]) for split in splits}


def load_examples(config: ml_collections.ConfigDict,
                  splits: Sequence[str] = SPLITS) -> dict[str, list[dict]]:
  """{split: [example, ...]} for each of `splits`, from the one source `config.dataset`
  names (a multitask mixture reads each of its parts through here: see examples.py)."""
  check_splits(splits)
  if config.dataset == "demo":
    return _demo(config, splits)
  if config.dataset == "local":
    return _local(config, splits)
  if config.dataset == "tfds":
    from transformer_jax.data import tfds_source  # pylint: disable=g-import-not-at-top
    return tfds_source.load_examples(config, splits)
  raise ValueError(f"Unknown config.dataset={config.dataset!r}; use 'demo', 'local' or 'tfds'.")
