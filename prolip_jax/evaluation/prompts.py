"""The one prompt ensemble (paper 4.2) every zero-shot path embeds its
classes with: the ``zero_shot``, ``heldout`` and ``bprw`` evaluator kinds
and ``LoadedModel.zero_shot_classifier`` (``interop/load.py``). Only the
text embedder differs between them.
"""

from __future__ import annotations

from typing import Callable, Sequence

from prolip_jax.evaluation.metrics import class_gaussians

# ``embed_texts(prompts: list[str]) -> (mu (P, d), logvar (P, d) or None)``.
TextEmbedder = Callable[[list[str]], tuple]


def prompt_ensemble(embed_texts: TextEmbedder, class_names: Sequence[str],
                    templates: Sequence[str]) -> tuple:
  """The prompt ensemble's embeddings (paper 4.2), per prompt.

  Every ``template.format(name)``, class-major (class c, template t is
  prompt ``c * N + t``), embedded in one call of ``embed_texts``.

  Returns:
    (mu ``(C, N, d)``, logvar ``(C, N, d)`` or None), C classes, N
    templates; ``metrics.class_gaussians`` averages them per class.
  """
  prompts = [t.format(c) for c in class_names for t in templates]
  mu, logvar = embed_texts(prompts)
  shape = (len(class_names), len(templates), -1)
  return mu.reshape(shape), None if logvar is None else logvar.reshape(shape)


def class_ensemble(embed_texts: TextEmbedder, class_names: Sequence[str],
                   templates: Sequence[str]) -> tuple:
  """Per-class Gaussians of the prompt ensemble: (mean mu ``(C, d)``, mean
  sigma^2 ``(C, d)`` or None) of ``prompt_ensemble`` (``class_gaussians``:
  the plain mean of the N prompt variances)."""
  return class_gaussians(*prompt_ensemble(embed_texts, class_names,
                                          templates))
