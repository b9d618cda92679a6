"""``python -m sdk_double.serve --home H [--port P] [--api-key-file F]``: the double's BoxLite server.  TESTS ONLY."""

from __future__ import annotations

import argparse
from pathlib import Path

from sdk_double.rest import serve

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m sdk_double.serve")
    parser.add_argument("--home", required=True, type=Path)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--api-key-file", type=Path)
    a = parser.parse_args()
    serve(a.home, a.port, a.api_key_file)
