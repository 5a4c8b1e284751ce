"""Evaluation on a held-out split: loss and accuracy, then the task's own metric on generated
outputs: sacreBLEU (translation), ROUGE-1/2/L (summarization), accuracy and macro-F1
(classification), each of them per part for a multitask mixture."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import ml_collections
import numpy as np
from absl import logging

from transformer_jax import metrics
from transformer_jax import parallel
from transformer_jax import predict
from transformer_jax import tasks
from transformer_jax.data import pipeline


def _eval_step(params, batch, *, model, axis_name):
  logits = tasks.forward(model, params, batch, deterministic=True)
  labels, weights = tasks.labels_and_weights(batch)
  return parallel.psum(metrics.token_metrics(logits, labels, weights), axis_name)


def text_metrics(task: str, outputs: Sequence[str], references: Sequence[str]) -> dict:
  """The task's metric of generated texts against reference texts."""
  if task == "translation":
    score, signature = metrics.bleu(outputs, references)
    logging.info("sacreBLEU %.2f (%s)", score, signature)
    return {"bleu": score}
  if task == "summarization":
    return metrics.rouge(outputs, references)
  if task == "classification":  # multitask: the label name as text
    return {"accuracy": float(np.mean([o.strip() == r.strip()
                                       for o, r in zip(outputs, references)]))}
  raise ValueError(f"No text metric for task {task!r}.")


class Evaluator:
  """Compiled eval and generation steps for one model; params are passed per call."""

  def __init__(self, config: ml_collections.ConfigDict, predictor: predict.Predictor):
    self.config = config
    self.predictor = predictor
    self.layout = predictor.layout
    self._eval_step = self.layout.compile_eval(functools.partial(
        _eval_step, model=predictor.model, axis_name=self.layout.axis_name))

  def loss_and_accuracy(self, device_params, data: pipeline.Encoded) -> dict:
    sums = None
    for batch in pipeline.eval_batches(data, self.predictor.batch_size):
      step_sums = self._eval_step(device_params, self.layout.eval_batch(batch))
      sums = metrics.add_sums(sums, self.layout.host_sums(step_sums))
    result = metrics.normalize(sums)
    if data.labels is None:
      result["perplexity"] = float(np.exp(min(result["loss"], 50.0)))
    return result

  def evaluate(self, device_params, data: pipeline.Encoded, examples: Sequence[dict],
               num_generate_examples: int = -1) -> tuple[dict, list[str]]:
    """Metrics of `data` (the encoded `examples`) and a few sample outputs as Markdown.

    Loss and accuracy use every example; generated metrics use the first
    `num_generate_examples` (-1 = all; a classifier always uses all, its outputs are cheap).
    """
    result, rows = self.evaluate_with_outputs(device_params, data, examples,
                                              num_generate_examples)
    samples = [f"**source:** {r['source'][:2000]}\n\n**output:** {r['output']}\n\n"
               f"**reference:** {r['reference']}" for r in rows[:3]]
    for sample in samples:
      logging.info("example: %s", sample.replace("\n\n", " | "))
    return result, samples

  def evaluate_with_outputs(self, device_params, data: pipeline.Encoded,
                            examples: Sequence[dict], num_generate_examples: int = -1,
                            decoding_config: ml_collections.ConfigDict | None = None
                            ) -> tuple[dict, list[dict]]:
    """Like `evaluate`, with every generated output as {source, output, reference}, in order
    (decoded with `decoding_config`, default the config's)."""
    self.predictor.device_params = device_params
    result = self.loss_and_accuracy(device_params, data)
    task = self.config.task
    n = len(data) if num_generate_examples < 0 or task == "classification" else min(
        num_generate_examples, len(data))
    if not n:
      return result, []
    prompts = tasks.prompt_tokens(data.subset(range(n))).features["inputs"]
    output_ids = self.predictor.output_ids(prompts, decoding_config=decoding_config)
    outputs = [self.predictor.output_text(ids) for ids in output_ids]
    if task == "classification":
      predicted = [int(ids[0]) for ids in output_ids]
      result.update(metrics.classification_scores(predicted, data.labels[:n],
                                                  self.config.model.num_classes))
      references = [self.predictor.output_text([e["label"]]) for e in examples[:n]]
    else:
      references = [e["target"] for e in examples[:n]]
      if task == "multitask":
        for part in sorted({e["task"] for e in examples[:n]}):
          chosen = [i for i, e in enumerate(examples[:n]) if e["task"] == part]
          part_result = text_metrics(examples[chosen[0]]["metric"],
                                     [outputs[i] for i in chosen], [references[i] for i in chosen])
          result.update({f"{part}_{k}": v for k, v in part_result.items()})
      else:
        result.update(text_metrics(task, outputs, references))
    rows = [dict(source=e["source"], output=o, reference=r)
            for e, o, r in zip(examples, outputs, references)]
    return result, rows
