"""The one prompt ensemble (paper 4.2) every zero-shot path embeds its
classes with: the ``zero_shot``, ``heldout`` and ``bprw`` evaluator kinds
and ``LoadedModel.zero_shot_classifier`` (``interop/load.py``). Only the
text embedder differs between them.
"""

from __future__ import annotations

import string
from typing import Callable, Sequence

from prolip_jax import errors
from prolip_jax.evaluation.metrics import class_gaussians

# ``embed_texts(prompts: list[str]) -> (mu (P, d), logvar (P, d) or None)``.
TextEmbedder = Callable[[list[str]], tuple]


_BRACES = ("a literal brace is written '{{' or '}}', as in str.format")


def _template_error(index: int, template: str) -> str:
  """Why ``template`` cannot name a class ('' when it can): it must hold
  exactly one replacement field, ``{}`` (or ``{0}``), and no stray brace."""
  try:
    fields = [name for _, name, _, _ in string.Formatter().parse(template)
              if name is not None]
  except ValueError as e:  # "Single '{' encountered in format string"
    return f'template {index} {template!r}: {e}; {_BRACES}'
  if not fields:
    return (f"template {index} {template!r} has no '{{}}' for the class "
            'name: every class would get the same prompt')
  if len(fields) > 1:
    return (f"template {index} {template!r} has {len(fields)} '{{}}': one "
            f'is the class name; {_BRACES}')
  if fields[0] not in ('', '0'):
    return (f"template {index} {template!r}: only '{{}}' is replaced (by "
            f"the class name), not '{{{fields[0]}}}'; {_BRACES}")
  try:
    template.format('class')
  except (ValueError, IndexError, KeyError, AttributeError) as e:
    return (f"template {index} {template!r}: {e} (a plain '{{}}' is "
            'replaced by the class name)')
  return ''


def check_templates(templates: Sequence[str]) -> None:
  """Raises ``errors.ConfigError`` (one line) unless ``templates`` is a
  sequence of ``str.format`` templates each naming the class once with
  ``{}``: a template without it would give every class the same prompt (and
  every image class 0), a stray brace a ``ValueError`` of ``str.format``."""
  if isinstance(templates, (str, bytes)):
    raise errors.ConfigError(
        f'templates must be a list of templates, not the string '
        f"{templates!r}: e.g. ['a photo of a {{}}.']")
  for i, template in enumerate(templates):
    if not isinstance(template, str):
      raise errors.ConfigError(f'template {i} {template!r} is not a string')
    why = _template_error(i, template)
    if why:
      raise errors.ConfigError(why)


def prompt_ensemble(embed_texts: TextEmbedder, class_names: Sequence[str],
                    templates: Sequence[str]) -> tuple:
  """The prompt ensemble's embeddings (paper 4.2), per prompt.

  Every ``template.format(name)``, class-major (class c, template t is
  prompt ``c * N + t``), embedded in one call of ``embed_texts``.

  Returns:
    (mu ``(C, N, d)``, logvar ``(C, N, d)`` or None), C classes, N
    templates; ``metrics.class_gaussians`` averages them per class.

  Raises:
    errors.ConfigError: a template that cannot name a class
    (``check_templates``), before anything is embedded.
  """
  check_templates(templates)
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
