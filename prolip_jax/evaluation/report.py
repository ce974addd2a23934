"""Every printed report of an evaluation, in one set of units and labels.

* ``format_table(metrics)``: the table ``python -m prolip_jax.evaluate``
  prints. It turns ``{suite/key: value}`` (``summary.json``'s ``metrics``,
  raw fractions) into ``suite  metric  value`` rows.
* ``format_summary(summary)``: the lines printed at the end of a training
  run (its held-out evaluation, ``kinds/heldout.py``, and the other
  ``config.evals``).
* ``heldout_line`` / ``evaluator_line``: the one-line progress reports of
  the training loop's evaluations.

All of them share the formats: accuracies, recalls and other fractions of
samples as percentages with one decimal (``pct``), retrieval recalls
grouped as ``R@1/5/10``, the same labels where the same metric appears
(``zero-shot top-1, CSD``, ``describe``), and sigma^2 labelled as per
dimension (mean of exp(logvar), what training prints) or as the trace
tr(Sigma) = sum_d exp(logvar_d) (paper 4.3), small values through
``number``. Each evaluator kind declares how its metric keys are shown
beside itself (``Evaluator.LABELS``, a tuple of ``Label``, in
``kinds/<kind>.py``); a key without a label keeps its name and is shown as
a number.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import shlex
from typing import Any, Callable, Mapping, NamedTuple

from prolip_jax.evaluation import kinds

_METRIC_NAMES = {'csd': 'CSD', 'cosine': 'cosine'}


def pct(x: float) -> str:
  """A fraction as a percentage with one decimal, as training prints it."""
  return f'{100 * x:.1f}%'


def count(x: Any) -> str:
  """A count with thousands separators (``12,345``); other numbers as
  ``number``, 'n/a' for None or NaN (an empty population)."""
  if isinstance(x, bool):
    return str(x)
  if isinstance(x, int):
    return f'{x:,}'
  if x is None or x != x:  # NaN: an empty population
    return 'n/a'
  return number(x)


def signed(x: float) -> str:
  """A correlation with its sign and two decimals (``+0.42``)."""
  return 'n/a' if x is None or x != x else f'{x:+.2f}'


def number(x: Any, digits: int = 3) -> str:
  """The one text format of a measured value that can be small (sigma^2, a
  learning rate, a loss term), in tables, progress lines and figures:
  ``digits`` significant digits, plain from 0.01 up (``0.731``, ``42.1``),
  scientific below as ``2.58e-3`` (no padded exponent); 'n/a' for None,
  'nan' / 'inf' for those (a skipped step's figures)."""
  if x is None:
    return 'n/a'
  if x != x or abs(x) == float('inf'):
    return str(float(x))
  if x == 0 or 1e-2 <= abs(x) < 1e4:
    return f'{x:.{digits}g}'
  mantissa, exponent = f'{x:.{digits - 1}e}'.split('e')
  return f'{mantissa}e{int(exponent)}'


def _view_name(key: str) -> str:
  """'image_75pct_patches_dropped' -> 'image, 75% patches dropped' (the
  inverse of the uncertainty report's key spelling)."""
  kind, _, rest = key.partition('_')
  return f'{kind}, ' + rest.replace('pct', '%').replace('_', ' ')


class Label(NamedTuple):
  """How an evaluator kind's metric keys matching ``pattern`` (matched in
  full) are shown: ``text`` (``str.format`` with the match's groups) and
  the value in ``fmt`` (``pct``, ``number``, ``signed``, ``count``...).
  A group holding '_' is a view key, shown as the uncertainty report's
  view ('image, 75% patches dropped'); ``csd`` is 'CSD'; other groups as
  ``names`` (the kind's own words) spells them, else as they are."""
  pattern: str
  text: str
  fmt: Callable[[Any], str]
  names: Mapping[str, str] = {}


def kind_labels(kind: str) -> tuple[Label, ...]:
  """The ``LABELS`` the kind ``kind`` declares beside itself
  (``kinds/<kind>.py``'s ``Evaluator.LABELS``), in order; () for a name
  that is no kind."""
  if kind not in {m.name for m in pkgutil.iter_modules(kinds.__path__)}:
    return ()
  module = importlib.import_module(f'{kinds.__name__}.{kind}')
  return tuple(module.Evaluator.LABELS)


def _group_text(group: str, names: Mapping[str, str]) -> str:
  if '_' in group:
    return _view_name(group)
  return _METRIC_NAMES.get(group, names.get(group, group))


def describe(suite: str, key: str, value: Any) -> tuple[str, str]:
  """``(label, formatted value)`` of one metric of the kind ``suite``, by
  the first of its ``kind_labels`` that matches; a key without one keeps
  its name and is shown as a number."""
  for label in kind_labels(suite):
    m = re.fullmatch(label.pattern, key)
    if m is None:
      continue
    text = label.text.format(*[_group_text(g, label.names)
                               for g in m.groups()])
    try:
      return text, label.fmt(value)
    except (TypeError, ValueError):  # not a number: show it as it is
      return text, str(value)
  return key, count(value) if isinstance(value, (int, float)) else str(value)


_RECALL = re.compile(r'(?:(csd|cosine)_)?(i2t|t2i)_R@(\d+)')
_DIRECTIONS = {'i2t': 'image -> text', 't2i': 'text -> image'}


def _split(name: str, kinds: dict[str, str] | None) -> tuple[str, str, str]:
  """``(shown name, kind whose rules apply, key)`` of a metric name:
  ``imagenet/csd_top1`` is evaluator ``imagenet`` of kind
  ``kinds['imagenet']``; without ``kinds`` the name is taken for the
  kind."""
  prefix, _, rest = name.partition('/')
  kind = (kinds or {}).get(prefix)
  if kind is not None:
    return prefix, kind, rest
  return prefix, prefix, rest


def _recall_row(direction: str, metric: str | None,
                recalls: list[tuple[int, float]]) -> tuple[str, str]:
  """``('retrieval image -> text R@1/5/10[, CSD]', '40.0% / 81.2% / ...')``
  of one direction's ``(k, recall)`` pairs."""
  label = (f'retrieval {_DIRECTIONS[direction]} R@'
           + '/'.join(str(k) for k, _ in recalls)
           + (f', {_METRIC_NAMES.get(metric, metric)}' if metric else ''))
  return label, ' / '.join(pct(v) for _, v in recalls)


def _retrieval_rows(items: list) -> tuple[list, set]:
  """Recalls of one metric and direction grouped into one row like
  training's ``retrieval image -> text R@1/5/10``; returns the rows and the
  names they used."""
  groups: dict[tuple, dict[int, tuple]] = {}
  for shown, _, key, value, name in items:
    m = _RECALL.fullmatch(key)
    if m:
      groups.setdefault((shown, m.group(1), m.group(2)), {})[int(
          m.group(3))] = (name, value)
  rows, used = [], set()
  for (shown, metric, direction), by_k in groups.items():
    ks = sorted(by_k)
    label, value = _recall_row(direction, metric,
                               [(k, by_k[k][1]) for k in ks])
    rows.append((shown, label, value, by_k[ks[0]][0]))
    used.update(by_k[k][0] for k in ks)
  return rows, used


def format_table(metrics: dict[str, Any], notes: bool = True,
                 kinds: dict[str, str] | None = None) -> str:
  """``suite  metric  value`` rows for the printed summary, in the order of
  ``metrics`` (retrieval recalls grouped at their first R@k), followed by
  one line on units when ``notes``. ``kinds`` maps evaluator names (the
  first part of a metric name) to their kind (``evaluator.kind_names()``)."""
  items = [(*_split(name, kinds), value, name)
           for name, value in metrics.items()]
  grouped, used = _retrieval_rows(items)
  first = {r[3]: r for r in grouped}
  rows = []
  for shown, suite, key, value, name in items:
    if name in first:
      rows.append(first[name][:3])
    if name in used:
      continue
    rows.append((shown, *describe(suite, key, value)))
  w1 = max([len(r[0]) for r in rows] + [5])
  w2 = max([len(r[1]) for r in rows] + [6])
  lines = [f'{"suite":{w1}s}  {"metric":{w2}s}  value',
           '-' * (w1 + w2 + 12)]
  for suite, label, value in rows:
    lines.append(f'{suite:{w1}s}  {label:{w2}s}  {value}')
  if notes and rows:
    lines.append('(summary.json and <name>.json hold the same metrics as '
                 'fractions; sigma^2 per dimension = tr(Sigma) / dim)')
  return '\n'.join(lines)


def heldout_header(dataset: str, count: int) -> str:
  """The summary's header line of the held-out evaluation."""
  if dataset == 'emoji':
    return (f'Held-out emoji ({count:,} images whose names were never trained '
            'on):')
  return f'Held-out {dataset} ({count:,} images never trained on):'



# The figures of the one-line held-out report, in its order.
_HELDOUT_LINE = (('zeroshot_csd_top1', 'top-1 CSD'),
                 ('zeroshot_cosine_top1', 'cosine'),
                 ('i2t_R@1', 'image->text R@1'),
                 ('sigma2_img', 'sigma^2 images'),
                 ('sigma2_captions', 'captions'))


def heldout_line(dataset: str, step: int, results: dict[str, float]) -> str:
  """``Held-out digits at step 300: top-1 CSD 93.1%, ...``: the figures of
  a periodic held-out evaluation, accuracies in percent, sigma^2 in the
  summary's format."""
  parts = []
  for key, label in _HELDOUT_LINE:
    if key in results:
      value = results[key]
      parts.append(f'{label} {number(value)}' if key.startswith('sigma2')
                   else f'{label} {pct(value)}')
  return f'Held-out {dataset} at step {step}: ' + ', '.join(parts)


def evaluator_line(name: str, metrics: dict[str, float]) -> str:
  """A one-line report for the progress output: accuracies and recalls as
  percentages, e.g. ``imagenet: csd_top1 61.2%, cosine_top1 60.8%``."""
  keys = [k for k in metrics if k.endswith(('top1', 'R@1'))] or list(metrics)
  parts = []
  for k in keys[:6]:
    v = metrics[k]
    shown = pct(v) if ('top' in k or 'R@' in k or 'more_uncertain' in k) \
        else number(v)
    parts.append(f'{k} {shown}')
  return f'{name}: ' + ', '.join(parts)


def format_summary(summary: dict[str, Any]) -> str:
  """The lines printed at the end of a training run: what was reached, the
  held-out evaluation labelled with its protocol, where the checkpoint is
  and the next commands."""
  step = summary['step']
  lines = []
  if summary.get('interrupted'):
    lines.append(f'Interrupted (Ctrl-C) at step {step}, checkpoint saved; '
                 'resume with the same command.')
  elif summary.get('preempted'):
    lines.append(f'Stopped by SIGTERM at step {step}; resume with the same '
                 'command.')
  else:
    lines.append(f'Finished at step {step} of {summary.get("total_steps", step)}'
                 + (f' ({step * summary["batch_size"]:,} pairs).'
                    if summary.get('batch_size') else '.'))
  ev = dict(summary.get('eval') or {})
  if ev:
    heldout = summary.get('heldout') or {'dataset': 'digits', 'images': 1000}
    lines.append(heldout_header(heldout['dataset'], heldout['images']))
    # Training's names (``zeroshot_csd_top1``) in the zero-shot suite's rules.
    for k in (1, 5):
      for metric in ('csd', 'cosine'):
        key = f'zeroshot_{metric}_top{k}'
        if key in ev:
          label, value = describe('zero_shot', key[len('zeroshot_'):],
                                  ev.pop(key))
          lines.append(f'  {label:36s} {value}')
    for direction in _DIRECTIONS:
      keys = [f'{direction}_R@{k}' for k in (1, 5, 10)]
      if all(k in ev for k in keys):
        label, value = _recall_row(direction, None, [
            (k, ev.pop(key)) for k, key in zip((1, 5, 10), keys)])
        lines.append(f'  {label:36s} {value}')
    if any(k.startswith(('i2t', 't2i')) for k in summary.get('eval', {})):
      lines.append('    (one caption per image, its most specific; '
                   '`prolip_jax.evaluate` ranks every caption of an image, '
                   'so its recalls differ)')
    sig = [(label, ev.pop(key)) for label, key in (
        ('images', 'sigma2_img'), ('captions', 'sigma2_captions'),
        ('prompts', 'sigma2_prompts')) if key in ev]
    if sig:
      lines.append('  mean sigma^2 per dimension: ' + ', '.join(
          f'{label} {number(value)}' for label, value in sig))
    for key in sorted(ev):
      value = ev[key]
      shown = pct(value) if key.startswith(('diff_acc', 'zeroshot')) else (
          number(value, 4))
      lines.append(f'  {key:36s} {shown}')
  evals = summary.get('evals') or {}
  if evals:
    lines.append('Evaluators (config.evals):')
    by_name: dict[str, dict[str, float]] = {}
    for key, value in evals.items():
      name, _, metric = key.partition('/')
      by_name.setdefault(name, {})[metric] = value
    for name, found in by_name.items():
      lines.append('  ' + evaluator_line(name, found))
  workdir = summary.get('workdir')
  lines.append(f"Checkpoint: {summary['checkpoint']}")
  if workdir and not summary.get('preempted'):
    # Quoted: pasted into a shell, a path with spaces stays one argument.
    quoted = shlex.quote(str(workdir))
    lines.append(f'Next: python -m prolip_jax.evaluate --workdir {quoted}')
    lines.append(f'      python tools/export_pytorch.py --workdir {quoted} '
                 f'--out {shlex.quote(f"{workdir}/export")}')
  return '\n'.join(lines)
