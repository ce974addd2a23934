"""Where files go: ``paths`` (the one path layer: local, ``gs://``,
``s3://``), ``atomic`` (whole-or-nothing files and folders), ``workdir``
(every file of a run, named once) and ``file_names`` (the file names of an
export, a snapshot and a workdir's tokenizer).
"""
