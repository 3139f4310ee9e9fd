"""``python -m lightning_gpumem report LOGDIR``: see :mod:`lightning_gpumem.cli`."""

from lightning_gpumem.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
