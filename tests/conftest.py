"""Suite-wide settings for the processes the tests start."""

import os

# `plait train` calibrates the machine for its closing time prediction the first time it
# meets a new shape; the suite's many short runs do not read that prediction, so they use
# the device's preset. tests/test_time_model.py calibrates explicitly.
os.environ.setdefault("PLAIT_CALIBRATION", "off")
