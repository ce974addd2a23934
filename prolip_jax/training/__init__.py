"""Training: the loop and everything a run does around it.

``train`` (``train_and_evaluate``, the jitted step), ``optimizer``,
``resume`` (what a run finds in its workdir), ``workdir_lock`` (one
writing run per workdir), ``progress`` (metrics, the progress line,
SIGTERM), ``signals`` (stops that arrive while
``prolip_jax.main`` starts), ``loop_report`` with ``step_timing`` and
``profiling`` (what the loop reports beyond the loss), ``mfu`` (the model
FLOPs and chip peaks behind it) and ``wandb_sink``. Checkpoints are
``prolip_jax.storage.checkpoint``'s.
"""
