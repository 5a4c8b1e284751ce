"""Evaluate and predict as research tools: decoding overrides, splits, saved outputs, n-best
with scores, JSON lines, interactive and piped use; every bad config refused up front."""

import json
import os
import subprocess

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from tests import cli
from tests.conftest import ROOT, make_tiny_config
from transformer_jax import commands
from transformer_jax import config_validation
from transformer_jax import predict
from transformer_jax import train


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, data_cache):
  path = str(tmp_path_factory.mktemp("trained"))
  train.train_and_evaluate(make_tiny_config(data_cache), path)
  return path


def test_evaluate_with_decoding_overrides_and_split_writes_outputs(workdir):
  result = cli.run(workdir, "--mode", "evaluate", "--split", "validation",
                   "--config.decoding.method=greedy", "--config.decoding.max_decode_len=20")
  assert result.returncode == 0, result.stderr[-3000:]
  record = json.loads(result.stdout.strip().splitlines()[-1])
  assert record["split"] == "validation" and record["decoding"] == "greedy"
  assert record["examples"] == 48
  folder = os.path.join(workdir, "eval", "step_20", "validation_greedy_len20")
  assert record["outputs"] == folder
  saved = json.load(open(os.path.join(folder, "metrics.json")))
  assert saved["bleu"] == record["bleu"] and saved["decoding_config"]["max_decode_len"] == 20
  for name in ("hypotheses.txt", "sources.txt", "references.txt"):
    assert len(open(os.path.join(folder, name), encoding="utf-8").read().split("\n")) == 49
  accumulator = event_accumulator.EventAccumulator(os.path.join(workdir, "eval_validation"))
  accumulator.Reload()
  assert [e.step for e in accumulator.Scalars("bleu")] == [20]


@pytest.mark.parametrize("args, message", [
    (["--config.model.emb_dim=64"], "model.emb_dim (saved 32, given 64)"),
    (["--config.decoding.beam_siz=3"], 'Did you mean "beam_size"'),
    (["--config.decoding.method=beams"], "did you mean 'beam'"),
    (["--config.decoding.top_p=0"], "decoding.top_p=0.0 must be > 0"),
    (["--split", "dev"], "--split dev: not a split"),
])
def test_evaluate_refuses_what_the_checkpoint_fixes_or_cannot_do(workdir, args, message):
  result = cli.run(workdir, "--mode", "evaluate", *args)
  assert result.returncode in (1, 2)
  assert message in cli.user_error(result.stderr)


def test_predict_nbest_jsonl_scores_best_first(workdir, tmp_path):
  source = tmp_path / "in.txt"
  # Only \n and \r\n end lines: the lone \r stays inside the second line.
  source.write_bytes(b"The dog sees the cat.\r\nA cat\rsees a dog.\n\n")
  result = cli.run(workdir, "--mode", "predict", "--input", str(source), "--nbest", "3",
                   "--output_format", "jsonl")
  assert result.returncode == 0, result.stderr[-3000:]
  lines = [json.loads(line) for line in result.stdout.splitlines()]
  assert [line["source"] for line in lines] == ["The dog sees the cat.", "A cat\rsees a dog.", ""]
  for line in lines[:2]:
    scores = [o["score"] for o in line["outputs"]]
    assert len(scores) == 3 and scores == sorted(scores, reverse=True)
  assert lines[2]["outputs"] == []
  moses = cli.run(workdir, "--mode", "predict", "--input", str(source), "--nbest", "2")
  assert [line.split(" ||| ")[0] for line in moses.stdout.splitlines()] == ["0", "0", "1", "1", ""]
  refused = cli.run(workdir, "--mode", "predict", "--input", str(source), "--nbest", "5")
  assert "decoding.beam_size >= 5" in cli.user_error(refused.stderr)


def test_predict_answers_a_pipe_line_by_line_and_exits_quietly_when_the_reader_leaves(workdir):
  process = subprocess.Popen(cli.command(workdir, "--mode", "predict",
                                         "--config.decoding.method=greedy"),
                             cwd=ROOT, env=cli.env(), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  cli.STARTED.append(process)
  process.stdin.write("The dog sees the cat.\n")
  process.stdin.flush()
  first = process.stdout.readline()  # answered while stdin is still open
  assert first.endswith("\n")
  process.stdout.close()  # the reader goes away, as `| head -1` does
  process.stdin.write("Another line.\n" * 50)
  process.stdin.close()
  process.wait(timeout=120)
  err = process.stderr.read()
  assert process.returncode == 0 and "Traceback" not in err


def test_predictor_decoding_overrides_are_cached_per_setting(workdir):
  predictor = predict.Predictor.from_workdir(workdir)
  texts = ["The dog sees the cat.", "", "My old friends helped the children."]
  greedy = predictor.predict(texts, method="greedy")
  # Beam 1 keeps 2 candidates per step (t5x's search), so it may end where greedy does not.
  assert len(predictor.predict(texts, method="beam", beam_size=1)) == len(texts)
  assert predictor.predict(texts, method="greedy") == greedy
  assert len(predictor.generator._decoders) == 2
  samples = predictor.predict_nbest(texts, 3, method="sample", temperature=1.0)
  assert [len(s) for s in samples] == [3, 0, 3]
  for pairs in samples:
    scores = [score for _, score in pairs]
    assert scores == sorted(scores, reverse=True) and all(np.isfinite(scores))
  for setting in range(predictor.generator.MAX_DECODERS + 2):
    predictor.predict(texts[:1], method="greedy", max_decode_len=setting + 1)
  assert len(predictor.generator._decoders) == predictor.generator.MAX_DECODERS
  with pytest.raises(ValueError, match="did you mean 'beam_size'"):
    predictor.predict(texts, beam_sise=2)
  with pytest.raises(config_validation.ConfigError, match="temperature"):
    predictor.predict(texts, method="sample", temperature=-1.0)


# ≥ 20 bad configs, each refused by the validation pass before anything is written.
BAD_CONFIGS = [
    ("task", "translate", "not one of"),
    ("architecture", "decoder", "did you mean 'decoder_only'"),
    ("dataset", "tfd", "not one of"),
    ("overlong", "cut", "not one of"),
    ("parallel.mode", "pjit", "not one of"),
    ("decoding.method", "beams", "did you mean 'beam'"),
    ("model.dtype", "fp16", "not one of"),
    ("model.attention_implementation", "flash", "not one of"),
    ("prng_impl", "philox", "not one of"),
    ("model.pooling", "max", "not one of"),
    ("per_device_batch_size", 0, "must be >= 1"),
    ("log_every_steps", 0, "must be >= 1"),
    ("learning_rate", 0.0, "must be > 0"),
    ("label_smoothing", 1.0, "< 1"),
    ("decoding.top_p", 0.0, "must be > 0"),
    ("decoding.top_p", 1.5, "<= 1"),
    ("decoding.temperature", -0.5, "must be >= 0"),
    ("decoding.beam_size", 0, "must be >= 1"),
    ("model.dropout_rate", 1.0, "< 1"),
    ("model.num_heads", 3, "divisible by config.model.num_heads=3"),
    ("model.max_len", 16, "max_len=16 is shorter"),
    ("eval_split", "dev", "not a key of config.splits"),
    ("dataset", "local", "needs config.data_dir"),
    ("decoding.max_decode_len", 64, "longer than config.model.max_len"),
]


@pytest.mark.parametrize("key, value, message", BAD_CONFIGS)
def test_bad_config_is_refused_before_any_work(tmp_path, data_cache, key, value, message):
  config = make_tiny_config(data_cache)
  section = config
  for part in key.split(".")[:-1]:
    section = section[part]
  section[key.split(".")[-1]] = value
  if key == "model.attention_implementation":
    config.model.dtype = "bfloat16"
  workdir = tmp_path / "never"
  with pytest.raises(config_validation.ConfigError, match=None) as raised:
    train.train_and_evaluate(config, str(workdir))
  assert message in str(raised.value)
  assert not workdir.exists()


def test_cudnn_attention_in_float32_is_refused(tiny_config):
  tiny_config.model.attention_implementation = "cudnn"
  with pytest.raises(config_validation.ConfigError, match="needs bfloat16 or float16 inputs"):
    config_validation.validate(tiny_config)


def test_cudnn_attention_with_an_unsupported_head_dim_is_refused(tiny_config):
  tiny_config.model.update(attention_implementation="cudnn", dtype="bfloat16", qkv_dim=36,
                           num_heads=2)
  with pytest.raises(config_validation.ConfigError,
                     match="needs a head dimension that is a multiple of 8 up to 256, not 18"):
    config_validation.validate(tiny_config)
  tiny_config.model.qkv_dim = 32
  config_validation.validate(tiny_config)


@pytest.mark.parametrize("config_arg, message", [
    ("configs/nope.py", "No such file or directory"),
    ("{bad}", "invalid syntax"),
    ("configs/demo.py --config.decoding.beam_siz=3", 'Did you mean "beam_size"'),
])
def test_config_flag_errors_are_one_line(tmp_path, config_arg, message):
  broken = tmp_path / "broken.py"
  broken.write_text("def get_config(:\n  pass\n")
  args = config_arg.replace("{bad}", str(broken)).split()
  result = subprocess.run(cli.command(tmp_path / "never", "--config", *args), cwd=ROOT,
                          env=cli.env(), capture_output=True, text=True, timeout=120)
  assert result.returncode == 2
  assert message in cli.user_error(result.stderr)
  assert not (tmp_path / "never").exists()


def test_predictor_keeps_its_own_copy_of_the_parameters(workdir):
  """A Predictor never shares buffers with the arrays it was given (a donated training step
  may overwrite those): deleting them leaves it working."""
  import jax  # pylint: disable=g-import-not-at-top
  from transformer_jax import checkpoints, families, parallel, workdir as workdir_lib
  config = workdir_lib.load_config(workdir)
  expected = predict.Predictor.from_workdir(workdir).predict(["The dog sees the cat."])
  for layout in (parallel.DataParallel(), parallel.MeshParallel()):
    params, step = checkpoints.restore_params(workdir, families.get(config).init_params)
    params = jax.device_put(params, jax.devices()[0])
    predictor = predict.Predictor(config, predict.tokenizer_lib.Tokenizer.load(
        workdir_lib.tokenizer_path(workdir)), params, step, layout)
    for leaf in jax.tree.leaves(params):
      leaf.delete()
    assert predictor.predict(["The dog sees the cat."]) == expected


def test_decoding_options_reach_the_search(workdir):
  """min_length, banned_ids and num_decodes set in config.decoding change what evaluate and
  predict generate."""
  predictor = predict.Predictor.from_workdir(workdir)
  prompts = list(predictor._prompts(["The dog sees the cat."]).values())
  run = lambda nbest=1, **overrides: predictor.output_ids(
      prompts, nbest, predictor.decoding_config(**overrides), with_scores=True)[0]
  greedy = run(method="greedy")[0][0].tolist()
  eos = greedy.index(1)
  banned = run(method="greedy", banned_ids=(greedy[0],))[0][0].tolist()
  assert greedy[0] not in banned
  longer = run(method="greedy", min_length=eos + 3)[0][0].tolist()
  assert 1 not in longer[:eos + 2]
  samples = run(2, method="sample", num_decodes=4)
  assert len(samples) == 2 and samples[0][1] >= samples[1][1]


def test_jsonl_keeps_an_output_exactly_and_text_gives_one_line():
  """A chat model's list or paragraphs: their line breaks are the output's (issue #58)."""
  outputs = [("1. one\n2. two\n\nThe end.", -0.5), ("plain", -1.25)]
  line = commands._format("Make a list.", outputs, 3, "jsonl", None)  # pylint: disable=protected-access
  assert "\n" not in line  # one JSON object per input line
  assert json.loads(line)["outputs"] == [{"text": "1. one\n2. two\n\nThe end.", "score": -0.5},
                                         {"text": "plain", "score": -1.25}]
  assert commands._format("Make a list.", outputs, 3, "text", None).splitlines() == [  # pylint: disable=protected-access
      "3 ||| 1. one 2. two  The end. ||| -0.5000", "3 ||| plain ||| -1.2500"]
