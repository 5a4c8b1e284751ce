"""The three task families end to end: packing leaves no trace, decoder-only generation, the
task metrics, and the shared-corpus configs training for a few steps."""

import collections
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import ROOT
from transformer_jax import commands
from transformer_jax import config_validation
from transformer_jax import default_config
from transformer_jax import families
from transformer_jax import metrics
from transformer_jax import predict
from transformer_jax import run_data
from transformer_jax import tasks
from transformer_jax import train
from transformer_jax import workdir as workdir_lib
from transformer_jax.data import hf_source
from transformer_jax.data import pipeline
from transformer_jax.model import models

SHARED = os.path.join(ROOT, "..", "shared", "data")
TINY = dict(vocab_size=64, emb_dim=16, num_heads=2, num_layers=1, qkv_dim=16, mlp_dim=32,
            max_len=40, dropout_rate=0.0)


def _random_sequences(rng, n, low, high, vocab):
  return [np.asarray(list(rng.integers(4, vocab, rng.integers(low, high))) + [1], np.int32)
          for _ in range(n)]


@pytest.mark.parametrize("family", ["encoder_decoder", "decoder_only"])
def test_packed_examples_score_as_if_alone(family):
  """Every packed segment gets exactly the logits of its example run on its own: no attention
  across segments, positions and the shifted input restart per segment."""
  rng = np.random.default_rng(0)
  config = models.TransformerConfig(**TINY)
  family_object = families.from_model_config(family, config)
  if family == "encoder_decoder":
    data = pipeline.Encoded({"inputs": _random_sequences(rng, 5, 2, 7, 64),
                             "targets": _random_sequences(rng, 5, 2, 7, 64)},
                            {"inputs": 24, "targets": 24})
  else:
    data = pipeline.Encoded({"targets": _random_sequences(rng, 5, 2, 7, 64)}, {"targets": 24})
  params = family_object.init_params(jax.random.PRNGKey(0))
  packed = pipeline.pad_rows(data, [[0, 1, 2], [3, 4]], pack=True)
  assert packed["targets_segmentation"].max() == 3  # several examples per row
  packed_logits = family_object.forward(params, packed, deterministic=True)
  alone = family_object.forward(params, pipeline.pad_rows(data, [[i] for i in range(5)], False),
                                deterministic=True)
  for row, examples in enumerate([[0, 1, 2], [3, 4]]):
    for segment, i in enumerate(examples, start=1):
      in_segment = packed["targets_segmentation"][row] == segment
      np.testing.assert_allclose(packed_logits[row][in_segment],
                                 alone[i][:in_segment.sum()], rtol=1e-5, atol=1e-5)


def test_decoder_only_generation_equals_recomputing_the_whole_sequence():
  """Batched, right-padded prompts of different lengths through the KV cache give the same
  greedy tokens as running the full model on `prompt + output so far` one row at a time."""
  family = families.from_model_config("decoder_only", models.TransformerConfig(**TINY))
  model = family.model
  params = family.init_params(jax.random.PRNGKey(3))
  prompts = _random_sequences(np.random.default_rng(1), 3, 1, 9, 64)
  padded = np.zeros((3, 10), np.int32)
  for row, prompt in enumerate(prompts):
    padded[row, :len(prompt)] = prompt
  decoding = default_config.get_config().decoding
  decoding.update(method="greedy", max_decode_len=6)
  generate = functools.partial(family.decode, decoding_config=decoding)
  tokens, _ = jax.jit(generate)(params, jnp.asarray(padded), jax.random.PRNGKey(0))
  outputs = np.asarray(tokens[:, 0])  # the best (only) output of each row
  for prompt, output in zip(prompts, outputs):
    tokens = list(prompt)  # SOURCE <eos>; each step appends the argmax after the last token
    for _ in range(6):
      logits = model.apply({"params": params}, jnp.asarray([tokens + [5]]), deterministic=True)
      tokens.append(int(jnp.argmax(logits[0, len(tokens)])))
    expected = np.asarray(tokens[len(prompt):])
    eos = np.flatnonzero(expected == 1)
    if eos.size:
      expected[eos[0] + 1:] = 0
    np.testing.assert_array_equal(output, expected)


def test_rouge_and_macro_f1_literal_values():
  scores = metrics.rouge(["the cat"], ["the cat sat"])
  assert scores["rouge1"] == pytest.approx(80.0)  # P 1, R 2/3
  assert scores["rouge2"] == pytest.approx(200 / 3)  # P 1, R 1/2
  assert scores["rougeL"] == pytest.approx(80.0)
  assert metrics.classification_scores([0, 0, 1, 1], [0, 1, 1, 1], 2) == pytest.approx(
      {"accuracy": 0.75, "macro_f1": (2 / 3 + 4 / 5) / 2})
  assert metrics.classification_scores([0, 0], [0, 0], 3)["macro_f1"] == pytest.approx(1 / 3)


def _write_sentiment(folder):
  os.makedirs(folder, exist_ok=True)
  rng = np.random.default_rng(0)
  words = {0: ["awful", "dull", "bad"], 1: ["great", "fun", "good"]}
  for split, n in (("train", 400), ("dev", 40), ("test", 40)):
    with open(os.path.join(folder, f"{split}.tsv"), "w") as f:
      f.write("label\tsentence\n")
      for _ in range(n):
        label = int(rng.integers(2))
        f.write(f"{label}\tthe film was {rng.choice(words[label])} and long\n")


def test_classification_trains_evaluates_and_predicts_label_names(tmp_path):
  _write_sentiment(str(tmp_path / "data"))
  config = default_config.get_config()
  config.update(task="classification", dataset="local", data_dir=str(tmp_path / "data"),
                max_source_length=16, num_train_steps=60, per_device_batch_size=16,
                learning_rate=3e-3, warmup_steps=10, label_smoothing=0.0, log_every_steps=20,
                eval_every_steps=60, checkpoint_every_steps=60)
  config.local.update(format="tsv")
  config.splits.update(validation="dev")
  config.model.update(TINY, max_len=16, num_classes=2)
  result = train.train_and_evaluate(config, str(tmp_path / "run"))
  assert set(result) >= {"loss", "accuracy", "macro_f1"}
  assert result["accuracy"] == 1.0  # one word decides the label: learnt in 60 steps
  evaluated = commands.run_evaluate(str(tmp_path / "run"))
  assert evaluated["split"] == "test" and evaluated["accuracy"] == 1.0
  # A classifier decodes nothing: no decoding settings in its results or folder name.
  assert "decoding" not in evaluated
  assert evaluated["outputs"] == str(tmp_path / "run" / "eval" / "step_60" / "test")
  saved = json.loads((tmp_path / "run" / "eval" / "step_60" / "test" / "metrics.json")
                     .read_text())
  assert saved["accuracy"] == 1.0 and "decoding_config" not in saved
  predictor = predict.Predictor.from_workdir(str(tmp_path / "run"))
  assert predictor.predict(["the film was great and long", "", "the film was dull"]) == [
      "positive", "", "negative"]
  # JSON lines: the label and every class's probability.
  source, output = tmp_path / "in.txt", tmp_path / "out.jsonl"
  source.write_text("the film was dull\n")
  commands.run_predict(str(tmp_path / "run"), str(source), str(output), output_format="jsonl")
  record = json.loads(output.read_text())
  assert record["source"] == "the film was dull" and record["label"] == "negative"
  assert set(record["probabilities"]) == {"negative", "positive"}
  assert sum(record["probabilities"].values()) == pytest.approx(1.0, abs=1e-5)
  assert record["probabilities"]["negative"] > 0.5


def _load_config(name, *args):
  return default_config.load(os.path.join(ROOT, "configs", f"{name}.py"), *args)


@pytest.mark.parametrize("name,folder", [("multi30k", "multi30k"), ("sst2", "sst2"),
                                         ("dialogsum", "dialogsum"),
                                         ("dialogsum_decoder_only", "dialogsum")])
def test_shared_corpus_configs_train_a_few_steps(tmp_path, name, folder):
  if not os.path.isdir(os.path.join(SHARED, folder)):
    pytest.skip(f"{SHARED}/{folder} is not here")
  config = _load_config(name)
  config.data_dir = os.path.join(SHARED, folder)
  # The config's data, tokenizer and task; a smaller model, 2 steps, 8 generated outputs.
  config.update(num_train_steps=2, eval_every_steps=2, checkpoint_every_steps=2,
                log_every_steps=1, num_generate_examples=8, per_device_batch_size=8)
  config.model.update(vocab_size=1000, emb_dim=16, num_heads=2, num_layers=1, qkv_dim=16,
                      mlp_dim=32)
  config.decoding.update(method="greedy", max_decode_len=8)
  result = train.train_and_evaluate(config, str(tmp_path))
  metric = {"multi30k": "bleu", "sst2": "macro_f1"}.get(name, "rougeL")
  assert np.isfinite(result["loss"]) and metric in result


def test_every_config_file_loads_and_builds_its_model():
  for path in sorted(os.listdir(os.path.join(ROOT, "configs"))):
    if path.endswith(".py"):
      config = _load_config(path[:-3])
      config.lock()
      family = families.get(config)
      shapes = jax.eval_shape(lambda f=family: f.init_params(jax.random.PRNGKey(0)))
      assert jax.tree.leaves(shapes), path


# Every config with a Hugging Face Hub variant: (config, its ':' argument, the Hub id).
HUB_VARIANTS = [
    ("wmt14_en_de", "hub", "wmt/wmt14"), ("wmt14_de_en", "hub", "wmt/wmt14"),
    ("cnn_dailymail", "hub", "abisee/cnn_dailymail"), ("dialogsum", "hub", "knkarthick/dialogsum"),
    ("sst2", "hub", "stanfordnlp/sst2"), ("imdb_reviews", "hub", "stanfordnlp/imdb"),
    ("uit_vsfc", "hub", "uitnlp/vietnamese_students_feedback"),
    ("multi30k", "hub", "bentrevett/multi30k"),
    ("flan_t5_dialogsum", "base,hub", "knkarthick/dialogsum"),
    ("gpt2_dialogsum", "hub", "knkarthick/dialogsum"),
    ("llm_dialogsum", "llama3.2,hub", "knkarthick/dialogsum"),
    ("qwen_multi30k", "hub", "bentrevett/multi30k"),
    ("bert_sst2", "hub,roberta", "stanfordnlp/sst2"),
    ("xlmr_uit_vsfc", "phobert,hub", "uitnlp/vietnamese_students_feedback"),
    ("opus_mt_multi30k", "hub", "bentrevett/multi30k"),
    ("multi30k_gpu", "hub", "bentrevett/multi30k"),
    ("dialogsum_decoder_only", "hub", "knkarthick/dialogsum"),
    ("cnn_dailymail_decoder_only", "hub", "abisee/cnn_dailymail"),
]


def _hub_layouts():
  """Each Hub dataset's columns and split names as its card gives them, a few rows a split
  (train long enough for the configs' slices of it), every text starting with its field's
  name: {Hub id: {split: Dataset}}."""
  import datasets  # pylint: disable=import-outside-toplevel
  text, classes = datasets.Value("string"), datasets.ClassLabel

  def splits(names=("train", "validation", "test"), unlabelled=(), **features):
    def row(split, i):
      values = {}
      for column, feature in features.items():
        if isinstance(feature, datasets.Translation):
          values[column] = {lang: f"{lang} {split} {i}" for lang in feature.languages}
        elif isinstance(feature, classes):
          values[column] = -1 if split in unlabelled else i % feature.num_classes
        else:
          values[column] = f"{column} {split} {i}" if feature == text else i
      return values
    return {name: datasets.Dataset.from_list([row(name, i) for i in range(size)],
                                             features=datasets.Features(features))
            for name, size in zip(names, (1200, 20, 20))}

  return {
      "wmt/wmt14": splits(translation=datasets.Translation(languages=["de", "en"])),
      "abisee/cnn_dailymail": splits(article=text, highlights=text, id=text),
      "knkarthick/dialogsum": splits(id=text, dialogue=text, summary=text, topic=text),
      # GLUE's test labels are hidden (-1): the :hub splits never read them.
      "stanfordnlp/sst2": splits(idx=datasets.Value("int32"), sentence=text,
                                 label=classes(names=["negative", "positive"]),
                                 unlabelled=("test",)),
      "stanfordnlp/imdb": splits(("train", "test", "unsupervised"), ("unsupervised",),
                                 text=text, label=classes(names=["neg", "pos"])),
      "uitnlp/vietnamese_students_feedback": splits(
          sentence=text, sentiment=classes(names=["negative", "neutral", "positive"]),
          topic=classes(names=["lecturer", "training_program", "facility", "others"])),
      # Files train / val / test: the library names the second split 'validation'.
      "bentrevett/multi30k": splits(("train", "val", "test"), en=text, de=text),
  }


# What each :hub variant reads: the source field, and the target field or the class names.
HUB_READS = {
    "wmt14_en_de": ("en", "de"), "wmt14_de_en": ("de", "en"), "multi30k": ("en", "de"),
    "cnn_dailymail": ("article", "highlights"), "dialogsum": ("dialogue", "summary"),
    "sst2": ("sentence", ["negative", "positive"]), "imdb_reviews": ("text", ["neg", "pos"]),
    "uit_vsfc": ("sentence", ["negative", "neutral", "positive"]),
}


@pytest.mark.parametrize("name,variant,hub_id", HUB_VARIANTS)
def test_hub_variant_changes_only_where_the_data_comes_from(name, variant, hub_id):
  plain = variant.replace("hub", "").strip(",")  # the same config without 'hub'
  local, hub = _load_config(name, *[plain] if plain else []), _load_config(name, variant)
  config_validation.validate(hub, 1)
  assert hub.dataset == "huggingface" and hub.huggingface.name == hub_id
  data_keys = ("dataset", "huggingface", "splits")
  assert ({k: v for k, v in hub.to_dict().items() if k not in data_keys}
          == {k: v for k, v in local.to_dict().items() if k not in data_keys})
  roles = ("source", "label") if hub.task == "classification" else ("source", "target")
  assert all(hub.huggingface.columns[role] for role in roles)


def test_hub_variant_argument_keeps_the_old_ones_and_refuses_unknown_parts():
  assert _load_config("bert_sst2", "roberta").pretrained == "FacebookAI/roberta-base"
  assert _load_config("bert_sst2", "roberta").dataset == "local"
  assert (_load_config("bert_sst2", "roberta,hub").to_dict()
          == _load_config("bert_sst2", "hub,roberta").to_dict())
  assert _load_config("flan_t5_dialogsum", "hub").pretrained == "google/flan-t5-small"
  assert _load_config("wmt14_en_de").dataset == "tfds"
  with pytest.raises(ValueError, match="Unknown config variant 'hbu'"):
    _load_config("sst2", "hbu")
  with pytest.raises(ValueError, match="gives the model twice"):
    _load_config("xlmr_uit_vsfc", "xlmr,phobert")


@pytest.mark.parametrize("name", sorted(HUB_READS))
def test_hub_variant_reads_its_datasets_layout(name, tmp_path, monkeypatch):
  """The :hub columns and split strings (slices of train included) read a local copy of the
  Hub dataset's layout; nothing reaches the network."""
  import datasets  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
  config = _load_config(name, "hub")
  for split, data in _hub_layouts()[config.huggingface.name].items():
    data.to_parquet(str(tmp_path / "data" / f"{split}.parquet"))
  # A folder of files named by split: the Hub id's subset and revision do not apply to it.
  config.huggingface.update(name=str(tmp_path / "data"), subset="", revision="")
  source, target = HUB_READS[name]
  hf_source.apply_label_names(config)
  assert isinstance(target, str) or config.label_names == target
  sizes = {}
  for split in ("train", "validation", "test"):
    examples, sizes[split] = hf_source.stream(config, split)
    for example in examples:
      assert example["source"].startswith(f"{source} ")
      assert (example["target"].startswith(f"{target} ") if isinstance(target, str)
              else 0 <= example["label"] < config.model.num_classes)
  # Held-out slices of train where the Hub dataset has no labelled validation split.
  assert tuple(sizes.values()) == {"sst2": (1200 - 872, 872, 20),
                                   "imdb_reviews": (200, 1000, 20)}.get(name, (1200, 20, 20))


def test_tokenizer_sample_is_seeded_uniform_and_streamed():
  from transformer_jax import tokenizer as tokenizer_lib
  texts = [f"t{i}" for i in range(1000)]
  assert tokenizer_lib.sample(iter(texts[:30]), 50, seed=0) == texts[:30]  # fewer: all
  picked = tokenizer_lib.sample(iter(texts), 100, seed=0)
  assert len(set(picked)) == 100 and set(picked) <= set(texts)
  assert picked == tokenizer_lib.sample(iter(texts), 100, seed=0)
  assert picked != tokenizer_lib.sample(iter(texts), 100, seed=1)
  # Uniform: over 200 seeds every text is kept about 100/1000 of the time; the last ones as
  # often as the first (a reservoir bug keeps the head or the tail).
  counts = collections.Counter(t for seed in range(200)
                               for t in tokenizer_lib.sample(iter(texts), 100, seed=seed))
  first, last = (sum(counts[t] for t in texts[part]) / 200 for part in
                 (slice(0, 500), slice(500, 1000)))
  assert abs(first - 50) < 3 and abs(last - 50) < 3


def test_tokenizer_is_trained_once_or_taken_from_a_given_model(tmp_path):
  from transformer_jax import tokenizer as tokenizer_lib
  config = default_config.get_config()
  config.model.vocab_size = 40
  config.dataset, config.data_dir = "local", str(tmp_path / "data")
  config.local.update(format="parallel", source_lang="en", target_lang="de")
  os.makedirs(config.data_dir)

  def write_corpus(words):
    for lang, word in zip(("en", "de"), words):
      with open(os.path.join(config.data_dir, f"train.{lang}"), "w", encoding="utf-8") as f:
        f.write("".join(f"{word} {i}\n" for i in range(50)))

  write_corpus(("the cat", "die Katze"))
  os.makedirs(tmp_path / "a")
  trained = run_data.load_tokenizer(config, str(tmp_path / "a"))
  assert trained.encode("the cat") != trained.encode("xyz qqq")
  # Reused as saved, whatever the data is now (a resumed run, predict).
  write_corpus(("x", "y"))
  again = run_data.load_tokenizer(config, str(tmp_path / "a"))
  assert again.model_proto == trained.model_proto
  # A given .model is copied into a new workdir instead of training one.
  os.makedirs(tmp_path / "b")
  config.tokenizer.path = str(tmp_path / "a" / workdir_lib.TOKENIZER_FILE)
  given = run_data.load_tokenizer(config, str(tmp_path / "b"))
  assert given.model_proto == trained.model_proto
  assert tokenizer_lib.Tokenizer.load(str(tmp_path / "b" / workdir_lib.TOKENIZER_FILE)
                                      ).model_proto == trained.model_proto


def test_multitask_mixture_trains_and_scores_each_part(tmp_path):
  _write_sentiment(str(tmp_path / "sentiment"))
  os.makedirs(tmp_path / "parallel")
  for split in ("train", "dev", "test"):
    for lang, words in (("en", ["one", "two", "three"]), ("de", ["eins", "zwei", "drei"])):
      with open(tmp_path / "parallel" / f"{split}.{lang}", "w") as f:
        f.write("".join(f"{words[i % 3]} {words[(i + 1) % 3]}\n" for i in range(30)))
  config = default_config.get_config()
  config.update(task="multitask", dataset="local", data_dir=str(tmp_path), max_source_length=16,
                max_target_length=8, num_train_steps=4, per_device_batch_size=8,
                eval_every_steps=4, checkpoint_every_steps=4, log_every_steps=2,
                num_generate_examples=-1, pack_examples=True)
  config.mixture = dict(
      translate=dict(prefix="translate: ", task="translation", data_dir="parallel",
                     local=dict(format="parallel", source_lang="en", target_lang="de"),
                     splits=dict(validation="dev"), max_train_examples=-1,
                     max_eval_examples=5),
      sentiment=dict(prefix="sentiment: ", task="classification", data_dir="sentiment",
                     local=dict(format="tsv"), splits=dict(validation="dev"),
                     label_names=["bad", "good"], max_train_examples=20, max_eval_examples=6))
  config.decoding.update(method="greedy", max_decode_len=6)
  config.model.update(TINY, vocab_size=60)
  os.makedirs(tmp_path / "run")
  examples, _, encoded = run_data.prepare_data(config, str(tmp_path / "run"), ("train", "test"))
  assert len(encoded["train"]) == 30 + 20 and len(examples["test"]) == 5 + 6
  assert {e["target"] for e in examples["test"] if e["task"] == "sentiment"} <= {"bad", "good"}
  assert examples["test"][0]["source"].startswith(("sentiment: ", "translate: "))
  result = train.train_and_evaluate(config, str(tmp_path / "run"))
  assert {"translate_bleu", "sentiment_accuracy"} <= set(result)


def test_few_and_many_texts_encode_as_each_alone():
  """encode_batch's two paths (few texts one by one, many on SentencePiece's threads)."""
  from transformer_jax import tokenizer as tokenizer_lib
  tokenizer = tokenizer_lib.train_tokenizer(["ein Haus am See", "a house by the lake"] * 50, 40)
  texts = [f"a house {'by the lake ' * (i % 5)}{i}" for i in range(tokenizer_lib.FEW_TEXTS + 3)]
  alone = [tokenizer.encode(text) for text in texts]
  assert tokenizer.encode_batch(texts[:3]) == alone[:3]
  assert tokenizer.encode_batch(texts) == alone
