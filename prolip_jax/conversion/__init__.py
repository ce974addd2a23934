"""Offline converters to array_record shards (the format of
``prolip_jax.data.record_format``), run before training, never by it.

* ``webdataset``: webdataset / img2dataset tar shards, one output shard per
  input shard, streamed, parallel over shards, resumable.
* ``image_folder``: an image folder plus a CSV / JSONL captions file.
* ``common``: what both share: the error of a bad input, the verdict on one
  record, the tallies and the ``summary.json`` they write, the command
  lines' common flags.
* ``beam``: both as Apache Beam pipelines (the optional ``beam`` extra),
  judging records with the same functions.

The command lines are ``tools/convert_webdataset.py``,
``tools/convert_folder.py`` and ``tools/convert_beam.py``. This package
imports ``prolip_jax.data`` (the record format, the bad-record reasons, path
patterns); nothing in ``data`` or a training run imports it.
"""
