"""Test set-up: 8 fake CPU devices, created before JAX starts, so mesh code runs for real."""

import os
import sys

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for `configs`
