"""Which model operation each traced kernel computes: a trace joined to the
compiled HLO.

``kernel_profile.py`` adds up device time by kernel name, and on a GPU the
names of XLA's own fusions (``loop_multiply_fusion_12``) do not say what
they compute; with CUDA graphs on (XLA's default) the kernels are not even
tied to HLO instructions. Run the step with command buffers off and an HLO
dump beside the trace:

  XLA_FLAGS='--xla_gpu_enable_command_buffer= --xla_dump_to=/tmp/hlo \
      --xla_dump_hlo_as_text --xla_dump_hlo_module_re=train_step' \
  python benchmarks/train_step.py --config.batch_size=512 \
      --config.model.remat=False --profile_dir /tmp/trace

then ``python benchmarks/hlo_attribution.py --trace /tmp/trace --hlo /tmp/hlo
--steps 3`` prints where the time went by what the kernels compute
(``WHAT``: the exact GELU's erf, LayerNorm's rsqrt, reductions, the
optimizer's sqrt, softmax's exp, plain elementwise work) and by where in the
model (the jax op name of each fusion, layer indices folded together).

Each kernel event of the trace carries the HLO instruction it ran for (its
``hlo_op`` statistic: a fusion, a custom call, a copy); that instruction is
looked up in the optimized HLO text, and a fusion is described by the
opcodes of the computation it calls.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
from typing import Any, Iterable, Optional

_COMPUTATION = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$')
_INSTRUCTION = re.compile(
    r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\(')
_CALLS = re.compile(r'(?:calls|to_apply|body|condition)=%?([\w.\-]+)')
_CALLED_LIST = re.compile(r'called_computations=\{([^}]*)\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_LAYER = re.compile(r'(resblocks)_\d+')

# What a fusion computes, from the opcodes it holds; first match wins.
WHAT = (
    ('matmul / attention (library call)', {'custom-call'}),
    ('matmul (XLA dot)', {'dot'}),
    ('exact GELU (erf, erfc) and its derivative',
     {'erf', 'erfc', 'jax:erf', 'jax:erfc'}),
    ('tanh (GELU tanh, or a loss)', {'tanh', 'jax:tanh'}),
    ('LayerNorm (rsqrt)', {'rsqrt', 'jax:rsqrt'}),
    ('optimizer and norms (sqrt)', {'sqrt'}),
    ('softmax, sigmoid, log (exp/log)', {'exponential', 'log',
                                         'log-plus-one', 'logistic'}),
    ('reductions (bias/LayerNorm gradients, sums)', {'reduce'}),
    ('collectives', {'all-reduce', 'all-gather', 'reduce-scatter',
                     'collective-permute', 'all-to-all'}),
    ('layout (transpose, copy)', {'transpose', 'copy'}),
)
OTHER = 'plain elementwise (add, multiply, convert, select)'


def parse_hlo(text: str) -> dict[str, dict[str, Any]]:
  """``{instruction name: {'opcode', 'shape', 'op_name', 'calls',
  'computation'}}`` of an HLO module's text (every computation)."""
  out: dict[str, dict[str, Any]] = {}
  computation = None
  for line in text.splitlines():
    if ' = ' not in line:
      header = _COMPUTATION.match(line)
      if header:
        computation = header.group(1)
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    name, shape, opcode = m.groups()
    calls = _CALLS.findall(line)
    listed = _CALLED_LIST.search(line)
    if listed:
      calls += [c.strip().lstrip('%') for c in listed.group(1).split(',')]
    op_name = _OP_NAME.search(line)
    out[name] = {'opcode': opcode, 'shape': shape.strip(),
                 'op_name': op_name.group(1) if op_name else '',
                 'calls': calls, 'computation': computation}
  return out


def by_computation(instructions: dict[str, dict[str, Any]]
                   ) -> dict[str, list[str]]:
  """``{computation: [its instruction names]}`` of ``parse_hlo``'s answer."""
  out: dict[str, list[str]] = collections.defaultdict(list)
  for n, info in instructions.items():
    out[info['computation']].append(n)
  return out


def opcodes(instructions: dict[str, dict[str, Any]], name: str,
            members: Optional[dict[str, list[str]]] = None) -> set[str]:
  """The opcodes ``name`` runs: its own, and for a fusion (or a call) every
  opcode of the computations it calls, recursively; with ``jax:<primitive>``
  for the jax primitive each came from (XLA may expand an ``erf`` into
  exponentials, its op name still says ``erf``)."""
  if members is None:  # pass by_computation's answer when asking often
    members = by_computation(instructions)
  seen, found = set(), set()
  todo = [name]
  while todo:
    n = todo.pop()
    info = instructions.get(n)
    if info is None:
      continue
    found.add(info['opcode'])
    if info['op_name']:  # the jax primitive, kept where XLA expanded it
      found.add('jax:' + info['op_name'].rsplit('/', 1)[-1])
    for comp in info['calls']:
      if comp not in seen:
        seen.add(comp)
        todo += members.get(comp, [])
  found.discard('parameter')
  found.discard('fusion')
  return found


def what(ops: set[str]) -> str:
  """The ``WHAT`` label of a set of opcodes (``OTHER`` when none)."""
  for label, needs in WHAT:
    if ops & needs:
      return label
  return OTHER


def where(op_name: str, depth: int = 6) -> str:
  """A fusion's place in the model from its jax op name, layers folded
  (``resblocks_7`` -> ``resblocks_*``), the last ``depth`` parts kept."""
  parts = _LAYER.sub(r'\1_*', op_name).split('/')
  return '/'.join(parts[-depth:])


def op_times(planes: Iterable[Any]) -> dict[str, tuple[int, int]]:
  """``{hlo_op: (calls, total ns)}`` of the kernels of ``planes``: the
  events that carry an ``hlo_op`` statistic on the device planes' stream
  lines (GPU) or, with no device plane, on the host's XLA client threads
  (CPU, where the 'kernels' are XLA's thunks)."""
  planes = list(planes)
  device = [p for p in planes if p.name.startswith(('/device:GPU',
                                                    '/device:TPU'))]
  out: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
  for plane in device or planes:
    for line in plane.lines:
      if device and not (line.name.startswith('Stream')
                         or line.name == 'XLA Ops'):
        continue
      if device and line.name == 'XLA Ops' and any(
          l.name.startswith('Stream') for l in plane.lines):
        continue  # derived from the streams: would count twice
      for event in line.events:
        stats = dict(event.stats)
        op = stats.get('hlo_op')
        if not op:
          continue
        entry = out[str(op)]
        entry[0] += 1
        entry[1] += int(event.duration_ns)
  return {k: (v[0], v[1]) for k, v in out.items()}


def attribute(times: dict[str, tuple[int, int]],
              instructions: dict[str, dict[str, Any]], steps: int,
              top: int = 25) -> dict[str, Any]:
  """Per-step milliseconds by ``WHAT`` label, by place in the model, and
  for the ``top`` instructions. Instructions the HLO text lacks are
  'unknown' (a trace and a dump of different programs)."""
  total = sum(ns for _, ns in times.values())
  by_what: dict[str, int] = collections.defaultdict(int)
  by_where: dict[tuple[str, str], int] = collections.defaultdict(int)
  rows = []
  members = by_computation(instructions)
  for op, (calls, ns) in times.items():
    info = instructions.get(op)
    ops = opcodes(instructions, op, members) if info else set()
    label = what(ops) if info else 'unknown'
    place = where(info['op_name']) if info else ''
    by_what[label] += ns
    by_where[(label, place)] += ns
    rows.append({'op': op, 'what': label, 'where': place,
                 'calls_per_step': calls / steps, 'ms_per_step': ns / 1e6 /
                 steps, 'share': 100 * ns / total if total else 0.0,
                 'shape': info['shape'] if info else '',
                 'opcodes': sorted(ops)})
  ms = lambda ns: ns / 1e6 / steps
  share = lambda ns: 100 * ns / total if total else 0.0
  return {
      'steps': steps, 'ms_per_step': ms(total),
      'known_share': share(sum(ns for op, (_, ns) in times.items()
                               if op in instructions)),
      'by_what': [{'what': k, 'ms_per_step': ms(v), 'share': share(v)}
                  for k, v in sorted(by_what.items(), key=lambda kv: -kv[1])],
      'by_where': [{'what': k[0], 'where': k[1], 'ms_per_step': ms(v),
                    'share': share(v)}
                   for k, v in sorted(by_where.items(),
                                      key=lambda kv: -kv[1])[:top]],
      'top_ops': sorted(rows, key=lambda r: -r['ms_per_step'])[:top]}


def format_attribution(result: dict[str, Any]) -> str:
  """Markdown tables of ``attribute``'s answer."""
  lines = [f"Kernels tied to HLO: {result['ms_per_step']:.1f} ms per step "
           f"({result['known_share']:.0f}% found in the HLO dump; "
           f"{result['steps']} traced steps)", '',
           '| what the kernels compute | ms per step | share |', '|---|---|---|']
  lines += [f"| {r['what']} | {r['ms_per_step']:.2f} | {r['share']:.1f}% |"
            for r in result['by_what']]
  lines += ['', '| what | where (jax op name, layers folded) | ms per step '
            '| share |', '|---|---|---|---|']
  lines += [f"| {r['what']} | `{r['where'][-90:]}` | {r['ms_per_step']:.2f} "
            f"| {r['share']:.1f}% |" for r in result['by_where']]
  lines += ['', '| HLO op | what | calls/step | ms/step | shape | opcodes |',
            '|---|---|---|---|---|---|']
  lines += [f"| `{r['op']}` | {r['what']} | {r['calls_per_step']:g} | "
            f"{r['ms_per_step']:.2f} | `{r['shape'][:40]}` | "
            f"{' '.join(r['opcodes'])[:80]} |" for r in result['top_ops']]
  return '\n'.join(lines)


def newest_hlo(dump_dir: str, module: str = 'train_step') -> str:
  """The optimized HLO text of the newest ``module`` in an XLA dump."""
  paths = [p for p in glob.glob(os.path.join(dump_dir, '*after_optimizations'
                                             '*.txt'))
           if module in os.path.basename(p) and 'buffer' not in p
           and 'memory' not in p]
  if not paths:
    raise FileNotFoundError(f'no optimized HLO of {module!r} under {dump_dir}')
  return max(paths, key=lambda p: (os.path.getsize(p), os.path.getmtime(p)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--trace', required=True, help='jax.profiler.trace dir')
  parser.add_argument('--hlo', required=True, help='--xla_dump_to dir')
  parser.add_argument('--steps', type=int, default=3, help='traced steps')
  parser.add_argument('--module', default='train_step')
  args = parser.parse_args()
  from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top
  traces = glob.glob(os.path.join(args.trace, '**', '*.xplane.pb'),
                     recursive=True)
  data = ProfileData.from_file(max(traces, key=os.path.getmtime))
  with open(newest_hlo(args.hlo, args.module)) as f:
    instructions = parse_hlo(f.read())
  print(format_attribution(attribute(op_times(data.planes), instructions,
                                     args.steps)))


if __name__ == '__main__':
  main()
