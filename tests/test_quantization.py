"""Weight-only quantization for inference (issue #60, config.quantization): int8 and int4
kernels through qwix, how close they stay to the float model, the same outputs on every device
layout, and bad settings refused in one line before anything is read or compiled."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests import cli
from tests import hf_fixtures
from tests.conftest import make_tiny_config
from tests.conftest import xla_flags
from transformer_jax import commands
from transformer_jax import config_validation
from transformer_jax import default_config
from transformer_jax import families
from transformer_jax import parallel
from transformer_jax import predict
from transformer_jax import train
from transformer_jax import workdir as workdir_lib
from transformer_jax.model import layers
from transformer_jax.model import lora as lora_lib
from transformer_jax.model import quantization
from transformer_jax.pretrained import checkpoint as checkpoint_lib
from transformer_jax.pretrained import export

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TEXTS = hf_fixtures.model_sentences("en", 12)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  return hf_fixtures.folder_maker(tmp_path_factory)


def _predictor(folder, weights="none", **settings):
  config = default_config.get_config()
  config.max_source_length, config.max_target_length = 24, 12
  config.quantization.update(weights=weights, **settings)
  return predict.Predictor.from_pretrained(folder, config)


def _log_probs(predictor) -> tuple[np.ndarray, np.ndarray]:
  """Teacher-forced log-probabilities [texts, len, vocab] of TEXTS, and where they count."""
  ids = [predictor.tokenizer.encode(t)[:16] for t in TEXTS]
  tokens = np.array([i + [0] * (16 - len(i)) for i in ids], np.int32)
  batch = {"inputs": tokens, "targets": tokens}
  params = jax.tree.map(parallel.first_local_copy, predictor.device_params)
  logits = predictor.family.forward(params, batch, deterministic=True)
  return np.asarray(jax.nn.log_softmax(logits)), tokens != 0


def _kernel_bytes(params) -> int:
  """Bytes of the projections' kernels (with their scales), where quantization applies."""
  leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=quantization.is_quantized)[0]
  return sum(quantization.parameter_bytes(leaf) for path, leaf in leaves
             if path[-1].key == "kernel" and "logits_dense" not in jax.tree_util.keystr(path))


# Measured on these tiny random checkpoints (hf_fixtures: 32 wide, weights drawn wide, so
# their outputs are sharper than a trained model's), teacher-forced over 12 sentences: the share
# of positions whose most likely token is unchanged, and the mean |change| of that token's
# log-probability. int8 (per channel): llama 0.962 / 0.059, bart 0.962 / 0.047. int4 (groups of
# 16, 16 levels for weights this wide): llama 0.440 / 1.66, bart 0.565 / 0.47. The bounds leave
# a margin under those. Kernel memory: int8 0.28x float32; int4 in groups of 16 0.19x (a
# float32 scale per 16 values; 0.16x with groups of 32).
BOUNDS = {("llama", "int8"): (0.9, 0.1), ("bart", "int8"): (0.9, 0.1),
          ("llama", "int4"): (0.35, 2.5), ("bart", "int4"): (0.45, 0.7)}


@pytest.mark.parametrize("kind", ["llama", "bart"])
def test_int8_and_int4_weights_stay_close_to_the_float_model(folders, kind):
  float_model = _predictor(folders(kind))
  reference, counted = _log_probs(float_model)
  best = reference.argmax(-1)
  float_bytes = _kernel_bytes(float_model.device_params)
  for weights, group_size, ratio in (("int8", 0, 0.3), ("int4", 16, 0.22)):
    model = _predictor(folders(kind), weights, group_size=group_size)
    log_probs, _ = _log_probs(model)
    agree = (log_probs.argmax(-1) == best)[counted].mean()
    moved = np.abs(np.take_along_axis(log_probs - reference, best[..., None], -1))[counted]
    least_agreement, most_moved = BOUNDS[kind, weights]
    assert agree >= least_agreement and moved.mean() <= most_moved, (weights, agree,
                                                                      moved.mean())
    assert _kernel_bytes(model.device_params) <= ratio * float_bytes
  # Greedy outputs: the first tokens agree (a random model's later tokens may part).
  assert all(a[:2] == b[:2] for a, b in zip(
      float_model.predict(TEXTS[:4], method="greedy"),
      _predictor(folders(kind), "int8").predict(TEXTS[:4], method="greedy")))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_embedding_and_output_layer_are_quantized_only_when_asked(folders, kind):
  """Llama's lm_head is its own; Qwen2's output is its tied embedding."""
  float_kept = _predictor(folders(kind), "int8")
  table = lambda p: p.device_params["embedding"]["embedding"]["embedding"]
  assert not quantization.is_quantized(table(float_kept))
  quantized = _predictor(folders(kind), "int8", embeddings=True)
  assert isinstance(table(quantized), quantization.Int8Table)
  assert table(quantized).values.dtype == np.int8
  if kind == "llama":
    assert not quantization.is_quantized(float_kept.device_params["logits_dense"]["kernel"])
    assert quantization.is_quantized(quantized.device_params["logits_dense"]["kernel"])
  # Still close to the float model (measured: 0.978 of the most likely tokens kept, llama;
  # 0.946, qwen2; 0.962 and 0.951 with the embedding float).
  reference, counted = _log_probs(float_kept)
  log_probs, _ = _log_probs(quantized)
  assert (log_probs.argmax(-1) == reference.argmax(-1))[counted].mean() >= 0.9


def _predict_jsonl(folder, devices, *overrides):
  result = cli.run_main("--pretrained", folder, "--mode", "predict", "--output_format", "jsonl",
                        "--config.quantization.weights=int8", "--config.max_source_length=24",
                        "--config.max_target_length=12", *overrides,
                        input="\n".join(TEXTS[:8]) + "\n", environ=cli.env(devices))
  assert result.returncode == 0, result.stderr[-3000:]
  return [json.loads(line) for line in result.stdout.splitlines()]


def test_a_quantized_model_gives_the_same_outputs_under_pmap_and_the_mesh(folders):
  one = _predict_jsonl(folders("llama"), 1)
  mesh = _predict_jsonl(folders("llama"), 8, "--config.parallel.mode=jit",
                        "--config.parallel.data=2", "--config.parallel.fsdp=2",
                        "--config.parallel.tensor=2")
  pmap = _predict_jsonl(folders("llama"), 8)
  outputs = lambda lines: [output for line in lines for output in line["outputs"]]
  for other in (mesh, pmap):
    assert [o["text"] for o in outputs(other)] == [o["text"] for o in outputs(one)]
    np.testing.assert_allclose([o["score"] for o in outputs(other)],
                               [o["score"] for o in outputs(one)], atol=1e-4)


def _problems(**keys) -> list[str]:
  config = default_config.get_config()
  for key, value in keys.items():
    section, name = key.split(".")
    config[section][name] = value
  return config_validation.problems(config)


def test_bad_quantization_settings_are_refused_in_one_line(folders, tmp_path):
  assert any("config.quantization.weights='int3' is not one of none, int8, int4" in p
             for p in _problems(**{"quantization.weights": "int3"}))
  # int4 groups must tile each kernel's input (emb_dim 512, mlp_dim 2048, heads of 64).
  assert not _problems(**{"quantization.weights": "int4", "quantization.group_size": 128})
  (problem,) = _problems(**{"quantization.weights": "int4", "quantization.group_size": 96})
  assert "group_size=96 does not divide model.emb_dim" in problem and "e.g. 64" in problem
  # From the command line, before anything is read or compiled: a classifier's head ...
  result = cli.run_main("--pretrained", folders("bert"), "--mode", "predict",
                        "--config.quantization.weights=int8",
                        "--config.quantization.embeddings=true", input="a\n")
  assert "a classifier's output is its class head" in cli.user_error(result.stderr)
  # ... an int4 group that does not divide the llama's 64-wide feed-forward ...
  result = cli.run_main("--pretrained", folders("llama"), "--mode", "predict",
                        "--config.quantization.weights=int4",
                        "--config.quantization.group_size=24", input="a\n")
  assert "group_size=24 does not divide model.emb_dim=32" in cli.user_error(result.stderr)
  # ... and training, which quantization is not for: nothing is written.
  workdir = tmp_path / "run"
  result = cli.run(workdir, "--config", "configs/demo.py", "--config.quantization.weights=int8")
  assert "training refuses it" in cli.user_error(result.stderr)
  assert not workdir.exists()


# ---- LoRA over a quantized base (QLoRA: config.lora.base_dtype 'int8' / 'int4') -------------

def _qlora_config(folder, data_cache, steps, base_dtype="int8"):
  config = make_tiny_config(data_cache)
  config.update(architecture="decoder_only", pretrained=folder, num_train_steps=steps,
                eval_every_steps=steps, checkpoint_every_steps=6, learning_rate=3e-3,
                num_generate_examples=0)
  config.model.dropout_rate = 0.0
  config.lora.update(rank=4, targets="all", base_dtype=base_dtype)
  config.quantization.group_size = 16  # int4: the tiny llama is 32 wide
  return config


@pytest.mark.parametrize("shards", [1, 2])
def test_an_int8_table_multiplies_a_block_of_rows_at_a_time(monkeypatch, shards):
  """Differentiated, the tied output layer over an int8 table converts blocks of rows (the
  last overlapping the one before it; with the rows split over 2 devices, blocks of each
  device's rows) in the forward and backward passes: the logits and the states' gradient of
  the whole table's product."""
  monkeypatch.setattr(quantization, "_TABLE_BLOCK_BYTES", 4 * 64 * 300)  # blocks of 300 rows
  monkeypatch.setattr(quantization, "_vocab_shards", lambda rows: shards)
  rng = np.random.default_rng(0)
  table = quantization.int8_table(rng.normal(size=(1000, 64)).astype(np.float32))
  states = rng.normal(size=(2, 5, 64)).astype(np.float32)
  cotangent = rng.normal(size=(2, 5, 1000)).astype(np.float32)
  whole = lambda y: y @ table.dequantized().T
  blocks = lambda y: table.logits(y, layers.float32_sum_dot)
  np.testing.assert_allclose(jax.jit(blocks)(states), whole(states), rtol=1e-5, atol=1e-5)
  differentiated = jax.jit(lambda y: jax.vjp(blocks, y)[0])(states)  # the blockwise forward
  np.testing.assert_allclose(differentiated, whole(states), rtol=1e-5, atol=1e-5)
  gradient = lambda logits: jax.jit(jax.grad(lambda y: (logits(y) * cotangent).sum()))(states)
  np.testing.assert_allclose(gradient(blocks), gradient(whole), rtol=1e-5, atol=1e-4)


def test_an_int8_table_split_over_the_tensor_axis_takes_blocks_of_each_devices_rows():
  """Under a 2 x 2 x 2 jit mesh (a process of its own) with the table's rows split over
  'tensor', the blockwise logits and the states' gradient equal the whole table's product."""
  done = subprocess.run([sys.executable, "-c", ("from tests import test_quantization; "
                         "test_quantization.check_a_table_split_over_the_tensor_axis()")],
                        env=dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu"),
                        cwd=ROOT, capture_output=True, text=True, timeout=cli.HANG, check=False)
  assert done.returncode == 0, done.stderr[-3000:]


def check_a_table_split_over_the_tensor_axis():
  quantization._TABLE_BLOCK_BYTES = 4 * 64 * 300  # pylint: disable=protected-access  # blocks of 300 rows
  rng = np.random.default_rng(0)
  table = quantization.int8_table(rng.normal(size=(1000, 64)).astype(np.float32))
  states = rng.normal(size=(4, 5, 64)).astype(np.float32)
  cotangent = rng.normal(size=(4, 5, 1000)).astype(np.float32)
  whole = lambda y: y @ table.dequantized().T
  mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
  P = jax.sharding.PartitionSpec
  with jax.set_mesh(mesh):
    split = jax.device_put(table, jax.sharding.NamedSharding(mesh, P("tensor", None)))
    blocks = lambda y: split.logits(y, layers.float32_sum_dot)
    assert quantization._vocab_shards(1000) == 2  # pylint: disable=protected-access
    logits = jax.jit(lambda y: jax.vjp(blocks, y)[0])(states)
    gradient = jax.jit(jax.grad(lambda y: (blocks(y) * cotangent).sum()))(states)
  np.testing.assert_allclose(logits, whole(states), rtol=1e-5, atol=1e-5)
  expected = jax.grad(lambda y: (whole(y) * cotangent).sum())(states)
  np.testing.assert_allclose(gradient, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("base_dtype", ["int8", "int4"])
def test_qlora_gradients_equal_plain_autodiff_through_the_quantized_base(folders, data_cache,
                                                                         base_dtype):
  """The quantized products dequantize their kernel again in the backward pass (so that no
  float copy lives from the forward pass to it): the adapters' and the inputs' gradients are
  those of plain autodiff through qwix's own products, with the layers rematerialised too
  (config.model.remat: remat.py replays the layers, quantized products included)."""
  import qwix  # pylint: disable=import-outside-toplevel
  config = _qlora_config(folders("llama"), data_cache, 1, base_dtype)
  family = families.get(config)
  config.model.remat = True
  rematerialised = families.get(config)
  params = family.init_params(jax.random.PRNGKey(0))
  adapters, base = lora_lib.split(params)
  adapters = jax.tree.map(lambda x: x + 0.1, adapters)  # b != 0: every path carries gradient
  boxed = jax.eval_shape(lambda: family.init_params(jax.random.PRNGKey(0), boxed=True,
                                                    quantized=True))
  frozen = quantization.quantize_params(base, lora_lib.split(boxed)[1])
  plain = qwix.quantize_model(family._make_model(), qwix.PtqProvider(  # pylint: disable=protected-access
      quantization.rules(family.quantization)), methods=["__call__"])
  tokens = np.random.default_rng(0).integers(3, 50, (2, 7)).astype(np.int32)

  def loss(model):
    return lambda trained: model.apply({"params": lora_lib.combine(trained, frozen)}, tokens,
                                       deterministic=True).astype(np.float32).std()

  theirs = jax.tree.leaves(jax.jit(jax.grad(loss(plain)))(adapters))
  # The rematerialised model also differentiated through a jit, which traces its forward
  # pass only when the gradient asks for it (outside qwix's context, were it traced there).
  for gradient in (jax.jit(jax.grad(loss(family.model))),
                   jax.jit(jax.grad(loss(rematerialised.model))),
                   jax.grad(jax.jit(loss(rematerialised.model)))):
    ours = jax.tree.leaves(gradient(adapters))
    assert len(ours) == len(theirs) >= 8 and all(np.abs(g).max() > 0 for g in ours)
    for a, b in zip(ours, theirs):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def qlora_run(folders, tmp_path_factory, data_cache):
  """Llama with adapters on every projection over an int8 base: 6 steps, resumed to 12."""
  workdir = str(tmp_path_factory.mktemp("qlora") / "run")
  first = train.train_and_evaluate(_qlora_config(folders("llama"), data_cache, 6), workdir)
  last = train.train_and_evaluate(_qlora_config(folders("llama"), data_cache, 12), workdir)
  return workdir, first, last


def test_lora_over_an_int8_base_trains_and_resumes_exactly(qlora_run, folders, tmp_path,
                                                           data_cache):
  workdir, first, last = qlora_run
  assert last["loss"] < first["loss"]
  family = families.get(workdir_lib.load_config(workdir))
  trained, base, step = predict.restore_lora(workdir, family)
  assert step == 12
  kernels = [x for x in jax.tree.leaves(base, is_leaf=quantization.is_quantized)
             if quantization.is_quantized(x)]
  assert len(kernels) == 2 * 6 and {x.array.qvalue.dtype for x in kernels} == {np.dtype(np.int8)}
  # query, kv, out, wi, wi_gate, wo per layer; the import's kernels quantized, once.
  imported = checkpoint_lib.read_params(checkpoint_lib.open_checkpoint(folders("llama")))
  np.testing.assert_allclose(
      quantization.dequantized(base)["decoder"]["layer_0"]["ffn"]["wi"]["kernel"],
      imported["decoder"]["layer_0"]["ffn"]["wi"]["kernel"], atol=0.01 * 0.3 * 4)
  whole = train.train_and_evaluate(_qlora_config(folders("llama"), data_cache, 12),
                                   str(tmp_path / "whole"))
  np.testing.assert_allclose(last["loss"], whole["loss"], rtol=1e-6)
  theirs, _, _ = predict.restore_lora(str(tmp_path / "whole"), family, with_base=False)
  for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(theirs)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_a_qlora_adapter_loads_in_peft_onto_the_dequantized_base(qlora_run, tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  workdir, _, _ = qlora_run
  config = workdir_lib.load_config(workdir)
  family = families.get(config)
  _, base, _ = predict.restore_lora(workdir, family)
  base_folder, adapter_folder, merged_folder = (str(tmp_path / n) for n in ("b", "a", "m"))
  float_family = families.get(lora_lib.without(config))
  export.export(jax.device_get(quantization.dequantized(base)), float_family.model_config,
                workdir, base_folder)
  commands.run_export(workdir, adapter_folder, export_format="peft")
  commands.run_export(workdir, merged_folder)  # merged: the dequantized base + the adapters
  tokens = torch.tensor([[5, 9, 12, 7, 30, 22, 1, 44]])
  with torch.no_grad():
    adapted = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base_folder), adapter_folder)
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_folder)
    np.testing.assert_allclose(adapted(tokens).logits.numpy(), merged(tokens).logits.numpy(),
                               atol=1e-4)


def test_lora_over_an_int4_base_on_an_eight_device_mesh_equals_one_device(folders, tmp_path,
                                                                          data_cache):
  """The quantized base placed in its kernels' shardings (data 2 x fsdp 2 x tensor 2): the same
  losses and adapters as one device."""
  config = _qlora_config(folders("llama"), data_cache, 6, base_dtype="int4")
  config.per_device_batch_size = 16
  one = str(tmp_path / "one")
  first = train.train_and_evaluate(config, one)
  mesh = str(tmp_path / "mesh")
  result = cli.run(mesh, "--config.architecture=decoder_only",
                   f"--config.pretrained={folders('llama')}", "--config.num_train_steps=6",
                   "--config.eval_every_steps=6", "--config.checkpoint_every_steps=6",
                   "--config.learning_rate=3e-3", "--config.num_generate_examples=0",
                   "--config.model.dropout_rate=0", "--config.lora.rank=4",
                   "--config.lora.targets=all", "--config.lora.base_dtype=int4",
                   "--config.quantization.group_size=16", "--config.per_device_batch_size=2",
                   "--config.parallel.mode=jit", "--config.parallel.data=2",
                   "--config.parallel.fsdp=2", "--config.parallel.tensor=2", cache=data_cache,
                   environ=cli.env(8))
  assert result.returncode == 0, result.stderr[-3000:]
  family = families.get(workdir_lib.load_config(one))
  ours, base, _ = predict.restore_lora(one, family)
  assert {x.array.qvalue.dtype for x in jax.tree.leaves(base, is_leaf=quantization.is_quantized)
          if quantization.is_quantized(x)} == {np.dtype("int4")}
  theirs, _, _ = predict.restore_lora(mesh, family, with_base=False)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
  assert first["loss"] == pytest.approx(commands.run_evaluate(mesh, split="validation")["loss"],
                                        rel=1e-5)
