"""kernels/dropout16.py (the CPU fast path of nn.Dropout): the keep rate, the expectation, independence of elements, and the switches."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.dropout16 import Dropout, dropout, keep_mask, keep_threshold


@pytest.mark.parametrize("rate", [0.1, 0.3, 0.5])
def test_keep_rate_and_expectation(rate):
  shape = (300, 333)                                  # odd sizes: the last word's second half is unused
  mask = np.asarray(keep_mask(jax.random.key(0), rate, shape))
  n = mask.size
  p = keep_threshold(rate) / 65536
  assert abs(p - (1 - rate)) < 1e-5
  # Binomial: 5 standard deviations.
  assert abs(mask.mean() - p) < 5 * np.sqrt(p * (1 - p) / n)
  x = jnp.ones(shape)
  out = np.asarray(dropout(x, rate, jax.random.key(1)))
  kept = out != 0
  np.testing.assert_allclose(out[kept], 1 / p, rtol=1e-6)
  assert abs(out.mean() - 1.0) < 5 * np.sqrt((1 - p) / p / n)


def test_masks_are_independent_of_position_and_key():
  shape = (64, 1001)
  a = np.asarray(keep_mask(jax.random.key(0), 0.5, shape))
  b = np.asarray(keep_mask(jax.random.key(1), 0.5, shape))
  assert 0.45 < (a == b).mean() < 0.55                # different keys: unrelated masks
  # Neighbours (which share a 32-bit word when the flat index is even) are not correlated.
  left, right = a.reshape(-1)[0:-1:2], a.reshape(-1)[1::2]
  assert abs(np.corrcoef(left, right)[0, 1]) < 0.02
  assert abs(np.corrcoef(a[:, :-1].reshape(-1), a[:, 1:].reshape(-1))[0, 1]) < 0.02


def test_module_is_identity_when_deterministic_or_rate_zero():
  x = jnp.arange(12.0).reshape(3, 4)
  module = Dropout(0.3)
  assert np.array_equal(module.apply({}, x, deterministic=True), x)
  assert np.array_equal(Dropout(0.0).apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(0)}), x)
  y = module.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(0)})
  z = module.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(0)})
  assert np.array_equal(y, z)                         # same key, same mask
  assert y.dtype == x.dtype


def test_bfloat16_input_keeps_its_dtype():
  x = jnp.ones((8, 8), jnp.bfloat16)
  assert dropout(x, 0.1, jax.random.key(0)).dtype == jnp.bfloat16
