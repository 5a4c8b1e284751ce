"""Continuous batching: a fixed pool of row slots that decode side by side, each at its own
step (the KV cache's write position per row, model/kv_cache.py). Between segments of
serve.stream_steps tokens, rows that finished leave and waiting rows are read into the free
slots (`runner.refill`) while the others decode on, so a short request is not held behind a
long one and a request that arrives mid-batch starts at the next segment.

The pool's cache holds the longest prompt and the longest output (max_source_length +
max_new_tokens slots per row; an encoder-decoder's sources max_source_length tokens), so
every row the server admits fits. New rows are read in (k rows, prompt length) buckets, k a
power of two: one compiled refill per bucket, and per bucket one more that reads the rows
packed (`packing`: a burst that fills the largest bucket in fewer rows, a few rows side by
side in one), and one compiled segment per k: a segment decodes the slots up to the last
live one. Where the live rows would fit a smaller bucket than their slots need (the end of a
burst), they move down to the lowest slots first.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.inference import decoding
from transformer_jax.inference import prompt_packing
from transformer_jax.model import lora as lora_lib
from transformer_jax.serving import batch_decoder


@dataclasses.dataclass
class _Slot:
  row: batch_decoder.Row
  handle: Any  # what `advance` hands back with the row's output (the engine's future)
  told: int = 0  # tokens the row's on_tokens has been given
  limit: int = 1  # the row's max_tokens, within decoding.max_total_len


class SlotPool:
  """`decoder`'s model (a batch_decoder.BatchDecoder of a sequence family) decoding a pool of
  its max_batch_size rows continuously. Used from one thread (the engine's), except
  `warm_up`, which compiles on a scratch pool of its own and adds what it compiled to
  `refills` / `compiled` (where the live pool finds a packed refill ready)."""

  def __init__(self, decoder: batch_decoder.BatchDecoder):
    self.decoder = decoder
    self.family, self.layout = decoder.family, decoder.layout
    self.rows = decoder.max_batch_size
    self.parts = self.layout.decode_parts  # parts of the rows that run programs of their own
    self.rows_per_part = self.rows // self.parts
    self.k_buckets = batch_decoder.power_of_two_buckets(
        self.layout.eval_devices // self.parts, self.rows_per_part)
    self.source_length = decoder.length_buckets[-1]
    empty, refill, advance = self._functions(decoder.predictor.config.decoding)
    self._empty = self.layout.compile_decode(empty)
    # New rows are read packed where a burst fills the largest bucket and their prompts fit
    # in fewer rows (prompt_packing.place), as one-call decoding reads them; not with named
    # adapters, whose rows must not share a packed row. A packed refill is used once
    # `warm_up` (in the background) has compiled it: packing never makes a request wait.
    self.packs = self.family.packs_prompts and decoder.adapters is None
    # The widest prompts a refill takes (a decoder's: its cache's length, less a slot).
    self.widest = self.family.runner.widest_refill(
        self.source_length, self.source_length + decoder.max_new_tokens)
    self._refill_function = refill
    self.refills: dict[int, Callable] = {}  # packed rows (0: none) -> the compiled refill
    self.compiled: set[tuple[int, int, int]] = set()  # (length, k, packed rows) refilled
    self.packed_refills = 0  # refills of the live pool that read their rows packed
    # A segment runs the slots up to the last live one (rounded up to a k bucket) per part:
    # one compiled segment per bucket, so that a lone request does not pay for every slot.
    self._advance = {k: self.layout.compile_decode_steps(functools.partial(advance, live=k))
                     for k in self.k_buckets}
    # Where few rows are left in high slots (the end of a burst), they move to the lowest
    # slots, so that their segments run a smaller bucket: one compiled move per bucket they
    # can move into, used once `warm_up` has compiled them all.
    self._move = {k: self.layout.compile_decode_steps(functools.partial(_move_rows, slots=k))
                  for k in self.k_buckets[:-1]}
    self.moves_compiled = False
    self.moves = 0  # times the live pool moved its rows down
    self.slots: list[_Slot | None] = [None] * self.rows
    self._carried = None

  def _functions(self, decoding_config) -> tuple[Callable, Callable, Callable]:
    """The compiled pieces, each on one part's rows: empty(params, dummy prompts) -> a pool of
    free slots; refill(params, carried, new rows, packed rows) -> carried (new rows' prompts
    read packed into that many rows, 0: unpacked); advance(params, carried, settings) ->
    (carried, progress), as BatchDecoder's segments."""
    family, runner = self.family, self.family.runner
    max_new = self.decoder.max_new_tokens
    segment = batch_decoder.segment_function(family, max_new, self.decoder.stream_steps,
                                             decoding_config)

    def empty(params, prompts):
      # Zeros of a prefill's shapes: no row is read until a refill (a prefill of the pool's
      # rows at full length would cost a 135M-parameter model most of a minute on a CPU).
      base = lora_lib.for_rows(params, jnp.zeros(prompts.shape[:1], jnp.int32))
      shapes = jax.eval_shape(lambda: runner.prefill(base, prompts, prompts.shape[0],
                                                     max_new)[:2])
      cache, context = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
      state = decoding.start_rows(cache, rows=prompts.shape[0], max_decode_len=max_new)
      return state, context, jnp.zeros((prompts.shape[0],), jnp.int32), jnp.zeros_like(prompts)

    def refill(params, carried, new, packed_rows):
      state, context, forced_firsts, prompts = carried
      inputs, forced_first, row_starts = family.split_prompt(new["prompts"])
      packing = (new["places"], packed_rows) if packed_rows else None
      cache, context, starts = runner.refill(lora_lib.for_rows(params, new["adapter"]),
                                             state[5], context, new["row_ids"], inputs, packing)
      starts = starts if row_starts is None else row_starts
      forced_firsts = forced_firsts.at[new["row_ids"]].set(
          0 if forced_first is None else forced_first, mode="drop")
      # Each slot's prompt (left-aligned, at most the pool's source length; packed refills'
      # rows are as wide as the packed row) for the repetition penalty.
      width, kept = inputs.shape[1], prompts.shape[1]
      fitted = (inputs[:, :kept] if width >= kept else
                jnp.pad(inputs, ((0, 0), (0, kept - width))))
      prompts = prompts.at[new["row_ids"]].set(fitted, mode="drop")
      return (decoding.refill_rows(state, cache, new["row_ids"], starts), context, forced_firsts,
              prompts)

    def advance(params, carried, rows, live):
      if live < carried[2].shape[0]:  # the first `live` slots only, written back in place
        first = lambda tree: jax.tree.map(lambda x: x[:live], tree)
        part, progress = advance(params, first(carried), first(rows), live)
        return jax.tree.map(lambda x, y: x.at[:live].set(y), carried, part), progress
      return segment(params, carried, rows)

    return empty, refill, advance

  # ---- The pool, from the engine's thread ------------------------------------------------

  def free(self) -> int:
    return sum(slot is None for slot in self.slots)

  def live(self) -> int:
    return self.rows - self.free()

  def _params(self):
    return self.decoder.params

  def _start(self):
    """The pool's state: every slot free (zeros, marked finished)."""
    prompts = np.full((self.rows, self.source_length), 3, np.int32)
    return self._empty(self._params(), self.layout.eval_batch(prompts))

  def admit(self, rows: Sequence[batch_decoder.Row], handles: Sequence[Any]) -> None:
    """Reads `rows` (at most `free()`) into free slots; `handles` come back with their
    outputs from `advance`."""
    if self._carried is None:
      self._carried = self._start()
    free = [i for i, slot in enumerate(self.slots) if slot is None]
    if len(rows) > len(free):
      raise ValueError(f"{len(rows)} rows cannot enter a pool with {len(free)} free slots.")
    limits = self.decoder.limits(rows)
    by_part: list[list[tuple[int, batch_decoder.Row]]] = [[] for _ in range(self.parts)]
    for slot, row, handle, limit in zip(free, rows, handles, limits):
      self.slots[slot] = _Slot(row, handle, limit=limit)
      by_part[slot // self.rows_per_part].append((slot % self.rows_per_part, row))
    length = max(self.decoder.prompt_bucket(len(row.prompt)) for row in rows)
    # Rows enter in buckets of k per part; a part's unused entries point past its rows
    # (dropped by the refill).
    count = max(map(len, by_part))
    while count:
      k = next(b for b in self.k_buckets if b >= min(count, self.k_buckets[-1]))
      batch = [part[:k] for part in by_part]
      by_part = [part[k:] for part in by_part]
      count = max(map(len, by_part))
      packed = self.packing(k, length)
      shape = (packed[0], k, packed[1]) if packed else None
      # Packed where that refill is compiled and the prompts fit, else unpacked.
      new = self._new_rows(batch, k, *packed) if shape in self.compiled else None
      if new is None:
        new, shape = self._new_rows(batch, k, length), (length, k, 0)
      self._carried = self._refill(self._carried, new, shape)
      self.packed_refills += bool(shape[2])

  def packed_rows(self, k: int) -> int:
    """The rows a packed refill of k new rows per part reads them in (0: never packed): a
    burst that fills the pool's largest bucket, in three quarters of its rows (one more
    compiled refill per prompt length; prompt_packing.place packs in quarters)."""
    full = k == self.k_buckets[-1] and k >= prompt_packing.MIN_ROWS
    return 3 * (k // 4) if self.packs and full else 0

  def packing(self, k: int, length: int) -> tuple[int, int] | None:
    """The (prompt width, packed rows) a refill of k new rows per part, of prompts up to
    `length` tokens, may read them in packed (None: never): a burst's `packed_rows`; fewer
    rows (2 <= k below that bucket) side by side in one row of k * length / 2 tokens, half
    what they read apart (prompts of 8 to 12 tokens fill a third to a half of a 16-token
    bucket)."""
    if self.packed_rows(k):
      return length, self.packed_rows(k)
    width = k * length // 2
    return (width, 1) if self.packs and k >= 2 and width <= self.widest else None

  def _refill(self, carried, new: dict, shape: tuple[int, int, int]):
    """`carried` with `new` read in: shape (prompt width, k, packed rows) (`shapes`)."""
    packed_rows = shape[2]
    if packed_rows not in self.refills:
      self.refills[packed_rows] = self.layout.compile_decode_steps(
          functools.partial(self._refill_function, packed_rows=packed_rows))
    carried = self.refills[packed_rows](self._params(), carried, new)
    self.compiled.add(shape)
    return carried

  def _new_rows(self, batch: list[list[tuple[int, batch_decoder.Row]]], k: int,
                length: int, packed_rows: int = 0) -> dict | None:
    """The refill's inputs for `batch` (k entries per part, in prompts of `length` tokens),
    read in `packed_rows` packed rows of that width per part (0: unpacked); None where they
    do not fit in them."""
    ids = np.full((self.parts, k), self.rows_per_part, np.int32)  # past the rows: dropped
    adapters = np.zeros((self.parts, k), np.int32)
    prompts = np.zeros((self.parts, k, length), np.int32)
    for part, entries in enumerate(batch):
      for i, (slot, row) in enumerate(entries):
        ids[part, i], adapters[part, i] = slot, row.adapter
        prompts[part, i, :len(row.prompt)] = row.prompt
    new = {"row_ids": ids.reshape(-1), "adapter": adapters.reshape(-1),
           "prompts": prompts.reshape(self.parts * k, length)}
    if packed_rows:
      lengths = np.count_nonzero(new["prompts"], axis=1)
      if packed_rows == 1:
        places = prompt_packing.side_by_side(lengths, self.parts, length)
      else:
        places, needed = prompt_packing.place(lengths, self.parts, length)
        places = places if places is not None and needed <= packed_rows else None
      if places is None:
        return None
      new["places"] = places
    return self.layout.eval_batch(new)

  def _bucket(self, rows: int) -> int:
    """The smallest segment that runs `rows` slots of each part."""
    return next(b for b in self.k_buckets if b >= rows)

  def _move_down(self) -> None:
    """Moves each part's live rows to its lowest slots (their order kept) where that lets the
    next segment run a smaller bucket: rows, caches and settings go with them."""
    per_part = self.rows_per_part
    parts = [range(p * per_part, (p + 1) * per_part) for p in range(self.parts)]
    live = [[i for i in part if self.slots[i] is not None] for part in parts]
    last = max(i % per_part for part in live for i in part)
    k = self._bucket(max(map(len, live)))
    if not self.moves_compiled or k >= self._bucket(last + 1):
      return
    order = [i for part, rows in zip(parts, live) for i in rows + [
        j for j in part if self.slots[j] is None]]  # new slot -> the slot it comes from
    sources = np.asarray([i % per_part for i in order], np.int32)
    self._carried, _ = self._move[k](self._params(), self._carried,
                                     self.layout.eval_batch({"sources": sources}))
    self.slots = [self.slots[i] for i in order]
    self.moves += 1

  def advance(self) -> list[tuple[Any, batch_decoder.Output]]:
    """One segment of every live row; streaming rows get their tokens so far. Returns the
    (handle, output) of each row that finished, whose slot is free again."""
    self._move_down()
    settings = batch_decoder.settings(
        [dataclasses.replace(slot.row, max_tokens=slot.limit) if slot else
         batch_decoder.Row(np.zeros((1,), np.int32)) for slot in self.slots], self.rows)
    per_part = self.rows_per_part
    last = max(i % per_part for i, slot in enumerate(self.slots) if slot is not None)
    k = self._bucket(last + 1)
    self._carried, progress = self._advance[k](self._params(), self._carried,
                                               self.layout.eval_batch(settings))
    progress = self.layout.host_rows(progress)  # [parts * k]: each part's first k slots
    done = []
    for i, slot in enumerate(self.slots):
      if slot is None:
        continue
      at = (i // per_part) * k + i % per_part
      ids, logprobs = batch_decoder.so_far(progress, at, slot.limit)
      if slot.row.on_tokens is not None and len(ids) > slot.told:
        slot.told = len(ids)
        batch_decoder.tell(slot.row, ids, logprobs)
      if progress["finished"][at] or progress["step"][at] >= slot.limit:
        done.append((slot.handle, batch_decoder.Output(ids, logprobs)))
        self.slots[i] = None
    return done

  def fail_all(self) -> list[Any]:
    """Empties the pool after a failed call; returns the handles of the rows it held."""
    handles = [slot.handle for slot in self.slots if slot is not None]
    self.slots = [None] * self.rows
    self._carried = None
    return handles

  # ---- Compiling ahead ---------------------------------------------------------------------

  def shapes(self) -> list[tuple[int, int, int]]:
    """Every (prompt width, new rows per part, packed rows) bucket a refill can take: the
    unpacked ones, then the packed ones (`packing`)."""
    lengths = self.decoder.length_buckets
    packed = [(packed[0], k, packed[1]) for length in lengths for k in self.k_buckets
              if (packed := self.packing(k, length))]
    return [(length, k, 0) for length in lengths for k in self.k_buckets] + packed

  def warm_up(self, progress: Callable[[int, int, tuple], None] | None = None,
              shapes: Sequence[tuple[int, int, int]] | None = None,
              stop: threading.Event | None = None) -> bool:
    """Compiles the refills of `shapes` (default: every one) and the pool's segment on a
    scratch pool (the live one is the engine thread's), telling `progress` (index, count,
    shape) before each; stops between shapes once `stop` is set. Returns whether it compiled
    them all."""
    every = self.shapes()
    scratch = [self._start()]

    def compile_one(shape):
      length, k, packed_rows = shape
      batch = [[(i, batch_decoder.Row(np.full((length,), 3, np.int32))) for i in range(k)]
               for _ in range(self.parts)]
      new = self._new_rows(batch, k, length)
      if packed_rows:  # any places compile it (the scratch pool's rows are never read)
        new["places"] = self.layout.eval_batch(np.zeros((self.parts * k, 2), np.int32))
      scratch[0] = self._refill(scratch[0], new, shape)
      if shape == every[0]:  # the moves, once (the server compiles this shape first)
        sources = np.arange(self.rows, dtype=np.int32) % self.rows_per_part
        for move in self._move.values():
          scratch[0], _ = move(self._params(), scratch[0],
                               self.layout.eval_batch({"sources": sources}))
        self.moves_compiled = True
      if shape == (length, k, 0) and length == every[0][0]:  # each segment size once
        scratch[0], _ = self._advance[k](self._params(), scratch[0], self.layout.eval_batch(
            batch_decoder.settings([], self.rows)))

    return batch_decoder.each_shape(every, shapes, progress, stop, compile_one)


def _move_rows(params, carried, order, slots: int):
  """carried (every leaf's first axis a slot) with each of its first `slots` slots i holding
  what slot order['sources'][i] held (the others as they were: only the moved rows are
  copied, the rest is updated in place)."""
  del params
  sources = order["sources"][:slots]
  return jax.tree.map(lambda x: x.at[:slots].set(x[sources]), carried), {}
