"""A checkpoint's generation_config.json as `config.decoding` settings.

Hugging Face counts the decoder start token in an encoder-decoder's `max_length` and
`min_length`; this project counts output tokens only (EOS included), hence the - 1s. A
decoder-only model's `max_length` counts its prompt: it becomes `decoding.max_total_len`, which
leaves each prompt what its own length leaves it (`max_new_tokens`, where set, wins, as in
`generate`). Token ids are renumbered through the checkpoint's VocabMap.
"""

from __future__ import annotations

from absl import logging

from transformer_jax.pretrained import vocab as vocab_lib


def decoding_settings(generation_config: dict, vocab: vocab_lib.VocabMap,
                      max_len: int, counts_prompt: bool = False) -> dict:
  """config.decoding keys and values that `generation_config` sets (the rest keep theirs).
  Where max_length and min_length `counts_prompt` (a decoder-only model's), max_length is the
  prompt's and the output's (max_total_len) and min_length is not applied."""
  g = {k: v for k, v in generation_config.items() if v is not None}
  settings = {}
  if g.get("do_sample"):  # transformers' defaults where the file is silent (top_k 50)
    settings.update(method="sample", temperature=float(g.get("temperature", 1.0)),
                    top_k=int(g.get("top_k", 50)), top_p=float(g.get("top_p", 1.0)))
  elif g.get("num_beams", 1) > 1:
    settings.update(method="beam", beam_size=int(g["num_beams"]), length_penalty="hf",
                    alpha=float(g.get("length_penalty", 1.0)))
  else:
    settings.update(method="greedy")
  if "max_new_tokens" in g:
    settings["max_decode_len"] = min(int(g["max_new_tokens"]), max_len)
  elif "max_length" in g and counts_prompt:
    settings["max_total_len"] = int(g["max_length"])
  elif "max_length" in g:
    settings["max_decode_len"] = min(int(g["max_length"]) - 1, max_len)
  if g.get("min_length", 0) > 1 and not counts_prompt:
    settings["min_length"] = int(g["min_length"]) - 1
  if "forced_bos_token_id" in g:
    settings["forced_bos_id"] = int(vocab.internal(g["forced_bos_token_id"]))
  ends = g.get("eos_token_id")
  if isinstance(ends, list) and len(ends) > 1:  # one of them is the model's EOS (internal 1)
    settings["end_ids"] = tuple(sorted({int(vocab.internal(i)) for i in ends} - {1}))
  if "forced_eos_token_id" in g:
    settings["forced_eos"] = True
  if g.get("no_repeat_ngram_size", 0) > 0:
    settings["no_repeat_ngram_size"] = int(g["no_repeat_ngram_size"])
  if g.get("repetition_penalty", 1.0) != 1.0:
    settings["repetition_penalty"] = float(g["repetition_penalty"])
  banned = []
  for ids in g.get("bad_words_ids") or []:
    if len(ids) == 1:
      banned.append(int(vocab.internal(ids[0])))
    else:
      logging.warning("bad_words_ids entry %s (several tokens) is not applied: only single "
                      "banned tokens are supported.", ids)
  if banned:
    settings["banned_ids"] = tuple(banned)
  return settings
