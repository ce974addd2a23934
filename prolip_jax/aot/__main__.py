"""``python -m prolip_jax.aot``: see ``prolip_jax.aot.compiler``."""

from prolip_jax.aot import compiler

if __name__ == '__main__':
  compiler.main()
