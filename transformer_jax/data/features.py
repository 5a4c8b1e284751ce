"""Examples -> token features for a model family (a feature converter, as t5x calls it): the
texts tokenized a chunk at a time, each example's features from the family's
`example_features`, gathered into Ragged arrays."""

from __future__ import annotations

import itertools
import time
from typing import Iterable

import numpy as np
from absl import logging

from transformer_jax import tokenizer as tokenizer_lib
from transformer_jax.data import pipeline
from transformer_jax.data import prompt_format

ENCODE_CHUNK = 100_000  # examples tokenized per batch call


class _Progress:
  """Logs encoding progress about every 10% of a split of more than a chunk, with an ETA (or,
  when the size is not known up front, every chunk)."""

  def __init__(self, total: int | None):
    self.total, self.start, self.next_report = total, time.perf_counter(), 0.1

  def update(self, done: int) -> None:
    elapsed = time.perf_counter() - self.start
    if self.total is None:
      logging.info("Encoded %s examples, %.0f s.", f"{done:,}", elapsed)
      return
    if self.total <= ENCODE_CHUNK or done / self.total < self.next_report:
      return
    logging.info("Encoded %s of %s examples (%.0f%%), %.0f s, ETA %.0f s.", f"{done:,}",
                 f"{self.total:,}", 100 * done / self.total, elapsed,
                 elapsed * max(self.total - done, 0) / done)
    self.next_report = done / self.total + 0.1



def _encode_by_language(text: prompt_format.TextEncoder, tokenizer, chunk: list[dict]
                        ) -> tuple[list[list[int]], list[list[int]]]:
  """(source ids, target ids) of translation examples of several directions: each group of
  one (source_lang, target_lang) tokenized in one call with those codes."""
  sources, targets = [None] * len(chunk), [None] * len(chunk)
  groups: dict[tuple[str, str], list[int]] = {}
  for i, example in enumerate(chunk):
    groups.setdefault((example["source_lang"], example["target_lang"]), []).append(i)
  for (source_lang, target_lang), indices in groups.items():
    with tokenizer.using_languages(source_lang, target_lang):
      source_ids, target_ids = text.encode([chunk[i]["source"] for i in indices],
                                           [chunk[i]["target"] for i in indices])
    for i, s, t in zip(indices, source_ids, target_ids):
      sources[i], targets[i] = s, t
  return sources, targets


def encode_examples(family, examples: Iterable[dict], tokenizer: tokenizer_lib.Tokenizer, *,
                    drop_overlong: bool = False, total: int | None = None
                    ) -> tuple[pipeline.Encoded, int]:
  """Token features of `examples` (a list, or a stream read a chunk at a time: memory holds
  token arrays, never the texts of a whole split), and how many were longer than
  max_source_length / max_target_length: truncated, or left out with `drop_overlong`
  (training with config.overlong='drop'). `total` (a list's length by default) gives the
  progress log its ETA. The `family` gives each example's features (`example_features`),
  their padded lengths and, for a classifier, the label array."""
  max_source, max_target = family.config.max_source_length, family.config.max_target_length
  # Per feature, one Ragged per chunk: memory holds arrays, not an object per example.
  features: dict[str, list[pipeline.Ragged]] = {name: [] for name in family.feature_lengths()}
  labels, overlong, done = [], 0, 0
  progress = _Progress(len(examples) if total is None and hasattr(examples, "__len__")
                       else total)
  examples = iter(examples)
  text = prompt_format.TextEncoder(family.config, tokenizer)
  while chunk := list(itertools.islice(examples, ENCODE_CHUNK)):
    if "messages" in chunk[0]:  # whole chat conversations
      sources, source_weights, targets = zip(*(text.encode_conversation(e["messages"])
                                               for e in chunk))
    elif "target_lang" in chunk[0]:  # many directions: each tagged with its own languages
      sources, targets = _encode_by_language(text, tokenizer, chunk)
      source_weights = [None] * len(chunk)
    else:
      sources, targets = text.encode([e["source"] for e in chunk],
                                     [e["target"] for e in chunk] if family.generates_text
                                     else None)
      source_weights = [None] * len(chunk)
    chunk_features: dict[str, list[np.ndarray]] = {name: [] for name in features}
    for example, source, target, weights in zip(chunk, sources, targets, source_weights):
      too_long = len(source) + 1 > max_source or len(target) + 1 > max_target
      overlong += too_long
      if too_long and drop_overlong:
        continue
      for feature, value in family.example_features(source, target, weights).items():
        chunk_features[feature].append(value)
      if not family.generates_text:
        labels.append(example["label"])
    for feature, values in chunk_features.items():
      features[feature].append(pipeline.Ragged.from_sequences(
          values, pipeline.feature_dtype(feature)))
    done += len(chunk)
    progress.update(done)
  return pipeline.Encoded(
      {name: pipeline.Ragged.concatenate(parts, pipeline.feature_dtype(name))
       for name, parts in features.items()},
      family.feature_lengths(), family.label_array(labels)), overlong
