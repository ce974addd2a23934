"""PC-CLIP on the bundled digits (Sam et al., "Finetuning CLIP to Reason
about Pairwise Differences").

Deterministic towers (no [UNC]). Every step embeds an ordinary image-caption
batch and a batch of difference pairs (image i, image j, a text T_ij saying
how i differs from j in digit value, stroke thickness, width or position,
built from measured attributes by ``data.pairs``); the loss is

  CLIP(images, captions) + loss.pcclip_weight * l(g(I_i) - g(I_j), f(T_ij))

with l CLIP's contrastive loss at tau = loss.pcclip_tau = 1 (eq. 1, 4) or the
squared loss (eq. 5, loss.pcclip_squared=True). The paper finetunes a
pre-trained CLIP; this demo trains from scratch with the combined loss.
Train-time eval adds eq. 2's difference-based accuracy on held-out pairs
(``eval/diff_acc``). Both terms run on the CLIP ring when the batch is split.
"""

from prolip_jax import demos


def get_config():
  return demos.tiny_demo_config('pcclip')
