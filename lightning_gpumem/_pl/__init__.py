"""Floor 2, the callbacks' Lightning glue: both namespaces, logging, peers, cross-rank helpers, patching.

The home of private Lightning access (CONTRIBUTING lists the modules;
``tests/pl/test_lightning_internals.py`` guards each). Imports ``_hw``, ``_core`` and ``keys`` only.
"""
