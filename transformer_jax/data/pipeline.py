"""Text pairs -> token arrays -> fixed-shape batches.

Training batches are a pure function of the step: the example order is a per-epoch
permutation derived from the seed, so a run resumed at step S reads exactly the batches an
uninterrupted run would, with no iterator state to save. Each process takes its own rows of
the global batch.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import numpy as np

from transformer_jax import tokenizer as tokenizer_lib


@dataclasses.dataclass
class EncodedPairs:
  """Padded token arrays: sources [n, max_source_len], targets [n, max_target_len]."""
  sources: np.ndarray
  targets: np.ndarray
  num_truncated: int

  def __len__(self) -> int:
    return len(self.sources)


def pad_with_eos(rows: Sequence[Sequence[int]], max_len: int) -> tuple[np.ndarray, int]:
  """Token id rows + EOS, padded with 0 to [n, max_len]; too long rows are cut, keeping EOS.

  Returns the array and how many rows were cut.
  """
  array = np.zeros((len(rows), max_len), dtype=np.int32)
  truncated = 0
  for row, ids in enumerate(rows):
    if len(ids) + 1 > max_len:
      ids = ids[:max_len - 1]
      truncated += 1
    array[row, :len(ids)] = ids
    array[row, len(ids)] = tokenizer_lib.EOS_ID
  return array, truncated


def encode_texts(texts: Sequence[str], tokenizer: tokenizer_lib.Tokenizer,
                 max_len: int) -> tuple[np.ndarray, int]:
  """Encoded texts through `pad_with_eos`."""
  return pad_with_eos([tokenizer.encode(text) for text in texts], max_len)


def encode_pairs(pairs: Sequence[tuple[str, str]], tokenizer: tokenizer_lib.Tokenizer,
                 max_source_len: int, max_target_len: int) -> EncodedPairs:
  sources, cut_sources = encode_texts([s for s, _ in pairs], tokenizer, max_source_len)
  targets, cut_targets = encode_texts([t for _, t in pairs], tokenizer, max_target_len)
  return EncodedPairs(sources, targets, cut_sources + cut_targets)


class TrainBatches:
  """Endless shuffled batches, indexed by step; this process's share of each global batch."""

  def __init__(self, data: EncodedPairs, global_batch_size: int, seed: int,
               process_index: int = 0, process_count: int = 1):
    if global_batch_size % process_count:
      raise ValueError(f"Global batch {global_batch_size} is not divisible by "
                       f"{process_count} processes.")
    if len(data) == 0:
      raise ValueError("The training split is empty.")
    self.data = data
    self.global_batch_size = global_batch_size
    self.local_batch_size = global_batch_size // process_count
    self.seed = seed
    self.process_index = process_index
    self._permutations: dict[int, np.ndarray] = {}

  def _permutation(self, epoch: int) -> np.ndarray:
    if epoch not in self._permutations:
      self._permutations = {epoch: np.random.default_rng([self.seed, epoch]).permutation(
          len(self.data))}  # keep one epoch: memory stays flat
    return self._permutations[epoch]

  def batch(self, step: int) -> dict[str, np.ndarray]:
    """The rows of global batch `step` that belong to this process."""
    start = step * self.global_batch_size + self.process_index * self.local_batch_size
    positions = np.arange(start, start + self.local_batch_size)
    indices = np.empty_like(positions)
    for epoch in np.unique(positions // len(self.data)):
      in_epoch = positions // len(self.data) == epoch
      indices[in_epoch] = self._permutation(int(epoch))[positions[in_epoch] % len(self.data)]
    return {"inputs": self.data.sources[indices], "targets": self.data.targets[indices]}

  def iterate(self, start_step: int) -> Iterator[dict[str, np.ndarray]]:
    step = start_step
    while True:
      yield self.batch(step)
      step += 1


def eval_batches(data: EncodedPairs, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
  """Batches in order; the last one is filled with all-padding rows (weight 0)."""
  for start in range(0, len(data), batch_size):
    sources = data.sources[start:start + batch_size]
    targets = data.targets[start:start + batch_size]
    fill = batch_size - len(sources)
    yield {"inputs": np.pad(sources, ((0, fill), (0, 0))),
           "targets": np.pad(targets, ((0, fill), (0, 0)))}


def prefix_lm_example(source_ids: Sequence[int], target_ids: Sequence[int],
                      max_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Decoder-only form of a source -> target pair: `SOURCE <eos> TARGET <eos> <pad>...`.

  Returns tokens [max_len] and loss weights [max_len]: 0 on the source part (the model reads
  it, is not graded on it), 1 on the target and its EOS, 0 on padding. The source is cut
  first when the pair does not fit, so the target is kept whole where possible.
  """
  target = list(target_ids)[:max_len - 2] + [tokenizer_lib.EOS_ID]
  source = list(source_ids)[:max_len - len(target) - 1] + [tokenizer_lib.EOS_ID]
  tokens = np.zeros(max_len, np.int32)
  weights = np.zeros(max_len, np.float32)
  tokens[:len(source) + len(target)] = source + target
  weights[len(source):len(source) + len(target)] = 1.0
  return tokens, weights
