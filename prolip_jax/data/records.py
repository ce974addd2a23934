"""The former ``records`` module, kept as a name for code written against it.

Image-text records live in four modules now:

* ``record_format``: the array_record record format (MessagePack map of
  key, image bytes, caption), ``ShardWriter`` and the conversion markers;
* ``record_sources``: ``ArrayRecordSource``, ``TfdsSource`` /
  ``open_tfds``, shard path expansion, ``caption_corpus``;
* ``bad_records``: the reasons a record is unusable, ``BadRecord``,
  ``check_record`` and the training-time guard ``CheckedSource``;
* ``image_decode``: ``decode_rgb`` (here ``decode_image``) and
  ``train_min_pixels``.

New code imports those; every public name is re-exported here.
"""

# pylint: disable=unused-import
from prolip_jax.data.bad_records import BAD_CAPTION
from prolip_jax.data.bad_records import BadRecord
from prolip_jax.data.bad_records import BadRecordError
from prolip_jax.data.bad_records import check_image_bytes
from prolip_jax.data.bad_records import check_record
from prolip_jax.data.bad_records import CheckedSource
from prolip_jax.data.bad_records import CORRUPT_IMAGE
from prolip_jax.data.bad_records import EMPTY_CAPTION
from prolip_jax.data.bad_records import MISSING_CAPTION
from prolip_jax.data.bad_records import MISSING_IMAGE
from prolip_jax.data.bad_records import REASONS
from prolip_jax.data.bad_records import TOO_LONG
from prolip_jax.data.bad_records import UNREADABLE
from prolip_jax.data.image_decode import decode_rgb as decode_image
from prolip_jax.data.image_decode import train_min_pixels
from prolip_jax.data.record_format import DONE_SUFFIX
from prolip_jax.data.record_format import incomplete_conversions
from prolip_jax.data.record_format import num_records
from prolip_jax.data.record_format import parse_example
from prolip_jax.data.record_format import read_done_marker
from prolip_jax.data.record_format import read_shard
from prolip_jax.data.record_format import record_captions
from prolip_jax.data.record_format import serialize_example
from prolip_jax.data.record_format import ShardWriter
from prolip_jax.data.record_format import SUFFIX
from prolip_jax.data.record_format import SUMMARY_FILE
from prolip_jax.data.record_format import WRITER_OPTIONS
from prolip_jax.data.record_format import write_done_marker
from prolip_jax.data.record_sources import ArrayRecordSource
from prolip_jax.data.record_sources import caption_corpus
from prolip_jax.data.record_sources import expand_braces
from prolip_jax.data.record_sources import expand_paths
from prolip_jax.data.record_sources import import_tfds
from prolip_jax.data.record_sources import open_tfds
from prolip_jax.data.record_sources import tfds_source
from prolip_jax.data.record_sources import TfdsSource
