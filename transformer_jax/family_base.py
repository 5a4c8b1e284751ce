"""What every model family offers (`Family`: what training, evaluation, predict and the
benchmark call), and the decoding that the text-generating families share. The families
themselves, and the registry of them, are in families.py."""

from __future__ import annotations

import abc
import copy
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from transformer_jax import output_loss
from transformer_jax import parallel
from transformer_jax import tokenizer as tokenizer_lib
from transformer_jax.data import pipeline
from transformer_jax.inference import generate
from transformer_jax.model import kv_cache
from transformer_jax.model import lora as lora_lib
from transformer_jax.model import quantization
from transformer_jax.model import schema as model_schema

Array = jax.Array


class Family(abc.ABC):
  """A sequence-to-sequence family; the classifier overrides what differs."""
  name = ""
  packable = True  # training rows may hold several packed examples
  generates_text = True  # examples have a target text (the classifier: a label)
  # Outputs continue the prompt in one sequence (decoder-only): Hugging Face's max_length
  # then counts the prompt too.
  continues_prompt = False
  num_model_inputs = 1  # token arrays the model's __call__ takes
  packs_prompts = False  # whether `decode` reads prompts packed (prompt_packing.py)

  def __init__(self, config: ml_collections.ConfigDict):
    self.config = config
    self.model_config = model_schema.model_config(config.model, lora=lora_lib.spec(config))
    # config.quantization: what self.model reads its projections' kernels (and with
    # `embeddings` its token embedding) as; None: float.
    self.quantization = quantization.spec(
        config, self.model_config.qkv_dim // self.model_config.num_heads)
    self._make_models()

  def _make_models(self) -> None:
    """self.float_model (as checkpoints hold it) and self.model (as it is served) for
    self.model_config."""
    self.float_model = self._make_model()
    self.model = quantization.quantized(self._make_model(self._held_config()),
                                        self.quantization)

  def with_adapters(self, lora: model_schema.LoraSpec) -> "Family":
    """This family over a model with adapters `lora` (a server's per-row adapters,
    lora.per_row_spec), the same in all else: parameters are this model's plus the adapters."""
    family = copy.copy(self)
    family.model_config = self.model_config.replace(lora=lora)
    family._make_models()  # pylint: disable=protected-access
    if hasattr(self, "runner"):
      family.runner = family._make_runner()  # pylint: disable=protected-access
    return family

  def trained_in_full(self) -> tuple[str, ...]:
    """Top-level parameters that train in full beside LoRA adapters (PEFT's
    `modules_to_save`: a classifier's head); the rest of the model stays frozen."""
    return ()

  @abc.abstractmethod
  def _make_model(self, model_config=None):
    """The family's Flax model for `model_config` (default: self.model_config)."""

  def _held_config(self, **changes):
    """self.model_config as the served model holds it: the token embedding in int8 where
    config.quantization.embeddings says so, with `changes`."""
    int8_embeddings = bool(self.quantization and self.quantization.embeddings)
    return self.model_config.replace(int8_embeddings=int8_embeddings, **changes)

  @staticmethod
  def longest_sequence(config: ml_collections.ConfigDict) -> int:
    return max(config.max_source_length, config.max_target_length)

  # ---- Training ---------------------------------------------------------------------------

  def init_params(self, rng: Array, *, boxed: bool = False, quantized: bool = False) -> dict:
    """Parameters from one-token dummy inputs (their shapes do not depend on length): float,
    as checkpoints hold them, or with `quantized` in config.quantization's layout (what
    self.model reads).

    With `boxed`, every parameter stays wrapped with the logical axis names it was created
    with (`nn.with_logical_partitioning` in the model), which a jit layout maps to the mesh.
    """
    ones = jnp.ones((1, 1), jnp.int32)
    model = self.model if quantized else self.float_model
    params = model.init(rng, *[ones] * self.num_model_inputs, deterministic=True)["params"]
    return params if boxed else parallel.unbox(params)

  def frozen_base(self, base: dict, layout=None) -> dict:
    """A LoRA run's frozen base (float parameters) as config.lora.base_dtype holds it: a
    float dtype cast, 'int8' / 'int4' quantized (QLoRA; under a jit `layout`, placed in the
    quantized kernels' shardings)."""
    if self.quantization is None:
      return lora_lib.cast(base, self.config.lora.base_dtype)
    frozen_boxed = self.frozen_abstract()
    frozen = quantization.quantize_params(base, frozen_boxed)
    return layout.place_params(frozen, frozen_boxed) if layout and layout.mode == "jit" \
        else frozen

  def frozen_abstract(self) -> dict:
    """A LoRA run's frozen base as it is held, boxed abstract values (shapes, dtypes and
    logical axes)."""
    boxed = jax.eval_shape(lambda: self.init_params(jax.random.PRNGKey(0), boxed=True,
                                                    quantized=True))
    frozen = lora_lib.split(boxed, self.trained_in_full())[1]
    if self.quantization is None:
      dtype = jnp.dtype(self.config.lora.base_dtype)
      frozen = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), frozen)
    return frozen

  @abc.abstractmethod
  def forward(self, params, batch: dict, *, deterministic: bool, rngs=None) -> Array:
    """Logits of a batch: [b, len, vocab] (sequence families) or [b, num_classes]."""

  def labels_and_weights(self, batch: dict) -> tuple[Array, Array]:
    """What the loss compares the logits with, and how much each position counts."""
    targets = batch["targets"]
    weights = batch.get("weights")
    if weights is None:
      weights = (targets > 0).astype(jnp.float32)
    return targets, weights

  def score_outputs(self, params, batch: dict, score, *, deterministic: bool, rngs=None):
    """`score(logits, labels, weights)` of the model's outputs on `batch`: the training loss
    and its metrics. The decoder-only family computes logits only where weights are not 0."""
    labels, weights = self.labels_and_weights(batch)
    return score(self.forward(params, batch, deterministic=deterministic, rngs=rngs),
                 labels, weights)

  def train_step_flops(self, batch_size: int) -> float | None:
    """Model FLOPs of one training step on full-length rows (for the MFU); None where
    flops.py has no formula for the family."""
    return None

  # ---- Data -------------------------------------------------------------------------------

  @abc.abstractmethod
  def feature_lengths(self) -> dict[str, int]:
    """Padded length of each token feature."""

  @abc.abstractmethod
  def example_features(self, source: list[int], target: list[int],
                       source_weights: list[float] | None = None) -> dict[str, np.ndarray]:
    """One example's token features from its source (and target) token ids (data/features.py
    encodes whole splits with it); `source_weights`: a chat conversation's loss weights over
    its source (its earlier replies)."""

  def label_array(self, labels: list[int]) -> np.ndarray | None:
    """The examples' labels as the batches carry them (None: the family has none)."""
    return None

  def max_prompt_length(self) -> int:
    """The longest prompt (`prompt`, `prompts`) in tokens."""
    return self.config.max_source_length

  def prompt(self, source: list[int]) -> np.ndarray:
    """What generation starts from for one text's source ids (predict's input)."""
    return pipeline.with_eos(source, self.config.max_source_length)

  def prompts(self, encoded) -> list[np.ndarray]:
    """What generation starts from, per example of `encoded` (data/pipeline.py's Encoded:
    not imported, as the data layer sits above the families): the encoder input
    (decoder-only: the `SOURCE <eos>` part)."""
    return encoded.features["inputs"]

  # ---- Generation -------------------------------------------------------------------------

  def check_nbest(self, decoding_config: ml_collections.ConfigDict, nbest: int) -> None:
    """Raises ValueError when the decoding settings cannot give `nbest` outputs."""
    generate.check_nbest(decoding_config, nbest)

  def max_decode_len(self, decoding_config: ml_collections.ConfigDict, source_len: int) -> int:
    return generate.max_decode_len(decoding_config, self.model_config, source_len)

  @abc.abstractmethod
  def decode(self, params, inputs: Array, rng: Array, *,
             decoding_config: ml_collections.ConfigDict, nbest: int = 1, packing=None):
    """[b, src_len] prompts -> ([b, nbest, len] output ids, [b, nbest] scores), best first.
    `packing`: (places [b, 2], packed rows) of prompt_packing.place, for families that
    `packs_prompts`; None: every prompt in its own row."""

  def output_text(self, ids: Sequence[int], tokenizer: tokenizer_lib.Tokenizer) -> str:
    """An output's text: detokenized ids (a classifier: the label name)."""
    return tokenizer.decode(ids)

  # ---- Inspection -------------------------------------------------------------------------

  @abc.abstractmethod
  def attention_weights(self, params, prompt: np.ndarray, output: np.ndarray):
    """Attention of one example, teacher-forced on its `prompt` and an `output` (token ids,
    EOS included, no padding): every layer's weights [1, heads, queries, keys] by module path
    (models.attention_weights), and per attention kind ('encoder_self', 'decoder_self',
    'cross') the token ids its queries predict or read, and those of its keys."""


class SequenceFamily(Family):
  """A family that generates text token by token from a KV cache."""
  packs_prompts = True

  def decoding_model(self):
    """The model its runner decodes with: this one, its KV cache kept in
    config.decoding.kv_cache_dtype where that is set (the same parameters)."""
    cache_dtype = self.config.get("decoding", {}).get("kv_cache_dtype", "")
    if not cache_dtype:
      return self.model
    return quantization.quantized(
        self._make_model(self._held_config(kv_cache_dtype=cache_dtype)), self.quantization)

  @property
  def logits_chunk_length(self) -> int:
    """config.logits_chunk_length, 0 (all positions at once) in a workdir saved before it."""
    return self.config.get("logits_chunk_length", 0)

  def output_layer(self, params):
    """The model's output layer (`model.logits`): states [..., emb] -> float32 logits."""
    return lambda states: self.output_logits(params, states)

  def output_logits(self, params, states: Array) -> Array:
    return self.model.apply({"params": params}, states, method=self.model.logits)

  def score_states(self, params, score, states: Array, labels: Array, weights: Array):
    """`score(logits of states [rows, len, emb], labels, weights)` over chunks of
    config.logits_chunk_length positions (> 0), fused with its gradients under
    config.fused_loss (output_loss.py)."""
    if self.config.get("fused_loss"):
      return output_loss.fused_score(score, self.output_logits, params, states, labels,
                                     weights, self.logits_chunk_length)
    return output_loss.chunked_score(score, self.output_layer(params), states, labels, weights,
                                     self.logits_chunk_length)

  def decode(self, params, inputs, rng, *, decoding_config, nbest=1, packing=None):
    inputs, forced_first, row_starts = self.split_prompt(inputs)
    max_len = self.max_decode_len(decoding_config, inputs.shape[1])
    rows = inputs.shape[0] * generate.copies(decoding_config, nbest)
    beams = decoding_config.beam_size if decoding_config.method == "beam" else 1
    cache, tokens_to_logits, start_id = self.runner.start_decoding(
        params, inputs, rows, max_len, packing, beams)
    start_id = start_id if row_starts is None else row_starts
    return generate.search(cache, tokens_to_logits, rng, start_id=start_id,
                           batch_size=inputs.shape[0], decoding_config=decoding_config,
                           max_len=max_len, nbest=nbest, forced_first=forced_first,
                           row_limits=self.output_limits(inputs, decoding_config),
                           reorder_cache=kv_cache.reorder_beams if beams > 1 else None,
                           expand_beams=kv_cache.expand_beams if beams > 1 else None,
                           prompt=inputs if self.continues_prompt else None)

  def output_limits(self, inputs: Array, decoding_config: ml_collections.ConfigDict
                    ) -> Array | None:
    """[b] output tokens each prompt may have before its EOS, None: max_decode_len's for all.
    A continued prompt under `decoding.max_total_len` (Hugging Face's max_length, which counts
    the prompt): what its own length leaves, as when it is generated alone."""
    total = decoding_config.get("max_total_len", 0)
    if not (self.continues_prompt and total) or decoding_config.max_decode_len:
      return None
    return jnp.maximum(total - jnp.sum(inputs != 0, axis=1), 0)

  def split_prompt(self, inputs: Array) -> tuple[Array, Array | None, Array | None]:
    """[b, len] prompts -> (what the model reads, [b] first output tokens to force per row, 0
    = none; [b] first decoder inputs per row instead of the runner's; None: no row
    forces one, or every row starts from the runner's)."""
    return inputs, None, None
