"""The GPU check (benchmarks/gpu_check.sh) keeps working on the CPU.

CI has no GPU, so it runs the check with ``--skip_device``: every section at
toy sizes on the CPU, through the same shell wrapper a GPU machine uses.
The figures are checked against what they must be on a CPU: bf16 attention
differs from the float32 reference by bf16 rounding (not by nothing, not by
more), float32 attention equals it (the CPU's float32 matmuls are exact
float32), the step's pairs/s is its batch over its step time, and the demo's
held-out figure is the one its own metrics.jsonl holds.
"""

import json
import os
import subprocess

import numpy as np
import pytest

from support import xla_flags

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_runs_end_to_end_on_the_cpu(tmp_path):
  out = tmp_path / 'check'
  env = dict(os.environ, XLA_FLAGS=xla_flags(1))
  proc = subprocess.run(
      ['bash', os.path.join(REPO, 'benchmarks', 'gpu_check.sh'),
       '--skip_device', '--out', str(out),
       '--sections', 'env,attention,step:remat_dots,demo'],
      capture_output=True, text=True, timeout=600, env=env, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  results = json.loads((out / 'gpu_check.json').read_text())['results']
  assert set(results) == {'env', 'attention', 'step:remat_dots', 'demo'}
  assert all(r['ok'] for r in results.values()), results

  assert results['env']['backend'] == 'cpu'

  rows = results['attention']['rows']
  measured = [r for r in rows if 'skipped' not in r]
  assert {(r['case'], r['dtype']) for r in measured} == {
      (c, d) for c in ('image', 'text') for d in ('bfloat16', 'float32')}
  for r in measured:
    errors = [r[k] for k in ('out', 'dq', 'dk', 'dv')]
    if r['dtype'] == 'bfloat16':  # 8-bit mantissas: ~2^-9 per operand
      assert all(1e-3 < e < 1e-2 for e in errors), r
    else:
      assert all(e < 1e-6 for e in errors), r
  # No GPU: the cuDNN rows say so rather than pretending.
  assert all(r['skipped'] == 'no NVIDIA GPU' for r in rows
             if r['implementation'] == 'cudnn')

  step = results['step:remat_dots']
  assert step['remat'] and step['remat_policy'] == (
      'dots_with_no_batch_dims_saveable')
  assert step['samples_per_s'] == pytest.approx(
      step['batch'] / (step['step_ms'] / 1e3), rel=1e-9)
  assert np.isfinite(step['final_loss']) and step['xla_memory_bytes'] > 0

  demo = results['demo']
  with open(out / 'demo_workdir' / 'metrics.jsonl') as f:
    metrics = [json.loads(line) for line in f if line.strip()]
  held_out = [m for m in metrics if 'eval/zeroshot_csd_top1' in m][-1]
  assert demo['steps'] == 5
  assert demo['heldout_top1_csd'] == pytest.approx(
      100 * held_out['eval/zeroshot_csd_top1'])

  tables = (out / 'gpu_check.md').read_text()
  assert '| B/16 step |' in tables and '| attention |' in tables
  assert 'Sections failed: none' in tables
  assert tables.strip() in proc.stdout
