"""BERT, RoBERTa and XLM-R classifiers and GPT-2 imported from Hugging Face, against
transformers itself: served, fine-tuned, exported, and bad input.

Tiny random checkpoints written by transformers (tests/hf_fixtures.py) stand in for hub
models; the tokenizers' ids are tests/test_pretrained_tokenizer.py's.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import cli
from tests import hf_fixtures
from tests.conftest import make_tiny_config
from transformer_jax import commands
from transformer_jax import default_config
from transformer_jax.data import pipeline
from transformer_jax.data import prompt_format
from transformer_jax.model import models
from transformer_jax.model import schema as model_schema
from transformer_jax.predict import Predictor
from transformer_jax.pretrained import checkpoint as checkpoint_lib
from transformer_jax.pretrained import mapping

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CLASSIFIERS = ("bert", "roberta", "xlm-roberta")
WINDOWED = ("mistral", "qwen3", "gemma2", "gemma3_text")  # an 8-token sliding window
LENGTH = 24  # tokens per padded row


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  return hf_fixtures.folder_maker(tmp_path_factory)


def _texts(kind: str, count: int = 6) -> list[str]:
  """Real sentences of different lengths (Vietnamese for XLM-R)."""
  language = "vi" if kind == "xlm-roberta" else "en"
  sentences = hf_fixtures.model_sentences(language, 200)
  return sorted(sentences[:count * 5], key=len)[::5][:count]


def _rows(predictor: Predictor, texts: list[str], eos: bool = True) -> np.ndarray:
  """[len(texts), LENGTH] internal ids as the pipeline makes them, padded with 0."""
  rows = np.zeros((len(texts), LENGTH), np.int32)
  for i, text in enumerate(texts):
    ids = predictor.tokenizer.encode(text)
    ids = pipeline.with_eos(ids, LENGTH) if eos else ids[:LENGTH]
    rows[i, :len(ids)] = ids
  return rows


@pytest.mark.parametrize("kind", CLASSIFIERS)
def test_classifier_probabilities_equal_pytorch(kind, folders):
  folder = folders(kind)
  predictor = Predictor.from_pretrained(folder)
  hf_config = json.load(open(os.path.join(folder, "config.json")))
  assert predictor.config.label_names == [hf_config["id2label"][str(i)]
                                          for i in range(len(hf_config["id2label"]))]
  inputs = _rows(predictor, _texts(kind))
  assert (inputs == 0).any() and (inputs != 0).all(axis=0).any()  # padded, unequal rows
  params = predictor.layout.checkpoint_state(predictor.device_params)
  ours = jax.nn.softmax(predictor.family.model.apply({"params": params}, jnp.asarray(inputs),
                                                     deterministic=True))
  model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
  vocab = predictor.tokenizer.vocab_map
  with torch.no_grad():
    logits = model(input_ids=torch.tensor(vocab.hf(inputs)),
                   attention_mask=torch.tensor(inputs != 0)).logits
  np.testing.assert_allclose(np.asarray(ours), torch.softmax(logits, -1).numpy(), atol=1e-4)


def test_classifier_jsonl_gives_the_checkpoints_label_names(folders, tmp_path):
  folder = folders("bert")
  texts = _texts("bert", 3)
  source = tmp_path / "in.txt"
  source.write_text("\n".join(texts) + "\n")
  result = cli.run_main("--pretrained", folder, "--mode", "predict", "--input", str(source),
                        "--output_format", "jsonl")
  assert result.returncode == 0, result.stderr[-3000:]
  records = [json.loads(line) for line in result.stdout.splitlines()]
  model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  with torch.no_grad():
    probabilities = torch.softmax(model(**tokenizer(texts, return_tensors="pt",
                                                    padding=True)).logits, -1).numpy()
  names = [model.config.id2label[i] for i in range(model.config.num_labels)]
  for record, text, expected in zip(records, texts, probabilities):
    assert record["source"] == text
    assert list(record["probabilities"]) == names  # id2label order
    np.testing.assert_allclose(list(record["probabilities"].values()), expected, atol=1e-4)
    assert record["label"] == names[int(np.argmax(expected))]


def test_evaluate_pretrained_classifier_scores_as_pytorch(folders, tmp_path):
  """--mode evaluate --pretrained on a classification split: the accuracy of transformers'
  own predictions, and no decoding settings in the result."""
  from transformer_jax import commands  # pylint: disable=import-outside-toplevel
  folder = folders("bert")
  _write_sentiment(str(tmp_path / "data"), 3)
  config = _classification_config(str(tmp_path / "data"), folder, 3)
  config.max_source_length = 64  # the checkpoint's positions; transformers truncates alike
  predictor = Predictor.from_pretrained(folder, config)
  result = commands.run_evaluate(None, split="test", predictor=predictor)
  assert "decoding" not in result and result["examples"] == 16
  rows = [line.split("\t") for line in open(tmp_path / "data" / "test.tsv")][1:]
  model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  with torch.no_grad():
    logits = model(**tokenizer([text.strip() for _, text in rows], return_tensors="pt",
                               padding=True, truncation=True, max_length=64)).logits.numpy()
  labels = np.array([int(label) for label, _ in rows])
  assert result["accuracy"] == pytest.approx(np.mean(logits.argmax(-1) == labels))


def vocab_internal(predictor: Predictor, hf_ids) -> list[int]:
  return [int(i) for i in predictor.tokenizer.vocab_map.internal(hf_ids)]


def _logits_against_pytorch(predictor: Predictor, model, kind: str, count: int = 6):
  """Asserts that our logits of right-padded rows of `kind`'s sentences equal those of
  transformers' `model` on the same ids within 1e-4; returns (ours, theirs, the non-pad
  positions)."""
  vocab = predictor.tokenizer.vocab_map
  tokens = _rows(predictor, _texts(kind, count))
  params = predictor.layout.checkpoint_state(predictor.device_params)
  ours = np.asarray(predictor.family.model.apply({"params": params}, jnp.asarray(tokens),
                                                 deterministic=True))
  inputs = np.asarray(models.shift_right(jnp.asarray(tokens), predictor.family.model_config.bos_id))
  with torch.no_grad():
    theirs = model(input_ids=torch.tensor(vocab.hf(np.where(tokens != 0, inputs, 1))),
                   attention_mask=torch.tensor(tokens != 0)).logits.numpy()
  real = tokens != 0
  np.testing.assert_allclose(ours[..., vocab.internal(np.arange(vocab.checkpoint_size))][real],
                             theirs[real], atol=1e-4)
  return ours, theirs, real


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma",
                                  "gemma2", "gemma3_text"])
def test_decoder_only_logits_and_greedy_continuations_equal_pytorch(kind, folders):
  """GPT-2; Llama (GQA 2 of 4, head_dim 16 != 32 / 4, llama3 RoPE scaling past a 16-token
  context, biases on q/k/v/o, untied), Mistral (multi-query, an 8-token sliding window),
  Qwen2 (biases on q/k/v only, linear RoPE scaling), Qwen3 (q/k norms, a window on one layer)
  and the Gemmas (hf_fixtures.KINDS says what each brings), windows shorter than the rows."""
  folder = folders(kind)
  predictor = Predictor.from_pretrained(folder)
  config = predictor.family.model_config
  # The Gemmas have a pad token of their own; the others get one added, never predicted.
  added_pad = not kind.startswith("gemma")
  assert predictor.tokenizer.vocab_map.added_pad == config.mask_padding_logit == added_pad
  if kind != "gpt2":
    assert config.position_embedding == "rope" and config.num_kv_heads < config.num_heads
    assert config.max_len == 128  # a sliding window reads every position
    assert config.sliding_window == (8 if kind in WINDOWED else 0)
  model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
  ours, theirs, real = _logits_against_pytorch(predictor, model, kind)
  assert np.ptp(theirs[real]) > 1.0  # not vacuous: the logits spread far past the tolerance
  assert (ours[..., 0] == models.PADDING_LOGIT).all() == added_pad

  # Served as it is, the checkpoint continues raw text as `generate` does: the tokenizer's ids
  # (Llama's with its own BOS, GPT-2's with none), no separator. Batched here with
  # right-padded prompts of different lengths, one at a time in transformers.
  assert predictor.config.prompt_format == "raw"
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  room = predictor.config.max_source_length - 1  # Mistral's window leaves 16 tokens a prompt
  fitting = [t for t in _texts(kind, 40) if len(tokenizer(t)["input_ids"]) <= room]
  texts = fitting[::len(fitting) // 4][:4]  # of different lengths
  assert len({len(tokenizer(t)["input_ids"]) for t in texts}) > 1
  if kind in WINDOWED:  # the longest prompts and their continuations pass the window
    assert len(tokenizer(texts[-1])["input_ids"]) > 2 * config.sliding_window
  prompts = [predictor.family.prompt(ids) for ids in
             predictor.tokenizer.encode_batch(texts)]
  outputs = predictor.output_ids(prompts, decoding_config=predictor.decoding_config(
      method="greedy", max_decode_len=10))
  for text, output in zip(texts, outputs):
    prompt = tokenizer(text, return_tensors="pt")["input_ids"]
    assert (prompt[0, 0] == tokenizer.bos_token_id) == (kind != "gpt2")
    with torch.no_grad():
      ids = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                           num_beams=1, max_new_tokens=10,
                           pad_token_id=tokenizer.eos_token_id)[0, prompt.shape[1]:].numpy()
    ends = np.flatnonzero(ids == tokenizer.eos_token_id)  # ours: EOS, then zeros
    expected = vocab_internal(predictor, ids[:ends[0] + 1] if len(ends) else ids)
    assert list(output[:len(expected)]) == expected
  if kind == "gpt2":  # the command line continues the text too, one line at a time
    result = cli.run_main("--mode", "predict", "--pretrained", folder, "--input", "-",
                          "--config.decoding.max_decode_len=10", input="\n".join(texts[:2]))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == predictor.predict(texts[:2], max_decode_len=10)


def test_a_generation_config_max_length_counts_the_prompt_as_generate_does(folders, tmp_path):
  """A decoder-only checkpoint whose generation_config.json sets max_length (and no
  max_new_tokens), served as it is: each prompt continues to max_length tokens in all, as
  `generate` with the checkpoint's own settings does; batched prompts of different lengths
  each as alone. (Without a length in the file generate makes 20 new tokens, we source + 50.)"""
  folder = str(tmp_path / "llama")
  shutil.copytree(folders("llama"), folder)
  path = os.path.join(folder, "generation_config.json")
  with open(path, encoding="utf-8") as f:
    generation = dict(json.load(f), max_length=16)
  generation.pop("max_new_tokens", None)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(generation, f)
  predictor = Predictor.from_pretrained(folder)
  decoding = predictor.config.decoding
  assert (decoding.max_total_len, decoding.max_decode_len, decoding.method) == (16, 0, "greedy")
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  texts = [t for t in _texts("llama", 40) if len(tokenizer(t)["input_ids"]) < 12][:4]
  if len({len(tokenizer(t)["input_ids"]) for t in texts}) < 2:
    # hf_fixtures' built-in sentences (no shared corpora) make longer prompts: their first words.
    words = _texts("llama", 1)[0].split()
    texts = [" ".join(words[:n]) for n in (2, 3, 4, 5)]
  assert len({len(tokenizer(t)["input_ids"]) for t in texts}) > 1
  prompts = [predictor.family.prompt(ids) for ids in predictor.tokenizer.encode_batch(texts)]
  model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
  cut = 0  # rows that max_length ends, rather than EOS
  for text, output in zip(texts, predictor.output_ids(prompts)):
    prompt = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():  # the checkpoint's generation settings, no lengths of ours
      ids = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                           pad_token_id=tokenizer.eos_token_id)[0, prompt.shape[1]:].numpy()
    ends = np.flatnonzero(ids == tokenizer.eos_token_id)
    if len(ends):
      expected = vocab_internal(predictor, ids[:ends[0] + 1])
    else:  # cut at max_length: ours then ends with EOS
      assert len(ids) == 16 - prompt.shape[1]
      expected, cut = vocab_internal(predictor, ids) + [1], cut + 1
    assert list(output[:len(expected) + 1]) == expected + [0]
  assert cut > 1
  # A length given on the command line (max_new_tokens to generate) counts new tokens.
  ten = predictor.output_ids(prompts, decoding_config=predictor.decoding_config(
      max_decode_len=10))
  assert all(len(np.trim_zeros(row, "b")) == 10 for row in ten if 1 not in row)



@pytest.mark.parametrize("kind", ["gemma", "llama"])
def test_a_bfloat16_checkpoint_is_held_and_run_in_bfloat16(kind, folders, tmp_path):
  """A checkpoint saved in bfloat16 (as most hub LLMs are), served with
  config.model.dtype='bfloat16': its weights are held in bfloat16 (half the memory), with the
  same logits as the same values held in float32, and as near transformers' bfloat16 model as
  that is to its own float32 one. Computing in float32 holds them in float32."""
  folder = str(tmp_path / "bf16")
  transformers.AutoModelForCausalLM.from_pretrained(
      folders(kind), dtype=torch.bfloat16).save_pretrained(folder)
  for name in os.listdir(folders(kind)):  # the tokenizer files
    if not os.path.exists(os.path.join(folder, name)):
      shutil.copy(os.path.join(folders(kind), name), folder)
  config = default_config.get_config()
  config.model.dtype = "bfloat16"
  predictor = Predictor.from_pretrained(folder, config)
  params = predictor.layout.checkpoint_state(predictor.device_params)
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  tokens = jnp.asarray(_rows(predictor, _texts(kind)))
  apply = lambda p: np.asarray(predictor.family.model.apply({"params": p}, tokens,
                                                            deterministic=True), np.float32)
  ours = apply(params)
  np.testing.assert_array_equal(ours, apply(jax.tree.map(lambda x: x.astype(jnp.float32),
                                                         params)))
  vocab = predictor.tokenizer.vocab_map
  real = np.asarray(tokens) != 0
  inputs = np.asarray(models.shift_right(tokens, predictor.family.model_config.bos_id))
  theirs = {}
  for dtype in (torch.bfloat16, torch.float32):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
      theirs[dtype] = model(input_ids=torch.tensor(vocab.hf(np.where(real, inputs, 1))),
                            attention_mask=torch.tensor(real)).logits.float().numpy()[real]
  ours = ours[..., vocab.internal(np.arange(vocab.checkpoint_size))][real]
  rounding = np.abs(theirs[torch.bfloat16] - theirs[torch.float32]).mean()
  assert np.abs(ours - theirs[torch.bfloat16]).mean() < 2 * rounding
  assert (ours.argmax(-1) == theirs[torch.bfloat16].argmax(-1)).mean() > 0.9
  float32 = Predictor.from_pretrained(folder)
  assert {x.dtype for x in jax.tree.leaves(float32.layout.checkpoint_state(
      float32.device_params))} == {jnp.dtype(jnp.float32)}

# Hub config.json files as older transformers wrote them (the keys that matter here), and the
# fields they must import as.
_HUB_CONFIGS = {
    "gemma-7b": (dict(model_type="gemma", hidden_act="gelu", hidden_activation=None,
                      num_hidden_layers=28, rope_theta=10000.0),
                 dict(ffn_activation="geglu_tanh", sliding_window=0, logits_softcap=0.0,
                      position_base=10000.0)),
    "gemma-2-2b": (dict(model_type="gemma2", hidden_activation="gelu_pytorch_tanh",
                        num_hidden_layers=26, sliding_window=4096, query_pre_attn_scalar=256,
                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
                   dict(sliding_window=4096, sliding_window_pattern="LG", attention_softcap=50.0,
                        logits_softcap=30.0, query_pre_attn_scalar=256.0, qk_norm=False)),
    "gemma-3-1b": (dict(model_type="gemma3_text", num_hidden_layers=26, sliding_window=512,
                        sliding_window_pattern=6, rope_theta=1000000, rope_local_base_freq=10000,
                        rope_scaling=None, attn_logit_softcapping=None,
                        final_logit_softcapping=None, eos_token_id=[1, 106]),
                   dict(sliding_window=512, sliding_window_pattern="LLLLLG",
                        position_base=1e6, local_position_base=1e4, rope_scaling="none",
                        attention_softcap=0.0, logits_softcap=0.0, qk_norm=True)),
    "gemma-3-4b": (dict(model_type="gemma3_text", num_hidden_layers=34, sliding_window=1024,
                        rope_theta=1000000, rope_scaling=dict(rope_type="linear", factor=8.0)),
                   dict(sliding_window=1024, sliding_window_pattern="LLLLLG", position_base=1e6,
                        rope_scaling="linear", rope_scaling_factor=8.0, local_position_base=1e4)),
    "qwen3-0.6b": (dict(model_type="qwen3", num_hidden_layers=28, use_sliding_window=False,
                        sliding_window=None, max_window_layers=28, rope_theta=1000000),
                   dict(sliding_window=0, qk_norm=True, position_base=1e6, qkv_bias=False)),
    "qwen2-windowed": (dict(model_type="qwen2", num_hidden_layers=4, use_sliding_window=True,
                            sliding_window=4096, max_window_layers=3),
                       dict(sliding_window=4096, sliding_window_pattern="GGGL", qkv_bias=True)),
    "mistral-7b-v0.1": (dict(model_type="mistral", num_hidden_layers=32, sliding_window=4096,
                             max_position_embeddings=32768),
                        dict(sliding_window=4096, sliding_window_pattern="L", max_len=32768)),
}


@pytest.mark.parametrize("name", _HUB_CONFIGS)
def test_decoder_only_hub_configs_import_as_transformers_reads_them(name):
  from transformer_jax.pretrained import architecture  # pylint: disable=import-outside-toplevel
  hf, expected = _HUB_CONFIGS[name]
  hf = dict(dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=32, max_position_embeddings=8192,
                 bos_token_id=2, eos_token_id=1, pad_token_id=0), **hf)
  fields = architecture.ARCHITECTURES[hf["model_type"]].model_fields(hf, tied=True)
  assert {key: fields.get(key, 0.0) for key in expected} == expected
  assert fields["qkv_dim"] == 4 * 32  # the head size of config.json, not hidden / heads
  models.TransformerConfig(**fields)  # every field is one


def _write_sentiment(folder, num_classes: int = 2):
  """A tsv corpus where one word decides the label."""
  os.makedirs(folder, exist_ok=True)
  rng = np.random.default_rng(0)
  words = [["awful", "dull", "bad"], ["great", "fun", "good"], ["fine", "okay", "average"]]
  for split, n in (("train", 200), ("dev", 16), ("test", 16)):
    with open(os.path.join(folder, f"{split}.tsv"), "w") as f:
      f.write("label\tsentence\n")
      for _ in range(n):
        label = int(rng.integers(num_classes))
        f.write(f"{label}\tthe film was {rng.choice(words[label])} and long\n")


def _classification_config(data_dir: str, folder: str, num_classes: int = 2):
  config = default_config.get_config()
  config.update(task="classification", dataset="local", data_dir=data_dir, pretrained=folder,
                max_source_length=16, num_train_steps=12, per_device_batch_size=8,
                learning_rate=1e-3, warmup_steps=2, label_smoothing=0.0, log_every_steps=4,
                eval_every_steps=12, checkpoint_every_steps=12)
  config.local.update(format="tsv")
  config.splits.update(validation="dev")
  config.model.update(num_classes=num_classes)
  config.label_names = ["negative", "positive", "neutral"][:num_classes]
  return config


@pytest.mark.parametrize("kind,num_classes,architecture", [
    ("bert_bare", 2, "BertForSequenceClassification"),  # a fresh head from the seed
    ("roberta", 2, "RobertaForSequenceClassification"),  # the checkpoint's head
    ("xlm-roberta", 3, "XLMRobertaForSequenceClassification")])
def test_classifier_fine_tunes_and_exports(kind, num_classes, architecture, folders, tmp_path):
  from transformer_jax import train  # pylint: disable=import-outside-toplevel
  folder = folders(kind)
  _write_sentiment(str(tmp_path / "data"), num_classes)
  config = _classification_config(str(tmp_path / "data"), folder, num_classes)
  config.num_train_steps, config.log_every_steps = 1, 1
  workdir = str(tmp_path / "run")
  first = train.train_and_evaluate(config, workdir)
  config.num_train_steps = 12
  last = train.train_and_evaluate(config, workdir)
  assert last["loss"] < first["loss"]

  output = str(tmp_path / "exported")
  commands.run_export(workdir, output)  # --mode export (its command line: test_pretrained_workflow)
  reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(output).eval()
  assert type(reloaded).__name__ == architecture
  assert list(reloaded.config.id2label.values()) == config.label_names  # the run's labels
  predictor = Predictor.from_workdir(workdir)
  texts = ["the film was great and long", "the film was dull", "a film"]
  inputs = _rows(predictor, texts)
  params = predictor.layout.checkpoint_state(predictor.device_params)
  ours = jax.nn.softmax(predictor.family.model.apply({"params": params}, jnp.asarray(inputs),
                                                     deterministic=True))
  with torch.no_grad():
    theirs = torch.softmax(reloaded(input_ids=torch.tensor(
        predictor.tokenizer.vocab_map.hf(inputs)),
        attention_mask=torch.tensor(inputs != 0)).logits, -1).numpy()
  np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4)


def _chat_folder(folders, tmp_path) -> str:
  """The Qwen2 kind (ChatML template) set up as Llama 3 Instruct is: config.json and
  generation_config.json list two end ids, <|end_of_text|> first, while the tokenizer's eos
  is the second, <|im_end|>, which ends a reply."""
  folder = str(tmp_path / "qwen2_chat")
  shutil.copytree(folders("qwen2"), folder)
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  ends = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
  for name, key, value in (("config.json", "eos_token_id", ends),
                           ("generation_config.json", "eos_token_id", ends),
                           ("tokenizer_config.json", "eos_token", "<|im_end|>")):
    with open(os.path.join(folder, name)) as f:
      values = json.load(f)
    with open(os.path.join(folder, name), "w") as f:
      json.dump(dict(values, **{key: value}), f)
  return folder


_CHAT = dict(prompt_format="chat", system_prompt="You write short summaries.",
             prompt_template="Summarize this:\n{source}")


def test_chat_prompts_and_replies_equal_transformers(folders, tmp_path):
  folder = _chat_folder(folders, tmp_path)
  config = default_config.get_config()
  config.update(_CHAT)
  config.max_source_length = 96  # no chat prompt cut (hf_fixtures' built-in sentences: ~70)
  predictor = Predictor.from_pretrained(folder, config)
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  im_end = tokenizer.eos_token_id
  assert vocab_internal(predictor, [im_end]) == [1]  # this project's EOS
  assert predictor.config.decoding.end_ids == tuple(vocab_internal(
      predictor, [tokenizer.convert_tokens_to_ids("<|end_of_text|>")]))
  # A multi-turn chat with a system prompt renders to transformers' ids.
  chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
          {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Translate "
                                                                               "'cat'."}]
  ours = predictor.tokenizer.encode_batch([predictor.tokenizer.render_chat(chat)],
                                          add_special_tokens=False)[0]
  assert ours == vocab_internal(predictor, tokenizer.apply_chat_template(
      chat, add_generation_prompt=True, tokenize=True, return_dict=False))
  # Greedy replies to config.prompt_template's user turn (after config.system_prompt) equal
  # generate's on apply_chat_template, batched with right padding, ending at <|im_end|>.
  texts = _texts("qwen2", 3)
  text_encoder = prompt_format.TextEncoder(predictor.config, predictor.tokenizer)
  outputs = predictor.output_ids([predictor.family.prompt(ids) for ids in
                                  text_encoder.encode(texts)[0]],
                                 decoding_config=predictor.decoding_config(max_decode_len=10))
  for text, output in zip(texts, outputs):
    prompt = torch.tensor([tokenizer.apply_chat_template(
        text_encoder.messages(text), add_generation_prompt=True, tokenize=True,
        return_dict=False)])
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert prompt[0, -len(header):].tolist() == header  # the generation prompt
    with torch.no_grad():
      ids = model_generate(folder, prompt)
    ends = np.flatnonzero(np.isin(ids, predictor.tokenizer.vocab_map.to_hf[
        [1, *predictor.config.decoding.end_ids]]))
    expected = vocab_internal(predictor, ids[:ends[0] + 1] if len(ends) else ids)
    if len(ends):
      expected[-1] = 1  # every end token ends our outputs as EOS
    assert list(output[:len(expected)]) == expected
  # Training examples: the reply and its <|im_end|> weigh, nothing else.
  family = predictor.family
  sources, targets = text_encoder.encode(texts[:1], ["A short reply."])
  features = family.example_features(sources[0], targets[0])
  reply = vocab_internal(predictor, tokenizer("A short reply.<|im_end|>",
                                              add_special_tokens=False)["input_ids"])
  assert targets[0] == reply
  assert list(features["targets"][features["weights"] == 1]) == reply


def _write_conversations(folder: str, texts: list[str]) -> None:
  """train / validation / test.jsonl of two-turn chats (a system turn first), and a line of
  another shape in bad.jsonl."""
  os.makedirs(folder, exist_ok=True)
  for split, count in (("train", 32), ("validation", 4), ("test", 4)):
    with open(os.path.join(folder, f"{split}.jsonl"), "w") as f:
      for i in range(count):
        a, b = texts[i % len(texts)], texts[(i + 1) % len(texts)]
        chat = [{"role": "system", "content": "Repeat the first word."},
                {"role": "user", "content": a}, {"role": "assistant", "content": a.split()[0]},
                {"role": "user", "content": b}, {"role": "assistant", "content": b.split()[0]}]
        f.write(json.dumps({"messages": chat}) + "\n")
  with open(os.path.join(folder, "bad.jsonl"), "w") as f:
    f.write(json.dumps({"messages": "Hello"}) + "\n")


def test_chat_conversations_train_on_every_reply(folders, tmp_path, data_cache):
  from transformer_jax import train  # pylint: disable=import-outside-toplevel
  from transformer_jax.data import readers  # pylint: disable=import-outside-toplevel
  folder, data = _chat_folder(folders, tmp_path), str(tmp_path / "chats")
  texts = [t for t in _texts("qwen2", 40) if len(t.split()) > 2][:8]
  _write_conversations(data, texts)
  with pytest.raises(ValueError, match="bad.jsonl, line 1, field 'messages': a messages field "
                                       "must be a list of"):
    list(readers.iter_jsonl(data, "bad", "source", "target", "messages"))
  # Each reply and its <|im_end|> weigh; the last one is the target, the rest the prompt.
  config = default_config.get_config()
  config.update(_CHAT)
  predictor = Predictor.from_pretrained(folder, config)
  chat = next(readers.iter_jsonl(data, "train", "", "", "messages"))["messages"]
  text_encoder = prompt_format.TextEncoder(predictor.config, predictor.tokenizer)
  source, weights, target = text_encoder.encode_conversation(chat)
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  whole = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)
  assert source + target == vocab_internal(predictor, whole)[:len(source) + len(target)]
  replies = tokenizer(f"{chat[2]['content']}<|im_end|>{chat[4]['content']}<|im_end|>",
                      add_special_tokens=False)["input_ids"]
  assert [t for t, w in zip(source, weights) if w] + target == vocab_internal(predictor, replies)
  # Fine-tuning on them lowers the loss; evaluation continues each chat's last user turn.
  config = make_tiny_config(data_cache)
  config.update(architecture="decoder_only", pretrained=folder, dataset="local", data_dir=data,
                task="summarization", num_train_steps=1, eval_every_steps=8,
                checkpoint_every_steps=8, learning_rate=1e-3, num_generate_examples=2,
                max_source_length=96, max_target_length=16, **_CHAT)
  config.local.update(format="jsonl", messages_field="messages")
  config.decoding.update(method="greedy", max_decode_len=8)
  workdir = str(tmp_path / "run")
  first = train.train_and_evaluate(config, workdir)
  config.num_train_steps = 8
  last = train.train_and_evaluate(config, workdir)
  assert np.isfinite(last["loss"]) and last["loss"] < first["loss"]


_MODELS: dict = {}


def model_generate(folder: str, prompt, max_new_tokens: int = 10) -> np.ndarray:
  """transformers' greedy continuation ids of `prompt` [1, len] (the new ones)."""
  if folder not in _MODELS:
    _MODELS[folder] = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
  model = _MODELS[folder]
  return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                        num_beams=1, max_new_tokens=max_new_tokens,
                        pad_token_id=model.generation_config.eos_token_id[0]
                        if isinstance(model.generation_config.eos_token_id, list)
                        else model.generation_config.eos_token_id
                        )[0, prompt.shape[1]:].numpy()


# One kind per architecture module's new parts (each takes most of a minute); the weight tables
# of every kind are checked both ways by the test after this one.
@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen3", "gemma3_text", "qwen2-chat"])
def test_decoder_only_checkpoints_fine_tune_and_export(kind, folders, tmp_path, data_cache):
  from transformer_jax import train  # pylint: disable=import-outside-toplevel
  folder = _chat_folder(folders, tmp_path) if kind == "qwen2-chat" else folders(kind)
  config = make_tiny_config(data_cache)
  config.update(architecture="decoder_only", pretrained=folder, num_train_steps=1,
                eval_every_steps=12, checkpoint_every_steps=12, learning_rate=1e-3,
                num_generate_examples=4, **(_CHAT if kind == "qwen2-chat" else {}))
  config.decoding.update(method="greedy", max_decode_len=8)
  workdir = str(tmp_path / "run")
  first = train.train_and_evaluate(config, workdir)
  config.num_train_steps = 12  # label smoothing 0.1: nothing is spread onto the added pad
  last = train.train_and_evaluate(config, workdir)
  assert np.isfinite(last["loss"]) and last["loss"] < first["loss"]

  output = str(tmp_path / "exported")
  commands.run_export(workdir, output)  # --mode export, in this process
  predictor = Predictor.from_workdir(workdir)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(output).eval()
  # The added pad left out of the export.
  assert reloaded.config.vocab_size == predictor.tokenizer.vocab_map.checkpoint_size
  _logits_against_pytorch(predictor, reloaded, kind.split("-")[0], count=3)
  assert predictor.config.prompt_format == config.prompt_format  # as it was trained


_SHARDED = """
import functools, json, sys
sys.path.insert(0, sys.argv[1])
import jax, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
from transformer_jax import families, parallel
from transformer_jax.model import models
from transformer_jax.pretrained import checkpoint
folder, tokens = sys.argv[2], np.load(sys.argv[3])
layout = parallel.MeshParallel(data=1, fsdp=4, tensor=2)
ck = checkpoint.open_checkpoint(folder)
family = families.from_model_config(ck.family, models.TransformerConfig(**ck.fields))
boxed = jax.eval_shape(functools.partial(family.init_params, boxed=True), jax.random.PRNGKey(0))
params = layout.place_params(checkpoint.read_params(ck), boxed)
forward = layout.compile_eval(lambda p, b: family.forward(p, b, deterministic=True))
np.save(sys.argv[3], np.asarray(forward(params, layout.eval_batch({"targets": tokens}))))
print("RESULT", json.dumps({"/".join(str(k.key) for k in path): list(x.sharding.spec)
                            for path, x in jax.tree_util.tree_leaves_with_path(params)}))
"""


def test_sharded_import_of_a_grouped_query_model_gives_one_device_logits(folders, tmp_path):
  """Llama with 2 key/value heads for 4 query heads on 8 devices (fsdp 4 x tensor 2): each
  tensor-parallel device holds one key/value head and its two query heads."""
  folder = folders("llama")
  predictor = Predictor.from_pretrained(folder)
  tokens = _rows(predictor, _texts("llama", 4))
  params = predictor.layout.checkpoint_state(predictor.device_params)
  one_device = np.asarray(predictor.family.model.apply({"params": params}, jnp.asarray(tokens),
                                                       deterministic=True))
  path = str(tmp_path / "tokens.npy")
  np.save(path, tokens)
  run = cli.subprocess.run([cli.sys.executable, "-c", _SHARDED, cli.ROOT, folder, path],
                           env=cli.env(8), capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  split = json.loads(run.stdout.split("RESULT", 1)[1])
  real = tokens != 0
  # Logits up to ~10 (wide random weights), summed in another order over the shards.
  np.testing.assert_allclose(np.load(path)[real], one_device[real], atol=1e-4, rtol=0)
  attention = "decoder/layer_1/self_attention"
  assert split[f"{attention}/query/kernel"] == ["fsdp", None, "tensor", None]
  assert split[f"{attention}/kv/kernel"] == ["fsdp", None, "tensor", None]


@pytest.mark.parametrize("kind", hf_fixtures.DECODER_KINDS)
def test_decoder_only_weight_tables_write_back_the_checkpoints_tensors(kind, folders):
  """Export's direction of every decoder-only kind's weight table: the imported parameters
  become exactly the checkpoint's own tensors again (all of them but a tied lm_head)."""
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  folder = folders(kind)
  checkpoint = checkpoint_lib.open_checkpoint(folder)
  fields = model_schema.as_dict(models.TransformerConfig(**checkpoint.fields))  # as export
  table = checkpoint.architecture.weight_table(checkpoint.hf_config, fields)
  written = mapping.state_dict(table, checkpoint_lib.read_params(checkpoint),
                               checkpoint.shapes())
  original = load_file(os.path.join(folder, checkpoint_lib.WEIGHTS))
  assert set(original) - set(written) <= {checkpoint.architecture.OUTPUT_TENSOR}
  for name, tensor in written.items():
    np.testing.assert_array_equal(tensor, original[name], err_msg=name)


def test_a_head_of_another_size_needs_reset_head(folders, tmp_path):
  from transformer_jax import train  # pylint: disable=import-outside-toplevel
  folder = folders("bert")  # three classes
  _write_sentiment(str(tmp_path / "data"))
  config = _classification_config(str(tmp_path / "data"), folder)
  with pytest.raises(checkpoint_lib.PretrainedError, match="--config.reset_head=True"):
    train.train_and_evaluate(config, str(tmp_path / "refused"))
  assert not os.path.exists(tmp_path / "refused" / "pretrained")
  # A new head (from the seed) beside imported weights, placed in their jit shardings.
  config.reset_head, config.num_train_steps, config.parallel.mode = True, 2, "jit"
  result = train.train_and_evaluate(config, str(tmp_path / "reset"))
  assert np.isfinite(result["loss"])


def test_bad_input_is_one_line(folders, tmp_path, monkeypatch):
  bert = folders("bert")
  no_tokenizer = tmp_path / "no_tokenizer"
  no_tokenizer.mkdir()
  for name in ("config.json", "model.safetensors"):
    shutil.copy(os.path.join(bert, name), no_tokenizer)
  no_weights = tmp_path / "no_weights"
  no_weights.mkdir()
  shutil.copy(os.path.join(bert, "config.json"), no_weights)
  unsupported = tmp_path / "unsupported"
  unsupported.mkdir()
  (unsupported / "config.json").write_text(json.dumps({"model_type": "electra"}))
  cases = [(no_tokenizer, "tokenizer"), (no_weights, "no weights"),
           (unsupported, "not supported; supported: bart, bert, gemma"),
           (folders("bert_bare"), "without a classification head: fine-tune it first")]
  # Chat asked of a checkpoint without a chat template, and of one whose template refuses the
  # conversation (a system turn).
  refusing = tmp_path / "refusing"
  shutil.copytree(folders("qwen2"), refusing)
  (refusing / "chat_template.jinja").write_text(
      "{% if messages[0]['role'] == 'system' %}{{ raise_exception('No system turns.') }}"
      "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
  chat = ("--config.prompt_format=chat", "--config.system_prompt=Be brief.")
  cases += [(folders("gpt2"), "needs the checkpoint's chat template", *chat),
            (refusing, "refused the conversation (TemplateError: No system turns.)", *chat)]
  # The first as a user runs it, the others through the same entry in this process.
  result = cli.run_main("--pretrained", str(cases[0][0]), "--mode", "predict", input="a\n")
  assert result.returncode == 1 and cases[0][1] in cli.user_error(result.stderr)
  for folder, message, *extra in cases[1:]:
    code, stderr = cli.main_in_process(monkeypatch, "--pretrained", str(folder), "--mode",
                                       "predict", *extra, stdin="a\n")
    assert code == 1 and message in cli.user_error(stderr), stderr[-2000:]
  # A checkpoint of another family than the config's task.
  workdir = tmp_path / "wrong_family"
  result = cli.run(workdir, "--config", "tests/tiny_config.py:" + str(tmp_path / "cache"),
                   f"--config.pretrained={bert}")
  assert result.returncode == 1
  assert "trains the encoder_classifier family" in cli.user_error(result.stderr)
