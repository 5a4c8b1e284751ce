"""A Hugging Face checkpoint's own tokenizer, in this project's ids.

The checkpoint's tokenizer files (tokenizer.json, spiece.model, vocab.json + merges.txt,
Marian's source.spm + target.spm + vocab.json, BERT's vocab.txt, PhoBERT's vocab.txt +
bpe.codes, ...) are loaded with `transformers.AutoTokenizer`, so text is split exactly as the
checkpoint was trained; this class only renumbers ids through the import's `VocabMap`
(checkpoint pad -> 0, eos -> 1) and offers the interface of `transformer_jax.tokenizer.Tokenizer`,
so the data pipeline, the token cache and decoding use it unchanged.

EOS: Hugging Face tokenizers append their end token themselves (eos; BERT's `[SEP]`, as BERT
tokenizers have no eos); the pipeline here appends EOS (internal 1) itself, so `encode` leaves
that trailing token out and `pipeline.with_eos(encode(text), n)` equals the checkpoint's own
ids (renumbered). Other special tokens the tokenizer adds, such as BART's and RoBERTa's
leading `<s>` or BERT's `[CLS]`, are kept. GPT-2's tokenizer appends nothing: `encode` is its
ids as they are, and its eos `<|endoftext|>` (internal 1) is what the pipeline appends.

Pad: a checkpoint without a pad token (GPT-2) gets one added past its vocabulary by the
`VocabMap` (internal 0); the tokenizer never produces it and `decode` drops it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import pathlib
import tempfile
import warnings
from typing import Sequence

import numpy as np
import transformers

from transformer_jax import workdir as workdir_lib
from transformer_jax.pretrained import chat_template
from transformer_jax.pretrained import files
from transformer_jax.pretrained import languages as languages_lib
from transformer_jax.pretrained.vocab import VocabMap

# Weight files share a checkpoint folder with the tokenizer files; a bucket load skips them.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".msgpack", ".h5", ".ot", ".pt", ".pth", ".ckpt",
                    ".onnx", ".gguf")
_FILES_HINT = ("the checkpoint's tokenizer files (tokenizer.json + tokenizer_config.json, "
               "spiece.model, sentencepiece.bpe.model, vocab.json + merges.txt, vocab.txt, "
               "vocab.txt + bpe.codes, or source.spm + target.spm + vocab.json)")


class PretrainedTokenizer:
  """A checkpoint's tokenizer whose ids are this project's (pad 0, eos 1).

  "eos" here is the token that ends the checkpoint's sequences: the tokenizer's eos token, or
  its sep token where it has no eos (BERT's `[SEP]`).

  Args:
    folder: a local folder or URL (gs://...) holding the checkpoint's tokenizer files.
    vocab_map: the import's renumbering; its pad (`to_hf[0]`) and eos (`to_hf[1]`) must be the
      tokenizer's, or its pad an added id (`vocab_map.added_pad`) where the tokenizer has none
      (GPT-2). Without it one is built from `vocab_size`, `pad_id` and `eos_id`, with a pad
      added where the tokenizer has none.
    vocab_size: the checkpoint's vocabulary (embedding rows, an added pad not counted); the
      tokenizer's size by default.
    pad_id, eos_id: the model config's pad and eos ids (checkpoint ids); the tokenizer's by
      default. Given, they are checked against the tokenizer files.

  Raises:
    ValueError: the tokenizer files are missing, do not load, or do not belong to the model
      (different pad / eos ids, no end token, or more pieces than the model has rows).
  """

  def __init__(self, folder: str | os.PathLike, vocab_map: VocabMap | None = None, *,
               vocab_size: int | None = None, pad_id: int | None = None,
               eos_id: int | None = None):
    self._folder = os.fspath(folder)
    self._download = None  # a bucket's files, kept while the tokenizer may read them
    local = self._folder
    if workdir_lib.is_url(self._folder):
      self._download = tempfile.TemporaryDirectory(prefix="hf_tokenizer_")
      local = self._download.name
      _copy_tokenizer_files(workdir_lib.path(self._folder), local)
    self._tok = _load_hf(local, self._folder)
    found = chat_template.find(local)
    self._chat_template = found[0] if found else None
    hf_pad, hf_eos = _pad_and_end(self._tok)
    if hf_eos is None:
      raise ValueError(f"The tokenizer in {self._folder} has no eos token (nor a sep token "
                       f"that ends sequences): copy {_FILES_HINT} into {self._folder}.")
    if vocab_map is not None:
      vocab_size, eos_id = vocab_map.checkpoint_size, int(vocab_map.to_hf[1])
      pad_id = None if vocab_map.added_pad else int(vocab_map.to_hf[0])
    else:
      # None stays None where the tokenizer has no pad: the vocab map then adds one.
      pad_id = hf_pad if pad_id is None else pad_id
      eos_id = hf_eos if eos_id is None else eos_id
    # Where the import adds a pad of its own (the model has none: GPT-2, Llama), a pad the
    # tokenizer names (Qwen's <|endoftext|>) is one more token of the vocabulary to it.
    if vocab_map is not None and vocab_map.added_pad:
      hf_pad = None
    if (pad_id, eos_id) != (hf_pad, hf_eos):
      raise ValueError(
          f"The tokenizer in {self._folder} has pad id {_shown(hf_pad)} and eos id {hf_eos} "
          f"but the model has pad {_shown(pad_id)} and eos {eos_id}: they are not this "
          f"checkpoint's; copy {_FILES_HINT} into {self._folder}.")
    self._size = len(self._tok)
    vocab_size = self._size if vocab_size is None else vocab_size
    if self._size > vocab_size:
      raise ValueError(
          f"The tokenizer in {self._folder} has {self._size} pieces but the model only "
          f"{vocab_size} embedding rows: they are not this checkpoint's; copy {_FILES_HINT} "
          f"into {self._folder}.")
    if vocab_map is None:
      vocab_map = VocabMap.create(vocab_size, pad_id, eos_id)
    self.vocab_map = vocab_map
    # Lists, not arrays: indexing a list per token beats NumPy on sentence-length inputs.
    self._to_internal = self.vocab_map.to_internal.tolist()
    self._to_hf = self.vocab_map.to_hf.tolist()
    # Marian's tokenizer carries a source and a target SentencePiece model.
    self._is_marian = isinstance(self._tok, transformers.MarianTokenizer)
    # Only a tokenizer that appends its end token has one to strip: GPT-2's appends nothing,
    # and a text ending in a literal "<|endoftext|>" must keep that token.
    self._appends_eos = self._tok("a")["input_ids"][-1:] == [hf_eos]
    # A multilingual checkpoint's language codes (None: it has none); see `set_languages`.
    self.languages = languages_lib.of(self._tok)
    self._code_ids = frozenset(
        self._to_internal[i] for i in (self.languages.codes.values() if self.languages else ())
        if i < len(self._to_internal))

  def set_languages(self, source: str, target: str) -> None:
    """Tags sources with language code `source` (default: the tokenizer's own) and targets
    with `target`, as transformers' `src_lang` / `tgt_lang` do. ValueError (one line) for a
    code the checkpoint does not know, or codes given to a tokenizer without them."""
    languages_lib.check(self.languages, source, target, self._folder)
    if self.languages is None:
      return
    self._tok.src_lang = source or self.languages.default_source
    self._tok.tgt_lang = target
    self.__dict__.pop("model_proto", None)  # the saved files now name these languages

  @contextlib.contextmanager
  def using_languages(self, source: str, target: str):
    """`set_languages(source, target)` for the duration of a `with` block (one direction of
    a many-direction run), the languages before it restored after."""
    before = (self._tok.src_lang, self._tok.tgt_lang)
    self.set_languages(source, target)
    try:
      yield self
    finally:
      self._tok.src_lang, self._tok.tgt_lang = before
      self.__dict__.pop("model_proto", None)

  def code_id(self, code: str) -> int:
    """The internal id of a language code's token (e.g. the target code decoding forces)."""
    return self._to_internal[self.languages.id_of(code, "target_lang")]

  @property
  def hf_tokenizer(self) -> transformers.PreTrainedTokenizerBase:
    """The underlying Hugging Face tokenizer (checkpoint ids)."""
    return self._tok

  @property
  def vocab_size(self) -> int:
    """The tokenizer's pieces; the model may have more embedding rows (T5: 32100 of 32128),
    and an added pad (GPT-2) is not counted."""
    return self._size

  @property
  def pad_id(self) -> int:
    """The checkpoint's pad id (internal 0): the vocab map's `to_hf[0]`. Where the checkpoint
    has no pad (GPT-2) an id past its vocabulary, which the tokenizer does not know."""
    return self._to_hf[0]

  @property
  def eos_id(self) -> int:
    """The checkpoint's end token (internal 1): its eos, or BERT's `[SEP]`."""
    return self._to_hf[1]

  @property
  def bos_id(self) -> int | None:
    """The checkpoint's bos id (BART's `<s>`), None where there is none (T5, Marian)."""
    return self._tok.bos_token_id

  @functools.cached_property
  def ends_with_eos(self) -> bool:
    """Whether `with_eos(encode(text))` ends as the checkpoint's sequences do: the tokenizer
    appends its end token (eos, BERT's `[SEP]`), or nothing after the text (GPT-2, whose
    training appends its eos as the pipeline does). Not so for mBART-cc25
    (`text </s> en_XX`): `encode` keeps that tail."""
    def ends_well(ids: list[int], text_ids: list[int]) -> bool:
      return bool(ids) and (ids[-1] == self.eos_id or ids[len(ids) - len(text_ids):] == text_ids)
    return all(ends_well(self._tok(**text)["input_ids"],
                         self._tok(**text, add_special_tokens=False)["input_ids"])
               for text in ({"text": "a"}, {"text_target": "a"}))

  def to_internal(self, hf_ids: int | Sequence[int] | np.ndarray) -> int | list[int]:
    """Checkpoint ids (e.g. a generation config's decoder_start_token_id) -> internal ids."""
    if isinstance(hf_ids, (int, np.integer)):
      return self._to_internal[int(hf_ids)]
    return [self._to_internal[int(i)] for i in hf_ids]

  def to_hf(self, internal_ids: int | Sequence[int] | np.ndarray) -> int | list[int]:
    """Internal ids -> checkpoint ids."""
    if isinstance(internal_ids, (int, np.integer)):
      return self._to_hf[int(internal_ids)]
    return [self._to_hf[int(i)] for i in internal_ids]

  def encode(self, text: str) -> list[int]:
    """The checkpoint's ids of `text` without the trailing EOS, as internal ids."""
    return self._internal(self._tok(text)["input_ids"])

  def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True
                   ) -> list[list[int]]:
    """`encode` of every text, in one call of the tokenizer (Rust threads where it has them).
    Without `add_special_tokens`: the text's own ids only, as `apply_chat_template` tokenizes
    a rendered chat (an end token written in the text is kept)."""
    if not texts:
      return []
    encoded = self._tok(list(texts), return_attention_mask=False,
                        add_special_tokens=add_special_tokens)["input_ids"]
    if not add_special_tokens:
      return [[self._to_internal[i] for i in ids] for ids in encoded]
    return [self._internal(ids) for ids in encoded]

  @property
  def has_chat_template(self) -> bool:
    return self._chat_template is not None

  def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The checkpoint's chat template rendered for `messages` ({'role', 'content'} dicts),
    with the variables transformers gives it (its special tokens). Raises a one-line
    ValueError when the template refuses the conversation (its raise_exception)."""
    variables = dict(self._tok.special_tokens_map)
    try:
      return chat_template.render(self._chat_template, messages,
                                  add_generation_prompt=add_generation_prompt, **variables)
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f"The chat template of {self._folder} refused the conversation "
                       f"({type(e).__name__}: {e}).") from None

  def encode_target(self, text: str) -> list[int]:
    """`encode` for the decoder side: Marian splits targets with its target SentencePiece
    model (Hugging Face's `text_target`); other tokenizers as `encode`."""
    return self._internal(self._tok(text_target=text)["input_ids"])

  def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]:
    if not texts:
      return []
    encoded = self._tok(text_target=list(texts), return_attention_mask=False)["input_ids"]
    return [self._internal(ids) for ids in encoded]

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Internal ids -> text, up to the first EOS; pad (an added one too), special tokens and
    ids past the tokenizer (padding rows of the embedding) are dropped."""
    ids = [int(i) for i in ids]
    if 1 in ids:
      ids = ids[:ids.index(1)]
    # Outputs never show a language code (M2M100's are not special tokens to transformers).
    ids = [i for i in ids if i not in self._code_ids]
    hf_ids = [h for h in self.to_hf([i for i in ids if 0 < i < len(self._to_hf)])
              if h < self._size]
    # Model outputs are target text: Marian must detokenize with its target model, which
    # transformers 5 only does when asked (it defaults to the source model for a shared vocab).
    extra = {"use_source_tokenizer": False} if self._is_marian else {}
    return self._tok.decode(hf_ids, skip_special_tokens=True, **extra)

  def id_to_piece(self, token_id: int) -> str:
    """The piece an internal id stands for, e.g. '▁Haus', 'Ġhouse' or '</s>'; '<pad>' for an
    added pad and '' for rows past the tokenizer, which it has no piece for."""
    if int(token_id) == 0 and self.vocab_map.added_pad:
      return "<pad>"
    return self._tok.convert_ids_to_tokens(self._to_hf[int(token_id)]) or ""

  @functools.cached_property
  def model_proto(self) -> bytes:
    """A digest of the saved tokenizer files: changes whenever the tokenizer files do. (Named
    like `Tokenizer.model_proto` because the token cache keys on it.)"""
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory() as folder:
      for name, data in _saved_files(self._tok, folder):
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.digest()

  def save(self, folder: str | os.PathLike) -> None:
    """Writes the tokenizer files to a local folder or URL (e.g. a training workdir's
    subfolder), each file whole or not at all."""
    target = workdir_lib.path(folder)
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
      for name, data in _saved_files(self._tok, scratch):
        workdir_lib.write_atomic(target / name, data)

  @classmethod
  def load(cls, folder: str | os.PathLike, vocab_map: VocabMap | None = None,
           **kwargs) -> "PretrainedTokenizer":
    """The tokenizer saved in `folder` (local or URL); arguments as the constructor's."""
    return cls(folder, vocab_map, **kwargs)

  def _internal(self, hf_ids: list[int]) -> list[int]:
    if self._appends_eos and hf_ids and hf_ids[-1] == self._to_hf[1]:
      hf_ids = hf_ids[:-1]
    return [self._to_internal[i] for i in hf_ids]


def _pad_and_end(tok) -> tuple[int | None, int | None]:
  """The tokenizer's pad and end token (eos, else sep: BERT's `[SEP]`); pad None where it has
  none, or where it pads with its end token (GPT-2 fine-tunes set pad = eos), which no vocab
  map can tell apart: an added pad then stands for it."""
  end = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
  pad = tok.pad_token_id
  return (None if pad == end else pad), end


def _shown(token_id: int | None) -> str:
  return "none" if token_id is None else str(token_id)


def _load_hf(local: str, shown: str) -> transformers.PreTrainedTokenizerBase:
  """AutoTokenizer on a local folder, with every failure one ValueError saying what to do."""
  if not os.path.isdir(local):
    raise ValueError(f"{shown} is not a folder: give the folder of {_FILES_HINT}.")
  _check_json_files(local, shown)
  try:
    with warnings.catch_warnings():
      # Marian asks for sacremoses, which its tokenizer never calls when encoding.
      warnings.filterwarnings("ignore", message="Recommended: pip install sacremoses")
      # local_files_only: a folder without tokenizer files must fail here, not turn into a
      # download of a Hub repository of the same name.
      # trust_remote_code=False: a folder's own tokenizer code (auto_map) is never imported.
      tok = transformers.AutoTokenizer.from_pretrained(local, local_files_only=True,
                                                       trust_remote_code=False)
  except Exception as error:  # pylint: disable=broad-except
    if (importlib.util.find_spec("google.protobuf") is None
        and any(name.endswith((".model", ".spm")) for name in os.listdir(local))):
      # transformers then reports a missing tiktoken, which is not the cause.
      raise ValueError(f"The tokenizer files in {shown} do not load: converting a "
                       "SentencePiece model needs protobuf (pip install protobuf).") from error
    reason = (str(error).strip().splitlines() or [""])[0][:300]
    raise ValueError(f"The tokenizer files in {shown} do not load ({type(error).__name__}: "
                     f"{reason}): copy {_FILES_HINT} into it.") from error
  # With a config.json alone, transformers 5 builds a tokenizer of a few placeholder pieces.
  # A Rust-backed tokenizer also loads from tokenizer.json alone, which is all `save` writes
  # for some (GPT-2's names only vocab.json and merges.txt).
  names = set(type(tok).vocab_files_names.values()) - {"tokenizer_config.json"}
  if tok.is_fast:
    names.add("tokenizer.json")
  if not any(os.path.isfile(os.path.join(local, name)) for name in names):
    raise ValueError(f"{shown} has none of the files of a {type(tok).__name__} "
                     f"({', '.join(sorted(names))}): copy {_FILES_HINT} into it.")
  chat_template.check(local, shown, bos_token=tok.bos_token, eos_token=tok.eos_token)
  return tok


# The tokenizer's JSON files and the keys each must have, checked before transformers reads
# them so that a damaged one is named (transformers reports a bare JSON parser error).
_JSON_FILES = {"tokenizer_config.json": (), "tokenizer.json": ("model",),
               "special_tokens_map.json": (), "vocab.json": (), "added_tokens.json": ()}


def _check_json_files(local: str, shown: str) -> None:
  for name, keys in _JSON_FILES.items():
    try:
      files.read_json(os.path.join(local, name), keys=keys)
    except files.PretrainedError as e:
      raise files.PretrainedError(str(e).replace(local, shown)) from None


def _saved_files(tok, scratch: str) -> list[tuple[str, bytes]]:
  """(name, content) of the files `save_pretrained` writes, sorted by name."""
  tok.save_pretrained(scratch)
  paths = sorted(pathlib.Path(scratch).iterdir())
  return [(path.name, path.read_bytes()) for path in paths if path.is_file()]


def _copy_tokenizer_files(source, local: str) -> None:
  """Copies a bucket folder's files, weights left out, into a local folder."""
  if not source.is_dir():
    raise ValueError(f"{source} is not a folder: give the folder of {_FILES_HINT}.")
  for item in source.iterdir():
    if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES):
      with open(os.path.join(local, item.name), "wb") as f:
        f.write(item.read_bytes())
