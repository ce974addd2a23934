"""webdataset / img2dataset tar shards -> array_record shards.

python tools/convert_webdataset.py --input 'DIR/{00000..00099}.tar' \
    --output OUT_DIR [--workers N] [--max_record_bytes 8388608]

Each example of a tar is its files sharing a key (``KEY.jpg`` + ``KEY.txt``,
or ``KEY.json`` with a ``"caption"`` field; ``.jpeg/.png/.webp`` images work
too). Every input shard becomes ``OUT_DIR/NAME.array_record`` (record format
in ``prolip_jax/data/record_format.py``) plus a ``.done`` marker holding its
summary; a re-run skips shards that have both, so an interrupted conversion
resumes. The input pattern's braces are expanded here (quote it), globs work
too. Undecodable images, missing/blank captions and records over
``--max_record_bytes`` are skipped and counted; the totals are printed and
written to ``OUT_DIR/summary.json``. Train with ``data.name='array_record'``,
``data.path='OUT_DIR/*.array_record'``. A tar that cannot be read to its end
(truncated, also on a member boundary: no end-of-archive marker; corrupt)
gets no shard and no ``.done`` marker: once every other shard is converted
the command stops with one line ``error: ...`` naming it (exit status 2, no
``summary.json``); so do inputs that give no record at all. A failed run
keeps no shard that holds no record, so a re-run converts a fixed input.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from prolip_jax import errors
from prolip_jax.conversion import common
from prolip_jax.conversion import webdataset
# pylint: enable=g-import-not-at-top,wrong-import-position


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--input', required=True, action='append',
                      help="tar shards: brace pattern or glob (repeatable)")
  parser.add_argument('--workers', type=int, default=os.cpu_count() or 1,
                      help='shards converted in parallel processes')
  common.add_common_args(parser)
  args = parser.parse_args(argv)
  summary = webdataset.convert_webdataset(
      args.input, args.output, workers=args.workers,
      max_record_bytes=args.max_record_bytes, verbose=True)
  common.print_summary(summary, args.output)
  return summary


if __name__ == '__main__':
  sys.exit(errors.cli_main(main))
