"""Per task: which model, how examples become token features, what the loss sees.

Three model families serve the tasks:
  encoder_decoder     translation, summarization, multitask: source -> target;
  decoder_only        the same tasks as a prefix LM on `SOURCE <eos> TARGET <eos>`, loss on
                      the target only (config.architecture = 'decoder_only');
  encoder_classifier  classification: source -> one of config.model.num_classes labels.
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from transformer_jax import models
from transformer_jax import tokenizer as tokenizer_lib
from transformer_jax.data import pipeline

TASKS = ("translation", "summarization", "classification", "multitask")
FAMILIES = ("encoder_decoder", "decoder_only")


def family(config: ml_collections.ConfigDict) -> str:
  if config.task not in TASKS:
    raise ValueError(f"Unknown config.task={config.task!r}; use one of {TASKS}.")
  if config.task == "classification":
    return "encoder_classifier"
  if config.architecture not in FAMILIES:
    raise ValueError(f"Unknown config.architecture={config.architecture!r}; use one of "
                     f"{FAMILIES}.")
  return config.architecture


def make_model(config: ml_collections.ConfigDict) -> nn.Module:
  model_config = models.model_config(config.model)
  kind = family(config)
  if kind == "decoder_only":
    needed = config.max_source_length + config.max_target_length
    if model_config.max_len < needed:
      raise ValueError(f"A decoder-only model reads source and target in one sequence: "
                       f"config.model.max_len={model_config.max_len} must be at least "
                       f"max_source_length + max_target_length = {needed}.")
    return models.DecoderOnly(model_config)
  if kind == "encoder_classifier":
    return models.EncoderClassifier(model_config)
  return models.EncoderDecoder(model_config)


def init_params(model: nn.Module, rng) -> dict:
  """Parameters of any family, from one-token dummy inputs (shapes do not depend on length)."""
  ones = jnp.ones((1, 1), jnp.int32)
  if isinstance(model, models.EncoderDecoder):
    return model.init(rng, ones, ones, deterministic=True)["params"]
  return model.init(rng, ones, deterministic=True)["params"]


def forward(model: nn.Module, params, batch: dict, *, deterministic: bool, rngs=None):
  """Logits for a batch: [b, len, vocab] for sequence models, [b, num_classes] otherwise."""
  kwargs = dict(deterministic=deterministic, rngs=rngs or {})
  variables = {"params": params}
  if isinstance(model, models.EncoderDecoder):
    return model.apply(variables, batch["inputs"], batch["targets"],
                       batch.get("inputs_position"), batch.get("targets_position"),
                       batch.get("inputs_segmentation"), batch.get("targets_segmentation"),
                       **kwargs)
  if isinstance(model, models.DecoderOnly):
    return model.apply(variables, batch["targets"], batch.get("targets_position"),
                       batch.get("targets_segmentation"), **kwargs)
  return model.apply(variables, batch["inputs"], **kwargs)


def labels_and_weights(batch: dict) -> tuple[jax.Array, jax.Array]:
  """What the loss compares the logits with, and how much each position counts."""
  if "labels" in batch:  # classification: one label per row; all-padding rows weigh 0
    return batch["labels"], jnp.any(batch["inputs"] != 0, axis=-1).astype(jnp.float32)
  targets = batch["targets"]
  weights = batch.get("weights")
  if weights is None:
    weights = (targets > 0).astype(jnp.float32)
  return targets, weights


def training_texts(examples: Sequence[dict]):
  """The texts SentencePiece learns from: sources, and targets when they are text."""
  for example in examples:
    yield example["source"]
    if "target" in example:
      yield example["target"]


def encode_examples(examples: Sequence[dict], tokenizer: tokenizer_lib.Tokenizer,
                    config: ml_collections.ConfigDict, *, drop_overlong: bool = False
                    ) -> tuple[pipeline.Encoded, int]:
  """Token features of `examples` for the config's model family.

  Returns the features and how many examples were too long for max_source_length /
  max_target_length: truncated, or left out when `drop_overlong` (training with
  config.overlong='drop').
  """
  kind = family(config)
  max_source, max_target = config.max_source_length, config.max_target_length
  features: dict[str, list[np.ndarray]] = {}
  labels, overlong = [], 0
  for example in examples:
    source = tokenizer.encode(example["source"])
    target = tokenizer.encode(example["target"]) if kind != "encoder_classifier" else []
    too_long = len(source) + 1 > max_source or len(target) + 1 > max_target
    overlong += too_long
    if too_long and drop_overlong:
      continue
    if kind == "decoder_only":
      # The source is cut to its own budget, so the prompt fits the same length at inference.
      tokens, weights = pipeline.prefix_lm_example(
          source[:max_source - 1], target[:max_target - 1], max_source + max_target)
      features.setdefault("targets", []).append(tokens)
      features.setdefault("weights", []).append(weights)
      continue
    features.setdefault("inputs", []).append(pipeline.with_eos(source, max_source))
    if kind == "encoder_classifier":
      labels.append(example["label"])
    else:
      features.setdefault("targets", []).append(pipeline.with_eos(target, max_target))
  lengths = {"encoder_decoder": {"inputs": max_source, "targets": max_target},
             "decoder_only": {"targets": max_source + max_target,
                              "weights": max_source + max_target},
             "encoder_classifier": {"inputs": max_source}}[kind]
  for name in lengths:
    features.setdefault(name, [])
  labels_array = np.asarray(labels, np.int32) if kind == "encoder_classifier" else None
  if labels_array is not None and len(labels_array) and (
      labels_array.min() < 0 or labels_array.max() >= config.model.num_classes):
    raise ValueError(f"Labels range over [{labels_array.min()}, {labels_array.max()}] but "
                     f"config.model.num_classes={config.model.num_classes}; raise it.")
  return pipeline.Encoded(features, lengths, labels_array), overlong


def prompt_tokens(encoded: pipeline.Encoded) -> pipeline.Encoded:
  """The generation input of each example: the source (encoder input), or for a prefix LM
  the `SOURCE <eos>` part of its tokens."""
  if "inputs" in encoded.features:
    return pipeline.Encoded({"inputs": encoded.features["inputs"]},
                            {"inputs": encoded.lengths["inputs"]})
  prompts = [tokens[weights == 0] for tokens, weights in
             zip(encoded.features["targets"], encoded.features["weights"])]
  return pipeline.Encoded({"inputs": prompts}, {"inputs": max(map(len, prompts), default=1)})
