"""Ahead-of-time compilation for TPU topologies (``prolip_jax.aot``).

The compile tests build the micro config's real train step for 4 v5p chips
from this CPU machine (libtpu from the ``test`` extra) and check, in the
compiled HLO, what must hold on a pod: no batch x batch array is gathered,
the ring's collective-permutes are there, gradients are reduced across the
batch shards, and the blockwise loss needs less memory than gathering the
embeddings for a dense loss. The parsing, topology and error tests are fast
and need no libtpu.
"""

import importlib.util
import json
import math
import os

from absl import flags
import jax
import numpy as np
import pytest

from prolip_jax import sharding as shd
from prolip_jax.aot import compiler as aot
from prolip_jax.aot import report as aot_report
from prolip_jax.aot import targets as aot_targets
from prolip_jax.config import presets
from prolip_jax.training import mfu

HAS_LIBTPU = importlib.util.find_spec('libtpu') is not None
needs_libtpu = pytest.mark.skipif(
    not HAS_LIBTPU, reason="libtpu is not installed (pip install -e "
    "'.[test]' installs it; TPU AOT compilation needs it)")

# A hand-written optimised module: a combined all-reduce in the entry, an
# async all-gather, a while loop with a recorded trip count whose body holds
# a collective-permute, and one (TPU style) whose count is only in its
# condition, `i < 5`, calling a reduce-scatter through a fusion.
_HLO = """HloModule jit_step, entry_computation_layout={()->f32[]}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body.1 (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %cp-start = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[]) collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}
  %cp-done = f32[8,16]{1,0} collective-permute-done(%cp-start)
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %cp-done)
}

%cond.1 (p: (s32[], f32[8,16])) -> pred[] {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%fused (q: bf16[64,32]) -> bf16[16,32] {
  %q = bf16[64,32]{1,0} parameter(0)
  ROOT %rs = bf16[16,32]{1,0:T(8,128)(2,1)} reduce-scatter(%q), dimensions={0}, to_apply=%add
}

%body.2 (p: (s32[], bf16[64,32])) -> (s32[], bf16[64,32]) {
  %p = (s32[], bf16[64,32]{1,0}) parameter(0)
  %f = bf16[16,32]{1,0} fusion(%q), kind=kLoop, calls=%fused
  ROOT %t = (s32[], bf16[64,32]{1,0}) tuple(%i, %q)
}

%cond.2 (p: (s32[], bf16[64,32])) -> pred[] {
  %p = (s32[], bf16[64,32]{1,0}) parameter(0)
  %c = s32[]{:T(128)} constant(5)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %c), direction=LT
}

ENTRY %main (x: f32[1024], y: f32[2,3]) -> f32[] {
  %x = f32[1024]{0} parameter(0)
  %y = f32[2,3]{1,0} parameter(1)
  %ar = (f32[1024]{0}, f32[2,3]{1,0}) all-reduce(%x, %y), replica_groups={}, to_apply=%add
  %ag-start = (f32[256,4]{1,0}, f32[1024,4]{1,0}) all-gather-start(%z), dimensions={0}
  %ag-done = f32[1024,4]{1,0} all-gather-done(%ag-start)
  %w1 = (s32[], f32[8,16]{1,0}) while(%t1), condition=%cond.1, body=%body.1, backend_config={"known_trip_count":{"n":"3"}}
  %w2 = (s32[], bf16[64,32]{1,0}) while(%t2), condition=%cond.2, body=%body.2
  ROOT %r = f32[] constant(0)
}
"""


def test_collectives_count_executions_and_result_bytes():
  got = aot_report.collectives(_HLO)
  assert got['all-reduce'] == {'count': 1, 'bytes': 4 * (1024 + 6)}
  assert got['all-gather'] == {'count': 1, 'bytes': 4 * 1024 * 4}
  # 3 iterations of one f32[8,16] permute (the -start is not counted).
  assert got['collective-permute'] == {'count': 3, 'bytes': 3 * 4 * 8 * 16}
  # 5 iterations (from `i < 5`) of one bf16[16,32] reduce-scatter in a fusion.
  assert got['reduce-scatter'] == {'count': 5, 'bytes': 5 * 2 * 16 * 32}
  assert got['all-to-all'] == {'count': 0, 'bytes': 0}
  assert got['unknown_trip_counts'] == 0


def test_square_gather_detection():
  ops = [('all-gather', 'f32[1024,4]{1,0}', 1),
         ('all-reduce', 'f32[2048,2048]{1,0}', 1)]
  assert not aot_report.has_square_gather(ops, 1024)
  assert aot_report.has_square_gather(
      ops + [('all-gather', '(f32[4]{0}, f32[1024,2048]{1,0})', 1)], 1024)


def test_analytic_flops_match_parameter_count():
  """2 FLOPs per multiply-add of every transformer weight per token (counted
  from the real parameter tree), plus attention, patch embedding and heads,
  against ``analytic_flops_per_pair``; B/16's forward is the perf notes'
  ~47 GFLOP."""
  from prolip_jax.models import ModelConfig, ProLIP  # pylint: disable=g-import-not-at-top
  cfg = presets.model_preset('B/16')
  model = ProLIP(ModelConfig.from_config(cfg))
  params = jax.eval_shape(lambda: model.init(
      jax.random.key(0), jax.numpy.zeros((1, 224, 224, 3)),
      jax.numpy.zeros((1, 64), jax.numpy.int32)))['params']

  def kernel_params(tree):
    return sum(math.prod(x.shape) for p, x in
               jax.tree_util.tree_flatten_with_path(tree)[0]
               if 'kernel' in jax.tree_util.keystr(p) and 'block' in
               jax.tree_util.keystr(p).lower())

  towers = {k: v for k, v in params.items() if isinstance(v, dict)}
  assert len(towers) == 2, list(params)
  vision, text = (towers[k] for k in sorted(towers, key=lambda k: (
      'text' in k.lower(), k)))
  n_img, n_txt = 196 + 2, 64 + 2
  expected = (2 * kernel_params(vision) * n_img
              + 2 * kernel_params(text) * n_txt
              + 12 * 4 * (n_img**2 + n_txt**2) * 768  # attention
              + 2 * 196 * 3 * 16 * 16 * 768  # patch embedding
              + 2 * 2 * 2 * 768 * 768)  # mu and log sigma^2 heads
  got = mfu.analytic_flops_per_pair(
      ModelConfig.from_config(cfg).to_dict())
  assert got['forward'] == pytest.approx(expected, rel=1e-3)
  assert 45e9 < got['forward'] < 49e9
  assert got['train'] == 3 * got['forward']
  masked = mfu.analytic_flops_per_pair(
      ModelConfig.from_config(cfg).to_dict(),
      {'fraction': 0.125, 'image_keep_ratio': 0.25})
  assert 1.03 < masked['train'] / got['train'] < 1.06


def test_topology_names():
  assert aot_targets.parse_topology('v5p:4x4x2') == ('v5p', 'tpu', '4x4x2')
  assert aot_targets.parse_topology('v5p-64') == ('v5p', 'tpu', '2x4x4')  # 32 chips
  assert aot_targets.parse_topology('v4-128') == ('v4', 'tpu', '4x4x4')
  assert aot_targets.parse_topology('v5e-256') == ('v5e', 'tpu', '16x16')
  assert aot_targets.parse_topology('h100') == ('h100', 'cuda', '1x1x1')
  assert aot_targets.parse_topology('h100:16') == ('h100', 'cuda', '1x2x8')
  for bad in ('v9:2x2', 'v5e:2x2x2', 'v5p-48', 'h100:12', 'tpu'):
    with pytest.raises(aot_targets.TopologyError, match='known'):
      aot_targets.parse_topology(bad)


def test_help_lists_every_flag_with_its_default(capsys):
  assert aot.run(['aot', '--help']) == 0
  out = capsys.readouterr().out
  for name in aot._FLAGS:  # pylint: disable=protected-access
    flag = flags.FLAGS[name]
    shown = f'--[no]{name}' if flag.boolean else f'--{name}=VALUE'
    assert f'{shown}  {flag.help} (default: {flag.default})' in out, name


@needs_libtpu
def test_each_compile_is_announced_on_stderr(capfd):
  """A line before each compile (minutes for a real model), on stderr: the
  table and the JSON line stay alone on stdout."""
  # A batch the objective cannot split is one line, not a traceback.
  assert aot.run(['aot', '--config', 'configs/prolip_micro.py',
                  '--topology', 'v5p:2x2x1', '--loss_only']) == 2
  err = capfd.readouterr().err
  assert err.startswith('error: batch_size 16 gives a per-device batch of 4'
                        ) and len(err.strip().splitlines()) == 1, err
  assert aot.run(['aot', '--config', 'configs/prolip_micro.py',
                  '--topology', 'v5p:2x2x1', '--loss_only',
                  '--per_device_batch=8']) == 0
  captured = capfd.readouterr()
  assert [l for l in captured.err.splitlines() if l.startswith(
      'Compiling')] == [
          f'Compiling the {form} loss alone for v5p:2x2x1, global batch 32 '
          '(seconds)' for form in ('ring', 'gathered')], captured.err
  assert json.loads(captured.out.strip().splitlines()[-1])


def test_unknown_topology_is_one_line_error(capsys):
  status = aot.run(['aot', '--config', 'configs/prolip_micro.py',
                    '--topology', 'v7x:2x2x1'])
  err = capsys.readouterr().err.strip()
  assert status == 2
  assert err.startswith("error: unknown topology 'v7x:2x2x1'; known:")
  assert '\n' not in err


def test_missing_libtpu_says_how_to_install(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, 'find_spec',
                      lambda name, *a: None if name == 'libtpu'
                      else real(name, *a))
  with pytest.raises(aot_targets.ToolchainError, match=r"pip install -e '\.\[tpu\]'"):
    aot_targets.resolve('v5p:2x2x1')


@pytest.mark.skipif(importlib.util.find_spec('jax_cuda12_plugin') is not None,
                    reason='the GPU toolchain is installed here')
def test_missing_gpu_toolchain_is_user_error():
  with pytest.raises(aot_targets.ToolchainError, match=r"'\.\[gpu\]'"):
    aot_targets.resolve('h100:1')


def test_h100_spec_parses_without_comments():
  spec = aot_targets.h100_spec()
  assert '#' not in spec and 'device_memory_size' in spec
  assert 'dnn_version_info' in spec


def test_fsdp_floor_replicates_small_parameters():
  """Which leaves of the B/16 parameter tree FSDP splits over 8 devices,
  against the rule written out here: at least ``min`` MiB and a dimension
  that 8 divides (the largest such one is split)."""
  from prolip_jax.models import ModelConfig, ProLIP  # pylint: disable=g-import-not-at-top
  model = ProLIP(ModelConfig.from_config(presets.model_preset('B/16')))
  params = jax.eval_shape(lambda: model.init(
      jax.random.key(0), jax.numpy.zeros((1, 224, 224, 3)),
      jax.numpy.zeros((1, 64), jax.numpy.int32)))['params']
  mesh = shd.make_mesh({'data': 1, 'fsdp': 8})
  leaves = jax.tree.leaves(params)
  for floor in (0.0, 4.0, 64.0):
    got = jax.tree.leaves(shd.param_shardings(mesh, params, floor))
    n_sharded = 0
    for x, s in zip(leaves, got):
      nbytes = int(np.prod(x.shape)) * 4
      divisible = [d for d in range(len(x.shape)) if x.shape[d] % 8 == 0]
      if nbytes >= floor * 2**20 and divisible:
        dim = max(divisible, key=lambda d: (x.shape[d], -d))
        want = tuple('fsdp' if d == dim else None
                     for d in range(len(x.shape)))
        n_sharded += 1
      else:
        want = ()
      assert tuple(s.spec) == want, (x.shape, floor, s.spec)
    if floor == 4.0:
      # B/16: the token embedding (32100x768, 94 MiB) and every MLP kernel
      # (768x3072, 9 MiB) are split; 768x768 projections (2.25 MiB), biases
      # and norms stay whole.
      assert 0 < n_sharded < len(leaves)
  assert shd.param_spec((768,), 8, min_size_mb=0.0) == jax.sharding.\
      PartitionSpec('fsdp')
  assert shd.param_spec((768,), 8, min_size_mb=4.0) == jax.sharding.\
      PartitionSpec()


@pytest.fixture(scope='module')
def micro_report():
  if not HAS_LIBTPU:
    pytest.skip("libtpu is not installed (pip install -e '.[test]')")
  c = presets.load_config_file('configs/prolip_micro.py')
  c.mesh.data = 2
  c.mesh.fsdp = 2
  c.mesh.fsdp_min_size_mb = 0.0  # split the micro model's tiny weights too
  target = aot_targets.resolve('v5p:2x2x1')
  report = aot.compile_step(c, target, per_device_batch=16)
  losses = {form: aot.compile_loss(c, target, 512, form)
            for form in ('ring', 'gathered')}
  return report, losses


@needs_libtpu
@pytest.mark.slow
def test_micro_step_compiles_for_v5p_with_pod_properties(micro_report):
  report, losses = micro_report
  assert report['num_devices'] == 4 and report['fits']
  assert report['mesh'] == {'data': 2, 'fsdp': 2}
  assert report['global_batch'] == 64
  colls = report['collectives']
  # The blockwise ring: text blocks travel by collective-permute.
  assert colls['collective-permute']['count'] >= 2
  # Gradients of the batch shards are summed (FSDP: reduce-scatter).
  assert colls['all-reduce']['count'] + colls['reduce-scatter']['count'] > 0
  # FSDP gathers weights, never the batch x batch logits.
  assert colls['all-gather']['count'] > 0
  assert not report['gathers_batch_square']
  assert report['params']['sharded_leaves'] > 0
  assert report['memory']['temporaries'] > 0
  assert report['flops']['xla_per_pair'] > 0
  assert report['estimate']['step_seconds'] > 0
  # The loss alone at 2,048 pairs: the ring's per-device temporaries are
  # below those of gathering every embedding for the dense loss.
  ring, gathered = losses['ring'], losses['gathered']
  assert ring['collectives']['collective-permute']['count'] > 0
  assert ring['collectives']['all-gather']['count'] == 0
  assert gathered['collectives']['all-gather']['count'] > 0
  assert ring['temporaries'] < gathered['temporaries']


def test_table_labels_estimates_and_reports_fit():
  gib = 2**30
  colls = {k: {'count': 0, 'bytes': 0} for k in aot_report.COLLECTIVES}
  colls['collective-permute'] = {'count': 124, 'bytes': 170 * 2**20}
  report = {
      'config': 'configs/prolip_b16.py', 'topology': 'v5p:4x4x2',
      'num_devices': 32, 'chip': 'TPU v5p', 'mesh': {'data': 32, 'fsdp': 1},
      'per_device_batch': 512, 'global_batch': 16384, 'compile_seconds': 9.0,
      'hbm_bytes': 95 * gib, 'peak_flops': 459e12, 'fits': False,
      'memory': {'arguments': 2 * gib, 'temporaries': 100 * gib,
                 'outputs_not_aliased': 0, 'total': 102 * gib},
      'flops': {'analytic_per_pair': 147.6e9, 'xla_per_pair': 190e9,
                'xla_per_device': 512 * 190e9,
                'ceiling_pairs_per_second': 459e12 / 147.6e9},
      'estimate': {'step_seconds': 0.4, 'pairs_per_second_per_chip': 1280.0,
                   'mfu': 1280 * 147.6e9 / 459e12},
      'collectives': dict(colls, ops=[('collective-permute', 'f32[2]', 1)]),
  }
  table = aot_report.format_table(report)
  assert '102.00 GiB of 95.0 GiB HBM (107%): does NOT fit' in table
  assert '0.400 s  [compiler estimate, not a measurement]' in table
  assert '1280  [compiler estimate]' in table
  assert '41.2% of 459 TFLOP/s' in table  # 1280 * 147.6e9 / 459e12
  assert 'collective-permute    124 ops, 170.0 MiB per step' in table
  line = aot_report.json_line(report)
  assert '\n' not in line and '"ops"' not in line
  # A scanned stack: XLA's cost analysis counts the loop body once, so the
  # report gives no XLA FLOPs or estimate and says why.
  scanned = dict(report, scan=True, cost_note=aot.SCAN_COST_NOTE,
                 flops={k: v for k, v in report['flops'].items()
                        if not k.startswith('xla')})
  del scanned['estimate']
  table = aot_report.format_table(scanned)
  assert '[compiler estimate' not in table and '% of 459 TFLOP' not in table
  assert 'no compiler estimate under model.scan' in table
  assert '--config.model.scan=false' in table


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec('jax_cuda12_plugin') is None,
                    reason="the GPU toolchain is not installed (pip install "
                    "-e '.[gpu]', ~5.5 GB; kept out of the default CI "
                    'install)')
def test_micro_step_compiles_for_two_h100s():
  c = presets.load_config_file('configs/prolip_micro.py')
  report = aot.compile_step(c, aot_targets.resolve('h100:2'), per_device_batch=8)
  assert report['num_devices'] == 2 and report['fits']
  assert report['collectives']['collective-permute']['count'] > 0
  assert report['collectives']['all-reduce']['count'] > 0


@needs_libtpu
@pytest.mark.slow
def test_main_on_a_cpu_machine_does_not_start_libtpu():
  """With libtpu installed (this extra) but no TPU chip or GPU, the CLI's
  jax uses the CPU without libtpu's warnings about the missing TPU."""
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
  if (hardware_utils.num_available_tpu_chips_and_device_id()[0]
      or hardware_utils.has_visible_nvidia_gpu()):
    pytest.skip('this machine has an accelerator')
  env = {k: v for k, v in os.environ.items() if k != 'JAX_PLATFORMS'}
  code = ('from prolip_jax import command_line; '
          'command_line.cpu_only_without_accelerators()'
          '; import jax; print(jax.devices()[0].platform)')
  out = subprocess.run([sys.executable, '-c', code], env=env,
                       capture_output=True, text=True, check=True)
  assert out.stdout.strip() == 'cpu'
  assert 'TPU' not in out.stderr, out.stderr


@pytest.mark.parametrize('start', [8, 512, 4096])
def test_find_max_batch_bisects_to_the_step(monkeypatch, start):
  monkeypatch.setattr(aot, 'compile_step',
                      lambda config, target, b: {'fits': b <= 1000})
  best, tried = aot.find_max_batch(None, None, start, 8)
  assert best == 1000
  assert all(b % 8 == 0 for b, _ in tried)
  assert all(ok == (b <= 1000) for b, ok in tried)
  monkeypatch.setattr(aot, 'compile_step',
                      lambda config, target, b: {'fits': False})
  assert aot.find_max_batch(None, None, start, 8)[0] == 0


@pytest.mark.skipif(importlib.util.find_spec('libtpu') is None,
                    reason='libtpu is not installed')
def test_resolving_a_topology_leaves_no_tpu_worker_variables():
  """libtpu is told it is worker 0 of a one-host slice while the topology is
  described; a process started afterwards (``prolip_jax.main`` in a test or
  a script) must not inherit that and take itself for a TPU pod host."""
  before = {k: os.environ.get(k) for k in (
      'TPU_WORKER_HOSTNAMES', 'TPU_WORKER_ID', 'TPU_ACCELERATOR_TYPE',
      'TPU_SKIP_MDS_QUERY')}
  target = aot_targets.resolve('v5p:2x2x1')
  assert len(target.devices) == 4
  assert {k: os.environ.get(k) for k in before} == before
