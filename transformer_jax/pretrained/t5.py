"""T5 v1.0, T5 v1.1 / Flan-T5, mT5 and UMT5 (Hugging Face `model_type` t5, mt5, umt5).

Pre-norm RMSNorm blocks without biases, unscaled attention scores, a relative position bias
(bidirectional in the encoder, causal in the decoder; in the first layer and shared by the
stack, or in every layer for UMT5), ReLU or gated-GELU (tanh) feed-forward, one embedding
for both sides. Ids: pad 0 = decoder start, eos 1 (this project's own convention).
"""

from __future__ import annotations

from transformer_jax.pretrained.mapping import (ACTIVATIONS, GATED, Entry, Layer,
                                               attention_entries, config_value, dense_entries,
                                               norm_entries)

MODEL_TYPES = ("t5", "mt5", "umt5")
FAMILY = "encoder_decoder"
EMBEDDING_TENSOR, OUTPUT_TENSOR = "shared.weight", "lm_head.weight"
_ATTENTION = dict(q="q", k="k", v="v", o="o")


def _activation(hf: dict) -> str:
  proj = hf.get("feed_forward_proj", "relu")
  gated = proj.startswith("gated-")
  name = proj.removeprefix("gated-")
  if gated and name == "gelu":
    name = "gelu_new"  # transformers' own rule: "gated-gelu" is the tanh approximation
  if name not in ACTIVATIONS:
    raise ValueError(f"feed_forward_proj={proj!r} is not supported; supported: "
                     f"{sorted(ACTIVATIONS)} and their 'gated-' forms.")
  return GATED[ACTIVATIONS[name]] if gated else ACTIVATIONS[name]


def _output_rescale(hf: dict) -> bool:
  """Whether decoder states are multiplied by d_model^-0.5 before the output layer: T5
  records it (`scale_decoder_outputs`, formerly `tie_word_embeddings`); mT5 never does; UMT5
  does when its config ties the embeddings (as the original models and transformers 4 do:
  google/umt5-* say false; transformers 5 forces true, and writes true)."""
  if hf["model_type"] == "mt5":
    return False
  if hf["model_type"] == "umt5":
    return hf.get("tie_word_embeddings") is not False
  return config_value(hf, "scale_decoder_outputs", hf.get("tie_word_embeddings") is not False)


def model_fields(hf: dict, tied: bool) -> dict:
  """TransformerConfig fields of the checkpoint's config.json; `tied`: no lm_head of its own."""
  dropout = config_value(hf, "dropout_rate", 0.1)
  return dict(
      vocab_size=hf["vocab_size"], emb_dim=hf["d_model"], num_heads=hf["num_heads"],
      qkv_dim=hf["num_heads"] * hf["d_kv"], mlp_dim=hf["d_ff"], num_layers=hf["num_layers"],
      num_decoder_layers=config_value(hf, "num_decoder_layers", hf["num_layers"]),
      dropout_rate=dropout, attention_dropout_rate=dropout, activation_dropout_rate=dropout,
      pre_ln=True, final_norm=True, norm="rmsnorm",
      layer_norm_epsilon=config_value(hf, "layer_norm_epsilon", 1e-6),
      ffn_activation=_activation(hf),
      use_bias=False, scale_attention_scores=False, position_embedding="relative",
      relative_attention_num_buckets=config_value(hf, "relative_attention_num_buckets", 32),
      relative_attention_max_distance=config_value(hf, "relative_attention_max_distance", 128),
      relative_bias_per_layer=hf["model_type"] == "umt5", scale_embeddings=False,
      embedding_norm=False, share_embeddings=True, tie_output=tied,
      output_rescale=_output_rescale(hf), logits_bias=False,
      bos_id=config_value(hf, "decoder_start_token_id", config_value(hf, "pad_token_id", 0)))


def special_ids(hf: dict) -> tuple[int, int]:
  """The checkpoint's (pad, eos) ids."""
  eos = config_value(hf, "eos_token_id", 1)
  return config_value(hf, "pad_token_id", 0), eos[0] if isinstance(eos, list) else eos


def weight_table(hf: dict, fields: dict, names=None) -> list[Entry]:
  """Every parameter of our EncoderDecoder and the checkpoint tensors it comes from (one
  layout whatever the checkpoint's tensor `names`)."""
  del names
  gated = fields["ffn_activation"] in GATED.values()
  per_layer = fields["relative_bias_per_layer"]
  table = [Entry(("shared_embedding", "embedding", "embedding"), ("shared.weight",),
                 "vocab_rows")]
  for stack, num_layers in (("encoder", fields["num_layers"]),
                            ("decoder", fields["num_decoder_layers"])):
    for i in range(num_layers):
      layer, hf_block = Layer(stack, i), f"{stack}.block.{i}.layer"
      blocks = [("self", "SelfAttention")]
      if stack == "decoder":
        blocks.append(("cross", "EncDecAttention"))
      for j, (kind, hf_name) in enumerate(blocks):
        table += attention_entries(layer.attention(kind), f"{hf_block}.{j}.{hf_name}",
                                   _ATTENTION, self_attention=kind == "self", bias=False)
        table += norm_entries(layer.attention_norm(kind), f"{hf_block}.{j}.layer_norm",
                              bias=False)
      hf_ffn = f"{hf_block}.{len(blocks)}.DenseReluDense"
      if gated:
        table += dense_entries(layer.ffn("wi_gate"), f"{hf_ffn}.wi_0", bias=False)
        table += dense_entries(layer.ffn("wi"), f"{hf_ffn}.wi_1", bias=False)
      else:
        table += dense_entries(layer.ffn("wi"), f"{hf_ffn}.wi", bias=False)
      table += dense_entries(layer.ffn("wo"), f"{hf_ffn}.wo", bias=False)
      table += norm_entries(layer.ffn_norm(), f"{hf_block}.{len(blocks)}.layer_norm",
                            bias=False)
      if i == 0 or per_layer:
        table.append(Entry((stack, f"relative_bias_{i}" if per_layer else "relative_bias",
                            "embedding"),
                           (f"{hf_block}.0.SelfAttention.relative_attention_bias.weight",)))
    table += norm_entries((stack, "final_norm"), f"{stack}.final_layer_norm", bias=False)
  if not fields["tie_output"]:
    table.append(Entry(("logits_dense", "kernel"), ("lm_head.weight",), "vocab_dense"))
  return table
