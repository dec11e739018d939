"""Suite-wide settings for the processes the tests start."""

import os

# `plait train` calibrates the machine for its closing time prediction the first time it
# meets a new shape; the suite's many short runs do not read that prediction, so they use
# the device's preset. tests/test_time_model.py calibrates explicitly.
os.environ.setdefault("PLAIT_CALIBRATION", "off")

# Every `plait train` draws its plots at the end (about 1.5 s of CPU); the suite's many runs
# skip them, and tests/test_report.py turns them back on for the runs it inspects.
os.environ.setdefault("PLAIT_REPORT", "off")
