"""An image folder plus a captions file -> array_record shards.

python tools/convert_folder.py --images DIR --captions captions.csv|.jsonl \
    --output OUT_DIR [--shard_size 10000] [--max_record_bytes 8388608]

Captions: CSV (header with an ``image``/``filepath``/``file`` column and a
``caption``/``text`` column) or JSONL (``{"image": "rel/path.jpg",
"caption": "..."}`` or ``{"image": ..., "captions": [...]}``); image paths
are relative to ``--images``. One record per (image, caption), keyed by the
image path, in ``OUT_DIR/00000.array_record``, ``00001...`` of
``--shard_size`` records (format in ``prolip_jax/data/record_format.py``). Image
bytes are stored unchanged. Undecodable or missing images, blank captions
and records over ``--max_record_bytes`` are skipped and counted; the totals
are printed and written to ``OUT_DIR/summary.json``. A missing ``--images``
folder or captions file, a CSV without image and caption columns and
captions that give no record at all are one line ``error: ...``, exit
status 2, with no shard half-written and no ``summary.json``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from prolip_jax import errors
from prolip_jax.conversion import common
from prolip_jax.conversion import image_folder
# pylint: enable=g-import-not-at-top,wrong-import-position


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--images', required=True, help='image folder')
  parser.add_argument('--captions', required=True,
                      help='captions .csv / .tsv / .jsonl')
  parser.add_argument('--shard_size', type=int, default=10000,
                      help='records per output shard')
  common.add_common_args(parser)
  args = parser.parse_args(argv)
  summary = image_folder.convert_folder(
      args.images, args.captions, args.output, shard_size=args.shard_size,
      max_record_bytes=args.max_record_bytes)
  common.print_summary(summary, args.output)
  return summary


if __name__ == '__main__':
  sys.exit(errors.cli_main(main))
