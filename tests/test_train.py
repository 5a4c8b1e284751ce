"""End to end on a tiny config: train, resume, evaluate, predict, accumulate gradients."""

import json
import os

import jax
import numpy as np
import pytest

from transformer_jax import checkpoints
from transformer_jax import commands
from transformer_jax import main
from transformer_jax import predict
from transformer_jax import train
from transformer_jax import workdir as workdir_lib


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_cache):
  from tests.conftest import make_tiny_config
  workdir = str(tmp_path_factory.mktemp("trained"))
  config = make_tiny_config(data_cache)
  result = train.train_and_evaluate(config, workdir)
  return config, workdir, result


def test_train_and_evaluate_writes_everything(trained):
  config, workdir, result = trained
  assert set(result) >= {"loss", "accuracy", "perplexity", "bleu"}
  assert np.isfinite(result["loss"]) and 0 <= result["accuracy"] <= 1
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["10", "20"]
  assert os.path.exists(os.path.join(workdir, "tokenizer.model"))
  assert workdir_lib.load_config(workdir).model.emb_dim == config.model.emb_dim
  for run in ("train", "eval"):  # the event files themselves: tests/test_run_logging.py
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(workdir, run)))


def test_resume_continues_exactly(tmp_path, tiny_config, trained):
  _, _, uninterrupted = trained
  tiny_config.num_train_steps = 10  # "interrupted" after the first checkpoint
  train.train_and_evaluate(tiny_config, str(tmp_path))
  tiny_config.num_train_steps = 20
  resumed = train.train_and_evaluate(tiny_config, str(tmp_path))
  np.testing.assert_allclose(resumed["loss"], uninterrupted["loss"], rtol=1e-5)


def test_evaluate_and_predict_from_workdir(trained, tmp_path):
  _, workdir, result = trained
  evaluated = commands.run_evaluate(workdir, split="validation")
  np.testing.assert_allclose(evaluated["loss"], result["loss"], rtol=1e-5)
  assert evaluated["step"] == 20
  assert evaluated["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
  source = tmp_path / "in.txt"
  long_line = " ".join(["dog"] * 5000).encode()
  source.write_bytes(b"The dog sees the cat.\n\nOften a child finds \xff our birds.\n" +
                     long_line + b"\n")
  output = tmp_path / "out.txt"
  commands.run_predict(workdir, str(source), str(output))
  lines = output.read_text(encoding="utf-8").split("\n")
  assert len(lines) == 5 and lines[-1] == "" and lines[1] == ""  # 4 lines, 2nd empty


def test_predict_keeps_order_across_length_buckets(trained):
  _, workdir, _ = trained
  predictor = predict.Predictor.from_workdir(workdir)
  texts = ["The dog sees the cat.", "", "I think that the old teachers have shown a red ball "
           "to my brave neighbours.", "A cat.", "   "]
  together = predictor.predict(texts)
  one_by_one = [predictor.predict([t])[0] for t in texts]
  assert together == one_by_one
  assert together[1] == "" and together[4] == ""


def test_checkpoint_averaging_is_the_parameter_mean(trained):
  _, workdir, _ = trained
  init_params = predict.Predictor.from_workdir(workdir).family.init_params
  last, _ = checkpoints.restore_params(workdir, init_params, 20)
  previous, _ = checkpoints.restore_params(workdir, init_params, 10)
  averaged, step = checkpoints.restore_params(workdir, init_params, average_last=2)
  assert step == 20
  for a, x, y in zip(*(jax.tree.leaves(t) for t in (averaged, last, previous))):
    np.testing.assert_allclose(a, (np.asarray(x, np.float64) + y) / 2, rtol=1e-6, atol=1e-7)


def test_restore_rejects_other_model_shape(trained, tiny_config):
  _, workdir, _ = trained
  tiny_config.model.emb_dim = 64
  tiny_config.model.qkv_dim = 64
  with pytest.raises(checkpoints.CheckpointError, match="does not match this model") as error:
    train.train_and_evaluate(tiny_config, workdir)
  assert ("Changed since this workdir was trained: model.emb_dim (saved 32, given 64); "
          "model.qkv_dim (saved 32, given 64).") in str(error.value)
  assert workdir_lib.load_config(workdir).model.emb_dim == 32  # the saved config is kept


def test_evaluate_without_checkpoint_says_what_to_do(tmp_path):
  with pytest.raises(workdir_lib.WorkdirError, match="not a training workdir"):
    commands.run_evaluate(str(tmp_path))


def test_cross_entropy_gradient_matches_autodiff():
  from transformer_jax import metrics
  import jax.numpy as jnp
  logits = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 11)) * 3
  targets = jax.random.randint(jax.random.PRNGKey(1), (3, 5), 0, 11)

  def reference(logits, smoothing):
    log_probs = jax.nn.log_softmax(logits)
    soft = jax.nn.one_hot(targets, 11) * (1 - smoothing - smoothing / 10) + smoothing / 10
    return -jnp.sum(soft * log_probs, -1)

  for smoothing in (0.0, 0.1):
    weights = jnp.arange(15.0).reshape(3, 5)
    ours = jax.grad(lambda x: jnp.sum(weights * metrics.smoothed_cross_entropy(x, targets,
                                                                             smoothing)))(logits)
    theirs = jax.grad(lambda x: jnp.sum(weights * reference(x, smoothing)))(logits)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    value, plain = metrics.smoothed_cross_entropy(logits, targets, smoothing,
                                                  also_unsmoothed=True)
    np.testing.assert_allclose(plain, reference(logits, 0.0), rtol=1e-5)
    entropy = 0.0 if smoothing == 0 else -(0.9 * np.log(0.9) + 0.1 * np.log(0.01))
    np.testing.assert_allclose(value, reference(logits, smoothing) - entropy, rtol=1e-5,
                               atol=1e-6)


def test_gradient_accumulation_equals_the_big_batch(tmp_path, tiny_config):
  tiny_config.model.dropout_rate = 0.0
  tiny_config.num_generate_examples = 0
  tiny_config.num_train_steps = 10
  big = train.train_and_evaluate(tiny_config, str(tmp_path / "big"))
  tiny_config.per_device_batch_size = 4
  tiny_config.grad_accum_steps = 4
  accumulated = train.train_and_evaluate(tiny_config, str(tmp_path / "accumulated"))
  np.testing.assert_allclose(accumulated["loss"], big["loss"], rtol=1e-5)
  np.testing.assert_allclose(accumulated["accuracy"], big["accuracy"], rtol=1e-5)


def test_token_metrics_count_a_token_correct_when_argmax_picks_its_target():
  from transformer_jax import metrics
  import jax.numpy as jnp
  logits = jnp.array([[[0.1, 2.0, 0.3], [1.0, 0.0, 5.0], [4.0, 4.0, 1.0], [0.0, 1.0, 0.5]]])
  # right, wrong, tied with the largest (argmax picks index 0: wrong), right but padding
  targets = jnp.array([[1, 0, 1, 1]])
  weights = jnp.array([[1.0, 1.0, 1.0, 0.0]])
  sums = metrics.token_metrics(logits, targets, weights)
  assert float(sums["accuracy"]) == 1.0 and float(sums["denominator"]) == 3.0
  plain = -jax.nn.log_softmax(logits)[0, jnp.arange(4), targets[0]]
  np.testing.assert_allclose(sums["loss"], jnp.sum(plain * weights[0]), rtol=1e-6)


@pytest.mark.parametrize("before, after", [
    (None, main.CPU_MEMORY_SCHEDULER),
    ("--xla_force_host_platform_device_count=8",
     "--xla_force_host_platform_device_count=8 " + main.CPU_MEMORY_SCHEDULER),
    ("--xla_cpu_enable_concurrency_optimized_scheduler=true",  # the user's choice stands
     "--xla_cpu_enable_concurrency_optimized_scheduler=true"),
])
def test_training_schedules_xla_cpu_for_memory_unless_the_user_chose(before, after):
  environ = {} if before is None else {"XLA_FLAGS": before}
  for _ in range(2):  # once only
    main.schedule_cpu_for_memory(environ)
    assert environ["XLA_FLAGS"] == after
