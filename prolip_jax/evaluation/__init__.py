"""Evaluation: zero-shot, retrieval, the uncertainty report, applications.

Modules (each importable on its own; this package imports none of them, so
``prolip_jax.interop.load`` can use ``metrics`` and ``zero_shot`` without
pulling in the runner). Evaluation imports neither the training loop nor
the model loader: ``train`` hands it the objective and a place for its
progress lines, ``prolip_jax/evaluate.py`` (the command) a loaded model.

* ``metrics``: pure scores and metrics over embeddings (CSD / cosine
  zero-shot, top-k, retrieval recall, flat hit@k).
* ``data``: evaluation sets in memory (``EvalData``, the bundled digits).
* ``embedder``: a loaded model's inputs embedded in batches with progress.
* ``zero_shot``: the one prompt ensemble (``prompt_ensemble``,
  ``class_ensemble``) every zero-shot path uses, and the zero-shot suite.
* ``context``, ``retrieval``, ``uncertainty_report``, ``applications``: the
  other suites; ``runner.run`` runs the configured ones, ``report`` formats
  every printed report (evaluate's table, the training run's summary and
  progress lines; one set of units and labels) and ``cli`` holds the flags
  of ``python -m prolip_jax.evaluate``.
* ``train_time``: the short held-out eval the training loop runs.
"""
