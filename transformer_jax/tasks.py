"""Per task: which texts the tokenizer learns from and which metric scores generated outputs.

  translation     sacreBLEU, chrF and chrF++ (sacreBLEU's)
  summarization   ROUGE-1/2/L
  classification  accuracy and macro-F1 (of class ids; as text, within a multitask mixture)
  multitask       a T5-style mixture (data/mixture.py), each part scored by its own metric

How a task's examples become model inputs depends on the model family: see families.py.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from absl import logging

from transformer_jax import metrics

TASKS = ("translation", "summarization", "classification", "multitask")


def has_labels(task: str) -> bool:
  """Whether the task's examples carry a class label (`label`) rather than a target text."""
  return task == "classification"


def is_mixture(task: str) -> bool:
  """Whether the task mixes parts (data/mixture.py), each scored by its own metric."""
  return task == "multitask"


def example_fields(task: str) -> tuple[str, str]:
  """The two fields of the task's examples: the source, and the label or target text."""
  return ("source", "label") if has_labels(task) else ("source", "target")


def training_texts(examples: Sequence[dict]):
  """The texts SentencePiece learns from: sources, and targets when they are text."""
  for example in examples:
    yield example["source"]
    if "target" in example:
      yield example["target"]


def text_metrics(task: str, outputs: Sequence[str], references: Sequence[str]) -> dict:
  """The task's metric of generated texts against reference texts."""
  if task == "translation":
    score, signature = metrics.bleu(outputs, references)
    chrf, chrf_signature = metrics.chrf(outputs, references)
    chrf_pp, chrf_pp_signature = metrics.chrf(outputs, references, word_order=2)
    logging.info("sacreBLEU %.2f (%s), chrF %.2f (%s), chrF++ %.2f (%s)", score, signature,
                 chrf, chrf_signature, chrf_pp, chrf_pp_signature)
    return {"bleu": score, "chrf": chrf, "chrf++": chrf_pp}
  if task == "summarization":
    return metrics.rouge(outputs, references)
  if task == "classification":  # multitask: the label name as text
    return {"accuracy": float(np.mean([o.strip() == r.strip()
                                       for o, r in zip(outputs, references)]))}
  raise ValueError(f"No text metric for task {task!r}.")
