"""The run's record on the console and in TensorBoard: the config and the MFU's peak at the
start, the training meter's log lines, each evaluation's metrics, samples and attention maps,
the profiler trace, and the closing summary."""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import optax
from absl import logging
from flax.training import train_state

from transformer_jax import attention_maps
from transformer_jax import checkpoint_policy
from transformer_jax import evaluation
from transformer_jax import families
from transformer_jax import flops
from transformer_jax import metrics
from transformer_jax import saved_config
from transformer_jax import summary_writer
from transformer_jax import tokenizer as tokenizer_lib
from transformer_jax.model import lora as lora_lib


def writers(workdir: str, is_chief: bool) -> tuple:
  """The TensorBoard writers of runs `train` and `eval`: the same tag names (loss, accuracy,
  ...) in both, so that the train and eval curves of a metric overlay in one chart."""
  return tuple(summary_writer.create_writer(os.path.join(workdir, run), is_chief)
               for run in ("train", "eval"))


def describe_run(config: ml_collections.ConfigDict, family: families.Family,
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


class Evaluation:
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
    params = lora_lib.state_params(state)
    result, samples = evaluator.evaluate(params, self._data, self._examples,
                                         self._config.num_generate_examples)
    writer.write_scalars(step, dict(result, eval_time_s=time.time() - start,
                                    decode_time_s=evaluator.decode_seconds))
    if samples:
      writer.write_texts(step, {"samples": "\n\n---\n\n".join(samples)})
    if self._config.attention_images.layers and evaluator.first_generated is not None:
      # Every process runs the forward pass (its arrays may span them); process 0 draws.
      maps = attention_maps.collect(self._family, self._layout.checkpoint_state(params),
                                    *evaluator.first_generated)
      if jax.process_index() == 0:
        writer.write_pngs(step, attention_maps.tensorboard_images(
            maps, self._config.attention_images, self._tokenizer))
    writer.flush()
    logging.info("step %d eval (%.1f s): %s", step, time.time() - start,
                 ", ".join(f"{k} {v:.4f}" for k, v in sorted(result.items())))
    return result


class Profile:
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


class TrainMeter:
  """The training metrics since the last log line, and the rates they were trained at.

  The step sums are accumulated on device: the host only waits at log and save time. Rates
  are measured from the end of the first step, so the compilation stays out of the steps/s,
  tokens/s, MFU and ETA.
  """

  def __init__(self, config: ml_collections.ConfigDict, schedule: optax.Schedule, layout,
               writer, manager, step_flops: float | None, peak_tflops: float, start_step: int):
    self._config, self._layout, self._writer, self._manager = config, layout, writer, manager
    self._schedule = schedule  # the optimizer's: the logged rate is the one stepped with
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
    checkpoint_policy.check_finite(host_sums, done, self._manager)
    norms = {k: float(host_sums[k]) / sums_steps for k in ("grad_norm", "param_norm")}
    train_metrics = metrics.normalize({k: v for k, v in host_sums.items()
                                       if k not in ("nonfinite_steps", *norms)})
    lr = float(self._schedule(done - 1))
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


def summary(workdir: str, run_start: float, final_step: int | None, stopped_early: bool,
             result: dict, best: checkpoint_policy.BestCheckpoint | None, manager) -> list[str]:
  """The lines of the run's closing log message."""
  lines = [f"Finished at step {final_step}{' (stopped early)' if stopped_early else ''} "
             f"in {(time.time() - run_start) / 60:.1f} min."]
  if result:
    lines.append("Final eval: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(result.items())))
  if best and best.record:
    lines.append(f"Best {best.record['metric']} {best.record['value']:.4f} at step "
                   f"{best.record['step']} (--checkpoint best: {best.manager.directory}).")
  lines.append(f"Checkpoints: {manager.directory}; TensorBoard: tensorboard --logdir "
                 f"{workdir}.")
  return lines
