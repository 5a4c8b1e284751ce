"""Many translation directions in one run (`config.directions`, e.g. 'en-vi,vi-en').

Each direction reads the config's dataset with its own pair of languages: a local `parallel`
folder's `{split}.en` / `{split}.vi` files serve both directions; a Hugging Face dataset's
`translation` dict column serves any pair (columns `translation.en` / `translation.vi`).
Every example carries its direction and its languages in the checkpoint's own codes
(`config.language_codes`, e.g. 'en=eng_Latn,vi=vie_Latn'): the tokenizer tags each example
with them and decoding forces each row's own target code, so one batch mixes directions.
Evaluation scores each direction apart, and their mean.
"""

from __future__ import annotations

import ml_collections


def pairs(config: ml_collections.ConfigDict) -> list[tuple[str, str]]:
  """The (source, target) data languages of `config.directions`; [] for a one-direction run."""
  text = config.get("directions", "") or ""
  found = []
  for item in (part.strip() for part in text.split(",")):
    if not item:
      continue
    source, sep, target = item.partition("-")
    if not sep or not source or not target or source == target:
      raise ValueError(f"config.directions={text!r}: write each direction as SOURCE-TARGET "
                       "data languages, comma-separated, e.g. 'en-vi,vi-en'.")
    found.append((source, target))
  return found


def codes(config: ml_collections.ConfigDict) -> dict[str, str]:
  """Data language -> checkpoint code of `config.language_codes` ('en=eng_Latn,vi=vie_Latn');
  a language it does not name keeps its data name as its code (M2M100's 'en', 'vi')."""
  text = config.get("language_codes", "") or ""
  found = {}
  for item in (part.strip() for part in text.split(",")):
    if not item:
      continue
    language, sep, code = item.partition("=")
    if not sep or not language or not code:
      raise ValueError(f"config.language_codes={text!r}: write DATA_LANGUAGE=CODE pairs, "
                       "comma-separated, e.g. 'en=eng_Latn,vi=vie_Latn'.")
    found[language.strip()] = code.strip()
  return found


def name(source: str, target: str) -> str:
  return f"{source}-{target}"


def direction_config(config: ml_collections.ConfigDict, source: str,
                     target: str) -> ml_collections.ConfigDict:
  """`config` reading one direction: the local files' suffixes, and the Hugging Face
  `translation` dict's keys (where the columns are unset or name that dict)."""
  one = ml_collections.ConfigDict(config.to_dict())
  with one.unlocked():
    one.directions = ""
    one.local.source_lang, one.local.target_lang = source, target
    columns = one.huggingface.columns
    if not columns.source or columns.source.startswith("translation."):
      columns.source = f"translation.{source}"
    if not columns.target or columns.target.startswith("translation."):
      columns.target = f"translation.{target}"
  return one


def configs(config: ml_collections.ConfigDict) -> list[tuple[str, str, ml_collections.ConfigDict]]:
  """(source, target, its config) per direction; [(., ., config)] for a one-direction run."""
  found = pairs(config)
  if not found:
    return [("", "", config)]
  return [(s, t, direction_config(config, s, t)) for s, t in found]


def tag(examples, config: ml_collections.ConfigDict, source: str, target: str):
  """The examples of one direction, each with its direction and its languages' codes."""
  code = codes(config)
  extra = {"direction": name(source, target), "source_lang": code.get(source, source),
           "target_lang": code.get(target, target)}
  return (dict(example, **extra) for example in examples)
