"""Tiny GGUF files for the tests, written with the `gguf` package as llama.cpp's converter
writes them: a Hugging Face Llama / Qwen2 folder's config as metadata, its byte-level BPE
tokenizer (`gpt2` model, tokens, types, merges, special ids, chat template), and its tensors
under llama.cpp's names, Llama's query and key rows permuted for llama.cpp's RoPE."""

import json
import os

import numpy as np

_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
          "output_norm.weight", "lm_head.weight": "output.weight"}
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
          "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_name(name: str) -> str:
  if name in _NAMES:
    return _NAMES[name]
  parts = name.split(".")
  return f"blk.{parts[2]}.{_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"


def _permuted(rows: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's convert_hf_to_gguf permutation of Llama's q / k rows."""
  return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2) \
      .reshape(rows.shape)


def random_q4_k(rows: int, width: int, seed: int) -> np.ndarray:
  """Q4_K blocks (which the gguf package cannot quantize into) of random values: per 256
  inputs a float16 scale and minimum, 12 bytes of 6-bit sub-block scales and 128 of nibbles."""
  rng = np.random.default_rng(seed)
  blocks = rng.integers(0, 256, (rows, width // 256, 144), dtype=np.uint8)
  blocks[..., 0:2] = np.full((rows, width // 256, 1), 0.002, np.float16).view(np.uint8)
  blocks[..., 2:4] = np.full((rows, width // 256, 1), 0.001, np.float16).view(np.uint8)
  return blocks.reshape(rows, -1)


def write(folder: str, path: str, kernels: str = "F32", ffn: str | None = None,
          architecture: str = "llama") -> str:
  """Writes the checkpoint in `folder` as a GGUF file at `path`: attention and feed-forward
  kernels as `kernels` (F32, F16, Q8_0, Q4_0, Q4_1), the feed-forward ones as `ffn` where
  given (Q4_K: random blocks, see `random_q4_k`), everything else F32."""
  import gguf  # pylint: disable=import-outside-toplevel
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
    config = json.load(f)
  with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
    tokenizer = json.load(f)
  with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
    tokenizer_config = json.load(f)
  heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
  head_dim = config.get("head_dim") or config["hidden_size"] // heads
  writer = gguf.GGUFWriter(path, architecture)
  writer.add_context_length(config["max_position_embeddings"])
  writer.add_embedding_length(config["hidden_size"])
  writer.add_block_count(config["num_hidden_layers"])
  writer.add_feed_forward_length(config["intermediate_size"])
  writer.add_head_count(heads)
  writer.add_head_count_kv(kv_heads)
  writer.add_key_length(head_dim)
  writer.add_value_length(head_dim)
  writer.add_rope_dimension_count(head_dim)
  writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
  writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
  vocab = tokenizer["model"]["vocab"]
  for added in tokenizer["added_tokens"]:
    vocab[added["content"]] = added["id"]
  tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
  special = {added["id"] for added in tokenizer["added_tokens"] if added["special"]}
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("llama-bpe")
  writer.add_token_list(tokens)
  writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
  merges = tokenizer["model"]["merges"]
  writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
  writer.add_bos_token_id(config["bos_token_id"])
  writer.add_eos_token_id(config["eos_token_id"])
  writer.add_add_bos_token(True)
  if tokenizer_config.get("chat_template"):
    writer.add_chat_template(tokenizer_config["chat_template"])
  tensors = load_file(os.path.join(folder, "model.safetensors"))
  for index, (name, value) in enumerate(sorted(tensors.items())):
    value = value.astype(np.float32)
    if architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
      value = _permuted(value, heads)
    elif architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
      value = _permuted(value, kv_heads)
    kind = "F32"
    if value.ndim == 2 and ("self_attn" in name or "mlp" in name):
      kind = (ffn or kernels) if "mlp" in name else kernels
    if kind == "Q4_K":
      writer.add_tensor(_gguf_name(name), random_q4_k(*value.shape, seed=index),
                        raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    elif kind in ("F32", "F16"):
      writer.add_tensor(_gguf_name(name), value.astype(np.float16 if kind == "F16" else np.float32))
    else:
      qtype = gguf.GGMLQuantizationType[kind]
      writer.add_tensor(_gguf_name(name), gguf.quants.quantize(value, qtype), raw_dtype=qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path
