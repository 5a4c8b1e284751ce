"""PretrainedTokenizer against transformers itself: T5, BART and Marian tokenizer files trained
here on real English, German and Vietnamese sentences give the checkpoint's own ids, renumbered
(pad 0, eos 1), and decode as transformers decodes."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

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


def _assert_matches_hf(tok, hf, texts, target=False):
  """Every text: encode == HF ids minus EOS, renumbered; + EOS == HF ids; decode == HF's."""
  hf_ids = [hf(text_target=t)["input_ids"] if target else hf(t)["input_ids"] for t in texts]
  encode = tok.encode_target if target else tok.encode
  batch = (tok.encode_target_batch if target else tok.encode_batch)(texts)
  for text, expected, batch_ids in zip(texts, hf_ids, batch):
    assert expected[-1] == hf.eos_token_id
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
  with pytest.raises(ValueError, match="do not load"):
    PretrainedTokenizer(broken)
  # BART's tokenizer files next to a T5 model: pad 1 / eos 2 against the model's 0 / 1.
  with pytest.raises(ValueError, match="pad id 1 and eos id 2 but the model has pad 0 and "
                                       "eos 1.*not this checkpoint's"):
    PretrainedTokenizer(bart_files.folder, VocabMap.create(32128, 0, 1))
  with pytest.raises(ValueError, match="embedding rows"):
    PretrainedTokenizer(t5_files.folder, vocab_size=100)
