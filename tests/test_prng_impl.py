"""config.prng_impl: the generator that initialisation and dropout keys come from."""

import jax
import pytest

from transformer_jax import benchmark
from transformer_jax import families
from transformer_jax import train

KEY_WORDS = {"threefry2x32": 2, "rbg": 4, "unsafe_rbg": 4}  # uint32 words per raw key


@pytest.fixture
def restore_prng_impl():
  previous = jax.config.jax_default_prng_impl
  yield
  jax.config.update("jax_default_prng_impl", previous)


@pytest.mark.parametrize("impl", sorted(KEY_WORDS))
def test_prng_impl_sets_the_default_generator(tiny_config, restore_prng_impl, impl):
  tiny_config.prng_impl = impl
  train.use_prng_impl(tiny_config)
  assert jax.config.jax_default_prng_impl == impl
  assert jax.random.PRNGKey(0).shape == (KEY_WORDS[impl],)


def test_training_steps_run_on_the_rbg_generator(tiny_config, restore_prng_impl):
  tiny_config.prng_impl = "rbg"
  family = families.get(tiny_config)
  # The training-step runner of benchmark.py and compare_pytorch.py (dropout on).
  step = benchmark.train_step_runner(tiny_config, family, batch_size=4, seq_len=8)
  assert jax.config.jax_default_prng_impl == "rbg"
  step()
  step()
