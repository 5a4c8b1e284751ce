"""Training and evaluation loop: `train_and_evaluate(config, workdir)`."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax.training import train_state
from jax.experimental import multihost_utils

from transformer_jax import attention_maps
from transformer_jax import checkpoints
from transformer_jax import config_validation
from transformer_jax import evaluation
from transformer_jax import families
from transformer_jax import flops
from transformer_jax import metrics
from transformer_jax import parallel
from transformer_jax import preemption
from transformer_jax import run_lock
from transformer_jax import saved_config
from transformer_jax import summary_writer
from transformer_jax import tasks
from transformer_jax import tokenizer as tokenizer_lib
from transformer_jax import workdir as workdir_lib
from transformer_jax.data import examples as examples_lib
from transformer_jax.data import pipeline
from transformer_jax.data import sources
from transformer_jax.data import token_cache


class NonFiniteLossError(RuntimeError):
  """The loss or the gradient norm stopped being finite; nothing was saved after it."""


def rsqrt_schedule(peak_learning_rate: float, warmup_steps: int) -> optax.Schedule:
  """Linear warmup to the peak, then decay with 1/sqrt(step), as in the paper."""

  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0  # optax counts from 0
    warmup = jnp.float32(max(warmup_steps, 1))
    return peak_learning_rate * jnp.minimum(step / warmup, jnp.sqrt(warmup / step))

  return schedule


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Adam (0.9, 0.98, 1e-9) on the rsqrt schedule; optional clipping and weight decay."""
  schedule = rsqrt_schedule(config.learning_rate, config.warmup_steps)
  if config.weight_decay > 0:
    adam = optax.adamw(schedule, b1=0.9, b2=0.98, eps=1e-9, weight_decay=config.weight_decay)
  else:
    adam = optax.adam(schedule, b1=0.9, b2=0.98, eps=1e-9)
  if config.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adam)
  return adam


def load_tokenizer(config: ml_collections.ConfigDict, workdir: str) -> tokenizer_lib.Tokenizer:
  """The workdir's tokenizer; on first use copied from `config.tokenizer.path`, or trained on
  a seeded sample of the training split's texts (by process 0; the others wait and load it,
  so every process of a multi-host run uses the same one)."""
  path = workdir_lib.tokenizer_path(workdir)
  if jax.process_index() == 0 and not path.exists():
    _new_tokenizer(config).save(path)
  if jax.process_count() > 1:  # every process passes here, whether or not it was made now
    multihost_utils.sync_global_devices("tokenizer saved")
  return tokenizer_lib.Tokenizer.load(path)


def _new_tokenizer(config: ml_collections.ConfigDict) -> tokenizer_lib.Tokenizer:
  t = config.tokenizer
  if t.path:
    return tokenizer_lib.Tokenizer.load(t.path)
  # The split is streamed: only the sample is held, whatever the corpus size.
  train_examples, _ = examples_lib.stream(config, "train")
  texts = tokenizer_lib.sample(tasks.training_texts(train_examples), t.num_sentences,
                               config.seed)
  logging.info("Training a %d-piece SentencePiece %s tokenizer on %d training texts.",
               config.model.vocab_size, t.model_type, len(texts))
  return tokenizer_lib.train_tokenizer(
      texts, config.model.vocab_size, model_type=t.model_type,
      character_coverage=t.character_coverage, byte_fallback=t.byte_fallback)


def data_shards(config: ml_collections.ConfigDict) -> tuple[int, range]:
  """How many shards the training split is read as, and which of them this process reads."""
  count = config.data_shards or jax.process_count()
  return count, pipeline.shards_of_process(jax.process_index(), jax.process_count(), count)


def prepare_data(config: ml_collections.ConfigDict, workdir: str, splits=sources.SPLITS, *,
                 training: bool = True):
  """Examples of the evaluation `splits`, the workdir's tokenizer (made on first use), and
  token features: the training split as `pipeline.Shards` (this process's, see
  `data_shards`), the others as `pipeline.Encoded`.

  The training texts are streamed, never held whole (`examples` has no "train"), and each
  shard's features come from the workdir's token cache (data/token_cache.py) when it holds
  them for this tokenizer, config and data; otherwise the shard is encoded and cached. With
  `training` False the training split is read like the others, to be scored.
  """
  family = families.get(config)
  tokenizer = load_tokenizer(config, workdir)
  eval_splits = [split for split in splits if split != "train" or not training]
  examples = examples_lib.load_examples(config, eval_splits) if eval_splits else {}
  encoded = {}
  if "train" in splits and training:
    encoded["train"] = _training_shards(config, workdir, family, tokenizer)
  for split in eval_splits:  # every reference is scored: overlong examples are truncated
    encoded[split], overlong = family.encode_examples(examples[split], tokenizer)
    _warn_overlong(config, split, overlong, len(examples[split]), "truncated")
  return examples, tokenizer, encoded


def _training_shards(config: ml_collections.ConfigDict, workdir: str, family: families.Family,
                     tokenizer: tokenizer_lib.Tokenizer) -> pipeline.Shards:
  count, shards = data_shards(config)
  cache_key = token_cache.key(config, family.name, family.feature_lengths(),
                              tokenizer.model_proto, "train")
  held = {}
  for shard in shards:
    entry = token_cache.entry(workdir, "train", cache_key, shard, count)
    held[shard] = token_cache.load(entry)
    if held[shard] is not None:
      logging.info("Training data: %s examples from the token cache %s.",
                   f"{len(held[shard]):,}", entry)
      continue
    stream, total = examples_lib.stream(config, "train", shard, count)
    drop = config.overlong == "drop"
    held[shard], overlong = family.encode_examples(stream, tokenizer, drop_overlong=drop,
                                                   total=total)
    _warn_overlong(config, "train" if count == 1 else f"train shard {shard} of {count}",
                   overlong, len(held[shard]) + overlong * drop,
                   "dropped" if drop else "truncated")
    if jax.process_index() == pipeline.saving_process(shard, jax.process_count(), count):
      token_cache.save(entry, held[shard])
      if not workdir_lib.is_url(workdir):  # from here on memory-mapped: pages the OS can drop
        mapped = token_cache.load(entry)
        held[shard] = held[shard] if mapped is None else mapped
  return pipeline.Shards(count, held)


def _warn_overlong(config: ml_collections.ConfigDict, split: str, overlong: int, total: int,
                   what: str) -> None:
  if overlong:
    logging.warning("%s: %d of %d examples longer than max_source_length=%d / "
                    "max_target_length=%d tokens were %s.", split, overlong, total,
                    config.max_source_length, config.max_target_length, what)


def _whole_data_state(state: dict) -> dict:
  """The data position of every shard, from this process's (which knows its own shards)."""
  if jax.process_count() == 1 or "shards" not in state:
    return state
  gathered = multihost_utils.process_allgather(np.asarray(state["shards"]))
  return pipeline.merge_states([{"shards": part} for part in gathered.tolist()])


def train_step(state: train_state.TrainState, batch, rng, *, family: families.Family,
               label_smoothing: float, grad_accum_steps: int = 1,
               axis_name: str | None = parallel.AXIS):
  """One update on the global batch, under either layout (see parallel.py).

  Under pmap (`axis_name` set) `batch` is this device's rows and sums are reduced over the
  axis; under jit (`axis_name` None) `batch` is the whole global batch.

  With `grad_accum_steps` k > 1 this device's rows are k micro-batches, run one after another
  (lax.scan) with their gradients summed: the same update as the whole batch at once, in a
  k-th of the activation memory.
  """
  # Different dropout on every step and device, reproducible from (rng, step, device).
  step_rng = jax.random.fold_in(rng, state.step)
  if axis_name is not None:
    step_rng = jax.random.fold_in(step_rng, jax.lax.axis_index(axis_name))
  # Dividing by the global token count makes the summed gradients an exact token mean.
  denominator = parallel.psum(jnp.sum(family.labels_and_weights(batch)[1]), axis_name)

  def micro_step(micro_batch, dropout_rng):
    labels, weights = family.labels_and_weights(micro_batch)

    def loss_fn(params):
      logits = family.forward(params, micro_batch, deterministic=False,
                              rngs={"dropout": dropout_rng})
      loss, unsmoothed = metrics.smoothed_cross_entropy(logits, labels, label_smoothing,
                                                        also_unsmoothed=True)
      return jnp.sum(loss * weights) / denominator, (logits, unsmoothed)

    (_, (logits, unsmoothed)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return grads, metrics.token_metrics(logits, labels, weights, unsmoothed)

  if grad_accum_steps == 1:
    grads, sums = micro_step(batch, step_rng)
  else:
    # Micro-batch i takes rows i, i + k, i + 2k, ...: under jit every device keeps an equal
    # share of each micro-batch, so no rows move between devices.
    micro_batches = (jax.tree.map(
        lambda x: x.reshape((-1, grad_accum_steps) + x.shape[1:]).swapaxes(0, 1), batch),
                     jax.random.split(step_rng, grad_accum_steps))

    def accumulate(totals, micro_batch):
      grads, sums = micro_step(*micro_batch)
      return jax.tree.map(jnp.add, totals, (grads, sums)), None

    first = jax.tree.map(lambda x: x[0], micro_batches)
    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: micro_step(*first)))
    (grads, sums), _ = jax.lax.scan(accumulate, zeros, micro_batches)
  grads = parallel.psum(grads, axis_name)
  new_state = state.apply_gradients(grads=grads)
  sums = parallel.psum(sums, axis_name)
  grad_norm = optax.tree.norm(grads)  # of the whole batch's gradient, before any clipping
  # Checked on the host before every save: non-finite weights are never checkpointed.
  finite = jnp.isfinite(sums["loss"]) & jnp.isfinite(grad_norm)
  # Norms are summed over the steps between two log lines like the other sums; the log
  # divides them by the number of steps (their mean over the interval).
  return new_state, dict(sums, nonfinite_steps=jnp.where(finite, 0.0, 1.0),
                         grad_norm=grad_norm, param_norm=optax.tree.norm(new_state.params))


def compile_train_step(config: ml_collections.ConfigDict, family: families.Family,
                       layout=None):
  """`train_step` for this config, compiled by `layout` (default: pmap) with the state donated
  (updated in place). Call it as step(placed_state, placed_batch, rng)."""
  layout = layout or parallel.DataParallel()
  return layout.compile_train_step(functools.partial(
      train_step, family=family, label_smoothing=config.label_smoothing,
      grad_accum_steps=config.grad_accum_steps, axis_name=layout.axis_name))


def use_prng_impl(config: ml_collections.ConfigDict) -> None:
  """Makes `config.prng_impl` JAX's default generator; call before any key is made (it is
  process-wide, and keys of one implementation do not mix with another's)."""
  jax.config.update("jax_default_prng_impl", config.get("prng_impl", "threefry2x32"))


def create_state(config: ml_collections.ConfigDict, family: families.Family,
                 rng) -> train_state.TrainState:
  """A fresh training state. Its parameters (and their optimizer moments) are boxed with
  their logical axis names; the layout's `create_state` places and unboxes them."""
  return train_state.TrainState.create(apply_fn=family.model.apply,
                                       params=family.init_params(rng, boxed=True),
                                       tx=make_optimizer(config))


@contextlib.contextmanager
def _locked(workdir: str):
  """Holds the workdir's run lock (taken by process 0; every process learns the outcome)."""
  lock = run_lock.RunLock(workdir) if jax.process_index() == 0 else None
  error = None
  if lock is not None:
    try:
      lock.acquire()
    except run_lock.WorkdirBusyError as e:
      error = e
  if jax.process_count() > 1:
    busy = multihost_utils.broadcast_one_to_all(np.int32(error is not None))
    if busy and error is None:
      error = run_lock.WorkdirBusyError(f"{workdir} is held by another run (see process 0).")
  if error is not None:
    raise error
  try:
    yield
  finally:
    if lock is not None:
      lock.release()


def _check_finite(host_sums: dict, step: int, manager) -> None:
  if host_sums["nonfinite_steps"] == 0 and np.isfinite(host_sums["loss"]):
    return
  last_good = manager.latest_step()
  raise NonFiniteLossError(
      f"The training loss or gradient became non-finite by step {step}; stopped without "
      f"saving. Last good checkpoint: {'none' if last_good is None else f'step {last_good}'} "
      f"in {manager.directory}. Lower config.learning_rate, raise config.warmup_steps or set "
      "config.grad_clip_norm, then re-run the same command to resume from it.")


def _step_flops_and_peak(config: ml_collections.ConfigDict, family: families.Family,
                         global_batch_size: int) -> tuple[float | None, float, str]:
  """(model FLOPs of one training step or None when flops.py has no formula for this
  family, peak TFLOP/s of one device, where that peak comes from) for the logged MFU."""
  step_flops = family.train_step_flops(global_batch_size)
  if step_flops is None:
    return None, 0.0, "no FLOP count for this model family"
  if jax.devices()[0].platform == "cpu":  # no data sheet; a small matmul keeps this quick
    return step_flops, flops.measured_matmul_tflops(size=512, repeats=3), \
        "measured float32 matmul (CPU)"
  peak, source = flops.peak_tflops(family.model_config.dtype)
  return step_flops, peak, source


def _improved(value: float, best: dict | None, mode: str) -> bool:
  if not math.isfinite(value):
    return False
  if best is None:
    return True
  return value > best["value"] if mode == "max" else value < best["value"]


def _model_changes(workdir: str, config: ml_collections.ConfigDict) -> str:
  """The model / data keys in which `config` differs from the workdir's saved config."""
  try:
    changes = saved_config.fixed_key_changes(workdir_lib.load_config(workdir), config)
  except workdir_lib.WorkdirError:
    return ""
  return f"Changed since this workdir was trained: {'; '.join(changes)}." if changes else ""


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains `config` in `workdir` (a local folder or a gs:// URL), resuming from its newest
  good checkpoint; returns the final evaluation (with "preempted": True when a SIGTERM or
  Ctrl-C stopped it early, after saving)."""
  config_validation.validate(config, jax.device_count())
  use_prng_impl(config)
  workdir_lib.path(workdir).mkdir(parents=True, exist_ok=True)
  with _locked(workdir):
    return _train_and_evaluate(config, workdir)


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  # ---- Setup ----------------------------------------------------------------------------
  run_start = time.time()
  is_chief = jax.process_index() == 0
  # Two TensorBoard runs with the same tag names (loss, accuracy, ...), so that the train and
  # eval curves of a metric overlay in one chart.
  train_writer = summary_writer.create_writer(os.path.join(workdir, "train"), is_chief)
  eval_writer = summary_writer.create_writer(os.path.join(workdir, "eval"), is_chief)
  layout = parallel.make_layout(config)
  family = families.get(config)
  # Each optimizer step sees grad_accum_steps micro-batches of per_device_batch_size per device.
  global_batch_size = (config.per_device_batch_size * jax.device_count() *
                       config.grad_accum_steps)

  # ---- Data -----------------------------------------------------------------------------
  examples, tokenizer, encoded = prepare_data(config, workdir, ("train", config.eval_split))
  if not len(encoded["train"]):
    raise ValueError(f"The training split of config.dataset={config.dataset!r} is empty; check "
                     "config.data_dir and config.splits.")
  train_batches = pipeline.TrainBatches(
      encoded["train"], global_batch_size, config.seed,
      pack=config.pack_examples and family.packable,
      process_index=jax.process_index(), process_count=jax.process_count())
  eval_data, eval_examples = encoded[config.eval_split], examples[config.eval_split]
  logging.info("Data: %d train examples in %d of %d shards here / %d %s examples; vocabulary "
               "%d; global batch %d on %d devices.", len(encoded["train"]),
               len(encoded["train"].held), encoded["train"].count, len(eval_data),
               config.eval_split, tokenizer.vocab_size, global_batch_size, jax.device_count())

  # ---- Model and optimizer --------------------------------------------------------------
  if tokenizer.vocab_size > family.model_config.vocab_size:
    raise ValueError(f"The tokenizer has {tokenizer.vocab_size} pieces but config.model."
                     f"vocab_size={family.model_config.vocab_size}; raise config.model."
                     "vocab_size.")
  rng = jax.random.PRNGKey(config.seed)
  init_rng, dropout_rng = jax.random.split(rng)
  # Under jit the state is created already sharded: no device ever holds all of it.
  state = layout.create_state(functools.partial(create_state, config, family, init_rng))
  num_params = sum(x.size for x in jax.tree.leaves(state.params))
  logging.info("Model: %s %s parameters; %s layout.", f"{num_params:,}", family.name,
               layout.mode)

  # ---- Restore --------------------------------------------------------------------------
  manager = checkpoints.manager(workdir, config.keep_checkpoints)
  if manager.latest_step() is not None:
    # Restored into the new state's shardings, whatever layout and devices saved it; a
    # damaged newest checkpoint falls back to the one before it.
    try:
      params, opt_state, step, data_state = checkpoints.restore(
          manager, state.params, state.opt_state, with_data_state=True)
    except checkpoints.CheckpointError as e:
      raise checkpoints.CheckpointError(f"{e} {_model_changes(workdir, config)}") from None
    damaged = checkpoints.damaged_steps_after(manager, step)  # the same list on every host
    if damaged and is_chief:
      checkpoints.set_aside(workdir, manager, damaged)
    if damaged and jax.process_count() > 1:
      multihost_utils.sync_global_devices("damaged checkpoints set aside")
      manager.reload()
    state = state.replace(step=step, params=params, opt_state=opt_state)
    train_batches.restore(data_state)
    logging.info("Resumed from checkpoint at step %d (data position %s).", step, data_state)
  if is_chief:  # after a successful restore: a mismatch keeps the old config
    workdir_lib.save_config(workdir, config)
  start_step = int(state.step)
  best_metric = config.checkpoint_best_metric
  best_manager = (checkpoints.manager(workdir, 1, folder=checkpoints.BEST_DIR)
                  if best_metric else None)
  best = checkpoints.best_record(best_manager) if best_manager else None  # kept across resumes
  if best and best["metric"] != best_metric:
    raise ValueError(f"{best_manager.directory} keeps the best {best['metric']!r}, not "
                     f"config.checkpoint_best_metric={best_metric!r}; move that folder away or "
                     "keep the metric.")

  # ---- TensorBoard: the config, and the peak the MFU is measured against ------------------
  step_flops, peak_tflops, peak_source = _step_flops_and_peak(config, family,
                                                              global_batch_size)
  config_text = "    " + config.to_json_best_effort(indent=2).replace("\n", "\n    ")
  train_writer.write_texts(0, {"config": config_text, "mfu_peak": (
      f"MFU is model FLOPs (flops.py, padded lengths) / ({peak_tflops:.1f} TFLOP/s x "
      f"{jax.device_count()} devices); peak from {peak_source}.")})
  train_writer.write_hparams(saved_config.flat(config.to_dict()))
  train_writer.flush()
  logging.info("MFU against %.1f TFLOP/s per device (%s).", peak_tflops, peak_source)

  # ---- Compiled steps -------------------------------------------------------------------
  p_train_step = compile_train_step(config, family, layout)
  evaluator = evaluation.Evaluator(config, family, tokenizer, layout)
  state = layout.place_state(state)

  def run_eval(step: int) -> dict:
    start = time.time()
    result, samples = evaluator.evaluate(state.params, eval_data, eval_examples,
                                         config.num_generate_examples)
    eval_writer.write_scalars(step, dict(result, eval_time_s=time.time() - start,
                                         decode_time_s=evaluator.decode_seconds))
    if samples:
      eval_writer.write_texts(step, {"samples": "\n\n---\n\n".join(samples)})
    if config.attention_images.layers and evaluator.first_generated is not None:
      # Every process runs the forward pass (its arrays may span them); process 0 draws.
      maps = attention_maps.collect(family, layout.checkpoint_state(state.params),
                                    *evaluator.first_generated)
      if is_chief:
        eval_writer.write_pngs(step, attention_maps.tensorboard_images(
            maps, config.attention_images, tokenizer))
    eval_writer.flush()
    logging.info("step %d eval (%.1f s): %s", step, time.time() - start,
                 ", ".join(f"{k} {v:.4f}" for k, v in sorted(result.items())))
    return result

  def keep_if_best(step: int, result: dict) -> bool:
    """Saves the parameters if `result` is the best evaluation yet; True if it is."""
    nonlocal best
    if best_metric not in result:
      raise ValueError(f"config.checkpoint_best_metric={best_metric!r} is not a metric of "
                       f"this evaluation ({', '.join(sorted(result))}).")
    if not _improved(result[best_metric], best, config.checkpoint_best_mode):
      return False
    best = dict(metric=best_metric, value=float(result[best_metric]), step=step)
    checkpoints.save_best(best_manager, step, layout.checkpoint_state(state).params, best)
    logging.info("New best %s %.4f at step %d, kept in %s.", best_metric, best["value"], step,
                 best_manager.directory)
    return True

  def save(step: int):
    if sums is not None:  # else checked at this step's log line
      _check_finite(layout.host_sums(sums), step, manager)
    start = time.time()
    saved = layout.checkpoint_state(state)
    checkpoints.save(manager, step, saved.params, saved.opt_state, _whole_data_state(data_state))
    logging.info("Saved checkpoint %d (%.1f s; written in the background) in %s.", step,
                 time.time() - start, manager.directory)

  # ---- Training loop --------------------------------------------------------------------
  result = {}
  stopped_early = False
  evals_without_best = 0  # counted within this run: a resumed run starts again from 0
  profile, profiling = tuple(config.profile_steps), False
  profile_dir = os.path.join(workdir, "profile")
  data_state = train_batches.state  # the pipeline's position after the last batch trained on
  # Closed on every exit, an error included: that stops the prefetch thread.
  with contextlib.closing(pipeline.prefetch(train_batches, layout.train_batch,
                                           config.prefetch_batches)) as batches, \
      preemption.PreemptionWatcher() as watcher:
    # Rates are measured from the end of the first step, so the compilation stays out of the
    # steps/s, tokens/s, MFU and ETA.
    sums, last_log_time, last_log_step, sums_steps = None, time.time(), start_step, 0
    for step in range(start_step, config.num_train_steps):
      if profile and step == profile[0] and is_chief:
        jax.profiler.start_trace(profile_dir)
        profiling = True
      batch, data_state = next(batches)
      state, step_sums = p_train_step(state, batch, dropout_rng)
      # Accumulated on device: the host only waits at log and save time.
      sums = step_sums if sums is None else jax.tree.map(jnp.add, sums, step_sums)
      sums_steps += 1
      done = step + 1
      if profiling and (done == profile[0] + profile[1] or done == config.num_train_steps):
        jax.block_until_ready(step_sums)
        jax.profiler.stop_trace()
        profiling = False
        logging.info("Wrote a profile of steps %d-%d to %s.", profile[0], step, profile_dir)
      checkpoints.check_background_saves(manager)
      if step == start_step:
        jax.block_until_ready(step_sums)
        logging.info("First step (compilation included) took %.1f s.",
                     time.time() - last_log_time)
        last_log_time, last_log_step = time.time(), done
      if done % config.log_every_steps == 0 or done == config.num_train_steps:
        host_sums = layout.host_sums(sums)
        _check_finite(host_sums, done, manager)
        norms = {k: float(host_sums[k]) / sums_steps for k in ("grad_norm", "param_norm")}
        train_metrics = metrics.normalize({k: v for k, v in host_sums.items()
                                           if k not in ("nonfinite_steps", *norms)})
        lr = float(rsqrt_schedule(config.learning_rate, config.warmup_steps)(done - 1))
        scalars = dict(loss=train_metrics["loss"], accuracy=train_metrics["accuracy"],
                       perplexity=metrics.perplexity(train_metrics["loss"]),
                       learning_rate=lr, **norms)
        progress = f"step {done}/{config.num_train_steps}: loss {train_metrics['loss']:.4f}, " \
                   f"lr {lr:.2e}, grad_norm {norms['grad_norm']:.3f}"
        if done > last_log_step:  # else only the first step ran since: no rate yet
          steps_per_sec = (done - last_log_step) / (time.time() - last_log_time)
          tokens_per_sec = host_sums["denominator"] / sums_steps * steps_per_sec
          scalars.update(steps_per_sec=steps_per_sec, step_time_s=1 / steps_per_sec,
                         tokens_per_sec=tokens_per_sec)
          progress += f", {steps_per_sec:.2f} steps/s, {tokens_per_sec:.0f} tokens/s"
          if step_flops:
            scalars["mfu"] = step_flops * steps_per_sec / (
                peak_tflops * 1e12 * jax.device_count())
            progress += f", MFU {scalars['mfu']:.1%}"
          eta = (config.num_train_steps - done) / steps_per_sec / 60
          progress += f", ETA {eta:.1f} min"
        train_writer.write_scalars(done, scalars)
        train_writer.flush()
        logging.info("%s", progress)
        sums, last_log_time, last_log_step, sums_steps = None, time.time(), done, 0
      pause_start = time.time()
      if watcher.should_stop(done):
        if profiling:  # stopped inside the traced steps: keep what was traced
          jax.profiler.stop_trace()
        save(done)
        checkpoints.wait_for_saves(manager)
        if best_manager:
          checkpoints.wait_for_saves(best_manager)
        logging.info("Stopped at step %d after saving its checkpoint.", done)
        return dict(result, preempted=True, step=done, checkpoint_dir=str(manager.directory))
      if done % config.eval_every_steps == 0 or done == config.num_train_steps:
        result = run_eval(done)
        if best_metric:
          evals_without_best = 0 if keep_if_best(done, result) else evals_without_best + 1
        stopped_early = 0 < config.early_stopping_evals <= evals_without_best
      if (done % config.checkpoint_every_steps == 0 or done == config.num_train_steps
          or stopped_early):
        save(done)
      if stopped_early:
        logging.info("Early stopping at step %d: %d evaluations without a better %s.", done,
                     evals_without_best, best_metric)
        break
      last_log_time += time.time() - pause_start  # steps/s and tokens/s count training only

  if profiling:  # stopped early inside the traced steps: keep what was traced
    jax.profiler.stop_trace()
  if start_step >= config.num_train_steps:
    logging.info("Already trained to step %d.", start_step)
    result = run_eval(start_step)
  checkpoints.wait_for_saves(manager)
  if best_manager:
    checkpoints.wait_for_saves(best_manager)
    best_manager.close()
  final_step = manager.latest_step()
  manager.close()
  train_writer.close()
  eval_writer.close()
  # ---- Summary ---------------------------------------------------------------------------
  summary = [f"Finished at step {final_step}{' (stopped early)' if stopped_early else ''} "
             f"in {(time.time() - run_start) / 60:.1f} min."]
  if result:
    summary.append("Final eval: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(result.items())))
  if best:
    summary.append(f"Best {best['metric']} {best['value']:.4f} at step {best['step']} "
                   f"(--checkpoint best: {best_manager.directory}).")
  summary.append(f"Checkpoints: {manager.directory}; TensorBoard: tensorboard --logdir "
                 f"{workdir}.")
  logging.info("\n  ".join(summary))
  if best_metric:
    result = dict(result, best=best, stopped_early=stopped_early)
  return result
