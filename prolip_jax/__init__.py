"""prolip_jax: probabilistic language-image pre-training in JAX/Flax."""

__version__ = '0.1.0'


def load(path, step=None):
  """Loads a trained model; see ``prolip_jax.inference.load``."""
  from prolip_jax import inference  # pylint: disable=g-import-not-at-top
  return inference.load(path, step=step)
