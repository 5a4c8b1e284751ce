"""Token sequences -> fixed-shape batches: padded or packed training rows, padded eval batches.

Training order: each epoch is a seeded permutation of the examples, grouped into rows (one
example per row, or several when packing), and a global batch takes the next rows, running
into the next epoch when one ends. The position (epoch, row) is the whole iterator state; it
is saved with every checkpoint, so a resumed run reads exactly the rows an uninterrupted run
would. Every process computes the same rows and keeps its own part of each global batch.
"""

from __future__ import annotations

import collections
import dataclasses
from concurrent import futures
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from transformer_jax import tokenizer as tokenizer_lib


@dataclasses.dataclass
class Encoded:
  """Unpadded token sequences per feature, and the padded length of each feature.

  Features: 'inputs' (encoder), 'targets' (decoder), 'weights' (per-token loss weights
  aligned with 'targets'; absent = every non-padding target token counts), and 'labels'
  (one class id per example).
  """
  features: dict[str, list[np.ndarray]]
  lengths: dict[str, int]
  labels: np.ndarray | None = None

  def __len__(self) -> int:
    return len(next(iter(self.features.values())))

  def subset(self, indices: Sequence[int]) -> "Encoded":
    return Encoded({k: [v[i] for i in indices] for k, v in self.features.items()},
                   self.lengths, None if self.labels is None else self.labels[list(indices)])


def with_eos(ids: Sequence[int], max_len: int) -> np.ndarray:
  """`ids` + EOS, cut to max_len keeping the EOS."""
  return np.asarray(list(ids)[:max_len - 1] + [tokenizer_lib.EOS_ID], np.int32)


def decoder_only_example(source_ids: Sequence[int], target_ids: Sequence[int],
                         max_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Decoder-only form of a source -> target pair: `SOURCE <eos> TARGET <eos>`, unpadded.

  Returns tokens and loss weights of the same length: 0 on the source part (the model reads
  it, is not graded on it), 1 on the target and its EOS. The source is cut first when the
  pair does not fit in max_len, so the target is kept whole where possible.
  """
  target = list(target_ids)[:max_len - 2] + [tokenizer_lib.EOS_ID]
  source = list(source_ids)[:max_len - len(target) - 1] + [tokenizer_lib.EOS_ID]
  weights = np.concatenate([np.zeros(len(source), np.float32), np.ones(len(target), np.float32)])
  return np.asarray(source + target, np.int32), weights


# ---- Padding and packing -------------------------------------------------------------------

def pad_rows(data: Encoded, rows: Sequence[Sequence[int]], pack: bool) -> dict[str, np.ndarray]:
  """One batch: row r holds the examples `rows[r]`, concatenated when `pack`.

  Packed features get `<name>_segmentation` (1, 2, ... per example; 0 = padding) and
  `<name>_position` (0.. within each example). 'weights' follows 'targets'. Unused rows
  (an empty list) are all padding.
  """
  batch = {}
  for name, sequences in data.features.items():
    dtype = np.float32 if name == "weights" else np.int32
    values = np.zeros((len(rows), data.lengths[name]), dtype)
    segmentation = np.zeros((len(rows), data.lengths[name]), np.int32)
    positions = np.zeros((len(rows), data.lengths[name]), np.int32)
    for r, examples in enumerate(rows):
      start = 0
      for segment, i in enumerate(examples, start=1):
        sequence = sequences[i]
        values[r, start:start + len(sequence)] = sequence
        segmentation[r, start:start + len(sequence)] = segment
        positions[r, start:start + len(sequence)] = np.arange(len(sequence))
        start += len(sequence)
    batch[name] = values
    if pack and name != "weights":
      batch[f"{name}_segmentation"] = segmentation
      batch[f"{name}_position"] = positions
  if data.labels is not None:
    batch["labels"] = np.asarray([data.labels[r[0]] if r else 0 for r in rows], np.int32)
  return batch


def pack_rows(data: Encoded, order: Sequence[int]) -> list[list[int]]:
  """Greedy sequential packing: examples in `order` fill a row until the next does not fit in
  every feature's length, then a new row starts. Deterministic, keeps the shuffled order."""
  rows, current, used = [], [], {name: 0 for name in data.features}
  for i in order:
    sizes = {name: len(data.features[name][i]) for name in data.features}
    if current and any(used[n] + sizes[n] > data.lengths[n] for n in sizes):
      rows.append(current)
      current, used = [], {name: 0 for name in data.features}
    current.append(int(i))
    used = {n: used[n] + sizes[n] for n in sizes}
  if current:
    rows.append(current)
  return rows


class TrainBatches:
  """Endless shuffled (optionally packed) batches: this process's share of each global batch.

  `state` / `restore(state)` give and set the position, a small dict saved with checkpoints.
  """

  def __init__(self, data: Encoded, global_batch_size: int, seed: int, *, pack: bool = False,
               process_index: int = 0, process_count: int = 1):
    if global_batch_size % process_count:
      raise ValueError(f"Global batch {global_batch_size} is not divisible by "
                       f"{process_count} processes.")
    if len(data) == 0:
      raise ValueError("The training split is empty (after dropping overlong examples?).")
    if pack and data.labels is not None:
      raise ValueError("Packing is for sequence tasks; set config.pack_examples=False for "
                       "classification.")
    self.data, self.pack, self.seed = data, pack, seed
    self.global_batch_size = global_batch_size
    self.local_batch_size = global_batch_size // process_count
    self.process_index = process_index
    self.epoch, self.row = 0, 0
    self._rows_epoch, self._rows = -1, []

  @property
  def state(self) -> dict[str, int]:
    return {"epoch": self.epoch, "row": self.row}

  def restore(self, state: dict[str, int]) -> None:
    self.epoch, self.row = int(state["epoch"]), int(state["row"])

  def epoch_rows(self, epoch: int) -> list[list[int]]:
    """The rows of `epoch`: a permutation seeded by (seed, epoch), packed or one per row."""
    if epoch != self._rows_epoch:  # keep one epoch: memory stays flat
      order = np.random.default_rng([self.seed, epoch]).permutation(len(self.data))
      self._rows = pack_rows(self.data, order) if self.pack else [[int(i)] for i in order]
      self._rows_epoch = epoch
    return self._rows

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    """The next global batch's rows that belong to this process; advances the state."""
    rows = []
    while len(rows) < self.global_batch_size:
      epoch_rows = self.epoch_rows(self.epoch)
      take = epoch_rows[self.row:self.row + self.global_batch_size - len(rows)]
      rows.extend(take)
      self.row += len(take)
      if self.row >= len(epoch_rows):
        self.epoch, self.row = self.epoch + 1, 0
    start = self.process_index * self.local_batch_size
    return pad_rows(self.data, rows[start:start + self.local_batch_size], self.pack)


def prefetch(batches: TrainBatches, place: Callable[[dict], Any], size: int = 2
             ) -> Iterator[tuple[Any, dict[str, int]]]:
  """Yields (placed batch, pipeline state after it), built `size` batches ahead in a
  background thread, so building rows and copying them to the devices overlaps the step.

  The state comes with its batch, not from `batches.state` (which runs ahead): it is what a
  checkpoint saved after this batch must hold. `size` 0 builds each batch when asked.
  """

  def produce():
    batch = next(batches)
    return place(batch), batches.state

  if size <= 0:
    while True:
      yield produce()
  with futures.ThreadPoolExecutor(1, thread_name_prefix="prefetch") as pool:
    # One worker: batches are produced in order.
    pending = collections.deque(pool.submit(produce) for _ in range(size))
    while True:
      item = pending.popleft().result()
      pending.append(pool.submit(produce))
      yield item


def eval_batches(data: Encoded, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
  """Padded batches in order; the last one is filled with all-padding rows (weight 0)."""
  for start in range(0, len(data), batch_size):
    rows = [[i] for i in range(start, min(start + batch_size, len(data)))]
    yield pad_rows(data, rows + [[]] * (batch_size - len(rows)), pack=False)
