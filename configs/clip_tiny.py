"""Deterministic CLIP baseline on the bundled digits (no [UNC] tokens)."""

from prolip_jax.config import presets


def get_config():
  return presets.tiny_demo_config('clip')
