"""The one place that knows each model family: its model, batches, loss targets and outputs.

  encoder_decoder     translation, summarization, multitask: source -> target text
  decoder_only        the same tasks as one causal sequence `SOURCE <eos> TARGET <eos>`
                      (causal over the source too, not a prefix LM), loss on the target
                      only (config.architecture = 'decoder_only')
  encoder_classifier  classification (config.task = 'classification'): source -> one of
                      config.model.num_classes labels

`families.get(config)` builds the family object; training, evaluation, predict and the
benchmark ask it (`forward`, `labels_and_weights`, `example_features`, `decode`, ...) and never
look at the model's type. Adding a family means adding a class here that implements
family_base.Family (what every family offers) and its name in NAMES.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from transformer_jax import default_config
from transformer_jax import family_base
from transformer_jax import flops
from transformer_jax.data import directions
from transformer_jax.data import pipeline
from transformer_jax.inference import generate
from transformer_jax.inference import runners
from transformer_jax.inference import search_basics
from transformer_jax.model import models
from transformer_jax.model import schema as model_schema

Array = jax.Array
Family = family_base.Family  # what every family offers (family_base.py)
NAMES = ("encoder_decoder", "decoder_only", "encoder_classifier")
ENCODER_DECODER, DECODER_ONLY, ENCODER_CLASSIFIER = NAMES
ARCHITECTURES = NAMES[:2]  # what config.architecture names (a classifier: config.task's)


def name(config: ml_collections.ConfigDict) -> str:
  """The family a config trains: classification uses the encoder classifier, the other tasks
  `config.architecture`."""
  if config.task == "classification":
    return ENCODER_CLASSIFIER
  if config.architecture not in ARCHITECTURES:
    raise ValueError(f"Unknown config.architecture={config.architecture!r}; use one of "
                     f"{ARCHITECTURES}.")
  return config.architecture


def get(config: ml_collections.ConfigDict) -> family_base.Family:
  """The family object of `config`, holding its model."""
  return _BY_NAME[name(config)](config)


def longest_sequence(config: ml_collections.ConfigDict) -> int:
  """Tokens in the longest sequence the config's model reads (its max_len must cover it)."""
  return _BY_NAME[name(config)].longest_sequence(config)


def generates_text(config: ml_collections.ConfigDict) -> bool:
  """Whether the config's model generates text (and config.decoding applies)."""
  return _BY_NAME[name(config)].generates_text


def family_class(family_name: str) -> type[family_base.Family]:
  """The class of a family by name (its `generates_text`, `continues_prompt`, ...)."""
  if family_name not in NAMES:
    raise ValueError(f"Unknown family {family_name!r}; use one of {NAMES}.")
  return _BY_NAME[family_name]


def set_family(config: ml_collections.ConfigDict, family_name: str) -> None:
  """Makes `config` train `family_name`: the classifier by its task, a text family by
  config.architecture (which a classification config cannot take: ValueError)."""
  family_class(family_name)  # a known name
  with config.unlocked():
    if family_name == EncoderClassifier.name:
      config.task = "classification"
    elif config.task == "classification":
      raise ValueError(f"a classification config cannot train the {family_name} family")
    else:
      config.architecture = family_name


def from_model_config(family_name: str, model_config: model_schema.TransformerConfig,
                      **config_overrides) -> family_base.Family:
  """A family around a model config, every other setting from default_config (for notebooks
  and tests that start from a TransformerConfig rather than an experiment config)."""
  config = default_config.get_config()
  set_family(config, family_name)
  config.model.update(model_schema.as_dict(model_config))
  config.update(config_overrides)
  return get(config)


class EncoderDecoder(family_base.SequenceFamily):
  """The paper's Transformer: the encoder reads the source, the decoder writes the target."""
  name = ENCODER_DECODER
  num_model_inputs = 2  # inputs, targets

  def __init__(self, config: ml_collections.ConfigDict):
    super().__init__(config)
    # Many translation directions in one run (data/directions.py): each prompt carries its
    # row's target-language code after its end, the token decoding forces first in that row
    # (mBART-cc25: the row's first decoder input, `start_from_last_target`).
    self.code_after_prompt = bool(directions.pairs(config))
    # mBART-cc25 / NLLB legacy_behaviour: `X </s> [code]`, ended by the tokenizer itself.
    self.code_after_eos = bool(config.get("code_after_eos", False))
    self.runner = self._make_runner()

  def _make_runner(self):
    return runners.EncoderDecoderRunner(self.decoding_model(), self.model_config)

  def _make_model(self, model_config=None):
    return models.EncoderDecoder(model_config or self.model_config)

  def max_prompt_length(self) -> int:
    return self.config.max_source_length + self.code_after_prompt

  def _ended(self, ids, max_len: int) -> np.ndarray:
    end = pipeline.with_own_end if self.code_after_eos else pipeline.with_eos
    return end(ids, max_len)

  def prompt(self, source: list[int]) -> np.ndarray:
    prompt = self._ended(source, self.config.max_source_length)
    if not self.code_after_prompt:
      return prompt
    # The target code of config.target_lang: forced first, or (cc25) the decoder's start.
    code = (self.model_config.bos_id if self.model_config.start_from_last_target
            else self.config.decoding.forced_bos_id)
    if code < 0 or not self.config.get("target_lang"):
      raise ValueError("This model translates several directions: name one with "
                       "--config.source_lang=CODE --config.target_lang=CODE.")
    return np.append(prompt, np.int32(code))

  def prompts(self, encoded) -> list[np.ndarray]:
    inputs = super().prompts(encoded)
    if not self.code_after_prompt:
      return inputs
    # The target's language code: its first token (`[code] X </s>`), or its last after its
    # EOS (`X </s> [code]`: mBART-cc25, NLLB legacy_behaviour).
    code = (lambda t: t[-1:]) if self.code_after_eos else (lambda t: t[:1])
    return [np.append(i, code(t)).astype(np.int32)
            for i, t in zip(inputs, encoded.features["targets"])]

  def split_prompt(self, inputs):
    if not self.code_after_prompt:
      return inputs, None, None
    inputs, codes = search_basics.split_code(inputs)
    if self.model_config.start_from_last_target:  # mBART-cc25: each row starts from its code
      return inputs, None, codes
    return inputs, codes, None

  def forward(self, params, batch: dict, *, deterministic: bool, rngs=None,
              states_only: bool = False) -> Array:
    """Logits [b, tgt_len, vocab] (`states_only`: the decoder's states before the output)."""
    return self.model.apply(
        {"params": params}, batch["inputs"], batch["targets"], batch.get("inputs_position"),
        batch.get("targets_position"), batch.get("inputs_segmentation"),
        batch.get("targets_segmentation"), deterministic=deterministic, rngs=rngs or {},
        states_only=states_only)

  def score_outputs(self, params, batch, score, *, deterministic, rngs=None):
    if not self.logits_chunk_length:
      return super().score_outputs(params, batch, score, deterministic=deterministic,
                                   rngs=rngs)
    labels, weights = self.labels_and_weights(batch)
    states = self.forward(params, batch, deterministic=deterministic, rngs=rngs,
                          states_only=True)
    return self.score_states(params, score, states, labels, weights)

  def train_step_flops(self, batch_size: int) -> float:
    return flops.train_step_flops(self.model_config, batch_size, self.config.max_source_length,
                                  self.config.max_target_length)

  def feature_lengths(self) -> dict[str, int]:
    return {"inputs": self.config.max_source_length, "targets": self.config.max_target_length}

  def example_features(self, source, target, source_weights=None):
    del source_weights  # decoder-only chat conversations only
    return {"inputs": self._ended(source, self.config.max_source_length),
            "targets": self._ended(target, self.config.max_target_length)}

  def attention_weights(self, params, prompt, output):
    if self.code_after_prompt:
      prompt = np.asarray(prompt)[:-1]
    model = self.model
    if self.model_config.start_from_last_target:
      # An output ends with EOS, not with its code: decoding started it from bos_id (the
      # code of config.target_lang), and so does teacher forcing here.
      model = models.EncoderDecoder(self.model_config.replace(start_from_last_target=False))
    weights = models.attention_weights(model, params, prompt[None], output[None])
    decoder_inputs = np.asarray(models.shift_right(output[None], self.model_config.bos_id))[0]
    return weights, {"encoder_self": (prompt, prompt), "decoder_self": (output, decoder_inputs),
                     "cross": (output, prompt)}

class DecoderOnly(family_base.SequenceFamily):
  """A causal LM over `SOURCE <eos> TARGET <eos>`, graded on the target only. Causal over the
  source too, or with `model.prefix_lm` a prefix LM: the source part (loss weight 0) read
  both ways, in training and when a prompt fills the KV cache.

  With config.prompt_format 'raw' or 'chat' (data/prompt_format.py) the sequence is the
  prompt's ids as a pretrained tokenizer makes them, then the target's: the model reads them
  as they are, not shifted right behind a start token, and decoding continues the prompt
  from its last token."""
  name = DECODER_ONLY
  continues_prompt = True

  def __init__(self, config: ml_collections.ConfigDict):
    super().__init__(config)
    self.unshifted = config.get("prompt_format", "task") != "task"
    self.runner = self._make_runner()

  def _make_runner(self):
    return runners.DecoderOnlyRunner(self.decoding_model(), self.model_config, self.unshifted)

  @staticmethod
  def longest_sequence(config):
    return config.max_source_length + config.max_target_length  # one sequence

  def _make_model(self, model_config=None):
    return models.DecoderOnly(model_config or self.model_config)

  def train_step_flops(self, batch_size: int) -> float:
    # The output layer runs at the target part's positions only (see score_outputs).
    return 3 * flops.decoder_only_forward_flops(
        self.model_config, batch_size,
        self.config.max_source_length + self.config.max_target_length,
        self.config.max_target_length)

  def forward(self, params, batch: dict, *, deterministic: bool, rngs=None,
              method=None) -> Array:
    """Logits [b, len, vocab] (`method=self.model.states`: the states before the output)."""
    return self.model.apply({"params": params}, batch["targets"], batch.get("targets_position"),
                            batch.get("targets_segmentation"), _prefix(batch),
                            deterministic=deterministic, rngs=rngs or {}, method=method,
                            shift=not self.unshifted)

  def labels_and_weights(self, batch: dict) -> tuple[Array, Array]:
    labels, weights = super().labels_and_weights(batch)
    if self.unshifted:  # logits[t] predict token t + 1
      next_one = lambda x: jnp.pad(x[:, 1:], ((0, 0), (0, 1)))
      labels, weights = next_one(labels), next_one(weights)
    return labels, weights

  def score_outputs(self, params, batch, score, *, deterministic, rngs=None):
    # Only the target part carries loss (a summary's ~60 of 320 positions): the output layer,
    # the largest matmul of a small model, runs on those positions alone, gathered from the
    # batch's states into a fixed budget of rows x max_target_length (all an unpacked batch
    # can weigh). A packed batch that weighs more takes the full computation instead.
    labels, weights = (x.reshape(-1) for x in self.labels_and_weights(batch))
    states = self.forward(params, batch, deterministic=deterministic, rngs=rngs,
                          method=self.model.states)
    states = states.reshape(-1, states.shape[-1])  # [b * len, emb]
    rows = batch["targets"].shape[0]
    budget = rows * self.config.max_target_length

    def scored(states, labels, weights):  # flat [n, ...]: `rows` rows of n / rows positions
      if not self.logits_chunk_length:
        return score(self.output_layer(params)(states), labels, weights)
      as_rows = lambda x: x.reshape((rows, -1) + x.shape[1:])
      return self.score_states(params, score, as_rows(states), as_rows(labels),
                               as_rows(weights))

    everywhere = lambda: scored(states, labels, weights)
    if budget >= len(weights):
      return everywhere()
    count = jnp.sum(weights != 0)

    def weighted_only():
      index = jnp.nonzero(weights, size=budget, fill_value=0)[0]
      kept = jnp.where(jnp.arange(budget) < count, weights[index], 0.0)  # the fill weighs 0
      return scored(states[index], labels[index], kept)

    return jax.lax.cond(count <= budget, weighted_only, everywhere)

  def feature_lengths(self) -> dict[str, int]:
    length = self.config.max_source_length + self.config.max_target_length
    return {"targets": length, "weights": length}

  def example_features(self, source, target, source_weights=None):
    # The source is cut to its own budget, so the prompt fits the same length at inference.
    max_source, max_target = self.config.max_source_length, self.config.max_target_length
    if self.unshifted:
      weights = self._cut(source_weights) if source_weights is not None else None
      tokens, weights = pipeline.text_example(self.prompt(source), target[:max_target], weights)
    else:
      tokens, weights = pipeline.decoder_only_example(
          source[:max_source - 1], target[:max_target - 1], max_source + max_target)
    return {"targets": tokens, "weights": weights}

  def prompt(self, source):
    if not self.unshifted:
      return super().prompt(source)
    # An empty text starts from the start token (GPT-2's <|endoftext|>, as transformers does).
    return np.asarray(self._cut(source) or [self.model_config.bos_id], np.int32)

  def _cut(self, source) -> list:
    """A raw or chat source in max_source_length: a text keeps its start, a chat its end
    (the latest turns and the generation prompt)."""
    n = self.config.max_source_length
    return list(source)[-n:] if self.config.prompt_format == "chat" else list(source)[:n]

  def prompts(self, encoded: pipeline.Encoded) -> list[np.ndarray]:
    """What each example's output follows: `SOURCE <eos>` (loss weight 0), or the raw or
    chat prompt before the final reply (a conversation's earlier replies weigh too)."""
    prompts = []
    for tokens, weights in zip(encoded.features["targets"], encoded.features["weights"]):
      if self.unshifted:  # all before the trailing weighted run (the final reply)
        unweighted = np.flatnonzero(weights == 0)
        prompts.append(tokens[:unweighted[-1] + 1 if len(unweighted) else 0])
      else:
        prompts.append(tokens[weights == 0])
    return prompts

  def max_decode_len(self, decoding_config, source_len):
    # The prompt and the output share the model's positions.
    return generate.max_decode_len(decoding_config, self.model_config, source_len,
                                   prompt_len=source_len)

  def attention_weights(self, params, prompt, output):
    tokens = np.concatenate([prompt, output])  # SOURCE <eos> TARGET <eos>, as in training
    prefix = np.arange(len(tokens)) < len(prompt)
    weights = models.attention_weights(self.model, params, tokens[None], None, None,
                                       prefix[None], shift=not self.unshifted)
    inputs = (tokens if self.unshifted else
              np.asarray(models.shift_right(tokens[None], self.model_config.bos_id))[0])
    return weights, {"decoder_self": (tokens, inputs)}

class EncoderClassifier(family_base.Family):
  """Encoder, pooling and a dense head: source -> one of config.model.num_classes labels."""
  name = ENCODER_CLASSIFIER
  packable = False  # one label per row
  generates_text = False

  @staticmethod
  def longest_sequence(config):
    return config.max_source_length

  def _make_model(self, model_config=None):
    return models.EncoderClassifier(model_config or self.model_config)

  def trained_in_full(self) -> tuple[str, ...]:
    # RoBERTa's head (pooling 'cls_head') is its dense + tanh layer and the output layer.
    return ("head", "pooling_query") + (("pooler",) * (self.model_config.pooling == "cls_head"))

  def forward(self, params, batch: dict, *, deterministic: bool, rngs=None) -> Array:
    return self.model.apply({"params": params}, batch["inputs"], deterministic=deterministic,
                            rngs=rngs or {})

  def labels_and_weights(self, batch: dict) -> tuple[Array, Array]:
    # One label per row; all-padding rows (filling the last batch) weigh 0.
    return batch["labels"], jnp.any(batch["inputs"] != 0, axis=-1).astype(jnp.float32)

  def feature_lengths(self) -> dict[str, int]:
    return {"inputs": self.config.max_source_length}

  def example_features(self, source, target, source_weights=None):
    del source_weights  # decoder-only chat conversations only
    return {"inputs": pipeline.with_eos(source, self.config.max_source_length)}

  def label_array(self, labels: list[int]) -> np.ndarray:
    array = np.asarray(labels, np.int32)
    num_classes = self.model_config.num_classes
    if len(array) and (array.min() < 0 or array.max() >= num_classes):
      raise ValueError(f"Labels range over [{array.min()}, {array.max()}] but "
                       f"config.model.num_classes={num_classes}; raise it.")
    return array

  def check_nbest(self, decoding_config, nbest):
    if nbest < 1:
      raise ValueError(f"nbest={nbest}: ask for at least 1 output.")
    if nbest > self.model_config.num_classes:
      raise ValueError(f"nbest={nbest}: the classifier has only "
                       f"{self.model_config.num_classes} classes.")

  def decode(self, params, inputs, rng, *, decoding_config, nbest=1, packing=None):
    """([b, nbest, 1] class ids, [b, nbest] log-probabilities), most likely first."""
    del rng, decoding_config, packing  # one label per prompt: nothing is packed
    logits = self.model.apply({"params": params}, inputs, deterministic=True)
    scores, ids = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32)), nbest)
    return ids[:, :, None], scores

  def attention_weights(self, params, prompt, output):
    del output  # a label: nothing attends to it
    return (models.attention_weights(self.model, params, prompt[None]),
            {"encoder_self": (prompt, prompt)})

  def output_text(self, ids, tokenizer):
    names, label = self.config.label_names, int(ids[0])
    return names[label] if label < len(names) else str(label)


def _prefix(batch: dict) -> Array | None:
  """[b, len]: the decoder-only source part `SOURCE <eos>` (non-padding, loss weight 0), which
  a prefix LM reads both ways; None for a batch of plain text without weights."""
  if "weights" not in batch:
    return None
  return (batch["weights"] == 0) & (batch["targets"] != 0)


_BY_NAME = {f.name: f for f in (EncoderDecoder, DecoderOnly, EncoderClassifier)}
