"""Caption cleaning before tokenisation, with open_clip's exact semantics.

``clean(text, mode)`` for ``mode`` in :data:`CLEAN_MODES`:

* ``'none'``: the text unchanged (this project's default: the tiny demos'
  tokenizers were trained on raw captions);
* ``'whitespace'``: ``basic_clean`` (``ftfy.fix_text``, HTML-unescape twice,
  strip) then whitespace runs collapsed to one space (open_clip
  ``_clean_whitespace``);
* ``'lower'``: ``'whitespace'`` then lower-cased (open_clip ``_clean_lower``,
  the default of its CLIP BPE tokenizer);
* ``'canonicalize'``: ``basic_clean`` then big_vision's
  ``canonicalize_text``: ``_`` -> space, every ASCII punctuation character
  (``string.punctuation``) removed, lower-cased, whitespace collapsed,
  stripped (open_clip ``_clean_canonicalize``; the ProLIP release's
  ``HFTokenizer('timm/ViT-B-16-SigLIP', clean='canonicalize')``).

``ftfy`` is imported on first use of a mode that needs it.
"""

from __future__ import annotations

import functools
import html
import string
from typing import Callable

CLEAN_MODES = ('none', 'whitespace', 'lower', 'canonicalize')

_PUNCTUATION = str.maketrans('', '', string.punctuation)


@functools.lru_cache(maxsize=None)
def _ftfy():
  import ftfy  # pylint: disable=g-import-not-at-top
  return ftfy


def basic_clean(text: str) -> str:
  """``ftfy.fix_text``, HTML entities unescaped twice, stripped."""
  text = _ftfy().fix_text(text)
  text = html.unescape(html.unescape(text))
  return text.strip()


def whitespace_clean(text: str) -> str:
  """Whitespace runs (any Unicode whitespace) -> one space, stripped."""
  return ' '.join(text.split()).strip()


def canonicalize_text(text: str) -> str:
  """big_vision's ``canonicalize_text``: ``_`` -> space, ASCII punctuation
  removed, lower-cased, whitespace collapsed."""
  text = text.replace('_', ' ').translate(_PUNCTUATION).lower()
  return ' '.join(text.split()).strip()


def _none(text: str) -> str:
  return text


def _whitespace(text: str) -> str:
  return whitespace_clean(basic_clean(text))


def _lower(text: str) -> str:
  return whitespace_clean(basic_clean(text)).lower()


def _canonicalize(text: str) -> str:
  return canonicalize_text(basic_clean(text))


_FUNCTIONS = {'none': _none, 'whitespace': _whitespace, 'lower': _lower,
              'canonicalize': _canonicalize}


def get_clean_fn(mode: str) -> Callable[[str], str]:
  """The cleaning function of ``mode`` (one of :data:`CLEAN_MODES`)."""
  if mode not in _FUNCTIONS:
    raise ValueError(f'tokenizer.clean must be one of {CLEAN_MODES}, got '
                     f'{mode!r}')
  return _FUNCTIONS[mode]


def clean(text: str, mode: str) -> str:
  """``text`` cleaned the way ``mode`` says (see the module docstring)."""
  return get_clean_fn(mode)(text)
