"""Decoding on fake models whose next-token logits depend on the whole prefix, against numpy
references: exhaustive search, a step-by-step 2 x beam search, greedy search, rescoring."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.inference import decoding

EOS, BOS = 1, 2


# ---- A fake model and numpy references ------------------------------------------------------

def _code(prefix, vocab):
  """A distinct integer for every output prefix (0 = empty)."""
  code = 0
  for token in prefix:
    code = code * (vocab + 1) + token + 1
  return code


def _random_tables(seed, batch, vocab, length):
  """[batch, codes, vocab] logits: one random vector per example and output prefix."""
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(batch, (vocab + 1) ** (length - 1), vocab)) * 2.0).astype(np.float32)


def _prefix_model(tables):
  """tokens_to_logits returning tables[example, code of its output so far]; the cache holds
  each row's code and example, so beam search reorders them with the rows."""
  tables = jnp.asarray(tables)
  batch, _, vocab = tables.shape
  cache = {"index": jnp.array(0), "code": jnp.zeros((batch,), jnp.int32),
           "example": jnp.arange(batch)}

  def tokens_to_logits(ids, cache):
    # The first call is fed BOS: the output so far is empty.
    code = jnp.where(cache["index"] == 0, 0, cache["code"] * (vocab + 1) + ids[:, 0] + 1)
    logits = tables[cache["example"], code]  # [rows, vocab]
    return logits, {"index": cache["index"] + 1, "code": code, "example": cache["example"]}

  return cache, tokens_to_logits


def _log_softmax(x):
  x = np.asarray(x, np.float64)
  return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(
      -1, keepdims=True))


def _penalty(length, alpha, kind="gnmt"):
  return (length if kind == "hf" else (5 + length) / 6) ** alpha


def _logprob(table, seq, forced=0):
  """log P(seq) under one example's table; the first `forced` tokens are free."""
  vocab = table.shape[-1]
  return sum(_log_softmax(table[_code(seq[:i], vocab)])[t] for i, t in enumerate(seq)
             if i >= forced)


def _exhaustive(table, alpha, length, kind="gnmt"):
  """Every output: those ending in EOS best first, then those of `length` tokens without EOS
  best first, as (tokens, score)."""
  vocab = table.shape[-1]
  logp = _log_softmax(table)  # [codes, vocab]
  finished, live = [], []
  for n in range(1, length + 1):
    for seq in itertools.product(range(vocab), repeat=n):
      if EOS in seq[:-1] or (seq[-1] != EOS and n < length):
        continue
      score = sum(logp[_code(seq[:i], vocab), t] for i, t in enumerate(seq)) / _penalty(
          n, alpha, kind)
      (finished if seq[-1] == EOS else live).append((seq, score))
  by_score = lambda hyps: sorted(hyps, key=lambda h: -h[1])
  return by_score(finished) + by_score(live)


def _reference_beam(table, beam, alpha, length, prompt=(), kind="gnmt", process=None):
  """The 2 x beam algorithm, one example, step by step: the 2 * beam best extensions of the
  live hypotheses; those ending in EOS (outside the prompt) compete for `beam` finished slots,
  the `beam` best others stay live; free finished slots take the live ones at the end.
  `process(seq, logits)` changes the logits after `seq`; impossible extensions are dropped."""
  vocab = table.shape[-1]
  process = process or (lambda seq, logits: logits)
  live, finished = [((), 0.0)], []
  for step in range(length):
    if step < len(prompt):
      candidates = [(seq + (prompt[step],), logprob) for seq, logprob in live]
      ends = lambda seq: False
    else:
      candidates = [(seq + (t,), logprob + _log_softmax(process(seq, table[_code(seq, vocab)]))[t])
                    for seq, logprob in live for t in range(vocab)]
      ends = lambda seq: seq[-1] == EOS
    candidates = sorted(candidates, key=lambda h: -h[1])[:2 * beam]
    candidates = [h for h in candidates if h[1] > decoding.NEG_INF / 2]
    finished += [(seq, logprob / _penalty(step + 1, alpha, kind)) for seq, logprob in candidates
                 if ends(seq)]
    finished = sorted(finished, key=lambda h: -h[1])[:beam]
    live = [h for h in candidates if not ends(h[0])][:beam]
  return (finished + [(seq, logprob / _penalty(length, alpha, kind))
                      for seq, logprob in live])[:beam]


def _assert_hypotheses(sequences, scores, expected):
  """[beam, length] tokens and [beam] scores == (tokens, score) list, zeros / NEG_INF after."""
  sequences, scores = np.asarray(sequences), np.asarray(scores)
  want = np.zeros_like(sequences)
  for i, (seq, _) in enumerate(expected):
    want[i, :len(seq)] = seq
  want_scores = [s for _, s in expected] + [decoding.NEG_INF] * (len(scores) - len(expected))
  np.testing.assert_array_equal(sequences, want)
  np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-5)


def _fixed_tables(logits, length):
  """The tables [1, codes, vocab] of a model giving `logits` [vocab] after every prefix."""
  logits = np.asarray(logits, np.float32)
  return np.tile(logits, ((len(logits) + 1) ** (length - 1), 1))[None]


# Compiled once per shape and static setting, and shared by the tests.
@functools.partial(jax.jit, static_argnames=("beam_size", "max_len", "processor", "kind"))
def _beam(tables, alpha, prompt=None, *, beam_size, max_len, processor=None, kind="gnmt"):
  cache, tokens_to_logits = _prefix_model(tables)
  return decoding.beam_search(jnp.zeros((tables.shape[0], 1), jnp.int32), cache,
                              tokens_to_logits, beam_size=beam_size, alpha=alpha, eos_id=EOS,
                              max_decode_len=max_len, bos_id=BOS, decoder_prompt=prompt,
                              logits_processor=processor, length_penalty_kind=kind)


@functools.partial(jax.jit, static_argnames=("max_len", "processor"))
def _greedy(tables, prompt=None, *, max_len, processor=None):
  cache, tokens_to_logits = _prefix_model(tables)
  return decoding.greedy_search(cache, tokens_to_logits, batch_size=tables.shape[0], bos_id=BOS,
                                eos_id=EOS, max_decode_len=max_len, return_logprobs=True,
                                decoder_prompt=prompt, logits_processor=processor)


_sample_traces = []  # one entry per compilation of _sample


@functools.partial(jax.jit, static_argnames=("max_len", "top_k", "num_decodes", "processor"))
def _sample(tables, rng, temperature=1.0, top_p=1.0, prompt=None, *, max_len, top_k=0,
            num_decodes=None, processor=None):
  _sample_traces.append(1)
  cache, tokens_to_logits = _prefix_model(tables)
  return decoding.sample(cache, tokens_to_logits, rng, batch_size=tables.shape[0], bos_id=BOS,
                         eos_id=EOS, max_decode_len=max_len, temperature=temperature,
                         top_k=top_k, top_p=top_p, return_logprobs=True,
                         num_decodes=num_decodes, decoder_prompt=prompt,
                         logits_processor=processor)


# ---- Beam search ----------------------------------------------------------------------------

def test_keeps_the_hypothesis_that_ended_first():
  # The case: a top-beam search keeps only [3 ...] and returns [3, 3, 3, 3] (-2.473);
  # EOS at once is better.
  logits = np.array([-1e7, -1.0, -0.9, -0.1, -1e7, -1e7, -1e7, -1e7])
  sequences, scores = _beam(_fixed_tables(logits, 4), 0.0, beam_size=2, max_len=4)
  logp = _log_softmax(logits)
  np.testing.assert_array_equal(sequences[0], [[1, 0, 0, 0], [3, 1, 0, 0]])
  np.testing.assert_allclose(scores[0], [logp[1], logp[3] + logp[1]], rtol=1e-6)
  assert round(float(scores[0, 0]), 3) == -1.518
  # With EOS out of reach, live hypotheses of max_decode_len tokens fill the slots.
  logits[EOS] = -1e7
  sequences, scores = _beam(_fixed_tables(logits, 4), 0.0, beam_size=2, max_len=4)
  logp = _log_softmax(logits)
  np.testing.assert_array_equal(sequences[0, 0], [3, 3, 3, 3])
  np.testing.assert_allclose(scores[0], [4 * logp[3], 3 * logp[3] + logp[2]], rtol=1e-6)
  # max_decode_len defaults to the source length + 50.
  shapes = jax.eval_shape(lambda: decoding.beam_search(
      jnp.ones((1, 3), jnp.int32), {}, lambda ids, c: (jnp.zeros((ids.shape[0], 8)), c),
      beam_size=2, alpha=0.0, eos_id=EOS))
  assert shapes[0].shape == (1, 2, 53)


@pytest.mark.parametrize("alpha", [0.0, 0.6])
@pytest.mark.parametrize("vocab,length", [(3, 4), (6, 4)])
def test_beam_as_wide_as_every_output_ranks_them_all(vocab, length, alpha):
  tables = _random_tables(vocab + length, 2, vocab, length)
  expected = [_exhaustive(table, alpha, length) for table in tables]
  beam = len(expected[0])  # every output: (vocab-1)^(n-1) ending in EOS at n, (vocab-1)^length not
  sequences, scores = _beam(tables, alpha, beam_size=beam, max_len=length)
  for example in range(2):
    _assert_hypotheses(sequences[example], scores[example], expected[example])


@pytest.mark.parametrize("beam", [1, 2, 3, 4])
def test_equals_step_by_step_reference(beam):
  vocab, length = 4, 5
  tables = _random_tables(beam, 8, vocab, length)
  for alpha in [0.0, 0.6]:
    sequences, scores = _beam(tables, alpha, beam_size=beam, max_len=length)
    for example, table in enumerate(tables):
      _assert_hypotheses(sequences[example], scores[example],
                         _reference_beam(table, beam, alpha, length))


@pytest.mark.parametrize("beam", [1, 3])
def test_forced_prompt_equals_reference(beam):
  vocab, length = 5, 4
  tables = _random_tables(beam, 5, vocab, length)
  # A forced EOS does not end the output; a prompt ends at its first 0.
  prompt = np.array([[4, 1], [1, 0], [0, 0], [3, 0], [0, 2]], np.int32)
  sequences, scores = _beam(tables, 0.6, jnp.asarray(prompt), beam_size=beam, max_len=length)
  for example, table in enumerate(tables):
    forced = tuple(itertools.takewhile(lambda t: t != 0, prompt[example]))
    _assert_hypotheses(sequences[example], scores[example],
                       _reference_beam(table, beam, 0.6, length, forced))


def test_stops_once_no_live_hypothesis_can_win():
  steps = []

  def tokens_to_logits(ids, cache):
    jax.debug.callback(steps.append, cache["index"])
    logits = jnp.array([-9.0, 0.0, -5.0, -6.0])  # EOS likely: both slots finish at steps 1, 2
    return jnp.tile(logits, (ids.shape[0], 1)), {"index": cache["index"] + 1}

  sequences, _ = jax.jit(lambda: decoding.beam_search(
      jnp.ones((1, 3), jnp.int32), {"index": jnp.array(0)}, tokens_to_logits, beam_size=2,
      alpha=0.6, eos_id=EOS, max_decode_len=10))()
  jax.effects_barrier()
  np.testing.assert_array_equal(sequences[0, :, :3], [[1, 0, 0], [2, 1, 0]])
  assert len(steps) == 2


def test_beam_size_one_keeps_an_ending_hypothesis_greedy_search_passes():
  # Greedy takes 2 (-0.47), then its best, EOS (-1.09): -1.57 in all. Beam 1 also keeps the
  # second-best extension of the first step, EOS (-0.97), and that is better.
  table = np.full((25, 4), -30.0, np.float32)  # (vocab + 1) ** (length - 1) prefixes
  table[0, [1, 2]] = [-0.5, 0.0]  # empty output: EOS or 2
  table[_code((2,), 4), 1:] = [0.0, -0.01, -0.01]  # after 2: EOS, narrowly
  greedy, greedy_logprob = _greedy(table[None], max_len=3)
  sequences, scores = _beam(table[None], 0.0, beam_size=1, max_len=3)
  np.testing.assert_array_equal(greedy[0], [2, 1, 0])
  np.testing.assert_array_equal(sequences[0, 0], [1, 0, 0])
  np.testing.assert_allclose(scores[0, 0], _logprob(table, (1,)), rtol=1e-5)
  assert scores[0, 0] > greedy_logprob[0]


# ---- Greedy search --------------------------------------------------------------------------

def test_greedy_with_prompt_equals_reference():
  vocab, length = 5, 5
  tables = _random_tables(3, 4, vocab, length)
  prompt = np.array([[3, 1, 4], [1, 0, 0], [0, 0, 0], [2, 2, 2]], np.int32)
  tokens, logprobs = _greedy(tables, prompt, max_len=length)
  for example, table in enumerate(tables):
    seq = list(itertools.takewhile(lambda t: t != 0, prompt[example]))
    forced = len(seq)
    while len(seq) < length and (len(seq) == forced or seq[-1] != EOS):
      seq.append(int(np.argmax(table[_code(seq, vocab)])))
    np.testing.assert_array_equal(tokens[example], seq + [0] * (length - len(seq)))
    np.testing.assert_allclose(logprobs[example], _logprob(table, seq, forced), rtol=1e-5)


# ---- Sampling -------------------------------------------------------------------------------

def test_zero_temperature_and_top_k_one_equal_greedy():
  tables = _random_tables(4, 4, 8, 3)
  greedy, _ = _greedy(tables, max_len=3)
  rng = jax.random.PRNGKey(7)
  np.testing.assert_array_equal(_sample(tables, rng, 1.5, top_k=1, max_len=3)[0], greedy)
  for temperature, top_p in [(0.0, 1.0), (1e-6, 1.0), (0.0, 0.5)]:
    np.testing.assert_array_equal(_sample(tables, rng, temperature, top_p, max_len=3)[0], greedy)


def test_temperature_and_top_p_are_traced():
  tables = _random_tables(5, 4, 8, 3)
  greedy, _ = _greedy(tables, max_len=3)
  rng = jax.random.PRNGKey(0)
  hot, _ = _sample(tables, rng, 5.0, 1.0, max_len=3)
  compilations = len(_sample_traces)
  np.testing.assert_array_equal(_sample(tables, rng, 0.0, 1.0, max_len=3)[0], greedy)
  np.testing.assert_array_equal(_sample(tables, rng, 5.0, 1e-6, max_len=3)[0], greedy)
  assert not np.array_equal(hot, greedy)
  assert len(_sample_traces) == compilations


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.5, 1.0, 0),
                                                    (1.0, 0.75, 0), (2.0, 1.0, 2)])
def test_samples_follow_the_filtered_distribution(temperature, top_p, top_k):
  probs = np.array([0.1, 0.05, 0.4, 0.3, 0.15])
  n = 4000
  tokens, _ = _sample(_fixed_tables(np.log(probs), 1), jax.random.PRNGKey(3), temperature,
                      top_p, max_len=1, top_k=top_k, num_decodes=n)
  expected = probs ** (1 / temperature)
  expected /= expected.sum()
  order = np.argsort(-expected)
  # Nucleus after temperature: the fewest most likely tokens holding top_p.
  kept = order[:min(np.searchsorted(np.cumsum(expected[order]), top_p - 1e-9) + 1,
                    top_k or len(probs))]
  expected = np.where(np.isin(np.arange(len(probs)), kept), expected, 0.0)
  expected /= expected.sum()
  counts = np.bincount(np.asarray(tokens).reshape(-1), minlength=len(probs)) / n
  np.testing.assert_allclose(counts, expected, atol=0.035)
  assert np.all(counts[expected == 0] == 0)


def test_categorical_inverts_the_cumulative_distribution_across_blocks():
  """600 tokens (three blocks of 256, the last padded), a third of them filtered out, some at
  block edges: u in (0, 1] maps to the first token whose cumulative probability reaches it,
  never to a filtered one; and draws follow softmax as jax.random.categorical's do."""
  rng = np.random.default_rng(0)
  logits = rng.normal(size=600).astype(np.float32)
  logits[rng.permutation(600)[:200]] = decoding.NEG_INF
  logits[[0, 255, 256, 511, 512, 599]] = decoding.NEG_INF
  probs = np.exp(logits - logits.max())
  probs /= probs.sum()
  cumulative = np.cumsum(probs.astype(np.float64))
  kept = np.flatnonzero(probs)
  middles = cumulative[kept] - probs[kept] / 2  # inside token k's share: k
  u = np.concatenate([middles, [1e-30, 1.0], rng.random(1000)])
  tokens = np.asarray(decoding._invert_cdf(jnp.tile(logits, (len(u), 1)),  # pylint: disable=protected-access
                                           jnp.asarray(u, jnp.float32)))
  assert (probs[tokens] > 0).all()
  np.testing.assert_array_equal(tokens[:len(kept)], kept)
  assert tokens[len(kept)] == kept[0] and tokens[len(kept) + 1] == kept[-1]
  # Elsewhere u lies in the drawn token's share, up to float32 sums.
  assert (cumulative[tokens] - probs[tokens] - 1e-5 <= u).all()
  assert (u <= cumulative[tokens] + 1e-5).all()
  keys = jax.random.split(jax.random.PRNGKey(0), 40000)
  small = np.log(np.array([0.1, 0.05, 0.4, 0.3, 0.15], np.float32))
  draws = np.asarray(jax.vmap(decoding.categorical, in_axes=(0, None))(keys, jnp.asarray(small)))
  np.testing.assert_allclose(np.bincount(draws, minlength=5) / len(draws), np.exp(small),
                             atol=0.01)


def test_num_decodes_with_prompt_returns_ranked_samples_and_their_logprobs():
  vocab, length, n = 6, 4, 5
  tables = _random_tables(6, 3, vocab, length)
  prompt = np.array([[3, 4], [5, 0], [0, 0]], np.int32)
  tokens, logprobs = _sample(tables, jax.random.PRNGKey(1), prompt=prompt, max_len=length,
                             num_decodes=n)
  assert tokens.shape == (3, n, length) and logprobs.shape == (3, n)
  assert np.all(np.diff(np.asarray(logprobs), axis=1) <= 0)  # most likely first
  for example, table in enumerate(tables):
    forced = list(itertools.takewhile(lambda t: t != 0, prompt[example]))
    assert len({tuple(row) for row in np.asarray(tokens[example])}) > 1  # independent samples
    for row, logprob in zip(np.asarray(tokens[example]), np.asarray(logprobs[example])):
      np.testing.assert_array_equal(row[:len(forced)], forced)
      end = next((i + 1 for i, t in enumerate(row) if t == EOS and i >= len(forced)), length)
      assert np.all(row[end:] == 0)
      np.testing.assert_allclose(logprob, _logprob(table, row[:end], len(forced)), rtol=1e-5)


@pytest.mark.parametrize("options", [dict(top_p=0.0), dict(top_p=-0.1), dict(top_p=1.5),
                                     dict(temperature=-0.5), dict(top_k=-1),
                                     dict(num_decodes=0)])
def test_sampling_refuses_bad_settings(options):
  with pytest.raises(ValueError, match=next(iter(options))):
    decoding.sample({}, lambda ids, cache: (jnp.zeros((ids.shape[0], 2)), cache),
                    jax.random.PRNGKey(0), batch_size=1,
                    bos_id=BOS, eos_id=EOS, max_decode_len=2, **options)


def test_fixed_seed_reproduces_samples():
  tables = _random_tables(7, 4, 8, 3)
  a, _ = _sample(tables, jax.random.PRNGKey(1), 1.0, 1.0, max_len=3)
  b, _ = _sample(tables, jax.random.PRNGKey(1), 1.0, 1.0, max_len=3)
  c, _ = _sample(tables, jax.random.PRNGKey(2), 1.0, 1.0, max_len=3)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


def test_per_row_settings_limits_and_token_logprobs_equal_each_row_alone():
  # A server's batch: each row its own temperature (0 = greedy), top_k, top_p, key and
  # longest output; each equals that row decoded alone with scalar settings, cut at its limit.
  vocab, length = 7, 4
  tables = _random_tables(9, 4, vocab, length)
  keys = jax.random.split(jax.random.PRNGKey(3), 4)
  settings = [(0.0, 0, 1.0, 4), (1.0, 3, 1.0, 2), (0.7, 0, 0.6, 4), (1.3, 2, 0.9, 3)]
  temperature, top_k, top_p, limits = (np.asarray(column) for column in zip(*settings))
  cache, tokens_to_logits = _prefix_model(tables)
  tokens, logprobs, token_logprobs = jax.jit(functools.partial(
      decoding.sample, tokens_to_logits=tokens_to_logits, batch_size=4, bos_id=BOS,
      eos_id=EOS, max_decode_len=length, return_logprobs=True, return_token_logprobs=True))(
          cache, rng=keys, temperature=temperature, top_k=top_k, top_p=top_p,
          row_limits=limits)
  for row, (t, k, p, limit) in enumerate(settings):
    alone, _ = _sample(tables[row:row + 1], keys[row:row + 1], t, p, max_len=length, top_k=k)
    expected = np.asarray(alone[0]).copy()
    expected[limit:] = 0
    np.testing.assert_array_equal(tokens[row], expected)
    end = next((i + 1 for i, x in enumerate(expected) if x == EOS), limit)
    np.testing.assert_allclose(token_logprobs[row, end:], 0.0)
    np.testing.assert_allclose(logprobs[row], _logprob(tables[row], expected[:end]), rtol=1e-5)
    np.testing.assert_allclose(np.sum(token_logprobs[row]), logprobs[row], rtol=1e-5)


def test_top_p_keeps_exactly_the_smallest_nucleus():
  probs = np.array([0.05, 0.4, 0.1, 0.3, 0.15])
  logits = jnp.log(jnp.asarray(probs))[None]
  # Sorted: 0.4, 0.3, 0.15, 0.1, 0.05. 0.4 + 0.3 = 0.7 < 0.75, so 0.15 is needed too.
  for top_p, want in [(0.75, [0, 1, 0, 1, 1]), (0.7, [0, 1, 0, 1, 0]), (0.3, [0, 1, 0, 0, 0]),
                      (1.0, [1, 1, 1, 1, 1])]:
    for value in (top_p, jnp.float32(top_p)):  # a traced-able array filters the same
      kept = decoding.filter_logits(logits, top_p=value)[0] > decoding.NEG_INF / 2
      np.testing.assert_array_equal(kept, np.array(want, bool))
    for shaped in (logits[0], logits[None]):  # one row alone, or rows in more axes
      kept = decoding.filter_logits(shaped, top_p=top_p) > decoding.NEG_INF / 2
      np.testing.assert_array_equal(kept.reshape(-1), np.array(want, bool))


def _kept_by_numpy(row, top_k, top_p):
  """The tokens a full sort keeps: the top_k best (0: all), then the smallest nucleus."""
  order = np.argsort(-row, kind="stable")
  kept = np.zeros(row.shape, bool)
  kept[order[:top_k or len(row)]] = True
  if top_p < 1:
    logits = np.where(kept, row, -np.inf)[order].astype(np.float64)
    probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    kept[order[(np.cumsum(probs) - probs) >= top_p]] = False
  return kept


def test_filters_over_candidates_or_the_whole_vocabulary_keep_the_same_tokens():
  """A peaked row's nucleus and top_k lie among the CANDIDATES best tokens, a flat row's past
  them (the full sort): each keeps what a full sort keeps, alone or beside the other."""
  vocab = 3 * decoding.CANDIDATES
  rng = np.random.default_rng(0)
  peaked = rng.normal(size=vocab).astype(np.float32) * 4
  flat = rng.normal(size=vocab).astype(np.float32) * 0.1
  cases = [(peaked, 0, 0.9), (flat, 0, 0.9), (peaked, 40, 1.0), (flat, vocab - 9, 1.0),
           (flat, 0, 1.0), (peaked, 300, 0.5)]
  for pair in [(0, 1), (0, 4), (2, 3), (4, 5), (1, 3)]:
    rows = [cases[i] for i in pair]
    logits = jnp.asarray(np.stack([r for r, _, _ in rows]))
    top_k = jnp.asarray([k for _, k, _ in rows])
    top_p = jnp.asarray([p for _, _, p in rows], jnp.float32)
    together = np.asarray(decoding.filter_logits(logits, top_k, top_p)) > decoding.NEG_INF / 2
    for i, (row, k, p) in enumerate(rows):
      alone = decoding.filter_logits(logits[i:i + 1], top_k[i:i + 1], top_p[i:i + 1])
      np.testing.assert_array_equal(np.asarray(alone[0]) > decoding.NEG_INF / 2, together[i])
      np.testing.assert_array_equal(together[i], _kept_by_numpy(row, k, p), err_msg=str(pair))
  # The flat row's nucleus holds most of the vocabulary: past the candidates.
  assert _kept_by_numpy(flat, 0, 0.9).sum() > decoding.CANDIDATES


def test_top_k_keeps_k_best():
  logits = jnp.array([[0.1, 3.0, -1.0, 2.0, 0.5]])
  kept = decoding.filter_logits(logits, top_k=2)[0] > decoding.NEG_INF / 2
  np.testing.assert_array_equal(kept, [False, True, False, True, False])


# ---- Logits processors ----------------------------------------------------------------------

def _greedy_fixed(logits, length, processor=None):
  """Greedy output [length] of a model giving `logits` at every step."""
  return np.asarray(_greedy(_fixed_tables(logits, length), max_len=length,
                            processor=processor)[0][0])


def _beams_fixed(logits, length, beam, processor=None):
  """Beam search outputs [beam, length] of a model giving `logits` at every step."""
  return np.asarray(_beam(_fixed_tables(logits, length), 0.6, beam_size=beam, max_len=length,
                          processor=processor)[0][0])


def test_min_length_bans_eos_before_it():
  logits = [-5.0, 0.0, -1.0, -2.0]  # EOS most likely
  assert list(_greedy_fixed(logits, 5)) == [1, 0, 0, 0, 0]
  processor = decoding.min_length_processor(2, EOS)
  assert list(_greedy_fixed(logits, 5, processor=processor)) == [2, 2, 1, 0, 0]
  for row in _beams_fixed(logits, 5, 3, processor=processor):
    assert EOS not in row[:2] and EOS in row


def test_banned_ids_are_never_generated():
  logits = [-5.0, -9.0, 0.0, -1.0, -2.0]
  processor = decoding.banned_ids_processor([2, 0])
  assert list(_greedy_fixed(logits, 3, processor=processor)) == [3, 3, 3]
  sequences = _beams_fixed(logits, 3, 4, processor=processor)
  assert not np.isin(sequences, [2]).any() and len({tuple(r) for r in sequences}) == 4


def test_repetition_penalty():
  processor = decoding.repetition_penalty_processor(2.0)
  logits = jnp.array([[2.0, -1.0, 3.0, 0.5, 1.0]])
  # Seen: 1 and 2 (0 is padding); positive logits are divided, negative ones multiplied.
  np.testing.assert_allclose(processor(logits, 2, jnp.array([[2, 1, 0, 0]])),
                             [[2.0, -2.0, 1.5, 0.5, 1.0]])
  peaked = [-9.0, -9.0, 2.0, 1.8, 1.2]
  assert list(_greedy_fixed(peaked, 3)) == [2, 2, 2]
  assert list(_greedy_fixed(peaked, 3, processor=processor)) == [2, 3, 4]
  # A decoder-only prompt's tokens count too, each input's over its consecutive rows (beams).
  prompted = decoding.repetition_penalty_processor(2.0, prompt=jnp.array([[4, 0], [3, 4]]))
  out = prompted(jnp.tile(logits, (4, 1)), 1, jnp.array([[2, 0]] * 4))
  np.testing.assert_allclose(out[:2], [[2.0, -1.0, 1.5, 0.5, 0.5]] * 2)
  np.testing.assert_allclose(out[2:], [[2.0, -1.0, 1.5, 0.25, 0.5]] * 2)


@pytest.mark.parametrize("per_row", [False, True])
def test_openai_penalties_count_each_rows_output_so_far(per_row):
  """OpenAI's formula per row: logit - frequency x count - presence x (count > 0) + bias, the
  count over the row's first `step` tokens (zeros after them are not id 0's); the whole batch
  at one step (static batches) or each row at its own (continuous batching)."""
  logits = np.random.default_rng(0).normal(size=(3, 12)).astype(np.float32)
  sequences = np.array([[5, 5, 7, 0, 0], [0, 2, 0, 4, 0], [9, 9, 9, 9, 9]], np.int32)
  step = np.array([3, 3, 5]) if per_row else np.array(3)
  presence, frequency = np.array([0.5, 0, 1], np.float32), np.array([1, 2, 0], np.float32)
  ids = np.full((3, 4), decoding.NO_TOKEN, np.int32)
  values = np.zeros((3, 4), np.float32)
  ids[1, :2], values[1, :2] = [11, 2], [50, -1.5]
  processor = jax.jit(decoding.openai_penalties_processor(presence, frequency, ids, values))
  expected = logits.copy()
  for row in range(3):
    counts = np.bincount(sequences[row, :np.broadcast_to(step, 3)[row]], minlength=12)
    expected[row] -= frequency[row] * counts + presence[row] * (counts > 0)
  expected[1, 11] += 50
  expected[1, 2] -= 1.5
  np.testing.assert_allclose(processor(logits, step, sequences), expected, rtol=1e-6)
  np.testing.assert_allclose(expected[1, 0], logits[1, 0] - 4)  # id 0 twice in row 1's output
  unset = decoding.openai_penalties_processor(
      np.zeros(3, np.float32), np.zeros(3, np.float32),
      np.full((3, 4), decoding.NO_TOKEN, np.int32), values)
  np.testing.assert_array_equal(unset(logits, step, sequences), logits)


def test_min_tokens_bans_the_end_below_each_rows_own_count():
  logits = jnp.zeros((3, 6))
  ends = decoding.min_tokens_processor(jnp.array([2, 0, 5]), EOS, end_ids=(4,))
  for step, banned_rows in [(jnp.array(1), [0, 2]), (jnp.array([2, 0, 4]), [2])]:
    out = np.asarray(ends(logits, step, jnp.zeros((3, 5), jnp.int32)))
    for row in range(3):
      expected = decoding.NEG_INF if row in banned_rows else 0.0
      assert out[row, EOS] == out[row, 4] == expected and (out[row, [0, 2, 3, 5]] == 0).all()


def test_processor_sees_the_step_and_the_output_so_far():
  def no_repeat_and_end_at_3(logits, step, sequences):
    previous = jax.lax.dynamic_index_in_dim(sequences, jnp.maximum(step - 1, 0), axis=1)
    vocab = jnp.arange(logits.shape[-1])
    logits = jnp.where((step > 0) & (vocab == previous), decoding.NEG_INF, logits)
    return jnp.where((step == 3) & (vocab != EOS), decoding.NEG_INF, logits)

  logits = [-9.0, -5.0, 0.0, -0.5, -3.0]
  assert list(_greedy_fixed(logits, 6, processor=no_repeat_and_end_at_3)) == [
      2, 3, 2, 1, 0, 0]
  for row in _beams_fixed(logits, 6, 3, processor=no_repeat_and_end_at_3):
    end = list(row).index(EOS)
    assert end <= 3 and np.all(row[1:end] != row[:end - 1]) and np.all(row[end + 1:] == 0)


def test_make_logits_processor():
  assert decoding.make_logits_processor(eos_id=EOS) is None
  processor = decoding.make_logits_processor(eos_id=EOS, min_length=1, banned_ids=(4,),
                                             repetition_penalty=2.0)
  logits = jnp.array([[1.0, 3.0, 2.0, -1.0, 5.0]])
  out = processor(logits, 0, jnp.zeros((1, 3), jnp.int32))
  np.testing.assert_allclose(out, [[1.0, decoding.NEG_INF, 2.0, -1.0, decoding.NEG_INF]])
  out = processor(logits, 2, jnp.array([[2, 3, 0]]))
  np.testing.assert_allclose(out, [[1.0, 3.0, 1.0, -2.0, decoding.NEG_INF]])


def test_processors_take_traced_settings():
  traces = []

  @jax.jit
  def run(min_length, penalty):
    traces.append(1)
    processor = decoding.chain_processors(decoding.min_length_processor(min_length, EOS),
                                          decoding.repetition_penalty_processor(penalty))
    cache, tokens_to_logits = _prefix_model(_fixed_tables([-9.0, 0.5, 1.0, 0.9], 4))
    return decoding.greedy_search(cache, tokens_to_logits, batch_size=1, bos_id=BOS, eos_id=EOS,
                                  max_decode_len=4, logits_processor=processor)[0]

  np.testing.assert_array_equal(run(0, 1.0), [2, 2, 2, 2])
  np.testing.assert_array_equal(run(1, 2.0), [2, 3, 1, 0])
  np.testing.assert_array_equal(run(3, 2.0), [2, 3, 2, 1])
  assert len(traces) == 1


@pytest.mark.parametrize("make", [lambda: decoding.min_length_processor(-1, EOS),
                                  lambda: decoding.banned_ids_processor([3, -2]),
                                  lambda: decoding.repetition_penalty_processor(0.0)])
def test_processors_refuse_bad_settings(make):
  with pytest.raises(ValueError):
    make()


# ---- Hugging Face generation settings: no-repeat n-grams, forced BOS / EOS, length penalty --

def _banned_ngram_ends(seq, n):
  """Hugging Face's NoRepeatNGramLogitsProcessor for one output `seq`: the tokens that would
  complete an n-gram already in it."""
  if len(seq) + 1 < n:
    return set()
  suffix = tuple(seq[len(seq) - n + 1:])
  return {ngram[-1] for ngram in zip(*[seq[i:] for i in range(n)]) if ngram[:-1] == suffix}


def _reference_process(seq, logits, length, ngram=0, bos=-1, eos=False):
  """numpy make_logits_processor(no_repeat_ngram_size, forced_bos_id, forced_eos) after
  output `seq` of at most `length` tokens."""
  logits = np.array(logits, np.float32)
  if ngram:
    logits[list(_banned_ngram_ends(list(seq), ngram))] = decoding.NEG_INF
  for token, at in ((bos, bos >= 0 and len(seq) == 0), (EOS, eos and len(seq) == length - 1)):
    if at:
      logits[:] = decoding.NEG_INF
      logits[token] = 0.0
  return logits


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_no_repeat_ngram_equals_reference(n):
  rng = np.random.default_rng(n)
  rows, length, vocab = 16, 9, 4  # a small vocabulary: many repeated n-grams
  outputs = rng.integers(1, vocab, size=(rows, length))
  traces = []

  @jax.jit
  def process(logits, step, sequences):  # `step` traced, as in the decoding loops
    traces.append(1)
    return decoding.no_repeat_ngram_processor(n)(logits, step, sequences)

  for step in range(length):
    sequences = np.where(np.arange(length) < step, outputs, 0)
    banned = np.asarray(process(jnp.zeros((rows, vocab)), jnp.int32(step), sequences)) < 0
    for row in range(rows):
      want = _banned_ngram_ends(list(outputs[row, :step]), n)
      assert set(np.flatnonzero(banned[row])) == want, (row, step)
  assert len(traces) == 1


def test_no_repeat_ngram_on_literal_logits():
  process = decoding.no_repeat_ngram_processor(2)
  logits = jnp.zeros((1, 6))
  # After 3 5 3 4 3: bigrams (3, 5) and (3, 4) exist, so 5 and 4 may not follow the last 3.
  out = process(logits, 5, jnp.array([[3, 5, 3, 4, 3, 0, 0]]))
  np.testing.assert_array_equal(out[0] < 0, [0, 0, 0, 0, 1, 1])
  # Before the last 3 (step 4, ends in 4): nothing followed a 4 yet.
  assert not np.any(process(logits, 4, jnp.array([[3, 5, 3, 4, 0, 0, 0]])) < 0)
  # Longer than the output: nothing to ban.
  assert decoding.no_repeat_ngram_processor(9)(logits, 5, jnp.ones((1, 7), jnp.int32)) is logits


def test_forced_bos_and_eos_processors_on_literal_logits():
  logits = jnp.array([[1.0, 2.0, 3.0, 4.0]])
  sequences = jnp.zeros((1, 3), jnp.int32)  # max_decode_len 3
  neg = decoding.NEG_INF
  bos = decoding.forced_bos_processor(2)
  np.testing.assert_array_equal(bos(logits, 0, sequences), [[neg, neg, 0.0, neg]])
  np.testing.assert_array_equal(bos(logits, 1, sequences), logits)
  eos = decoding.forced_eos_processor(EOS)
  np.testing.assert_array_equal(eos(logits, 2, sequences), [[neg, 0.0, neg, neg]])
  np.testing.assert_array_equal(eos(logits, 1, sequences), logits)
  # The forced tokens win over bans and min length (Hugging Face's order).
  processor = decoding.make_logits_processor(eos_id=EOS, min_length=3, banned_ids=(1, 2),
                                             forced_bos_id=2, forced_eos=True)
  np.testing.assert_array_equal(processor(logits, 0, sequences), [[neg, neg, 0.0, neg]])
  np.testing.assert_array_equal(processor(logits, 1, sequences), [[1.0, neg, neg, 4.0]])
  np.testing.assert_array_equal(processor(logits, 2, sequences), [[neg, 0.0, neg, neg]])
  with pytest.raises(ValueError, match="forced_bos_id"):
    decoding.forced_bos_processor(-1)
  with pytest.raises(ValueError, match="no_repeat_ngram_size"):
    decoding.no_repeat_ngram_processor(0)


HF_SETTINGS = [dict(ngram=2), dict(bos=4), dict(eos=True), dict(ngram=1, bos=3, eos=True)]


def _hf_processor(ngram=0, bos=-1, eos=False):
  return decoding.make_logits_processor(eos_id=EOS, no_repeat_ngram_size=ngram,
                                        forced_bos_id=bos, forced_eos=eos)


@pytest.mark.parametrize("settings", HF_SETTINGS)
def test_greedy_with_hf_settings_equals_reference(settings):
  vocab, length = 6, 6
  # Random models, and one that would say 2 2 2 ... and never EOS without the settings.
  tables = np.concatenate([_random_tables(11, 3, vocab, length),
                           _fixed_tables([-9.0, -30.0, 0.0, -0.5, -1.0, -1.5], length)])
  tokens, logprobs = _greedy(tables, max_len=length, processor=_hf_processor(**settings))
  for example, table in enumerate(tables):
    seq, logprob = [], 0.0
    while len(seq) < length and EOS not in seq:
      logp = _log_softmax(_reference_process(seq, table[_code(seq, vocab)], length, **settings))
      seq.append(int(np.argmax(logp)))
      logprob += logp[seq[-1]]
    np.testing.assert_array_equal(tokens[example], seq + [0] * (length - len(seq)))
    np.testing.assert_allclose(logprobs[example], logprob, rtol=1e-5)
  fixed = list(np.asarray(tokens[-1]))
  if "ngram" in settings:  # no n-gram twice
    ngrams = list(zip(*[fixed[i:] for i in range(settings["ngram"])]))
    assert len(set(ngrams)) == len(ngrams), fixed
  if "bos" in settings:
    assert fixed[0] == settings["bos"]
  if "eos" in settings:
    assert fixed[-1] == EOS


@pytest.mark.parametrize("settings", HF_SETTINGS)
def test_beam_with_hf_settings_equals_reference(settings):
  vocab, length, beam = 5, 4, 3
  tables = _random_tables(12, 3, vocab, length)
  sequences, scores = _beam(tables, 0.6, beam_size=beam, max_len=length,
                            processor=_hf_processor(**settings))
  process = functools.partial(_reference_process, length=length, **settings)
  for example, table in enumerate(tables):
    _assert_hypotheses(sequences[example], scores[example],
                       _reference_beam(table, beam, 0.6, length, process=process))


def test_sampling_with_hf_settings():
  vocab, length = 8, 5
  tokens, _ = _sample(_random_tables(13, 2, vocab, length), jax.random.PRNGKey(0),
                      max_len=length, num_decodes=16,
                      processor=_hf_processor(ngram=1, bos=5, eos=True))
  for row in np.asarray(tokens).reshape(-1, length):
    end = list(row).index(EOS) + 1  # forced at the last position at the latest
    assert row[0] == 5 and len(set(row[:end])) == end and np.all(row[end:] == 0)


def test_length_penalty_kinds():
  np.testing.assert_allclose(decoding.length_penalty(4, 1.0, "hf"), 4.0)
  np.testing.assert_allclose(decoding.length_penalty(4, 0.5, "hf"), 2.0)
  np.testing.assert_allclose(decoding.length_penalty(7, 1.0), 2.0)  # gnmt: (5 + 7) / 6
  with pytest.raises(ValueError, match="'t5'"):
    decoding.length_penalty(4, 1.0, "t5")


def test_beam_ranks_by_the_hf_length_penalty_when_asked():
  # [EOS] has log-prob about -1.0, [3, EOS] about -1.5: GNMT (alpha 1) divides them by 1 and
  # 7/6 (-1.0 beats -1.29), Hugging Face by 1 and 2 (-0.75 beats -1.0).
  table = np.full((25, 4), -30.0, np.float32)
  table[0, 1:] = np.log([0.37, 0.26, 0.37])  # empty output: EOS, 2 or 3
  table[_code((3,), 4), 1:] = np.log([0.6, 0.2, 0.2])  # after 3: EOS
  table[_code((2,), 4), 1:] = np.log([0.1, 0.45, 0.45])
  gnmt, gnmt_scores = _beam(table[None], 1.0, beam_size=2, max_len=3)
  hf, hf_scores = _beam(table[None], 1.0, beam_size=2, max_len=3, kind="hf")
  np.testing.assert_array_equal(gnmt[0, 0], [1, 0, 0])
  np.testing.assert_array_equal(hf[0, 0], [3, 1, 0])
  np.testing.assert_allclose(hf_scores[0, 0], _logprob(table, (3, 1)) / 2, rtol=1e-5)
  # Against every output and the step-by-step reference.
  tables = _random_tables(14, 2, 3, 4)
  wide, wide_scores = _beam(tables, 1.0, beam_size=len(_exhaustive(tables[0], 1.0, 4)),
                            max_len=4, kind="hf")
  narrow, narrow_scores = _beam(tables, 1.0, beam_size=2, max_len=4, kind="hf")
  for example, table in enumerate(tables):
    _assert_hypotheses(wide[example], wide_scores[example], _exhaustive(table, 1.0, 4, "hf"))
    _assert_hypotheses(narrow[example], narrow_scores[example],
                       _reference_beam(table, 2, 1.0, 4, kind="hf"))
