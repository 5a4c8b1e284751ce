"""Examples of a config's splits: from its one dataset, or from every part of a mixture."""

from __future__ import annotations

from typing import Sequence

import ml_collections

from transformer_jax.data import mixture
from transformer_jax.data import sources


def load_examples(config: ml_collections.ConfigDict,
                  splits: Sequence[str] = sources.SPLITS) -> dict[str, list[dict]]:
  """{split: [example, ...]} for each of `splits`: {'source', 'target'} (translation,
  summarization, multitask) or {'source', 'label'} (classification) dicts."""
  sources.check_splits(splits)
  if config.task == "multitask":
    return mixture.load_examples(config, splits)
  return sources.load_examples(config, splits)
