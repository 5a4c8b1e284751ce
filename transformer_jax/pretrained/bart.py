"""BART and mBART (Hugging Face `model_type` bart, mbart).

Post-LN (BART) or pre-LN with a final LayerNorm per stack (mBART) blocks with biases,
learned positions stored two rows late, a LayerNorm over the embeddings (`layernorm_embedding`),
GELU (erf), tied output with `final_logits_bias`. Ids: bos 0, pad 1, eos 2 = decoder start
(mBART configs without a decoder_start_token_id start from bos, as transformers does).
marian.py reuses this weight table.
"""

from __future__ import annotations

from transformer_jax.pretrained.mapping import (Entry, Layer, activation, attention_entries,
                                               config_value, dense_entries, norm_entries)

MODEL_TYPES = ("bart", "mbart")
FAMILY = "encoder_decoder"
EMBEDDING_TENSOR, OUTPUT_TENSOR = "model.shared.weight", "lm_head.weight"
POSITION_OFFSET = 2  # BartLearnedPositionalEmbedding reads row position + 2
_ATTENTION = dict(q="q_proj", k="k_proj", v="v_proj", o="out_proj")


def common_fields(hf: dict, tied: bool) -> dict:
  """The fields BART-like configs (BART, mBART, Marian) name alike."""
  for encoder_key, decoder_key in (("encoder_attention_heads", "decoder_attention_heads"),
                                   ("encoder_ffn_dim", "decoder_ffn_dim")):
    if hf.get(decoder_key, hf[encoder_key]) != hf[encoder_key]:
      raise ValueError(f"{encoder_key} != {decoder_key} in config.json: encoders and decoders "
                       "of different widths are not supported.")
  ffn_activation = activation(hf, "activation_function", "gelu")
  return dict(
      vocab_size=hf["vocab_size"], emb_dim=hf["d_model"],
      num_heads=hf["encoder_attention_heads"], qkv_dim=hf["d_model"],
      mlp_dim=hf["encoder_ffn_dim"], num_layers=hf["encoder_layers"],
      num_decoder_layers=hf["decoder_layers"], max_len=hf["max_position_embeddings"],
      dropout_rate=config_value(hf, "dropout", 0.1),
      attention_dropout_rate=config_value(hf, "attention_dropout", 0.0),
      activation_dropout_rate=config_value(hf, "activation_dropout", 0.0),
      norm="layernorm", layer_norm_epsilon=1e-5, ffn_activation=ffn_activation,
      use_bias=True, scale_attention_scores=True, position_base=10000.0,
      scale_embeddings=bool(config_value(hf, "scale_embedding", False)), tie_output=tied,
      output_rescale=False, logits_bias=True, bos_id=decoder_start(hf))


def decoder_start(hf: dict) -> int:
  """The first decoder input, `decoder_start_token_id`, else what transformers fills in: BART's
  default (eos 2), and for mBART, whose configs may have none, the bos token that `generate`
  falls back to."""
  default = 2 if hf["model_type"] == "bart" else config_value(hf, "bos_token_id", 0)
  return config_value(hf, "decoder_start_token_id", default)


def model_fields(hf: dict, tied: bool) -> dict:
  """TransformerConfig fields of the checkpoint's config.json; `tied`: no lm_head of its own."""
  mbart = hf["model_type"] == "mbart"
  return dict(common_fields(hf, tied), pre_ln=mbart, final_norm=mbart,
              position_embedding="learned", embedding_norm=True, share_embeddings=True)


def special_ids(hf: dict) -> tuple[int, int]:
  """The checkpoint's (pad, eos) ids."""
  return config_value(hf, "pad_token_id", 1), config_value(hf, "eos_token_id", 2)


def weight_table(hf: dict, fields: dict, names=None, *,
                 learned_positions: bool = True) -> list[Entry]:
  """Every parameter of our EncoderDecoder and the checkpoint tensors it comes from (one
  layout whatever the checkpoint's tensor `names`)."""
  del hf, names
  if fields["share_embeddings"]:
    table = [Entry(("shared_embedding", "embedding", "embedding"), (EMBEDDING_TENSOR,),
                   "vocab_rows")]
  else:
    table = [Entry((f"{ours}_embedding", "embedding", "embedding"),
                   (f"model.{stack}.embed_tokens.weight",), "vocab_rows")
             for ours, stack in (("source", "encoder"), ("target", "decoder"))]
  for stack, num_layers in (("encoder", fields["num_layers"]),
                            ("decoder", fields["num_decoder_layers"])):
    hf_stack = f"model.{stack}"
    if learned_positions:
      table.append(Entry((f"{stack}_positions", "pos_embedding"),
                         (f"{hf_stack}.embed_positions.weight",), "offset_rows",
                         POSITION_OFFSET))
    if fields["embedding_norm"]:
      table += norm_entries((f"{stack}_embedding_norm",), f"{hf_stack}.layernorm_embedding",
                            bias=True)
    for i in range(num_layers):
      layer, hf_layer = Layer(stack, i), f"{hf_stack}.layers.{i}"
      blocks = [("self", "self_attn")]
      if stack == "decoder":
        blocks.append(("cross", "encoder_attn"))
      for kind, hf_name in blocks:
        table += attention_entries(layer.attention(kind), f"{hf_layer}.{hf_name}", _ATTENTION,
                                   self_attention=kind == "self", bias=True)
        table += norm_entries(layer.attention_norm(kind), f"{hf_layer}.{hf_name}_layer_norm",
                              bias=True)
      table += dense_entries(layer.ffn("wi"), f"{hf_layer}.fc1", bias=True)
      table += dense_entries(layer.ffn("wo"), f"{hf_layer}.fc2", bias=True)
      table += norm_entries(layer.ffn_norm(), f"{hf_layer}.final_layer_norm", bias=True)
    if fields["final_norm"]:
      table += norm_entries((stack, "final_norm"), f"{hf_stack}.layer_norm", bias=True)
  if fields["tie_output"]:
    if fields["logits_bias"]:  # M2M100 has none
      table.append(Entry(("logits_bias",), ("final_logits_bias",), "vocab_bias"))
  else:
    table.append(Entry(("logits_dense", "kernel"), (OUTPUT_TENSOR,), "vocab_dense"))
    table.append(Entry(("logits_dense", "bias"), ("final_logits_bias",), "vocab_bias"))
  return table
