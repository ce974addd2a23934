"""prolip_jax: probabilistic language-image pre-training in JAX/Flax."""

__version__ = '0.1.0'


def load(path, step=None, tokenizer=None, image_size=None):
  """Loads a trained model, an export or Hugging Face snapshot directory, or
  ``hf-hub:OWNER/NAME`` (optionally at another ``image_size``); see
  ``prolip_jax.interop.load.load``."""
  from prolip_jax.interop import load as load_lib  # pylint: disable=g-import-not-at-top
  return load_lib.load(path, step=step, tokenizer=tokenizer,
                       image_size=image_size)
