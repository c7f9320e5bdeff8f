"""Puts ``clients/python`` on ``sys.path`` so ``import shardq`` works
however pytest is started (``python3 -m pytest -q clients/python`` from the
repository root, or ``pytest`` here)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
