"""Tiny Hugging Face checkpoint folders, built offline the way each architecture ships them.

Tokenizers are trained here on real sentences (the shared corpora) and saved with
transformers, so a test reads the same files an import of t5-small, facebook/bart-base,
Helsinki-NLP/opus-mt-en-de, bert-base-uncased, roberta-base, xlm-roberta-base or gpt2 would:
T5 spiece.model + tokenizer.json, BART / RoBERTa / GPT-2 vocab.json + merges.txt +
tokenizer.json, Marian source.spm + target.spm + vocab.json, BERT vocab.txt + tokenizer.json,
XLM-R sentencepiece.bpe.model + tokenizer.json. `tiny_model` writes a whole checkpoint folder:
a tiny random model of each architecture beside those files.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import os
import shutil
import tempfile
import warnings
from typing import Sequence

import sentencepiece as spm

# Not tests.conftest's ROOT: importing conftest sets the suite's XLA flags (LLVM -O0, no
# vectorized loops), and the benchmarks that build their folders here must compile as users do.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(ROOT, "..", "shared", "data")

# language -> files of the shared corpora (one sentence a line, plain or gzip).
_CORPORA = {
    "en": ["multi30k/val.en.gz", "tatoeba/tatoeba.deu-eng.eng"],
    "de": ["multi30k/val.de.gz", "tatoeba/tatoeba.deu-eng.deu"],
    "vi": ["tatoeba/tatoeba.vie-eng.vie", "iwslt15_en_vi/tst2012.vi"],
}


def sentences(language: str, count: int) -> list[str] | None:
  """`count` non-empty sentences of 'en', 'de' or 'vi' from the shared corpora, taken
  alternately from each file (Vietnamese: Tatoeba's short everyday sentences and IWSLT'15's
  TED talks, tokenized); None when the corpora are not here."""
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


def bert_tokenizer_files(folder: str, texts: list[str], vocab_size: int = 800) -> TokenizerFiles:
  """Uncased BERT (bert-base-uncased style): WordPiece over lower-cased, accent-stripped text
  with [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4, as vocab.txt + tokenizer.json. Sequences
  are `[CLS] text [SEP]`; there is no eos or bos token."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  os.makedirs(folder, exist_ok=True)
  wordpiece = tokenizers.BertWordPieceTokenizer(lowercase=True)
  wordpiece.train_from_iterator(texts, vocab_size=vocab_size, show_progress=False,
                                special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
  wordpiece.save_model(folder)  # vocab.txt
  transformers.BertTokenizerFast.from_pretrained(folder, do_lower_case=True).save_pretrained(
      folder)
  return _reloaded(folder)


def roberta_tokenizer_files(folder: str, texts: list[str],
                            vocab_size: int = 700) -> TokenizerFiles:
  """RoBERTa: byte-level BPE with <s>=0, <pad>=1, </s>=2, <unk>=3 and <mask> last (BART's
  layout), as vocab.json + merges.txt + tokenizer.json. Sequences are `<s> text </s>`."""
  import transformers  # pylint: disable=import-outside-toplevel
  _byte_level_bpe(folder, texts, vocab_size, ["<s>", "<pad>", "</s>", "<unk>"], ["<mask>"])
  transformers.RobertaTokenizerFast.from_pretrained(folder).save_pretrained(folder)
  return _reloaded(folder)


def xlmr_tokenizer_files(folder: str, texts: list[str], vocab_size: int = 800) -> TokenizerFiles:
  """XLM-RoBERTa: a SentencePiece unigram model (<unk>=0, <s>=1, </s>=2 inside it) saved as
  sentencepiece.bpe.model + tokenizer.json, whose ids are fairseq's as XLM-R's are: <s>=0,
  <pad>=1, </s>=2, <unk>=3, every other piece its SentencePiece id + 1, <mask> last."""
  import transformers  # pylint: disable=import-outside-toplevel
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "sentencepiece.bpe.model"), "wb") as f:
    f.write(_spm_model(texts, vocab_size, unk_id=0, bos_id=1, eos_id=2, pad_id=-1))
  transformers.XLMRobertaTokenizerFast.from_pretrained(folder).save_pretrained(folder)
  return _reloaded(folder)


def fairseq_spm_model(texts: list[str], vocab_size: int = 600) -> bytes:
  """A SentencePiece model with fairseq's ids (<unk> 0, <s> 1, </s> 2), as NLLB's, M2M100's
  and mBART's sentencepiece.bpe.model are."""
  return _spm_model(texts, vocab_size, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)


def multilingual_tokenizer_files(kind: str, folder: str, model: bytes,
                                 nllb_codes: Sequence[str] = ("eng_Latn", "vie_Latn")):
  """A multilingual tokenizer's files written by transformers around SentencePiece `model`:
  'nllb' / 'nllb_legacy' (NLLB-200's, with `nllb_codes` as its language codes; legacy:
  `legacy_behaviour`), 'm2m100' (M2M100's vocab.json + spm, its 100 codes), 'mbart50'
  (mBART-50's 52 codes) or 'cc25' (mBART-cc25's 25). Returns transformers' tokenizer."""
  import sentencepiece  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "sentencepiece.bpe.model"), "wb") as f:
    f.write(model)
  if kind in ("nllb", "nllb_legacy"):
    tok = transformers.NllbTokenizer.from_pretrained(
        folder, additional_special_tokens=list(nllb_codes),
        legacy_behaviour=kind == "nllb_legacy")
  elif kind == "mbart50":
    tok = transformers.MBart50Tokenizer.from_pretrained(folder)
  elif kind == "cc25":
    tok = transformers.MBartTokenizer.from_pretrained(folder)
  else:  # M2M100: vocab.json over the pieces, fairseq's four specials first
    processor = sentencepiece.SentencePieceProcessor(model_proto=model)
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(processor.get_piece_size()):
      vocab.setdefault(processor.id_to_piece(i), len(vocab))
    with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
      json.dump(vocab, f, ensure_ascii=False)
    tok = transformers.M2M100Tokenizer(os.path.join(folder, "vocab.json"),
                                       os.path.join(folder, "sentencepiece.bpe.model"))
  tok.save_pretrained(folder)
  return transformers.AutoTokenizer.from_pretrained(folder)


def rows_for(tok) -> int:
  """Embedding rows for every id `tok` gives (M2M100's language ids lie past len(tok)), a
  multiple of 8."""
  top = max(len(tok), *tok.convert_tokens_to_ids(tok.all_special_tokens))
  if hasattr(tok, "lang_token_to_id"):
    top = max(top, *tok.lang_token_to_id.values())
  return -(-(top + 1) // 8) * 8


def gpt2_tokenizer_files(folder: str, texts: list[str], vocab_size: int = 800) -> TokenizerFiles:
  """GPT-2: byte-level BPE (all 256 bytes, then merges) with `<|endoftext|>` the last id, as
  vocab.json + merges.txt + tokenizer.json. `<|endoftext|>` is bos, eos and unk; there is no
  pad, and the tokenizer adds nothing to a text."""
  import transformers  # pylint: disable=import-outside-toplevel
  _byte_level_bpe(folder, texts, vocab_size - 1, [], ["<|endoftext|>"])
  transformers.GPT2TokenizerFast.from_pretrained(folder).save_pretrained(folder)
  return _reloaded(folder)


# ChatML (Qwen's, SmolLM2's) with an optional system turn; the reply ends with <|im_end|>.
CHATML_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def llama_tokenizer_files(folder: str, texts: list[str], vocab_size: int = 800) -> TokenizerFiles:
  """Llama 3 style: one tokenizer.json of a byte-level BPE with `<|begin_of_text|>` (bos,
  which the tokenizer puts before every text), `<|end_of_text|>` (eos), `<|endoftext|>` and
  ChatML's `<|im_start|>` / `<|im_end|>` the last ids; no pad; CHATML_TEMPLATE its chat
  template. (Qwen2's tokenizer class pads with its `<|endoftext|>`: a token of the
  vocabulary, as in the Qwen checkpoints.)"""
  bos, eos, qwen_pad = "<|begin_of_text|>", "<|end_of_text|>", "<|endoftext|>"
  special = [bos, eos, qwen_pad, "<|im_start|>", "<|im_end|>"]
  return _bos_bpe(folder, texts, vocab_size - len(special), [], special,
                  chat_template=CHATML_TEMPLATE, bos_token=bos, eos_token=eos)


def gemma_tokenizer_files(folder: str, texts: list[str], vocab_size: int = 800) -> TokenizerFiles:
  """Gemma's ids: `<pad>`=0, `<eos>`=1, `<bos>`=2 (which the tokenizer puts before every text),
  `<unk>`=3, in one tokenizer.json of a byte-level BPE (Gemma's own is a SentencePiece BPE: the
  ids and special tokens are what an import reads)."""
  specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
  return _bos_bpe(folder, texts, vocab_size, specials, [], pad_token="<pad>",
                  eos_token="<eos>", bos_token="<bos>", unk_token="<unk>")


def _bos_bpe(folder: str, texts: list[str], vocab_size: int, first: list[str],
             last: list[str], chat_template: str | None = None, **tokens) -> TokenizerFiles:
  """A byte-level BPE (see _byte_level_bpe) that puts its `bos_token` before every text, saved
  as one tokenizer.json with the special `tokens` (bos_token=..., eos_token=...) and the
  `chat_template` if given."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  _byte_level_bpe(folder, texts, vocab_size, first, last)
  vocab, merges = (os.path.join(folder, name) for name in ("vocab.json", "merges.txt"))
  bpe = tokenizers.ByteLevelBPETokenizer(vocab, merges)
  bpe.add_special_tokens(first + last)
  bos = tokens["bos_token"]
  bpe.post_processor = tokenizers.processors.TemplateProcessing(
      single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bpe.token_to_id(bos))])
  os.remove(vocab)
  os.remove(merges)
  tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, **tokens)
  if chat_template:
    tokenizer.chat_template = chat_template
  tokenizer.save_pretrained(folder)
  return _reloaded(folder)


def _byte_level_bpe(folder: str, texts: list[str], vocab_size: int, first: list[str],
                    last: list[str]) -> None:
  """vocab.json + merges.txt of a byte-level BPE with the `first` tokens at ids 0, 1, ... and
  the `last` ones after every merge (RoBERTa's <mask>, GPT-2's <|endoftext|>)."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  os.makedirs(folder, exist_ok=True)
  bpe = tokenizers.ByteLevelBPETokenizer()
  bpe.train_from_iterator(texts, vocab_size=vocab_size, show_progress=False,
                          special_tokens=first)
  bpe.model.save(folder)
  vocab_path = os.path.join(folder, "vocab.json")
  with open(vocab_path, encoding="utf-8") as f:
    vocab = json.load(f)
  for token in last:
    vocab[token] = len(vocab)
  with open(vocab_path, "w", encoding="utf-8") as f:
    json.dump(vocab, f, ensure_ascii=False)


# ---- Tiny models -----------------------------------------------------------------------------

# English, German and Vietnamese sentences for when the shared corpora are absent, so that
# model tests never skip (tokenizers trained on them are smaller, which the models follow).
FALLBACK_SENTENCES = {
    "en": [
        "A man is riding a bicycle down the street.", "Two dogs are playing in the snow.",
        "The children are reading books in the library.", "A woman is cooking dinner.",
        "Tom said he would be back before noon.", "Mary doesn't know where her keys are.",
        "The train to Berlin leaves at seven o'clock.", "We walked along the river at night.",
        "A group of people is standing in front of a building.", "It is raining again today.",
        "My brother plays the guitar in a small band.", "The old house has a red door.",
        "She bought three apples and a loaf of bread.", "Please close the window, it's cold.",
        "A young girl is jumping into a swimming pool.", "They have lived here for ten years.",
        "The cat is sleeping on the warm sofa.", "Can you help me carry these boxes?",
        "Two men are working on the roof of a house.", "I will call you tomorrow morning.",
        "The museum is closed on Mondays.", "A boy in a blue shirt is kicking a ball.",
        "He forgot his umbrella at the office.", "The weather was beautiful last weekend.",
        "A dog runs across the green field.", "Where is the nearest train station?",
        "The teacher explained the problem twice.", "We need more time to finish the work.",
        "A woman in a black dress is singing on stage.", "Tom is older than his sister.",
    ],
    "de": [
        "Ein Mann fährt mit dem Fahrrad die Straße hinunter.", "Zwei Hunde spielen im Schnee.",
        "Die Kinder lesen Bücher in der Bibliothek.", "Eine Frau kocht das Abendessen.",
        "Tom sagte, er sei vor Mittag zurück.", "Maria weiß nicht, wo ihre Schlüssel sind.",
        "Der Zug nach Berlin fährt um sieben Uhr ab.", "Wir gingen nachts am Fluss entlang.",
        "Eine Gruppe von Menschen steht vor einem Gebäude.", "Heute regnet es schon wieder.",
        "Mein Bruder spielt Gitarre in einer kleinen Band.", "Das alte Haus hat eine rote Tür.",
        "Sie kaufte drei Äpfel und ein Brot.", "Bitte schließ das Fenster, es ist kalt.",
        "Ein junges Mädchen springt in ein Schwimmbecken.", "Sie wohnen seit zehn Jahren hier.",
        "Die Katze schläft auf dem warmen Sofa.", "Kannst du mir helfen, diese Kisten zu tragen?",
        "Zwei Männer arbeiten auf dem Dach eines Hauses.", "Ich rufe dich morgen früh an.",
        "Das Museum ist montags geschlossen.", "Ein Junge in einem blauen Hemd tritt einen Ball.",
        "Er hat seinen Regenschirm im Büro vergessen.", "Das Wetter war letztes Wochenende schön.",
        "Ein Hund rennt über die grüne Wiese.", "Wo ist der nächste Bahnhof?",
        "Der Lehrer erklärte das Problem zweimal.", "Wir brauchen mehr Zeit für die Arbeit.",
        "Eine Frau in einem schwarzen Kleid singt auf der Bühne.", "Tom ist älter als seine Schwester.",
    ],
    "vi": [
        "Một người đàn ông đang đạp xe xuống phố.", "Hai con chó đang chơi trong tuyết.",
        "Bọn trẻ đang đọc sách trong thư viện.", "Một người phụ nữ đang nấu bữa tối.",
        "Tom nói anh ấy sẽ về trước buổi trưa.", "Mary không biết chìa khóa của cô ấy ở đâu.",
        "Chuyến tàu đi Hà Nội khởi hành lúc bảy giờ.", "Chúng tôi đi dạo dọc bờ sông vào ban đêm.",
        "Hôm nay trời lại mưa.", "Anh trai tôi chơi ghi-ta trong một ban nhạc nhỏ.",
        "Ngôi nhà cũ có một cánh cửa màu đỏ.", "Cô ấy mua ba quả táo và một ổ bánh mì.",
        "Làm ơn đóng cửa sổ lại, trời lạnh quá.", "Họ đã sống ở đây mười năm rồi.",
        "Con mèo đang ngủ trên chiếc ghế sofa ấm áp.",
        "Bạn có thể giúp tôi mang những cái hộp này không?",
        "Tôi sẽ gọi cho bạn vào sáng mai.", "Bảo tàng đóng cửa vào thứ Hai.",
        "Anh ấy quên chiếc ô ở văn phòng.", "Thời tiết cuối tuần trước rất đẹp.",
        "Ga tàu gần nhất ở đâu?", "Thầy giáo đã giải thích vấn đề hai lần.",
        "Giảng viên nhiệt tình và rất vui tính.", "Giáo trình chưa cụ thể, khó hiểu.",
        "Tom lớn tuổi hơn em gái của anh ấy.",
        "Chúng ta cần thêm thời gian để hoàn thành công việc.",
    ],
}

ENCODER_DECODER, CLASSIFIER, DECODER_ONLY = "encoder_decoder", "encoder_classifier", "decoder_only"
# Label names as a sentiment checkpoint's config.json has them (UIT-VSFC's 0 / 1 / 2).
SENTIMENT_LABELS = ("negative", "neutral", "positive")


@dataclasses.dataclass(frozen=True)
class Kind:
  """A kind of tiny checkpoint the tests build: everything `tiny_model` needs to know of it."""
  model_type: str  # config.json's model_type (pretrained/architecture.py's registry)
  family: str  # the family it imports as
  tokenizer: str  # its tokenizer's builder in _TOKENIZER_BUILDERS (kinds that share one)
  model: str  # its model class and config in _MODEL_BUILDERS
  labels: tuple[str, ...] | None = None  # a classifier's label names (None: no classifier)
  logits_bias: bool = False  # a final_logits_bias that `eos_bias` can raise
  untied: bool = False  # an lm_head of its own, beside the embedding


# The one table of test kinds. The encoder-decoders come first, in this order: their weights'
# seeds derive from it (kept, so their checkpoints stay the same), and test_pretrained_models
# runs its translation tests over them.
KINDS = {
    # T5 v1.0: ReLU, tied output, decoder outputs rescaled.
    "t5": Kind("t5", ENCODER_DECODER, "t5", "t5"),
    # T5 v1.1 / Flan-T5: gated-GELU, untied lm_head; mT5 the same; UMT5 a bias per layer.
    "t5_gated": Kind("t5", ENCODER_DECODER, "t5", "t5", untied=True),
    "mt5": Kind("mt5", ENCODER_DECODER, "t5", "t5", untied=True),
    "umt5": Kind("umt5", ENCODER_DECODER, "t5", "t5"),
    "bart": Kind("bart", ENCODER_DECODER, "bart", "bart", logits_bias=True),
    "mbart": Kind("mbart", ENCODER_DECODER, "bart", "bart", logits_bias=True),  # pre-LN
    # OPUS-MT: scaled embeddings, sinusoidal positions, pad = last id, pad banned.
    "marian": Kind("marian", ENCODER_DECODER, "marian", "marian", logits_bias=True),
    # Post-LN encoders, 64 positions. BERT: uncased WordPiece, [PAD]=0, [SEP]=3 the end token.
    "bert": Kind("bert", CLASSIFIER, "bert", "bert", labels=SENTIMENT_LABELS),
    "bert_bare": Kind("bert", CLASSIFIER, "bert", "bert"),  # BertModel with its pooler
    # Byte-level BPE, <s>=0 <pad>=1 </s>=2, positions offset past the pad, one token type.
    "roberta": Kind("roberta", CLASSIFIER, "roberta", "roberta",
                    labels=("negative", "positive")),
    # SentencePiece with XLM-R's ids, trained on Vietnamese + English; else as roberta.
    "xlm-roberta": Kind("xlm-roberta", CLASSIFIER, "xlmr", "xlm-roberta",
                        labels=SENTIMENT_LABELS),
    # Pre-LN, tied output, 128 positions, `<|endoftext|>` the last id as bos and eos, no pad.
    "gpt2": Kind("gpt2", DECODER_ONLY, "gpt2", "gpt2"),
    # Llama 3: 2 key/value heads for 4 query heads, a head dimension (16) that is not hidden /
    # heads, llama3 RoPE scaling past a 16-token original context, biases on q/k/v/o, its own
    # lm_head; bos <|begin_of_text|> added by the tokenizer, eos <|end_of_text|>, no pad.
    "llama": Kind("llama", DECODER_ONLY, "llama", "llama", untied=True),
    # Mistral: multi-query (1 key/value head), an 8-token sliding window on every layer (shorter
    # than the prompts), tied output.
    "mistral": Kind("mistral", DECODER_ONLY, "llama", "llama"),
    # Qwen2: biases on q/k/v only, 2 key/value heads, linear RoPE scaling, tied output.
    "qwen2": Kind("qwen2", DECODER_ONLY, "llama", "llama"),
    # Qwen3: per-head query and key norms, head_dim 16 (not 32 / 4), 2 key/value heads, an
    # 8-token window on its second layer only (max_window_layers 1), no biases, tied output.
    "qwen3": Kind("qwen3", DECODER_ONLY, "llama", "llama"),
    # The Gemmas (Gemma's ids: pad 0, eos 1, bos 2): (1 + w) norms, embeddings x sqrt(hidden),
    # tanh-GeGLU, 2 key/value heads of 16 dimensions (not 32 / 4), tied output. Gemma with
    # q/k/v/o biases; Gemma 2 with post-sublayer norms, query_pre_attn_scalar 8 (not 16),
    # attention and final soft caps that bite (5 and 3) and an 8-token window on its first
    # layer; Gemma 3 with q/k norms besides, its own RoPE base on the windowed layer, linear
    # RoPE scaling on the global one, a final soft cap (and an attention cap that transformers
    # ignores).
    "gemma": Kind("gemma", DECODER_ONLY, "gemma", "gemma"),
    "gemma2": Kind("gemma2", DECODER_ONLY, "gemma", "gemma"),
    "gemma3_text": Kind("gemma3_text", DECODER_ONLY, "gemma", "gemma"),
    # M2M100 / NLLB-200 (last, so that no other kind's seed moves): pre-LN with final norms,
    # ReLU, scaled embeddings, sinusoidal positions over non-pad tokens, no logits bias. BART's
    # tokenizer (no language codes; tests/test_multilingual.py has NLLB's and M2M100's).
    "m2m_100": Kind("m2m_100", ENCODER_DECODER, "bart", "m2m_100"),
}
ALL_KINDS = tuple(KINDS)
_of_family = lambda family: tuple(k for k, kind in KINDS.items() if kind.family == family)
SEQ2SEQ_KINDS = MODEL_KINDS = _of_family(ENCODER_DECODER)
ENCODER_KINDS = _of_family(CLASSIFIER)  # encoder-only (classifiers)
DECODER_KINDS = _of_family(DECODER_ONLY)  # decoder-only language models
T5_KINDS = tuple(k for k, kind in KINDS.items() if kind.model == "t5")
# Small enough to build and run in well under a second each, big enough to have every part:
# 4 heads (2 per tensor-parallel device), a width that splits 4 ways (fsdp).
# BART-like weights initialise wider than transformers' 0.02 (made for d_model in the
# hundreds), at which a tiny random model repeats one token whatever its input. T5 keeps its
# own scale: its attention scores are not scaled, and wider weights make the softmax so sharp
# that float32 itself (transformers against transformers in float64) drifts past 1e-4.
_T5_SIZES = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                 relative_attention_num_buckets=8, relative_attention_max_distance=20)
_BART_SIZES = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                   decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                   init_std=0.3)
# The encoders and GPT-2 (hidden 32, 2 layers, 4 heads, intermediate 64, as above) initialise
# wider than transformers' 0.02 too: at 0.02 a tiny classifier gives every text nearly the same
# logits and GPT-2 a nearly uniform next-token distribution, which compare equal whatever an
# import gets wrong.
_ENCODER_SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, initializer_range=0.3)
_GPT2_SIZES = dict(n_embd=32, n_layer=2, n_head=4, n_inner=64, initializer_range=0.3)
_TOKENIZERS: dict = {}  # (builder, texts) -> a folder of its files, copied into each model's
# Tokenizer builder -> (the texts it trains on, from (en, de, vi); how it is made in `folder`).
_TOKENIZER_BUILDERS = {
    "t5": (lambda en, de, vi: (en + de,),
           lambda folder, texts: t5_tokenizer_files(folder, texts, vocab_size=700, extra_ids=20)),
    "bart": (lambda en, de, vi: (en + de,),
             lambda folder, texts: bart_tokenizer_files(folder, texts, vocab_size=700)),
    "marian": (lambda en, de, vi: (en, de),
               lambda folder, source, target: marian_tokenizer_files(folder, source, target,
                                                                     vocab_size=400)),
    "bert": (lambda en, de, vi: (en,),
             lambda folder, texts: bert_tokenizer_files(folder, texts, vocab_size=800)),
    "roberta": (lambda en, de, vi: (en,),
                lambda folder, texts: roberta_tokenizer_files(folder, texts, vocab_size=700)),
    "xlmr": (lambda en, de, vi: (vi + en,),
             lambda folder, texts: xlmr_tokenizer_files(folder, texts, vocab_size=800)),
    "gpt2": (lambda en, de, vi: (en,),
             lambda folder, texts: gpt2_tokenizer_files(folder, texts, vocab_size=800)),
    "llama": (lambda en, de, vi: (en + de,),
              lambda folder, texts: llama_tokenizer_files(folder, texts, vocab_size=800)),
    "gemma": (lambda en, de, vi: (en + de,),
              lambda folder, texts: gemma_tokenizer_files(folder, texts, vocab_size=800)),
}


def model_sentences(language: str, count: int = 400) -> list[str]:
  """`count` sentences of 'en', 'de' or 'vi' from the shared corpora, or the built-in ones."""
  return sentences(language, count) or FALLBACK_SENTENCES[language]


def _tokenizer_files(kind: str, folder: str, en: list[str], de: list[str],
                     vi: list[str]) -> TokenizerFiles:
  """The kind's tokenizer files copied into `folder`; each tokenizer is trained once per
  process (kinds with the same builder share it: the T5 kinds, BART and mBART, ...)."""
  builder = KINDS[kind].tokenizer
  texts_of, make = _TOKENIZER_BUILDERS[builder]
  texts = texts_of(en, de, vi)
  key = (builder, *map(tuple, texts))
  if key not in _TOKENIZERS:
    _TOKENIZERS[key] = make(tempfile.mkdtemp(prefix=f"hf_{builder}_tokenizer_"), *texts)
  os.makedirs(folder, exist_ok=True)
  for name in os.listdir(_TOKENIZERS[key].folder):
    shutil.copy(os.path.join(_TOKENIZERS[key].folder, name), folder)
  return dataclasses.replace(_TOKENIZERS[key], folder=folder)


def tiny_model(kind: str, folder: str, *, en: list[str] | None = None,
               de: list[str] | None = None, vi: list[str] | None = None,
               generation: dict | None = None, eos_bias: float = 0.0,
               labels: int | Sequence[str] | None = None, seed: int = 0) -> str:
  """Writes a complete tiny Hugging Face checkpoint of `kind` into `folder` and returns it.

  The folder holds what a hub download holds: config.json, generation_config.json (not the
  encoders': they do not generate), model.safetensors and the tokenizer files, whose pad /
  eos / decoder start ids and size agree with the model's. Weights are random (torch seed
  `seed`), with the parts that initialise to constants (norm scales, BART's
  final_logits_bias; the encoders' and GPT-2's biases) randomised too so that their import is
  tested.

  Args:
    kind: a key of KINDS (what each is: the comments there).
    folder: where to write (created if needed).
    en, de, vi: sentences the tokenizer trains on (see _TOKENIZER_BUILDERS: T5, BART: English
      + German; Marian: source English, target German; BERT, RoBERTa, GPT-2: English; XLM-R:
      Vietnamese + English); `model_sentences` by default.
    generation: generation_config.json values to set, e.g. {"forced_bos_token_id": 0}.
    eos_bias: added to the logits bias of EOS (BART, mBART, Marian: T5 has no bias), so that
      outputs end on their own, at different lengths, as a random model's rarely do.
    labels: the classifiers' labels instead of the kind's: a number of them (transformers'
      names LABEL_0, LABEL_1, ...) or their names (config.json's id2label).
    seed: torch seed of the weights (offset per kind: mT5 and gated T5 differ).
  """
  import torch  # pylint: disable=import-outside-toplevel
  if kind not in KINDS:
    raise ValueError(f"Unknown kind {kind!r}; use one of {ALL_KINDS}.")
  spec = KINDS[kind]
  if eos_bias and not spec.logits_bias:
    raise ValueError(f"eos_bias: {kind} has no logits bias.")
  if labels is not None and spec.labels is None:
    raise ValueError(f"labels: {kind} has no classifier; use one of "
                     f"{tuple(k for k, other in KINDS.items() if other.labels)}.")
  if generation and spec.family == CLASSIFIER:
    raise ValueError(f"generation: {kind} does not generate.")
  en = model_sentences("en") if en is None else en
  de = model_sentences("de") if de is None else de
  vi = model_sentences("vi") if vi is None else vi
  files = _tokenizer_files(kind, folder, en, de, vi)
  generation = dict(generation or {})
  model_class, config = _MODEL_BUILDERS[spec.model](
      kind, files, generation, spec.labels if labels is None else labels)
  # The encoder-decoders keep the seeds they had before the other kinds came.
  kinds = MODEL_KINDS if kind in MODEL_KINDS else ALL_KINDS
  torch.manual_seed(seed * len(kinds) + kinds.index(kind))
  model = model_class(config).eval()
  with torch.no_grad():
    for name, param in model.named_parameters():
      if "layer_norm" in name or "layernorm" in name:
        param.add_(0.1 * torch.randn_like(param))
      elif spec.family != ENCODER_DECODER and (_is_norm(name) or name.endswith(".bias")):
        # BERT's LayerNorm, GPT-2's ln_*, and the biases these initialise to zero.
        param.add_(0.1 * torch.randn_like(param))
    if hasattr(model, "final_logits_bias"):
      model.final_logits_bias.copy_(0.1 * torch.randn_like(model.final_logits_bias))
      model.final_logits_bias[0, files.eos_id] += eos_bias
    if spec.untied:
      # Untied: an lm_head of its own, stored beside the embedding.
      model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
  if generation:
    for key, value in generation.items():
      setattr(model.generation_config, key, value)
    model.generation_config._from_model_config = False  # pylint: disable=protected-access
  model.save_pretrained(folder)
  return folder


def folder_maker(tmp_path_factory):
  """kind -> a tiny checkpoint folder (`tiny_model`), each made on its first use: a test
  module's fixture returns this."""
  made = {}

  def get(kind: str) -> str:
    if kind not in made:
      made[kind] = tiny_model(kind, str(tmp_path_factory.mktemp(kind)))
    return made[kind]

  return get


def _t5(kind: str, files: TokenizerFiles, generation: dict, labels):
  """T5, mT5, UMT5: (model class, config); the ids are the tokenizer's."""
  del generation, labels
  import transformers  # pylint: disable=import-outside-toplevel
  # Rounded up past the tokenizer like t5-small's 32128 rows for 32100 pieces: rows no
  # piece uses, and a vocabulary that splits over tensor-parallel devices.
  sizes = dict(_T5_SIZES, vocab_size=-(-files.vocab_size // 8) * 8, pad_token_id=files.pad_id,
               eos_token_id=files.eos_id, decoder_start_token_id=files.pad_id)
  model_type = KINDS[kind].model_type
  config_class, model_class = {
      "t5": (transformers.T5Config, transformers.T5ForConditionalGeneration),
      "mt5": (transformers.MT5Config, transformers.MT5ForConditionalGeneration),
      "umt5": (transformers.UMT5Config, transformers.UMT5ForConditionalGeneration)}[model_type]
  extra = {}
  if kind != "t5":
    extra["feed_forward_proj"] = "gated-gelu"
  if KINDS[kind].untied:
    extra["tie_word_embeddings"] = False
  return model_class, config_class(**sizes, **extra)


def _bart(kind: str, files: TokenizerFiles, generation: dict, labels):
  """BART, mBART: (model class, config)."""
  del generation, labels
  import transformers  # pylint: disable=import-outside-toplevel
  config_class, model_class = {
      "bart": (transformers.BartConfig, transformers.BartForConditionalGeneration),
      "mbart": (transformers.MBartConfig, transformers.MBartForConditionalGeneration)}[kind]
  # mBART's config leaves decoder_start_token_id unset (transformers' default: generation
  # then starts from bos); BART's is eos.
  return model_class, config_class(
      **_BART_SIZES, vocab_size=files.vocab_size, max_position_embeddings=64,
      bos_token_id=files.tokenizer.bos_token_id, pad_token_id=files.pad_id,
      eos_token_id=files.eos_id, forced_eos_token_id=files.eos_id)


def _m2m_100(kind: str, files: TokenizerFiles, generation: dict, labels):
  """M2M100: (model class, config); its generation config forces EOS last, as BART's does
  (M2M100Config has no such field of its own)."""
  del kind, labels
  import transformers  # pylint: disable=import-outside-toplevel
  generation.setdefault("forced_eos_token_id", files.eos_id)
  return transformers.M2M100ForConditionalGeneration, transformers.M2M100Config(
      **_BART_SIZES, vocab_size=files.vocab_size, max_position_embeddings=64,
      bos_token_id=files.tokenizer.bos_token_id, pad_token_id=files.pad_id,
      eos_token_id=files.eos_id, decoder_start_token_id=files.eos_id)


def _marian(kind: str, files: TokenizerFiles, generation: dict, labels):
  """OPUS-MT: (model class, config); its generation config bans the pad token."""
  del kind, labels
  import transformers  # pylint: disable=import-outside-toplevel
  # As every OPUS-MT generation_config.json: never generate the pad token.
  generation.setdefault("bad_words_ids", [[files.pad_id]])
  return transformers.MarianMTModel, transformers.MarianConfig(
      **_BART_SIZES, vocab_size=files.vocab_size, max_position_embeddings=128,
      pad_token_id=files.pad_id, eos_token_id=files.eos_id,
      decoder_start_token_id=files.pad_id, forced_eos_token_id=files.eos_id,
      scale_embedding=True, share_encoder_decoder_embeddings=True)


def _gpt2(kind: str, files: TokenizerFiles, generation: dict, labels):
  """GPT-2: (model class, config)."""
  del kind, generation, labels
  import transformers  # pylint: disable=import-outside-toplevel
  end = files.eos_id  # <|endoftext|>: GPT-2 starts and ends texts with it, and pads with none
  return transformers.GPT2LMHeadModel, transformers.GPT2Config(
      **_GPT2_SIZES, vocab_size=files.vocab_size, n_positions=128, bos_token_id=end,
      eos_token_id=end, pad_token_id=None)


def _encoder(kind: str, files: TokenizerFiles, generation: dict,
             labels: int | Sequence[str] | None):
  """BERT, RoBERTa, XLM-R: (model class, config), a classifier of `labels`."""
  del generation
  import transformers  # pylint: disable=import-outside-toplevel
  if labels is None:  # bert_bare: no classifier, so no labels in its config
    names = {}
  elif isinstance(labels, int):
    names = {"num_labels": labels}
  else:
    names = {"id2label": dict(enumerate(labels)),
             "label2id": {name: i for i, name in enumerate(labels)}}
  sizes = dict(_ENCODER_SIZES, vocab_size=files.vocab_size, **names)
  if kind in ("bert", "bert_bare"):
    model_class = (transformers.BertForSequenceClassification if kind == "bert" else
                   transformers.BertModel)
    # As bert-base-uncased: pad 0 and no bos / eos ids ([CLS] and [SEP] are the tokenizer's).
    return model_class, transformers.BertConfig(
        **sizes, max_position_embeddings=64, type_vocab_size=2, pad_token_id=files.pad_id)
  tokenizer = files.tokenizer
  config_class, model_class = {
      "roberta": (transformers.RobertaConfig, transformers.RobertaForSequenceClassification),
      "xlm-roberta": (transformers.XLMRobertaConfig,
                      transformers.XLMRobertaForSequenceClassification)}[kind]
  # Positions count from pad + 1 (fairseq's convention), so 64 tokens need pad + 1 more
  # rows: roberta-base's 514 for 512.
  return model_class, config_class(
      **sizes, max_position_embeddings=64 + tokenizer.pad_token_id + 1, type_vocab_size=1,
      pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
      eos_token_id=tokenizer.eos_token_id)


def _llama(kind: str, files: TokenizerFiles, generation: dict, labels):
  """Llama, Mistral, Qwen2, Qwen3: (model class, config), each with the quirks KINDS names."""
  del generation, labels
  import transformers  # pylint: disable=import-outside-toplevel
  tokenizer = files.tokenizer
  sizes = dict(vocab_size=files.vocab_size, hidden_size=32, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
               initializer_range=0.3, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id, pad_token_id=None, rms_norm_eps=1e-5)
  if kind == "llama":
    return transformers.LlamaForCausalLM, transformers.LlamaConfig(
        **sizes, num_key_value_heads=2, head_dim=16, attention_bias=True,
        tie_word_embeddings=False, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=4.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=16))
  if kind == "mistral":
    return transformers.MistralForCausalLM, transformers.MistralConfig(
        **sizes, num_key_value_heads=1, sliding_window=8, tie_word_embeddings=True)
  if kind == "qwen3":
    return transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
        **sizes, num_key_value_heads=2, head_dim=16, use_sliding_window=True, sliding_window=8,
        max_window_layers=1, tie_word_embeddings=True)
  return transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
      **sizes, num_key_value_heads=2, tie_word_embeddings=True,
      rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))


def _gemma(kind: str, files: TokenizerFiles, generation: dict, labels):
  """Gemma, Gemma 2, Gemma 3 (text): (model class, config), with the quirks KINDS names."""
  del generation, labels
  import transformers  # pylint: disable=import-outside-toplevel
  tokenizer = files.tokenizer
  sizes = dict(vocab_size=files.vocab_size, hidden_size=32, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=128, initializer_range=0.3, rms_norm_eps=1e-5,
               pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id)
  if kind == "gemma":
    return transformers.GemmaForCausalLM, transformers.GemmaConfig(
        **sizes, attention_bias=True, rope_parameters=dict(rope_type="default",
                                                          rope_theta=1000.0))
  window = dict(sliding_window=8, query_pre_attn_scalar=8, attn_logit_softcapping=5.0,
                final_logit_softcapping=3.0)
  if kind == "gemma2":
    return transformers.Gemma2ForCausalLM, transformers.Gemma2Config(**sizes, **window)
  # Gemma 3's attention cap is set too: transformers never applies it, and nor may an import.
  return transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
      **sizes, **window, layer_types=["sliding_attention", "full_attention"],
      rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=100.0),
                           full_attention=dict(rope_type="linear", rope_theta=10000.0,
                                               factor=2.0)))


# Model builder -> (kind, tokenizer files, generation_config values, labels) -> (model class,
# config); it may add generation values (Marian's banned pad).
_MODEL_BUILDERS = {"t5": _t5, "bart": _bart, "marian": _marian, "m2m_100": _m2m_100, "bert": _encoder,
                   "roberta": _encoder, "xlm-roberta": _encoder, "gpt2": _gpt2,
                   "llama": _llama, "gemma": _gemma}


def _is_norm(name: str) -> bool:
  """Whether a parameter is a layer norm's: BERT's `LayerNorm`, GPT-2's `ln_1`, `ln_f`,
  Llama's and Gemma's `*_layernorm`, q/k norms (`q_norm`, `k_norm`) and final `norm`."""
  return ("layernorm" in name.lower() or ".ln_" in f".{name}"
          or name.endswith("norm.weight"))


def prompt_holding_its_continuation(model, bos_id: int, seed: int = 0) -> list[int]:
  """Ids of a prompt (BOS and 8 random tokens) that holds the token a transformers causal LM
  `model` would pick next: where the repetition penalty counts the prompt, it changes the
  greedy output; where it counts the output alone, it does not."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  with torch.no_grad():
    while True:
      ids = [bos_id] + rng.integers(5, model.config.vocab_size - 10, size=8).tolist()
      if int(model(torch.tensor([ids])).logits[0, -1].argmax()) in ids:
        return ids
