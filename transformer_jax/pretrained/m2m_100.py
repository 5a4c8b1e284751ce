"""M2M100 and the dense NLLB-200 checkpoints (Hugging Face `model_type` m2m_100).

mBART's pre-LN layout with a final LayerNorm per stack (bart.py's weight table), but no
LayerNorm over the embeddings and no `final_logits_bias`; embeddings x sqrt(d_model)
(`scale_embedding`); ReLU; sinusoidal positions computed, not stored, in tensor2tensor's
[sin | cos] layout, numbered from 2 over non-pad tokens only (layers.sinusoidal_positions_t2t).
Ids: bos 0, pad 1, eos 2 = decoder start. Sentences carry language codes (`__en__`, `eng_Latn`):
see pretrained/languages.py.
"""

from __future__ import annotations

from transformer_jax.pretrained import bart
from transformer_jax.pretrained.mapping import Entry, activation, config_value

MODEL_TYPES = ("m2m_100",)
FAMILY = "encoder_decoder"
EMBEDDING_TENSOR, OUTPUT_TENSOR = bart.EMBEDDING_TENSOR, bart.OUTPUT_TENSOR


def model_fields(hf: dict, tied: bool) -> dict:
  """TransformerConfig fields of the checkpoint's config.json; `tied`: no lm_head of its own."""
  if config_value(hf, "pad_token_id", 1) != 1:
    # The position table numbers positions from padding_idx + 1, fixed at 2 here.
    raise ValueError(f"pad_token_id={hf['pad_token_id']} in config.json: m2m_100 checkpoints "
                     "with a pad other than 1 are not supported.")
  if not tied:
    raise ValueError("config.json unties lm_head from the embedding (tie_word_embeddings="
                     "false): m2m_100 checkpoints with an output layer of their own are not "
                     "supported.")
  fields = bart.common_fields(hf, tied)
  fields.update(pre_ln=True, final_norm=True, position_embedding="sinusoidal_t2t",
                embedding_norm=False, share_embeddings=True, logits_bias=False,
                ffn_activation=activation(hf, "activation_function", "relu"),
                scale_embeddings=bool(config_value(hf, "scale_embedding", True)),
                bos_id=config_value(hf, "decoder_start_token_id", 2))
  return fields


def special_ids(hf: dict) -> tuple[int, int]:
  """The checkpoint's (pad, eos) ids."""
  return config_value(hf, "pad_token_id", 1), config_value(hf, "eos_token_id", 2)


def weight_table(hf: dict, fields: dict, names=None) -> list[Entry]:
  # bart's table without stored positions; tied and bias-free, it names no final_logits_bias.
  return bart.weight_table(hf, fields, names, learned_positions=False)
