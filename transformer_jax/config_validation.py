"""One pass over a whole config before any file is read or written, or anything compiled.

`validate(config)` checks every choice key against its allowed values, numeric ranges and the
rules between keys, and raises ConfigError listing every problem at once (so one run shows
all that needs fixing, not the first of them after an hour of training).
"""

from __future__ import annotations

import difflib
import importlib.util
import re
from typing import Any

import jax
import ml_collections

from transformer_jax import families
from transformer_jax import parallel
from transformer_jax.data import directions
from transformer_jax.data import hf_source
from transformer_jax.data import prompt_format
from transformer_jax.model import kernels
from transformer_jax.model import kv_cache
from transformer_jax.model import layers
from transformer_jax.model import lora as lora_lib
from transformer_jax.model import quantization

CHOICES = {
    "task": ("translation", "summarization", "classification", "multitask"),
    "architecture": families.ARCHITECTURES,
    "prompt_format": prompt_format.FORMATS,
    "dataset": ("demo", "local", "tfds", "huggingface"),
    "local.format": ("parallel", "jsonl", "tsv", "label_lines", "label_files"),
    "tokenizer.model_type": ("bpe", "unigram", "char", "word"),
    "overlong": ("truncate", "drop"),
    "parallel.mode": ("pmap", "jit"),
    "decoding.method": ("greedy", "beam", "sample"),
    "decoding.length_penalty": ("gnmt", "hf"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.position_embedding": layers.POSITION_EMBEDDINGS,
    "model.norm": ("layernorm", "rmsnorm"),
    "model.rope_scaling": ("none", "linear", "llama3"),
    "model.ffn_activation": tuple(sorted(layers.ACTIVATIONS)),
    "model.attention_implementation": kernels.IMPLEMENTATIONS,
    "prng_impl": ("threefry2x32", "rbg", "unsafe_rbg"),
    "model.remat_policy": ("full", "dots", "dots_no_batch"),
    "model.pooling": ("mean", "first", "attention", "cls_pooler", "cls_head"),
    "checkpoint_best_mode": ("max", "min"),
    "lora.base_dtype": ("float32", "bfloat16", "int8", "int4"),
    "quantization.weights": quantization.WEIGHT_TYPES,
}

# key: (lowest, highest or None, whether the lowest is allowed, whether the highest is)
RANGES = {
    "num_train_steps": (0, None, True, True),
    "per_device_batch_size": (1, None, True, True),
    "grad_accum_steps": (1, None, True, True),
    "learning_rate": (0, None, False, True),
    "warmup_steps": (0, None, True, True),
    "label_smoothing": (0, 1, True, False),
    "logits_chunk_length": (0, None, True, True),
    "weight_decay": (0, None, True, True),
    "grad_clip_norm": (0, None, True, True),
    "layer_decay": (0, 1, False, True),
    "prefetch_batches": (0, None, True, True),
    "data_shards": (0, None, True, True),
    "log_every_steps": (1, None, True, True),
    "eval_every_steps": (1, None, True, True),
    "checkpoint_every_steps": (1, None, True, True),
    "keep_checkpoints": (1, None, True, True),
    "early_stopping_evals": (0, None, True, True),
    "num_generate_examples": (-1, None, True, True),
    "max_source_length": (2, None, True, True),
    "max_target_length": (2, None, True, True),
    "tokenizer.num_sentences": (1, None, True, True),
    "tokenizer.character_coverage": (0, 1, False, True),
    "model.rope_scaling_factor": (0, None, False, True),
    "model.rope_original_max_len": (1, None, True, True),
    "decoding.beam_size": (1, None, True, True),
    "decoding.alpha": (0, None, True, True),
    "decoding.temperature": (0, None, True, True),
    "decoding.top_k": (0, None, True, True),
    "decoding.top_p": (0, 1, False, True),
    "decoding.max_decode_len": (0, None, True, True),
    "decoding.max_total_len": (0, None, True, True),
    "decoding.num_decodes": (1, None, True, True),
    "decoding.min_length": (0, None, True, True),
    "decoding.repetition_penalty": (0, None, False, True),
    "decoding.no_repeat_ngram_size": (0, None, True, True),
    "decoding.forced_bos_id": (-1, None, True, True),
    "serve.max_batch_size": (1, None, True, True),
    "serve.max_wait_ms": (0, None, True, True),
    "serve.max_queue": (1, None, True, True),
    "serve.max_n": (1, None, True, True),
    "serve.stream_steps": (1, None, True, True),
    "serve.log_stats_s": (0, None, True, True),
    "model.vocab_size": (8, None, True, True),
    "model.emb_dim": (1, None, True, True),
    "model.num_heads": (1, None, True, True),
    "model.num_kv_heads": (0, None, True, True),
    "model.num_layers": (1, None, True, True),
    "model.qkv_dim": (1, None, True, True),
    "model.mlp_dim": (1, None, True, True),
    "model.max_len": (2, None, True, True),
    "model.dropout_rate": (0, 1, True, False),
    "model.attention_dropout_rate": (0, 1, True, False),
    "model.num_classes": (2, None, True, True),
    "model.relative_attention_num_buckets": (4, None, True, True),
    "model.relative_attention_max_distance": (1, None, True, True),
    "model.num_token_types": (0, None, True, True),
    "model.sliding_window": (0, None, True, True),
    "model.attention_softcap": (0, None, True, True),
    "model.logits_softcap": (0, None, True, True),
    "model.query_pre_attn_scalar": (0, None, True, True),
    "model.local_position_base": (0, None, True, True),
    "lora.rank": (0, None, True, True),
    "lora.alpha": (0, None, False, True),
    "lora.dropout": (0, 1, True, False),
}


class ConfigError(ValueError):
  """The config has settings that cannot work; the message lists each with what to do."""


def _get(config: ml_collections.ConfigDict, key: str) -> Any:
  value = config
  for part in key.split("."):
    if part not in value:
      return None
    value = value[part]
  return value


def _range_problem(key: str, value: Any, low, high, low_ok: bool, high_ok: bool) -> str | None:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return f"config.{key}={value!r} must be a number"
  too_low = value < low if low_ok else value <= low
  too_high = high is not None and (value > high if high_ok else value >= high)
  if not (too_low or too_high):
    return None
  upper = "" if high is None else f" and {'<=' if high_ok else '<'} {high}"
  return f"config.{key}={value} must be {'>=' if low_ok else '>'} {low}{upper}"


def problems(config: ml_collections.ConfigDict, device_count: int | None = None) -> list[str]:
  """Every problem with `config`, as short phrases (empty: the config is fine)."""
  found = []
  for key, allowed in CHOICES.items():
    value = _get(config, key)
    if value is not None and value not in allowed:
      close = difflib.get_close_matches(str(value), allowed, n=1)
      hint = f" (did you mean {close[0]!r}?)" if close else ""
      found.append(f"config.{key}={value!r} is not one of {', '.join(allowed)}{hint}")
  for key, bounds in RANGES.items():
    value = _get(config, key)
    if value is not None:
      problem = _range_problem(key, value, *bounds)
      if problem:
        found.append(problem)
  for key in ("decoding.banned_ids", "decoding.end_ids"):
    ids = _get(config, key)
    if ids is not None and not (isinstance(ids, (list, tuple)) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
      found.append(f"config.{key}={ids!r} must be a tuple of token ids >= 0, e.g. (3, 7)")
  if found:
    return found  # the rules below assume well-formed values
  found += _cross_key_problems(config, device_count)
  return found


def _cross_key_problems(config: ml_collections.ConfigDict,
                        device_count: int | None) -> list[str]:
  return (_model_problems(config) + _lora_problems(config) + _data_problems(config)
          + _decoding_problems(config) + _quantization_problems(config)
          + _run_record_problems(config) + _rule_problems(config.parallel.logical_axis_rules)
          + _device_problems(config, device_count)
          # The platform once the devices are up (train.py); else what any platform refuses.
          + _kernel_problems(config, jax.default_backend() if device_count else None))


def _model_problems(config: ml_collections.ConfigDict) -> list[str]:
  """The model keys (and logits_chunk_length) that do not fit each other or the family."""
  found = []
  m = config.model
  if m.qkv_dim % m.num_heads:
    found.append(f"config.model.qkv_dim={m.qkv_dim} must be divisible by "
                 f"config.model.num_heads={m.num_heads}")
  if m.num_kv_heads and (m.num_kv_heads < 1 or m.num_heads % m.num_kv_heads):
    found.append(f"config.model.num_kv_heads={m.num_kv_heads} must divide "
                 f"config.model.num_heads={m.num_heads} (each key/value head serves an equal "
                 "group of query heads; 1 = multi-query, 0 = num_heads)")
  head_dim = m.qkv_dim // m.num_heads
  if m.position_embedding == "rope" and head_dim % 2:
    found.append(f"config.model.position_embedding='rope' needs an even head dimension "
                 f"(qkv_dim / num_heads = {head_dim}): rotary embeddings turn pairs of "
                 "dimensions")
  if (m.position_embedding == "relative"
      and m.relative_attention_max_distance <= m.relative_attention_num_buckets // 2):
    found.append(f"config.model.relative_attention_max_distance="
                 f"{m.relative_attention_max_distance} must exceed half of "
                 f"relative_attention_num_buckets={m.relative_attention_num_buckets} (the "
                 "exact buckets); raise it")
  if m.logits_bias and not m.tie_output:
    found.append("config.model.logits_bias=True is for the tied output layer; an untied one "
                 "(tie_output=False) has its own bias with use_bias=True")
  if m.position_embedding == "relative" and families.name(config) == families.DECODER_ONLY:
    found.append("config.model.position_embedding='relative' is for encoders and "
                 "encoder-decoders; a decoder_only model takes 'sinusoidal', 'learned' or "
                 "'rope'")
  if m.get("prefix_lm") and families.name(config) != families.DECODER_ONLY:
    found.append("config.model.prefix_lm=True is for config.architecture='decoder_only' (an "
                 "encoder already reads the source both ways)")
  if config.get("fused_loss") and not config.get("logits_chunk_length"):
    found.append("config.fused_loss needs config.logits_chunk_length > 0: the positions of "
                 "every row per chunk (e.g. 256)")
  if config.get("logits_chunk_length") and not families.generates_text(config):
    found.append("config.logits_chunk_length chunks a sequence model's output over its "
                 "positions; a classifier has one output per row: leave it 0")
  found += _layer_option_problems(config)
  longest = families.longest_sequence(config)
  if longest > m.max_len:
    found.append(f"config.model.max_len={m.max_len} is shorter than the longest sequence "
                 f"the model sees ({longest} tokens from max_source_length / "
                 "max_target_length); raise max_len or lower those")
  return found


def _lora_problems(config: ml_collections.ConfigDict) -> list[str]:
  """config.lora: adapters need a pretrained model, and settings without a rank do nothing."""
  lora = config.get("lora")
  if lora is None:
    return []
  if not lora.rank:
    return [f"config.lora.{key}={lora[key]!r} is set but config.lora.rank=0 (LoRA off): set "
            f"config.lora.rank > 0 to train adapters, or drop {key}"
            for key in ("alpha", "init") if lora[key]]
  found = []
  if not config.pretrained:
    found.append("config.lora trains adapters on a pretrained model: set config.pretrained "
                 "(a Hugging Face folder or hub name), or config.lora.rank=0")
  try:
    lora_lib.targets(lora.targets)
  except ValueError as e:
    found.append(str(e).rstrip("."))
  return found


def _layer_option_problems(config: ml_collections.ConfigDict) -> list[str]:
  """The attention and norm options that need others beside them
  (read with .get: a workdir saved before they existed lacks them)."""
  found = []
  m = config.model
  pattern = m.get("sliding_window_pattern", "L")
  if not (isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}):
    found.append(f"config.model.sliding_window_pattern={pattern!r} must be letters 'L' "
                 "(a sliding-window layer) and 'G' (a global one), e.g. 'L' or 'LG'")
  if m.get("sliding_window") and not families.generates_text(config):  # an encoder alone
    found.append("config.model.sliding_window is for decoders (causal self-attention); a "
                 "classifier's encoder reads every position")
  if m.get("local_position_base") and not (m.get("sliding_window")
                                           and m.position_embedding == "rope"):
    found.append("config.model.local_position_base is the RoPE base of sliding-window "
                 "layers: it needs position_embedding='rope' and a sliding_window")
  if m.get("norm_plus_one") and m.norm != "rmsnorm":
    found.append("config.model.norm_plus_one=True scales an RMSNorm by (1 + scale): it needs "
                 "config.model.norm='rmsnorm'")
  if m.get("post_sublayer_norm") and not m.pre_ln:
    found.append("config.model.post_sublayer_norm=True adds a norm to pre-LN blocks' sublayer "
                 "outputs (post-LN blocks normalise after the residual add already): set "
                 "config.model.pre_ln=True")
  return found


def _data_problems(config: ml_collections.ConfigDict) -> list[str]:
  """The data keys that do not fit each other (or the task)."""
  found = []
  if config.eval_split not in config.splits:
    found.append(f"config.eval_split={config.eval_split!r} is not a key of config.splits "
                 f"({', '.join(config.splits)})")
  if config.dataset == "local" and not config.data_dir and config.task != "multitask":
    found.append("config.dataset='local' needs config.data_dir: pass --config.data_dir=FOLDER of the corpus")
  if config.prompt_format != "task" and families.name(config) != families.DECODER_ONLY:
    found.append(f"config.prompt_format={config.prompt_format!r} is for decoder-only models "
                 "(config.architecture='decoder_only'); use 'task'")
  if prompt_format.SOURCE_FIELD not in config.prompt_template:
    found.append(f"config.prompt_template={config.prompt_template!r} has no "
                 f"{prompt_format.SOURCE_FIELD} for the source text")
  elif config.prompt_format == "task" and config.prompt_template != prompt_format.SOURCE_FIELD:
    found.append("config.prompt_template applies to prompt_format 'raw' and 'chat'; set one "
                 "of them, or leave the template at '{source}'")
  conversations = ((config.dataset == "local" and config.local.get("messages_field"))
                   or (config.dataset == "huggingface"
                       and config.huggingface.columns.get("messages")))
  if conversations and config.prompt_format != "chat":
    found.append("chat conversations (a messages field or column) train in "
                 "config.prompt_format='chat'; set it")
  if config.dataset == "tfds" and not config.tfds.name:
    found.append("config.dataset='tfds' needs config.tfds.name")
  if config.dataset == "huggingface":
    found.extend(_huggingface_problems(config))
  if config.task == "multitask" and not config.mixture:
    found.append("config.task='multitask' needs config.mixture (see configs/multitask.py)")
  found.extend(_direction_problems(config))
  # A Hugging Face dataset's ClassLabel column names its classes itself (checked on opening).
  if (config.task == "classification" and config.dataset != "huggingface"
      and len(config.label_names) != config.model.num_classes):
    found.append(f"config.label_names has {len(config.label_names)} names but "
                 f"config.model.num_classes={config.model.num_classes}")
  return found


def _direction_problems(config: ml_collections.ConfigDict) -> list[str]:
  """Many translation directions (data/directions.py): well written, and for a multilingual
  checkpoint's translation (its codes are checked against the checkpoint on opening it)."""
  try:
    many = directions.pairs(config)
    directions.codes(config)
  except ValueError as e:
    return [str(e).rstrip(".")]
  if many and (config.task != "translation" or not config.get("pretrained")
               or families.name(config) != families.ENCODER_DECODER):
    return ["config.directions translates with a multilingual encoder-decoder checkpoint: "
            "set config.task='translation' and config.pretrained (NLLB-200, M2M100, mBART-50)"]
  return []


def _decoding_problems(config: ml_collections.ConfigDict) -> list[str]:
  """config.decoding against the model it decodes (only where the model generates text)."""
  found = []
  if not families.generates_text(config):
    return found
  m, d = config.model, config.decoding
  if d.max_decode_len > m.max_len:
    found.append(f"config.decoding.max_decode_len={d.max_decode_len} is longer "
                 f"than config.model.max_len={m.max_len}")
  if d.min_length and d.max_decode_len and d.min_length >= d.max_decode_len:
    found.append(f"config.decoding.min_length={d.min_length} leaves no room for EOS in "
                 f"config.decoding.max_decode_len={d.max_decode_len} tokens; lower it")
  for key in ("banned_ids", "end_ids"):
    past_vocab = [i for i in d.get(key, ()) if i >= m.vocab_size]
    if past_vocab:
      found.append(f"config.decoding.{key} {past_vocab} are not below "
                   f"config.model.vocab_size={m.vocab_size}")
  if d.forced_bos_id >= m.vocab_size:
    found.append(f"config.decoding.forced_bos_id={d.forced_bos_id} is not below "
                 f"config.model.vocab_size={m.vocab_size}")
  for where, value in (("decoding", d.get("kv_cache_dtype", "")),
                       ("model", m.get("kv_cache_dtype", ""))):
    if value not in kv_cache.CACHE_DTYPES:
      found.append(f"config.{where}.kv_cache_dtype={value!r} is not one of "
                   f"{kv_cache.CACHE_DTYPES[1:]} ('' = the model's dtype)")
  return found


def _quantization_problems(config: ml_collections.ConfigDict) -> list[str]:
  """config.quantization against the model it quantizes."""
  q = config.get("quantization")
  if q is None or q.weights not in quantization.WEIGHT_TYPES:
    return []
  held = quantization.spec(config, 1)  # the weights asked for, or a QLoRA base's
  if held is None:
    return []
  asked = ("config.quantization.weights" if q.weights != "none" else "config.lora.base_dtype")
  found = []
  if importlib.util.find_spec(quantization.LIBRARY) is None:
    found.append(f"{asked}={held.weights!r} needs {quantization.LIBRARY}: "
                 "pip install -r requirements.txt (or pip install '.[quantization]')")
  if q.embeddings and not families.generates_text(config):
    found.append("config.quantization.embeddings quantizes a text model's embedding and output "
                 "layer, but a classifier's output is its class head, which stays float: "
                 "leave it False")
  if q.group_size < 0:
    found.append(f"config.quantization.group_size={q.group_size} must be 0 (the default) or "
                 "positive")
  elif held.group_size:
    problem = quantization.group_problem(held.group_size, config.model)
    found += [problem] if problem else []
  return found


def _kernel_problems(config: ml_collections.ConfigDict, platform: str | None) -> list[str]:
  """The attention kernel asked for, where it cannot run this model at all (kernels.py)."""
  m = config.model
  why = kernels.config_refusal(
      m.attention_implementation, platform, dtype=m.dtype, head_dim=m.qkv_dim // m.num_heads,
      prefix_lm=bool(m.get("prefix_lm")),
      relative_bias=m.position_embedding == "relative", softcap=bool(m.get("attention_softcap")))
  return [f"{why} (kernels.py lists what each kernel takes; 'auto' picks one that does)"] \
      if why else []


def _device_problems(config: ml_collections.ConfigDict, device_count: int | None) -> list[str]:
  """The mesh and the data shards against the devices (when their count is known)."""
  found = []
  if config.parallel.mode == "jit" and device_count is not None:
    sizes = [config.parallel.data, config.parallel.fsdp, config.parallel.tensor]
    fixed = [s for s in sizes if s != -1]
    product = 1
    for s in fixed:
      product *= s
    if sizes.count(-1) > 1 or any(s < 1 for s in fixed) or (
        device_count % product if sizes.count(-1) else product != device_count):
      found.append(f"config.parallel data x fsdp x tensor = {sizes} does not fit {device_count} "
                   "devices (their product must be the device count; one may be -1 = the rest)")
  if device_count is not None and config.data_shards:
    global_batch = config.per_device_batch_size * device_count * config.grad_accum_steps
    if global_batch % config.data_shards:
      found.append(f"config.data_shards={config.data_shards} does not divide the global batch "
                   f"of {global_batch} rows (every shard gives an equal part of it)")
  return found


def _run_record_problems(config: ml_collections.ConfigDict) -> list[str]:
  """Keep-best, early stopping, attention images and profiling settings."""
  found = []
  metric, mode = config.checkpoint_best_metric, config.checkpoint_best_mode
  if not isinstance(metric, str):
    found.append(f"config.checkpoint_best_metric={metric!r} must be an eval metric name or ''")
  elif metric in ("loss", "perplexity") and mode == "max":
    found.append(f"config.checkpoint_best_metric={metric!r} is better when lower: set "
                 "config.checkpoint_best_mode='min'")
  if config.early_stopping_evals and not metric:
    found.append("config.early_stopping_evals needs config.checkpoint_best_metric (the metric "
                 "whose improvement it waits for)")
  images = config.attention_images
  if not all(isinstance(v, (list, tuple)) and all(
      isinstance(i, int) and not isinstance(i, bool) for i in v)
             for v in (images.layers, images.heads)):
    found.append("config.attention_images.layers and .heads must be tuples of ints, e.g. "
                 "(-1,) and (0,); layers=() draws none")
  elif images.layers:
    m = config.model
    layers = min(m.num_layers, m.num_decoder_layers or m.num_layers)  # in every stack
    if [i for i in images.layers if not -layers <= i < layers] or [
        i for i in images.heads if not -m.num_heads <= i < m.num_heads]:
      found.append(f"config.attention_images layers {tuple(images.layers)} / heads "
                   f"{tuple(images.heads)} are out of range for {layers} layers and "
                   f"{m.num_heads} heads")
    elif importlib.util.find_spec("matplotlib") is None:
      found.append("config.attention_images needs matplotlib: pip install matplotlib, or set "
                   "config.attention_images.layers=()")
  profile = config.profile_steps
  if profile and not (isinstance(profile, (list, tuple)) and len(profile) == 2 and all(
      isinstance(v, int) and not isinstance(v, bool) for v in profile) and profile[0] >= 0
                      and profile[1] >= 1):
    found.append(f"config.profile_steps={tuple(profile)!r} must be (first step >= 0, number "
                 "of steps >= 1), or () for no profile")
  return found


def _huggingface_problems(config: ml_collections.ConfigDict) -> list[str]:
  h, found = config.huggingface, []
  if not h.name:
    found.append("config.dataset='huggingface' needs config.huggingface.name: a Hub id such as "
                 "knkarthick/dialogsum, a save_to_disk folder, a folder of data files, or a "
                 "builder (parquet, json, csv) with config.huggingface.data_files")
  if importlib.util.find_spec("datasets") is None:
    found.append("config.dataset='huggingface' needs the datasets library: pip install "
                 "'transformer_jax[hf]' (or pip install datasets)")
  builder = h.name in hf_source.BUILDERS
  if builder and not h.data_files.train:
    found.append(f"config.huggingface.name={h.name!r} reads files: set "
                 "config.huggingface.data_files.train (and .validation / .test) to paths or globs")
  if not builder and any(h.data_files.values()):
    found.append("config.huggingface.data_files is for the builders (parquet, json, csv, "
                 f"arrow, text), not config.huggingface.name={h.name!r}")
  return found


def _rule_problems(rules) -> list[str]:
  """config.parallel.logical_axis_rules must be [logical name, mesh axes] pairs."""
  for rule in rules:
    axes = rule[1] if isinstance(rule, (list, tuple)) and len(rule) == 2 else ()
    names = axes if isinstance(axes, (list, tuple)) else [axes]
    if not (isinstance(rule, (list, tuple)) and len(rule) == 2 and isinstance(rule[0], str)
            and all(n is None or n in parallel.MESH_AXES for n in names)):
      return [f"config.parallel.logical_axis_rules: {rule!r} is not a [logical name, mesh "
              f"axes] pair (mesh axes: None, one of {parallel.MESH_AXES}, or a list of them)"]
  return []


def validate(config: ml_collections.ConfigDict, device_count: int | None = None) -> None:
  """Raises ConfigError naming every problem of `config` (nothing is read or written)."""
  found = problems(config, device_count)
  if found:
    raise ConfigError("; ".join(found) + ".")


def override_error(error: Exception) -> str:
  """A one-line message for a bad --config flag (a misspelt key, a missing or broken file)."""
  text = " ".join(str(error).replace("\\'", "'").replace("\\n", " ").split())
  misspelt = re.search(r"'(\w+)'.*(Did you mean \"\w+\")", text)
  if misspelt:  # ml_collections' locked-config error, quoted twice over
    return f"no config key '{misspelt.group(1)}'. {misspelt.group(2)}?"
  text = text.replace("Configuration is not available because of an earlier failure to load: ",
                      "")
  return text[:400]
