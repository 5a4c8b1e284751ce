"""Hugging Face checkpoints imported into models.EncoderDecoder against transformers itself.

Every supported architecture (T5 v1.0, T5 v1.1 gated and untied, mT5, UMT5, BART, mBART,
Marian) as a tiny random checkpoint folder written by transformers (tests/hf_fixtures.py):
teacher-forced logits equal PyTorch's, greedy generation gives `generate`'s ids and text,
the import shards over a jit mesh (a decoder-only Gemma 3's too), and broken folders fail
with one helpful error.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import cli
from tests import hf_fixtures
from tests.conftest import ROOT
from transformer_jax import default_config
from transformer_jax import families
from transformer_jax.data import pipeline
from transformer_jax.model import models
from transformer_jax.pretrained import checkpoint as checkpoint_lib
from transformer_jax.pretrained import generation
from transformer_jax.pretrained import tokenizer as tokenizer_lib

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

KINDS = hf_fixtures.MODEL_KINDS
T5_KINDS = hf_fixtures.T5_KINDS
NEW_TOKENS = 12  # generated per row: a dozen steps of the KV cache, and fast
# Rows of different lengths (short to long); the source side is English, the target German.
ROWS = (3, 0, 7, 1)
GENERATE_ROWS = 8


@dataclasses.dataclass
class Imported:
  """A tiny checkpoint folder, its import and transformers' own model and tokenizer."""
  folder: str
  checkpoint: checkpoint_lib.Checkpoint
  params: dict  # numpy, internal ids
  family: families.Family
  tokenizer: tokenizer_lib.PretrainedTokenizer
  torch_model: Any

  def forward(self, inputs: np.ndarray, targets: np.ndarray) -> np.ndarray:
    return np.asarray(_jit_forward(self.family)(self.params, jnp.asarray(inputs),
                                                jnp.asarray(targets)))

  def hf(self, internal_ids) -> np.ndarray:
    return self.checkpoint.vocab.hf(internal_ids)


@functools.lru_cache(maxsize=None)
def _jit_forward(family: families.Family):
  return jax.jit(lambda params, inputs, targets: family.forward(
      params, {"inputs": inputs, "targets": targets}, deterministic=True))


def family_of(checkpoint: checkpoint_lib.Checkpoint) -> families.Family:
  """The encoder-decoder family of an imported checkpoint (T5 has no position limit: the
  model config's default max_len stands)."""
  return families.from_model_config("encoder_decoder",
                                    models.TransformerConfig(**checkpoint.fields))


@pytest.fixture(scope="session")
def sentences():
  """English sources and German targets the tokenizers were not trained on where the shared
  corpora are here (else the built-in sentences, which they were)."""
  en, de = hf_fixtures.model_sentences("en", 420), hf_fixtures.model_sentences("de", 420)
  held_out = slice(400, 420) if len(en) >= 420 else slice(0, 20)
  return en[held_out], de[held_out]


@pytest.fixture(scope="session")
def imported(tmp_path_factory):
  """`imported(kind)`: the kind's checkpoint, built and imported once; `imported(kind, name,
  **tiny_model_arguments)` a variant of it, built the first time `name` is asked for."""
  built: dict[tuple, Imported] = {}

  def get(kind: str, variant: str | None = None, **arguments) -> Imported:
    if (kind, variant) not in built:
      folder = hf_fixtures.tiny_model(
          kind, str(tmp_path_factory.mktemp(f"{kind}_{variant or 'model'}")), **arguments)
      checkpoint = checkpoint_lib.open_checkpoint(folder)
      torch_model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
      built[kind, variant] = Imported(
          folder, checkpoint, checkpoint_lib.read_params(checkpoint), family_of(checkpoint),
          tokenizer_lib.PretrainedTokenizer(folder, checkpoint.vocab), torch_model)
    return built[kind, variant]

  return get


def _padded(rows: list[list[int]], extra: int = 0) -> np.ndarray:
  """Internal ids + EOS, padded with 0 to the longest row (+ `extra` columns)."""
  length = max(len(r) for r in rows) + 1 + extra
  return np.stack([np.pad(pipeline.with_eos(r, length), (0, length - len(r) - 1))
                   for r in rows])


def _batch(m: Imported, sentences) -> tuple[np.ndarray, np.ndarray]:
  en, de = sentences
  inputs = _padded([m.tokenizer.encode(en[i]) for i in ROWS])
  targets = _padded([m.tokenizer.encode_target(de[i]) for i in ROWS], extra=1)
  return inputs, targets


def _version(text: str) -> tuple[int, ...]:
  return tuple(int(part) for part in text.split(".")[:2])


def _until_eos(ids, eos: int) -> list[int]:
  ids = [int(i) for i in ids]
  return ids[:ids.index(eos) + 1] if eos in ids else ids


# ---- Teacher forcing -----------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_teacher_forced_logits_equal_pytorch(imported, sentences, kind):
  if kind == "umt5" and _version(transformers.__version__) < (5, 18):
    # Seen on a GPU machine's transformers 5.17: its UMT5 decoder attends to later targets
    # when teacher-forced (no causal mask; 5.18 passes is_causal), so it is no reference.
    pytest.skip("transformers < 5.18 runs UMT5's decoder without its causal mask")
  m = imported(kind)
  inputs, targets = _batch(m, sentences)
  lengths = (inputs != 0).sum(1), (targets != 0).sum(1)
  assert len(set(lengths[0])) > 1 and len(set(lengths[1])) > 1  # rows padded differently
  ours = m.forward(inputs, targets)
  decoder_inputs = np.asarray(models.shift_right(jnp.asarray(targets),
                                                 m.checkpoint.fields["bos_id"]))
  with torch.no_grad():
    reference = m.torch_model(
        input_ids=torch.tensor(m.hf(inputs)), attention_mask=torch.tensor(inputs != 0),
        decoder_input_ids=torch.tensor(m.hf(decoder_inputs))).logits.numpy()
  reference = reference[..., m.checkpoint.vocab.to_hf]  # columns in internal order
  valid = targets != 0
  np.testing.assert_allclose(ours[valid], reference[valid], atol=1e-4, rtol=0)
  # Not vacuous: the logits spread over a range far wider than the tolerance.
  assert np.ptp(reference[valid]) > 0.1
  # Untied checkpoints (T5 v1.1, mT5) bring an output layer of their own, which the fixture
  # draws apart from the embedding.
  assert ("logits_dense" in m.params) == (kind in ("t5_gated", "mt5"))


# ---- Generation ----------------------------------------------------------------------------

def _decoding(m: Imported, **changes):
  decoding = default_config.get_config().decoding
  decoding.update(generation.decoding_settings(m.checkpoint.generation_config,
                                               m.checkpoint.vocab, m.family.model_config.max_len))
  decoding.update(method="greedy", max_decode_len=NEW_TOKENS, **changes)
  return decoding


def _generate_inputs(m: Imported, sentences) -> np.ndarray:
  return _padded(m.tokenizer.encode_batch(sentences[0][:GENERATE_ROWS]))


def _greedy(m: Imported, inputs: np.ndarray, decoding) -> tuple[np.ndarray, np.ndarray]:
  """Our greedy search: [b, NEW_TOKENS] internal ids and [b] log-probabilities."""
  decode = jax.jit(functools.partial(m.family.decode, decoding_config=decoding, nbest=1))
  ids, scores = decode(m.params, jnp.asarray(inputs), jax.random.PRNGKey(0))
  return np.asarray(ids)[:, 0], np.asarray(scores)[:, 0]


def _hf_generate(m: Imported, inputs: np.ndarray, **kwargs) -> tuple[np.ndarray, np.ndarray]:
  """transformers' greedy search: [b, <= NEW_TOKENS] checkpoint ids, decoder start dropped,
  and per step the log-softmax of its processed logits, [steps, b, vocab]."""
  with torch.no_grad():
    out = m.torch_model.generate(
        input_ids=torch.tensor(m.hf(inputs)), attention_mask=torch.tensor(inputs != 0),
        num_beams=1, do_sample=False, max_new_tokens=NEW_TOKENS, output_scores=True,
        return_dict_in_generate=True, **kwargs)
  ids = out.sequences.numpy()
  start = m.checkpoint.vocab.hf(m.checkpoint.fields["bos_id"])
  assert (ids[:, 0] == start).all()  # the decoder start, which our outputs leave out
  return ids[:, 1:], torch.log_softmax(torch.stack(out.scores), -1).numpy()


def _assert_generation_matches(m: Imported, sentences, decoding, **hf_kwargs) -> list:
  """Our greedy ids (checkpoint ids, up to EOS) == transformers', and so are the text and
  the log-probability of each output: every step's cached-decoding logits agree, not only
  their argmax."""
  inputs = _generate_inputs(m, sentences)
  ours, our_scores = _greedy(m, inputs, decoding)
  theirs, logprobs = _hf_generate(m, inputs, **hf_kwargs)
  eos = m.tokenizer.eos_id
  ours_hf = [_until_eos(row, eos) for row in m.hf(ours)]
  assert ours_hf == [_until_eos(row, eos) for row in theirs]
  their_scores = [sum(logprobs[step, b, token] for step, token in enumerate(row))
                  for b, row in enumerate(ours_hf)]
  np.testing.assert_allclose(our_scores, their_scores, atol=1e-4, rtol=0)
  # Ids past the tokenizer (T5's unused embedding rows) have no text: decode drops them.
  pieces = [[i for i in row if i < m.tokenizer.vocab_size] for row in ours_hf]
  assert [m.tokenizer.decode(row) for row in ours] == m.tokenizer.hf_tokenizer.batch_decode(
      pieces, skip_special_tokens=True)
  return ours_hf


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_equals_transformers_generate(imported, sentences, kind):
  """Also checks the decoder start: transformers' first token is ours (mBART's config has
  none, so both start from its bos)."""
  m = imported(kind)
  decoding = _decoding(m)
  forced_eos = "forced_eos_token_id" in m.checkpoint.generation_config
  assert decoding.forced_eos == forced_eos == (kind not in T5_KINDS)
  outputs = _assert_generation_matches(m, sentences, decoding)
  if forced_eos:  # every output ends with EOS, at the last position at the latest
    assert all(row[-1] == m.tokenizer.eos_id for row in outputs)
  if kind == "marian":  # generation_config.json bans the pad token, as OPUS-MT's do
    assert tuple(decoding.banned_ids) == (0,)


def test_forced_eos_equals_transformers(imported, sentences):
  """T5 checkpoints force no EOS; asked to, both sides end every row at the same place."""
  m = imported("t5")
  outputs = _assert_generation_matches(m, sentences, _decoding(m, forced_eos=True),
                                       forced_eos_token_id=m.tokenizer.eos_id)
  assert all(row[-1] == m.tokenizer.eos_id and len(row) <= NEW_TOKENS for row in outputs)


def test_outputs_ending_on_their_own_equal_transformers(imported, sentences):
  """Marian with EOS's logits bias raised so that half the rows end early on their own (the
  rest of the row is padding) and half run to the forced EOS.

  Raising EOS's logit changes no other token's rank: each row follows its course in the plain
  model until EOS first comes out on top, which it does where the plain model's EOS came
  within the raised amount of the best token. So the bias is set between the rows' closest
  approaches (the forced last step left out), and which rows end early is known beforehand.
  """
  plain = imported("marian")
  _, logprobs = _hf_generate(plain, _generate_inputs(plain, sentences))
  eos = plain.tokenizer.eos_id
  closest = (logprobs.max(-1) - logprobs[..., eos])[:NEW_TOKENS - 1].min(0)  # [rows]
  half = len(closest) // 2
  below, above = np.sort(closest)[[half - 1, half]]
  assert above - below > 1e-3, closest  # float32 ties would make the split uncertain
  m = imported("marian", "early_eos", eos_bias=float(below + above) / 2)
  lengths = np.array([len(row) for row in _assert_generation_matches(m, sentences,
                                                                     _decoding(m))])
  assert ((lengths < NEW_TOKENS) == (closest <= below)).all(), (lengths, closest)


def test_forced_bos_from_generation_config_equals_transformers(imported, sentences):
  m = imported("bart", "forced_bos", generation={"forced_bos_token_id": 0})
  decoding = _decoding(m)
  assert decoding.forced_bos_id == m.checkpoint.vocab.internal(0) == 2
  outputs = _assert_generation_matches(m, sentences, decoding)
  assert all(row[0] == 0 for row in outputs)  # <s> first, as bart-large-cnn writes


# ---- Sharded import ------------------------------------------------------------------------

_SHARDED = """
import functools, json, sys
sys.path.insert(0, {root!r})
import jax
import numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
from transformer_jax import families, parallel
from transformer_jax.model import models
from transformer_jax.pretrained import checkpoint
assert jax.device_count() == 8
layout = parallel.MeshParallel(data=1, fsdp=4, tensor=2)
results = {{}}
for kind, folder in {folders!r}.items():
  ck = checkpoint.open_checkpoint(folder)
  family = families.from_model_config(ck.family, models.TransformerConfig(**ck.fields))
  boxed = jax.eval_shape(functools.partial(family.init_params, boxed=True),
                         jax.random.PRNGKey(0))
  params = layout.place_params(checkpoint.read_params(ck), boxed)
  batch = dict(np.load(folder + ".batch.npz"))
  forward = layout.compile_eval(
      lambda p, b: family.forward(p, b, deterministic=True))
  logits = np.asarray(forward(params, layout.eval_batch(batch)))
  np.save(folder + ".sharded.npy", logits)
  split = {{"/".join(str(k.key) for k in path): list(x.sharding.spec)
           for path, x in jax.tree_util.tree_leaves_with_path(params)
           if not x.sharding.is_fully_replicated}}
  results[kind] = split
print("RESULT", json.dumps(results))
"""


@pytest.fixture(scope="session")
def sharded_runs(imported, sentences, tmp_path_factory):
  """T5, BART and Gemma 3 (decoder-only: q/k norms, post-sublayer norms, grouped key/value
  heads) forwards on 8 simulated devices (fsdp 4 x tensor 2), in one subprocess: per kind
  (one-device logits, targets, sharded logits, the parameters that were split)."""
  folders, single = {}, {}
  for kind in ("t5", "bart"):
    m = imported(kind)
    inputs, targets = _batch(m, sentences)
    np.savez(m.folder + ".batch.npz", inputs=inputs, targets=targets)
    folders[kind], single[kind] = m.folder, (m.forward(inputs, targets), targets)
  folder = hf_fixtures.tiny_model("gemma3_text", str(tmp_path_factory.mktemp("gemma3_text")))
  checkpoint = checkpoint_lib.open_checkpoint(folder)
  tokenizer = tokenizer_lib.PretrainedTokenizer(folder, checkpoint.vocab)
  targets = _padded([tokenizer.encode(sentences[0][i]) for i in ROWS])
  family = families.from_model_config("decoder_only",
                                      models.TransformerConfig(**checkpoint.fields))
  logits = family.forward(checkpoint_lib.read_params(checkpoint), {"targets": targets},
                          deterministic=True)
  np.savez(folder + ".batch.npz", targets=targets)
  folders["gemma3_text"], single["gemma3_text"] = folder, (np.asarray(logits), targets)
  run = subprocess.run([sys.executable, "-c", _SHARDED.format(root=ROOT, folders=folders)],
                       env=cli.env(8), capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  split = json.loads(run.stdout.split("RESULT", 1)[1])
  return {kind: (*single[kind], np.load(folders[kind] + ".sharded.npy"), split[kind])
          for kind in folders}


@pytest.mark.parametrize("kind", ["t5", "bart", "gemma3_text"])
def test_sharded_import_gives_one_device_logits(sharded_runs, kind):
  one_device, targets, sharded, split = sharded_runs[kind]
  valid = targets != 0
  # On a GPU the one-device logits come from the GPU and the sharded ones from the CPU:
  # their sums run in different orders (1.5e-5 apart on an H100).
  np.testing.assert_allclose(sharded[valid], one_device[valid], atol=3e-5, rtol=0)
  # The parameters were really split: the embedding over vocab (tensor, where the rows divide:
  # T5's are rounded up, BART's are the tokenizer's) x embed (fsdp), the heads over tensor.
  vocab_axis = "tensor" if one_device.shape[-1] % 2 == 0 else None
  if kind == "gemma3_text":  # 2 key/value heads of 4, one per tensor device; norms whole
    assert split["embedding/embedding/embedding"] == [vocab_axis, "fsdp"]
    for name in ("query", "kv"):
      assert split[f"decoder/layer_1/self_attention/{name}/kernel"] == [
          "fsdp", None, "tensor", None]
    assert "decoder/layer_1/self_attention/query_norm/scale" not in split
    assert split["decoder/layer_1/ffn_block/post_norm/scale"] == ["fsdp"]
    return
  assert split["shared_embedding/embedding/embedding"] == [vocab_axis, "fsdp"]
  assert split["decoder/layer_1/self_attention/qkv/kernel"] == ["fsdp", None, "tensor", None]


# ---- Broken folders ------------------------------------------------------------------------

def _copy(source: str, target, names) -> str:
  os.makedirs(target, exist_ok=True)
  for name in names:
    shutil.copy(os.path.join(source, name), target)
  return str(target)


def test_a_folder_without_weights_says_so(imported, tmp_path):
  folder = _copy(imported("t5").folder, tmp_path / "no_weights",
                 ["config.json", "spiece.model", "tokenizer.json"])
  with pytest.raises(checkpoint_lib.PretrainedError, match="has no weights"):
    checkpoint_lib.open_checkpoint(folder)


def test_an_unsupported_model_type_is_named(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
  with pytest.raises(checkpoint_lib.PretrainedError,
                     match=r"'gpt_neox'.*not supported; supported: bart, .*t5"):
    checkpoint_lib.open_checkpoint(str(tmp_path))


def test_pytorch_bin_weights_only_say_how_to_convert(imported, tmp_path):
  folder = _copy(imported("bart").folder, tmp_path / "bin", ["config.json"])
  (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"not a real state dict")
  with pytest.raises(checkpoint_lib.PretrainedError,
                     match=r"\.bin weights but no model\.safetensors.*save_pretrained"):
    checkpoint_lib.open_checkpoint(folder)
  assert issubclass(checkpoint_lib.PretrainedError, ValueError)


def test_tokenizer_files_of_another_model_are_refused(imported, tmp_path):
  """T5 weights beside BART's tokenizer files (pad 1, eos 2 against T5's pad 0, eos 1)."""
  t5, bart = imported("t5"), imported("bart")
  folder = _copy(t5.folder, tmp_path / "mixed", ["config.json", "model.safetensors"])
  _copy(bart.folder, folder, ["vocab.json", "merges.txt", "tokenizer.json",
                              "tokenizer_config.json"])
  checkpoint = checkpoint_lib.open_checkpoint(folder)  # the weights themselves are fine
  with pytest.raises(ValueError, match=r"pad id 1 and eos id 2 but the model has pad 0 and "
                                       r"eos 1: they are not this checkpoint's"):
    tokenizer_lib.PretrainedTokenizer(folder, checkpoint.vocab)
