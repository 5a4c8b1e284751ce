"""PEFT LoRA adapters in and out: adapter_config.json + adapter_model.safetensors, as
`peft.PeftModel.save_pretrained` writes them and `PeftModel.from_pretrained(base, DIR)` reads
them.

A tensor `base_model.model.<module>.lora_A.weight` [r, in] / `.lora_B.weight` [out, r] belongs
to the Hugging Face module whose weight the architecture's table (mapping.Entry) maps to one of
our kernels; the same table says how the kernel is laid out (a fused q/k/v kernel takes one
adapter per part), so the adapters follow every reordering the weights do. A classifier's head
(PEFT's `modules_to_save`) travels as its plain tensors, `base_model.model.classifier.weight`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np
from flax import traverse_util

from transformer_jax import workdir as workdir_lib
from transformer_jax.model import lora as lora_lib
from transformer_jax.model import schema as model_schema
from transformer_jax.pretrained import architecture
from transformer_jax.pretrained import checkpoint as checkpoint_lib
from transformer_jax.pretrained import files
from transformer_jax.pretrained import mapping

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
TASK_TYPES = {"encoder_decoder": "SEQ_2_SEQ_LM", "decoder_only": "CAUSAL_LM",
              "encoder_classifier": "SEQ_CLS"}
# Kernel layouts (mapping.Entry kinds) an adapter can follow: [in, out] like a torch Linear's
# transpose ('dense'; 'copy': GPT-2's Conv1D, stored [in, out]), q/k/v parts of a fused kernel
# ('heads_in'), and output projections from heads ('heads_out', 'fused_out').
_PLAIN = ("dense", "copy", "heads_out", "fused_out")


@dataclasses.dataclass(frozen=True)
class Site:
  """Where the adapter of one Hugging Face module lives in our parameter tree."""
  module: str  # the HF module, e.g. 'model.layers.0.self_attn.q_proj'
  adapter: tuple[str, ...]  # our adapter's path, e.g. (..., 'self_attention', 'qkv_lora')
  projection: str  # lora.PROJECTION_TARGETS key
  part: int  # the part of a fused kernel (0 otherwise)
  kind: str  # the kernel's mapping.Entry kind


def sites(table: list[mapping.Entry]) -> dict[str, Site]:
  """HF module name -> Site, for every kernel of `table` an adapter can sit on (PEFT's format
  reaches those of `_check_supported` kinds)."""
  found = {}
  for entry in table:
    if entry.path[-1] != "kernel" or entry.path[-2] not in lora_lib.PROJECTION_TARGETS:
      continue
    projection = entry.path[-2]
    adapter = entry.path[:-2] + (projection + lora_lib.SUFFIX,)
    for part, name in enumerate(entry.hf):
      module = name.removesuffix(".weight")
      found[module] = Site(module, adapter, projection, part, entry.kind)
  return found


def _check_supported(site: Site) -> None:
  if site.kind not in _PLAIN + ("heads_in",):
    # GPT-2's c_attn: one module for q, k and v, whose one lora_A PEFT shares between them.
    raise files.PretrainedError(
        f"PEFT adapters of {site.module} (q, k and v fused, one lora_A for all three) are not "
        "supported: use --config.lora.targets=attention_out,ffn_in,ffn_out.")


def _head_entries(table: list[mapping.Entry], trained_in_full: tuple[str, ...]) -> list:
  return [entry for entry in table if entry.path[0] in trained_in_full]


# ---- Out ----------------------------------------------------------------------------------

def to_peft(site: Site, a: np.ndarray, b: np.ndarray, lora: model_schema.LoraSpec
            ) -> tuple[np.ndarray, np.ndarray] | None:
  """(lora_A [r, in], lora_B [out, r]) of `site` from our adapter's a, b (None: a part the
  adapter does not cover)."""
  rank = lora.rank
  if site.kind == "heads_in":
    parts = lora_lib.targeted_parts(lora, site.projection)
    if site.part not in parts:
      return None
    j = parts.index(site.part)
    return a[:, j, :].T, b[j].reshape(rank, -1).T
  return a.reshape(-1, rank).T, b.reshape(rank, -1).T


def write_adapter(trained: dict, model_config: model_schema.TransformerConfig, family,
                  workdir: str, output: str, base_name: str, dropout: float) -> list[str]:
  """Writes the PEFT adapter folder `output` for the `trained` parameters (adapters and a
  classifier's head) of a LoRA workdir trained from `base_name`; returns the names written."""
  from transformer_jax.pretrained import run_files  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import save  # pylint: disable=g-import-not-at-top
  lora = model_config.lora
  hf_config = run_files.saved_json(workdir)
  module = architecture.ARCHITECTURES[hf_config["model_type"]]
  fields = model_schema.as_dict(model_config)
  table = module.weight_table(hf_config, fields)
  flat = {path: np.asarray(v, np.float32) for path, v in
          traverse_util.flatten_dict(trained).items()}
  tensors, targets = {}, []
  for name, site in sites(table).items():
    if site.adapter + ("a",) not in flat:
      continue
    _check_supported(site)
    pair = to_peft(site, flat[site.adapter + ("a",)], flat[site.adapter + ("b",)], lora)
    if pair is None:
      continue
    tensors[f"{PREFIX}{name}.lora_A.weight"] = np.ascontiguousarray(pair[0])
    tensors[f"{PREFIX}{name}.lora_B.weight"] = np.ascontiguousarray(pair[1])
    targets.append(name)
  head = _head_entries(table, family.trained_in_full())
  shapes = mapping.Shapes.of(fields, checkpoint_lib.vocab_map(hf_config))
  for name, array in mapping.state_dict(head, trained, shapes).items():
    tensors[PREFIX + name] = np.ascontiguousarray(array)
  adapter_config = dict(
      peft_type="LORA", task_type=TASK_TYPES[family.name], base_model_name_or_path=base_name,
      r=lora.rank, lora_alpha=lora.alpha, lora_dropout=dropout, use_rslora=lora.rslora,
      # Whole module names: BERT's 'output.dense' would also match its attention's.
      target_modules=sorted(targets),
      modules_to_save=sorted({n.rsplit(".", 1)[0] for e in head for n in e.hf}) or None,
      bias="none", fan_in_fan_out=False, inference_mode=True, init_lora_weights=True,
      rank_pattern={}, alpha_pattern={}, use_dora=False)
  target = workdir_lib.path(output)
  target.mkdir(parents=True, exist_ok=True)
  workdir_lib.write_atomic(target / WEIGHTS, save(tensors, metadata={"format": "pt"}))
  workdir_lib.write_atomic(target / CONFIG, json.dumps(adapter_config, indent=2).encode())
  return [CONFIG, WEIGHTS]


# ---- In -----------------------------------------------------------------------------------

def read_config(folder: str) -> dict:
  """A PEFT adapter folder's adapter_config.json, checked to be a LoRA this project reads."""
  path = os.path.join(folder, CONFIG)
  if not os.path.isfile(path) or not os.path.isfile(os.path.join(folder, WEIGHTS)):
    raise files.PretrainedError(f"{folder} is not a PEFT adapter folder: it needs {CONFIG} and "
                                f"{WEIGHTS} (PeftModel.save_pretrained writes both).")
  config = files.read_json(path, keys=("peft_type", "r"))
  unsupported = [f"{key}={config[key]!r}" for key, fine in
                 (("peft_type", "LORA"), ("bias", "none"), ("use_dora", False))
                 if config.get(key, fine) != fine]
  unsupported += [f"{key} (a rank or alpha per module)" for key in
                  ("rank_pattern", "alpha_pattern") if config.get(key)]
  if unsupported:
    raise files.PretrainedError(f"{path}: {', '.join(unsupported)} is not supported; this "
                                "project reads plain LoRA adapters (one rank, one alpha).")
  return config


def _tensors(folder: str) -> dict[str, np.ndarray]:
  header = files.read_header(os.path.join(folder, WEIGHTS))
  return {name: info.read() for name, info in header.items()}


def _match(name: str, table_sites: dict[str, Site]) -> Site | None:
  """The site of PEFT module `name`, also where the adapter was made on the model under
  another head (a bare 'encoder...' against 'bert.encoder...', or the other way)."""
  if name in table_sites:
    return table_sites[name]
  for module, site in table_sites.items():
    if module.endswith("." + name) or name.endswith("." + module):
      return site
  return None


def _adapter_modules(tensors: dict[str, np.ndarray]) -> set[str]:
  return {name[len(PREFIX):-len(".lora_A.weight")] for name in tensors
          if name.startswith(PREFIX) and name.endswith(".lora_A.weight")}


def settings(folder: str, checkpoint: checkpoint_lib.Checkpoint) -> dict:
  """config.lora values (rank, alpha, rslora, dropout, targets) of the adapter in `folder`,
  made for `checkpoint`; PretrainedError in one line where it was made for another base."""
  config = read_config(folder)
  _check_base(folder, config, checkpoint)
  table = checkpoint.architecture.weight_table(checkpoint.hf_config, checkpoint.fields)
  table_sites = sites(table)
  targets, unknown = set(), []
  for name in sorted(_adapter_modules(_tensors(folder))):
    site = _match(name, table_sites)
    if site is None:
      unknown.append(name)
    else:
      _check_supported(site)
      targets.add(lora_lib.PROJECTION_TARGETS[site.projection][site.part])
  if unknown or not targets:
    raise files.PretrainedError(
        f"The adapter in {folder} adapts modules that {checkpoint.folder} does not have "
        f"({', '.join(unknown[:3]) or 'none at all'}): it was made for another base model.")
  return dict(rank=int(config["r"]), alpha=float(config.get("lora_alpha", 8)),
              rslora=bool(config.get("use_rslora", False)),
              dropout=float(config.get("lora_dropout") or 0.0),
              targets=",".join(t for t in model_schema.LORA_TARGETS if t in targets))


def _check_base(folder: str, config: dict, checkpoint: checkpoint_lib.Checkpoint) -> None:
  """The adapter's base_model_name_or_path names this checkpoint (by its last path part,
  since a hub name and its downloaded folder differ before it)."""
  made_for = (config.get("base_model_name_or_path") or "").rstrip("/")
  here = {os.path.basename(os.path.normpath(checkpoint.folder)),
          checkpoint.hf_config.get("_name_or_path", "").rstrip("/").rsplit("/", 1)[-1]}
  if made_for and os.path.basename(made_for) not in here - {""}:
    raise files.PretrainedError(
        f"The adapter in {folder} was made for {made_for}, not {checkpoint.folder}: pass the "
        "base model it was trained on.")


def read_adapter(folder: str, checkpoint: checkpoint_lib.Checkpoint,
                 model_config: model_schema.TransformerConfig, expected: dict,
                 trained_in_full: tuple[str, ...] = ()) -> dict:
  """Our adapter parameters (and a classifier's head, where the adapter saved one) from the
  PEFT folder, checked against `expected` (the model's adapter and head shapes)."""
  lora = model_config.lora
  tensors = _tensors(folder)
  fields = model_schema.as_dict(model_config)
  table = checkpoint.architecture.weight_table(checkpoint.hf_config, checkpoint.fields)
  expected_flat = traverse_util.flatten_dict(expected)
  table_sites = sites(table)
  flat: dict[tuple, Any] = {}
  for name in _adapter_modules(tensors):
    site = _match(name, table_sites)
    if site is None:
      raise files.PretrainedError(f"The adapter in {folder} adapts {name}, which this model "
                                  "does not have: it was made for another base model.")
    _check_supported(site)
    a_hf = tensors[f"{PREFIX}{name}.lora_A.weight"]
    b_hf = tensors[f"{PREFIX}{name}.lora_B.weight"]
    a, b = (flat.setdefault(site.adapter + (k,), np.zeros(
        expected_flat[site.adapter + (k,)].shape, np.float32)) for k in ("a", "b"))
    if site.kind == "heads_in":
      j = lora_lib.targeted_parts(lora, site.projection).index(site.part)
      a, b = a[:, j, :], b[j]
    _fit(a, a_hf.T, name, folder)
    _fit(b, b_hf.T, name, folder)
  # Adapters of layers the PEFT adapter left out (layers_to_transform) start as PEFT starts
  # them: a uniform within +-1/sqrt(fan_in), b = 0 (no update).
  rng = np.random.default_rng(0)
  for path, like in expected_flat.items():
    if lora_lib.is_adapter(path) and path not in flat:
      fused = path[-2].removesuffix(lora_lib.SUFFIX) in lora_lib.FUSED  # a [emb, parts, r]
      bound = 1.0 / np.sqrt(np.prod(like.shape[:-2] if fused else like.shape[:-1]))
      flat[path] = (rng.uniform(-bound, bound, like.shape).astype(np.float32)
                    if path[-1] == "a" else np.zeros(like.shape, np.float32))
  head = [e for e in _head_entries(table, trained_in_full)
          if all(PREFIX + n in tensors for n in e.hf)]
  shapes = mapping.Shapes.of(fields, checkpoint.vocab)
  for entry in head:
    flat[entry.path] = mapping.to_ours(entry, [tensors[PREFIX + n] for n in entry.hf], shapes)
  # Adapters of layers the PEFT adapter left out (layers_to_transform) start at B = 0.
  for path, like in expected_flat.items():
    if path not in flat and path[-1] == "b":
      flat[path] = np.zeros(like.shape, np.float32)
  return traverse_util.unflatten_dict(flat)


def _fit(target: np.ndarray, value: np.ndarray, name: str, folder: str) -> None:
  """Copies `value` into `target` (a view into an adapter), reshaped to it; PretrainedError
  where the sizes differ (an adapter made for another base)."""
  if target.size != value.size:
    raise files.PretrainedError(
        f"The adapter in {folder} does not fit this model: {name} holds {list(value.shape)} "
        f"where the model needs {list(target.shape)} (made for another base model?).")
  target[...] = value.reshape(target.shape)
