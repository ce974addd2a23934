"""Where a traced step's device time goes: kernels by category and by name.

Reads the ``*.xplane.pb`` that ``jax.profiler.trace`` writes, with
``jax.profiler.ProfileData`` (no TensorBoard needed), and adds up the
kernels that ran on the device's streams:

  summary = kernel_profile.summarize(trace_dir, steps=3)
  print(kernel_profile.format_summary(summary))

``benchmarks/train_step.py --profile_dir DIR`` and the GPU check's
``step:no_remat`` section trace a few steps of the real train step and
print this table (docs/gpu.md, "If MFU is low").
"""

from __future__ import annotations

import collections
import glob
import os
import re
from typing import Any, Iterable

# First match wins. Names as NVIDIA's and XLA's kernels are called: cuDNN's
# fused attention, cuBLAS/CUTLASS/nvJet/Triton matmuls, NCCL collectives,
# copies; the rest are XLA's own fusions (elementwise, reductions, LayerNorm,
# softmax outside cuDNN, the optimizer).
CATEGORIES = (
    ('attention (cuDNN fused)', re.compile(r'fmha|flash|cudnn', re.I)),
    ('matmul', re.compile(r'gemm|cutlass|cublas|xmma|nvjet|sm\d+_|'
                          r'triton_gemm|__dot|dot_', re.I)),
    ('collective', re.compile(r'nccl|all_reduce|all-reduce|allreduce|'
                              r'collective', re.I)),
    ('copy', re.compile(r'memcpy|memset|copy', re.I)),
)
OTHER = 'other XLA kernels (fusions, reductions)'
DEVICE_PLANES = ('/device:GPU', '/device:TPU')


def category(name: str) -> str:
  """The ``CATEGORIES`` label of a kernel name (``OTHER`` when none)."""
  for label, pattern in CATEGORIES:
    if pattern.search(name):
      return label
  return OTHER


def _kernel_lines(plane) -> list:
  # GPU planes hold one line per CUDA stream plus lines derived from them
  # ('XLA Ops', 'XLA Modules', 'Steps') that would count each kernel twice:
  # the streams where there are any, else XLA's op line (TPU planes).
  lines = list(plane.lines)
  streams = [line for line in lines if line.name.startswith('Stream')]
  return streams or [line for line in lines if line.name == 'XLA Ops']


def kernel_times(planes: Iterable[Any]) -> dict[str, tuple[int, int]]:
  """``{kernel name: (calls, total ns)}`` over the device planes.

  ``planes``: ``ProfileData.planes`` (objects with ``name`` and ``lines``,
  lines with ``name`` and ``events``, events with ``name`` and
  ``duration_ns``).
  """
  out: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
  for plane in planes:
    if not plane.name.startswith(DEVICE_PLANES):
      continue
    for line in _kernel_lines(plane):
      for event in line.events:
        entry = out[event.name]
        entry[0] += 1
        entry[1] += int(event.duration_ns)
  return {k: (v[0], v[1]) for k, v in out.items()}


def summarize_times(times: dict[str, tuple[int, int]], steps: int,
                    top: int = 20) -> dict[str, Any]:
  """Per-step milliseconds by category and for the ``top`` kernels.

  ``times``: ``kernel_times``'s answer for ``steps`` traced steps. Shares
  are of the summed kernel time (kernels on parallel streams overlap, so
  the sum can exceed the wall-clock step).
  """
  total_ns = sum(ns for _, ns in times.values())
  by_category: dict[str, int] = collections.defaultdict(int)
  for name, (_, ns) in times.items():
    by_category[category(name)] += ns
  share = lambda ns: 100.0 * ns / total_ns if total_ns else 0.0
  ms = lambda ns: ns / 1e6 / steps
  kernels = sorted(times.items(), key=lambda kv: -kv[1][1])[:top]
  return {
      'steps': steps, 'kernel_ms_per_step': ms(total_ns),
      'categories': [{'category': c, 'ms_per_step': ms(ns), 'share': share(ns)}
                     for c, ns in sorted(by_category.items(),
                                         key=lambda kv: -kv[1])],
      'top_kernels': [{'name': n, 'calls_per_step': calls / steps,
                       'ms_per_step': ms(ns), 'share': share(ns),
                       'category': category(n)}
                      for n, (calls, ns) in kernels]}


def summarize(trace_dir: str, steps: int, top: int = 20) -> dict[str, Any]:
  """``summarize_times`` of the newest trace under ``trace_dir``."""
  from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top
  paths = glob.glob(os.path.join(trace_dir, '**', '*.xplane.pb'),
                    recursive=True)
  if not paths:
    raise FileNotFoundError(f'no *.xplane.pb under {trace_dir}')
  data = ProfileData.from_file(max(paths, key=os.path.getmtime))
  planes = list(data.planes)
  summary = summarize_times(kernel_times(planes), steps, top)
  if not summary['categories']:
    summary['note'] = ('no device kernels in the trace (on a CPU there are '
                       'none to count); its planes: ' + '; '.join(
                           f"{p.name} [{', '.join(l.name for l in p.lines)}]"
                           for p in planes)[:500])
  return summary


def format_summary(summary: dict[str, Any]) -> str:
  """Two Markdown tables: time by category, then the top kernels."""
  if summary.get('note'):
    return summary['note']
  lines = [f"Device kernels, {summary['kernel_ms_per_step']:.1f} ms per step "
           f"summed over streams ({summary['steps']} traced steps):", '',
           '| category | ms per step | share |', '|---|---|---|']
  lines += [f"| {c['category']} | {c['ms_per_step']:.1f} | {c['share']:.1f}% |"
            for c in summary['categories']]
  lines += ['', '| kernel | category | calls per step | ms per step | share |',
            '|---|---|---|---|---|']
  for k in summary['top_kernels']:
    name = k['name'] if len(k['name']) <= 70 else k['name'][:67] + '...'
    lines.append(f"| `{name}` | {k['category']} | {k['calls_per_step']:g} | "
                 f"{k['ms_per_step']:.2f} | {k['share']:.1f}% |")
  return '\n'.join(lines)

