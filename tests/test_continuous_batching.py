"""Continuous batching in `--mode serve` (issue #58), in process: a pool of row slots where
rows of very different lengths finish and waiting rows take their slots between segments
gives every row exactly the output it gets decoded alone (greedy ids; sampled ids with a seed;
both sequence families), and a short request that arrives while a long one decodes finishes
first."""

import concurrent.futures
import json
import subprocess
import sys
import threading

import numpy as np
import pytest

from tests import cli
from tests import hf_fixtures
from tests.conftest import ROOT
from tests.test_serving_stream import _one_call
from transformer_jax import default_config
from transformer_jax import predict
from transformer_jax.serving import batch_decoder
from transformer_jax.serving import engine as engine_lib
from transformer_jax.serving import slot_pool

TEXTS = ["a man is riding a bike", "two dogs", "a woman walks in the snow", "people",
         "a child plays with a red ball in the park", "cats"]
MAX_TOKENS = [64, 1, 9, 33, 2, 17]


@pytest.fixture(scope="module", params=["llama", "bart"])
def decoder(request, tmp_path_factory):
  config = default_config.get_config()
  config.max_source_length, config.max_target_length = 16, 64
  folder = hf_fixtures.tiny_model(request.param, str(tmp_path_factory.mktemp(request.param)))
  predictor = predict.Predictor.from_pretrained(folder, config)
  return batch_decoder.BatchDecoder(predictor, 2, stream_steps=4)


def through_the_pool(pool, rows) -> dict:
  """Every row's output, the rows entering `pool`'s free slots in order as others finish:
  {index in rows: batch_decoder.Output}."""
  waiting, outputs = list(range(len(rows))), {}
  while waiting or pool.live():
    entering, waiting = waiting[:pool.free()], waiting[pool.free():]
    if entering:
      pool.admit([rows[i] for i in entering], entering)
    outputs.update(pool.advance())
  return outputs


# Some rows with OpenAI's penalties, a logit_bias, vLLM's min_tokens and repetition penalty:
# each row's own in the pool too.
PENALTIES = {0: dict(presence_penalty=-1.0, frequency_penalty=0.5),
             2: dict(repetition_penalty=1.8),
             3: dict(frequency_penalty=1.0, logit_bias={40: 3.0, 41: -2.0}),
             5: dict(min_tokens=5, logit_bias={1: 4.0})}  # EOS (id 1) favoured after 5


def _rows(decoder):
  """Greedy and sampled rows (seeded), max_tokens from 1 to 64."""
  predictor = decoder.predictor
  prompts = [np.asarray(predictor.family.prompt(predictor.tokenizer.encode(t))) for t in TEXTS]
  return [batch_decoder.Row(p, MAX_TOKENS[i], temperature=[0.0, 1.0][i % 2], top_k=0,
                            top_p=[1.0, 0.9][i % 2], seed=11, prompt_index=i,
                            **PENALTIES.get(i, {}))
          for i, p in enumerate(prompts)]


def test_rows_entering_free_slots_decode_as_each_alone(decoder):
  """Two slots for six rows: the four that wait enter as others finish, mid-decode."""
  pool = slot_pool.SlotPool(decoder)
  rows = _rows(decoder)
  waiting, outputs, entered = list(enumerate(rows)), {}, []
  while waiting or pool.live():
    count = min(pool.free(), len(waiting))
    if count:
      entered.append((len(outputs), [i for i, _ in waiting[:count]]))
      pool.admit([row for _, row in waiting[:count]], [i for i, _ in waiting[:count]])
      waiting = waiting[count:]
    for i, output in pool.advance():
      outputs[i] = output
  # Rows entered while others decoded (not only into an empty pool).
  assert any(done and len(new) == 1 for done, new in entered), entered
  for i, row in enumerate(rows):
    ids, logprobs = _one_call(decoder, [row])[0]
    np.testing.assert_array_equal(outputs[i].ids, ids)
    # float32 sums over caches of other lengths, 64 steps deep: last-bit differences.
    np.testing.assert_allclose(outputs[i].logprobs, logprobs, atol=5e-5)
    assert len(ids) == row.max_tokens or ids[-1] == 1  # its own limit, or its EOS


def _read_packed_as_each_alone(decoder, rows, shape):
  """`rows` entering an eight-slot pool at once, read packed in `shape` (prompt width, new
  rows, packed rows) once warm-up has compiled it: each row's output is its one-call
  decode's."""
  pool = slot_pool.SlotPool(batch_decoder.BatchDecoder(decoder.predictor, 8, stream_steps=8))
  for i, row in enumerate(rows):
    row.max_tokens, row.prompt_index = min(row.max_tokens, 12), i
  assert shape in pool.shapes() and pool.warm_up(shapes=[shape])
  pool.admit(rows, list(range(len(rows))))
  assert pool.packed_refills == 1
  outputs = {}
  while pool.live():
    outputs.update(pool.advance())
  for i, (ids, logprobs) in enumerate(_one_call(decoder, rows)):
    np.testing.assert_array_equal(outputs[i].ids, ids)
    np.testing.assert_allclose(outputs[i].logprobs, logprobs, atol=5e-5)
  return pool


def test_rows_entering_together_are_read_packed(decoder):
  """Eight rows entering an eight-slot pool at once: their prompts (3 to 12 tokens) are read
  packed into six rows (prompt_packing.py)."""
  _read_packed_as_each_alone(decoder, (_rows(decoder) + _rows(decoder))[:8], (16, 8, 6))


def test_a_few_rows_entering_are_read_side_by_side_in_one_row(decoder):
  """Three short prompts (a bucket of four rows of 8 tokens) are read side by side in one
  packed row of 16 tokens, half what they would read apart."""
  rows = [row for row in _rows(decoder) if decoder.prompt_bucket(len(row.prompt)) == 8][:3]
  assert len(rows) == 3 and sum(len(row.prompt) for row in rows) <= 16
  pool = _read_packed_as_each_alone(decoder, rows, (16, 4, 1))
  assert pool.packing(4, 8) == (16, 1)


def test_rows_left_in_high_slots_move_down_and_decode_as_each_alone(decoder):
  """A four-slot pool whose first two rows end at once: the two left (one greedy, one
  sampled with a seed) move to slots 0 and 1, so that their segments run two slots, not
  four, and each output is still its one-call decode's."""
  pool = slot_pool.SlotPool(batch_decoder.BatchDecoder(decoder.predictor, 4, stream_steps=4))
  every = _rows(decoder)
  rows = [every[1], every[4], every[0], every[3]]  # 1, 2, 64 (greedy), 33 (sampled) tokens
  for i, row in enumerate(rows):
    row.max_tokens, row.prompt_index = min(row.max_tokens, 24), i
  assert pool.warm_up(shapes=pool.shapes()[:1]) and pool.moves_compiled
  pool.admit(rows, list(range(4)))
  outputs = {}
  while pool.live():
    outputs.update(pool.advance())
  assert pool.moves == 1
  for i, (ids, logprobs) in enumerate(_one_call(decoder, rows)):
    np.testing.assert_array_equal(outputs[i].ids, ids)
    np.testing.assert_allclose(outputs[i].logprobs, logprobs, atol=5e-5)


_MOVE_SCRIPT = r"""
import copy, json, os, sys
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
sys.path.insert(0, sys.argv[1])
import numpy as np
from tests import cli
from tests import hf_fixtures
from tests.test_continuous_batching import _rows
from tests.test_serving_stream import _one_call
from transformer_jax import default_config, predict
from transformer_jax.serving import batch_decoder, slot_pool

folder = hf_fixtures.tiny_model("llama", sys.argv[2])
results = {}
for mode in ("pmap", "jit"):
  config = default_config.get_config()
  config.max_source_length, config.max_target_length = 16, 64
  config.parallel.update(mode=mode, data=2, fsdp=2, tensor=1)
  decoder = batch_decoder.BatchDecoder(predict.Predictor.from_pretrained(folder, config), 8,
                                       stream_steps=4)
  pool = slot_pool.SlotPool(decoder)
  every = _rows(decoder)
  # Under pmap each device holds two slots: a short row, then a long one.
  rows = [copy.copy(every[i]) for i in (1, 0, 4, 3, 1, 2, 4, 5)]
  for i, row in enumerate(rows):
    row.max_tokens, row.prompt_index = min(row.max_tokens, 24), i
  pool.warm_up(shapes=pool.shapes()[:1])
  pool.admit(rows, list(range(8)))
  outputs = {}
  while pool.live():
    outputs.update(pool.advance())
  results[mode] = {"moves": pool.moves, "same": all(
      np.array_equal(outputs[i].ids, ids) for i, (ids, _) in enumerate(_one_call(decoder, rows)))}
print(json.dumps(results))
"""


def test_rows_move_down_under_pmap_and_the_mesh(tmp_path):
  """The same on four devices: under pmap (two slots per device, each moving within its
  own) and over a 2 x 2 data x fsdp mesh (one program), outputs equal one-call decoding."""
  result = subprocess.run([sys.executable, "-c", _MOVE_SCRIPT, ROOT, str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=cli.env(), check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  results = json.loads(result.stdout.splitlines()[-1])
  assert results == {"pmap": {"moves": 1, "same": True}, "jit": {"moves": 1, "same": True}}


def test_a_short_request_arriving_mid_decode_finishes_first(decoder):
  pool = slot_pool.SlotPool(decoder)
  engine = engine_lib.Engine(decoder, max_wait_ms=0, max_queue=8, pool=pool)
  try:
    long_row, short_row = _rows(decoder)[0], _rows(decoder)[1]
    long_row.temperature = 0.0
    started = threading.Event()
    long_row.on_tokens = lambda ids, logprobs: started.set()
    finished = []
    long_future, = engine.submit([long_row])
    long_future.add_done_callback(lambda _: finished.append("long"))
    assert started.wait(120)  # the long row is decoding
    short_future, = engine.submit([short_row])
    short_future.add_done_callback(lambda _: finished.append("short"))
    concurrent.futures.wait([long_future, short_future], timeout=300)
    assert finished == ["short", "long"]
    assert len(long_future.result().ids) == 64 or long_future.result().ids[-1] == 1
    np.testing.assert_array_equal(short_future.result().ids,
                                  _one_call(decoder, [short_row])[0][0])
  finally:
    engine.close()


def test_a_row_arriving_while_the_pool_decodes_enters_without_waiting_for_more(decoder):
  """serve.max_wait_ms gathers a burst only into an idle pool: while rows decode, a row that
  waits enters at the next segment even where more slots are free (the device would wait)."""
  wide = batch_decoder.BatchDecoder(decoder.predictor, 4, stream_steps=4)
  engine = engine_lib.Engine(wide, max_wait_ms=0, max_queue=8, pool=slot_pool.SlotPool(wide))
  try:
    long_row, short_row = _rows(decoder)[0], _rows(decoder)[4]
    started = threading.Event()
    long_row.on_tokens = lambda ids, logprobs: started.set()
    long_future, = engine.submit([long_row])
    assert started.wait(120)  # decoding, three slots free
    engine.max_wait = 3600.0  # a wait for more rows would outlast the test
    short_future, = engine.submit([short_row])
    assert concurrent.futures.wait([short_future], timeout=120).done
    assert not long_future.done()
  finally:
    engine.max_wait = 0.0
    engine.close()


def test_repetition_penalty_counts_a_decoder_only_prompt_as_transformers_does(tmp_path):
  """transformers' repetition penalty counts a decoder-only model's whole input ids, the
  prompt's too: one-call decoding, static segments and the pool give its greedy ids, for a
  prompt that holds the token greedy search would pick next without the penalty; a row's own
  penalty (a request's) replaces the config's."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  folder = hf_fixtures.tiny_model("llama", str(tmp_path / "llama"))
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
  ids = hf_fixtures.prompt_holding_its_continuation(
      model, transformers.AutoTokenizer.from_pretrained(folder).bos_token_id)
  with torch.no_grad():
    generate = lambda **kwargs: model.generate(torch.tensor([ids]), do_sample=False,
                                               max_new_tokens=6, **kwargs)[0, 9:].tolist()
    expected, plain = generate(repetition_penalty=2.0), generate()
  assert expected != plain
  config = default_config.get_config()
  config.max_source_length, config.max_target_length = 16, 8
  config.decoding.repetition_penalty = 2.0
  predictor = predict.Predictor.from_pretrained(folder, config)
  to_hf = predictor.tokenizer.to_hf
  prompt = np.asarray(predictor.family.prompt(predictor.tokenizer.to_internal(ids)))
  one_call = predictor.output_ids([prompt], 1, predictor.decoding_config(
      method="greedy", max_decode_len=6))[0]
  assert to_hf(one_call[:6]) == expected
  decoder = batch_decoder.BatchDecoder(predictor, 2, stream_steps=4)
  row = batch_decoder.Row(prompt, 6)
  assert to_hf(decoder.decode([row])[0].ids) == expected
  pool = slot_pool.SlotPool(decoder)
  unpenalised = batch_decoder.Row(prompt, 6, repetition_penalty=1.0)
  outputs = through_the_pool(pool, [row, unpenalised, row])
  assert to_hf(outputs[2].ids) == expected and to_hf(outputs[1].ids) == plain
