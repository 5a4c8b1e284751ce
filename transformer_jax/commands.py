"""The `--mode evaluate` and `--mode predict` commands, on a trained workdir."""

from __future__ import annotations

from absl import logging

from transformer_jax import evaluation
from transformer_jax import metrics
from transformer_jax import predict
from transformer_jax import train
from transformer_jax import workdir as workdir_lib


def run_evaluate(workdir: str, step: int | None = None, split: str = "test",
                 average_last: int = 1) -> dict:
  """Task metrics of the workdir's checkpoint (latest unless `step`; the mean of the last
  `average_last` checkpoints up to it) on every example of `split`."""
  predictor = predict.Predictor.from_workdir(workdir, step, average_last)
  config = predictor.config
  examples, _, encoded = train.prepare_data(config, workdir, (split,))
  evaluator = evaluation.Evaluator(config, predictor)
  result, _ = evaluator.evaluate(predictor.device_params, encoded[split], examples[split])
  result.update(step=predictor.step, split=split, examples=len(encoded[split]),
                decoding=config.decoding.method, average_last=average_last)
  if "bleu" in result or config.task == "multitask":
    result["bleu_signature"] = metrics.bleu_signature()
  logging.info("Evaluated step %d on %s: %s", predictor.step, split, result)
  return result


def run_predict(workdir: str, input_path: str, output_path: str, step: int | None = None,
                average_last: int = 1) -> None:
  """One output per line of `input_path` into `output_path` ('-' = stdin / stdout)."""
  predictor = predict.Predictor.from_workdir(workdir, step, average_last)
  with workdir_lib.open_text(input_path, "r") as source, \
      workdir_lib.open_text(output_path, "w") as sink:
    for output in predictor.predict_lines(source):
      sink.write(output.replace("\n", " ") + "\n")
      sink.flush()
