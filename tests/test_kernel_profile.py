"""benchmarks/kernel_profile.py adds up a trace's device kernels right.

A hand-built trace (the ``ProfileData`` shape: planes of lines of events)
with known durations: the totals, per-step figures and shares are checked
against sums done here by hand, and the lines that repeat the streams' kernels
(a GPU plane's 'XLA Ops') or belong to the host are left out.
"""

import dataclasses
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), 'benchmarks'))
import kernel_profile  # pylint: disable=g-import-not-at-top,wrong-import-position


@dataclasses.dataclass
class Event:
  name: str
  duration_ns: int


@dataclasses.dataclass
class Line:
  name: str
  events: list


@dataclasses.dataclass
class Plane:
  name: str
  lines: list


def _gpu_trace():
  stream_a = Line('Stream #13(Compute)', [
      Event('nvjet_sm90_tst_128x160_NNT', 3_000_000),
      Event('loop_add_fusion_3', 500_000),
      Event('nvjet_sm90_tst_128x160_NNT', 3_000_000),
      Event('cudnn_generated_fort_native_sdpa_sm90_flash_fprop', 2_000_000)])
  stream_b = Line('Stream #14(Compute)', [
      Event('loop_add_fusion_3', 500_000),
      Event('ncclDevKernel_AllReduce_Sum_f32', 1_000_000)])
  # Derived from the streams: counting it would double every kernel.
  xla_ops = Line('XLA Ops', [Event('fusion.1', 9_000_000)])
  host = Plane('/host:CPU', [Line('python', [Event('PjitFunction', 10**9)])])
  return [host, Plane('/device:GPU:0', [stream_a, xla_ops, stream_b])]


def test_kernel_times_count_the_stream_lines_of_device_planes_only():
  assert kernel_profile.kernel_times(_gpu_trace()) == {
      'nvjet_sm90_tst_128x160_NNT': (2, 6_000_000),
      'loop_add_fusion_3': (2, 1_000_000),
      'cudnn_generated_fort_native_sdpa_sm90_flash_fprop': (1, 2_000_000),
      'ncclDevKernel_AllReduce_Sum_f32': (1, 1_000_000)}


def test_a_tpu_plane_is_read_from_its_xla_ops_line():
  tpu = Plane('/device:TPU:0', [
      Line('XLA Modules', [Event('jit_step', 7_000_000)]),
      Line('XLA Ops', [Event('convolution.1', 4_000_000),
                       Event('fusion.2', 3_000_000)])])
  assert kernel_profile.kernel_times([tpu]) == {
      'convolution.1': (1, 4_000_000), 'fusion.2': (1, 3_000_000)}


def test_summary_per_step_by_category_and_by_kernel():
  times = kernel_profile.kernel_times(_gpu_trace())
  summary = kernel_profile.summarize_times(times, steps=2, top=2)
  total_ms = (6 + 1 + 2 + 1) / 2  # 10 ms of kernels over 2 steps
  assert summary['kernel_ms_per_step'] == pytest.approx(total_ms)
  categories = {c['category']: (c['ms_per_step'], c['share'])
                for c in summary['categories']}
  assert categories == {
      'matmul': (pytest.approx(3.0), pytest.approx(60.0)),
      'attention (cuDNN fused)': (pytest.approx(1.0), pytest.approx(20.0)),
      kernel_profile.OTHER: (pytest.approx(0.5), pytest.approx(10.0)),
      'collective': (pytest.approx(0.5), pytest.approx(10.0))}
  assert [c['category'] for c in summary['categories']][:2] == [
      'matmul', 'attention (cuDNN fused)']
  top = summary['top_kernels']
  assert [k['name'] for k in top] == [
      'nvjet_sm90_tst_128x160_NNT',
      'cudnn_generated_fort_native_sdpa_sm90_flash_fprop']
  assert top[0]['calls_per_step'] == 1.0
  assert top[0]['ms_per_step'] == pytest.approx(3.0)
  text = kernel_profile.format_summary(summary)
  assert '| matmul | 3.0 | 60.0% |' in text
  assert '5.0 ms per step' in text


@pytest.mark.parametrize('name,expected', [
    ('cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma', 'attention (cuDNN fused)'),
    ('void cudnn::fusion::compute_dot_do_o_specialized<true, 64>', 'attention (cuDNN fused)'),
    ('nvjet_sm90_tss_192x96_64x5_1x2_h_bz_NTT', 'matmul'),
    ('gemm_fusion_dot_1303', 'matmul'),
    ('ncclDevKernel_AllReduce_Sum_bf16_RING_LL', 'collective'),
    ('loop_convert_multiply_fusion_47', kernel_profile.OTHER),
    ('input_add_reduce_fusion_48', kernel_profile.OTHER),
])
def test_categories_of_the_kernels_an_h200_ran(name, expected):
  assert kernel_profile.category(name) == expected


def test_a_trace_without_device_kernels_says_so(tmp_path):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
  x = jnp.ones((64, 64))
  f(x).block_until_ready()
  with jax.profiler.trace(str(tmp_path)):
    f(x).block_until_ready()
  summary = kernel_profile.summarize(str(tmp_path), steps=1)
  assert summary['categories'] == [] and '/host:CPU' in summary['note']
  assert kernel_profile.format_summary(summary) == summary['note']


# ----------------------------------------------------------------------------
# hlo_attribution.py: kernels joined to the compiled HLO


import hlo_attribution  # pylint: disable=g-import-not-at-top,wrong-import-position


@dataclasses.dataclass
class StatEvent:
  name: str
  duration_ns: int
  stats: list


def test_kernels_are_named_by_the_hlo_they_ran_for(tmp_path):
  """A real CPU trace of a GELU and a LayerNorm joined to the compiled
  program's HLO text: every traced thunk is found in the HLO, the erf's
  fusion is called the GELU and the rsqrt's the LayerNorm, and the table's
  time is the trace's own sum."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top

  def f(x, w):
    h = jax.nn.gelu(x @ w, approximate=False)
    return jax.nn.standardize(h, axis=-1).sum()

  args = (jnp.ones((128, 64)), jnp.full((64, 256), 0.01))
  compiled = jax.jit(f).lower(*args).compile()
  compiled(*args).block_until_ready()
  with jax.profiler.trace(str(tmp_path)):
    for _ in range(2):
      compiled(*args).block_until_ready()
  paths = [os.path.join(d, n) for d, _, names in os.walk(tmp_path)
           for n in names if n.endswith('.xplane.pb')]
  times = hlo_attribution.op_times(ProfileData.from_file(paths[0]).planes)
  instructions = hlo_attribution.parse_hlo(compiled.as_text())
  result = hlo_attribution.attribute(times, instructions, steps=2)
  assert times and result['known_share'] == pytest.approx(100)
  assert all(calls == 2 for calls, _ in times.values())
  total_ms = sum(ns for _, ns in times.values()) / 1e6 / 2
  assert result['ms_per_step'] == pytest.approx(total_ms)
  assert sum(r['ms_per_step'] for r in result['by_what']) == pytest.approx(
      total_ms)
  labels = {r['what'] for r in result['top_ops']}
  assert 'matmul (XLA dot)' in labels
  assert 'exact GELU (erf, erfc) and its derivative' in labels
  assert any('standardize' in r['where'] or r['what'].startswith('LayerNorm')
             for r in result['top_ops'])
  text = hlo_attribution.format_attribution(result)
  assert '| exact GELU (erf, erfc) and its derivative |' in text


def test_gpu_stream_kernels_are_counted_once_by_their_hlo_op():
  """A GPU plane: the stream lines' kernels count, the derived 'XLA Ops'
  line does not; kernels without an hlo_op (a memset) are left out."""
  streams = [Line('Stream #13(Compute)', [
      StatEvent('loop_multiply_fusion_3', 4_000_000,
                [('hlo_op', 'multiply_fusion.3'), ('hlo_module', 'm')]),
      StatEvent('memset32', 1_000, [])]),
             Line('Stream #14(Compute)', [
                 StatEvent('loop_multiply_fusion_3', 2_000_000,
                           [('hlo_op', 'multiply_fusion.3')])]),
             Line('XLA Ops', [StatEvent('multiply_fusion.3', 6_000_000,
                                        [('hlo_op', 'multiply_fusion.3')])])]
  host = Plane('/host:CPU', [Line('python', [StatEvent(
      'x', 10**9, [('hlo_op', 'host_op')])])])
  assert hlo_attribution.op_times(
      [host, Plane('/device:GPU:0', streams)]) == {
          'multiply_fusion.3': (2, 6_000_000)}
  hlo = '\n'.join([
      'HloModule m', '',
      '%fused_computation.3 (p: f32[8]) -> f32[8] {',
      '  %p = f32[8]{0} parameter(0)',
      '  ROOT %e = f32[8]{0} erf(f32[8]{0} %p), metadata={op_name='
      '"jit(step)/visual/resblocks_11/mlp/erf"}', '}', '',
      'ENTRY %main (a: f32[8]) -> f32[8] {',
      '  %a = f32[8]{0} parameter(0)',
      '  ROOT %multiply_fusion.3 = f32[8]{0} fusion(f32[8]{0} %a), '
      'kind=kLoop, calls=%fused_computation.3, metadata={op_name='
      '"jit(step)/visual/resblocks_11/mlp/erf"}', '}'])
  result = hlo_attribution.attribute(
      {'multiply_fusion.3': (2, 6_000_000)}, hlo_attribution.parse_hlo(hlo),
      steps=2)
  assert result['by_where'] == [{
      'what': 'exact GELU (erf, erfc) and its derivative',
      'where': 'jit(step)/visual/resblocks_*/mlp/erf', 'ms_per_step': 3.0,
      'share': 100.0}]
