"""Inference: turn source texts into outputs (translations, summaries, labels).

`Predictor.from_workdir(workdir)` loads the config, tokenizer and newest good (or a given, or
the average of the last N) checkpoint saved by training; `Predictor.from_pretrained(PATH)`
serves a Hugging Face checkpoint as it is. Either maps lists of strings to outputs,
batched by length, with the generation settings of `config.decoding` (greedy, sampling or beam
search), each overridable per call.
"""

from __future__ import annotations

import difflib
import functools
from typing import Iterable, Iterator, Sequence

import jax
import ml_collections
import numpy as np
from absl import logging

from transformer_jax import attention_maps as attention_maps_lib
from transformer_jax import checkpoints
from transformer_jax import config_validation
from transformer_jax import families
from transformer_jax import parallel
from transformer_jax import tokenizer as tokenizer_lib
from transformer_jax import workdir as workdir_lib
from transformer_jax.data import prompt_format
from transformer_jax.inference import generate
from transformer_jax.model import lora as lora_lib
from transformer_jax.model import quantization
from transformer_jax.pretrained import gguf_file
from transformer_jax.pretrained import run_files


class Predictor:
  """A trained model, its tokenizer and compiled generation, ready to turn texts into outputs:
  translations, summaries, or label names.

  Decoding settings may be overridden per call (`predict(texts, beam_size=8)`).
  """

  def __init__(self, config: ml_collections.ConfigDict, tokenizer: tokenizer_lib.Tokenizer,
               params, step: int | None = None, layout=None):
    self.config = config
    self.tokenizer = tokenizer
    self.step = step
    self.family = families.get(config)
    self.model = self.family.model
    # The training config's layout (pmap or jit over a mesh) on this machine's devices. The
    # parameters are copied onto its devices: the Predictor never shares buffers with a
    # training state that a donated step may overwrite.
    self.generator = generate.Generator(self.family, layout or parallel.make_layout(config))
    boxed = jax.eval_shape(functools.partial(self.family.init_params, boxed=True,
                                             quantized=True), jax.random.PRNGKey(0))
    if self.family.quantization:  # config.quantization: float weights quantized at load
      params = quantization.quantize_params(params, boxed)
    self.device_params = self.generator.layout.place_params(params, boxed)

  @classmethod
  def from_workdir(cls, workdir: str, step: int | str | None = None, average_last: int = 1,
                   config: ml_collections.ConfigDict | None = None) -> "Predictor":
    """Loads the workdir's config (or `config`, e.g. the saved one with other decoding
    settings), tokenizer and checkpoint (the newest good one unless `step`: a step, or
    'best' for the best evaluation's)."""
    config = config or workdir_lib.load_config(workdir)
    tokenizer = run_files.workdir_tokenizer(config, workdir)
    if config.get("pretrained"):
      from transformer_jax import pretrained_run  # pylint: disable=g-import-not-at-top
      # The target code of this call's config.target_lang, not of the training run's.
      pretrained_run.apply_target_code(config, tokenizer)
    layout = parallel.make_layout(config, fit_devices=True)
    family = families.get(config)
    if family.model_config.lora:  # served merged: decoding pays nothing for the adapters
      if average_last > 1:
        raise checkpoints.CheckpointError(
            "--average_last averages weights, but a LoRA workdir's checkpoints hold adapters, "
            "whose products do not average: drop --average_last.")
      trained, base, step = restore_lora(workdir, family, step, layout)
      base = quantization.dequantized(base)  # a QLoRA base: merged in float32
      params = lora_lib.merge(lora_lib.combine(trained, base), family.model_config.lora)
      return cls(lora_lib.without(config), tokenizer, params, step, layout)
    init = functools.partial(family.init_params, boxed=True)
    params, step = checkpoints.restore_params(workdir, init, step, average_last, layout)
    return cls(config, tokenizer, params, step, layout)

  @classmethod
  def from_pretrained(cls, name_or_path: str, config: ml_collections.ConfigDict | None = None,
                      given_keys: Sequence[str] | None = None,
                      adapter: str | None = None) -> "Predictor":
    """A Hugging Face checkpoint (folder or hub name) served as it is: its model, tokenizer
    and generation_config.json decoding. `config` (default: default_config with the
    checkpoint's lengths) supplies the task and anything else; its decoding keys named in
    `given_keys` (e.g. 'decoding.beam_size'; default: those that differ from
    default_config's) win over the generation config. `adapter`: a PEFT LoRA adapter folder
    made for this checkpoint, merged into its weights at load."""
    from transformer_jax import default_config  # pylint: disable=g-import-not-at-top
    from transformer_jax.pretrained import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
    from transformer_jax import pretrained_run  # pylint: disable=g-import-not-at-top
    checkpoint = checkpoint_lib.open_checkpoint(name_or_path)
    defaults = default_config.get_config()
    config = ml_collections.ConfigDict((config or defaults).to_dict())
    lengths = lambda c: (c.max_source_length, c.max_target_length, c.model.max_len)
    default_lengths = lengths(config) == lengths(defaults)
    if default_lengths:  # none chosen: as long as the checkpoint allows
      config.model.max_len = checkpoint.fields.get("max_len", 512)
    if given_keys is None:
      given_keys = [f"decoding.{k}" for k, v in config.decoding.items()
                    if defaults.decoding.get(k) != v]
      given_keys += ["prompt_format"] * (config.get("prompt_format", "task") != "task")
    config.pretrained = name_or_path
    pretrained_run.apply(config, checkpoint, serving=True, given_keys=set(given_keys))
    if default_lengths:
      pretrained_run.serving_lengths(config)  # after `apply`: the checkpoint's family decides
    # A GGUF file's Q8_0 / Q4_0 kernels are read as they are, into the quantized layout.
    held = checkpoint.gguf is not None and gguf_file.hold_as_file(config, checkpoint.gguf,
                                                                   adapter)
    config_validation.validate(config)
    tokenizer = run_files.tokenizer(checkpoint.folder, checkpoint.vocab, config)
    boxed = jax.eval_shape(functools.partial(families.get(config).init_params, boxed=True,
                                             quantized=held), jax.random.PRNGKey(0))
    # A bfloat16 checkpoint served with config.model.dtype='bfloat16' is held in bfloat16.
    dtype = checkpoint_lib.held_dtype(checkpoint, config.model.dtype)
    params = checkpoint_lib.read_params(checkpoint, parallel.unbox(boxed),
                                        dtype=np.float32 if adapter else dtype)
    if adapter:  # merged in float32, then held as the plain checkpoint would be (on the host)
      params = jax.tree.map(lambda x: np.asarray(x, dtype),
                            _with_adapter(params, adapter, checkpoint, config))
    missing = checkpoint_lib.missing_params(params, parallel.unbox(boxed))
    if missing:
      raise checkpoint_lib.PretrainedError(
          f"{checkpoint.folder} lacks {jax.tree_util.keystr(missing[0])} (and "
          f"{len(missing) - 1} more parameters): fine-tune it before serving it.")
    return cls(config, tokenizer, params, step=0,
               layout=parallel.make_layout(config, fit_devices=True))

  @property
  def layout(self):
    return self.generator.layout

  def decoding_config(self, **overrides) -> ml_collections.ConfigDict:
    """config.decoding with `overrides` applied and checked (unknown keys, bad values)."""
    decoding_config = ml_collections.ConfigDict(self.config.decoding.to_dict())
    for key, value in overrides.items():
      if key not in decoding_config:
        close = difflib.get_close_matches(key, list(decoding_config), n=1)
        raise ValueError(f"Unknown decoding setting {key!r}"
                         f"{f'; did you mean {close[0]!r}' if close else ''}. Settings: "
                         f"{', '.join(decoding_config)}.")
      decoding_config[key] = value
    checked = ml_collections.ConfigDict(self.config.to_dict())
    checked.decoding = decoding_config
    config_validation.validate(checked)
    return decoding_config

  def output_ids(self, prompts: Sequence[np.ndarray], nbest: int = 1,
                 decoding_config: ml_collections.ConfigDict | None = None,
                 with_scores: bool = False) -> list:
    """Generated ids for encoded sources; see `generate.Generator.output_ids`."""
    return self.generator.output_ids(self.device_params, prompts, nbest, decoding_config,
                                     with_scores)

  def output_text(self, ids: Sequence[int]) -> str:
    return self.family.output_text(ids, self.tokenizer)

  def _prompts(self, texts: Sequence[str]) -> dict[int, np.ndarray]:
    """Encoded non-empty texts by position; over-long ones truncated (one warning)."""
    max_len = self.config.max_source_length
    kept = [i for i, t in enumerate(texts) if t.strip()]
    encoded, _ = prompt_format.TextEncoder(self.config, self.tokenizer).encode(
        [texts[i] for i in kept])
    prompts = [self.family.prompt(ids) for ids in encoded]
    too_long = sum(not np.array_equal(p[:len(ids)], ids) for p, ids in zip(prompts, encoded))
    if too_long:
      logging.warning("%d input(s) longer than max_source_length=%d tokens were truncated.",
                      too_long, max_len)
    return dict(zip(kept, prompts))

  def predict(self, texts: Sequence[str], **decoding_overrides) -> list[str]:
    """One output per text, in order; empty texts give empty outputs. Keyword arguments
    override config.decoding for this call (method, beam_size, alpha, temperature, ...)."""
    decoding_config = self.decoding_config(**decoding_overrides)
    prompts = self._prompts(texts)
    outputs = [""] * len(texts)
    for i, ids in zip(prompts, self.output_ids(list(prompts.values()), 1, decoding_config)):
      outputs[i] = self.output_text(ids)
    return outputs

  def predict_nbest(self, texts: Sequence[str], n: int,
                    **decoding_overrides) -> list[list[tuple[str, float]]]:
    """The `n` best outputs per text as (text, score) pairs, best first; the score is the
    log-probability the search ranks by (length-penalised for beam search; for a classifier,
    the class's log-probability). Empty texts give empty lists."""
    decoding_config = self.decoding_config(**decoding_overrides)
    self.family.check_nbest(decoding_config, n)
    prompts = self._prompts(texts)
    outputs: list[list[tuple[str, float]]] = [[] for _ in texts]
    for i, pairs in zip(prompts, self.output_ids(list(prompts.values()), n, decoding_config,
                                                 with_scores=True)):
      outputs[i] = [(self.output_text(ids), score) for ids, score in pairs]
    return outputs

  def attention_maps(self, text: str) -> tuple[str, list[attention_maps_lib.AttentionMap]]:
    """The model's output for `text` (decoded with config.decoding), and every attention
    layer's weights over the two, with their tokens."""
    prompts = self._prompts([text])
    if not prompts:
      raise ValueError("The text to draw attention for is empty.")
    prompt = prompts[0]
    output = self.output_ids([prompt])[0]
    params = self.layout.checkpoint_state(self.device_params)  # one copy of the parameters
    return (self.output_text(output),
            attention_maps_lib.collect(self.family, params, prompt, output))

  def predict_lines(self, lines: Iterable[str], chunk_size: int = 1024) -> Iterator[str]:
    """Streams outputs for `lines`, `chunk_size` at a time, never holding the whole input."""
    for chunk in chunk_lines(lines, chunk_size):
      yield from self.predict(chunk)


def chunk_lines(lines: Iterable[str], size: int) -> Iterator[list[str]]:
  """Lists of `size` lines (the last may be shorter), line ends stripped."""
  chunk = []
  for line in lines:
    chunk.append(line.rstrip("\r\n"))
    if len(chunk) == size:
      yield chunk
      chunk = []
  if chunk:
    yield chunk


def restore_lora(workdir: str, family, step: int | str | None = None, layout=None, *,
                 with_base: bool = True) -> tuple:
  """A LoRA workdir's (trained parameters at `step`: adapters and a classifier's head, frozen
  base or None without `with_base`, step), restored into `layout`'s shardings (default: one device)."""
  parts = lambda rng: lora_lib.split(family.init_params(rng, boxed=True),
                                     family.trained_in_full())
  trained, step = checkpoints.restore_params(workdir, lambda rng: parts(rng)[0], step,
                                             layout=layout)
  if not with_base:
    return trained, None, step
  # As it was saved (config.lora.base_dtype): its fingerprint is of those values.
  boxed = family.frozen_abstract()
  like = parallel.unbox(boxed) if layout is None else layout.abstract_params(boxed)
  return trained, checkpoints.restore_lora_base(workdir, like), step


def _with_adapter(params: dict, adapter: str, checkpoint, config: ml_collections.ConfigDict
                  ) -> dict:
  """`params` of `checkpoint` with the PEFT adapter in folder `adapter` merged into them (and
  the classifier head it saved, if any)."""
  adapters, lora = read_peft_adapter(adapter, checkpoint, config)
  logging.info("Merged the LoRA adapter of %s into %s.", adapter, checkpoint.folder)
  return jax.device_get(lora_lib.merge(lora_lib.combine(adapters, params), lora))


def read_peft_adapter(folder: str, checkpoint, config: ml_collections.ConfigDict
                      ) -> tuple[dict, lora_lib.LoraSpec]:
  """The PEFT LoRA adapter in `folder`, made for `checkpoint` (served with `config`): our
  adapter parameters (and a classifier head it saved, if any), and its LoraSpec."""
  from transformer_jax.pretrained import peft  # pylint: disable=g-import-not-at-top
  adapted = ml_collections.ConfigDict(config.to_dict())
  adapted.lora.update(peft.settings(folder, checkpoint))
  family = families.get(adapted)
  boxed = jax.eval_shape(functools.partial(family.init_params, boxed=True),
                         jax.random.PRNGKey(0))
  expected = parallel.unbox(lora_lib.split(boxed, family.trained_in_full())[0])
  adapters = peft.read_adapter(folder, checkpoint, family.model_config, expected,
                               family.trained_in_full())
  return adapters, family.model_config.lora
