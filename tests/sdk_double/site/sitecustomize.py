"""Every Python process of a test sub-run uses the SDK double when ``BOXLITE_SDK_DOUBLE=1``.  TESTS ONLY.

A sub-run puts this directory (and ``tests/``) on ``PYTHONPATH``; processes the
plugin starts itself (``python -m pytest_boxlite.boxproc`` for worker scope and
xdist workers) then open the vm runtime on the double too.  Guest interpreters
(inside boxes) never see it: they do not get the host's ``PYTHONPATH``.
"""

import os

if os.environ.get("BOXLITE_SDK_DOUBLE") == "1" and os.environ.get("PYTEST_BOXLITE_GUEST") != "1":
    import sdk_double.activate  # noqa: F401 - installs the double on import
