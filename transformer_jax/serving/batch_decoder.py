"""The compiled decode of a server's batch: rows of different requests, each with its own
sampling settings (temperature, top_k, top_p, penalties, logit_bias, min_tokens), seed and
output limit, decoded in segments of serve.stream_steps tokens (one compiled call fills the KV
cache, each further call advances every row), so that streaming rows get their tokens while
the batch decodes.

Shapes are bucketed so that a server compiles a few programs, once: prompts are padded to a
power of two >= 8 (at most config.max_source_length) and batches to devices x a power of two (at
most serve.max_batch_size), as generate.py buckets them; every output is decoded to one length
(the server's longest), each row stopping at its own limit and the batch when all have.
`warm_up` compiles (prompt length, rows) buckets ahead of their first batch.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import tokenizer as tokenizer_lib
from transformer_jax.inference import decoding
from transformer_jax.inference import generate
from transformer_jax.model import lora as lora_lib

# The most entries of one row's logit_bias: a fixed width keeps one compiled segment.
LOGIT_BIAS_ENTRIES = 300


@dataclasses.dataclass
class Row:
  """One output to generate: a prompt's token ids and that output's settings."""
  prompt: np.ndarray
  max_tokens: int = 1
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  # The row samples with fold_in(fold_in(PRNGKey(seed), prompt_index), choice): fixed by the
  # request's seed and the row's place in it, whatever batch the row is decoded in.
  seed: int = 0
  prompt_index: int = 0
  choice: int = 0
  adapter: int = 0  # the row's named adapter (adapters.AdapterSet.index); 0: the base alone
  # OpenAI's penalties of tokens already in the output, and logit_bias: {model's id: bias}.
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: dict[int, float] | None = None
  min_tokens: int = 0  # vLLM's: no EOS (nor end id) before this many tokens
  repetition_penalty: float | None = None  # vLLM's; None: the checkpoint's decoding config's
  # Called from the decoding thread after each segment of serve.stream_steps tokens that
  # added some to this row, with all of its tokens so far (ids, log-probabilities; EOS
  # included where it ended): a streamed request's text is sent while its batch decodes.
  on_tokens: Callable[[np.ndarray, np.ndarray], None] | None = dataclasses.field(
      default=None, repr=False, compare=False)


@dataclasses.dataclass
class Output:
  """A row's generated ids (EOS included where it ended so) and their log-probabilities; a
  classifier's row: every class's log-probability."""
  ids: np.ndarray
  logprobs: np.ndarray


def power_of_two_buckets(low: int, high: int) -> list[int]:
  """low, 2 low, 4 low, ... and `high` itself: the sizes generate.py's buckets take."""
  sizes = [low]
  while sizes[-1] < high:
    sizes.append(min(sizes[-1] * 2, high))
  return sizes


class BatchDecoder:
  """The predictor's model, decoding batches of `Row`s in bucketed shapes."""

  def __init__(self, predictor, max_batch_size: int, stream_steps: int = 4,
               adapters=None):
    self.predictor = predictor
    self.layout = predictor.layout
    # Named adapters (adapters.AdapterSet): each row reads its own, stacked beside the base.
    self.adapters = adapters
    self.family = predictor.family
    self.params = predictor.device_params
    if adapters is not None:
      self.family = adapters.family
      self.params = lora_lib.combine(self.layout.place_params(adapters.stack, adapters.boxed),
                                     self.params)
    config = predictor.config
    devices = self.layout.eval_devices
    # Whole rows per device: the batch is a multiple of the devices.
    self.max_batch_size = -(-max_batch_size // devices) * devices
    self.row_buckets = power_of_two_buckets(devices, self.max_batch_size)
    self.max_source_length = config.max_source_length
    self.length_buckets = sorted({generate.bucket_length(n, config.max_source_length)
                                  for n in range(1, config.max_source_length + 1)})
    self.classifier = not self.family.generates_text
    self.stream_steps = stream_steps
    if self.classifier:
      self.max_new_tokens = 0
      self._decode = generate.decode_fn(self.family, config.decoding, self.layout,
                                        nbest=self.family.model_config.num_classes)
    else:
      self.max_new_tokens = max_new_tokens(self.family, config)
      start, advance = self._segment_functions(config.decoding)
      self._start = self.layout.compile_decode(start)
      self._advance = self.layout.compile_decode_steps(advance)

  def _segment_functions(self, decoding_config) -> tuple[Callable, Callable]:
    """The two compiled halves of a batch's decode, segment by segment:
      start(params, prompts [rows, len], per-row settings) -> carried state (the prompts read,
        the KV cache filled, nothing generated; the prompts kept for the repetition penalty),
        as `split_prompt` and the runner's prefill read prompts in one-call decoding (a
        many-direction workdir's per-row target code);
      advance(params, carried, settings) -> (carried, progress): `segment_function`'s.
    """
    family, length = self.family, self.max_new_tokens
    advance = segment_function(family, length, self.stream_steps, decoding_config)

    def start(params, prompts, rows):
      inputs, forced_first, row_starts = family.split_prompt(prompts)
      cache, context, start_id = family.runner.prefill(
          lora_lib.for_rows(params, rows["adapter"]), inputs, inputs.shape[0], length)
      state = decoding.start_sampling(
          cache, batch_size=prompts.shape[0], max_decode_len=length,
          bos_id=start_id if row_starts is None else row_starts)
      firsts = jnp.zeros(prompts.shape[:1], jnp.int32) if forced_first is None else forced_first
      return state, context, firsts, inputs

    return start, advance

  def limits(self, rows: Sequence[Row]) -> list[int]:
    """Each row's max_tokens, within what decoding.max_total_len leaves after its prompt."""
    prompts = np.zeros((len(rows), max(len(r.prompt) for r in rows)), np.int32)
    for i, row in enumerate(rows):
      prompts[i, :len(row.prompt)] = row.prompt
    limits = self.family.output_limits(prompts, self.predictor.config.decoding)
    if limits is None:
      return [row.max_tokens for row in rows]
    # A prompt that leaves no room still decodes one token, as one-call decoding does.
    return [max(1, min(row.max_tokens, int(limit)))
            for row, limit in zip(rows, np.asarray(limits))]

  def prompt_bucket(self, length: int) -> int:
    """The padded length of a batch whose longest prompt has `length` tokens."""
    return generate.bucket_length(length, self.max_source_length)

  def shapes(self) -> list[tuple[int, int]]:
    """Every (prompt length, rows) bucket a batch can take."""
    return [(length, rows) for length in self.length_buckets for rows in self.row_buckets]

  def warm_up(self, progress: Callable[[int, int, tuple], None] | None = None,
              shapes: Sequence[tuple[int, int]] | None = None,
              stop: threading.Event | None = None) -> bool:
    """Compiles the buckets `shapes` (default: every one) by decoding one-token outputs of
    dummy prompts, telling `progress` (index, count, shape) among all the buckets before
    each; stops between buckets once `stop` is set. Returns whether it compiled them all.
    Safe beside `decode` in another thread: a batch whose shape is not compiled yet compiles
    it on the spot."""
    return each_shape(self.shapes(), shapes, progress, stop, lambda shape: self.decode(
        [Row(np.full((shape[0],), 3, np.int32))] * shape[1]))

  def decode(self, rows: Sequence[Row]) -> list[Output]:
    """Outputs of up to max_batch_size rows, in order."""
    if not rows or len(rows) > self.max_batch_size:
      raise ValueError(f"A batch holds 1 to {self.max_batch_size} rows, not {len(rows)}.")
    length = self.prompt_bucket(max(len(r.prompt) for r in rows))
    count = generate.batch_bucket(len(rows), self.max_batch_size, self.layout.eval_devices)
    prompts = np.zeros((count, length), np.int32)
    for i, row in enumerate(rows):
      prompts[i, :len(row.prompt)] = row.prompt
    layout = self.layout
    if self.classifier:
      keys = generate.row_keys(0, 0, count)
      ids, scores = layout.host_rows(self._decode(self.params,
                                                  layout.eval_batch(prompts),
                                                  layout.eval_batch(keys)))
      # [rows, classes, 1] class ids most likely first -> every class's log-probability.
      by_class = np.zeros(scores.shape, np.float32)
      np.put_along_axis(by_class, ids[:, :, 0], scores, axis=1)
      return [Output(np.zeros((0,), np.int32), by_class[i]) for i in range(len(rows))]
    limits = self.limits(rows)
    row_settings = layout.eval_batch(settings(
        [dataclasses.replace(row, max_tokens=limit) for row, limit in zip(rows, limits)],
        count))
    params = self.params
    carried = self._start(params, layout.eval_batch(prompts), row_settings)
    told = [0] * len(rows)  # tokens each row's on_tokens has been given
    carried, progress = self._advance(params, carried, row_settings)
    while True:
      # The next segment is queued before this one's tokens are read, so that the device does
      # not wait for the host (after the last one it runs no step: every row has finished).
      carried, following = self._advance(params, carried, row_settings)
      progress = layout.host_rows(progress)
      for i, row in enumerate(rows):
        ids, logprobs = so_far(progress, i, limits[i])
        if row.on_tokens is not None and len(ids) > told[i]:
          told[i] = len(ids)
          tell(row, ids, logprobs)
      # Every row stops at its limit (<= max_new_tokens), so the second test is a guard.
      if progress["finished"][:len(rows)].all() or progress["step"].min() >= (
          self.max_new_tokens):
        break
      progress = following
    return [Output(progress["ids"][i, :limit], progress["logprobs"][i, :limit])
            for i, limit in enumerate(limits)]


def segment_function(family, max_new: int, steps: int, decoding_config) -> Callable:
  """advance(params, carried, settings) -> (carried, progress): up to `steps` more tokens for
  every row (decoding.sample_steps: `decoding.sample`'s own loop body) of `carried` = (sampling
  state, runner context, [rows] first tokens to force, 0: none, [rows, len] prompts), each row
  with its own settings and named adapter; `progress` = {step, finished, ids, logprobs} per
  row so far."""
  runner, end_ids = family.runner, tuple(decoding_config.end_ids)
  forced_eos = decoding_config.forced_eos
  processor = logits_processor(decoding_config)

  def advance(params, carried, rows):
    state, context, forced_firsts, prompts = carried
    # Each row's repetition penalty (0: the config's), counting a decoder-only prompt's tokens
    # as one-call decoding does; skipped where every row's is 1.
    penalty = jnp.where(rows["repetition_penalty"] > 0, rows["repetition_penalty"],
                        decoding_config.repetition_penalty)
    repetition = decoding.only_where(
        lambda step: jnp.any(penalty != 1.0),
        decoding.repetition_penalty_processor(penalty,
                                              prompts if family.continues_prompt else None))
    # A many-direction workdir's target code, first; then Hugging Face's forced_eos_token_id,
    # EOS at the row's last position (it wins, as in --mode predict's processors).
    forced = jnp.zeros((forced_firsts.shape[0], max_new), jnp.int32).at[:, 0].set(
        forced_firsts)
    if forced_eos:
      forced = forced.at[jnp.arange(forced.shape[0]), rows["max_tokens"] - 1].set(
          tokenizer_lib.EOS_ID, mode="drop")
    state = decoding.sample_steps(
        state, runner.step_logits(lora_lib.for_rows(params, rows["adapter"]), context),
        row_keys(rows), steps=steps, eos_id=tokenizer_lib.EOS_ID, end_ids=end_ids,
        temperature=rows["temperature"], top_k=rows["top_k"], top_p=rows["top_p"],
        row_limits=rows["max_tokens"], logits_processor=processor, forced=forced,
        row_processor=decoding.chain_processors(
            repetition,
            decoding.openai_penalties_processor(
                rows["presence_penalty"], rows["frequency_penalty"], rows["bias_ids"],
                rows["bias_values"]),
            decoding.min_tokens_processor(rows["min_tokens"], tokenizer_lib.EOS_ID, end_ids)))
    step, finished, ids, _, logprobs = decoding.sampling_progress(state)
    return (state, context, forced_firsts, prompts), {
        "step": jnp.broadcast_to(step, finished.shape), "finished": finished, "ids": ids,
        "logprobs": logprobs}

  return advance


def so_far(progress: dict[str, np.ndarray], i: int, max_tokens: int
            ) -> tuple[np.ndarray, np.ndarray]:
  """Row i's tokens decoded so far (through its EOS, within its max_tokens), and their
  log-probabilities."""
  ids = progress["ids"][i, :min(int(progress["step"][i]), max_tokens)]
  ends = np.flatnonzero(ids == tokenizer_lib.EOS_ID)
  count = ends[0] + 1 if len(ends) else len(ids)
  return ids[:count], progress["logprobs"][i, :count]


def tell(row: Row, ids: np.ndarray, logprobs: np.ndarray) -> None:
  """Hands a streaming row its tokens; a listener's failure (a client gone) is not the
  batch's."""
  try:
    row.on_tokens(ids, logprobs)
  except Exception:  # pylint: disable=broad-except
    logging.exception("Handing a row its streamed tokens failed.")


def settings(rows: Sequence[Row], count: int) -> dict[str, np.ndarray]:
  """Per-row settings, padded to `count` rows with greedy one-token rows."""
  pad = count - len(rows)
  column = lambda values, dtype, fill: np.asarray(list(values) + [fill] * pad, dtype)
  return {
      "temperature": column((r.temperature for r in rows), np.float32, 0.0),
      "top_k": column((r.top_k for r in rows), np.int32, 0),
      "top_p": column((r.top_p for r in rows), np.float32, 1.0),
      "max_tokens": column((r.max_tokens for r in rows), np.int32, 1),
      "seed": column((r.seed % 2**31 for r in rows), np.int32, 0),
      "prompt_index": column((r.prompt_index for r in rows), np.int32, 0),
      "choice": column((r.choice for r in rows), np.int32, 0),
      "adapter": column((r.adapter for r in rows), np.int32, 0),
      "presence_penalty": column((r.presence_penalty for r in rows), np.float32, 0.0),
      "frequency_penalty": column((r.frequency_penalty for r in rows), np.float32, 0.0),
      "min_tokens": column((r.min_tokens for r in rows), np.int32, 0),
      "repetition_penalty": column((r.repetition_penalty or 0.0 for r in rows), np.float32, 0.0),
      **logit_biases(rows, count)}


def logit_biases(rows: Sequence[Row], count: int) -> dict[str, np.ndarray]:
  """Each row's logit_bias as LOGIT_BIAS_ENTRIES (id, bias) pairs, NO_TOKEN where none."""
  ids = np.full((count, LOGIT_BIAS_ENTRIES), decoding.NO_TOKEN, np.int32)
  biases = np.zeros((count, LOGIT_BIAS_ENTRIES), np.float32)
  for i, row in enumerate(rows):
    if row.logit_bias:
      ids[i, :len(row.logit_bias)] = list(row.logit_bias)
      biases[i, :len(row.logit_bias)] = list(row.logit_bias.values())
  return {"bias_ids": ids, "bias_values": biases}


def each_shape(every: list[tuple], shapes: Sequence[tuple] | None,
               progress: Callable[[int, int, tuple], None] | None,
               stop: threading.Event | None, compile_one: Callable[[tuple], None]) -> bool:
  """`compile_one` of each of `shapes` (default: `every` one), telling `progress` (index
  among `every`, their count, shape) before each; stops between shapes once `stop` is set.
  Returns whether it went through them all."""
  for shape in every if shapes is None else shapes:
    if stop is not None and stop.is_set():
      return False
    if progress:
      progress(every.index(shape), len(every), shape)
    compile_one(shape)
  return True


def logits_processor(decoding_config):
  """The checkpoint's logits processors (banned ids, min length, ...): they apply to every
  request, as they do in --mode predict; all but the repetition penalty, which
  `segment_function` applies first with each row's prompt (and each row's own, where a
  request sets one), and the forced EOS, which it forces at each row's own last position."""
  d = decoding_config
  return decoding.make_logits_processor(
      eos_id=tokenizer_lib.EOS_ID, end_ids=tuple(d.end_ids), min_length=d.min_length,
      banned_ids=tuple(d.banned_ids), no_repeat_ngram_size=d.no_repeat_ngram_size,
      forced_bos_id=d.forced_bos_id)


def row_keys(rows: dict) -> jax.Array:
  """Each row's sampling key, fold_in(fold_in(PRNGKey(seed), prompt_index), choice), derived
  in the decoding thread's program: a JAX call on the server's event loop would wait for the
  batch being decoded."""
  return jax.vmap(lambda seed, prompt, choice: jax.random.fold_in(
      jax.random.fold_in(jax.random.PRNGKey(seed), prompt), choice))(
          rows["seed"], rows["prompt_index"], rows["choice"])


def max_new_tokens(family, config) -> int:
  """The server's longest output: config.max_target_length, within the positions the model
  has after the longest prompt (a decoder-only model's prompt and output share them)."""
  longest_prompt = config.max_source_length if family.continues_prompt else 0
  room = config.model.max_len - longest_prompt
  if room < 1:
    raise ValueError(f"config.model.max_len={config.model.max_len} leaves no room to generate "
                     f"after a {longest_prompt}-token prompt: lower max_source_length.")
  return min(config.max_target_length, room)
