"""LoRA (config.lora, transformer_jax/model/lora.py) against the reference PEFT: adapters that start
as the base, train alone, travel to and from PEFT's format with equal outputs, and shard.

Tiny Hugging Face models made here (tests/hf_fixtures.py) stand in for hub checkpoints.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from tests import cli
from tests import hf_fixtures
from tests.conftest import make_tiny_config
from transformer_jax import checkpoints
from transformer_jax import commands
from transformer_jax import config_validation
from transformer_jax import families
from transformer_jax import layer_decay
from transformer_jax import predict
from transformer_jax import train
from transformer_jax import workdir as workdir_lib
from transformer_jax.model import lora as lora_lib
from transformer_jax.model import models
from transformer_jax.predict import Predictor
from transformer_jax.pretrained import checkpoint as checkpoint_lib
from transformer_jax.pretrained import peft as peft_lib

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TEXTS = ["A man is sleeping on a bench.", "Two dogs run.", "The woman reads a book."]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  return hf_fixtures.folder_maker(tmp_path_factory)


def _t5_config(folder: str, data_cache: str, steps: int):
  config = make_tiny_config(data_cache)
  config.pretrained = folder
  config.num_train_steps, config.eval_every_steps, config.learning_rate = steps, 10, 3e-3
  config.num_generate_examples = 0  # evaluations score the loss: no decoding to compile
  config.lora.update(rank=4, alpha=8.0, targets="all")
  config.decoding.update(method="greedy", max_decode_len=8)
  return config


def _t5_family(folders):
  """The LoRA family of the T5 runs, as their workdirs' saved configs give it."""
  from transformer_jax import pretrained_run  # pylint: disable=import-outside-toplevel
  config = _t5_config(folders("t5"), "", 20)
  pretrained_run.apply(config, checkpoint_lib.open_checkpoint(config.pretrained))
  return families.get(config)


@pytest.fixture(scope="module")
def t5_run(folders, tmp_path_factory, data_cache):
  """T5 with rank-4 adapters on every projection: 10 steps, then resumed to 20."""
  workdir = str(tmp_path_factory.mktemp("t5_lora") / "run")
  first = train.train_and_evaluate(_t5_config(folders("t5"), data_cache, 10), workdir)
  last = train.train_and_evaluate(_t5_config(folders("t5"), data_cache, 20), workdir)
  return workdir, first, last


def _model_inputs(family, count: int = 3, length: int = 9):
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, 300, (count, length))
  tokens[1, 5:] = 0  # a padded row
  return [jnp.asarray(tokens)] * family.num_model_inputs


@pytest.mark.parametrize("kind,config_update", [
    ("t5", {}), ("bart", {}), ("bert", {"task": "classification"}),
    ("llama", {"architecture": "decoder_only"})])
def test_adapters_start_as_the_base(kind, config_update, folders, data_cache):
  """B = 0 at the start: the adapted model's outputs are the base's, exactly."""
  from transformer_jax import pretrained_run  # pylint: disable=import-outside-toplevel
  config = make_tiny_config(data_cache)
  config.update(pretrained=folders(kind), **config_update)
  config.model.num_classes = 3  # the BERT checkpoint's head
  config.lora.update(rank=4, targets="all")
  checkpoint = checkpoint_lib.open_checkpoint(config.pretrained)
  pretrained_run.apply(config, checkpoint)
  adapted, base = families.get(config), families.get(lora_lib.without(config))
  params = checkpoint_lib.read_params(checkpoint)
  adapters, _ = lora_lib.split(adapted.init_params(jax.random.PRNGKey(1)))
  inputs = _model_inputs(base)
  ours = adapted.model.apply({"params": lora_lib.combine(adapters, params)}, *inputs,
                             deterministic=True)
  theirs = base.model.apply({"params": params}, *inputs, deterministic=True)
  assert len(jax.tree.leaves(adapters)) > 10
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
  # Layer-wise learning-rate decay scales an adapter as the kernel it adapts.
  decay = traverse_util.flatten_dict(layer_decay.multipliers(lora_lib.combine(adapters, params),
                                                             0.5))
  for path, factor in decay.items():
    if lora_lib.is_adapter(path):
      kernel = path[:-2] + (path[-2].removesuffix(lora_lib.SUFFIX), "kernel")
      assert factor == decay[kernel] < 1


def test_training_moves_only_the_adapters(t5_run, folders):
  workdir, first, last = t5_run
  assert last["loss"] < first["loss"]
  # The frozen base, kept once, is the import bit for bit.
  imported = checkpoint_lib.read_params(checkpoint_lib.open_checkpoint(folders("t5")))
  trained, base, step = predict.restore_lora(workdir, _t5_family(folders))
  assert step == 20
  assert jax.tree.structure(base) == jax.tree.structure(imported)
  for ours, theirs in zip(jax.tree.leaves(base), jax.tree.leaves(imported)):
    np.testing.assert_array_equal(np.asarray(ours), theirs)
  # Each step's checkpoint holds the adapters alone, and their optimizer state no more.
  flat = traverse_util.flatten_dict(trained)
  assert flat and all(lora_lib.is_adapter(path) for path in flat)
  assert any(np.any(np.asarray(v) != 0) for p, v in flat.items() if p[-1] == "b")
  manager = checkpoints.manager(workdir, read_only=True)
  opt_meta = manager.item_metadata(20)["opt_state"]
  opt_shapes = [tuple(leaf.shape) for leaf in jax.tree.leaves(getattr(opt_meta, "tree", opt_meta))
                if hasattr(leaf, "shape")]
  # Adam's two moments of each adapter (and its step counters): nothing of the base's.
  adapter_values = sum(x.size for x in jax.tree.leaves(trained))
  assert 0 < sum(int(np.prod(shape)) for shape in opt_shapes) - 2 * adapter_values <= 4
  assert not {x.shape for x in jax.tree.leaves(imported) if x.ndim >= 2} & set(opt_shapes)
  assert sorted(os.listdir(os.path.join(workdir, checkpoints.LORA_BASE_DIR))) == ["0"]


def test_resumed_run_equals_an_uninterrupted_one(t5_run, folders, tmp_path, data_cache):
  workdir, _, resumed = t5_run
  whole = train.train_and_evaluate(_t5_config(folders("t5"), data_cache, 20),
                                   str(tmp_path / "whole"))
  np.testing.assert_allclose(resumed["loss"], whole["loss"], rtol=1e-6)
  family = _t5_family(folders)
  ours, _, _ = predict.restore_lora(workdir, family, with_base=False)
  theirs, _, _ = predict.restore_lora(str(tmp_path / "whole"), family, with_base=False)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def _seq2seq_logits(model, tokens: np.ndarray, decoder_inputs: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(tokens != 0),
                 decoder_input_ids=torch.tensor(decoder_inputs)).logits.numpy()


def test_peft_export_loads_in_peft_and_merged_export_in_transformers(t5_run, folders,
                                                                     tmp_path):
  workdir, _, _ = t5_run
  adapter_dir, merged_dir = str(tmp_path / "adapter"), str(tmp_path / "merged")
  assert commands.run_export(workdir, adapter_dir, export_format="peft") == [
      peft_lib.CONFIG, peft_lib.WEIGHTS]
  commands.run_export(workdir, merged_dir)
  adapter_config = json.load(open(os.path.join(adapter_dir, peft_lib.CONFIG)))
  assert adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 8.0
  assert adapter_config["base_model_name_or_path"] == folders("t5")

  base = transformers.AutoModelForSeq2SeqLM.from_pretrained(folders("t5")).eval()
  peft_model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
  merged = transformers.AutoModelForSeq2SeqLM.from_pretrained(merged_dir).eval()
  predictor = Predictor.from_workdir(workdir)  # the adapters merged at load
  assert predictor.family.model_config.lora is None
  vocab = predictor.tokenizer.vocab_map
  rng = np.random.default_rng(0)
  inputs, targets = rng.integers(3, 300, (2, 12)), rng.integers(3, 300, (2, 9))
  inputs[1, 7:], targets[0, 5:] = 0, 0
  params = predictor.layout.checkpoint_state(predictor.device_params)
  ours = np.asarray(predictor.family.model.apply(
      {"params": params}, jnp.asarray(inputs), jnp.asarray(targets), deterministic=True))
  decoder_inputs = vocab.hf(np.asarray(models.shift_right(
      jnp.asarray(targets), predictor.family.model_config.bos_id)))
  real = targets != 0
  for model in (peft_model, merged):
    theirs = _seq2seq_logits(model, vocab.hf(inputs), decoder_inputs)
    np.testing.assert_allclose(ours[real], theirs[..., vocab.to_hf][real], atol=1e-4)
  # (PeftModel adapted `base` in place: the base's own logits from a fresh copy.)
  base = transformers.AutoModelForSeq2SeqLM.from_pretrained(folders("t5")).eval()
  base_logits = _seq2seq_logits(base, vocab.hf(inputs), decoder_inputs)
  assert np.abs(base_logits[..., vocab.to_hf][real] - ours[real]).max() > 1e-2  # it trained

  # Greedy outputs of PEFT's model are --mode predict's.
  source = tmp_path / "source.txt"
  source.write_text("\n".join(TEXTS) + "\n")
  commands.run_predict(workdir, str(source), str(tmp_path / "ours.txt"))
  tokenizer = transformers.AutoTokenizer.from_pretrained(folders("t5"))
  batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
  with torch.no_grad():
    generated = peft_model.generate(**batch, max_new_tokens=8, do_sample=False, num_beams=1)
  theirs = tokenizer.batch_decode(generated, skip_special_tokens=True)
  assert (tmp_path / "ours.txt").read_text().splitlines() == theirs


def _random_peft_adapter(base, folder: str, targets, seed: int = 0, **config):
  """A PEFT LoRA adapter of `base` as peft writes it, with random non-zero B."""
  torch.manual_seed(seed)
  model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=16, target_modules=targets,
                                                    **config))
  with torch.no_grad():
    for name, param in model.named_parameters():
      if "lora_B" in name:
        param.normal_(0.0, 0.3)
  model.save_pretrained(folder)
  return model.eval()


def test_peft_adapters_import_with_equal_logits(folders, tmp_path):
  """Adapters written by peft itself, served with --adapter: Llama (grouped query attention,
  every linear layer) and a BERT classifier whose head PEFT saves beside them."""
  from tests.test_pretrained_encoders import _logits_against_pytorch  # pylint: disable=import-outside-toplevel
  base = transformers.AutoModelForCausalLM.from_pretrained(folders("llama")).eval()
  adapter_dir = str(tmp_path / "llama_adapter")
  theirs = _random_peft_adapter(base, adapter_dir, "all-linear")
  predictor = Predictor.from_pretrained(folders("llama"), adapter=adapter_dir)
  _logits_against_pytorch(predictor, theirs, "llama", count=3)

  bert = transformers.AutoModelForSequenceClassification.from_pretrained(folders("bert"))
  bert_dir = str(tmp_path / "bert_adapter")
  theirs = _random_peft_adapter(bert, bert_dir, ["query", "value", "output.dense"],
                                task_type="SEQ_CLS")
  with torch.no_grad():  # a head PEFT trained in full (modules_to_save)
    theirs.base_model.model.classifier.modules_to_save["default"].weight.normal_()
  theirs.save_pretrained(bert_dir)
  predictor = Predictor.from_pretrained(folders("bert"), adapter=bert_dir)
  tokenizer = transformers.AutoTokenizer.from_pretrained(folders("bert"))
  batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
  with torch.no_grad():
    expected = torch.softmax(theirs(**batch).logits, -1).numpy()
  probabilities = [dict(outputs) for outputs in predictor.predict_nbest(TEXTS, 3)]
  names = predictor.config.label_names
  ours = np.exp([[p[name] for name in names] for p in probabilities])  # log-probabilities
  np.testing.assert_allclose(ours, expected, atol=1e-5)


def test_training_continues_from_a_peft_adapter(folders, tmp_path, data_cache):
  base = transformers.AutoModelForCausalLM.from_pretrained(folders("llama")).eval()
  adapter_dir = str(tmp_path / "adapter")
  _random_peft_adapter(base, adapter_dir, ["q_proj", "v_proj"])
  config = make_tiny_config(data_cache)
  config.update(architecture="decoder_only", pretrained=folders("llama"), num_train_steps=1,
                learning_rate=1e-9, warmup_steps=1, eval_every_steps=1,
                num_generate_examples=0)
  config.lora.init = adapter_dir  # its rank, alpha and targets come with it
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(config, workdir)
  exported = str(tmp_path / "exported")
  commands.run_export(workdir, exported, export_format="peft")
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  before = load_file(os.path.join(adapter_dir, peft_lib.WEIGHTS))
  after = load_file(os.path.join(exported, peft_lib.WEIGHTS))
  assert sorted(before) == sorted(after)
  for name, value in before.items():
    np.testing.assert_allclose(after[name], value, atol=1e-6)


def test_lora_on_an_eight_device_mesh_equals_one_device(folders, tmp_path, data_cache):
  """Llama (2 key/value heads) with adapters on every projection and a bfloat16 base, over a
  data 2 x fsdp 2 x tensor 2 mesh, against pmap on one device: the same losses and adapters."""
  settings = dict(architecture="decoder_only", pretrained=folders("llama"),
                  num_train_steps=6, eval_every_steps=6, checkpoint_every_steps=6,
                  learning_rate=3e-3, num_generate_examples=0)
  lora = dict(rank=4, targets="all", base_dtype="bfloat16")
  config = make_tiny_config(data_cache)
  config.update(per_device_batch_size=16, **settings)
  config.lora.update(lora)
  config.model.dropout_rate = 0.0  # the same masks on every layout
  one = str(tmp_path / "one")
  train.train_and_evaluate(config, one)  # here: one device
  mesh = str(tmp_path / "mesh")
  overrides = [f"--config.{k}={v}" for k, v in settings.items()]
  overrides += [f"--config.lora.{k}={v}" for k, v in lora.items()]
  result = cli.run(mesh, *overrides, "--config.model.dropout_rate=0",
                   "--config.per_device_batch_size=2", "--config.parallel.mode=jit",
                   "--config.parallel.data=2", "--config.parallel.fsdp=2",
                   "--config.parallel.tensor=2", cache=data_cache, environ=cli.env(8))
  assert result.returncode == 0, result.stderr[-3000:]
  lora_family = families.get(workdir_lib.load_config(one))
  ours, base, _ = predict.restore_lora(one, lora_family)
  assert {x.dtype for x in jax.tree.leaves(base)} == {jnp.dtype("bfloat16")}  # half the memory
  theirs, _, _ = predict.restore_lora(mesh, lora_family, with_base=False)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
  # Both read back by one device, merged.
  metrics = [commands.run_evaluate(w, split="validation") for w in (one, mesh)]
  np.testing.assert_allclose(metrics[0]["loss"], metrics[1]["loss"], rtol=1e-5)


def test_bad_lora_input_is_one_line_with_nothing_written(folders, tmp_path, data_cache):
  t5, llama = folders("t5"), folders("llama")
  workdir = tmp_path / "run"
  result = cli.run(workdir, f"--config.pretrained={t5}", "--config.lora.rank=4",
                   "--config.lora.targets=q_proj", cache=data_cache)
  assert result.returncode != 0 and "config.lora.targets='q_proj' matches no layer" in (
      cli.user_error(result.stderr))
  assert not workdir.exists()
  config = make_tiny_config(data_cache)  # the same checks, in this process
  config.lora.update(rank=0, alpha=16.0)
  assert config_validation.problems(config) == [
      "config.lora.alpha=16.0 is set but config.lora.rank=0 (LoRA off): set config.lora.rank "
      "> 0 to train adapters, or drop alpha"]
  result = cli.run(workdir, "--mode", "predict", "--adapter", str(tmp_path), cache=data_cache)
  assert "--adapter adds a PEFT adapter to --pretrained" in cli.user_error(result.stderr)

  # An adapter of another base: its modules, or their sizes, are not this model's.
  llama_adapter = str(tmp_path / "llama_adapter")
  _random_peft_adapter(transformers.AutoModelForCausalLM.from_pretrained(llama),
                       llama_adapter, ["q_proj", "v_proj"])
  with pytest.raises(checkpoint_lib.PretrainedError, match="made for .*llama"):
    Predictor.from_pretrained(t5, adapter=llama_adapter)
  config_path = os.path.join(llama_adapter, peft_lib.CONFIG)
  adapter_config = json.load(open(config_path))
  json.dump(dict(adapter_config, base_model_name_or_path=t5), open(config_path, "w"))
  with pytest.raises(checkpoint_lib.PretrainedError, match="adapts modules that"):
    Predictor.from_pretrained(t5, adapter=llama_adapter)
