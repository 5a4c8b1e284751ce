"""`--mode serve`: loads the model, compiles its smallest batch shape, serves HTTP until
SIGTERM while the other shapes compile in the background (a request whose shape is not ready
compiles it itself; none fails for it), with JAX's persistent compilation cache on by
default, so that a second start reads the compiled programs instead.

On SIGTERM (or Ctrl-C) uvicorn stops accepting connections and waits for the requests in
flight, which the engine finishes decoding; the process then exits 0.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import sys
import threading
import time
from typing import Sequence

from absl import logging
import jax
import ml_collections

from transformer_jax import default_config
from transformer_jax import predict
from transformer_jax.serving import app as app_lib
from transformer_jax.serving import batch_decoder
from transformer_jax.serving import slot_pool
from transformer_jax.serving import engine as engine_lib

API_KEY_VARIABLE = "TRANSFORMER_JAX_API_KEY"  # the API key, where --api_key is not given


def use_compilation_cache(folder: str | None) -> str | None:
  """Turns on JAX's persistent compilation cache in `folder` (None: $JAX_COMPILATION_CACHE_DIR
  where set, else the user's cache folder, ~/.cache/transformer_jax/jax or $XDG_CACHE_HOME's;
  'none': off); returns the folder."""
  if folder == "none":
    return None
  folder = folder or os.environ.get("JAX_COMPILATION_CACHE_DIR")
  if not folder:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.path.join(base, "transformer_jax", "jax")
  jax.config.update("jax_compilation_cache_dir", folder)
  # Every program the server runs is a decode worth keeping, however quickly it compiled.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  print(f"Compilation cache: {folder} (--compilation_cache none: off).", file=sys.stderr,
        flush=True)
  return folder


def load_model(workdir: str | None = None, pretrained: str | None = None,
               step: int | str | None = None, average_last: int = 1,
               config: ml_collections.ConfigDict | None = None,
               given_keys: Sequence[str] | None = None,
               adapter: str | None = None) -> predict.Predictor:
  """The model to serve: a workdir's checkpoint (as --mode predict restores it; LoRA adapters
  merged) or a pretrained checkpoint, with a PEFT `adapter` merged where given
  (`Predictor.from_pretrained`'s arguments)."""
  if pretrained is not None:
    return predict.Predictor.from_pretrained(pretrained, config, given_keys=given_keys,
                                             adapter=adapter)
  return predict.Predictor.from_workdir(workdir, step, average_last, config)


def serve_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """config.serve, with default_config's values where an older saved config has none."""
  defaults = default_config.get_config().serve.to_dict()
  return ml_collections.ConfigDict({**defaults, **config.get("serve", {})})


def model_name(workdir: str | None, pretrained: str | None) -> str:
  """The id /v1/models shows and requests name: the checkpoint's folder or hub name."""
  if pretrained is not None:
    return pretrained if not os.path.isdir(pretrained) else os.path.basename(
        os.path.normpath(pretrained))
  return os.path.basename(os.path.normpath(workdir))


def check_address(host: str, port: int) -> None:
  """Raises ValueError where `host`:`port` cannot be listened on (in use, not this
  machine's), before the model is loaded and compiled."""
  try:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
      probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      probe.bind((host, port))
  except OSError as e:
    raise ValueError(f"Cannot listen on {host}:{port}: {e.strerror or e}; pick another --port "
                     "or --host.") from e


def check_host(host: str, api_key: str | None) -> None:
  """Warns when the server is reachable beyond this machine without an API key."""
  if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
    logging.warning("Serving on %s without an API key: anyone who reaches this port can use "
                    "the model (pass --api_key or set %s).", host, API_KEY_VARIABLE)


def settle_heap() -> None:
  """Keeps what is loaded by now (the model, JAX, compiled programs: hundreds of thousands of
  objects that live as long as the server) out of the collector's full collections, each of
  which walked them all and held every thread for 0.15-0.4 s, many times a minute under
  load. Garbage is collected first, so that none is kept."""
  gc.collect()
  gc.freeze()


def run_serve(predictor: predict.Predictor, name: str, host: str = "127.0.0.1",
              port: int = 8000, api_key: str | None = None, adapters=None) -> None:
  """Serves `predictor` at http://host:port until SIGTERM or Ctrl-C, with the named LoRA
  `adapters` (adapters.AdapterSet) beside it where given."""
  import uvicorn  # pylint: disable=g-import-not-at-top
  api_key = api_key or os.environ.get(API_KEY_VARIABLE) or None
  check_host(host, api_key)
  serve = serve_config(predictor.config)
  with predictor.config.unlocked():
    predictor.config.serve = serve
  decoder = batch_decoder.BatchDecoder(predictor, serve.max_batch_size, serve.stream_steps,
                                       adapters)
  pool = (slot_pool.SlotPool(decoder) if serve.get("continuous_batching", True)
          and not decoder.classifier else None)
  compiled = pool or decoder  # what is compiled per shape: the pool's refills, or batches
  shapes = compiled.shapes()
  start = time.perf_counter()
  what = "new rows" if pool else "batch shape"

  def progress(done: int, total: int, shape: tuple[int, ...]) -> None:
    packed = f", packed into {shape[2]}" if len(shape) > 2 and shape[2] else ""
    print(f"Compiling {what} {done + 1}/{total}: {shape[1]} rows of {shape[0]} prompt "
          f"tokens{packed} ({time.perf_counter() - start:.0f} s so far).", file=sys.stderr,
          flush=True)

  compiled.warm_up(progress, shapes[:1])  # the smallest: answering starts once it is ready

  stopping = threading.Event()

  def compile_the_rest():  # until shutdown, which waits for the shape in progress
    if compiled.warm_up(progress, shapes[1:], stopping):
      print(f"Compiled all {len(shapes)} {what} shapes (prompts up to "
            f"{decoder.max_source_length} tokens, up to {decoder.max_batch_size} rows) in "
            f"{time.perf_counter() - start:.0f} s.", file=sys.stderr, flush=True)
      settle_heap()  # the compiled programs too

  engine = engine_lib.Engine(decoder, serve.max_wait_ms, serve.max_queue, pool,
                             serve.log_stats_s)
  app = app_lib.create_app(app_lib.Service(predictor, engine, name), api_key)
  # A line per request only where asked for: at hundreds of requests a second, logging them
  # took a tenth of the event loop.
  server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                         access_log=serve.log_requests,
                                         timeout_graceful_shutdown=300))
  # uvicorn re-raises the signal that stopped it once it has drained; a handler that does
  # nothing lets the drained server exit 0 instead of dying by SIGTERM.
  previous = signal.signal(signal.SIGTERM, lambda *_: None)
  # Joined before the process exits: a thread left inside XLA's compiler at exit aborts it.
  compiler = threading.Thread(target=compile_the_rest, name="compile-shapes")
  settle_heap()
  compiler.start()
  try:
    beside = f" and adapters {', '.join(adapters.names)}" if adapters else ""
    print(f"Serving {name}{beside} on http://{host}:{port}/v1 (Ctrl-C or SIGTERM stops).",
          file=sys.stderr, flush=True)
    server.run()
  finally:
    signal.signal(signal.SIGTERM, previous)
    stopping.set()
    compiler.join()
    engine.close()
