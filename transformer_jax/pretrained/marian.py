"""Marian / OPUS-MT (Hugging Face `model_type` marian).

BART's post-LN layout (bart.py's weight table) with sinusoidal positions in the [sin | cos]
halves layout, computed rather than stored, embeddings x sqrt(d_model) (`scale_embedding`),
SiLU, no embedding LayerNorm, tied output with `final_logits_bias`. Ids: eos 0, unk 1,
pad = vocab size - 1 = decoder start; generation bans the pad token.
"""

from __future__ import annotations

from transformer_jax.pretrained import bart
from transformer_jax.pretrained.mapping import Entry, config_value

MODEL_TYPES = ("marian",)
FAMILY = "encoder_decoder"
EMBEDDING_TENSOR, OUTPUT_TENSOR = bart.EMBEDDING_TENSOR, bart.OUTPUT_TENSOR


def model_fields(hf: dict, tied: bool) -> dict:
  """TransformerConfig fields of the checkpoint's config.json; `tied`: no lm_head of its own."""
  decoder_vocab = config_value(hf, "decoder_vocab_size", hf["vocab_size"])
  if decoder_vocab != hf["vocab_size"]:
    raise ValueError(f"decoder_vocab_size={decoder_vocab} differs from vocab_size="
                     f"{hf['vocab_size']}: Marian models with two vocabularies are not "
                     "supported.")
  fields = bart.common_fields(hf, tied)
  fields.update(pre_ln=False, final_norm=False, position_embedding="sinusoidal_halves",
                embedding_norm=False,
                share_embeddings=bool(config_value(hf, "share_encoder_decoder_embeddings", True)),
                bos_id=config_value(hf, "decoder_start_token_id", hf["pad_token_id"]))
  return fields


def special_ids(hf: dict) -> tuple[int, int]:
  """The checkpoint's (pad, eos) ids."""
  return hf["pad_token_id"], config_value(hf, "eos_token_id", 0)


def weight_table(hf: dict, fields: dict, names=None) -> list[Entry]:
  return bart.weight_table(hf, fields, names, learned_positions=False)
