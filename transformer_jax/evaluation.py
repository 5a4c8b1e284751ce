"""Evaluation on a held-out split: loss and accuracy, then the task's own metric on generated
outputs: sacreBLEU (translation), ROUGE-1/2/L (summarization), accuracy and macro-F1
(classification), each of them per part for a multitask mixture, and per direction (with
their mean) for a many-direction translation run (data/directions.py)."""

from __future__ import annotations

import functools
import itertools
import time
from typing import Sequence

import ml_collections
from absl import logging

from transformer_jax import metrics
from transformer_jax import parallel
from transformer_jax import tasks
from transformer_jax import tokenizer as tokenizer_lib
from transformer_jax.data import pipeline
from transformer_jax.inference import generate


def _eval_step(params, batch, *, family, axis_name):
  return parallel.psum(family.score_outputs(params, batch, metrics.token_metrics,
                                            deterministic=True), axis_name)


def generation_indices(examples: Sequence[dict], n: int) -> list[int]:
  """The `n` examples whose outputs are generated and scored, in order: the first n, or for
  a multitask mixture or many directions (whose examples come part after part) the parts in
  turn, so every part is scored."""
  part = next((key for key in ("task", "direction") if examples and key in examples[0]), None)
  if part is None:
    return list(range(min(n, len(examples))))
  by_part: dict[str, list[int]] = {}
  for i, example in enumerate(examples):
    by_part.setdefault(example[part], []).append(i)
  taken = itertools.chain.from_iterable(itertools.zip_longest(*by_part.values()))
  return sorted(itertools.islice((i for i in taken if i is not None), n))


class Evaluator:
  """Compiled eval and generation steps for one model family; params are passed per call."""

  def __init__(self, config: ml_collections.ConfigDict, family,
               tokenizer: tokenizer_lib.Tokenizer, layout=None):
    self.config = config
    self.family = family
    self.tokenizer = tokenizer
    self.generator = generate.Generator(family, layout)
    self.layout = self.generator.layout
    self._eval_step = self.layout.compile_eval(functools.partial(
        _eval_step, family=family, axis_name=self.layout.axis_name))

  def loss_and_accuracy(self, device_params, data: pipeline.Encoded) -> dict:
    sums = None
    for batch in pipeline.eval_batches(data, self.generator.batch_size):
      step_sums = self._eval_step(device_params, self.layout.eval_batch(batch))
      sums = metrics.add_sums(sums, self.layout.host_sums(step_sums))
    result = metrics.normalize(sums)
    if data.labels is None:
      result["perplexity"] = metrics.perplexity(result["loss"])
    return result

  def evaluate(self, device_params, data: pipeline.Encoded, examples: Sequence[dict],
               num_generate_examples: int = -1) -> tuple[dict, list[str]]:
    """Metrics of `data` (the encoded `examples`) and a few sample outputs as Markdown.

    Loss and accuracy use every example; generated metrics use `num_generate_examples` of
    them (-1 = all; a classifier always uses all, its outputs are cheap).
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
    self.decode_seconds = 0.0  # generation's share of this evaluation, for TensorBoard
    self.first_generated = None  # (prompt, output ids) of the first generated example
    result = self.loss_and_accuracy(device_params, data)
    task = self.config.task
    n = len(data) if num_generate_examples < 0 or tasks.has_labels(task) else min(
        num_generate_examples, len(data))
    chosen = generation_indices(examples, n)
    if not chosen:
      return result, []
    prompts = self.family.prompts(data.subset(chosen))
    start = time.perf_counter()
    output_ids = self.generator.output_ids(device_params, prompts,
                                           decoding_config=decoding_config)
    self.decode_seconds = time.perf_counter() - start
    self.first_generated = (prompts[0], output_ids[0])
    outputs = [self.family.output_text(ids, self.tokenizer) for ids in output_ids]
    examples = [examples[i] for i in chosen]
    if tasks.has_labels(task):
      labels = data.labels[chosen]
      result.update(metrics.classification_scores([int(ids[0]) for ids in output_ids], labels,
                                                  self.config.model.num_classes))
      references = [self.family.output_text([label], self.tokenizer) for label in labels]
    else:
      references = [e["target"] for e in examples]
      if tasks.is_mixture(task):
        for part in sorted({e["task"] for e in examples}):
          mine = [i for i, e in enumerate(examples) if e["task"] == part]
          part_result = tasks.text_metrics(examples[mine[0]]["metric"],
                                           [outputs[i] for i in mine],
                                           [references[i] for i in mine])
          result.update({f"{part}_{k}": v for k, v in part_result.items()})
      elif "direction" in examples[0]:
        result.update(_per_direction(task, examples, outputs, references))
      else:
        result.update(tasks.text_metrics(task, outputs, references))
    rows = [dict(source=e["source"], output=o, reference=r)
            for e, o, r in zip(examples, outputs, references)]
    return result, rows


def _per_direction(task: str, examples: Sequence[dict], outputs: Sequence[str],
                   references: Sequence[str]) -> dict:
  """The task's metrics per translation direction ('en-vi_bleu', 'vi-en_chrf', ...) and, under
  the plain names, their mean over the directions (each direction counts once)."""
  result, per_metric = {}, {}
  for direction in sorted({e["direction"] for e in examples}):
    mine = [i for i, e in enumerate(examples) if e["direction"] == direction]
    scores = tasks.text_metrics(task, [outputs[i] for i in mine], [references[i] for i in mine])
    for key, value in scores.items():
      result[f"{direction}_{key}"] = value
      per_metric.setdefault(key, []).append(value)
  result.update({key: sum(values) / len(values) for key, values in per_metric.items()})
  return result
