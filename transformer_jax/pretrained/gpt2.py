"""GPT-2 (Hugging Face `model_type` gpt2), as the decoder-only family.

Pre-LN blocks with biases and a final LayerNorm (`ln_f`), learned positions, tanh GELU
(`gelu_new`), the output tied to the token embedding. Its projections are Conv1D modules whose
weights are stored [in, out] (not torch Linear's [out, in]), q, k and v fused in `c_attn`.
Ids: `<|endoftext|>` (50256) is bos and eos alike, and there is no pad token: the import adds
one past the vocabulary (vocab.py), whose logit the model masks (`mask_padding_logit`).
"""

from __future__ import annotations

from typing import Collection

from transformer_jax.pretrained.mapping import Entry, Layer, activation, config_value, norm_entries

MODEL_TYPES = ("gpt2",)
FAMILY = "decoder_only"
EMBEDDING_TENSOR, OUTPUT_TENSOR = "transformer.wte.weight", "lm_head.weight"


def model_fields(hf: dict, tied: bool) -> dict:
  """TransformerConfig fields of the checkpoint's config.json; `tied`: no lm_head of its own."""
  if not tied:
    raise ValueError("its lm_head differs from the token embedding: untied GPT-2 models are "
                     "not supported")
  if hf.get("scale_attn_by_inverse_layer_idx"):
    raise ValueError("scale_attn_by_inverse_layer_idx=true is not supported")
  if not config_value(hf, "scale_attn_weights", True):
    raise ValueError("scale_attn_weights=false is not supported")
  ffn_activation = activation(hf, "activation_function", "gelu_new")
  width = hf["n_embd"]
  return dict(
      vocab_size=hf["vocab_size"] + 1,  # the added pad
      emb_dim=width, num_heads=hf["n_head"], qkv_dim=width,
      mlp_dim=config_value(hf, "n_inner", 4 * width), num_layers=hf["n_layer"],
      num_decoder_layers=None, max_len=hf["n_positions"],
      dropout_rate=config_value(hf, "resid_pdrop", 0.1),
      attention_dropout_rate=config_value(hf, "attn_pdrop", 0.1), activation_dropout_rate=0.0,
      pre_ln=True, final_norm=True, norm="layernorm",
      layer_norm_epsilon=config_value(hf, "layer_norm_epsilon", 1e-5),
      ffn_activation=ffn_activation, use_bias=True, scale_attention_scores=True,
      position_embedding="learned", scale_embeddings=False, embedding_norm=False,
      share_embeddings=True, tie_output=True, output_rescale=False, logits_bias=False,
      mask_padding_logit=True, bos_id=config_value(hf, "bos_token_id", 50256))


def special_ids(hf: dict) -> tuple[None, int]:
  """The checkpoint's (pad, eos) ids: no pad (one is added)."""
  return None, config_value(hf, "eos_token_id", 50256)


def weight_table(hf: dict, fields: dict, names: Collection[str] | None = None) -> list[Entry]:
  """Every parameter of our DecoderOnly and the checkpoint tensors it comes from (`names`:
  the checkpoint's tensors, 'transformer.'-prefixed in GPT2LMHeadModel, not in GPT2Model;
  None: GPT2LMHeadModel's, as export writes)."""
  del hf
  prefix = "" if names is not None and "wte.weight" in names else "transformer."
  table = [Entry(("embedding", "embedding", "embedding"), (f"{prefix}wte.weight",),
                 "vocab_rows"),
           Entry(("positions", "pos_embedding"), (f"{prefix}wpe.weight",))]
  for i in range(fields["num_layers"]):
    layer, hf_layer = Layer("decoder", i), f"{prefix}h.{i}"
    attention = layer.attention()
    table += [
        Entry(attention + ("qkv", "kernel"), (f"{hf_layer}.attn.c_attn.weight",), "fused_in"),
        Entry(attention + ("qkv", "bias"), (f"{hf_layer}.attn.c_attn.bias",), "fused_bias"),
        Entry(attention + ("out", "kernel"), (f"{hf_layer}.attn.c_proj.weight",), "fused_out"),
        Entry(attention + ("out", "bias"), (f"{hf_layer}.attn.c_proj.bias",))]
    table += norm_entries(layer.attention_norm(), f"{hf_layer}.ln_1", bias=True)
    for ours_name, hf_name in (("wi", "c_fc"), ("wo", "c_proj")):  # Conv1D: already [in, out]
      table += [Entry(layer.ffn(ours_name) + ("kernel",), (f"{hf_layer}.mlp.{hf_name}.weight",)),
                Entry(layer.ffn(ours_name) + ("bias",), (f"{hf_layer}.mlp.{hf_name}.bias",))]
    table += norm_entries(layer.ffn_norm(), f"{hf_layer}.ln_2", bias=True)
  table += norm_entries(("decoder", "final_norm"), f"{prefix}ln_f", bias=True)
  return table
