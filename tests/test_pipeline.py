import numpy as np
import pytest

from transformer_jax.data import demo
from transformer_jax.data import pipeline


def test_decoder_only_example_literal():
  tokens, weights = pipeline.decoder_only_example([7, 8, 9], [5, 6], max_len=9)
  np.testing.assert_array_equal(tokens, [7, 8, 9, 1, 5, 6, 1])
  np.testing.assert_array_equal(weights, [0, 0, 0, 0, 1, 1, 1])


def test_decoder_only_example_cuts_the_source_first():
  tokens, weights = pipeline.decoder_only_example([7, 8, 9, 10], [5, 6], max_len=6)
  np.testing.assert_array_equal(tokens, [7, 8, 1, 5, 6, 1])
  np.testing.assert_array_equal(weights, [0, 0, 0, 1, 1, 1])


def _numbered(n: int, lengths=None) -> pipeline.Encoded:
  """Example i: inputs [i+10] * length_i + EOS and targets [i+100, EOS]."""
  lengths = lengths or [1] * n
  inputs = [np.array([i + 10] * lengths[i] + [1], np.int32) for i in range(n)]
  targets = [np.array([i + 100, 1], np.int32) for i in range(n)]
  return pipeline.Encoded({"inputs": inputs, "targets": targets}, {"inputs": 8, "targets": 6})


def test_train_batches_cover_each_epoch_and_resume_from_their_state():
  data = _numbered(10)
  batches = pipeline.TrainBatches(data, global_batch_size=4, seed=3)
  first_epoch = np.concatenate([next(batches)["targets"][:, 0] for _ in range(2)] +
                               [next(batches)["targets"][:2, 0]])
  assert sorted(first_epoch - 100) == list(range(10))  # an epoch sees every example once
  assert batches.state == {"epoch": 1, "row": 2}
  resumed = pipeline.TrainBatches(data, global_batch_size=4, seed=3)
  resumed.restore(batches.state)
  for _ in range(4):
    np.testing.assert_array_equal(next(resumed)["inputs"], next(batches)["inputs"])
  # Two processes split each global batch between them.
  whole = pipeline.TrainBatches(data, 4, 3)
  halves = [pipeline.TrainBatches(data, 4, 3, process_index=i, process_count=2)
            for i in range(2)]
  for _ in range(3):
    np.testing.assert_array_equal(
        np.concatenate([next(h)["inputs"] for h in halves]), next(whole)["inputs"])


def _sharded(data: pipeline.Encoded, count: int, held) -> pipeline.Shards:
  """Example i in shard i % count, as the readers shard a split."""
  return pipeline.Shards(count, {s: data.subset(range(s, len(data), count)) for s in held})


def test_processes_holding_a_shard_each_give_the_batches_of_one_process_holding_both():
  data = _numbered(30, lengths=[1 + i % 5 for i in range(30)])
  for pack in (False, True):
    one = pipeline.TrainBatches(_sharded(data, 2, [0, 1]), 6, seed=3, pack=pack)
    two = [pipeline.TrainBatches(_sharded(data, 2, [i]), 6, seed=3, pack=pack,
                                 process_index=i, process_count=2) for i in range(2)]
    seen = [set(), set()]
    for _ in range(12):  # several epochs of both shards
      expected, halves = next(one), [next(t) for t in two]
      for name in expected:
        np.testing.assert_array_equal(
            np.concatenate([h[name] for h in halves]), expected[name])
      for i, half in enumerate(halves):
        seen[i] |= set(half["targets"][half["targets"] >= 100].tolist())
    # Each process read only its own shard: the even examples, or the odd ones.
    assert seen == [{100 + i for i in range(0, 30, 2)}, {100 + i for i in range(1, 30, 2)}]
    # Their states joined are the one process's state, and resume it.
    state = pipeline.merge_states([t.state for t in two])
    assert state == one.state and all(-1 in sum(t.state["shards"], []) for t in two)
    resumed = pipeline.TrainBatches(_sharded(data, 2, [1]), 6, seed=3, pack=pack,
                                    process_index=1, process_count=2)
    resumed.restore(state)
    for _ in range(5):
      np.testing.assert_array_equal(next(resumed)["inputs"], next(two[1])["inputs"])


def test_shard_layouts_and_their_errors():
  assert [list(pipeline.shards_of_process(i, 2, 4)) for i in range(2)] == [[0, 1], [2, 3]]
  assert [list(pipeline.shards_of_process(i, 4, 1)) for i in range(4)] == [[0]] * 4
  assert [list(pipeline.shards_of_process(i, 2, 3)) for i in range(2)] == [[0, 1], [1, 2]]
  assert [pipeline.saving_process(s, 2, 3) for s in range(3)] == [0, 0, 1]
  data = _numbered(12)
  with pytest.raises(ValueError, match="not divisible by 4 data shards"):
    pipeline.TrainBatches(_sharded(data, 4, range(4)), 6, seed=0)
  with pytest.raises(ValueError, match=r"reads data shards \[1\], not \[0\]"):
    pipeline.TrainBatches(_sharded(data, 2, [0]), 4, seed=0, process_index=1, process_count=2)
  batches = pipeline.TrainBatches(_sharded(data, 2, [0, 1]), 4, seed=0)
  with pytest.raises(ValueError, match="for 1 data shard.* set --config.data_shards=1"):
    batches.restore({"epoch": 0, "row": 3})


def test_prefetch_yields_each_batch_with_the_state_after_it():
  data = _numbered(10)
  plain = pipeline.TrainBatches(data, global_batch_size=4, seed=3)
  expected = [(next(plain), plain.state) for _ in range(5)]
  for size in (0, 2):
    ahead = pipeline.TrainBatches(data, global_batch_size=4, seed=3)
    prefetched = pipeline.prefetch(ahead, place=lambda b: b, size=size)
    for batch, state in expected:
      got_batch, got_state = next(prefetched)
      assert got_state == state  # what a checkpoint after this batch must hold
      np.testing.assert_array_equal(got_batch["inputs"], batch["inputs"])
    prefetched.close()


def test_packed_batch_has_the_exact_features():
  # Inputs of 3, 4, 2 and 5 tokens (EOS included) in rows of 8; targets of 2 in rows of 6.
  data = _numbered(4, lengths=[2, 3, 1, 4])
  assert pipeline.pack_rows(data, [0, 1, 2, 3]) == [[0, 1], [2, 3]]
  batch = pipeline.pad_rows(data, [[0, 1], [2, 3]], pack=True)
  assert sorted(batch) == ["inputs", "inputs_position", "inputs_segmentation", "targets",
                           "targets_position", "targets_segmentation"]
  np.testing.assert_array_equal(batch["inputs"], [[10, 10, 1, 11, 11, 11, 1, 0],
                                                  [12, 1, 13, 13, 13, 13, 1, 0]])
  np.testing.assert_array_equal(batch["inputs_segmentation"], [[1, 1, 1, 2, 2, 2, 2, 0],
                                                               [1, 1, 2, 2, 2, 2, 2, 0]])
  np.testing.assert_array_equal(batch["inputs_position"], [[0, 1, 2, 0, 1, 2, 3, 0],
                                                           [0, 1, 0, 1, 2, 3, 4, 0]])
  np.testing.assert_array_equal(batch["targets"], [[100, 1, 101, 1, 0, 0],
                                                   [102, 1, 103, 1, 0, 0]])
  np.testing.assert_array_equal(batch["targets_segmentation"], [[1, 1, 2, 2, 0, 0],
                                                                [1, 1, 2, 2, 0, 0]])
  np.testing.assert_array_equal(batch["targets_position"], [[0, 1, 0, 1, 0, 0],
                                                            [0, 1, 0, 1, 0, 0]])


def test_packing_starts_a_new_row_when_any_feature_is_full():
  data = _numbered(5)  # inputs of 2 tokens in rows of 8, targets of 2 in rows of 6
  assert pipeline.pack_rows(data, range(5)) == [[0, 1, 2], [3, 4]]  # targets fill first


def test_packed_training_resumes_exactly():
  data = _numbered(30, lengths=[1 + i % 5 for i in range(30)])
  batches = pipeline.TrainBatches(data, global_batch_size=3, seed=0, pack=True)
  for _ in range(5):
    next(batches)
  resumed = pipeline.TrainBatches(data, global_batch_size=3, seed=0, pack=True)
  resumed.restore(batches.state)
  for _ in range(10):  # across epoch boundaries too
    expected, got = next(batches), next(resumed)
    for name in expected:
      np.testing.assert_array_equal(got[name], expected[name])


def test_demo_grammar_agreement_and_word_order():
  assert demo._german_np({"noun": demo.NOUNS[0], "plural": False, "det": ("the", None),
                          "adj": ("old", "alt")}, "acc") == "den alten Hund"
  assert demo._german_np({"noun": demo.NOUNS[4], "plural": False, "det": ("a", "ein"),
                          "adj": ("tired", "müd")}, "dat") == "einer müden Frau"
  assert demo._german_np({"noun": demo.NOUNS[2], "plural": True, "det": ("", None),
                          "adj": ("small", "klein")}, "dat") == "kleinen Kindern"


def test_demo_splits_are_deterministic_and_disjoint():
  a = demo.generate_splits(300, 50, 50, seed=4)
  assert a == demo.generate_splits(300, 50, 50, seed=4)
  sources = [{s for s, _ in a[split]} for split in ("train", "validation", "test")]
  assert sum(map(len, sources)) == len(set.union(*sources)) == 400


def _greedy(data: pipeline.Encoded, order) -> list[list[int]]:
  """Greedy packing one example at a time: the rule pack_rows implements."""
  rows, used = [], None
  for i in order:
    sizes = [len(f[i]) for f in data.features.values()]
    if used is None or any(u + s > data.lengths[name]
                           for u, s, name in zip(used, sizes, data.features)):
      rows.append([])
      used = [0] * len(sizes)
    rows[-1].append(int(i))
    used = [u + s for u, s in zip(used, sizes)]
  return rows


def test_epoch_rows_are_packed_as_they_are_read():
  rng = np.random.default_rng(0)
  sequences = [rng.integers(3, 50, rng.integers(1, 9)) for _ in range(3000)]
  targets = [rng.integers(3, 50, rng.integers(1, 5)) for _ in range(3000)]
  data = pipeline.Encoded({"inputs": sequences, "targets": targets},
                          {"inputs": 16, "targets": 9})
  order = rng.permutation(len(sequences))
  whole = _greedy(data, order)
  assert pipeline.pack_rows(data, order) == whole
  lazy = pipeline.EpochRows(data, order, pack=True)
  assert [r.tolist() for r in lazy.take(0, 10)] == whole[:10]
  assert not lazy.complete and lazy.num_rows == 10  # the rest of the epoch is not packed yet
  # A resume near the end, and the end.
  assert [r.tolist() for r in lazy.take(len(whole) - 5, 10)] == whole[-5:]
  assert lazy.complete and lazy.num_rows == len(whole)


def test_padded_rows_match_a_row_by_row_reference():
  rng = np.random.default_rng(1)
  sequences = lambda longest: [rng.integers(3, 50, rng.integers(1, longest)) for _ in range(40)]
  data = pipeline.Encoded({"inputs": sequences(6), "targets": sequences(4)},
                          {"inputs": 12, "targets": 8, "weights": 8})
  data.features["weights"] = pipeline.Ragged(  # weights as long as targets
      rng.random(len(data.features["targets"].values)).astype(np.float32),
      data.features["targets"].offsets)
  rows = [list(r) for r in _greedy(data, rng.permutation(40))] + [[]]
  batch = pipeline.pad_rows(data, rows, pack=True)
  for name in data.features:
    for r, row in enumerate(rows):
      tokens = np.concatenate([data.features[name][i] for i in row] + [np.zeros(0)])
      padded = np.zeros(data.lengths[name])
      padded[:len(tokens)] = tokens
      np.testing.assert_array_equal(batch[name][r], padded.astype(batch[name].dtype))
      if name != "weights":
        segments = np.concatenate([np.full(len(data.features[name][i]), k + 1)
                                   for k, i in enumerate(row)] + [np.zeros(0)])
        positions = np.concatenate([np.arange(len(data.features[name][i])) for i in row]
                                   + [np.zeros(0)])
        np.testing.assert_array_equal(batch[f"{name}_segmentation"][r][:len(tokens)], segments)
        np.testing.assert_array_equal(batch[f"{name}_position"][r][:len(tokens)], positions)
        assert not batch[f"{name}_segmentation"][r][len(tokens):].any()




def test_config_refuses_data_shards_that_do_not_divide_the_global_batch(tiny_config):
  from transformer_jax import config_validation
  tiny_config.data_shards = 3  # 16 rows per device
  with pytest.raises(config_validation.ConfigError,
                     match="data_shards=3 does not divide the global batch of 32 rows"):
    config_validation.validate(tiny_config, device_count=2)
  tiny_config.data_shards = 4
  config_validation.validate(tiny_config, device_count=2)
