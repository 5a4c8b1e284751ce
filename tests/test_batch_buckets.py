"""Batch buckets (issue #42): a call of n inputs decodes the smallest bucket that holds them,
with exactly the outputs it would get inside a full batch, and compiles once per bucket."""

import json
import logging
import subprocess
import sys

import numpy as np
import pytest

from tests import cli
from tests.conftest import ROOT
from transformer_jax.inference import generate


@pytest.mark.parametrize("count, devices, batch, rows", [
    (1, 1, 64, 1), (3, 1, 64, 4), (4, 1, 64, 4), (5, 1, 64, 8), (64, 1, 64, 64),
    (1, 8, 64, 8), (9, 8, 64, 16), (40, 8, 48, 48)])
def test_batch_bucket_is_the_smallest_device_multiple_power_of_two(count, devices, batch,
                                                                   rows):
  assert generate.batch_bucket(count, batch, devices) == rows


def _generator(config):
  import jax  # pylint: disable=g-import-not-at-top
  from transformer_jax import families, parallel  # pylint: disable=g-import-not-at-top
  family = families.get(config)
  layout = parallel.make_layout(config)
  params = layout.place_params(family.init_params(jax.random.PRNGKey(0)))
  return generate.Generator(family, layout), params


def test_a_second_call_in_the_same_bucket_compiles_nothing(tiny_config, caplog):
  generator, params = _generator(tiny_config)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 200, n).astype(np.int32) for n in (5, 7, 6, 4)]
  compiles = lambda: sum("Compiling decoding" in r.getMessage() for r in caplog.records)
  with caplog.at_level(logging.INFO):
    generator.output_ids(params, prompts[:1])  # 1 row
    assert compiles() == 1
    generator.output_ids(params, prompts[1:2])  # another single input: the same program
    assert compiles() == 1
    generator.output_ids(params, prompts[:3])  # 3 inputs: the 4-row bucket
    assert compiles() == 2
    generator.output_ids(params, prompts[:4])  # 4 inputs share it
    assert compiles() == 2


_SCRIPT = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
sys.path.insert(0, sys.argv[1])
import jax, numpy as np
from tests import conftest
from transformer_jax import families, parallel
from transformer_jax.inference import generate

results = {}
# Each method under each layout, each family (sampling under pmap: the decoder-only case).
for architecture, mode, method in [
    ("encoder_decoder", "pmap", "greedy"), ("encoder_decoder", "pmap", "beam"),
    ("encoder_decoder", "jit", "greedy"), ("encoder_decoder", "jit", "sample"),
    ("decoder_only", "pmap", "greedy"), ("decoder_only", "pmap", "sample")]:
  config = conftest.make_tiny_config(sys.argv[2])
  config.architecture = architecture
  config.parallel.mode = mode
  config.decoding.update(method=method, beam_size=3, max_decode_len=6, temperature=1.0)
  family = families.get(config)
  layout = parallel.make_layout(config)
  params = layout.place_params(family.init_params(jax.random.PRNGKey(0)),
                               jax.eval_shape(lambda: family.init_params(
                                   jax.random.PRNGKey(0), boxed=True)))
  generator = generate.Generator(family, layout)
  rng = np.random.default_rng(1)
  # Lengths 3..7 share the 8-token length bucket: the shorter ones are padded.
  prompts = [rng.integers(3, 200, rng.integers(3, 8)).astype(np.int32) for _ in range(64)]
  outputs = {n: [o.tolist() for o in generator.output_ids(params, prompts[:n])]
             for n in (64, 1, 3, 8)}
  results[f"{architecture}/{mode}/{method}"] = {
      "same": all(outputs[n] == outputs[64][:n] for n in (1, 3, 8)),
      "distinct_outputs": len({json.dumps(o) for o in outputs[64]}),
      "buckets": sorted({key[1] for key in next(iter(generator._decoders.values())).programs})}
print(json.dumps(results))
"""


def test_outputs_are_the_same_in_every_bucket_under_pmap_and_jit(tmp_path):
  """1, 3 and 8 inputs decode (in 4, 4 and 8 rows on 4 devices) exactly as they do among 64:
  greedy, beam and sampling, both families, pmap and jit over a mesh."""
  result = subprocess.run([sys.executable, "-c", _SCRIPT, ROOT, str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=cli.env())
  assert result.returncode == 0, result.stderr[-3000:]
  results = json.loads(result.stdout.splitlines()[-1])
  for case, outcome in results.items():
    assert outcome["same"], case
    assert outcome["distinct_outputs"] > 1, case  # real outputs, not one repeated row
    assert outcome["buckets"] == [4, 8, 64], case
