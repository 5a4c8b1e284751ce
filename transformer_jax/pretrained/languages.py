"""Language codes of multilingual checkpoints: which a tokenizer knows, how it tags a sentence,
and `config.source_lang` / `config.target_lang` checked against them.

  NLLB-200        `eng_Latn`  `[code] X </s>` (`X </s> [code]` with legacy_behaviour)
  M2M100          `en`        `[__en__] X </s>`
  mBART-50        `en_XX`     `[code] X </s>`
  mBART-cc25      `en_XX`     `X </s> [code]`, the decoder starting from the target code

The tokenizer tags the source with the source code and the target with the target code
(transformers' `src_lang` / `tgt_lang`); generation starts from the decoder start token and
forces the target code as the first output token (`forced_bos_token_id`), as transformers'
`generate` does for these checkpoints.
"""

from __future__ import annotations

import dataclasses
import difflib

PREFIX, SUFFIX = "prefix", "suffix"  # where the code goes: before the text, after its </s>


@dataclasses.dataclass(frozen=True)
class Languages:
  """A tokenizer's language codes: code (as the user writes it) -> checkpoint id of its token,
  and where it puts them (PREFIX or SUFFIX)."""
  codes: dict[str, int]
  style: str
  default_source: str  # the tokenizer's own src_lang
  # mBART-cc25: the decoder starts from the target code (its decoder_start_token_id), which
  # no token is forced after; the others start from </s> and force the code first.
  decoder_starts_with_code: bool = False

  def id_of(self, code: str, key: str) -> int:
    """The checkpoint id of `code`; ValueError naming the close matches for an unknown one."""
    if code not in self.codes:
      close = difflib.get_close_matches(code, list(self.codes), n=4, cutoff=0.5)
      hint = f"close matches: {', '.join(close)}" if close else (
          f"e.g. {', '.join(sorted(self.codes)[:6])}")
      raise ValueError(f"Unknown language code config.{key}={code!r} for this checkpoint "
                       f"({len(self.codes)} codes; {hint}).")
    return self.codes[code]


def of(tokenizer) -> Languages | None:
  """The language codes of a Hugging Face tokenizer, None where it has none."""
  name = type(tokenizer).__name__
  if name.startswith("Nllb"):
    codes = {token: tokenizer.convert_tokens_to_ids(token)
             for token in tokenizer.all_special_tokens if _is_nllb_code(token)}
    style = SUFFIX if getattr(tokenizer, "legacy_behaviour", False) else PREFIX
  elif name.startswith("M2M100"):
    codes = {code: tokenizer.get_lang_id(code) for code in tokenizer.lang_code_to_token}
    style = PREFIX
  elif name.startswith("MBart50"):
    codes, style = dict(tokenizer.lang_code_to_id), PREFIX
  elif name.startswith("MBart"):
    codes, style = dict(tokenizer.lang_code_to_id), SUFFIX
  else:
    return None
  if not codes:
    return None
  return Languages({k: int(v) for k, v in codes.items()}, style, tokenizer.src_lang,
                   decoder_starts_with_code=name.startswith("MBart") and style == SUFFIX)


def _is_nllb_code(token: str) -> bool:
  """NLLB's codes: ISO 639-3 and a script, e.g. `vie_Latn`, `zho_Hans`."""
  language, _, script = token.partition("_")
  return len(language) == 3 and language.isalpha() and len(script) == 4 and script.isalpha()


def check(languages: Languages | None, source_lang: str, target_lang: str,
          folder: str) -> None:
  """Raises ValueError, one line, for codes given to a checkpoint without them, a missing
  target code, or an unknown code."""
  if languages is None:
    if source_lang or target_lang:
      raise ValueError(f"{folder} has no language codes: drop config.source_lang / "
                       "config.target_lang.")
    return
  if not target_lang:
    example = next((c for c in ("vie_Latn", "vi", "vi_VN") if c in languages.codes),
                   sorted(languages.codes)[0])
    raise ValueError(f"{folder} is a multilingual checkpoint: set the language to translate "
                     f"into, --config.target_lang=CODE (e.g. {example}; and "
                     "--config.source_lang for the source).")
  languages.id_of(source_lang or languages.default_source, "source_lang")
  languages.id_of(target_lang, "target_lang")
