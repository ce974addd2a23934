"""Applications of the learned uncertainty (paper 4.4, appendices A.8, B.4, C.8).

* ``bprw``: Bayesian Prompt Re-Weighting, EM over per-class prompt weights
  (Algorithm 1), zero-shot (nearest images) and few-shot (labelled images).
* ``traversal``: inclusion-based image traversal from a [ROOT] caption to the
  image's nearest caption.
* ``filtering``: uncertainty-aware image-text pair filtering by CSD, with a
  jitted, batch-sharded scoring function.
* ``pcclip``: PC-CLIP's difference-based classification (eq. 2) and
  comparative prompting (eq. 3).
"""
