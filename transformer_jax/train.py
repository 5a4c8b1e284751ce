"""Training and evaluation loop: `train_and_evaluate(config, workdir)`, with the train state
and the compiled step. What a run saves lives in checkpoint_policy.py, what it logs in
run_record.py, its optimizer in optimizer.py."""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax.training import train_state
from jax.experimental import multihost_utils

from transformer_jax import checkpoint_policy
from transformer_jax import checkpoints
from transformer_jax import config_validation
from transformer_jax import families
from transformer_jax import metrics
from transformer_jax import optimizer
from transformer_jax import parallel
from transformer_jax import preemption
from transformer_jax import run_data
from transformer_jax import run_lock
from transformer_jax import run_record
from transformer_jax import tokenizer as tokenizer_lib
from transformer_jax import workdir as workdir_lib
from transformer_jax.data import pipeline
from transformer_jax.data import sources
from transformer_jax.model import lora as lora_lib


class TrainState(train_state.TrainState):
  """Flax's train state plus a LoRA run's frozen base (None otherwise): handed to every step
  beside the parameters it trains, never updated, never in a step's checkpoint."""
  frozen: Any = None


def train_step(state: TrainState, batch, rng, *, family: families.Family,
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
    # Differentiated by the trained parameters only: a LoRA run's base is a constant here.
    loss_fn = lambda params: family.score_outputs(lora_lib.combine(params, state.frozen),
                                                  micro_batch, score,
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
                 rng) -> TrainState:
  """A fresh training state. Its parameters (and their optimizer moments) are boxed with
  their logical axis names; the layout's `create_state` places and unboxes them. With LoRA
  the optimizer sees only the adapters (and a classifier's head): the rest is `frozen`, in
  config.lora.base_dtype."""
  # Quantized only for LoRA over an int8 / int4 base (QLoRA): training refuses
  # config.quantization.
  params, frozen = family.init_params(rng, boxed=True, quantized=True), None
  if family.model_config.lora:
    params, frozen = lora_lib.split(params, family.trained_in_full())
    if family.quantization is None:
      frozen = lora_lib.cast(frozen, config.lora.base_dtype)
  return TrainState.create(apply_fn=family.model.apply, params=params, frozen=frozen,
                           tx=optimizer.make_optimizer(config))


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
  if config.quantization.weights != "none":
    raise config_validation.ConfigError(
        f"config.quantization.weights={config.quantization.weights!r} quantizes a model for "
        "--mode predict / evaluate / serve; training refuses it: leave it 'none'.")
  if config.pretrained:
    from transformer_jax import pretrained_run  # pylint: disable=g-import-not-at-top
    checkpoint = pretrained_run.run_checkpoint(config, workdir)
    pretrained_run.apply(config, checkpoint)
    if config.lora.init:  # the adapter's rank, alpha and targets
      from transformer_jax.pretrained import peft  # pylint: disable=g-import-not-at-top
      config.lora.update(peft.settings(config.lora.init, checkpoint))
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
  train_writer, eval_writer = run_record.writers(workdir, is_chief)
  layout = parallel.make_layout(config)
  family = families.get(config)
  global_batch_size = _global_batch_size(config)

  # ---- Data -----------------------------------------------------------------------------
  tokenizer, train_batches, eval_data, eval_examples = _data(config, workdir, family,
                                                             global_batch_size)

  # ---- Model and optimizer: fresh, pretrained, or restored --------------------------------
  init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(config.seed))
  manager = checkpoints.manager(workdir, config.keep_checkpoints)
  state = _starting_state(config, workdir, family, layout, tokenizer, init_rng, manager,
                          train_batches)
  start_step = int(state.step)
  best = checkpoint_policy.BestCheckpoint.of(config, workdir, layout)

  # ---- Compiled steps; TensorBoard: the config, and the peak the MFU is measured against --
  mfu_terms = run_record.describe_run(config, family, global_batch_size, train_writer)
  p_train_step = compile_train_step(config, family, layout)
  run_eval = run_record.Evaluation(config, family, tokenizer, layout, eval_data,
                                   eval_examples, eval_writer)
  state = layout.place_state(state)

  # ---- Training loop --------------------------------------------------------------------
  result, stopped_early = {}, False
  due = lambda done, every: done % every == 0 or done == config.num_train_steps
  profile = run_record.Profile(config, workdir, is_chief)
  data_state = train_batches.state  # the pipeline's position after the last batch trained on
  # Closed on every exit, an error included: that stops the prefetch thread.
  with contextlib.closing(pipeline.prefetch(train_batches, layout.train_batch,
                                           config.prefetch_batches)) as batches, \
      preemption.PreemptionWatcher() as watcher:
    meter = run_record.TrainMeter(config, optimizer.learning_rate_schedule(config), layout,
                                  train_writer, manager, *mfu_terms, start_step)
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
      if due(done, config.log_every_steps):
        meter.log(done)
      pause_start = time.time()
      if watcher.should_stop(done):
        profile.stop()  # stopped inside the traced steps: keep what was traced
        checkpoint_policy.save(manager, layout, done, state, data_state, meter.sums, best,
                               wait=True)
        logging.info("Stopped at step %d after saving its checkpoint.", done)
        return dict(result, preempted=True, step=done, checkpoint_dir=str(manager.directory))
      if due(done, config.eval_every_steps):
        result = run_eval(done, state)
        stopped_early = best is not None and best.observe(done, result, state)
      if due(done, config.checkpoint_every_steps) or stopped_early:
        checkpoint_policy.save(manager, layout, done, state, data_state, meter.sums)
      if stopped_early:
        break
      meter.exclude_since(pause_start)  # steps/s and tokens/s count training only

  profile.stop()  # stopped early inside the traced steps: keep what was traced
  if start_step >= config.num_train_steps:
    logging.info("Already trained to step %d.", start_step)
    result = run_eval(start_step, state)
  final_step = checkpoint_policy.close(manager, best)
  for writer in (train_writer, eval_writer):
    writer.close()

  # ---- Summary ---------------------------------------------------------------------------
  logging.info("\n  ".join(run_record.summary(workdir, run_start, final_step, stopped_early,
                                              result, best, manager)))
  return dict(result, best=best.record, stopped_early=stopped_early) if best else result


def _global_batch_size(config: ml_collections.ConfigDict) -> int:
  """Examples per optimizer step: grad_accum_steps micro-batches of per_device_batch_size
  per device."""
  return config.per_device_batch_size * jax.device_count() * config.grad_accum_steps


def _data(config: ml_collections.ConfigDict, workdir: str, family: families.Family,
          global_batch_size: int) -> tuple[tokenizer_lib.Tokenizer, pipeline.TrainBatches,
                                           pipeline.Encoded, list[dict]]:
  """(The workdir's tokenizer, this process's training batches, the eval split's features,
  its examples)."""
  examples, tokenizer, encoded = run_data.prepare_data(config, workdir,
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


def _starting_state(config: ml_collections.ConfigDict, workdir: str, family: families.Family,
                    layout, tokenizer: tokenizer_lib.Tokenizer, rng, manager,
                    train_batches: pipeline.TrainBatches) -> TrainState:
  """The state training starts from: the workdir's newest good checkpoint (and the data
  position it saved), else the pretrained weights or a fresh initialisation from `rng`.
  Saves the run's config in the workdir once a restore has succeeded (a mismatch keeps the
  old one)."""
  state = _initial_state(config, family, layout, tokenizer, rng)
  lora = family.model_config.lora is not None
  if config.pretrained and manager.latest_step() is None:
    from transformer_jax import pretrained_run  # pylint: disable=g-import-not-at-top
    params = pretrained_run.starting_params(config, family, layout, rng)
    state = (pretrained_run.lora_start(config, workdir, family, layout, state, params) if lora
             else state.replace(params=params))
  elif lora:  # resuming: the base saved when the run started
    state = state.replace(frozen=checkpoints.restore_lora_base(workdir, state.frozen))
  state = checkpoint_policy.restore(config, workdir, manager, state, train_batches)
  if jax.process_index() == 0:
    workdir_lib.save_config(workdir, config)
  return state


def _initial_state(config: ml_collections.ConfigDict, family: families.Family, layout,
                   tokenizer: tokenizer_lib.Tokenizer, rng) -> TrainState:
  """A fresh training state placed by `layout`, for a model that has room for `tokenizer`."""
  if tokenizer.vocab_size > family.model_config.vocab_size:
    raise ValueError(f"The tokenizer has {tokenizer.vocab_size} pieces but config.model."
                     f"vocab_size={family.model_config.vocab_size}; raise config.model."
                     "vocab_size.")
  # Under jit the state is created already sharded: no device ever holds all of it.
  state = layout.create_state(functools.partial(create_state, config, family, rng))
  num_params = sum(x.size for x in jax.tree.leaves(state.params))
  num_frozen = sum(x.size for x in jax.tree.leaves(state.frozen))
  logging.info("Model: %s %s parameters%s; %s layout.", f"{num_params:,}", family.name,
               f" trained, {num_frozen:,} frozen (LoRA)" if num_frozen else "", layout.mode)
  return state
