"""Training and evaluation loop: `train_and_evaluate(config, workdir)`."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time

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
from transformer_jax import layer_decay
from transformer_jax import metrics
from transformer_jax import parallel
from transformer_jax import preemption
from transformer_jax import run_lock
from transformer_jax import saved_config
from transformer_jax import summary_writer
from transformer_jax import tokenizer as tokenizer_lib
from transformer_jax import workdir as workdir_lib
from transformer_jax.data import pipeline
from transformer_jax.data import preparation
from transformer_jax.data import sources


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
  """Adam (0.9, 0.98, 1e-9) on the rsqrt schedule; optional clipping, weight decay and
  layer-wise learning-rate decay (`config.layer_decay`, see layer_decay.py)."""
  schedule = rsqrt_schedule(config.learning_rate, config.warmup_steps)
  if config.weight_decay > 0:
    adam = optax.adamw(schedule, b1=0.9, b2=0.98, eps=1e-9, weight_decay=config.weight_decay)
  else:
    adam = optax.adam(schedule, b1=0.9, b2=0.98, eps=1e-9)
  parts = [adam]
  if config.grad_clip_norm > 0:
    parts.insert(0, optax.clip_by_global_norm(config.grad_clip_norm))
  # Last, so that it scales whole updates (Adam's and AdamW's decoupled decay term). At 1.0
  # nothing is added: the optimizer state keeps the structure older checkpoints hold.
  if config.get("layer_decay", 1.0) < 1.0:
    parts.append(layer_decay.scale_by_layer_decay(config.layer_decay))
  return parts[0] if len(parts) == 1 else optax.chain(*parts)


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

  def score(logits, labels, weights):
    loss, unsmoothed = metrics.smoothed_cross_entropy(
        logits, labels, label_smoothing, also_unsmoothed=True,
        padding_masked=family.model_config.mask_padding_logit)
    return (jnp.sum(loss * weights) / denominator,
            metrics.token_metrics(logits, labels, weights, unsmoothed))

  def micro_step(micro_batch, dropout_rng):
    loss_fn = lambda params: family.score_outputs(params, micro_batch, score,
                                                  deterministic=False,
                                                  rngs={"dropout": dropout_rng})
    (_, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return grads, sums

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


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains `config` in `workdir` (a local folder or a gs:// URL), resuming from its newest
  good checkpoint; returns the final evaluation (with "preempted": True when a SIGTERM or
  Ctrl-C stopped it early, after saving).

  With `config.pretrained`, the checkpoint sets the model's architecture keys first and its
  weights start the run (unless the workdir already holds a checkpoint to resume from).
  """
  if config.pretrained:
    from transformer_jax.pretrained import run_config  # pylint: disable=g-import-not-at-top
    run_config.apply(config, run_config.run_checkpoint(config, workdir))
  config_validation.validate(config, jax.device_count())
  # A missing split or column is found before the workdir is made.
  sources.check_dataset(config, ("train", config.eval_split))
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
  tokenizer, train_batches, eval_data, eval_examples = _data(config, workdir, family,
                                                             global_batch_size)

  # ---- Model and optimizer --------------------------------------------------------------
  init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(config.seed))
  state = _initial_state(config, family, layout, tokenizer, init_rng)

  # ---- Restore --------------------------------------------------------------------------
  manager = checkpoints.manager(workdir, config.keep_checkpoints)
  if config.pretrained and manager.latest_step() is None:
    state = state.replace(params=_pretrained_params(config, family, layout, init_rng))
  state = _restore(config, workdir, manager, state, train_batches)
  if is_chief:  # after a successful restore: a mismatch keeps the old config
    workdir_lib.save_config(workdir, config)
  start_step = int(state.step)
  best = _BestCheckpoint(config, workdir, layout) if config.checkpoint_best_metric else None

  # ---- TensorBoard: the config, and the peak the MFU is measured against ------------------
  step_flops, peak_tflops = _describe_run(config, family, global_batch_size, train_writer)

  # ---- Compiled steps -------------------------------------------------------------------
  p_train_step = compile_train_step(config, family, layout)
  run_eval = _Evaluation(config, family, tokenizer, layout, eval_data, eval_examples,
                         eval_writer)
  state = layout.place_state(state)

  # ---- Training loop --------------------------------------------------------------------
  result = {}
  stopped_early = False
  evals_without_best = 0  # counted within this run: a resumed run starts again from 0
  profile = _Profile(config, workdir, is_chief)
  data_state = train_batches.state  # the pipeline's position after the last batch trained on
  # Closed on every exit, an error included: that stops the prefetch thread.
  with contextlib.closing(pipeline.prefetch(train_batches, layout.train_batch,
                                           config.prefetch_batches)) as batches, \
      preemption.PreemptionWatcher() as watcher:
    meter = _TrainMeter(config, layout, train_writer, manager, step_flops, peak_tflops,
                        start_step)
    for step in range(start_step, config.num_train_steps):
      profile.start_at(step)
      batch, data_state = next(batches)
      state, step_sums = p_train_step(state, batch, dropout_rng)
      meter.add(step_sums)
      done = step + 1
      profile.stop_after(done, step_sums)
      checkpoints.check_background_saves(manager)
      if step == start_step:
        meter.first_step_done(step_sums, done)
      if done % config.log_every_steps == 0 or done == config.num_train_steps:
        meter.log(done)
      pause_start = time.time()
      if watcher.should_stop(done):
        profile.stop()  # stopped inside the traced steps: keep what was traced
        _save(manager, layout, done, state, data_state, meter.sums)
        _wait_for_saves(manager, best)
        logging.info("Stopped at step %d after saving its checkpoint.", done)
        return dict(result, preempted=True, step=done, checkpoint_dir=str(manager.directory))
      if done % config.eval_every_steps == 0 or done == config.num_train_steps:
        result = run_eval(done, state)
        if best:
          evals_without_best = (0 if best.keep_if_best(done, result, state)
                                else evals_without_best + 1)
        stopped_early = 0 < config.early_stopping_evals <= evals_without_best
      if (done % config.checkpoint_every_steps == 0 or done == config.num_train_steps
          or stopped_early):
        _save(manager, layout, done, state, data_state, meter.sums)
      if stopped_early:
        logging.info("Early stopping at step %d: %d evaluations without a better %s.", done,
                     evals_without_best, best.metric)
        break
      meter.exclude_since(pause_start)  # steps/s and tokens/s count training only

  profile.stop()  # stopped early inside the traced steps: keep what was traced
  if start_step >= config.num_train_steps:
    logging.info("Already trained to step %d.", start_step)
    result = run_eval(start_step, state)
  _wait_for_saves(manager, best)
  if best:
    best.manager.close()
  final_step = manager.latest_step()
  manager.close()
  train_writer.close()
  eval_writer.close()

  # ---- Summary ---------------------------------------------------------------------------
  logging.info("\n  ".join(_summary(workdir, run_start, final_step, stopped_early, result,
                                    best, manager)))
  if best:
    result = dict(result, best=best.record, stopped_early=stopped_early)
  return result


def _data(config: ml_collections.ConfigDict, workdir: str, family: families.Family,
          global_batch_size: int) -> tuple[tokenizer_lib.Tokenizer, pipeline.TrainBatches,
                                           pipeline.Encoded, list[dict]]:
  """(The workdir's tokenizer, this process's training batches, the eval split's features,
  its examples)."""
  examples, tokenizer, encoded = preparation.prepare_data(config, workdir,
                                                          ("train", config.eval_split))
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
  return tokenizer, train_batches, eval_data, eval_examples


def _initial_state(config: ml_collections.ConfigDict, family: families.Family, layout,
                   tokenizer: tokenizer_lib.Tokenizer, rng) -> train_state.TrainState:
  """A fresh training state placed by `layout`, for a model that has room for `tokenizer`."""
  if tokenizer.vocab_size > family.model_config.vocab_size:
    raise ValueError(f"The tokenizer has {tokenizer.vocab_size} pieces but config.model."
                     f"vocab_size={family.model_config.vocab_size}; raise config.model."
                     "vocab_size.")
  # Under jit the state is created already sharded: no device ever holds all of it.
  state = layout.create_state(functools.partial(create_state, config, family, rng))
  num_params = sum(x.size for x in jax.tree.leaves(state.params))
  logging.info("Model: %s %s parameters; %s layout.", f"{num_params:,}", family.name,
               layout.mode)
  return state


def _pretrained_params(config: ml_collections.ConfigDict, family: families.Family, layout,
                       rng):
  """The weights of `config.pretrained`, placed as the layout holds parameters (sharded under
  jit: each device receives only its part). Parameters the checkpoint does not hold (a bare
  encoder's classification head; all of it with config.reset_head) start as a from-scratch
  run's would, from the seed's `rng`."""
  from transformer_jax.pretrained import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
  checkpoint = checkpoint_lib.open_checkpoint(config.pretrained)
  boxed = jax.eval_shape(functools.partial(family.init_params, boxed=True), rng)
  expected = parallel.unbox(boxed)
  params = checkpoint_lib.read_params(checkpoint, expected, reset_head=config.reset_head)
  missing = checkpoint_lib.missing_params(params, expected)
  if missing:  # a classifier's head: the whole model is initialised once, on one device
    params = checkpoint_lib.complete_params(params, jax.device_get(
        jax.jit(family.init_params)(rng)))
    logging.info("Model: %s start from the seed (not in the checkpoint).",
                 ", ".join(jax.tree_util.keystr(path) for path in missing))
  logging.info("Model: weights of %s (%s) imported.", config.pretrained, checkpoint.model_type)
  # pmap: host arrays, replicated on every device with the rest of the state (place_state).
  return layout.place_params(params, boxed) if layout.mode == "jit" else params


def _restore(config: ml_collections.ConfigDict, workdir: str, manager,
             state: train_state.TrainState,
             train_batches: pipeline.TrainBatches) -> train_state.TrainState:
  """`state`, and the position of `train_batches`, from the newest good checkpoint (as they
  are when there is none)."""
  if manager.latest_step() is None:
    return state
  # Restored into the new state's shardings, whatever layout and devices saved it; a
  # damaged newest checkpoint falls back to the one before it.
  try:
    params, opt_state, step, data_state = checkpoints.restore(
        manager, state.params, state.opt_state, with_data_state=True)
  except checkpoints.CheckpointError as e:
    raise checkpoints.CheckpointError(f"{e} {_model_changes(workdir, config)}") from None
  damaged = checkpoints.damaged_steps_after(manager, step)  # the same list on every host
  if damaged and jax.process_index() == 0:
    checkpoints.set_aside(workdir, manager, damaged)
  if damaged and jax.process_count() > 1:
    multihost_utils.sync_global_devices("damaged checkpoints set aside")
    manager.reload()
  state = state.replace(step=step, params=params, opt_state=opt_state)
  train_batches.restore(data_state)
  logging.info("Resumed from checkpoint at step %d (data position %s).", step, data_state)
  return state


def _model_changes(workdir: str, config: ml_collections.ConfigDict) -> str:
  """The model / data keys in which `config` differs from the workdir's saved config."""
  try:
    changes = saved_config.fixed_key_changes(workdir_lib.load_config(workdir), config)
  except workdir_lib.WorkdirError:
    return ""
  return f"Changed since this workdir was trained: {'; '.join(changes)}." if changes else ""


class _BestCheckpoint:
  """The parameters of the best evaluation by `config.checkpoint_best_metric`, in their own
  folder; `record` ({metric, value, step}, None before the first) is kept across resumes."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str, layout):
    self.metric, self._mode, self._layout = (config.checkpoint_best_metric,
                                             config.checkpoint_best_mode, layout)
    self.manager = checkpoints.manager(workdir, 1, folder=checkpoints.BEST_DIR)
    self.record = checkpoints.best_record(self.manager)
    if self.record and self.record["metric"] != self.metric:
      raise ValueError(f"{self.manager.directory} keeps the best {self.record['metric']!r}, "
                       f"not config.checkpoint_best_metric={self.metric!r}; move that folder "
                       "away or keep the metric.")

  def keep_if_best(self, step: int, result: dict, state: train_state.TrainState) -> bool:
    """Saves the parameters if `result` is the best evaluation yet; True if it is."""
    if self.metric not in result:
      raise ValueError(f"config.checkpoint_best_metric={self.metric!r} is not a metric of "
                       f"this evaluation ({', '.join(sorted(result))}).")
    if not _improved(result[self.metric], self.record, self._mode):
      return False
    self.record = dict(metric=self.metric, value=float(result[self.metric]), step=step)
    checkpoints.save_best(self.manager, step, self._layout.checkpoint_state(state).params,
                          self.record)
    logging.info("New best %s %.4f at step %d, kept in %s.", self.metric, self.record["value"],
                 step, self.manager.directory)
    return True


def _improved(value: float, best: dict | None, mode: str) -> bool:
  if not math.isfinite(value):
    return False
  if best is None:
    return True
  return value > best["value"] if mode == "max" else value < best["value"]


def _describe_run(config: ml_collections.ConfigDict, family: families.Family,
                  global_batch_size: int, writer) -> tuple[float | None, float]:
  """Writes the config and the MFU's peak to TensorBoard; returns (model FLOPs of one training
  step or None, peak TFLOP/s of one device)."""
  step_flops, peak_tflops, peak_source = _step_flops_and_peak(config, family,
                                                              global_batch_size)
  config_text = "    " + config.to_json_best_effort(indent=2).replace("\n", "\n    ")
  writer.write_texts(0, {"config": config_text, "mfu_peak": (
      f"MFU is model FLOPs (flops.py, padded lengths) / ({peak_tflops:.1f} TFLOP/s x "
      f"{jax.device_count()} devices); peak from {peak_source}.")})
  writer.write_hparams(saved_config.flat(config.to_dict()))
  writer.flush()
  logging.info("MFU against %.1f TFLOP/s per device (%s).", peak_tflops, peak_source)
  return step_flops, peak_tflops


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


class _Evaluation:
  """Evaluates the training state on the eval split and writes the result to TensorBoard:
  the metrics, generated samples and attention heatmaps."""

  def __init__(self, config: ml_collections.ConfigDict, family: families.Family,
               tokenizer: tokenizer_lib.Tokenizer, layout, eval_data, eval_examples, writer):
    self._config, self._family, self._tokenizer, self._layout = config, family, tokenizer, layout
    self._data, self._examples, self._writer = eval_data, eval_examples, writer
    self._evaluator = evaluation.Evaluator(config, family, tokenizer, layout)

  def __call__(self, step: int, state: train_state.TrainState) -> dict:
    start = time.time()
    evaluator, writer = self._evaluator, self._writer
    result, samples = evaluator.evaluate(state.params, self._data, self._examples,
                                         self._config.num_generate_examples)
    writer.write_scalars(step, dict(result, eval_time_s=time.time() - start,
                                    decode_time_s=evaluator.decode_seconds))
    if samples:
      writer.write_texts(step, {"samples": "\n\n---\n\n".join(samples)})
    if self._config.attention_images.layers and evaluator.first_generated is not None:
      # Every process runs the forward pass (its arrays may span them); process 0 draws.
      maps = attention_maps.collect(self._family, self._layout.checkpoint_state(state.params),
                                    *evaluator.first_generated)
      if jax.process_index() == 0:
        writer.write_pngs(step, attention_maps.tensorboard_images(
            maps, self._config.attention_images, self._tokenizer))
    writer.flush()
    logging.info("step %d eval (%.1f s): %s", step, time.time() - start,
                 ", ".join(f"{k} {v:.4f}" for k, v in sorted(result.items())))
    return result


class _Profile:
  """A profiler trace of the steps `config.profile_steps` = (first, count) names, taken by
  process 0 into WORKDIR/profile."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str, is_chief: bool):
    self._steps, self._last_step = tuple(config.profile_steps), config.num_train_steps
    self._dir, self._is_chief = os.path.join(workdir, "profile"), is_chief
    self._tracing = False

  def start_at(self, step: int) -> None:
    if self._steps and step == self._steps[0] and self._is_chief:
      jax.profiler.start_trace(self._dir)
      self._tracing = True

  def stop_after(self, done: int, step_sums) -> None:
    """Ends the trace once step `done` - 1, the last one it covers, has run."""
    if self._tracing and (done == self._steps[0] + self._steps[1] or done == self._last_step):
      jax.block_until_ready(step_sums)
      self.stop()
      logging.info("Wrote a profile of steps %d-%d to %s.", self._steps[0], done - 1,
                   self._dir)

  def stop(self) -> None:
    if self._tracing:
      jax.profiler.stop_trace()
      self._tracing = False


class _TrainMeter:
  """The training metrics since the last log line, and the rates they were trained at.

  The step sums are accumulated on device: the host only waits at log and save time. Rates
  are measured from the end of the first step, so the compilation stays out of the steps/s,
  tokens/s, MFU and ETA.
  """

  def __init__(self, config: ml_collections.ConfigDict, layout, writer, manager,
               step_flops: float | None, peak_tflops: float, start_step: int):
    self._config, self._layout, self._writer, self._manager = config, layout, writer, manager
    self._step_flops, self._peak_tflops = step_flops, peak_tflops
    self.sums, self._last_log_time, self._last_log_step, self._sums_steps = (
        None, time.time(), start_step, 0)

  def add(self, step_sums) -> None:
    self.sums = step_sums if self.sums is None else jax.tree.map(jnp.add, self.sums, step_sums)
    self._sums_steps += 1

  def first_step_done(self, step_sums, done: int) -> None:
    jax.block_until_ready(step_sums)
    logging.info("First step (compilation included) took %.1f s.",
                 time.time() - self._last_log_time)
    self._last_log_time, self._last_log_step = time.time(), done

  def exclude_since(self, pause_start: float) -> None:
    """Leaves the time since `pause_start` (evaluating, saving) out of the rates."""
    self._last_log_time += time.time() - pause_start

  def log(self, done: int) -> None:
    """Checks the sums are finite, then logs them and their rates (to TensorBoard too)."""
    config, sums_steps = self._config, self._sums_steps
    host_sums = self._layout.host_sums(self.sums)
    _check_finite(host_sums, done, self._manager)
    norms = {k: float(host_sums[k]) / sums_steps for k in ("grad_norm", "param_norm")}
    train_metrics = metrics.normalize({k: v for k, v in host_sums.items()
                                       if k not in ("nonfinite_steps", *norms)})
    lr = float(rsqrt_schedule(config.learning_rate, config.warmup_steps)(done - 1))
    scalars = dict(loss=train_metrics["loss"], accuracy=train_metrics["accuracy"],
                   perplexity=metrics.perplexity(train_metrics["loss"]),
                   learning_rate=lr, **norms)
    progress = f"step {done}/{config.num_train_steps}: loss {train_metrics['loss']:.4f}, " \
               f"lr {lr:.2e}, grad_norm {norms['grad_norm']:.3f}"
    if done > self._last_log_step:  # else only the first step ran since: no rate yet
      steps_per_sec = (done - self._last_log_step) / (time.time() - self._last_log_time)
      tokens_per_sec = host_sums["denominator"] / sums_steps * steps_per_sec
      scalars.update(steps_per_sec=steps_per_sec, step_time_s=1 / steps_per_sec,
                     tokens_per_sec=tokens_per_sec)
      progress += f", {steps_per_sec:.2f} steps/s, {tokens_per_sec:.0f} tokens/s"
      if self._step_flops:
        scalars["mfu"] = self._step_flops * steps_per_sec / (
            self._peak_tflops * 1e12 * jax.device_count())
        progress += f", MFU {scalars['mfu']:.1%}"
      eta = (config.num_train_steps - done) / steps_per_sec / 60
      progress += f", ETA {eta:.1f} min"
    self._writer.write_scalars(done, scalars)
    self._writer.flush()
    logging.info("%s", progress)
    self.sums, self._last_log_time, self._last_log_step, self._sums_steps = (
        None, time.time(), done, 0)


def _check_finite(host_sums: dict, step: int, manager) -> None:
  if host_sums["nonfinite_steps"] == 0 and np.isfinite(host_sums["loss"]):
    return
  last_good = manager.latest_step()
  raise NonFiniteLossError(
      f"The training loss or gradient became non-finite by step {step}; stopped without "
      f"saving. Last good checkpoint: {'none' if last_good is None else f'step {last_good}'} "
      f"in {manager.directory}. Lower config.learning_rate, raise config.warmup_steps or set "
      "config.grad_clip_norm, then re-run the same command to resume from it.")


def _save(manager, layout, step: int, state: train_state.TrainState, data_state: dict,
          sums) -> None:
  """Starts writing the checkpoint of `step` in the background, once the steps since the
  last log line (`sums`) are known to be finite."""
  if sums is not None:  # else checked at this step's log line
    _check_finite(layout.host_sums(sums), step, manager)
  start = time.time()
  saved = layout.checkpoint_state(state)
  checkpoints.save(manager, step, saved.params, saved.opt_state, _whole_data_state(data_state))
  logging.info("Saved checkpoint %d (%.1f s; written in the background) in %s.", step,
               time.time() - start, manager.directory)


def _wait_for_saves(manager, best: _BestCheckpoint | None) -> None:
  checkpoints.wait_for_saves(manager)
  if best:
    checkpoints.wait_for_saves(best.manager)


def _summary(workdir: str, run_start: float, final_step: int | None, stopped_early: bool,
             result: dict, best: _BestCheckpoint | None, manager) -> list[str]:
  """The lines of the run's closing log message."""
  summary = [f"Finished at step {final_step}{' (stopped early)' if stopped_early else ''} "
             f"in {(time.time() - run_start) / 60:.1f} min."]
  if result:
    summary.append("Final eval: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(result.items())))
  if best and best.record:
    summary.append(f"Best {best.record['metric']} {best.record['value']:.4f} at step "
                   f"{best.record['step']} (--checkpoint best: {best.manager.directory}).")
  summary.append(f"Checkpoints: {manager.directory}; TensorBoard: tensorboard --logdir "
                 f"{workdir}.")
  return summary
