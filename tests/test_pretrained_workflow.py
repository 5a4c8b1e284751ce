"""Pretrained checkpoints through the commands: serve, fine-tune, export, and bad input.

Tiny Hugging Face models made here (tests/hf_fixtures.py) stand in for hub checkpoints; the
exactness of the import itself is tests/test_pretrained_models.py's.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import cli
from tests import hf_fixtures
from tests.conftest import make_tiny_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXTS = ["A man is riding a bike down the street.", "Two dogs play in the snow.",
         "A woman in a red coat reads a book."]


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory):
  return hf_fixtures.tiny_model("t5", str(tmp_path_factory.mktemp("t5")))


@pytest.fixture(scope="module")
def marian_folder(tmp_path_factory):
  return hf_fixtures.tiny_model("marian", str(tmp_path_factory.mktemp("marian")))


def _hf_greedy(folder: str, texts: list[str], max_new_tokens: int) -> list[str]:
  model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  encoded = tokenizer(texts, return_tensors="pt", padding=True)
  with torch.no_grad():
    ids = model.generate(**encoded, num_beams=1, do_sample=False, max_new_tokens=max_new_tokens)
  return tokenizer.batch_decode(ids, skip_special_tokens=True)


def test_predict_pretrained_cli_and_predictor_equal_hf_generate(marian_folder):
  # Marian: its generation_config bans the pad token and forces EOS at the length limit.
  expected = _hf_greedy(marian_folder, TEXTS, 10)
  result = subprocess.run(
      [sys.executable, "-m", "transformer_jax.main", "--pretrained", marian_folder,
       "--mode", "predict", "--config.decoding.method=greedy",
       "--config.decoding.max_decode_len=10"],
      input="\n".join(TEXTS) + "\n", cwd=cli.ROOT, env=cli.env(), capture_output=True,
      text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.splitlines() == expected

  from transformer_jax.predict import Predictor  # pylint: disable=import-outside-toplevel
  predictor = Predictor.from_pretrained(marian_folder)
  assert predictor.config.decoding.banned_ids == (0,)  # the pad token, renumbered
  assert predictor.config.decoding.forced_eos
  assert predictor.predict(TEXTS, method="greedy", max_decode_len=10) == expected


def test_fine_tune_evaluate_and_export(t5_folder, tmp_path, data_cache):
  from transformer_jax.model import models  # pylint: disable=import-outside-toplevel
  from transformer_jax import train  # pylint: disable=import-outside-toplevel
  from transformer_jax.predict import Predictor  # pylint: disable=import-outside-toplevel
  from transformer_jax.pretrained import run_files  # pylint: disable=import-outside-toplevel
  config = make_tiny_config(data_cache)
  config.pretrained = t5_folder
  config.num_train_steps, config.eval_every_steps, config.learning_rate = 20, 20, 3e-3
  config.model.num_layers = 6  # the checkpoint's architecture replaces the config file's
  workdir = str(tmp_path / "run")
  first = train.train_and_evaluate(config, workdir)
  config.num_train_steps = 40  # resumes from step 20: the workdir's weights, not the import
  last = train.train_and_evaluate(config, workdir)
  assert last["loss"] < first["loss"]
  assert sorted(os.listdir(os.path.join(workdir, "pretrained"))) == [
      "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]

  predictor = Predictor.from_workdir(workdir)  # the saved tokenizer files
  assert predictor.family.model_config.num_layers == 2
  assert len(predictor.predict(["Der Hund schläft."])) == 1

  output = str(tmp_path / "exported")
  result = cli.run(workdir, "--mode", "export", "--output", output)
  assert result.returncode == 0, result.stderr[-3000:]
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(output))
  params = predictor.layout.checkpoint_state(predictor.device_params)
  vocab = run_files.saved_vocab(workdir)
  rng = np.random.default_rng(0)
  inputs, targets = rng.integers(3, 300, (2, 12)), rng.integers(3, 300, (2, 9))
  inputs[1, 7:], targets[0, 5:] = 0, 0
  ours = np.asarray(predictor.family.model.apply(
      {"params": params}, jnp.asarray(inputs), jnp.asarray(targets), deterministic=True))
  decoder_inputs = np.asarray(models.shift_right(jnp.asarray(targets),
                                                 predictor.family.model_config.bos_id))
  reloaded = transformers.AutoModelForSeq2SeqLM.from_pretrained(output).eval()
  with torch.no_grad():
    theirs = reloaded(input_ids=torch.tensor(vocab.hf(inputs)),
                      attention_mask=torch.tensor(inputs != 0),
                      decoder_input_ids=torch.tensor(vocab.hf(decoder_inputs))).logits.numpy()
  np.testing.assert_allclose(ours[targets != 0], theirs[..., vocab.to_hf][targets != 0],
                             atol=1e-4)


@pytest.fixture(scope="module")
def bart_folder(tmp_path_factory):
  return hf_fixtures.tiny_model("bart", str(tmp_path_factory.mktemp("bart")))


def test_fine_tune_under_jit_and_evaluate_pretrained(bart_folder, tmp_path, data_cache):
  """BART fine-tuned under the jit layout (weights placed in their shardings), then the
  checkpoint as it is scored by --mode evaluate --pretrained (no workdir)."""
  from transformer_jax import train  # pylint: disable=import-outside-toplevel
  config = make_tiny_config(data_cache)
  config.pretrained = bart_folder
  config.parallel.mode = "jit"
  config.num_train_steps, config.eval_every_steps, config.learning_rate = 10, 10, 1e-3
  result = train.train_and_evaluate(config, str(tmp_path / "run"))
  assert np.isfinite(result["loss"]) and "bleu" in result

  demo = [f"--config.demo.{k}={v}" for k, v in
          dict(num_train=100, num_validation=8, num_test=8, cache_dir=data_cache).items()]
  scored = _serve("--pretrained", bart_folder, "--mode", "evaluate",
                  "--config.decoding.max_decode_len=8", *demo)
  assert scored.returncode == 0, scored.stderr[-3000:]
  metrics = json.loads(scored.stdout.splitlines()[-1])
  assert metrics["pretrained"] == bart_folder and metrics["examples"] == 8
  assert "bleu" in metrics and metrics["step"] == 0


def _serve(*args, environ=None):
  return cli.run_main(*args, environ=environ, input="A sentence.\n")


def test_bad_checkpoints_are_one_line_errors(t5_folder, tmp_path):
  no_weights = tmp_path / "no_weights"
  no_weights.mkdir()
  (no_weights / "config.json").write_text(open(os.path.join(t5_folder, "config.json")).read())
  bin_only = tmp_path / "bin_only"
  bin_only.mkdir()
  (bin_only / "config.json").write_text(open(os.path.join(t5_folder, "config.json")).read())
  (bin_only / "pytorch_model.bin").write_bytes(b"\0")
  unsupported = tmp_path / "unsupported"
  unsupported.mkdir()
  (unsupported / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
  cases = [(no_weights, "no weights"), (bin_only, ".bin weights"),
           (unsupported, "not supported; supported: bart")]
  for folder, message in cases:
    result = _serve("--pretrained", str(folder), "--mode", "predict")
    assert result.returncode == 1 and message in cli.user_error(result.stderr), result.stderr
  offline = _serve("--pretrained", "nobody/no-such-model", "--mode", "predict",
                   environ=cli.env(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home")))
  assert offline.returncode == 1
  assert "hf download nobody/no-such-model" in cli.user_error(offline.stderr)
  workdir = tmp_path / "refused"
  refused = cli.run(workdir, "--config", "tests/tiny_config.py:" + str(tmp_path / "cache"),
                    f"--config.pretrained={t5_folder}", "--config.model.num_heads=2")
  assert refused.returncode == 2
  assert "--config.model.num_heads=2" in cli.user_error(refused.stderr)
  assert not workdir.exists()  # refused before anything was written


def test_config_checks_of_pretrained_runs_and_model_options():
  from transformer_jax import config_validation  # pylint: disable=import-outside-toplevel
  from transformer_jax import default_config  # pylint: disable=import-outside-toplevel
  config = default_config.get_config()
  config.model.update(position_embedding="relative", relative_attention_num_buckets=32,
                      relative_attention_max_distance=16)
  assert any("must exceed half" in p for p in config_validation.problems(config))
  config = default_config.get_config()
  config.model.update(logits_bias=True, tie_output=False)
  assert any("logits_bias=True is for the tied" in p for p in config_validation.problems(config))
