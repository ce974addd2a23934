"""What ``prolip_jax.aot`` reads from a compiled step: collectives from the
HLO text, and the table it prints (the analytic FLOP count and the chips'
datasheet figures are ``prolip_jax.training.mfu``'s).

Pure functions on strings and numbers (no jax), so they are tested fast.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from prolip_jax.training.mfu import GIB

# Collective kinds reported, as XLA names them (asynchronous forms end in
# -start/-done; the -done op carries the result shape).
COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter',
               'collective-permute', 'all-to-all')


_DTYPE_BYTES = {'pred': 1, 's4': 1, 'u4': 1, 's8': 1, 'u8': 1, 'f8e4m3fn': 1,
                'f8e5m2': 1, 'bf16': 2, 'f16': 2, 's16': 2, 'u16': 2,
                'f32': 4, 's32': 4, 'u32': 4, 'f64': 8, 's64': 8, 'u64': 8,
                'c64': 8, 'c128': 16, 'token': 0}
_ARRAY = re.compile(r'\b([a-z]+\d*[a-z\d]*)\[([\d,]*)\]')
_COMPUTATION = re.compile(r'^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$')
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def shape_arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """``[(dtype, dims), ...]`` of an HLO shape string (array or tuple)."""
  out = []
  for dtype, dims in _ARRAY.findall(shape):
    if dtype in _DTYPE_BYTES:
      out.append((dtype, tuple(int(d) for d in dims.split(',') if d)))
  return out


def shape_bytes(shape: str) -> int:
  """Bytes of every array in an HLO shape string."""
  total = 0
  for dtype, dims in shape_arrays(shape):
    n = 1
    for d in dims:
      n *= d
    total += n * _DTYPE_BYTES[dtype]
  return total


def _split_instruction(line: str) -> Optional[tuple[str, str, str]]:
  """``(shape, opcode, rest)`` of one HLO instruction line, or None."""
  if '=' not in line:
    return None
  rhs = line.split('=', 1)[1].lstrip()
  if rhs.startswith('('):  # a tuple shape: up to its balancing paren
    depth = 0
    for i, ch in enumerate(rhs):
      depth += ch == '('
      depth -= ch == ')'
      if depth == 0:
        break
    shape, rest = rhs[:i + 1], rhs[i + 1:].lstrip()
  else:
    parts = rhs.split(' ', 1)
    if len(parts) < 2:
      return None
    shape, rest = parts
  m = re.match(r'([\w\-]+)\(', rest)
  if not m:
    return None
  return shape, m.group(1), rest


def _condition_bound(lines: list[str]) -> Optional[int]:
  """N of a loop condition ``counter < N`` (a ``fori_loop`` from 0, as the
  TPU compiler leaves it without a recorded trip count), else None."""
  root = [l for l in lines if l.lstrip().startswith('ROOT')]
  if not root or 'direction=LT' not in root[0]:
    return None
  consts = [int(c) for l in lines
            for c in re.findall(r'\bs32\[\][^=]*?constant\((\d+)\)', l)]
  return consts[0] if len(consts) == 1 else None


def collectives(hlo_text: str) -> dict[str, Any]:
  """Collectives of a compiled module, as executed once per step.

  Returns ``{kind: {'count': n, 'bytes': b}}`` for every kind of
  ``COLLECTIVES`` (result bytes per device, summed), ``'ops'``: one
  ``(kind, shape, times)`` per instruction, and ``'unknown_trip_counts'``:
  while loops whose trip count XLA did not record (their collectives are
  counted once). A collective inside a ``while`` body runs once per
  iteration (the ring's ``fori_loop``), so it counts ``known_trip_count``
  times (or N of a ``counter < N`` loop condition); branches of a conditional count once each (an upper bound).
  """
  comps: dict[str, list[str]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    m = _COMPUTATION.match(line)
    if m and '=' not in line.split('{', 1)[0].split('(', 1)[0]:
      current = m.group(2)
      comps[current] = []
      if m.group(1):
        entry = current
      continue
    if current is not None:
      if line.strip() == '}':
        current = None
      else:
        comps[current].append(line)
  if entry is None:
    raise ValueError('no ENTRY computation in the HLO text')

  times: dict[str, int] = {}
  unknown = 0
  stack = [(entry, 1)]
  while stack:  # the call graph of an HLO module is a DAG
    name, n = stack.pop()
    if name not in comps:
      continue
    times[name] = times.get(name, 0) + n
    for line in comps[name]:
      trip = 1
      body = re.search(r'\bbody=%?([\w.\-]+)', line)
      if body:
        found = _TRIP_COUNT.search(line)
        cond = re.search(r'\bcondition=%?([\w.\-]+)', line)
        if found:
          trip = int(found.group(1))
        elif cond and _condition_bound(comps.get(cond.group(1), [])):
          trip = _condition_bound(comps[cond.group(1)])
        else:
          unknown += 1
        stack.append((body.group(1), n * trip))
      for key in ('calls', 'true_computation', 'false_computation'):
        for callee in re.findall(rf'\b{key}=%?([\w.\-]+)', line):
          stack.append((callee, n))
      branches = re.search(r'branch_computations=\{([^}]*)\}', line)
      if branches:
        for callee in branches.group(1).split(','):
          stack.append((callee.strip().lstrip('%'), n))

  out: dict[str, Any] = {k: {'count': 0, 'bytes': 0} for k in COLLECTIVES}
  ops = []
  for name, n in times.items():
    for line in comps[name]:
      parsed = _split_instruction(line)
      if parsed is None:
        continue
      shape, opcode, _ = parsed
      kind = opcode[:-len('-done')] if opcode.endswith('-done') else opcode
      if kind not in out:
        continue
      out[kind]['count'] += n
      out[kind]['bytes'] += n * shape_bytes(shape)
      ops.append((kind, shape, n))
  out['ops'] = ops
  out['unknown_trip_counts'] = unknown
  return out


def has_square_gather(ops, batch: int) -> bool:
  """Whether an all-gather's result holds a ``batch x batch`` (or larger)
  matrix: the logits of a gathered-dense loss."""
  for kind, shape, _ in ops:
    if kind != 'all-gather':
      continue
    for _, dims in shape_arrays(shape):
      if sum(d >= batch for d in dims) >= 2:
        return True
  return False


# ----------------------------------------------------------------------------
# The report


def format_table(report: dict[str, Any]) -> str:
  """The labelled table ``prolip_jax.aot`` prints."""
  r = report
  mem = r.get('memory') or {}
  lines = [f"prolip_jax.aot: {r['config']} on {r['topology']} "
           f"({r['num_devices']} x {r['chip']}), mesh {r['mesh']}"]

  def row(label, value):
    lines.append(f'  {label:<34s} {value}')

  row('batch', f"{r['per_device_batch']} per device, "
               f"{r['global_batch']} global")
  row('compile time', f"{r['compile_seconds']:.1f} s")
  if r.get('error'):
    row('does not compile', r['error'])
  if mem:
    hbm = r['hbm_bytes']
    row('memory per device: arguments', f"{mem['arguments'] / GIB:.2f} GiB")
    row('                   temporaries',
        f"{mem['temporaries'] / GIB:.2f} GiB")
    row('                   outputs (not aliased)',
        f"{mem['outputs_not_aliased'] / GIB:.2f} GiB")
    row('                   total', f"{mem['total'] / GIB:.2f} GiB of "
        f"{hbm / GIB:.1f} GiB HBM ({100 * mem['total'] / hbm:.0f}%): "
        f"{'fits' if r['fits'] else 'does NOT fit'}")
  elif r.get('needed_bytes'):
    row('memory per device (compiler)', f"needs {r['needed_bytes'] / GIB:.2f}"
        f" GiB of {r['hbm_bytes'] / GIB:.1f} GiB HBM: does NOT fit")
  p = r.get('params') or {}
  if p:
    row('parameters', f"{p['count'] / 1e6:.1f} M; FSDP-sharded "
        f"{p['sharded_bytes'] / 2**20:.1f} MiB in {p['sharded_leaves']} "
        f"arrays, replicated {p['replicated_bytes'] / 2**20:.1f} MiB in "
        f"{p['replicated_leaves']} arrays (floor "
        f"{p['fsdp_min_size_mb']} MiB)")
  f = r.get('flops') or {}
  if f:
    xla = f.get('xla_per_pair')
    row('FLOPs per pair: analytic (model)',
        f"{f['analytic_per_pair'] / 1e9:.1f} GFLOP (3 x forward, no remat)")
    if xla:
      row('FLOPs per pair: XLA cost analysis', f'{xla / 1e9:.1f} GFLOP '
          f"(per device {f['xla_per_device'] / 1e12:.2f} TFLOP/step)")
    elif r.get('cost_note'):
      row('FLOPs per pair: XLA cost analysis', r['cost_note'])
    else:
      row('FLOPs per pair: XLA cost analysis', 'not available (XLA gives '
          'none for this target; deviceless GPU compiles have none)')
  e = r.get('estimate') or {}
  if f and not e:
    row('step time', 'no compiler estimate ' + (
        'under model.scan' if r.get('cost_note') else 'for this target'))
  if e:
    row('step time', f"{e['step_seconds']:.3f} s  [compiler estimate, "
        'not a measurement]')
    row('pairs/s per chip', f"{e['pairs_per_second_per_chip']:.0f}  "
        '[compiler estimate]')
    row('MFU', f"{100 * e['mfu']:.1f}% of {r['peak_flops'] / 1e12:.0f} "
        'TFLOP/s bf16 peak  [compiler estimate]')
  if f:
    row('peak-FLOPs ceiling', f"{f['ceiling_pairs_per_second']:.0f} "
        'pairs/s per chip at 100% MFU')
  c = r.get('collectives') or {}
  if c:
    for kind in COLLECTIVES:
      row(f'collectives: {kind}', f"{c[kind]['count']} ops, "
          f"{c[kind]['bytes'] / 2**20:.1f} MiB per step")
  if r.get('cudnn_attention_calls') is not None:
    row('cuDNN fused attention calls', str(r['cudnn_attention_calls']))
  lb = r.get('loss_memory')
  if lb:
    for form in ('ring', 'gathered'):
      if form in lb:
        row(f'loss alone, {form}', f"{lb[form]['temporaries'] / 2**20:.1f} "
            'MiB temporaries per device')
  if r.get('max_per_device_batch') is not None:
    row('largest per-device batch', f"{r['max_per_device_batch']} "
        f"({r['max_batch_search']})")
  return '\n'.join(lines)


def format_loss_table(config: str, topology: str, per_device_batch: int,
                      losses: dict[str, Any]) -> str:
  """The ``--loss_only`` table: the loss and its gradient alone, per device,
  blockwise ring vs gathered dense."""
  ring = losses['ring']
  lines = [f'prolip_jax.aot --loss_only: {config} on {topology}, '
           f"{per_device_batch} per device, {ring['global_batch']} global"]
  for form, r in losses.items():
    c = r['collectives']
    moved = ', '.join(f"{k} {c[k]['bytes'] / 2**20:.1f} MiB"
                      for k in COLLECTIVES if c[k]['bytes']) or 'none'
    lines.append(
        f"  {form:<9s} temporaries {r['temporaries'] / 2**20:10.1f} MiB, "
        f"total {r['memory']['total'] / 2**20:10.1f} MiB; collectives per "
        f'step: {moved}')
  return '\n'.join(lines)


def json_line(report: dict[str, Any]) -> str:
  """The report as one JSON line (``ops`` left out)."""
  r = dict(report)
  if r.get('collectives'):
    r['collectives'] = {k: v for k, v in r['collectives'].items()
                        if k != 'ops'}
  return json.dumps(r, sort_keys=True)
