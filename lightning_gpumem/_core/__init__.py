"""Floor 0, pure (stdlib only): the memory sample, units, argument checks, files, the run model, its advice.

Nothing here imports torch or Lightning (``tests/package/test_layering.py`` checks it in a fresh
interpreter), so the report (``gpumem report``) and the searches run and are tested without either.
"""
