"""``jsonl``: an image folder and a JSONL file of captions, for retrieval.

Evaluation (``data='jsonl:PATH'``): ``{"image": "rel/path.jpg",
"captions": [...]}`` lines (``"caption": str`` works too); images relative
to the entry's ``images_dir`` (default: the file's folder).
"""

from __future__ import annotations

import os

from prolip_jax import errors
from prolip_jax.data import eval_data
from prolip_jax.data.sources import base
from prolip_jax.data.sources import views


class JsonlCaptions(base.Source):
  """Captioned images listed in a JSONL file (evaluation only)."""

  name = 'jsonl'
  LOCAL_PATH = True

  def retrieval_set(self, rest, cfg):
    if not os.path.isfile(rest):
      raise errors.DatasetUnavailableError(f'{cfg.data}: no file {rest}')
    ds = eval_data.retrieval_jsonl(
        cfg.get('images_dir', '') or os.path.dirname(os.path.abspath(rest)),
        rest)
    return views.RetrievalSet(
        views.ImageSet(os.path.basename(rest), len(ds),
                       lambda i: (ds.images[i], -1)),
        list(ds.captions), ds.image_of_text)

  def available(self, rest, cfg):
    return None if os.path.isfile(rest) else f'{cfg.data}: no file {rest}'
