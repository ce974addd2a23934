"""webdataset tars, or an image folder plus captions, -> array_record shards on Apache Beam.

python tools/convert_beam.py --input 'gs://b/cc3m/{00000..00331}.tar' \
    --output gs://b/cc3m_ar [--max_record_bytes 8388608] [Beam options]
python tools/convert_beam.py --images DIR --captions captions.jsonl \
    --output OUT_DIR [--shard_size 10000] [Beam options]

The same shards, ``.done`` markers, skip counts and ``summary.json`` as
``tools/convert_webdataset.py`` and ``tools/convert_folder.py`` (the
pipeline: ``prolip_jax/conversion/beam.py``), on any Beam runner. Every
option this tool does not know is Beam's: ``--runner=DirectRunner
--direct_num_workers=4 --direct_running_mode=multi_processing`` on one
machine (the default is the DirectRunner in one process), or the Dataflow,
Flink and Spark options of docs/data.md; Beam checks them before any output
(an unknown runner is one ``error:`` line). Paths may be local or ``gs://``
(Beam's file systems). Needs ``pip install 'prolip_jax[beam]'``.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from prolip_jax import errors
from prolip_jax.conversion import beam
from prolip_jax.conversion import common
# pylint: enable=g-import-not-at-top,wrong-import-position


def _refuse_typos(parser: argparse.ArgumentParser, beam_args: list[str]):
  """Options this tool does not know go to Beam, which only logs a warning
  for one it does not know either; one that looks like this tool's own
  (``--shard-size``) is refused here instead of ignored."""
  beam.require_beam()
  from apache_beam.options import pipeline_options  # pylint: disable=g-import-not-at-top
  beams = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
  for cls in {str(c): c for c in
              pipeline_options.PipelineOptions.__subclasses__()}.values():
    cls._add_argparse_args(beams)  # pylint: disable=protected-access
  _, unknown = beams.parse_known_args(beam_args)
  ours = [o for a in parser._actions for o in a.option_strings]  # pylint: disable=protected-access
  for arg in unknown:
    name = arg.split('=', 1)[0]
    close = difflib.get_close_matches(name.replace('-', '_'), ours, 1, 0.8)
    if name.startswith('--') and close:
      raise errors.ConfigError(f'unknown option {name}: did you mean '
                               f'{close[0]}?')


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0],
                                   allow_abbrev=False)
  parser.add_argument('--input', action='append',
                      help='tar shards: brace pattern, glob or folder '
                      '(repeatable)')
  parser.add_argument('--images', help='image folder (with --captions)')
  parser.add_argument('--captions',
                      help='captions .csv / .tsv / .jsonl (local)')
  parser.add_argument('--shard_size', type=int, default=10000,
                      help='records per output shard (folder layout)')
  common.add_common_args(parser)
  args, beam_args = parser.parse_known_args(argv)
  _refuse_typos(parser, beam_args)
  if bool(args.input) == bool(args.images or args.captions):
    raise errors.ConfigError('give either --input (tars) or --images and '
                             '--captions (an image folder)')
  if args.input:
    summary = beam.convert_webdataset(
        args.input, args.output, max_record_bytes=args.max_record_bytes,
        pipeline_args=beam_args)
  else:
    if not (args.images and args.captions):
      raise errors.ConfigError('--images and --captions go together')
    summary = beam.convert_folder(
        args.images, args.captions, args.output, shard_size=args.shard_size,
        max_record_bytes=args.max_record_bytes, pipeline_args=beam_args)
  common.print_summary(summary, args.output)
  return summary


if __name__ == '__main__':
  sys.exit(errors.cli_main(main))
