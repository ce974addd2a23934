"""Partial-information views for L_inclusion(Z ⊂ Z_masked) (paper 3.3, 4.1)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def num_kept_patches(num_patches: int, keep_ratio: float) -> int:
  """Patches a masked image keeps: ``round(num_patches * keep_ratio)``, at
  least one (49 of 196 for B/16 at the paper's 25%)."""
  return max(1, int(round(num_patches * keep_ratio)))


def random_keep_indices(rng: Array, batch_size: int, num_patches: int,
                        keep_ratio: float) -> Array:
  """Patch indices kept by token drop, ``(batch_size, n_keep)`` int32.

  Each sample draws its own random subset (as in MAE/FLIP); indices are sorted
  so kept patches stay in raster order. ``keep_ratio`` is the fraction kept:
  0.25 for the paper's "mask 75%", 0.75 for the release's behaviour.
  """
  n_keep = num_kept_patches(num_patches, keep_ratio)
  noise = jax.random.uniform(rng, (batch_size, num_patches))
  keep = jnp.argsort(noise, axis=1)[:, :n_keep]
  return jnp.sort(keep, axis=1).astype(jnp.int32)


def mask_text_tokens(rng: Array, tokens: Array, mask_id: int, pad_id: int,
                     prob: float) -> Array:
  """Replaces each real (non-pad) token by ``mask_id`` with probability ``prob``.

  ``tokens``: ``(b, L)`` int32; padding stays padding, so the caption length
  (and with it where [UNC]/[CLS] go) is unchanged.
  """
  replace = jax.random.bernoulli(rng, prob, tokens.shape) & (tokens != pad_id)
  return jnp.where(replace, mask_id, tokens)
