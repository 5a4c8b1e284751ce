"""Device layouts: 1 device, pmap and jit over 8 simulated devices, 2 processes, and
checkpoints that move between layouts. Each run is a subprocess with its own device count."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests.conftest import xla_flags
from transformer_jax import checkpoints
from transformer_jax import commands
from transformer_jax import families
from transformer_jax import parallel
from transformer_jax import predict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_DISTRIBUTED = """
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize("localhost:{port}", {num_processes}, {process_id})
"""

_TRAIN = """
import json, sys
import jax
import numpy as np
sys.path.insert(0, {root!r})
from tests.conftest import make_tiny_config
import functools
from transformer_jax import checkpoints, families, parallel, train
config = make_tiny_config({cache!r})
config.model.dropout_rate = 0.0
config.num_generate_examples = 0
config.update_from_flattened_dict({overrides!r})
result = train.train_and_evaluate(config, {workdir!r})
if {dump_step!r}:  # the parameters of that checkpoint, as this layout restores them
  layout = parallel.make_layout(config)
  init = functools.partial(families.get(config).init_params, boxed=True)
  params, _ = checkpoints.restore_params({workdir!r}, init, {dump_step!r}, layout=layout)
  sharded = [len(x.sharding.device_set) > 1 and not x.sharding.is_fully_replicated
             for x in jax.tree.leaves(params)]
  result["sharded_leaves"] = sum(sharded)
  np.savez({workdir!r} + "/restored.npz", *[np.asarray(x) for x in jax.tree.leaves(params)])
print("RESULT", json.dumps(result))
"""


def _run(script, devices, processes=1):
  """Runs `script` in `processes` processes of `devices` CPU devices (jax.distributed over
  gloo on localhost when several); returns each one's JSON line after "RESULT"."""
  env = dict(os.environ, XLA_FLAGS=xla_flags(devices),
             JAX_PLATFORMS="cpu")
  prefix = [""]
  if processes > 1:
    with socket.socket() as s:
      s.bind(("localhost", 0))
      port = s.getsockname()[1]
    prefix = [_DISTRIBUTED.format(port=port, num_processes=processes, process_id=i)
              for i in range(processes)]
  runs = [subprocess.Popen([sys.executable, "-c", p + script], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True) for p in prefix]
  outputs = [r.communicate(timeout=600) for r in runs]
  for run, (_, err) in zip(runs, outputs):
    assert run.returncode == 0, err[-3000:]
  return [json.loads(out.split("RESULT", 1)[1]) for out, _ in outputs]


def _train(workdir, cache, devices, overrides, processes=1, dump_step=None):
  """Trains the tiny config (dropout off) in `processes` processes of `devices` devices.

  The training split is read as 2 shards: one process reads both, two processes (by default,
  one shard per process) one each, and the global batches are the same.
  """
  overrides = {"data_shards": 2, **overrides} if processes == 1 else overrides
  script = _TRAIN.format(root=ROOT, cache=cache, overrides=overrides, workdir=str(workdir),
                         dump_step=dump_step)
  results = _run(script, devices, processes)
  for other in results[1:]:
    assert other == results[0]  # every process reports the same global metrics
  return results[0]


_READ_SHARDS = """
import json, os, sys
import numpy as np
sys.path.insert(0, {root!r})
from tests.conftest import make_tiny_config
from transformer_jax import checkpoint_policy
from transformer_jax import run_data
from transformer_jax.data import pipeline
config = make_tiny_config({cache!r})
config.update_from_flattened_dict({overrides!r})
os.makedirs({workdir!r}, exist_ok=True)
streamed, stream = [], run_data.examples_lib.stream
def recording(config, split, *shard):
  streamed.append([split, *shard])
  return stream(config, split, *shard)
run_data.examples_lib.stream = recording
_, _, encoded = run_data.prepare_data(config, {workdir!r}, ("train",))
batches = pipeline.TrainBatches(encoded["train"], 16, config.seed, pack=True,
                                process_index=jax.process_index(),
                                process_count=jax.process_count())
inputs = [next(batches)["inputs"].tolist() for _ in range(5)]
print("RESULT", json.dumps(dict(
    streamed=streamed, held=sorted(encoded["train"].held), inputs=inputs,
    examples=[len(d) for d in encoded["train"].held.values()],
    state=checkpoint_policy.whole_data_state(batches.state))))
"""


@pytest.mark.parametrize("source", ["demo", "huggingface"])
def test_two_processes_read_disjoint_shards_and_together_give_one_process_batches(
    tmp_path, data_cache, source):
  dataset = {}
  if source == "huggingface":  # the demo pairs as a folder of Parquet files, as on the Hub
    pytest.importorskip("datasets")
    from tests import hf_datasets  # pylint: disable=import-outside-toplevel
    folder = hf_datasets.write(data_cache, str(tmp_path / "data"))["summarization"]
    dataset = {"dataset": "huggingface", "huggingface.name": folder}

  def read(workdir, processes, overrides):
    script = _READ_SHARDS.format(root=ROOT, cache=data_cache, workdir=str(tmp_path / workdir),
                                 overrides={**dataset, **overrides})
    return _run("import jax\n" + script, 1, processes)

  zero, one = read("two", 2, {})  # data_shards 0: one shard per process
  # Process 0 streamed the whole split once, for the tokenizer's sample; then each process
  # read and encoded its own shard, example i in shard i % 2.
  assert zero["streamed"] == [["train"], ["train", 0, 2]] and one["streamed"] == [
      ["train", 1, 2]]
  assert (zero["held"], one["held"]) == ([0], [1])
  assert zero["examples"] == one["examples"] == [1000]
  (whole,) = read("whole", 1, {"data_shards": 2})
  assert whole["held"] == [0, 1]
  for step in range(5):
    assert zero["inputs"][step] + one["inputs"][step] == whole["inputs"][step]
  # Every process saves the same whole position, gathered from both.
  assert zero["state"] == one["state"] == whole["state"]
  assert sorted(os.listdir(tmp_path / "two" / "token_cache"))[0].endswith("-shard0of2")


JIT_8 = {"parallel.mode": "jit", "parallel.data": 2, "parallel.fsdp": 2, "parallel.tensor": 2}


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory, data_cache):
  """pmap over 8 devices, 2 rows each: 20 steps, checkpoints at 10 and 20."""
  workdir = tmp_path_factory.mktemp("eight")
  return workdir, _train(workdir, data_cache, 8, {"per_device_batch_size": 2})


def test_one_device_pmap_and_jit_give_the_same_loss(tmp_path, data_cache, eight_devices):
  workdir, eight = eight_devices
  one = _train(tmp_path / "one", data_cache, 1, {"per_device_batch_size": 16})
  np.testing.assert_allclose(eight["loss"], one["loss"], rtol=1e-4)
  np.testing.assert_allclose(eight["accuracy"], one["accuracy"], rtol=1e-4)
  # jit over a 2 x 2 x 2 (data, fsdp, tensor) mesh: the same global batch of 16.
  jit = _train(tmp_path / "jit", data_cache, 8, {**JIT_8, "per_device_batch_size": 2})
  np.testing.assert_allclose(jit["loss"], one["loss"], rtol=1e-4)
  np.testing.assert_allclose(jit["accuracy"], one["accuracy"], rtol=1e-4)
  # Two processes give these losses in the next test (jit); two processes under pmap share a
  # workdir through a preemption in tests/test_cloud.py.


def test_two_processes_under_jit_write_one_sharded_checkpoint(tmp_path, data_cache,
                                                              eight_devices):
  _, eight = eight_devices
  two = _train(tmp_path, data_cache, 4, {**JIT_8, "per_device_batch_size": 2}, processes=2)
  np.testing.assert_allclose(two["loss"], eight["loss"], rtol=1e-4)
  # Saved shard by shard by 2 processes; read back whole by 1 process on 1 device, whose
  # evaluate and predict fall back to a data-parallel mesh.
  evaluated = commands.run_evaluate(str(tmp_path), split="validation")
  np.testing.assert_allclose(evaluated["loss"], two["loss"], rtol=1e-5)
  outputs = predict.Predictor.from_workdir(str(tmp_path)).predict(["The dog sees the cat.", ""])
  assert len(outputs) == 2 and outputs[1] == ""


def test_checkpoint_moves_from_pmap_8_to_jit_4_to_one_device(tmp_path, data_cache,
                                                             eight_devices):
  _, uninterrupted = eight_devices
  workdir = tmp_path / "moving"
  # pmap over 8 devices for 10 steps ...
  _train(workdir, data_cache, 8, {"per_device_batch_size": 2, "num_train_steps": 10})
  # ... resumed by jit over 4 devices (fsdp 2 x tensor 2), same global batch, to step 20.
  resumed = _train(workdir, data_cache, 4, {"parallel.mode": "jit", "parallel.data": 1,
                                            "parallel.fsdp": 2, "parallel.tensor": 2,
                                            "per_device_batch_size": 4}, dump_step=10)
  assert resumed["sharded_leaves"] > 0  # the restore really split parameters over devices
  np.testing.assert_allclose(resumed["loss"], uninterrupted["loss"], rtol=1e-4)
  # One device reads the pmap-written step 10 exactly as the 4-device mesh did ...
  family = predict.Predictor.from_workdir(str(workdir), step=10).family
  params, _ = checkpoints.restore_params(str(workdir), family.init_params, 10)
  restored = np.load(workdir / "restored.npz")
  for i, leaf in enumerate(jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(leaf), restored[f"arr_{i}"])
  # ... and evaluates the jit-written step 20.
  evaluated = commands.run_evaluate(str(workdir), split="validation")
  assert evaluated["step"] == 20
  np.testing.assert_allclose(evaluated["loss"], resumed["loss"], rtol=1e-5)


def test_parameter_rules_split_attention_ffn_and_embeddings(tiny_config):
  tiny_config.model.update(num_heads=4, tie_output=False)
  family = families.get(tiny_config)
  abstract = jax.eval_shape(lambda: family.init_params(jax.random.PRNGKey(0), boxed=True))
  layout = parallel.MeshParallel(data=1, fsdp=1, tensor=1)  # specs only; one device here
  layout.mesh = jax.sharding.AbstractMesh((1, 2, 2), parallel.MESH_AXES)
  specs = jax.tree.map(lambda s: s.spec, layout.shardings(abstract))
  layer = specs["decoder"]["layer_0"]
  assert specs["shared_embedding"]["embedding"]["embedding"] == P("tensor", "fsdp")
  assert layer["self_attention"]["qkv"]["kernel"] == P(
      "fsdp", None, "tensor", None)
  assert layer["cross_attention"]["out"]["kernel"] == P(
      "tensor", None, "fsdp")
  assert layer["ffn"]["wi"]["kernel"] == P("fsdp", "tensor")
  assert layer["ffn"]["wo"]["bias"] == P("fsdp")
  assert layer["ffn_block"]["norm"]["scale"] == P("fsdp")
  assert specs["logits_dense"]["kernel"] == P("fsdp", "tensor")
  # vocab_size 256 splits over tensor 2, not over 3: a dimension that does not divide stays
  # whole.
  layout.mesh = jax.sharding.AbstractMesh((1, 1, 3), parallel.MESH_AXES)
  specs = jax.tree.map(lambda s: s.spec, layout.shardings(abstract))
  assert specs["shared_embedding"]["embedding"]["embedding"] == P(None, "fsdp")


def test_mesh_sizes_that_do_not_fit_are_clear_errors(tiny_config):
  with pytest.raises(ValueError, match="at most one of data / fsdp / tensor may be -1"):
    parallel.make_mesh(-1, -1, 1)
  with pytest.raises(ValueError, match="use 3 devices, but there are"):
    parallel.make_mesh(3, 1, 1)
  tiny_config.parallel.mode = "mesh"
  with pytest.raises(ValueError, match="use 'pmap' or 'jit'"):
    parallel.make_layout(tiny_config)
