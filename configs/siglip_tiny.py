"""Deterministic SIGLIP baseline on the bundled digits (no [UNC] tokens)."""

from prolip_jax import demos


def get_config():
  return demos.tiny_demo_config('siglip')
