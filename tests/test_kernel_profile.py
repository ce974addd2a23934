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
