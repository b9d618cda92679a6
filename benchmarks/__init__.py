"""pytest-boxlite's benchmarks: ``python -m benchmarks --help`` lists the tables.

Modules: ``_bench`` (the runner: bounded sub-runs, busy CPU, leak checks, options, formatting),
``_rows`` (rows of pytest runs in interleaved rounds, each against its base), ``_suites`` (the
generated suites), ``_peers`` (pytest-forked and pytest-isolate in a pytest 8 environment),
``_sdists`` (real projects' sdists and environments); one module per measurement, named after
what it measures.
"""
