"""The evaluator kinds: one module per kind, named after it, each with one
class ``Evaluator`` (``evaluation/evaluator.py`` finds them by name).

* ``zero_shot``: top-k accuracy by CSD and cosine against prompt-ensemble
  class Gaussians (paper 4.2); ``{metric}_top{k}``.
* ``retrieval``: image->text and text->image recall@k over every caption of
  an image (or ``caption_indices``); ``{metric}_i2t_R@k``.
* ``uncertainty``: sigma^2 of images and captions, the fraction of captions
  more uncertain than their image, Spearman(caption length, sigma^2).
* ``heldout``: the short evaluation training runs on the held-out part of
  the bundled set it trains on (zero-shot, one-caption retrieval, sigma^2,
  the objective's own figures).
* ``uncertainty_report``: the uncertainty figures of paper 4.3 on a bundled
  set (Figs. 4-8, C.6).
* ``bprw``, ``traversal``, ``filtering``: the applications of
  ``prolip_jax.applications`` scored on a bundled set.
"""
