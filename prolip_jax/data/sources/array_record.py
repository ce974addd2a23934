"""``array_record``: our array_record shards (``data/record_format.py``),
written by ``tools/convert_webdataset.py`` or ``tools/convert_folder.py``.

Training (``data.name='array_record'``): ``data.path`` is a glob / brace
pattern / comma-separated list / directory of ``.array_record`` files.
Evaluation (``data='array_record:GLOB'``): retrieval, records sharing a
``key`` being one image and its captions.
"""

from __future__ import annotations

import os

from prolip_jax.data import eval_data
from prolip_jax.data import record_sources
from prolip_jax.data.sources import base
from prolip_jax.data.sources import views


class ArrayRecordShards(base.RecordSource):
  """Shards of records, trained on or scored for retrieval."""

  name = 'array_record'
  KEYS = {**base.RecordSource.KEYS, **base.declared('path')}
  LOCAL_PATH = True

  def open_records(self, data, where):
    path = self.value(data, 'path')
    if not path:
      raise ValueError(f"{where}.name='array_record' needs {where}.path (a "
                       'glob of .array_record shards)')
    return record_sources.ArrayRecordSource(path)

  def retrieval_set(self, rest, cfg):
    ds = eval_data.retrieval_array_record(rest)
    return views.RetrievalSet(
        views.ImageSet(os.path.basename(rest), len(ds),
                       lambda i: (ds.images[i], -1)),
        list(ds.captions), ds.image_of_text)
