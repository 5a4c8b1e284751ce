"""A run's config around a pretrained checkpoint (train, predict and serve call it).

The checkpoint fixes the architecture (`config.model` sizes, norms, positions, vocabulary) and
its tokenizer; the experiment config keeps what fine-tuning chooses: dropout, dtype, remat,
the attention implementation, lengths, the task and its data. The checkpoint files a workdir
keeps are pretrained/run_files.py's.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import ml_collections
from absl import logging

from transformer_jax import checkpoints
from transformer_jax import default_config
from transformer_jax import families
from transformer_jax import parallel
from transformer_jax import workdir as workdir_lib
from transformer_jax.data import directions as directions_lib
from transformer_jax.model import lora as lora_lib
from transformer_jax.pretrained import checkpoint as checkpoint_lib
from transformer_jax.pretrained import generation
from transformer_jax.pretrained import gguf_file
from transformer_jax.pretrained import languages as languages_lib
from transformer_jax.pretrained import run_files
from transformer_jax.pretrained import tokenizer as tokenizer_lib

TUNABLE_MODEL_KEYS = ("dropout_rate", "attention_dropout_rate", "activation_dropout_rate",
                      "dtype", "remat", "remat_policy", "attention_implementation", "max_len")
# config.decoding keys that keep a checkpoint's generation valid (banned pad, forced tokens):
# a training run takes them from generation_config.json where its config keeps the default
# (banned ids: added to the config's); the search itself (method, beams, lengths) is taken
# only when serving the checkpoint as it is.
_TOKEN_DECODING_KEYS = ("forced_bos_id", "forced_eos", "banned_ids", "end_ids")


# For messages: the configs that train each family.
CONFIGS_OF = {
    families.ENCODER_DECODER: "a translation, summarization or multitask config",
    families.DECODER_ONLY: "a translation or summarization config with "
                           "config.architecture='decoder_only'",
    families.ENCODER_CLASSIFIER: "a classification config (config.task='classification')"}


def refused_overrides(checkpoint: checkpoint_lib.Checkpoint, config: ml_collections.ConfigDict,
                      given_keys) -> list[str]:
  """Command-line keys (e.g. 'model.num_layers') that contradict the checkpoint."""
  refused = []
  for key in given_keys:
    section, _, name = key.partition(".")
    if section == "tokenizer":
      refused.append(f"--config.{key} (the tokenizer comes from the checkpoint)")
    elif (section == "model" and name in checkpoint.fields and name not in TUNABLE_MODEL_KEYS
          and config.model[name] != checkpoint.fields[name]):
      refused.append(f"--config.{key}={config.model[name]!r} (the checkpoint has "
                     f"{checkpoint.fields[name]!r})")
  return refused


def run_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> checkpoint_lib.Checkpoint:
  """The checkpoint a run starts from: described from the workdir's own copy of its config
  once the run has saved one (so a resumed run needs neither the original folder nor the
  network), else opened from `config.pretrained`."""
  if config.pretrained and gguf_file.find(config.pretrained):
    raise checkpoint_lib.PretrainedError(
        f"{config.pretrained} is a GGUF file, which is served as it is (--pretrained FILE.gguf "
        "with --mode predict / evaluate / serve); fine-tune from a Hugging Face folder.")
  files = run_files.files_dir(workdir)
  if run_files.saved(workdir) and (workdir_lib.path(workdir) / workdir_lib.CONFIG_FILE).exists():
    generation = files / "generation_config.json"
    tied = workdir_lib.load_config(workdir).model.tie_output
    return checkpoint_lib.describe(
        os.fspath(files), run_files.saved_json(workdir),
        json.loads(generation.read_text()) if generation.exists() else {}, tied=tied)
  return checkpoint_lib.open_checkpoint(config.pretrained)


def apply(config: ml_collections.ConfigDict, checkpoint: checkpoint_lib.Checkpoint, *,
          serving: bool = False, given_keys=()) -> None:
  """Sets `config.model` from the checkpoint (tunable keys stay the config's) and
  `config.decoding` from its generation_config.json: every setting it makes when `serving`
  the checkpoint as it is (keys in `given_keys`, set on the command line, stay as given);
  for training only the token rules (forced ids where the config keeps the default, banned
  ids added to the config's). A classifier's labels: see `_apply_head`.

  Raises:
    PretrainedError: the checkpoint cannot train or serve as this config asks.
  """
  _apply_family(config, checkpoint, serving)
  defaults = default_config.get_config().decoding
  fixed_len = checkpoint.fields.get("max_len")
  with config.unlocked():
    for key, value in checkpoint.fields.items():
      if key not in TUNABLE_MODEL_KEYS:
        config.model[key] = value
    longest = families.longest_sequence(config)
    config.model.max_len = fixed_len or max(config.model.max_len, longest)
    family = families.family_class(checkpoint.family)
    if not family.generates_text:
      _apply_head(config, checkpoint, serving)
      return
    if serving and family.continues_prompt and "prompt_format" not in given_keys:
      config.prompt_format = "raw"  # text to continue, as transformers' generate reads it
    settings = generation.decoding_settings(checkpoint.generation_config, checkpoint.vocab,
                                            config.model.max_len,
                                            counts_prompt=family.continues_prompt)
    for key, value in settings.items():
      if serving:
        if f"decoding.{key}" not in given_keys:
          config.decoding[key] = value
      elif key == "banned_ids":
        config.decoding.banned_ids = tuple(sorted(set(config.decoding.banned_ids) | set(value)))
      elif key in _TOKEN_DECODING_KEYS and config.decoding[key] == defaults[key]:
        config.decoding[key] = value
    if not family.continues_prompt:  # the encoder-decoders: the only multilingual ones
      _apply_languages(config, checkpoint)


def _apply_languages(config: ml_collections.ConfigDict,
                     checkpoint: checkpoint_lib.Checkpoint) -> None:
  """config.source_lang / target_lang (and a many-direction run's language codes) checked
  against the checkpoint's language codes, and the target code forced as the first output
  token (transformers' forced_bos_token_id)."""
  loaded = tokenizer_lib.PretrainedTokenizer(checkpoint.folder, checkpoint.vocab)
  source, target = config.get("source_lang", ""), config.get("target_lang", "")
  try:
    many = directions_lib.pairs(config)
    if many and loaded.languages is None:
      raise ValueError(f"{checkpoint.folder} has no language codes: config.directions needs a "
                       "multilingual checkpoint (NLLB-200, M2M100, mBART-50).")
    codes = directions_lib.codes(config)
    for pair in many:  # every direction's codes known; each row forces its own target code
      loaded.set_languages(*(codes.get(language, language) for language in pair))
    if target or not many:
      loaded.set_languages(source, target)
  except ValueError as e:
    raise checkpoint_lib.PretrainedError(str(e)) from None
  languages = loaded.languages
  with config.unlocked():
    config.code_after_eos = bool(languages and languages.style == languages_lib.SUFFIX)
    # mBART-cc25: each target `X </s> [code]` starts the decoder from its own code, so that a
    # batch may mix target languages (transformers' shift_tokens_right for mBART).
    config.model.start_from_last_target = bool(languages and languages.decoder_starts_with_code)
  apply_target_code(config, loaded)


def apply_target_code(config: ml_collections.ConfigDict,
                      loaded: tokenizer_lib.PretrainedTokenizer) -> None:
  """Decoding into config.target_lang: its code forced as the first output token, or for
  mBART-cc25 the decoder's first input (its decoder_start_token_id)."""
  if loaded.languages is None or not config.get("target_lang"):
    return
  code = loaded.code_id(config.target_lang)
  with config.unlocked():
    if loaded.languages.decoder_starts_with_code:
      config.model.bos_id = code
    else:
      config.decoding.forced_bos_id = code


def _apply_family(config: ml_collections.ConfigDict, checkpoint: checkpoint_lib.Checkpoint,
                  serving: bool) -> None:
  """Serving, the checkpoint's family is the model's (a classifier's task is classification);
  training, the config must train the checkpoint's family."""
  wanted, family = checkpoint.family, families.name(config)
  if wanted == family:
    return
  if serving:
    try:
      families.set_family(config, wanted)
      return
    except ValueError:
      pass  # a classification config: the error below says what to use
  raise checkpoint_lib.PretrainedError(
      f"{checkpoint.folder} is a {checkpoint.model_type} checkpoint, which trains the {wanted} "
      f"family, but this config trains {family}: use {CONFIGS_OF[wanted]}.")


def _apply_head(config: ml_collections.ConfigDict, checkpoint: checkpoint_lib.Checkpoint,
                serving: bool) -> None:
  """A classifier's classes. Served as it is, the checkpoint's head and its id2label names;
  fine-tuned, the config's classes and names, on the checkpoint's head where it has one of
  that size (config.reset_head: always a fresh one), else a fresh head from the seed."""
  names = checkpoint.label_names
  if serving:
    if checkpoint.has_head is False:
      raise checkpoint_lib.PretrainedError(
          f"{checkpoint.folder} is a bare {checkpoint.model_type} encoder without a "
          "classification head: fine-tune it first (--config.pretrained=PATH with a "
          "classification config).")
    config.model.num_classes = len(names)
    config.label_names = names
  elif (checkpoint.has_head and not config.reset_head
        and len(names) != config.model.num_classes):
    raise checkpoint_lib.PretrainedError(
        f"The classification head of {checkpoint.folder} has {len(names)} classes "
        f"({', '.join(names)}) but config.model.num_classes={config.model.num_classes}: pass "
        "--config.reset_head=True to train a new head for this config's classes.")


def serving_lengths(config: ml_collections.ConfigDict) -> None:
  """Source and target lengths for serving a checkpoint with the default config: as long as
  its positions allow, at most 512 tokens (a decoder-only model: half each, as prompt and
  output share one sequence)."""
  with config.unlocked():
    length = config.model.max_len
    if families.family_class(families.name(config)).continues_prompt:
      length //= 2
    config.max_source_length = config.max_target_length = min(length, 512)


def lora_start(config: ml_collections.ConfigDict, workdir: str, family: families.Family,
                layout, state, params):
  """A LoRA run's first train state (from `state`, train.py's fresh one): the checkpoint's
  weights `params` as the frozen base (saved once in WORKDIR/lora_base), a classifier's head
  among the trained parameters, and the adapters the state was created with (B = 0) or those
  of config.lora.init."""
  head, base = lora_lib.split(params, family.trained_in_full())
  trainable = lora_lib.combine(head, state.params)
  if config.lora.init:
    from transformer_jax.pretrained import peft  # pylint: disable=g-import-not-at-top
    boxed, _ = lora_lib.split(jax.eval_shape(
        functools.partial(family.init_params, boxed=True), jax.random.PRNGKey(0)),
                              family.trained_in_full())
    adapters = peft.read_adapter(config.lora.init, checkpoint_lib.open_checkpoint(
        config.pretrained), family.model_config, parallel.unbox(boxed), family.trained_in_full())
    trainable = lora_lib.combine(adapters, trainable)
    if layout.mode == "jit":
      trainable = layout.place_params(trainable, boxed)
    logging.info("Model: adapters of %s.", config.lora.init)
  frozen = family.frozen_base(base, layout)
  checkpoints.save_lora_base(workdir, frozen)
  return state.replace(params=trainable, frozen=frozen)


def starting_params(config: ml_collections.ConfigDict, family: families.Family, layout,
                       rng):
  """The weights of `config.pretrained`, placed as the layout holds parameters (sharded under
  jit: each device receives only its part). Parameters the checkpoint does not hold (a bare
  encoder's classification head; all of it with config.reset_head) start as a from-scratch
  run's would, from the seed's `rng`."""
  checkpoint = checkpoint_lib.open_checkpoint(config.pretrained)
  # A LoRA run's adapters start in lora_start, not from the seed here.
  boxed = lora_lib.drop_adapters(
      jax.eval_shape(functools.partial(family.init_params, boxed=True), rng))
  expected = parallel.unbox(boxed)
  params = checkpoint_lib.read_params(checkpoint, expected, reset_head=config.reset_head)
  missing = checkpoint_lib.missing_params(params, expected)
  if missing:  # a classifier's head: the whole model is initialised once, on one device
    params = checkpoint_lib.complete_params(params, lora_lib.drop_adapters(jax.device_get(
        jax.jit(family.init_params)(rng))))
    logging.info("Model: %s start from the seed (not in the checkpoint).",
                 ", ".join(jax.tree_util.keystr(path) for path in missing))
  logging.info("Model: weights of %s (%s) imported.", config.pretrained, checkpoint.model_type)
  # pmap: host arrays, replicated on every device with the rest of the state (place_state).
  return layout.place_params(params, boxed) if layout.mode == "jit" else params
