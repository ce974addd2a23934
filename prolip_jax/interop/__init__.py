"""Models in and out: ``load`` (``prolip_jax.load``: a workdir, an export or
a Hugging Face snapshot), ``hub`` (Hugging Face snapshots and our exports),
``convert`` (JAX parameters <-> the release's PyTorch state dict),
``torch_reference`` (the PyTorch implementation that specifies the export
format) and ``manifest`` (an export's list of files, written last).
"""
