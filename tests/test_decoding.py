"""Decoding on a fake model whose next-token logits depend on the whole prefix."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import decoding

VOCAB, EOS, BOS, MAX_LEN = 4, 1, 2, 4


def _logit_table(seed):
  # One logit vector per (position, previous token, running sum of the prefix mod 3).
  return jax.random.normal(jax.random.PRNGKey(seed), (MAX_LEN, VOCAB, 3, VOCAB)) * 2.0


def _fake_model(table, batch):
  """tokens_to_logits over a cache holding the step and each row's prefix sum."""
  cache = {"index": jnp.array(0), "prefix_sum": jnp.zeros((batch,), jnp.int32)}

  def tokens_to_logits(ids, cache):
    last = ids[:, 0]
    prefix_sum = cache["prefix_sum"] + jnp.where(last == BOS, 0, last)
    logits = table[cache["index"], last, prefix_sum % 3]
    return logits, {"index": cache["index"] + 1, "prefix_sum": prefix_sum}

  return cache, tokens_to_logits


def _log_softmax(x):
  x = np.asarray(x, np.float64)
  return x - np.log(np.exp(x - x.max()).sum()) - x.max()


def _exhaustive_best(table, alpha):
  """Every output that ends in EOS, or reaches MAX_LEN, scored as the beam search scores."""
  table = np.asarray(table)
  best = []
  for length in range(1, MAX_LEN + 1):
    for seq in itertools.product(range(VOCAB), repeat=length):
      if EOS in seq[:-1] or (length < MAX_LEN and seq[-1] != EOS):
        continue
      logprob, last, prefix_sum = 0.0, BOS, 0
      for i, token in enumerate(seq):
        prefix_sum += 0 if last == BOS else last
        logprob += _log_softmax(table[i, last, prefix_sum % 3])[token]
        last = token
      best.append((logprob / ((5 + length) / 6) ** alpha, seq))
  return sorted(best, reverse=True)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_wide_beam_finds_exact_best(alpha, seed):
  table = _logit_table(seed)
  cache, tokens_to_logits = _fake_model(table, batch=1)
  # 256 slots >= every hypothesis there is (at most 4 + 12 + 36 + 108 end by step 4).
  sequences, scores = decoding.beam_search(jnp.ones((1, 3), jnp.int32), cache, tokens_to_logits,
                                           beam_size=256, alpha=alpha, eos_id=EOS,
                                           max_decode_len=MAX_LEN, bos_id=BOS)
  expected = _exhaustive_best(table, alpha)
  best_score, best_seq = expected[0]
  np.testing.assert_allclose(scores[0, 0], best_score, rtol=1e-5)
  np.testing.assert_array_equal(sequences[0, 0, :len(best_seq)], best_seq)
  np.testing.assert_array_equal(sequences[0, 0, len(best_seq):], 0)
  # Every returned hypothesis carries its true score, best first.
  by_sequence = {seq: score for score, seq in expected}
  found = np.asarray(scores[0]) > decoding.NEG_INF / 2
  assert np.all(np.diff(np.asarray(scores[0])[found]) <= 1e-6)
  for row, score in zip(np.asarray(sequences[0])[found], np.asarray(scores[0])[found]):
    length = next((i + 1 for i, t in enumerate(row) if t == EOS), MAX_LEN)
    np.testing.assert_allclose(score, by_sequence[tuple(row[:length])], rtol=1e-5)


def test_without_early_stop_wide_beam_returns_the_whole_ranking():
  table = _logit_table(5)
  cache, tokens_to_logits = _fake_model(table, batch=1)
  # alpha < 0 disables the early stop: every hypothesis is finished and ranked.
  sequences, scores = decoding.beam_search(jnp.ones((1, 3), jnp.int32), cache, tokens_to_logits,
                                           beam_size=256, alpha=-0.5, eos_id=EOS,
                                           max_decode_len=MAX_LEN, bos_id=BOS)
  expected = _exhaustive_best(table, -0.5)
  np.testing.assert_allclose(np.asarray(scores[0])[:len(expected)], [s for s, _ in expected],
                             rtol=1e-5)
  assert np.all(np.asarray(scores[0])[len(expected):] == decoding.NEG_INF)


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_beam_one_is_greedy(alpha):
  batch = 3
  tables = jnp.stack([_logit_table(s) for s in range(batch)])

  def fake(batch_tables):
    cache = {"index": jnp.array(0), "prefix_sum": jnp.zeros((batch,), jnp.int32)}

    def tokens_to_logits(ids, cache):
      last = ids[:, 0]
      prefix_sum = cache["prefix_sum"] + jnp.where(last == BOS, 0, last)
      rows = jnp.arange(ids.shape[0]) % batch
      logits = batch_tables[rows, cache["index"], last, prefix_sum % 3]
      return logits, {"index": cache["index"] + 1, "prefix_sum": prefix_sum}
    return cache, tokens_to_logits

  cache, tokens_to_logits = fake(tables)
  greedy = decoding.greedy_search(cache, tokens_to_logits, batch_size=batch, bos_id=BOS,
                                  eos_id=EOS, max_decode_len=MAX_LEN)
  sequences, scores = decoding.beam_search(jnp.ones((batch, 3), jnp.int32), cache,
                                           tokens_to_logits, beam_size=1, alpha=alpha,
                                           eos_id=EOS, max_decode_len=MAX_LEN, bos_id=BOS)
  np.testing.assert_array_equal(sequences[:, 0], greedy)


def _sampling_model(batch, vocab=50, seed=0):
  table = jax.random.normal(jax.random.PRNGKey(seed), (MAX_LEN + 1, vocab)) * 3.0
  cache = {"index": jnp.array(0)}

  def tokens_to_logits(ids, cache):
    logits = jnp.tile(table[cache["index"]][None], (ids.shape[0], 1)) + ids * 0.01
    return logits, {"index": cache["index"] + 1}
  return cache, tokens_to_logits


def test_top_k_one_and_zero_temperature_equal_greedy():
  cache, tokens_to_logits = _sampling_model(batch=4)
  common = dict(batch_size=4, bos_id=BOS, eos_id=EOS, max_decode_len=MAX_LEN)
  greedy = decoding.greedy_search(cache, tokens_to_logits, **common)
  rng = jax.random.PRNGKey(7)
  np.testing.assert_array_equal(
      decoding.sample(cache, tokens_to_logits, rng, top_k=1, temperature=1.5, **common), greedy)
  np.testing.assert_array_equal(
      decoding.sample(cache, tokens_to_logits, rng, temperature=0.0, **common), greedy)
  np.testing.assert_array_equal(
      decoding.sample(cache, tokens_to_logits, rng, temperature=1e-6, **common), greedy)


def test_fixed_seed_reproduces_samples():
  cache, tokens_to_logits = _sampling_model(batch=8)
  common = dict(batch_size=8, bos_id=BOS, eos_id=EOS, max_decode_len=MAX_LEN)
  a = decoding.sample(cache, tokens_to_logits, jax.random.PRNGKey(1), **common)
  b = decoding.sample(cache, tokens_to_logits, jax.random.PRNGKey(1), **common)
  c = decoding.sample(cache, tokens_to_logits, jax.random.PRNGKey(2), **common)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


def test_top_p_keeps_exactly_the_smallest_nucleus():
  probs = np.array([0.05, 0.4, 0.1, 0.3, 0.15])
  logits = jnp.log(jnp.asarray(probs))[None]
  # Sorted: 0.4, 0.3, 0.15, 0.1, 0.05. 0.4 + 0.3 = 0.7 < 0.75, so 0.15 is needed too.
  kept = decoding.filter_logits(logits, top_p=0.75)[0] > decoding.NEG_INF / 2
  np.testing.assert_array_equal(kept, [False, True, False, True, True])
  kept = decoding.filter_logits(logits, top_p=0.7)[0] > decoding.NEG_INF / 2
  np.testing.assert_array_equal(kept, [False, True, False, True, False])
  kept = decoding.filter_logits(logits, top_p=0.3)[0] > decoding.NEG_INF / 2
  np.testing.assert_array_equal(kept, [False, True, False, False, False])


def test_top_k_keeps_k_best():
  logits = jnp.array([[0.1, 3.0, -1.0, 2.0, 0.5]])
  kept = decoding.filter_logits(logits, top_k=2)[0] > decoding.NEG_INF / 2
  np.testing.assert_array_equal(kept, [False, True, False, True, False])
