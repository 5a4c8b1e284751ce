"""TensorBoard event files on a local disk or in a bucket, without TensorFlow.

clu's SummaryWriter goes through tf.summary, whose GCS client cannot be pointed at an emulator
and which makes TensorFlow a dependency of training. This writer builds the same event records
with TensorBoard's own protobufs and writes them through the workdir's file-system layer
(etils.epath): appended to a local file, or re-uploaded whole to an object store at each flush
(objects cannot be appended to; a file that outgrows `max_object_bytes` is closed and a new
one started, and TensorBoard reads them in order).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Any, Mapping

from tensorboard.compat.proto import event_pb2
from tensorboard.compat.proto import summary_pb2
from tensorboard.compat.proto import tensor_pb2
from tensorboard.compat.proto import tensor_shape_pb2
from tensorboard.compat.proto import types_pb2
from tensorboard.plugins.hparams import summary_v2 as hparams_summary
from tensorboard.summary.writer import record_writer

from transformer_jax import workdir as workdir_lib


class _Records:
  """Collects framed records in memory (RecordWriter wants a file-like object)."""

  def __init__(self):
    self.data = bytearray()

  def write(self, data: bytes) -> None:
    self.data += data

  def flush(self) -> None:
    pass


class EventFileWriter:
  """Scalars, texts, hparams and PNG images as TensorBoard events under `logdir`; the method
  names are those of clu's MetricWriter (whose package imports TensorFlow)."""

  def __init__(self, logdir: str, max_object_bytes: int = 8 << 20):
    self._logdir = workdir_lib.path(logdir)
    self._remote = workdir_lib.is_url(logdir)
    self._max_object_bytes = max_object_bytes
    self._lock = threading.Lock()
    self._logdir.mkdir(parents=True, exist_ok=True)
    self._start_file()

  def _start_file(self) -> None:
    name = f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}.v2"
    self._file = self._logdir / name
    self._written = bytearray()  # remote: the object's whole contents so far
    self._pending = _Records()
    self._records = record_writer.RecordWriter(self._pending)
    self._write_event(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

  def _write_event(self, event: event_pb2.Event) -> None:
    with self._lock:
      self._records.write(event.SerializeToString())

  def _write_values(self, step: int, values: list[summary_pb2.Summary.Value]) -> None:
    self._write_event(event_pb2.Event(wall_time=time.time(), step=int(step),
                                      summary=summary_pb2.Summary(value=values)))

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    self._write_values(step, [summary_pb2.Summary.Value(tag=tag, simple_value=float(value))
                              for tag, value in scalars.items()])

  def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
    metadata = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
    self._write_values(step, [summary_pb2.Summary.Value(
        tag=tag, metadata=metadata, tensor=tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING, string_val=[text.encode("utf-8")],
            tensor_shape=tensor_shape_pb2.TensorShapeProto()))
                              for tag, text in texts.items()])

  def write_pngs(self, step: int, images: Mapping[str, bytes]) -> None:
    """Images (PNG-encoded) for TensorBoard's Images tab. (clu's write_images takes pixel
    arrays; the heatmaps here come from matplotlib already encoded.)"""
    self._write_values(step, [summary_pb2.Summary.Value(tag=tag, image=summary_pb2.Summary.Image(
        height=_png_size(png)[1], width=_png_size(png)[0], colorspace=4,
        encoded_image_string=png)) for tag, png in images.items()])

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    """`hparams` (flat: key -> value) for TensorBoard's HParams tab, at step 0. Values other
    than bool, int, float and str (lists, None) are written as their text."""
    values = {key: value if isinstance(value, (bool, int, float, str)) else str(value)
              for key, value in hparams.items()}
    summary = hparams_summary.hparams_pb(values)
    self._write_event(event_pb2.Event(wall_time=time.time(), step=0, summary=summary))

  def write_summaries(self, step, values, metadata=None):
    raise NotImplementedError("EventFileWriter writes scalars, texts, hparams and PNGs only.")

  def write_images(self, step, images):
    raise NotImplementedError("EventFileWriter writes scalars, texts, hparams and PNGs only.")

  def write_videos(self, step, videos):
    raise NotImplementedError("EventFileWriter writes scalars, texts, hparams and PNGs only.")

  def write_audios(self, step, audios, *, sample_rate):
    raise NotImplementedError("EventFileWriter writes scalars, texts, hparams and PNGs only.")

  def write_histograms(self, step, arrays, num_buckets=None):
    raise NotImplementedError("EventFileWriter writes scalars, texts, hparams and PNGs only.")

  def flush(self) -> None:
    with self._lock:
      pending = bytes(self._pending.data)
      self._pending.data.clear()
      if not pending:
        return
      if self._remote:
        self._written += pending
        self._file.write_bytes(bytes(self._written))
      else:
        try:
          with self._file.open("ab") as f:
            f.write(pending)
        except OSError as e:  # a full disk: name the file (the error itself does not)
          raise OSError(e.errno, e.strerror, str(self._file)) from None
    if self._remote and len(self._written) > self._max_object_bytes:
      self._start_file()

  def close(self) -> None:
    self.flush()


def _png_size(png: bytes) -> tuple[int, int]:
  """(width, height) from a PNG's header."""
  return struct.unpack(">II", png[16:24])


class _NoWriter:
  """What processes other than 0 write: nothing."""

  def write_scalars(self, step, scalars): pass
  def write_texts(self, step, texts): pass
  def write_pngs(self, step, images): pass
  def write_hparams(self, hparams): pass
  def flush(self): pass
  def close(self): pass


def create_writer(logdir: str, is_chief: bool) -> EventFileWriter | _NoWriter:
  """Process 0 writes events to `logdir`; the others write nothing (progress goes to the log
  from train.py, once)."""
  return EventFileWriter(logdir) if is_chief else _NoWriter()
