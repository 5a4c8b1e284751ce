"""Gemma, Gemma 2 and Gemma 3's text model (Hugging Face `model_type` gemma, gemma2,
gemma3_text), as the decoder-only family.

What every Gemma has: pre-norm RMSNorm blocks whose norms scale by (1 + weight) (weights
stored around 0; `norm_plus_one`), token embeddings times sqrt(hidden_size), that factor
rounded to the model's dtype first (`embedding_scale_in_dtype`), a GeGLU feed-forward network
with the tanh GELU (gate, up, down), rotary embeddings, grouped-query attention with a head
size of its own (`head_dim`), no biases but the optional `attention_bias` (q, k, v and o), the
output tied to the embedding.

Gemma 2 adds a norm after each sublayer (post_attention_layernorm, post_feedforward_layernorm;
the feed-forward network's pre-norm is pre_feedforward_layernorm: `post_sublayer_norm`),
scores scaled by query_pre_attn_scalar^-0.5 and soft-capped (attn_logit_softcapping), final
logits soft-capped (final_logit_softcapping), and a sliding window on alternate layers (the
first, third, ...: `layer_types`). Gemma 3 keeps all that but the attention soft cap (its
config.json may name one; transformers never applies it, so neither does this import), adds
per-head query and key norms (`qk_norm`), windows 5 layers of every 6 (`layer_types`, or the
older `sliding_window_pattern`) and rotates them with a base of their own
(`rope_local_base_freq`, or transformers 5's rope_parameters keyed by layer type).

Ids: Gemma's own pad (0), eos (1; the first of a list) and bos (2), so the vocabulary keeps
its order; a config.json without a pad gets one added, as for Llama.
"""

from __future__ import annotations

from typing import Collection

from transformer_jax.pretrained.mapping import (CAUSAL_LM_EMBEDDING, CAUSAL_LM_OUTPUT, GATED,
                                               SLIDING, Entry, Layer, activation,
                                               causal_lm_table, config_value, dense_entries,
                                               norm_entries, rope_fields, window_fields)

MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
FAMILY = "decoder_only"
EMBEDDING_TENSOR, OUTPUT_TENSOR = CAUSAL_LM_EMBEDDING, CAUSAL_LM_OUTPUT
# transformers' defaults where config.json leaves a key out (a null in it means "none").
_FINAL_SOFTCAP = {"gemma2": 30.0, "gemma3_text": None}
_WINDOW_PERIOD = {"gemma2": 2, "gemma3_text": 6}  # every n-th layer is global


def _activation(hf: dict) -> str:
  """Gemma's MLP activation: `hidden_act` (whose legacy "gelu" transformers reads as the tanh
  GELU); Gemma 2 / 3 read `hidden_activation`."""
  if hf["model_type"] != "gemma":
    return activation(hf, "hidden_activation", "gelu_pytorch_tanh")
  name = config_value(hf, "hidden_act", "gelu_pytorch_tanh")
  return activation(hf, "hidden_act", name, name="gelu_pytorch_tanh" if name == "gelu" else name)


def _window(hf: dict) -> dict:
  """Gemma 2 / 3's sliding window over config.json's layer_types, else every layer but each
  period-th (Gemma 3's period: sliding_window_pattern, 6 by default)."""
  period = config_value(hf, "_sliding_window_pattern", _WINDOW_PERIOD[hf["model_type"]])
  period = config_value(hf, "sliding_window_pattern", period)  # as transformers 4 wrote it
  kinds = config_value(hf, "layer_types", [SLIDING if (i + 1) % period else "full_attention"
                                           for i in range(hf["num_hidden_layers"])])
  return window_fields(config_value(hf, "sliding_window", 4096), kinds)


def _rope(hf: dict, windowed: bool) -> dict:
  """RoPE fields: one base for every layer (Gemma, Gemma 2); Gemma 3's global layers' base and
  scaling (rope_parameters['full_attention'], or rope_theta + rope_scaling) and its sliding
  layers' base (rope_parameters['sliding_attention'], or rope_local_base_freq)."""
  if hf["model_type"] != "gemma3_text":
    return rope_fields(hf)
  parameters = config_value(hf, "rope_parameters", {}) or {}
  if "full_attention" in parameters:  # transformers 5: by layer type
    full, local = parameters["full_attention"], parameters.get(SLIDING) or {}
  else:
    full = {**(config_value(hf, "rope_scaling", {}) or {}), **parameters}
    local = {"rope_theta": config_value(hf, "rope_local_base_freq", 10000.0)}
  if local.get("rope_type", "default") != "default":
    raise ValueError(f"rope type {local['rope_type']!r} on sliding-window layers is not "
                     "supported; supported: 'default'")
  fields = rope_fields(hf, dict(full), default_theta=1_000_000.0)
  if windowed:
    fields["local_position_base"] = float(local.get("rope_theta", 10000.0))
  return fields


def _gemma2_fields(hf: dict) -> dict:
  """What Gemma 2 and 3 add to Gemma: post-sublayer norms, their score scale and soft caps,
  the window; Gemma 3's query/key norms."""
  gemma2 = hf["model_type"] == "gemma2"
  # Gemma 3's attention never reads its config's cap (transformers' Gemma3Attention passes it
  # to no attention function).
  attention_cap = hf.get("attn_logit_softcapping", 50.0) if gemma2 else None
  final_cap = hf.get("final_logit_softcapping", _FINAL_SOFTCAP[hf["model_type"]])
  window = _window(hf)
  return dict(post_sublayer_norm=True, qk_norm=not gemma2,
              query_pre_attn_scalar=float(config_value(hf, "query_pre_attn_scalar", 256)),
              attention_softcap=float(attention_cap or 0.0),
              logits_softcap=float(final_cap or 0.0),
              **window, **_rope(hf, bool(window["sliding_window"])))


def model_fields(hf: dict, tied: bool) -> dict:
  """TransformerConfig fields of the checkpoint's config.json; `tied`: no lm_head of its own."""
  heads = hf["num_attention_heads"]
  head_dim = config_value(hf, "head_dim", hf["hidden_size"] // heads)
  attention_bias = bool(config_value(hf, "attention_bias", False))
  if config_value(hf, "use_bidirectional_attention", False):
    raise ValueError("use_bidirectional_attention=true (an encoder) is not supported")
  added_pad = special_ids(hf)[0] is None
  extra = rope_fields(hf) if hf["model_type"] == "gemma" else _gemma2_fields(hf)
  return dict(
      vocab_size=hf["vocab_size"] + added_pad,
      emb_dim=hf["hidden_size"], num_heads=heads,
      num_kv_heads=config_value(hf, "num_key_value_heads", heads), qkv_dim=heads * head_dim,
      mlp_dim=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
      num_decoder_layers=None, max_len=hf["max_position_embeddings"],
      dropout_rate=0.0, attention_dropout_rate=config_value(hf, "attention_dropout", 0.0),
      activation_dropout_rate=0.0, pre_ln=True, final_norm=True, norm="rmsnorm",
      norm_plus_one=True, layer_norm_epsilon=config_value(hf, "rms_norm_eps", 1e-6),
      ffn_activation=GATED[_activation(hf)],  # act(gate) * up
      use_bias=False, qkv_bias=attention_bias, out_bias=attention_bias,
      scale_attention_scores=True, position_embedding="rope", scale_embeddings=True,
      embedding_scale_in_dtype=True, embedding_norm=False, share_embeddings=True,
      tie_output=tied, output_rescale=False, logits_bias=False, mask_padding_logit=added_pad,
      bos_id=config_value(hf, "bos_token_id", 2), **extra)


def special_ids(hf: dict) -> tuple[int | None, int]:
  """The checkpoint's (pad, eos) ids: Gemma's pad (None: one is added) and the first of a
  list of end ids."""
  eos = config_value(hf, "eos_token_id", 1)
  return config_value(hf, "pad_token_id", None), eos[0] if isinstance(eos, list) else eos


def weight_table(hf: dict, fields: dict, names: Collection[str] | None = None) -> list[Entry]:
  """Every parameter of our DecoderOnly and the checkpoint tensors it comes from (`names`
  unused: *ForCausalLM's layout; an untied model's lm_head where it has one)."""
  del names
  # Gemma's post_attention_layernorm is the feed-forward network's pre-norm; Gemma 2 / 3's
  # follows the attention, and pre_feedforward_layernorm comes before the network.
  ffn_norm = "pre_feedforward_layernorm" if hf["model_type"] != "gemma" else (
      "post_attention_layernorm")

  def norms_and_feed_forward(layer: Layer, hf_layer: str) -> list[Entry]:
    table = norm_entries(layer.ffn_norm(), f"{hf_layer}.{ffn_norm}", bias=False)
    if fields.get("post_sublayer_norm"):
      table += norm_entries(layer.attention_norm(name="post_norm"),
                            f"{hf_layer}.post_attention_layernorm", bias=False)
      table += norm_entries(layer.ffn_norm("post_norm"), f"{hf_layer}.post_feedforward_layernorm",
                            bias=False)
    for ours, theirs in (("wi_gate", "gate_proj"), ("wi", "up_proj"), ("wo", "down_proj")):
      table += dense_entries(layer.ffn(ours), f"{hf_layer}.mlp.{theirs}", bias=False)
    return table

  return causal_lm_table(fields, norms_and_feed_forward)
