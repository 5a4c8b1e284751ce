"""Speed on random tokens (no dataset): training step, MFU and decoding throughput.

  python -m transformer_jax.benchmark --config configs/demo.py --batch_size 64 --seq_len 32 \
      --decode_len 64 --steps 20 [--config.model.K=V ...] [--vocab_size V] [--peak_tflops P]

Prints one JSON line: train_step_s, train_tokens_per_s (target tokens per second, whole
machine), model_flops_per_step (analytic, `flops.py`), mfu (against --peak_tflops, the data
sheet of a known accelerator, or a measured float32 matmul on CPU), compile_s,
peak_memory_bytes (where the backend reports it), device, and decode throughputs.

Decoding runs for exactly `decode_len` tokens per row (EOS is never chosen) with random
weights, with the KV cache and without it. "Without" recomputes the
decoder over the whole fixed-length output buffer at every step, which is what a
jit-compiled decoder without a cache does (shapes are static).
"""

from __future__ import annotations

import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags
from ml_collections import config_flags

from transformer_jax import families
from transformer_jax import flops
from transformer_jax import parallel
from transformer_jax import train
from transformer_jax.inference import decoding
from transformer_jax.model import kv_cache

NEVER = -1  # an EOS id no token has: every row decodes decode_len tokens
PROFILE_STEPS = 3  # traced after the timed steps, with --profile_dir


def _timed(fn, steps: int, warmup: int) -> float:
  """Mean seconds per call of `fn` (which must block until its result is ready)."""
  for _ in range(warmup):
    fn()
  start = time.perf_counter()
  for _ in range(steps):
    fn()
  return (time.perf_counter() - start) / steps


def trace_steps(run, profile_dir: str, steps: int = PROFILE_STEPS) -> None:
  """A jax.profiler trace of `steps` calls of `run` in `profile_dir`, with the Perfetto file
  that benchmarks/trace_summary.py reads."""
  with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
    for _ in range(steps):
      run()


def train_step_runner(config, family, batch_size: int, seq_len: int,
                      batch: dict | None = None, with_state: bool = False):
  """A call that runs one training step (config.parallel's layout) on fixed random tokens (or
  the host arrays of `batch`, e.g. a classifier's inputs and labels) and blocks until it is
  done; the state it updates lives in the closure (`with_state`: also a call that returns
  it, and one that returns the bytes the compiled step needs: `compiled_bytes`)."""
  train.use_prng_impl(config)
  layout = parallel.make_layout(config)
  if batch is None:
    rng = np.random.default_rng(0)
    batch = {k: rng.integers(3, config.model.vocab_size, (batch_size, seq_len), dtype=np.int32)
             for k in ("inputs", "targets")}
  batch = layout.train_batch(batch)
  create = functools.partial(train.create_state, config, family, jax.random.PRNGKey(0))
  holder = {"state": layout.place_state(layout.create_state(create))}
  dropout = jax.random.PRNGKey(1)
  step = train.compile_train_step(config, family, layout)

  def run():
    holder["state"], sums = step(holder["state"], batch, dropout)
    jax.block_until_ready(sums)

  if not with_state:
    return run
  return run, lambda: holder["state"], lambda: compiled_bytes(step, holder["state"], batch,
                                                              dropout)


def compiled_bytes(compiled, *args) -> int:
  """Bytes XLA's program for `compiled(*args)` needs while it runs: its arguments, its outputs
  (those that reuse an argument's buffer counted once) and its temporaries."""
  memory = compiled.lower(*args).compile().memory_analysis()
  return (memory.argument_size_in_bytes + memory.output_size_in_bytes
          - memory.alias_size_in_bytes + memory.temp_size_in_bytes)


def train_speed(config, family, batch_size: int, seq_len: int, steps: int, warmup: int,
                profile_dir: str | None = None) -> dict:
  """Seconds per training step (config.parallel's layout) on random tokens, and target
  tokens per second; with `profile_dir`, then a trace of PROFILE_STEPS more steps there."""
  run = train_step_runner(config, family, batch_size, seq_len)
  start = time.perf_counter()
  run()
  compile_s = time.perf_counter() - start
  seconds = _timed(run, steps, warmup)
  if profile_dir:
    trace_steps(run, profile_dir)
  return {"train_step_s": seconds, "train_tokens_per_s": batch_size * seq_len / seconds,
          "compile_s": compile_s}


def _no_pad(logits):
  # Random weights may favour id 0; padding must never be generated (it would end the prefix).
  return logits.at[:, 0].set(decoding.NEG_INF)


def _no_cache_callback(family, params, encoded, source, batch_rows, decode_len):
  """tokens_to_logits that re-runs the decoder over the whole output buffer each step."""
  model = family.model

  def tokens_to_logits(ids, cache):
    index = cache["index"]
    # The buffer holds the outputs so far (the model shifts in the bos itself): the token fed
    # at step t > 0 is output t - 1.
    written = jax.lax.dynamic_update_slice(cache["buffer"], ids, (0, jnp.maximum(index - 1, 0)))
    buffer = jnp.where(index == 0, cache["buffer"], written)
    logits = model.apply({"params": params}, encoded, source, buffer, deterministic=True,
                         method=model.decode)  # [n, decode_len, vocab]
    step_logits = jax.lax.dynamic_index_in_dim(logits, index, axis=1, keepdims=False)
    return _no_pad(step_logits), {"index": index + 1, "buffer": buffer}

  return tokens_to_logits, {"index": jnp.array(0),
                            "buffer": jnp.ones((batch_rows, decode_len), jnp.int32)}


def _decode(params, inputs, *, family, decode_len: int, beam_size: int, use_cache: bool):
  """Decoded ids of random-weight `family` (no EOS, so every output is decode_len long):
  with the KV cache as predict and evaluation decode, or re-running the decoder."""
  reorder_cache = expand_beams = None
  if use_cache:
    cache, cached, _ = family.runner.start_decoding(params, inputs, inputs.shape[0] * beam_size,
                                             decode_len, beams=beam_size)
    if beam_size > 1:
      reorder_cache, expand_beams = kv_cache.reorder_beams, kv_cache.expand_beams

    def tokens_to_logits(ids, cache):
      logits, cache = cached(ids, cache)
      return _no_pad(logits), cache
  else:
    model = family.model
    encoded = model.apply({"params": params}, inputs, deterministic=True, method=model.encode)
    tokens_to_logits, cache = _no_cache_callback(
        family, params, decoding.flat_batch_beam_expand(encoded, beam_size),
        decoding.flat_batch_beam_expand(inputs, beam_size), inputs.shape[0], decode_len)
  # Caches are made per example; beam search expands them to its beams.
  if beam_size > 1:
    return decoding.beam_search(inputs, cache, tokens_to_logits, beam_size=beam_size, alpha=0.6,
                                eos_id=NEVER, max_decode_len=decode_len,
                                reorder_cache=reorder_cache, expand_beams=expand_beams)[0]
  return decoding.greedy_search(cache, tokens_to_logits, batch_size=inputs.shape[0], bos_id=2,
                                eos_id=NEVER, max_decode_len=decode_len)


def decode_speed(config, family, batch_size: int, decode_len: int, steps: int,
                 warmup: int) -> dict:
  rng = np.random.default_rng(0)
  source_len = min(32, config.model.max_len)
  inputs = jnp.asarray(rng.integers(3, config.model.vocab_size, (batch_size, source_len)),
                       jnp.int32)
  params = jax.jit(lambda: family.init_params(jax.random.PRNGKey(0)))()
  result = {}
  for name, beam, cached in [("greedy", 1, True), ("greedy_no_cache", 1, False),
                             ("beam4", 4, True), ("beam4_no_cache", 4, False)]:
    fn = jax.jit(functools.partial(_decode, family=family, decode_len=decode_len, beam_size=beam,
                                   use_cache=cached))
    seconds = _timed(lambda: jax.block_until_ready(fn(params, inputs)), steps, warmup)
    result[f"decode_{name}_tokens_per_s"] = batch_size * decode_len / seconds
  result["decode_cache_speedup_greedy"] = (result["decode_greedy_tokens_per_s"] /
                                           result["decode_greedy_no_cache_tokens_per_s"])
  return result


def define_flags() -> None:
  """The command line's flags, defined when run as a program only: a library import of this
  module (train_step_runner, decode_speed) then leaves absl's flags to the importer, e.g.
  transformer_jax.main, which defines its own --config."""
  config_flags.DEFINE_config_file("config", "configs/demo.py", "Model and optimizer config.",
                                  lock_config=True)
  flags.DEFINE_integer("batch_size", 64, "Rows per step (whole machine).")
  flags.DEFINE_integer("seq_len", 32, "Source and target length for training.")
  flags.DEFINE_integer("decode_len", 64, "Tokens generated per row when decoding.")
  flags.DEFINE_integer("decode_batch_size", 32, "Rows decoded at once.")
  flags.DEFINE_integer("steps", 20, "Timed repetitions.")
  flags.DEFINE_integer("warmup", 3, "Untimed repetitions after compilation.")
  flags.DEFINE_bool("decode", True, "Also measure decoding.")
  flags.DEFINE_integer("vocab_size", None, "Overrides config.model.vocab_size.")
  flags.DEFINE_string("profile_dir", None, "Also trace PROFILE_STEPS training steps with "
                      "jax.profiler into this folder (summary: benchmarks/trace_summary.py).")
  flags.DEFINE_float("peak_tflops", None, "Peak TFLOP/s of one device for the MFU; default: "
                     "known accelerators' data sheets, or a measured matmul on CPU.")


def main(argv):
  del argv
  f = flags.FLAGS
  config = f.config
  with config.unlocked():
    if f.vocab_size:
      config.model.vocab_size = f.vocab_size
    config.model.max_len = max(config.model.max_len, f.seq_len, f.decode_len)
    config.task, config.architecture = "translation", "encoder_decoder"
  family = families.get(config)
  model_config = family.model_config
  device = jax.devices()[0]
  result = {"device": device.device_kind, "devices": jax.device_count(),
            "batch_size": f.batch_size, "seq_len": f.seq_len, "dtype": str(config.model.dtype)}
  result.update(train_speed(config, family, f.batch_size, f.seq_len, f.steps, f.warmup,
                            f.profile_dir))
  step_flops = flops.train_step_flops(model_config, f.batch_size, f.seq_len, f.seq_len)
  if f.peak_tflops:
    peak, source = f.peak_tflops, "--peak_tflops"
  else:
    peak, source = flops.peak_tflops(model_config.dtype, device)
  result.update(model_flops_per_step=step_flops, peak_tflops_per_device=peak, peak_source=source,
                mfu=step_flops / result["train_step_s"] / (peak * 1e12 * jax.device_count()))
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  result["peak_memory_bytes"] = (stats or {}).get("peak_bytes_in_use")
  if f.decode:
    result["decode_len"] = f.decode_len
    result["decode_batch_size"] = f.decode_batch_size
    result.update(decode_speed(config, family, f.decode_batch_size, f.decode_len,
                               max(f.steps // 4, 2), 1))
  print(json.dumps(result), flush=True)


if __name__ == "__main__":
  define_flags()
  app.run(main)
