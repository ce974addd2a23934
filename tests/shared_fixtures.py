"""Fixtures several test modules use, registered for the whole suite by
``conftest.py`` (``pytest_plugins``), so that no test module imports another
for them. Plain helpers are in ``support.py``.

A module-scoped fixture here is built once per module that uses it, as it
was when the modules imported it from one another; ``workdir``, read only,
and ``two_process_losses`` are built once per session.
"""

import os

import numpy as np
import pytest

from prolip_jax.data import tokenizer as tok_lib
from prolip_jax.storage import checkpoint

import support


@pytest.fixture(scope='session')
def workdir(tmp_path_factory):
  """A workdir holding a randomly initialised tiny [UNC] model (32 wide,
  one layer per tower) at step 1 and a tokenizer trained on the digits'
  captions: what the evaluation tests load and score (read only)."""
  path = str(tmp_path_factory.mktemp('eval_workdir'))
  cfg, params = support.tiny_random_model(
      24, os.path.join(path, checkpoint.TOKENIZER_FILE))
  with checkpoint.manager(path) as mngr:
    checkpoint.save(mngr, 1, params, {'unused': np.zeros(1, np.float32)},
                    {'model': cfg.to_dict(), 'config': {}, 'step': 1},
                    force=True)
    mngr.wait_until_finished()
  return path


@pytest.fixture(scope='session')
def two_process_losses(tmp_path_factory):
  """The loss curve of an uninterrupted run of ``support.TwoProcesses``
  (``TWO_PROCESS_STEPS`` steps, local disk): what the two-host runs that
  are stopped and resumed must reproduce (trained once per session)."""
  workdir = tmp_path_factory.mktemp('two_process_reference')
  run = support.TwoProcesses(str(workdir / 'run'), workdir, 'reference')
  assert run.wait() == [0, 0], run.output(0)[-3000:]
  return support.metric_values(str(workdir / 'run'))


@pytest.fixture(scope='module')
def photos():
  """scikit-learn's two sample photos (427 x 640 RGB, uint8). Imported
  here, not when a test module is collected: ``sklearn.datasets`` took
  1.3 s of every pytest process's collection (2026-12-07, this 2-core
  VM)."""
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  return [np.asarray(x, np.uint8)
          for x in datasets.load_sample_images().images]


@pytest.fixture(scope='module')
def export_tool():
  """``tools/export_pytorch.py`` as a module."""
  return support.load_module('tools/export_pytorch.py', 'export_pytorch_r21')


@pytest.fixture(scope='module')
def import_tool():
  """``tools/import_pytorch.py`` as a module."""
  return support.load_module('tools/import_pytorch.py', 'import_pytorch_r21')


@pytest.fixture(scope='module')
def tokenizers(tmp_path_factory):
  """Two valid sentencepiece models trained on different captions."""
  d = tmp_path_factory.mktemp('tok')
  words = ['red', 'green', 'blue', 'cat', 'dog', 'bird', 'a', 'photo', 'of',
           'the', 'small', 'large', 'one', 'two', 'seven', 'digit']
  rng = np.random.default_rng(0)
  out = []
  for name, shift in (('a.model', 0), ('b.model', 5)):
    corpus = [' '.join(words[(j + shift) % len(words)] + 'xyz'[k % 3] * shift
                       for j, k in zip(rng.integers(0, 16, 6), range(6)))
              for _ in range(300)]
    out.append(tok_lib.train_tokenizer(corpus, str(d / name), 60))
  assert tok_lib.file_sha256(out[0]) != tok_lib.file_sha256(out[1])
  return out
