"""The attention kernel table (transformer_jax/model/kernels.py): every kernel that runs here
equals the reference attention on the masks it claims (the TPU's kernels, splash and tokamax's
Mosaic one, in Pallas interpret mode: forward within 1e-5 in float32, gradients within 1e-4,
alone, in a model and under the jit mesh); 'auto''s choice per platform with the platform
forced; a call a named kernel cannot take falls back with one log line; a kernel a config
cannot run is a one-line error first. The GPU kernels (cuDNN, tokamax's Triton one) are
checked on a GPU by tools/gpu_session.sh kernels."""

import dataclasses
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import cli
from tests.conftest import xla_flags
from transformer_jax import config_validation
from transformer_jax import parallel
from transformer_jax.model import attention
from transformer_jax.model import kernels
from transformer_jax.model import models

FORWARD = dict(rtol=1e-5, atol=1e-5)
GRADIENT = dict(rtol=1e-4, atol=1e-4)
LENGTH = 128  # splash's smallest block
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ON_GPU = jax.default_backend() == "gpu"
# tokamax's TPU kernel runs interpreted on the CPU; on a GPU 'tokamax' is its Triton kernel.
TOKAMAX_TPU_HERE = pytest.mark.skipif(ON_GPU, reason="a GPU runs tokamax's Triton kernel")


@pytest.fixture
def interpreted(monkeypatch):
  """Pallas kernels of other platforms run here, interpreted."""
  monkeypatch.setenv(kernels.INTERPRET_ENV, "1")


def _segments(*spans):
  """[len] segment ids: spans of (segment id, length), padding (0) to LENGTH."""
  ids = np.concatenate([np.full(n, s) for s, n in spans])
  return np.pad(ids, (0, LENGTH - len(ids))).astype(np.int32)


def _parts(query_segments, key_segments, causal, window=0):
  qs, ks = (jnp.asarray(np.stack(x)) for x in (query_segments, key_segments))
  visible = qs[:, None, :, None] == ks[:, None, None, :]
  slots_q, slots_k = np.arange(qs.shape[1])[:, None], np.arange(ks.shape[1])[None, :]
  if causal:
    visible &= slots_k <= slots_q
  if window:
    visible &= slots_k > slots_q - window
  visible &= (qs != 0)[:, None, :, None] & (ks != 0)[:, None, None, :]
  return kernels.StructuredMask(visible, qs, ks, causal=causal, window=window)


CASES = {  # (query segments per row, key segments per row, causal, window, kv heads, softcap)
    "bidirectional_padded": ([_segments((1, 108)), _segments((1, 70))], None, False, 0, 4, 0.0),
    "causal_packed": ([_segments((1, 50), (2, 60)), _segments((1, 128))], None, True, 0, 4, 0.0),
    "sliding_window": ([_segments((1, 40), (2, 80)), _segments((1, 100))], None, True, 16, 4,
                       0.0),
    "grouped_heads": ([_segments((1, 90), (2, 30)), _segments((1, 128))], None, True, 0, 2,
                      0.0),
    "softcap": ([_segments((1, 128)), _segments((1, 64), (2, 64))], None, True, 0, 4, 5.0),
    "cross_packed": ([_segments((1, 60), (2, 50)), _segments((1, 90))],
                     [np.concatenate([_segments((1, 100), (2, 28)), _segments((2, 60))]),
                      np.concatenate([_segments((1, 128)), _segments((1, 40))])], False, 0, 4,
                     0.0),
}


def _call(case):
  query_segments, key_segments, causal, window, kv_heads, softcap = CASES[case]
  key_segments = query_segments if key_segments is None else key_segments
  parts = _parts(query_segments, key_segments, causal, window)
  b, q, k = 2, parts.query_segments.shape[1], parts.key_segments.shape[1]
  r = jax.random.split(jax.random.PRNGKey(0), 4)
  query = jax.random.normal(r[0], (b, q, 4, 16))
  key, value = (jax.random.normal(x, (b, k, kv_heads, 16)) for x in r[1:3])
  cotangent = jax.random.normal(r[3], query.shape)
  return (query, key, value), parts, softcap, cotangent


def _loss(fn, parts, cotangent):
  """A loss on the queries that may attend somewhere (padding queries are the kernels' own
  business: see kernels.py)."""
  real = (parts.query_segments != 0)[:, :, None, None]
  return lambda *qkv: jnp.sum(jnp.where(real, fn(*qkv) * cotangent, 0.0))


@pytest.mark.parametrize("case", sorted(CASES))
def test_splash_equals_the_reference(interpreted, case):
  qkv, parts, softcap, cotangent = _call(case)
  call = kernels.Call.of(qkv[0], qkv[1], parts, softcap=softcap)
  assert kernels.choose("splash", call) == "splash"
  splash = lambda q, k, v: kernels.run("splash", q, k, v, parts, softcap=softcap)
  reference = lambda q, k, v: attention.dot_product_attention(q, k, v, parts.dense,
                                                              softcap=softcap)
  real = np.asarray(parts.query_segments != 0)
  np.testing.assert_allclose(np.asarray(splash(*qkv))[real], np.asarray(reference(*qkv))[real],
                             **FORWARD)
  grads = [jax.grad(_loss(fn, parts, cotangent), argnums=(0, 1, 2))(*qkv)
           for fn in (splash, reference)]
  for ours, theirs in zip(*grads):
    np.testing.assert_allclose(ours, theirs, **GRADIENT)


def _prefix_lm_mask():
  """A prefix LM's mask (an array only: the prefix differs per row): each row's first
  `prefix` tokens see each other, the rest causally, padding after `length`."""
  masks = []
  for prefix, length in ((40, 128), (70, 100)):
    slots = np.arange(LENGTH)
    visible = (slots[None, :] <= slots[:, None]) | ((slots[:, None] < prefix)
                                                    & (slots[None, :] < prefix))
    masks.append(visible & (slots[:, None] < length) & (slots[None, :] < length))
  return jnp.asarray(np.stack(masks)[:, None])


@TOKAMAX_TPU_HERE
@pytest.mark.parametrize("case", sorted(CASES) + ["prefix_lm"])
def test_tokamax_on_the_tpu_equals_the_reference(interpreted, case):
  """tokamax's Mosaic TPU kernel, interpreted: every mask our models build (a prefix LM's
  as an array), grouped heads and soft-cap."""
  qkv, parts, softcap, cotangent = _call("causal_packed" if case == "prefix_lm" else case)
  mask = _prefix_lm_mask() if case == "prefix_lm" else parts
  dense = kernels.split_mask(mask)[0]
  assert kernels.choose("tokamax", kernels.Call.of(qkv[0], qkv[1], mask, softcap=softcap)) \
      == "tokamax"
  tokamax = lambda q, k, v: kernels.run("tokamax", q, k, v, mask, softcap=softcap)
  reference = lambda q, k, v: attention.dot_product_attention(q, k, v, dense, softcap=softcap)
  real = np.asarray(jnp.any(dense, axis=-1)[:, 0])  # queries that see a key
  np.testing.assert_allclose(np.asarray(tokamax(*qkv))[real], np.asarray(reference(*qkv))[real],
                             **FORWARD)
  loss = lambda fn: lambda *x: jnp.sum(jnp.where(real[:, :, None, None], fn(*x) * cotangent, 0))
  grads = [jax.grad(loss(fn), argnums=(0, 1, 2))(*qkv) for fn in (tokamax, reference)]
  for ours, theirs in zip(*grads):
    np.testing.assert_allclose(ours, theirs, **GRADIENT)


@pytest.mark.parametrize("implementation, options", [
    ("tokamax", dict(prefix_lm=True)),  # on a TPU its mask arrays take a prefix LM
    ("splash", {}),
])
def test_a_tpu_kernel_the_config_can_run_passes(implementation, options):
  assert kernels.config_refusal(implementation, "tpu", dtype="float32", head_dim=64,
                                relative_bias=False, softcap=False,
                                prefix_lm=options.get("prefix_lm", False)) is None


@TOKAMAX_TPU_HERE
def test_tokamax_on_the_tpu_without_a_mask_equals_the_reference(interpreted):
  qkv, _, _, _ = _call("grouped_heads")
  np.testing.assert_allclose(kernels.run("tokamax", *qkv, None),
                             attention.dot_product_attention(*qkv, None), **FORWARD)


def test_tpu_kernels_under_the_jit_mesh_equal_the_reference():
  """Rows over data x fsdp and heads over tensor (2 x 2 x 2 simulated devices, a process of
  its own), each device's part through shard_map: splash and tokamax (interpreted), forward
  and gradients as the reference."""
  env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu",
             **{kernels.INTERPRET_ENV: "1"})
  done = subprocess.run([sys.executable, "-c", "from tests import test_kernels; "
                         "test_kernels.check_tpu_kernels_under_the_jit_mesh()"], env=env,
                        cwd=ROOT, capture_output=True, text=True, timeout=cli.HANG)
  assert done.returncode == 0, done.stderr[-3000:]


def check_tpu_kernels_under_the_jit_mesh():
  qkv, parts, _, cotangent = _call("grouped_heads")
  twice = lambda x: jnp.concatenate([x, x[::-1]])  # 4 rows: one per data x fsdp shard
  qkv, cotangent = [twice(x) for x in qkv], twice(cotangent)
  parts = jax.tree.map(twice, parts)
  mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
  spec = jax.sharding.PartitionSpec(("data", "fsdp"), None, "tensor", None)
  reference = lambda q, k, v: attention.dot_product_attention(q, k, v, parts.dense)
  expected = jax.grad(_loss(reference, parts, cotangent), argnums=(0, 1, 2))(*qkv)
  real = np.asarray(parts.query_segments != 0)
  for name in ("splash", "tokamax"):
    with jax.set_mesh(mesh):
      sharded = [jax.device_put(x, jax.sharding.NamedSharding(mesh, spec)) for x in qkv]
      kernel = jax.jit(lambda q, k, v, p, name=name: kernels.run(name, q, k, v, p))
      out = kernel(*sharded, parts)
      grads = jax.jit(jax.grad(_loss(lambda *x, kernel=kernel: kernel(*x, parts), parts,
                                     cotangent), argnums=(0, 1, 2)))(*sharded)
    assert len(out.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(reference(*qkv))[real],
                               **FORWARD)
    for ours, theirs in zip(grads, expected):
      np.testing.assert_allclose(ours, theirs, **GRADIENT)


MODEL = models.TransformerConfig(vocab_size=50, emb_dim=32, num_heads=4, num_layers=2,
                                 qkv_dim=32, mlp_dim=64, max_len=LENGTH, dropout_rate=0.0,
                                 attention_dropout_rate=0.0)


@pytest.mark.parametrize("name, family, options", [
    ("splash", "decoder_only", dict(position_embedding="rope", num_kv_heads=2,
                                    sliding_window=24, sliding_window_pattern="LG")),
    ("splash", "encoder_decoder", dict(num_kv_heads=2)),
    pytest.param("tokamax", "decoder_only", dict(position_embedding="rope", num_kv_heads=2,
                                                 prefix_lm=True), marks=TOKAMAX_TPU_HERE),
])
def test_a_model_on_a_tpu_kernel_equals_the_reference(interpreted, monkeypatch, name, family,
                                                      options):
  """Packed rows (two segments and padding) through a whole model: the loss and its
  gradients, the kernel (every attention layer's: self, windowed, cross; a prefix LM's mask
  through tokamax) against the reference."""
  calls = []
  kernel = kernels.KERNELS[name]

  def counted(*args):  # a call that ran (one that failed and fell back is not counted)
    out = kernel.run(*args)
    calls.append(args[4])
    return out

  monkeypatch.setitem(kernels.KERNELS, name, dataclasses.replace(kernel, run=counted))
  rng = np.random.default_rng(0)
  segmentation = np.stack([_segments((1, 70), (2, 40)), _segments((1, 100))])
  tokens = jnp.asarray(np.where(segmentation > 0, rng.integers(3, 50, segmentation.shape), 0))
  positions = jnp.asarray(np.concatenate(
      [np.concatenate([np.arange(70), np.arange(58)]), np.arange(128)]).reshape(2, LENGTH))
  segmentation = jnp.asarray(segmentation)
  prefix = (positions < 30) & (tokens != 0)  # each segment's first 30 tokens

  def loss(implementation):
    config = MODEL.replace(attention_implementation=implementation, **options)
    if family == "decoder_only":
      model = models.DecoderOnly(config)
      apply = lambda params: model.apply({"params": params}, tokens, positions, segmentation,
                                         prefix, deterministic=True)
      init = lambda: model.init(jax.random.PRNGKey(1), tokens, deterministic=True)
    else:
      model = models.EncoderDecoder(config)
      apply = lambda params: model.apply({"params": params}, tokens, tokens, positions,
                                         positions, segmentation, segmentation,
                                         deterministic=True)
      init = lambda: model.init(jax.random.PRNGKey(1), tokens, tokens, deterministic=True)
    params = parallel.unbox(init()["params"])
    weights = (tokens != 0)[..., None]
    return params, lambda p: jnp.sum(jnp.where(weights, jax.nn.log_softmax(apply(p)), 0.0))

  params, reference = loss("reference")
  _, ours = loss(name)
  calls.clear()  # init's
  np.testing.assert_allclose(ours(params), reference(params), rtol=1e-5)
  assert len(calls) == MODEL.num_layers * (1 if family == "decoder_only" else 3)
  if name == "splash":
    windows = {parts.window for parts in calls}
    assert windows == ({0, 24} if family == "decoder_only" else {0})
  for mine, theirs in zip(jax.tree.leaves(jax.grad(ours)(params)),
                          jax.tree.leaves(jax.grad(reference)(params))):
    np.testing.assert_allclose(mine, theirs, **GRADIENT)


@pytest.mark.parametrize("platform, dtype, queries, has_parts, chosen", [
    ("cpu", jnp.bfloat16, LENGTH, True, "reference"),
    ("gpu", jnp.bfloat16, LENGTH, True, "cudnn"),
    ("gpu", jnp.float32, LENGTH, True, "reference"),  # cuDNN has no float32 kernel
    ("gpu", jnp.bfloat16, 1, False, "reference"),  # a decoding step
    ("tpu", jnp.float32, LENGTH, True, "splash"),
    ("tpu", jnp.float32, LENGTH, False, "tokamax"),  # a prefix LM's mask: an array only
    ("tpu", jnp.float32, 100, True, "reference"),  # not whole 128-blocks
    ("tpu", jnp.float32, 1, False, "reference"),
])
def test_auto_picks_per_platform(platform, dtype, queries, has_parts, chosen):
  query = jnp.zeros((2, queries, 4, 64), dtype)
  parts = _parts([_segments((1, LENGTH))] * 2, [_segments((1, LENGTH))] * 2, True)
  mask = parts if has_parts else parts.dense
  if queries != LENGTH:
    mask = jnp.ones((2, 1, queries, queries), bool)
    if has_parts:
      mask = kernels.StructuredMask(mask, jnp.ones((2, queries), jnp.int32),
                                    jnp.ones((2, queries), jnp.int32), causal=True)
  assert kernels.choose("auto", kernels.Call.of(query, query, mask, platform=platform)) \
      == chosen


def test_a_call_the_kernel_cannot_take_falls_back_with_one_log_line(interpreted, caplog):
  qkv, parts, _, _ = _call("causal_packed")
  with caplog.at_level(logging.INFO):
    for _ in range(2):  # a decoding step's mask: an array without parts
      call = kernels.Call.of(qkv[0], qkv[1], parts.dense)
      assert kernels.choose("splash", call) == "reference"
      out = attention.fused_attention(*qkv, parts.dense, "splash")
  lines = [r.getMessage() for r in caplog.records if "attention_implementation" in r.getMessage()]
  assert lines == ["attention_implementation='splash' needs the mask's parts (causal / "
                   "segments / window), not a mask array: this call runs the reference."]
  np.testing.assert_allclose(out, attention.dot_product_attention(*qkv, parts.dense), **FORWARD)


def test_a_kernel_package_that_fails_here_falls_back_with_one_log_line(monkeypatch, caplog):
  """As tokamax 0.0.12's GPU kernels fail to build under jax 0.11.2 (AttributeError: pl.dot
  was removed): the reference runs, logged once per failure."""
  def failing(*args):
    raise AttributeError("pl.dot was deprecated in JAX v0.11.0, and removed")

  monkeypatch.setitem(kernels.KERNELS, "tokamax",
                      dataclasses.replace(kernels.KERNELS["tokamax"], run=failing))
  qkv, parts, _, _ = _call("causal_packed")
  with caplog.at_level(logging.WARNING):
    assert kernels.run("tokamax", *qkv, parts) is None
    assert kernels.run("tokamax", *qkv, parts) is None
  assert [r.getMessage() for r in caplog.records] == [
      "attention_implementation='tokamax' failed here (AttributeError: pl.dot was deprecated "
      "in JAX v0.11.0, and removed): this call runs the reference."]


@pytest.mark.parametrize("implementation, options, platform, message", [
    ("splash", {}, "cpu", "attention_implementation='splash' runs on tpu, not cpu"),
    ("cudnn", dict(dtype="bfloat16"), "cpu", "'cudnn' runs on gpu, not cpu"),
    ("splash", dict(position_embedding="relative"), "tpu", "takes no score bias"),
    ("splash", dict(prefix_lm=True), "tpu", "a prefix LM's mask (per-row prefixes)"),
    ("xla", dict(attention_softcap=5.0), "gpu", "'xla' has no score soft-capping"),
    ("tokamax", dict(position_embedding="relative"), "tpu", "'tokamax' takes no score bias"),
])
def test_a_kernel_the_config_cannot_run_is_one_line_before_compiling(
    tiny_config, monkeypatch, implementation, options, platform, message):
  tiny_config.model.update(attention_implementation=implementation, **options)
  if options.get("prefix_lm"):
    tiny_config.architecture = "decoder_only"
  monkeypatch.setattr(jax, "default_backend", lambda: platform)
  with pytest.raises(config_validation.ConfigError) as raised:
    config_validation.validate(tiny_config, device_count=jax.device_count())
  assert message in str(raised.value)
  line = next(line for line in str(raised.value).splitlines() if message in line)
  assert line.count("attention_implementation") == 1



@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="cuDNN and tokamax's GPU kernels run on a GPU only")
@pytest.mark.parametrize("name", ["cudnn", "tokamax"])
@pytest.mark.parametrize("case", ["causal_packed", "sliding_window", "grouped_heads",
                                  "softcap", "cross_packed"])
def test_gpu_kernels_equal_the_reference(name, case):
  """In bfloat16 (cuDNN's precision), against the reference on the same bfloat16 inputs."""
  qkv, parts, softcap, cotangent = _call(case)
  qkv = [x.astype(jnp.bfloat16) for x in qkv]
  if kernels.choose(name, kernels.Call.of(qkv[0], qkv[1], parts, softcap=softcap)) != name:
    pytest.skip(f"{name} does not take {case}")
  if kernels.run(name, *qkv, parts, softcap=softcap) is None:  # logged: the package failed
    pytest.skip(f"{name} fails to build here (see the log)")
  ours = lambda q, k, v: kernels.run(name, q, k, v, parts, softcap=softcap).astype(jnp.float32)
  reference = lambda q, k, v: attention.dot_product_attention(
      q, k, v, parts.dense, softcap=softcap).astype(jnp.float32)
  real = np.asarray(parts.query_segments != 0)
  np.testing.assert_allclose(np.asarray(ours(*qkv))[real], np.asarray(reference(*qkv))[real],
                             rtol=2e-2, atol=2e-2)
  grads = [jax.grad(_loss(fn, parts, cotangent), argnums=(0, 1, 2))(*qkv)
           for fn in (ours, reference)]
  for mine, theirs in zip(*grads):
    np.testing.assert_allclose(np.asarray(mine, np.float32), np.asarray(theirs, np.float32),
                               rtol=5e-2, atol=5e-2)
