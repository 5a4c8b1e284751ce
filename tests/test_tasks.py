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
from transformer_jax import default_config
from transformer_jax import families
from transformer_jax import metrics
from transformer_jax import models
from transformer_jax import predict
from transformer_jax import tasks
from transformer_jax import train
from transformer_jax import workdir as workdir_lib
from transformer_jax.data import pipeline
from transformer_jax.data import preparation

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


def _load_config(name):
  return default_config.load(os.path.join(ROOT, "configs", f"{name}.py"))


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
  trained = preparation.load_tokenizer(config, str(tmp_path / "a"))
  assert trained.encode("the cat") != trained.encode("xyz qqq")
  # Reused as saved, whatever the data is now (a resumed run, predict).
  write_corpus(("x", "y"))
  again = preparation.load_tokenizer(config, str(tmp_path / "a"))
  assert again.model_proto == trained.model_proto
  # A given .model is copied into a new workdir instead of training one.
  os.makedirs(tmp_path / "b")
  config.tokenizer.path = str(tmp_path / "a" / workdir_lib.TOKENIZER_FILE)
  given = preparation.load_tokenizer(config, str(tmp_path / "b"))
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
  examples, _, encoded = preparation.prepare_data(config, str(tmp_path / "run"), ("train", "test"))
  assert len(encoded["train"]) == 30 + 20 and len(examples["test"]) == 5 + 6
  assert {e["target"] for e in examples["test"] if e["task"] == "sentiment"} <= {"bad", "good"}
  assert examples["test"][0]["source"].startswith(("sentiment: ", "translate: "))
  result = train.train_and_evaluate(config, str(tmp_path / "run"))
  assert {"translate_bleu", "sentiment_accuracy"} <= set(result)
