"""Where examples come from, selected by `config.dataset`: 'demo', 'local', 'tfds' or
'huggingface'.

An example is a dict: {'source': str, 'target': str} for translation and summarization,
{'source': str, 'label': int} for classification.
"""

from __future__ import annotations

import itertools
import os
from typing import Iterable, Sequence

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


def _local_reader(config: ml_collections.ConfigDict, split: str):
  """A function that reads `split` of the local dataset: an iterator (parallel, jsonl files)
  or a list."""
  if not config.data_dir:
    raise ValueError("config.dataset='local' needs the dataset folder: --config.data_dir=PATH.")
  if not os.path.isdir(config.data_dir):
    raise FileNotFoundError(f"config.data_dir={config.data_dir!r} is not a folder.")
  local, data_dir, name = config.local, config.data_dir, config.splits[split]
  readers_by_format = {
      "parallel": lambda: readers.iter_parallel(data_dir, name, local.source_lang,
                                                local.target_lang),
      "jsonl": lambda: readers.iter_jsonl(data_dir, name, local.source_field, local.target_field,
                                          local.get("messages_field", "")),
      "tsv": lambda: readers.read_tsv(data_dir, name, local.text_column, local.label_column),
      "label_lines": lambda: readers.read_label_lines(data_dir, name, local.text_file,
                                                      local.label_file),
      "label_files": lambda: readers.read_label_files(data_dir, local.label_files,
                                                      local.encoding, config.data_seed)[split],
  }
  if local.format not in readers_by_format:
    raise ValueError(f"Unknown config.local.format={local.format!r}; use one of "
                     f"{sorted(readers_by_format)}.")
  return readers_by_format[local.format]


def load_examples(config: ml_collections.ConfigDict,
                  splits: Sequence[str] = SPLITS) -> dict[str, list[dict]]:
  """{split: [example, ...]} for each of `splits`, from the one source `config.dataset`
  names (a multitask mixture reads each of its parts through here: see examples.py)."""
  check_splits(splits)
  if config.dataset == "demo":
    return _demo(config, splits)
  if config.dataset == "local":
    return {split: list(_local_reader(config, split)()) for split in splits}
  if config.dataset == "tfds":
    from transformer_jax.data import tfds_source  # pylint: disable=g-import-not-at-top
    return {split: list(tfds_source.stream(config, split)[0]) for split in splits}
  if config.dataset == "huggingface":
    from transformer_jax.data import hf_source  # pylint: disable=g-import-not-at-top
    return {split: list(hf_source.stream(config, split)[0]) for split in splits}
  raise ValueError(f"Unknown config.dataset={config.dataset!r}; use 'demo', 'local', 'tfds' or "
                   "'huggingface'.")


def check_dataset(config: ml_collections.ConfigDict, splits: Sequence[str]) -> None:
  """Opens a Hugging Face dataset's `splits` and checks the fields the task reads, and takes
  the class names of a ClassLabel column: before a run writes anything, a wrong name, split or
  column is one line; for TFDS, that it is installed. The other sources are checked as they
  are read."""
  if config.dataset == "tfds":
    from transformer_jax.data import tfds_source  # pylint: disable=g-import-not-at-top
    tfds_source.check_installed()
  if config.dataset == "huggingface":
    from transformer_jax.data import directions  # pylint: disable=g-import-not-at-top
    from transformer_jax.data import hf_source  # pylint: disable=g-import-not-at-top
    for _, _, one in directions.configs(config):  # each direction's columns
      hf_source.check(one, splits)
    hf_source.apply_label_names(config)


def shard_of(examples: Sequence[dict], shard_index: int, shard_count: int
             ) -> tuple[Iterable[dict], int]:
  """Examples shard_index, shard_index + shard_count, ... of a list, and how many."""
  return (itertools.islice(examples, shard_index, None, shard_count),
          len(range(shard_index, len(examples), shard_count)))


def stream(config: ml_collections.ConfigDict, split: str, shard_index: int = 0,
           shard_count: int = 1) -> tuple[Iterable[dict], int | None]:
  """One shard of `split`: examples shard_index, shard_index + shard_count, ... in the
  source's order, read as they are asked for where the source allows it (local parallel and
  jsonl files, TFDS, Hugging Face datasets), and how many there are (None when that is not known up front)."""
  check_splits([split])
  if config.dataset == "tfds":
    from transformer_jax.data import tfds_source  # pylint: disable=g-import-not-at-top
    return tfds_source.stream(config, split, shard_index, shard_count)
  if config.dataset == "huggingface":
    from transformer_jax.data import hf_source  # pylint: disable=g-import-not-at-top
    return hf_source.stream(config, split, shard_index, shard_count)
  if config.dataset == "local" and config.local.format in ("parallel", "jsonl"):
    read = _local_reader(config, split)
    total = None
    if config.local.format == "parallel":  # line counts are cheap; jsonl skips blank lines
      path = readers.find_file(config.data_dir,
                               f"{config.splits[split]}.{config.local.source_lang}")
      total = len(range(shard_index, readers.count_lines(path), shard_count))
    return itertools.islice(read(), shard_index, None, shard_count), total
  return shard_of(load_examples(config, [split])[split], shard_index, shard_count)
