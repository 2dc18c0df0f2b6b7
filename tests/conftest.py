# Makes tests/harness.py and tests/parity/st_io.py importable from every suite.
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.join(_HERE, "parity")):
    if _p not in sys.path:
        sys.path.insert(0, _p)
