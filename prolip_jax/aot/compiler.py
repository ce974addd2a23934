"""Compile the train step ahead of time for a TPU topology or H100s, from a
machine without either: memory, FLOPs, a step-time estimate, collectives.

  python -m prolip_jax.aot --config configs/prolip_b16.py --topology v5p:4x4x2
  python -m prolip_jax.aot --config configs/prolip_b16.py --topology h100:8 \\
      --find_max_batch

Targets (topologies, H100s) are ``targets.py``; reports and HLO parsing
``report.py``. It compiles exactly the step ``prolip_jax.main`` runs
(``train.jit_train_step`` on ``train.run_state_initializer``'s state: same
config, mesh rules, shardings, donation, objective) on abstract arrays, so
nothing is allocated.
Topologies (``--topology``):

  v4:AxBxC, v5p:AxBxC     a TPU slice as a 3-D chip grid (v5p:4x4x2 = 32 chips)
  v5e:AxB, v6e:AxB        a 2-D chip grid (v5e:16x16 = 256 chips)
  v4-N, v5p-N, v5e-N, v6e-N  Cloud's names (N TensorCores for v4/v5p, N
                          chips for v5e/v6e: v5p-64 = v5p:4x4x2)
  h100:N                  N H100 SXM GPUs, 8 per host (h100 = h100:1)

TPUs need ``pip install -e '.[tpu]'`` (libtpu), GPUs ``pip install -e
'.[gpu]'`` (the CUDA toolchain, no GPU needed). The step time, pairs/s and
MFU come from XLA's cost model: a compiler estimate, not a measurement.
Exit status 2 with one line ``error: ...`` for a user error.
"""

from __future__ import annotations

import json
import re
import sys
import time
from typing import Any, Optional

from absl import flags

from prolip_jax import command_line
from prolip_jax import errors
from prolip_jax.aot import report as aot_report
from prolip_jax.aot.targets import KNOWN
from prolip_jax.aot.targets import resolve
from prolip_jax.aot.targets import Target
from prolip_jax.training import mfu

# ----------------------------------------------------------------------------
# Compiling

SCAN_COST_NOTE = ("none under model.scan (XLA's cost analysis counts the "
                  'scanned layer stack once, not once per layer): rerun '
                  'with --config.model.scan=false for the estimate')


def _model(config, devices):
  """The ``ProLIP`` of the config for ``devices`` (attention as
  ``prolip_jax.main`` picks it for them: cuDNN on NVIDIA GPUs where the
  shapes allow; the tokenizer's pad id is the config's, no tokenizer is
  read) and the [MASK] id to compile with."""
  from prolip_jax.models import attention_impl_for  # pylint: disable=g-import-not-at-top
  from prolip_jax.models import ModelConfig  # pylint: disable=g-import-not-at-top
  from prolip_jax.models import ProLIP  # pylint: disable=g-import-not-at-top
  cfg = ModelConfig.from_config(config.model)
  if config.tokenizer.pad_id >= 0:
    cfg = ModelConfig.from_config(dict(
        cfg.to_dict(), text=dict(cfg.text.__dict__,
                                 pad_id=config.tokenizer.pad_id)))
  # Only a constant in the graph: any id in the vocabulary compiles the same.
  mask_id = (config.tokenizer.mask_id if config.tokenizer.mask_id >= 0
             else cfg.text.vocab_size - 1)
  return ProLIP(cfg, attention=attention_impl_for(
      list(devices), cfg.attention_impl)), mask_id


def abstract_batch(config, model_cfg, global_batch: int, sharding,
                   objective=None) -> dict:
  """``jax.ShapeDtypeStruct``s of one global batch, as the data pipeline
  makes it (one example through its ``TrainTransform`` with a stand-in
  tokenizer: same keys, shapes and dtypes). ``objective``: the config's
  (resolved here when None)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from prolip_jax import objectives  # pylint: disable=g-import-not-at-top
  from prolip_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  from prolip_jax.objectives.base import Objective  # pylint: disable=g-import-not-at-top
  from prolip_jax.training import train  # pylint: disable=g-import-not-at-top

  if objective is None:
    objective = objectives.get(config.objective)
  if type(objective).wrap_dataset is not Objective.wrap_dataset:
    raise errors.UserError(
        f'objective {config.objective!r} adds its own batch entries '
        '(wrap_dataset), which prolip_jax.aot cannot make up without data')

  ctx = model_cfg.text.context_length

  def tokenizer(text):
    del text
    return np.zeros((1, ctx), np.int32)

  size = model_cfg.vision.image_size
  transform = pipeline.TrainTransform(
      tokenizer, size, train.augment_config(config.data),
      config.data.get('num_views', 1))
  example = transform.random_map(
      {'image': np.zeros((size, size, 3), np.uint8), 'caption': 'a'},
      np.random.default_rng(0))
  return {k: jax.ShapeDtypeStruct((global_batch,) + np.shape(v),
                                  np.asarray(v).dtype, sharding=sharding)
          for k, v in example.items()}


def _memory(compiled) -> Optional[dict[str, int]]:
  stats = compiled.memory_analysis()
  if stats is None:
    return None
  out_extra = stats.output_size_in_bytes - stats.alias_size_in_bytes
  mem = {'arguments': stats.argument_size_in_bytes,
         'temporaries': stats.temp_size_in_bytes,
         'outputs': stats.output_size_in_bytes,
         'outputs_not_aliased': out_extra,
         'generated_code': stats.generated_code_size_in_bytes}
  mem['total'] = (mem['arguments'] + out_extra + mem['temporaries']
                  + mem['generated_code'])
  return mem


def _cost(compiled) -> dict[str, float]:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return dict(cost or {})


_OOM = re.compile(r'RESOURCE_EXHAUSTED|Ran out of memory|out of memory',
                  re.IGNORECASE)
_USED = re.compile(r'Used ([\d.]+)([KMGT]) of ([\d.]+)([KMGT]) hbm')


def _needed_bytes(message: str) -> Optional[int]:
  m = _USED.search(message)
  if not m:
    return None
  scale = {'K': 2**10, 'M': 2**20, 'G': 2**30, 'T': 2**40}
  return int(float(m.group(1)) * scale[m.group(2)])


def _param_report(abstract_params, shardings, min_size_mb) -> dict[str, Any]:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  rep = {'count': 0, 'sharded_bytes': 0, 'replicated_bytes': 0,
         'sharded_leaves': 0, 'replicated_leaves': 0,
         'fsdp_min_size_mb': min_size_mb}
  for x, s in zip(jax.tree.leaves(abstract_params), jax.tree.leaves(
      shardings)):
    size = int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
    rep['count'] += int(np.prod(x.shape))
    kind = 'sharded' if any(p is not None for p in s.spec) else 'replicated'
    rep[f'{kind}_bytes'] += size
    rep[f'{kind}_leaves'] += 1
  return rep


def _for_target(config, target: Target, per_device_batch: int):
  """``(config, objective, mesh)`` of a compile for ``target``: a resolved
  copy of ``config`` with ``batch_size`` set to ``per_device_batch`` pairs
  on each batch shard of the target's mesh, checked as a run checks it (a
  bad value is one ``error:`` line)."""
  from prolip_jax import objectives  # pylint: disable=g-import-not-at-top
  from prolip_jax import sharding as shd  # pylint: disable=g-import-not-at-top
  from prolip_jax.training import train  # pylint: disable=g-import-not-at-top
  config = config.copy_and_resolve_references()
  with errors.config_errors():
    objective = objectives.get(config.objective)
    mesh = shd.make_mesh(config.mesh, devices=target.devices,
                         whole_topology=True)
    config.batch_size = per_device_batch * shd.num_batch_shards(mesh)
    train.validate_config(config, objective)
  return config, objective, mesh


def compile_step(config, target: Target, per_device_batch: int
                 ) -> dict[str, Any]:
  """Compiles the train step for ``target`` at ``per_device_batch`` pairs
  per device; returns the report (``fits``; ``error`` when the compiler
  refused it for memory)."""
  import jax  # pylint: disable=g-import-not-at-top
  from prolip_jax import sharding as shd  # pylint: disable=g-import-not-at-top
  from prolip_jax.training import optimizer  # pylint: disable=g-import-not-at-top
  from prolip_jax.training import train  # pylint: disable=g-import-not-at-top

  config, objective, mesh = _for_target(config, target, per_device_batch)
  with errors.config_errors():
    model, mask_id = _model(config, mesh.devices.flat)
    tx, schedule = optimizer.make_optimizer(config.optim, config.total_steps)
    init_state, shardings = train.run_state_initializer(config, model, tx,
                                                        mesh, objective)
    state = jax.eval_shape(init_state, jax.random.key(0))
    step = train.jit_train_step(model, config, tx, schedule, mesh, mask_id,
                                shardings, objective)
  batch = abstract_batch(config, model.config, config.batch_size,
                         shd.batch_sharding(mesh), objective)
  rng = jax.ShapeDtypeStruct((), jax.random.key(0).dtype,
                             sharding=shd.replicated(mesh))
  report: dict[str, Any] = {
      'topology': target.name, 'platform': target.platform,
      'chip': target.chip.name, 'num_devices': len(target.devices),
      'mesh': dict(mesh.shape), 'per_device_batch': per_device_batch,
      'global_batch': config.batch_size, 'hbm_bytes': target.chip.hbm_bytes,
      'peak_flops': target.chip.peak_bf16_flops,
      'remat': bool(config.model.remat),
      'scan': bool(config.model.get('scan', False)),
      'compute_dtype': config.model.compute_dtype,
      'params': _param_report(state.params, shardings.params,
                              config.mesh.get('fsdp_min_size_mb',
                                              shd.FSDP_MIN_SIZE_MB))}
  _status(f'Compiling the train step for {target.name} '
          f'({len(target.devices)} x {target.chip.name}), {per_device_batch} '
          f'pairs per device, remat {bool(config.model.remat)}, scan '
          f'{bool(config.model.get("scan", False))} (a real-size model takes '
          'minutes on a CPU)')
  t0 = time.time()
  try:
    compiled = step.lower(state, batch, rng).compile()
  except Exception as e:  # pylint: disable=broad-except
    if not _OOM.search(str(e)):
      raise
    report.update(compile_seconds=time.time() - t0, fits=False,
                  error=str(e).strip().splitlines()[0][:300],
                  needed_bytes=_needed_bytes(str(e)))
    return report
  report['compile_seconds'] = time.time() - t0
  mem = _memory(compiled)
  report['memory'] = mem
  report['fits'] = mem is None or mem['total'] <= target.chip.hbm_bytes
  cost = _cost(compiled)
  analytic = mfu.run_flops_per_pair(config, model.config.to_dict(),
                                    objective)
  flops = {'analytic_per_pair': analytic['train'],
           'analytic_forward_per_pair': analytic['forward'],
           'ceiling_pairs_per_second': (target.chip.peak_bf16_flops
                                        / analytic['train'])}
  if report['scan']:
    # XLA's cost analysis counts a while loop's body once, so a scanned
    # layer stack reads as one layer: its FLOPs and step time are no
    # estimate of the step at all.
    cost = {}
    report['cost_note'] = SCAN_COST_NOTE
  if cost.get('flops'):
    flops['xla_per_device'] = cost['flops']
    flops['xla_per_pair'] = cost['flops'] / per_device_batch
  report['flops'] = flops
  seconds = cost.get('optimal_seconds')
  if seconds and seconds > 0:
    pairs = per_device_batch / seconds
    report['estimate'] = {
        'step_seconds': seconds, 'pairs_per_second_per_chip': pairs,
        'mfu': pairs * analytic['train'] / target.chip.peak_bf16_flops,
        'note': 'XLA cost-model estimate, not a measurement'}
  text = compiled.as_text()
  colls = aot_report.collectives(text)
  report['collectives'] = colls
  report['gathers_batch_square'] = aot_report.has_square_gather(
      colls['ops'], config.batch_size)
  if target.platform == 'cuda':
    report['cudnn_attention_calls'] = len(
        re.findall(r'custom_call_target="__cudnn\$fmha', text))
  return report


def compile_loss(config, target: Target, per_device_batch: int,
                 form: str) -> dict[str, Any]:
  """Compiles the objective's loss and its gradient alone, over the tower
  outputs of a global batch: ``form='ring'`` as the train step computes it
  (the blockwise ring in ``shard_map``), ``'gathered'`` by all-gathering
  every embedding and evaluating the dense loss on each device (open_clip's
  default). Returns the per-device memory and collectives. The embeddings
  are the train step's (``Objective.make_embed_fn``, with no teacher)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from prolip_jax import models  # pylint: disable=g-import-not-at-top
  from prolip_jax import sharding as shd  # pylint: disable=g-import-not-at-top

  config, objective, mesh = _for_target(config, target, per_device_batch)
  with errors.config_errors():
    objective.validate_batch(
        config, shd.num_batch_shards(mesh))  # one line, not a traceback
    model, mask_id = _model(config, mesh.devices.flat)
  b = config.batch_size
  size = model.config.vision.image_size
  params = jax.eval_shape(lambda: models.init_params(model, jax.random.key(0)))
  images = jax.ShapeDtypeStruct((b, size, size, 3), jax.numpy.float32)
  tokens = jax.ShapeDtypeStruct((b, model.config.text.context_length),
                                jax.numpy.int32)
  embed = objective.make_embed_fn(model, config, mesh, mask_id)
  embeddings = jax.eval_shape(
      lambda p, i, t: embed(p, None, i, t, jax.random.key(0)),
      params, images, tokens)
  if form == 'ring':
    loss = objective.loss_over(config.loss, mesh)
  else:
    specs = objective.shard_specs()
    dense = objective.local_loss(config.loss)

    def gathered(*args):
      args = [jax.tree.map(lambda x: jax.lax.all_gather(
          x, shd.BATCH_AXES, tiled=True), a) if s == P(shd.BATCH_AXES)
              else a for a, s in zip(args, specs)]
      return dense(*args)

    loss = jax.shard_map(gathered, mesh=mesh, in_specs=specs, out_specs=P(),
                         check_vma=False)

  def value_and_grad(embeddings, scale, bias):
    return jax.value_and_grad(
        lambda e: loss(e[0], e[1], scale, bias, e[2], e[3])[0])(embeddings)

  batch_sharding = shd.batch_sharding(mesh)
  emb = jax.tree.map(lambda s: jax.ShapeDtypeStruct(
      s.shape, s.dtype, sharding=batch_sharding), embeddings)
  scalar = jax.ShapeDtypeStruct((), jax.numpy.float32,
                                sharding=shd.replicated(mesh))
  t0 = time.time()
  _status(f'Compiling the {form} loss alone for {target.name}, global batch '
          f'{b} (seconds)')
  compiled = jax.jit(value_and_grad).lower(emb, scalar, scalar).compile()
  colls = aot_report.collectives(compiled.as_text())
  return {'form': form, 'global_batch': b, 'memory': _memory(compiled),
          'temporaries': (_memory(compiled) or {}).get('temporaries', 0),
          'compile_seconds': time.time() - t0,
          'collectives': {k: v for k, v in colls.items() if k != 'ops'},
          'gathers_batch_square': aot_report.has_square_gather(colls['ops'],
                                                               b)}


def find_max_batch(config, target: Target, start: int, step: int
                   ) -> tuple[int, list[tuple[int, bool]]]:
  """The largest per-device batch (a multiple of ``step``) whose step fits
  in HBM: doubling from ``start`` to bracket it, then bisection. Returns it
  (0 if even ``step`` does not fit) and every ``(batch, fits)`` tried."""
  tried: list[tuple[int, bool]] = []

  def fits(b):
    ok = compile_step(config, target, b)['fits']
    tried.append((b, ok))
    print(f'  per-device batch {b}: {"fits" if ok else "does not fit"}',
          file=sys.stderr, flush=True)
    return ok

  b = max(step, start // step * step)
  if fits(b):
    lo, hi = b, None
    while hi is None:
      if fits(lo * 2):
        lo *= 2
      else:
        hi = lo * 2
  else:
    lo, hi = 0, b
    while lo == 0 and hi > step:
      half = max(step, hi // 2 // step * step)
      if fits(half):
        lo = half
      else:
        hi = half
    if lo == 0:
      return 0, tried
  while hi - lo > step:
    mid = (lo + hi) // 2 // step * step
    if mid in (lo, hi):
      break
    if fits(mid):
      lo = mid
    else:
      hi = mid
  return lo, tried


# ----------------------------------------------------------------------------
# Command line


def _define_flags():
  if 'topology' in flags.FLAGS:
    return
  flags.DEFINE_string('topology', None, f'Where to compile: {KNOWN}.')
  flags.DEFINE_integer('per_device_batch', None, 'Pairs per device (default: '
                       'the config batch_size over the mesh\'s batch '
                       'shards).')
  flags.DEFINE_bool('find_max_batch', False, 'Also bisect the largest '
                    'per-device batch that fits in HBM.')
  flags.DEFINE_integer('batch_step', 0, 'Resolution of --find_max_batch '
                       '(0: the smallest legal step, 8 for ProLIP).')
  flags.DEFINE_bool('loss_memory', True, 'Also compile the loss alone, '
                    'blockwise ring vs gathered dense (batch-split meshes).')
  flags.DEFINE_bool('loss_only', False, 'Compile only the loss, ring vs '
                    'gathered dense (seconds, not minutes).')


# The flags --help lists, in this order (with main's --config ones).
_FLAGS = ('topology', 'per_device_batch', 'find_max_batch', 'batch_step',
          'loss_memory', 'loss_only')


def usage() -> str:
  """What ``--help`` prints: the module's text and one line per flag (its
  help and default)."""
  _define_flags()
  lines = [__doc__.strip(), '', 'Flags:',
           '  --config=FILE  a run config (default configs/prolip_tiny.py)',
           '  --config.KEY=VALUE  override one config value (python -m '
           'prolip_jax.main --print_config lists them)']
  for name in _FLAGS:
    flag = flags.FLAGS[name]
    shown = f'--[no]{name}' if flag.boolean else f'--{name}=VALUE'
    lines.append(f'  {shown}  {flag.help} (default: {flag.default})')
  return '\n'.join(lines)


def _status(text: str):
  """A line on stderr before a slow phase (stdout keeps the table and the
  JSON line)."""
  print(text, file=sys.stderr, flush=True)


def _default_per_device_batch(config, target: Target) -> int:
  from prolip_jax import sharding as shd  # pylint: disable=g-import-not-at-top
  with errors.config_errors():
    mesh = shd.make_mesh(config.mesh, devices=target.devices,
                         whole_topology=True)
    shards = shd.num_batch_shards(mesh)
    if config.batch_size % shards:
      raise ValueError(f'batch_size {config.batch_size} is not divisible by '
                       f'the {shards} batch shards of mesh {dict(mesh.shape)}'
                       '; pass --per_device_batch')
  return config.batch_size // shards


def _config_file(argv: list[str]) -> str:
  return command_line.config_path(argv, command_line.DEFAULT_TRAINING_CONFIG)


def run(argv: list[str]) -> int:
  """The command line ``argv`` (program name first); returns the exit
  status."""
  from prolip_jax import objectives  # pylint: disable=g-import-not-at-top
  if any(a in ('--help', '-h', '--helpfull', '-help') for a in argv[1:]):
    print(usage())
    return 0

  def body():
    _define_flags()
    config = command_line.parse_training_config(argv)
    fl = flags.FLAGS
    if not fl.topology:
      raise errors.UserError(f'--topology is required; known: {KNOWN}')
    target = resolve(fl.topology)
    per_device = fl.per_device_batch or _default_per_device_batch(config,
                                                                  target)
    if fl.loss_only:
      losses = {form: compile_loss(config, target, per_device, form)
                for form in ('ring', 'gathered')}
      print(aot_report.format_loss_table(
          _config_file(argv), target.name,
          per_device, losses))
      print(json.dumps(losses, sort_keys=True), flush=True)
      return 0
    report = compile_step(config, target, per_device)
    report['config'] = _config_file(argv)
    if fl.loss_memory and report['mesh'] and max(
        report['global_batch'] // per_device, 1) > 1:
      report['loss_memory'] = {
          form: compile_loss(config, target, per_device, form)
          for form in ('ring', 'gathered')}
    if fl.find_max_batch:
      step = fl.batch_step or objectives.get(
          config.objective).batch_multiple(config)
      best, tried = find_max_batch(config, target, per_device, step)
      report['max_per_device_batch'] = best
      report['max_batch_search'] = (f'step {step}, tried ' + ', '.join(
          f'{b}{"" if ok else " (no)"}' for b, ok in tried))
    print(aot_report.format_table(report))
    print(aot_report.json_line(report), flush=True)
    return 0

  return errors.cli_main(body, argv)


def main():
  sys.exit(run(sys.argv))

