"""Streaming in `--mode serve`, in process: a batch decoded in segments of serve.stream_steps
tokens gives `decoding.sample`'s outputs from one compiled call, hands streaming rows their
tokens while it decodes; TextStream's pieces add up to the non-streamed text."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import hf_fixtures
from transformer_jax import config_validation
from transformer_jax import default_config
from transformer_jax import predict
from transformer_jax import tokenizer as tokenizer_lib
from transformer_jax.inference import decoding
from transformer_jax.inference import generate
from transformer_jax.serving import batch_decoder
from transformer_jax.serving import texts

TEXTS = ["a man is riding a bike", "two dogs", "a woman walks in the snow", "people"]


def _predictor(kind, folder):
  config = default_config.get_config()
  config.max_source_length, config.max_target_length = 16, 12
  return predict.Predictor.from_pretrained(hf_fixtures.tiny_model(kind, folder), config)


def _rows(predictor):
  """Greedy and sampled rows with their own settings (OpenAI's penalties too) and limits."""
  prompts = [np.asarray(predictor.family.prompt(predictor.tokenizer.encode(t))) for t in TEXTS]
  penalties = [dict(min_tokens=6, logit_bias={1: 3.0}), {},
               dict(frequency_penalty=0.8, logit_bias={40: 2.0}),
               dict(presence_penalty=-1.0, frequency_penalty=-0.5)]
  return [batch_decoder.Row(p, 12 - i, [0.0, 1.0, 0.7, 0.0][i], [0, 5, 0, 0][i],
                            [1.0, 0.9, 1.0, 1.0][i], 7, i, 0, **penalties[i])
          for i, p in enumerate(prompts)]


def _one_call(decoder, rows):
  """The rows decoded as the server decoded them before streaming: prefill and the whole
  `decoding.sample` loop in one compiled call. A forced EOS (BART's forced_eos_token_id) falls
  on each row's own last position, as `--mode predict` with max_decode_len = the row's
  max_tokens forces it."""
  d, family, length = decoder.predictor.config.decoding, decoder.family, decoder.max_new_tokens
  processor = decoding.make_logits_processor(
      eos_id=tokenizer_lib.EOS_ID, end_ids=tuple(d.end_ids), min_length=d.min_length,
      banned_ids=tuple(d.banned_ids), no_repeat_ngram_size=d.no_repeat_ngram_size,
      forced_bos_id=d.forced_bos_id)

  def decode(params, prompts, settings):
    # Each row's repetition penalty (a decoder-only prompt's tokens counted), penalties,
    # logit_bias and min_tokens first, as the server's segments apply them.
    repeats = jnp.where(settings["repetition_penalty"] > 0, settings["repetition_penalty"],
                        d.repetition_penalty)
    penalties = decoding.chain_processors(
        decoding.repetition_penalty_processor(
            repeats, prompts if family.continues_prompt else None),
        decoding.openai_penalties_processor(
            settings["presence_penalty"], settings["frequency_penalty"], settings["bias_ids"],
            settings["bias_values"]),
        decoding.min_tokens_processor(settings["min_tokens"], tokenizer_lib.EOS_ID,
                                      tuple(d.end_ids)))
    last = None
    if d.forced_eos:
      eos = jnp.arange(family.model_config.vocab_size) == tokenizer_lib.EOS_ID
      last = lambda logits, step, sequences: jnp.where(
          (step == settings["max_tokens"] - 1)[:, None], jnp.where(eos, 0.0, -1e10), logits)
    row_processor = decoding.chain_processors(penalties, processor, last)
    cache, tokens_to_logits, start_id = family.runner.start_decoding(params, prompts,
                                                              prompts.shape[0], length)
    keys = jax.vmap(lambda seed, prompt, choice: jax.random.fold_in(
        jax.random.fold_in(jax.random.PRNGKey(seed), prompt), choice))(
            settings["seed"], settings["prompt_index"], settings["choice"])
    return decoding.sample(
        cache, tokens_to_logits, keys, batch_size=prompts.shape[0], bos_id=start_id,
        eos_id=tokenizer_lib.EOS_ID, end_ids=tuple(d.end_ids), max_decode_len=length,
        temperature=settings["temperature"], top_k=settings["top_k"], top_p=settings["top_p"],
        row_limits=settings["max_tokens"], return_token_logprobs=True,
        logits_processor=row_processor)

  layout = decoder.layout
  width = generate.bucket_length(max(len(r.prompt) for r in rows), decoder.max_source_length)
  prompts = np.zeros((len(rows), width), np.int32)
  for i, row in enumerate(rows):
    prompts[i, :len(row.prompt)] = row.prompt
  settings = batch_decoder.settings(rows, len(rows))
  ids, logprobs = layout.host_rows(layout.compile_decode(decode)(
      decoder.predictor.device_params, layout.eval_batch(prompts), layout.eval_batch(settings)))
  return [(ids[i, :r.max_tokens], logprobs[i, :r.max_tokens]) for i, r in enumerate(rows)]


@pytest.mark.parametrize("kind", ["llama", "bart"])
def test_segments_equal_one_call_and_stream_while_decoding(kind, tmp_path):
  predictor = _predictor(kind, str(tmp_path))
  decoder = batch_decoder.BatchDecoder(predictor, 4, stream_steps=3)
  rows = _rows(predictor)
  told = []  # (tokens so far, whether decode() had returned) at each call
  returned = [False]
  rows[1].on_tokens = lambda ids, logprobs: told.append((ids.copy(), returned[0]))
  outputs = decoder.decode(rows)
  returned[0] = True
  expected = _one_call(decoder, rows)
  for output, (ids, logprobs) in zip(outputs, expected):
    np.testing.assert_array_equal(output.ids, ids)
    if kind == "llama":  # decoder-only: bit-identical
      np.testing.assert_array_equal(output.logprobs, logprobs)
    else:  # the encoder's keys reach the loop as an argument: float32 rounding apart
      np.testing.assert_allclose(output.logprobs, logprobs, atol=1e-5)
  # The streaming row (11 tokens, no EOS: untrained) got 3 more tokens per segment, the last
  # 2, each time a prefix of its output, all before the batch's decode returned.
  assert [len(ids) for ids, _ in told] == [3, 6, 9, 11]
  assert all(np.array_equal(ids, outputs[1].ids[:len(ids)]) and not done for ids, done in told)


@pytest.fixture(scope="module")
def llama_tokenizer(tmp_path_factory):
  folder = str(tmp_path_factory.mktemp("tokenizer"))
  return predict.Predictor.from_pretrained(hf_fixtures.tiny_model("llama", folder)).tokenizer


@pytest.mark.parametrize("stop", [(), ("wö",), ("日本", "b"), ("ünï",), ("d, ü",)])
def test_text_stream_pieces_add_up_to_the_completion(llama_tokenizer, stop):
  tokenizer = llama_tokenizer
  ids = tokenizer.encode("héllo wörld, ünïcödé ✓ 日本語 ok")  # multi-byte characters
  assert "\ufffd" in "".join(tokenizer.decode(ids[:n]) for n in range(len(ids)))  # cut ones
  logprobs = -np.arange(len(ids), dtype=np.float32)
  expected = texts.completion(tokenizer, np.asarray(ids), logprobs, len(ids) + 1, stop)
  for step in (1, 2, 3):
    stream = texts.TextStream(tokenizer, len(ids) + 1, stop)
    pieces = [stream.update(ids[:n], logprobs[:n]) for n in range(step, len(ids), step)]
    # A stop string ends the stream once it is seen, before the output's last token.
    assert bool(stream.done) == bool(stop)
    pieces.append(stream.finish(np.asarray(ids), logprobs))
    assert "".join(pieces) == expected.text
    assert not any(p.endswith("\ufffd") for p in pieces)
    assert sum(bool(p) for p in pieces) > 1
    assert (stream.done.token_ids, stream.done.finish_reason) == (
        expected.token_ids, expected.finish_reason)
    assert expected.finish_reason == ("stop" if stop else "length")


@pytest.mark.parametrize("key, value, expected", [("stream_steps", 0, ">= 1"),
                                                   ("log_stats_s", -1.0, ">= 0")])
def test_bad_serve_settings_are_one_line_errors(key, value, expected):
  config = default_config.get_config()
  config.serve[key] = value
  with pytest.raises(config_validation.ConfigError) as raised:
    config_validation.validate(config)
  assert f"config.serve.{key}={value} must be {expected}" in str(raised.value)
  assert "\n" not in str(raised.value)
