"""Every host of a multi-host run starts with the same settings and code.

Hosts started with different configs (a flag given to one host only) or a
different checkout each run their own schedule: they meet in different
collectives and wait for each other forever (measured: process 0 in a
metrics flush, process 1 in the final save's barrier, both alive after
400 s). So before any step, ``check`` gathers a digest of every host's
flattened config and of the package's source; where they differ, every
host gathers every host's flattened config too and stops with the same
one line naming the keys that differ (``errors.ConfigError``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Any

import jax
from jax.experimental import multihost_utils
import numpy as np

from prolip_jax import errors

CODE_KEY = '(the prolip_jax code)'
# Keys named in the line; the rest are counted.
SHOWN_KEYS = 8


@functools.lru_cache(maxsize=None)
def code_digest() -> str:
  """A digest of the package's Python source (the code every host runs)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  digest = hashlib.sha256()
  for folder, dirs, files in os.walk(root):
    dirs.sort()
    for name in sorted(f for f in files if f.endswith('.py')):
      path = os.path.join(folder, name)
      digest.update(os.path.relpath(path, root).encode() + b'\0')
      with open(path, 'rb') as f:
        digest.update(f.read())
  return digest.hexdigest()[:16]


def _flatten(value: Any, prefix: str, out: dict[str, str]):
  if isinstance(value, dict) and value:
    for key in sorted(value):
      _flatten(value[key], f'{prefix}.{key}' if prefix else str(key), out)
  else:
    out[prefix] = json.dumps(value, sort_keys=True)


def settings(config) -> dict[str, str]:
  """``config`` as dotted keys -> JSON values, plus the code's digest."""
  out: dict[str, str] = {}
  _flatten(json.loads(config.to_json_best_effort()), '', out)
  out[CODE_KEY] = code_digest()
  return out


def differences(mine: dict[str, str], chief: dict[str, str]) -> list[str]:
  """The keys whose values differ (or that only one side has), sorted."""
  return sorted(k for k in set(mine) | set(chief)
                if mine.get(k) != chief.get(k))


def message(by_process: list[dict[str, str]]) -> str:
  """The one line naming, for each process that differs from process 0,
  the keys that differ (with both values for the first few)."""
  chief = by_process[0]
  parts = []
  for index, mine in enumerate(by_process[1:], start=1):
    keys = differences(mine, chief)
    if not keys:
      continue
    shown = ', '.join(
        f'{k} ({chief.get(k, "unset")} on process 0, '
        f'{mine.get(k, "unset")} on process {index})' if k != CODE_KEY else
        f'{k} (another checkout or version)' for k in keys[:SHOWN_KEYS])
    more = len(keys) - SHOWN_KEYS
    parts.append(f'process {index}: {shown}'
                 + (f' and {more} more key(s)' if more > 0 else ''))
  return ('the hosts of this run were started with different settings, '
          'which would leave them waiting for each other: '
          + '; '.join(parts) + '; start every host with the same command '
          'line, config file and prolip_jax version')


def gather_bytes(data: bytes) -> list[bytes]:
  """Every process's ``data`` (collective: every process calls it)."""
  sizes = multihost_utils.process_allgather(np.int32(len(data)))
  buffer = np.zeros(int(np.max(sizes)), np.uint8)
  buffer[:len(data)] = np.frombuffer(data, np.uint8)
  gathered = np.asarray(multihost_utils.process_allgather(buffer))
  return [gathered[i, :int(n)].tobytes()
          for i, n in enumerate(np.asarray(sizes).reshape(-1))]


def check(config):
  """Raises ``errors.ConfigError`` on every host, with the same line, when
  the hosts' settings or code differ. A no-op with one process. A
  collective: every process calls it at the same point of its start-up."""
  if jax.process_count() == 1:
    return
  mine = settings(config)
  text = json.dumps(mine, sort_keys=True).encode()
  digest = np.frombuffer(hashlib.sha256(text).digest(), np.uint32)
  digests = np.asarray(multihost_utils.process_allgather(digest))
  if (digests == digests[0]).all():
    return
  by_process = [json.loads(b) for b in gather_bytes(text)]
  raise errors.ConfigError(message(by_process))
