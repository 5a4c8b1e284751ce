"""The `--mode evaluate`, `--mode predict` and `--mode attention` commands, on a trained
workdir."""

from __future__ import annotations

import json
import math
import os
import stat
import sys
from typing import IO, Iterator, Sequence

import ml_collections
from absl import logging

from transformer_jax import attention_maps
from transformer_jax import evaluation
from transformer_jax import metrics
from transformer_jax import predict
from transformer_jax import run_data
from transformer_jax import summary_writer
from transformer_jax import tasks
from transformer_jax import workdir as workdir_lib


def decoding_tag(decoding_config: ml_collections.ConfigDict, average_last: int = 1) -> str:
  """A folder name for outputs of one decoding setting, e.g. beam4_alpha0.6, beam4_alpha1.0_hf
  (Hugging Face's length penalty) or greedy."""
  d = decoding_config
  tag = {"beam": f"beam{d.beam_size}_alpha{d.alpha}", "greedy": "greedy",
         "sample": f"sample_t{d.temperature}_k{d.top_k}_p{d.top_p}_seed{d.seed}"}[d.method]
  if d.method == "beam" and d.length_penalty != "gnmt":
    tag += f"_{d.length_penalty}"  # the same alpha ranks differently
  if d.max_decode_len:
    tag += f"_len{d.max_decode_len}"
  return tag + (f"_avg{average_last}" if average_last > 1 else "")


def run_evaluate(workdir: str | None, step: int | str | None = None, split: str = "test",
                 average_last: int = 1, config: ml_collections.ConfigDict | None = None,
                 predictor: predict.Predictor | None = None) -> dict:
  """Task metrics of the workdir's checkpoint (the newest good one unless `step`, a step or
  'best'; the mean of the last `average_last` checkpoints up to it) on every example of
  `split`, decoded with
  `config.decoding` (default: the saved config's).

  Writes WORKDIR/eval/step_N/SPLIT_DECODING/ (a classifier, which decodes nothing:
  SPLIT/, and no decoding in the result) with metrics.json and, one line per example in
  order, hypotheses.txt, sources.txt and references.txt; logs the metrics to TensorBoard in
  the run WORKDIR/eval_SPLIT.

  A given `predictor` (e.g. `Predictor.from_pretrained`) is evaluated with its own config;
  its outputs go to WORKDIR/eval/pretrained/ when a workdir is given, nowhere otherwise.
  """
  if predictor is not None:
    config = predictor.config
  config = config or workdir_lib.load_config(workdir)
  if split not in config.splits:
    raise ValueError(f"--split {split}: not a split of this workdir's config.splits "
                     f"({', '.join(config.splits)}).")
  if predictor is None:
    predictor = predict.Predictor.from_workdir(workdir, step, average_last, config)
  examples, _, encoded = run_data.prepare_data(config, workdir, (split,), training=False,
                                                  tokenizer=predictor.tokenizer)
  evaluator = evaluation.Evaluator(config, predictor.family, predictor.tokenizer,
                                   predictor.layout)
  result, rows = evaluator.evaluate_with_outputs(predictor.device_params, encoded[split],
                                                 examples[split])
  # A classifier decodes nothing: its results name no decoding settings.
  decoding = config.decoding if predictor.family.generates_text else None
  result.update(step=predictor.step, checkpoint="best" if step == "best" else "step",
                split=split, examples=len(encoded[split]),
                **({} if decoding is None else {"decoding": decoding.method}),
                average_last=average_last)
  if "bleu" in result:
    result.update(metrics.translation_signatures())
  elif tasks.is_mixture(config.task):
    result["bleu_signature"] = metrics.bleu_signature()
  if config.get("pretrained") and predictor.step == 0:
    result["pretrained"] = config.pretrained
  if workdir is None:
    logging.info("Evaluated %s on %s: %s", config.pretrained, split, result)
    return result
  checkpoint_dir = f"step_{predictor.step}" if "pretrained" not in result else "pretrained"
  if decoding is not None:
    tag = f"_{decoding_tag(decoding, average_last)}"
  else:
    tag = f"_avg{average_last}" if average_last > 1 else ""
  outputs_dir = workdir_lib.path(workdir) / "eval" / checkpoint_dir / f"{split}{tag}"
  result["outputs"] = os.fspath(outputs_dir)
  _write_outputs(outputs_dir, result, decoding, rows)
  writer = summary_writer.EventFileWriter(os.fspath(workdir_lib.path(workdir) / f"eval_{split}"))
  writer.write_scalars(predictor.step, {k: v for k, v in result.items()
                                        if isinstance(v, (int, float)) and k != "step"})
  writer.close()
  logging.info("Evaluated step %d on %s: %s", predictor.step, split, result)
  return result


def _write_outputs(folder, result: dict, decoding_config: ml_collections.ConfigDict | None,
                   rows: list[dict]) -> None:
  folder.mkdir(parents=True, exist_ok=True)
  record = dict(result)
  if decoding_config is not None:  # None: a classifier, which decodes nothing
    record["decoding_config"] = decoding_config.to_dict()
  (folder / "metrics.json").write_text(json.dumps(record, indent=2) + "\n")
  for name, key in (("hypotheses.txt", "output"), ("sources.txt", "source"),
                    ("references.txt", "reference")):
    # One line per example: line breaks inside a text become spaces.
    (folder / name).write_text("".join(" ".join(r[key].splitlines()) + "\n" for r in rows))


def _is_interactive(input_path: str) -> bool:
  """stdin from a terminal or a pipe: answer each line as it arrives."""
  if input_path != "-":
    return False
  try:
    mode = os.fstat(sys.stdin.fileno()).st_mode
  except (OSError, ValueError):
    return False
  return sys.stdin.isatty() or stat.S_ISFIFO(mode)


def _lines(source: IO[str]) -> Iterator[str]:
  return iter(source.readline, "")  # readline: no read-ahead past the line on a pipe


def run_predict(workdir: str, input_path: str, output_path: str,
                step: int | str | None = None,
                average_last: int = 1, config: ml_collections.ConfigDict | None = None,
                nbest: int = 1, output_format: str = "text",
                predictor: predict.Predictor | None = None) -> None:
  """Outputs for each line of `input_path` into `output_path` ('-' = stdin / stdout; local
  paths or URLs such as gs://).

  `output_format` 'text': the best output per input line, or with `nbest` > 1 the Moses
  n-best format `INDEX ||| TEXT ||| SCORE`, n lines per input. 'jsonl': one JSON object per
  input line, {"source", "outputs": [{"text", "score"}, ...]} best first (a classifier:
  {"source", "label", "probabilities": {name: p}}). Reading a terminal or a pipe, each line is
  answered (and flushed) as it arrives; files go in batches. A given `predictor` (e.g.
  `Predictor.from_pretrained`) replaces the workdir's.
  """
  predictor = predictor or predict.Predictor.from_workdir(workdir, step, average_last, config)
  classifier = not predictor.family.generates_text
  if classifier and output_format == "jsonl":
    nbest = predictor.config.model.num_classes  # every class's probability
  predictor.family.check_nbest(predictor.config.decoding, nbest)
  chunk_size = 1 if _is_interactive(input_path) else 1024
  index = 0
  with workdir_lib.open_text(input_path, "r") as source, \
      workdir_lib.open_text(output_path, "w") as sink:
    for chunk in predict.chunk_lines(_lines(source), chunk_size):
      if output_format == "text" and nbest == 1:
        lines = [" ".join(o.splitlines()) for o in predictor.predict(chunk)]
      else:
        results = predictor.predict_nbest(chunk, nbest)
        lines = [_format(text, outputs, index + i, output_format,
                         predictor.config.label_names if classifier else None)
                 for i, (text, outputs) in enumerate(zip(chunk, results))]
      index += len(chunk)
      sink.write("".join(line + "\n" for line in lines))
      sink.flush()


def _format(source: str, outputs: list[tuple[str, float]], index: int, output_format: str,
            label_names: Sequence[str] | None) -> str:
  """One input's line(s); a classifier's (`label_names` given) probabilities in label order.
  JSON keeps each text exactly (a chat model's lists and paragraphs); only the one-line text
  format turns its line breaks into spaces."""
  if output_format == "text":
    return "\n".join(f"{index} ||| {' '.join(text.splitlines())} ||| {score:.4f}"
                     for text, score in outputs)
  if label_names is not None:
    scores = dict(outputs)
    return json.dumps(dict(source=source, label=outputs[0][0] if outputs else None,
                           probabilities={name: math.exp(scores[name]) for name in label_names
                                          if name in scores}),
                      ensure_ascii=False)
  return json.dumps(dict(source=source, outputs=[dict(text=t, score=s) for t, s in outputs]),
                    ensure_ascii=False)


def run_attention(workdir: str, text: str, output_path: str, step: int | str | None = None,
                  config: ml_collections.ConfigDict | None = None) -> str:
  """Draws the attention of the model (config.attention_images: layers and heads of every
  attention kind) on `text` and its output into one PNG at `output_path` (a local path or
  URL); returns the output it drew."""
  predictor = predict.Predictor.from_workdir(workdir, step, 1, config)
  output, maps = predictor.attention_maps(text)
  png = attention_maps.draw(attention_maps.chosen(maps, predictor.config.attention_images),
                            predictor.tokenizer)
  workdir_lib.write_atomic(workdir_lib.path(output_path), png)
  return output


def run_export(workdir: str, output: str, step: int | str | None = None,
               average_last: int = 1, config: ml_collections.ConfigDict | None = None,
               export_format: str = "hf") -> list[str]:
  """Writes the workdir's checkpoint (as `run_predict` picks it) as a Hugging Face folder
  `output` (a LoRA run's adapters merged), or with `export_format` 'peft' a LoRA run's
  adapters alone as a PEFT adapter folder; only for workdirs trained from a pretrained
  checkpoint (config.pretrained)."""
  from transformer_jax.pretrained import export  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_count() > 1:
    raise ValueError("--mode export runs on one process: start it without --multihost (it "
                     "reads the checkpoint whole).")
  config = config or workdir_lib.load_config(workdir)
  if not config.get("pretrained"):
    raise ValueError(f"{workdir} was trained from random weights: --mode export writes models "
                     "fine-tuned from a Hugging Face checkpoint (config.pretrained) back to "
                     "that format.")
  if export_format == "peft":
    return _export_adapter(workdir, output, step, average_last, config)
  predictor = predict.Predictor.from_workdir(workdir, step, average_last, config)
  params = predictor.layout.checkpoint_state(predictor.device_params)
  written = export.export(params, predictor.family.model_config, workdir, output,
                          label_names=config.label_names)
  logging.info("Exported step %s of %s to %s.", predictor.step, workdir, output)
  return written


def _export_adapter(workdir: str, output: str, step: int | str | None, average_last: int,
                    config: ml_collections.ConfigDict) -> list[str]:
  """A LoRA workdir's adapters (and a classifier's head) as a PEFT adapter folder."""
  from transformer_jax import families  # pylint: disable=g-import-not-at-top
  from transformer_jax.pretrained import peft  # pylint: disable=g-import-not-at-top
  family = families.get(config)
  if family.model_config.lora is None:
    raise ValueError(f"{workdir} fine-tuned the whole model: --export_format peft writes LoRA "
                     "adapters (train with --config.lora.rank=R); export it without the flag.")
  if average_last > 1:
    raise ValueError("--average_last averages weights, but adapters' products do not "
                     "average: drop --average_last.")
  trained, _, step = predict.restore_lora(workdir, family, step, with_base=False)
  written = peft.write_adapter(trained, family.model_config, family, workdir, output,
                               config.pretrained, config.lora.dropout)
  logging.info("Exported the adapters of step %s of %s to %s.", step, workdir, output)
  return written
