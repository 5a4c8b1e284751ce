"""Every attention implementation the backend has against 'reference', on padded and packed
inputs: outputs, gradients, and a model's loss and gradients.

On CPU this checks 'xla' and 'auto'; on GPU also 'cudnn' (in bfloat16, its only precision
family besides float16, hence the looser tolerance). Fully masked query rows are part of every
case: padding queries, and a packed target segment with no source segment to attend to.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import metrics
from transformer_jax.model import attention
from transformer_jax.model import kernels
from transformer_jax.model import models

ON_GPU = jax.default_backend() == "gpu"
IMPLEMENTATIONS = [
    "xla", "auto",
    pytest.param("cudnn", marks=[pytest.mark.gpu,
                                 pytest.mark.skipif(not ON_GPU, reason="cuDNN needs a GPU")]),
]
# (dtype, relative tolerance): float32 paths agree to rounding; bfloat16 inputs carry ~3
# significant digits, and its errors grow through the softmax and the backward pass.
PRECISION = {"float32": (jnp.float32, 1e-5), "bfloat16": (jnp.bfloat16, 3e-2)}

# Two packed rows and one padded row (token 0 = padding, segment 0 = padding).
SOURCE = np.array([[5, 6, 7, 8, 9, 4, 3, 0],
                   [5, 6, 7, 0, 0, 0, 0, 0],
                   [3, 4, 5, 6, 7, 8, 9, 10]])
SOURCE_SEGMENTS = np.array([[1, 1, 1, 2, 2, 2, 2, 0],
                            [1, 1, 1, 0, 0, 0, 0, 0],
                            [1, 1, 1, 1, 1, 1, 1, 1]])
TARGET = np.array([[4, 5, 6, 7, 8, 9, 0, 0],
                   [4, 5, 6, 7, 8, 0, 0, 0],
                   [3, 4, 5, 6, 7, 8, 9, 0]])
# Row 1's second target segment has no source segment 2: its queries see no key at all.
TARGET_SEGMENTS = np.array([[1, 1, 1, 2, 2, 2, 0, 0],
                            [1, 1, 2, 2, 2, 0, 0, 0],
                            [1, 1, 1, 1, 1, 1, 1, 0]])


def _masks():
  src, tgt = jnp.asarray(SOURCE), jnp.asarray(TARGET)
  src_seg, tgt_seg = jnp.asarray(SOURCE_SEGMENTS), jnp.asarray(TARGET_SEGMENTS)
  return {
      "encoder": models.self_attention_mask(src, src_seg, causal=False),
      "decoder": models.self_attention_mask(tgt, tgt_seg, causal=True),
      "cross": attention.combine_masks(attention.padding_mask(tgt, src),
                                       attention.segment_mask(tgt_seg, src_seg)),
  }


def _precision(implementation):
  half = attention.resolve_implementation(implementation) == "cudnn"  # no float32 kernel
  return PRECISION["bfloat16" if half else "float32"]


def _rel(x, ref):
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  assert np.isfinite(x).all()
  return np.linalg.norm(x - ref) / np.linalg.norm(ref)


def test_a_packed_segment_without_source_is_a_fully_masked_row():
  cross = np.asarray(_masks()["cross"])
  assert not cross[1, 0, 2:5].any()  # the case the cuDNN path must survive
  assert cross[0, 0, :3].any(axis=-1).all()


@pytest.mark.parametrize("dtype, length, head_dim, chosen", [
    (jnp.bfloat16, 8, 64, "cudnn"), (jnp.float16, 8, 64, "cudnn"),
    (jnp.float32, 8, 64, "reference"),  # cuDNN has no float32 kernel
    (jnp.bfloat16, 1, 64, "reference"),  # a decoding step's single query
    (jnp.bfloat16, 8, 12, "reference"),  # head dimensions cuDNN refuses
    (jnp.bfloat16, 8, 264, "reference")])
def test_auto_takes_cudnn_only_where_its_kernels_apply(monkeypatch, dtype, length, head_dim,
                                                        chosen):
  """Where 'auto' means cuDNN (a GPU: the platform forced), inputs cuDNN cannot take fall
  back to the reference."""
  del monkeypatch
  query = jnp.zeros((2, length, 4, head_dim), dtype)
  on_gpu = kernels.Call.of(query, query, platform="gpu")
  assert kernels.choose("auto", on_gpu) == chosen
  assert kernels.choose("xla", on_gpu) == "xla"


def test_auto_is_the_default_and_the_reference_off_a_gpu():
  """Models default to 'auto': cuDNN on a GPU, the reference einsums on a CPU or TPU."""
  assert models.TransformerConfig().attention_implementation == "auto"
  query = jnp.zeros((2, 8, 4, 64), jnp.bfloat16)
  assert attention.resolve_implementation("auto", query) == ("cudnn" if ON_GPU else "reference")


def test_auto_on_a_gpu_decodes_like_the_full_forward(monkeypatch):
  """'auto' as a GPU runs it (the cuDNN branch of `fused_attention` wherever a call has more
  than one query: a prompt's prefill, the full forward), XLA standing in for the kernel:
  padded prompts of a prefix LM with RoPE and grouped heads fill the cache, decode, and equal
  the full forward, and the branch was taken."""
  from tests import test_modern_variants  # pylint: disable=g-import-not-at-top
  calls = []
  original = jax.nn.dot_product_attention

  def kernel(query, key, value, *args, implementation=None, **kwargs):
    calls.append(implementation)
    return original(query, key, value, *args, implementation="xla", **kwargs)

  def resolve(implementation, query=None, key=None, mask=None, **unused):  # float32 here
    if implementation != "auto":
      return implementation
    return "cudnn" if query is not None and query.shape[1] > 1 else "reference"

  monkeypatch.setattr(jax.nn, "dot_product_attention", kernel)
  monkeypatch.setattr(attention, "resolve_implementation", resolve)
  test_modern_variants.test_decoder_only_padded_prompts_and_copies_decode_like_the_full_forward(
      "prefix_rope_gqa")
  assert calls and set(calls) == {"cudnn"}


@pytest.mark.parametrize("kind", ["encoder", "decoder", "cross"])
def test_cudnn_is_never_given_an_empty_row(monkeypatch, kind):
  """The cuDNN call's arguments and the result, on any backend: XLA stands in for the kernel."""
  seen = {}
  original = jax.nn.dot_product_attention

  def kernel(query, key, value, *, mask, implementation):
    seen.update(mask=mask, implementation=implementation)
    return original(query, key, value, mask=mask, implementation="xla")

  monkeypatch.setattr(jax.nn, "dot_product_attention", kernel)
  q, k, v = jax.random.normal(jax.random.PRNGKey(0), (3, 3, 8, 2, 16))
  mask = _masks()[kind]
  out = kernels.run("cudnn", q, k, v, mask)
  assert seen["implementation"] == "cudnn" and seen["mask"].shape == (3, 1, 8, 8)
  assert np.asarray(seen["mask"]).any(axis=-1).all()
  # Fully masked rows included: the reference's uniform weights.
  np.testing.assert_allclose(out, attention.dot_product_attention(q, k, v, mask), rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", ["encoder", "decoder", "cross"])
def test_outputs_and_gradients_match_reference(implementation, kind):
  dtype, tolerance = _precision(implementation)
  mask = _masks()[kind]
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  shape = (3, 8, 2, 16)  # [b, len, heads, head_dim]
  q, k, v, cotangent = (jax.random.normal(key, shape, jnp.float32) for key in keys)

  def reference(q, k, v):
    return attention.dot_product_attention(q, k, v, mask)

  def fused(q, k, v):
    return attention.fused_attention(q, k, v, mask, implementation)

  expected, reference_vjp = jax.vjp(reference, q, k, v)
  out, fused_vjp = jax.vjp(fused, *(x.astype(dtype) for x in (q, k, v)))
  assert _rel(out, expected) < tolerance
  for got, want in zip(fused_vjp(cotangent.astype(dtype)), reference_vjp(cotangent)):
    assert _rel(got, want) < tolerance


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_packed_model_loss_and_gradients_match_reference(implementation):
  dtype, tolerance = _precision(implementation)
  config = models.TransformerConfig(vocab_size=16, emb_dim=32, num_heads=2, num_layers=1,
                                    qkv_dim=32, mlp_dim=64, max_len=8, dropout_rate=0.0,
                                    attention_dropout_rate=0.0, dtype=dtype)
  batch = dict(inputs=SOURCE, targets=TARGET, inputs_segmentation=SOURCE_SEGMENTS,
               targets_segmentation=TARGET_SEGMENTS,
               inputs_position=np.zeros_like(SOURCE), targets_position=np.zeros_like(TARGET))
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  reference = models.EncoderDecoder(config.replace(dtype=jnp.float32))
  params = reference.init(jax.random.PRNGKey(0), batch["inputs"], batch["targets"],
                          deterministic=True)["params"]

  def loss(model, params):
    logits = model.apply({"params": params}, batch["inputs"], batch["targets"],
                         batch["inputs_position"], batch["targets_position"],
                         batch["inputs_segmentation"], batch["targets_segmentation"],
                         deterministic=True)
    weights = (batch["targets"] != 0).astype(jnp.float32)
    return jnp.sum(metrics.smoothed_cross_entropy(logits, batch["targets"]) * weights)

  fast = models.EncoderDecoder(config.replace(attention_implementation=implementation))
  want_loss, want_grads = jax.value_and_grad(lambda p: loss(reference, p))(params)
  got_loss, got_grads = jax.value_and_grad(lambda p: loss(fast, p))(params)
  assert _rel(got_loss, want_loss) < tolerance
  flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
  assert _rel(flat(got_grads), flat(want_grads)) < tolerance * 3  # summed over every weight
