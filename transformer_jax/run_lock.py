"""One training run per workdir: a lock file that names its holder (host, pid, start time).

Created exclusively (O_EXCL on a disk, an if-absent precondition in a bucket), refreshed by a
heartbeat thread, removed when the run ends. A lock whose holder is gone is taken over with a
warning: on the same machine when its process no longer exists (or the machine rebooted since),
from another machine when its heartbeat is older than `stale_after` seconds.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time

import fsspec
from absl import logging

from transformer_jax import workdir as workdir_lib

LOCK_FILE = "RUN_LOCK"


class WorkdirBusyError(RuntimeError):
  """Another live run holds the workdir."""


def _boot_id() -> str:
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      return f.read().strip()
  except OSError:
    return ""


def _process_exists(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


class RunLock:
  """`with RunLock(workdir): ...` holds the workdir for the duration of the block."""

  def __init__(self, workdir: str, stale_after: float = 600.0, heartbeat: float = 60.0):
    self.url = os.fspath(workdir_lib.path(workdir) / LOCK_FILE)
    self._fs, self._path = fsspec.core.url_to_fs(self.url)
    self.stale_after = stale_after
    self.heartbeat = heartbeat
    self._stop = threading.Event()
    self._thread = None
    self._holder = dict(host=socket.gethostname(), pid=os.getpid(), boot_id=_boot_id(),
                        started=datetime.datetime.now().astimezone().isoformat(timespec="seconds"))

  def _record(self) -> bytes:
    return json.dumps(dict(self._holder, heartbeat=time.time())).encode()

  def _create(self) -> bool:
    """Writes the lock if there is none; False if one exists."""
    try:
      self._fs.pipe_file(self._path, self._record(), mode="create")
      return True
    except FileExistsError:
      return False

  def _read(self) -> dict | None:
    try:
      return json.loads(self._fs.cat_file(self._path))
    except FileNotFoundError:
      return None
    except ValueError:  # a half-written lock from a killed run: its writer is gone
      return {}

  def _is_stale(self, holder: dict) -> bool:
    if not holder:
      return True
    same_machine = (holder.get("host") == self._holder["host"] and
                    holder.get("boot_id") == self._holder["boot_id"])
    if same_machine:
      return not _process_exists(int(holder.get("pid", -1)))
    return time.time() - float(holder.get("heartbeat", 0)) > self.stale_after

  def acquire(self) -> None:
    """Takes the lock, or raises WorkdirBusyError naming the run that holds it."""
    self._fs.makedirs(self._fs._parent(self._path), exist_ok=True)
    while not self._create():
      holder = self._read()
      if holder is None:
        continue  # released between our two calls: try again
      if not self._is_stale(holder):
        raise WorkdirBusyError(
            f"{self.url} is held by another run (host {holder.get('host')}, pid "
            f"{holder.get('pid')}, started {holder.get('started')}); wait for it to end, or use "
            "another --workdir.")
      logging.warning("Taking over the lock of a run that is gone (host %s, pid %s, started "
                      "%s).", holder.get("host"), holder.get("pid"), holder.get("started"))
      self._fs.rm_file(self._path)
    self._thread = threading.Thread(target=self._beat, name="run_lock", daemon=True)
    self._thread.start()

  def _beat(self) -> None:
    while not self._stop.wait(self.heartbeat):
      try:
        self._fs.pipe_file(self._path, self._record())
      except Exception as e:  # a missed heartbeat is not worth stopping training for
        logging.warning("Could not refresh %s: %s", self.url, e)

  def release(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
      holder = self._read()
      if holder and holder.get("pid") == self._holder["pid"] and (
          holder.get("host") == self._holder["host"]):
        self._fs.rm_file(self._path)

  def __enter__(self) -> "RunLock":
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()
