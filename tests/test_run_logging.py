"""What a training run leaves to read: TensorBoard runs, keep-best checkpoints, early stopping."""

import json
import math
import os
import re
import sys

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from transformer_jax import checkpoints
from transformer_jax import commands
from transformer_jax import config_validation
from transformer_jax import predict
from transformer_jax import train
from tests.conftest import ROOT


def _events(workdir, run):
  accumulator = event_accumulator.EventAccumulator(os.path.join(workdir, run), size_guidance={
      event_accumulator.TENSORS: 0, event_accumulator.SCALARS: 0, event_accumulator.IMAGES: 0})
  accumulator.Reload()
  return accumulator


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, data_cache):
  """A run whose BLEU can never improve (one-token outputs score 0), so early stopping ends
  it at the second evaluation without a better score."""
  from tests.conftest import make_tiny_config
  config = make_tiny_config(data_cache)
  config.num_train_steps = 40
  config.eval_every_steps = 5
  config.checkpoint_every_steps = 100
  config.num_generate_examples = 8
  config.decoding.max_decode_len = 1
  config.checkpoint_best_metric = "bleu"
  config.early_stopping_evals = 2
  config.profile_steps = (12, 10)  # cut short by the early stop at step 15
  config.attention_images.update(dict(layers=(0,), heads=(0, -1)))
  workdir = str(tmp_path_factory.mktemp("stopped"))
  return workdir, train.train_and_evaluate(config, workdir)


def test_train_and_eval_runs_share_tags_and_log_the_config(stopped):
  workdir, _ = stopped
  train_run, eval_run = _events(workdir, "train"), _events(workdir, "eval")
  train_tags, eval_tags = set(train_run.Tags()["scalars"]), set(eval_run.Tags()["scalars"])
  assert {"loss", "accuracy", "perplexity"} <= train_tags & eval_tags  # they overlay
  assert {"grad_norm", "param_norm", "learning_rate", "tokens_per_sec", "step_time_s",
          "mfu"} <= train_tags
  assert {"bleu", "eval_time_s", "decode_time_s"} <= eval_tags
  # log_every_steps 5: one point per log line, the first rate-less line included.
  assert [e.step for e in train_run.Scalars("grad_norm")] == [5, 10, 15]
  for tag in ("grad_norm", "param_norm", "mfu"):
    values = [e.value for e in train_run.Scalars(tag)]
    assert all(math.isfinite(v) and v > 0 for v in values), (tag, values)
  # The parameters grow from their initialisation: a real norm, not a constant.
  assert len({e.value for e in train_run.Scalars("param_norm")}) == 3
  config_text = train_run.Tensors("config")[0]
  assert config_text.step == 0
  saved = json.loads(config_text.tensor_proto.string_val[0].decode())
  assert saved["checkpoint_best_metric"] == "bleu" and saved["model"]["emb_dim"] == 32
  assert "samples" in eval_run.Tags()["tensors"]
  assert "_hparams_/session_start_info" in train_run.Tags()["tensors"]
  # Attention heatmaps of the first generated example at each evaluation.
  assert sorted(eval_run.Tags()["images"]) == [
      f"attention/{kind}/layer_0/head_{head}" for kind in ("cross", "decoder_self",
                                                           "encoder_self") for head in (0, 1)]
  images = eval_run.Images("attention/cross/layer_0/head_1")
  assert [image.step for image in images] == [5, 10, 15]
  png = images[0].encoded_image_string
  assert png.startswith(b"\x89PNG") and images[0].width > 100 and images[0].height > 100


def _traces(workdir):
  return [name for _, _, names in os.walk(os.path.join(workdir, "profile")) for name in names
          if name.endswith(".xplane.pb")]


def test_early_stopping_saves_and_keeps_the_best(stopped):
  workdir, result = stopped
  assert len(_traces(workdir)) == 1  # the profile running at the stop was written
  # Evaluations at 5 (first: the best), 10 and 15 (no better BLEU): stopped at 15.
  assert result["stopped_early"] and result["best"] == dict(metric="bleu", value=0.0, step=5)
  assert checkpoints.manager(workdir, read_only=True).all_steps() == [15]
  assert sorted(os.listdir(os.path.join(workdir, checkpoints.BEST_DIR))) == ["5"]
  evaluated = commands.run_evaluate(workdir, "best", split="validation")
  assert evaluated["step"] == 5 and evaluated["checkpoint"] == "best"
  assert commands.run_evaluate(workdir, split="validation")["step"] == 15
  # The best parameters are step 5's, not the latest.
  init = predict.Predictor.from_workdir(workdir).family.init_params
  best, _ = checkpoints.restore_params(workdir, init, "best")
  latest, _ = checkpoints.restore_params(workdir, init)
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(best),
                                                         jax.tree.leaves(latest)))


def test_evaluate_cli_takes_the_best_checkpoint(stopped):
  from tests import cli
  workdir, _ = stopped
  run = cli.run(workdir, "--mode", "evaluate", "--split", "validation", "--checkpoint", "best")
  assert run.returncode == 0, run.stderr[-3000:]
  assert json.loads(run.stdout.splitlines()[-1])["step"] == 5


def test_attention_cli_draws_a_sentence_from_the_workdir(stopped):
  from tests import cli
  workdir, _ = stopped
  png = os.path.join(workdir, "attention.png")
  run = cli.run(workdir, "--mode", "attention", "--text", "the red house", "--output", png)
  assert run.returncode == 0, run.stderr[-3000:]
  assert f"drawn in {png}" in run.stdout
  with open(png, "rb") as f:
    header = f.read(24)
  # Saved config: layer 0, heads (0, -1) -> 3 kinds x 2 heads in a 3 x 2 grid.
  width, height = int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")
  assert header.startswith(b"\x89PNG") and height > width > 0
  missing = cli.run(workdir, "--mode", "attention", "--output", png)
  assert missing.returncode != 0 and "--mode attention needs --text" in missing.stderr


def test_best_checkpoint_missing_says_what_to_do(tmp_path, tiny_config):
  tiny_config.num_train_steps = 1
  tiny_config.num_generate_examples = 0
  train.train_and_evaluate(tiny_config, str(tmp_path))
  with pytest.raises(checkpoints.CheckpointError, match="checkpoint_best_metric=NAME"):
    commands.run_evaluate(str(tmp_path), "best", split="validation")


@pytest.mark.parametrize("overrides, message", [
    (dict(checkpoint_best_metric="loss"), "set config.checkpoint_best_mode='min'"),
    (dict(checkpoint_best_mode="best"), "checkpoint_best_mode='best' is not one of max, min"),
    (dict(early_stopping_evals=3), "early_stopping_evals needs config.checkpoint_best_metric"),
    (dict(profile_steps=(5,)), "profile_steps=(5,) must be (first step >= 0"),
])
def test_config_refuses_unworkable_best_and_profile_settings(tiny_config, overrides, message):
  tiny_config.update(overrides)
  with pytest.raises(config_validation.ConfigError, match=re.escape(message)):
    config_validation.validate(tiny_config)


@pytest.mark.parametrize("profile_steps", [(0, 2), (2, 2)])  # from the first step, or later
def test_profile_steps_writes_a_trace(tmp_path, tiny_config, profile_steps):
  tiny_config.num_train_steps = 4
  tiny_config.num_generate_examples = 0
  tiny_config.profile_steps = profile_steps
  train.train_and_evaluate(tiny_config, str(tmp_path))
  assert len(_traces(str(tmp_path))) == 1


def test_console_has_one_line_per_log_step_save_lines_and_a_summary(tmp_path, tiny_config,
                                                                     caplog):
  tiny_config.num_train_steps = 10
  tiny_config.num_generate_examples = 0
  caplog.set_level("INFO")
  train.train_and_evaluate(tiny_config, str(tmp_path))
  lines = [r.getMessage() for r in caplog.records]
  progress = [line for line in lines if line.startswith("step ") and "/10: loss" in line]
  assert [line.split(":")[0] for line in progress] == ["step 5/10", "step 10/10"]
  assert all("steps/s" in line and "ETA" in line for line in progress)
  assert sum(line.startswith("Saved checkpoint 10 (") for line in lines) == 1
  summary = [line for line in lines if line.startswith("Finished at step 10 in ")]
  assert len(summary) == 1 and f"Checkpoints: {tmp_path}/checkpoints" in summary[0]


def test_plot_curves_draws_the_train_and_eval_runs(stopped, tmp_path, capsys):
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import plot_curves  # pylint: disable=g-import-not-at-top
  workdir, _ = stopped
  curves = plot_curves.curves(workdir)
  # What training logged, read back: eval BLEU at each evaluation, train loss per log step.
  assert [step for step, _ in curves["eval"]["bleu"]] == [5, 10, 15]
  assert [step for step, _ in curves["train"]["loss"]] == [5, 10, 15]
  assert plot_curves.default_tags([curves]) == ["loss", "bleu"]
  png = str(tmp_path / "curves.png")
  assert plot_curves.main([workdir, workdir, "--labels", "a,b", "--output", png]) == 0
  assert "loss, bleu of 2 workdir(s) drawn in" in capsys.readouterr().out
  with open(png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert plot_curves.main([str(tmp_path / "none"), "--output", png]) == 1
