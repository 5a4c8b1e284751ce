"""Multilingual checkpoints against transformers: M2M100 / NLLB-200 (`m2m_100`, NLLB also with
`legacy_behaviour`) and mBART-50 / mBART-cc25.

Tiny tokenizers are trained here on English and Vietnamese sentences and saved by transformers
as NLLB's, M2M100's and mBART's files (with their language codes); tiny random models are
written by transformers beside them. For every kind: the tokenizer's ids with
config.source_lang / target_lang equal transformers' with src_lang / tgt_lang; teacher-forced
logits equal PyTorch's on padded batches; greedy outputs equal `generate(forced_bos_token_id=
<target code>)` (cc25: the decoder starting from it) in both directions, through `--mode
predict --pretrained` and `Predictor.from_pretrained`. Batches mixing directions decode each
row as alone and train as transformers does; wrong language settings are one line.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tensorboard.backend.event_processing import event_accumulator

from tests import cli
from tests import hf_fixtures
from tests.test_continuous_batching import through_the_pool
from transformer_jax import commands
from transformer_jax import config_validation
from transformer_jax import default_config
from transformer_jax import families
from transformer_jax import predict
from transformer_jax import workdir as workdir_lib
from transformer_jax.data import directions
from transformer_jax.data import features
from transformer_jax.data import pipeline
from transformer_jax.model import layers
from transformer_jax.model import models
from transformer_jax.pretrained import checkpoint as checkpoint_lib
from transformer_jax.pretrained import run_files
from transformer_jax.pretrained import tokenizer as tokenizer_lib
from transformer_jax.serving import batch_decoder
from transformer_jax.serving import slot_pool

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW_TOKENS = 10
NLLB_CODES = ("eng_Latn", "vie_Latn", "deu_Latn", "fra_Latn")
# kind -> (source code, target code) for en -> vi, in the checkpoint's own codes.
CODES = {"nllb": ("eng_Latn", "vie_Latn"), "m2m100": ("en", "vi"),
         "mbart50": ("en_XX", "vi_VN"), "nllb_legacy": ("eng_Latn", "vie_Latn"),
         "cc25": ("en_XX", "vi_VN")}
SUFFIX_KINDS = ("nllb_legacy", "cc25")  # `X </s> [code]`
KINDS = tuple(CODES)
_SIZES = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
              decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, init_std=0.3,
              max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2,
              decoder_start_token_id=2)


@pytest.fixture(scope="module")
def texts():
  """(English, Vietnamese) sentences: 300 each to train on, the rest held out."""
  en, vi = hf_fixtures.model_sentences("en", 400), hf_fixtures.model_sentences("vi", 400)
  return en, vi


@dataclasses.dataclass
class Built:
  folder: str
  hf_tokenizer: Any
  torch_model: Any
  checkpoint: checkpoint_lib.Checkpoint
  params: dict


@pytest.fixture(scope="module")
def built(texts, tmp_path_factory):
  """kind -> a tiny checkpoint folder of it (NLLB, M2M100: m2m_100; mBART-50: mbart)."""
  model = hf_fixtures.fairseq_spm_model(texts[0][:300] + texts[1][:300])
  result = {}
  for seed, kind in enumerate(KINDS):
    folder = str(tmp_path_factory.mktemp(kind))
    tok = hf_fixtures.multilingual_tokenizer_files(kind, folder, model, NLLB_CODES)
    torch.manual_seed(seed)
    if kind in ("mbart50", "cc25"):
      torch_model = transformers.MBartForConditionalGeneration(transformers.MBartConfig(
          **_SIZES, vocab_size=hf_fixtures.rows_for(tok), scale_embedding=True)).eval()
    else:
      torch_model = transformers.M2M100ForConditionalGeneration(transformers.M2M100Config(
          **_SIZES, vocab_size=hf_fixtures.rows_for(tok))).eval()
    with torch.no_grad():
      for name, param in torch_model.named_parameters():
        if "layer_norm" in name or "layernorm" in name:
          param.add_(0.1 * torch.randn_like(param))
    torch_model.save_pretrained(folder)
    checkpoint = checkpoint_lib.open_checkpoint(folder)
    result[kind] = Built(folder, tok, torch_model, checkpoint,
                         checkpoint_lib.read_params(checkpoint))
  return result


def _tokenizer(b: Built, source: str, target: str) -> tokenizer_lib.PretrainedTokenizer:
  tok = tokenizer_lib.PretrainedTokenizer(b.folder, b.checkpoint.vocab)
  tok.set_languages(source, target)
  return tok


def _hf_tokenizer(b: Built, source: str, target: str):
  return transformers.AutoTokenizer.from_pretrained(b.folder, src_lang=source, tgt_lang=target)


def test_t2t_table_equals_transformers():
  for dim in (16, 17):
    reference = transformers.models.m2m_100.modeling_m2m_100.M2M100SinusoidalPositionalEmbedding\
        .get_embedding(40, dim, padding_idx=1).numpy()
    # float32 both; numpy's and PyTorch's sin / exp differ in the last bit or two.
    np.testing.assert_allclose(layers.sinusoidal_positions_t2t(38, dim), reference[2:],
                               atol=2e-6, rtol=0)
  positions = layers.non_pad_positions(jnp.array([[0, 0, 5, 6, 7], [5, 6, 0, 0, 0]]))
  np.testing.assert_array_equal(positions, [[0, 0, 0, 1, 2], [0, 1, 0, 0, 0]])


@pytest.mark.parametrize("kind", KINDS)
def test_tokenizer_ids_equal_transformers(built, texts, kind):
  b = built[kind]
  en, vi = texts
  for source, target, sources, targets in ((*CODES[kind], en, vi),
                                           (*CODES[kind][::-1], vi, en)):
    ours, theirs = _tokenizer(b, source, target), _hf_tokenizer(b, source, target)
    vocab = b.checkpoint.vocab
    for text, text_target in zip(sources, targets):
      expected = theirs(text, text_target=text_target)
      assert vocab.hf(_ended(kind, ours.encode(text))).tolist() == expected["input_ids"]
      assert vocab.hf(_ended(kind, ours.encode_target(text_target))).tolist() == (
          expected["labels"])
    assert ours.encode_batch(sources[:5]) == [ours.encode(t) for t in sources[:5]]
    assert ours.encode_target_batch(targets[:5]) == [ours.encode_target(t)
                                                      for t in targets[:5]]
    # The source is tagged with the source code: first, or last after </s>.
    code = theirs.get_lang_id(source) if kind == "m2m100" else theirs.convert_tokens_to_ids(
        source)
    assert vocab.hf(_ended(kind, ours.encode(sources[0])))[
        -1 if kind in SUFFIX_KINDS else 0] == code


def _short(texts, count: int, start: int = 300, tok=None) -> tuple[list[str], list[str]]:
  """`count` held-out (English, Vietnamese) pairs of at most 120 characters each; with the
  (shared SentencePiece) `tok`, of 15 to 29 pieces each, so that every prompt (with its
  code, EOS and a many-direction run's target code) falls into the one 32-token length bucket
  of generation: one compilation."""
  fits = lambda text: len(text) < 120 and (
      tok is None or 15 <= len(tok(text, add_special_tokens=False)["input_ids"]) <= 29)
  if len(texts[0]) <= start:  # hf_fixtures' built-in sentences (no shared corpora): all read
    start = 0
  pairs = [(e, v) for e, v in zip(*(t[start:] for t in texts)) if fits(e) and fits(v)]
  assert len(pairs) >= count
  return [e for e, _ in pairs[:count]], [v for _, v in pairs[:count]]


def _ended(kind: str, ids: list[int], max_len: int = 512) -> np.ndarray:
  """A sequence as the family ends it: + EOS, or as it is where the code follows EOS."""
  return (pipeline.with_own_end if kind in SUFFIX_KINDS else pipeline.with_eos)(ids, max_len)


def _padded(kind: str, rows: list[list[int]], extra: int = 0) -> np.ndarray:
  return _stacked([_ended(kind, r) for r in rows], extra)


def _stacked(rows, extra: int = 0) -> np.ndarray:
  """Rows padded to the longest + `extra`."""
  length = max(len(r) for r in rows) + extra
  return np.stack([np.pad(r, (0, length - len(r))) for r in rows])


@pytest.mark.parametrize("kind", KINDS)
def test_teacher_forced_logits_equal_pytorch(built, texts, kind):
  b = built[kind]
  tok = _tokenizer(b, *CODES[kind])
  en, vi = _short(texts, 4)
  inputs = _padded(kind, [tok.encode(t) for t in en])
  targets = _padded(kind, [tok.encode_target(t) for t in vi], extra=1)
  assert len(set((inputs != 0).sum(1))) > 1  # rows padded differently
  # mBART-cc25's decoder starts from the target code (the import sets the model's bos_id to
  # it), the others' from </s>.
  start = tok.code_id(CODES[kind][1]) if kind == "cc25" else b.checkpoint.fields["bos_id"]
  family = families.from_model_config(
      "encoder_decoder", models.TransformerConfig(**dict(b.checkpoint.fields, bos_id=start)))
  ours = np.asarray(jax.jit(lambda p, i, t: family.forward(
      p, {"inputs": i, "targets": t}, deterministic=True))(b.params, inputs, targets))
  vocab = b.checkpoint.vocab
  decoder_inputs = np.asarray(models.shift_right(jnp.asarray(targets), start))
  if kind == "cc25":  # transformers' own shift: the labels' last token (the code) first
    labels = torch.tensor(np.where(targets != 0, vocab.hf(targets), -100))
    shifted = transformers.models.mbart.modeling_mbart.shift_tokens_right(labels, 1).numpy()
    assert (shifted == vocab.hf(decoder_inputs))[targets != 0].all()
  with torch.no_grad():
    reference = b.torch_model(
        input_ids=torch.tensor(vocab.hf(inputs)), attention_mask=torch.tensor(inputs != 0),
        decoder_input_ids=torch.tensor(vocab.hf(decoder_inputs))).logits.numpy()
  reference = reference[..., vocab.to_hf]
  valid = targets != 0
  np.testing.assert_allclose(ours[valid], reference[valid], atol=1e-4, rtol=0)
  assert np.ptp(reference[valid]) > 0.1


def _serving_config(source: str, target: str):
  config = default_config.get_config()
  config.source_lang, config.target_lang = source, target
  config.decoding.method = "greedy"
  config.decoding.max_decode_len = NEW_TOKENS
  return config


def _hf_generate(b: Built, sentences: list[str], source: str, target: str) -> list[str]:
  tok = _hf_tokenizer(b, source, target)
  batch = tok(sentences, return_tensors="pt", padding=True)
  code = tok.convert_tokens_to_ids(target) if not hasattr(tok, "get_lang_id") else (
      tok.get_lang_id(target))
  # mBART-cc25 starts decoding from the target code; the others force it as the first token.
  start = dict(decoder_start_token_id=code) if type(tok).__name__ == "MBartTokenizer" else (
      dict(forced_bos_token_id=code))
  with torch.no_grad():
    out = b.torch_model.generate(**batch, **start, num_beams=1, do_sample=False,
                                 max_new_tokens=NEW_TOKENS)
  return out, tok


def _generated_texts(out, tok) -> list[str]:
  """generate's rows as text, the decoder start and the codes left out."""
  return [tok.decode([i for i in row[1:] if i not in tok.all_special_ids and i < len(tok)],
                     skip_special_tokens=True) for row in out.numpy()]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_generate_in_both_directions(built, texts, tmp_path, monkeypatch, kind):
  """Each direction through `--mode predict --pretrained` (its output file) and the
  Predictor.from_pretrained it makes (ids), against generate(forced_bos_token_id=<target
  code>); mBART-cc25's decoder starts from the target code instead (decoder_start_token_id).
  The Predictor the command makes is kept to compare ids: one compilation per direction."""
  made, from_pretrained = [], predict.Predictor.from_pretrained.__func__

  def recorded(cls, *args, **kwargs):  # the real one, its Predictor kept
    made.append(from_pretrained(cls, *args, **kwargs))
    return made[-1]

  monkeypatch.setattr(predict.Predictor, "from_pretrained", classmethod(recorded))
  b = built[kind]
  en, vi = _short(texts, 4, start=330, tok=built["nllb"].hf_tokenizer)
  vocab = b.checkpoint.vocab
  for (source, target), sentences in ((CODES[kind], en), (CODES[kind][::-1], vi)):
    out, tok = _hf_generate(b, sentences, source, target)
    reference = _generated_texts(out, tok)
    assert not any(target in t or f"__{target}__" in t for t in reference)
    source_file, output = tmp_path / f"{source}.txt", tmp_path / f"{source}.out"
    source_file.write_text("\n".join(sentences) + "\n", encoding="utf-8")
    code, stderr = cli.main_in_process(
        monkeypatch, "--pretrained", b.folder, "--mode", "predict", "--input", str(source_file),
        "--output", str(output), f"--config.source_lang={source}",
        f"--config.target_lang={target}", "--config.decoding.method=greedy",
        f"--config.decoding.max_decode_len={NEW_TOKENS}")
    assert code == 0, stderr
    assert output.read_text(encoding="utf-8").splitlines() == reference

    predictor = made.pop()
    assert (predictor.config.source_lang, predictor.config.target_lang) == (source, target)
    prompts = list(predictor._prompts(sentences).values())  # pylint: disable=protected-access
    for row, ids in zip(out.numpy(), predictor.output_ids(prompts)):
      expected = [int(i) for i in row[1:] if i != tok.pad_token_id]
      got = [int(i) for i in vocab.hf(ids)]
      assert got[:got.index(2) + 1 if 2 in got else None] == expected
      if kind != "cc25":  # the target code first (cc25's decoder starts from it)
        assert got[0] == (tok.get_lang_id(target) if kind == "m2m100" else
                          tok.convert_tokens_to_ids(target))


def test_predict_cli_equals_generate(built, texts, tmp_path):
  b = built["nllb"]
  sentences = _short(texts, 4, start=350, tok=built["nllb"].hf_tokenizer)[1]
  out, tok = _hf_generate(b, sentences, "vie_Latn", "eng_Latn")
  expected = [tok.decode(row[2:], skip_special_tokens=True) for row in out.numpy()]
  result = subprocess.run(
      [sys.executable, "-m", "transformer_jax.main", "--pretrained", b.folder, "--mode",
       "predict", "--config.source_lang=vie_Latn", "--config.target_lang=eng_Latn",
       "--config.decoding.method=greedy", f"--config.decoding.max_decode_len={NEW_TOKENS}"],
      input="\n".join(sentences) + "\n", cwd=cli.ROOT, env=cli.env(), capture_output=True,
      text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.splitlines() == expected


def test_an_unknown_code_is_one_line_naming_close_matches(built, tmp_path):
  output = tmp_path / "out.txt"
  result = subprocess.run(
      [sys.executable, "-m", "transformer_jax.main", "--pretrained", built["nllb"].folder,
       "--mode", "predict", "--output", str(output), "--config.target_lang=vie_Latm"],
      input="xin chào\n", cwd=cli.ROOT, env=cli.env(), capture_output=True, text=True,
      timeout=300)
  assert result.returncode != 0
  assert ("Unknown language code config.target_lang='vie_Latm' for this checkpoint (4 codes; "
          "close matches: vie_Latn") in result.stderr
  assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
  assert not output.exists()


def _refused_before_training(folder: str, config, tmp_path) -> str:
  """The error of fine-tuning `folder` with `config`, which must come before anything is
  written."""
  from transformer_jax import train  # pylint: disable=import-outside-toplevel
  config.pretrained, workdir = folder, tmp_path / "refused"
  with pytest.raises(checkpoint_lib.PretrainedError) as raised:
    train.train_and_evaluate(config, str(workdir))
  assert not workdir.exists()
  return str(raised.value)


def test_a_missing_target_code_is_one_line(built, tmp_path):
  expected = (
      f"{built['m2m100'].folder} is a multilingual checkpoint: set the language to translate "
      "into, --config.target_lang=CODE (e.g. vi; and --config.source_lang for the source).")
  with pytest.raises(checkpoint_lib.PretrainedError) as raised:
    predict.Predictor.from_pretrained(built["m2m100"].folder, _serving_config("en", ""))
  assert str(raised.value) == expected
  assert _refused_before_training(built["m2m100"].folder, _serving_config("en", ""),
                                  tmp_path) == expected


def test_codes_for_a_checkpoint_without_them_are_refused(tmp_path):
  folder = hf_fixtures.tiny_model("bart", str(tmp_path / "bart"))
  with pytest.raises(checkpoint_lib.PretrainedError, match="has no language codes: drop "
                     "config.source_lang / config.target_lang"):
    predict.Predictor.from_pretrained(folder, _serving_config("", "vi"))
  assert "has no language codes: drop config.source_lang" in _refused_before_training(
      folder, _serving_config("", "vi"), tmp_path)
  config = _serving_config("", "")
  config.directions = "en-vi,vi-en"
  with pytest.raises(checkpoint_lib.PretrainedError, match="has no language codes: "
                     "config.directions needs a multilingual checkpoint"):
    predict.Predictor.from_pretrained(folder, config)


def test_directions_are_checked_before_anything_runs():
  config = default_config.get_config()
  config.directions, config.language_codes = " en-vi, vi-en ", "en=eng_Latn, vi=vie_Latn"
  assert directions.pairs(config) == [("en", "vi"), ("vi", "en")]
  assert directions.codes(config) == {"en": "eng_Latn", "vi": "vie_Latn"}
  assert config_validation.problems(config) == [
      "config.directions translates with a multilingual encoder-decoder checkpoint: set "
      "config.task='translation' and config.pretrained (NLLB-200, M2M100, mBART-50)"]
  config.pretrained = "facebook/nllb-200-distilled-600M"
  assert config_validation.problems(config) == []
  for key, value, message in (("directions", "en", "write each direction as SOURCE-TARGET"),
                              ("directions", "en-en", "write each direction as SOURCE-TARGET"),
                              ("language_codes", "en:eng_Latn", "write DATA_LANGUAGE=CODE")):
    bad = default_config.get_config()
    bad.pretrained, bad[key] = "x", value
    assert any(message in problem for problem in config_validation.problems(bad))


# ---- Many directions in one run ------------------------------------------------------------

def _directions_config(b: Built, kind: str = "nllb"):
  config = _serving_config("", "")
  config.pretrained = b.folder
  (en, vi) = CODES[kind]
  config.directions, config.language_codes = "en-vi,vi-en", f"en={en},vi={vi}"
  return config


# The prefix kinds (M2M100, mBART-50) work as NLLB's; the suffix kinds each their own way
# (NLLB legacy: the code forced first; mBART-cc25: the decoder starts from it).
@pytest.mark.parametrize("kind", ("nllb", *SUFFIX_KINDS))
def test_a_mixed_batch_decodes_each_row_as_alone(built, texts, kind):
  b = built[kind]
  predictor = predict.Predictor.from_pretrained(b.folder, _directions_config(b, kind))
  tok, family, vocab = predictor.tokenizer, predictor.family, b.checkpoint.vocab
  en, vi = _short(texts, 2, start=360, tok=built["nllb"].hf_tokenizer)
  examples = []  # en -> vi and vi -> en rows, alternating, as the data pipeline tags them
  for e, v in zip(en, vi):
    for (source, target), (text, text_target) in ((CODES[kind], (e, v)),
                                                   (CODES[kind][::-1], (v, e))):
      examples.append({"source": text, "target": text_target, "source_lang": source,
                       "target_lang": target})
  encoded, _ = features.encode_examples(family, examples, tok)
  # Evaluation's prompts: each source, its end (`X </s> [code]` for the suffix kinds) and
  # its row's target code.
  prompts = family.prompts(encoded)
  for example, prompt in zip(examples, prompts):
    with tok.using_languages(example["source_lang"], example["target_lang"]):
      ended = _ended(kind, tok.encode(example["source"]), predictor.config.max_source_length)
      np.testing.assert_array_equal(prompt, np.append(ended, tok.code_id(example["target_lang"])))
  mixed = predictor.output_ids(prompts)
  _check_served_rows(predictor, prompts, mixed)
  for example, prompt, ids in zip(examples, prompts, mixed):
    np.testing.assert_array_equal(ids, predictor.output_ids([prompt])[0])
    # ... and as transformers' generate for that row's own direction.
    out, _ = _hf_generate(b, [example["source"]], example["source_lang"],
                          example["target_lang"])
    got = [int(i) for i in vocab.hf(ids)]
    assert got[:got.index(2) + 1 if 2 in got else None] == [
        int(i) for i in out.numpy()[0, 1:] if i != 1]

  # Training on the mixed batch: teacher-forced logits equal PyTorch's given the labels, from
  # which transformers makes the decoder inputs itself (mBART: each from its own code).
  inputs = _stacked([p[:-1] for p in prompts])
  targets = _stacked(list(encoded.features["targets"]), extra=1)
  ours = np.asarray(jax.jit(lambda p, i, t: family.forward(
      p, {"inputs": i, "targets": t}, deterministic=True))(b.params, inputs, targets))
  with torch.no_grad():
    reference = b.torch_model(
        input_ids=torch.tensor(vocab.hf(inputs)), attention_mask=torch.tensor(inputs != 0),
        labels=torch.tensor(np.where(targets != 0, vocab.hf(targets), -100))).logits.numpy()
  valid = targets != 0
  np.testing.assert_allclose(ours[valid], reference[..., vocab.to_hf][valid], atol=1e-4, rtol=0)


def _check_served_rows(predictor, prompts, expected):
  """The server's decodes of mixed-direction rows (a static batch of all; a two-slot pool
  they enter as others finish) give each row the ids one-call decoding gives: its own
  target code first (or its decoder started from it)."""
  decoder = batch_decoder.BatchDecoder(predictor, len(prompts))
  rows = [batch_decoder.Row(p, NEW_TOKENS) for p in prompts]
  pooled = through_the_pool(slot_pool.SlotPool(batch_decoder.BatchDecoder(predictor, 2)), rows)
  for i, (output, ids) in enumerate(zip(decoder.decode(rows), expected)):
    ids = np.asarray(ids)
    ids = ids[:np.flatnonzero(ids == 1)[0] + 1] if (ids == 1).any() else ids  # through EOS
    np.testing.assert_array_equal(output.ids, ids)
    np.testing.assert_array_equal(pooled[i].ids, ids)


def test_the_files_a_run_keeps_and_exports_keep_the_language_codes(built, texts, tmp_path):
  """What a fine-tuning run copies into WORKDIR/pretrained/ and an export writes back, for
  every kind (a run fine-tuning NLLB exports below): transformers reloads the same tokenizer,
  legacy_behaviour included, with the same codes and ids in both directions."""
  en, vi = _short(texts, 10)
  for kind, b in built.items():
    workdir = str(tmp_path / kind)
    run_files.save_files(b.checkpoint, workdir)
    for source, target in (CODES[kind], CODES[kind][::-1]):
      theirs = _hf_tokenizer(b, source, target)
      reloaded = transformers.AutoTokenizer.from_pretrained(
          str(run_files.files_dir(workdir)), src_lang=source, tgt_lang=target)
      assert type(reloaded) is type(theirs)
      assert getattr(reloaded, "legacy_behaviour", None) == getattr(theirs, "legacy_behaviour",
                                                                   None)
      sources, targets = (en, vi) if source == CODES[kind][0] else (vi, en)
      ours, expected = (tok(sources, text_target=targets) for tok in (reloaded, theirs))
      assert (ours["input_ids"], ours["labels"]) == (expected["input_ids"], expected["labels"])


def _parallel_folder(folder) -> str | None:
  """Tatoeba's aligned English / Vietnamese sentences as train / validation files; None
  where the shared corpora are not here."""
  root = os.path.join(hf_fixtures.SHARED, "tatoeba")
  if not os.path.isdir(root):
    return None
  os.makedirs(folder, exist_ok=True)
  for suffix, name in (("en", "tatoeba.vie-eng.eng"), ("vi", "tatoeba.vie-eng.vie")):
    with open(os.path.join(root, name), encoding="utf-8") as f:
      lines = [line.strip() for line in f][:96]
    for split, part in (("train", lines[:80]), ("validation", lines[80:])):
      with open(os.path.join(folder, f"{split}.{suffix}"), "w", encoding="utf-8") as f:
        f.write("\n".join(part) + "\n")
  return str(folder)


def test_fine_tuning_both_directions_and_export(built, tmp_path):
  from transformer_jax import train  # pylint: disable=import-outside-toplevel
  b = built["nllb"]
  data_dir = _parallel_folder(tmp_path / "data")
  if data_dir is None:
    pytest.skip("the shared corpora (Tatoeba vie-eng) are not here")
  config = _directions_config(b)
  config.update(dataset="local", data_dir=data_dir, eval_split="validation",
                max_source_length=32, max_target_length=32, per_device_batch_size=8,
                learning_rate=2e-3, warmup_steps=2, log_every_steps=4, num_generate_examples=8,
                num_train_steps=12, eval_every_steps=6, checkpoint_every_steps=12,
                checkpoint_best_metric="chrf")
  config.attention_images.layers = ()
  workdir = str(tmp_path / "run")
  last = train.train_and_evaluate(config, workdir)
  for direction in ("en-vi", "vi-en"):
    assert {f"{direction}_bleu", f"{direction}_chrf", f"{direction}_chrf++"} <= set(last)
  assert last["chrf"] == pytest.approx((last["en-vi_chrf"] + last["vi-en_chrf"]) / 2)
  record = event_accumulator.EventAccumulator(os.path.join(workdir, "eval"))
  record.Reload()
  losses = [e.value for e in record.Scalars("loss")]
  assert len(losses) == 2 and losses[-1] < losses[0]
  assert {"chrf", "chrf++", "en-vi_chrf", "vi-en_bleu"} <= set(record.Tags()["scalars"])

  output = str(tmp_path / "exported")
  commands.run_export(workdir, output)
  reloaded = transformers.AutoTokenizer.from_pretrained(output, src_lang="vie_Latn",
                                                        tgt_lang="eng_Latn")
  assert reloaded.convert_tokens_to_ids(list(NLLB_CODES)) == (
      b.hf_tokenizer.convert_tokens_to_ids(list(NLLB_CODES)))
  # Predicting names one direction: its source tagging, its target code after the prompt.
  saved = workdir_lib.load_config(workdir)
  saved.source_lang, saved.target_lang = "vie_Latn", "eng_Latn"
  one = predict.Predictor.from_workdir(workdir, config=saved)
  prompt = one.family.prompt(one.tokenizer.encode("Tôi yêu bạn."))
  assert b.checkpoint.vocab.hf(prompt).tolist() == (
      reloaded("Tôi yêu bạn.")["input_ids"] + [reloaded.convert_tokens_to_ids("eng_Latn")])

  predictor = predict.Predictor.from_workdir(workdir)
  with predictor.tokenizer.using_languages("vie_Latn", "eng_Latn"):
    ids = predictor.tokenizer.encode("Tôi yêu bạn.")
  assert b.checkpoint.vocab.hf(pipeline.with_eos(ids, 32)).tolist() == (
      reloaded("Tôi yêu bạn.")["input_ids"])
  params = predictor.layout.checkpoint_state(predictor.device_params)
  inputs = np.array([ids + [1], (ids + [1])[:4] + [0] * (len(ids) - 3)])
  targets = np.array([[5, 9, 11, 1], [7, 1, 0, 0]])
  ours = np.asarray(predictor.family.model.apply({"params": params}, jnp.asarray(inputs),
                                                 jnp.asarray(targets), deterministic=True))
  decoder_inputs = np.asarray(models.shift_right(jnp.asarray(targets),
                                                 predictor.family.model_config.bos_id))
  vocab = b.checkpoint.vocab
  model = transformers.AutoModelForSeq2SeqLM.from_pretrained(output).eval()
  with torch.no_grad():
    theirs = model(input_ids=torch.tensor(vocab.hf(inputs)),
                   attention_mask=torch.tensor(inputs != 0),
                   decoder_input_ids=torch.tensor(vocab.hf(decoder_inputs))).logits.numpy()
  np.testing.assert_allclose(ours[targets != 0], theirs[..., vocab.to_hf][targets != 0],
                             atol=1e-4, rtol=0)
