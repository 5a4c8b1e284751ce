"""Several LoRA adapters on one served base (issue #58, `--adapter NAME=DIR`): two PEFT
adapters of different ranks, scales and targets, requests for the base and each adapter
interleaved in shared batches; each answer equals what `--mode predict --adapter DIR` (the
adapter merged) gives, the prompt log-probabilities equal peft's own model's, and bad names
and folders are one-line errors."""

import concurrent.futures

import numpy as np
import pytest

from tests import cli
from tests import hf_fixtures
from tests.test_continuous_batching import through_the_pool
from tests.test_serving import Server
from tests.test_serving import _pretrained_config
from transformer_jax import default_config
from transformer_jax import predict
from transformer_jax.serving import adapters as adapters_lib
from transformer_jax.serving import batch_decoder
from transformer_jax.serving import slot_pool

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TEXTS = ["a man is riding a bike", "two dogs play in the snow", "a woman", "people walk"]
# Adapter name -> (rank, alpha, targets, use_rslora), per kind's module names.
ADAPTERS = {
    "llama": {"one": (4, 16, ["q_proj", "v_proj"], False),
              "two": (8, 8, ["k_proj", "o_proj", "gate_proj", "down_proj"], True)},
    "bart": {"one": (4, 16, ["q_proj", "v_proj"], False),
             "two": (8, 8, ["k_proj", "out_proj", "fc1", "fc2"], True)}}


def _model_class(kind):
  return (transformers.AutoModelForCausalLM if kind == "llama"
          else transformers.AutoModelForSeq2SeqLM)


def _write_adapters(kind: str, base_folder: str, folder) -> dict[str, str]:
  """Each of ADAPTERS[kind] as peft writes it, with random non-zero B: {name: folder}."""
  written = {}
  for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS[kind].items()):
    torch.manual_seed(seed)
    model = peft.get_peft_model(_model_class(kind).from_pretrained(base_folder), peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora))
    with torch.no_grad():
      for parameter_name, parameter in model.named_parameters():
        if "lora_B" in parameter_name:
          parameter.normal_(0.0, 0.3)
    written[name] = str(folder / name)
    model.save_pretrained(written[name])
  return written


@pytest.fixture(scope="module")
def llama_with_adapters(tmp_path_factory):
  root = tmp_path_factory.mktemp("multi_adapter")
  folder = hf_fixtures.tiny_model("llama", str(root / "llama"))
  named = _write_adapters("llama", folder, root)
  server = Server("--pretrained", folder, "--config.max_source_length=32",
                  "--config.max_target_length=16", "--compilation_cache", "none",
                  *[f"--adapter={name}={path}" for name, path in named.items()],
                  max_batch_size=4)
  yield folder, named, server
  server.process.kill()


def test_interleaved_adapters_answer_as_each_merged(llama_with_adapters):
  folder, named, server = llama_with_adapters
  models = [card.id for card in server.client.models.list().data]
  assert models == [server.name, "one", "two"]
  status, listed = server.get("/v1/models")
  assert status == 200
  assert [(m.get("parent"), m.get("root")) for m in listed["data"]] == [
      (None, None), (server.name, named["one"]), (server.name, named["two"])]
  expected = {None: predict.Predictor.from_pretrained(folder, _pretrained_config())}
  for name, path in named.items():  # what --mode predict --adapter PATH gives
    expected[name] = predict.Predictor.from_pretrained(folder, _pretrained_config(),
                                                       adapter=path)
  outputs = {name: p.predict(TEXTS, method="greedy", max_decode_len=10)
             for name, p in expected.items()}
  assert outputs["one"] != outputs[None] != outputs["two"] != outputs["one"]
  # Every (text, model) pair at once: rows of all three share the server's batches.
  pairs = [(i, name) for i in range(len(TEXTS)) for name in (None, "one", "two")]
  with concurrent.futures.ThreadPoolExecutor(len(pairs)) as pool:
    answers = list(pool.map(lambda pair: server.client.completions.create(
        model=pair[1] or server.name, prompt=TEXTS[pair[0]], max_tokens=10, temperature=0),
                            pairs))
  for (i, name), answer in zip(pairs, answers):
    assert answer.choices[0].text == outputs[name][i], (i, name)
    assert answer.model == (name or server.name)


def test_adapter_prompt_logprobs_equal_peft(llama_with_adapters):
  """echo + logprobs with an adapter: its prompt's log-probabilities are those of peft's
  PeftModel over the same base (within 1e-4), the base's request beside it its own."""
  folder, named, server = llama_with_adapters
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  ids = tokenizer("two dogs run in the park")["input_ids"]
  for name in ("two", None):
    # A fresh base each time: PeftModel puts its layers into the model it is given.
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, named[name]).eval() if name else model
    with torch.no_grad():
      expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1).numpy()
    got = server.client.completions.create(model=name or server.name, prompt=ids, echo=True,
                                           max_tokens=0, logprobs=1).choices[0].logprobs
    want = [expected[t - 1, ids[t]] for t in range(1, len(ids))]
    np.testing.assert_allclose(got.token_logprobs[1:], want, atol=1e-4, err_msg=str(name))


def test_unknown_adapters_are_400_and_bad_folders_one_line(llama_with_adapters, tmp_path):
  folder, named, server = llama_with_adapters
  status, error = server.post("/v1/completions", {"model": "three", "prompt": "a"})
  assert status == 400 and error["error"]["param"] == "model"
  assert "'one', 'two'" in error["error"]["message"]
  assert server.client.completions.create(model="one", prompt="a", max_tokens=2).choices
  # A folder that is no adapter: one line at start, before the server listens.
  result = cli.run_main("--mode", "serve", "--pretrained", folder, "--port",
                        str(cli.free_port()), f"--adapter=one={named['one']}",
                        f"--adapter=bad={tmp_path}")
  assert result.returncode == 1
  assert f"{tmp_path} is not a PEFT adapter folder" in cli.user_error(result.stderr)
  # Predict merges one adapter: a named one is for the server.
  result = cli.run_main("--mode", "predict", "--pretrained", folder,
                        f"--adapter=one={named['one']}")
  assert "names an adapter for --mode serve" in cli.user_error(result.stderr)


def test_parse_names_and_folders():
  assert adapters_lib.parse(["/a/b=c"]) == ("/a/b=c", {})
  assert adapters_lib.parse(["x=/a", "y=/b"]) == (None, {"x": "/a", "y": "/b"})
  for values, message in [(["/a", "/b"], "name each one"), (["/a", "x=/b"], "name each one"),
                          (["x=/a", "x=/b"], "given twice"), (["a b=/x"], "letters, digits")]:
    with pytest.raises(ValueError, match=message):
      adapters_lib.parse(values)


def test_encoder_decoder_rows_of_each_adapter_in_one_pool(tmp_path):
  """BART, in process: rows of the base and of two adapters entering a two-slot pool as
  others finish, and one static batch of all: each row's output is its merged model's."""
  folder = hf_fixtures.tiny_model("bart", str(tmp_path / "bart"), eos_bias=2.0)
  named = _write_adapters("bart", folder, tmp_path)
  config = default_config.get_config()
  config.max_source_length, config.max_target_length = 16, 24
  base = predict.Predictor.from_pretrained(folder, config)
  decoder = batch_decoder.BatchDecoder(base, 2, stream_steps=4,
                                       adapters=adapters_lib.load(base, named, "bart"))
  prompts = [np.asarray(base.family.prompt(base.tokenizer.encode(t))) for t in TEXTS]
  rows = [batch_decoder.Row(p, 20, adapter=i % 3) for i, p in enumerate(prompts)]
  outputs = through_the_pool(slot_pool.SlotPool(decoder), rows)
  merged = [base] + [predict.Predictor.from_pretrained(folder, config, adapter=path)
                     for path in named.values()]
  batch = decoder.decode(rows[:2])
  alone_decoders = [batch_decoder.BatchDecoder(p, 1) for p in merged]
  changed = 0
  for i, row in enumerate(rows):
    alone = alone_decoders[row.adapter].decode([row])[0].ids
    np.testing.assert_array_equal(outputs[i].ids, alone)
    if i < 2:
      np.testing.assert_array_equal(batch[i].ids, alone)
    base_alone = alone_decoders[0].decode([row])[0].ids
    changed += row.adapter > 0 and not np.array_equal(alone, base_alone)
  assert changed  # the adapters change outputs: the rows above did read theirs
