"""The package's shape (no import cycles, family knowledge in one module) and the small
correctness defects found in review, each pinned by a test."""

import ast
import itertools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tests.conftest import ROOT
from transformer_jax import default_config
from transformer_jax import evaluation
from transformer_jax import families
from transformer_jax import metrics
from transformer_jax import tasks
from transformer_jax.data import examples as examples_lib
from transformer_jax.inference import generate
from transformer_jax.model import layers
from transformer_jax.model import models

PACKAGE = os.path.join(ROOT, "transformer_jax")


def _modules() -> dict[str, str]:
  """Dotted module name -> file path, for every module of the package."""
  found = {}
  for folder, _, files in os.walk(PACKAGE):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        found[dotted.removesuffix(".__init__")] = path
  return found


def _imports(path: str, modules) -> set[str]:
  """The package modules a file imports, at any level (function-level imports included)."""
  imported = set()
  for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
    if isinstance(node, ast.ImportFrom) and node.module:
      for alias in node.names:
        name = f"{node.module}.{alias.name}"
        imported.add(name if name in modules else node.module)
    elif isinstance(node, ast.Import):
      imported.update(alias.name for alias in node.names)
  return {name for name in imported if name in modules}


def test_no_import_cycle_inside_the_package():
  modules = _modules()
  graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
  state: dict[str, str] = {}

  def visit(name, trail):
    state[name] = "open"
    for other in sorted(graph[name]):
      if state.get(other) == "open":
        pytest.fail("import cycle: " + " -> ".join(trail + [name, other]))
      if other not in state:
        visit(other, trail + [name])
    state[name] = "done"

  for name in sorted(graph):
    if name not in state:
      visit(name, [])
  assert "transformer_jax.predict" not in graph["transformer_jax.train"]
  assert "transformer_jax.predict" not in graph["transformer_jax.evaluation"]


def test_the_model_package_imports_nothing_else_of_the_project():
  """transformer_jax/model/ is the Flax model alone: what decodes, trains or serves it sits
  above and imports it, never the other way."""
  modules = _modules()
  inside = lambda name: name == "transformer_jax.model" or name.startswith("transformer_jax.model.")
  for name, path in modules.items():
    if inside(name):
      outside = {m for m in _imports(path, modules) if not inside(m)}
      assert not outside, (name, outside)


def test_only_the_hugging_face_source_imports_the_datasets_library():
  """`datasets` is an optional extra: nothing else may need it."""
  importers = set()
  for name, path in _modules().items():
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
               else [])
      if any(n.split(".")[0] in ("datasets", "pyarrow") for n in names):
        importers.add(name)
  assert importers == {"transformer_jax.data.hf_source"}


def test_model_family_checks_live_only_in_families():
  """No module but families.py (and models.py, which defines them) asks which family a model
  or config is."""
  family_names = ("EncoderDecoder", "DecoderOnly", "EncoderClassifier")
  for name, path in _modules().items():
    if name in ("transformer_jax.families", "transformer_jax.model.models"):
      continue
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
      if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance":
        assert not any(n in ast.unparse(node) for n in family_names), (name, ast.unparse(node))
      if isinstance(node, ast.Compare):
        text = ast.unparse(node)
        assert "architecture" not in text and "encoder_classifier" not in text, (name, text)


def test_task_and_family_names_are_compared_only_where_they_are_defined():
  """The rest of the package asks tasks.py (has_labels, is_mixture, ...) or the family (its
  class attributes) instead of comparing a task's or a family's name."""
  names = set(tasks.TASKS) | set(families.NAMES)
  owners = {"transformer_jax.families", "transformer_jax.tasks",
            "transformer_jax.config_validation"}
  is_name = lambda node: isinstance(node, ast.Constant) and node.value in names

  def compares_a_name(node: ast.Compare) -> bool:
    # x == 'classification', x != 'multitask', x in ('translation', ...); not a dataset's
    # 'translation' column looked up with `in`.
    for op, left, right in zip(node.ops, [node.left, *node.comparators], node.comparators):
      if isinstance(op, (ast.Eq, ast.NotEq)) and (is_name(left) or is_name(right)):
        return True
      if (isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, (ast.Tuple, ast.List, ast.Set))
          and any(map(is_name, right.elts))):
        return True
    return False

  found = []
  for name, path in _modules().items():
    if name in owners:
      continue
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
      if isinstance(node, ast.Compare) and compares_a_name(node):
        found.append(f"{name}: {ast.unparse(node)}")
  assert not found, found


# ---- Defects found in review -----------------------------------------------------------------

def _label_files_config(tmp_path, seed: int, data_seed: int) -> ml_collections.ConfigDict:
  for name, word in (("neg", "bad"), ("pos", "good")):
    (tmp_path / name).write_text("".join(f"{word} {i}\n" for i in range(40)))
  config = default_config.get_config()
  config.update(task="classification", dataset="local", data_dir=str(tmp_path), seed=seed,
                data_seed=data_seed)
  config.local.update(format="label_files", label_files=["neg", "pos"])
  return config


def test_held_out_split_does_not_depend_on_the_training_seed(tmp_path):
  test_split = lambda seed, data_seed: examples_lib.load_examples(
      _label_files_config(tmp_path, seed, data_seed), ["test"])["test"]
  assert test_split(0, 0) == test_split(7, 0)
  assert test_split(0, 0) != test_split(0, 3)


def test_mixture_caps_do_not_depend_on_the_training_seed(tmp_path):
  part = tmp_path / "part"
  part.mkdir()
  for split in ("train", "validation", "test"):
    (part / f"{split}.en").write_text("".join(f"source {i}\n" for i in range(30)))
    (part / f"{split}.de").write_text("".join(f"target {i}\n" for i in range(30)))
  config = default_config.get_config()
  config.update(task="multitask", dataset="local", data_dir=str(tmp_path))
  config.mixture = ml_collections.ConfigDict({"t": dict(
      prefix="t: ", task="translation", data_dir="part", max_train_examples=5,
      max_eval_examples=5)})
  first = examples_lib.load_examples(config, ["train", "test"])
  config.seed = 11
  assert examples_lib.load_examples(config, ["train", "test"]) == first
  assert len(first["test"]) == 5
  config.data_seed = 1
  assert examples_lib.load_examples(config, ["train", "test"]) != first


def test_multitask_evaluation_generates_outputs_of_every_part():
  examples = [{"task": t} for t in ("a", "a", "a", "a", "b", "b", "c")]
  assert evaluation.generation_indices(examples, 3) == [0, 4, 6]
  assert evaluation.generation_indices(examples, 5) == [0, 1, 4, 5, 6]
  assert evaluation.generation_indices([{"source": "x"}] * 4, 2) == [0, 1]


def test_positions_past_max_len_are_an_error_not_nan():
  model = models.EncoderDecoder(models.named_config("tiny", vocab_size=20, max_len=8))
  ones = lambda n: jnp.ones((1, n), jnp.int32)
  variables = model.init(jax.random.PRNGKey(0), ones(8), ones(8), deterministic=True)
  with pytest.raises(ValueError, match="longer than the model's position range"):
    model.apply(variables, ones(9), ones(4), deterministic=True)


def test_dropout_keep_probability_is_the_configured_rate():
  """Rate 0.1 keeps 90% of activations on average (it was 230/256 = 89.84%: the rate was
  rounded to a multiple of 1/256)."""
  masks = jax.vmap(lambda key: layers.dropout_keep_mask(key, 0.1, (20_000,))[0])(
      jax.random.split(jax.random.PRNGKey(0), 400))
  assert layers.dropout_keep_mask(jax.random.PRNGKey(0), 0.1, (4,))[1] == 0.9
  assert abs(float(jnp.mean(masks)) - 0.9) < 3e-4  # 8M draws: standard error ~1e-4
  for rate in (0.0, 1.0):
    assert float(jnp.mean(layers.dropout_keep_mask(jax.random.PRNGKey(1), rate, (999,))[0])) \
        == 1.0 - rate


def test_accuracy_does_not_count_ties_as_correct():
  logits = jnp.zeros((1, 2, 5))  # every class ties
  sums = metrics.token_metrics(logits, jnp.array([[3, 0]]), jnp.ones((1, 2)))
  assert float(sums["accuracy"]) == 1.0  # only the target that argmax picks (index 0)


def test_sampling_keys_differ_across_length_buckets():
  """Two prompts of different lengths land in different buckets; each batch gets its own
  key (before, every bucket's first batch reused fold_in(seed, 0))."""
  keys = []

  def p_decode(params, inputs, rng, places, packed_rows):
    del places, packed_rows  # no packing: not asked for (no packs_prompts attribute)
    keys.append(np.asarray(jax.random.key_data(rng)) if jnp.issubdtype(
        rng.dtype, jax.dtypes.prng_key) else np.asarray(rng))
    return np.zeros((1, inputs.shape[1], 1, 1), np.int32), np.zeros((1, inputs.shape[1], 1))

  generate.generate_ids(p_decode, None, [np.ones(3, np.int32), np.ones(12, np.int32)],
                        max_len=16, batch_size=1)
  assert len(keys) == 2 and not np.array_equal(keys[0], keys[1])


_DEVICE_SCRIPT = r"""
import os, sys
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np
from transformer_jax import parallel
from transformer_jax.inference import generate

class RandomFamily:  # outputs random bits: rows that share a key give equal outputs
  packs_prompts = False

  def decode(self, params, inputs, keys, *, decoding_config, nbest, packing):
    bits = jax.vmap(lambda key: jax.random.bits(key, (nbest, 1), jnp.uint32))(keys)
    return bits.astype(jnp.int32), jnp.zeros((inputs.shape[0], nbest))

layout = parallel.DataParallel()
run = generate.decode_fn(RandomFamily(), None, layout)
inputs = layout.eval_batch(np.ones((4, 8), np.int32))  # one identical row per device
keys = layout.eval_batch(generate.row_keys(0, 0, 4))
tokens, _ = layout.host_rows(run(None, inputs, keys))
print(len(set(tokens[:, 0, 0].tolist())))
"""


def test_sampling_keys_differ_across_devices():
  result = subprocess.run([sys.executable, "-c", _DEVICE_SCRIPT, ROOT], capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split()[-1] == "4"  # was 1: every device sampled with the same key


# ---- The pretrained registry -----------------------------------------------------------------

def test_every_registered_architecture_offers_the_protocol_and_a_test_kind():
  from tests import hf_fixtures  # pylint: disable=import-outside-toplevel
  from transformer_jax.pretrained import architecture  # pylint: disable=import-outside-toplevel
  from transformer_jax.pretrained import mapping  # pylint: disable=import-outside-toplevel
  for module in architecture.MODULES:
    assert not architecture.missing_members(module), module.__name__
    assert module.FAMILY in families.NAMES, module.__name__
    # One activation table, mapping.py's: none of its own.
    assert getattr(module, "ACTIVATIONS", mapping.ACTIVATIONS) is mapping.ACTIVATIONS
    assert not hasattr(module, "_ACTIVATIONS"), module.__name__
  # Each model_type has a tiny checkpoint kind in the tests, of the family it imports as.
  tested = {kind.model_type: kind.family for kind in hf_fixtures.KINDS.values()}
  assert set(tested) == set(architecture.MODEL_TYPES)
  assert all(architecture.ARCHITECTURES[t].FAMILY == f for t, f in tested.items())


def test_the_readme_table_names_exactly_the_registered_model_types():
  from transformer_jax.pretrained import architecture  # pylint: disable=import-outside-toplevel
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    section = f.read().split("## Start from a pretrained model", 1)[1]
  lines = section.splitlines()
  first = next(i for i, line in enumerate(lines) if line.startswith("|"))
  table = list(itertools.takewhile(lambda line: line.startswith("|"), lines[first:]))[2:]
  # The checkpoints column names each model_type in backticks.
  named = {name for line in table for name in re.findall(r"`([a-z0-9_-]+)`", line.split("|")[2])}
  assert named == set(architecture.MODEL_TYPES)


def test_the_benchmarks_fixtures_leave_the_xla_flags_alone():
  """The benchmarks build folders and prompts with tests/hf_fixtures.py; importing it must not
  bring in the suite's flags (conftest: LLVM -O0, which left every elementwise loop of
  compare_generate's decode unvectorized and its numbers up to 1.4x slow)."""
  environ = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  run = subprocess.run([sys.executable, "-c", "import os, tests.hf_fixtures; "
                        "print(os.environ.get('XLA_FLAGS'))"], cwd=ROOT, env=environ,
                       capture_output=True, text=True, timeout=120)
  assert run.returncode == 0, run.stderr[-2000:]
  assert run.stdout.strip() == "None"
