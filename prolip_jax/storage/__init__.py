"""Where files go: ``paths`` (the one path layer: local, ``gs://``,
``s3://``), ``atomic`` (whole-or-nothing files and folders), ``workdir``
(every file of a run, named once), ``file_names`` (the file names of an
export, a snapshot and a workdir's tokenizer) and ``checkpoint`` (Orbax
checkpoints: written by training, read by ``interop`` and ``evaluate``).
"""
