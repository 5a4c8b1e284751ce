"""Tiny Hugging Face checkpoint folders, built offline the way each architecture ships them.

Tokenizers are trained here on real sentences (the shared corpora) and saved with
transformers, so a test reads the same files an import of t5-small, facebook/bart-base or
Helsinki-NLP/opus-mt-en-de would: T5 spiece.model + tokenizer.json, BART vocab.json +
merges.txt + tokenizer.json, Marian source.spm + target.spm + vocab.json.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import os
import warnings

import sentencepiece as spm

from tests.conftest import ROOT

SHARED = os.path.join(ROOT, "..", "shared", "data")

# language -> files of the shared corpora (one sentence a line, plain or gzip).
_CORPORA = {
    "en": ["multi30k/val.en.gz", "tatoeba/tatoeba.deu-eng.eng"],
    "de": ["multi30k/val.de.gz", "tatoeba/tatoeba.deu-eng.deu"],
    "vi": ["tatoeba/tatoeba.vie-eng.vie", "iwslt15_en_vi/tst2012.vi"],
}


def sentences(language: str, count: int) -> list[str] | None:
  """`count` non-empty sentences of 'en', 'de' or 'vi' from the shared corpora, taken
  alternately from each file; None when the corpora are not here."""
  lines = []
  for name in _CORPORA[language]:
    path = os.path.join(SHARED, name)
    if not os.path.exists(path):
      return None
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
      lines.append([line.strip() for line in f if line.strip()])
  mixed = [line for group in zip(*lines) for line in group]
  return mixed[:count]


def dialogues(count: int) -> list[str] | None:
  """`count` DialogSum dialogues: long, multi-line English texts."""
  path = os.path.join(SHARED, "dialogsum", "dev.jsonl.gz")
  if not os.path.exists(path):
    return None
  with gzip.open(path, "rt", encoding="utf-8") as f:
    return [json.loads(line)["dialogue"] for line, _ in zip(f, range(count))]


@dataclasses.dataclass(frozen=True)
class TokenizerFiles:
  """A folder of tokenizer files and the tokenizer transformers loads from it."""
  folder: str
  tokenizer: object  # transformers.AutoTokenizer.from_pretrained(folder)

  @property
  def vocab_size(self) -> int:
    return len(self.tokenizer)

  @property
  def pad_id(self) -> int:
    return self.tokenizer.pad_token_id

  @property
  def eos_id(self) -> int:
    return self.tokenizer.eos_token_id


def _spm_model(texts: list[str], vocab_size: int, **ids) -> bytes:
  model = io.BytesIO()
  # hard_vocab_limit=False: a small sample may not support the exact size.
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size,
      model_type="unigram", character_coverage=1.0, hard_vocab_limit=False, minloglevel=2,
      num_threads=1, **ids)
  return model.getvalue()


def _reloaded(folder: str) -> TokenizerFiles:
  import transformers  # pylint: disable=import-outside-toplevel
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Recommended: pip install sacremoses")
    return TokenizerFiles(folder, transformers.AutoTokenizer.from_pretrained(
        folder, local_files_only=True))


def t5_tokenizer_files(folder: str, texts: list[str], vocab_size: int = 700,
                       extra_ids: int = 20) -> TokenizerFiles:
  """T5 / mT5: a SentencePiece unigram model with T5's ids (pad 0, eos 1, unk 2, no bos),
  `extra_ids` sentinels <extra_id_N> after it, as spiece.model + tokenizer.json."""
  import transformers  # pylint: disable=import-outside-toplevel
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "spiece.model"), "wb") as f:
    f.write(_spm_model(texts, vocab_size, pad_id=0, eos_id=1, unk_id=2, bos_id=-1))
  # transformers 5 ignores T5Tokenizer(vocab_file=...); from_pretrained converts the model.
  transformers.T5Tokenizer.from_pretrained(folder, extra_ids=extra_ids).save_pretrained(folder)
  return _reloaded(folder)


def bart_tokenizer_files(folder: str, texts: list[str], vocab_size: int = 700) -> TokenizerFiles:
  """BART: byte-level BPE with <s>=0, <pad>=1, </s>=2, <unk>=3 and <mask> last, as
  vocab.json + merges.txt + tokenizer.json."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  os.makedirs(folder, exist_ok=True)
  bpe = tokenizers.ByteLevelBPETokenizer()
  bpe.train_from_iterator(texts, vocab_size=vocab_size, show_progress=False,
                          special_tokens=["<s>", "<pad>", "</s>", "<unk>"])
  bpe.model.save(folder)  # vocab.json, merges.txt
  vocab_path = os.path.join(folder, "vocab.json")
  with open(vocab_path, encoding="utf-8") as f:
    vocab = json.load(f)
  vocab["<mask>"] = len(vocab)
  with open(vocab_path, "w", encoding="utf-8") as f:
    json.dump(vocab, f, ensure_ascii=False)
  transformers.BartTokenizer.from_pretrained(folder).save_pretrained(folder)
  return _reloaded(folder)


def marian_tokenizer_files(folder: str, source_texts: list[str], target_texts: list[str],
                           vocab_size: int = 500) -> TokenizerFiles:
  """Marian OPUS-MT: source.spm and target.spm trained on each side, and one vocab.json over
  the pieces of both with </s>=0, <unk>=1 and <pad> the last id."""
  import transformers  # pylint: disable=import-outside-toplevel
  os.makedirs(folder, exist_ok=True)
  pieces = ["</s>", "<unk>"]
  for name, texts in (("source.spm", source_texts), ("target.spm", target_texts)):
    model = _spm_model(texts, vocab_size)
    with open(os.path.join(folder, name), "wb") as f:
      f.write(model)
    processor = spm.SentencePieceProcessor(model_proto=model)
    for i in range(processor.get_piece_size()):
      if not (processor.is_control(i) or processor.is_unknown(i)):
        pieces.append(processor.id_to_piece(i))
  pieces = list(dict.fromkeys(pieces)) + ["<pad>"]
  with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
    json.dump({piece: i for i, piece in enumerate(pieces)}, f, ensure_ascii=False, indent=1)
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Recommended: pip install sacremoses")
    transformers.MarianTokenizer.from_pretrained(folder).save_pretrained(folder)
  return _reloaded(folder)
