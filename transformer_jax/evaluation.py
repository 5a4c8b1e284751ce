"""Evaluation on a held-out split: token loss and accuracy, and BLEU of its translations."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import ml_collections
import numpy as np
from absl import logging

from transformer_jax import metrics
from transformer_jax import models
from transformer_jax import parallel
from transformer_jax import predict
from transformer_jax import tokenizer as tokenizer_lib
from transformer_jax.data import pipeline


def _eval_step(params, batch, *, model: models.EncoderDecoder):
  logits = model.apply({"params": params}, batch["inputs"], batch["targets"], deterministic=True)
  sums = metrics.token_metrics(logits, batch["targets"], batch["targets"] > 0)
  return jax.lax.psum(sums, parallel.AXIS)


class Evaluator:
  """Compiled eval and decode steps for one model; params are passed per call."""

  def __init__(self, model: models.EncoderDecoder, tokenizer: tokenizer_lib.Tokenizer,
               batch_size: int, decoding_config: ml_collections.ConfigDict):
    self.tokenizer = tokenizer
    self.batch_size = batch_size
    self._eval_step = jax.pmap(functools.partial(_eval_step, model=model),
                               axis_name=parallel.AXIS)
    self._decode = predict.decode_fn(model, decoding_config)
    self._seed = decoding_config.seed

  def loss_and_accuracy(self, replicated_params, data: pipeline.EncodedPairs) -> dict:
    sums = None
    for batch in pipeline.eval_batches(data, self.batch_size):
      step_sums = self._eval_step(replicated_params, parallel.shard(batch))
      sums = metrics.add_sums(sums, jax.tree.map(lambda x: x[0], step_sums))
    result = metrics.normalize(sums)
    result["perplexity"] = float(np.exp(min(result["loss"], 50.0)))
    return result

  def bleu(self, replicated_params, data: pipeline.EncodedPairs,
           references: Sequence[str]) -> tuple[dict, list[str]]:
    """BLEU of the translations of `data.sources` (config.decoding) against `references`."""
    tokens = predict.translate_ids(self._decode, replicated_params, data.sources, self.batch_size,
                                   self._seed)
    hypotheses = [self.tokenizer.decode(row) for row in tokens]
    score, signature = metrics.bleu(hypotheses, references)
    logging.info("sacreBLEU %.2f (%s)", score, signature)
    return {"bleu": score}, hypotheses

  def evaluate(self, replicated_params, data: pipeline.EncodedPairs,
               references: Sequence[str], num_bleu_examples: int = -1) -> dict:
    """Loss, accuracy and perplexity on all of `data`; BLEU on its first `num_bleu_examples`."""
    result = self.loss_and_accuracy(replicated_params, data)
    n = len(data) if num_bleu_examples < 0 else min(num_bleu_examples, len(data))
    if n:
      subset = pipeline.EncodedPairs(data.sources[:n], data.targets[:n], 0)
      bleu, hypotheses = self.bleu(replicated_params, subset, references[:n])
      result.update(bleu)
      for source, hypothesis, reference in list(zip(data.sources, hypotheses, references))[:3]:
        logging.info("example: %s\n  -> %s\n  reference: %s", self.tokenizer.decode(source),
                     hypothesis, reference)
    return result
