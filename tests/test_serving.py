"""`--mode serve`: a real server process on 127.0.0.1, called with the real `openai` client and
raw HTTP, against `--mode predict`'s outputs (the Predictor it runs) for a demo encoder-decoder
workdir, a tiny pretrained decoder-only Llama with a chat template, and a tiny BERT classifier.
"""

import concurrent.futures
import json
import math
import re
import signal
import socket
import sys
import urllib.error
import urllib.request

import openai
import numpy as np
import pytest

from tests import cli
from tests import hf_fixtures
from tests.conftest import ROOT, make_tiny_config
from transformer_jax import default_config
from transformer_jax import predict
from transformer_jax import train

TEXTS = ["a man is riding a bike", "two dogs play in the snow", "a woman", "people walk"]


class Server:
  """A `--mode serve` process on a free port, with an openai client for it."""

  def __init__(self, *args, api_key=None, max_batch_size=2):
    self.port = cli.free_port()
    extra = dict(TRANSFORMER_JAX_API_KEY=api_key) if api_key else {}
    self.process = cli.Run([sys.executable, "-m", "transformer_jax.main", "--mode", "serve",
                            "--port", str(self.port),
                            f"--config.serve.max_batch_size={max_batch_size}", *args],
                           cwd=ROOT, env=cli.env(**extra))
    # Not in cli.STARTED, which is emptied after each test: module fixtures stop the servers.
    self.url = f"http://127.0.0.1:{self.port}"
    try:
      cli.wait_for(lambda: self.get("/health")[0] == 200, self.process)
    except BaseException:
      self.process.kill()
      raise
    self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key or "none",
                                max_retries=0)
    self.name = self.client.models.list().data[0].id

  def get(self, path):
    return self.request("GET", path)

  def post(self, path, body, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return self.request("POST", path, data, headers)

  def request(self, method, path, data=None, headers=None):
    """(status, parsed JSON or text); (None, error) where nothing answered."""
    request = urllib.request.Request(f"{self.url}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
    try:
      with urllib.request.urlopen(request, timeout=120) as response:
        status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as e:
      status, text = e.code, e.read().decode()
    except OSError as e:
      return None, str(e)
    try:
      return status, json.loads(text)
    except json.JSONDecodeError:
      return status, text


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, data_cache):
  path = str(tmp_path_factory.mktemp("served"))
  config = make_tiny_config(data_cache)
  config.update(num_train_steps=10, eval_every_steps=10, num_generate_examples=0)
  train.train_and_evaluate(config, path)
  return path


# A few output tokens at least, so that an untrained model's outputs are not all empty.
MIN_LENGTH = "--config.decoding.min_length=3"


@pytest.fixture(scope="module")
def _seq2seq_servers(workdir):
  servers = []
  yield servers
  for server in servers:
    server.process.kill()
    print(server.process.output()[1][-5000:])  # shown where a test failed


@pytest.fixture
def seq2seq(_seq2seq_servers, workdir):
  """The module's server, or a new one where a test stopped it: the SIGTERM test stops it, and
  xdist's worksteal may hand a worker tests of this module after that one."""
  if not _seq2seq_servers or _seq2seq_servers[-1].process.poll() is not None:
    # Few compiled shapes: prompts of 8, 16, 24 tokens x batches of 1, 2, 4 rows. A line per
    # request (the SIGTERM test waits for its request's).
    _seq2seq_servers.append(Server("--workdir", workdir, MIN_LENGTH,
                                   "--config.serve.log_requests=true", max_batch_size=4))
  return _seq2seq_servers[-1]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  folder = hf_fixtures.tiny_model("llama", str(tmp_path_factory.mktemp("llama")))
  cache = tmp_path_factory.mktemp("compilation_cache")
  server = Server("--pretrained", folder, "--config.max_source_length=32",
                  "--config.max_target_length=16", "--compilation_cache", str(cache),
                  "--config.serve.log_stats_s=0.001", api_key="secret")
  server.compilation_cache = cache
  yield folder, server
  server.process.kill()


def _pretrained_config(**keys):
  config = default_config.get_config()
  config.max_source_length, config.max_target_length = 32, 16
  config.update(keys)
  return config


def test_encoder_decoder_completions_and_chat_equal_predict_greedy(seq2seq, workdir):
  predictor = predict.Predictor.from_workdir(workdir)
  expected = predictor.predict_nbest(TEXTS, 1, method="greedy", max_decode_len=12, min_length=3)
  (model,) = seq2seq.client.models.list().data
  assert model.id == workdir.rstrip("/").split("/")[-1]
  answer = seq2seq.client.completions.create(model=model.id, prompt=TEXTS, max_tokens=12,
                                             temperature=0, logprobs=0)
  assert [c.text for c in answer.choices] == [e[0][0] for e in expected]
  assert all(c.text for c in answer.choices)
  # Usage: the prompts' tokens (the source and its EOS) and every generated token.
  prompts = predictor._prompts(TEXTS)  # pylint: disable=protected-access
  assert answer.usage.prompt_tokens == sum(len(p) for p in prompts.values())
  assert answer.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in answer.choices)
  for choice, ((_, score),) in zip(answer.choices, expected):
    # The chosen tokens' log-probabilities add up to the greedy search's score.
    assert math.isclose(sum(choice.logprobs.token_logprobs), score, abs_tol=1e-3)
    assert choice.finish_reason in ("stop", "length")
  chat = seq2seq.client.chat.completions.create(
      model=model.id, max_tokens=12, temperature=0,
      messages=[{"role": "system", "content": "ignored"}, {"role": "user", "content": TEXTS[1]}])
  assert chat.choices[0].message.content == expected[1][0][0]
  assert chat.usage.prompt_tokens == len(prompts[1])


def test_streams_add_up_to_the_answer_and_seeds_reproduce(seq2seq):
  kwargs = dict(max_tokens=20, temperature=1.0, top_p=0.9, n=2, seed=7)
  first = seq2seq.client.completions.create(model=seq2seq.name, prompt=TEXTS[0], **kwargs)
  again = seq2seq.client.completions.create(model=seq2seq.name, prompt=TEXTS[0], **kwargs)
  assert [c.text for c in first.choices] == [c.text for c in again.choices]
  assert len(first.choices) == 2
  pieces = {0: "", 1: ""}
  finish = {}
  for chunk in seq2seq.client.completions.create(model=seq2seq.name, prompt=TEXTS[0],
                                                 stream=True, **kwargs):
    for choice in chunk.choices:
      pieces[choice.index] += choice.text
      if choice.finish_reason:
        finish[choice.index] = choice.finish_reason
  assert [pieces[0], pieces[1]] == [c.text for c in first.choices]
  assert finish == {c.index: c.finish_reason for c in first.choices}
  chat_kwargs = dict(kwargs, n=1)
  messages = [{"role": "user", "content": TEXTS[2]}]
  whole = seq2seq.client.chat.completions.create(model=seq2seq.name, messages=messages,
                                                 **chat_kwargs)
  streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                     seq2seq.client.chat.completions.create(model=seq2seq.name,
                                                            messages=messages, stream=True,
                                                            **chat_kwargs) if chunk.choices)
  assert streamed == whole.choices[0].message.content


def test_concurrent_requests_with_mixed_settings_equal_sequential_answers(seq2seq):
  # 32 requests: greedy ones and seeded samples with their own temperature / top_k / top_p,
  # batched together by the server, each equal to its answer when sent alone.
  # Every third with OpenAI's penalties, every fifth with a logit_bias: per row too.
  requests = [dict(prompt=TEXTS[i % 4], max_tokens=4 + i % 9, temperature=0)
              if i % 2 else dict(prompt=TEXTS[i % 4], max_tokens=12, temperature=0.5 + i / 64,
                                 top_k=[0, 5][i % 4 // 2], top_p=[1.0, 0.8][i % 3 == 0], seed=i)
              for i in range(32)]
  for i, request in enumerate(requests):
    if i % 3 == 0:
      request.update(frequency_penalty=1.5, presence_penalty=0.5)
    if i % 5 == 0:
      request.update(logit_bias={str(7 + i % 4): 4.0})
  ask = lambda kwargs: seq2seq.client.completions.create(
      model=seq2seq.name, **{k: v for k, v in kwargs.items() if k != "top_k"},
      extra_body={"top_k": kwargs.get("top_k", 0)}).choices[0].text
  alone = [ask(r) for r in requests]
  with concurrent.futures.ThreadPoolExecutor(32) as pool:
    together = list(pool.map(ask, requests))
  assert together == alone
  assert len(set(alone)) > 4


def test_logit_bias_rules_its_own_row_alone(seq2seq):
  # +100 on one token: each of the row's greedy tokens is that one (no EOS either), while a
  # row decoded beside it answers as it does alone.
  plain = dict(model=seq2seq.name, prompt=TEXTS[0], max_tokens=6, temperature=0, logprobs=0)
  ask = lambda kwargs: seq2seq.client.completions.create(**kwargs).choices[0]
  alone = ask(plain)
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    biased, beside = pool.map(ask, [dict(plain, logit_bias={"9": 100}), plain])
  assert len(biased.logprobs.tokens) == 6 and len(set(biased.logprobs.tokens)) == 1
  assert biased.text != alone.text and beside.text == alone.text


@pytest.mark.parametrize("body, param, message", [
    (b'{"prompt": "a", ', None, "JSON"),
    ({"max_tokens": 5}, "prompt", "prompt"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens", "max_tokens=0"),
    ({"prompt": "a", "max_tokens": 29}, "max_tokens", "at most 28"),
    ({"prompt": " ".join(["word"] * 40)}, "prompt", "max_source_length=24"),
    ({"prompt": "a", "model": "gpt-4"}, "model", "does not exist"),
    ({"prompt": "a", "n": 9}, "n", "max_n"),
    ({"prompt": "a", "temperature": -1}, "temperature", "temperature"),
    ({"prompt": "a", "echo": True, "logprobs": 1}, "echo", "decoder-only"),
    ({"prompt": "a", "logprobs": 6}, "logprobs", "less than or equal to 5"),
    ({"prompt": "a", "best_of": 2}, "best_of", "not supported"),
    ({"prompt": "a", "presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
    ({"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ({"prompt": "a", "logit_bias": {"5": 101}}, "logit_bias", "less than or equal to 100"),
    ({"prompt": "a", "logit_bias": {"256": 1}}, "logit_bias", "vocabulary (256 ids)"),
    ({"prompt": "a", "max_tokens": 3, "min_tokens": 4}, "min_tokens", "more than max_tokens=3"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
])
def test_bad_requests_get_400_and_the_server_keeps_serving(seq2seq, body, param, message):
  status, answer = seq2seq.post("/v1/completions", body)
  assert status == 400, answer
  assert answer["error"]["type"] == "invalid_request_error"
  assert answer["error"]["param"] == param
  assert message in answer["error"]["message"], answer
  status, answer = seq2seq.post("/v1/completions", {"prompt": "a", "max_tokens": 3})
  assert status == 200 and len(answer["choices"]) == 1, answer


def test_wrong_routes_for_the_family_and_unknown_paths(seq2seq):
  status, answer = seq2seq.post("/v1/classifications", {"input": ["a"]})
  assert status == 400 and "/v1/completions" in answer["error"]["message"]
  status, answer = seq2seq.post("/v1/chat/completions", {"messages": []})
  assert status == 400 and answer["error"]["param"] == "messages"
  status, answer = seq2seq.get("/v1/nothing")
  assert status == 404 and "error" in answer


def test_sigterm_answers_the_request_in_flight_and_exits_0(seq2seq):
  # This module's server has logged earlier requests: wait for this one's line.
  received = lambda: seq2seq.process.output()[1].count("Received request")
  before = received()
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    pending = pool.submit(seq2seq.post, "/v1/completions",
                          {"prompt": TEXTS, "max_tokens": 28, "n": 8, "temperature": 1})
    cli.wait_for(lambda: received() > before, seq2seq.process)
    code, _, stderr = cli.stop(seq2seq.process, signal.SIGTERM)
    status, answer = pending.result()
  assert code == 0, stderr[-3000:]
  assert status == 200 and len(answer["choices"]) == 32, answer
  assert seq2seq.get("/health")[0] is None  # no longer listening


def test_decoder_only_raw_and_chat_equal_predict_greedy_and_need_the_key(llama):
  """Also: the server answered once its smallest shape compiled, the rest compiling behind
  it, into the --compilation_cache folder (a second start reads them there)."""
  folder, server = llama
  assert any(server.compilation_cache.iterdir())
  raw = predict.Predictor.from_pretrained(folder, _pretrained_config())
  expected = raw.predict(TEXTS, method="greedy", max_decode_len=10)
  name = server.name
  answer = server.client.completions.create(model=name, prompt=TEXTS, max_tokens=10,
                                            temperature=0)
  assert [c.text for c in answer.choices] == expected
  chat = predict.Predictor.from_pretrained(folder, _pretrained_config(prompt_format="chat"))
  expected = chat.predict(TEXTS[:2], method="greedy", max_decode_len=10)
  for text, reply in zip(TEXTS, expected):
    answer = server.client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": text}], max_tokens=10, temperature=0)
    assert answer.choices[0].message.content == reply
  # The chat template's prompt is longer than the raw text's.
  assert answer.usage.prompt_tokens > len(raw.tokenizer.encode(TEXTS[1]))
  status, error = server.post("/v1/completions", {"prompt": "a"})
  assert status == 401 and error["error"]["code"] == "invalid_api_key"
  status, _ = server.post("/v1/completions", {"prompt": "a", "max_tokens": 2},
                          {"Authorization": "Bearer secret"})
  assert status == 200
  assert server.get("/health")[0] == 200  # open without the key
  # Stop strings end the text before them.
  long = server.client.completions.create(model=name, prompt=TEXTS[0], max_tokens=10,
                                          temperature=0).choices[0]
  stop = long.text[3:6]
  cut = server.client.completions.create(model=name, prompt=TEXTS[0], max_tokens=10,
                                         temperature=0, stop=[stop]).choices[0]
  assert cut.text == long.text[:long.text.index(stop)] and cut.finish_reason == "stop"
  # No line per request by default; a stats line (every 0.001 s here) once rows are answered.
  log = server.process.output()[1]
  assert "rows answered" in log and "tokens generated" in log
  assert "Received request" not in log and "POST /v1/completions" not in log


def test_prompt_logprobs_as_an_evaluation_harness_reads_them(llama):
  """lm-evaluation-harness's log-likelihood requests (local-completions): token-id prompts of
  context + continuation, echo, max_tokens 1, logprobs 1. Each prompt token's log-probability
  is the one transformers gives on the same folder (within 1e-4), the first None; a token is
  greedy where the harness reads it so (its log-probability the top one's) exactly where
  transformers' argmax is that token."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  folder, server = llama
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
  requests = [tokenizer(t)["input_ids"] for t in ("two dogs run in the park",
                                                  "a man is riding a bike")]
  with torch.no_grad():  # a continuation the model itself would choose: greedy positions
    requests[1] = model.generate(torch.tensor([requests[1]]), do_sample=False,
                                 max_new_tokens=4)[0].tolist()
  answer = server.client.completions.create(model=server.name, prompt=requests, echo=True,
                                            max_tokens=1, logprobs=1, temperature=0)
  greedy_seen = set()
  for ids, choice in zip(requests, answer.choices):
    with torch.no_grad():
      expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1).numpy()
    got = choice.logprobs
    assert len(got.tokens) == len(ids) + 1  # the prompt, then the one generated token
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    want = [expected[t - 1, ids[t]] for t in range(1, len(ids))]
    np.testing.assert_allclose(got.token_logprobs[1:len(ids)], want, atol=1e-4)
    for t in range(1, len(ids)):
      top = got.top_logprobs[t]
      assert len(top) == 1
      is_greedy = got.token_logprobs[t] == max(top.values())
      assert is_greedy == (expected[t - 1].argmax() == ids[t])
      greedy_seen.add(is_greedy)
    assert choice.text.startswith(tokenizer.decode(ids, skip_special_tokens=True))
  assert greedy_seen == {True, False}  # both kinds of position were checked
  # max_tokens 0: the prompt alone.
  alone = server.client.completions.create(model=server.name, prompt=requests[0], echo=True,
                                           max_tokens=0, logprobs=0).choices[0]
  assert len(alone.logprobs.tokens) == len(requests[0]) and alone.logprobs.top_logprobs is None
  # Chat: the k most likely tokens at each generated position, the chosen (greedy) first.
  chat = server.client.chat.completions.create(
      model=server.name, messages=[{"role": "user", "content": "two dogs"}], max_tokens=4,
      temperature=0, logprobs=True, top_logprobs=3).choices[0].logprobs.content
  assert len(chat) == 4
  for entry in chat:
    assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
    assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-4
  for body, param in [({"prompt": "a", "echo": True, "n": 2, "logprobs": 1}, "n"),
                      ({"prompt": "a", "logprobs": 1, "stream": True}, "stream")]:
    status, error = server.post("/v1/completions", body, {"Authorization": "Bearer secret"})
    assert status == 400 and error["error"]["param"] == param, error


def test_sampling_extras_equal_transformers(llama):
  """Greedy outputs under logit_bias equal transformers' generate with the same biases as
  one-token `sequence_bias`; under OpenAI's presence and frequency penalties (which
  transformers lacks), its logits at each step less frequency x count - presence x seen, over
  the tokens generated so far; under min_tokens, generate's min_new_tokens; under
  repetition_penalty, generate's. Token ids are the checkpoint's own."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  folder, server = llama
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
  prompt = tokenizer(TEXTS[0])["input_ids"]

  def served(**kwargs):
    choice = server.client.completions.create(model=server.name, prompt=prompt, max_tokens=10,
                                              temperature=0, logprobs=0, **kwargs).choices[0]
    return tokenizer.convert_tokens_to_ids(choice.logprobs.tokens)

  def transformers_greedy(bias, presence=0.0, frequency=0.0):
    output = []
    with torch.no_grad():
      while len(output) < 10 and tokenizer.eos_token_id not in output:
        logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(output, dtype=torch.long),
                                minlength=logits.shape[0]).float()
        logits = logits - frequency * counts - presence * (counts > 0).float()
        for token, value in bias.items():
          logits[token] += value
        output.append(int(logits.argmax()))
    return output

  plain = served()
  with torch.no_grad():
    generated = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10,
                               sequence_bias={(plain[1],): 3.0, (plain[0],): -1.0})
  biased = served(logit_bias={str(plain[1]): 3.0, str(plain[0]): -1.0})
  assert biased == generated[0, len(prompt):].tolist() != plain
  # Negative penalties favour tokens already out (a random model's greedy output has no
  # repeats to discourage); positive ones with a bias that would repeat its token.
  for kwargs, bias in [(dict(presence_penalty=-1.0, frequency_penalty=-1.5), {}),
                       (dict(presence_penalty=0.5, frequency_penalty=1.0), {plain[6]: 2.5})]:
    got = served(logit_bias={str(k): v for k, v in bias.items()}, **kwargs)
    assert got == transformers_greedy(bias, kwargs["presence_penalty"],
                                      kwargs["frequency_penalty"]) != plain
  # vLLM's min_tokens as transformers' min_new_tokens, where a bias makes EOS the favourite;
  # ignore_eos: no EOS before max_tokens.
  end = tokenizer.eos_token_id
  assert served(logit_bias={str(end): 50.0}) == [end]
  with torch.no_grad():
    generated = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10,
                               min_new_tokens=4, sequence_bias={(end,): 50.0})
  got = served(logit_bias={str(end): 50.0}, extra_body={"min_tokens": 4})
  assert got == generated[0, len(prompt):].tolist() and len(got) == 5
  got = served(logit_bias={str(end): 50.0}, extra_body={"ignore_eos": True})
  assert len(got) == 10 and end not in got
  # vLLM's repetition_penalty as transformers', which counts the prompt's tokens too.
  held = hf_fixtures.prompt_holding_its_continuation(model, tokenizer.bos_token_id)
  with torch.no_grad():
    generated = model.generate(torch.tensor([held]), do_sample=False, max_new_tokens=10,
                               repetition_penalty=2.0)[0, len(held):].tolist()
  choice = server.client.completions.create(
      model=server.name, prompt=held, max_tokens=10, temperature=0, logprobs=0,
      extra_body={"repetition_penalty": 2.0}).choices[0]
  assert tokenizer.convert_tokens_to_ids(choice.logprobs.tokens) == generated


def test_streams_send_text_while_the_batch_decodes(llama):
  # serve.stream_steps=4 (the default): a 16-token output's text comes in up to 4 pieces (5
  # where the last characters wait for the end), one per decoded segment, not all at the end
  # nor one per token; with a stop string too, the pieces add up to the non-streamed text.
  _, server = llama
  kwargs = dict(model=server.name, prompt=TEXTS[0], max_tokens=16, temperature=0)
  whole = server.client.completions.create(**kwargs).choices[0]
  assert whole.finish_reason == "length"
  for stop in ([], [whole.text[-4:-2]]):
    expected = server.client.completions.create(**kwargs, stop=stop).choices[0]
    pieces, finish = [], None
    for chunk in server.client.completions.create(**kwargs, stop=stop, stream=True):
      pieces += [c.text for c in chunk.choices if c.text]
      finish = [c.finish_reason for c in chunk.choices if c.finish_reason] or finish
    assert "".join(pieces) == expected.text
    assert finish == [expected.finish_reason]
    if not stop:
      assert 1 < len(pieces) <= 5, pieces


def test_classifier_answers_classifications_with_predict_probabilities(tmp_path):
  folder = hf_fixtures.tiny_model("bert", str(tmp_path / "bert"))
  server = Server("--pretrained", folder, "--config.max_source_length=16")
  cli.STARTED.append(server.process)  # stopped after this test
  predictor = predict.Predictor.from_pretrained(folder)
  expected = predictor.predict_nbest(TEXTS, predictor.config.model.num_classes)
  status, answer = server.post("/v1/classifications", {"input": TEXTS})
  assert status == 200, answer
  for row, outputs in zip(answer["data"], expected):
    assert row["label"] == outputs[0][0]
    assert row["probabilities"] == pytest.approx(
        {name: math.exp(score) for name, score in outputs}, abs=1e-6)
  assert answer["usage"]["prompt_tokens"] > len(TEXTS)
  status, answer = server.post("/v1/completions", {"prompt": "a"})
  assert status == 400 and "/v1/classifications" in answer["error"]["message"]


def test_bad_serve_flags_are_one_line_errors(workdir):
  result = cli.run_main("--mode", "serve", "--workdir", workdir, "--port", "70000")
  assert result.returncode == 2
  assert re.search("port=70000", cli.user_error(result.stderr))
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = str(taken.getsockname()[1])
    result = cli.run_main("--mode", "serve", "--workdir", workdir, "--port", port)
  assert result.returncode == 1
  assert "Cannot listen on 127.0.0.1" in cli.user_error(result.stderr)
