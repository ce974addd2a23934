"""Evaluation: zero-shot, retrieval, the uncertainty report, applications.

Modules (each importable on its own; this package imports none of them, so
``prolip_jax.interop.load`` can use ``metrics`` without pulling in the runner):

* ``metrics``: pure scores and metrics over embeddings (CSD / cosine
  zero-shot, top-k, retrieval recall, flat hit@k).
* ``data``: evaluation sets in memory (``EvalData``, the bundled digits).
* ``embedder``: a loaded model's inputs embedded in batches with progress.
* ``context``, ``zero_shot``, ``retrieval``, ``uncertainty_report``,
  ``applications``: the suites; ``runner.run`` runs the configured ones,
  ``report`` formats the printed table (training's units and labels) and
  ``cli`` is ``python -m prolip_jax.evaluate``.
* ``train_time``: the short held-out eval the training loop runs.
"""
