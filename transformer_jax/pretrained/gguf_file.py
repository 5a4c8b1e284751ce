"""GGUF files (llama.cpp's format) served as checkpoints: `--pretrained FILE.gguf`, or a folder
holding one, for the decoder-only architectures this project reads (llama, mistral as llama.cpp
writes it, qwen2, qwen3), through the `gguf` package that llama.cpp publishes.

The file's metadata gives the model's config.json and its tokenizer (rebuilt by transformers'
GGUF tokenizer converter, as `AutoTokenizer.from_pretrained(..., gguf_file=...)` builds it),
written into a folder of this process's own so that the rest of the import reads it as a
Hugging Face folder. The tensors are read from the memory-mapped file one at a time:
- every attention and feed-forward kernel in Q8_0 or Q4_0 (all of one type, widths that are
  multiples of 32): held as they are, as int8 / int4 values with the file's own scale per
  32 inputs (model/quantization.py's layout, config.quantization set to match), so the model
  computes with exactly the file's dequantized values and no float copy of them is made;
- anything else (F32, F16, BF16, Q4_1, Q4_K and the other types `gguf` dequantizes): as
  float32, one tensor at a time.
llama.cpp stores Llama's query and key rows permuted for its RoPE; they are put back.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import os
import shutil
import tempfile
from typing import Any

import jax
import numpy as np
from flax import traverse_util

from transformer_jax.model import quantization
from transformer_jax.pretrained import files
from transformer_jax.pretrained import mapping

PretrainedError = files.PretrainedError
SUFFIX = ".gguf"
# GGUF's general.architecture ("arch", as llama.cpp says) -> Hugging Face model_type
# (llama.cpp writes Mistral as llama).
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_PERMUTED = ("llama",)  # whose q / k rows llama.cpp permutes
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
          "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_KERNELS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
BLOCK = 32  # values per scale of Q8_0 and Q4_0
_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                   "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def find(name_or_path: str) -> str | None:
  """The GGUF file `name_or_path` names: itself (FILE.gguf) or a folder's only .gguf file with
  no config.json beside it; None where it names something else."""
  path = os.path.expanduser(name_or_path)
  if os.path.isfile(path) and path.endswith(SUFFIX):
    return path
  if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
    return None
  found = sorted(n for n in os.listdir(path) if n.endswith(SUFFIX))
  if len(found) > 1:
    raise PretrainedError(f"{path} holds {len(found)} GGUF files ({', '.join(found[:3])}): "
                          "pass the one to serve, --pretrained FOLDER/FILE.gguf.")
  return os.path.join(path, found[0]) if found else None


class GGUF:
  """A GGUF file's metadata and tensors, by Hugging Face names (the checkpoint's `_Tensors`
  interface), checked against the file's size as it is opened."""

  def __init__(self, path: str):
    try:
      import gguf  # pylint: disable=import-outside-toplevel
    except ImportError:
      raise PretrainedError(f"{path}: GGUF files need the gguf package (llama.cpp's): pip "
                            "install -r requirements.txt (or pip install gguf).") from None
    self.path = path
    try:  # memory-mapped: a size the header claims past the file's end fails, unallocated
      self._reader = gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, OverflowError, TypeError) as e:
      raise PretrainedError(f"{path} cannot be read as a GGUF file ({_short(e)}): it is "
                            "damaged or not GGUF; download it again.") from None
    self._by_name = {t.name: t for t in self._reader.tensors}
    self.arch = self.field("general.architecture")
    if self.arch not in MODEL_TYPES:
      raise PretrainedError(f"{path}: GGUF architecture {self.arch!r} is not "
                            f"supported; supported: {', '.join(MODEL_TYPES)}.")
    self._check_types()

  def field(self, key: str, default: Any = None) -> Any:
    field = self._reader.fields.get(key)
    if field is None:
      return default
    return field.contents()

  def _check_types(self) -> None:
    from gguf import quants  # pylint: disable=import-outside-toplevel
    for tensor in self._reader.tensors:
      kind = tensor.tensor_type
      if kind.name in ("F32", "F16", "BF16"):
        continue
      if not hasattr(quants, kind.name):
        raise PretrainedError(f"{self.path}: tensor {tensor.name} is of GGUF type "
                              f"{kind.name}, which this reader cannot dequantize.")

  # ---- The checkpoint's tensor interface (Hugging Face names) -----------------------------

  def gguf_name(self, hf_name: str) -> str | None:
    if hf_name in _GLOBAL:
      return _GLOBAL[hf_name]
    parts = hf_name.split(".")  # model.layers.N.<part>.(weight|bias)
    if len(parts) < 5 or parts[:2] != ["model", "layers"]:
      return None
    part = _LAYER.get(".".join(parts[3:-1]))
    return None if part is None else f"blk.{parts[2]}.{part}.{parts[-1]}"

  def __contains__(self, hf_name: str) -> bool:
    return self.gguf_name(hf_name) in self._by_name

  @property
  def names(self) -> list[str]:
    layers = int(self.field(f"{self.arch}.block_count", 0))
    candidates = list(_GLOBAL) + [f"model.layers.{i}.{part}.{kind}" for i in range(layers)
                                  for part in _LAYER for kind in ("weight", "bias")]
    return [name for name in candidates if name in self]

  @property
  def float_dtype(self) -> np.dtype:
    return np.dtype(np.float32)

  def shape(self, hf_name: str) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(self._tensor(hf_name).shape.tolist()))

  def _tensor(self, hf_name: str):
    name = self.gguf_name(hf_name)
    if name not in self._by_name:
      raise PretrainedError(f"{self.path} has no tensor {name or hf_name}: it does not match "
                            "its own metadata (a damaged or partial file?).")
    return self._by_name[name]

  def __getitem__(self, hf_name: str) -> np.ndarray:
    """The tensor in float32, [out, in] as a Hugging Face checkpoint holds it."""
    from gguf import quants  # pylint: disable=import-outside-toplevel
    tensor = self._tensor(hf_name)
    try:
      values = quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
      values = values.reshape(self.shape(hf_name))
    except (ValueError, NotImplementedError) as e:
      raise PretrainedError(f"{self.path}: tensor {tensor.name} ({tensor.tensor_type.name}) "
                            f"cannot be read ({_short(e)}).") from None
    return self._unpermuted(hf_name, values)

  # ---- Kernels held as the file holds them -------------------------------------------------

  def held_quantization(self) -> str | None:
    """'int8' (every kernel Q8_0) or 'int4' (every kernel Q4_0) where the kernels can be held
    as the file holds them; None where they are read as float32."""
    kinds = {t.tensor_type.name for name, t in self._by_name.items()
             if name.split(".")[-2] in _KERNELS and name.endswith(".weight")}
    held = {frozenset({"Q8_0"}): "int8", frozenset({"Q4_0"}): "int4"}.get(frozenset(kinds))
    config = self.config
    widths = (config["hidden_size"], config["intermediate_size"], config["head_dim"])
    return held if held and all(w % BLOCK == 0 for w in widths) else None

  def quantized(self, hf_name: str) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 / Q4_0 kernel's values (int8, [out, in]) and scales (float32, [out, in / 32]):
    the tensor is values x scales, each scale over 32 consecutive inputs."""
    tensor = self._tensor(hf_name)
    out, width = self.shape(hf_name)
    kind = tensor.tensor_type.name
    blocks = np.asarray(tensor.data).reshape(out, width // BLOCK, -1)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
      values = blocks[..., 2:].copy().view(np.int8)
    else:  # Q4_0: the low nibbles are a block's first 16 values, the high ones the rest
      packed = blocks[..., 2:]
      values = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int8) - 8
    values = values.reshape(out, width)
    return self._unpermuted(hf_name, values), self._unpermuted(hf_name, scales)

  def _unpermuted(self, hf_name: str, rows: np.ndarray) -> np.ndarray:
    """llama.cpp's RoPE order of Llama's query and key rows back to Hugging Face's."""
    if self.arch not in _PERMUTED or not hf_name.endswith(
        ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
      return rows
    config = self.config
    heads = config["num_attention_heads" if "q_proj" in hf_name else "num_key_value_heads"]
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)

  # ---- config.json, generation_config.json and the tokenizer -------------------------------

  @functools.cached_property
  def config(self) -> dict:
    """The model's config.json, from the metadata."""
    a = self.arch
    get = lambda key, default=None: self.field(f"{a}.{key}", default)
    try:
      heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
      config = dict(
          model_type=MODEL_TYPES[a], hidden_size=hidden,
          intermediate_size=int(get("feed_forward_length")),
          num_hidden_layers=int(get("block_count")), num_attention_heads=heads,
          num_key_value_heads=int(get("attention.head_count_kv", heads)),
          head_dim=int(get("attention.key_length", hidden // heads)),
          max_position_embeddings=int(get("context_length")),
          rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
          rope_theta=float(get("rope.freq_base", 10000.0)),
          vocab_size=len(self.field("tokenizer.ggml.tokens", [])),
          bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
          eos_token_id=self.field("tokenizer.ggml.eos_token_id"),
          tie_word_embeddings="output.weight" not in self._by_name,
          attention_bias="blk.0.attn_output.bias" in self._by_name)
    except (TypeError, ValueError) as e:
      raise PretrainedError(f"{self.path}: its {a} metadata is incomplete ({_short(e)}).") \
          from None
    scaling = get("rope.scaling.type", "none")
    if scaling == "linear":
      config["rope_scaling"] = dict(rope_type="linear", factor=float(get("rope.scaling.factor")))
    elif scaling not in ("none", None) or "rope_freqs.weight" in self._by_name:
      raise PretrainedError(f"{self.path}: RoPE scaling {scaling!r} (or a rope_freqs tensor) "
                            "is not supported in GGUF files; only none and linear are.")
    rows = self.shape("model.embed_tokens.weight")[0] if "model.embed_tokens.weight" in self \
        else None
    if rows != config["vocab_size"]:
      raise PretrainedError(f"{self.path}: its tokenizer has {config['vocab_size']} tokens but "
                            f"its embedding {rows} rows (a damaged file?).")
    return config

  def write_folder(self, folder: str) -> None:
    """config.json, generation_config.json and the tokenizer's files, into `folder`."""
    import transformers  # pylint: disable=import-outside-toplevel
    try:
      from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping  # pylint: disable=import-outside-toplevel
    except ImportError:
      raise PretrainedError("GGUF tokenizers need transformers with its GGUF converter "
                            "(transformers >= 5.24): pip install -U transformers.") from None
    config = self.config
    grouped = {group: {name: self.field(f"tokenizer.{key}") for key, name in renames.items()
                       if f"tokenizer.{key}" in self._reader.fields}
               for group, renames in mapping.GGUF_TOKENIZER_MAPPING.items()}
    tokens, settings = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokens.get("tokenizer_type") == "llama":
      settings.setdefault("add_bos_token", True)  # llama.cpp's default for SentencePiece
    for name, key in _SPECIAL_TOKENS.items():
      token_id = self.field(f"tokenizer.ggml.{key}")
      settings[name] = tokens["tokens"][token_id] if token_id is not None else None
    try:
      backend, _ = mapping.convert_gguf_tokenizer(self.arch, tokens)
    except Exception as e:  # pylint: disable=broad-except  # the converter's own errors
      raise PretrainedError(f"{self.path}: its tokenizer cannot be rebuilt ({_short(e)}).") \
          from None
    chat_template = settings.pop("chat_template", None)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **settings)
    if chat_template:
      tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
      json.dump(config, f)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None}
    with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as f:
      json.dump(generation, f)


@functools.lru_cache(maxsize=4)
def opened(path: str) -> GGUF:
  """The GGUF file at `path`, its header read once per process."""
  return GGUF(path)


def open_folder(path: str) -> tuple[GGUF, str]:
  """The file and a folder of this process's own (removed at exit) holding its config.json,
  generation_config.json and tokenizer files."""
  source = opened(path)
  folder = tempfile.mkdtemp(prefix="gguf_")
  atexit.register(shutil.rmtree, folder, ignore_errors=True)
  source.write_folder(folder)
  return source, folder


def hold_as_file(config, path: str, adapter: str | None = None) -> bool:
  """Sets config.quantization to hold the kernels as the file at `path` does (Q8_0: int8,
  Q4_0: int4, in groups of 32) where it can, and says whether it did; refused where the
  command asked for another quantization or a LoRA adapter to merge into them."""
  held = opened(path).held_quantization()
  if held is None:
    return False  # float32 kernels, which config.quantization may quantize as any others
  kind = "Q8_0" if held == "int8" else "Q4_0"
  q = config.quantization
  if q.weights not in ("none", held) or q.group_size not in (0, BLOCK) or q.embeddings:
    raise PretrainedError(f"{path} holds its kernels in {kind}, served as they are ({held} in "
                          f"groups of {BLOCK}; its embedding and output layer as float): drop "
                          "--config.quantization.weights / group_size / embeddings.")
  if adapter:
    raise PretrainedError(f"{path} holds its kernels in {kind}; --adapter merges an adapter "
                          "into float weights: serve the adapter over a float checkpoint.")
  q.update(weights=held, group_size=BLOCK)
  return True


def holds_quantized(abstract) -> bool:
  """Whether a model's parameters (abstract) hold quantized kernels."""
  return abstract is not None and any(
      quantization.is_quantized(x)
      for x in jax.tree.leaves(abstract, is_leaf=quantization.is_quantized))


def read_params(source: GGUF, table, shapes, abstract) -> dict:
  """Our parameter tree of the file: the kernels of `table` (mapping.Entry: dense, heads_in,
  heads_out) as quantized leaves in the layout of `abstract` (the quantized model's
  parameters), everything else float32 as `mapping.build_params` converts it."""
  wanted = {path: leaf for path, leaf in traverse_util.flatten_dict(abstract).items()
            if quantization.is_quantized(leaf)}
  params = traverse_util.flatten_dict(mapping.build_params(
      [e for e in table if e.path not in wanted], source.__getitem__, shapes))
  # Scales have one row per 32 inputs: the output projection's [h * d / 32, emb] splits into
  # [h, d / 32, emb] as its values' [h * d, emb] into [h, d, emb].
  scale_shapes = dataclasses.replace(shapes, head_dim=shapes.head_dim // BLOCK)
  for entry in (e for e in table if e.path in wanted):
    pairs = [source.quantized(name) for name in entry.hf]
    values = mapping.to_ours(entry, [v for v, _ in pairs], shapes)
    scales = mapping.to_ours(entry, [s for _, s in pairs],
                             scale_shapes if entry.kind == "heads_out" else shapes)
    leaf = wanted[entry.path]
    if values.shape != tuple(leaf.shape):
      raise PretrainedError(f"{source.path}: {'/'.join(entry.path)} is {list(values.shape)} "
                            f"in the file but {list(leaf.shape)} in its model.")
    params[entry.path] = jax.tree.unflatten(  # QArray's leaves: values, scales
        jax.tree.structure(leaf), [np.asarray(values).astype(jax.tree.leaves(leaf)[0].dtype),
                                   np.ascontiguousarray(scales, np.float32)])
  return traverse_util.unflatten_dict(params)


def _short(error: Exception) -> str:
  return " ".join(str(error).split())[:200]
