"""Runs of `python -m transformer_jax.main` as a user starts them, for the robustness tests."""

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

from tests.conftest import ROOT, xla_flags


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def env(devices: int = 1, **extra) -> dict:
  return dict(os.environ, XLA_FLAGS=xla_flags(devices),
              JAX_PLATFORMS="cpu", **extra)


def command(workdir: str, *args: str, cache: str | None = None) -> list[str]:
  config = ["--config", f"tests/tiny_config.py:{cache}"] if cache else []
  return [sys.executable, "-m", "transformer_jax.main", "--workdir", str(workdir), *config,
          *args]


class Run(subprocess.Popen):
  """A run in the background whose output goes to files: a pipe that nobody reads while the
  test waits would fill up and stall the run."""

  def __init__(self, args, **kwargs):
    self._files = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    super().__init__(args, stdout=self._files[0], stderr=self._files[1], text=True, **kwargs)

  def output(self) -> tuple[str, str]:
    """(stdout, stderr) so far."""
    texts = []
    for f in self._files:
      f.seek(0)
      texts.append(f.read())
    return texts[0], texts[1]

  def communicate(self, input=None, timeout=None):  # pylint: disable=redefined-builtin
    del input
    self.wait(timeout)
    return self.output()


STARTED: list[subprocess.Popen] = []  # killed after each test (conftest), whatever happened


def start(workdir, *args, cache=None, environ=None) -> Run:
  process = Run(command(workdir, *args, cache=cache), cwd=ROOT, env=environ or env())
  STARTED.append(process)
  return process


def run(workdir, *args, cache=None, environ=None, timeout=300) -> subprocess.CompletedProcess:
  return subprocess.run(command(workdir, *args, cache=cache), cwd=ROOT, env=environ or env(),
                        capture_output=True, text=True, timeout=timeout)


def run_main(*args, input=None, environ=None,  # pylint: disable=redefined-builtin
             timeout=300) -> subprocess.CompletedProcess:
  """`python -m transformer_jax.main ARGS` without a workdir (serving a --pretrained model)."""
  return subprocess.run([sys.executable, "-m", "transformer_jax.main", *args], cwd=ROOT,
                        env=environ or env(), capture_output=True, text=True, timeout=timeout,
                        input=input)


def main_in_process(monkeypatch, *args: str, stdin: str = "") -> tuple[int, str]:
  """`python -m transformer_jax.main ARGS` through main's own flag parsing and entry, in this
  process: (exit status, what it wrote to stderr). A process per call costs seconds of imports;
  the tests that need a real process (its exit, signals, devices) start one."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  from absl import logging  # pylint: disable=import-outside-toplevel
  from transformer_jax import main  # pylint: disable=import-outside-toplevel
  argv = ["transformer_jax.main", *args]
  monkeypatch.setattr(sys, "argv", argv)  # config_flags reads its overrides there
  monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode())))
  # Training adds its XLA:CPU flag to XLA_FLAGS: restored afterwards, so that the processes
  # later tests start do not inherit it.
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  handler, was_parsed = logging.get_absl_handler(), flags.FLAGS.is_parsed()
  filters, level = list(handler.filters), logging.get_absl_logger().level

  def forget_flags():  # a parse registers a flag per --config.KEY override
    for name in [name for name in flags.FLAGS if name.startswith("config.")]:
      delattr(flags.FLAGS, name)
    flags.FLAGS.unparse_flags()

  forget_flags()
  stderr, code = io.StringIO(), 0
  try:
    with contextlib.redirect_stderr(stderr):
      main.parse_flags(argv)
      main.main(argv[:1])
  except SystemExit as e:
    code = e.code
  finally:
    forget_flags()
    if was_parsed:
      flags.FLAGS.mark_as_parsed()
    handler.filters[:] = filters  # main's log filter reads the flags
    logging.get_absl_logger().setLevel(level)  # the parse set it from --verbosity
  return code, stderr.getvalue()


def user_error(stderr: str) -> str:
  """The lines a user sees besides the log: at most two, and never a traceback."""
  assert "Traceback" not in stderr, stderr[-3000:]
  lines = [line for line in stderr.splitlines() if line.startswith("error:")]
  assert 1 <= len(lines) <= 2, stderr[-3000:]
  return "\n".join(lines)


def wait_for(condition, process: subprocess.Popen | None = None, timeout: float = 300):
  """Polls `condition` until it holds; fails early if `process` ends first."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    if condition():
      return
    if process is not None and process.poll() is not None:
      raise AssertionError(f"the run ended first: {process.communicate()[1][-3000:]}")
    time.sleep(0.5)
  so_far = process.output()[1][-3000:] if isinstance(process, Run) else ""
  raise AssertionError(f"timed out; the run's log so far: {so_far}")


# Seconds after which a run that has not exited counts as hung. A stop or an exit takes a few
# seconds alone, and once took over a minute beside the other xdist worker on the 2-core CI
# machine, so no test times it against a tighter deadline.
HANG = 180


def stop(process: subprocess.Popen, sig=signal.SIGTERM, timeout: float = HANG):
  """Sends `sig`; returns (exit code, stdout, stderr)."""
  process.send_signal(sig)
  try:
    out, err = process.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    so_far = process.output()[1][-4000:] if isinstance(process, Run) else ""
    raise AssertionError(f"no exit {timeout:.0f} s after signal {sig}; the run's log so far: "
                         f"{so_far}") from None
  return process.returncode, out, err


class Bucket:
  """A bucket of the GCS emulator, read through its JSON API (the test process itself keeps
  no storage client)."""

  def __init__(self, url: str, name: str):
    self.url, self.name = url, name

  def names(self, prefix: str = "") -> list[str]:
    query = urllib.parse.urlencode({"prefix": prefix})
    with urllib.request.urlopen(f"{self.url}/storage/v1/b/{self.name}/o?{query}") as r:
      return [item["name"] for item in json.load(r).get("items", [])]

  def read(self, name: str) -> bytes:
    quoted = urllib.parse.quote(name, safe="")
    with urllib.request.urlopen(f"{self.url}/storage/v1/b/{self.name}/o/{quoted}?alt=media") as r:
      return r.read()

  def write(self, name: str, data: bytes) -> None:
    query = urllib.parse.urlencode({"uploadType": "media", "name": name})
    request = urllib.request.Request(f"{self.url}/upload/storage/v1/b/{self.name}/o?{query}",
                                     data=data, method="POST")
    urllib.request.urlopen(request).close()

  def steps(self, run: str) -> list[int]:
    """Finished checkpoint steps (Orbax marks them with commit_success.txt on GCS)."""
    return sorted({int(n.split("/")[2]) for n in self.names(f"{run}/checkpoints/")
                   if n.split("/")[2].isdigit() and n.endswith("/commit_success.txt")
                   and n.count("/") == 3})
