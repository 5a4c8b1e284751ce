"""The request queue and the one thread that decodes it.

Requests put their rows (a prompt x n choices each) on a queue. With a slot pool (continuous
batching, slot_pool.py: every sequence model unless serve.continuous_batching is off) the
decode thread reads waiting rows into the pool's free slots between segments, and answers each
row when it finishes. Otherwise (a classifier) it takes the
first waiting row, then more until serve.max_batch_size rows or serve.max_wait_ms have
passed, and decodes them as one batch (rows of different requests and settings together:
batch_decoder.py). Requests the server has received but is still reading (`arriving`, counted
by the app) are waited for a little longer (ARRIVING_WAIT_S): under a burst the event loop
hands rows over one by one, and a batch started at once would hold only the first. Each row's result goes back through its own future, so a request is
answered when all of its rows are, whichever batches they were in. A batch that fails is
retried row by row, so that one bad row fails only its own request. Every log_stats_s seconds
in which rows were answered, a line says how many and how fast.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from typing import Sequence

from absl import logging

from transformer_jax.serving import batch_decoder
from transformer_jax.serving import slot_pool


# How long a batch may wait, beyond serve.max_wait_ms, for requests already received.
ARRIVING_WAIT_S = 0.05


class QueueFullError(Exception):
  """More rows wait than serve.max_queue allows (HTTP 429)."""


class _Stats:
  """The rows answered and tokens generated since the last stats line, logged once
  `every` seconds (0: never) have passed at an answer."""

  def __init__(self, every: float):
    self.every = every
    self.since, self.rows, self.tokens = time.monotonic(), 0, 0

  def answered(self, outputs: Sequence[batch_decoder.Output], decoding: int,
               waiting: int) -> None:
    if not self.every or not outputs:
      return
    self.rows += len(outputs)
    self.tokens += sum(len(output.ids) for output in outputs)
    now = time.monotonic()
    span = now - self.since
    if span >= self.every:
      logging.info("In %.1f s: %d rows answered (%.1f/s), %d tokens generated (%.1f/s); %d "
                   "rows decoding, %d waiting.", span, self.rows, self.rows / span,
                   self.tokens, self.tokens / span, decoding, waiting)
      self.since, self.rows, self.tokens = now, 0, 0


class Engine:
  """Batches rows submitted from any thread onto `decoder`, in one background thread."""

  def __init__(self, decoder: batch_decoder.BatchDecoder, max_wait_ms: float, max_queue: int,
               pool: slot_pool.SlotPool | None = None, log_stats_s: float = 0.0):
    self.decoder = decoder
    self._stats = _Stats(log_stats_s)
    self.pool = pool
    self.max_wait = max_wait_ms / 1000
    self.max_queue = max_queue
    self._queue: queue.Queue = queue.Queue()
    self._waiting = 0  # rows queued, not yet taken into a batch
    self.arriving = 0  # requests received, not yet queued (the event loop counts them)
    self._lock = threading.Lock()
    self._thread = threading.Thread(target=self._loop, name="decode", daemon=True)
    self._thread.start()

  def submit(self, rows: Sequence[batch_decoder.Row]) -> list[concurrent.futures.Future]:
    """A future per row, resolved with its batch_decoder.Output; QueueFullError when the
    queue cannot take them all (then none is queued)."""
    with self._lock:
      if self._waiting + len(rows) > self.max_queue:
        raise QueueFullError(f"The server is busy: {self._waiting} rows wait to be decoded "
                             f"(serve.max_queue={self.max_queue}); retry later.")
      self._waiting += len(rows)
      futures = []
      for row in rows:
        future: concurrent.futures.Future = concurrent.futures.Future()
        futures.append(future)
        self._queue.put((row, future))
    return futures

  def close(self) -> None:
    """Decodes what is queued, then stops the thread."""
    self._queue.put(None)
    self._thread.join()

  def _take(self, limit: int, block: bool = True) -> list | None:
    """The next rows: the first waiting row (None once closed), then up to `limit` within
    max_wait of it. Without `block` (rows are decoding: the device would wait), only the rows
    that wait now, [] when none does."""
    try:
      first = self._queue.get(block=block)
    except queue.Empty:
      return []
    if first is None:
      return None
    batch = [first]
    deadline = time.monotonic() + self.max_wait
    while len(batch) < limit:
      now = time.monotonic()
      waiting = block and (now < deadline or (
          self.arriving > 0 and now < deadline + ARRIVING_WAIT_S))
      try:
        # Short polls while waiting, so that the `arriving` count is read afresh.
        item = self._queue.get(timeout=0.001) if waiting else self._queue.get_nowait()
      except queue.Empty:
        if waiting:
          continue
        break
      if item is None:
        self._queue.put(None)  # stop after this batch
        break
      batch.append(item)
    with self._lock:
      self._waiting -= len(batch)
    return batch

  def _loop(self) -> None:
    if self.pool is not None:
      return self._continuous_loop()
    while True:
      batch = self._take(self.decoder.max_batch_size)
      if batch is None:
        return
      live = [(row, future) for row, future in batch if future.set_running_or_notify_cancel()]
      if live:
        self._decode(live)

  def _continuous_loop(self) -> None:
    """Rows enter the pool's free slots between segments; each is answered as it finishes.
    Once closed, the rows in the pool finish first."""
    pool, closing = self.pool, False
    while not closing or pool.live():
      if not closing and pool.free():
        # Wait for a row only while the pool is idle; else take what waits now.
        taken = self._take(pool.free(), block=not pool.live())
        closing = taken is None
        live = [(row, f) for row, f in taken or [] if f.set_running_or_notify_cancel()]
        if live:
          self._pool_call(pool.admit, [row for row, _ in live], [f for _, f in live])
      if pool.live():
        done = self._pool_call(pool.advance) or []
        for future, output in done:
          future.set_result(output)
        self._stats.answered([output for _, output in done], pool.live(), self._waiting)

  def _pool_call(self, call, *args):
    """A pool call; where it fails, every row in the pool fails with it (the pool starts
    afresh for the rows that come next)."""
    try:
      return call(*args)
    except Exception as e:  # pylint: disable=broad-except
      logging.exception("Decoding in the slot pool failed.")
      handles = self.pool.fail_all()
      if args and not handles:
        handles = list(args[1])
      for future in handles:
        if not future.done():
          future.set_exception(e)
      return None

  def _decode(self, batch: list) -> None:
    start = time.monotonic()
    try:
      outputs = self.decoder.decode([row for row, _ in batch])
    except Exception as e:  # pylint: disable=broad-except
      if len(batch) == 1:
        logging.exception("Decoding a row failed.")
        batch[0][1].set_exception(e)
        return
      logging.warning("A batch of %d rows failed (%s); decoding them one by one.", len(batch),
                      e)
      for item in batch:
        self._decode([item])
      return
    logging.debug("Decoded %d rows in %.3f s.", len(batch), time.monotonic() - start)
    for (_, future), output in zip(batch, outputs):
      future.set_result(output)
    self._stats.answered(outputs, 0, self._waiting)
