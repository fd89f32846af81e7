"""Test setup: 8 fake CPU devices so mesh code runs without accelerators."""

import os

from tidejax.platform import configure_cpu_devices

# Must run before jax is imported anywhere.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
configure_cpu_devices(8)
