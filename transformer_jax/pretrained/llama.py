"""Llama 2 / 3 / 3.1 / 3.2, TinyLlama, SmolLM / SmolLM2, Mistral, Qwen2 / Qwen2.5 and Qwen3
(Hugging Face `model_type` llama, mistral, qwen2, qwen3), as the decoder-only family.

Pre-norm RMSNorm blocks and a final RMSNorm (`model.norm`), rotary position embeddings in the
half-split layout over the whole head (`rope_theta`, with `rope_parameters` / `rope_scaling`
of type default, linear or llama3), grouped-query attention (`num_key_value_heads`), a head
size of its own where config.json gives `head_dim`, a SwiGLU feed-forward network (gate, up,
down), no embedding scale, the output tied to the embedding or its own `lm_head`. Biases:
Llama's and Qwen3's `attention_bias` (q, k, v and o) and Llama's `mlp_bias`; Qwen2's on q, k
and v only. Qwen3 RMS-normalises queries and keys per head (`q_norm`, `k_norm`) before RoPE.
Sliding windows are the model's own (`sliding_window`): Mistral's on every layer, Qwen2's and
Qwen3's (`use_sliding_window`) on the layers from `max_window_layers` on, or as config.json's
`layer_types` say.
Ids: no pad token (one is added, as for GPT-2), bos and eos from config.json (eos may be a
list: the first is the one this project ends sequences with).
"""

from __future__ import annotations

from typing import Collection

from transformer_jax.pretrained.mapping import (CAUSAL_LM_EMBEDDING, CAUSAL_LM_OUTPUT, GATED,
                                               SLIDING, Entry, Layer, activation,
                                               causal_lm_table, config_value, dense_entries,
                                               norm_entries, rope_fields, window_fields)

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
FAMILY = "decoder_only"
EMBEDDING_TENSOR, OUTPUT_TENSOR = CAUSAL_LM_EMBEDDING, CAUSAL_LM_OUTPUT
_QWEN = ("qwen2", "qwen3")


def _window(hf: dict) -> dict:
  """The sliding window and its layers, as transformers reads them: Mistral's on every layer
  (it ignores layer_types), Qwen's only with use_sliding_window, on config.json's layer_types
  or else the layers from max_window_layers on; Llama has none."""
  window, layers = config_value(hf, "sliding_window", None), hf["num_hidden_layers"]
  if hf["model_type"] == "llama" or (hf["model_type"] in _QWEN
                                     and not config_value(hf, "use_sliding_window", False)):
    window = None
  if hf["model_type"] == "mistral":
    return window_fields(window, [SLIDING] * layers)
  first = config_value(hf, "max_window_layers", layers)
  kinds = config_value(hf, "layer_types",
                       [SLIDING if i >= first else "full_attention" for i in range(layers)])
  return window_fields(window, kinds)


def model_fields(hf: dict, tied: bool) -> dict:
  """TransformerConfig fields of the checkpoint's config.json; `tied`: no lm_head of its own."""
  mlp_bias = bool(config_value(hf, "mlp_bias", False))
  if mlp_bias and not tied:
    raise ValueError("mlp_bias=true with an lm_head of its own is not supported")
  attention_bias = bool(config_value(hf, "attention_bias", False))
  heads = hf["num_attention_heads"]
  head_dim = config_value(hf, "head_dim", hf["hidden_size"] // heads)
  return dict(
      vocab_size=hf["vocab_size"] + 1,  # the added pad
      emb_dim=hf["hidden_size"], num_heads=heads,
      num_kv_heads=config_value(hf, "num_key_value_heads", heads), qkv_dim=heads * head_dim,
      mlp_dim=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
      num_decoder_layers=None, max_len=hf["max_position_embeddings"],
      dropout_rate=0.0, attention_dropout_rate=config_value(hf, "attention_dropout", 0.0),
      activation_dropout_rate=0.0, pre_ln=True, final_norm=True, norm="rmsnorm",
      layer_norm_epsilon=config_value(hf, "rms_norm_eps", 1e-6),
      ffn_activation=GATED[activation(hf, "hidden_act", "silu")],  # act(gate) * up
      use_bias=mlp_bias, qkv_bias=hf["model_type"] == "qwen2" or attention_bias,
      out_bias=attention_bias, qk_norm=hf["model_type"] == "qwen3",
      scale_attention_scores=True, position_embedding="rope", **rope_fields(hf), **_window(hf),
      scale_embeddings=False, embedding_norm=False, share_embeddings=True, tie_output=tied,
      output_rescale=False, logits_bias=False, mask_padding_logit=True,
      bos_id=config_value(hf, "bos_token_id", special_ids(hf)[1]))


def special_ids(hf: dict) -> tuple[None, int]:
  """The checkpoint's (pad, eos) ids: no pad (one is added; a pad_token_id in config.json is
  left to the tokenizer), the first of a list of end ids."""
  eos = config_value(hf, "eos_token_id", 2)
  return None, eos[0] if isinstance(eos, list) else eos


def weight_table(hf: dict, fields: dict, names: Collection[str] | None = None) -> list[Entry]:
  """Every parameter of our DecoderOnly and the checkpoint tensors it comes from
  (`names` unused: *ForCausalLM's layout; an untied model's lm_head where it has one)."""
  del hf, names

  def feed_forward(layer: Layer, hf_layer: str) -> list[Entry]:
    table = []
    for ours, theirs in (("wi_gate", "gate_proj"), ("wi", "up_proj"), ("wo", "down_proj")):
      table += dense_entries(layer.ffn(ours), f"{hf_layer}.mlp.{theirs}", bias=fields["use_bias"])
    return table + norm_entries(layer.ffn_norm(), f"{hf_layer}.post_attention_layernorm",
                                bias=False)

  return causal_lm_table(fields, feed_forward)


def complete_config(hf: dict, folder: str) -> dict:
  """config.json with the tokenizer's end token first among its end ids: Llama 3 Instruct
  lists <|end_of_text|> first, while its tokenizer (and chat template) ends a turn with
  <|eot_id|>, the id this project ends sequences with (the others end decoding too)."""
  ends = config_value(hf, "eos_token_id", None)
  if not isinstance(ends, list) or len(ends) < 2:
    return hf
  import transformers  # pylint: disable=g-import-not-at-top
  try:
    eos = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True).eos_token_id
  except Exception:  # pylint: disable=broad-except
    return hf  # the tokenizer's own check reports what is wrong with its files
  if eos not in ends[1:]:
    return hf
  return dict(hf, eos_token_id=[eos] + [i for i in ends if i != eos])
