"""Examples of a config's splits: from its one dataset, or from every part of a mixture."""

from __future__ import annotations

from typing import Iterable, Sequence

import ml_collections

from transformer_jax import tasks
from transformer_jax.data import directions
from transformer_jax.data import mixture
from transformer_jax.data import sources


def load_examples(config: ml_collections.ConfigDict,
                  splits: Sequence[str] = sources.SPLITS) -> dict[str, list[dict]]:
  """{split: [example, ...]} for each of `splits`: {'source', 'target'} (translation,
  summarization, multitask) or {'source', 'label'} (classification) dicts."""
  sources.check_splits(splits)
  if tasks.is_mixture(config.task):
    return mixture.load_examples(config, splits)
  if directions.pairs(config):  # every direction's examples, one direction after another
    loaded = {split: [] for split in splits}
    for source, target, one in directions.configs(config):
      for split, examples in sources.load_examples(one, splits).items():
        loaded[split] += directions.tag(examples, config, source, target)
    return loaded
  return sources.load_examples(config, splits)


def stream(config: ml_collections.ConfigDict, split: str, shard_index: int = 0,
           shard_count: int = 1) -> tuple[Iterable[dict], int | None]:
  """Examples shard_index, shard_index + shard_count, ... of `split`, streamed where the source
  allows (see sources.stream), and how many (None when not known up front)."""
  if tasks.is_mixture(config.task) or directions.pairs(config):
    return sources.shard_of(load_examples(config, [split])[split], shard_index, shard_count)
  return sources.stream(config, split, shard_index, shard_count)
