"""Losses and metrics. Device-side metrics are (sum, denominator) pairs, divided once on host."""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import sacrebleu

Array = jax.Array


def smoothed_cross_entropy(logits: Array, targets: Array, label_smoothing: float = 0.0, *,
                           also_unsmoothed: bool = False, padding_masked: bool = False):
  """Per-token cross-entropy [b, len] against label-smoothed one-hot targets, in float32.

  The smoothed distribution puts 1 - label_smoothing on the target and spreads the rest over
  the other classes (flax examples/wmt's convention); its entropy is subtracted so that a
  perfect prediction scores 0. `padding_masked`: the model masks class 0 (padding:
  `mask_padding_logit`), so nothing is spread onto it. With `also_unsmoothed`, also returns
  the plain -log p[target] (what the training step reports).
  """
  logits = logits.astype(jnp.float32)
  unsmoothed = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  if label_smoothing > 0:
    vocab_size = logits.shape[-1]
    others = vocab_size - 1 - padding_masked  # the classes that share label_smoothing
    confidence = 1.0 - label_smoothing
    low_confidence = label_smoothing / others
    one_hot = jax.nn.one_hot(targets, vocab_size)
    soft_targets = one_hot * confidence + (1.0 - one_hot) * low_confidence
    if padding_masked:
      soft_targets = soft_targets.at[..., 0].set(0.0)
    cross_entropy = optax.softmax_cross_entropy(logits, soft_targets) + (
        confidence * math.log(confidence) +
        label_smoothing * math.log(low_confidence))  # minus the smoothed targets' entropy
  else:
    cross_entropy = unsmoothed
  return (cross_entropy, unsmoothed) if also_unsmoothed else cross_entropy


def token_metrics(logits: Array, targets: Array, weights: Array,
                  unsmoothed_loss: Array | None = None) -> dict[str, Array]:
  """Summed unsmoothed loss and correct-token count (argmax == target), with their
  denominator."""
  weights = weights.astype(jnp.float32)
  if unsmoothed_loss is None:
    unsmoothed_loss = smoothed_cross_entropy(logits, targets)
  correct = (jnp.argmax(logits, axis=-1) == targets) * weights
  return {"loss": jnp.sum(unsmoothed_loss * weights), "accuracy": jnp.sum(correct),
          "denominator": jnp.sum(weights)}


def perplexity(loss: float) -> float:
  """exp(mean token loss), capped at exp(50) so a diverged loss gives a number, not inf."""
  return float(np.exp(min(loss, 50.0)))


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


def chrf(hypotheses: Sequence[str], references: Sequence[str],
         word_order: int = 0) -> tuple[float, str]:
  """Corpus chrF (Popovic, 2015: character 6-gram F-score, beta 2), or chrF++ with
  `word_order=2` (word uni- and bigrams besides), as sacreBLEU computes them; returns (score,
  signature). Kinder than BLEU to morphology-rich and low-resource targets."""
  metric = sacrebleu.metrics.CHRF(word_order=word_order)
  score = metric.corpus_score(list(hypotheses), [list(references)])
  return float(score.score), str(metric.get_signature())


def translation_signatures() -> dict[str, str]:
  """The signatures of `bleu`, `chrf` and chrF++ (settings and sacreBLEU's version)."""
  signatures = {"bleu_signature": bleu_signature()}
  for key, word_order in (("chrf_signature", 0), ("chrf++_signature", 2)):
    metric = sacrebleu.metrics.CHRF(word_order=word_order)
    metric.corpus_score(["a"], [["a"]])
    signatures[key] = str(metric.get_signature())
  return signatures


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
