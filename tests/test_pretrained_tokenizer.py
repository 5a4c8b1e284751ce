"""PretrainedTokenizer against transformers itself: T5, BART, Marian, BERT, RoBERTa, XLM-R and
GPT-2 tokenizer files trained here on real English, German and Vietnamese sentences give the
checkpoint's own ids, renumbered (pad 0, eos 1; BERT's [SEP] is its eos, GPT-2's pad an added
id), and decode as transformers decodes."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import transformers

from tests import hf_fixtures
from tests.conftest import ROOT
from transformer_jax.data import pipeline
from transformer_jax.pretrained import tokenizer as pretrained_tokenizer
from transformer_jax.pretrained.vocab import VocabMap

PretrainedTokenizer = pretrained_tokenizer.PretrainedTokenizer
TRAIN, TEST = 600, 250  # sentences per language: tokenizers train on some, are tested on others


@pytest.fixture(scope="session")
def corpus():
  texts = {language: hf_fixtures.sentences(language, TRAIN + TEST) for language in
           ("en", "de", "vi")}
  dialogues = hf_fixtures.dialogues(10)
  if dialogues is None or any(lines is None for lines in texts.values()):
    pytest.skip(f"the shared corpora are not in {hf_fixtures.SHARED}")
  return {"train": {k: v[:TRAIN] for k, v in texts.items()},
          "test": {**{k: v[TRAIN:] for k, v in texts.items()}, "dialogues": dialogues}}


@pytest.fixture(scope="session")
def t5_files(corpus, tmp_path_factory):
  train = corpus["train"]
  return hf_fixtures.t5_tokenizer_files(str(tmp_path_factory.mktemp("t5")),
                                        train["en"] + train["de"] + train["vi"])


@pytest.fixture(scope="session")
def bart_files(corpus, tmp_path_factory):
  train = corpus["train"]
  return hf_fixtures.bart_tokenizer_files(str(tmp_path_factory.mktemp("bart")),
                                          train["en"] + train["vi"])


@pytest.fixture(scope="session")
def marian_files(corpus, tmp_path_factory):
  return hf_fixtures.marian_tokenizer_files(str(tmp_path_factory.mktemp("marian")),
                                            corpus["train"]["en"], corpus["train"]["de"])


@pytest.fixture(scope="module")
def bert_files(corpus, tmp_path_factory):
  train = corpus["train"]
  return hf_fixtures.bert_tokenizer_files(str(tmp_path_factory.mktemp("bert")),
                                          train["en"] + train["vi"])


@pytest.fixture(scope="module")
def roberta_files(corpus, tmp_path_factory):
  train = corpus["train"]
  return hf_fixtures.roberta_tokenizer_files(str(tmp_path_factory.mktemp("roberta")),
                                             train["en"] + train["vi"])


@pytest.fixture(scope="module")
def xlmr_files(corpus, tmp_path_factory):
  train = corpus["train"]
  return hf_fixtures.xlmr_tokenizer_files(str(tmp_path_factory.mktemp("xlmr")),
                                          train["vi"] + train["en"])


@pytest.fixture(scope="module")
def gpt2_files(corpus, tmp_path_factory):
  train = corpus["train"]
  return hf_fixtures.gpt2_tokenizer_files(str(tmp_path_factory.mktemp("gpt2")),
                                          train["en"] + train["vi"], vocab_size=1000)


def _assert_matches_hf(tok, hf, texts, target=False):
  """Every text: encode == HF ids minus EOS, renumbered; + EOS == HF ids; decode == HF's.
  (BERT has no eos: its sequences end with [SEP].)"""
  hf_ids = [hf(text_target=t)["input_ids"] if target else hf(t)["input_ids"] for t in texts]
  encode = tok.encode_target if target else tok.encode
  batch = (tok.encode_target_batch if target else tok.encode_batch)(texts)
  end = hf.sep_token_id if hf.eos_token_id is None else hf.eos_token_id
  for text, expected, batch_ids in zip(texts, hf_ids, batch):
    assert expected[-1] == end
    ids = encode(text)
    assert ids == batch_ids == tok.vocab_map.internal(expected[:-1]).tolist(), text
    assert 0 not in ids and 1 not in ids  # pad and eos are the pipeline's to add
    with_eos = pipeline.with_eos(ids, 10_000)
    assert with_eos.tolist() == tok.vocab_map.internal(expected).tolist()
    # Padding after the EOS is how decoders hand their outputs over.
    assert tok.decode(np.concatenate([with_eos, [0, 0]])) == hf.decode(
        expected, skip_special_tokens=True)


def test_t5_ids_are_the_checkpoints_in_english_german_and_vietnamese(t5_files, corpus):
  tok = PretrainedTokenizer(t5_files.folder)
  assert tok.vocab_map.is_identity and tok.ends_with_eos  # T5 has pad 0, eos 1 already
  assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, None)
  assert tok.vocab_size == len(t5_files.tokenizer) == t5_files.vocab_size
  for texts in corpus["test"].values():
    _assert_matches_hf(tok, t5_files.tokenizer, texts)
    _assert_matches_hf(tok, t5_files.tokenizer, texts[:20], target=True)
  sentinel = t5_files.tokenizer.convert_tokens_to_ids("<extra_id_0>")
  assert tok.id_to_piece(sentinel) == "<extra_id_0>"
  assert tok.decode(tok.encode("Zwei Hunde spielen im Schnee.")) == "Zwei Hunde spielen im Schnee."


def test_bart_keeps_its_leading_bos_and_renumbers_pad_and_eos(bart_files, corpus):
  hf = bart_files.tokenizer
  assert (hf.bos_token_id, hf.pad_token_id, hf.eos_token_id, hf.unk_token_id) == (0, 1, 2, 3)
  assert hf.mask_token_id == len(hf) - 1
  tok = PretrainedTokenizer(bart_files.folder, VocabMap.create(len(hf) + 3, 1, 2))
  # <pad> 1 -> 0, </s> 2 -> 1, and <s> takes the freed id 2.
  assert tok.to_internal([0, 1, 2, 3]) == [2, 0, 1, 3] and tok.ends_with_eos
  assert tok.to_hf(1) == tok.eos_id == 2
  assert tok.to_internal(hf.eos_token_id) == 1  # BART's decoder_start_token_id
  for texts in (corpus["test"]["en"], corpus["test"]["vi"], corpus["test"]["dialogues"]):
    _assert_matches_hf(tok, hf, texts)
  ids = tok.encode("Hai con chó chơi trong tuyết.")
  assert tok.id_to_piece(ids[0]) == "<s>" and ids[0] == 2
  assert tok.decode(ids) == "Hai con chó chơi trong tuyết."
  # Ids past the tokenizer (the model's spare embedding rows) decode to nothing.
  assert tok.decode(ids + [len(hf) + 1]) == "Hai con chó chơi trong tuyết."


def test_marian_encodes_sources_and_targets_with_their_own_models(marian_files, corpus):
  hf = marian_files.tokenizer
  assert (hf.eos_token_id, hf.unk_token_id, hf.pad_token_id) == (0, 1, len(hf) - 1)
  tok = PretrainedTokenizer(marian_files.folder, vocab_size=len(hf), pad_id=len(hf) - 1,
                            eos_id=0)
  assert tok.to_internal([hf.pad_token_id, hf.eos_token_id]) == [0, 1] and tok.ends_with_eos
  english, german = corpus["test"]["en"], corpus["test"]["de"]
  _assert_matches_hf(tok, hf, english)
  _assert_matches_hf(tok, hf, german, target=True)
  # The two SentencePiece models split German differently: target ids are not source ids.
  assert sum(tok.encode(t) != tok.encode_target(t) for t in german) > len(german) // 2
  for text in german[:50]:  # decoded with the target model, as transformers 4 did by default
    hf_ids = hf(text_target=text)["input_ids"]
    assert tok.decode(tok.encode_target(text)) == hf.decode(
        hf_ids, skip_special_tokens=True, use_source_tokenizer=False)


def test_bert_ends_with_sep_and_keeps_its_leading_cls(bert_files, corpus):
  hf = bert_files.tokenizer
  assert (hf.pad_token_id, hf.unk_token_id, hf.cls_token_id, hf.sep_token_id,
          hf.mask_token_id) == (0, 1, 2, 3, 4)
  assert hf.eos_token_id is None and hf.bos_token_id is None  # [SEP] is BERT's end token
  for tok in (PretrainedTokenizer(bert_files.folder),
              PretrainedTokenizer(bert_files.folder, VocabMap.create(len(hf), 0, 3))):
    # [PAD] stays 0, [SEP] 3 -> 1 and [UNK] takes the freed id 3.
    assert tok.to_internal([0, 1, 2, 3]) == [0, 3, 2, 1] and tok.ends_with_eos
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 3, None)
    for texts in (corpus["test"]["en"], corpus["test"]["vi"]):
      _assert_matches_hf(tok, hf, texts)
  ids = tok.encode("Two dogs are playing in the snow.")
  assert tok.id_to_piece(ids[0]) == "[CLS]" and ids[0] == 2 and 1 not in ids
  assert tok.id_to_piece(1) == "[SEP]"
  # Uncased: lower-cased, accents stripped, as transformers decodes it.
  assert tok.decode(ids) == "two dogs are playing in the snow."
  assert tok.decode(tok.encode("Hai con chó chơi.")) == "hai con cho choi."


@pytest.mark.parametrize("name", ["roberta", "xlmr"])
def test_roberta_and_xlm_r_keep_their_leading_bos(name, roberta_files, xlmr_files, corpus):
  files = {"roberta": roberta_files, "xlmr": xlmr_files}[name]
  hf = files.tokenizer
  assert (hf.bos_token_id, hf.pad_token_id, hf.eos_token_id, hf.unk_token_id) == (0, 1, 2, 3)
  assert hf.sep_token_id == 2 and hf.mask_token_id == len(hf) - 1
  tok = PretrainedTokenizer(files.folder, VocabMap.create(len(hf), 1, 2))
  assert tok.to_internal([0, 1, 2, 3]) == [2, 0, 1, 3] and tok.ends_with_eos
  for texts in (corpus["test"]["en"], corpus["test"]["vi"]):
    _assert_matches_hf(tok, hf, texts)
  ids = tok.encode("Một con chó chơi trong tuyết.")
  assert tok.id_to_piece(ids[0]) == "<s>" and ids[0] == 2
  assert tok.decode(ids) == "Một con chó chơi trong tuyết."
  if name == "xlmr":  # SentencePiece ids + 1, as fairseq numbers them
    pieces = hf.convert_ids_to_tokens(hf("tuyết")["input_ids"])
    assert pieces[0] == "<s>" and pieces[1].startswith("▁") and pieces[-1] == "</s>"


def test_gpt2_gets_an_added_pad_and_appends_nothing(gpt2_files, corpus, tmp_path):
  hf = gpt2_files.tokenizer
  end = len(hf) - 1  # <|endoftext|>: bos, eos and unk at once; no pad
  assert (hf.bos_token_id, hf.eos_token_id, hf.unk_token_id, hf.pad_token_id) == (
      end, end, end, None)
  tok = PretrainedTokenizer(gpt2_files.folder)
  assert tok.vocab_map.added_pad and tok.vocab_map.checkpoint_size == len(hf)
  assert len(tok.vocab_map.to_hf) == len(hf) + 1 and tok.vocab_size == len(hf)
  assert (tok.pad_id, tok.eos_id) == (len(hf), end) and tok.ends_with_eos
  assert tok.to_internal([end, len(hf)]) == [1, 0] and tok.id_to_piece(0) == "<pad>"
  for texts in (corpus["test"]["en"], corpus["test"]["vi"], corpus["test"]["dialogues"]):
    batch = tok.encode_batch(texts)
    for text, batch_ids in zip(texts, batch):
      expected = hf(text)["input_ids"]
      ids = tok.encode(text)
      # Nothing to strip: the ids are transformers' own, and the EOS is the pipeline's.
      assert ids == batch_ids == tok.vocab_map.internal(expected).tolist(), text
      assert 0 not in ids and 1 not in ids
      with_eos = pipeline.with_eos(ids, 10_000)
      assert tok.to_hf(with_eos) == expected + [end]
      # Byte-level BPE loses nothing: the text comes back whole, the added pad dropped.
      assert tok.decode(np.concatenate([with_eos, [0, 0]])) == text
      assert tok.decode([0] + ids) == text
  # A literal <|endoftext|> that ends a text is text, not an appended EOS: it is kept.
  assert tok.encode("The end.<|endoftext|>")[-1] == 1
  # The import's vocab map (pad added) is accepted; a pad the tokenizer lacks is not.
  loaded = PretrainedTokenizer(gpt2_files.folder, VocabMap.create(len(hf), None, end))
  assert loaded.encode("A dog.") == tok.encode("A dog.")
  with pytest.raises(ValueError, match="has pad id none and eos id .* but the model has pad "
                                       "5 .*not this checkpoint's"):
    PretrainedTokenizer(gpt2_files.folder, VocabMap.create(len(hf), 5, end))
  # save() writes tokenizer.json alone (GPT-2's file names are vocab.json and merges.txt).
  tok.save(tmp_path / "saved")
  again = PretrainedTokenizer.load(tmp_path / "saved", tok.vocab_map)
  assert again.model_proto == tok.model_proto and again.encode("A dog.") == tok.encode("A dog.")


def test_gpt2_fine_tunes_that_pad_with_eos_get_an_added_pad(gpt2_files, tmp_path):
  folder = tmp_path / "pad_is_eos"
  shutil.copytree(gpt2_files.folder, folder)
  config = json.loads((folder / "tokenizer_config.json").read_text())
  (folder / "tokenizer_config.json").write_text(
      json.dumps(dict(config, pad_token="<|endoftext|>")))
  hf = gpt2_files.tokenizer
  tok = PretrainedTokenizer(folder)
  assert tok.hf_tokenizer.pad_token_id == len(hf) - 1 == tok.eos_id
  assert tok.vocab_map.added_pad and tok.pad_id == len(hf)


def test_a_language_code_after_eos_is_not_an_ending_the_pipeline_makes(xlmr_files, tmp_path):
  """mBART-cc25 style (`text </s> en_XX`): ends_with_eos is False (the import refuses it)."""
  folder = tmp_path / "cc25"
  folder.mkdir()
  shutil.copy(os.path.join(xlmr_files.folder, "sentencepiece.bpe.model"), folder)
  transformers.MBartTokenizer.from_pretrained(folder, src_lang="en_XX").save_pretrained(folder)
  tok = PretrainedTokenizer(folder)
  hf_ids = tok.hf_tokenizer("A dog.")["input_ids"]
  assert tok.hf_tokenizer.convert_ids_to_tokens(hf_ids[-2:]) == ["</s>", "en_XX"]
  assert not tok.ends_with_eos
  assert tok.encode("A dog.") == tok.to_internal(hf_ids)  # the tail is kept, not cut


def test_phobert_loads_its_vocab_txt_and_bpe_codes(tmp_path):
  """PhoBERT (model_type roberta, PhobertTokenizer): fastBPE codes over word-segmented text."""
  merges = ["H a", "Ha i</w>", "c o", "co n</w>", "c h", "t r", "tr o", "tro n", "tron g</w>",
            "t u", "tu y", "tuy ế", "tuyế t</w>"]
  pieces = ["Hai", "con", "ch@@", "ó", "trong", "tuyết", "."]
  (tmp_path / "vocab.txt").write_text("".join(f"{piece} 1\n" for piece in pieces))
  (tmp_path / "bpe.codes").write_text("".join(f"{merge} 1\n" for merge in merges))
  (tmp_path / "config.json").write_text(json.dumps(
      {"model_type": "roberta", "tokenizer_class": "PhobertTokenizer"}))
  tok = PretrainedTokenizer(tmp_path)
  hf = tok.hf_tokenizer
  assert type(hf).__name__ == "PhobertTokenizer"
  assert (hf.bos_token_id, hf.pad_token_id, hf.eos_token_id, hf.unk_token_id) == (0, 1, 2, 3)
  assert tok.to_internal([0, 1, 2, 3]) == [2, 0, 1, 3] and tok.ends_with_eos
  text = "Hai con chó trong tuyết ."
  expected = hf(text)["input_ids"]
  assert hf.convert_ids_to_tokens(expected) == [
      "<s>", "Hai", "con", "ch@@", "ó", "trong", "tuyết", ".", "</s>"]
  assert pipeline.with_eos(tok.encode(text), 100).tolist() == tok.to_internal(expected)
  assert tok.decode(tok.encode(text)) == text
  unknown = hf("con mèo")["input_ids"]  # m, è, o: no piece
  assert hf.unk_token_id in unknown and tok.encode("con mèo") == tok.to_internal(unknown[:-1])


def test_model_proto_survives_save_and_load_and_tells_tokenizers_apart(
    t5_files, bart_files, marian_files, tmp_path):
  for files in (t5_files, bart_files, marian_files):
    tok = PretrainedTokenizer(files.folder)
    tok.save(tmp_path / os.path.basename(files.folder) / "tokenizer")
    loaded = PretrainedTokenizer.load(tmp_path / os.path.basename(files.folder) / "tokenizer")
    assert loaded.model_proto == tok.model_proto
    assert loaded.encode_batch(["Ein Hund läuft.", "Một con chó."]) == tok.encode_batch(
        ["Ein Hund läuft.", "Một con chó."])
  protos = {PretrainedTokenizer(f.folder).model_proto
            for f in (t5_files, bart_files, marian_files)}
  assert len(protos) == 3
  changed = PretrainedTokenizer(t5_files.folder)
  changed.hf_tokenizer.add_tokens(["<new>"])
  assert changed.model_proto != PretrainedTokenizer(t5_files.folder).model_proto


def test_save_and_load_through_a_bucket(bart_files, gcs_emulator):
  # A fresh process: bucket clients read STORAGE_EMULATOR_HOST when they start.
  script = (
      "import os, sys\n"
      "from transformer_jax import workdir\n"
      "from transformer_jax.pretrained.tokenizer import PretrainedTokenizer as T\n"
      "tok = T(sys.argv[1])\n"
      "tok.save('gs://test-bucket/tok')\n"
      "(workdir.path('gs://test-bucket/tok') / 'model.safetensors').write_bytes(b'weights')\n"
      "loaded = T.load('gs://test-bucket/tok')\n"
      "assert loaded.model_proto == tok.model_proto\n"
      "assert loaded.encode('Một con chó.') == tok.encode('Một con chó.')\n"
      "print(sorted(os.listdir(loaded._download.name)))\n")  # weights are not downloaded
  environ = dict(os.environ, STORAGE_EMULATOR_HOST=gcs_emulator, PYTHONPATH=ROOT)
  result = subprocess.run([sys.executable, "-c", script, bart_files.folder], env=environ,
                          capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip() == "['tokenizer.json', 'tokenizer_config.json']"


def test_tokenizer_files_that_do_not_load_or_fit_are_clear_errors(t5_files, bart_files,
                                                                    tmp_path):
  with pytest.raises(ValueError, match="is not a folder"):
    PretrainedTokenizer(tmp_path / "missing")
  with pytest.raises(ValueError, match="do not load.*copy the checkpoint's tokenizer files"):
    PretrainedTokenizer(tmp_path)  # an empty folder
  model_only = tmp_path / "model_only"  # transformers 5 alone would make a placeholder vocab
  model_only.mkdir()
  (model_only / "config.json").write_text('{"model_type": "t5"}')
  with pytest.raises(ValueError, match="none of the files of a T5Tokenizer"):
    PretrainedTokenizer(model_only)
  broken = tmp_path / "broken"
  shutil.copytree(t5_files.folder, broken)
  os.remove(broken / "spiece.model")
  (broken / "tokenizer.json").write_text("{not json")
  with pytest.raises(ValueError, match=r"broken/tokenizer\.json is not valid JSON"):
    PretrainedTokenizer(broken)
  # BART's tokenizer files next to a T5 model: pad 1 / eos 2 against the model's 0 / 1.
  with pytest.raises(ValueError, match="pad id 1 and eos id 2 but the model has pad 0 and "
                                       "eos 1.*not this checkpoint's"):
    PretrainedTokenizer(bart_files.folder, VocabMap.create(32128, 0, 1))
  with pytest.raises(ValueError, match="embedding rows"):
    PretrainedTokenizer(t5_files.folder, vocab_size=100)
