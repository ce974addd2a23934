"""The two halves of MFU: the analytic model FLOPs of a training pair and
each chip's dense bf16 peak.

One count behind the training loop's measured MFU (``loop_report``),
``prolip_jax.aot``'s report and ``benchmarks/train_step.py``. Pure functions
on numbers and config dicts (no jax).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator chip: HBM bytes and dense bf16 peak FLOP/s."""
  name: str
  hbm_bytes: int
  peak_bf16_flops: float


# Datasheet figures per chip (Cloud TPU system architecture pages; NVIDIA's
# H100 SXM datasheet, dense bf16 without sparsity).
CHIPS = {
    'v4': Chip('TPU v4', 32 * GIB, 275e12),
    'v5e': Chip('TPU v5e', 16 * GIB, 197e12),
    'v5p': Chip('TPU v5p', 95 * GIB, 459e12),
    'v6e': Chip('TPU v6e', 32 * GIB, 918e12),
    # H100: device_memory_size of XLA's h100_sxm.txtpb (specs/).
    'h100': Chip('NVIDIA H100 SXM', 84_978_434_048, 989e12),
    # Not compiled for (no aot target): here for the measured MFU of a run.
    'h200': Chip('NVIDIA H200 SXM', 141 * 10**9, 989e12),
    'a100': Chip('NVIDIA A100 SXM4 80GB', 80 * 10**9, 312e12),
}
# jax's device_kind of each generation's devices.
DEVICE_KINDS = {'TPU v4': 'v4', 'TPU v5 lite': 'v5e', 'TPU v5': 'v5p',
                'TPU v6 lite': 'v6e', 'TPU v5e': 'v5e', 'TPU v5p': 'v5p'}
# jax's device_kind of NVIDIA GPUs (the CUDA device name). SXM parts only:
# a PCIe or NVL card of the same name has a lower peak, so it gets no MFU
# rather than a wrong one.
GPU_DEVICE_KINDS = {'NVIDIA H100 80GB HBM3': 'h100', 'NVIDIA H200': 'h200',
                    'NVIDIA A100-SXM4-80GB': 'a100'}


def chip_of_device_kind(kind: str) -> Optional[Chip]:
  """The ``CHIPS`` entry of a jax ``device.device_kind`` ('TPU v5 lite',
  'NVIDIA H100 80GB HBM3', ...); None for a kind without a known peak (a
  CPU, a PCIe card, an older chip)."""
  gen = DEVICE_KINDS.get(kind) or GPU_DEVICE_KINDS.get(kind)
  return CHIPS[gen] if gen else None


def _tower_forward_flops(tokens: int, width: int, layers: int,
                         mlp_dim: int) -> float:
  """Forward FLOPs of a pre-LN transformer stack on ``tokens`` tokens:
  2 per multiply-add of the QKV/output projections (4 W^2) and the MLP
  (2 W mlp_dim), plus attention scores and values (2 T^2 W each)."""
  matmul = 2 * tokens * (4 * width * width + 2 * width * mlp_dim)
  attention = 4 * tokens * tokens * width
  return layers * (matmul + attention)


def analytic_flops_per_pair(model: dict, masking: Optional[dict] = None
                            ) -> dict[str, float]:
  """Model FLOPs of one training pair (forward + backward = 3 x forward,
  no rematerialisation: the MFU convention, /work perf notes).

  ``model``: ``ModelConfig.to_dict()``. Image tokens: patches + [CLS] (+
  [UNC]); text: context + [CLS] (+ [UNC]); patch embedding and the output
  heads are included. ``masking``: ``{'fraction', 'image_keep_ratio'}`` of
  ProLIP's masked copies (a ``fraction`` of the pairs is embedded again with
  ``image_keep_ratio`` of the patches and the full caption length).
  """
  v, t = model['vision'], model['text']
  extra = 2 if model.get('use_unc', True) else 1
  patches = (v['image_size'] // v['patch_size']) ** 2

  def image(n_patches):
    w = v['width']
    embed = 2 * n_patches * 3 * v['patch_size'] ** 2 * w
    head = 2 * 2 * w * model['embed_dim']
    return embed + head + _tower_forward_flops(
        n_patches + extra, w, v['layers'], int(w * v['mlp_ratio']))

  def text():
    w = t['width']
    head = 2 * 2 * w * model['embed_dim']
    return head + _tower_forward_flops(
        t['context_length'] + extra, w, t['layers'], int(w * t['mlp_ratio']))

  forward = image(patches) + text()
  masked = 0.0
  if masking and masking.get('fraction', 0) > 0:
    keep = max(1, int(round(patches * masking['image_keep_ratio'])))
    masked = masking['fraction'] * (image(keep) + text())
  return {'forward': forward, 'masked_forward': masked,
          'train': 3 * (forward + masked)}


def run_flops_per_pair(config, model: dict, objective) -> dict[str, float]:
  """``analytic_flops_per_pair`` of a run: ``model`` is the run's
  ``ModelConfig.to_dict()``, ``objective`` its ``Objective``
  (``objectives.get(config.objective)``), whose ``masked_copies(config)``
  says which masked copies count (ProLIP's ``config.masking``; none for the
  others). The one count behind ``prolip_jax.aot``'s report, the training
  loop's measured MFU (``loop_report``) and ``benchmarks/train_step.py``."""
  return analytic_flops_per_pair(model, objective.masked_copies(config))
