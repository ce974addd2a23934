"""Ahead-of-time compilation of the train step for hardware this machine
does not have: ``python -m prolip_jax.aot`` (``__main__``).

``compiler`` (compile the step, find the largest batch, the command line),
``targets`` (TPU topologies and H100s; the packaged GPU spec in ``specs/``)
and ``report`` (what is read from a compiled step: collectives, FLOPs, the
table).
"""
