"""Losses and metrics. Device-side metrics are (sum, denominator) pairs, divided once on host."""

from __future__ import annotations

import functools
import math
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import sacrebleu

Array = jax.Array


def _at_targets(logits: Array, targets: Array) -> Array:
  """logits[..., targets]: [..., vocab], [...] -> [...]."""
  return jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def _cross_entropy_forward(logits: Array, targets: Array, confidence: float, low: float):
  """Smoothed and plain cross-entropy from one pass of exp; the softmax is kept for backward."""
  logits = logits.astype(jnp.float32)
  vocab_size = logits.shape[-1]
  shifted = logits - jnp.max(logits, axis=-1, keepdims=True)  # [..., vocab]
  exp = jnp.exp(shifted)
  sum_exp = jnp.sum(exp, axis=-1)
  log_sum_exp = jnp.log(sum_exp)
  # A gather: the custom VJP below means autodiff never turns it into a scatter.
  target_log_probs = _at_targets(shifted, targets) - log_sum_exp
  sum_log_probs = jnp.sum(shifted, axis=-1) - vocab_size * log_sum_exp
  # -(confidence * log p[target] + low * sum of the other log p).
  smoothed = -(confidence * target_log_probs + low * (sum_log_probs - target_log_probs))
  return (smoothed, -target_log_probs), exp / sum_exp[..., None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _cross_entropy(logits, targets, confidence, low):
  return _cross_entropy_forward(logits, targets, confidence, low)[0]


def _cross_entropy_fwd(logits, targets, confidence, low):
  outputs, probs = _cross_entropy_forward(logits, targets, confidence, low)
  return outputs, (probs, targets, jnp.zeros((), logits.dtype))  # the last carries the dtype


def _cross_entropy_bwd(confidence, low, residuals, cotangents):
  # d/dlogits of -sum_j q_j log p_j is p - q, with q the (smoothed or one-hot) target
  # distribution: one elementwise pass, where autodiff of log_softmax recomputes the softmax.
  probs, targets, dtype_carrier = residuals
  g_smoothed, g_plain = cotangents
  one_hot = jax.nn.one_hot(targets, probs.shape[-1], dtype=jnp.float32)
  smoothed_targets = low + (confidence - low) * one_hot
  grad = (g_smoothed[..., None] * (probs - smoothed_targets) +
          g_plain[..., None] * (probs - one_hot))
  return grad.astype(dtype_carrier.dtype), None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def smoothed_cross_entropy(logits: Array, targets: Array, label_smoothing: float = 0.0, *,
                           also_unsmoothed: bool = False):
  """Per-token cross-entropy [b, len] against label-smoothed one-hot targets, in float32.

  The smoothed distribution puts 1 - label_smoothing on the target and spreads the rest over
  the other classes; its entropy is subtracted so that a perfect prediction scores 0. With
  `also_unsmoothed`, also returns the plain -log p[target] from the same softmax (the
  training step reports it without a second pass over the vocabulary). The gradient is the
  closed form p - q (custom VJP), which saves a softmax in the backward pass.
  """
  vocab_size = logits.shape[-1]
  confidence = 1.0 - label_smoothing
  low_confidence = label_smoothing / (vocab_size - 1)
  cross_entropy, unsmoothed = _cross_entropy(logits, targets, confidence, low_confidence)
  if label_smoothing > 0:
    cross_entropy -= -(confidence * math.log(confidence) +
                       label_smoothing * math.log(low_confidence))  # smoothed targets' entropy
  return (cross_entropy, unsmoothed) if also_unsmoothed else cross_entropy


def token_metrics(logits: Array, targets: Array, weights: Array,
                  unsmoothed_loss: Array | None = None) -> dict[str, Array]:
  """Summed unsmoothed loss and correct-token count, with their denominator.

  A token is correct when its target's logit is the largest (a tie counts as correct). This
  compares against the row maximum, which the loss computes anyway, instead of an argmax:
  on CPU an argmax over the vocabulary costs as much as the softmax.
  """
  weights = weights.astype(jnp.float32)
  if unsmoothed_loss is None:
    unsmoothed_loss = smoothed_cross_entropy(logits, targets)
  loss = unsmoothed_loss * weights
  correct = (_at_targets(logits, targets) >= jnp.max(logits, axis=-1)) * weights
  return {"loss": jnp.sum(loss), "accuracy": jnp.sum(correct), "denominator": jnp.sum(weights)}


def normalize(sums: Mapping[str, float]) -> dict[str, float]:
  """Divides every summed metric by the shared 'denominator'."""
  denominator = float(sums["denominator"])
  return {k: float(v) / max(denominator, 1.0) for k, v in sums.items() if k != "denominator"}


def add_sums(total: dict | None, new: Mapping[str, np.ndarray]) -> dict:
  """Accumulates summed metrics on the host (float64, so long evals stay exact)."""
  new = {k: np.asarray(v, dtype=np.float64).sum() for k, v in new.items()}
  if total is None:
    return new
  return {k: total[k] + new[k] for k in total}


def bleu(hypotheses: Sequence[str], references: Sequence[str]) -> tuple[float, str]:
  """Corpus sacreBLEU on detokenized, cased text; returns (score, signature)."""
  metric = sacrebleu.metrics.BLEU()
  score = metric.corpus_score(list(hypotheses), [list(references)])
  return float(score.score), str(metric.get_signature())


def bleu_signature() -> str:
  """The signature of `bleu`: its settings and sacreBLEU's version, not the data (sacreBLEU
  only states the reference count after scoring, so one dummy sentence is scored)."""
  metric = sacrebleu.metrics.BLEU()
  metric.corpus_score(["a"], [["a"]])
  return str(metric.get_signature())


def rouge(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
  """Mean ROUGE-1/2/L F-measure x 100 (rouge-score, Porter stemming, as in the summarization
  literature); ROUGE-L is the sentence-level LCS variant."""
  from rouge_score import rouge_scorer  # pylint: disable=g-import-not-at-top
  scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
  totals = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
  for hypothesis, reference in zip(hypotheses, references):
    for name, score in scorer.score(reference, hypothesis).items():
      totals[name] += score.fmeasure
  return {name: 100.0 * total / max(len(hypotheses), 1) for name, total in totals.items()}


def classification_scores(predictions: Sequence[int], labels: Sequence[int],
                          num_classes: int) -> dict[str, float]:
  """Accuracy and macro-F1 (the unweighted mean of per-class F1; a class never predicted nor
  present scores 0, as in scikit-learn with zero_division=0)."""
  predictions, labels = np.asarray(predictions), np.asarray(labels)
  f1s = []
  for c in range(num_classes):
    true_positive = np.sum((predictions == c) & (labels == c))
    predicted, actual = np.sum(predictions == c), np.sum(labels == c)
    denominator = predicted + actual
    f1s.append(2.0 * true_positive / denominator if denominator else 0.0)
  return {"accuracy": float(np.mean(predictions == labels)) if len(labels) else 0.0,
          "macro_f1": float(np.mean(f1s))}
