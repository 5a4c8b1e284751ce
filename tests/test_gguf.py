"""GGUF files in (issue #60, pretrained/gguf_file.py): a tiny Llama written by the `gguf`
package in F32, F16, Q8_0, Q4_0, Q4_1 and Q4_K gives the logits transformers gives for the same
file (`from_pretrained(..., gguf_file=...)`, which dequantizes) and the same tokens; Q8_0 and
Q4_0 kernels are held as the file holds them; damaged and hostile files are one line."""

import os
import struct
import tracemalloc

import jax
import numpy as np
import pytest

from tests import cli
from tests import gguf_files
from tests import hf_fixtures
from transformer_jax import parallel
from transformer_jax import predict
from transformer_jax.model import quantization
from transformer_jax.pretrained import checkpoint as checkpoint_lib

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

TEXT = "A man is riding a bicycle down the street."
# (architecture, attention and feed-forward kernels, feed-forward kernels where they differ,
# held as)
FILES = {"f32": ("llama", "F32", None, "none"), "f16": ("llama", "F16", None, "none"),
         "q8_0": ("llama", "Q8_0", None, "int8"), "q4_0": ("llama", "Q4_0", None, "int4"),
         "q4_1": ("llama", "Q4_1", None, "none"), "q4_k": ("llama", "F32", "Q4_K", "none"),
         # Qwen2: biases on q / k / v, its output tied to the embedding, no row permutation.
         "qwen2_q8_0": ("qwen2", "Q8_0", None, "int8")}


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
  """Tiny Llama and Qwen2 folders whose widths are multiples of 256 (Q4_K's block): 4 heads of
  64, 2 key/value heads; the Llama with its own lm_head."""
  folders = {}
  for architecture in ("llama", "qwen2"):
    folder = str(tmp_path_factory.mktemp(architecture))
    files = hf_fixtures.llama_tokenizer_files(folder, hf_fixtures.model_sentences("en"))
    sizes = dict(vocab_size=files.vocab_size, hidden_size=256, intermediate_size=256,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=128, bos_token_id=files.tokenizer.bos_token_id,
                 eos_token_id=files.tokenizer.eos_token_id, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    if architecture == "llama":
      model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
          **sizes, tie_word_embeddings=False))
    else:
      model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
          **sizes, tie_word_embeddings=True))
      with torch.no_grad():  # biases that are not zero, so that their reading is tested
        for name, param in model.named_parameters():
          if name.endswith("bias"):
            param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(folder)
    folders[architecture] = folder
  return folders


@pytest.fixture(scope="module")
def gguf_path(hf_folders, tmp_path_factory):
  made = {}

  def get(name: str) -> str:
    if name not in made:
      architecture, kernels, ffn, _ = FILES[name]
      made[name] = gguf_files.write(hf_folders[architecture], str(
          tmp_path_factory.mktemp(name) / f"tiny-{name}.gguf"), kernels, ffn, architecture)
    return made[name]

  return get


def _our_logits(predictor, hf_ids):
  checkpoint = checkpoint_lib.open_checkpoint(predictor.config.pretrained)
  internal = np.asarray(checkpoint.vocab.internal(np.asarray(hf_ids)))[None]
  params = jax.tree.map(parallel.first_local_copy, predictor.device_params)
  logits = np.asarray(predictor.family.forward(params, {"targets": internal},
                                               deterministic=True))[0]
  return checkpoint.vocab.rows_to_hf(logits.T).T, checkpoint.vocab  # hf ids' columns first


@pytest.mark.parametrize("name", sorted(FILES))
def test_a_gguf_file_gives_the_logits_and_tokens_transformers_gives(gguf_path, name):
  path = gguf_path(name)
  folder, file = os.path.split(path)
  theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=file,
                                                             dtype=torch.float32).eval()
  their_tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=file)
  ids = their_tokenizer(TEXT)["input_ids"]
  ours = predict.Predictor.from_pretrained(path)
  logits, vocab = _our_logits(ours, ids)
  with torch.no_grad():
    expected = theirs(torch.tensor([ids])).logits.numpy()[0]
  # The dequantized values are the same on both sides: only float32 sums differ.
  np.testing.assert_allclose(logits[:, :expected.shape[1]], expected, atol=1e-4, rtol=0)
  encoded = [int(i) for i in vocab.hf(np.asarray(ours.tokenizer.encode(TEXT)))]
  assert encoded in (ids, ids[1:])  # with or without the BOS the tokenizer adds
  held = [x for x in jax.tree.leaves(ours.device_params, is_leaf=quantization.is_quantized)
          if quantization.is_quantized(x)]
  assert ours.config.quantization.weights == FILES[name][3]
  if FILES[name][3] == "none":
    assert not held
  else:  # every kernel read as the file holds it: 7 per layer
    assert len(held) == 2 * 6 and {x.array.qvalue.dtype.name for x in held} == {FILES[name][3]}


def test_a_folder_with_one_gguf_file_serves_from_the_command_line(gguf_path, monkeypatch):
  path = gguf_path("q8_0")
  expected = predict.Predictor.from_pretrained(path).predict([TEXT], method="greedy",
                                                             max_decode_len=8)
  code, stderr = cli.main_in_process(
      monkeypatch, "--pretrained", os.path.dirname(path), "--mode", "predict",
      "--config.decoding.method=greedy", "--config.decoding.max_decode_len=8",
      "--output", str(os.path.join(os.path.dirname(path), "out.txt")), stdin=TEXT + "\n")
  assert code in (0, None), stderr[-2000:]
  with open(os.path.join(os.path.dirname(path), "out.txt"), encoding="utf-8") as f:
    assert f.read().splitlines() == expected
  # Asked for another quantization than the file's: one line.
  code, stderr = cli.main_in_process(monkeypatch, "--pretrained", path, "--mode", "predict",
                                     "--config.quantization.weights=int4", stdin=TEXT + "\n")
  assert code != 0 and "holds its kernels in Q8_0" in cli.user_error(stderr)


def _tensor_info_offset(data: bytes, name: str) -> int:
  """Where a tensor's info (after its name: n_dims, dims, type, offset) starts in the header."""
  return data.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)


def test_damaged_and_hostile_gguf_files_are_one_line(gguf_path, tmp_path, monkeypatch):
  with open(gguf_path("q8_0"), "rb") as f:
    data = f.read()
  name = "blk.0.ffn_up.weight"
  info = _tensor_info_offset(data, name)
  n_dims = struct.unpack_from("<I", data, info)[0]
  damaged = {
      "truncated": data[:len(data) - 5000],
      "bad_header": b"GGUX" + data[4:],
      "unknown_type": (data[:info + 4 + 8 * n_dims] + struct.pack("<I", 99)
                       + data[info + 8 + 8 * n_dims:]),
      # A tensor claiming 2^20 x 2^20 values in a file of a few megabytes.
      "hostile_shape": (data[:info + 4] + struct.pack("<QQ", 2 ** 20, 2 ** 20)
                        + data[info + 4 + 16:]),
  }
  expected = {"truncated": "cannot be read as a GGUF file", "bad_header": "cannot be read",
              "unknown_type": "99", "hostile_shape": "cannot be read"}
  for kind, content in damaged.items():
    path = tmp_path / f"{kind}.gguf"
    path.write_bytes(content)
    tracemalloc.start()
    with pytest.raises(checkpoint_lib.PretrainedError) as error:
      predict.Predictor.from_pretrained(str(path))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    message = str(error.value)
    assert "\n" not in message and str(path) in message and expected[kind] in message, message
    assert peak < len(data), (kind, peak)  # nothing sized by the header's claims
  # An I32 kernel (a type no model reads) and an architecture this project does not read.
  assert "blk.0.ffn_up.weight is of GGUF type I32" in _refusal(tmp_path, monkeypatch, "llama")
  assert "GGUF architecture 'gpt2' is not supported" in _refusal(tmp_path, monkeypatch, "gpt2")


def _refusal(tmp_path, monkeypatch, architecture: str) -> str:
  """The one line `--mode predict` prints for a file holding one int32 tensor."""
  import gguf  # pylint: disable=import-outside-toplevel
  path = str(tmp_path / f"{architecture}.gguf")
  writer = gguf.GGUFWriter(path, architecture)
  writer.add_tensor("blk.0.ffn_up.weight", np.zeros((4, 4), np.int32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  code, stderr = cli.main_in_process(monkeypatch, "--pretrained", path, "--mode", "predict",
                                     stdin="a\n")
  assert code != 0
  return cli.user_error(stderr)
