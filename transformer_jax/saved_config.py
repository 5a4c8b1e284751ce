"""`--config` of evaluate and predict: the workdir's saved training config.

main.py passes `--config transformer_jax/saved_config.py:WORKDIR` when no --config is given,
so `--config.decoding.beam_size=8` (and the other overrides evaluate and predict accept)
apply to the config the checkpoint was trained with. `override_problems` refuses the rest.
"""

from __future__ import annotations

import ml_collections

from transformer_jax import workdir as workdir_lib

# Keys that describe the trained model and its data: evaluate / predict cannot change them.
FIXED_KEYS = ("task", "architecture", "dataset", "local", "tfds", "huggingface", "splits",
              "demo.num_train", "demo.num_validation", "demo.num_test", "demo.seed", "data_seed",
              "label_names", "mixture", "tokenizer", "max_source_length", "max_target_length",
              "model", "lora.rank", "lora.alpha", "lora.rslora", "lora.targets",
              "lora.base_dtype")


def get_config(workdir: str) -> ml_collections.ConfigDict:
  return workdir_lib.load_config(workdir)


def flat(tree: dict, prefix: str = "") -> dict:
  """{'model.emb_dim': 512, ...}: nested config dicts as dotted keys (empty dicts kept)."""
  result = {}
  for key, value in tree.items():
    if isinstance(value, dict) and value:
      result.update(flat(value, f"{prefix}{key}."))
    else:
      result[f"{prefix}{key}"] = value
  return result


def changed_keys(saved: ml_collections.ConfigDict, given: ml_collections.ConfigDict) -> dict:
  """Keys whose values differ: {key: (saved, given)}."""
  a, b = flat(saved.to_dict()), flat(given.to_dict())
  return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def fixed_key_changes(saved: ml_collections.ConfigDict,
                      given: ml_collections.ConfigDict) -> list[str]:
  """'key (saved X, given Y)' for every changed key the checkpoint fixes."""
  return [f"{k} (saved {old!r}, given {new!r})"
          for k, (old, new) in changed_keys(saved, given).items()
          if any(k == fixed or k.startswith(fixed + ".") for fixed in FIXED_KEYS)]
