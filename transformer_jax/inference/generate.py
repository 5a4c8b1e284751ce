"""Generation over a model family: compiled decode functions, length and batch buckets.

A family (families.py) knows how to start decoding its model; this module runs the search the
config names (decoding.py), compiles it once per (source length, rows) bucket under the
device layout, and turns lists of token sequences into outputs in order. A call of n inputs
decodes the smallest batch bucket that holds them (devices x a power of two, up to the
configured batch), not the whole configured batch. Evaluation and predict both use
`Generator`.
"""

from __future__ import annotations

import collections
import json
from typing import Any, Callable, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from transformer_jax import parallel
from transformer_jax import tokenizer as tokenizer_lib
from transformer_jax.inference import decoding
from transformer_jax.inference import prompt_packing

Array = jax.Array


def max_decode_len(decoding_config: ml_collections.ConfigDict, model_config, source_len: int,
                   prompt_len: int = 0) -> int:
  """Longest output: `decoding.max_decode_len`, or (when 0) source length + 50 (a continued
  prompt under `decoding.max_total_len`: that many, each row ending earlier by its prompt's
  length); never past the model's position range (which a decoder-only model's prompt of
  `prompt_len` shares)."""
  total = decoding_config.get("max_total_len", 0) if prompt_len else 0
  length = decoding_config.max_decode_len or total or source_len + 50
  room = model_config.max_len - prompt_len
  if decoding_config.max_decode_len > room:
    raise ValueError(f"config.decoding.max_decode_len={length} does not fit config.model."
                     f"max_len={model_config.max_len} (after a {prompt_len}-token prompt); "
                     "lower it or raise max_len.")
  return min(length, room)


def check_nbest(decoding_config: ml_collections.ConfigDict, nbest: int) -> None:
  """Raises ValueError when the decoding method cannot give `nbest` outputs."""
  d = decoding_config
  if nbest < 1:
    raise ValueError(f"nbest={nbest}: ask for at least 1 output.")
  if d.method == "beam" and nbest > d.beam_size:
    raise ValueError(f"nbest={nbest} needs decoding.beam_size >= {nbest} (it is "
                     f"{d.beam_size}).")
  if d.method == "greedy" and nbest > 1:
    raise ValueError(f"nbest={nbest}: greedy search gives one output; use decoding.method "
                     "'beam' (beam_size >= nbest) or 'sample'.")


def copies(decoding_config: ml_collections.ConfigDict, nbest: int = 1) -> int:
  """Rows per input that the decoding callback sees: the beams, the samples drawn (at least
  `nbest`, `decoding.num_decodes` for best-of-n), or 1 for greedy search."""
  d = decoding_config
  if d.method == "beam":
    return d.beam_size
  if d.method == "sample":
    return max(nbest, d.num_decodes)
  return nbest


def search(cache: Any, tokens_to_logits: decoding.TokensToLogits, rng: Array, *,
           start_id: int, batch_size: int, decoding_config: ml_collections.ConfigDict,
           max_len: int, nbest: int = 1, forced_first: Array | None = None,
           row_limits: Array | None = None,
           reorder_cache: Callable[[Any, Array], Any] | None = None,
           expand_beams: Callable[[Any, int], Any] | None = None,
           prompt: Array | None = None) -> tuple[Array, Array]:
  """Runs the configured search: ([b, nbest, max_len] output ids, [b, nbest] scores), best
  first. Scores are what the search ranks by: the length-penalised log-probability for beam
  search, the log-probability for greedy and sampled outputs.

  `cache` is per example (the searches expand it); `tokens_to_logits` sees
  `copies(decoding_config, nbest)` rows per example. The logits processors of
  `decoding_config` (min length, banned ids, repetition penalty, no-repeat n-grams, forced
  BOS / EOS) apply to every method; `forced_first` [b]: a first output token per example (0 =
  none) instead of `forced_bos_id` (each row's target language); `row_limits` [b]: output
  tokens per example before an EOS that ends it (a decoder-only prompt's room under
  `decoding.max_total_len`); `reorder_cache`, `expand_beams`: how beam search reorders the
  cache's rows and expands them to its beams (decoding.beam_search); `prompt` [b, len]: a
  decoder-only model's prompts, whose tokens the repetition penalty counts as Hugging Face's
  does.
  """
  d = decoding_config
  end_ids = tuple(d.end_ids)
  common = dict(eos_id=tokenizer_lib.EOS_ID, end_ids=end_ids, max_decode_len=max_len,
                bos_id=start_id, logits_processor=decoding.chain_processors(
                    decoding.make_logits_processor(
                        eos_id=tokenizer_lib.EOS_ID, end_ids=end_ids, min_length=d.min_length,
                        banned_ids=tuple(d.banned_ids),
                        repetition_penalty=d.repetition_penalty,
                        no_repeat_ngram_size=d.no_repeat_ngram_size,
                        forced_bos_id=d.forced_bos_id if forced_first is None else forced_first,
                        forced_eos=d.forced_eos, prompt=prompt),
                    None if row_limits is None else _ended_at(row_limits)))
  if d.method == "beam":
    dummy_inputs = jnp.zeros((batch_size, 1), jnp.int32)  # beam_search reads only its shape
    sequences, scores = decoding.beam_search(dummy_inputs, cache, tokens_to_logits,
                                             beam_size=d.beam_size, alpha=d.alpha,
                                             length_penalty_kind=d.length_penalty,
                                             reorder_cache=reorder_cache,
                                             expand_beams=expand_beams, **common)
    return sequences[:, :nbest], scores[:, :nbest]
  if d.method == "greedy":
    tokens, scores = decoding.greedy_search(cache, tokens_to_logits, batch_size=batch_size,
                                            return_logprobs=True, **common)
    return tokens[:, None], scores[:, None]
  # Independent samples of each input, the most likely first (best-of-n).
  tokens, scores = decoding.sample(cache, tokens_to_logits, rng, batch_size=batch_size,
                                   temperature=d.temperature, top_k=d.top_k, top_p=d.top_p,
                                   num_decodes=copies(d, nbest), return_logprobs=True,
                                   **common)
  return tokens[:, :nbest], scores[:, :nbest]


def _ended_at(row_limits: Array) -> decoding.LogitsProcessor:
  """EOS forced at output position `row_limits[i]` of example i's rows (its beams or samples,
  consecutive), after as many tokens as it may have; nothing else after it. Last in the chain:
  it wins, as Hugging Face's max_length stops a row whatever comes next."""
  eos_only = lambda vocab: jnp.where(jnp.arange(vocab) == tokenizer_lib.EOS_ID, 0.0,
                                     decoding.NEG_INF)

  def process(logits, step, sequences):
    del sequences
    limits = decoding.first_inputs(row_limits, logits.shape[0])  # [rows, 1]
    return jnp.where(step >= limits, eos_only(logits.shape[-1])[None, :], logits)
  return process


# Compiled decoding programs kept per decoding setting, one per (source length, rows) bucket:
# the most recently used this many.
MAX_PROGRAMS = 32


def decode_fn(family, decoding_config: ml_collections.ConfigDict, layout=None, nbest: int = 1):
  """(placed params, placed inputs [rows, len], placed row keys [rows], placed places [rows, 2]
  or None, packed rows) -> (output ids [.., nbest, len] ([.., nbest, 1] class ids for a
  classifier), scores [.., nbest]), compiled by `layout` (default pmap) once per (source
  length, rows, packed rows), the most recent MAX_PROGRAMS kept. Each row samples with its own
  key (`row_keys`), wherever the layout puts it; `places` and packed rows pack the prompts
  (prompt_packing.place), the same outputs from a prefill of fewer rows."""
  layout = layout or parallel.DataParallel()
  compiled: collections.OrderedDict = collections.OrderedDict()  # by the key above

  def per_device(params, inputs, keys, places, packed_rows):
    packing = None if places is None else (places, packed_rows)
    return family.decode(params, inputs, keys, decoding_config=decoding_config, nbest=nbest,
                         packing=packing)

  def run(device_params, device_inputs, device_keys, device_places=None, packed_rows=0):
    shape = (device_inputs.shape[-1], rows_of(device_inputs), packed_rows)
    if shape not in compiled:
      logging.info("Compiling decoding (%s, %d-best) for %d rows of %d source tokens%s.",
                   getattr(decoding_config, "method", "-"), nbest, shape[1], shape[0],
                   f", prompts packed in {packed_rows} rows" if packed_rows else "")
      compiled[shape] = layout.compile_decode(
          lambda params, inputs, keys, places: per_device(params, inputs, keys, places,
                                                          packed_rows))
      if len(compiled) > MAX_PROGRAMS:
        compiled.popitem(last=False)
    compiled.move_to_end(shape)
    return compiled[shape](device_params, device_inputs, device_keys, device_places)

  run.programs = compiled  # inspection: the (source length, rows, packed rows) compiled so far
  run.packs_prompts = family.packs_prompts
  return run


def rows_of(device_inputs) -> int:
  """Rows of a placed batch: [devices, rows / devices, len] under pmap, [rows, len] global."""
  return int(np.prod(device_inputs.shape[:-1]))


def batch_bucket(count: int, batch_size: int, devices: int) -> int:
  """Rows decoded for `count` inputs: the smallest `devices` x 2^k that holds them, at most
  `batch_size` (a multiple of `devices`). A one-sentence call decodes one row per device."""
  rows = devices
  while rows < count:
    rows *= 2
  return min(rows, batch_size)


@jax.jit
def _fold_pairs(key: Array, batches: Array, rows: Array) -> Array:
  return jax.vmap(lambda batch, row: jax.random.fold_in(jax.random.fold_in(key, batch), row))(
      batches, rows)


def row_keys(seed: int, batch_index: int, rows: int) -> np.ndarray:
  """A sampling key per row of batch `batch_index` of a call: fold_in(fold_in(seed, batch),
  row). A row's samples depend on its input and position alone, not on how many rows the
  batch was padded to or which device decodes it."""
  return input_keys(seed, range(batch_index * rows, (batch_index + 1) * rows), rows, rows)


def input_keys(seed: int, indices: Sequence[int], rows: int, batch_size: int) -> np.ndarray:
  """Sampling keys for a batch of `rows` holding the call's inputs `indices` (then padding):
  input i samples with fold_in(fold_in(seed, i // batch_size), i % batch_size), the key of
  its place in the call, whichever batch and row it is decoded in."""
  places = list(indices) + [0] * (rows - len(indices))  # padding rows: any key (dropped)
  places = np.asarray(places, np.int32)
  return np.asarray(_fold_pairs(jax.random.PRNGKey(seed), places // batch_size,
                                places % batch_size))


def bucket_length(num_tokens: int, max_len: int) -> int:
  """Padded source length: the next power of two >= 8, at most max_len (few compilations)."""
  length = 8
  while length < num_tokens:
    length *= 2
  return min(length, max_len)


def generate_ids(p_decode, device_params, prompts: Sequence[np.ndarray], max_len: int,
                 batch_size: int, seed: int = 0, layout=None
                 ) -> list[tuple[np.ndarray, np.ndarray]]:
  """(output ids [nbest, len], scores [nbest]) for token sequences of any length (EOS
  included), in order.

  The prompts are sorted by length and decoded in batches of up to `batch_size` consecutive
  ones, each padded to the length bucket of its longest: a call that fits in one batch is one
  decode, as in transformers' `generate` (one decode per length bucket instead cost a call of
  32 mixed-length sentences four loops of 32 steps; benchmarks/RESULTS.md, issue #42), and a
  long evaluation pads each prompt little. Every batch of a call has the same rows, the
  batch bucket of the call's size (one program per length bucket). The sorted prompts are
  dealt to the parts of the batch that programs decode apart (devices under pmap) in turn, so
  that each part packs as well as the others (prompt_packing.py). Each input samples with the
  key of its place in the call (`input_keys`), so no two share random numbers."""
  layout = layout or parallel.DataParallel()
  order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
  rows = batch_bucket(min(len(prompts), batch_size), batch_size, layout.eval_devices)
  parts = layout.decode_parts
  outputs: list = [None] * len(prompts)
  for start in range(0, len(order), batch_size):
    chosen = order[start:start + batch_size]
    length = bucket_length(len(prompts[chosen[-1]]), max_len)  # the longest is last
    # The k-th prompt's row: part k % parts, the (k // parts)-th row of that part.
    row_of = [(k % parts) * (rows // parts) + k // parts for k in range(len(chosen))]
    sources = np.zeros((rows, length), np.int32)
    inputs_by_row = np.zeros(rows, np.int64)  # padding rows: any key (dropped)
    for row, i in zip(row_of, chosen):
      sources[row, :len(prompts[i])] = prompts[i]
      inputs_by_row[row] = i
    keys = input_keys(seed, inputs_by_row, rows, batch_size)
    places, packed_rows = None, 0
    if getattr(p_decode, "packs_prompts", False):
      places, packed_rows = prompt_packing.place(np.count_nonzero(sources, axis=1), parts,
                                                 length)
    tokens, scores = layout.host_rows(p_decode(
        device_params, layout.eval_batch(sources), layout.eval_batch(keys),
        None if places is None else layout.eval_batch(places), packed_rows))
    for row, i in zip(row_of, chosen):
      outputs[i] = (tokens[row], scores[row])
  return outputs


class Generator:
  """A family's compiled generation on a layout; parameters are passed per call (placed by
  the layout), so it never holds buffers that a donated training step may reuse.

  The compiled functions are kept per decoding setting (the most recent `MAX_DECODERS`), so a
  new setting never reuses a stale one.
  """
  MAX_DECODERS = 8

  def __init__(self, family, layout=None):
    self.family = family
    self.config = family.config
    self.layout = layout or parallel.make_layout(family.config)
    self.batch_size = self.config.per_device_batch_size * self.layout.eval_devices
    self._decoders: collections.OrderedDict = collections.OrderedDict()

  def _decoder(self, decoding_config: ml_collections.ConfigDict, nbest: int):
    key = (json.dumps(decoding_config.to_dict(), sort_keys=True), nbest)
    if key not in self._decoders:
      self._decoders[key] = decode_fn(self.family, decoding_config, self.layout, nbest)
      if len(self._decoders) > self.MAX_DECODERS:
        self._decoders.popitem(last=False)
    self._decoders.move_to_end(key)
    return self._decoders[key]

  def output_ids(self, device_params, prompts: Sequence[np.ndarray], nbest: int = 1,
                 decoding_config: ml_collections.ConfigDict | None = None,
                 with_scores: bool = False) -> list:
    """Generated ids (or [class id]) for encoded prompts, EOS included, in order: the best
    array per prompt, or with `with_scores` a list of `nbest` (ids, score) pairs, best first."""
    decoding_config = decoding_config or self.config.decoding
    results = generate_ids(self._decoder(decoding_config, nbest), device_params, prompts,
                           self.family.max_prompt_length(), self.batch_size,
                           decoding_config.seed, self.layout)
    if with_scores:
      return [list(zip(tokens, scores.tolist())) for tokens, scores in results]
    return [tokens[0] for tokens, _ in results]
