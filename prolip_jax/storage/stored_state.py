"""What a workdir holds when a run starts, read once.

A start opens one checkpoint manager, the one its run saves with
(``checkpoint.manager``), reads the stored state through it
(``StoredState.read``) and passes that down: the refusal of set-aside
checkpoints, ``init_from``, the drift check, the tokenizer check and the
restore all read it instead of opening the checkpoints again. On an object
store every opening is a round of listings and every meta item a request.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import orbax.checkpoint as ocp

from prolip_jax.storage import checkpoint
from prolip_jax.storage.workdir import Workdir


def newest_meta(mngr: ocp.CheckpointManager
                ) -> Optional[tuple[int, dict[str, Any]]]:
  """``(step, meta)`` of the newest checkpoint whose meta reads, or None."""
  for step in sorted(mngr.all_steps(), reverse=True):
    try:
      return step, checkpoint.read_meta(mngr, step)
    except Exception:  # pylint: disable=broad-except
      continue  # reported when its arrays fail to restore
  return None


@dataclasses.dataclass(frozen=True)
class StoredState:
  """The checkpoints of a workdir at a run's start.

  ``steps``: the checkpointed steps, oldest first (as the manager listed
  them when it opened); ``newest``: ``(step, meta)`` of the newest step
  whose meta item reads, or None; ``set_aside``: the names under
  ``checkpoints_unreadable/`` (steps an earlier run set aside as
  unreadable).
  """
  steps: tuple[int, ...]
  newest: Optional[tuple[int, dict[str, Any]]]
  set_aside: tuple[str, ...]

  @classmethod
  def read(cls, mngr: ocp.CheckpointManager, workdir: Workdir
           ) -> StoredState:
    """The steps ``mngr`` listed, the newest one's meta and ``workdir``'s
    set-aside folder."""
    aside = workdir.unreadable
    held = tuple(sorted(p.name for p in aside.iterdir())) if (
        aside.is_dir()) else ()
    return cls(tuple(sorted(mngr.all_steps())), newest_meta(mngr), held)
