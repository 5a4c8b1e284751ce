"""Token sequences -> fixed-shape batches: padded or packed training rows, padded eval batches.

Training order: each epoch is a seeded permutation of the examples, grouped into rows (one
example per row, or several when packing), and a global batch takes the next rows, running
into the next epoch when one ends. The position (epoch, row) is the whole iterator state; it
is saved with every checkpoint, so a resumed run reads exactly the rows an uninterrupted run
would. With several data shards (`Shards`: one per host of a pod by default) each shard has
its own epochs and position, a global batch takes rows from every shard, and a process reads
only the shards its part of the batch comes from.
"""

from __future__ import annotations

import collections
import dataclasses
from concurrent import futures
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from transformer_jax import tokenizer as tokenizer_lib


def feature_dtype(name: str):
  """Loss weights are float32; every token feature is int32."""
  return np.float32 if name == "weights" else np.int32


class Ragged:
  """Sequences of different lengths in one flat array: item i is values[offsets[i]:offsets[i +
  1]]. Millions of examples cost two arrays, not millions of objects, and the arrays can be
  memory-mapped from the token cache (data/token_cache.py)."""

  def __init__(self, values: np.ndarray, offsets: np.ndarray):
    self.values, self.offsets = values, offsets

  @classmethod
  def from_sequences(cls, sequences: Sequence[Sequence], dtype=np.int32) -> "Ragged":
    lengths = np.fromiter((len(s) for s in sequences), np.int64, len(sequences))
    offsets = np.zeros(len(sequences) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = (np.concatenate([np.asarray(s, dtype) for s in sequences]) if len(sequences)
              else np.zeros(0, dtype))
    return cls(values.astype(dtype, copy=False), offsets)

  @classmethod
  def concatenate(cls, parts: Sequence["Ragged"], dtype=np.int32) -> "Ragged":
    """The items of `parts`, one after another."""
    if not parts:
      return cls(np.zeros(0, dtype), np.zeros(1, np.int64))
    starts = np.cumsum([0] + [len(p.values) for p in parts[:-1]])
    offsets = np.concatenate([parts[0].offsets[:1]] + [
        p.offsets[1:] - p.offsets[0] + start for p, start in zip(parts, starts)])
    return cls(np.concatenate([p.values for p in parts]).astype(dtype, copy=False), offsets)

  def __len__(self) -> int:
    return len(self.offsets) - 1

  def __getitem__(self, i: int) -> np.ndarray:
    if not -len(self) <= i < len(self):
      raise IndexError(f"item {i} of {len(self)}")
    i %= len(self)
    return self.values[self.offsets[i]:self.offsets[i + 1]]

  def __iter__(self) -> Iterator[np.ndarray]:
    return (self[i] for i in range(len(self)))

  def lengths(self) -> np.ndarray:
    return np.diff(self.offsets)

  def take(self, indices: Sequence[int]) -> "Ragged":
    return Ragged.from_sequences([self[int(i)] for i in indices], self.values.dtype)


@dataclasses.dataclass
class Encoded:
  """Unpadded token sequences per feature (lists or `Ragged`, stored as `Ragged`), and the
  padded length of each feature.

  Features: 'inputs' (encoder), 'targets' (decoder), 'weights' (per-token loss weights
  aligned with 'targets'; absent = every non-padding target token counts), and 'labels'
  (one class id per example).
  """
  features: dict[str, Ragged]
  lengths: dict[str, int]
  labels: np.ndarray | None = None

  def __post_init__(self):
    self.features = {name: f if isinstance(f, Ragged) else Ragged.from_sequences(
        f, feature_dtype(name)) for name, f in self.features.items()}

  def __len__(self) -> int:
    return len(next(iter(self.features.values())))

  def subset(self, indices: Sequence[int]) -> "Encoded":
    return Encoded({k: v.take(indices) for k, v in self.features.items()},
                   self.lengths, None if self.labels is None else self.labels[list(indices)])


def with_eos(ids: Sequence[int], max_len: int) -> np.ndarray:
  """`ids` + EOS, cut to max_len keeping the EOS."""
  return np.asarray(list(ids)[:max_len - 1] + [tokenizer_lib.EOS_ID], np.int32)


def with_own_end(ids: Sequence[int], max_len: int) -> np.ndarray:
  """`ids` that end themselves as `X EOS code` (mBART-cc25's language code after EOS), cut
  to max_len keeping that two-token end."""
  ids = list(ids)
  if len(ids) > max_len:
    ids = ids[:max_len - 2] + ids[-2:]
  return np.asarray(ids, np.int32)


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


def text_example(prompt_ids: Sequence[int], target_ids: Sequence[int],
                 prompt_weights: Sequence[float] | None = None) -> tuple[np.ndarray, np.ndarray]:
  """A raw or chat example (data/prompt_format.py): the prompt's ids, then the target's (which
  end as the format ends them), unpadded, with loss weights 0 on the prompt (or
  `prompt_weights`: a conversation's earlier replies) and 1 on the target. The first token
  weighs 0 even without a prompt: nothing before it predicts it."""
  weights = np.concatenate([
      np.zeros(len(prompt_ids), np.float32) if prompt_weights is None
      else np.asarray(prompt_weights, np.float32)[:len(prompt_ids)],
      np.ones(len(target_ids), np.float32)])
  weights[:1] = 0.0
  return np.asarray(list(prompt_ids) + list(target_ids), np.int32), weights


# ---- Padding and packing -------------------------------------------------------------------

def pad_rows(data: Encoded, rows: Sequence[Sequence[int]], pack: bool) -> dict[str, np.ndarray]:
  """One batch: row r holds the examples `rows[r]`, concatenated when `pack`.

  Packed features get `<name>_segmentation` (1, 2, ... per example; 0 = padding) and
  `<name>_position` (0.. within each example). 'weights' follows 'targets'. Unused rows
  (an empty list) are all padding. Every token is placed by one scatter per array (no loop
  over examples): the pipeline keeps up with an accelerator on one thread.
  """
  counts = np.fromiter((len(r) for r in rows), np.int64, len(rows))
  examples = (np.concatenate([np.asarray(r, np.int64) for r in rows]) if counts.sum()
              else np.zeros(0, np.int64))
  row_of = np.repeat(np.arange(len(rows)), counts)  # per example
  first_of_row = np.cumsum(counts) - counts  # index in `examples` of each row's first example
  segment = np.arange(len(examples)) - np.repeat(first_of_row, counts) + 1
  batch = {}
  for name, sequences in data.features.items():
    lengths = sequences.offsets[examples + 1] - sequences.offsets[examples]
    start = np.cumsum(lengths) - lengths  # of each example, in all the batch's tokens
    # An example's first column: its start less that of its row's first example.
    column = start - np.repeat(start[first_of_row[counts > 0]], counts[counts > 0])
    token_example = np.repeat(np.arange(len(examples)), lengths)
    position = np.arange(lengths.sum()) - start[token_example]
    at = (row_of[token_example], column[token_example] + position)
    shape = (len(rows), data.lengths[name])
    batch[name] = np.zeros(shape, feature_dtype(name))
    batch[name][at] = sequences.values[sequences.offsets[examples][token_example] + position]
    if pack and name != "weights":
      batch[f"{name}_segmentation"] = np.zeros(shape, np.int32)
      batch[f"{name}_segmentation"][at] = segment[token_example]
      batch[f"{name}_position"] = np.zeros(shape, np.int32)
      batch[f"{name}_position"][at] = position
  if data.labels is not None:
    batch["labels"] = np.asarray([data.labels[r[0]] if len(r) else 0 for r in rows], np.int32)
  return batch


def pack_rows(data: Encoded, order: Sequence[int]) -> list[list[int]]:
  """Greedy sequential packing: examples in `order` fill a row until the next does not fit in
  every feature's length, then a new row starts. Deterministic, keeps the shuffled order."""
  rows = EpochRows(data, np.asarray(order), pack=True)
  return [row.tolist() for row in rows.take(0, len(order))]


class EpochRows:
  """One epoch's rows: row r holds the examples order[bounds[r]:bounds[r + 1]].

  Packed rows are found as they are asked for, so a start (or a resume at row R) packs only
  up to where it reads. A row ends where a feature's running token count would pass its
  length: one binary search per feature and row, not a step per example.
  """

  def __init__(self, data: Encoded, order: np.ndarray, pack: bool):
    self.order, self.pack = np.asarray(order, np.int64), pack
    if not pack:
      self._bounds, self.num_rows = np.arange(len(order) + 1), len(order)
      return
    self._bounds, self.num_rows = np.zeros(len(order) + 1, np.int64), 0
    self._limits = [data.lengths[name] for name in data.features]
    self._features = list(data.features.values())
    self._running = None  # per feature, tokens of order[:i] for every i; made on first use

  @property
  def complete(self) -> bool:
    return self._bounds[self.num_rows] >= len(self.order)

  def ensure(self, num_rows: int) -> None:
    """Makes rows until there are `num_rows` or the epoch's examples are used up."""
    if self.complete or self.num_rows >= num_rows:
      return
    if self._running is None:
      self._running = []
      for feature in self._features:
        running = np.zeros(len(self.order) + 1, np.int64)
        np.cumsum(feature.lengths()[self.order], out=running[1:])
        self._running.append(running)
    start = int(self._bounds[self.num_rows])
    while self.num_rows < num_rows and start < len(self.order):
      stop = min(int(np.searchsorted(running, running[start] + limit, side="right")) - 1
                 for running, limit in zip(self._running, self._limits))
      start = max(stop, start + 1)  # an example longer than a row still gets one of its own
      self.num_rows += 1
      self._bounds[self.num_rows] = start

  def take(self, start: int, count: int) -> list[np.ndarray]:
    """Rows start .. start + count (fewer at the end of the epoch), as example indices."""
    self.ensure(start + count)
    return [self.order[self._bounds[r]:self._bounds[r + 1]]
            for r in range(start, min(start + count, self.num_rows))]


@dataclasses.dataclass
class Shards:
  """The training split cut into `count` shards (example i of the source in shard i % count),
  of which a process holds some (`held`: shard -> its examples). A pod's hosts each read and
  encode only their own shards; one process may hold them all."""
  count: int
  held: dict[int, Encoded]

  def __len__(self) -> int:
    return sum(len(data) for data in self.held.values())


def shards_of_process(process_index: int, process_count: int, shard_count: int) -> range:
  """The shards a process reads. Global batch rows come from the shards in order (shard s
  gives rows s*R .. (s+1)*R - 1, R = global batch / shard_count) and a process keeps its
  1/process_count slice of them, so it needs the shards that slice overlaps: its own
  shard_count/process_count when that divides, every shard a part of one otherwise."""
  return range(process_index * shard_count // process_count,
               -(-(process_index + 1) * shard_count // process_count))


def saving_process(shard: int, process_count: int, shard_count: int) -> int:
  """The first process that reads `shard`: the one that writes it into the token cache."""
  return shard * process_count // shard_count


class ShardRows:
  """One shard's training rows, endless: every epoch a permutation seeded by (seed, epoch,
  and the shard when there are several), grouped into rows; (epoch, row) is its position."""

  def __init__(self, data: Encoded, seed: Sequence[int], pack: bool):
    self.data, self.seed, self.pack = data, list(seed), pack
    self.epoch, self.row = 0, 0
    self._rows_epoch, self._rows = -1, None

  def epoch_rows(self, epoch: int) -> EpochRows:
    if epoch != self._rows_epoch:  # keep one epoch: memory stays flat
      order = np.random.default_rng(self.seed[:1] + [epoch] + self.seed[1:]).permutation(
          len(self.data))
      self._rows = EpochRows(self.data, order, self.pack)
      self._rows_epoch = epoch
    return self._rows

  def take(self, count: int) -> list[list[int]]:
    """The next `count` rows, running into the next epoch when one ends."""
    rows = []
    while len(rows) < count:
      epoch_rows = self.epoch_rows(self.epoch)
      taken = epoch_rows.take(self.row, count - len(rows))
      rows.extend(taken)
      self.row += len(taken)
      epoch_rows.ensure(self.row + 1)  # is there a row after these?
      if epoch_rows.complete and self.row >= epoch_rows.num_rows:
        self.epoch, self.row = self.epoch + 1, 0
    return rows


class TrainBatches:
  """Endless shuffled (optionally packed) batches: this process's share of each global batch.

  A global batch is the next global_batch_size / shard_count rows of every shard, in shard
  order, so it depends on the shard count and not on how many processes read it: two
  processes holding a shard each give, together, the batches one process holding both gives.
  `state` / `restore(state)` give and set the position, a small dict saved with checkpoints:
  {"epoch", "row"} for one shard, {"shards": [[epoch, row], ...]} for several ([-1, -1] for a
  shard this process does not hold; `merge_states` joins the processes' states).
  """

  def __init__(self, data: Encoded | Shards, global_batch_size: int, seed: int, *,
               pack: bool = False, process_index: int = 0, process_count: int = 1):
    shards = data if isinstance(data, Shards) else Shards(1, {0: data})
    if global_batch_size % process_count:
      raise ValueError(f"Global batch {global_batch_size} is not divisible by "
                       f"{process_count} processes.")
    if global_batch_size % shards.count:
      raise ValueError(f"Global batch {global_batch_size} is not divisible by "
                       f"{shards.count} data shards; set config.data_shards to a divisor of it.")
    needed = shards_of_process(process_index, process_count, shards.count)
    if sorted(shards.held) != list(needed):
      raise ValueError(f"Process {process_index} of {process_count} reads data shards "
                       f"{list(needed)}, not {sorted(shards.held)}.")
    for shard, held in shards.held.items():
      if len(held) == 0:
        raise ValueError(f"Training data shard {shard} of {shards.count} is empty (after "
                         "dropping overlong examples?); use fewer config.data_shards.")
      if pack and held.labels is not None:
        raise ValueError("Packing is for sequence tasks; set config.pack_examples=False for "
                         "classification.")
    self.shards, self.pack, self.global_batch_size = shards, pack, global_batch_size
    self.rows_per_shard = global_batch_size // shards.count
    self.local_batch_size = global_batch_size // process_count
    self.first_row = process_index * self.local_batch_size  # of the global batch
    # One shard keeps the seed of (seed, epoch) alone: the order of runs before shards.
    self._rows = {shard: ShardRows(held, [seed] + ([shard] if shards.count > 1 else []), pack)
                  for shard, held in sorted(shards.held.items())}

  @property
  def state(self) -> dict:
    if self.shards.count == 1:
      return {"epoch": self._rows[0].epoch, "row": self._rows[0].row}
    return {"shards": [[self._rows[s].epoch, self._rows[s].row] if s in self._rows else [-1, -1]
                       for s in range(self.shards.count)]}

  def restore(self, state: dict) -> None:
    saved_count = len(state["shards"]) if "shards" in state else 1
    if saved_count != self.shards.count:
      raise ValueError(f"The checkpoint's data position is for {saved_count} data shard(s) and "
                       f"this run reads {self.shards.count}: set --config.data_shards="
                       f"{saved_count} to resume it.")
    positions = state["shards"] if "shards" in state else [[state["epoch"], state["row"]]]
    for shard, rows in self._rows.items():
      rows.epoch, rows.row = (int(x) for x in positions[shard])

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    """The next global batch's rows that belong to this process; advances the state."""
    parts = []
    for shard, shard_rows in self._rows.items():
      rows = shard_rows.take(self.rows_per_shard)
      # The part of this shard's rows (global rows shard * R ..) in this process's slice.
      start = max(self.first_row - shard * self.rows_per_shard, 0)
      stop = min(self.first_row + self.local_batch_size - shard * self.rows_per_shard,
                 self.rows_per_shard)
      parts.append(pad_rows(shard_rows.data, rows[start:stop], self.pack))
    return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}


def merge_states(states: Sequence[dict]) -> dict:
  """The whole position from every process's `TrainBatches.state` (each knows its shards)."""
  if "shards" not in states[0]:
    return states[0]  # one shard: every process has all of it
  return {"shards": np.max([state["shards"] for state in states], axis=0).tolist()}


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
